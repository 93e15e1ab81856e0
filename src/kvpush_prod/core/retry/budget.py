"""The per-peer retry budget: a token bucket that caps how many retries one peer can cause."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpush_prod.errors import ConfigError

PeerId = str


@dataclass(frozen=True, slots=True)
class BudgetSettings:
    """Per-peer token bucket: ``burst`` retries at once, refilled at ``rate_per_s`` (the
    defaults are config's ``retry.budget_per_s`` and ``retry.budget_burst``)."""

    rate_per_s: float = 10.0
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

    def __len__(self) -> int:
        return len(self._buckets)

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
