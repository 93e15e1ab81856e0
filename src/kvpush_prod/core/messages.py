"""Wire messages between engines: versioned msgspec Structs, encoded as msgpack.

Shared by the control channel (ZMQ frames) and the DONE notification carried by the last WRITE.
"""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 1

# Prefix of a NIXL notification that carries a Done message (lets a receiver skip foreign notifs).
NOTIF_PREFIX = b"KVP1"


class Region(msgspec.Struct, frozen=True):
    """One registered KV memory region, seen as ``num_blocks`` equal block slots.

    Block ``b`` of the region occupies ``[base + b * block_stride, + block_len)``.
    """

    base: int
    block_stride: int
    block_len: int
    num_blocks: int
    dev_id: int = 0


class Layout(msgspec.Struct, frozen=True):
    """How an engine rank's KV cache is laid out; both sides must agree on ``compat``."""

    compat: str  # hash of model shape, dtype, block size, tp size, region block lengths
    mem_type: str  # "DRAM" or "VRAM"
    regions: list[Region]


class PeerInfo(msgspec.Struct, frozen=True):
    """Who sent a message: engine, process incarnation, rank, and how to reach it."""

    engine_id: str
    incarnation: int  # random per process start: a restarted peer is a new peer
    rank: int
    control: str  # "tcp://host:port" of this rank's control endpoint
    agent_name: str = ""
    agent_meta: bytes = b""  # NIXL agent metadata (a few hundred bytes)
    layout: Layout | None = None


class Register(msgspec.Struct, tag="register", frozen=True):
    """D -> P: D reserved ``block_ids`` for ``transfer_id`` and grants a write permit on them.

    ``first_block`` is the index, in P's block list of the prompt, of ``block_ids[0]``: blocks
    before it are already on D (prefix-cache hit) and must not be written.
    """

    v: int
    transfer_id: str
    sender: PeerInfo
    block_ids: list[int]
    first_block: int
    num_tokens: int
    generation: int
    permit_ttl_ms: int
    sent_at: float = 0.0  # sender's wall clock when sent: the receiver subtracts the message's age


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    """Either way: the sender is alive and still holds these (transfer_id, generation) leases.

    From P it renews D's reservations (P is still pushing); from D it renews P's send leases
    (D still waits). ``peer_incarnation`` is the receiver incarnation the sender believes in.
    """

    v: int
    sender: PeerInfo
    peer_incarnation: int
    live: list[tuple[str, int]]
    permit_ttl_ms: int = 0  # from D: the permits of ``live`` are renewed for this long
    sent_at: float = 0.0


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    """D -> P: stop pushing ``transfer_id`` (D aborted); P answers CancelAck once nothing is in flight."""

    v: int
    transfer_id: str
    generation: int
    sender: PeerInfo
    reason: str


class CancelAck(msgspec.Struct, tag="cancel_ack", frozen=True):
    """P -> D: no WRITE for (transfer_id, generation) is or will be in flight: D may reuse its blocks."""

    v: int
    transfer_id: str
    generation: int
    sender: PeerInfo


class Failed(msgspec.Struct, tag="failed", frozen=True):
    """P -> D: P will not complete this transfer and nothing is in flight; D fails the receive now."""

    v: int
    transfer_id: str
    generation: int
    sender: PeerInfo
    reason: str
    detail: str = ""


class Fallback(msgspec.Struct, tag="fallback", frozen=True):
    """P -> D: the push failed; D should pull (READ) ``block_ids`` from P, then send PullDone."""

    v: int
    transfer_id: str
    generation: int
    sender: PeerInfo
    block_ids: list[int]
    first_block: int
    reason: str
    permit_ttl_ms: int = 30_000  # D may READ P's blocks for this long
    checksum: int = -1
    sent_at: float = 0.0


class PullDone(msgspec.Struct, tag="pull_done", frozen=True):
    """D -> P: D finished (or gave up) pulling; P may free its blocks."""

    v: int
    transfer_id: str
    generation: int
    sender: PeerInfo
    ok: bool


class Done(msgspec.Struct, tag="done", frozen=True):
    """P -> D, as the notification of the last WRITE: every block of the transfer has landed."""

    v: int
    transfer_id: str
    generation: int
    num_blocks: int
    checksum: int = -1  # crc32 of the blocks P wrote when verification is on, else -1


ControlMessage = Register | Heartbeat | Cancel | CancelAck | Failed | Fallback | PullDone

_encoder = msgspec.msgpack.Encoder()
_control_decoder = msgspec.msgpack.Decoder(ControlMessage)
_done_decoder = msgspec.msgpack.Decoder(Done)


def encode(msg: ControlMessage | Done) -> bytes:
    """msgpack bytes of a message."""
    return _encoder.encode(msg)


def decode_control(data: bytes) -> ControlMessage:
    """Decode and type-check a control message; raises msgspec.ValidationError/DecodeError."""
    return _control_decoder.decode(data)


def encode_done(done: Done) -> bytes:
    """A NIXL notification payload carrying ``done``."""
    return NOTIF_PREFIX + _encoder.encode(done)


def decode_done(notif: bytes) -> Done | None:
    """The Done inside a notification, or None if the notification is not ours."""
    if not notif.startswith(NOTIF_PREFIX):
        return None
    return _done_decoder.decode(notif[len(NOTIF_PREFIX) :])
