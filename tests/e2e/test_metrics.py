"""Acceptance: on a healthy real P/D run, the documented series are on vLLM's /metrics of both
engines and on the router's, with values that add up (transfers, bytes, chunks, blocks).

Series the connector does not emit yet are listed below by name, not silently skipped.
"""

from __future__ import annotations

import itertools
import json
import re
import time
import warnings
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpush_prod.lab.client import completion_body, metric_sum, request
from kvpush_prod.lab.cluster import Cluster
from kvpush_prod.lab.tinymodel import prompt_of_length
from kvpush_prod.metrics import CONNECTOR_SERIES, OUTCOMES, exported_name
from kvpush_prod.metrics_docs import router_series

pytestmark = pytest.mark.e2e

DASHBOARD = Path(__file__).resolve().parents[2] / "configs" / "grafana" / "kvpush.json"
ENGINE = {"producer": "prefill", "consumer": "decode"}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# (series, role): samples on every healthy run, emitted by the connector today.
HEALTHY_NOW = {
    ("kvpush_transfers", "producer"), ("kvpush_transfers", "consumer"),
    ("kvpush_transfer_bytes", "producer"), ("kvpush_transfer_bytes", "consumer"),
    ("kvpush_transfer_seconds", "producer"),
    ("kvpush_chunk_post_seconds", "producer"),
    ("kvpush_chunks", "producer"),
    ("kvpush_connector_blocks", "producer"), ("kvpush_connector_blocks", "consumer"),
    ("kvpush_control_insecure", "producer"), ("kvpush_control_insecure", "consumer"),
}
# (series, role): samples on every healthy run once the connector emits them (issue 4:
# connector wiring of credits, leases, scheduler and breaker). Checked when present,
# reported by a warning while absent.
HEALTHY_BY_ISSUE_4 = {
    ("kvpush_transfer_seconds", "consumer"),
    ("kvpush_queue_wait_seconds", "producer"),
    ("kvpush_credits_budget_blocks", "consumer"),
    ("kvpush_credits_in_use_blocks", "consumer"),
    ("kvpush_credits_granted_blocks", "consumer"),
    ("kvpush_credits_waiting_transfers", "consumer"),
    ("kvpush_admissions", "consumer"),
    ("kvpush_leases_active", "producer"), ("kvpush_leases_active", "consumer"),
    ("kvpush_link_bandwidth_bytes_per_second", "producer"),
    ("kvpush_inflight_bytes", "producer"),
    ("kvpush_transfers_active", "producer"), ("kvpush_transfers_active", "consumer"),
    ("kvpush_breaker_state", "producer"),
}
# Series with samples only on faults (or bad input): on a healthy run they must not grow.
EMITTED_ON_FAULTS = {
    "kvpush_retries", "kvpush_fallbacks", "kvpush_breaker_trips", "kvpush_leases_expired",
    "kvpush_leases_fenced", "kvpush_control_messages_rejected", "kvpush_kv_params_rejected",
    "kvpush_peer_restarts", "kvpush_pump_errors",
}

_seeds = itertools.count(10_000)  # prompts differ from other e2e files' prompts


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scrape_text(url: str) -> str:
    return httpx.get(url.rstrip("/") + "/metrics", timeout=10).text


def parse(text: str) -> tuple[set[str], Samples]:
    families: set[str] = set()
    samples: Samples = {}
    for fam in text_string_to_metric_families(text):
        families.add(fam.name)
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return families, samples


def has_samples(samples: Samples, name: str, **labels: str) -> bool:
    return any(n == name and all(dict(lb).get(k) == v for k, v in labels.items())
               for n, lb in samples)


def sample_name(series_name: str) -> str:
    series = next(s for s in CONNECTOR_SERIES if s.name == series_name)
    return exported_name(series) + ("_count" if series.kind == "histogram" else "")


def test_every_connector_series_is_classified_as_docs_metrics_md_says() -> None:
    healthy = {s for s, _ in HEALTHY_NOW} | {s for s, _ in HEALTHY_BY_ISSUE_4}
    assert healthy | EMITTED_ON_FAULTS == {s.name for s in CONNECTOR_SERIES}
    # docs/metrics.md's "samples" column comes from Series.healthy.
    assert healthy == {s.name for s in CONNECTOR_SERIES if s.healthy}
    assert {s.name for s in CONNECTOR_SERIES if not s.healthy} == EMITTED_ON_FAULTS


