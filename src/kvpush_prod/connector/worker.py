"""Worker-side half of the PushConnector (runs in each vLLM worker process, one per rank).

Owns this rank's NIXL agent and control endpoint, driven by one transfer pump thread that
feeds events to the core (Sender on P, Receiver on D) and carries out the actions it returns.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import random
import sys
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from kvpush_prod.config import KvpushConfig, is_loopback
from kvpush_prod.connector.metadata import PushMetadata, SendSpec
from kvpush_prod.control import ControlCodec, ControlEndpoint
from kvpush_prod.control.security import EndpointSecurity
from kvpush_prod.core import messages
from kvpush_prod.core.actions import (
    Action,
    ConnectPeer,
    DropPeer,
    Note,
    PostRead,
    PostWrite,
    ReleaseSend,
    ReportFailed,
    ReportFinished,
    SendMessage,
)
from kvpush_prod.core.identity import agent_name
from kvpush_prod.core.receiver import Receiver, ReceiverSettings
from kvpush_prod.core.retry import BreakerSettings, BreakerState, BudgetSettings, RetrySettings
from kvpush_prod.core.scheduler import SchedulerSettings
from kvpush_prod.core.sender import Sender, SenderSettings
from kvpush_prod.core.transfer import TransferTimeouts
from kvpush_prod.errors import ConfigError
from kvpush_prod.metrics import StatsBuffer
from kvpush_prod.trace import Tracer
from kvpush_prod.transport.faults import FaultyTransport, fault_settings
from kvpush_prod.transport.layout import layout_from_kv_caches
from kvpush_prod.transport.nixl import NixlTransport, RemotePeer, make_agent

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_BREAKER_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
MESSAGES_PER_PASS = 256  # a flood of control messages cannot hold the pump (and its lock)
MAX_MESSAGE_AGE_S = 3600.0  # a sent_at further back is a broken clock, not a slow network


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


def _core_settings(cfg: KvpushConfig, block_bytes: int) -> dict[str, Any]:
    """The parts of the YAML config both sides' core engines share."""
    leases = cfg.leases
    total = leases.transfer_timeout_s
    return {
        "scheduler": SchedulerSettings(
            chunk_bytes=cfg.push.chunk_bytes,
            target_latency_s=cfg.push.target_latency_ms / 1000.0,
            stop_margin_s=leases.stop_margin_s,
        ),
        "retry": RetrySettings(
            max_attempts=cfg.retry.max_attempts,
            backoff_base_s=cfg.retry.base_backoff_ms / 1000.0,
            backoff_max_s=max(cfg.retry.max_backoff_ms, cfg.retry.base_backoff_ms) / 1000.0,
        ),
        "budget": BudgetSettings(rate_per_s=cfg.retry.budget_per_s, burst=cfg.retry.budget_burst),
        # Per-state limits are the whole-transfer bound: leases end stuck phases sooner.
        "timeouts": TransferTimeouts(new_s=total, waiting_s=total, registered_s=total,
                                     pushing_s=total, retrying_s=total,
                                     fallback_s=cfg.fallback.pull_permit_s + total / 4,
                                     total_s=total),
    }


