"""A ZMQ control endpoint: a ROUTER that receives, a bounded set of DEALERs that send.

With keys, every connection is CurveZMQ: encrypted, and both ends proven by the allow-list.
Single-threaded by design: only the transfer pump thread touches the sockets.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import math
import os
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import zmq
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_fixed
from zmq.utils.monitor import parse_monitor_message

from kvpush_prod.control.addresses import address_problem, is_ipv6
from kvpush_prod.control.codec import ControlCodec, RejectReason
from kvpush_prod.control.keys import fingerprint
from kvpush_prod.control.security import (
    HANDSHAKE_EVENTS,
    ZAP_DOMAIN,
    AllowListAuthenticator,
    EndpointSecurity,
    handshake_reason,
)
from kvpush_prod.core import messages
from kvpush_prod.errors import ConfigError, ProtocolError
from kvpush_prod.loglimit import LogLimiter

logger = logging.getLogger(__name__)
BIND_WAIT_S = 10.0  # how long a taken control port is retried before giving up
HANDSHAKE_IVL_MS = 5000  # a connection not through its handshake by then is dropped
LOG_EVERY_S = 10.0  # at most one log line per rejection reason this often (all are counted)
MONITOR_DRAIN = 1000  # events read per monitor per wait; the rest wake the next wait
MIN_WAIT_MS = 1  # the shortest blocking wait: a caller looping on wait() never spins a core
SNDHWM = 10_000

Socket = zmq.Socket[bytes]


def ephemeral_range() -> tuple[int, int] | None:
    """This host's range of ports for outgoing connections (Linux), or None if unknown."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return None


def warn_if_ephemeral(port: int) -> None:
    """A listening port inside the ephemeral range can be taken, while this engine restarts, by
    any outgoing connection, even by a peer's reconnect attempt to it (TCP self-connect)."""
    rng = ephemeral_range()
    if rng is not None and rng[0] <= port <= rng[1]:
        logger.warning(
            "kvpush: control port %d is inside this host's ephemeral port range %d-%d "
            "(net.ipv4.ip_local_port_range); an outgoing connection may take it while the "
            "engine restarts. Set control.port below %d, or reserve it with "
            "net.ipv4.ip_local_reserved_ports", port, rng[0], rng[1], rng[0])


def _port_taken(exc: BaseException) -> bool:
    return isinstance(exc, zmq.ZMQError) and exc.errno == errno.EADDRINUSE


@dataclass(frozen=True)
class _Watch:
    """What a monitor socket watches: our ROUTER, or the DEALER to ``address``."""

    address: str
    outbound: bool


