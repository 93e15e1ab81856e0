"""Every Prometheus series kvpush-prod exports, named in one place.

Engines buffer observations (StatsBuffer) that vLLM carries to its API server, where the
connector's PromMetrics bridge writes them into these series on vLLM's own ``/metrics``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["counter", "gauge", "histogram"]

_SECONDS_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0, 60.0,
)


@dataclass(frozen=True)
class Series:
    """One exported series: its name (without the ``_total`` a counter gets), kind, labels."""

    name: str
    kind: Kind
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = _SECONDS_BUCKETS


# Labels stay bounded: role (producer|consumer), outcome, reason, peer (an engine id).
CONNECTOR_SERIES: tuple[Series, ...] = (
    Series("kvpush_transfers", "counter",
           "Transfers that ended, by role and outcome (pushed, failed, expired, aborted, "
           "cancelled, recompute, pull_fallback).", ("role", "outcome")),
    Series("kvpush_transfer_bytes", "counter",
           "KV bytes moved by completed transfers (producer: pushed, consumer: received).",
           ("role",)),
    Series("kvpush_transfer_seconds", "histogram",
           "Producer: blocks ready to last WRITE complete; consumer: REGISTER sent to DONE.",
           ("role",)),
    Series("kvpush_chunk_post_seconds", "histogram",
           "Time to post one chunk (WRITE/READ) to the transport.", ("role",)),
    Series("kvpush_chunks", "counter", "Chunks (WRITEs/READs) completed, by result.",
           ("role", "result")),
    Series("kvpush_control_messages_rejected", "counter",
           "Control messages and notifications dropped, by reason.", ("role", "reason")),
    Series("kvpush_kv_params_rejected", "counter",
           "Requests whose kv_transfer_params were malformed (served by local compute).",
           ("role",)),
    Series("kvpush_connector_blocks", "gauge",
           "KV blocks the engine holds on behalf of the connector (P: sent-but-not-freed, "
           "D: reserved for inbound transfers).", ("role",)),
    Series("kvpush_transfers_active", "gauge", "Transfers in progress.", ("role",)),
)

SERIES_BY_NAME = {s.name: s for s in CONNECTOR_SERIES}


def exported_name(series: Series) -> str:
    """The name a scrape shows (counters gain ``_total``)."""
    return series.name + "_total" if series.kind == "counter" else series.name


class StatsBuffer:
    """Thread-safe buffer of observations between two drains (counters as deltas)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, tuple[str, ...]], float] = {}
        self._gauges: dict[tuple[str, tuple[str, ...]], float] = {}
        self._hist: list[tuple[str, tuple[str, ...], float]] = []

    def inc(self, name: str, labels: tuple[str, ...], value: float = 1.0) -> None:
        with self._lock:
            key = (name, labels)
            self._counters[key] = self._counters.get(key, 0.0) + value

    def set(self, name: str, labels: tuple[str, ...], value: float) -> None:
        with self._lock:
            self._gauges[(name, labels)] = value

    def observe(self, name: str, labels: tuple[str, ...], value: float) -> None:
        with self._lock:
            self._hist.append((name, labels, value))

    def drain(self) -> dict[str, Any]:
        """A serialisable snapshot, emptied afterwards; ``{}`` when nothing happened."""
        with self._lock:
            data: dict[str, Any] = {}
            if self._counters:
                data["c"] = [[n, list(lb), v] for (n, lb), v in self._counters.items()]
            if self._gauges:
                data["g"] = [[n, list(lb), v] for (n, lb), v in self._gauges.items()]
            if self._hist:
                data["h"] = [[n, list(lb), v] for n, lb, v in self._hist]
            self._counters, self._gauges, self._hist = {}, {}, []
            return data


def merge_stats(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Combine two drained snapshots (lists concatenate; the later gauge value wins)."""
    out = {k: list(v) for k, v in a.items()}
    for k, v in b.items():
        out.setdefault(k, []).extend(v)
    return out


class MetricsSink:
    """Writes drained snapshots into prometheus_client metrics created from the series table.

    ``factory(kind)`` returns the metric class to use (vLLM passes its own wrappers);
    ``base_labels``/``base_values`` are the labels every series carries (vLLM's engine labels).
    """

    def __init__(self, factory: Any, base_labels: list[str],
                 per_engine_values: dict[int, list[object]], registry: Any = None) -> None:
        self._per_engine = per_engine_values
        self._metrics: dict[str, Any] = {}
        for s in CONNECTOR_SERIES:
            cls = factory(s.kind)
            kwargs: dict[str, Any] = {"labelnames": [*base_labels, *s.labels]}
            if s.kind == "histogram":
                kwargs["buckets"] = list(s.buckets)
            if registry is not None:
                kwargs["registry"] = registry
            self._metrics[s.name] = cls(s.name, s.doc, **kwargs)

    def observe(self, data: dict[str, Any], engine_idx: int = 0) -> None:
        base = [str(v) for v in self._per_engine.get(engine_idx, [])]
        for name, labels, value in data.get("c", ()):
            if name in self._metrics and value > 0:
                self._metrics[name].labels(*base, *labels).inc(value)
        for name, labels, value in data.get("g", ()):
            if name in self._metrics:
                self._metrics[name].labels(*base, *labels).set(value)
        for name, labels, value in data.get("h", ()):
            if name in self._metrics:
                self._metrics[name].labels(*base, *labels).observe(value)
