"""Worker-side half of the PushConnector (runs in each vLLM worker process, one per rank).

Owns this rank's NIXL agent and control endpoint, driven by one transfer pump thread: the
pump is the driver's ``Effects`` (the NIXL transport, the control socket, vLLM's results and
metrics), and the engine thread hands it typed commands for the core (Sender on P,
Receiver on D).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import queue
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec

from kvpush_prod.config import KvpushConfig, is_loopback
from kvpush_prod.config.core import (
    CoreSettings,
    core_settings,
    layerwise_on,
    slots_of,
    staging_blocks,
)
from kvpush_prod.connector.connects import CONNECT_THREADS, ConnectResult, Connects
from kvpush_prod.connector.layerwise import LayerStep, layer_parts
from kvpush_prod.connector.linkguard import LinkGuard
from kvpush_prod.connector.metadata import PushMetadata, RecvSpec, SendSpec
from kvpush_prod.control import ControlCodec, ControlEndpoint
from kvpush_prod.control.security import EndpointSecurity
from kvpush_prod.core import actions, blocksize, messages, protocol, tpmap
from kvpush_prod.core.admission import notice_command
from kvpush_prod.core.commands import (
    AbortReceive,
    AbortSend,
    BlocksReady,
    Command,
    ExpectBlocks,
    ForwardFailed,
    Hold,
    LayersReady,
    NotNeeded,
    RegisterBlocks,
)
from kvpush_prod.core.identity import agent_name
from kvpush_prod.core.links import MAX_REMEMBERED, Joins, Link, Links, Splits, d_links
from kvpush_prod.core.receiver import Receiver
from kvpush_prod.core.retry import BreakerState, ChunkError, ErrorKind
from kvpush_prod.core.sender import Sender
from kvpush_prod.core.staging import StagingPool
from kvpush_prod.core.vocabulary import (
    NoteKind,
    Notice,
    Outcome,
    ParamsRejectReason,
    RejectReason,
    Side,
)
from kvpush_prod.driver import DEFERRED, Deferred, Driver, Engine, Stage
from kvpush_prod.errors import ConfigError
from kvpush_prod.loglimit import LogLimiter
from kvpush_prod.metrics import TABLES_EVERY_S, StatsBuffer, TableSizes, set_tables
from kvpush_prod.otel import transfer_spans
from kvpush_prod.trace import Tracer
from kvpush_prod.transport.base import Op, RemotePeer, Transport, chunk_error
from kvpush_prod.transport.checksum import kv_crc32
from kvpush_prod.transport.faults import FaultyTransport, fault_settings
from kvpush_prod.transport.layout import Heads, head_slab, layout_from_kv_caches
from kvpush_prod.transport.nixl import (
    UCX_TCP_USER_TIMEOUT,
    NixlTransport,
    bound_tcp_delivery,
    make_agent,
)
from kvpush_prod.transport.staging import GatherArea, StagingArea

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_BREAKER_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
LOG_EVERY_S = 10.0  # at most one line per kind of rejection, fence or restart this often
MESSAGES_PER_PASS = 256  # a flood of control messages cannot hold the pump (and its lock)
# A pass handles control messages for at most this long under the lock (each key its fair
# share: ControlEndpoint.receive); the rest waits for the next pass. Reading and decoding
# happen before, without the lock (ControlEndpoint.fill).
PASS_BUDGET_S = 0.004
# After a pass cut at its budget, or a read that left messages on the socket (a burst, or a
# key flooding), the pump sleeps before the next, at least this long and as long as that
# read and pass took: the engine thread, if it waits for the lock, takes it (a released lock
# is not handed to a waiter: the pump would take it back first), and a flood costs the
# engine's core at most about half of it (measured on real engines: with a fixed 2 ms pause,
# 128 KiB heartbeats kept P's pump busy ~80% and a decode's largest gap at 48-64 ms).
PASS_GAP_S = 0.002
TICK_S = 0.05  # leases, deadlines and heartbeats are looked at this often
# While messages are left over (a pass cut short by its budget), timers wait for them: a
# renewal still queued must be read before a lease is judged over. At most this long, so a
# flood never stops the heartbeats.
TICK_DEFER_S = 0.5
# The shortest wait of the pump between two transport polls. NIXL 1.5.1's Python API has no
# completion or notification fd (check_xfer_state and get_new_notifs are polls), so a
# bounded wait is unavoidable while chunks are in flight; anything shorter was measured to
# busy a whole core on the engine's own CPU (poll(0) for a 100 us period).
MIN_WAIT_S = 0.001
# After handing over a push, the engine thread watches the chunks it posted for at most this
# long: NIXL/UCX completes a WRITE (frees the link for the next chunk, lets P release the
# blocks) only when the writer's side is progressed, and the pump's next poll is up to a
# period (plus a GIL switch interval) away: measured on loopback, post -> completion seen
# 1.38 ms p50 without the watch, 0.28-0.46 ms with it. Bounded, and only right after a post;
# P's pump takes over whatever is still in flight.
HANDOFF_WATCH_S = 0.001
# D: while the engine runs forwards (decodes), every step already polls the transport
# (``progress_now``), so the pump's own 1 ms polls only compete with the forward for the
# core and the GIL: measured on the bench (AVX-512 box), D's TPOT was 1.3-1.8x vLLM push's
# at concurrency 4-16 with them and 0.94-1.4x without. While a forward began within this
# long, the pump waits until this long after it. Steps without a forward (D idle, waiting
# only for KV) come every 1.5-5 ms here: then the pump keeps its 1 ms polls (measured: post
# -> DONE seen 0.9 ms p50 with them, 2.2 ms when it backed off for those steps too).
STEADY_STEP_S = 0.005
# D: the pump backs off for as long as D's forwards have lately taken (a moving average of
# forward began -> step ended, at least STEADY_STEP_S, at most MAX_FORWARD_BACKOFF_S): at 32
# layers a decode step takes 30-40 ms, and a fixed 5 ms back-off left ~30 polls per step
# competing with the forward for the GIL (measured: TPOT -12% at 2 req/s with 5 ms polls
# instead of 1; docs/benchmarks.md). The step's end is not signalled to the pump: a pass
# there, at every step, would take the GIL just as the next step is scheduled.
MAX_FORWARD_BACKOFF_S = 0.1
STEP_AVERAGE_WEIGHT = 0.2  # of the latest forward in the moving average
PUMP_THREAD_NAME = b"kvpush-pump"  # what ps, top -H and /proc/<pid>/task/<tid>/comm show
_PR_SET_NAME = 15


def name_os_thread(name: bytes) -> None:
    """Give the calling thread ``name`` in the OS (Linux; 15 bytes at most), so per-thread
    tools (top -H, /proc/<pid>/task/<tid>/comm) can find it. Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: only the name is lost
        logger.debug("kvpush: cannot name the pump thread", exc_info=True)


E = TypeVar("E", bound=Engine)


def endpoint_security(cfg: KvpushConfig) -> EndpointSecurity | None:
    """The CurveZMQ keys of this engine and its allow-list, or None without keys (loopback,
    or a network the operator declared trusted with control.insecure)."""
    c = cfg.control
    if not (c.key_file and c.allowed_keys):
        return None
    return EndpointSecurity.from_files(c.key_file, c.allowed_keys)


