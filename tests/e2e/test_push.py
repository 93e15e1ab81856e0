"""End to end: real prefill and decode engines with PushConnector, the router, real NIXL.

Every answer through the router must equal a plain single engine's greedy answer.
"""

from __future__ import annotations

import asyncio
import itertools

import httpx
import pytest

from kvpush_prod.lab.client import Result, completion_body, metric_sum, request, scrape
from kvpush_prod.lab.cluster import Cluster
from kvpush_prod.lab.tinymodel import prompt_of_length
from kvpush_prod.signing import DECODE

pytestmark = pytest.mark.e2e

MAX_TOKENS = 32
_seeds = itertools.count(1)  # every prompt differs from its first token: no accidental cache hit
LENGTHS = ["1", "B-1", "B", "B+1", "2B", "1000", "1900"]


def resolve(case: str, block: int) -> int:
    return {"1": 1, "B-1": block - 1, "B": block, "B+1": block + 1, "2B": 2 * block}.get(
        case, int(case) if case.isdigit() else 0
    )


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


async def reference(
    client: httpx.AsyncClient,
    cluster: Cluster,
    prompt: str,
    chat: bool = False,
    max_tokens: int = MAX_TOKENS,
) -> Result:
    ref = await request(
        client, cluster.urls["reference"], completion_body(prompt, max_tokens, False, chat=chat)
    )
    assert ref.ok, ref.error
    return ref


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("case", LENGTHS)
async def test_greedy_output_through_router_equals_single_engine(
    cluster: Cluster, case: str, chat: bool, stream: bool
) -> None:
    block = cluster.block_size()
    prompt = prompt_of_length(resolve(case, block), seed=next(_seeds))
    async with httpx.AsyncClient() as client:
        ref = await reference(client, cluster, prompt, chat)
        got = await request(
            client, cluster.urls["router"], completion_body(prompt, MAX_TOKENS, stream, chat=chat)
        )
    assert got.ok, got.error
    assert got.text == ref.text
    assert got.prompt_tokens == ref.prompt_tokens
    if not stream:
        # D's answer says what arrived: every block of the prompt, pushed.
        summary = (got.kv_transfer_params or {}).get("kvpush")
        assert summary is not None, got.kv_transfer_params
        assert summary["outcome"] == "pushed"
        assert ref.prompt_tokens is not None
        assert summary["blocks"] == cdiv(ref.prompt_tokens, block)
        assert summary["bytes"] > 0 and summary["bytes"] % summary["blocks"] == 0


