"""The transfer pump sleeps: it never waits less than 1 ms between transport polls, waits
the idle period when nothing is in flight, and the engine thread sees a DONE at its step
without the pump thread having polled for it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from kvpush_prod.config import config_from_extra
from kvpush_prod.connector.metadata import PushMetadata
from kvpush_prod.connector.worker import (
    MAX_FORWARD_BACKOFF_S,
    MIN_WAIT_S,
    STEADY_STEP_S,
    TransferPump,
    WorkerSide,
)
from kvpush_prod.control import ControlCodec, ControlEndpoint
from kvpush_prod.core.commands import RegisterBlocks
from kvpush_prod.core.vocabulary import Side
from tests.connector.test_pump import Pair


class _Waits:
    """Stands in for the endpoint's ``wait``: records each timeout, stops the pump after
    ``n`` of them."""

    def __init__(self, pump: TransferPump[Any], n: int) -> None:
        self.pump, self.n = pump, n
        self.timeouts: list[float] = []
        self.thread_names: set[str] = set()

    def __call__(self, timeout_s: float) -> bool:
        self.timeouts.append(timeout_s)
        comm = Path(f"/proc/self/task/{threading.get_native_id()}/comm")
        if comm.exists():
            self.thread_names.add(comm.read_text().strip())
        if len(self.timeouts) >= self.n:
            self.pump._halt.set()
        return False


def _run_pump(pump: TransferPump[Any], n: int = 20) -> _Waits:
    waits = _Waits(pump, n)
    pump.endpoint.wait = waits  # type: ignore[method-assign]
    pump.start()
    pump.join(timeout=10)
    assert not pump.is_alive()
    return waits


def test_the_pump_waits_the_idle_period_when_nothing_is_in_flight() -> None:
    pair = Pair()
    waits = _run_pump(pair.d)
    assert set(waits.timeouts) == {pair.d.cfg.transport.idle_poll_ms / 1e3}


def test_the_pump_never_waits_less_than_1_ms_while_a_receive_is_pending() -> None:
    pair = Pair()
    pair.d.request_of["t"] = "d-t"
    pair.d.submit(RegisterBlocks("t", "tcp://p:1", (10, 11, 12), 0, 300))
    waits = _run_pump(pair.d)
    assert pair.d.engine.active == 1
    assert min(waits.timeouts) >= MIN_WAIT_S
    assert waits.timeouts[-1] == pytest.approx(1e-3)  # active_poll_ms: 1, the floor


def test_the_pump_never_waits_less_than_1_ms_while_its_chunks_are_in_flight() -> None:
    pair = Pair()
    pair.tx.fates = ["PROC"] * 3  # P's WRITEs stay in flight
    pair.push()
    waits = _run_pump(pair.p)
    assert pair.tx.posts  # posted, none completed (the last waits for the others)
    assert min(waits.timeouts) >= MIN_WAIT_S
    assert waits.timeouts[-1] == pytest.approx(1e-3)  # active_poll_ms: 1, the floor


def test_d_backs_off_while_forwards_come_and_polls_fast_once_they_stop() -> None:
    """While D's engine runs forwards (each step polls the transport at its end), D's pump
    waits as long as a forward has lately taken after each began (at least STEADY_STEP_S,
    at most MAX_FORWARD_BACKOFF_S) instead of every 1 ms; steps without a forward (D only
    waiting for KV) and the time after the last forward keep the 1 ms floor."""
    pair = Pair()
    pair.d.request_of["t"] = "d-t"
    pair.d.submit(RegisterBlocks("t", "tcp://p:1", (10, 11, 12), 0, 300))
    pair.d._pass(False)
    assert pair.d._busy()
    active, idle = 1e-3, 0.05
    assert pair.d._period(active, idle) == pytest.approx(active)  # no forward yet
    worker = WorkerSide(pair.d.cfg, Side.CONSUMER, "D", 0, 1, 0, "sig", 100)
    worker._rx = pair.d
    worker.on_metadata(PushMetadata())  # a step without a forward
    assert pair.d._period(active, idle) == pytest.approx(active)
    worker.on_metadata(PushMetadata(forward=True))
    steady = pair.d._period(active, idle)  # no forward measured yet: STEADY_STEP_S
    assert STEADY_STEP_S - 1e-3 < steady <= STEADY_STEP_S
    pair.d._forwards.last -= STEADY_STEP_S  # no forward since
    assert pair.d._period(active, idle) == pytest.approx(active)


def test_d_backs_off_as_long_as_its_forwards_take_within_bounds() -> None:
    """A deep model's 30 ms forwards make D's pump wait ~30 ms after each began (not 5 ms,
    then 1 ms polls through the rest of the forward); never more than
    MAX_FORWARD_BACKOFF_S, never less than STEADY_STEP_S; the step's end wakes nothing."""
    pair = Pair()
    pair.d.request_of["t"] = "d-t"
    pair.d.submit(RegisterBlocks("t", "tcp://p:1", (10, 11, 12), 0, 300))
    pair.d._pass(False)
    worker = WorkerSide(pair.d.cfg, Side.CONSUMER, "D", 0, 1, 0, "sig", 100)
    worker._rx = pair.d
    active, idle = 1e-3, 0.05

    def step(took: float) -> float:
        worker.on_metadata(PushMetadata(forward=True))
        pair.d._forwards.last -= took  # the forward took ``took``
        worker.get_finished()
        worker.on_metadata(PushMetadata(forward=True))  # the next one begins
        return pair.d._period(active, idle)

    assert step(0.03) == pytest.approx(0.03, abs=1e-3)  # the first one measured sets it
    for _ in range(20):
        wait = step(0.03)
    assert wait == pytest.approx(0.03, abs=1e-3)
    assert step(0.5) <= MAX_FORWARD_BACKOFF_S  # one long step (a compile): bounded
    for _ in range(40):
        wait = step(0.002)  # a tiny model's steps
    assert STEADY_STEP_S - 1e-3 < wait <= STEADY_STEP_S
    woke: list[bool] = []
    pair.d.endpoint.wake = lambda: woke.append(True)  # type: ignore[method-assign]
    step(0.03)
    assert not woke