async def test_healthy_run_exports_the_documented_series_with_plausible_values(
        cluster: Cluster) -> None:
    assert cluster.wait_idle(60) == {"prefill": 0.0, "decode": 0.0}
    block = cluster.block_size()
    urls = {"prefill": cluster.urls["prefill"], "decode": cluster.urls["decode"],
            "router": cluster.urls["router"]}
    before = {k: parse(scrape_text(u))[1] for k, u in urls.items()}

    # Traffic: lengths around block boundaries and long prompts; plain and streamed;
    # completions and chat.
    cases = [(3, False, False), (block + 5, False, True), (3 * block, True, False),
             (700, True, True), (1500, False, False), (2 * block - 1, True, False)]
    n = len(cases)
    results = []
    async with httpx.AsyncClient() as client:
        for length, stream, chat in cases:
            prompt = prompt_of_length(length, seed=next(_seeds))
            got = await request(client, urls["router"],
                                completion_body(prompt, 16, stream, chat=chat))
            assert got.ok, got.error
            results.append(got)
    summaries = [r.kv_transfer_params["kvpush"] for r in results
                 if r.kv_transfer_params and "kvpush" in r.kv_transfer_params]
    assert summaries and all(s["outcome"] == "pushed" for s in summaries), summaries
    bytes_per_block = summaries[0]["bytes"] // summaries[0]["blocks"]
    assert all(r.prompt_tokens for r in results)
    expected_bytes = sum(cdiv(r.prompt_tokens or 0, block) * bytes_per_block for r in results)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in results)

    # Stats reach the API server with the engines' next steps: wait for them to settle.
    def snapshot() -> dict[str, tuple[str, Samples]]:
        out = {}
        for k, u in urls.items():
            text = scrape_text(u)
            out[k] = (text, parse(text)[1])
        return out

    def delta(now: dict[str, tuple[str, Samples]], engine: str, name: str,
              **labels: str) -> float:
        return (metric_sum(now[engine][1], name, **labels)
                - metric_sum(before[engine], name, **labels))

    deadline = time.monotonic() + 60
    while True:
        now = snapshot()
        settled = (
            delta(now, "decode", "kvpush_transfers_total", role="consumer", outcome="pushed") >= n
            and delta(now, "prefill", "kvpush_transfers_total", role="producer",
                      outcome="pushed") >= n
            and metric_sum(now["prefill"][1], "kvpush_connector_blocks") == 0
            and metric_sum(now["decode"][1], "kvpush_connector_blocks") == 0
            # A streamed answer is counted once its relay ends, just after the client read
            # the last bytes.
            and delta(now, "router", "kvpush_router_requests_total", outcome="ok") >= n
            and delta(now, "router", "kvpush_router_request_seconds_count") >= n
        )
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.5)

    problems: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    # 1. Every connector series is registered (HELP/TYPE) on both engines' /metrics.
    for engine in ("prefill", "decode"):
        families = parse(now[engine][0])[0]
        missing = sorted(s.name for s in CONNECTOR_SERIES if s.name not in families)
        check(not missing, f"{engine} /metrics lacks families {missing}")

    # 2. The healthy-path series emitted today have samples, with vLLM's labels.
    for series, role in sorted(HEALTHY_NOW):
        samples = now[ENGINE[role]][1]
        name = sample_name(series)
        check(has_samples(samples, name, role=role), f"no {name}{{role={role}}} samples")
        for (sname, labels) in samples:
            if sname == name:
                check({"model_name", "engine"} <= dict(labels).keys(),
                      f"{name} lacks vLLM's labels: {labels}")
                break

    # 3. Values add up.
    for role, engine in ENGINE.items():
        pushed = delta(now, engine, "kvpush_transfers_total", role=role, outcome="pushed")
        check(pushed == n, f"{role}: {pushed} transfers pushed, expected {n}")
        for outcome in OUTCOMES:
            if outcome != "pushed":
                d = delta(now, engine, "kvpush_transfers_total", role=role, outcome=outcome)
                check(d == 0, f"{role}: {d} transfers ended {outcome} on a healthy run")
        moved = delta(now, engine, "kvpush_transfer_bytes_total", role=role)
        check(moved == expected_bytes, f"{role}: {moved} bytes counted, expected "
              f"{expected_bytes} ({bytes_per_block} per block)")
        check(metric_sum(now[engine][1], "kvpush_connector_blocks", role=role) == 0,
              f"{role}: connector blocks not back to 0 when idle")
        check(metric_sum(now[engine][1], "kvpush_control_insecure", role=role) == 0,
              f"{role}: the test cluster's control channel runs without keys")
    count = delta(now, "prefill", "kvpush_transfer_seconds_count", role="producer")
    total = delta(now, "prefill", "kvpush_transfer_seconds_sum", role="producer")
    check(count == n, f"producer transfer_seconds_count grew by {count}, expected {n}")
    check(0 < total < 30 * n, f"producer transfer_seconds_sum grew by {total}")
    ok_chunks = delta(now, "prefill", "kvpush_chunks_total", role="producer", result="ok")
    posts = delta(now, "prefill", "kvpush_chunk_post_seconds_count", role="producer")
    check(ok_chunks >= n, f"{ok_chunks} chunks ok for {n} transfers")
    check(posts == ok_chunks, f"{posts} chunk posts timed but {ok_chunks} chunks completed")
    for result in ("error", "post_failed"):
        d = delta(now, "prefill", "kvpush_chunks_total", result=result)
        check(d == 0, f"{d} chunks ended {result}")
    external = delta(now, "decode", "vllm:prompt_tokens_by_source_total",
                     source="external_kv_transfer")
    check(external >= prompt_tokens - n,
          f"decode got {external} prompt tokens over the wire of {prompt_tokens}")

    # 4. Fault series did not grow (absent means zero).
    for series in sorted(EMITTED_ON_FAULTS):
        name = sample_name(series)
        for engine in ("prefill", "decode"):
            d = delta(now, engine, name)
            check(d == 0, f"{engine}: {name} grew by {d} on a healthy run")

    # 5. Series the connector will emit on healthy runs (issue 4): checked when present.
    absent = []
    for series, role in sorted(HEALTHY_BY_ISSUE_4):
        samples = now[ENGINE[role]][1]
        name = sample_name(series)
        if not has_samples(samples, name, role=role):
            absent.append(f"{name}{{role={role}}}")
            continue
        value = metric_sum(samples, name, role=role)
        if series in ("kvpush_credits_in_use_blocks", "kvpush_credits_waiting_transfers",
                      "kvpush_leases_active", "kvpush_inflight_bytes",
                      "kvpush_transfers_active"):
            check(value == 0, f"{name}{{role={role}}} = {value} when idle")
        elif series in ("kvpush_credits_budget_blocks",
                        "kvpush_link_bandwidth_bytes_per_second"):
            check(value > 0, f"{name}{{role={role}}} = {value}")
        elif series == "kvpush_breaker_state":
            check(value == 0, f"breaker not closed on a healthy run: {value}")
        elif series == "kvpush_admissions":
            d = delta(now, ENGINE[role], name, role=role, decision="admit")
            check(d == n, f"{d} admissions for {n} transfers")
        elif series in ("kvpush_queue_wait_seconds", "kvpush_transfer_seconds"):
            d = delta(now, ENGINE[role], name, role=role)
            check(d == n, f"{name}{{role={role}}} grew by {d}, expected {n}")
        elif series == "kvpush_credits_granted_blocks":
            d = delta(now, ENGINE[role], name, role=role)
            check(d * bytes_per_block == expected_bytes, f"{d} blocks granted")
    if absent:
        warnings.warn("kvpush series not emitted yet (expected by issue 4): "
                      + ", ".join(absent), stacklevel=1)

    # 6. The router's own series.
    router = now["router"][1]
    families = parse(now["router"][0])[0]
    for s in router_series():
        check(s.name in families, f"router /metrics lacks {s.name}")
        if s.healthy:
            names = {exported_name(s), s.name + "_count"}
            check(any(n in names for n, _ in router), f"router has no {s.name} samples")
    ok = delta(now, "router", "kvpush_router_requests_total", outcome="ok")
    check(ok == n, f"router counted {ok} ok requests, expected {n}")
    timed = delta(now, "router", "kvpush_router_request_seconds_count")
    check(timed == n, f"router timed {timed} requests, expected {n}")
    check(delta(now, "router", "kvpush_router_ttft_seconds_count") >= 1, "router TTFT not timed")
    check(delta(now, "router", "kvpush_router_retries_total") == 0, "router retried")
    for role in ("prefill", "decode"):
        check(metric_sum(router, "kvpush_router_backend_up", role=role) == 1,
              f"router backend_up{{role={role}}} != 1")
    check(metric_sum(router, "kvpush_router_inflight") == 0, "router legs in flight when idle")

    # 7. The vLLM series the dashboard uses exist on a real engine.
    used = set(re.findall(r"vllm:[a-zA-Z0-9_:]+", DASHBOARD.read_text()))
    engines_text = now["prefill"][0] + now["decode"][0]
    for name in sorted(used):
        check(re.search(rf"^{re.escape(name)}[{{ ]", engines_text, re.M) is not None,
              f"the dashboard uses {name}, which vLLM does not export")

    report = {"absent_issue_4": absent, "problems": problems}
    print("metrics e2e:", json.dumps(report, indent=1))
    assert problems == []
