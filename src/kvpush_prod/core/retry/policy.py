"""When to post a failed chunk again: tenacity's stop and wait strategies, evaluated sans-IO.

Full-jitter exponential backoff from an injected RNG; no sleeping, no clock (time is passed in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import tenacity
from tenacity.stop import stop_after_attempt, stop_after_delay, stop_base
from tenacity.wait import wait_base, wait_exponential, wait_random_exponential

from kvpush_prod.errors import ConfigError


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
    """Backoff and stop conditions for one chunk's retries (the defaults are config's
    ``retry`` section's; ``max_delay_s`` is the core's own)."""

    max_attempts: int = 3  # attempts in all, the first post included
    max_delay_s: float = 5.0  # give up once this long has passed since the first attempt
    backoff_base_s: float = 0.002  # window of the first retry: [0, base]
    backoff_max_s: float = 0.2  # the window never grows past this

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
