"""A ZMQ control endpoint: a ROUTER that receives, a bounded set of DEALERs that send.

With keys, every connection is CurveZMQ: encrypted, and both ends proven by the allow-list.
Single-threaded by design: only the transfer pump thread touches the sockets (sends come from
whichever thread holds the pump's lock). Each sender key gets its own backlog and a fair share
of every receive, and may name only so many control addresses (``KeyQuotas``).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import math
import os
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

import msgspec
import zmq
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_fixed
from zmq.utils.monitor import parse_monitor_message

from kvpush_prod.control import probe
from kvpush_prod.control.addresses import address_problem, is_ipv6
from kvpush_prod.control.codec import ControlCodec
from kvpush_prod.control.keys import fingerprint
from kvpush_prod.control.security import (
    HANDSHAKE_EVENTS,
    ZAP_DOMAIN,
    AllowListAuthenticator,
    EndpointSecurity,
    handshake_reason,
)
from kvpush_prod.core import messages, protocol
from kvpush_prod.errors import ConfigError, ProtocolError
from kvpush_prod.loglimit import LogLimiter
from kvpush_prod.vocabulary import RejectReason

logger = logging.getLogger(__name__)
BIND_WAIT_S = 10.0  # how long a taken control port is retried before giving up
HANDSHAKE_IVL_MS = 5000  # a connection not through its handshake by then is dropped
LOG_EVERY_S = 10.0  # at most one log line per rejection reason this often (all are counted)
MONITOR_DRAIN = 1000  # events read per monitor per wait; the rest wake the next wait
MIN_WAIT_MS = 1  # the shortest blocking wait: a caller looping on wait() never spins a core
SNDHWM = 10_000
# Peer sockets (a DEALER and its monitor) made ahead by the pump thread outside its lock, as
# many as a key may name new addresses at once (KeyQuotas.new_addresses_burst): creating a
# socket was measured to take 21 ms-1 s of wall time (0.1 ms of CPU) on a loaded engine
# during a flood, which under the lock the engine thread would wait out. At most this many.
MAX_SPARE_PEERS = 16

Socket = zmq.Socket[bytes]


@dataclass(frozen=True)
class KeyQuotas:
    """What one sender key may take of an endpoint (with keys; plaintext: all senders share
    one key, "", and addresses are not bounded: a claimed address is no identity).

    An engine of the deployment holds a valid key: what it sends is authenticated, not
    benign. Its messages wait in a backlog of its own, each ``receive`` takes a fair share
    of every key's, and its messages and the replies to it use only a few control addresses.
    """

    # Of one key, per receive: the rest waits for the next (at least one message each time).
    messages_per_receive: int = 64
    bytes_per_receive: int = 1 << 20
    # Of one key, read from the socket and not yet received; what comes beyond is dropped
    # before it is decoded (reason quota_backlog).
    backlog_messages: int = 4096
    backlog_bytes: int = 16 << 20
    # Control addresses one key's messages may name and replies to it may go to (its ranks'
    # and data-parallel engines'); another is refused (quota_addresses) while these are in
    # use, and takes the place of one unused for ``address_idle_s`` (a restarted engine on
    # a new address). A new address also takes a token of the key's bucket (``burst``,
    # refilled at ``new_addresses_per_s``): each may cost a socket, and on a loaded engine
    # one socket's creation was measured to hold the interpreter for 228-357 ms.
    addresses: int = 64
    address_idle_s: float = 60.0
    new_addresses_burst: int = 16
    new_addresses_per_s: float = 1.0
    # Read from the socket per fill, and for at most this long; the rest waits in ZMQ.
    intake_frames: int = 1024
    intake_s: float = 0.005

    def __post_init__(self) -> None:
        for name in (
            "messages_per_receive",
            "bytes_per_receive",
            "backlog_messages",
            "backlog_bytes",
            "addresses",
            "new_addresses_burst",
            "intake_frames",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"KeyQuotas.{name}={getattr(self, name)}: must be at least 1")


class _Lazy:
    """A log detail made only if the line is written (floods are counted, rarely logged)."""

    __slots__ = ("_make",)

    def __init__(self, make: Callable[[], str]) -> None:
        self._make = make

    def __str__(self) -> str:
        return self._make()


@dataclass
class _Backlog:
    """One key's messages read and decoded, not yet received: (message, its bytes)."""

    items: deque[tuple[messages.ControlMessage, int]] = field(default_factory=deque)
    nbytes: int = 0


