"""The client side of the control-port probe (``control.probe``): an authenticated handshake
with a running engine, round-trip latency, a burst of bytes for bandwidth, and clock skew."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvpush_prod.control import probe
from kvpush_prod.control.keys import KeyPair
from kvpush_prod.control.security import HANDSHAKE_EVENTS, handshake_reason


class ProbeError(Exception):
    """The probe could not finish: the message says why and what to do."""


@dataclass(frozen=True)
class ProbeResult:
    handshake_s: float
    rtts_s: tuple[float, ...]  # every round trip of the pings, sorted
    bandwidth_bytes_per_s: float
    burst_bytes: int
    skew_s: float  # the peer's wall clock minus ours, from the fastest round trip
    skew_error_s: float  # half that round trip: the skew is known only this well

    @property
    def rtt_p50_s(self) -> float:
        return statistics.median(self.rtts_s)


@dataclass(frozen=True)
class ProbePlan:
    pings: int = 20
    burst_bytes: int = 16 << 20
    frame_bytes: int = 256 << 10
    timeout_s: float = 5.0


class _Session:
    """One DEALER to the engine's control port, through its handshake."""

    def __init__(
        self, address: str, keypair: KeyPair | None, server_key: bytes | None, timeout_s: float
    ) -> None:
        self.address, self.timeout_ms = address, int(timeout_s * 1000)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keypair is not None and server_key is not None:
            self.sock.curve_secretkey = keypair.secret
            self.sock.curve_publickey = keypair.public
            self.sock.curve_serverkey = server_key
        self.monitor = self.sock.get_monitor_socket(
            HANDSHAKE_EVENTS | zmq.EVENT_HANDSHAKE_SUCCEEDED
        )

    def handshake(self) -> float:
        start = time.perf_counter()
        self.sock.connect(self.address)
        deadline = start + self.timeout_ms / 1000
        while (left := deadline - time.perf_counter()) > 0:
            if not self.monitor.poll(max(1, int(left * 1000))):
                break
            event = parse_monitor_message(self.monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return time.perf_counter() - start
            found = handshake_reason(int(event["event"]), int(event["value"]), outbound=True)
            if found is not None:
                raise ProbeError(f"the handshake with {self.address} failed: {found[1]}")
        raise ProbeError(
            f"no handshake with {self.address} within {self.timeout_ms / 1000:g} s: is an "
            "engine's control port there (control.port + rank), and does a firewall let "
            "this host reach it?"
        )

    def receive(self) -> probe.Pong:
        if not self.sock.poll(self.timeout_ms, zmq.POLLIN):
            raise ProbeError(
                f"{self.address} did not answer a probe within {self.timeout_ms / 1000:g} s: "
                "the engine may run a kvpush without the probe (upgrade it) or be stalled"
            )
        pong = probe.parse_reply(self.sock.recv())
        if pong is None:
            raise ProbeError(f"{self.address} answered the probe with something else")
        return pong

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)
        self.ctx.term()


def probe_peer(
    address: str, keypair: KeyPair | None, server_key: bytes | None, plan: ProbePlan = ProbePlan()
) -> ProbeResult:
    """Probe the control port at ``address`` (``tcp://host:port``): with keys, as
    ``keypair`` proving the engine holds ``server_key``. Raises ProbeError."""
    session = _Session(address, keypair, server_key, plan.timeout_s)
    try:
        handshake_s = session.handshake()
        rtts, skews = [], []
        for seq in range(plan.pings):
            wall, start = time.time(), time.perf_counter()
            session.sock.send(probe.request(seq))
            pong = session.receive()
            rtt = time.perf_counter() - start
            rtts.append(rtt)
            skews.append((rtt, pong.peer_wall_s - (wall + rtt / 2)))
        frames = max(1, plan.burst_bytes // plan.frame_bytes)
        start = time.perf_counter()
        for seq in range(frames):
            session.sock.send(probe.request(plan.pings + seq, plan.frame_bytes))
        received = sum(session.receive().received_bytes for _ in range(frames))
        elapsed = time.perf_counter() - start
    finally:
        session.close()

    best_rtt, skew = min(skews)
    return ProbeResult(
        handshake_s, tuple(sorted(rtts)), received / elapsed, received, skew, best_rtt / 2
    )
