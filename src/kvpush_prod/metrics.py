"""Every Prometheus series the connector exports, named in one place.

Engines buffer observations (StatsBuffer) that vLLM carries to its API server, where the
connector's PromMetrics bridge (MetricsSink) writes them into these series on vLLM's own
``/metrics``. The router's ``kvpush_router_*`` series live in ``router/metrics.py``;
``metrics_docs.all_series`` names both, and renders docs/metrics.md from them.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Literal

from kvpush_prod.vocabulary import ParamsRejectReason, RejectReason

logger = logging.getLogger(__name__)

Kind = Literal["counter", "gauge", "histogram"]

SECONDS_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
# Posting a chunk is a local call (tens of microseconds when healthy); a slow post means the
# transport's queues are full or the progress thread is starved.
_POST_BUCKETS = (0.00001, 0.000025, 0.00005, *(b for b in SECONDS_BUCKETS if b <= 0.25), 1.0)
# Descriptors per post: a run of blocks per region on a fresh cache (tens to hundreds), a
# block per region on a fragmented one (thousands at 8k tokens), split over 8,192.
_DESCRIPTOR_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)

# The only labels a kvpush series may carry (vLLM adds model_name and engine on its side).
# Each is bounded: a fixed set of values, or the engine ids of the peers (peer).
LABELS: dict[str, str] = {
    "role": "`producer` (P, prefill) or `consumer` (D, decode)",
    "outcome": "how a transfer ended",
    "reason": "why (a short fixed set per series, never free text)",
    "peer": "the remote engine's `engine_id` (bounded by the number of engines)",
    "kind": "which lease: `permit` (D lets P write) or `send` (P holds blocks for D)",
    "result": "how a chunk ended",
    "decision": "what D's admission control decided for a transfer",
    "table": "one of an engine's tables (the list under Tables below)",
    "when": "a layer-wise WRITE's post: `during_forward` (P's forward still ran) or "
    "`after_forward`",
    "version": "a wire protocol version this build speaks: its own or the one before (N-1)",
}
# The router's own labels (its series are not on vLLM's /metrics, so vLLM adds nothing).
ROUTER_LABELS: dict[str, str] = {
    "role": "`prefill` or `decode` (which kind of backend)",
    "backend": "a backend's base URL, from the router's configuration",
    "endpoint": "the OpenAI path: `/v1/completions` or `/v1/chat/completions`",
    "outcome": "how a client request ended",
    "reason": "the failure that made the router retry on another pair, or the limit that "
    "refused a client's request",
    "table": "one of the router's tables (the list under Tables below)",
}
ROLES = ("producer", "consumer")
# The wire protocol versions this build speaks (``core.protocol``: N-1 and its own; a test
# holds them equal, this layer may not import the core).
PROTOCOL_VERSIONS = ("2", "3")
OUTCOMES = (
    "pushed",
    "retried",
    "pull_fallback",
    "recompute",
    "failed",
    "expired",
    "aborted",
    "cancelled",
    "prefix_hit",
)
# The identity an operator (and the chaos nemesis) checks per engine and role: every
# transfer started ends once, in exactly one of OUTCOMES (docs/metrics.md, "Accounting").
OUTCOME_GROUPS: dict[str, tuple[str, ...]] = {
    "pushed": ("pushed", "retried"),
    "pulled": ("pull_fallback",),
    "recomputed": ("recompute", "prefix_hit"),
    "failed": ("failed", "expired", "aborted", "cancelled"),
}
# Every table an engine keeps whose entries are keyed by a request, transfer, peer or key:
# its name (the ``table`` label of kvpush_table_entries / kvpush_table_capacity), what one
# entry is. P: role producer; D: role consumer; some tables exist on one side only.
TABLES: dict[str, str] = {
    # scheduler side (vLLM's EngineCore), both
    "trust.nonces": "a signed request's nonce, until its signature expires (replay memory)",
    "trust.nonce_expiry": "the same nonces in expiry order",
    "trust.resolved": "a host name resolved for the control.allowed_peers check",
    # scheduler side, P
    "scheduler.requests": "P: a request to push, until it finishes",
    "scheduler.owners": "P: a request's decode engine key, until it finishes",
    "scheduler.sent": "P: a request whose push was handed to the workers, until it finishes",
    "scheduler.held": "P: a finished request whose blocks are held for its push",
    "scheduler.live": "P: a transfer id pushed by a live request",
    "scheduler.transfer_ids": "P: a request's transfer id, until its push ends",
    "scheduler.refused": "P: a request whose params were refused, until it finishes",
    # scheduler side, D
    "admission.inbound": "D: a request's inbound transfer, from its first ask to its end",
    "admission.over": "D: a request whose transfer is over, until the request finishes",
    "admission.transfer_ids": "D: a transfer id received by a live request",
    "credits.held": "D: a transfer holding receive credit",
    "credits.waiting": "D: a transfer waiting for credit",
    "credits.peers": "D: a prefill engine with credit counters",
    "scheduler.received": "D: what arrived for a request, until its reply is made",
    "scheduler.outcomes": "D: a worker's outcome of a request, until the scheduler reads it",
    # worker side (one per rank; with tensor parallelism the last rank reported)
    "pump.requests": "a transfer handed to this rank, until it ends",
    "pump.began": "a transfer's start time, until it ends",
    "pump.chunks": "a chunk posted to NIXL, until it completes",
    "pump.peer_labels": "a connected peer agent's metric label",
    "pump.recv_blocks": "D: a receive's blocks, until it ends",
    "pump.staged": "D: a receive's slots of the staging area (staging.receive_mib), until it ends",
    "pump.views": "D: the part of each block a receive fills",
    "pump.joins": "D: a part of a receive fed by several P ranks",
    "links.wire": "D: a sub-transfer's id on the wire",
    "links.by_rank": "D: a sub-transfer by (wire id, P rank)",
    "links.by_generation": "D: a sub-transfer by (wire id, generation)",
    "splits.parts": "P: a part of a transfer that feeds several D ranks",
    "splits.known": "P: what the engine said of a transfer, for parts made later",
    "splits.ended": "P: a transfer released (its late REGISTERs make no new parts)",
    "driver.peers": "a connected peer agent",
    "nixl.peers": "a remote NIXL agent loaded",
    "nixl.slices": "a layer-wise slice of a remote agent's descriptors",
    "linkguard.links": "P: a link watched by the slow-link guard",
    "control.peers": "an open socket pair to a peer's control address",
    "control.spares": "a socket pair made ahead for a new peer",
    "control.monitors": "a socket monitor (disconnect watch)",
    "control.backlog_keys": "a key with messages read and not yet handled",
    "control.address_keys": "a peer key with control addresses",
    "control.address_buckets": "a peer key's new-address rate bucket",
    "control.stale": "a replaced socket waiting to be closed",
    "sender.transfers": "P: an outbound transfer",
    "sender.unknown": "P: a transfer a REGISTER named before P's engine did",
    "sender.chunks": "P: a chunk in flight",
    "sender.tombstones": "P: a cancelled or aborted transfer, until its time to live",
    "sender.refused": "P: a transfer whose REGISTER was refused before its owner was known",
    "sender.peers": "P: a D rank met (the peer directory)",
    "sender.retired": "P: a D rank's replaced incarnations",
    "sender.agents": "P: a D rank's NIXL agent name",
    "sender.connect_retry": "P: when a D agent that could not be connected is asked again",
    "sender.silent": "P: a D agent whose connection failed, not heard from since",
    "sender.breakers": "P: a circuit breaker, per D agent",
    "sender.retry_budgets": "P: a retry budget, per D agent",
    "push.links": "P: a link (D agent) of the WRITE scheduler",
    "push.transfers": "P: a transfer queued in the WRITE scheduler",
    "push.inflight": "P: a WRITE in flight",
    "push.delayed": "P: a WRITE waiting to be retried",
    "push.cutoffs": "P: a transfer deadline in the scheduler's heap (lazy)",
    "receiver.transfers": "D: an inbound transfer",
    "receiver.waiting": "D: a transfer waiting for credit",
    "receiver.peers": "D: a P rank heard from",
    "receiver.heard": "D: when an origin was last heard",
    "receiver.chunks": "D: a READ in flight (pull fallback)",
    "receiver.done_log": "D: a receive that ended with its DONE (late DONEs are dropped)",
    "receiver.retry_budgets": "D: a retry budget, per P agent",
    "receiver.permits": "D: a write permit granted to P",
    "receiver.permits_expiry": "D: a permit's expiry in the lease heap (lazy)",
    "pull.links": "D: a link (P agent) of the READ scheduler",
    "pull.transfers": "D: a transfer queued in the READ scheduler",
    "pull.inflight": "D: a READ in flight",
    "pull.delayed": "D: a READ waiting to be retried",
    "pull.cutoffs": "D: a transfer deadline in the READ scheduler's heap (lazy)",
}
CHUNK_RESULTS = ("ok", "error", "post_failed")
DECISIONS = ("admit", "later", "refuse")
LEASE_KINDS = ("permit", "send")
# The label values of the two rejection counters: every word of their enums, nothing else.
CONTROL_REJECT_REASONS = tuple(r.value for r in RejectReason)
PARAMS_REJECT_REASONS = tuple(r.value for r in ParamsRejectReason)
PUMP_STAGES = ("message", "command", "action", "completion", "timer")
# Why P's connection to a decode engine failed (connector/connects.py).
CONNECT_FAILURES = ("timeout", "error")
# vLLM's connector hooks that contain what raises in them (connector/connector.py).
HOOKS = (
    # scheduler side
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "on_new_request",
    "request_finished",
    "update_connector_output",
    "has_pending_push_work",
    # worker side
    "bind_connector_metadata",
    "wait_for_save",
    "get_finished",
    "build_connector_worker_meta",
    "shutdown",
    # both
    "get_kv_connector_stats",
)
BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}

# Labels vLLM puts on every connector series, and what Prometheus adds on a scrape.
VLLM_LABELS = ("model_name", "engine")
SCRAPE_LABELS = ("job", "instance")
# Most label sets one series may hold in MetricsSink; more means a label is unbounded.
MAX_LABEL_SETS = 1000


@dataclass(frozen=True)
class Series:
    """One exported series: its name (without the ``_total`` a counter gets), kind, labels.

    ``values`` lists, for labels with a closed set of values, every value the connector emits.
    ``healthy``: the series has samples on every healthy run (False: only after a fault or
    bad input; absent then means zero).
    """

    name: str
    kind: Kind
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = SECONDS_BUCKETS
    values: tuple[tuple[str, tuple[str, ...]], ...] = ()
    source: Literal["connector", "router"] = "connector"
    healthy: bool = True

    def allowed(self, label: str) -> tuple[str, ...] | None:
        """The closed set of values of ``label``, or None when it is open (peer, reason)."""
        for name, vals in self.values:
            if name == label:
                return vals
        return None


def _s(
    name: str,
    kind: Kind,
    labels: tuple[str, ...],
    doc: str,
    buckets: tuple[float, ...] = SECONDS_BUCKETS,
    values: dict[str, tuple[str, ...]] | None = None,
    healthy: bool = True,
) -> Series:
    closed: dict[str, tuple[str, ...]] = {"role": ROLES} if "role" in labels else {}
    closed.update(values or {})
    return Series(name, kind, doc, labels, buckets, tuple(closed.items()), healthy=healthy)


_R = ("role",)
CONNECTOR_SERIES: tuple[Series, ...] = (
    _s(
        "kvpush_transfers",
        "counter",
        ("role", "outcome"),
        "Transfers that ended, by outcome: pushed (first try), retried (pushed after >= 1 "
        "retry), pull_fallback (D pulled it), recompute (D computed the prompt itself), failed, "
        "expired (a lease or deadline ran out), aborted (the request ended first), cancelled "
        "(D cancelled after registering), prefix_hit (D's prefix cache held the whole prompt).",
        values={"outcome": OUTCOMES},
    ),
    _s(
        "kvpush_transfers_started",
        "counter",
        _R,
        "Transfers begun (P: a request with valid do_remote_decode params; D: a request with "
        "valid do_remote_prefill params, before its admission). Each ends once in "
        "kvpush_transfers_total; one handed to the engine's workers ends once per "
        "tensor-parallel rank and is counted started once per rank. Once quiet, started = "
        "sum of kvpush_transfers_total over outcomes + kvpush_transfers_active.",
    ),
    _s(
        "kvpush_transfer_bytes",
        "counter",
        _R,
        "KV bytes moved by completed transfers (producer: pushed, consumer: received).",
    ),
    _s(
        "kvpush_transfer_seconds",
        "histogram",
        _R,
        "Producer: blocks ready to last WRITE complete; consumer: REGISTER sent to DONE.",
    ),
    _s(
        "kvpush_queue_wait_seconds",
        "histogram",
        _R,
        "Producer: transfer ready (blocks computed and REGISTER received) to its first chunk "
        "posted; time spent queued behind other transfers on the link.",
    ),
    _s(
        "kvpush_chunk_post_seconds",
        "histogram",
        _R,
        "Time to post one chunk (WRITE/READ) to the transport.",
        _POST_BUCKETS,
    ),
    _s(
        "kvpush_chunks",
        "counter",
        ("role", "result"),
        "Chunks (WRITEs/READs) that ended: ok, error (completed with an error), post_failed "
        "(the transport refused to post it).",
        values={"result": CHUNK_RESULTS},
    ),
    _s(
        "kvpush_retries",
        "counter",
        ("role", "reason"),
        "Chunks posted again after a retryable error, by the error's class.",
        healthy=False,
    ),
    _s(
        "kvpush_fallbacks",
        "counter",
        ("role", "reason"),
        "Transfers switched from push to pull (D READs from P), by why the push was given up.",
        healthy=False,
    ),
    _s(
        "kvpush_breaker_state",
        "gauge",
        ("role", "peer"),
        "Circuit breaker per peer: 0 closed (push), 1 half-open (one probe), 2 open "
        "(new transfers go straight to fallback).",
    ),
    _s(
        "kvpush_protocol_fallbacks",
        "counter",
        ("role", "version"),
        "Peers (each process of one) this engine talks an older protocol version to than its "
        "own, by that version: a mixed-version fleet, as during a rolling upgrade (KV is still "
        "pushed; each is also logged). A decode also counts a prefill it heard only through "
        "an older DONE. Once every engine runs one release it stops rising.",
        healthy=False,
    ),
    _s(
        "kvpush_protocol_dones",
        "counter",
        ("role", "version"),
        "Pushes by the protocol version of the pair: producer, last WRITEs posted carrying a "
        "DONE (a re-post counts again); consumer, DONE notifications received.",
        values={"version": PROTOCOL_VERSIONS},
    ),
    _s(
        "kvpush_breaker_trips",
        "counter",
        ("role", "peer"),
        "Times the peer's circuit breaker opened.",
        healthy=False,
    ),
    _s(
        "kvpush_staging_blocks",
        "gauge",
        _R,
        "A staging area's size in KV blocks over every layer: D's receive area "
        "(staging.receive_mib; the credit budget is capped at it), P's gather area "
        "(staging.send_mib).",
        healthy=False,
    ),
    _s(
        "kvpush_staging_used_blocks",
        "gauge",
        _R,
        "Staging slots held now: D's by receives in progress, P's by gathered WRITEs in "
        "flight (or kept after one was given up in flight).",
        healthy=False,
    ),
    _s(
        "kvpush_staging_copy_seconds",
        "histogram",
        _R,
        "D's copy of a landed transfer from its staging slots into its KV blocks (on the "
        "transfer pump, before the engine learns the KV arrived).",
        buckets=SECONDS_BUCKETS,
        healthy=False,
    ),
    _s(
        "kvpush_staging_refused",
        "counter",
        _R,
        "D: receives that failed because its staging area had no room (the credit budget "
        "should make this 0: a count means staging.receive_mib is smaller than what was "
        "admitted). P: WRITEs posted from the KV blocks, not gathered, for want of slots "
        "(raise staging.send_mib).",
        healthy=False,
    ),
    _s(
        "kvpush_credits_budget_blocks",
        "gauge",
        _R,
        "D's receive window: KV blocks inbound transfers may reserve now (the budget, "
        "capped by the blocks D's KV cache has free).",
    ),
    _s(
        "kvpush_credits_in_use_blocks",
        "gauge",
        _R,
        "Blocks of the receive window reserved by admitted transfers now.",
    ),
    _s(
        "kvpush_credits_granted_blocks",
        "counter",
        _R,
        "Blocks granted to transfers (cumulative; rate() is the grant throughput).",
    ),
    _s(
        "kvpush_credits_waiting_transfers",
        "gauge",
        _R,
        "Transfers waiting for credit (admission said later).",
    ),
    _s(
        "kvpush_admissions",
        "counter",
        ("role", "decision"),
        "Admission decisions for inbound transfers: admit, later (ask again), refuse.",
        values={"decision": DECISIONS},
    ),
    _s(
        "kvpush_leases_active",
        "gauge",
        ("role", "kind"),
        "Live leases: permit (D's write permits to P), send (P's holds of sent blocks for D).",
        values={"kind": LEASE_KINDS},
    ),
    _s(
        "kvpush_leases_expired",
        "counter",
        ("role", "kind"),
        "Leases that ran out without being released (a silent or dead peer).",
        values={"kind": LEASE_KINDS},
        healthy=False,
    ),
    _s(
        "kvpush_leases_fenced",
        "counter",
        _R,
        "Late messages or writes refused because their generation was stale.",
        healthy=False,
    ),
    _s(
        "kvpush_link_bandwidth_bytes_per_second",
        "gauge",
        ("role", "peer"),
        "Measured bandwidth of the link to the peer (EWMA of chunk completions; whole pushes' "
        "once one landed, so layer-wise chunks do not make it look slower).",
    ),
    _s(
        "kvpush_link_slow",
        "gauge",
        ("role", "peer"),
        "1 while the link to the peer is slow: its measured bandwidth stayed below "
        "links.slow_fraction of links.expected_gbps for links.slow_window_s (logged once with "
        "the transports in use; alert KvpushLinkSlow). Absent without links.expected_gbps.",
        healthy=False,
    ),
    _s(
        "kvpush_link_capped",
        "counter",
        ("role", "reason"),
        "Times a chunk ready to post waited because its link was at an in-flight cap: bytes "
        "(measured bandwidth x push.target_latency_ms) or chunks (push.max_inflight_chunks). "
        "Load, not a fault; absent until a cap first binds.",
        values={"reason": ("bytes", "chunks")},
        healthy=False,
    ),
    _s("kvpush_inflight_bytes", "gauge", _R, "Bytes posted and not yet completed."),
    _s(
        "kvpush_control_messages_rejected",
        "counter",
        ("role", "reason"),
        "Control messages and notifications dropped (never acted on), by reason; "
        "prompt_mismatch / checksum_mismatch: KV that arrived and was refused (recomputed).",
        values={"reason": CONTROL_REJECT_REASONS},
        healthy=False,
    ),
    _s(
        "kvpush_kv_params_rejected",
        "counter",
        ("role", "reason"),
        "Requests whose kv_transfer_params were refused: malformed, unsigned / bad_signature "
        "/ expired (not signed by the router's params key), unknown_key (a peer key outside "
        "the allow-list), foreign_peer (an address outside control.allowed_peers), unusable "
        "(a prefill engine's fields without do_remote_prefill, or a pull connector's answer), "
        "wrong_leg / unknown_field / replayed (signed for the other leg, with a field the "
        "router does not sign, or already used by another request), replay_memory_full, "
        "duplicate_transfer (another live request has its transfer id). D computes such a "
        "prompt locally; P does not push it.",
        values={"reason": PARAMS_REJECT_REASONS},
        healthy=False,
    ),
    _s(
        "kvpush_control_insecure",
        "gauge",
        _R,
        "1 while the control channel runs without keys on a non-loopback address "
        "(control.insecure: true): any host that reaches the port can forge messages.",
    ),
    _s(
        "kvpush_pump_errors",
        "counter",
        ("role", "reason"),
        "Inputs or actions of the transfer pump that raised, by stage (message, command, "
        "action, completion, timer); each is contained: the others of the pass go on.",
        values={"reason": PUMP_STAGES},
        healthy=False,
    ),
    _s(
        "kvpush_hook_errors",
        "counter",
        ("role", "reason"),
        "vLLM connector hooks that raised, by hook: contained (never an engine crash), the "
        "requests concerned recompute their prompt or fail per kv_load_failure_policy; a bug.",
        values={"reason": HOOKS},
        healthy=False,
    ),
    _s(
        "kvpush_connector_blocks",
        "gauge",
        _R,
        "KV blocks the engine holds on behalf of the connector (P: sent-but-not-freed, "
        "D: reserved for inbound transfers).",
    ),
    _s("kvpush_transfers_active", "gauge", _R, "Transfers in progress."),
    _s(
        "kvpush_peer_connections_lost",
        "counter",
        _R,
        "NIXL connections the transport closed under a transfer (REMOTE_DISCONNECT: e.g. "
        "UCX's TCP user timeout during a network partition): dropped and made anew on next "
        "use (P once it hears from that D again, D at its next pull from that P). A steady "
        "rate means a link that keeps failing.",
        healthy=False,
    ),
    _s(
        "kvpush_peer_restarts",
        "counter",
        _R,
        "Peers seen coming back as a new process (same engine id, new agent): reconnected.",
        healthy=False,
    ),
    _s(
        "kvpush_layerwise_writes",
        "counter",
        ("role", "when"),
        "Layer-wise push (push.layerwise): WRITEs of one layer's KV posted while P's forward "
        "was still computing later layers (during_forward) or after it ended "
        "(after_forward: the REGISTER came late, or the last layer).",
        values={"when": ("during_forward", "after_forward")},
        healthy=False,
    ),
    _s(
        "kvpush_post_descriptors",
        "histogram",
        _R,
        "NIXL descriptors one chunk's post hands the backend: one per run of blocks adjacent "
        "on both sides per KV region (per block per region when D's cache is fragmented; "
        "per piece when block sizes or tensor-parallel sizes differ). Over 8,192 a post is "
        "split into parts.",
        _DESCRIPTOR_BUCKETS,
    ),
    _s(
        "kvpush_post_build_seconds",
        "histogram",
        _R,
        "Time to build one chunk's NIXL request from its block ids (runs, descriptor lists, "
        "NIXL's request), before the backend submits it; part of kvpush_chunk_post_seconds. "
        "A post split into parts counts its first part's (the others are built as it "
        "completes).",
        _POST_BUCKETS,
    ),
    _s(
        "kvpush_table_entries",
        "gauge",
        ("role", "table"),
        "Entries of each table the engine keeps per request, transfer, peer or key (the "
        "Tables section). Flat across quiet windows; one that grows with time is a leak.",
        values={"table": tuple(TABLES)},
    ),
    _s(
        "kvpush_table_capacity",
        "gauge",
        ("role", "table"),
        "The bound of a table of kvpush_table_entries, where it has one of its own (oldest "
        "entries forgotten, or new ones refused, past it).",
        values={"table": tuple(TABLES)},
    ),
    _s(
        "kvpush_peer_connect_seconds",
        "histogram",
        _R,
        "Time to make a NIXL connection to a peer engine (load its agent, prepare its "
        "descriptors), off the transfer pump: P's to a decode engine (transfers to it wait "
        "for it), D's to a prefill engine it pulls from (that pull's READs wait for it). Once "
        "per peer engine process (again when one restarts).",
    ),
    _s(
        "kvpush_peer_connect_failures",
        "counter",
        ("role", "reason"),
        "Connections to a peer engine that failed (error) or did not finish within "
        "transport.connect_timeout_s (timeout): on P the transfers waiting for it fell back "
        "to pull or failed, on D the pulls waiting for it failed (vLLM's "
        "kv_load_failure_policy); a connect that lands late is still used by later ones.",
        values={"reason": CONNECT_FAILURES},
        healthy=False,
    ),
)

SERIES_BY_NAME = {s.name: s for s in CONNECTOR_SERIES}


def exported_name(series: Series) -> str:
    """The name a scrape shows (counters gain ``_total``)."""
    return series.name + "_total" if series.kind == "counter" else series.name


def sample_names(series: Series) -> tuple[str, ...]:
    """Every sample name a scrape may show for ``series``."""
    if series.kind == "counter":
        return (series.name + "_total",)
    if series.kind == "histogram":
        return tuple(series.name + s for s in ("_bucket", "_sum", "_count"))
    return (series.name,)


TableSizes = dict[str, tuple[int, int | None]]
# Tables are measured at most this often (len() of each, under no lock the engine waits for).
TABLES_EVERY_S = 1.0


def set_tables(stats: StatsBuffer, role: str, tables: TableSizes) -> None:
    """Set kvpush_table_entries (and kvpush_table_capacity where bounded) for each table, under
    one take of the buffer's lock (the scheduler does it at every step's drain)."""
    gauges: dict[tuple[str, tuple[str, ...]], float] = {}
    for name, (entries, capacity) in tables.items():
        gauges["kvpush_table_entries", (role, name)] = float(entries)
        if capacity is not None:
            gauges["kvpush_table_capacity", (role, name)] = float(capacity)
    stats.set_many(gauges)


class StatsBuffer:
    """Thread-safe buffer of observations between two drains (counters as deltas).

    A gauge leaves with a drain only when its value differs from the one the last drain
    carried: gauges are set every engine step, and a snapshot that is never empty would be
    shipped worker -> engine core -> API server and recorded at every step for nothing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, tuple[str, ...]], float] = {}
        self._gauges: dict[tuple[str, tuple[str, ...]], float] = {}
        self._sent: dict[tuple[str, tuple[str, ...]], float] = {}
        self._hist: list[tuple[str, tuple[str, ...], float]] = []

    def inc(self, name: str, labels: tuple[str, ...], value: float = 1.0) -> None:
        with self._lock:
            key = (name, labels)
            self._counters[key] = self._counters.get(key, 0.0) + value

    def set(self, name: str, labels: tuple[str, ...], value: float) -> None:
        with self._lock:
            self._gauges[(name, labels)] = value

    def set_many(self, gauges: dict[tuple[str, tuple[str, ...]], float]) -> None:
        """Several gauges set at once: one take of the lock."""
        with self._lock:
            self._gauges.update(gauges)

    def observe(self, name: str, labels: tuple[str, ...], value: float) -> None:
        with self._lock:
            self._hist.append((name, labels, value))

    def gauge_values(self) -> dict[tuple[str, tuple[str, ...]], float]:
        """Every gauge's value as last set (whether or not a drain carried it)."""
        with self._lock:
            return {**self._sent, **self._gauges}

    def drain(self) -> dict[str, Any]:
        """A serialisable snapshot, emptied afterwards; ``{}`` when nothing happened."""
        with self._lock:
            data: dict[str, Any] = {}
            if self._counters:
                data["c"] = [[n, list(lb), v] for (n, lb), v in self._counters.items()]
            changed = [(k, v) for k, v in self._gauges.items() if self._sent.get(k) != v]
            if changed:
                data["g"] = [[n, list(lb), v] for (n, lb), v in changed]
                self._sent.update(changed)
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
    ``observe`` never raises: an observation for an unknown series, with the wrong number of
    labels or past ``MAX_LABEL_SETS`` label sets of its series is dropped and logged once.
    """

    def __init__(
        self,
        factory: Any,
        base_labels: list[str],
        per_engine_values: dict[int, list[object]],
        registry: Any = None,
    ) -> None:
        self._per_engine = per_engine_values
        self._metrics: dict[str, Any] = {}
        self._seen: dict[str, set[tuple[str, ...]]] = {}
        self._warned: set[tuple[str, str]] = set()
        for s in CONNECTOR_SERIES:
            cls = factory(s.kind)
            kwargs: dict[str, Any] = {"labelnames": [*base_labels, *s.labels]}
            if s.kind == "histogram":
                kwargs["buckets"] = list(s.buckets)
            if s.kind == "gauge":
                # Several API server processes (vLLM --api-server-count, the default with
                # --data-parallel-size) each write the gauges of the engines they hear
                # from: the latest write is the engine's state, as for vLLM's own gauges
                # (the default mode would keep each process's last value, stale ones too).
                kwargs["multiprocess_mode"] = "mostrecent"
            if registry is not None:
                kwargs["registry"] = registry
            self._metrics[s.name] = cls(s.name, s.doc, **kwargs)
            self._seen[s.name] = set()

    def _child(self, name: str, base: list[str], labels: Any) -> Any:
        series = SERIES_BY_NAME.get(name)
        if series is None:
            self._warn_once(name, "unknown", f"kvpush: no series named {name!r}; dropped")
            return None
        key = tuple(str(v) for v in labels)
        if len(key) != len(series.labels):
            self._warn_once(
                name, "arity", f"kvpush: {name} takes labels {series.labels}, got {key}; dropped"
            )
            return None
        seen = self._seen[name]
        if key not in seen:
            if len(seen) >= MAX_LABEL_SETS:
                self._warn_once(
                    name,
                    "cardinality",
                    f"kvpush: {name} reached {MAX_LABEL_SETS} "
                    f"label sets (new: {key}); a label is unbounded; dropped",
                )
                return None
            seen.add(key)
        return self._metrics[name].labels(*base, *key)

    def _warn_once(self, name: str, what: str, message: str) -> None:
        if (name, what) not in self._warned:
            self._warned.add((name, what))
            logger.warning(message)

    def observe(self, data: dict[str, Any], engine_idx: int = 0) -> None:
        base = [str(v) for v in self._per_engine.get(engine_idx, [])]
        for name, labels, value in data.get("c", ()):
            if value > 0 and (child := self._child(name, base, labels)) is not None:
                child.inc(value)
        for name, labels, value in data.get("g", ()):
            if (child := self._child(name, base, labels)) is not None:
                child.set(value)
        for name, labels, value in data.get("h", ()):
            if (child := self._child(name, base, labels)) is not None:
                child.observe(value)