class _AddressBook:
    """Key -> the control addresses it uses, least recently used first, at most ``limit``
    each; a new one takes the place of one unused for ``idle_s``, else it is refused. New
    addresses of a key also come at most ``burst`` at once, then ``per_s`` a second."""

    def __init__(self, limit: int, idle_s: float, burst: int = 16, per_s: float = 1.0) -> None:
        self._limit, self._idle_s = limit, idle_s
        self._burst, self._per_s = burst, per_s
        self._by_key: dict[str, OrderedDict[str, float]] = {}
        self._tokens: dict[str, tuple[float, float]] = {}  # key -> (tokens, as of)

    def admit(self, key: str, address: str, now: float) -> tuple[bool, str]:
        """Whether ``key`` may use ``address`` now, and the address it replaces ("": none)."""
        book = self._by_key.setdefault(key, OrderedDict())
        if address in book:
            book[address] = now
            book.move_to_end(address)
            return True, ""
        tokens, at = self._tokens.get(key, (float(self._burst), now))
        tokens = min(float(self._burst), tokens + max(0.0, now - at) * self._per_s)
        if tokens < 1.0:
            self._tokens[key] = (tokens, now)
            return False, ""
        replaced = ""
        if len(book) >= self._limit:
            oldest, last = next(iter(book.items()))
            if now - last < self._idle_s:
                self._tokens[key] = (tokens, now)
                return False, ""
            del book[oldest]
            replaced = oldest
        book[address] = now
        self._tokens[key] = (tokens - 1.0, now)
        return True, replaced

    def keys(self) -> int:
        """Keys with addresses (one per peer key, never forgotten)."""
        return len(self._by_key)

    def buckets(self) -> int:
        """Keys with a new-address rate bucket (one per peer key, never forgotten)."""
        return len(self._tokens)

    def addresses(self, key: str) -> list[str]:
        return list(self._by_key.get(key, ()))


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
            "net.ipv4.ip_local_reserved_ports",
            port,
            rng[0],
            rng[1],
            rng[0],
        )


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

    def __init__(
        self,
        codec: ControlCodec,
        host: str,
        port: int,
        security: EndpointSecurity | None = None,
        max_peers: int = 1024,
        quotas: KeyQuotas | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_peers < 1:
            raise ConfigError(f"max_peers={max_peers}: must be at least 1")
        self._codec = codec
        self._security = security
        self._max_peers = max_peers
        self._clock = clock
        self.quotas = quotas or KeyQuotas()
        self.rejected: Counter[str] = Counter()
        # Guards ``rejected`` and the address book: sends come from the thread that holds
        # the pump's lock while the pump thread reads and decodes (``fill``) without it.
        self._books = threading.Lock()
        q = self.quotas
        self._addresses = _AddressBook(
            q.addresses, q.address_idle_s, q.new_addresses_burst, q.new_addresses_per_s
        )
        self._stale: list[tuple[str, str]] = []  # (address, key) replaced: sockets to close
        self._backlog: OrderedDict[str, _Backlog] = OrderedDict()  # key -> its messages
        self._filled = False  # a fill ran since the last receive
        self.evictions = 0  # peer sockets closed to stay within max_peers
        self.probes = 0  # probe frames answered (``kvpush doctor --peer``)
        # The protocol version settled on with each peer (``core.protocol``), and how many
        # peers were first settled below this build's, by version (kvpush_protocol_fallbacks).
        self._versions = protocol.PeerVersions(4 * max_peers)
        self.protocol_fallbacks: Counter[str] = Counter()
        self._log = LogLimiter(logger, LOG_EVERY_S)
        self._pending = False
        self._closed = False
        self._auth: AllowListAuthenticator | None = None
        self._init_zmq(max_peers)
        try:
            if security is not None:
                # Started before the bind: no connection may ever be accepted unchecked.
                self._auth = AllowListAuthenticator(self._ctx, security.allowed)
                self._auth.start()
            self._router = self._ctx.socket(zmq.ROUTER)
            bind_host = self._open_router(codec, host, port, security)
        except BaseException:
            self._teardown()
            raise
        self._poller.register(self._router, zmq.POLLIN)
        self.address = f"tcp://{bind_host}:{port}"
        warn_if_ephemeral(port)
        if security is not None:
            logger.info(
                "kvpush: control endpoint %s is CurveZMQ as %s (%s), %d allowed keys",
                self.address,
                security.keypair.name,
                security.keypair.fingerprint,
                len(security.allowed),
            )

    def _init_zmq(self, max_peers: int) -> None:
        """The ZMQ context, the peer and monitor books, and the poller with its wake pipe
        (the ROUTER comes after: ``_open_router``)."""
        # A context of our own: the ZAP handler is per context, and so is the socket limit.
        self._ctx: zmq.Context[Socket] = zmq.Context()
        # Each peer costs a DEALER and the two ends of its monitor; closed sockets hold their
        # slot until ZMQ's reaper thread gets to them, which a burst of new peers can outrun.
        self._ctx.set(zmq.MAX_SOCKETS, 4 * max_peers + 4096)
        self._peers: OrderedDict[tuple[str, str], tuple[Socket, Socket]] = OrderedDict()
        self._spares: deque[tuple[Socket, Socket]] = deque()  # made ahead (``prepare``)
        self._monitors: dict[Socket, _Watch] = {}
        self._monitor_ids = itertools.count()
        self._poller = zmq.Poller()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, zmq.POLLIN)

    def _open_router(
        self, codec: ControlCodec, host: str, port: int, security: EndpointSecurity | None
    ) -> str:
        """Set up the ROUTER that takes every peer's messages and bind it; the host as
        bound (IPv6 in brackets)."""
        self._router.setsockopt(zmq.LINGER, 0)
        # A frame bigger than this is dropped by ZMQ itself before we allocate it.
        self._router.setsockopt(zmq.MAXMSGSIZE, codec.max_message_bytes + 4096)
        self._router.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        if security is not None:
            self._router.curve_secretkey = security.keypair.secret
            self._router.curve_publickey = security.keypair.public
            self._router.curve_server = True
            self._router.zap_domain = ZAP_DOMAIN.encode()
            # Fail closed: were the ZAP handler gone, refuse clients instead of accepting
            # every key (libzmq's default without a handler).
            self._router.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        bind_host = host
        if ":" in host and not host.startswith("["):
            bind_host = f"[{host}]"
        if bind_host.startswith("["):
            self._router.ipv6 = True
        self._bind(f"tcp://{bind_host}:{port}")
        self._watch(self._router, _Watch(f"tcp://{bind_host}:{port}", outbound=False))
        return bind_host

    def _bind(self, address: str) -> None:
        # A process restarted at once may race its dying predecessor for the port: wait a
        # little for it to go before calling the port taken.
        try:
            for attempt in Retrying(
                stop=stop_after_delay(BIND_WAIT_S),
                wait=wait_fixed(0.25),
                retry=retry_if_exception(_port_taken),
                reraise=True,
            ):
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
        self.prepare()
        return self._pending or self._router in events

    def prepare(self) -> None:
        """Make peer sockets ahead (as many as a key may name new addresses at once, at most
        ``MAX_SPARE_PEERS``), so that a send to a new peer only connects one (called by
        ``wait``: the pump thread, outside its lock)."""
        spares = min(self.quotas.new_addresses_burst, MAX_SPARE_PEERS, self._max_peers)
        while len(self._spares) < spares and not self._closed:
            try:
                spare = self._new_dealer()
            except zmq.ZMQError:
                return  # out of sockets: ``send`` counts it when it needs one
            self._spares.append(spare)

    def fill(self) -> bool:
        """Read what waits on the socket into each sender key's backlog, decoded, without
        handing anything out (never blocks): the pump calls this outside its lock, so
        decoding never holds the engine thread. At most ``quotas.intake_frames`` frames and
        ``quotas.intake_s`` of reading; the rest waits in ZMQ for the next fill, and True
        says some does (a burst, or a sender flooding).

        Dropped and counted in ``rejected``: a message without an allow-listed key, one
        over its key's backlog (before it is decoded), one that does not open (oversize,
        malformed, version), and one naming a control address its key may not use.
        """
        self._filled = True
        q = self.quotas
        deadline = self._clock() + q.intake_s
        for _ in range(q.intake_frames):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            origin = ""
            if self._security is not None:
                origin = self._origin(frames[-1])
                if not origin:
                    self._reject(
                        RejectReason.UNAUTHENTICATED,
                        "dropped a control message without an allow-listed sender key",
                    )
                    continue
            if len(frames) == 2 and probe.is_probe(frames[1].buffer):
                self._answer_probe(frames)
            else:
                self._intake(frames, origin)
            if self._clock() >= deadline:
                break
        return self._readable()

    def _answer_probe(self, frames: list[zmq.Frame]) -> None:
        """Answer a probe frame on its own connection (a fixed 32 bytes, ``control.probe``);
        a reply that cannot go out at once is dropped: the prober times out, nothing waits."""
        answer = probe.reply(frames[1].bytes, time.time())
        if answer is None:
            self._reject(RejectReason.MALFORMED, "dropped a malformed probe frame")
            return
        with contextlib.suppress(zmq.ZMQError):
            self._router.send_multipart([frames[0].bytes, answer], zmq.NOBLOCK)
            self.probes += 1

    def _readable(self) -> bool:
        return bool(int(self._router.get(zmq.EVENTS)) & zmq.POLLIN)

    def _intake(self, frames: list[zmq.Frame], origin: str) -> None:
        q = self.quotas
        size = sum(len(f) for f in frames[1:])  # frame 0 is the ROUTER's peer identity
        backlog = self._backlog.get(origin)
        if backlog is not None and (
            len(backlog.items) >= q.backlog_messages or backlog.nbytes + size > q.backlog_bytes
        ):
            n, nbytes = len(backlog.items), backlog.nbytes
            self._reject(
                RejectReason.QUOTA_BACKLOG,
                _Lazy(
                    lambda: (
                        f"dropped a control message from {self._who(origin)}: {n} messages "
                        f"({nbytes} bytes) of it wait already, the most one key may have "
                        "waiting"
                    )
                ),
            )
            return
        try:
            msg = self._codec.open([f.bytes for f in frames[1:]])
        except ProtocolError as exc:
            self._reject(exc.reason, f"dropped a control message from {self._who(origin)}: {exc}")
            return
        if self._security is not None:
            address = msg.sender.control
            ok, _ = self._admit(origin, address)
            if not ok:
                self._reject(
                    RejectReason.QUOTA_ADDRESSES,
                    _Lazy(
                        lambda: (
                            f"dropped {type(msg).__name__} from {self._who(origin)}: it names "
                            f"the control address {address!r:.80}, beyond what this key's "
                            f"messages and replies may use ({self.quotas.addresses} addresses, "
                            f"{self.quotas.new_addresses_per_s:g} new a second)"
                        )
                    ),
                )
                return
        self._heard(msg)
        if backlog is None:
            backlog = self._backlog[origin] = _Backlog()
        backlog.items.append((msg, size))
        backlog.nbytes += size

    def _heard(self, msg: messages.ControlMessage) -> None:
        """Settle the protocol version with ``msg``'s sender; a peer settled below this
        build's version is counted and said once per process of it (a mixed-version fleet)."""
        with self._books:
            fallback = self._versions.heard(msg)
        self._fell_back(fallback)

    def done_heard(self, address: str, engine_id: str, version: int) -> None:
        """D took a DONE of protocol ``version`` from the prefill at ``address`` (a NIXL
        notification: an older P may push to D without any control message D hears)."""
        with self._books:
            fallback = self._versions.done_heard(address, engine_id, version)
        self._fell_back(fallback)

    def _fell_back(self, fallback: protocol.Fallback | None) -> None:
        if fallback is None:
            return
        with self._books:
            self.protocol_fallbacks[str(fallback.version)] += 1
        logger.warning(
            "kvpush: peer %s at %s speaks protocol %s (an older kvpush-prod); this engine "
            "speaks %s and talks protocol %d to it, KV still pushed, until it is upgraded "
            "(a mixed-version fleet, as during a rolling upgrade: %s; counted in "
            "kvpush_protocol_fallbacks_total)",
            fallback.engine_id,
            fallback.address,
            fallback.theirs,
            protocol.spoken(),
            fallback.version,
            protocol.UPGRADES,
        )

    def protocol_of(self, address: str) -> int:
        """The protocol version messages to the peer at ``address`` go in."""
        with self._books:
            return self._versions.version_for(address)

    def receive(
        self, limit: int = 256
    ) -> Generator[tuple[messages.ControlMessage, str], None, None]:
        """Up to ``limit`` waiting messages (never blocks) as ``(message, origin)``.

        ``origin`` is the sender's Z85 public key as proven by its CurveZMQ handshake (in the
        allow-list), or "" in plaintext mode. Each key's messages come in the order sent;
        keys take turns, each at most ``quotas.messages_per_receive`` messages and
        ``quotas.bytes_per_receive`` bytes (at least one message) per call: the rest waits
        for the next. Reads the socket first (``fill``) unless a fill ran since the last
        call. Invalid messages are counted in ``rejected``; ``pending`` says whether more
        are waiting. A caller may stop early: what it did not take stays for the next call.
        """
        self._pending = True  # until nothing is seen waiting (also if the caller stops early)
        if not self._filled:
            self.fill()
        self._filled = False
        q = self.quotas
        taken = 0
        share: dict[str, tuple[int, int]] = {}  # key -> (messages, bytes) taken this call
        while taken < limit:
            progressed = False
            for key in list(self._backlog):
                backlog = self._backlog.get(key)
                if backlog is None:
                    continue
                count, nbytes = share.get(key, (0, 0))
                msg, size = backlog.items[0]
                if count >= q.messages_per_receive or (
                    count and nbytes + size > q.bytes_per_receive
                ):
                    continue
                backlog.items.popleft()
                backlog.nbytes -= size
                if backlog.items:
                    self._backlog.move_to_end(key)  # the others' turn first
                else:
                    del self._backlog[key]
                share[key] = (count + 1, nbytes + size)
                taken += 1
                progressed = True
                yield msg, key
                if taken >= limit:
                    break
            if not progressed:
                break
        self._pending = bool(self._backlog) or self._readable()

    @property
    def backlog(self) -> int:
        """Messages read and decoded, not yet received (all keys)."""
        return sum(len(b.items) for b in self._backlog.values())

    def poll(
        self, timeout_s: float, limit: int = 256
    ) -> Iterator[tuple[messages.ControlMessage, str]]:
        """``wait`` then ``receive``."""
        if self.wait(timeout_s):
            yield from self.receive(limit)

    def _origin(self, frame: zmq.Frame) -> str:
        assert self._security is not None
        try:
            user_id = frame.get("User-Id")  # set by our ZAP handler: the Z85 client key
        except zmq.ZMQError:
            return ""
        if (
            isinstance(user_id, str)
            and user_id.encode("ascii", "replace") in self._security.allowed
        ):
            return user_id
        return ""

    def tables(self) -> dict[str, tuple[int, int | None]]:
        """Entries of the endpoint's tables: peer sockets (``max_peers``), spare sockets,
        socket monitors, keys with messages waiting, keys with addresses, stale sockets."""
        return {
            "control.peers": (len(self._peers), self._max_peers),
            "control.spares": (len(self._spares), MAX_SPARE_PEERS),
            "control.monitors": (len(self._monitors), None),
            "control.backlog_keys": (len(self._backlog), None),
            "control.address_keys": (self._addresses.keys(), None),
            "control.address_buckets": (self._addresses.buckets(), None),
            "control.stale": (len(self._stale), None),
        }

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
            logger.debug(
                "kvpush: endpoint closed; not sending %s to %s", type(msg).__name__, address
            )
            return
        if not isinstance(to, str):  # the type says str; a caller's bug must not raise here
            to = ""
        self._close_stale()
        peer_key = (address, to if self._security is not None else "")
        entry = self._peers.get(peer_key) if isinstance(address, str) else None
        what = type(msg).__name__
        if entry is None and self._refuse_new_peer(address, to, what):
            return
        if self._security is not None and not self._admit(to, address)[0]:
            self._reject(
                RejectReason.QUOTA_ADDRESSES,
                _Lazy(
                    lambda: (
                        f"not sending {what} to {address!r:.80}: beyond the "
                        f"control addresses replies to {self._who(to)} may go to "
                        f"({self.quotas.addresses}, {self.quotas.new_addresses_per_s:g} new a "
                        "second)"
                    )
                ),
            )
            return
        version = self.protocol_of(address)
        if msg.v != version:
            msg = msgspec.structs.replace(msg, v=version)
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
        self._put(entry[0], frames, address, what)

    def _refuse_new_peer(self, address: str, to: str, what: str) -> bool:
        """A message (a ``what``) to a peer with no socket open yet: True when it is refused
        (and counted) for a bad address or, with keys, a key not in the allow-list."""
        problem = address_problem(address)
        if problem is not None:
            self._reject(
                RejectReason.BAD_ADDRESS,
                f"not sending {what} to {address!r}: {problem}",
            )
            return True
        if self._security is not None and not self._known_key(to):
            self._reject(
                RejectReason.UNKNOWN_PEER_KEY,
                f"not sending {what} to {address}: its key {to!r:.60} is not in the allow-list"
                if to
                else f"not sending {what} to {address}: no peer key given, and with keys "
                "every message names the key its receiver must prove",
            )
            return True
        return False

    def _put(self, dealer: Socket, frames: list[bytes], address: str, what: str) -> None:
        """Queue ``frames`` (a ``what``) on the DEALER to ``address`` without blocking; a full
        queue or a socket error drops them (counted)."""
        try:
            dealer.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            self._reject(
                RejectReason.QUEUE_FULL,
                f"control queue to {address} is full "
                f"({SNDHWM} messages: the peer is down or slow); dropped {what}",
            )
        except zmq.ZMQError as exc:
            self._reject(RejectReason.NO_SOCKET, f"cannot send to {address}: {exc}")

    def _known_key(self, to: str) -> bool:
        assert self._security is not None
        return bool(to) and to.encode("ascii", "replace") in self._security.allowed

    def _admit(self, key: str, address: str) -> tuple[bool, str]:
        """Whether ``key`` may use the control address ``address`` (``_AddressBook``); a
        replaced address's socket is closed by the next send (the sending thread's)."""
        with self._books:
            ok, replaced = self._addresses.admit(key, address, self._clock())
            if replaced:
                self._stale.append((replaced, key))
        return ok, replaced

    def addresses_of(self, key: str) -> list[str]:
        """The control addresses ``key`` uses now, least recently used first."""
        with self._books:
            return self._addresses.addresses(key)

    def _close_stale(self) -> None:
        if not self._stale:
            return
        with self._books:
            stale, self._stale = self._stale, []
        for peer_key in stale:
            entry = self._peers.pop(peer_key, None)
            if entry is not None:
                self._close_peer(entry)

    def _open_peer(self, address: str, to: str) -> tuple[Socket, Socket] | None:
        while len(self._peers) >= self._max_peers:
            (old_address, _), old = self._peers.popitem(last=False)
            self._close_peer(old)
            self.evictions += 1
            logger.debug("kvpush: closed the least recently used peer socket (%s)", old_address)
        try:
            sock, monitor = self._spares.popleft() if self._spares else self._new_dealer()
        except zmq.ZMQError as exc:
            self._no_socket(address, exc)
            return None
        try:
            if is_ipv6(address):
                sock.ipv6 = True
            if self._security is not None:
                sock.curve_serverkey = to.encode("ascii")
            self._monitors[monitor] = _Watch(address, outbound=True)
        except zmq.ZMQError as exc:
            self._close_peer((sock, monitor))
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

    def _new_dealer(self) -> tuple[Socket, Socket]:
        """A DEALER with everything but its peer set (the peer's key and address come at
        ``_open_peer``), and the monitor of its handshakes."""
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SNDHWM)
            sock.setsockopt(zmq.IMMEDIATE, 0)
            # While the peer is down, retry its port at 100 ms doubling up to 1 s instead of
            # every 100 ms for as long as it stays down.
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
            if self._security is not None:
                sock.curve_secretkey = self._security.keypair.secret
                sock.curve_publickey = self._security.keypair.public
            return sock, self._watch(sock, _Watch("", outbound=True))
        except zmq.ZMQError:
            sock.close(0)
            raise

    def _no_socket(self, address: str, exc: zmq.ZMQError) -> None:
        self._reject(
            RejectReason.NO_SOCKET,
            f"cannot open a socket to {address}: {exc}; raise "
            "the open-files limit (ulimit -n) or lower control.max_peers",
        )

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
            self._reject(
                reason, f"refused a connection to the control port {watch.address}: {why}{refused}"
            )

    def _reject(self, reason: str, detail: str | _Lazy) -> None:
        reason = reason.value if isinstance(reason, RejectReason) else reason
        with self._books:
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
        spares: deque[tuple[Socket, Socket]] = getattr(self, "_spares", deque())
        for entry in [*self._peers.values(), *spares]:
            self._close_peer(entry)
        self._peers.clear()
        spares.clear()
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
