"""Prefill and decode API servers with data parallelism (``--data-parallel-size 2`` each:
two engine cores per server, each with its own control port) behind the router, in the
concurrent flow: the router learns P's DP ranks' identities and pins each P leg to one
rank; D's API server hands each D leg to one of its cores, which registers with that P
rank; every answer equals a single engine's, every transfer is pushed, all four cores serve.

At stop 17 this stalled in two of three runs (a CurveZMQ handshake P -> D not done within
HANDSHAKE_IVL, D's REGISTERs late by ~8 s) and was left out of CI. The stall went with
pyzmq's asyncio ZAP thread (control/security.py now runs its own); since then it passed
every run, and runs in CI."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import httpx
import pytest

from kvpush_prod.lab.client import completion_body, metric_sum, request, scrape
from kvpush_prod.lab.cluster import Cluster, ClusterSpec
from kvpush_prod.lab.tinymodel import prompt_of_length

from .conftest import release_shared_clusters

# Full run only (KVPUSH_E2E_EXTRA=1): DP 2 on both sides: four engine cores, ~2 min of CI; CI's budget (README, "Tests").
pytestmark = [pytest.mark.e2e, pytest.mark.full]

MAX_TOKENS = 12
_seeds = itertools.count(40_000)
TOKEN = "d" * 64


@pytest.fixture(scope="module")
def dp_prefill(e2e_workdir, shared_reference) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    workdir = e2e_workdir("e2e-dp2")
    token = workdir / "admin.token"
    token.write_text(TOKEN)
    release_shared_clusters()  # two engine cores each on P and D + reference: the shared pair must go
    spec = ClusterSpec(
        workdir=workdir,
        prefill_kv_gib=1,
        decode_kv_gib=1,
        prefill_args=["--data-parallel-size", "2"],
        prefill_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        decode_args=["--data-parallel-size", "2"],
        decode_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        router_args=["--admin-token-file", str(token)],
    )
    with Cluster(shared_reference.attach(spec)) as c:
        yield c


def _by_rank(cluster: Cluster, name: str, metric: str) -> dict[str, float]:
    """``metric`` per engine core (vLLM's ``engine`` label is the DP rank)."""
    out: dict[str, float] = {}
    for (n, labels), v in scrape(cluster.urls[name]).items():
        if n == metric:
            rank = dict(labels).get("engine", "")
            out[rank] = out.get(rank, 0.0) + v
    return out


async def test_every_dp_rank_of_p_and_d_is_reachable_in_the_concurrent_flow(
    dp_prefill: Cluster,
) -> None:
    c = dp_prefill
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.get(
            c.urls["router"] + "/admin/backends", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        (p,) = r.json()["prefill"]
        assert p["identity"]["dp_size"] == 2, p
        ports = {int(k): v["control_port"] for k, v in p["dp_ranks"].items()}
        assert len(set(ports.values())) == 2, p  # each engine core has its own port

        before = _by_rank(c, "prefill", "vllm:request_success_total")
        d_before = _by_rank(c, "decode", "vllm:request_success_total")
        pushed_before = metric_sum(
            c.metrics("decode"), "kvpush_transfers_total", role="consumer", outcome="pushed"
        )
        prompts = [prompt_of_length(n, seed=next(_seeds)) for n in (60, 300, 700, 150) * 3]
        refs = [
            await request(client, c.urls["reference"], completion_body(pr, MAX_TOKENS, False))
            for pr in prompts
        ]
        got = await asyncio.gather(
            *(
                request(client, c.urls["router"], completion_body(pr, MAX_TOKENS, i % 2 == 0))
                for i, pr in enumerate(prompts)
            )
        )
    for i, (g, ref) in enumerate(zip(got, refs, strict=True)):
        assert ref.ok, ref.error
        assert g.ok, (i, g.error)
        assert g.text == ref.text, i
    pushed = (
        metric_sum(c.metrics("decode"), "kvpush_transfers_total", role="consumer", outcome="pushed")
        - pushed_before
    )
    assert pushed == len(prompts)  # none fell back, expired or was recomputed
    after = _by_rank(c, "prefill", "vllm:request_success_total")
    grew = {rank: after[rank] - before.get(rank, 0.0) for rank in after}
    assert len(grew) == 2 and all(v > 0 for v in grew.values()), grew
    d_after = _by_rank(c, "decode", "vllm:request_success_total")
    d_grew = {rank: d_after[rank] - d_before.get(rank, 0.0) for rank in d_after}
    assert len(d_grew) == 2 and all(v > 0 for v in d_grew.values()), d_grew
    assert c.wait_idle(timeout=60) == dict.fromkeys(c.engine_names, 0)
