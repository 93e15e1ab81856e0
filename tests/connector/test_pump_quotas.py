"""The pump under a flood: a pass handles control messages for at most PASS_BUDGET_S (by the
pump's clock) and leaves the rest for the next; between such passes the lock is free for
the engine thread; reading and decoding happen without the lock; what a key floods past its
quotas is counted as rejected."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvpush_prod.config.core import core_settings
from kvpush_prod.connector.worker import PASS_BUDGET_S, PASS_GAP_S, SenderPump, _Results
from kvpush_prod.control import ControlCodec, ControlEndpoint, EndpointSecurity
from kvpush_prod.core import messages as m
from kvpush_prod.core.commands import ExpectBlocks
from kvpush_prod.core.identity import agent_name
from kvpush_prod.core.sender import Sender
from kvpush_prod.lab.launch import free_port
from kvpush_prod.metrics import StatsBuffer
from tests.connector.test_pump import CFG, LAYOUT, Nic, Pair, Transport, _Rng, info
from tests.control.helpers import keypair

V = m.PROTOCOL_VERSION
D_SLIM = m.PeerInfo("D", 1, 0, "tcp://d:1")
STEP_S = 0.001  # what each message costs on the fake clock


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def cancels(n: int, start: int = 0) -> list[m.ControlMessage]:
    return [m.Cancel(V, f"c{i}", 0, D_SLIM, "aborted") for i in range(start, start + n)]


def costly(pump: SenderPump, clock: Clock) -> list[str]:
    """Each message the pump's driver handles advances ``clock`` by STEP_S; returns the
    transfer ids handled, in order."""
    handled: list[str] = []
    message = pump.driver.message

    def timed(msg: m.ControlMessage, origin: str = "") -> None:
        handled.append(getattr(msg, "transfer_id", ""))
        clock.t += STEP_S
        message(msg, origin)

    pump.driver.message = timed  # type: ignore[method-assign]
    return handled


def test_a_pass_stops_at_its_budget_and_the_next_goes_on_where_it_stopped() -> None:
    pair = Pair()
    clock = Clock()
    pair.p.now = clock  # type: ignore[method-assign]
    handled = costly(pair.p, clock)
    pair.p.endpoint.wire.inbox["tcp://p:1"].extend(cancels(100))  # type: ignore[attr-defined]
    pair.p.submit(ExpectBlocks("mine"))
    per_pass = round(PASS_BUDGET_S / STEP_S)
    with pair.p.lock:
        assert pair.p._pass(True) is True  # cut: messages are left
    assert handled == [f"c{i}" for i in range(per_pass)]
    assert "mine" in pair.p.engine._out  # the engine thread's command ran in the cut pass
    with pair.p.lock:
        assert pair.p._pass(True) is True
    assert handled == [f"c{i}" for i in range(2 * per_pass)]
    while pair.p.endpoint.wire.inbox["tcp://p:1"]:  # type: ignore[attr-defined]
        with pair.p.lock:
            pair.p._pass(True)
    assert handled == [f"c{i}" for i in range(100)]  # none lost, in order
    with pair.p.lock:
        assert pair.p._pass(True) is False  # nothing left: not cut


class FloodEndpoint:
    """An endpoint under a flood that never ends: every read leaves more on the socket."""

    def __init__(self, pump_lock: Any) -> None:
        self.lock = pump_lock
        self.rejected: Counter[str] = Counter()
        self.protocol_fallbacks: Counter[str] = Counter()
        self.pending = True
        self.fills = 0
        self._next = 0

    def wait(self, timeout_s: float) -> bool:
        return True

    def fill(self) -> bool:
        assert not self.lock.locked(), "decoding must not hold the pump's lock"
        self.fills += 1
        return True

    def receive(self, limit: int = 256) -> Iterator[tuple[m.ControlMessage, str]]:
        for _ in range(limit):
            self._next += 1
            yield cancels(1, self._next)[0], ""

    def send(self, address: str, msg: m.ControlMessage, to: str = "") -> None: ...

    def protocol_of(self, address: str) -> int:
        return m.PROTOCOL_VERSION

    def done_heard(self, address: str, engine_id: str, version: int) -> None: ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


def test_under_a_flood_the_pump_leaves_the_lock_free_between_passes() -> None:
    pair = Pair()
    pump = pair.p
    clock = Clock()
    pump.now = clock  # type: ignore[method-assign]
    costly(pump, clock)
    flood = FloodEndpoint(pump.lock)
    pump.endpoint = flood  # type: ignore[assignment]
    gaps: list[float] = []
    taken: list[bool] = []

    def gap(timeout: float | None = None) -> bool:
        gaps.append(timeout or 0.0)
        # Here the engine thread would be waiting: it can take the lock.
        got = pump.lock.acquire(blocking=False)
        taken.append(got)
        if got:
            pump.lock.release()
        if len(gaps) >= 20:
            pump._halt.set()
        return pump._halt.is_set()

    pump._halt.wait = gap  # type: ignore[method-assign]
    pump.start()
    pump.join(timeout=10)
    assert not pump.is_alive()
    # Each pass took its budget by the pump's clock: the pause is as long (at least the gap).
    assert gaps == pytest.approx([max(PASS_GAP_S, PASS_BUDGET_S)] * 20)
    assert all(taken)
    assert flood.fills >= 20


def test_without_a_flood_the_pump_does_not_pause() -> None:
    pair = Pair()
    pump = pair.p
    waits = 0

    def wait(timeout_s: float) -> bool:
        nonlocal waits
        waits += 1
        if waits == 1:
            pump.endpoint.wire.inbox["tcp://p:1"].extend(cancels(10))  # type: ignore[attr-defined]
            return True
        if waits >= 5:
            pump._halt.set()
        return False

    gaps: list[float | None] = []
    pump.endpoint.wait = wait  # type: ignore[method-assign]
    pump._halt.wait = lambda timeout=None: gaps.append(timeout) or False  # type: ignore[method-assign,func-returns-value]
    pump.start()
    pump.join(timeout=10)
    assert not pump.is_alive()
    assert gaps == []
    assert not pump.endpoint.wire.inbox["tcp://p:1"]  # type: ignore[attr-defined]


def test_a_register_flood_from_one_key_is_refused_and_counted_through_a_real_endpoint() -> None:
    p_key, d_key, evil = keypair("prefill-0"), keypair("decode-0"), keypair("decode-9")
    allowed = {k.public: k.name for k in (p_key, d_key, evil)}
    port = free_port()
    endpoint = ControlEndpoint(
        ControlCodec(1 << 20), "127.0.0.1", port, EndpointSecurity(p_key, allowed)
    )
    p_info = info("P", f"tcp://127.0.0.1:{port}")
    stats = StatsBuffer()
    pump = SenderPump(
        CFG,
        Sender(p_info, core_settings(CFG, 4096).sender, _Rng()),
        Transport(Nic(), p_info.agent_name),
        endpoint,
        _Results(),
        stats,
    )
    ctx = zmq.Context()
    quota = pump.engine.s.max_unknown_per_origin
    n = quota + 300
    try:
        pump.start()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_publickey, sock.curve_secretkey = evil.public, evil.secret
        sock.curve_serverkey = p_key.public
        sock.connect(endpoint.address)
        sender = m.PeerInfo(
            "D9", 5, 0, "tcp://127.0.0.1:9", agent_name("a9", evil.public.decode()), b"meta", LAYOUT
        )
        for i in range(n):
            sock.send(m.encode(m.Register(V, f"ghost-{i}", sender, [1], 0, 10, 1 + i, 60_000)))
        seen: Counter[str] = Counter()
        deadline = time.monotonic() + 30
        while seen["quota_registrations"] < n - quota and time.monotonic() < deadline:
            time.sleep(0.05)
            for name, labels, value in stats.drain().get("c", []):
                if name == "kvpush_control_messages_rejected":
                    seen[labels[1]] += value
        assert seen["quota_registrations"] == n - quota
        with pump.lock:
            assert pump.engine.active == quota
    finally:
        ctx.destroy(linger=0)
        pump.stop()
