"""Bridge from the connector's StatsBuffer snapshots to vLLM's KV-connector stats and Prometheus.

vLLM carries a KVConnectorStats from worker and scheduler processes to its API server.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvpush_prod.metrics import MetricsSink, merge_stats


class KvpushStats(KVConnectorStats):
    """A drained StatsBuffer snapshot (``data`` holds lists "c", "g", "h")."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        return KvpushStats(data=merge_stats(self.data, other.data or {}))

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for name, labels, value in self.data.get("c", ()):
            key = name + ("[" + ",".join(labels) + "]" if labels else "")
            out[key] = out.get(key, 0) + value
        for name, labels, value in self.data.get("g", ()):
            out[name + ("[" + ",".join(labels) + "]" if labels else "")] = value
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in ("c", "g", "h"))


class KvpushPromMetrics(KVConnectorPromMetrics):
    """Registers every kvpush series with vLLM's metric classes and records snapshots."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        classes = {"counter": self._counter_cls, "gauge": self._gauge_cls,
                   "histogram": self._histogram_cls}
        self._sink = MetricsSink(classes.__getitem__, labelnames, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self._sink.observe(transfer_stats_data, engine_idx)