class ControlEndpoint:
    """Bind ``tcp://host:port``; ``receive`` yields valid inbound messages with their sender,
    ``send`` queues messages to peers; everything dropped is counted in ``rejected``.

    ``security`` None: plaintext, no authentication (loopback or a trusted network only).
    Otherwise the ROUTER is a CurveZMQ server with this engine's key pair that accepts only
    clients whose public key is in ``security.allowed``, and every DEALER proves the key
    its peer must hold.
    """

    def __init__(self, codec: ControlCodec, host: str, port: int,
                 security: EndpointSecurity | None = None, max_peers: int = 1024) -> None:
        if max_peers < 1:
            raise ConfigError(f"max_peers={max_peers}: must be at least 1")
        self._codec = codec
        self._security = security
        self._max_peers = max_peers
        self.rejected: Counter[str] = Counter()
        self.evictions = 0  # peer sockets closed to stay within max_peers
        self._log = LogLimiter(logger, LOG_EVERY_S)
        self._pending = False
        self._closed = False
        # A context of our own: the ZAP handler is per context, and so is the socket limit.
        self._ctx: zmq.Context[Socket] = zmq.Context()
        # Each peer costs a DEALER and the two ends of its monitor; closed sockets hold their
        # slot until ZMQ's reaper thread gets to them, which a burst of new peers can outrun.
        self._ctx.set(zmq.MAX_SOCKETS, 4 * max_peers + 4096)
        self._auth: AllowListAuthenticator | None = None
        self._peers: OrderedDict[tuple[str, str], tuple[Socket, Socket]] = OrderedDict()
        self._monitors: dict[Socket, _Watch] = {}
        self._monitor_ids = itertools.count()
        self._poller = zmq.Poller()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, zmq.POLLIN)
        try:
            if security is not None:
                # Started before the bind: no connection may ever be accepted unchecked.
                self._auth = AllowListAuthenticator(self._ctx, security.allowed)
                self._auth.start()
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            # A frame bigger than this is dropped by ZMQ itself before we allocate it.
            self._router.setsockopt(zmq.MAXMSGSIZE, codec.max_message_bytes + 4096)
            self._router.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
            if security is not None:
                self._router.curve_secretkey = security.keypair.secret
                self._router.curve_publickey = security.keypair.public
                self._router.curve_server = True
                self._router.zap_domain = ZAP_DOMAIN.encode()
                # Fail closed: were the ZAP handler gone, refuse clients instead of
                # accepting every key (libzmq's default without a handler).
                self._router.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
            bind_host = host
            if ":" in host and not host.startswith("["):
                bind_host = f"[{host}]"
            if bind_host.startswith("["):
                self._router.ipv6 = True
            self._bind(f"tcp://{bind_host}:{port}")
            self._watch(self._router, _Watch(f"tcp://{bind_host}:{port}", outbound=False))
        except BaseException:
            self._teardown()
            raise
        self._poller.register(self._router, zmq.POLLIN)
        self.address = f"tcp://{bind_host}:{port}"
        warn_if_ephemeral(port)
        if security is not None:
            logger.info("kvpush: control endpoint %s is CurveZMQ as %s (%s), %d allowed keys",
                        self.address, security.keypair.name, security.keypair.fingerprint,
                        len(security.allowed))

    def _bind(self, address: str) -> None:
        # A process restarted at once may race its dying predecessor for the port: wait a
        # little for it to go before calling the port taken.
        try:
            for attempt in Retrying(stop=stop_after_delay(BIND_WAIT_S), wait=wait_fixed(0.25),
                                    retry=retry_if_exception(_port_taken), reraise=True):
                with attempt:
                    self._router.bind(address)
        except zmq.ZMQError as exc:
            raise ConfigError(
                f"cannot bind the control endpoint to {address}: {exc}. Set "
                "control.port to a free port (each rank uses port + rank) or control.host "
                "to an address of this machine"
            ) from None

    # ------------------------------------------------------------------ identity
    @property
    def secure(self) -> bool:
        """True when the channel runs CurveZMQ (keys), False when plaintext."""
        return self._security is not None

    @property
    def public_key(self) -> str:
        """This engine's Z85 public key (what peers pass as ``to``); "" when plaintext."""
        return self._security.keypair.public.decode() if self._security else ""

    def name_of(self, origin: str) -> str:
        """The allow-list name of ``origin`` (a bounded label for logs and metrics); "" for
        an unknown key or in plaintext mode."""
        if self._security is None or not origin:
            return ""
        return self._security.allowed.get(origin.encode("ascii", "replace"), "")

    def _who(self, origin: str) -> str:
        if not origin:
            return "a plaintext peer"
        return f"{self.name_of(origin) or '?'} ({fingerprint(origin)})"

    # ------------------------------------------------------------------ receiving
    @property
    def pending(self) -> bool:
        """True when the last ``receive`` stopped at its limit with messages still waiting
        (``wait`` then returns True at once)."""
        return self._pending

    def wake(self) -> None:
        """Interrupt a ``wait`` in progress; safe from any thread."""
        # A full pipe means the poller is already awake.
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for input or a ``wake``; True if messages may be waiting.

        The wait is whole milliseconds, at least ``MIN_WAIT_MS`` (a shorter timeout is rounded
        up: a loop around ``wait`` never spins). Also counts failed handshakes reported
        meanwhile. Returns at once, True, when the last ``receive`` left messages behind.
        """
        timeout_ms = 0 if self._pending else max(MIN_WAIT_MS, math.ceil(timeout_s * 1000))
        events = dict(self._poller.poll(timeout_ms))
        if self._wake_r in events:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_r, 4096):
                    pass
        for sock in events:
            watch = self._monitors.get(sock)
            if watch is not None:
                self._drain_monitor(sock, watch)
        return self._pending or self._router in events

    def receive(self, limit: int = 256) -> Iterator[tuple[messages.ControlMessage, str]]:
        """Up to ``limit`` waiting messages (never blocks) as ``(message, origin)``.

        ``origin`` is the sender's Z85 public key as proven by its CurveZMQ handshake (in the
        allow-list), or "" in plaintext mode. Invalid messages are counted in ``rejected``
        and count towards ``limit``; ``pending`` says whether more are waiting.
        """
        self._pending = True  # until the queue is seen empty (also if the caller stops early)
        for _ in range(limit):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._pending = False
                return
            origin = ""
            if self._security is not None:
                origin = self._origin(frames[-1])
                if not origin:
                    self._reject(RejectReason.UNAUTHENTICATED,
                                 "dropped a control message without an allow-listed sender key")
                    continue
            try:
                # frame 0 is the ROUTER's peer identity
                msg = self._codec.open([f.bytes for f in frames[1:]])
            except ProtocolError as exc:
                self._reject(exc.reason, f"dropped a control message from {self._who(origin)}: "
                             f"{exc}")
                continue
            yield msg, origin
        self._pending = bool(int(self._router.get(zmq.EVENTS)) & zmq.POLLIN)

    def poll(self, timeout_s: float,
             limit: int = 256) -> Iterator[tuple[messages.ControlMessage, str]]:
        """``wait`` then ``receive``."""
        if self.wait(timeout_s):
            yield from self.receive(limit)

    def _origin(self, frame: zmq.Frame) -> str:
        assert self._security is not None
        try:
            user_id = frame.get("User-Id")  # set by our ZAP handler: the Z85 client key
        except zmq.ZMQError:
            return ""
        if isinstance(user_id, str) and user_id.encode("ascii", "replace") in \
                self._security.allowed:
            return user_id
        return ""

    # ------------------------------------------------------------------ sending
    @property
    def open_peers(self) -> int:
        """Peer sockets open now (at most ``max_peers``)."""
        return len(self._peers)

    def send(self, address: str, msg: messages.ControlMessage, to: str = "") -> None:
        """Queue ``msg`` to the endpoint at ``address`` (never blocks, never raises).

        With keys, ``to`` is the Z85 public key the peer at ``address`` must prove (one of the
        allow-list); the message goes nowhere else. Plaintext: ``to`` is ignored. A message
        that cannot be sent is dropped and counted in ``rejected``.
        """
        if self._closed:
            logger.debug("kvpush: endpoint closed; not sending %s to %s", type(msg).__name__,
                         address)
            return
        if not isinstance(to, str):  # the type says str; a caller's bug must not raise here
            to = ""
        peer_key = (address, to if self._security is not None else "")
        entry = self._peers.get(peer_key) if isinstance(address, str) else None
        if entry is None:
            problem = address_problem(address)
            if problem is not None:
                self._reject(RejectReason.BAD_ADDRESS, f"not sending {type(msg).__name__} to "
                             f"{address!r}: {problem}")
                return
            if self._security is not None and not self._known_key(to):
                self._reject(RejectReason.UNKNOWN_PEER_KEY, f"not sending {type(msg).__name__} "
                             f"to {address}: its key {to!r:.60} is not in the allow-list"
                             if to else f"not sending {type(msg).__name__} to {address}: no "
                             "peer key given, and with keys every message names the key "
                             "its receiver must prove")
                return
        try:
            frames = self._codec.seal(msg)
        except ProtocolError as exc:
            self._reject(exc.reason, f"not sending to {address}: {exc}")
            return
        if entry is None:
            entry = self._open_peer(address, peer_key[1])
            if entry is None:
                return
        else:
            self._peers.move_to_end(peer_key)
        try:
            entry[0].send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            self._reject(RejectReason.QUEUE_FULL, f"control queue to {address} is full "
                         f"({SNDHWM} messages: the peer is down or slow); dropped "
                         f"{type(msg).__name__}")
        except zmq.ZMQError as exc:
            self._reject(RejectReason.NO_SOCKET, f"cannot send to {address}: {exc}")

    def _known_key(self, to: str) -> bool:
        assert self._security is not None
        return bool(to) and to.encode("ascii", "replace") in self._security.allowed

    def _open_peer(self, address: str, to: str) -> tuple[Socket, Socket] | None:
        while len(self._peers) >= self._max_peers:
            (old_address, _), old = self._peers.popitem(last=False)
            self._close_peer(old)
            self.evictions += 1
            logger.debug("kvpush: closed the least recently used peer socket (%s)", old_address)
        try:
            sock = self._ctx.socket(zmq.DEALER)
        except zmq.ZMQError as exc:
            self._no_socket(address, exc)
            return None
        try:
            self._configure_dealer(sock, address, to)
            monitor = self._watch(sock, _Watch(address, outbound=True))
        except zmq.ZMQError as exc:
            sock.close(0)
            self._no_socket(address, exc)
            return None
        try:
            sock.connect(address)
        except zmq.ZMQError as exc:
            self._close_peer((sock, monitor))
            self._reject(RejectReason.BAD_ADDRESS, f"cannot connect to {address}: {exc}")
            return None
        entry = (sock, monitor)
        self._peers[(address, to)] = entry
        return entry

    def _configure_dealer(self, sock: Socket, address: str, to: str) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.IMMEDIATE, 0)
        # While the peer is down, retry its port at 100 ms doubling up to 1 s instead of
        # every 100 ms for as long as it stays down.
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        if is_ipv6(address):
            sock.ipv6 = True
        if self._security is not None:
            sock.curve_secretkey = self._security.keypair.secret
            sock.curve_publickey = self._security.keypair.public
            sock.curve_serverkey = to.encode("ascii")

    def _no_socket(self, address: str, exc: zmq.ZMQError) -> None:
        self._reject(RejectReason.NO_SOCKET, f"cannot open a socket to {address}: {exc}; raise "
                     "the open-files limit (ulimit -n) or lower control.max_peers")

    def _close_peer(self, entry: tuple[Socket, Socket]) -> None:
        sock, monitor = entry
        # Stop the monitor while its reader is still open: libzmq posts a last
        # MONITOR_STOPPED event, which must have somewhere to go (this hung once).
        sock.disable_monitor()
        self._unwatch(monitor)
        sock.close(0)

    def forget(self, address: str) -> None:
        """Drop every connection to a peer address (e.g. after it restarted)."""
        for peer_key in [k for k in self._peers if k[0] == address]:
            self._close_peer(self._peers.pop(peer_key))

    # ------------------------------------------------------------------ handshakes
    def _watch(self, sock: Socket, watch: _Watch) -> Socket:
        # Our own inproc name: pyzmq's default is derived from the fd, which a closed
        # socket's successor may reuse while libzmq still holds the old name.
        addr = f"inproc://kvpush-monitor-{id(self):x}-{next(self._monitor_ids)}"
        monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS, addr)
        monitor.setsockopt(zmq.LINGER, 0)
        self._monitors[monitor] = watch
        self._poller.register(monitor, zmq.POLLIN)
        return monitor

    def _unwatch(self, monitor: Socket) -> None:
        if self._monitors.pop(monitor, None) is not None:
            self._poller.unregister(monitor)
        monitor.close(0)

    def _drain_monitor(self, monitor: Socket, watch: _Watch) -> None:
        for _ in range(MONITOR_DRAIN):
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            found = handshake_reason(int(event["event"]), int(event["value"]), watch.outbound)
            if found is None:
                continue
            reason, why = found
            if watch.outbound:
                self._reject(reason, f"handshake with the peer at {watch.address} failed: {why}")
                continue
            refused = ""
            if reason is RejectReason.HANDSHAKE_UNKNOWN_KEY and self._auth is not None:
                ip, fp = self._auth.allow_list.last_refused
                refused = f" (last refused: key {fp} from {ip})"
            self._reject(reason, f"refused a connection to the control port {watch.address}: "
                         f"{why}{refused}")

    def _reject(self, reason: str, detail: str) -> None:
        reason = reason.value if isinstance(reason, RejectReason) else reason
        self.rejected[reason] += 1
        self._log.log(logging.WARNING, reason, "kvpush: %s [%s]", detail, reason)

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Close every socket, the ZAP thread and the context; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._teardown()

    def _teardown(self) -> None:
        for entry in self._peers.values():
            self._close_peer(entry)
        self._peers.clear()
        router = getattr(self, "_router", None)
        if router is not None and self._monitors:
            router.disable_monitor()  # before its reader closes, as in _close_peer
        for monitor in list(self._monitors):
            self._unwatch(monitor)
        if router is not None:
            router.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.destroy(linger=0)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
