"""Transport error classification, sans-IO retry policy (tenacity strategies), budget, breaker.

Decides retry / fallback / fatal per error, when to retry (full jitter), whether the peer's
retry budget allows it, and whether a peer's circuit breaker lets new transfers push at all.
"""

from __future__ import annotations

import enum
import math
import re
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import tenacity
from tenacity.stop import stop_after_attempt, stop_after_delay, stop_base
from tenacity.wait import wait_base, wait_exponential, wait_random_exponential

from kvpush_prod.errors import ConfigError

PeerId = str

# --------------------------------------------------------------------------- classification


class ErrorClass(enum.Enum):
    """What to do after a transport error on a chunk."""

    RETRY = "retry"  # transient: posting the same chunk again may succeed
    FALLBACK = "fallback"  # the push path is broken, D may still pull: send FALLBACK
    FATAL = "fatal"  # the request itself is wrong: neither retry nor pull can give right bytes


@dataclass(frozen=True, slots=True)
class Classification:
    """One row of the classification table; ``peer_down`` also counts against the breaker."""

    kind: str  # canonical name, e.g. "BACKEND"
    action: ErrorClass
    peer_down: bool
    why: str


R, F, X = ErrorClass.RETRY, ErrorClass.FALLBACK, ErrorClass.FATAL

# canonical kind, NIXL exception class, NIXL status name, action, peer_down, why
_TABLE: tuple[tuple[str, str, str, ErrorClass, bool, str], ...] = (
    ("BACKEND", "nixlBackendError", "NIXL_ERR_BACKEND", R, False,
     "transient backend (UCX/EFA) failure"),
    ("TIMEOUT", "TimeoutError", "TIMEOUT", R, False,
     "the chunk did not complete in time"),
    ("ERR", "", "ERR", R, False,
     "completion state ERR without detail"),
    ("UNKNOWN", "nixlUnknownError", "NIXL_ERR_UNKNOWN", R, False,
     "unknown transport error: retried under the budget, then fallback"),
    ("NOT_POSTED", "nixlNotPostedError", "NIXL_ERR_NOT_POSTED", R, False,
     "the transfer was not posted: posting again is safe"),
    ("REPOST_ACTIVE", "nixlRepostActiveError", "NIXL_ERR_REPOST_ACTIVE", R, False,
     "the handle is still busy: post again later"),
    ("REMOTE_DISCONNECT", "nixlRemoteDisconnectError", "NIXL_ERR_REMOTE_DISCONNECT", F, True,
     "the remote agent went away: re-handshake; D may pull"),
    ("NOT_FOUND", "nixlNotFoundError", "NIXL_ERR_NOT_FOUND", F, True,
     "remote agent or memory not known here (stale metadata): never retried"),
    ("CANCELED", "nixlCancelledError", "NIXL_ERR_CANCELED", F, False,
     "the transfer was cancelled under us: never retried"),
    ("NOT_ALLOWED", "nixlNotAllowedError", "NIXL_ERR_NOT_ALLOWED", F, False,
     "operation not allowed in the handle's state: never retried"),
    ("NOT_SUPPORTED", "nixlNotSupportedError", "NIXL_ERR_NOT_SUPPORTED", F, False,
     "the backend cannot do this operation: never retried"),
    ("INVALID_PARAM", "nixlInvalidParamError", "NIXL_ERR_INVALID_PARAM", X, False,
     "bad descriptors or block ids (a bug): never retried"),
    ("MISMATCH", "nixlMismatchError", "NIXL_ERR_MISMATCH", X, False,
     "layouts differ between P and D: a pull would move wrong bytes too"),
)  # fmt: skip

# Anything not in the table: do not repeat what we do not understand, but let D still pull.
UNCLASSIFIED = Classification("UNCLASSIFIED", ErrorClass.FALLBACK, False, "not in the table")


def _build_lookup() -> Mapping[str, Classification]:
    out: dict[str, Classification] = {}
    for kind, exc_name, status, action, peer_down, why in _TABLE:
        c = Classification(kind, action, peer_down, why)
        for name in (kind, exc_name, status):
            if name:
                out[name] = c
    # NIXL spells it both ways; the Python exception says "Cancelled".
    out["NIXL_ERR_CANCELLED"] = out["CANCELED"]
    out["CANCELLED"] = out["CANCELED"]
    return MappingProxyType(out)


CLASSIFICATION: Mapping[str, Classification] = _build_lookup()


