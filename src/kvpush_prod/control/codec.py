"""Sealing and opening control messages: one msgpack frame, size limit, protocol version
(the versions this build speaks, ``core.protocol``).

Never pickle: a message is a typed msgspec Struct, so a malformed frame is a decode error.
Who sent it is not the codec's business: CurveZMQ authenticates the connection. Only REGISTER
and FALLBACK may be as large as ``max_message_bytes``; every other kind is refused over
``SMALL_MESSAGE_BYTES`` before it is decoded (its kind read from the first bytes).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvpush_prod.core import messages, protocol
from kvpush_prod.core.quotas import SMALL_MESSAGE_BYTES
from kvpush_prod.core.vocabulary import RejectReason
from kvpush_prod.errors import ProtocolError

# The kinds that carry an agent's metadata, a layout and block ids: up to max_message_bytes.
LARGE_KINDS = frozenset({b"register", b"fallback"})
_TYPE_KEY = b"\xa4type"  # msgpack fixstr "type": the tag our encoder writes first


def kind_of(body: bytes) -> bytes | None:
    """The tag of ``body`` as our encoder writes it (a map whose first key is "type"), without
    decoding it; None when it does not start that way (then the smallest limit applies)."""
    if len(body) < 8:
        return None
    head = body[0]
    at = 1 if head & 0xF0 == 0x80 else 3 if head == 0xDE else -1  # fixmap, map16
    if at < 0 or body[at : at + 5] != _TYPE_KEY:
        return None
    tag = body[at + 5]
    if tag & 0xE0 != 0xA0:  # a fixstr: every tag is under 32 bytes
        return None
    start = at + 6
    return bytes(body[start : start + (tag & 0x1F)])


class ControlCodec:
    """Turns messages into ZMQ frames ``[body]`` and back, enforcing the limits: at most
    ``max_message_bytes``, and ``small_message_bytes`` for every kind but REGISTER and
    FALLBACK (a heartbeat, a notice, an answer)."""

    def __init__(
        self, max_message_bytes: int, small_message_bytes: int = SMALL_MESSAGE_BYTES
    ) -> None:
        self._max = max_message_bytes
        self._small = min(small_message_bytes, max_message_bytes)

    @property
    def max_message_bytes(self) -> int:
        return self._max

    def limit_of(self, body: bytes) -> tuple[int, str]:
        """The most bytes a message like ``body`` may have, and what it is (for the error)."""
        kind = kind_of(body)
        if kind is not None and kind in LARGE_KINDS:
            return self._max, kind.decode()
        return self._small, kind.decode("ascii", "replace") if kind else "unrecognised"

    def seal(self, msg: messages.ControlMessage) -> list[bytes]:
        body = messages.encode(msg)
        limit, kind = self.limit_of(body)
        if len(body) > limit:
            raise ProtocolError(
                RejectReason.OVERSIZE_OUTBOUND.value,
                f"outbound {type(msg).__name__} is {len(body)} bytes, over {limit} "
                f"(control.max_message_bytes={self._max}; a {kind} message at most "
                f"{self._small} unless a REGISTER or FALLBACK)",
            )
        return [body]

    def open(self, frames: Sequence[bytes]) -> messages.ControlMessage:
        """The message in ``frames``; raises ProtocolError(reason) when it must be dropped."""
        if len(frames) != 1:
            raise ProtocolError(
                RejectReason.MALFORMED.value, f"expected 1 frame [body], got {len(frames)}"
            )
        (body,) = frames
        limit, kind = self.limit_of(body)
        if len(body) > limit:
            raise ProtocolError(
                RejectReason.OVERSIZE.value,
                f"{len(body)} byte {kind} message over {limit} bytes (control.max_message_bytes"
                f"={self._max}; only REGISTER and FALLBACK may be over {self._small})",
            )
        try:
            msg = messages.decode_control(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(RejectReason.MALFORMED.value, str(exc)) from None
        if not protocol.accepts(msg):
            raise ProtocolError(RejectReason.VERSION.value, protocol.refusal(msg))
        return msg
