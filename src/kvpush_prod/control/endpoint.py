"""A ZMQ control endpoint: a ROUTER that receives, one DEALER per peer that sends.

Single-threaded by design: only the transfer pump thread touches the sockets.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator

import zmq

from kvpush_prod.control.codec import ControlCodec
from kvpush_prod.core import messages
from kvpush_prod.errors import ConfigError, ProtocolError

logger = logging.getLogger(__name__)
BIND_WAIT_S = 10.0  # how long a taken control port is retried before giving up


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


class ControlEndpoint:
    """Bind ``tcp://host:port``; ``poll`` returns valid inbound messages, counting the rest."""

    def __init__(self, codec: ControlCodec, host: str, port: int) -> None:
        self._codec = codec
        self._ctx = zmq.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        # A frame bigger than this is dropped by ZMQ itself before we allocate it.
        self._router.setsockopt(zmq.MAXMSGSIZE, codec.max_message_bytes + 4096)
        # A process restarted at once may race its dying predecessor for the port: wait a
        # little for it to go before calling the port taken.
        deadline = time.monotonic() + BIND_WAIT_S
        while True:
            try:
                self._router.bind(f"tcp://{host}:{port}")
                break
            except zmq.ZMQError as exc:
                if exc.errno == errno.EADDRINUSE and time.monotonic() < deadline:
                    time.sleep(0.25)
                    continue
                self._router.close(0)
                raise ConfigError(
                    f"cannot bind the control endpoint to tcp://{host}:{port}: {exc}. Set "
                    "control.port to a free port (each rank uses port + rank) or control.host "
                    "to an address of this machine"
                ) from None
        self.address = f"tcp://{host}:{port}"
        warn_if_ephemeral(port)
        self._peers: dict[str, zmq.Socket] = {}
        self.rejected: Counter[str] = Counter()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)

    def wake(self) -> None:
        """Interrupt a ``poll`` in progress; safe from any thread."""
        # A full pipe means the poller is already awake.
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for input or a ``wake``; True if messages may be waiting."""
        events = dict(self._poller.poll(max(0, int(timeout_s * 1000))))
        if self._wake_r in events:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        return self._router in events

    def receive(self) -> Iterator[messages.ControlMessage]:
        """Every valid message waiting now (never blocks); invalid ones are counted."""
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                yield self._codec.open(frames[1:])  # frame 0 is the ROUTER's peer identity
            except ProtocolError as exc:
                self.rejected[exc.reason] += 1
                logger.warning("kvpush: dropped control message: %s", exc)

    def poll(self, timeout_s: float) -> Iterator[messages.ControlMessage]:
        """``wait`` then ``receive``."""
        if self.wait(timeout_s):
            yield from self.receive()

    def send(self, address: str, msg: messages.ControlMessage) -> None:
        """Queue ``msg`` to the endpoint at ``address`` (never blocks)."""
        sock = self._peers.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            sock.setsockopt(zmq.IMMEDIATE, 0)
            # While the peer is down, retry its port at 100 ms doubling up to 1 s instead of
            # every 100 ms for as long as it stays down.
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            sock.connect(address)
            self._peers[address] = sock
        try:
            sock.send_multipart(self._codec.seal(msg), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("kvpush: control queue to %s is full; dropped %s", address,
                           type(msg).__name__)

    def forget(self, address: str) -> None:
        """Drop the connection to a peer (e.g. after it restarted)."""
        sock = self._peers.pop(address, None)
        if sock is not None:
            sock.close(0)

    def close(self) -> None:
        for sock in self._peers.values():
            sock.close(0)
        self._peers.clear()
        self._router.close(0)
        os.close(self._wake_r)
        os.close(self._wake_w)