def classify(error: str | BaseException) -> Classification:
    """Classify a NIXL exception (or its class name), a status string, "TIMEOUT" or "ERR".

    For an exception, its class and then its bases are looked up, so a subclass of
    ``nixlBackendError`` classifies like it; a status name inside the message counts too.
    """
    if isinstance(error, BaseException):
        for cls in type(error).__mro__:
            found = CLASSIFICATION.get(cls.__name__)
            if found is not None:
                return found
        return _from_text(str(error))
    name = error.strip()
    # Status strings are upper case ("timeout" and "err" come from logs and completions too).
    found = CLASSIFICATION.get(name) or CLASSIFICATION.get(name.upper())
    return found if found is not None else _from_text(name)


def _from_text(text: str) -> Classification:
    """The first known name inside a message such as "ERR:nixlBackendError" (else
    UNCLASSIFIED); the most specific token wins over the bare completion state "ERR"."""
    fallback: Classification | None = None
    for token in re.split(r"[\s:,()\[\]'\"]+", text):
        found = CLASSIFICATION.get(token)
        if found is None:
            continue
        if found.kind != "ERR":
            return found
        fallback = fallback or found
    return fallback or UNCLASSIFIED


def classification_rows() -> list[tuple[str, str, str, ErrorClass, bool, str]]:
    """The table as rows (canonical, exception class, status name, action, peer_down, why)."""
    return list(_TABLE)


# --------------------------------------------------------------------------- retry policy


class RandomLike(Protocol):
    """The one method of ``random.Random`` the jitter needs; inject a seeded one in tests."""

    def uniform(self, a: float, b: float) -> float: ...


class wait_full_jitter(wait_random_exponential):  # lower case: tenacity's naming
    """tenacity's full-jitter wait (uniform in [min, exponential cap]) with an injected RNG.

    tenacity's own ``wait_random_exponential`` draws from the global ``random`` module,
    which a test cannot seed per policy; the cap computation is tenacity's, unchanged.
    """

    def __init__(
        self,
        rng: RandomLike,
        multiplier: float = 1,
        max: float = 60,  # tenacity's parameter names, shadowing the builtins
        exp_base: float = 2,
        min: float = 0,
    ) -> None:
        super().__init__(multiplier=multiplier, max=max, exp_base=exp_base, min=min)
        self._rng = rng

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        cap = wait_exponential.__call__(self, retry_state)  # tenacity's exponential cap
        return self._rng.uniform(self.min, cap)


@dataclass(frozen=True, slots=True)
class RetrySettings:
    """Backoff and stop conditions for one chunk's retries."""

    max_attempts: int = 4  # attempts in all, the first post included
    max_delay_s: float = 5.0  # give up once this long has passed since the first attempt
    backoff_base_s: float = 0.05  # window of the first retry: [0, base]
    backoff_max_s: float = 1.0  # the window never grows past this

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"retry max_attempts must be >= 1, got {self.max_attempts}")
        if not self.max_delay_s > 0:
            raise ConfigError(f"retry max_delay_s must be > 0, got {self.max_delay_s}")
        if not self.backoff_base_s > 0:
            raise ConfigError(f"retry backoff_base_s must be > 0, got {self.backoff_base_s}")
        if not self.backoff_max_s >= self.backoff_base_s:
            raise ConfigError(
                f"retry backoff_max_s must be >= backoff_base_s ({self.backoff_base_s}), "
                f"got {self.backoff_max_s}"
            )


class RetryPolicy:
    """tenacity's stop and wait strategies evaluated sans-IO: no sleeping, no clock.

    ``next_attempt_at(attempt, first_attempt_at, now)`` answers when to post again after
    attempt number ``attempt`` (1 = the first post) failed at ``now``, or None to give up.
    As in tenacity's own loop, the wait is computed first, then the stop is asked (so
    ``stop_before_delay`` sees the upcoming sleep).
    """

    def __init__(self, stop: stop_base, wait: wait_base) -> None:
        self.stop = stop
        self.wait = wait
        # Only a carrier for RetryCallState; it never runs anything.
        self._retrying = tenacity.Retrying(stop=stop, wait=wait, reraise=True)

    @classmethod
    def from_settings(cls, settings: RetrySettings, rng: RandomLike) -> RetryPolicy:
        return cls(
            stop=stop_after_attempt(settings.max_attempts) | stop_after_delay(settings.max_delay_s),
            wait=wait_full_jitter(
                rng, multiplier=settings.backoff_base_s, max=settings.backoff_max_s
            ),
        )

    def next_attempt_at(self, attempt: int, first_attempt_at: float, now: float) -> float | None:
        if attempt < 1:
            raise ValueError(f"attempt numbers start at 1, got {attempt}")
        state = tenacity.RetryCallState(self._retrying, fn=None, args=(), kwargs={})
        state.start_time = first_attempt_at
        state.attempt_number = attempt
        state.outcome_timestamp = now
        sleep = float(self.wait(state))
        state.upcoming_sleep = sleep
        if self.stop(state):
            return None
        return now + sleep


