"""Error classification, the sans-IO tenacity retry policy, the retry budget and the breaker."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tenacity.stop import stop_after_attempt, stop_any, stop_before_delay
from tenacity.wait import wait_fixed

from kvpush_prod.core.retry import (
    BREAKER_TRANSITIONS,
    CLASSIFICATION,
    UNCLASSIFIED,
    BreakerEvent,
    BreakerSettings,
    BreakerState,
    BudgetSettings,
    CircuitBreaker,
    ErrorClass,
    PeerBreakers,
    RetryBudget,
    RetryPolicy,
    RetrySettings,
    classification_rows,
    classify,
    decide,
    wait_full_jitter,
)
from kvpush_prod.errors import ConfigError

CORE = settings.get_profile("kvpush-core")

# ----------------------------------------------------------------------------- classification

EXPECTED = {
    "nixlBackendError": ErrorClass.RETRY,
    "NIXL_ERR_BACKEND": ErrorClass.RETRY,
    "TIMEOUT": ErrorClass.RETRY,
    "ERR": ErrorClass.RETRY,
    "nixlUnknownError": ErrorClass.RETRY,
    "NIXL_ERR_UNKNOWN": ErrorClass.RETRY,
    "nixlRemoteDisconnectError": ErrorClass.FALLBACK,
    "NIXL_ERR_REMOTE_DISCONNECT": ErrorClass.FALLBACK,
    "nixlNotFoundError": ErrorClass.FALLBACK,
    "NIXL_ERR_NOT_FOUND": ErrorClass.FALLBACK,
    "nixlCancelledError": ErrorClass.FALLBACK,
    "NIXL_ERR_CANCELED": ErrorClass.FALLBACK,
    "nixlNotAllowedError": ErrorClass.FALLBACK,
    "nixlInvalidParamError": ErrorClass.FATAL,
    "NIXL_ERR_INVALID_PARAM": ErrorClass.FATAL,
    "nixlMismatchError": ErrorClass.FATAL,
    "NIXL_ERR_MISMATCH": ErrorClass.FATAL,
}


@pytest.mark.parametrize(("name", "action"), sorted(EXPECTED.items()))
def test_each_transport_error_name_maps_to_its_action(name: str, action: ErrorClass) -> None:
    assert classify(name).action is action


@pytest.mark.parametrize("kind", ["INVALID_PARAM", "NOT_FOUND", "MISMATCH", "REMOTE_DISCONNECT"])
def test_invalid_param_not_found_and_disconnect_are_never_retried(kind: str) -> None:
    for name, c in CLASSIFICATION.items():
        if c.kind == kind:
            assert c.action is not ErrorClass.RETRY, name


def test_remote_disconnect_falls_back_and_marks_the_peer_down() -> None:
    c = classify("NIXL_ERR_REMOTE_DISCONNECT")
    assert c.action is ErrorClass.FALLBACK and c.peer_down


def test_exception_name_and_status_name_of_a_row_classify_alike() -> None:
    for kind, exc_name, status, action, _, _ in classification_rows():
        for name in (exc_name, status):
            if name:
                assert classify(name).kind == kind
                assert classify(name).action is action


def test_status_strings_classify_in_any_case() -> None:
    assert classify("timeout").kind == "TIMEOUT"
    assert classify(" err ").kind == "ERR"


def test_an_unknown_name_falls_back_rather_than_retrying_blindly() -> None:
    assert classify("SOMETHING_NEW") is UNCLASSIFIED
    assert UNCLASSIFIED.action is ErrorClass.FALLBACK


def test_an_exception_classifies_by_its_class_then_its_bases() -> None:
    class nixlBackendError(Exception):  # noqa: N801 - NIXL's own spelling
        pass

    class RailDown(nixlBackendError):
        pass

    assert classify(nixlBackendError("x")).kind == "BACKEND"
    assert classify(RailDown("x")).kind == "BACKEND"
    assert classify(TimeoutError()).kind == "TIMEOUT"


def test_an_exception_classifies_by_a_status_name_in_its_message() -> None:
    assert classify(RuntimeError("post failed: NIXL_ERR_INVALID_PARAM")).action is ErrorClass.FATAL
    assert classify(RuntimeError("no clue")) is UNCLASSIFIED


# ----------------------------------------------------------------------------- policy


class TopOfWindow:
    """An RNG stub that always draws the top of the window: exposes the exponential caps."""

    def uniform(self, a: float, b: float) -> float:
        return b


def test_the_backoff_window_doubles_up_to_its_max() -> None:
    settings_ = RetrySettings(
        max_attempts=10, max_delay_s=100.0, backoff_base_s=0.1, backoff_max_s=0.5
    )
    policy = RetryPolicy.from_settings(settings_, TopOfWindow())
    waits = [policy.next_attempt_at(n, 0.0, 0.0) for n in range(1, 6)]
    assert waits == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])


def test_the_jittered_schedule_is_deterministic_for_a_seeded_rng() -> None:
    s = RetrySettings(max_attempts=6, max_delay_s=100.0, backoff_base_s=0.1, backoff_max_s=1.0)

    def schedule(seed: int) -> list[float | None]:
        policy = RetryPolicy.from_settings(s, random.Random(seed))
        return [policy.next_attempt_at(n, 0.0, 10.0) for n in range(1, 6)]

    assert schedule(42) == schedule(42)
    assert schedule(42) != schedule(43)


@CORE
@given(seed=st.integers(0, 2**32 - 1), attempt=st.integers(1, 30), now=st.floats(0, 1e6))
def test_full_jitter_draws_within_zero_and_the_exponential_cap(
    seed: int, attempt: int, now: float
) -> None:
    s = RetrySettings(max_attempts=100, max_delay_s=1e9, backoff_base_s=0.05, backoff_max_s=2.0)
    policy = RetryPolicy.from_settings(s, random.Random(seed))
    at = policy.next_attempt_at(attempt, now, now)
    assert at is not None
    cap = min(2.0, 0.05 * 2 ** (attempt - 1))
    assert now <= at <= now + cap + 1e-9


def test_gives_up_after_max_attempts() -> None:
    s = RetrySettings(max_attempts=3, max_delay_s=100.0)
    policy = RetryPolicy.from_settings(s, random.Random(0))
    assert policy.next_attempt_at(1, 0.0, 0.0) is not None
    assert policy.next_attempt_at(2, 0.0, 0.1) is not None
    assert policy.next_attempt_at(3, 0.0, 0.2) is None


def test_gives_up_once_max_delay_has_passed_since_the_first_attempt() -> None:
    s = RetrySettings(max_attempts=100, max_delay_s=5.0)
    policy = RetryPolicy.from_settings(s, random.Random(0))
    assert policy.next_attempt_at(2, 100.0, 104.9) is not None
    assert policy.next_attempt_at(2, 100.0, 105.0) is None


def test_any_tenacity_strategies_compose_into_a_policy() -> None:
    # stop_before_delay sees the upcoming wait, as in tenacity's own loop
    policy = RetryPolicy(
        stop=stop_any(stop_after_attempt(10), stop_before_delay(1.0)), wait=wait_fixed(0.4)
    )
    assert policy.next_attempt_at(1, 0.0, 0.5) == pytest.approx(0.9)
    assert policy.next_attempt_at(2, 0.0, 0.7) is None  # 0.7 + 0.4 > 1.0


def test_the_policy_uses_tenacity_strategy_objects() -> None:
    policy = RetryPolicy.from_settings(RetrySettings(), random.Random(0))
    assert isinstance(policy.wait, wait_full_jitter)
    assert isinstance(policy.stop, stop_any)


def test_attempt_numbers_start_at_one() -> None:
    with pytest.raises(ValueError, match="0"):
        RetryPolicy.from_settings(RetrySettings(), random.Random(0)).next_attempt_at(0, 0.0, 0.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"max_delay_s": 0.0},
        {"backoff_base_s": 0.0},
        {"backoff_base_s": 1.0, "backoff_max_s": 0.5},
    ],
)
def test_invalid_retry_settings_are_config_errors(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        RetrySettings(**kwargs)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- budget


def test_the_budget_starts_full_and_denies_when_empty() -> None:
    b = RetryBudget(BudgetSettings(rate_per_s=1.0, burst=3))
    assert [b.try_spend("p", 0.0) for _ in range(4)] == [True, True, True, False]
    assert b.denied == 1


def test_the_budget_refills_at_its_rate_up_to_the_burst() -> None:
    b = RetryBudget(BudgetSettings(rate_per_s=2.0, burst=3))
    for _ in range(3):
        b.try_spend("p", 0.0)
    assert b.tokens("p", 0.5) == pytest.approx(1.0)
    assert b.try_spend("p", 0.5)
    assert not b.try_spend("p", 0.5)
    assert b.tokens("p", 100.0) == pytest.approx(3.0)


def test_budgets_are_per_peer() -> None:
    b = RetryBudget(BudgetSettings(rate_per_s=0.0, burst=1))
    assert b.try_spend("p1", 0.0)
    assert not b.try_spend("p1", 1.0)
    assert b.try_spend("p2", 1.0)


def test_a_clock_stepping_back_refills_nothing() -> None:
    b = RetryBudget(BudgetSettings(rate_per_s=1.0, burst=2))
    b.try_spend("p", 10.0)
    b.try_spend("p", 10.0)
    assert b.tokens("p", 5.0) == 0.0
    assert b.tokens("p", 11.0) == pytest.approx(1.0)


def test_invalid_budget_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        BudgetSettings(rate_per_s=-1.0)
    with pytest.raises(ConfigError):
        BudgetSettings(burst=0.5)


# ----------------------------------------------------------------------------- decide


def _decide(error: str, attempt: int, budget: RetryBudget, now: float = 1.0) -> ErrorClass:
    policy = RetryPolicy.from_settings(RetrySettings(max_attempts=3), random.Random(0))
    return decide(
        error,
        attempt=attempt,
        first_attempt_at=0.0,
        now=now,
        policy=policy,
        budget=budget,
        peer="p",
    ).action


def test_decide_retries_a_transient_error_within_policy_and_budget() -> None:
    policy = RetryPolicy.from_settings(RetrySettings(max_attempts=3), random.Random(0))
    d = decide(
        "NIXL_ERR_BACKEND", attempt=1, first_attempt_at=0.0, now=1.0, policy=policy,
        budget=RetryBudget(), peer="p",
    )  # fmt: skip
    assert d.action is ErrorClass.RETRY
    assert d.retry_at is not None and d.retry_at >= 1.0


def test_decide_falls_back_when_attempts_run_out_or_the_budget_is_empty() -> None:
    assert _decide("NIXL_ERR_BACKEND", 3, RetryBudget()) is ErrorClass.FALLBACK
    empty = RetryBudget(BudgetSettings(rate_per_s=0.0, burst=1))
    empty.try_spend("p", 0.0)
    assert _decide("NIXL_ERR_BACKEND", 1, empty) is ErrorClass.FALLBACK


def test_decide_passes_fallback_and_fatal_through_without_spending_budget() -> None:
    b = RetryBudget(BudgetSettings(rate_per_s=0.0, burst=1))
    assert _decide("NIXL_ERR_INVALID_PARAM", 1, b) is ErrorClass.FATAL
    assert _decide("NIXL_ERR_REMOTE_DISCONNECT", 1, b) is ErrorClass.FALLBACK
    assert b.tokens("p", 1.0) == 1.0


# ----------------------------------------------------------------------------- breaker


def breaker(**kw: float) -> CircuitBreaker:
    base: dict[str, float] = {
        "failure_threshold": 3, "window_s": 10.0, "cooldown_s": 30.0, "max_cooldown_s": 100.0,
        "probe_timeout_s": 20.0,
    }  # fmt: skip
    base.update(kw)
    return CircuitBreaker(BreakerSettings(**base))  # type: ignore[arg-type]


def test_the_breaker_opens_after_threshold_failures_within_the_window() -> None:
    b = breaker()
    b.record_failure(0.0)
    b.record_failure(1.0)
    assert b.state(1.0) is BreakerState.CLOSED and b.allow(1.0)
    b.record_failure(2.0)
    assert b.state(2.0) is BreakerState.OPEN
    assert not b.allow(2.0)
    assert b.trips == 1


def test_failures_spread_wider_than_the_window_do_not_open_it() -> None:
    b = breaker()
    for t in (0.0, 6.0, 12.0, 18.0):
        b.record_failure(t)
    assert b.state(18.0) is BreakerState.CLOSED


def test_after_the_cooldown_exactly_one_probe_goes_through() -> None:
    b = breaker()
    for t in (0.0, 0.1, 0.2):
        b.record_failure(t)
    assert not b.allow(30.1)
    assert b.state(30.2) is BreakerState.HALF_OPEN
    assert b.allow(30.2)
    assert not b.allow(30.3)
    assert not b.allow(40.0)


def test_a_successful_probe_closes_it_and_resets_the_cooldown() -> None:
    b = breaker()
    for t in (0.0, 0.1, 0.2):
        b.record_failure(t)
    b.allow(30.2)
    b.record_failure(31.0)  # probe failed: cooldown 60
    assert b.cooldown_s == 60.0
    assert b.allow(91.0)
    b.record_success(92.0)
    assert b.state(92.0) is BreakerState.CLOSED
    assert b.cooldown_s == 30.0
    assert b.allow(92.0) and b.allow(92.0)


def test_a_failed_probe_reopens_it_with_the_cooldown_doubled_up_to_the_max() -> None:
    b = breaker()
    for t in (0.0, 0.1, 0.2):
        b.record_failure(t)
    now = 0.2
    cooldowns = []
    for _ in range(4):
        now += b.cooldown_s
        assert b.allow(now)
        b.record_failure(now)
        assert b.state(now) is BreakerState.OPEN
        cooldowns.append(b.cooldown_s)
    assert cooldowns == [60.0, 100.0, 100.0, 100.0]


def test_a_probe_that_never_reports_counts_as_failed() -> None:
    b = breaker()
    for t in (0.0, 0.1, 0.2):
        b.record_failure(t)
    assert b.allow(30.2)
    assert b.state(50.1) is BreakerState.HALF_OPEN
    assert b.state(50.2) is BreakerState.OPEN  # probe timeout 20 s
    assert b.cooldown_s == 60.0
    assert not b.allow(110.1)
    assert b.allow(110.2)


def test_results_arriving_while_open_change_nothing() -> None:
    b = breaker()
    for t in (0.0, 0.1, 0.2):
        b.record_failure(t)
    b.record_success(1.0)
    b.record_failure(2.0)
    assert b.state(2.0) is BreakerState.OPEN
    assert b.allow(30.2)  # the cooldown still runs from the first opening


def test_peer_breakers_are_independent() -> None:
    pb = PeerBreakers(BreakerSettings(failure_threshold=1))
    pb.record_failure("p1", 0.0)
    assert not pb.allow("p1", 0.0)
    assert pb.allow("p2", 0.0)
    pb.record_success("p2", 0.0)
    assert pb.states(0.0) == {"p1": BreakerState.OPEN, "p2": BreakerState.CLOSED}


def test_invalid_breaker_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        BreakerSettings(failure_threshold=0)
    with pytest.raises(ConfigError):
        BreakerSettings(cooldown_s=10.0, max_cooldown_s=5.0)
    with pytest.raises(ConfigError):
        BreakerSettings(window_s=0.0)


def test_the_transition_table_covers_every_state() -> None:
    assert {s for s, _ in BREAKER_TRANSITIONS} == set(BreakerState)
    assert BREAKER_TRANSITIONS[(BreakerState.CLOSED, BreakerEvent.TRIP)] is BreakerState.OPEN
    assert BREAKER_TRANSITIONS[(BreakerState.HALF_OPEN, BreakerEvent.FAILURE)] is BreakerState.OPEN


@CORE
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["allow", "ok", "fail"]), st.floats(0.0, 40.0)), max_size=60
    )
)
def test_half_open_lets_at_most_one_probe_through_per_opening(ops: list[tuple[str, float]]) -> None:
    b = breaker(failure_threshold=2, window_s=5.0, cooldown_s=10.0, max_cooldown_s=40.0)
    now = 0.0
    probes_this_half_open = 0
    opening = b.trips
    for op, dt in ops:
        now += dt
        before = b.state(now)
        if b.trips != opening:  # a new opening (possibly already half-open again)
            opening = b.trips
            probes_this_half_open = 0
        if op == "allow":
            allowed = b.allow(now)
            if before is BreakerState.OPEN:
                assert not allowed
            if before is BreakerState.HALF_OPEN and allowed:
                probes_this_half_open += 1
                assert probes_this_half_open == 1
        elif op == "ok":
            b.record_success(now)
        else:
            b.record_failure(now)
        assert 10.0 <= b.cooldown_s <= 40.0
