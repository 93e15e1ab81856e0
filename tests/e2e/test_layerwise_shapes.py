"""Layer-wise push (``push.layerwise: on``) between engines of different shapes: P at TP 2
into D at TP 1 (each P rank writes its head slab of each layer), and P at block size 32 into
D at 64 (each layer's units). P prefills at most 512 tokens a step, so prompts below and
above it are checked (the longer ones pushed in the step that completes them).

Answers must equal a single engine's (of D's block size; seeded random weights: a wrong or
missing layer or head changes the answer), every transfer pushed, WRITEs posted while P's
forward ran, D computing at most each prompt's last token, nothing held afterwards. One
cluster per shape, three prompts each: long (engine starts of 60-80 s), so the full tier.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpush_prod.lab.client import completion_body, metric_sum, scrape
from kvpush_prod.lab.cluster import Cluster, ClusterSpec, SharedReference
from kvpush_prod.lab.tinymodel import prompt_of_length

from .conftest import answers_match_reference, release_shared_clusters

pytestmark = [pytest.mark.e2e, pytest.mark.full]

MAX_TOKENS = 12
BATCHED = 512  # P's max_num_batched_tokens
LENGTHS = [100, 700, 1900]  # one step; two; four
_seeds = itertools.count(23_500)

# Shape -> ClusterSpec fields. The TP case keeps the default block size, so it compares with
# the session's shared reference; the block case needs a reference of D's block size (its
# own, started with the cluster).
SHAPES: dict[str, dict[str, Any]] = {
    "P-tp2-D-tp1": {"prefill_tp": 2, "decode_tp": 1},
    "P-b32-D-b64": {"block_size": 64, "prefill_args": ["--block-size", "32"]},
}


@pytest.fixture(scope="module", params=list(SHAPES), ids=str)
def shaped(
    request: pytest.FixtureRequest,
    e2e_workdir: Callable[[str], Path],
    shared_reference: SharedReference,
) -> Iterator[Cluster]:
    fields = dict(SHAPES[request.param])
    release_shared_clusters()  # room for this one's engines (TP 2: an extra worker)
    spec = ClusterSpec(
        workdir=e2e_workdir(f"e2e-layerwise-{request.param}"),
        prefill_kv_gib=1,
        decode_kv_gib=1,
        # As in test_hetero_tp.py: a TP 2 engine beside a TP 1 one on this box can stall
        # for seconds; longer timeouts keep that a slow request, not a fallback.
        extra={
            "push": {"layerwise": "on", "chunk_timeout_s": 60.0},
            "leases": {"permit_ttl_s": 60.0, "peer_timeout_s": 45.0},
        },
        **fields,
    )
    spec.prefill_args = [*spec.prefill_args, "--max-num-batched-tokens", str(BATCHED)]
    with Cluster(shared_reference.attach(spec)) as c:
        # One warm-up request (not asserted): a fresh TP 2 pair's first request is slow.
        httpx.post(
            c.urls["router"] + "/v1/completions",
            timeout=180,
            json=completion_body(prompt_of_length(96, seed=1), 2, False),
        )
        yield c


async def test_layerwise_across_shapes_answers_equal_a_single_engine(shaped: Cluster) -> None:
    writes_before = scrape(shaped.urls["prefill"])
    delta = await answers_match_reference(shaped, LENGTHS, _seeds, MAX_TOKENS)

    def writes(when: str) -> float:
        now = scrape(shaped.urls["prefill"])
        labels = {"role": "producer", "when": when}
        return metric_sum(now, "kvpush_layerwise_writes_total", **labels) - metric_sum(
            writes_before, "kvpush_layerwise_writes_total", **labels
        )

    assert writes("during_forward") > 0  # layers posted while P's forward ran
    d_tp = shaped.spec.decode_tp
    assert delta("kvpush_transfers_total", role="consumer", outcome="pushed") == len(LENGTHS) * d_tp
    assert delta("kvpush_transfers_total", role="consumer", outcome="failed") == 0
    local = delta("vllm:prompt_tokens_by_source_total", source="local_compute")
    assert local <= len(LENGTHS), "D recomputed prompts instead of receiving their KV"
    assert shaped.wait_idle(60) == {"prefill": 0.0, "decode": 0.0}