@dataclass
class _Results:
    """Completions the engine thread collects each step (filled by the pump thread)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    outcomes: dict[str, str] = field(default_factory=dict)  # request id -> how it was received

    def take(self) -> tuple[set[str], set[str], set[str]]:
        with self.lock:
            out = (self.sending, self.recving, self.failed)
            self.sending, self.recving, self.failed = set(), set(), set()
            return out

    def take_outcomes(self) -> dict[str, str]:
        with self.lock:
            out, self.outcomes = self.outcomes, {}
            return out


class WorkerSide:
    """Registers the KV cache with NIXL and runs the push protocol of this rank."""

    _gather: GatherArea | None = None  # P: the gather area (staging.send_mib)

    def __init__(
        self,
        cfg: KvpushConfig,
        role: Side,
        engine_id: str,
        tp_rank: int,
        tp_size: int,
        dp_index: int,
        signature: str,
        num_blocks: int,
        facts: dict[str, str] | None = None,
        otlp_endpoint: str | None = None,
        heads: Heads | None = None,
        recompute_on_failure: bool = False,
        block_bytes: int = 0,
    ) -> None:
        self.cfg = cfg
        # One block over every layer as vLLM sizes it (page size x layers): sizes the staging
        # area as the scheduler's credit budget does (``config.core.staging_blocks``).
        self.block_bytes = block_bytes
        # D: vLLM's kv_load_failure_policy is recompute (a failed receive is recomputed, and
        # counted so)
        self.recompute_on_failure = recompute_on_failure
        self.role = role
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.heads = heads or Heads(tp_size=tp_size, tp_rank=tp_rank)
        self.layout: messages.Layout | None = None
        self._refused_tp: set[int] = set()  # prefill TP sizes already logged as refused
        self.port = cfg.control.port + dp_index * tp_size + tp_rank
        self.signature = signature
        self.facts = facts or {}  # named for peers: a mismatch is reported value by value
        self.num_blocks = num_blocks
        self.incarnation = random.SystemRandom().getrandbits(62)
        self.stats = StatsBuffer()
        self.results = _Results()
        self._pending_sends: list[SendSpec] = []
        self.offered: PushMetadata | None = None  # D: the last step's plan the pump has
        self._device: str = "cpu"
        self._tx: SenderPump | None = None  # P
        self._rx: ReceiverPump | None = None  # D
        # P, layer-wise push (push.layerwise): layer name -> its part of a block ({}: off or
        # not possible on this cache), and the running forward's layers (engine thread only)
        self._layers: dict[str, int] = {}
        self._step: LayerStep | None = None
        self.trace = Tracer(f"kvpush-{role.value}", spans=transfer_spans(role.value, otlp_endpoint))

    @property
    def _pump(self) -> SenderPump | ReceiverPump | None:
        return self._tx or self._rx

    # ------------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()))
        self._device = first.device.type
        if self._device != "cpu" and self.cfg.verify.checksums:
            raise ConfigError(
                "verify.checksums reads KV blocks through host memory and cannot check a GPU "
                "KV cache; set verify.checksums: false on GPU engines"
            )
        layout = self.layout = layout_from_kv_caches(
            kv_caches, self.num_blocks, self.signature, self.facts, self.heads
        )
        staging = self._staging(layout)
        if staging is not None:
            layout = self.layout = staging.layout  # what P writes into and D reads into
        host = self.cfg.control.advertise_host or self.cfg.control.host
        control = f"tcp://{host}:{self.port}"
        security = endpoint_security(self.cfg)
        transport = self._transport(layout, control, security)
        me = messages.PeerInfo(
            engine_id=self.engine_id,
            incarnation=self.incarnation,
            rank=self.tp_rank,
            control=control,
            agent_name=transport.name,
            agent_meta=transport.metadata(),
            layout=layout,
        )
        block_bytes = sum(r.block_len for r in layout.regions)
        if self.role is Side.PRODUCER and self.cfg.push.layerwise != "off":
            self._layers = layer_parts(kv_caches, layout, self._device)
        settings = core_settings(self.cfg, block_bytes)
        pump = self._make_pump(me, layout, settings, transport, self._endpoint(security))
        if self._rx is not None:
            self._rx.staging = staging
        if self._tx is not None:
            self._tx.gather = self._gather
        pump.start()
        logger.info(
            "kvpush: %s rank %d of %d ready, control %s, %d KV regions, %d B per "
            "block, %d KV heads %s",
            self.role.value,
            self.tp_rank,
            self.tp_size,
            me.control,
            len(layout.regions),
            block_bytes,
            self.heads.local,
            "head-major" if layout.kv_heads else "(blocks not sliceable by head)",
        )

    def _staging(self, layout: messages.Layout) -> StagingArea | None:
        """D's receive area (``staging.receive_mib``), or None (off, or P)."""
        if self.role is not Side.CONSUMER or not self.cfg.staging.receive_mib:
            return None
        slots = staging_blocks(
            self.cfg, self.block_bytes or sum(r.block_len for r in layout.regions)
        )
        if not slots:
            return None
        if self._device != "cpu":
            raise ConfigError(
                f"staging.receive_mib={self.cfg.staging.receive_mib}: the receive area is for "
                "CPU KV caches only; set staging.receive_mib: 0 on GPU decode engines"
            )
        area = StagingArea(layout, slots)
        logger.info(
            "kvpush: receive area of %d blocks (%d MiB): pushes land there and are copied "
            "into the KV cache",
            slots,
            area.memory.nbytes >> 20,
        )
        return area

    def _make_pump(
        self,
        me: messages.PeerInfo,
        layout: messages.Layout,
        settings: CoreSettings,
        transport: Transport,
        endpoint: ControlEndpoint,
    ) -> SenderPump | ReceiverPump:
        """This rank's pump (not started): P's around a Sender, D's around a Receiver."""
        # Not seeded from anything a peer sees: generations must be unguessable.
        rng = random.SystemRandom()
        if self.role is Side.PRODUCER:
            self._tx = SenderPump(
                self.cfg,
                Sender(me, settings.sender, rng),
                transport,
                endpoint,
                self.results,
                self.stats,
                self.trace,
            )
            self._tx.splits = Splits(
                self.tp_rank, self.tp_size, layout.total_kv_heads, layout.replicated
            )
            return self._tx
        self._rx = ReceiverPump(
            self.cfg,
            Receiver(me, settings.receiver, rng, tokens=rng),
            transport,
            endpoint,
            self.results,
            self.stats,
            self.trace,
        )
        if self.recompute_on_failure:
            self._rx.failed_outcome = Outcome.RECOMPUTE
        return self._rx

    def _transport(
        self, layout: messages.Layout, control: str, security: EndpointSecurity | None
    ) -> Transport:
        """This rank's NIXL agent over ``layout`` (behind the fault injector if enabled)."""
        t = self.cfg.transport
        # The agent is named for this engine's identity (its key; without keys, its control
        # address), so no other engine can announce it.
        identity = security.keypair.public.decode() if security else control
        name = agent_name(f"kvpush-{self.engine_id}-r{self.tp_rank}-{self.incarnation:x}", identity)
        self._bound_tcp_delivery()
        agent = make_agent(name, t.backend, t.progress_thread, t.progress_delay_us, t.num_threads)
        self._gather = self._gather_area(layout)
        transport: Transport = NixlTransport(
            agent, layout, producer=self.role is Side.PRODUCER, gather=self._gather
        )
        faults = fault_settings(self.cfg.faults.model_dump())
        if faults.enabled:
            transport = FaultyTransport(transport, faults)
        return transport

    def _gather_area(self, layout: messages.Layout) -> GatherArea | None:
        """P's gather area (``staging.send_mib``), or None (off, or D)."""
        mib = self.cfg.staging.send_mib
        if self.role is not Side.PRODUCER or not mib:
            return None
        block_bytes = self.block_bytes or sum(r.block_len for r in layout.regions)
        slots = slots_of(mib, block_bytes, "staging.send_mib")
        if self._device != "cpu":
            raise ConfigError(
                f"staging.send_mib={mib}: the gather area is for CPU KV caches only; set "
                "staging.send_mib: 0 on GPU prefill engines"
            )
        logger.info(
            "kvpush: gather area of %d blocks (%d MiB): scattered blocks are copied together "
            "before a WRITE",
            slots,
            mib,
        )
        return GatherArea(layout, slots, self.cfg.leases.permit_ttl_s)

    def _bound_tcp_delivery(self) -> None:
        """No WRITE over UCX's TCP transport lands after D's permit ran out: data a
        partition holds longer than the permit less a heartbeat and the stop margin ends
        its connection instead (the chunk fails; retries or a fallback follow)."""
        leases = self.cfg.leases
        bound = leases.permit_ttl_s - leases.heartbeat_interval_s - leases.stop_margin_s
        value, ours = bound_tcp_delivery(max(0.5, bound))
        logger.info(
            "kvpush: UCX TCP data unacknowledged for %s ends its connection (%s=%s%s)",
            value,
            UCX_TCP_USER_TIMEOUT,
            value,
            ", from leases.permit_ttl_s - heartbeat_interval_s - stop_margin_s"
            if ours
            else ", as set in the environment",
        )

    def _endpoint(self, security: EndpointSecurity | None) -> ControlEndpoint:
        """This rank's control endpoint; an insecure one on a network address is said loudly."""
        endpoint = ControlEndpoint(
            ControlCodec(self.cfg.control.max_message_bytes),
            self.cfg.control.host,
            self.port,
            security=security,
            max_peers=self.cfg.control.max_peers,
        )
        insecure = security is None and not is_loopback(self.cfg.control.host)
        self.stats.set("kvpush_control_insecure", (self.role.value,), 1.0 if insecure else 0.0)
        if insecure:
            logger.error(
                "kvpush: INSECURE control channel on %s:%d (control.insecure: true): plaintext "
                "and unauthenticated, any host that reaches this port can make the engine write "
                "or free KV blocks. Give each engine keys (kvpush keys generate; docs/security.md)",
                self.cfg.control.host,
                self.port,
            )
        return endpoint

    # ------------------------------------------------------------------ per step
    def on_metadata(self, meta: PushMetadata) -> None:
        """Before the forward: the step's work for the pump, handed over in one piece (D's
        REGISTERs leave as soon as the pump's lock is free). Never waits for the pump."""
        if meta.forward and self._rx is not None:
            self._rx.forward_began()
        if meta.empty():
            return
        rx, tx = self._rx, self._tx
        if rx is not None:
            rx.offer(lambda: self._receive_plan(rx, meta), "the step's receive plan")
            self.offered = meta  # its receives are the pump's now (they run their course)
        if tx is not None:
            tx.offer(lambda: self._send_plan(tx, meta), "the step's send plan")
            self._pending_sends.extend(meta.send)

    def _send_plan(self, tx: SenderPump, meta: PushMetadata) -> None:
        """P, under the pump's lock: what the scheduler said of its transfers. A transfer
        split over several D ranks (see core.links) gets each command once per part; the
        facts are noted first, for parts made later."""
        command = tx.driver.command
        for tid, owner in meta.expect_send:
            known = tx.splits.note(tid)
            known.expected, known.owner = True, owner or known.owner
            for part in tx.splits.parts(tid):
                command(ExpectBlocks(part, owner))
        for tid in meta.abort_send:
            parts = tx.splits.parts(tid)
            tx.splits.forget(tid)
            for part in parts:
                command(AbortSend(part))
        for tid in meta.hold:
            tx.splits.note(tid).held = True
            for part in tx.splits.parts(tid):
                command(Hold(part))

    def _receive_plan(self, pump: ReceiverPump, meta: PushMetadata) -> None:
        """D, under the pump's lock: the step's waits, REGISTERs, notices and aborts. Each
        receive on its own: one that raises fails (it has no REGISTER, so nothing can land
        in its blocks) and never stops another."""
        command = pump.driver.command
        for ref, notice in meta.notices:
            # The admission's notices, per link: the core's own translation, nothing here.
            links = self._links(pump, ref.transfer_id, ref.p_tp)
            for link in links:
                command(
                    notice_command(
                        notice,
                        link.core_id,
                        self._address(ref.p_host, ref.p_port, link.p_rank),
                        ref.p_key,
                    )
                )
            if notice is Notice.NOT_NEEDED:
                self._tell_unfed(
                    pump,
                    ref.transfer_id,
                    ref.p_host,
                    ref.p_port,
                    ref.p_key,
                    ref.p_tp,
                    refused=not links,
                )
        for spec in meta.recv:
            try:
                self._receive(pump, spec)
            except Exception:  # noqa: BLE001 - contained, counted; this receive fails
                pump.contained(Stage.COMMAND, f"the receive of {spec.transfer_id[:64]}")
                if not any(
                    pump.request_of.get(i) == spec.request_id
                    for i in [spec.transfer_id, *pump.joins.parts(spec.transfer_id)]
                ):
                    self._fail_here(spec.request_id, pump)
        for tid in meta.abort_recv:
            for part in pump.joins.parts(tid):
                command(AbortReceive(part))

    def _receive(self, pump: ReceiverPump, spec: RecvSpec) -> None:
        """One receive: its links (parts when P's TP size differs), then its REGISTERs."""
        self.trace(
            "recv_spec",
            spec.transfer_id,
            blocks=len(spec.block_ids),
            trace_headers=spec.trace_headers,
        )
        links = self._links(pump, spec.transfer_id, spec.p_tp)
        try:
            views = [self._view(link) for link in links]
        except ConfigError:  # our blocks cannot be sliced by head (the log says why)
            links = []
        if not links:
            self._refuse_receive(pump, spec)
            return
        if self._taken(pump, spec, [link.core_id for link in links]):
            return
        block_ids = self._stage(pump, spec)
        if block_ids is None:
            return
        if len(links) > 1:
            pump.joins.split(spec.transfer_id, [lk.core_id for lk in links])
        for link, view in zip(links, views, strict=True):
            pump.links.add(link)
            pump.request_of[link.core_id] = spec.request_id
            pump.recv_blocks[link.core_id] = list(block_ids)
            pump.views[link.core_id] = view
            pump.began[link.core_id] = time.monotonic()
        for link in links:
            pump.driver.command(
                RegisterBlocks(
                    link.core_id,
                    self._address(spec.p_host, spec.p_port, link.p_rank),
                    tuple(block_ids),
                    spec.first_block,
                    spec.num_tokens,
                    spec.p_key,
                    spec.prompt,
                )
            )
        self._tell_unfed(pump, spec.transfer_id, spec.p_host, spec.p_port, spec.p_key, spec.p_tp)

    def _stage(self, pump: ReceiverPump, spec: RecvSpec) -> list[int] | None:
        """The ids P writes into for ``spec``: its blocks, or its slots of the staging area;
        None when the area has no room (the receive then fails here, said and counted; the
        credit budget, capped at the area, keeps that from happening)."""
        if pump.staging is None:
            return list(spec.block_ids)
        slots = pump.staging.stage(spec.request_id, spec.block_ids)
        if slots is not None:
            return slots
        self._tell_unfed(
            pump, spec.transfer_id, spec.p_host, spec.p_port, spec.p_key, spec.p_tp, refused=True
        )
        free, held = pump.staging.pool.free, pump.staging.pool.held
        logger.error(
            "kvpush: no room in the receive area for %s (%d blocks; %d free, %d held): its "
            "receive fails; raise staging.receive_mib",
            spec.transfer_id[:64],
            len(spec.block_ids),
            free,
            held,
        )
        self.stats.inc("kvpush_staging_refused", (self.role.value,))
        self._fail_here(spec.request_id, pump)
        return None

    def _fail_here(self, rid: str, pump: ReceiverPump) -> None:
        """The receive of request ``rid`` fails here: no REGISTER left for it, so nothing can
        land in its blocks (vLLM's kv_load_failure_policy applies). Counted first: see
        ``_count_end``."""
        if pump.staging is not None:
            pump.staging.drop(rid)
        self._count_failed(pump)
        with self.results.lock:
            self.results.recving.add(rid)
            self.results.failed.add(rid)
            self.results.outcomes[rid] = Outcome.FAILED.value

    def _taken(self, pump: ReceiverPump, spec: RecvSpec, ids: list[str]) -> bool:
        """Another live request receives ``spec``'s transfer id already (the scheduler side
        refuses that first; this is the worker's own guard): this receive fails here, and
        nothing of the other's changes (no REGISTER, no notice to P)."""
        holders = {pump.request_of.get(i) for i in ids} - {None, spec.request_id}
        if not holders:
            return False
        logger.error(
            "kvpush: request %s names transfer %.60r, which request %s receives; its receive fails",
            spec.request_id,
            spec.transfer_id,
            holders.pop(),
        )
        self.stats.inc(
            "kvpush_kv_params_rejected", (self.role.value, ParamsRejectReason.DUPLICATE_TRANSFER)
        )
        self._fail_here(spec.request_id, pump)
        return True

    def _links(self, pump: ReceiverPump, tid: str, p_tp: int) -> list[Link]:
        """The sub-transfers of ``tid`` on this D rank (one, the transfer itself, when P
        runs our tensor-parallel size); none when P's size cannot be mapped onto ours."""
        layout = self.layout
        if layout is None:
            return [Link(tid, tid, self.tp_rank)]
        try:
            links = d_links(
                tid, self.tp_rank, self.tp_size, p_tp, layout.total_kv_heads, layout.replicated
            )
        except ValueError:
            return []
        if len(links) > 1 or links[0].core_id != tid or links[0].p_rank != self.tp_rank:
            pump.log_mapping(p_tp, layout)
        return links

    def _view(self, link: Link) -> list[messages.Region] | None:
        """The part of each of our blocks ``link`` fills (None: the whole block)."""
        if not link.heads or self.layout is None:
            return None
        return list(head_slab(self.layout, link.d_first, link.heads, self.layout.kv_heads).regions)

    def _tell_unfed(
        self,
        pump: ReceiverPump,
        tid: str,
        host: str,
        port: int,
        key: str,
        p_tp: int,
        refused: bool = False,
    ) -> None:
        """Tell the P ranks that hold ``tid``'s blocks but will get no REGISTER from any D
        rank (``tpmap.unfed_told_by``) that they may free them now, not when their send
        lease ends."""
        layout = self.layout
        if layout is None and not refused:
            return  # no layout, no mapping: each rank pairs with its own P rank
        total, replicated = (layout.total_kv_heads, layout.replicated) if layout else (0, False)
        for p_rank in tpmap.unfed_told_by(
            self.tp_rank, p_tp, self.tp_size, total, replicated, refused
        ):
            pump.driver.command(NotNeeded(tid, self._address(host, port, p_rank), key))

    def _refuse_receive(self, pump: ReceiverPump, spec: RecvSpec) -> None:
        """P's tensor-parallel size cannot be mapped onto ours: the request fails here at
        once (recomputed or failed by kv_load_failure_policy), said and counted, and the P
        ranks are told they may free its blocks now (not when their send lease runs out)."""
        rid, tid, p_tp = spec.request_id, spec.transfer_id, spec.p_tp
        self._tell_unfed(pump, tid, spec.p_host, spec.p_port, spec.p_key, p_tp, refused=True)
        layout = self.layout
        total = layout.total_kv_heads if layout is not None else 0
        why = tpmap.problem(
            p_tp, self.tp_size, total, layout.replicated if layout is not None else False
        ) or (
            "this engine's KV cache blocks are not stored head after head (kv_cache_layout), "
            "so a part of each block cannot be filled from another rank; use the same "
            "tensor-parallel size on both"
        )
        if p_tp not in self._refused_tp:
            self._refused_tp.add(p_tp)
            logger.error(
                "kvpush: cannot receive KV from a prefill engine of tensor-parallel "
                "size %d on this decode engine of size %d: %s",
                p_tp,
                self.tp_size,
                why,
            )
        self.stats.inc(
            "kvpush_control_messages_rejected", (self.role.value, RejectReason.INCOMPATIBLE)
        )
        self._fail_here(rid, pump)
        self.trace("refused", tid, p_tp=p_tp)

    def _count_failed(self, pump: ReceiverPump) -> None:
        """A receive this rank ends here without the core: counted as the core's would be."""
        self.stats.inc("kvpush_transfers", (self.role.value, pump.failed_outcome.value))

    def _address(self, host: str, port: int, p_rank: int | None = None) -> str:
        return f"tcp://{host}:{port + (self.tp_rank if p_rank is None else p_rank)}"

    def layer_saved(self, layer_name: str) -> None:
        """P, engine thread, after each attention layer's forward: with a layer-wise push,
        the layers computed from the first are handed to the pump (never waited for)."""
        pump = self._tx
        if pump is None or not self._layers or not self._pending_sends:
            return
        step = self._step
        if step is None:
            p = self.cfg.push
            bandwidth = (
                pump.link_bandwidth or pump.engine.sched.settings.initial_bandwidth_bytes_per_s
            )
            on = layerwise_on(
                p.layerwise,
                sum(len(s.block_ids) for s in self._pending_sends),
                pump.block_bytes,
                self.heads.block_size or 16,
                bandwidth,
                p.layerwise_min_tokens,
                p.layerwise_min_transfer_ms,
            )
            step = self._step = LayerStep(list(self._pending_sends), on)
            pump.forward_running = on
        index = self._layers.get(layer_name)
        if not step.on or index is None:
            return
        ready = step.saved(index)
        if ready:
            sends, parts = step.sends, len(self._layers)
            pump.offer(lambda: self._layers_ready(pump, sends, ready, parts), "layers ready")

    def _layers_ready(
        self, pump: SenderPump, sends: list[SendSpec], ready: int, parts: int
    ) -> None:
        """Under the pump's lock: the first ``ready`` layers of ``sends`` are computed."""
        command = pump.driver.command
        for spec in sends:
            tid = spec.transfer_id
            if pump.request_of.setdefault(tid, spec.request_id) != spec.request_id:
                continue  # another request's transfer id: the hand-over refuses it
            known = pump.splits.note(tid)
            known.expected, known.owner = True, spec.owner or known.owner
            known.layer_blocks, known.prompt = tuple(spec.block_ids), spec.prompt
            known.layers, known.parts = ready, parts
            if ready == 1 or ready == parts:
                self.trace(
                    "layers_ready",
                    tid,
                    ready=ready,
                    parts=parts,
                    blocks=len(spec.block_ids),
                    trace_headers=spec.trace_headers,
                )
            for part in pump.splits.parts(tid):
                command(
                    LayersReady(part, tuple(spec.block_ids), ready, parts, spec.owner, spec.prompt)
                )

    def after_forward(self, forward_failed: bool = False) -> None:
        """P: this step's prompts are computed; hand their blocks to the pump. With
        ``forward_failed`` the forward raised: the blocks hold no usable KV and D is told."""
        pump = self._tx
        if self._step is not None and pump is not None:
            if self._step.on and self.trace.on:
                # On this (engine) thread: a layer-wise push's pushes before it overlapped
                # the forward (spans: ``forward_end``).
                for spec in self._step.sends:
                    self.trace("forward_end", spec.transfer_id, trace_headers=spec.trace_headers)
            self._step, pump.forward_running = None, False
        if not self._pending_sends or pump is None:
            return
        sends, self._pending_sends = self._pending_sends, []
        if not forward_failed and self._device == "cuda":
            import torch

            torch.cuda.current_stream().synchronize()  # KV must be in memory before a WRITE
        # Posted at once when the pump's lock is free (the hot path: no thread hop), else by
        # the pump's next pass; this thread never waits for it.
        pump.offer(
            lambda: self._hand_over(pump, sends, forward_failed), "the push hand-over", now=True
        )

    def _hand_over(self, pump: SenderPump, sends: list[SendSpec], forward_failed: bool) -> None:
        """Under the pump's lock: this step's prompts to the core. Whatever raises, no push of
        these is left without an end: the core hears that their forward failed (D
        recomputes) and releases their blocks once held."""
        handed: set[str] = set()
        try:
            self._hand_over_each(pump, sends, forward_failed, handed)
        except Exception:
            pump.contained(Stage.COMMAND, "the push hand-over")
            for spec in sends:
                if spec.transfer_id not in handed:
                    with contextlib.suppress(Exception):
                        pump.driver.command(ForwardFailed(spec.transfer_id, tuple(spec.block_ids)))

    def _hand_over_each(
        self, pump: SenderPump, sends: list[SendSpec], forward_failed: bool, handed: set[str]
    ) -> None:
        parts: dict[str, list[str]] = {}
        for spec in list(sends):
            holder = pump.request_of.get(spec.transfer_id)
            if holder is not None and holder != spec.request_id:
                # The scheduler side refuses a repeated transfer id first; never let one
                # request's push take another's place: this one is not pushed.
                logger.error(
                    "kvpush: request %s names transfer %.60r, which request %s "
                    "pushes; it is not pushed",
                    spec.request_id,
                    spec.transfer_id,
                    holder,
                )
                sends.remove(spec)
                handed.add(spec.transfer_id)
                self.stats.inc("kvpush_transfers", (self.role.value, Outcome.FAILED.value))
                with self.results.lock:
                    self.results.sending.add(spec.request_id)
                continue
            pump.request_of[spec.transfer_id] = spec.request_id
            known = pump.splits.note(spec.transfer_id)
            known.expected, known.owner = True, spec.owner or known.owner
            if forward_failed:
                known.failed = True
            known.blocks, known.prompt = tuple(spec.block_ids), spec.prompt
            parts[spec.transfer_id] = pump.splits.parts(spec.transfer_id)
        if forward_failed:
            logger.warning(
                "kvpush: the forward raised; %d prompt(s) of this step are not "
                "pushed and their decode engines are told",
                len(sends),
            )
        for spec in sends:
            self.trace(
                "forward_failed" if forward_failed else "blocks_ready",
                spec.transfer_id,
                blocks=len(spec.block_ids),
                trace_headers=spec.trace_headers,
            )
            handed.add(spec.transfer_id)
            for part in parts[spec.transfer_id]:
                pump.driver.command(
                    ForwardFailed(part, tuple(spec.block_ids))
                    if forward_failed
                    else BlocksReady(part, tuple(spec.block_ids), spec.owner, spec.prompt)
                )

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        """Completions since the last step. Looks at the transport first (one cheap poll), so
        a DONE or a chunk's completion that arrived since the pump's last look is reported at
        this step, not one pump period later."""
        pump = self._pump
        if pump is not None:
            pump.progress_now()
            if self._rx is not None:
                self._rx.step_ended()
        sending, recving, failed = self.results.take()
        if self.trace.on and (sending or recving):
            self.trace("taken", sending=sorted(sending), recving=sorted(recving))
        return sending, recving, failed

    def take_outcomes(self) -> dict[str, str]:
        return self.results.take_outcomes()

    def get_stats(self) -> dict[str, Any]:
        pump = self._pump
        if pump is not None:
            # Read at drain time, so the step that reports the last completion also
            # reports nothing in flight (a stale value would stick while the engine idles).
            self.stats.set("kvpush_inflight_bytes", (self.role.value,), pump.inflight_bytes)
            pump.tables_at_drain()
        return self.stats.drain()

    def shutdown(self) -> None:
        pump = self._pump
        if pump is not None:
            pump.stop()
            self._tx = self._rx = None
        if self.trace.spans is not None:
            self.trace.spans.close()


