"""The push protocol of one worker rank, as two sans-IO engines: Sender (P) and Receiver (D).

They take events (a REGISTER arrived, blocks are ready, a chunk completed, time passed) and
return actions for the shell to carry out; they never touch sockets, NIXL or the clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpush_prod.core.messages import (
    PROTOCOL_VERSION,
    Cancel,
    CancelAck,
    ControlMessage,
    Done,
    Failed,
    PeerInfo,
    Register,
)

# ----------------------------------------------------------------------------------------------
# Actions


@dataclass(frozen=True)
class SendMessage:
    """Send ``msg`` to the control endpoint at ``address``."""

    address: str
    msg: ControlMessage


@dataclass(frozen=True)
class PostWrite:
    """WRITE local blocks into the peer's blocks; ``done`` rides on it as the notification."""

    chunk_id: int
    transfer_id: str
    peer: PeerInfo
    local_blocks: list[int]
    remote_blocks: list[int]
    done: Done | None
    transfer_blocks: list[int] | None = None  # on the last chunk: every local block pushed


@dataclass(frozen=True)
class FinishSend:
    """P no longer needs the request's blocks (pushed, cancelled, failed or lease expired)."""

    request_id: str
    transfer_id: str
    outcome: str  # "pushed" | "cancelled" | "failed" | "expired"
    nbytes: int = 0


@dataclass(frozen=True)
class FinishRecv:
    """D's receive ended; ``ok`` False means the KV did not (fully) arrive."""

    request_id: str
    transfer_id: str
    ok: bool
    outcome: str  # "pushed" | "failed" | "expired" | "aborted"
    reason: str = ""


@dataclass(frozen=True)
class Rejected:
    """An inbound message or notification was dropped (count it by ``reason``)."""

    reason: str
    detail: str


Action = SendMessage | PostWrite | FinishSend | FinishRecv | Rejected


@dataclass(frozen=True)
class PushSettings:
    """Protocol knobs of one rank (plain numbers: the shell maps the YAML config onto them)."""

    block_bytes: int  # bytes of one block across all regions of this rank
    chunk_blocks: int  # most blocks in one WRITE
    send_lease_s: float  # P holds finished blocks this long without a REGISTER
    stop_margin_s: float  # P posts nothing later than permit expiry minus this
    permit_ttl_s: float  # D's write permit term
    skew_margin_s: float  # D reuses blocks only this long after permit expiry
    tombstone_s: float = 120.0  # how long P remembers a cancelled/aborted transfer


class SendState(enum.Enum):
    WAITING = "waiting"  # blocks or registration still missing
    PUSHING = "pushing"
    DRAINING = "draining"  # cancelled or failed: waiting for in-flight chunks to complete
    CLOSED = "closed"


@dataclass
class _Outgoing:
    transfer_id: str
    request_id: str | None = None
    blocks: list[int] | None = None
    blocks_at: float = 0.0
    held: bool = False  # the scheduler has handed the blocks to us (request finished)
    reg: Register | None = None
    permit_deadline: float = 0.0
    state: SendState = SendState.WAITING
    next_block: int = 0  # index into reg.block_ids of the next block to post
    inflight: set[int] = field(default_factory=set)
    outcome: str = ""
    fail_reason: str = ""
    pushed_bytes: int = 0
    finished: bool = False  # FinishSend emitted


