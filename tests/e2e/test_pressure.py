"""End to end under KV-memory pressure: a decode engine with a small KV cache, prompts that
share a system prompt, sixteen requests at once through the router.

D's admission then meets what vLLM does when memory is short: allocations that fail and are
asked again with another prefix hit (the system prompt got cached meanwhile), credit bounded
by the blocks D really has free, running requests preempted and recomputed. Every answer
must still equal a single engine's, no engine may die, and nothing may stay held.

D runs with a staging area (``staging.receive_mib``) smaller than what sixteen receives need: its
free blocks come back scattered by the churn, the pushes land in staging slots and are
copied into them, and the credit budget, capped at the slots, makes the rest wait. P runs
with a gather area (``staging.send_mib``): a push of the shared system prompt's blocks and
a tail elsewhere is copied together before its WRITE.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvpush_prod.lab.client import completion_body, metric_sum, request, scrape
from kvpush_prod.lab.cluster import Cluster, ClusterSpec
from kvpush_prod.lab.tinymodel import prompt_of_length

pytestmark = pytest.mark.e2e

BLOCK = 64
D_BLOCKS = 120  # 7680 tokens: far less than sixteen prompts and their answers need at once
SYSTEM_TOKENS = 4 * BLOCK  # whole blocks: D's prefix cache can share them
CONCURRENT = 16
MAX_TOKENS = 64
_seeds = itertools.count(7001)
# 2 MiB of 64 KiB blocks (2 layers of K and V, float32, block 64): 32 slots, three to six
# receives at once.
STAGING_MIB = 2


@pytest.fixture(scope="module")
def pressed(e2e_workdir: Callable[[str], Path]) -> Iterator[Cluster]:
    spec = ClusterSpec(
        workdir=e2e_workdir("e2e-pressure"),
        block_size=BLOCK,
        decode_args=["--num-gpu-blocks-override", str(D_BLOCKS)],
        decode_extra={"staging": {"receive_mib": STAGING_MIB}},
        prefill_extra={"staging": {"send_mib": STAGING_MIB}},
    )
    with Cluster(spec) as c:
        yield c


def prompts(system: str, count: int) -> list[str]:
    # Unique tails of 300..525 tokens: each request alone fits D easily, all of them do not.
    return [
        " ".join([system, prompt_of_length(300 + 15 * i, seed=next(_seeds))]) for i in range(count)
    ]


async def test_answers_under_kv_pressure_equal_a_single_engines_and_nothing_is_held(
    pressed: Cluster,
) -> None:
    system = prompt_of_length(SYSTEM_TOKENS, seed=next(_seeds))
    batch = prompts(system, CONCURRENT)
    before = scrape(pressed.urls["decode"])
    async with httpx.AsyncClient(
        limits=httpx.Limits(max_connections=64), timeout=httpx.Timeout(120.0)
    ) as client:
        refs = []
        for p in batch:
            ref = await request(
                client, pressed.urls["reference"], completion_body(p, MAX_TOKENS, False)
            )
            assert ref.ok, ref.error
            refs.append(ref)
        got = await asyncio.gather(
            *(
                request(client, pressed.urls["router"], completion_body(p, MAX_TOKENS, i % 2 == 0))
                for i, p in enumerate(batch)
            )
        )
    for i, (g, r) in enumerate(zip(got, refs, strict=True)):
        assert g.ok, (i, g.error)
        assert g.text == r.text, i

    for name in ("prefill", "decode", "reference"):
        assert pressed.procs[name].alive(), f"{name} died"
    held = pressed.wait_idle(timeout=60)
    assert held == {"prefill": 0, "decode": 0}, held
    after = scrape(pressed.urls["decode"])

    def delta(metric: str, **labels: str) -> float:
        return metric_sum(after, metric, **labels) - metric_sum(before, metric, **labels)

    print(
        "pressure:",
        {
            "preemptions": delta("vllm:num_preemptions_total"),
            "transfers": {
                o: delta("kvpush_transfers_total", role="consumer", outcome=o)
                for o in (
                    "pushed",
                    "retried",
                    "pull_fallback",
                    "recompute",
                    "failed",
                    "prefix_hit",
                    "aborted",
                )
            },
            "admissions": {
                d: delta("kvpush_admissions_total", role="consumer", decision=d)
                for d in ("admit", "later", "refuse")
            },
            "prompt_tokens": {
                s: delta("vllm:prompt_tokens_by_source_total", source=s)
                for s in ("external_kv_transfer", "local_compute", "local_cache_hit")
            },
        },
    )
    # The pressure was real: D preempted running requests to make room.
    assert delta("vllm:num_preemptions_total") > 0
    # KV did come over the wire, and no hook had to contain anything.
    assert delta("kvpush_transfers_total", role="consumer") > 0
    assert delta("kvpush_hook_errors_total") == 0
    assert metric_sum(scrape(pressed.urls["prefill"]), "kvpush_hook_errors_total") == 0
    assert metric_sum(after, "kvpush_credits_in_use_blocks", role="consumer") == 0
    # Every delivered receive went through the staging area, and left it.
    delivered = sum(
        delta("kvpush_transfers_total", role="consumer", outcome=o)
        for o in ("pushed", "retried", "pull_fallback")
    )
    assert delivered > 0
    assert delta("kvpush_staging_copy_seconds_count", role="consumer") == delivered
    slots = metric_sum(after, "kvpush_staging_blocks", role="consumer")
    assert 0 < slots < D_BLOCKS // 2  # under the budget it caps (half of D's blocks)
    assert metric_sum(after, "kvpush_staging_used_blocks", role="consumer") == 0
    assert delta("kvpush_staging_refused_total") == 0
    assert metric_sum(after, "kvpush_credits_budget_blocks", role="consumer") <= slots
    p_after = scrape(pressed.urls["prefill"])
    assert metric_sum(p_after, "kvpush_staging_blocks", role="producer") > 0
    assert metric_sum(p_after, "kvpush_staging_used_blocks", role="producer") == 0
