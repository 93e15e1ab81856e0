"""Multi-chunk transfers on real engines: the cpu-multichunk profile cuts every transfer into
one WRITE per 128 KiB block (a 1024-token prompt is 8 chunks, a 1900-token one 15), four in
flight per link.

Answers must equal a single engine's, the KV must cross the wire, nothing may stay held; the
per-link cap must hold chunks back and the bandwidth estimate must move with completions.
Then P fails 30% of its WRITEs (injected, switched on by a file): chunks are retried, a failed
last chunk is confirmed with D and posted again, and a push gives way to a pull only once
retries are exhausted (or the budget, the breaker or an unanswered DoneQuery says so).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvpush_prod.lab.client import completion_body, metric_sum, request, scrape
from kvpush_prod.lab.cluster import Cluster, ClusterSpec, SharedReference
from kvpush_prod.lab.tinymodel import prompt_of_length
from kvpush_prod.transport.faults import FAULTS_ENV

pytestmark = pytest.mark.e2e

PROFILE = "cpu-multichunk"
CHUNK_BYTES = 131072  # the profile's push.chunk_bytes
MAX_TOKENS = 16
PULL_REASONS = {"retries_exhausted", "retry_budget", "breaker_open", "done_query_timeout"}
_seeds = itertools.count(9100)


@pytest.fixture(scope="module")
def multichunk(
    e2e_workdir: Callable[[str], Path], shared_reference: SharedReference
) -> Iterator[Cluster]:
    workdir = e2e_workdir("e2e-multichunk")
    switch = workdir / "faults-active"
    switch.unlink(missing_ok=True)
    faults = {"complete_fail_rate": 0.3, "seed": 3, "active_file": str(switch)}
    spec = ClusterSpec(
        workdir=workdir,
        profile=PROFILE,
        prefill_kv_gib=1,
        decode_kv_gib=2,
        prefill_env={FAULTS_ENV: json.dumps(faults)},
    )
    with Cluster(shared_reference.attach(spec)) as c:
        yield c


def _delta(before: dict, after: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
    return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)


def _by_reason(before: dict, after: dict, name: str) -> dict[str, float]:  # type: ignore[type-arg]
    reasons = {dict(lbls).get("reason", "") for n, lbls in after if n == name}
    out = {r: _delta(before, after, name, reason=r) for r in reasons}
    return {r: v for r, v in out.items() if v}


def _bandwidth(cluster: Cluster) -> float:
    return metric_sum(
        scrape(cluster.urls["prefill"]), "kvpush_link_bandwidth_bytes_per_second", role="producer"
    )


async def test_many_chunks_per_transfer_equal_single_engine_cap_binds_bandwidth_moves(
    multichunk: Cluster,
) -> None:
    block = multichunk.block_size()
    lengths = [1024, 1900, 1000, 3 * block + 5]
    p0, d0 = scrape(multichunk.urls["prefill"]), scrape(multichunk.urls["decode"])
    readings: list[float] = []
    chunks = 0
    async with httpx.AsyncClient() as client:
        for n in lengths:
            prompt = prompt_of_length(n, seed=next(_seeds))
            ref = await request(
                client, multichunk.urls["reference"], completion_body(prompt, MAX_TOKENS, False)
            )
            got = await request(
                client, multichunk.urls["router"], completion_body(prompt, MAX_TOKENS, False)
            )
            assert ref.ok and got.ok, (ref.error, got.error)
            assert got.text == ref.text
            summary = (got.kv_transfer_params or {})["kvpush"]
            assert summary["outcome"] == "pushed"
            assert ref.prompt_tokens is not None
            assert summary["blocks"] == -(-ref.prompt_tokens // block)
            per_block = summary["bytes"] // summary["blocks"]
            chunks += -(-summary["blocks"] // max(1, CHUNK_BYTES // per_block))
            readings.append(_bandwidth(multichunk))
        # Gauges reach /metrics with the engine's steps: one more request carries the last.
        flush = await request(
            client,
            multichunk.urls["router"],
            completion_body(prompt_of_length(5, seed=next(_seeds)), 2, False),
        )
        assert flush.ok, flush.error
        readings.append(_bandwidth(multichunk))
    p1, d1 = scrape(multichunk.urls["prefill"]), scrape(multichunk.urls["decode"])
    # Each 1000+ token prompt spans at least 8 chunks (one 128 KiB block each).
    assert chunks >= 8 * 3
    assert _delta(p0, p1, "kvpush_chunks_total", role="producer", result="ok") >= chunks
    # The KV crossed the wire: D computed at most the last token of each prompt.
    assert _delta(d0, d1, "vllm:prompt_tokens_by_source_total", source="local_compute") <= len(
        lengths
    )
    # Four chunks in flight per link (or the byte cap) held ready chunks back.
    assert _delta(p0, p1, "kvpush_link_capped_total", role="producer") > 0
    # The bandwidth estimate follows the completions: measured, and moving (a reading is
    # the gauge as of the engine's last step, so the first ones may predate any chunk).
    measured = [r for r in readings if r > 0]
    assert len(set(measured)) > 1, readings


async def test_write_failures_are_retried_and_pulled_only_once_retries_are_exhausted(
    multichunk: Cluster,
) -> None:
    lengths = [1900, 1024, 1500, 1200, 1800, 1100, 1700, 1300] * 2
    prompts = [prompt_of_length(n, seed=next(_seeds)) for n in lengths]
    switch = multichunk.spec.workdir / "faults-active"
    p0 = scrape(multichunk.urls["prefill"])
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=32)) as client:
        refs = [
            await request(
                client, multichunk.urls["reference"], completion_body(p, MAX_TOKENS, False)
            )
            for p in prompts
        ]
        switch.touch()
        try:
            got = await asyncio.gather(
                *(
                    request(
                        client,
                        multichunk.urls["router"],
                        completion_body(p, MAX_TOKENS, i % 2 == 0),
                    )
                    for i, p in enumerate(prompts)
                )
            )
        finally:
            switch.unlink(missing_ok=True)
    for i, (g, r) in enumerate(zip(got, refs, strict=True)):
        assert r.ok and g.ok, (i, r.error, g.error)
        assert g.text == r.text, i
    p1 = scrape(multichunk.urls["prefill"])
    assert _delta(p0, p1, "kvpush_chunks_total", role="producer", result="error") > 0
    retries = _by_reason(p0, p1, "kvpush_retries_total")
    assert sum(retries.values()) > 0, retries
    assert _delta(p0, p1, "kvpush_transfers_total", role="producer", outcome="retried") > 0
    fallbacks = _by_reason(p0, p1, "kvpush_fallbacks_total")
    assert set(fallbacks) <= PULL_REASONS, fallbacks


def test_multichunk_cluster_leaves_nothing_held(multichunk: Cluster) -> None:
    assert multichunk.wait_idle(60) == {"prefill": 0.0, "decode": 0.0}