class Sender:
    """P side of one rank: pair blocks with REGISTERs, push them, report when blocks are free."""

    def __init__(self, me: PeerInfo, settings: PushSettings) -> None:
        self.me = me
        self.s = settings
        self._out: dict[str, _Outgoing] = {}
        self._chunks: dict[int, str] = {}  # chunk id -> transfer id
        self._next_chunk = 1
        self._tombstones: dict[str, float] = {}  # transfer id -> forget-at

    # -- introspection
    @property
    def active(self) -> int:
        return len(self._out)

    def inflight_chunks(self) -> int:
        return len(self._chunks)

    def held_blocks(self) -> int:
        return sum(len(o.blocks or ()) for o in self._out.values() if not o.finished)

    # -- events from the engine
    def blocks_ready(self, transfer_id: str, request_id: str, blocks: list[int],
                     now: float) -> list[Action]:
        """The prompt's KV is computed in ``blocks`` (this step's forward has finished)."""
        o = self._out.setdefault(transfer_id, _Outgoing(transfer_id))
        o.request_id, o.blocks, o.blocks_at = request_id, list(blocks), now
        if transfer_id in self._tombstones:
            # D said it does not want this transfer: free once the scheduler hands it over.
            o.state, o.outcome = SendState.CLOSED, "cancelled"
            return self._maybe_finish(o)
        return self._maybe_start(o, now)

    def hold(self, transfer_id: str) -> list[Action]:
        """The scheduler finished the request and left its blocks to us until FinishSend."""
        o = self._out.get(transfer_id)
        if o is None:
            return []
        o.held = True
        return self._maybe_finish(o)

    def abort(self, transfer_id: str, now: float) -> list[Action]:
        """P's request ended before its KV was computed: the transfer can never happen."""
        self._tombstones[transfer_id] = now + self.s.tombstone_s
        o = self._out.pop(transfer_id, None)
        if o is not None and o.reg is not None:
            return [self._failed(o.reg, "prefill_aborted", "the prefill request was aborted")]
        return []

    # -- events from the network
    def on_message(self, msg: ControlMessage, now: float) -> list[Action]:
        if isinstance(msg, Register):
            return self._on_register(msg, now)
        if isinstance(msg, Cancel):
            return self._on_cancel(msg, now)
        return [Rejected("unexpected", f"{type(msg).__name__} is not for a prefill engine")]

    def _on_register(self, reg: Register, now: float) -> list[Action]:
        if reg.transfer_id in self._tombstones:
            return [self._failed(reg, "prefill_aborted", "the prefill request is gone")]
        o = self._out.setdefault(reg.transfer_id, _Outgoing(reg.transfer_id))
        if o.reg is not None:
            if reg.generation == o.reg.generation:
                return []  # duplicate: idempotent
            if reg.generation < o.reg.generation or o.state is not SendState.WAITING:
                return [Rejected("stale_generation",
                                 f"REGISTER {reg.transfer_id} generation {reg.generation} "
                                 f"after {o.reg.generation}")]
        o.reg = reg
        o.permit_deadline = now + reg.permit_ttl_ms / 1000.0
        return self._maybe_start(o, now)

    def _on_cancel(self, msg: Cancel, now: float) -> list[Action]:
        o = self._out.get(msg.transfer_id)
        ack = SendMessage(msg.sender.control, CancelAck(PROTOCOL_VERSION, msg.transfer_id,
                                                        msg.generation, self.me))
        if o is None:
            # Blocks may still arrive: remember, so they are freed instead of pushed.
            self._tombstones[msg.transfer_id] = now + self.s.tombstone_s
            return [ack]
        if o.reg is not None and msg.generation not in (0, o.reg.generation):
            return [Rejected("stale_generation",
                             f"CANCEL {msg.transfer_id} generation {msg.generation}, "
                             f"current {o.reg.generation}")]
        self._tombstones[msg.transfer_id] = now + self.s.tombstone_s
        o.outcome = "cancelled"
        if o.state is SendState.PUSHING and o.inflight:
            o.state = SendState.DRAINING  # the ack goes out once in-flight chunks drain
            return []
        o.state = SendState.CLOSED
        return [ack, *self._maybe_finish(o)]

    def on_chunk(self, chunk_id: int, ok: bool, error: str, now: float) -> list[Action]:
        """A posted chunk completed (``ok``) or failed with transport error ``error``."""
        tid = self._chunks.pop(chunk_id, None)
        if tid is None:
            return []
        o = self._out.get(tid)
        if o is None:
            return []
        o.inflight.discard(chunk_id)
        if not ok and o.state is SendState.PUSHING:
            o.state, o.outcome, o.fail_reason = SendState.DRAINING, "failed", error
        if o.state is SendState.PUSHING:
            return self._post_next(o, now)
        if o.state is SendState.DRAINING and not o.inflight:
            return self._close_drained(o)
        return []

    def tick(self, now: float) -> list[Action]:
        """Expire send leases, unusable permits and old tombstones."""
        out: list[Action] = []
        for tid in [t for t, at in self._tombstones.items() if at <= now]:
            del self._tombstones[tid]
        for o in list(self._out.values()):
            if o.state is SendState.WAITING:
                if o.blocks is not None and o.reg is None and now - o.blocks_at > self.s.send_lease_s:
                    o.state, o.outcome = SendState.CLOSED, "expired"
                    out.extend(self._maybe_finish(o))
                elif o.reg is not None and now >= o.permit_deadline - self.s.stop_margin_s:
                    # D's permit ran out before the blocks arrived: D fails the receive itself.
                    o.state, o.outcome = SendState.CLOSED, "expired"
                    out.extend(self._maybe_finish(o))
            elif o.state is SendState.PUSHING and now >= o.permit_deadline - self.s.stop_margin_s:
                o.state, o.outcome, o.fail_reason = SendState.DRAINING, "failed", "permit_expired"
                if not o.inflight:
                    out.extend(self._close_drained(o))
        return out

    # -- internals
    def _maybe_start(self, o: _Outgoing, now: float) -> list[Action]:
        if o.state is not SendState.WAITING or o.blocks is None or o.reg is None:
            return []
        reg = o.reg
        problem = self._check(o.blocks, reg)
        if problem:
            o.state, o.outcome = SendState.CLOSED, "failed"
            return [self._failed(reg, "bad_blocks", problem), *self._maybe_finish(o)]
        if now >= o.permit_deadline - self.s.stop_margin_s:
            o.state, o.outcome = SendState.CLOSED, "expired"
            return self._maybe_finish(o)
        o.state = SendState.PUSHING
        return self._post_next(o, now)

    def _check(self, blocks: list[int], reg: Register) -> str:
        layout = reg.sender.layout
        limit = layout.regions[0].num_blocks if layout and layout.regions else 0
        if reg.first_block < 0 or reg.first_block + len(reg.block_ids) != len(blocks):
            return (f"REGISTER has {len(reg.block_ids)} blocks from block {reg.first_block}, "
                    f"but the prompt fills {len(blocks)} blocks on the prefill engine")
        bad = [b for b in reg.block_ids if b < 0 or b >= limit]
        if bad:
            return f"block ids {bad[:5]} outside the decode KV cache of {limit} blocks"
        return ""

    def _post_next(self, o: _Outgoing, now: float) -> list[Action]:
        assert o.reg is not None and o.blocks is not None
        reg = o.reg
        total = len(reg.block_ids)
        if o.next_block >= total:
            if not o.inflight:
                o.state, o.outcome = SendState.CLOSED, "pushed"
                return self._maybe_finish(o)
            return []
        out: list[Action] = []
        # Chunks before the last go out together; the last one carries DONE and leaves only
        # after all others completed, since separate WRITEs are not ordered on the wire.
        while o.next_block < total:
            end = min(o.next_block + self.s.chunk_blocks, total)
            last = end == total
            if last and o.inflight:
                break
            cid = self._next_chunk
            self._next_chunk += 1
            self._chunks[cid] = o.transfer_id
            o.inflight.add(cid)
            local = o.blocks[reg.first_block + o.next_block: reg.first_block + end]
            remote = reg.block_ids[o.next_block:end]
            done = Done(PROTOCOL_VERSION, o.transfer_id, reg.generation, total) if last else None
            everything = o.blocks[reg.first_block:] if last else None
            out.append(PostWrite(cid, o.transfer_id, reg.sender, local, remote, done, everything))
            o.pushed_bytes += (end - o.next_block) * self.s.block_bytes
            o.next_block = end
        return out

    def _close_drained(self, o: _Outgoing) -> list[Action]:
        o.state = SendState.CLOSED
        out: list[Action] = []
        if o.reg is not None:
            if o.outcome == "cancelled":
                out.append(SendMessage(o.reg.sender.control,
                                       CancelAck(PROTOCOL_VERSION, o.transfer_id,
                                                 o.reg.generation, self.me)))
            else:
                out.append(self._failed(o.reg, o.fail_reason or "write_failed",
                                        "the push could not complete"))
        return out + self._maybe_finish(o)

    def _maybe_finish(self, o: _Outgoing) -> list[Action]:
        if o.state is not SendState.CLOSED:
            return []
        if o.blocks is None:
            # Never got blocks (registration only): nothing to free.
            self._out.pop(o.transfer_id, None)
            return []
        if not o.held or o.finished:
            return []
        o.finished = True
        self._out.pop(o.transfer_id, None)
        assert o.request_id is not None
        nbytes = o.pushed_bytes if o.outcome == "pushed" else 0
        return [FinishSend(o.request_id, o.transfer_id, o.outcome or "pushed", nbytes)]

    def _failed(self, reg: Register, reason: str, detail: str) -> SendMessage:
        return SendMessage(reg.sender.control, Failed(PROTOCOL_VERSION, reg.transfer_id,
                                                      reg.generation, self.me, reason, detail))