# --------------------------------------------------------------------------- retry budget


@dataclass(frozen=True, slots=True)
class BudgetSettings:
    """Per-peer token bucket: ``burst`` retries at once, refilled at ``rate_per_s``."""

    rate_per_s: float = 5.0
    burst: float = 20.0

    def __post_init__(self) -> None:
        if not (self.rate_per_s >= 0 and math.isfinite(self.rate_per_s)):
            raise ConfigError(f"retry budget rate_per_s must be >= 0, got {self.rate_per_s}")
        if not (self.burst >= 1 and math.isfinite(self.burst)):
            raise ConfigError(f"retry budget burst must be >= 1, got {self.burst}")


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class RetryBudget:
    """Caps retries per peer so a sick peer cannot turn every chunk into a retry storm."""

    def __init__(self, settings: BudgetSettings | None = None) -> None:
        self._settings = settings if settings is not None else BudgetSettings()
        self._buckets: dict[PeerId, _Bucket] = {}
        self._denied = 0

    @property
    def denied(self) -> int:
        """Retries refused so far (for metrics)."""
        return self._denied

    def tokens(self, peer: PeerId, now: float) -> float:
        return self._refill(peer, now).tokens

    def try_spend(self, peer: PeerId, now: float, cost: float = 1.0) -> bool:
        """Take ``cost`` tokens from ``peer``'s bucket if it has them."""
        bucket = self._refill(peer, now)
        if bucket.tokens + 1e-9 < cost:
            self._denied += 1
            return False
        bucket.tokens = max(0.0, bucket.tokens - cost)
        return True

    def _refill(self, peer: PeerId, now: float) -> _Bucket:
        s = self._settings
        bucket = self._buckets.get(peer)
        if bucket is None:
            bucket = self._buckets[peer] = _Bucket(s.burst, now)
            return bucket
        if now > bucket.at:  # a clock that steps back refills nothing
            bucket.tokens = min(s.burst, bucket.tokens + (now - bucket.at) * s.rate_per_s)
            bucket.at = now
        return bucket


# --------------------------------------------------------------------------- decision


@dataclass(frozen=True, slots=True)
class RetryDecision:
    """What the shell does after a chunk error: retry at ``retry_at``, fall back, or fail."""

    action: ErrorClass
    retry_at: float | None
    classification: Classification
    reason: str


def decide(
    error: str | BaseException,
    *,
    attempt: int,
    first_attempt_at: float,
    now: float,
    policy: RetryPolicy,
    budget: RetryBudget,
    peer: PeerId,
) -> RetryDecision:
    """Classify ``error`` and, if retryable, ask the policy and then the peer's budget.

    A retry that the policy or the budget refuses becomes a fallback (D pulls).
    """
    c = classify(error)
    if c.action is not ErrorClass.RETRY:
        return RetryDecision(c.action, None, c, f"{c.kind}: {c.why}")
    at = policy.next_attempt_at(attempt, first_attempt_at, now)
    if at is None:
        return RetryDecision(
            ErrorClass.FALLBACK, None, c, f"{c.kind}: gave up after attempt {attempt}"
        )
    if not budget.try_spend(peer, now):
        return RetryDecision(
            ErrorClass.FALLBACK, None, c, f"{c.kind}: retry budget of peer {peer!r} is empty"
        )
    return RetryDecision(ErrorClass.RETRY, at, c, f"{c.kind}: retry {attempt} at {at:.3f}")


# --------------------------------------------------------------------------- circuit breaker


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
    failure_threshold: int = 3
    window_s: float = 10.0
    cooldown_s: float = 30.0
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

    def allow(self, peer: PeerId, now: float) -> bool:
        return self[peer].allow(now)

    def record_success(self, peer: PeerId, now: float) -> None:
        self[peer].record_success(now)

    def record_failure(self, peer: PeerId, now: float) -> None:
        self[peer].record_failure(now)

    def states(self, now: float) -> dict[PeerId, BreakerState]:
        return {peer: b.state(now) for peer, b in self._breakers.items()}
