"""The probe on a control port: ``kvpush doctor --peer`` times round trips and a burst of bytes
over the engine's own control channel (same socket, keys and allow-list as its peers use).

A probe frame is not a control message: it starts with ``PROBE_PREFIX`` (never the start of a
msgpack map, which every control message is) and is answered on the same connection with a
fixed 32-byte reply (so a probe can never make the engine send more than it received), never
reaching the protocol core. With keys only an allow-listed key gets through the handshake.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

PROBE_PREFIX = b"\xc1kvpush-probe1"  # 0xc1: "never used" in msgpack, so no message starts so
REPLY_PREFIX = b"\xc1kvpush-pong01"
_REPLY = struct.Struct("!QQd")  # sequence, bytes received, the engine's wall clock (s)
_SEQ = struct.Struct("!Q")
REPLY_BYTES = len(REPLY_PREFIX) + _REPLY.size


def is_probe(body: bytes | memoryview) -> bool:
    """Whether a frame is a probe (read from its first bytes, without copying the rest)."""
    return bytes(body[: len(PROBE_PREFIX)]) == PROBE_PREFIX


def request(seq: int, payload_bytes: int = 0) -> bytes:
    """A probe frame numbered ``seq`` carrying ``payload_bytes`` of zeros."""
    return PROBE_PREFIX + _SEQ.pack(seq) + bytes(payload_bytes)


def reply(body: bytes, wall_s: float) -> bytes | None:
    """The engine's answer to a probe frame ``body`` (None when it is malformed)."""
    head = len(PROBE_PREFIX)
    if len(body) < head + _SEQ.size:
        return None
    (seq,) = _SEQ.unpack_from(body, head)
    return REPLY_PREFIX + _REPLY.pack(seq, len(body), wall_s)


@dataclass(frozen=True)
class Pong:
    seq: int
    received_bytes: int
    peer_wall_s: float


def parse_reply(body: bytes) -> Pong | None:
    if len(body) != REPLY_BYTES or not body.startswith(REPLY_PREFIX):
        return None
    seq, received, wall = _REPLY.unpack_from(body, len(REPLY_PREFIX))
    return Pong(seq, received, wall)
