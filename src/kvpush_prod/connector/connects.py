"""P's NIXL connections to decode engines, made off the transfer pump: a small pool of connect
threads, one connect per agent at a time, each bounded in time; the pump collects the results.

A first connection to a D (loading its agent, preparing a descriptor of every block of its KV
cache) took seconds on a loaded host; on the pump it stopped every other transfer meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvpush_prod.core.messages import MAX_TEXT_LEN, PeerInfo

T = TypeVar("T")
# Connect threads: a slow D does not hold up the first connection to another, and the NIXL
# calls of all of them are serialized anyway (transport.nixl.SerializedAgent).
CONNECT_THREADS = 2


@dataclass(frozen=True, slots=True)
class ConnectResult(Generic[T]):
    """How a connect to ``agent`` ended, as the pump hands it to the driver: ``peer`` (None:
    failed, ``problem`` why; ``timed_out``: it was still running at the bound) after
    ``seconds``. ``late``: the connect ended after it was reported timed out."""

    agent: str
    peer: T | None
    problem: str
    seconds: float
    timed_out: bool = False
    late: bool = False


@dataclass(eq=False, slots=True)
class _Running(Generic[T]):
    future: Future[T]
    started: float
    timed_out: bool = field(default=False)  # reported as timed out; its end is still awaited


class Connects(Generic[T]):
    """Runs ``connect(info)`` for each agent asked on a connect thread; ``results`` (on the
    pump) gives each outcome once, a timeout at ``timeout_s`` first and the real end later.

    ``wake`` is called from a connect thread when one ends (the pump's wake pipe); ``clock``
    is the pump's monotonic clock. ``threads`` 0: each connect runs inside ``start`` and is
    handed over by the next ``results`` (a pump stepped by hand, in tests)."""

    def __init__(
        self,
        connect: Callable[[PeerInfo], T],
        wake: Callable[[], None],
        clock: Callable[[], float],
        timeout_s: float,
        threads: int = CONNECT_THREADS,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"connect timeout must be > 0 s, got {timeout_s}")
        self._connect = connect
        self._wake = wake
        self._clock = clock
        self.timeout_s = timeout_s
        self._pool = (
            ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvpush-connect")
            if threads > 0
            else None
        )
        self._running: dict[str, _Running[T]] = {}
        self._lock = threading.Lock()  # ``_running`` (the pump; ``pending`` may be asked anywhere)

    def start(self, info: PeerInfo) -> bool:
        """Connect to ``info``'s agent on a connect thread; False if one is already running
        for it (its result answers this ask too)."""
        agent = info.agent_name
        with self._lock:
            if agent in self._running:
                return False
            started = self._clock()
            future = (
                self._pool.submit(self._connect, info)
                if self._pool
                else _inline(self._connect, info)
            )
            self._running[agent] = _Running(future, started)
        future.add_done_callback(lambda _: self._wake())
        return True

    def pending(self, agent: str) -> bool:
        """A connect to ``agent`` is still running (timed out or not)."""
        with self._lock:
            return agent in self._running

    def __len__(self) -> int:
        with self._lock:
            return len(self._running)

    def results(self) -> list[ConnectResult[T]]:
        """Connects that ended, and those that ran past the bound (each reported once as
        timed out, and once more when it ends)."""
        now = self._clock()
        out: list[ConnectResult[T]] = []
        with self._lock:
            for agent, run in list(self._running.items()):
                took = now - run.started
                if run.future.done():
                    del self._running[agent]
                    out.append(_ended(agent, run, took))
                elif not run.timed_out and took >= self.timeout_s:
                    run.timed_out = True
                    problem = f"no connection after {took:.1f} s (transport.connect_timeout_s)"
                    out.append(ConnectResult(agent, None, problem, took, timed_out=True))
        return out

    def close(self) -> None:
        """Stop taking connects; one running ends on its own (a NIXL call cannot be cut)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _inline(connect: Callable[[PeerInfo], T], info: PeerInfo) -> Future[T]:
    future: Future[T] = Future()
    try:
        future.set_result(connect(info))
    except Exception as exc:  # noqa: BLE001 - handed over as the connect's failure
        future.set_exception(exc)
    return future


def _ended(agent: str, run: _Running[T], took: float) -> ConnectResult[T]:
    exc = run.future.exception() if not run.future.cancelled() else None
    if run.future.cancelled():
        return ConnectResult(agent, None, "cancelled", took, late=run.timed_out)
    if exc is not None:
        problem = f"{type(exc).__name__}: {exc}"[:MAX_TEXT_LEN]
        return ConnectResult(agent, None, problem, took, late=run.timed_out)
    return ConnectResult(agent, run.future.result(), "", took, late=run.timed_out)