class WorkerSide:
    """Registers the KV cache with NIXL and runs the push protocol of this rank."""

    def __init__(self, cfg: KvpushConfig, role: str, engine_id: str, tp_rank: int,
                 tp_size: int, dp_index: int, signature: str, num_blocks: int) -> None:
        self.cfg = cfg
        self.role = role
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.port = cfg.control.port + dp_index * tp_size + tp_rank
        self.signature = signature
        self.num_blocks = num_blocks
        self.incarnation = random.SystemRandom().getrandbits(62)
        self.stats = StatsBuffer()
        self.results = _Results()
        self._pending_sends: list[SendSpec] = []
        self._device: str = "cpu"
        self._pump: TransferPump | None = None
        self.trace = Tracer(f"kvpush-{role}")

    # ------------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()))
        self._device = first.device.type
        if self._device != "cpu" and self.cfg.verify.checksums:
            raise ConfigError(
                "verify.checksums reads KV blocks through host memory and cannot check a GPU "
                "KV cache; set verify.checksums: false on GPU engines"
            )
        layout = layout_from_kv_caches(kv_caches, self.num_blocks, self.signature)
        t = self.cfg.transport
        host = self.cfg.control.advertise_host or self.cfg.control.host
        control = f"tcp://{host}:{self.port}"
        security = endpoint_security(self.cfg)
        # The agent is named for this engine's identity (its key; without keys, its control
        # address), so no other engine can announce it.
        identity = security.keypair.public.decode() if security else control
        name = agent_name(f"kvpush-{self.engine_id}-r{self.tp_rank}-{self.incarnation:x}",
                          identity)
        agent = make_agent(name, t.backend, t.progress_thread, t.progress_delay_us, t.num_threads)
        transport: Any = NixlTransport(agent, layout)
        faults = fault_settings(self.cfg.faults.model_dump())
        if faults.enabled:
            transport = FaultyTransport(transport, faults)
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
        shared = _core_settings(self.cfg, block_bytes)
        leases = self.cfg.leases
        # Not seeded from anything a peer sees: generations must be unguessable.
        rng = random.SystemRandom()
        protocol: Sender | Receiver
        if self.role == "producer":
            protocol = Sender(me, SenderSettings(
                block_bytes=block_bytes,
                breaker=BreakerSettings(
                    failure_threshold=self.cfg.breaker.failure_threshold,
                    window_s=self.cfg.breaker.window_s,
                    cooldown_s=self.cfg.breaker.cooldown_s,
                    max_cooldown_s=self.cfg.breaker.max_cooldown_s,
                ),
                send_lease_s=leases.send_lease_ttl_s,
                max_peers=self.cfg.control.max_peers,
                stop_margin_s=leases.stop_margin_s,
                skew_margin_s=leases.skew_margin_s,
                heartbeat_s=leases.heartbeat_interval_s,
                fallback=self.cfg.fallback.pull,
                pull_permit_s=self.cfg.fallback.pull_permit_s,
                register_grace_s=leases.register_grace_s,
                **shared,
            ), rng)
        else:
            protocol = Receiver(me, ReceiverSettings(
                block_bytes=block_bytes,
                permit_ttl_s=leases.permit_ttl_s,
                skew_margin_s=leases.skew_margin_s,
                stop_margin_s=leases.stop_margin_s,
                heartbeat_s=leases.heartbeat_interval_s,
                peer_timeout_s=leases.peer_timeout_s,
                max_peers=self.cfg.control.max_peers,
                **shared,
            ), rng, tokens=rng)
        endpoint = ControlEndpoint(
            ControlCodec(self.cfg.control.max_message_bytes),
            self.cfg.control.host,
            self.port,
            security=security,
            max_peers=self.cfg.control.max_peers,
        )
        insecure = security is None and not is_loopback(self.cfg.control.host)
        self.stats.set("kvpush_control_insecure", (self.role,), 1.0 if insecure else 0.0)
        if insecure:
            logger.error(
                "kvpush: INSECURE control channel on %s:%d (control.insecure: true): plaintext "
                "and unauthenticated, any host that reaches this port can make the engine write "
                "or free KV blocks. Give each engine keys (kvpush keys generate; docs/security.md)",
                self.cfg.control.host, self.port)
        self._pump = TransferPump(self.cfg, self.role, transport, endpoint, protocol,
                                  self.results, self.stats, self.trace)
        self._pump.start()
        # The pump must get the GIL within a fraction of a millisecond when the engine thread
        # hands it a push; CPython's default switch interval (5 ms) would add that much to TTFT.
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
        logger.info("kvpush: %s rank %d ready, control %s, %d KV regions, %d B per block",
                    self.role, self.tp_rank, me.control, len(layout.regions), block_bytes)

    # ------------------------------------------------------------------ per step
    def on_metadata(self, meta: PushMetadata) -> None:
        """Before the forward: D registers reserved blocks at once (REGISTER leaves early)."""
        pump = self._pump
        if pump is None or meta.empty():
            return
        for ref in meta.wait_admission:
            address = self._address(ref.p_host, ref.p_port)
            pump.submit(lambda r, t=ref.transfer_id, a=address, k=ref.p_key:
                        r.await_admission(t, a, k))
        for tid in meta.admission_over:
            pump.submit(lambda r, t=tid: r.admission_over(t))
        for spec in meta.recv:
            self.trace("recv_spec", spec.transfer_id, blocks=len(spec.block_ids))
            pump.request_of[spec.transfer_id] = spec.request_id
            pump.recv_blocks[spec.transfer_id] = list(spec.block_ids)
            pump.began[spec.transfer_id] = time.monotonic()
            address = self._address(spec.p_host, spec.p_port)
            pump.submit(lambda r, s=spec, a=address: r.register(
                s.transfer_id, a, s.block_ids, s.first_block, s.num_tokens, time.monotonic(),
                owner=s.p_key))
        for ref in meta.not_needed:
            address = self._address(ref.p_host, ref.p_port)
            pump.submit(lambda r, t=ref.transfer_id, a=address, k=ref.p_key:
                        r.not_needed(t, a, k))
        for tid in meta.abort_recv:
            pump.submit(lambda r, t=tid: r.abort(t, time.monotonic()))
        for tid, owner in meta.expect_send:
            pump.submit(lambda s, t=tid, o=owner: s.expect_blocks(t, time.monotonic(), o))
        for tid in meta.abort_send:
            pump.submit(lambda s, t=tid: s.abort(t, time.monotonic()))
        for tid in meta.hold:
            pump.submit(lambda s, t=tid: s.hold(t))
        self._pending_sends.extend(meta.send)

    def _address(self, host: str, port: int) -> str:
        return f"tcp://{host}:{port + self.tp_rank}"

    def after_forward(self, forward_failed: bool = False) -> None:
        """P: this step's prompts are computed; hand their blocks to the pump. With
        ``forward_failed`` the forward raised: the blocks hold no usable KV and D is told."""
        if not self._pending_sends or self._pump is None:
            return
        sends, self._pending_sends = self._pending_sends, []
        for spec in sends:
            self._pump.request_of[spec.transfer_id] = spec.request_id
        if forward_failed:
            logger.warning("kvpush: the forward raised; %d prompt(s) of this step are not "
                           "pushed and their decode engines are told", len(sends))
            for spec in sends:
                self.trace("forward_failed", spec.transfer_id)
                self._pump.run_now(lambda s, sp=spec: s.forward_failed(
                    sp.transfer_id, sp.block_ids, time.monotonic()))
            return
        if self._device == "cuda":
            import torch

            torch.cuda.current_stream().synchronize()  # KV must be in memory before a WRITE
        for spec in sends:
            self.trace("blocks_ready", spec.transfer_id, blocks=len(spec.block_ids))
            self._pump.run_now(lambda s, sp=spec: s.blocks_ready(
                sp.transfer_id, sp.block_ids, time.monotonic(), sp.owner))

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        sending, recving, failed = self.results.take()
        if self.trace.on and (sending or recving):
            self.trace("taken", sending=sorted(sending), recving=sorted(recving))
        return sending, recving, failed

    def take_outcomes(self) -> dict[str, str]:
        return self.results.take_outcomes()

    def get_stats(self) -> dict[str, Any]:
        if self._pump is not None:
            # Read at drain time, so the step that reports the last completion also
            # reports nothing in flight (a stale value would stick while the engine idles).
            self.stats.set("kvpush_inflight_bytes", (self.role,), self._pump.inflight_bytes)
        return self.stats.drain()

    def shutdown(self) -> None:
        if self._pump is not None:
            self._pump.stop()
            self._pump = None


