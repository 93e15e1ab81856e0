"""Pairing policies: which of the eligible backends of one role gets the next leg.

Tiny strategy objects, one per role; they read ``Backend.inflight`` (and ``Backend.load``,
the engine's own /metrics) and keep a cursor. ``link_aware`` also learns, per (P, D) pair,
how long D waited for its first token, and picks a P's D by earliest expected finish.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from kvpush_prod.router.types import Backend


class Policy(Protocol):
    # Whether the policy learns each (P, D) link from ``observe`` (the router then times
    # the legs for it).
    learns_links: bool

    def choose(self, backends: Sequence[Backend], eligible: Sequence[Backend]) -> Backend:
        """Pick one of ``eligible`` (non-empty, a subset of ``backends``, in its order)."""
        ...

    def choose_for(
        self, p: Backend, backends: Sequence[Backend], eligible: Sequence[Backend]
    ) -> Backend:
        """Pick the D (one of ``eligible``) for a request whose P is ``p``."""
        ...

    def observe(self, p: Backend, d: Backend, seconds: float, prompt_tokens: int) -> None:
        """D's first token came ``seconds`` after P answered, for a prompt of
        ``prompt_tokens``."""
        ...


class RoundRobin:
    """Cycle through the configured order, skipping the ineligible ones."""

    learns_links = False

    def __init__(self) -> None:
        # Position in the configured list, not in ``eligible``: when a backend goes down
        # and comes back the rotation stays fair instead of restarting at the first one.
        self._next = 0

    def _rotated(self, backends: Sequence[Backend], eligible: Sequence[Backend]) -> list[Backend]:
        n = len(backends)
        ok = {id(b) for b in eligible}
        start = self._next % n
        return [backends[(start + i) % n] for i in range(n) if id(backends[(start + i) % n]) in ok]

    def _advance_past(self, backends: Sequence[Backend], chosen: Backend) -> None:
        for i, b in enumerate(backends):
            if b is chosen:
                self._next = i + 1
                return

    def choose(self, backends: Sequence[Backend], eligible: Sequence[Backend]) -> Backend:
        chosen = self._rotated(backends, eligible)[0]
        self._advance_past(backends, chosen)
        return chosen

    def choose_for(
        self, p: Backend, backends: Sequence[Backend], eligible: Sequence[Backend]
    ) -> Backend:
        return self.choose(backends, eligible)  # a D whatever its P

    def observe(self, p: Backend, d: Backend, seconds: float, prompt_tokens: int) -> None:
        return None  # links are not learnt


class LeastLoaded(RoundRobin):
    """Fewest legs in flight; ties go round robin so idle backends share the load."""

    def choose(self, backends: Sequence[Backend], eligible: Sequence[Backend]) -> Backend:
        chosen = min(self._rotated(backends, eligible), key=lambda b: b.inflight)
        self._advance_past(backends, chosen)
        return chosen


class EngineLoadAware(RoundRobin):
    """The engine's own load, from its /metrics (``Backend.load``), with the router's legs in
    flight since: queued requests weigh double (they wait for a slot), and a KV cache over
    80% full adds up to 10 more (new requests there soon preempt running ones). A backend
    whose load was never read counts only its legs in flight. Ties go round robin."""

    @staticmethod
    def score(b: Backend) -> float:
        load = b.load
        if load is None:
            return float(b.inflight)
        busy = max(float(b.inflight), load.running + load.waiting)
        return busy + 2 * load.waiting + 50 * max(0.0, load.kv_usage - 0.8)

    def choose(self, backends: Sequence[Backend], eligible: Sequence[Backend]) -> Backend:
        chosen = min(self._rotated(backends, eligible), key=self.score)
        self._advance_past(backends, chosen)
        return chosen


class LinkAware(EngineLoadAware):
    """D by earliest expected finish over the chosen P's link to it (P itself as
    ``engine_load``).

    The router times each streamed request from P's answer (P's prefill done; its push
    starts then) to D's first token: the KV crossing the (P, D) link and D's first step,
    without P's own queue, which is the same whichever D is chosen and, measured from the
    legs' start, drowned a link's difference in noise. Per pair it keeps the last ``window``
    of those times per prompt token and takes their median as the link's cost: one outlier
    (a cold connection, a busy box) moves nothing, and a link that changed is seen within
    half a window. A D's expected finish for the next request is that cost plus, for each
    leg D has in flight, the median pair's cost: a slow or throttled link gets fewer
    requests, a fast one more until its D's queue evens them out; equal links share them
    (least legs in flight, ties in turn). A pair with no time younger than ``stale_s`` is
    tried first, and every ``explore_every``-th choice for a P goes to its least recently
    timed D, so a link that recovers is noticed. Non-streamed requests are not timed (their
    first byte comes with the whole answer): they follow what the streamed ones taught, or
    ``engine_load``'s rotation before any."""

    learns_links = True

    def __init__(
        self,
        window: int = 8,
        explore_every: int = 16,
        stale_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.explore_every = explore_every
        self.stale_s = stale_s
        self._clock = clock
        self._window = window
        # (P url, D url) -> the last times (seconds per prompt token, when). Bounded: the
        # configured backends' pairs, ``window`` each.
        self._times: dict[tuple[str, str], deque[tuple[float, float]]] = {}
        self._choices: dict[str, int] = {}  # per P: D choices made (for exploration)

    def observe(self, p: Backend, d: Backend, seconds: float, prompt_tokens: int) -> None:
        if seconds < 0 or prompt_tokens <= 0:
            return
        key = (p.url, d.url)
        times = self._times.get(key)
        if times is None:
            times = self._times[key] = deque(maxlen=self._window)
        times.append((seconds / prompt_tokens, self._clock()))

    def estimate(self, p: Backend, d: Backend) -> float | None:
        """Seconds per prompt token over (p, d), None when not timed within ``stale_s``."""
        since = self._clock() - self.stale_s
        fresh = [v for v, at in self._times.get((p.url, d.url), ()) if at >= since]
        return statistics.median(fresh) if fresh else None

    def _last_timed(self, p: Backend, d: Backend) -> float:
        times = self._times.get((p.url, d.url))
        return times[-1][1] if times else float("-inf")

    def choose_for(
        self, p: Backend, backends: Sequence[Backend], eligible: Sequence[Backend]
    ) -> Backend:
        order = self._rotated(backends, eligible)
        n = self._choices[p.url] = self._choices.get(p.url, 0) + 1
        ests = {id(d): self.estimate(p, d) for d in order}
        untimed = [d for d in order if ests[id(d)] is None]
        if untimed:
            chosen = untimed[0]
        elif self.explore_every > 0 and n % self.explore_every == 0:
            chosen = min(order, key=lambda d: self._last_timed(p, d))
        else:
            # A leg in flight on D delays the next by about a typical pair's time.
            costs = {k: v for k, v in ests.items() if v is not None}
            unit = max(statistics.median(costs.values()), 1e-12)
            chosen = min(order, key=lambda d: costs[id(d)] + unit * d.inflight)
        self._advance_past(backends, chosen)
        return chosen


POLICIES = ("round_robin", "least_loaded", "engine_load", "link_aware")


def make_policy(name: str, clock: Callable[[], float] = time.monotonic) -> Policy:
    """The policy ``name``; ``clock`` times what a policy learns (the simulator's own)."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "engine_load":
        return EngineLoadAware()
    if name == "link_aware":
        return LinkAware(clock=clock)
    raise ValueError(f"unknown router policy {name!r}; use one of {', '.join(POLICIES)}")