def test_p_keeps_its_1_ms_polls_while_its_engine_runs_forwards() -> None:
    """P's pump never backs off: P's steps do not watch its pushes' completions."""
    pair = Pair()
    pair.tx.fates = ["PROC"] * 3
    pair.push()
    worker = WorkerSide(pair.p.cfg, Side.PRODUCER, "P", 0, 1, 0, "sig", 100)
    worker._tx = pair.p
    worker.on_metadata(PushMetadata(forward=True))
    assert pair.p._busy()
    assert pair.p._period(1e-3, 0.05) == pytest.approx(1e-3)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="Linux /proc only")
def test_the_pump_thread_is_named_kvpush_pump_in_the_os() -> None:
    pair = Pair()
    waits = _run_pump(pair.d, n=2)
    assert waits.thread_names == {"kvpush-pump"}


def test_get_finished_reports_a_done_that_arrived_without_a_pump_pass() -> None:
    pair = Pair()
    pair.push()  # D registered, P posted all three chunks; the DONE is at D's NIC
    pair.p._pass(True)
    worker = WorkerSide(pair.d.cfg, Side.CONSUMER, "D", 0, 1, 0, "sig", 100)
    worker._rx = pair.d
    worker.results = pair.d_results
    assert pair.d_results.take() == (set(), set(), set())  # nothing seen before the step
    _, recving, failed = worker.get_finished()
    assert recving == {"d-t"} and not failed


def test_endpoint_wait_never_asks_for_less_than_1_ms(monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = ControlEndpoint(ControlCodec(1 << 16), "127.0.0.1", 0)
    asked: list[Any] = []
    real = endpoint._poller.poll

    def poll(timeout: Any = None) -> Any:
        asked.append(timeout)
        return real(timeout)

    monkeypatch.setattr(endpoint._poller, "poll", poll)
    try:
        for timeout_s in (0.0, 0.0001, 0.0009, 0.001, 0.0015):
            endpoint.wait(timeout_s)
    finally:
        endpoint.close()
    assert asked == [1, 1, 1, 1, 2]


def test_the_old_sub_millisecond_key_is_refused_with_its_replacement() -> None:
    from kvpush_prod.errors import ConfigError

    with pytest.raises(ConfigError, match="active_poll_ms"):
        config_from_extra({"transport": {"active_poll_us": 100}})
    with pytest.raises(ConfigError):
        config_from_extra({"transport": {"active_poll_ms": 0}})
