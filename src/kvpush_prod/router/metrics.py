"""The router's own Prometheus series, in one place, registered on a registry you pass in.

Labels stay bounded: endpoint (two paths), outcome, reason, role and backend URL (from config).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

# TTFT through P/D spans a few ms (loopback, tiny model) to tens of seconds (long prompts
# under load), so the buckets are log-spaced over that whole range.
_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


# A source of table sizes: table name -> (entries, bound or None).
TableSource = Callable[[], dict[str, tuple[int, int | None]]]
# The ``table`` label's values: what the router keeps per client, backend or request.
ROUTER_TABLES: dict[str, str] = {
    "requests.admitted": "a client request admitted (bounded by max_concurrent_requests)",
    "legs.background": "a prefill leg left running after the decode leg answered",
    "health.tasks": "a backend's health poller",
    "health.key_failures": "a prefill backend whose identity check fails",
    "client.legs_connections": "a pooled HTTP connection to a backend (legs)",
    "client.health_connections": "a pooled HTTP connection to a backend (health checks)",
}

# The ``endpoint`` label's values (router/legs.py: COMPLETIONS_PATH, CHAT_PATH).
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


class Outcome(str, Enum):
    """How one client request ended; the ``outcome`` label of ``kvpush_router_requests_total``."""

    OK = "ok"
    RETRIED_OK = "retried_ok"
    CLIENT_ERROR = "client_error"
    BACKEND_ERROR = "backend_error"
    NO_BACKEND = "no_backend"
    CLIENT_CANCELLED = "client_cancelled"
    REJECTED = "rejected"  # refused by a router limit (RejectReason says which)


class RejectReason(str, Enum):
    """Which router limit refused or cut off a client: ``reason`` of
    ``kvpush_router_requests_rejected_total`` (docs/router.md, "Limits")."""

    BODY_TOO_LARGE = "body_too_large"
    HEADER_TOO_LARGE = "header_too_large"
    HEADER_TIMEOUT = "header_timeout"
    BODY_TIMEOUT = "body_timeout"
    TOO_DEEP = "too_deep"
    CONCURRENCY = "concurrency"
    DRAINING = "draining"
    N_GT_1 = "n_gt_1"
    BEAM_SEARCH = "beam_search"
    WRITE_STALL = "write_stall"


class RouterMetrics:
    """All ``kvpush_router_*`` series. Pass ``registry=`` (tests use a fresh one each)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvpush_router_requests_total",
            "Client requests by endpoint and how they ended.",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "kvpush_router_request_seconds",
            "Time from receiving a client request to its last byte sent.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "kvpush_router_ttft_seconds",
            "Time from receiving a client request to the first byte from the decode backend.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "kvpush_router_retries_total",
            "Requests retried on another (prefill, decode) pair, by the failure that caused it.",
            ["reason"],
            registry=r,
        )
        self.rejected = Counter(
            "kvpush_router_requests_rejected_total",
            "Clients refused or cut off by a router limit, by the limit.",
            ["reason"],
            registry=r,
        )
        for reason in RejectReason:
            # Every reason from the start, at 0: rate() and alerts see the first hit.
            self.rejected.labels(reason.value)
        self.direct = Counter(
            "kvpush_router_direct_total",
            "Requests routed to a decode backend alone, their prompt estimated below "
            "direct_below_tokens: no prefill leg, D computes the prompt, no KV is "
            "transferred. Counted once per request, whatever its outcome "
            "(kvpush_router_requests_total).",
            ["endpoint"],
            registry=r,
        )
        for endpoint in ENDPOINTS:
            self.direct.labels(endpoint)
        self._backend_series(r)
        self._table_series(r)

    def _table_series(self, r: CollectorRegistry) -> None:
        """The table gauges, measured at each scrape from the sources added."""
        self.table_entries = Gauge(
            "kvpush_router_table_entries",
            "Entries of each table the router keeps per client request, backend or "
            "connection (docs/metrics.md, Tables); flat across quiet windows, a table that "
            "grows with time is a leak. Measured at each scrape.",
            ["table"],
            registry=r,
        )
        self.table_capacity = Gauge(
            "kvpush_router_table_capacity",
            "The bound of a table of kvpush_router_table_entries, where it has one.",
            ["table"],
            registry=r,
        )
        self._table_sources: dict[str, TableSource] = {}

    def add_tables(self, name: str, source: TableSource) -> None:
        """Measure ``source``'s tables at every scrape (replacing an earlier one of
        ``name``)."""
        self._table_sources[name] = source

    def measure_tables(self) -> None:
        for source in list(self._table_sources.values()):
            for name, (entries, capacity) in source().items():
                self.table_entries.labels(name).set(entries)
                if capacity is not None:
                    self.table_capacity.labels(name).set(capacity)

    def _backend_series(self, r: CollectorRegistry) -> None:
        """The per-backend gauges."""
        self.backend_up = Gauge(
            "kvpush_router_backend_up",
            "1 if the router routes to this backend (healthy, and for prefill: identity known).",
            ["role", "backend"],
            registry=r,
        )
        self.inflight = Gauge(
            "kvpush_router_inflight",
            "Legs in flight to this backend.",
            ["role", "backend"],
            registry=r,
        )

    def observe_request(self, endpoint: str, outcome: Outcome, seconds: float) -> None:
        self.requests.labels(endpoint, outcome.value).inc()
        self.request_seconds.labels(endpoint).observe(seconds)

    def observe_ttft(self, endpoint: str, seconds: float) -> None:
        self.ttft_seconds.labels(endpoint).observe(seconds)

    def count_direct(self, endpoint: str) -> None:
        self.direct.labels(endpoint).inc()

    def count_retry(self, reason: str) -> None:
        self.retries.labels(reason).inc()

    def count_rejected(self, reason: RejectReason) -> None:
        self.rejected.labels(reason.value).inc()

    def set_backend_up(self, role: str, backend: str, up: bool) -> None:
        self.backend_up.labels(role, backend).set(1.0 if up else 0.0)

    def set_inflight(self, role: str, backend: str, n: int) -> None:
        self.inflight.labels(role, backend).set(n)

    def exposition(self) -> bytes:
        """The registry in Prometheus text format (the tables measured first)."""
        self.measure_tables()
        return generate_latest(self.registry)