@dataclass
class ForwardPace:
    """D: when the engine last began a step with a forward, and a moving average of how
    long a forward takes (began -> its step's end): how long the pump stays quiet."""

    last: float = 0.0  # when the last forward began
    running: bool = False  # it began and its step has not ended yet
    average_s: float = 0.0  # 0: none measured yet

    def began(self, now: float) -> None:
        self.last, self.running = now, True

    def ended(self, now: float) -> None:
        if self.running:
            self.running = False
            w = STEP_AVERAGE_WEIGHT if self.average_s else 1.0
            self.average_s += w * (now - self.last - self.average_s)

    def quiet_left(self, now: float) -> float:
        """How much longer the pump stays quiet after the last forward began (<= 0: none):
        the average forward, at least ``STEADY_STEP_S``, at most ``MAX_FORWARD_BACKOFF_S``."""
        backoff = min(MAX_FORWARD_BACKOFF_S, max(STEADY_STEP_S, self.average_s))
        return backoff - (now - self.last)


class TransferPump(threading.Thread, Generic[E]):
    """The one thread that touches NIXL and the control sockets, and the driver's Effects.

    Blocks on the control socket and its wake pipe while idle (no CPU spent), waking at
    least every ``transport.idle_poll_ms`` for timers; while chunks or receives are in
    flight, polls the transport every ``transport.active_poll_ms`` (never less than
    ``MIN_WAIT_S``: NIXL offers no fd to block on). The engine thread also looks at
    completions where it already holds the lock (``run_now``) and once per step
    (``progress_now``), so the step that can use a DONE gets it.
    """

    side: Side
    # Peers are connected on connect threads (``Connects``), not on the pump: loading an
    # agent and preparing descriptors for its whole KV cache takes long for a large cache,
    # and every other transfer would wait for the pump meanwhile (P connects to each D it
    # pushes to, D to each P it pulls from).
    connect_threads = CONNECT_THREADS  # 0: run each in ``Connects.start`` (tests step by hand)
    staging: StagingArea | None = None  # D: the staging area (staging.receive_mib), set at start

    def __init__(
        self,
        cfg: KvpushConfig,
        engine: E,
        transport: Transport,
        endpoint: ControlEndpoint,
        results: _Results,
        stats: StatsBuffer,
        trace: Tracer | None = None,
    ) -> None:
        super().__init__(name=f"kvpush-pump-{self.side.value}", daemon=True)
        self.cfg = cfg
        self.role = self.side.value
        self.engine = engine
        self.driver: Driver[E, RemotePeer] = Driver(engine, self)
        self.transport = transport
        self.endpoint = endpoint
        self.results = results
        self.stats = stats
        self.link_guard = LinkGuard.from_config(cfg)  # None without links.expected_gbps
        self.trace = trace or Tracer("")
        self.request_of: dict[str, str] = {}  # transfer id -> vLLM request id (engine thread adds)
        self.recv_blocks: dict[str, list[int]] = {}  # D: transfer id -> its blocks
        # Sub-transfers across tensor-parallel sizes (core.links): changed under ``lock`` by
        # the work the engine thread offers.
        self.joins = Joins()  # D: a request's parts, one per P rank feeding this rank
        self.links = Links()  # D: core ids <-> wire ids
        self.views: dict[str, list[messages.Region] | None] = {}  # D: part -> slab it fills
        self.splits = Splits(0, 1, 0)  # P: parts per D rank fed (set at registration)
        self._peer_label: dict[str, str] = {}  # agent name -> "engine/rank" (bounded label)
        self._peer_control: dict[str, str] = {}  # agent name -> its control address
        # Work the engine thread handed over (``offer``), run in order under ``lock``.
        self._offered: queue.SimpleQueue[tuple[Callable[[], None], str]] = queue.SimpleQueue()
        self._halt = threading.Event()
        # Held for every use of the core, NIXL and the sending sockets and of the shell's
        # tables above: by the pump, and by the engine thread only when it finds it free
        # (``offer(now=True)``, ``progress_now``): the engine thread never waits for it.
        self.lock = threading.Lock()
        self._handles: dict[int, tuple[Any, float, int, str]] = {}  # chunk -> (handle, t, n, tid)
        self.inflight_bytes = 0  # read by the engine thread (an int: atomic to read)
        self.began: dict[str, float] = {}  # transfer id -> start (P: first post, D: REGISTER)
        # How a receive that failed is counted (D: recompute under vLLM's recompute policy)
        self.failed_outcome = Outcome.FAILED
        self._tables_at = -TABLES_EVERY_S  # when the tables were last measured
        self._labels = (self.role,)
        self._verify = cfg.verify.checksums
        self.block_bytes = self._block_bytes = sum(r.block_len for r in transport.layout.regions)
        # P, layer-wise push: set by the engine thread while a layer-wise forward runs (a
        # WRITE counted ``during_forward``); the slowest link's bandwidth as whole pushes
        # measured it, for push.layerwise auto (0: no link yet)
        self.forward_running = False
        self.link_bandwidth = 0.0
        self._chunk_timeout = cfg.push.chunk_timeout_s
        self._last_tick = 0.0
        self._forwards = ForwardPace()  # D: when forwards begin and how long they take
        self._reported_rejects: dict[str, int] = {}
        self._reported_fallbacks: dict[str, int] = {}
        self._log = LogLimiter(logger, LOG_EVERY_S)  # lines whose number peers choose
        self._mappings_logged: set[tuple[int, int]] = set()  # (P's TP, D's TP)
        self.connects = self._connects(cfg, endpoint)

    def _connects(self, cfg: KvpushConfig, endpoint: ControlEndpoint) -> Connects[RemotePeer]:
        """The connect threads, which wake the pump when a connect ends."""
        return Connects(
            self._connect_now,
            endpoint.wake,
            self.now,
            cfg.transport.connect_timeout_s,
            self.connect_threads,
        )

    def log_mapping(self, other_tp: int, layout: messages.Layout) -> None:
        """Say once per pair of sizes how heads map across tensor-parallel ranks."""
        key = (
            (other_tp, layout.tp_size) if self.side is Side.CONSUMER else (layout.tp_size, other_tp)
        )  # (P's TP, D's TP)
        if key in self._mappings_logged:
            return
        self._mappings_logged.add(key)
        # A warning so that it shows with vLLM's default logging (kvpush's info lines do
        # not): an operator should see once that the two sides' ranks are mapped by heads.
        logger.warning(
            "kvpush: tensor-parallel sizes differ, KV heads mapped (this is rank %d): %s",
            layout.tp_rank,
            tpmap.mapping_text(key[0], key[1], max(layout.total_kv_heads, 1), layout.replicated),
        )

    # -- engine thread API: it hands work over and reads results; it never waits for the
    # lock the pump holds
    def offer(self, work: Callable[[], None], what: str, now: bool = False) -> None:
        """Hand ``work`` (a change to the pump's state and the core commands that go with
        it) to whoever holds the pump's lock next, in the order offered. With ``now`` the
        calling thread runs it at once if the lock is free (a push posted without waiting
        for the pump to be scheduled, then watched for ``HANDOFF_WATCH_S``); it never waits
        for the lock: if the pump holds it, the pump's next pass runs the work."""
        self._offered.put((work, what))
        if now and self.lock.acquire(blocking=False):
            try:
                self._run_offered()
                self._watch_handoff()
            except Exception:  # noqa: BLE001 - never break the engine's step
                self.contained(Stage.COMMAND, what)
            finally:
                self.lock.release()
        self.endpoint.wake()  # the pump runs what is left, and polls for what was posted

    def submit(self, command: Command[E]) -> None:
        """Hand a core command to the pump (``offer``)."""
        self.offer(lambda: self.driver.command(command), type(command).__name__)

    def run_now(self, command: Command[E]) -> None:
        """A core command run at once when the pump's lock is free (``offer(now=True)``)."""
        self.offer(lambda: self.driver.command(command), type(command).__name__, now=True)

    def _run_offered(self) -> None:
        """Under the lock: the work offered so far, in order, each on its own."""
        while True:
            try:
                work, what = self._offered.get_nowait()
            except queue.Empty:
                return
            try:
                work()
            except Exception:  # noqa: BLE001 - contained, counted, logged
                self.contained(Stage.COMMAND, what)

    def _watch_handoff(self) -> None:
        """Progress the chunks just posted until they complete or ``HANDOFF_WATCH_S`` ends."""
        deadline = time.monotonic() + HANDOFF_WATCH_S
        while self._handles:
            self._check_chunks()
            if time.monotonic() >= deadline:
                return

    def progress_now(self) -> None:
        """Engine thread, once per step: completions and notifications now (one transport
        poll under the lock), so the step that can use a result gets it without the pump
        having to poll fast."""
        if not (self._handles or self._watching()):
            return
        if not self.lock.acquire(blocking=False):
            return  # the pump is at work: it polls the transport itself
        try:
            if self._handles:
                self._check_chunks()
            self._progress()
            if self.engine.busy:
                self.driver.poll()
        except Exception:  # noqa: BLE001 - never break the engine's step
            self.contained(Stage.COMPLETION, "the engine thread's look at completions")
        finally:
            self.lock.release()

    def stop(self) -> None:
        self._halt.set()
        self.endpoint.wake()
        self.join(timeout=5)
        self.connects.close()
        self.endpoint.close()
        self.transport.close()

    # -- the loop
    def run(self) -> None:
        name_os_thread(PUMP_THREAD_NAME)
        active_poll = max(MIN_WAIT_S, self.cfg.transport.active_poll_ms / 1e3)
        idle_poll = max(active_poll, self.cfg.transport.idle_poll_ms / 1e3)
        # Reads and decodes waiting messages without the lock (a test's endpoint may not).
        fill = getattr(self.endpoint, "fill", None)
        pause = 0.0
        while not self._halt.is_set():
            try:
                if pause:
                    self._halt.wait(pause)  # the engine thread's turn (see PASS_GAP_S)
                readable = self.endpoint.wait(self._period(active_poll, idle_poll))
                began = self.now()
                more = bool(fill()) if readable and fill is not None else False
                with self.lock:
                    cut = self._pass(readable)
                pause = max(PASS_GAP_S, self.now() - began) if more or cut else 0.0
            except Exception:  # noqa: BLE001 - the pump must survive to keep leases honest
                pause = 0.0
                self.contained(Stage.TIMER, "the pass")
                time.sleep(0.01)

    def _period(self, active_poll: float, idle_poll: float) -> float:
        """How long the pump may sleep on the control socket before its next pass."""
        if not self._busy():
            return idle_poll
        left = self._forwards.quiet_left(time.monotonic())
        return max(active_poll, left) if left > 0 else active_poll

    def forward_began(self) -> None:
        """Engine thread (D): a step with a forward begins; its ``get_finished`` polls the
        transport for our READs and DONEs, so the pump backs off for as long as forwards
        have lately taken (at least ``STEADY_STEP_S``, at most ``MAX_FORWARD_BACKOFF_S``)."""
        self._forwards.began(time.monotonic())

    def step_ended(self) -> None:
        """Engine thread (D), at the end of each step (``get_finished``): the length of a
        forward that ran joins the moving average (the pump is not woken)."""
        self._forwards.ended(time.monotonic())

    def _busy(self) -> bool:
        """Chunks in flight or queued, or receives waiting: poll at the active rate.

        Receives count: with UCX a WRITE into this engine completes, and its DONE arrives,
        only as fast as this side is progressed too (measured on loopback: D progressed
        only at vLLM's steps, ~1.6 ms apart, saw each DONE 1.6-5 ms after P's post instead
        of 0.02 ms).
        """
        return bool(self._handles) or self.engine.busy or self._watching()

    def _watching(self) -> bool:
        """Something only a transport poll can tell (beyond our own chunks) is awaited."""
        return False

    def _pass(self, readable: bool) -> bool:
        """One round of the loop: messages, commands, completions, scheduling, timers.

        Messages for at most ``PASS_BUDGET_S`` (by ``now``); True when the budget cut them
        short with messages left: the caller gives the engine thread its turn first.
        """
        cut = False
        if readable:
            deadline = self.now() + PASS_BUDGET_S
            inbox = self.endpoint.receive(MESSAGES_PER_PASS)
            try:
                for msg, origin in inbox:
                    # Each message on its own: one that raises never drops or delays another.
                    try:
                        if self.trace.on:
                            self.trace(
                                "msg_in", getattr(msg, "transfer_id", ""), kind=type(msg).__name__
                            )
                        msg = self._inbound(msg)
                    except Exception:  # noqa: BLE001 - contained, counted, logged
                        self.contained(Stage.MESSAGE, type(msg).__name__)
                    else:
                        self.driver.message(msg, origin)
                    if self.now() >= deadline:
                        cut = bool(getattr(self.endpoint, "pending", True))
                        break
            finally:
                inbox.close()  # what was not taken stays with the endpoint for the next pass
        self._run_offered()
        self._connections()
        if self._handles:
            self._check_chunks()
        self._progress()
        now = self.now()
        if self.engine.busy:
            self.driver.poll()
        since = now - self._last_tick
        if since >= TICK_S and (not cut or since >= TICK_DEFER_S):
            self._last_tick = now
            self.driver.tick()
            self._report_gauges(now)
            if not self.cfg.transport.progress_thread:
                # A light pass for connection wire-up and keep-alives while nothing is active.
                self._light_pass()
        return cut

    def _progress(self) -> None:
        """Progress the transport for what the engine has in flight."""

    def _inbound(self, msg: messages.ControlMessage) -> messages.ControlMessage:
        """A message as the core should see it (sub-transfers across TP sizes)."""
        return msg

    def _light_pass(self) -> None:
        if not self._handles:
            self.transport.notifications()

    # -- Effects: the driver's hands
    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def send(self, peer: str, to: str, message: messages.ControlMessage) -> None:
        self.endpoint.send(peer, message, to)
        if self.trace.on:
            self.trace("msg_out", getattr(message, "transfer_id", ""), kind=type(message).__name__)

    def connect(self, info: messages.PeerInfo) -> RemotePeer | None | Deferred:
        self._peer_label[info.agent_name] = f"{info.engine_id}/r{info.rank}"
        self._peer_control[info.agent_name] = info.control
        if info.layout is None:
            return None
        mine = self.transport.layout
        if info.layout.tp_size != mine.tp_size:
            self.log_mapping(info.layout.tp_size, mine)
        self.connects.start(info)  # ``_connections`` hands the driver its result
        return DEFERRED

    def _connect_now(self, info: messages.PeerInfo) -> RemotePeer:
        """Connect to ``info``'s agent (on a connect thread, or inline in stepped tests)."""
        assert info.layout is not None
        return self.transport.connect(info.agent_meta, info.layout, info.agent_name)

    def _connections(self) -> None:
        """Connects that ended on the connect threads, or ran past their bound: counted,
        logged, and handed to the driver (the transfers waiting for them go on or give up)."""
        if not len(self.connects):
            return
        for result in self.connects.results():
            self._connected(result)
            if result.late and result.peer is None:
                continue  # already reported as timed out: nothing new for the engine
            self.driver.connected(result.agent, result.peer, result.problem)

    def _connected(self, result: ConnectResult[RemotePeer]) -> None:
        """Count and log how a connect ended (or that it is past its bound)."""
        who = self._peer_label.get(result.agent, "?")
        if not result.timed_out:
            self.stats.observe("kvpush_peer_connect_seconds", self._labels, result.seconds)
        if result.peer is not None:
            level = logging.WARNING if result.late else logging.INFO
            logger.log(
                level,
                "kvpush: connected to %s (%s) in %.2f s%s",
                result.agent[:64],
                who,
                result.seconds,
                " (after its timeout: later transfers use it)" if result.late else "",
            )
            return
        if result.late:
            return  # counted when it timed out
        reason = "timeout" if result.timed_out else "error"
        self.stats.inc("kvpush_peer_connect_failures", (self.role, reason))
        self._log.log(
            logging.ERROR,
            "connect",
            "kvpush: cannot connect to %s (%s): %s; the transfers waiting for it fall back",
            result.agent[:64],
            who,
            result.problem,
        )

    def disconnect(self, agent: str) -> None:
        if self.connects.pending(agent):
            # Its connect thread is still at it: the driver undoes the connection it makes
            # when it lands (the transport must not drop a peer while adding it).
            return
        self.transport.disconnect(agent)
        self._peer_label.pop(agent, None)
        self._peer_control.pop(agent, None)

    def write(self, action: actions.PostWrite, peer: RemotePeer) -> ChunkError | None:
        regions = peer.local.regions if peer.local is not None else None
        if action.layerwise:
            self.stats.inc(
                "kvpush_layerwise_writes",
                (self.role, "during_forward" if self.forward_running else "after_forward"),
            )
        return self._post(
            action.chunk_id,
            action.transfer_id,
            "WRITE",
            peer,
            action.src_blocks,
            action.dst_blocks,
            self._done_notif(action, regions, peer.local_k if peer.unit_tokens else 0),
            action.regions,
            action.part if action.layerwise else None,  # a layer-wise WRITE: one layer's
        )

    def read(self, action: actions.PostRead, peer: RemotePeer) -> ChunkError | None:
        return self._post(
            action.chunk_id,
            action.transfer_id,
            "READ",
            peer,
            action.local_blocks,
            action.remote_blocks,
            b"",
        )

    def post_failed(self, action: actions.PostWrite | actions.PostRead, error: ChunkError) -> None:
        self.began.setdefault(action.transfer_id, time.monotonic())
        logger.warning(
            "kvpush: %s for %s failed to post: %s", type(action).__name__, action.transfer_id, error
        )
        self.stats.inc("kvpush_chunks", (self.role, "post_failed"))

    def release_send(self, action: actions.ReleaseSend) -> None:
        tid = action.transfer_id
        self.trace("release", tid, outcome=action.outcome.value)
        join = self.splits.end(tid, action.outcome.delivered, action.outcome, action.nbytes)
        if join is None:
            self.began.pop(tid, None)
            return  # other D ranks of this transfer are still fed from these blocks
        rid = self.request_of.pop(join.base, None)
        if rid is None:
            logger.error("kvpush: release of unknown transfer %s", tid)
            return
        self._count_end(
            join.base if join.base in self.began else tid,
            join.outcome or action.outcome,
            join.nbytes,
        )
        with self.results.lock:
            self.results.sending.add(rid)

    def report_finished(self, action: actions.ReportFinished) -> None:
        ok = True
        if action.checksum >= 0 and action.blocks:
            # Pulled: the ids read (units when block sizes differ), in P's order.
            ok = (
                self._checksum(
                    list(action.blocks), self.views.get(action.transfer_id), action.units
                )
                == action.checksum
            )
            if not ok:
                logger.error("kvpush: checksum mismatch on pulled %s", action.transfer_id)
                self.stats.inc(
                    "kvpush_control_messages_rejected", (self.role, RejectReason.CHECKSUM_MISMATCH)
                )
        self._report(action.transfer_id, ok=ok, outcome=action.outcome if ok else Outcome.FAILED)

    def report_failed(self, action: actions.ReportFailed) -> None:
        self._report(action.transfer_id, ok=False, outcome=Outcome.FAILED)
        logger.warning(
            "kvpush: receive of %s failed: %s %s", action.transfer_id, action.reason, action.detail
        )

    def note(self, note: actions.Note) -> None:
        kind = note.kind
        if kind is NoteKind.REJECTED:
            # Peers choose how many of these happen: counted each, logged rate-limited.
            self.stats.inc("kvpush_control_messages_rejected", (self.role, note.reason))
            self._log.log(
                logging.WARNING,
                (kind, note.reason),
                "kvpush: rejected (%s): %s",
                note.reason,
                note.detail,
            )
        elif kind is NoteKind.FENCED:
            self.stats.inc("kvpush_leases_fenced", self._labels)
            self._log.log(logging.INFO, kind, "kvpush: fenced: %s", note.detail)
        elif kind is NoteKind.RETRY:
            self.stats.inc("kvpush_retries", (self.role, note.reason))
        elif kind is NoteKind.FALLBACK:
            self.stats.inc("kvpush_fallbacks", (self.role, note.reason))
            logger.warning("kvpush: falling back to pull: %s", note.detail)
        elif kind is NoteKind.LEASE_EXPIRED:
            self.stats.inc("kvpush_leases_expired", (self.role, note.reason))
        elif kind is NoteKind.BREAKER_TRIP:
            self.stats.inc(
                "kvpush_breaker_trips", (self.role, self._peer_label.get(note.reason, note.reason))
            )
            logger.warning("kvpush: circuit breaker to %s opened: %s", note.reason, note.detail)
        elif kind is NoteKind.QUEUE_WAIT:
            self.stats.observe("kvpush_queue_wait_seconds", self._labels, note.value)
        elif kind is NoteKind.LINK_CAPPED:
            self.stats.inc("kvpush_link_capped", (self.role, note.reason), int(note.value))
        elif kind is NoteKind.TRANSFER_DONE:
            began = self.began.pop(note.detail, None)
            if began is not None:
                self.stats.observe(
                    "kvpush_transfer_seconds", self._labels, time.monotonic() - began
                )
            self.trace("transfer_done", note.detail)
        elif kind is NoteKind.PEER_RESTART:
            self.stats.inc("kvpush_peer_restarts", self._labels)
            self._log.log(logging.WARNING, kind, "kvpush: peer restarted: %s", note.detail)
        elif kind is NoteKind.OLDER_PREFILL:
            # D took an older P's DONE: counted and logged once per peer process.
            self.endpoint.done_heard(note.detail, note.reason, int(note.value))
        elif kind is NoteKind.CONNECTION_LOST:
            self.stats.inc("kvpush_peer_connections_lost", self._labels)
            self._log.log(
                logging.WARNING,
                kind,
                "kvpush: the NIXL connection to %s (%s) was closed under us "
                "(REMOTE_DISCONNECT): dropped; the next transfer with it connects anew",
                note.detail[:64],
                self._peer_label.get(note.detail, "?"),
            )

    def contained(self, stage: Stage, what: str) -> None:
        """Log and count an input or action that raised; the rest of the pass goes on."""
        self.stats.inc("kvpush_pump_errors", (self.role, stage.value))
        logger.exception(
            "kvpush: %s raised in the transfer pump (%s stage); it is dropped "
            "and everything else goes on",
            what,
            stage.value,
        )

    # -- the data plane
    def _done_notif(
        self,
        action: actions.PostWrite,
        regions: list[messages.Region] | None = None,
        units: int = 0,
    ) -> bytes:
        """The DONE the last WRITE carries (``units``: ids are units, that many per block)."""
        if action.done is None:
            return b""
        # In the protocol version settled with D (``core.protocol``): an older D reads it.
        version = self.endpoint.protocol_of(self._peer_control.get(action.peer, ""))
        done = msgspec.structs.replace(action.done, v=version)
        self.stats.inc("kvpush_protocol_dones", (self.role, str(version)))
        if self._verify:
            blocks = list(action.all_src or action.src_blocks)
            done = msgspec.structs.replace(done, checksum=self._checksum(blocks, regions, units))
        return messages.encode_done(done)

    def _post(
        self,
        chunk_id: int,
        tid: str,
        op: Op,
        peer: RemotePeer,
        local: tuple[int, ...],
        remote: tuple[int, ...],
        notif: bytes,
        regions: tuple[int, int] | None = None,
        layer: int | None = None,
    ) -> ChunkError | None:
        t0 = time.monotonic()
        self.began.setdefault(tid, t0)
        try:
            handle = (
                self.transport.post(op, peer, list(local), list(remote), notif)
                if regions is None
                else self.transport.post(op, peer, list(local), list(remote), notif, regions)
            )
        except Exception as exc:  # noqa: BLE001 - any failure to post fails the chunk
            return chunk_error(exc)
        # Ids are units when block sizes differ: each is 1/local_k of one of our blocks;
        # a WRITE of some regions (layer-wise, or a whole push cut by regions) moves theirs.
        block = self._block_bytes
        if regions is not None:
            block = sum(r.block_len for r in self.transport.layout.regions[slice(*regions)])
        nbytes = len(local) * block // (peer.local_k if peer.unit_tokens else 1)
        post_s = time.monotonic() - t0
        # What the post carried and what building it cost (None: a transport that keeps no
        # such record, or an injected fault that posted nothing real).
        cost = getattr(self.transport, "last_post", None)
        if cost is not None:
            self.stats.observe("kvpush_post_descriptors", self._labels, cost.descriptors)
            self.stats.observe("kvpush_post_build_seconds", self._labels, cost.build_s)
        if self.trace.on:
            self._trace_post(tid, op, chunk_id, nbytes, bool(notif), post_s, cost, layer)
        self._handles[chunk_id] = (handle, t0, nbytes, tid)
        self.inflight_bytes += nbytes
        self.stats.observe("kvpush_chunk_post_seconds", self._labels, post_s)
        return None

    def _trace_post(
        self,
        tid: str,
        op: Op,
        chunk_id: int,
        nbytes: int,
        last: bool,
        post_s: float,
        cost: Any,
        layer: int | None,
    ) -> None:
        extra: dict[str, Any] = (
            {}
            if cost is None
            else {
                "descriptors": cost.descriptors,
                "runs": cost.runs,
                "parts": cost.parts,
                "path": cost.path,
                "build_us": round(1e6 * cost.build_s, 1),
            }
        )
        if layer is not None:
            extra["layer"] = layer
        self.trace(
            "post",
            tid,
            op=op,
            chunk=chunk_id,
            nbytes=nbytes,
            last=last,
            post_ms=round(1000 * post_s, 3),
            **extra,
        )

    def _check_chunks(self) -> None:
        for cid in list(self._handles):
            try:
                self._check_chunk(cid)
            except Exception:  # noqa: BLE001 - contained, counted, logged
                self._handles.pop(cid, None)
                self.contained(Stage.COMPLETION, f"chunk {cid}")

    def _check_chunk(self, cid: int) -> None:
        now = time.monotonic()
        handle, posted, nbytes, tid = self._handles[cid]
        state = self.transport.state(handle)
        if state == "PROC":
            if now - posted < self._chunk_timeout:
                return
            state = ChunkError(ErrorKind.TIMEOUT)
        del self._handles[cid]
        self.inflight_bytes -= nbytes
        self.transport.release(handle)
        error = state if isinstance(state, ChunkError) else None  # else it is DONE
        self.trace("chunk_end", tid, chunk=cid, state=str(state))
        self.stats.inc("kvpush_chunks", (self.role, "ok" if error is None else "error"))
        if error is not None:
            logger.warning("kvpush: chunk %d failed: %s", cid, error)
        self.driver.completed(cid, error)

    def _checksum(
        self, blocks: list[int], regions: list[messages.Region] | None = None, units: int = 0
    ) -> int:
        """crc32 of ``blocks`` over ``regions`` (default: whole blocks of our layout), in
        units when ``units`` > 0 (``transport.checksum.kv_crc32``)."""
        return kv_crc32(
            regions if regions is not None else self.transport.layout.regions, blocks, units
        )

    # -- vLLM's side of the results
    def _report(self, tid: str, ok: bool, outcome: Outcome) -> None:
        self.recv_blocks.pop(tid, None)
        self.views.pop(tid, None)
        rid = self.request_of.pop(tid, None)
        if rid is None:
            logger.error("kvpush: report for unknown transfer %s", tid)
            return
        began = self.began.pop(tid, None)
        join = self.joins.end(tid, ok, outcome)
        if join is None:
            return  # other P ranks still feed this request's blocks
        tid, ok, outcome = join.base, join.ok, join.outcome or outcome
        if began is not None:
            self.began[tid] = began
        if self.staging is not None and not self._unstage(rid, tid, ok and outcome.delivered):
            ok, outcome = False, Outcome.FAILED
        self.trace("report", tid, ok=ok, outcome=outcome.value)
        self._count_end(tid, outcome, 0)
        with self.results.lock:
            self.results.recving.add(rid)
            self.results.outcomes[rid] = outcome.value
            if not ok:
                self.results.failed.add(rid)

    def _unstage(self, rid: str, tid: str, delivered: bool) -> bool:
        """Request ``rid``'s receive ended (``delivered``: its KV all landed): copy it from
        its staging slots into its KV blocks and free the slots; False when the copy failed
        (so does the receive). Anything else frees the slots only."""
        staging = self.staging
        if staging is None:
            return True
        if not delivered:
            staging.drop(rid)
            return True
        t0 = time.perf_counter()
        try:
            copied = staging.land(rid)
        except Exception:  # noqa: BLE001 - contained, counted; this receive fails
            self.contained(Stage.COMPLETION, f"the staging copy of {tid[:64]}")
            return False
        if copied:
            self.stats.observe(
                "kvpush_staging_copy_seconds", self._labels, time.perf_counter() - t0
            )
            self.trace("staged_copy", tid, nbytes=copied)
        return True

    def _area_gauges(self, pool: StagingPool) -> None:
        """The size and use of this rank's staging area (D's receive, P's gather area)."""
        self.stats.set("kvpush_staging_used_blocks", self._labels, float(pool.held))
        self.stats.set("kvpush_staging_blocks", self._labels, float(pool.slots))

    def _count_end(self, tid: str, outcome: Outcome, nbytes: int) -> None:
        """Count a transfer's end. Always before its result is published: the engine thread
        takes the results, then drains the stats, in one step; counted after, an end whose
        result an idle engine already took would wait in the stats for a step that may not
        come (its scheduler shows it ended, its kvpush_transfers_total does not)."""
        counted = self.failed_outcome if outcome is Outcome.FAILED else outcome
        self.stats.inc("kvpush_transfers", (self.role, counted.value))
        began = self.began.pop(tid, None)  # P's pushes were timed at transfer_done already
        if outcome.delivered and began is not None:
            self.stats.observe("kvpush_transfer_seconds", self._labels, time.monotonic() - began)
        if nbytes:
            self.stats.inc("kvpush_transfer_bytes", self._labels, nbytes)

    def _report_gauges(self, now: float) -> None:
        for reason, n in self.endpoint.rejected.items():
            seen = self._reported_rejects.get(reason, 0)
            if n > seen:
                self.stats.inc("kvpush_control_messages_rejected", (self.role, reason), n - seen)
                self._reported_rejects[reason] = n
        for version, n in self.endpoint.protocol_fallbacks.items():
            seen = self._reported_fallbacks.get(version, 0)
            if n > seen:
                self.stats.inc("kvpush_protocol_fallbacks", (self.role, version), n - seen)
                self._reported_fallbacks[version] = n
        self.report_tables(now)

    def report_tables(self, now: float, force: bool = False) -> None:
        """Under the lock: kvpush_table_entries of every table, at most once a
        ``TABLES_EVERY_S`` unless ``force``."""
        if force or now - self._tables_at >= TABLES_EVERY_S:
            self._tables_at = now
            set_tables(self.stats, self.role, self.tables())

    def tables_at_drain(self) -> None:
        """Engine thread, at a stats drain: the tables measured now if the lock is free
        (never waited for) and nothing is in flight, so that the last step before the engine
        idles carries their values at rest; the pump measures them otherwise."""
        if self._busy() or not self.lock.acquire(blocking=False):
            return
        try:
            self.report_tables(self.now(), force=True)
        except Exception:  # noqa: BLE001 - never break the engine's step
            self.contained(Stage.TIMER, "the tables' sizes")
        finally:
            self.lock.release()

    def tables(self) -> TableSizes:
        """Entries of every table of this rank: the pump's own, the core's, the control
        endpoint's and the transport's (under the pump's lock: the pump thread reads them)."""
        out: TableSizes = {
            "pump.requests": (len(self.request_of), None),
            "pump.began": (len(self.began), None),
            "pump.chunks": (len(self._handles), None),
            "pump.peer_labels": (len(self._peer_label), None),
            "driver.peers": (len(self.driver.peers), None),
        }
        if self.link_guard is not None:
            out["linkguard.links"] = (len(self.link_guard), None)
        for part in (self.engine, self.endpoint, self.transport):
            sizes = getattr(part, "tables", None)  # a test's fake may keep none
            if callable(sizes):
                out.update(sizes())
        return out


