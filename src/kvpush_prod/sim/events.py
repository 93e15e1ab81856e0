"""The simulator's clock and event queue, and a processor-sharing link (bandwidth shared
equally by the flows on it, each finishing one one-way latency after its last byte left)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field


class Loop:
    """Simulated time: callbacks run in time order (ties in scheduling order)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.events = 0

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(when, self.now), next(self._seq), fn))

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        self.at(self.now + delay, fn)

    def run(self, until: float = float("inf"), max_events: int = 50_000_000) -> None:
        while self._heap and self._heap[0][0] <= until:
            when, _, fn = heapq.heappop(self._heap)
            self.now = when
            fn()
            self.events += 1
            if self.events >= max_events:
                raise RuntimeError(f"simulation did not settle within {max_events} events")


@dataclass
class _Flow:
    remaining: float
    done: Callable[[], None]


@dataclass
class Link:
    """A NIC (or a pair's path): ``bandwidth`` bytes/s shared equally by the flows in flight."""

    loop: Loop
    bandwidth: float
    latency: float  # one way, seconds
    name: str = ""
    _flows: dict[int, _Flow] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    _last: float = 0.0
    _version: int = 0
    bytes_moved: float = 0.0

    def send(self, nbytes: float, done: Callable[[], None]) -> None:
        """Start a flow of ``nbytes``; ``done`` runs when its last byte has arrived."""
        self._advance()
        self._flows[next(self._ids)] = _Flow(float(nbytes), done)
        self._reschedule()

    @property
    def active(self) -> int:
        return len(self._flows)

    def _advance(self) -> None:
        now = self.loop.now
        if self._flows and now > self._last:
            share = self.bandwidth * (now - self._last) / len(self._flows)
            for f in self._flows.values():
                f.remaining -= share
                self.bytes_moved += share
        self._last = now

    def _reschedule(self) -> None:
        self._version += 1
        if not self._flows:
            return
        version = self._version
        key = min(self._flows, key=lambda k: self._flows[k].remaining)
        wait = max(0.0, self._flows[key].remaining) * len(self._flows) / self.bandwidth
        self.loop.after(wait, lambda: self._finish(version, key))

    def _finish(self, version: int, key: int) -> None:
        if version != self._version:
            return
        self._advance()
        # The flow this event was for ends now whatever float residue it has left (<1 byte
        # residues of others too): a tiny leftover must never schedule an endless chain.
        self._flows[key].remaining = 0.0
        finished = [k for k, f in self._flows.items() if f.remaining <= 1.0]
        for k in finished:
            f = self._flows.pop(k)
            self.loop.after(self.latency, f.done)
        self._reschedule()
