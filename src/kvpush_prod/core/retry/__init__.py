"""Retries of failed chunks, as small modules: ``classification`` (what an error means),
``policy`` (when to post again), ``budget`` (how many retries a peer may cause), ``breaker``
(when a peer gets no pushes at all) and ``decision`` (the three asked in turn).
"""

from kvpush_prod.core.retry.breaker import (
    BREAKER_TRANSITIONS,
    BreakerEvent,
    BreakerSettings,
    BreakerState,
    CircuitBreaker,
    PeerBreakers,
)
from kvpush_prod.core.retry.budget import BudgetSettings, PeerId, RetryBudget
from kvpush_prod.core.retry.classification import (
    BY_KIND,
    CLASSIFICATION,
    UNCLASSIFIED,
    ChunkError,
    Classification,
    ErrorClass,
    ErrorKind,
    classification_rows,
    classify,
)
from kvpush_prod.core.retry.decision import RetryDecision, decide, decide_next
from kvpush_prod.core.retry.policy import RandomLike, RetryPolicy, RetrySettings, wait_full_jitter

__all__ = [
    "BREAKER_TRANSITIONS",
    "BY_KIND",
    "CLASSIFICATION",
    "UNCLASSIFIED",
    "BreakerEvent",
    "BreakerSettings",
    "BreakerState",
    "BudgetSettings",
    "ChunkError",
    "CircuitBreaker",
    "Classification",
    "ErrorClass",
    "ErrorKind",
    "PeerBreakers",
    "PeerId",
    "RandomLike",
    "RetryBudget",
    "RetryDecision",
    "RetryPolicy",
    "RetrySettings",
    "classification_rows",
    "classify",
    "decide",
    "decide_next",
    "wait_full_jitter",
]
