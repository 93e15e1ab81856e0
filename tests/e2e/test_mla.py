"""A DeepSeek-style MLA model end to end: the KV cache holds one latent per token and layer
(``kv_lora_rank + qk_rope_head_dim`` values, no heads), pushed as whole blocks.

One cluster for every case: answers (streamed and not, several prompt lengths around the
block size the engine reports) must equal a single MLA engine's, each pushed block must
carry exactly layers x block x latent float32 values and arrive intact (crc32 checked by D),
D must compute at most the last prompt token of each request, and nothing stays held.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvpush_prod.lab.client import completion_body, metric_sum, request, scrape
from kvpush_prod.lab.cluster import Cluster, ClusterSpec
from kvpush_prod.lab.tinymla import TinyMlaSpec
from kvpush_prod.lab.tinymodel import prompt_of_length

# Full run only (KVPUSH_E2E_EXTRA=1): an MLA cluster of its own (~95 s); the MLA layout is unit-tested in CI; CI's budget (README, "Tests").
pytestmark = [pytest.mark.e2e, pytest.mark.full]

SHAPE = TinyMlaSpec()
MAX_TOKENS = 16
FLOAT32 = 4


@pytest.fixture(scope="module")
def mla(e2e_workdir: Callable[[str], Path]) -> Iterator[Cluster]:
    # verify.checksums: D checks a crc32 of the pushed blocks against P's (the bytes, in
    # block order, not only the answers). A longer permit: between these two MLA engines
    # the first handshake's NIXL add_remote_agent on P took 2.5-8 s on this box (0.1 s for
    # the tiny Llama pair), past cpu-loopback's 5 s permit, so the first request failed.
    spec = ClusterSpec(
        workdir=e2e_workdir("e2e-mla"),
        prefill_kv_gib=1,
        decode_kv_gib=1,
        model=SHAPE,
        extra={
            "verify": {"checksums": True},
            "leases": {"permit_ttl_s": 30.0, "peer_timeout_s": 20.0},
        },
    )
    with Cluster(spec) as c:
        yield c


async def test_mla_answers_equal_a_single_engine_and_kv_is_pushed(mla: Cluster) -> None:
    block = mla.block_size()  # the CPU MLA backend picks it (16 without AMX), never assumed
    assert mla.block_size("prefill") == block
    lengths = [1, block - 1, block, block + 1, 5 * block + 3, 333]
    before = scrape(mla.urls["decode"])
    received = 0
    async with httpx.AsyncClient() as client:
        for n in lengths:
            prompt = prompt_of_length(n, seed=9000 + n)
            ref = await request(
                client, mla.urls["reference"], completion_body(prompt, MAX_TOKENS, False)
            )
            got = await request(
                client, mla.urls["router"], completion_body(prompt, MAX_TOKENS, False)
            )
            ref_streamed = await request(
                client, mla.urls["reference"], completion_body(prompt + " w5", MAX_TOKENS, False)
            )
            streamed = await request(
                client, mla.urls["router"], completion_body(prompt + " w5", MAX_TOKENS, True)
            )
            assert ref.ok and got.ok and streamed.ok and ref_streamed.ok, (
                n,
                ref.error,
                got.error,
                streamed.error,
            )
            assert got.text == ref.text, n
            assert streamed.text == ref_streamed.text, n
            summary = (got.kv_transfer_params or {})["kvpush"]
            assert ref.prompt_tokens == n
            assert summary["outcome"] == "pushed"
            assert summary["blocks"] == -(-n // block)
            per_block = SHAPE.num_layers * block * SHAPE.latent_size * FLOAT32
            assert summary["bytes"] == summary["blocks"] * per_block
            received += summary["bytes"]
    after = scrape(mla.urls["decode"])

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    requests = 2 * len(lengths)
    # D computes at most the last prompt token itself (to sample the first output token).
    assert delta("vllm:prompt_tokens_by_source_total", source="local_compute") <= requests
    assert delta("kvpush_transfers_total", role="consumer", outcome="pushed") == requests
    assert delta("kvpush_transfers_total", role="consumer", outcome="failed") == 0
    assert delta("kvpush_transfer_bytes_total", role="consumer") >= received


async def test_mla_output_depends_on_the_pushed_context(mla: Cluster) -> None:
    """The check above means something only if the KV matters: two prompts that end alike
    but differ earlier must answer differently through P/D."""
    tail = prompt_of_length(4, seed=1)
    async with httpx.AsyncClient() as client:
        a = await request(
            client,
            mla.urls["router"],
            completion_body(prompt_of_length(40, seed=2) + " " + tail, 8, False),
        )
        b = await request(
            client,
            mla.urls["router"],
            completion_body(prompt_of_length(40, seed=3) + " " + tail, 8, False),
        )
    assert a.ok and b.ok
    assert a.text != b.text


def test_mla_leaves_nothing_held(mla: Cluster) -> None:
    assert mla.wait_idle(60) == {"prefill": 0.0, "decode": 0.0}
