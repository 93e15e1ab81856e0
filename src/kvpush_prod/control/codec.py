"""Sealing and opening control messages: one msgpack frame, size limit, protocol version.

Never pickle: a message is a typed msgspec Struct, so a malformed frame is a decode error.
Who sent it is not the codec's business: CurveZMQ authenticates the connection.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import msgspec

from kvpush_prod.core import messages
from kvpush_prod.errors import ProtocolError


class RejectReason(str, enum.Enum):
    """Why a control message or connection was dropped (the label of the rejection counter)."""

    # An inbound message, dropped before anything acted on it.
    OVERSIZE = "oversize"
    MALFORMED = "malformed"
    VERSION = "version"
    UNAUTHENTICATED = "unauthenticated"  # no allow-listed sender key on it (defence in depth)
    # Decided by the protocol core on a well-formed message.
    UNKNOWN_TRANSFER = "unknown_transfer"
    STALE_GENERATION = "stale_generation"
    BAD_BLOCKS = "bad_blocks"
    INCOMPATIBLE = "incompatible"
    # A connection to this engine's control port whose handshake failed (per attempt).
    HANDSHAKE_UNKNOWN_KEY = "handshake_unknown_key"  # client key not in the allow-list
    HANDSHAKE_CRYPTO = "handshake_crypto"  # client expects another key for us, or tampering
    HANDSHAKE_MECHANISM = "handshake_mechanism"  # plaintext client to CURVE, or the reverse
    HANDSHAKE_PROTOCOL = "handshake_protocol"  # any other ZMTP/CURVE protocol error
    HANDSHAKE_FAILED = "handshake_failed"  # dropped or timed out (HANDSHAKE_IVL) mid-way
    # An outbound message this engine did not send, or a connection of ours that failed.
    BAD_ADDRESS = "bad_address"  # not tcp://HOST:PORT with a sane host and port
    UNKNOWN_PEER_KEY = "unknown_peer_key"  # `to` empty or not in the allow-list
    OVERSIZE_OUTBOUND = "oversize_outbound"  # over control.max_message_bytes
    QUEUE_FULL = "queue_full"  # the peer's send queue is full (it is down or slow)
    NO_SOCKET = "no_socket"  # no socket could be opened (out of file descriptors)
    PEER_REFUSED_KEY = "peer_refused_key"  # the peer's allow-list lacks this engine's key
    PEER_HANDSHAKE_FAILED = "peer_handshake_failed"  # usually: its key is not the `to` we hold


class ControlCodec:
    """Turns messages into ZMQ frames ``[body]`` and back, enforcing the limits."""

    def __init__(self, max_message_bytes: int) -> None:
        self._max = max_message_bytes

    @property
    def max_message_bytes(self) -> int:
        return self._max

    def seal(self, msg: messages.ControlMessage) -> list[bytes]:
        body = messages.encode(msg)
        if len(body) > self._max:
            raise ProtocolError(
                RejectReason.OVERSIZE_OUTBOUND.value,
                f"outbound {type(msg).__name__} is {len(body)} bytes, over "
                f"control.max_message_bytes={self._max}",
            )
        return [body]

    def open(self, frames: Sequence[bytes]) -> messages.ControlMessage:
        """The message in ``frames``; raises ProtocolError(reason) when it must be dropped."""
        if len(frames) != 1:
            raise ProtocolError(
                RejectReason.MALFORMED.value, f"expected 1 frame [body], got {len(frames)}"
            )
        (body,) = frames
        if len(body) > self._max:
            raise ProtocolError(
                RejectReason.OVERSIZE.value,
                f"{len(body)} byte message over control.max_message_bytes={self._max}",
            )
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
