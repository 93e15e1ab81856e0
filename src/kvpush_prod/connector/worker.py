"""Worker-side half of the PushConnector (runs in each vLLM worker process, one per rank).

Owns this rank's NIXL agent and control endpoint, driven by one transfer pump thread.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import random
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from kvpush_prod.config import KvpushConfig
from kvpush_prod.connector.metadata import PushMetadata, SendSpec
from kvpush_prod.control import ControlCodec, ControlEndpoint
from kvpush_prod.core import messages
from kvpush_prod.core.push import (
    Action,
    FinishRecv,
    FinishSend,
    PostWrite,
    PushSettings,
    Receiver,
    Rejected,
    Sender,
    SendMessage,
)
from kvpush_prod.metrics import StatsBuffer
from kvpush_prod.transport.layout import layout_from_kv_caches
from kvpush_prod.transport.nixl import NixlTransport, RemotePeer, make_agent

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass
class _Results:
    """Completions the engine thread collects each step (filled by the pump thread)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)

    def take(self) -> tuple[set[str], set[str], set[str]]:
        with self.lock:
            out = (self.sending, self.recving, self.failed)
            self.sending, self.recving, self.failed = set(), set(), set()
            return out


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

    # ------------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()))
        self._device = first.device.type
        layout = layout_from_kv_caches(kv_caches, self.num_blocks, self.signature)
        t = self.cfg.transport
        name = f"kvpush-{self.engine_id}-r{self.tp_rank}-{self.incarnation:x}"
        agent = make_agent(name, t.backend, t.progress_thread, t.progress_delay_us, t.num_threads)
        transport = NixlTransport(agent, layout)
        host = self.cfg.control.advertise_host or self.cfg.control.host
        me = messages.PeerInfo(
            engine_id=self.engine_id,
            incarnation=self.incarnation,
            rank=self.tp_rank,
            control=f"tcp://{host}:{self.port}",
            agent_name=transport.name,
            agent_meta=transport.metadata(),
            layout=layout,
        )
        block_bytes = sum(r.block_len for r in layout.regions)
        settings = PushSettings(
            block_bytes=block_bytes,
            chunk_blocks=max(1, self.cfg.push.chunk_bytes // max(1, block_bytes)),
            send_lease_s=self.cfg.leases.send_lease_ttl_s,
            stop_margin_s=self.cfg.leases.stop_margin_s,
            permit_ttl_s=self.cfg.leases.permit_ttl_s,
            skew_margin_s=self.cfg.leases.skew_margin_s,
        )
        endpoint = ControlEndpoint(
            ControlCodec(self.cfg.control.secret, self.cfg.control.max_message_bytes),
            self.cfg.control.host,
            self.port,
        )
        protocol: Sender | Receiver = (
            Sender(me, settings) if self.role == "producer" else Receiver(me, settings)
        )
        self._pump = TransferPump(self.cfg, self.role, transport, endpoint, protocol,
                                  self.results, self.stats)
        self._pump.start()
        logger.info("kvpush: %s rank %d ready, control %s, %d KV regions, %d B per block",
                    self.role, self.tp_rank, me.control, len(layout.regions), block_bytes)

    # ------------------------------------------------------------------ per step
    def on_metadata(self, meta: PushMetadata) -> None:
        """Before the forward: D registers reserved blocks at once (REGISTER leaves early)."""
        pump = self._pump
        if pump is None:
            return
        for spec in meta.recv:
            address = f"tcp://{spec.p_host}:{spec.p_port + self.tp_rank}"
            pump.submit(lambda r, s=spec, a=address: r.expect(
                s.transfer_id, s.request_id, a, s.block_ids, s.first_block, s.num_tokens,
                time.monotonic()))
        for ref in meta.not_needed:
            address = f"tcp://{ref.p_host}:{ref.p_port + self.tp_rank}"
            pump.submit(lambda r, tid=ref.transfer_id, a=address: r.not_needed(tid, a))
        for tid in meta.abort_recv:
            pump.submit(lambda r, t=tid: r.abort(t, time.monotonic()))
        for tid in meta.abort_send:
            pump.submit(lambda s, t=tid: s.abort(t, time.monotonic()))
        for tid in meta.hold:
            pump.submit(lambda s, t=tid: s.hold(t))
        self._pending_sends.extend(meta.send)

    def after_forward(self) -> None:
        """P: this step's prompts are computed; hand their blocks to the pump."""
        if not self._pending_sends or self._pump is None:
            return
        if self._device == "cuda":
            import torch

            torch.cuda.current_stream().synchronize()  # KV must be in memory before a WRITE
        sends, self._pending_sends = self._pending_sends, []
        for spec in sends:
            self._pump.submit(lambda s, sp=spec: s.blocks_ready(
                sp.transfer_id, sp.request_id, sp.block_ids, time.monotonic()))

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        return self.results.take()

    def get_stats(self) -> dict[str, Any]:
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

    def __init__(self, cfg: KvpushConfig, role: str, transport: NixlTransport,
                 endpoint: ControlEndpoint, protocol: Sender | Receiver, results: _Results,
                 stats: StatsBuffer) -> None:
        super().__init__(name=f"kvpush-pump-{role}", daemon=True)
        self.cfg = cfg
        self.role = role
        self.transport = transport
        self.endpoint = endpoint
        self.protocol = protocol
        self.results = results
        self.stats = stats
        self._commands: queue.SimpleQueue[Callable[[Any], list[Action]]] = queue.SimpleQueue()
        self._halt = threading.Event()
        self._handles: dict[int, tuple[Any, float, int]] = {}  # chunk -> (handle, posted, bytes)
        self._peers: dict[str, RemotePeer] = {}  # agent name -> connected peer
        self._peer_of_rank: dict[tuple[str, int], str] = {}  # (engine, rank) -> agent name
        self._began: dict[str, float] = {}  # transfer id -> start time (for latency)
        self._labels = (role,)
        self._verify = cfg.verify.checksums
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
        while not self._halt.is_set():
            busy = bool(self._handles) or (
                isinstance(self.protocol, Receiver) and self.protocol.active > 0)
            try:
                actions: list[Action] = []
                for msg in self.endpoint.poll(active_poll if busy else idle_poll):
                    actions += self.protocol.on_message(msg, time.monotonic())
                while True:
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    actions += command(self.protocol)
                self._execute(actions)
                if self._handles:
                    self._check_chunks()
                if isinstance(self.protocol, Receiver) and self.protocol.active > 0:
                    self._check_notifications()
                now = time.monotonic()
                if now - self._last_tick >= 0.05:
                    self._last_tick = now
                    self._execute(self.protocol.tick(now))
                    self._count_endpoint_rejects()
            except Exception:  # noqa: BLE001 - the pump must survive to keep leases honest
                logger.exception("kvpush: transfer pump error (continuing)")
                time.sleep(0.01)

    def _execute(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, SendMessage):
                self.endpoint.send(action.address, action.msg)
            elif isinstance(action, PostWrite):
                self._post_write(action)
            elif isinstance(action, FinishSend):
                with self.results.lock:
                    self.results.sending.add(action.request_id)
                self._finish(action.transfer_id, action.outcome, action.nbytes)
            elif isinstance(action, FinishRecv):
                with self.results.lock:
                    self.results.recving.add(action.request_id)
                    if not action.ok:
                        self.results.failed.add(action.request_id)
                if action.reason:
                    logger.warning("kvpush: receive of %s ended %s: %s", action.transfer_id,
                                   action.outcome, action.reason)
                self._finish(action.transfer_id, action.outcome, 0)
            elif isinstance(action, Rejected):
                self.stats.inc("kvpush_control_messages_rejected", (self.role, action.reason))
                logger.warning("kvpush: rejected: %s", action.detail)

    def _finish(self, transfer_id: str, outcome: str, nbytes: int) -> None:
        self.stats.inc("kvpush_transfers", (self.role, outcome))
        started = self._began.pop(transfer_id, None)
        if outcome == "pushed" and started is not None:
            self.stats.observe("kvpush_transfer_seconds", self._labels,
                               time.monotonic() - started)
        if nbytes:
            self.stats.inc("kvpush_transfer_bytes", self._labels, nbytes)

    def _connect(self, peer: messages.PeerInfo) -> RemotePeer:
        remote = self._peers.get(peer.agent_name)
        if remote is not None:
            return remote
        assert peer.layout is not None
        key = (peer.engine_id, peer.rank)
        old = self._peer_of_rank.get(key)
        if old is not None and old != peer.agent_name:
            # Same engine and rank, new process: drop the stale agent before using the new one.
            logger.info("kvpush: peer %s rank %d restarted; reconnecting", *key)
            self.transport.disconnect(old)
            self._peers.pop(old, None)
        remote = self.transport.connect(peer.agent_meta, peer.layout)
        self._peers[peer.agent_name] = remote
        self._peer_of_rank[key] = peer.agent_name
        return remote

    def _post_write(self, action: PostWrite) -> None:
        t0 = time.monotonic()
        self._began.setdefault(action.transfer_id, t0)
        try:
            remote = self._connect(action.peer)
            notif = b""
            if action.done is not None:
                done = action.done
                if self._verify:
                    done = msgspec.structs.replace(done, checksum=self._checksum(
                        self.transport.layout, action.transfer_blocks or action.local_blocks))
                notif = messages.encode_done(done)
            handle = self.transport.post("WRITE", remote, action.local_blocks,
                                         action.remote_blocks, notif)
        except Exception as exc:  # noqa: BLE001 - any failure to post fails the chunk
            logger.warning("kvpush: WRITE for %s failed to post: %s", action.transfer_id, exc)
            self.stats.inc("kvpush_chunks", (self.role, "post_failed"))
            self._execute(self.protocol.on_chunk(action.chunk_id, False,
                                                 type(exc).__name__, time.monotonic()))
            return
        nbytes = len(action.local_blocks) * sum(r.block_len for r in self.transport.layout.regions)
        self._handles[action.chunk_id] = (handle, t0, nbytes)
        self.stats.observe("kvpush_chunk_post_seconds", self._labels, time.monotonic() - t0)

    def _check_chunks(self) -> None:
        now = time.monotonic()
        for cid, (handle, _posted, _nbytes) in list(self._handles.items()):
            state = self.transport.state(handle)
            if state == "PROC":
                continue
            del self._handles[cid]
            self.transport.release(handle)
            ok = state == "DONE"
            self.stats.inc("kvpush_chunks", (self.role, "ok" if ok else "error"))
            if not ok:
                logger.warning("kvpush: chunk %d failed: %s", cid, state)
            self._execute(self.protocol.on_chunk(cid, ok, "" if ok else state, now))

    def _check_notifications(self) -> None:
        receiver = self.protocol
        assert isinstance(receiver, Receiver)
        for _agent, notifs in self.transport.notifications().items():
            for raw in notifs:
                try:
                    done = messages.decode_done(raw)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    self._execute([Rejected("malformed", f"bad DONE notification: {exc}")])
                    continue
                if done is None:
                    continue
                verified = True
                if done.checksum >= 0:
                    blocks = receiver.blocks_of(done.transfer_id)
                    if blocks is not None:
                        verified = self._checksum(self.transport.layout, blocks) == done.checksum
                        if not verified:
                            logger.error("kvpush: checksum mismatch for %s", done.transfer_id)
                self._execute(receiver.on_done(done, time.monotonic(), verified))

    @staticmethod
    def _checksum(layout: messages.Layout, blocks: list[int]) -> int:
        crc = 0
        for region in layout.regions:
            for b in blocks:
                addr = region.base + b * region.block_stride
                crc = zlib.crc32(ctypes.string_at(addr, region.block_len), crc)
        return crc

    def _count_endpoint_rejects(self) -> None:
        for reason, n in self.endpoint.rejected.items():
            seen = self._reported_rejects.get(reason, 0)
            if n > seen:
                self.stats.inc("kvpush_control_messages_rejected", (self.role, reason), n - seen)
                self._reported_rejects[reason] = n
