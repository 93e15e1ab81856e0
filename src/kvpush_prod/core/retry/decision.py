"""After a chunk error: classify it, then ask the retry policy and the peer's budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvpush_prod.core.retry.budget import PeerId, RetryBudget
from kvpush_prod.core.retry.classification import (
    ChunkError,
    Classification,
    ErrorClass,
    classify,
)
from kvpush_prod.core.retry.policy import RetryPolicy


@dataclass(frozen=True, slots=True)
class RetryDecision:
    """What the shell does after a chunk error: retry at ``retry_at``, fall back, or fail.

    ``gave_up``: why a retryable error is not retried (``retries_exhausted``: the policy
    said stop; ``retry_budget``: the peer's budget is empty); "" otherwise. ``reason``
    starts with it (or with the error's kind), so its first word is a metric label."""

    action: ErrorClass
    retry_at: float | None
    classification: Classification
    reason: str
    gave_up: str = ""


def decide(
    error: ChunkError | str | BaseException,
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
            ErrorClass.FALLBACK,
            None,
            c,
            f"retries_exhausted: {c.kind}, gave up after attempt {attempt}",
            "retries_exhausted",
        )
    if not budget.try_spend(peer, now):
        return RetryDecision(
            ErrorClass.FALLBACK,
            None,
            c,
            f"retry_budget: {c.kind}, the retry budget of peer {peer!r} is empty",
            "retry_budget",
        )
    return RetryDecision(ErrorClass.RETRY, at, c, f"{c.kind}: retry {attempt} at {at:.3f}")


class FailedPost(Protocol):
    """A post that failed: its attempt (0: the first) and when that first attempt went out."""

    @property
    def attempt(self) -> int: ...
    @property
    def first_posted_at(self) -> float: ...


def decide_next(
    error: ChunkError | str | BaseException,
    failed: FailedPost,
    now: float,
    policy: RetryPolicy,
    budget: RetryBudget,
    peer: PeerId,
) -> RetryDecision:
    """``decide`` whether ``failed`` is posted again (its next attempt, timed from its first)."""
    return decide(
        error,
        attempt=failed.attempt + 1,
        first_attempt_at=failed.first_posted_at,
        now=now,
        policy=policy,
        budget=budget,
        peer=peer,
    )
