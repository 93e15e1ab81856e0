"""Acceptance: on a healthy real P/D run, the documented series are on vLLM's /metrics of both
engines and on the router's, with values that add up (transfers, bytes, chunks, blocks).

Every series docs/metrics.md marks "every run" must have samples; none is skipped.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpush_prod.lab.client import completion_body, metric_sum, request
from kvpush_prod.lab.cluster import Cluster
from kvpush_prod.lab.tinymodel import prompt_of_length
from kvpush_prod.metrics import CONNECTOR_SERIES, OUTCOMES, TABLES, exported_name
from kvpush_prod.metrics_docs import router_series

pytestmark = pytest.mark.e2e

DASHBOARD = Path(__file__).resolve().parents[2] / "configs" / "grafana" / "kvpush.json"
ENGINE = {"producer": "prefill", "consumer": "decode"}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# (series, role): samples on every healthy run (docs/metrics.md: "every run").
HEALTHY = {
    ("kvpush_transfers", "producer"),
    ("kvpush_transfers", "consumer"),
    ("kvpush_transfers_started", "producer"),
    ("kvpush_transfers_started", "consumer"),
    ("kvpush_table_entries", "producer"),
    ("kvpush_table_entries", "consumer"),
    ("kvpush_table_capacity", "producer"),
    ("kvpush_table_capacity", "consumer"),
    ("kvpush_transfer_bytes", "producer"),
    ("kvpush_transfer_bytes", "consumer"),
    ("kvpush_transfer_seconds", "producer"),
    ("kvpush_transfer_seconds", "consumer"),
    ("kvpush_queue_wait_seconds", "producer"),
    ("kvpush_chunk_post_seconds", "producer"),
    ("kvpush_post_descriptors", "producer"),
    ("kvpush_post_build_seconds", "producer"),
    ("kvpush_chunks", "producer"),
    ("kvpush_connector_blocks", "producer"),
    ("kvpush_connector_blocks", "consumer"),
    ("kvpush_control_insecure", "producer"),
    ("kvpush_control_insecure", "consumer"),
    ("kvpush_credits_budget_blocks", "consumer"),
    ("kvpush_credits_in_use_blocks", "consumer"),
    ("kvpush_credits_granted_blocks", "consumer"),
    ("kvpush_credits_waiting_transfers", "consumer"),
    ("kvpush_admissions", "consumer"),
    ("kvpush_leases_active", "producer"),
    ("kvpush_leases_active", "consumer"),
    ("kvpush_link_bandwidth_bytes_per_second", "producer"),
    ("kvpush_inflight_bytes", "producer"),
    ("kvpush_transfers_active", "producer"),
    ("kvpush_transfers_active", "consumer"),
    ("kvpush_breaker_state", "producer"),
    ("kvpush_protocol_dones", "producer"),
    ("kvpush_protocol_dones", "consumer"),
    ("kvpush_peer_connect_seconds", "producer"),
}
# Series with samples only on faults (or bad input): on a healthy run they must not grow.
EMITTED_ON_FAULTS = {
    "kvpush_retries",
    "kvpush_fallbacks",
    "kvpush_breaker_trips",
    "kvpush_leases_expired",
    "kvpush_leases_fenced",
    "kvpush_control_messages_rejected",
    "kvpush_kv_params_rejected",
    "kvpush_peer_restarts",
    "kvpush_peer_connections_lost",
    "kvpush_pump_errors",
    "kvpush_hook_errors",
    # Not a fault but load: a link cap binds only with several chunks in flight on a link,
    # which this run's sequential one-chunk transfers never have.
    "kvpush_link_capped",
    # Set only with links.expected_gbps (this run's cpu-loopback profile has none), and 1 only
    # on a slow link.
    "kvpush_link_slow",
    # Only with push.layerwise on or auto (off in this run's profile).
    "kvpush_layerwise_writes",
    # Only with staging.receive_mib / staging.send_mib set (off in this run's profile).
    "kvpush_staging_blocks",
    "kvpush_staging_used_blocks",
    "kvpush_staging_copy_seconds",
    "kvpush_staging_refused",
    # Only with a peer of the previous release (protocol N-1).
    "kvpush_protocol_fallbacks",
    "kvpush_peer_connect_failures",
}
# Gauges back to zero once the engines are idle, and gauges that must be positive.
ZERO_WHEN_IDLE = {
    "kvpush_credits_in_use_blocks",
    "kvpush_credits_waiting_transfers",
    "kvpush_leases_active",
    "kvpush_inflight_bytes",
    "kvpush_transfers_active",
}
POSITIVE = {"kvpush_credits_budget_blocks", "kvpush_link_bandwidth_bytes_per_second"}

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
    return any(
        n == name and all(dict(lb).get(k) == v for k, v in labels.items()) for n, lb in samples
    )


def sample_name(series_name: str) -> str:
    series = next(s for s in CONNECTOR_SERIES if s.name == series_name)
    return exported_name(series) + ("_count" if series.kind == "histogram" else "")


Snapshot = dict[str, tuple[str, Samples]]  # per endpoint: the /metrics text and its samples


@dataclass
class Run:
    """The traffic one test sent, the endpoints' samples before and after, and what is wrong."""

    urls: dict[str, str]
    before: dict[str, Samples]
    n: int = 0
    expected_bytes: int = 0
    bytes_per_block: int = 0
    prompt_tokens: int = 0
    now: Snapshot = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.problems.append(what)

    def delta(self, engine: str, name: str, **labels: str) -> float:
        return metric_sum(self.now[engine][1], name, **labels) - metric_sum(
            self.before[engine], name, **labels
        )

    def value(self, engine: str, name: str, **labels: str) -> float:
        return metric_sum(self.now[engine][1], name, **labels)

    def snapshot(self) -> Snapshot:
        out = {}
        for k, u in self.urls.items():
            text = scrape_text(u)
            out[k] = (text, parse(text)[1])
        return out


