"""Layer-wise push on real engines (``push.layerwise: on``): P posts each layer's KV while its
forward computes the next layers; D gets DONE only after every layer landed.

Answers must equal a single engine's (seeded random weights: a wrong or missing layer changes
the answer) for prompts of one block to many, below and above P's max_num_batched_tokens
(chunked prefill: the prompt is pushed in the step that completes it); WRITEs must have been
posted while P's forward was still running, and P's transfer spans must show it (a layer's
WRITE posted before the span's ``forward_end``); nothing may stay held afterwards.

Other shapes (TP 2 -> 1, block 32 -> 64) run in test_layerwise_shapes.py (full tier).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvpush_prod.lab.client import completion_body, metric_sum, request, scrape
from kvpush_prod.lab.cluster import Cluster, ClusterSpec, SharedReference
from kvpush_prod.lab.tinymodel import prompt_of_length

from .otlp_sink import OtlpSink, Span

pytestmark = pytest.mark.e2e

MAX_TOKENS = 24
BATCHED = 512  # P's max_num_batched_tokens: longer prompts are prefilled in several steps
_seeds = itertools.count(23_000)


@pytest.fixture(scope="module")
def otlp() -> Iterator[OtlpSink]:
    sink = OtlpSink()
    yield sink
    sink.stop()


@pytest.fixture(scope="module")
def layerwise(
    e2e_workdir: Callable[[str], Path], shared_reference: SharedReference, otlp: OtlpSink
) -> Iterator[Cluster]:
    # P traces (vLLM's --otlp-traces-endpoint): its kvpush.send spans go to ``otlp``.
    spec = ClusterSpec(
        workdir=e2e_workdir("e2e-layerwise"),
        prefill_kv_gib=1,
        decode_kv_gib=2,
        extra={"push": {"layerwise": "on"}},
        prefill_args=[
            "--max-num-batched-tokens",
            str(BATCHED),
            "--otlp-traces-endpoint",
            otlp.endpoint,
        ],
    )
    with Cluster(shared_reference.attach(spec)) as c:
        yield c


def _writes(cluster: Cluster, when: str) -> float:
    return metric_sum(
        scrape(cluster.urls["prefill"]), "kvpush_layerwise_writes_total", role="producer", when=when
    )


@pytest.mark.parametrize("length", [1, 100, 129, 500, 1000, 1900])
async def test_layerwise_answers_equal_a_single_engine(layerwise: Cluster, length: int) -> None:
    block = layerwise.block_size()
    before = _writes(layerwise, "during_forward") + _writes(layerwise, "after_forward")
    prompt = prompt_of_length(length, seed=next(_seeds))
    async with httpx.AsyncClient(timeout=120) as client:
        ref = await request(
            client, layerwise.urls["reference"], completion_body(prompt, MAX_TOKENS, False)
        )
        got = await request(
            client, layerwise.urls["router"], completion_body(prompt, MAX_TOKENS, False)
        )
        streamed = await request(
            client, layerwise.urls["router"], completion_body(prompt + " w9", MAX_TOKENS, True)
        )
        ref_streamed = await request(
            client, layerwise.urls["reference"], completion_body(prompt + " w9", MAX_TOKENS, False)
        )
    assert ref.ok and got.ok and streamed.ok, (ref.error, got.error, streamed.error)
    assert got.text == ref.text
    assert streamed.text == ref_streamed.text
    summary = (got.kv_transfer_params or {})["kvpush"]
    assert summary["outcome"] == "pushed", summary
    assert ref.prompt_tokens is not None
    assert summary["blocks"] == -(-ref.prompt_tokens // block)
    after = _writes(layerwise, "during_forward") + _writes(layerwise, "after_forward")
    assert after > before  # pushed layer by layer (one WRITE per layer at least)


def _overlapped(span: Span) -> bool:
    """The span shows a layer's WRITE posted before P's forward ended (event times: one
    clock, P's, in the order P's trace saw them)."""
    ends = [t for name, t, _ in span.timed if name == "forward_end"]
    return bool(ends) and any(
        name == "push" and "kvpush.layer" in attrs and t < ends[0] for name, t, attrs in span.timed
    )


async def test_writes_are_posted_before_the_forward_ends(
    layerwise: Cluster, otlp: OtlpSink
) -> None:
    """The REGISTER reaches P before its forward on this box (the router sends both legs at
    once), so the first layers of a long prompt go out while P still computes the rest: the
    metric counts them and P's transfer spans show a layer posted before ``forward_end``."""
    before = _writes(layerwise, "during_forward")
    traces = [f"{next(_seeds):032x}" for _ in range(3)]
    async with httpx.AsyncClient(timeout=120) as client:
        for trace_id in traces:
            prompt = prompt_of_length(400, seed=next(_seeds))
            headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
            got = await request(
                client, layerwise.urls["router"], completion_body(prompt, 4, False), headers
            )
            assert got.ok, got.error
    assert _writes(layerwise, "during_forward") > before

    def sends() -> list[Span]:
        return [s for t in traces for s in otlp.of_trace(t) if s.name == "kvpush.send"]

    for _ in range(60):  # spans are exported in batches (every 5 s)
        if len(sends()) == len(traces):
            break
        await asyncio.sleep(0.5)
    spans = sends()
    assert len(spans) == len(traces), [s.trace_id for s in spans]
    assert all(s.attributes["kvpush.outcome"] == "pushed" for s in spans)
    assert all("forward_end" in s.events and "landed" in s.events for s in spans), spans
    assert any(_overlapped(s) for s in spans), [s.timed for s in spans]