async def test_prompt_kv_crossed_the_wire_and_was_not_recomputed(cluster: Cluster) -> None:
    block = cluster.block_size()
    lengths = [3, block + 7, 3 * block, 700, 1500]
    before = scrape(cluster.urls["decode"])
    received = 0
    prompt_tokens = 0
    async with httpx.AsyncClient() as client:
        for n in lengths:
            prompt = prompt_of_length(n, seed=next(_seeds))
            ref = await reference(client, cluster, prompt)
            got = await request(
                client, cluster.urls["router"], completion_body(prompt, MAX_TOKENS, False)
            )
            assert got.ok and got.text == ref.text
            summary = (got.kv_transfer_params or {})["kvpush"]
            received += summary["bytes"]
            prompt_tokens += n
    after = scrape(cluster.urls["decode"])

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    local = delta("vllm:prompt_tokens_by_source_total", source="local_compute")
    external = delta("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    # D computes at most the last prompt token itself (to sample the first output token).
    assert local <= len(lengths)
    assert external >= prompt_tokens - len(lengths)
    # Our own counter of received bytes agrees with what each answer reported.
    assert delta("kvpush_transfer_bytes_total", role="consumer") == received
    assert delta("kvpush_transfers_total", role="consumer", outcome="pushed") == len(lengths)


async def test_sixteen_concurrent_requests_equal_single_engine(cluster: Cluster) -> None:
    block = cluster.block_size()
    lengths = [1, block - 1, block, block + 1, 2 * block, 1000, 1900, 300] * 2
    prompts = [prompt_of_length(n, seed=next(_seeds)) for n in lengths]
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
        refs = [await reference(client, cluster, p) for p in prompts]
        got = await asyncio.gather(
            *(
                request(client, cluster.urls["router"], completion_body(p, MAX_TOKENS, i % 2 == 0))
                for i, p in enumerate(prompts)
            )
        )
    for i, (g, r) in enumerate(zip(got, refs, strict=True)):
        assert g.ok, (i, g.error)
        assert g.text == r.text, i


async def test_decode_prefix_cache_hit_pushes_only_the_missing_blocks(cluster: Cluster) -> None:
    block = cluster.block_size()
    head = prompt_of_length(2 * block, seed=next(_seeds)).split()
    first = " ".join(head + prompt_of_length(block // 2, seed=next(_seeds)).split())
    second = " ".join(head + prompt_of_length(block + 3, seed=next(_seeds)).split())
    async with httpx.AsyncClient() as client:
        for prompt, expect_blocks in ((first, 3), (second, cdiv(3 * block + 3, block) - 2)):
            ref = await reference(client, cluster, prompt)
            got = await request(
                client, cluster.urls["router"], completion_body(prompt, MAX_TOKENS, False)
            )
            assert got.ok and got.text == ref.text
            summary = (got.kv_transfer_params or {})["kvpush"]
            assert summary["outcome"] == "pushed"
            # The second prompt shares two full blocks with the first: D has them cached.
            assert summary["blocks"] == expect_blocks, summary


async def test_malformed_kv_transfer_params_fall_back_to_local_compute(cluster: Cluster) -> None:
    prompt = prompt_of_length(200, seed=next(_seeds))
    before = scrape(cluster.urls["decode"])
    async with httpx.AsyncClient() as client:
        ref = await reference(client, cluster, prompt)
        body = completion_body(
            prompt,
            MAX_TOKENS,
            False,
            kv_transfer_params={"do_remote_prefill": True, "remote_port": "not-a-port"},
        )
        got = await request(client, cluster.urls["decode"], body)
    assert got.ok, got.error
    assert got.text == ref.text
    after = scrape(cluster.urls["decode"])
    rejected = metric_sum(after, "kvpush_kv_params_rejected_total") - metric_sum(
        before, "kvpush_kv_params_rejected_total"
    )
    assert rejected == 1


async def test_client_cancel_mid_stream_leaks_no_block(cluster: Cluster) -> None:
    prompts = [prompt_of_length(1500, seed=next(_seeds)) for _ in range(6)]
    async with httpx.AsyncClient() as client:

        async def cancel_early(prompt: str, after_s: float) -> None:
            body = completion_body(prompt, 400, True)
            try:
                async with asyncio.timeout(after_s):
                    await request(client, cluster.urls["router"], body)
            except TimeoutError:
                pass

        # Cancel at different moments: before, around and after the transfer.
        await asyncio.gather(*(cancel_early(p, 0.05 + 0.15 * i) for i, p in enumerate(prompts)))
        # The pair still serves correct answers afterwards.
        prompt = prompt_of_length(500, seed=next(_seeds))
        ref = await reference(client, cluster, prompt)
        got = await request(
            client, cluster.urls["router"], completion_body(prompt, MAX_TOKENS, False)
        )
        assert got.ok and got.text == ref.text
    assert cluster.wait_idle(60) == {"prefill": 0.0, "decode": 0.0}


def test_engines_hold_no_connector_block_after_the_run(cluster: Cluster) -> None:
    assert cluster.wait_idle(60) == {"prefill": 0.0, "decode": 0.0}


async def test_missing_prefill_leg_fails_fast_with_a_clear_error(cluster: Cluster) -> None:
    """D registered with a P that never got the request: P never lists the transfer in its
    heartbeats, D stops renewing the permit, and the receive fails once it is fenced (with
    vLLM's default kv_load_failure_policy=fail: a clear HTTP error, never wrong tokens)."""
    import time

    probe = await _probe(cluster)
    prompt = prompt_of_length(300, seed=next(_seeds))
    params = {
        "do_remote_prefill": True,
        "transfer_id": f"orphan-{next(_seeds)}",
        **{
            k: probe[k]
            for k in ("remote_engine_id", "remote_host", "remote_port", "tp_size", "remote_key")
        },
    }
    before = scrape(cluster.urls["decode"])
    t0 = time.monotonic()
    async with httpx.AsyncClient() as client:
        got = await request(
            client,
            cluster.urls["decode"],
            completion_body(
                prompt, MAX_TOKENS, False, kv_transfer_params=cluster.sign(params, DECODE)
            ),
        )
    waited = time.monotonic() - t0
    assert not got.ok and got.status >= 400, (got.status, got.text)
    # Bounded by the register grace, the permit term and margins (10 + 5 + 1 s here), never
    # the 120 s hard bound.
    assert waited < 30, waited
    after = scrape(cluster.urls["decode"])
    failed = metric_sum(
        after, "kvpush_transfers_total", role="consumer", outcome="failed"
    ) - metric_sum(before, "kvpush_transfers_total", role="consumer", outcome="failed")
    assert failed == 1
    assert cluster.wait_idle(30) == {"prefill": 0.0, "decode": 0.0}


async def _probe(cluster: Cluster) -> dict:
    async with httpx.AsyncClient() as client:
        r = await request(
            client,
            cluster.urls["prefill"],
            completion_body(
                "probe",
                1,
                False,
                kv_transfer_params={"do_remote_decode": True, "kvpush_probe": True},
            ),
        )
    assert r.ok and r.kv_transfer_params, r.error
    return r.kv_transfer_params
