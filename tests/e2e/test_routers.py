"""kvpush behind routers other than its own concurrent one.

1. The vLLM project's own router (the pip package ``vllm-router`` in its P/D mode), as a
user of that router runs it: the answers equal a single engine's, the prompt KV
crosses the wire (D computes at most the last prompt token), both legs run concurrently
once the router learned P's push mode from P's first answer, and nothing stays pinned
afterwards.

2. A sequential router (P first, then D with P's answer as it is: Ray Serve LLM's default
connector backend, vLLM's example proxies), here kvpush's own router in its ``pull`` mode:
D still gets the KV pushed, nothing is recomputed.

vllm-router passes no CurveZMQ key and signs nothing: the engines run with keys whose names
are their engine ids (D finds P's key by ``remote_engine_id``) and without a params key.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpush_prod.lab.client import completion_body, metric_sum, request, scrape
from kvpush_prod.lab.cluster import Cluster, ClusterSpec
from kvpush_prod.lab.launch import Proc, free_port, router_command, wait_healthy
from kvpush_prod.lab.tinymodel import prompt_of_length

from .otlp_sink import OtlpSink

pytestmark = pytest.mark.e2e

MAX_TOKENS = 24
_seeds = itertools.count(5000)


def vllm_router_binary() -> str:
    found = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which(
        "vllm-router"
    )
    assert found, "vllm-router is not installed: pip install -e '.[dev]' brings it"
    return found


@pytest.fixture(scope="module")
def otlp() -> Iterator[OtlpSink]:
    sink = OtlpSink()
    yield sink
    sink.stop()


@pytest.fixture(scope="module")
def behind(e2e_workdir, otlp: OtlpSink) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    # The engines trace (vLLM's --otlp-traces-endpoint): kvpush's transfer spans go there too.
    spec = ClusterSpec(
        workdir=e2e_workdir("e2e-vllm-router"),
        router=False,
        signed_params=False,
        prefill_engine_id="prefill",
        decode_engine_id="decode",
        prefill_kv_gib=1,
        decode_kv_gib=1,
        engine_args=["--otlp-traces-endpoint", otlp.endpoint],
    )
    with Cluster(spec) as c:
        port = free_port()
        cmd = [
            vllm_router_binary(),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--vllm-pd-disaggregation",
            "--prefill",
            c.urls["prefill"],
            "--decode",
            c.urls["decode"],
            "--policy",
            "round_robin",
            "--log-level",
            "debug",
        ]
        c.procs["vllm-router"] = Proc(
            "vllm-router", cmd, dict(os.environ), c.log_dir / "vllm-router.log"
        )
        c.urls["vllm-router"] = f"http://127.0.0.1:{port}"
        wait_healthy(c.urls["vllm-router"], c.procs["vllm-router"], 120)
        port = free_port()
        cmd = router_command(port) + [
            "--prefill",
            c.urls["prefill"],
            "--decode",
            c.urls["decode"],
            "--mode",
            "pull",
            "--direct-below-tokens",
            "0",
        ]
        c.procs["sequential"] = Proc(
            "sequential", cmd, dict(os.environ), c.log_dir / "sequential-router.log"
        )
        c.urls["sequential"] = f"http://127.0.0.1:{port}"
        wait_healthy(c.urls["sequential"], c.procs["sequential"], 120)
        yield c


def delta(after, before, name: str, **labels: str) -> float:  # type: ignore[no-untyped-def]
    return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)


async def test_answers_equal_a_single_engine_and_the_kv_crossed_the_wire(behind: Cluster) -> None:
    block = behind.block_size()
    lengths = [1, block - 1, block + 1, 3 * block, 700, 1500, 40, 300]
    prompts = [prompt_of_length(n, seed=next(_seeds)) for n in lengths]
    before_d, before_p = scrape(behind.urls["decode"]), scrape(behind.urls["prefill"])
    async with httpx.AsyncClient(timeout=120) as client:
        refs = [
            await request(client, behind.urls["reference"], completion_body(p, MAX_TOKENS, False))
            for p in prompts
        ]
        # One at a time first (the router learns P's push mode from P's first answer),
        # then all at once.
        got = [
            await request(
                client, behind.urls["vllm-router"], completion_body(p, MAX_TOKENS, i % 2 == 1)
            )
            for i, p in enumerate(prompts[:2])
        ]
        got += await asyncio.gather(
            *(
                request(
                    client, behind.urls["vllm-router"], completion_body(p, MAX_TOKENS, i % 2 == 1)
                )
                for i, p in enumerate(prompts[2:])
            )
        )
    for i, (g, r) in enumerate(zip(got, refs, strict=True)):
        assert g.ok, (i, g.error)
        assert r.ok and g.text == r.text, (i, lengths[i])
    after_d, after_p = scrape(behind.urls["decode"]), scrape(behind.urls["prefill"])

    prompt_tokens = sum(r.prompt_tokens or 0 for r in refs)
    local = delta(after_d, before_d, "vllm:prompt_tokens_by_source_total", source="local_compute")
    external = delta(
        after_d, before_d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )
    # D computes at most the last prompt token of each request itself.
    assert local <= len(prompts), (local, external, prompt_tokens)
    assert external >= prompt_tokens - len(prompts)
    assert delta(
        after_d, before_d, "kvpush_transfers_total", role="consumer", outcome="pushed"
    ) == len(prompts)
    assert delta(after_d, before_d, "kvpush_kv_params_rejected_total") == 0
    assert delta(after_p, before_p, "kvpush_kv_params_rejected_total") == 0
    # Nothing pinned: P let go of every prompt's blocks once pushed (no send lease ran out).
    assert behind.wait_idle(timeout=30) == {"prefill": 0, "decode": 0}
    assert delta(scrape(behind.urls["prefill"]), before_p, "kvpush_leases_expired_total") == 0
    # The router ran P first only until P's answer told it the connector pushes (its debug
    # log names the sequential path "Stage 1"); every later request had both legs at once.
    log = behind.procs["vllm-router"].log_path.read_text(errors="replace")
    assert log.count("ENTERED process_vllm_two_stage_request") == len(prompts)
    assert log.count("Stage 1 - Prefill") <= 1


async def test_a_sequential_router_gets_the_kv_pushed_not_recomputed(behind: Cluster) -> None:
    block = behind.block_size()
    lengths = [block + 3, 600, 2, 1200]
    prompts = [prompt_of_length(n, seed=next(_seeds)) for n in lengths]
    before = scrape(behind.urls["decode"])
    async with httpx.AsyncClient(timeout=120) as client:
        for i, prompt in enumerate(prompts):
            ref = await request(
                client, behind.urls["reference"], completion_body(prompt, MAX_TOKENS, False)
            )
            got = await request(
                client, behind.urls["sequential"], completion_body(prompt, MAX_TOKENS, i % 2 == 1)
            )
            assert got.ok, (i, got.error)
            assert ref.ok and got.text == ref.text, i
            if i % 2 == 0:
                summary = (got.kv_transfer_params or {})["kvpush"]
                assert summary["outcome"] == "pushed", summary
    after = scrape(behind.urls["decode"])
    assert delta(after, before, "kvpush_transfers_total", role="consumer", outcome="pushed") == len(
        prompts
    )
    assert delta(
        after, before, "vllm:prompt_tokens_by_source_total", source="local_compute"
    ) <= len(prompts)
    assert behind.wait_idle(timeout=30) == {"prefill": 0, "decode": 0}


async def test_transfer_spans_join_the_requests_trace(behind: Cluster, otlp: OtlpSink) -> None:
    """A client's traceparent goes through the router to both legs; vLLM's request spans and
    kvpush's transfer spans (P: kvpush.send, D: kvpush.receive) land in that trace."""
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4737"
    headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    prompt = prompt_of_length(300, seed=next(_seeds))
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(
            behind.urls["sequential"] + "/v1/completions",
            headers=headers,
            json=completion_body(prompt, 4, False),
        )
    assert r.status_code == 200, r.text
    deadline = asyncio.get_running_loop().time() + 30  # spans are exported in batches
    names: set[tuple[str, str]] = set()
    while asyncio.get_running_loop().time() < deadline:
        names = {(s.service, s.name) for s in otlp.of_trace(trace_id)}
        ours = {("kvpush-producer", "kvpush.send"), ("kvpush-consumer", "kvpush.receive")}
        if ours <= names and names - ours:
            break
        await asyncio.sleep(0.5)
    assert ("kvpush-producer", "kvpush.send") in names, names
    assert ("kvpush-consumer", "kvpush.receive") in names, names
    everything = sorted({(s.service, s.name, s.trace_id[:8]) for s in otlp.spans})
    assert any(service not in ("kvpush-producer", "kvpush-consumer") for service, _ in names), (
        f"no span of vLLM's own in the trace: {everything}"
    )
    (receive,) = [s for s in otlp.of_trace(trace_id) if s.name == "kvpush.receive"]
    assert receive.attributes["kvpush.outcome"] == "pushed"
    assert "register" in receive.events and "done" in receive.events
    assert receive.parent_span_id == "00f067aa0ba902b7"
