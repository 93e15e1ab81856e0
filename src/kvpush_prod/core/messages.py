"""Wire messages between engines: versioned msgspec Structs, encoded as msgpack.

Shared by the control channel (ZMQ frames) and the DONE notification carried by the last WRITE.
Every field is bounded here, so decoding rejects an oversized or out-of-range field before any
engine sees it.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

# The wire protocol's version, apart from the package's (docs/protocol.md, "Versions"): 3 adds
# the negotiation (a REGISTER names the versions its sender speaks; each side talks to each
# peer the highest both speak, ``core.protocol``). This build also speaks 2 (kvpush-prod
# 0.1.0), whose frames are the same Structs.
PROTOCOL_VERSION = 3

# Field bounds (decoding enforces them; a message over one is malformed and dropped).
MAX_ID_LEN = 256  # transfer ids, engine ids, agent names
MAX_ADDRESS_LEN = 300  # "tcp://host:port"
MAX_TEXT_LEN = 1024  # reasons and details
MAX_AGENT_META = 256 << 10  # NIXL agent metadata (a few hundred bytes to a few KiB)
MAX_REGIONS = 8192  # KV regions of one rank (layers x K/V x ...)
MAX_BLOCKS = 1 << 20  # block ids in one message, and blocks per region
MAX_LIVE = 1 << 16  # transfers listed in one heartbeat
U63 = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]  # generations, incarnations, addresses
Count = Annotated[int, Meta(ge=0, le=1 << 40)]
Id = Annotated[str, Meta(max_length=MAX_ID_LEN)]
TransferId = Annotated[str, Meta(min_length=1, max_length=MAX_ID_LEN)]
Address = Annotated[str, Meta(max_length=MAX_ADDRESS_LEN)]
Text = Annotated[str, Meta(max_length=MAX_TEXT_LEN)]
BlockIds = Annotated[list[Annotated[int, Meta(ge=0, le=1 << 40)]], Meta(max_length=MAX_BLOCKS)]
TtlMs = Annotated[int, Meta(ge=0, le=86_400_000)]
Rank = Annotated[int, Meta(ge=0, le=65_535)]
WallTime = Annotated[float, Meta(ge=0.0, le=1e11)]  # seconds since the epoch, 0: unknown
# The digest of the prompt's token ids the KV was computed for (``core.digest``); b"": none.
PromptDigest = Annotated[bytes, Meta(max_length=32)]

# Prefix of a NIXL notification that carries a Done message (lets a receiver skip foreign notifs).
NOTIF_PREFIX = b"KVP1"


class Region(msgspec.Struct, frozen=True):
    """One registered KV memory region, seen as ``num_blocks`` equal block slots.

    Block ``b`` of the region occupies ``[base + b * block_stride, + block_len)``. Inside a
    slot, ``tok_groups`` groups of the layout's ``block_size`` tokens, each token's bytes
    together (``[groups][tokens][bytes]``); 0 when the tensor does not tell (then no
    conversion between block sizes). ``tok_pattern`` sizes the groups when they differ.
    """

    base: U63
    block_stride: Count
    block_len: Annotated[int, Meta(ge=1, le=1 << 40)]
    num_blocks: Annotated[int, Meta(ge=1, le=MAX_BLOCKS)]
    dev_id: Annotated[int, Meta(ge=0, le=1 << 16)] = 0
    tok_groups: Annotated[int, Meta(ge=0, le=1 << 20)] = 0
    # The groups' token sizes when they are not all alike: one repeat of (groups, bytes per
    # token) runs, repeated through the block (vLLM's CPU "vec" kernel: per head, K as
    # head_size groups of one element per token, then V as one group of head_size); empty:
    # every group ``block_len / (tok_groups * block_size)`` bytes per token.
    tok_pattern: Annotated[
        list[tuple[Annotated[int, Meta(ge=1, le=1 << 20)], Annotated[int, Meta(ge=1, le=1 << 30)]]],
        Meta(max_length=4096),
    ] = []


MAX_FACTS = 32  # named facts of a layout (model, dtype, block size, versions, ...)
FactName = Annotated[str, Meta(min_length=1, max_length=32)]
FactValue = Annotated[str, Meta(max_length=200)]


class Layout(msgspec.Struct, frozen=True):
    """How an engine rank's KV cache is laid out; both sides must agree on ``compat``.

    ``facts`` name what ``compat`` hashes (and the model, its revision and the versions),
    so a mismatch can be reported value by value (``core.compat``)."""

    compat: Id  # hash of model shape, dtype, per-token bytes of each region per KV head
    mem_type: Literal["DRAM", "VRAM"]
    regions: Annotated[list[Region], Meta(max_length=MAX_REGIONS)]
    facts: Annotated[dict[FactName, FactValue], Meta(max_length=MAX_FACTS)] = {}
    # Tensor parallelism (``core.tpmap``): this rank of ``tp_size``; each region's block
    # holds ``kv_heads`` KV heads one after the other (head-major: head h is the h-th equal
    # slab of the block), 0 when the block interior is not head-major (or cannot be told),
    # out of the model's ``total_kv_heads``; ``replicated``: every rank holds all of them (MLA).
    tp_size: Annotated[int, Meta(ge=1, le=65_536)] = 1
    tp_rank: Rank = 0
    kv_heads: Annotated[int, Meta(ge=0, le=65_536)] = 0
    total_kv_heads: Annotated[int, Meta(ge=0, le=65_536)] = 0
    replicated: bool = False
    # Tokens per KV block (vLLM's --block-size), 0 when not told: the two sides may differ
    # when every region's token geometry is known (``core.blocksize``).
    block_size: Annotated[int, Meta(ge=0, le=1 << 20)] = 0


class PeerInfo(msgspec.Struct, frozen=True):
    """Who sent a message: engine, process incarnation, rank, and how to reach it."""

    engine_id: Id
    incarnation: U63  # random per process start: a restarted peer is a new peer
    rank: Rank
    control: Address  # "tcp://host:port" of this rank's control endpoint
    agent_name: Id = ""
    agent_meta: Annotated[bytes, Meta(max_length=MAX_AGENT_META)] = b""  # NIXL agent metadata
    layout: Layout | None = None


class Register(msgspec.Struct, tag="register", frozen=True):
    """D -> P: D reserved ``block_ids`` for ``transfer_id`` and grants a write permit on them.

    ``first_block`` is the index, in P's block list of the prompt, of ``block_ids[0]``: blocks
    before it are already on D (prefix-cache hit) and must not be written.
    """

    v: int
    transfer_id: TransferId
    sender: PeerInfo
    block_ids: BlockIds
    first_block: Count
    num_tokens: Count
    generation: U63
    permit_ttl_ms: TtlMs
    sent_at: WallTime = (
        0.0  # sender's wall clock when sent: the receiver subtracts the message's age
    )


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    """Either way: the sender is alive and still holds these (transfer_id, generation) leases.

    From P it renews D's reservations (P is still pushing); from D it renews P's send leases
    (D still waits). ``peer_incarnation`` is the receiver incarnation the sender believes in.
    """

    v: int
    sender: PeerInfo
    peer_incarnation: U63
    live: Annotated[list[tuple[TransferId, U63]], Meta(max_length=MAX_LIVE)]
    permit_ttl_ms: TtlMs = 0  # from D: the permits of ``live`` are renewed for this long
    sent_at: WallTime = 0.0


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    """D -> P: stop pushing ``transfer_id`` (D aborted); P answers CancelAck once nothing is in flight."""

    v: int
    transfer_id: TransferId
    generation: U63
    sender: PeerInfo
    reason: Text


class CancelAck(msgspec.Struct, tag="cancel_ack", frozen=True):
    """P -> D: no WRITE for (transfer_id, generation) is or will be in flight: D may reuse its blocks."""

    v: int
    transfer_id: TransferId
    generation: U63
    sender: PeerInfo


class Failed(msgspec.Struct, tag="failed", frozen=True):
    """P -> D: P will not complete this transfer and nothing is in flight; D fails the receive now."""

    v: int
    transfer_id: TransferId
    generation: U63
    sender: PeerInfo
    reason: Text
    detail: Text = ""


class Fallback(msgspec.Struct, tag="fallback", frozen=True):
    """P -> D: the push failed; D should pull (READ) ``block_ids`` from P, then send PullDone."""

    v: int
    transfer_id: TransferId
    generation: U63
    sender: PeerInfo
    block_ids: BlockIds
    first_block: Count
    reason: Text
    permit_ttl_ms: TtlMs = 30_000  # D may READ P's blocks for this long
    checksum: Annotated[int, Meta(ge=-1, le=(1 << 32) - 1)] = -1
    sent_at: WallTime = 0.0
    prompt: PromptDigest = b""  # what P's blocks hold the KV of (D checks it is its prompt)


class PullDone(msgspec.Struct, tag="pull_done", frozen=True):
    """D -> P: D finished (or gave up) pulling; P may free its blocks."""

    v: int
    transfer_id: TransferId
    generation: U63
    sender: PeerInfo
    ok: bool


class Done(msgspec.Struct, tag="done", frozen=True):
    """P -> D, as the notification of the last WRITE: every block of the transfer has landed.

    ``attempt``: which post of the last chunk carries it (0: the first). D takes no DONE of
    an attempt it already told P had not arrived (``DoneState`` pending): that post may
    still land late, after the re-post, and must not end the receive under it."""

    v: int
    transfer_id: TransferId
    generation: U63
    num_blocks: Count
    checksum: Annotated[
        int, Meta(ge=-1, le=(1 << 32) - 1)
    ] = -1  # crc32 of the blocks P wrote when verification is on, else -1
    attempt: Annotated[int, Meta(ge=0, le=1 << 16)] = 0
    # Tokens per unit when P and D block sizes differ (``num_blocks`` then counts units and
    # the checksum runs over unit pieces, ``core.blocksize``); 0: whole blocks.
    unit_tokens: Annotated[int, Meta(ge=0, le=1 << 20)] = 0
    # The digest of the prompt P computed this KV for: D takes it only for a request whose
    # own prompt has the same digest (a replayed or re-bound leg cannot swap prompts).
    prompt: PromptDigest = b""


class DoneQuery(msgspec.Struct, tag="done_query", frozen=True):
    """P -> D: the post ``attempt`` of the last chunk failed at P, but its DONE may have
    landed: did it? D answers with ``DoneState``; from then on D ignores that attempt's
    DONE if it had not arrived (so P may post the last chunk again)."""

    v: int
    transfer_id: TransferId
    generation: U63
    sender: PeerInfo
    attempt: Annotated[int, Meta(ge=0, le=1 << 16)] = 0


DoneStateName = Literal["done", "pending", "gone"]


class DoneState(msgspec.Struct, tag="done_state", frozen=True):
    """D -> P, the answer to a ``DoneQuery``: ``done`` (the DONE of this generation arrived:
    the transfer is pushed), ``pending`` (it did not; D still waits, and ignores that
    attempt's DONE from now on), ``gone`` (D no longer receives this transfer)."""

    v: int
    transfer_id: TransferId
    generation: U63
    sender: PeerInfo
    attempt: Annotated[int, Meta(ge=0, le=1 << 16)]
    state: DoneStateName


ControlMessage = (
    Register | Heartbeat | Cancel | CancelAck | Failed | Fallback | PullDone | DoneQuery | DoneState
)

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
