"""Another model shape end to end: more layers, one KV head (MQA), a wider head, block 64.

The KV layout (regions per layer, block stride, bytes per block) is read from the engines,
never assumed: answers must still equal a single engine's and each pushed block must carry
exactly layers x 2 (K and V) x block x kv_heads x head_dim float32 values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvpush_prod.lab.client import completion_body, request
from kvpush_prod.lab.cluster import Cluster, ClusterSpec
from kvpush_prod.lab.tinymodel import TinyModelSpec, prompt_of_length

# Full run only (KVPUSH_E2E_EXTRA=1): a cluster of its own (~70 s); CI keeps other shapes in test_hetero_tp and test_compat; CI's budget (README, "Tests").
pytestmark = [pytest.mark.e2e, pytest.mark.full]

SHAPE = TinyModelSpec(
    num_layers=3, hidden_size=192, intermediate_size=384, num_heads=3, num_kv_heads=1, head_dim=64
)
BLOCK = 64  # the CPU attention backend takes multiples of 32
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def shaped(e2e_workdir: Callable[[str], Path]) -> Iterator[Cluster]:
    spec = ClusterSpec(
        workdir=e2e_workdir("e2e-shape"),
        block_size=BLOCK,
        prefill_kv_gib=1,
        decode_kv_gib=1,
        model=SHAPE,
    )
    with Cluster(spec) as c:
        yield c


@pytest.mark.parametrize("length", [1, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 3, 1000])
async def test_other_model_shape_equals_single_engine(shaped: Cluster, length: int) -> None:
    assert shaped.block_size() == BLOCK
    prompt = prompt_of_length(length, seed=7000 + length)
    async with httpx.AsyncClient() as client:
        ref = await request(
            client, shaped.urls["reference"], completion_body(prompt, MAX_TOKENS, False)
        )
        got = await request(
            client, shaped.urls["router"], completion_body(prompt, MAX_TOKENS, False)
        )
        streamed = await request(
            client, shaped.urls["router"], completion_body(prompt + " w5", MAX_TOKENS, True)
        )
        ref_streamed = await request(
            client, shaped.urls["reference"], completion_body(prompt + " w5", MAX_TOKENS, False)
        )
    assert ref.ok and got.ok and streamed.ok, (ref.error, got.error, streamed.error)
    assert got.text == ref.text
    assert streamed.text == ref_streamed.text
    summary = (got.kv_transfer_params or {})["kvpush"]
    assert ref.prompt_tokens is not None
    assert summary["outcome"] == "pushed"
    assert summary["blocks"] == -(-ref.prompt_tokens // BLOCK)
    per_block = SHAPE.num_layers * 2 * BLOCK * SHAPE.num_kv_heads * SHAPE.head_dim * 4
    assert summary["bytes"] == summary["blocks"] * per_block


def test_other_model_shape_leaves_nothing_held(shaped: Cluster) -> None:
    assert shaped.wait_idle(60) == {"prefill": 0.0, "decode": 0.0}