def test_layerwise_leaves_nothing_held(layerwise: Cluster) -> None:
    assert layerwise.wait_idle(60) == {"prefill": 0.0, "decode": 0.0}


async def test_kill_9_of_prefill_mid_prefill_gives_no_wrong_answer_and_leaves_d_nothing(
    layerwise: Cluster,
) -> None:
    """Several long prompts (each prefilled in several steps, pushed layer by layer), P
    killed with SIGKILL while they are being computed and pushed: every answer that comes
    back is the single engine's, none hangs, D holds nothing afterwards; P restarted serves."""
    prompts = [prompt_of_length(1900, seed=next(_seeds)) for _ in range(6)]
    async with httpx.AsyncClient(timeout=120) as client:
        refs = [
            await request(
                client, layerwise.urls["reference"], completion_body(p, MAX_TOKENS, False)
            )
            for p in prompts
        ]
        assert all(r.ok for r in refs)
        before = _writes(layerwise, "during_forward")
        tasks = [
            asyncio.create_task(
                request(client, layerwise.urls["router"], completion_body(p, MAX_TOKENS, False))
            )
            for p in prompts
        ]
        for _ in range(3000):  # until P is pushing layer by layer
            if _writes(layerwise, "during_forward") > before:
                break
            await asyncio.sleep(0.01)
        layerwise.procs["prefill"].kill()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 180)  # none hangs
    for ref, got in zip(refs, results, strict=True):
        if got.ok:
            assert got.text == ref.text  # never a wrong answer
    assert layerwise.wait_idle(60) == {"decode": 0.0}
    layerwise.start_engine("prefill")
    prompt = prompt_of_length(700, seed=next(_seeds))
    async with httpx.AsyncClient(timeout=120) as client:
        ref = await request(
            client, layerwise.urls["reference"], completion_body(prompt, MAX_TOKENS, False)
        )
        for _ in range(30):  # the router sees P back
            got = await request(
                client, layerwise.urls["router"], completion_body(prompt, MAX_TOKENS, False)
            )
            if got.ok:
                break
            await asyncio.sleep(1)
    assert got.ok and got.text == ref.text
    assert layerwise.wait_idle(60) == {"prefill": 0.0, "decode": 0.0}
