"""Sealing and opening control messages: msgpack body, optional HMAC-SHA256, size limit.

Never pickle: a message is a typed msgspec Struct, so a malformed frame is a decode error.
"""

from __future__ import annotations

import enum
import hashlib
import hmac

import msgspec

from kvpush_prod.core import messages
from kvpush_prod.errors import ProtocolError


class RejectReason(str, enum.Enum):
    """Why an inbound control message was dropped (the label of the rejection counter)."""

    OVERSIZE = "oversize"
    MALFORMED = "malformed"
    UNAUTHENTICATED = "unauthenticated"
    VERSION = "version"
    UNKNOWN_TRANSFER = "unknown_transfer"
    STALE_GENERATION = "stale_generation"
    BAD_BLOCKS = "bad_blocks"
    INCOMPATIBLE = "incompatible"


class ControlCodec:
    """Turns messages into ZMQ frames ``[mac, body]`` and back, enforcing the limits."""

    def __init__(self, secret: str | bytes | None, max_message_bytes: int) -> None:
        if isinstance(secret, str):
            secret = secret.encode()
        self._secret = secret or None
        self._max = max_message_bytes

    @property
    def max_message_bytes(self) -> int:
        return self._max

    @property
    def authenticated(self) -> bool:
        return self._secret is not None

    def _mac(self, body: bytes) -> bytes:
        assert self._secret is not None
        return hmac.new(self._secret, body, hashlib.sha256).digest()

    def seal(self, msg: messages.ControlMessage) -> list[bytes]:
        body = messages.encode(msg)
        if len(body) > self._max:
            raise ProtocolError(
                RejectReason.OVERSIZE.value,
                f"outbound {type(msg).__name__} is {len(body)} bytes, over "
                f"control.max_message_bytes={self._max}",
            )
        return [self._mac(body) if self._secret else b"", body]

    def open(self, frames: list[bytes]) -> messages.ControlMessage:
        """The message in ``frames``; raises ProtocolError(reason) when it must be dropped."""
        if len(frames) != 2:
            raise ProtocolError(
                RejectReason.MALFORMED.value, f"expected 2 frames [mac, body], got {len(frames)}"
            )
        mac, body = frames
        if len(body) > self._max or len(mac) > 64:
            raise ProtocolError(
                RejectReason.OVERSIZE.value,
                f"{len(body)} byte message over control.max_message_bytes={self._max}",
            )
        if self._secret is not None:
            if not mac:
                raise ProtocolError(
                    RejectReason.UNAUTHENTICATED.value,
                    "message without HMAC while control.secret is set",
                )
            if not hmac.compare_digest(mac, self._mac(body)):
                raise ProtocolError(RejectReason.UNAUTHENTICATED.value, "HMAC does not match")
        try:
            msg = messages.decode_control(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(RejectReason.MALFORMED.value, str(exc)) from None
        if msg.v != messages.PROTOCOL_VERSION:
            raise ProtocolError(
                RejectReason.VERSION.value,
                f"protocol version {msg.v}, this engine speaks {messages.PROTOCOL_VERSION}: "
                "run the same kvpush-prod version on prefill and decode",
            )
        return msg
