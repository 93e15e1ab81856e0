"""The series table: the exact list the connector emits, naming rules, bounded labels, and
MetricsSink writing StatsBuffer snapshots into an isolated registry without ever raising.
"""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpush_prod.metrics import (
    CONNECTOR_SERIES,
    LABELS,
    MAX_LABEL_SETS,
    OUTCOMES,
    MetricsSink,
    Series,
    StatsBuffer,
    exported_name,
    merge_stats,
)
from kvpush_prod.metrics_docs import all_series, router_series

# The contract with the connector: these names, kinds and labels, exactly.
EXPECTED = {
    "kvpush_transfers": ("counter", ("role", "outcome")),
    "kvpush_transfers_started": ("counter", ("role",)),
    "kvpush_transfer_bytes": ("counter", ("role",)),
    "kvpush_transfer_seconds": ("histogram", ("role",)),
    "kvpush_queue_wait_seconds": ("histogram", ("role",)),
    "kvpush_chunk_post_seconds": ("histogram", ("role",)),
    "kvpush_chunks": ("counter", ("role", "result")),
    "kvpush_retries": ("counter", ("role", "reason")),
    "kvpush_fallbacks": ("counter", ("role", "reason")),
    "kvpush_breaker_state": ("gauge", ("role", "peer")),
    "kvpush_breaker_trips": ("counter", ("role", "peer")),
    "kvpush_staging_blocks": ("gauge", ("role",)),
    "kvpush_staging_used_blocks": ("gauge", ("role",)),
    "kvpush_staging_copy_seconds": ("histogram", ("role",)),
    "kvpush_staging_refused": ("counter", ("role",)),
    "kvpush_credits_budget_blocks": ("gauge", ("role",)),
    "kvpush_credits_in_use_blocks": ("gauge", ("role",)),
    "kvpush_credits_granted_blocks": ("counter", ("role",)),
    "kvpush_credits_waiting_transfers": ("gauge", ("role",)),
    "kvpush_admissions": ("counter", ("role", "decision")),
    "kvpush_leases_active": ("gauge", ("role", "kind")),
    "kvpush_leases_expired": ("counter", ("role", "kind")),
    "kvpush_leases_fenced": ("counter", ("role",)),
    "kvpush_link_bandwidth_bytes_per_second": ("gauge", ("role", "peer")),
    "kvpush_link_slow": ("gauge", ("role", "peer")),
    "kvpush_link_capped": ("counter", ("role", "reason")),
    "kvpush_inflight_bytes": ("gauge", ("role",)),
    "kvpush_control_messages_rejected": ("counter", ("role", "reason")),
    "kvpush_kv_params_rejected": ("counter", ("role", "reason")),
    "kvpush_control_insecure": ("gauge", ("role",)),
    "kvpush_pump_errors": ("counter", ("role", "reason")),
    "kvpush_hook_errors": ("counter", ("role", "reason")),
    "kvpush_connector_blocks": ("gauge", ("role",)),
    "kvpush_transfers_active": ("gauge", ("role",)),
    "kvpush_peer_restarts": ("counter", ("role",)),
    "kvpush_peer_connections_lost": ("counter", ("role",)),
    "kvpush_protocol_fallbacks": ("counter", ("role", "version")),
    "kvpush_protocol_dones": ("counter", ("role", "version")),
    "kvpush_layerwise_writes": ("counter", ("role", "when")),
    "kvpush_post_descriptors": ("histogram", ("role",)),
    "kvpush_post_build_seconds": ("histogram", ("role",)),
    "kvpush_table_entries": ("gauge", ("role", "table")),
    "kvpush_table_capacity": ("gauge", ("role", "table")),
    "kvpush_peer_connect_seconds": ("histogram", ("role",)),
    "kvpush_peer_connect_failures": ("counter", ("role", "reason")),
}
VLLM_BASE = ["model_name", "engine"]


def test_connector_series_are_exactly_the_agreed_list() -> None:
    got = {s.name: (s.kind, s.labels) for s in CONNECTOR_SERIES}
    assert got == EXPECTED


def test_outcomes_include_the_agreed_values() -> None:
    assert {
        "pushed",
        "retried",
        "pull_fallback",
        "recompute",
        "failed",
        "expired",
        "aborted",
        "cancelled",
    } <= set(OUTCOMES)


@pytest.mark.parametrize("series", all_series(), ids=lambda s: s.name)
def test_names_follow_kvpush_noun_unit_and_labels_are_bounded(series: Series) -> None:
    assert series.name.startswith("kvpush_")
    assert not series.name.endswith("_total"), "counters get _total on export"
    if series.kind == "histogram":
        # A unit of time or size, or a count of a named thing (plural, as Prometheus
        # names count units): descriptors per post.
        assert series.name.endswith(("_seconds", "_bytes", "_descriptors")), (
            "a histogram names its unit"
        )
    assert series.doc.strip()
    for banned in ("request_id", "transfer_id", "request", "prompt"):
        assert banned not in series.labels
    if series.source == "connector":
        assert set(series.labels) <= set(LABELS)
        assert series.labels[0] == "role"
    if series.kind == "counter":
        assert exported_name(series) == series.name + "_total"


def test_router_series_are_read_from_router_metrics() -> None:
    names = {s.name for s in router_series()}
    assert {
        "kvpush_router_requests",
        "kvpush_router_ttft_seconds",
        "kvpush_router_backend_up",
    } <= names
    assert all(s.source == "router" for s in router_series())
    assert len({s.name for s in all_series()}) == len(all_series())


def _factory(kind: str) -> type:
    return {"counter": Counter, "gauge": Gauge, "histogram": Histogram}[kind]


