"""CurveZMQ for a control endpoint: its key pair and allow-list, the ZAP handler that enforces
the list, and what each failed handshake means (the reason it is counted under)."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import zmq
from zmq.utils import z85

from kvpush_prod.control.keys import KeyPair, fingerprint, load_allowed, load_keypair
from kvpush_prod.errors import ConfigError
from kvpush_prod.vocabulary import RejectReason

# The ZAP domain of our ROUTERs; the handler answers for this domain only.
ZAP_DOMAIN = "kvpush"
HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
ZAP_REFUSED = 400  # the status our handler answers for a key not in the allow-list
_REFUSED = str(ZAP_REFUSED).encode()
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq sends ZAP requests (RFC 27)
ZAP_VERSION = b"1.0"
ZAP_DRAIN = 1000  # requests answered per wake-up; the rest wake the next poll


@dataclass(frozen=True)
class EndpointSecurity:
    """This engine's key pair and the allow-list (Z85 public key -> name) of its peers."""

    keypair: KeyPair
    allowed: Mapping[bytes, str]

    def __post_init__(self) -> None:
        if not self.allowed:
            raise ConfigError(
                "the allow-list is empty: no peer could connect or be sent to; "
                "list every engine's public key (control.allowed_keys)"
            )
        bad = [k for k in (self.keypair.public, *self.allowed) if len(k) != 40]
        if bad:
            raise ConfigError(
                f"{bad[0]!r} is not a 40-character Z85 public key; load keys "
                "with kvpush_prod.control.keys"
            )
        # A read-only copy: the ZAP thread reads it while the caller's mapping could change.
        object.__setattr__(self, "allowed", MappingProxyType(dict(self.allowed)))

    @classmethod
    def from_files(
        cls, key_file: str | os.PathLike[str], allowed_keys: str | os.PathLike[str]
    ) -> EndpointSecurity:
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


class AllowListAuthenticator:
    """The ZAP handler (RFC 27) of our ROUTER, with the allow-list as its only policy.

    A plain thread blocked in ``zmq_poll`` on the ZAP socket and a stop pipe: it sleeps
    until a handshake asks, answers every waiting request, and sleeps again. (pyzmq's
    ThreadAuthenticator runs an asyncio loop that re-wraps its sockets on every poll; in a
    busy engine process we want the smallest thing that cannot miss a wake-up.)
    """

    def __init__(
        self, context: zmq.Context[zmq.Socket[bytes]], allowed: Mapping[bytes, str]
    ) -> None:
        self.allow_list = _AllowList(allowed)
        self.answered: dict[bytes, int] = {b"200": 0, _REFUSED: 0, b"500": 0}  # by status
        self._zap = context.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)
        stop_at = f"inproc://kvpush-zap-stop-{id(self):x}"
        self._stop_r = context.socket(zmq.PAIR)
        self._stop_r.setsockopt(zmq.LINGER, 0)
        self._stop_r.bind(stop_at)
        self._stop_w = context.socket(zmq.PAIR)
        self._stop_w.setsockopt(zmq.LINGER, 0)
        self._stop_w.connect(stop_at)
        self._thread = threading.Thread(target=self._run, name="kvpush-zap", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and close its sockets; safe to call twice."""
        if self._stop_w.closed:
            return
        if self._thread.is_alive():
            self._stop_w.send(b"")
            self._thread.join(5.0)
        self._stop_w.close(0)
        if not self._thread.is_alive():  # else it closes them itself on its way out
            for sock in (self._zap, self._stop_r):
                sock.close(0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())  # sleeps, GIL released, until one is readable
                if self._stop_r in ready:
                    return
                for _ in range(ZAP_DRAIN):
                    try:
                        request = self._zap.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._zap.send_multipart(self.answer(request))
        except zmq.ZMQError:
            return  # the context was terminated under us: the endpoint is closing
        finally:
            for sock in (self._zap, self._stop_r):
                sock.close(0)

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply to ``request``: 200 with the client's Z85 key as User-Id for a key
        in the allow-list on our domain, 400 for anything else (a REP socket must answer
        every request, even one it cannot read, or it never receives again)."""
        request_id = request[1] if len(request) > 1 else b""
        status, text, user = _REFUSED, b"refused", b""
        if len(request) < 7 or request[0] != ZAP_VERSION:
            status, text = b"500", b"malformed ZAP request"
        else:
            domain, address, mechanism = request[2], request[3], request[5]
            if domain == ZAP_DOMAIN.encode() and mechanism == b"CURVE" and len(request[6]) == 32:
                key = z85.encode(request[6])
                self.allow_list.address = address.decode("utf-8", "replace")
                if self.allow_list.callback(ZAP_DOMAIN, key):
                    status, text, user = b"200", b"OK", key
        self.answered[status] += 1
        return [ZAP_VERSION, request_id, status, text, user, b""]


def handshake_reason(event: int, value: int, outbound: bool) -> tuple[RejectReason, str] | None:
    """The counter reason and a log explanation of a failed-handshake monitor event.

    ``outbound``: the event came from one of our connections to a peer (a DEALER), not
    from a client of our control port (the ROUTER). None for any other event.
    """
    if outbound:
        return _outbound_reason(event, value)
    return _inbound_reason(event, value)


def _outbound_reason(event: int, value: int) -> tuple[RejectReason, str] | None:
    """``handshake_reason`` of our connection to a peer (a DEALER)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            RejectReason.PEER_REFUSED_KEY,
            f"the peer refused this engine's key (ZAP status {value}): add this "
            "engine's .key file to the peer's allow-list",
        )
    if (
        event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    ):
        return (
            RejectReason.PEER_HANDSHAKE_FAILED,
            "the peer and this engine disagree on using keys (one runs without "
            "control.key_file): configure keys on both",
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return (
            RejectReason.PEER_HANDSHAKE_FAILED,
            "the handshake did not complete: it ran past its 5 s limit (seen on a "
            "host with more engine processes than cores), the peer dropped it, or "
            "the peer's key is not the one this engine holds for it (refresh the "
            "allow-list); ZMQ reconnects by itself",
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return (
            RejectReason.PEER_HANDSHAKE_FAILED,
            "the handshake failed; most often the peer's key is not the one this "
            "engine holds for it (it was regenerated): refresh the allow-list",
        )
    return None


def _inbound_reason(event: int, value: int) -> tuple[RejectReason, str] | None:
    """``handshake_reason`` of a client of our control port (the ROUTER)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        if value == ZAP_REFUSED:
            return (RejectReason.HANDSHAKE_UNKNOWN_KEY, "a client's key is not in the allow-list")
        return (
            RejectReason.HANDSHAKE_PROTOCOL,
            f"the ZAP handler answered status {value} (it may have stopped)",
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return (
                RejectReason.HANDSHAKE_CRYPTO,
                "a client's handshake does not decrypt: it holds another public key for "
                "this engine (a stale allow-list), or the bytes were replayed or altered",
            )
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return (
                RejectReason.HANDSHAKE_MECHANISM,
                "a client and this engine disagree on using keys (one runs without "
                "control.key_file)",
            )
        return (RejectReason.HANDSHAKE_PROTOCOL, f"ZMTP protocol error 0x{value:x}")
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return (
            RejectReason.HANDSHAKE_FAILED,
            "a client dropped or did not finish its handshake in time",
        )
    return None
