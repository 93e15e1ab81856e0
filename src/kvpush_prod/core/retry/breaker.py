"""The per-peer circuit breaker (Nygard): repeated push failures to one peer send new
transfers straight to fallback until a half-open probe succeeds; every change is a table entry.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvpush_prod.errors import ConfigError

PeerId = str


class BreakerState(enum.Enum):
    CLOSED = "closed"  # pushes go through
    OPEN = "open"  # new transfers go straight to fallback
    HALF_OPEN = "half_open"  # one probe push is let through


class BreakerEvent(enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"
    TRIP = "trip"  # failure_threshold failures within window_s
    COOLDOWN_ELAPSED = "cooldown_elapsed"
    PROBE = "probe"  # the one probe was let through
    PROBE_TIMEOUT = "probe_timeout"  # the probe never reported: count it as failed


_B, _E = BreakerState, BreakerEvent

BREAKER_TRANSITIONS: Mapping[tuple[BreakerState, BreakerEvent], BreakerState] = MappingProxyType({
    (_B.CLOSED, _E.SUCCESS): _B.CLOSED,
    (_B.CLOSED, _E.FAILURE): _B.CLOSED,  # counted in the window
    (_B.CLOSED, _E.TRIP): _B.OPEN,
    (_B.OPEN, _E.SUCCESS): _B.OPEN,  # late results of pushes begun before opening
    (_B.OPEN, _E.FAILURE): _B.OPEN,
    (_B.OPEN, _E.COOLDOWN_ELAPSED): _B.HALF_OPEN,
    (_B.HALF_OPEN, _E.PROBE): _B.HALF_OPEN,
    (_B.HALF_OPEN, _E.SUCCESS): _B.CLOSED,  # cooldown reset
    (_B.HALF_OPEN, _E.FAILURE): _B.OPEN,  # cooldown doubled, up to max_cooldown_s
    (_B.HALF_OPEN, _E.PROBE_TIMEOUT): _B.OPEN,  # cooldown doubled, up to max_cooldown_s
})  # fmt: skip


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    """When a peer's breaker opens and for how long (the defaults are config's ``breaker``
    section's; ``probe_timeout_s`` is the core's own)."""

    failure_threshold: int = 3
    window_s: float = 10.0
    cooldown_s: float = 5.0
    max_cooldown_s: float = 300.0
    probe_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ConfigError(
                f"breaker failure_threshold must be >= 1, got {self.failure_threshold}"
            )
        for name in ("window_s", "cooldown_s", "probe_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"breaker {name} must be > 0 seconds, got {value}")
        if not self.max_cooldown_s >= self.cooldown_s:
            raise ConfigError(
                f"breaker max_cooldown_s must be >= cooldown_s ({self.cooldown_s}), "
                f"got {self.max_cooldown_s}"
            )


class CircuitBreaker:
    """One peer's breaker (Nygard): CLOSED -> OPEN -> HALF_OPEN -> CLOSED or OPEN again.

    Every state change goes through ``BREAKER_TRANSITIONS``. In HALF_OPEN any success
    closes and any failure re-opens: both are fresh evidence about the peer.
    """

    def __init__(self, settings: BreakerSettings | None = None) -> None:
        self._settings = settings if settings is not None else BreakerSettings()
        self._state = BreakerState.CLOSED
        self._failures: deque[float] = deque()
        self._cooldown = self._settings.cooldown_s
        self._opened_at = -math.inf
        self._probe_at: float | None = None
        self._trips = 0

    @property
    def settings(self) -> BreakerSettings:
        return self._settings

    @property
    def cooldown_s(self) -> float:
        return self._cooldown

    @property
    def trips(self) -> int:
        """How many times it opened (for metrics)."""
        return self._trips

    def state(self, now: float) -> BreakerState:
        """The state at ``now``, after time-driven transitions (cooldown, probe timeout)."""
        self._advance(now)
        return self._state

    def allow(self, now: float) -> bool:
        """May a new transfer push to this peer? In HALF_OPEN, True exactly once (the probe)."""
        self._advance(now)
        if self._state is BreakerState.CLOSED:
            return True
        if self._state is BreakerState.HALF_OPEN and self._probe_at is None:
            self._fire(BreakerEvent.PROBE)
            self._probe_at = now
            return True
        return False

    def record_success(self, now: float) -> None:
        self._advance(now)
        if self._state is BreakerState.HALF_OPEN:
            self._cooldown = self._settings.cooldown_s
            self._failures.clear()
            self._probe_at = None
        self._fire(BreakerEvent.SUCCESS)

    def record_failure(self, now: float) -> None:
        self._advance(now)
        if self._state is BreakerState.CLOSED:
            self._failures.append(now)
            self._prune(now)
            if len(self._failures) >= self._settings.failure_threshold:
                self._open(now, BreakerEvent.TRIP)
            else:
                self._fire(BreakerEvent.FAILURE)
        elif self._state is BreakerState.HALF_OPEN:
            self._cooldown = min(2 * self._cooldown, self._settings.max_cooldown_s)
            self._open(now, BreakerEvent.FAILURE)
        else:
            self._fire(BreakerEvent.FAILURE)

    def _advance(self, now: float) -> None:
        if self._state is BreakerState.OPEN and now >= self._opened_at + self._cooldown:
            self._probe_at = None
            self._fire(BreakerEvent.COOLDOWN_ELAPSED)
        if (
            self._state is BreakerState.HALF_OPEN
            and self._probe_at is not None
            and now >= self._probe_at + self._settings.probe_timeout_s
        ):
            self._cooldown = min(2 * self._cooldown, self._settings.max_cooldown_s)
            self._open(self._probe_at + self._settings.probe_timeout_s, _E.PROBE_TIMEOUT)
            self._advance(now)  # the doubled cooldown may itself be over already

    def _open(self, at: float, event: BreakerEvent) -> None:
        self._fire(event)
        self._opened_at = at
        self._probe_at = None
        self._failures.clear()
        self._trips += 1

    def _prune(self, now: float) -> None:
        horizon = now - self._settings.window_s
        while self._failures and self._failures[0] <= horizon:
            self._failures.popleft()

    def _fire(self, event: BreakerEvent) -> None:
        self._state = BREAKER_TRANSITIONS[(self._state, event)]


class PeerBreakers:
    """One ``CircuitBreaker`` per peer, made on first use."""

    def __init__(self, settings: BreakerSettings | None = None) -> None:
        self._settings = settings if settings is not None else BreakerSettings()
        self._breakers: dict[PeerId, CircuitBreaker] = {}

    def __getitem__(self, peer: PeerId) -> CircuitBreaker:
        b = self._breakers.get(peer)
        if b is None:
            b = self._breakers[peer] = CircuitBreaker(self._settings)
        return b

    def __len__(self) -> int:
        return len(self._breakers)

    def allow(self, peer: PeerId, now: float) -> bool:
        return self[peer].allow(now)

    def record_success(self, peer: PeerId, now: float) -> None:
        self[peer].record_success(now)

    def record_failure(self, peer: PeerId, now: float) -> None:
        self[peer].record_failure(now)

    def states(self, now: float) -> dict[PeerId, BreakerState]:
        return {peer: b.state(now) for peer, b in self._breakers.items()}
