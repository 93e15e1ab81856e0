"""Transfer or recompute on real engines: a second router in front of the session's P/D
pair, with ``--direct-below-tokens 64``, sends short prompts to D alone. Their answers equal
the single engine's, the router counts them (``kvpush_router_direct_total``), P sees none of
them and D's connector moves no KV for them; a prompt above the threshold is still pushed.

(The session cluster's own router keeps ``direct_below_tokens`` 0, as every lab cluster
does, so the other tests' short prompts are still pushed.)
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvpush_prod.lab.client import completion_body, metric_sum, request, scrape
from kvpush_prod.lab.cluster import Cluster
from kvpush_prod.lab.launch import Proc, free_port, router_command, wait_healthy
from kvpush_prod.lab.tinymodel import prompt_of_length
from kvpush_prod.router.legs import COMPLETIONS_PATH
from kvpush_prod.router.prompt import prompt_tokens

pytestmark = pytest.mark.e2e

THRESHOLD = 64
MAX_TOKENS = 8
_seeds = itertools.count(31_000)


@pytest.fixture(scope="module")
def direct_router(cluster: Cluster) -> Iterator[str]:
    """A router like the cluster's (same params key, D's key probed) that sends prompts
    estimated below THRESHOLD tokens to D alone."""
    port = free_port()
    cmd = router_command(port) + [
        "--prefill",
        cluster.urls["prefill"],
        "--decode",
        cluster.urls["decode"],
        "--direct-below-tokens",
        str(THRESHOLD),
        "--params-key-file",
        str(cluster.params_key_file),
        "--probe-decode",
    ]
    proc = Proc("direct-router", cmd, dict(os.environ), cluster.log_dir / "direct-router.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 120)
        yield url
    finally:
        proc.stop()


def _body(prompt: str | list[int], stream: bool) -> dict[str, Any]:
    return {**completion_body("", MAX_TOKENS, stream), "prompt": prompt}


def _estimate(prompt: str | list[int]) -> int:
    size = prompt_tokens(COMPLETIONS_PATH, {"prompt": prompt}, 3.0, 1 << 20)
    assert size.tokens is not None
    return size.tokens


async def test_short_prompts_go_to_decode_alone_and_answer_like_a_single_engine(
    cluster: Cluster, direct_router: str
) -> None:
    # Text of 1 to 30 tokens (estimated at most 52), and 63 token ids (exact: below 64).
    texts: list[str | list[int]] = [prompt_of_length(n, seed=next(_seeds)) for n in (1, 5, 16, 30)]
    short = [*texts, [11 + (next(_seeds) * 7 + i * 13) % 1000 for i in range(THRESHOLD - 1)]]
    assert all(_estimate(p) < THRESHOLD for p in short)
    long_prompt = prompt_of_length(200, seed=next(_seeds))
    long_ids = [11 + i * 17 % 1000 for i in range(THRESHOLD)]  # exactly 64: not below

    before = {
        name: scrape(url)
        for name, url in (
            ("router", direct_router),
            ("prefill", cluster.urls["prefill"]),
            ("decode", cluster.urls["decode"]),
        )
    }
    async with httpx.AsyncClient(timeout=120) as client:
        for i, prompt in enumerate(short):
            stream = i % 2 == 1
            ref = await request(client, cluster.urls["reference"], _body(prompt, False))
            got = await request(client, direct_router, _body(prompt, stream))
            assert ref.ok and got.ok, (prompt, ref.error, got.error)
            assert got.text == ref.text, (prompt, stream)
            # D computed the prompt itself: no transfer, so no kvpush summary in the answer.
            assert got.kv_transfer_params is None, got.kv_transfer_params
        mid = {
            name: scrape(url)
            for name, url in (
                ("router", direct_router),
                ("prefill", cluster.urls["prefill"]),
                ("decode", cluster.urls["decode"]),
            )
        }

        pushed = []
        for prompt in (long_prompt, long_ids):
            ref = await request(client, cluster.urls["reference"], _body(prompt, False))
            got = await request(client, direct_router, _body(prompt, False))
            assert ref.ok and got.ok, (ref.error, got.error)
            assert got.text == ref.text
            pushed.append((got.kv_transfer_params or {}).get("kvpush", {}).get("outcome"))
        assert pushed == ["pushed", "pushed"]
    after = {
        name: scrape(url)
        for name, url in (
            ("router", direct_router),
            ("prefill", cluster.urls["prefill"]),
            ("decode", cluster.urls["decode"]),
        )
    }

    def moved(
        frm: dict[str, Any], to: dict[str, Any], engine: str, name: str, **labels: str
    ) -> float:
        return metric_sum(to[engine], name, **labels) - metric_sum(frm[engine], name, **labels)

    n = len(short)
    # The short ones: counted by the router, never seen by P, no KV moved into D.
    assert (
        moved(before, mid, "router", "kvpush_router_direct_total", endpoint="/v1/completions") == n
    )
    assert (
        moved(
            before,
            mid,
            "router",
            "kvpush_router_requests_total",
            endpoint="/v1/completions",
            outcome="ok",
        )
        == n
    )
    assert moved(before, mid, "prefill", "vllm:request_success_total") == 0
    assert moved(before, mid, "decode", "kvpush_transfers_total", role="consumer") == 0
    assert moved(before, mid, "decode", "kvpush_transfer_bytes_total") == 0
    assert moved(before, mid, "decode", "vllm:request_success_total") == n
    # The two above the threshold: both legs, pushed, not counted as direct.
    assert moved(mid, after, "router", "kvpush_router_direct_total") == 0
    assert (
        moved(mid, after, "decode", "kvpush_transfers_total", role="consumer", outcome="pushed")
        == 2
    )
    assert moved(mid, after, "prefill", "vllm:request_success_total") == 2
    assert cluster.wait_idle(timeout=30) == {"prefill": 0, "decode": 0}
