"""P's connect threads (connector/connects.py): one connect per agent at a time, each
outcome handed over once, a connect past its bound reported as timed out and its real end
later; the clock is the test's, the connects are held on events (nothing here waits on time)."""

from __future__ import annotations

import threading

import pytest

from kvpush_prod.connector.connects import ConnectResult, Connects
from kvpush_prod.core import messages as m

LAYOUT = m.Layout("c", "DRAM", [m.Region(0, 100, 100, 8)])
BOUND_S = 30.0  # only a broken build waits this long on an event


def info(agent: str) -> m.PeerInfo:
    return m.PeerInfo("D", 1, 0, "tcp://d:1", agent, b"meta", LAYOUT)


class World:
    """Connects whose connect blocks until the test lets that agent's through."""

    def __init__(self, threads: int = 2) -> None:
        self.now = 0.0
        self.gates: dict[str, threading.Event] = {}
        self.calls: list[str] = []
        self.woken = threading.Semaphore(0)
        self.c: Connects[str] = Connects(
            self._connect, self.woken.release, lambda: self.now, 10.0, threads
        )

    def _connect(self, peer: m.PeerInfo) -> str:
        self.calls.append(peer.agent_name)
        gate = self.gates.setdefault(peer.agent_name, threading.Event())
        assert gate.wait(BOUND_S)
        if peer.agent_name.startswith("bad"):
            raise RuntimeError("NIXL_ERR_BACKEND")
        return f"peer:{peer.agent_name}"

    def let(self, agent: str) -> list[ConnectResult[str]]:
        """Let ``agent``'s connect through and take what the pump would see on its wake."""
        self.gates.setdefault(agent, threading.Event()).set()
        assert self.woken.acquire(timeout=BOUND_S)
        return self.c.results()


def test_one_connect_per_agent_runs_and_its_result_is_handed_over_once() -> None:
    w = World()
    assert w.c.start(info("a")) and not w.c.start(info("a"))
    assert w.c.pending("a") and w.c.results() == []
    w.now = 2.5
    (r,) = w.let("a")
    assert (r.agent, r.peer, r.problem, r.seconds, r.timed_out) == ("a", "peer:a", "", 2.5, False)
    assert w.calls == ["a"] and not w.c.pending("a") and w.c.results() == []


def test_a_slow_connect_does_not_hold_up_another_agents() -> None:
    w = World()
    w.c.start(info("slow"))
    w.c.start(info("fast"))
    (r,) = w.let("fast")
    assert r.agent == "fast" and r.peer == "peer:fast"
    assert w.c.pending("slow")
    w.gates["slow"].set()


def test_a_connect_that_raises_is_a_failure_naming_the_error() -> None:
    w = World()
    w.c.start(info("bad"))
    (r,) = w.let("bad")
    assert r.peer is None and "NIXL_ERR_BACKEND" in r.problem and not r.timed_out


def test_a_connect_past_its_bound_is_reported_timed_out_once_then_its_real_end() -> None:
    w = World()
    w.c.start(info("a"))
    w.now = 9.9
    assert w.c.results() == []
    w.now = 10.0
    (r,) = w.c.results()
    assert r.timed_out and r.peer is None and "10.0 s" in r.problem
    w.now = 11.0
    assert w.c.results() == [] and w.c.pending("a")  # reported once; still running
    w.now = 12.0
    (late,) = w.let("a")
    assert late.late and late.peer == "peer:a" and late.seconds == 12.0


def test_inline_connects_run_when_asked_and_are_handed_over_by_the_next_results() -> None:
    w = World(threads=0)
    w.gates["a"] = threading.Event()
    w.gates["a"].set()
    assert w.c.start(info("a")) and w.calls == ["a"]
    (r,) = w.c.results()
    assert r.peer == "peer:a"


def test_a_bound_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="connect timeout must be > 0 s, got 0"):
        Connects(lambda i: "x", lambda: None, lambda: 0.0, 0.0)
