"""CurveZMQ for a control endpoint: its key pair and allow-list, the ZAP handler that enforces
the list, and what each failed handshake means (the reason it is counted under)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvpush_prod.control.codec import RejectReason
from kvpush_prod.control.keys import KeyPair, fingerprint, load_allowed, load_keypair
from kvpush_prod.errors import ConfigError

# The ZAP domain of our ROUTERs; the handler answers for this domain only.
ZAP_DOMAIN = "kvpush"
HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
ZAP_REFUSED = 400  # the status our handler answers for a key not in the allow-list


@dataclass(frozen=True)
class EndpointSecurity:
    """This engine's key pair and the allow-list (Z85 public key -> name) of its peers."""

    keypair: KeyPair
    allowed: Mapping[bytes, str]

    def __post_init__(self) -> None:
        if not self.allowed:
            raise ConfigError("the allow-list is empty: no peer could connect or be sent to; "
                              "list every engine's public key (control.allowed_keys)")
        bad = [k for k in (self.keypair.public, *self.allowed) if len(k) != 40]
        if bad:
            raise ConfigError(f"{bad[0]!r} is not a 40-character Z85 public key; load keys "
                              "with kvpush_prod.control.keys")
        # A read-only copy: the ZAP thread reads it while the caller's mapping could change.
        object.__setattr__(self, "allowed", MappingProxyType(dict(self.allowed)))

    @classmethod
    def from_files(cls, key_file: str | os.PathLike[str],
                   allowed_keys: str | os.PathLike[str]) -> EndpointSecurity:
        """From control.key_file (a ``.key_secret``) and control.allowed_keys."""
        return cls(load_keypair(key_file), load_allowed(allowed_keys))


class _AllowList:
    """The ZAP credentials callback: a client may connect iff its key is in the allow-list."""

    def __init__(self, allowed: Mapping[bytes, str]) -> None:
        self._keys = frozenset(allowed)
        self.address = ""  # of the client being checked (set by the authenticator)
        # The last refusal, for the endpoint's (rate-limited) log line; a tuple is
        # replaced whole, so the endpoint thread never sees half of one.
        self.last_refused: tuple[str, str] = ("", "")

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self._keys:
            return True
        self.last_refused = (self.address, fingerprint(key))
        return False


class AllowListAuthenticator(ThreadAuthenticator):
    """pyzmq's ZAP thread (it blocks on its sockets) with the allow-list as its only policy."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]],
                 allowed: Mapping[bytes, str]) -> None:
        super().__init__(context)
        self.allow_list = _AllowList(allowed)
        self.configure_curve_callback(ZAP_DOMAIN, self.allow_list)

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) > 3:  # [version, request id, domain, address, identity, mechanism, ...]
            self.allow_list.address = msg[3].decode("utf-8", "replace")
        await super().handle_zap_message(msg)


def handshake_reason(event: int, value: int, outbound: bool) -> tuple[RejectReason, str] | None:
    """The counter reason and a log explanation of a failed-handshake monitor event.

    ``outbound``: the event came from one of our connections to a peer (a DEALER), not
    from a client of our control port (the ROUTER). None for any other event.
    """
    if outbound:
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (RejectReason.PEER_REFUSED_KEY,
                    f"the peer refused this engine's key (ZAP status {value}): add this "
                    "engine's .key file to the peer's allow-list")
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and \
                value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return (RejectReason.PEER_HANDSHAKE_FAILED,
                    "the peer and this engine disagree on using keys (one runs without "
                    "control.key_file): configure keys on both")
        if event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
            return (RejectReason.PEER_HANDSHAKE_FAILED,
                    "the handshake failed; most often the peer's key is not the one this "
                    "engine holds for it (it was regenerated): refresh the allow-list")
        return None
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        if value == ZAP_REFUSED:
            return (RejectReason.HANDSHAKE_UNKNOWN_KEY,
                    "a client's key is not in the allow-list")
        return (RejectReason.HANDSHAKE_PROTOCOL,
                f"the ZAP handler answered status {value} (it may have stopped)")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return (RejectReason.HANDSHAKE_CRYPTO,
                    "a client's handshake does not decrypt: it holds another public key for "
                    "this engine (a stale allow-list), or the bytes were replayed or altered")
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return (RejectReason.HANDSHAKE_MECHANISM,
                    "a client and this engine disagree on using keys (one runs without "
                    "control.key_file)")
        return (RejectReason.HANDSHAKE_PROTOCOL, f"ZMTP protocol error 0x{value:x}")
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return (RejectReason.HANDSHAKE_FAILED,
                "a client dropped or did not finish its handshake in time")
    return None
