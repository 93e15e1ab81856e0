"""Bridge from the connector's StatsBuffer snapshots to vLLM's KV-connector stats and Prometheus.

vLLM carries a KVConnectorStats from worker and scheduler processes to its API server.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvpush_prod.loglimit import LogLimiter
from kvpush_prod.metrics import MetricsSink, merge_stats

logger = logging.getLogger(__name__)
# vLLM calls these in its own loops (engine core output, API server logging): what raises
# here is logged, at most once per interval per kind, and never reaches vLLM.
_log = LogLimiter(logger, 60.0)


class KvpushStats(KVConnectorStats):
    """A drained StatsBuffer snapshot (``data`` holds lists "c", "g", "h")."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """This snapshot merged with ``other``; one that cannot be merged is dropped
        (logged), never raised into vLLM's step."""
        try:
            return KvpushStats(data=merge_stats(self.data, other.data or {}))
        except Exception:  # noqa: BLE001 - metrics must never stop the engine
            _log.log(
                logging.ERROR,
                "aggregate",
                "kvpush: a stats snapshot could not be merged and is dropped: %r",
                type(other).__name__,
            )
            return self

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

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        classes = {
            "counter": self._counter_cls,
            "gauge": self._gauge_cls,
            "histogram": self._histogram_cls,
        }
        self._sink = MetricsSink(classes.__getitem__, labelnames, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record a snapshot; one that cannot be recorded is dropped (logged), never raised
        into vLLM's metrics loop."""
        try:
            self._sink.observe(transfer_stats_data, engine_idx)
        except Exception:  # noqa: BLE001 - metrics must never stop the API server
            _log.log(
                logging.ERROR,
                "observe",
                "kvpush: a stats snapshot of engine %s could not be recorded and is dropped",
                engine_idx,
            )