class SenderPump(TransferPump[Sender]):
    """P's pump: its completions are its WRITEs'; D's READs of its blocks need progress."""

    gather: GatherArea | None = None  # P's gather area (staging.send_mib), set at start

    side = Side.PRODUCER

    def send(self, peer: str, to: str, message: messages.ControlMessage) -> None:
        if isinstance(message, messages.Fallback) and self._verify:
            message = self._stamp_fallback(message)
        super().send(peer, to, message)

    def _stamp_fallback(self, msg: messages.Fallback) -> messages.Fallback:
        """``msg`` with the crc32 of the blocks D will read, as the DONE of a push carries
        it (over the part of each block that D reads, in units when block sizes differ):
        pulled KV is verified like pushed KV."""
        remote = self.driver.peers.get(self.engine.agent_of(msg.transfer_id))
        if remote is None:
            return msg  # not connected: D's READs fail and the receive fails anyway
        regions = remote.local.regions if remote.local is not None else None
        units = remote.local_k if remote.unit_tokens else 0
        return msgspec.structs.replace(
            msg, checksum=self._checksum(list(msg.block_ids), regions, units)
        )

    def _inbound(self, msg: messages.ControlMessage) -> messages.ControlMessage:
        """A REGISTER of a decode engine with more ranks than ours splits its transfer into
        one part per D rank this rank feeds; what the engine said of it is replayed to the
        new parts (before the REGISTER reaches the core)."""
        if isinstance(msg, messages.Register):
            base, parts, known = self.splits.on_register(msg)
            if parts:
                layout = msg.sender.layout
                if layout is not None:
                    self.log_mapping(layout.tp_size, self.transport.layout)
                rid = self.request_of.get(base)
                for part in parts:
                    if rid is not None:
                        self.trace("split", part, base=base)
                    self._replay(part, known)
        return msg

    def _replay(self, part: str, known: Any) -> None:
        if known is None:
            return
        if known.failed and known.blocks is not None:
            self.driver.command(ForwardFailed(part, known.blocks))
            return
        if known.expected:
            self.driver.command(ExpectBlocks(part, known.owner))
        if known.blocks is None and known.layers:
            self.driver.command(
                LayersReady(
                    part, known.layer_blocks, known.layers, known.parts, known.owner, known.prompt
                )
            )
        if known.blocks is not None:
            self.driver.command(BlocksReady(part, known.blocks, known.owner, known.prompt))
        if known.held:
            self.driver.command(Hold(part))

    def _watching(self) -> bool:
        return self.engine.pulling

    def _progress(self) -> None:
        if self.engine.pulling:
            self.transport.notifications()  # progress for D's READs (none are ours)

    def tables(self) -> TableSizes:
        return {**super().tables(), **self.splits.tables()}

    def _report_gauges(self, now: float) -> None:
        super()._report_gauges(now)
        if self.gather is not None:
            self._area_gauges(self.gather.pool)
            full, self.gather.full = self.gather.full, 0
            if full:
                self.stats.inc("kvpush_staging_refused", self._labels, full)
        p = self.engine
        # Only peers connected now: a replaced process's link (until the core forgets it)
        # must not make a series labelled with its raw agent name.
        links = [link for link in p.sched.links() if link in self._peer_label]
        for link in links:
            label, bandwidth = self._peer_label[link], p.sched.measured_bandwidth(link)
            self.stats.set("kvpush_link_bandwidth_bytes_per_second", (self.role, label), bandwidth)
            if self.link_guard is not None:  # links.expected_gbps: the slow-link guard
                slow = self.link_guard.observe(label, bandwidth, now)
                self.stats.set("kvpush_link_slow", (self.role, label), float(slow))
        if links:
            self.link_bandwidth = p.sched.slowest_whole_bandwidth(links)
        for peer, state in p.breaker_states(now).items():
            if peer in self._peer_label:
                self.stats.set(
                    "kvpush_breaker_state",
                    (self.role, self._peer_label[peer]),
                    _BREAKER_VALUE[state],
                )


