"""Pairing policies: which of the eligible backends of one role gets the next leg.

Tiny strategy objects, one per role; they read ``Backend.inflight`` (and ``Backend.load``,
the engine's own /metrics) and keep a cursor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvpush_prod.router.types import Backend


class Policy(Protocol):
    def choose(self, backends: Sequence[Backend], eligible: Sequence[Backend]) -> Backend:
        """Pick one of ``eligible`` (non-empty, a subset of ``backends``, in its order)."""
        ...


class RoundRobin:
    """Cycle through the configured order, skipping the ineligible ones."""

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


POLICIES = ("round_robin", "least_loaded", "engine_load")


def make_policy(name: str) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "engine_load":
        return EngineLoadAware()
    raise ValueError(f"unknown router policy {name!r}; use one of {', '.join(POLICIES)}")