# ----------------------------------------------------------------------------------------------
# Receiver


class RecvState(enum.Enum):
    WAITING = "waiting"  # REGISTER sent, waiting for DONE
    CANCELLING = "cancelling"  # aborted: waiting for CancelAck or the fence


@dataclass
class _Incoming:
    transfer_id: str
    request_id: str
    p_address: str
    generation: int
    blocks: list[int]
    permit_deadline: float
    state: RecvState = RecvState.WAITING


class Receiver:
    """D side of one rank: register reserved blocks with P, wait for DONE, fence on abort."""

    def __init__(self, me: PeerInfo, settings: PushSettings) -> None:
        self.me = me
        self.s = settings
        self._in: dict[str, _Incoming] = {}
        self._generation = 0

    @property
    def active(self) -> int:
        return len(self._in)

    def reserved_blocks(self) -> int:
        return sum(len(i.blocks) for i in self._in.values())

    def blocks_of(self, transfer_id: str) -> list[int] | None:
        inc = self._in.get(transfer_id)
        return None if inc is None else inc.blocks

    def expect(self, transfer_id: str, request_id: str, p_address: str, blocks: list[int],
               first_block: int, num_tokens: int, now: float) -> list[Action]:
        """D reserved ``blocks``: grant P a write permit on them."""
        if transfer_id in self._in:
            return [Rejected("duplicate", f"transfer {transfer_id} is already being received")]
        self._generation += 1
        inc = _Incoming(transfer_id, request_id, p_address, self._generation, list(blocks),
                        now + self.s.permit_ttl_s)
        self._in[transfer_id] = inc
        reg = Register(PROTOCOL_VERSION, transfer_id, self.me, list(blocks), first_block,
                       num_tokens, inc.generation, int(self.s.permit_ttl_s * 1000))
        return [SendMessage(p_address, reg)]

    def not_needed(self, transfer_id: str, p_address: str) -> list[Action]:
        """D will not receive this transfer (computes locally): let P free its blocks now."""
        return [SendMessage(p_address, Cancel(PROTOCOL_VERSION, transfer_id, 0, self.me,
                                              "not_needed"))]

    def abort(self, transfer_id: str, now: float) -> list[Action]:
        """D's request was aborted while waiting: stop P, then release the blocks safely."""
        inc = self._in.get(transfer_id)
        if inc is None or inc.state is not RecvState.WAITING:
            return []
        inc.state = RecvState.CANCELLING
        return [SendMessage(inc.p_address, Cancel(PROTOCOL_VERSION, transfer_id, inc.generation,
                                                  self.me, "aborted"))]

    def on_done(self, done: Done, now: float, verified: bool = True) -> list[Action]:
        inc = self._in.get(done.transfer_id)
        if inc is None:
            return [Rejected("unknown_transfer", f"DONE for unknown transfer {done.transfer_id}")]
        if done.generation != inc.generation:
            return [Rejected("stale_generation",
                             f"DONE {done.transfer_id} generation {done.generation}, "
                             f"expected {inc.generation}")]
        del self._in[done.transfer_id]
        if inc.state is RecvState.CANCELLING:
            return [FinishRecv(inc.request_id, inc.transfer_id, True, "aborted")]
        if not verified:
            return [FinishRecv(inc.request_id, inc.transfer_id, False, "failed",
                               "checksum_mismatch")]
        return [FinishRecv(inc.request_id, inc.transfer_id, True, "pushed")]

    def on_message(self, msg: ControlMessage, now: float) -> list[Action]:
        if not isinstance(msg, (Failed, CancelAck)):
            return [Rejected("unexpected", f"{type(msg).__name__} is not for a decode engine")]
        inc = self._in.get(msg.transfer_id)
        if inc is None:
            return [Rejected("unknown_transfer",
                             f"{type(msg).__name__} for unknown transfer {msg.transfer_id}")]
        if msg.generation != inc.generation:
            return [Rejected("stale_generation",
                             f"{type(msg).__name__} {msg.transfer_id} generation "
                             f"{msg.generation}, expected {inc.generation}")]
        del self._in[msg.transfer_id]
        if inc.state is RecvState.CANCELLING:
            return [FinishRecv(inc.request_id, inc.transfer_id, True, "aborted")]
        if isinstance(msg, Failed):
            return [FinishRecv(inc.request_id, inc.transfer_id, False, "failed", msg.reason)]
        return [FinishRecv(inc.request_id, inc.transfer_id, False, "failed", "cancelled_by_peer")]

    def tick(self, now: float) -> list[Action]:
        """Fail receives whose permit expired (plus skew margin: P has stopped writing)."""
        out: list[Action] = []
        for inc in list(self._in.values()):
            if now >= inc.permit_deadline + self.s.skew_margin_s:
                del self._in[inc.transfer_id]
                if inc.state is RecvState.CANCELLING:
                    out.append(FinishRecv(inc.request_id, inc.transfer_id, True, "aborted"))
                else:
                    out.append(FinishRecv(inc.request_id, inc.transfer_id, False, "expired",
                                          "permit_expired"))
        return out