async def send_traffic(run: Run, block: int) -> None:
    """Lengths around block boundaries and long prompts; plain and streamed; completions and
    chat. Every one must be pushed."""
    cases = [
        (3, False, False),
        (block + 5, False, True),
        (3 * block, True, False),
        (700, True, True),
        (1500, False, False),
        (2 * block - 1, True, False),
    ]
    results = []
    async with httpx.AsyncClient() as client:
        for length, stream, chat in cases:
            prompt = prompt_of_length(length, seed=next(_seeds))
            got = await request(
                client, run.urls["router"], completion_body(prompt, 16, stream, chat=chat)
            )
            assert got.ok, got.error
            results.append(got)
    summaries = [
        r.kv_transfer_params["kvpush"]
        for r in results
        if r.kv_transfer_params and "kvpush" in r.kv_transfer_params
    ]
    assert summaries and all(s["outcome"] == "pushed" for s in summaries), summaries
    assert all(r.prompt_tokens for r in results)
    run.n = len(cases)
    run.bytes_per_block = summaries[0]["bytes"] // summaries[0]["blocks"]
    run.expected_bytes = sum(
        cdiv(r.prompt_tokens or 0, block) * run.bytes_per_block for r in results
    )
    run.prompt_tokens = sum(r.prompt_tokens or 0 for r in results)


def wait_settled(run: Run, timeout: float = 60) -> None:
    """Stats reach the API server with the engines' next steps: wait for them to settle."""
    n = run.n
    deadline = time.monotonic() + timeout
    while True:
        run.now = run.snapshot()
        settled = (
            run.delta("decode", "kvpush_transfers_total", role="consumer", outcome="pushed") >= n
            and run.delta("prefill", "kvpush_transfers_total", role="producer", outcome="pushed")
            >= n
            and run.value("prefill", "kvpush_connector_blocks") == 0
            and run.value("decode", "kvpush_connector_blocks") == 0
            # A streamed answer is counted once its relay ends, just after the client read
            # the last bytes.
            and run.delta("router", "kvpush_router_requests_total", outcome="ok") >= n
            and run.delta("router", "kvpush_router_request_seconds_count") >= n
        )
        if settled or time.monotonic() > deadline:
            return
        time.sleep(0.5)


async def flush_earlier_stats(urls: dict[str, str]) -> None:
    """The cluster is shared: what an earlier test's faults counted in an engine's worker
    reaches /metrics only with that engine's next steps, which would put it in this test's
    window. One pushed request, settled, steps both engines first."""
    warm = Run(urls, before={k: parse(scrape_text(u))[1] for k, u in urls.items()}, n=1)
    async with httpx.AsyncClient() as client:
        prompt = prompt_of_length(40, seed=next(_seeds))
        got = await request(client, urls["router"], completion_body(prompt, 2, False))
    assert got.ok, got.error
    wait_settled(warm)


def check_registered_with_samples(run: Run) -> None:
    """Every connector series is registered (HELP/TYPE) on both engines' /metrics, and every
    healthy one has samples with vLLM's labels."""
    for engine in ("prefill", "decode"):
        families = parse(run.now[engine][0])[0]
        missing = sorted(s.name for s in CONNECTOR_SERIES if s.name not in families)
        run.check(not missing, f"{engine} /metrics lacks families {missing}")
    for series, role in sorted(HEALTHY):
        samples = run.now[ENGINE[role]][1]
        name = sample_name(series)
        run.check(has_samples(samples, name, role=role), f"no {name}{{role={role}}} samples")
        for sname, labels in samples:
            if sname == name:
                run.check(
                    {"model_name", "engine"} <= dict(labels).keys(),
                    f"{name} lacks vLLM's labels: {labels}",
                )
                break