def _scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _base(**labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"model_name": "m", "engine": "0", **labels}.items()))


def test_snapshots_from_buffers_land_in_the_series_with_vllm_labels() -> None:
    reg = CollectorRegistry()
    sink = MetricsSink(_factory, VLLM_BASE, {0: ["m", "0"]}, registry=reg)
    a, b = StatsBuffer(), StatsBuffer()
    a.inc("kvpush_transfers", ("producer", "pushed"))
    a.inc("kvpush_transfers", ("producer", "pushed"))
    a.inc("kvpush_transfer_bytes", ("producer",), 4096)
    a.set("kvpush_breaker_state", ("producer", "d0"), 2)
    b.set("kvpush_breaker_state", ("producer", "d0"), 0)
    b.observe("kvpush_transfer_seconds", ("producer",), 0.003)
    sink.observe(merge_stats(a.drain(), b.drain()))
    assert a.drain() == {} and b.drain() == {}
    got = _scrape(reg)
    assert got[("kvpush_transfers_total", _base(role="producer", outcome="pushed"))] == 2
    assert got[("kvpush_transfer_bytes_total", _base(role="producer"))] == 4096
    assert got[("kvpush_breaker_state", _base(role="producer", peer="d0"))] == 0  # later wins
    assert got[("kvpush_transfer_seconds_count", _base(role="producer"))] == 1
    assert got[("kvpush_transfer_seconds_bucket", _base(role="producer", le="0.005"))] == 1


def test_a_gauge_leaves_only_when_its_value_changed() -> None:
    """Gauges are set every engine step; an unchanged one must not make every step's
    snapshot non-empty (vLLM ships and records each non-empty one)."""
    buf = StatsBuffer()
    buf.set("kvpush_inflight_bytes", ("consumer",), 0)
    assert buf.drain() == {"g": [["kvpush_inflight_bytes", ["consumer"], 0]]}
    buf.set("kvpush_inflight_bytes", ("consumer",), 0)
    assert buf.drain() == {}
    buf.set("kvpush_inflight_bytes", ("consumer",), 4096)
    buf.set("kvpush_breaker_state", ("producer", "d0"), 0)
    got = buf.drain()["g"]
    assert sorted(got) == [
        ["kvpush_breaker_state", ["producer", "d0"], 0],
        ["kvpush_inflight_bytes", ["consumer"], 4096],
    ]
    buf.set("kvpush_inflight_bytes", ("consumer",), 0)
    assert buf.drain() == {"g": [["kvpush_inflight_bytes", ["consumer"], 0]]}


def test_every_series_is_registered_before_any_observation() -> None:
    reg = CollectorRegistry()
    MetricsSink(_factory, VLLM_BASE, {0: ["m", "0"]}, registry=reg)
    text = generate_latest(reg).decode()
    families = {f.name for f in text_string_to_metric_families(text)}
    assert {s.name for s in CONNECTOR_SERIES} <= families


def test_bad_observations_are_dropped_and_logged_once_never_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reg = CollectorRegistry()
    sink = MetricsSink(_factory, VLLM_BASE, {0: ["m", "0"]}, registry=reg)
    bad = {
        "c": [
            ["kvpush_no_such_series", ["producer"], 1],
            ["kvpush_transfers", ["producer"], 1],
            ["kvpush_transfers", ["producer"], 1],
        ],
        "g": [["kvpush_connector_blocks", ["producer", "extra"], 3]],
        "h": [["kvpush_transfer_seconds", [], 0.1]],
    }
    with caplog.at_level(logging.WARNING, logger="kvpush_prod.metrics"):
        sink.observe(bad)
        sink.observe(bad)
    assert len(caplog.records) == 4  # one per (series, problem), not per observation
    sink.observe({"c": [["kvpush_transfers", ["consumer", "pushed"], 1]]})
    assert _scrape(reg)[("kvpush_transfers_total", _base(role="consumer", outcome="pushed"))] == 1


def test_an_unbounded_label_is_capped(caplog: pytest.LogCaptureFixture) -> None:
    reg = CollectorRegistry()
    sink = MetricsSink(_factory, VLLM_BASE, {0: ["m", "0"]}, registry=reg)
    sink.observe(
        {
            "g": [
                ["kvpush_breaker_state", ["producer", f"peer{i}"], 0]
                for i in range(MAX_LABEL_SETS + 50)
            ]
        }
    )
    peers = {dict(lb)["peer"] for (n, lb) in _scrape(reg) if n == "kvpush_breaker_state"}
    assert len(peers) == MAX_LABEL_SETS
    assert any("unbounded" in r.message for r in caplog.records)


def test_zero_and_negative_counter_deltas_are_ignored() -> None:
    reg = CollectorRegistry()
    sink = MetricsSink(_factory, VLLM_BASE, {0: ["m", "0"]}, registry=reg)
    sink.observe(
        {"c": [["kvpush_chunks", ["producer", "ok"], 0], ["kvpush_chunks", ["producer", "ok"], -3]]}
    )
    assert ("kvpush_chunks_total", _base(role="producer", result="ok")) not in _scrape(reg)


def test_gauges_show_the_latest_write_across_api_server_processes() -> None:
    # With several API servers (vLLM's default with --data-parallel-size) each process
    # writes the gauges of the engines it hears from; the default multiprocess mode would
    # keep every process's last value, stale ones too (an idle engine reading as busy).
    sink = MetricsSink(_factory, VLLM_BASE, {0: ["m", "0"]}, registry=CollectorRegistry())
    gauges = [s.name for s in CONNECTOR_SERIES if s.kind == "gauge"]
    assert gauges
    assert {sink._metrics[n]._multiprocess_mode for n in gauges} == {"mostrecent"}