class ReceiverPump(TransferPump[Receiver]):
    """D's pump: it also watches NIXL notifications for the DONE of each push."""

    side = Side.CONSUMER

    def send(self, peer: str, to: str, message: messages.ControlMessage) -> None:
        super().send(peer, to, self.links.outbound(message))

    def _inbound(self, msg: messages.ControlMessage) -> messages.ControlMessage:
        return self.links.inbound(msg)

    def tables(self) -> TableSizes:
        return {
            **super().tables(),
            "pump.recv_blocks": (len(self.recv_blocks), None),
            "pump.views": (len(self.views), None),
            **({"pump.staged": (len(self.staging), None)} if self.staging is not None else {}),
            "pump.joins": (len(self.joins), MAX_REMEMBERED),
            **self.links.tables(),
        }

    def _report_gauges(self, now: float) -> None:
        super()._report_gauges(now)
        if self.staging is not None:
            self._area_gauges(self.staging.pool)

    def _watching(self) -> bool:
        return self.engine.active > 0  # DONE notifications to watch

    def _progress(self) -> None:
        if self.engine.active > 0:
            self._check_notifications()

    def _light_pass(self) -> None:
        self._check_notifications()

    def _check_notifications(self) -> None:
        for agent, notifs in self.transport.notifications().items():
            for raw in notifs:
                self._notification(str(agent), raw)

    def _notification(self, agent: str, raw: bytes) -> None:
        self.driver.feed(
            Stage.COMPLETION,
            f"a notification of {agent[:64]}",
            lambda rx, now: self._done_in(rx, now, agent, raw),
        )

    def _done_in(self, rx: Receiver, now: float, agent: str, raw: bytes) -> list[actions.Action]:
        """The DONE a notification carries (checked against the blocks with verify on)."""
        try:
            done = messages.decode_done(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return [
                actions.Note(
                    NoteKind.REJECTED, RejectReason.MALFORMED, f"bad DONE notification: {exc}"
                )
            ]
        if done is None:
            return []
        if not protocol.OLDEST <= done.v <= protocol.CURRENT:
            return [
                actions.Note(NoteKind.REJECTED, RejectReason.VERSION, f"DONE of protocol {done.v}")
            ]
        self.stats.inc("kvpush_protocol_dones", (self.role, str(done.v)))
        done = self.links.done(done)
        self.trace("done_in", done.transfer_id)
        verified = True
        if done.checksum >= 0:
            blocks = rx.blocks_of(done.transfer_id)
            if blocks is not None:
                units = 0  # P's block size differs: the crc runs over units
                if done.unit_tokens:
                    size = self.transport.layout.block_size
                    units = size // done.unit_tokens if size % done.unit_tokens == 0 else 0
                    blocks = blocksize.expand(blocks, units)[: done.num_blocks]
                verified = (units > 0 or not done.unit_tokens) and self._checksum(
                    blocks, self.views.get(done.transfer_id), units
                ) == done.checksum
                if not verified:
                    logger.error("kvpush: checksum mismatch for %s", done.transfer_id)
        return rx.on_done(done, now, verified, agent)