def check_transfers_add_up(run: Run) -> None:
    """Transfers, bytes, chunks and prompt tokens agree with the traffic sent."""
    n = run.n
    for role, engine in ENGINE.items():
        pushed = run.delta(engine, "kvpush_transfers_total", role=role, outcome="pushed")
        run.check(pushed == n, f"{role}: {pushed} transfers pushed, expected {n}")
        for outcome in OUTCOMES:
            if outcome != "pushed":
                d = run.delta(engine, "kvpush_transfers_total", role=role, outcome=outcome)
                run.check(d == 0, f"{role}: {d} transfers ended {outcome} on a healthy run")
        moved = run.delta(engine, "kvpush_transfer_bytes_total", role=role)
        run.check(
            moved == run.expected_bytes,
            f"{role}: {moved} bytes counted, expected "
            f"{run.expected_bytes} ({run.bytes_per_block} per block)",
        )
        run.check(
            run.value(engine, "kvpush_connector_blocks", role=role) == 0,
            f"{role}: connector blocks not back to 0 when idle",
        )
        run.check(
            run.value(engine, "kvpush_control_insecure", role=role) == 0,
            f"{role}: the test cluster's control channel runs without keys",
        )
    count = run.delta("prefill", "kvpush_transfer_seconds_count", role="producer")
    total = run.delta("prefill", "kvpush_transfer_seconds_sum", role="producer")
    run.check(count == n, f"producer transfer_seconds_count grew by {count}, expected {n}")
    run.check(0 < total < 30 * n, f"producer transfer_seconds_sum grew by {total}")
    ok_chunks = run.delta("prefill", "kvpush_chunks_total", role="producer", result="ok")
    posts = run.delta("prefill", "kvpush_chunk_post_seconds_count", role="producer")
    run.check(ok_chunks >= n, f"{ok_chunks} chunks ok for {n} transfers")
    run.check(posts == ok_chunks, f"{posts} chunk posts timed but {ok_chunks} chunks completed")
    for series in ("kvpush_post_descriptors_count", "kvpush_post_build_seconds_count"):
        d = run.delta("prefill", series, role="producer")
        run.check(d == posts, f"{series} grew by {d} for {posts} chunk posts")
    for result in ("error", "post_failed"):
        d = run.delta("prefill", "kvpush_chunks_total", result=result)
        run.check(d == 0, f"{d} chunks ended {result}")
    external = run.delta(
        "decode", "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )
    run.check(
        external >= run.prompt_tokens - n,
        f"decode got {external} prompt tokens over the wire of {run.prompt_tokens}",
    )


def check_healthy_values(run: Run) -> None:
    """Gauges at rest when idle; admissions, queue waits, transfer times and credits one per
    transfer."""
    n = run.n
    for series, role in sorted(HEALTHY):
        engine, name = ENGINE[role], sample_name(series)
        value = run.value(engine, name, role=role)
        if series in ZERO_WHEN_IDLE:
            run.check(value == 0, f"{name}{{role={role}}} = {value} when idle")
        elif series in POSITIVE:
            run.check(value > 0, f"{name}{{role={role}}} = {value}")
        elif series == "kvpush_breaker_state":
            run.check(value == 0, f"breaker not closed on a healthy run: {value}")
        elif series == "kvpush_admissions":
            d = run.delta(engine, name, role=role, decision="admit")
            run.check(d == n, f"{d} admissions for {n} transfers")
        elif series in ("kvpush_queue_wait_seconds", "kvpush_transfer_seconds"):
            d = run.delta(engine, name, role=role)
            run.check(d == n, f"{name}{{role={role}}} grew by {d}, expected {n}")
        elif series == "kvpush_credits_granted_blocks":
            d = run.delta(engine, name, role=role)
            run.check(d * run.bytes_per_block == run.expected_bytes, f"{d} blocks granted")


def check_every_transfer_ended_once(run: Run) -> None:
    """Per engine: started = ended (every outcome) + active, and the transfer-keyed tables
    are empty at rest (docs/metrics.md, "Accounting" and "Tables")."""
    for role, engine in ENGINE.items():
        started = run.delta(engine, "kvpush_transfers_started_total", role=role)
        ended = run.delta(engine, "kvpush_transfers_total", role=role)
        active = run.value(engine, "kvpush_transfers_active", role=role)
        run.check(started == run.n, f"{role}: {started} transfers started for {run.n} sent")
        run.check(
            started == ended + active, f"{role}: {started} started, {ended} ended, {active} active"
        )
        tables = {
            dict(labels)["table"]: v
            for (name, labels), v in run.now[engine][1].items()
            if name == "kvpush_table_entries" and dict(labels).get("role") == role
        }
        run.check(set(tables) <= set(TABLES), f"{role}: unknown tables {set(tables) - set(TABLES)}")
        mine = ("sender.transfers", "push.links") if role == "producer" else ("receiver.done_log",)
        for table in ("trust.nonces", "pump.requests", "control.peers", *mine):
            run.check(table in tables, f"{role}: no kvpush_table_entries{{table={table!r}}}")
        for table in ("pump.requests", "pump.chunks", "scheduler.held", "admission.inbound"):
            left = tables.get(table, 0)
            run.check(left == 0, f"{role}: {table} holds {left} entries at rest")


def check_fault_series_flat(run: Run) -> None:
    """Fault series did not grow (absent means zero)."""
    for series in sorted(EMITTED_ON_FAULTS):
        name = sample_name(series)
        for engine in ("prefill", "decode"):
            d = run.delta(engine, name)
            run.check(d == 0, f"{engine}: {name} grew by {d} on a healthy run")


def check_router(run: Run) -> None:
    """The router's own series: every one registered, the healthy ones with samples."""
    n = run.n
    router = run.now["router"][1]
    families = parse(run.now["router"][0])[0]
    for s in router_series():
        run.check(s.name in families, f"router /metrics lacks {s.name}")
        if s.healthy:
            names = {exported_name(s), s.name + "_count"}
            run.check(any(x in names for x, _ in router), f"router has no {s.name} samples")
    ok = run.delta("router", "kvpush_router_requests_total", outcome="ok")
    run.check(ok == n, f"router counted {ok} ok requests, expected {n}")
    timed = run.delta("router", "kvpush_router_request_seconds_count")
    run.check(timed == n, f"router timed {timed} requests, expected {n}")
    run.check(run.delta("router", "kvpush_router_ttft_seconds_count") >= 1, "router TTFT not timed")
    run.check(run.delta("router", "kvpush_router_retries_total") == 0, "router retried")
    for role in ("prefill", "decode"):
        run.check(
            metric_sum(router, "kvpush_router_backend_up", role=role) == 1,
            f"router backend_up{{role={role}}} != 1",
        )
    run.check(metric_sum(router, "kvpush_router_inflight") == 0, "router legs in flight when idle")
    for table in ("requests.admitted", "legs.background"):
        left = metric_sum(router, "kvpush_router_table_entries", table=table)
        run.check(left == 0, f"router table {table} holds {left} entries when idle")
    run.check(
        metric_sum(router, "kvpush_router_table_entries", table="health.tasks") == 2,
        "router: not one health poller per backend",
    )


def check_dashboard_series_exist(run: Run) -> None:
    """The vLLM series the dashboard uses exist on a real engine."""
    used = set(re.findall(r"vllm:[a-zA-Z0-9_:]+", DASHBOARD.read_text()))
    engines_text = run.now["prefill"][0] + run.now["decode"][0]
    for name in sorted(used):
        run.check(
            re.search(rf"^{re.escape(name)}[{{ ]", engines_text, re.M) is not None,
            f"the dashboard uses {name}, which vLLM does not export",
        )


CHECKS: tuple[Callable[[Run], None], ...] = (
    check_registered_with_samples,
    check_transfers_add_up,
    check_healthy_values,
    check_every_transfer_ended_once,
    check_fault_series_flat,
    check_router,
    check_dashboard_series_exist,
)


def test_every_connector_series_is_classified_as_docs_metrics_md_says() -> None:
    healthy = {s for s, _ in HEALTHY}
    assert healthy | EMITTED_ON_FAULTS == {s.name for s in CONNECTOR_SERIES}
    # docs/metrics.md's "samples" column comes from Series.healthy.
    assert healthy == {s.name for s in CONNECTOR_SERIES if s.healthy}
    assert {s.name for s in CONNECTOR_SERIES if not s.healthy} == EMITTED_ON_FAULTS


async def test_healthy_run_exports_the_documented_series_with_plausible_values(
    cluster: Cluster,
) -> None:
    assert cluster.wait_idle(60) == {"prefill": 0.0, "decode": 0.0}
    urls = {
        "prefill": cluster.urls["prefill"],
        "decode": cluster.urls["decode"],
        "router": cluster.urls["router"],
    }
    await flush_earlier_stats(urls)
    run = Run(urls, before={k: parse(scrape_text(u))[1] for k, u in urls.items()})
    await send_traffic(run, cluster.block_size())
    wait_settled(run)
    for check in CHECKS:
        check(run)
    print("metrics e2e:", json.dumps({"problems": run.problems}, indent=1))
    assert run.problems == []