class TransferPump(threading.Thread):
    """The one thread that touches NIXL and the control sockets.

    Blocks on the control socket while idle (no CPU spent), polls the transport every
    ``active_poll_us`` while chunks or receives are in flight.
    """

    def __init__(self, cfg: KvpushConfig, role: str, transport: Any,
                 endpoint: ControlEndpoint, protocol: Sender | Receiver, results: _Results,
                 stats: StatsBuffer, trace: Tracer | None = None) -> None:
        super().__init__(name=f"kvpush-pump-{role}", daemon=True)
        self.cfg = cfg
        self.role = role
        self.transport = transport
        self.endpoint = endpoint
        self.protocol = protocol
        self.results = results
        self.stats = stats
        self.trace = trace or Tracer("")
        self.request_of: dict[str, str] = {}  # transfer id -> vLLM request id (engine thread adds)
        self.recv_blocks: dict[str, list[int]] = {}  # D: transfer id -> its blocks
        self._peer_label: dict[str, str] = {}  # agent name -> "engine/rank" (bounded label)
        self._commands: queue.SimpleQueue[Callable[[Any], list[Action]]] = queue.SimpleQueue()
        self._halt = threading.Event()
        # Held for every use of the protocol, NIXL and the sending sockets: by the pump, and by
        # the engine thread when it hands over a push (run_now).
        self.lock = threading.Lock()
        self._handles: dict[int, tuple[Any, float, int]] = {}  # chunk -> (handle, posted, bytes)
        self.inflight_bytes = 0  # read by the engine thread (an int: atomic to read)
        self._peers: dict[str, RemotePeer] = {}  # agent name -> connected peer
        self.began: dict[str, float] = {}  # transfer id -> start (P: first post, D: REGISTER)
        self._labels = (role,)
        self._verify = cfg.verify.checksums
        self._block_bytes = sum(r.block_len for r in transport.layout.regions)
        self._chunk_timeout = cfg.push.chunk_timeout_s
        self._last_tick = 0.0
        self._reported_rejects: dict[str, int] = {}

    # -- engine thread API
    def submit(self, command: Callable[[Any], list[Action]]) -> None:
        self._commands.put(command)
        self.endpoint.wake()

    def stop(self) -> None:
        self._halt.set()
        self.endpoint.wake()
        self.join(timeout=5)
        self.endpoint.close()
        self.transport.close()

    # -- the loop
    def run(self) -> None:
        active_poll = self.cfg.transport.active_poll_us / 1e6
        idle_poll = self.cfg.transport.idle_poll_ms / 1e3
        receiver = self.protocol if isinstance(self.protocol, Receiver) else None
        while not self._halt.is_set():
            busy = bool(self._handles) or self.protocol.busy or (
                receiver is not None and receiver.active > 0)
            try:
                readable = self.endpoint.wait(active_poll if busy else idle_poll)
                with self.lock:
                    self._pass(readable, receiver)
            except Exception:  # noqa: BLE001 - the pump must survive to keep leases honest
                self._contained("timer", "the pass")
                time.sleep(0.01)

    def _contained(self, stage: str, what: str) -> None:
        """Log and count an input or action that raised; the rest of the pass goes on."""
        self.stats.inc("kvpush_pump_errors", (self.role, stage))
        logger.exception("kvpush: %s raised in the transfer pump (%s stage); it is dropped "
                         "and everything else goes on", what, stage)

    def run_now(self, command: Callable[[Any], list[Action]]) -> None:
        """Run ``command`` on the protocol in the calling thread (the engine thread's hot path:
        a push is posted at once instead of waiting for the pump to be scheduled)."""
        with self.lock:
            try:
                self._execute(command(self.protocol))
            except Exception:  # noqa: BLE001 - never break the engine's step
                logger.exception("kvpush: push hand-off failed")
        self.endpoint.wake()  # the pump now has chunks to watch: poll at the active rate

    def _pass(self, readable: bool, receiver: Receiver | None) -> None:
        """One round of the loop: messages, commands, completions, scheduling, timers."""
        for msg, origin in self.endpoint.receive(MESSAGES_PER_PASS) if readable else ():
            # Each message on its own: one that raises never drops or delays another.
            try:
                if self.trace.on:
                    self.trace("msg_in", getattr(msg, "transfer_id", ""),
                               kind=type(msg).__name__)
                sent_at = getattr(msg, "sent_at", 0.0)
                age = min(max(0.0, time.time() - sent_at), MAX_MESSAGE_AGE_S) if sent_at else 0.0
                self._execute(self.protocol.on_message(msg, time.monotonic(), age, origin))
            except Exception:  # noqa: BLE001 - contained, counted, logged
                self._contained("message", type(msg).__name__)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            try:
                self._execute(command(self.protocol))
            except Exception:  # noqa: BLE001 - contained, counted, logged
                self._contained("command", "an engine-thread command")
        if self._handles:
            self._check_chunks()
        if receiver is not None and receiver.active > 0:
            self._check_notifications(receiver)
        elif isinstance(self.protocol, Sender) and self.protocol.pulling:
            self.transport.notifications()  # progress for D's READs (none are ours)
        now = time.monotonic()
        if self.protocol.busy:
            self._execute(self.protocol.poll(now))
        if now - self._last_tick >= 0.05:
            self._last_tick = now
            self._execute(self.protocol.tick(now))
            self._report_gauges(now)
            if not self.cfg.transport.progress_thread:
                # A light pass for connection wire-up and keep-alives while nothing is active.
                if receiver is not None:
                    self._check_notifications(receiver)
                elif not self._handles:
                    self.transport.notifications()

    def _execute(self, actions: list[Action]) -> None:
        for action in actions:
            # Each action on its own: one that raises never drops the others.
            try:
                self._execute_one(action)
            except Exception:  # noqa: BLE001 - contained, counted, logged
                self._contained("action", type(action).__name__)

    def _execute_one(self, action: Action) -> None:
        if isinstance(action, SendMessage):
            msg = action.message
            if hasattr(msg, "sent_at"):
                msg = msgspec.structs.replace(msg, sent_at=time.time())  # type: ignore[type-var]
            self.endpoint.send(action.peer, msg, action.to)
            if self.trace.on:
                self.trace("msg_out", getattr(msg, "transfer_id", ""),
                           kind=type(msg).__name__)
        elif isinstance(action, PostWrite):
            self._post(action.chunk_id, action.transfer_id, "WRITE", action.peer,
                       action.src_blocks, action.dst_blocks, self._done_notif(action))
        elif isinstance(action, PostRead):
            self._post(action.chunk_id, action.transfer_id, "READ", action.peer,
                       action.local_blocks, action.remote_blocks, b"")
        elif isinstance(action, ConnectPeer):
            self._connect(action)
        elif isinstance(action, DropPeer):
            self._drop(action.agent_name)
        elif isinstance(action, ReleaseSend):
            self._release_send(action)
        elif isinstance(action, ReportFinished):
            self._report_finished(action)
        elif isinstance(action, ReportFailed):
            self._report(action.transfer_id, ok=False, outcome="failed")
            logger.warning("kvpush: receive of %s failed: %s %s", action.transfer_id,
                           action.reason, action.detail)
        elif isinstance(action, Note):
            self._note(action)

    # -- actions
    def _drop(self, agent_name: str) -> None:
        self.transport.disconnect(agent_name)
        self._peers.pop(agent_name, None)
        self._peer_label.pop(agent_name, None)

    def _connect(self, action: ConnectPeer) -> None:
        if action.replaces:
            self._drop(action.replaces)
        info = action.info
        self._peer_label[info.agent_name] = f"{info.engine_id}/r{info.rank}"
        if info.agent_name in self._peers or info.layout is None:
            return
        try:
            peer = self.transport.connect(info.agent_meta, info.layout, info.agent_name)
        except Exception as exc:  # noqa: BLE001 - the posts to it will fail and fall back
            logger.error("kvpush: cannot connect to %s (%s): %s", info.agent_name,
                         info.engine_id, exc)
            return
        self._peers[info.agent_name] = peer

    def _done_notif(self, action: PostWrite) -> bytes:
        if action.done is None:
            return b""
        done = action.done
        if self._verify:
            blocks = list(action.all_src or action.src_blocks)
            done = msgspec.structs.replace(done, checksum=self._checksum(blocks))
        return messages.encode_done(done)

    def _post(self, chunk_id: int, tid: str, op: str, peer_name: str,
              local: tuple[int, ...], remote: tuple[int, ...], notif: bytes) -> None:
        t0 = time.monotonic()
        self.began.setdefault(tid, t0)
        peer = self._peers.get(peer_name)
        try:
            if peer is None:
                raise RuntimeError(f"NIXL_ERR_NOT_FOUND: no connection to agent {peer_name}")
            handle = self.transport.post(op, peer, list(local), list(remote), notif)
        except Exception as exc:  # noqa: BLE001 - any failure to post fails the chunk
            logger.warning("kvpush: %s for %s failed to post: %s", op, tid, exc)
            self.stats.inc("kvpush_chunks", (self.role, "post_failed"))
            self._execute(self.protocol.on_chunk(chunk_id, False, f"{type(exc).__name__}: {exc}",
                                                 time.monotonic()))
            return
        nbytes = len(local) * self._block_bytes
        self.trace("post", tid, op=op, chunk=chunk_id, nbytes=nbytes, last=bool(notif),
                   post_ms=round(1000 * (time.monotonic() - t0), 3))
        self._handles[chunk_id] = (handle, t0, nbytes)
        self.inflight_bytes += nbytes
        self.stats.observe("kvpush_chunk_post_seconds", self._labels, time.monotonic() - t0)

    def _check_chunks(self) -> None:
        for cid in list(self._handles):
            try:
                self._check_chunk(cid)
            except Exception:  # noqa: BLE001 - contained, counted, logged
                self._handles.pop(cid, None)
                self._contained("completion", f"chunk {cid}")

    def _check_chunk(self, cid: int) -> None:
        now = time.monotonic()
        handle, posted, nbytes = self._handles[cid]
        state = self.transport.state(handle)
        if state == "PROC":
            if now - posted < self._chunk_timeout:
                return
            state = "TIMEOUT"
        del self._handles[cid]
        self.inflight_bytes -= nbytes
        self.transport.release(handle)
        ok = state == "DONE"
        self.trace("chunk_end", "", chunk=cid, state=state)
        self.stats.inc("kvpush_chunks", (self.role, "ok" if ok else "error"))
        if not ok:
            logger.warning("kvpush: chunk %d failed: %s", cid, state)
        self._execute(self.protocol.on_chunk(cid, ok, "" if ok else state, now))

    def _check_notifications(self, receiver: Receiver) -> None:
        for agent, notifs in self.transport.notifications().items():
            for raw in notifs:
                try:
                    self._on_notification(receiver, str(agent), raw)
                except Exception:  # noqa: BLE001 - contained, counted, logged
                    self._contained("completion", f"a notification of {str(agent)[:64]}")

    def _on_notification(self, receiver: Receiver, agent: str, raw: bytes) -> None:
        try:
            done = messages.decode_done(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._note(Note("rejected", "malformed", f"bad DONE notification: {exc}"))
            return
        if done is None:
            return
        self.trace("done_in", done.transfer_id)
        verified = True
        if done.checksum >= 0:
            blocks = receiver.blocks_of(done.transfer_id)
            if blocks is not None:
                verified = self._checksum(blocks) == done.checksum
                if not verified:
                    logger.error("kvpush: checksum mismatch for %s", done.transfer_id)
        self._execute(receiver.on_done(done, time.monotonic(), verified, agent))

    def _release_send(self, action: ReleaseSend) -> None:
        rid = self.request_of.pop(action.transfer_id, None)
        if rid is None:
            logger.error("kvpush: release of unknown transfer %s", action.transfer_id)
            return
        self.trace("release", action.transfer_id, outcome=action.outcome)
        with self.results.lock:
            self.results.sending.add(rid)
        self._count_end(action.transfer_id, action.outcome, action.nbytes)

    def _report_finished(self, action: ReportFinished) -> None:
        ok = True
        blocks = self.recv_blocks.get(action.transfer_id)
        if action.checksum >= 0 and blocks is not None:
            ok = self._checksum(blocks) == action.checksum
            if not ok:
                logger.error("kvpush: checksum mismatch on pulled %s", action.transfer_id)
        self._report(action.transfer_id, ok=ok, outcome=action.outcome if ok else "failed")

    def _report(self, tid: str, ok: bool, outcome: str) -> None:
        self.recv_blocks.pop(tid, None)
        rid = self.request_of.pop(tid, None)
        if rid is None:
            logger.error("kvpush: report for unknown transfer %s", tid)
            return
        self.trace("report", tid, ok=ok, outcome=outcome)
        with self.results.lock:
            self.results.recving.add(rid)
            self.results.outcomes[rid] = outcome
            if not ok:
                self.results.failed.add(rid)
        self._count_end(tid, outcome, 0)

    def _count_end(self, tid: str, outcome: str, nbytes: int) -> None:
        self.stats.inc("kvpush_transfers", (self.role, outcome))
        began = self.began.pop(tid, None)  # P's pushes were timed at transfer_done already
        if outcome in ("pushed", "retried", "pull_fallback") and began is not None:
            self.stats.observe("kvpush_transfer_seconds", self._labels, time.monotonic() - began)
        if nbytes:
            self.stats.inc("kvpush_transfer_bytes", self._labels, nbytes)

    def _note(self, note: Note) -> None:
        kind = note.kind
        if kind == "rejected":
            self.stats.inc("kvpush_control_messages_rejected", (self.role, note.reason))
            logger.warning("kvpush: rejected (%s): %s", note.reason, note.detail)
        elif kind == "fenced":
            self.stats.inc("kvpush_leases_fenced", self._labels)
            logger.info("kvpush: fenced: %s", note.detail)
        elif kind == "retry":
            self.stats.inc("kvpush_retries", (self.role, note.reason))
        elif kind == "fallback":
            self.stats.inc("kvpush_fallbacks", (self.role, note.reason))
            logger.warning("kvpush: falling back to pull: %s", note.detail)
        elif kind == "lease_expired":
            self.stats.inc("kvpush_leases_expired", (self.role, note.reason))
        elif kind == "breaker_trip":
            self.stats.inc("kvpush_breaker_trips",
                           (self.role, self._peer_label.get(note.reason, note.reason)))
            logger.warning("kvpush: circuit breaker to %s opened: %s", note.reason, note.detail)
        elif kind == "queue_wait":
            self.stats.observe("kvpush_queue_wait_seconds", self._labels, note.value)
        elif kind == "transfer_done":
            began = self.began.pop(note.detail, None)
            if began is not None:
                self.stats.observe("kvpush_transfer_seconds", self._labels,
                                   time.monotonic() - began)
            self.trace("transfer_done", note.detail)
        elif kind == "peer_restart":
            self.stats.inc("kvpush_peer_restarts", self._labels)
            logger.warning("kvpush: peer restarted: %s", note.detail)

    def _checksum(self, blocks: list[int]) -> int:
        crc = 0
        for region in self.transport.layout.regions:
            for b in blocks:
                addr = region.base + b * region.block_stride
                crc = zlib.crc32(ctypes.string_at(addr, region.block_len), crc)
        return crc

    def _report_gauges(self, now: float) -> None:
        for reason, n in self.endpoint.rejected.items():
            seen = self._reported_rejects.get(reason, 0)
            if n > seen:
                self.stats.inc("kvpush_control_messages_rejected", (self.role, reason), n - seen)
                self._reported_rejects[reason] = n
        p = self.protocol
        if isinstance(p, Sender):
            for link in p.sched.links():
                self.stats.set("kvpush_link_bandwidth_bytes_per_second",
                               (self.role, self._peer_label.get(link, link)), p.sched.bandwidth(link))
            for peer, state in p.breaker_states(now).items():
                self.stats.set("kvpush_breaker_state", (self.role, self._peer_label.get(peer, peer)),
                               _BREAKER_VALUE[state])
