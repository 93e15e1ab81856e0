"""Prefill and decode engines of different KV block sizes share KV: P --block-size 32 into
D --block-size 64, and 64 into 32 (units of the smaller size, ``core.blocksize``). Answers
equal a single engine's of D's block size, every transfer is pushed (D computes at most
the last prompt token), and nothing is held afterwards. One cluster per direction.

(Engines that cannot share KV, e.g. block sizes where neither divides the other, are
refused at the first handshake: tests/core/test_blocksize.py and tests/core/test_compat.py.)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpush_prod.lab.cluster import Cluster, ClusterSpec

from .conftest import answers_match_reference, release_shared_clusters

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
_seeds = itertools.count(9000)


# CI runs P 32 -> D 64 (several P blocks fill one D block); 64 -> 32 (one P block into two
# D blocks) costs another ~75 s of engines and runs in the full run (KVPUSH_E2E_EXTRA=1).
@pytest.fixture(
    scope="module",
    params=[(32, 64), pytest.param((64, 32), marks=pytest.mark.full)],
    ids=lambda t: f"P{t[0]}-D{t[1]}",
)
def sizes(request: pytest.FixtureRequest, e2e_workdir: Callable[[str], Path]) -> Iterator[Cluster]:
    p_block, d_block = request.param
    # The cluster's block size is D's (and the reference engine's: the same attention
    # kernel as D's decode); P's own --block-size comes after it and wins.
    spec = ClusterSpec(
        workdir=e2e_workdir(f"e2e-blocks-{p_block}-{d_block}"),
        block_size=d_block,
        prefill_args=["--block-size", str(p_block)],
        prefill_kv_gib=1,
        decode_kv_gib=1,
    )
    with Cluster(spec) as c:
        yield c


async def test_different_block_sizes_push_and_answer_like_a_single_engine(sizes: Cluster) -> None:
    p_block, d_block = sizes.block_size("prefill"), sizes.block_size("decode")
    assert p_block != d_block and {p_block, d_block} == {32, 64}
    lengths = [5, 33, 71, 130, 250]  # inside one block, across blocks, never whole ones
    delta = await answers_match_reference(sizes, lengths, _seeds, MAX_TOKENS)

    local = delta("vllm:prompt_tokens_by_source_total", source="local_compute")
    assert local <= len(lengths), "D recomputed prompts instead of receiving their KV"
    assert delta("kvpush_transfers_total", role="consumer", outcome="pushed") == len(lengths)
    assert delta("kvpush_transfers_total", role="consumer", outcome="failed") == 0
    assert delta("kvpush_fallbacks_total") == 0
    assert sizes.wait_idle(timeout=30) == {"prefill": 0, "decode": 0}


@pytest.fixture(
    scope="module",
    params=[(2, 32, 1, 64), (1, 64, 2, 32)],
    ids=lambda t: f"P-tp{t[0]}-b{t[1]}-D-tp{t[2]}-b{t[3]}",
)
def tp_and_sizes(
    request: pytest.FixtureRequest, e2e_workdir: Callable[[str], Path]
) -> Iterator[Cluster]:
    p_tp, p_block, d_tp, d_block = request.param
    release_shared_clusters()  # room for the TP 2 engine's extra worker
    spec = ClusterSpec(
        workdir=e2e_workdir(f"e2e-tp-blocks-{p_tp}{d_tp}"),
        block_size=d_block,
        prefill_args=["--block-size", str(p_block)],
        prefill_tp=p_tp,
        decode_tp=d_tp,
        prefill_kv_gib=1,
        decode_kv_gib=1,
        extra={
            "leases": {"permit_ttl_s": 60.0, "peer_timeout_s": 45.0},
            "push": {"chunk_timeout_s": 60.0},
        },
    )
    with Cluster(spec) as c:
        yield c


@pytest.mark.full  # a TP 2 engine beside a TP 1 one: four engine processes, CI's budget
async def test_different_block_sizes_and_tp_sizes_together(tp_and_sizes: Cluster) -> None:
    """Head slabs (TP 2 <-> 1) of units (block 32 <-> 64): each D rank receives exactly its
    heads, token by token where an engine of D's block size keeps them."""
    lengths = [5, 33, 71, 130, 250]
    delta = await answers_match_reference(tp_and_sizes, lengths, _seeds, MAX_TOKENS)
    d_tp = tp_and_sizes.spec.decode_tp
    assert delta("vllm:prompt_tokens_by_source_total", source="local_compute") <= len(lengths)
    assert delta("kvpush_transfers_total", role="consumer", outcome="pushed") == len(lengths) * d_tp
    assert delta("kvpush_fallbacks_total") == 0
    assert tp_and_sizes.wait_idle(timeout=30) == {"prefill": 0, "decode": 0}
