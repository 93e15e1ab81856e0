"""CreditLedger: admit / later / refuse, idempotent release, aging, and its invariants."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpush_prod.core.credits import CreditLedger, CreditSettings, Decision
from kvpush_prod.errors import ConfigError, ProtocolError

CORE = settings.get_profile("kvpush-core")


def ledger(budget: int = 10, cap: int = 6, aging: float = 2.0, stale: float = 30.0) -> CreditLedger:
    return CreditLedger(CreditSettings(budget, cap, aging_s=aging, stale_waiter_s=stale))


def test_admits_within_budget_and_counts_the_grant_per_peer() -> None:
    led = ledger()
    a = led.request("t1", "p1", 4, now=0.0)
    assert a.decision is Decision.ADMIT and a.admitted
    assert led.in_use == 4 and led.free == 6
    credit = led.peer_credit("p1")
    assert (credit.granted_total, credit.released_total, credit.in_use) == (4, 0, 4)


def test_later_when_the_budget_is_full_then_admit_after_a_release() -> None:
    led = ledger(budget=10, cap=10)
    assert led.request("t1", "p1", 7, 0.0).admitted
    later = led.request("t2", "p2", 5, 0.1)
    assert later.decision is Decision.LATER
    assert "7/10" in later.reason
    assert led.release("t1")
    assert led.request("t2", "p2", 5, 0.2).admitted


def test_later_when_the_peer_is_at_its_cap_even_with_budget_free() -> None:
    led = ledger(budget=10, cap=4)
    assert led.request("t1", "p1", 3, 0.0).admitted
    later = led.request("t2", "p1", 2, 0.0)
    assert later.decision is Decision.LATER and "'p1'" in later.reason
    assert led.request("t3", "p2", 2, 0.0).admitted


@pytest.mark.parametrize(("nblocks", "budget", "cap"), [(11, 10, 10), (5, 10, 4)])
def test_refuses_what_can_never_fit_instead_of_answering_later(
    nblocks: int, budget: int, cap: int
) -> None:
    led = ledger(budget=budget, cap=cap)
    a = led.request("big", "p1", nblocks, 0.0)
    assert a.decision is Decision.REFUSE
    assert str(nblocks) in a.reason
    assert not led.is_waiting("big") and led.in_use == 0


def test_a_waiter_whose_request_grows_past_the_cap_is_refused_and_forgotten() -> None:
    led = ledger(budget=10, cap=6)
    led.request("w", "p1", 6, 0.0)
    led.request("t", "p2", 6, 0.0)  # waits
    assert led.request("t", "p2", 7, 1.0).decision is Decision.REFUSE
    assert not led.is_waiting("t")


def test_release_is_idempotent_and_counts_duplicates() -> None:
    led = ledger()
    led.request("t1", "p1", 3, 0.0)
    assert led.release("t1") is True
    assert led.release("t1") is False
    assert led.release("never") is False
    assert led.in_use == 0
    assert led.peer_credit("p1").released_total == 3
    assert led.stats().duplicate_releases == 2
    assert led.stats().released == 1


def test_asking_again_for_an_admitted_transfer_is_idempotent() -> None:
    led = ledger()
    assert led.request("t1", "p1", 3, 0.0).admitted
    again = led.request("t1", "p1", 3, 0.5)
    assert again.admitted and again.reason == "already admitted"
    assert led.in_use == 3 and led.peer_credit("p1").granted_total == 3


def test_an_admitted_transfer_asking_for_fewer_blocks_keeps_its_credit_shrunk() -> None:
    led = ledger(budget=10, cap=10)
    assert led.request("t1", "p1", 5, 0.0).admitted
    smaller = led.request("t1", "p1", 3, 0.1)  # the local prefix hit grew between asks
    assert smaller.admitted and led.holds("t1")
    assert led.in_use == 3 and led.peer_credit("p1").in_use == 3
    assert led.release("t1") and led.in_use == 0 and led.peer_credit("p1").in_use == 0


def test_an_admitted_transfer_asking_for_more_blocks_is_decided_afresh() -> None:
    led = ledger(budget=10, cap=10)
    assert led.request("t1", "p1", 3, 0.0).admitted
    assert led.request("t1", "p1", 6, 0.1).admitted  # room: re-granted at the new size
    assert led.in_use == 6 and led.peer_credit("p1").in_use == 6
    assert led.request("t2", "p2", 4, 0.2).admitted
    later = led.request("t1", "p1", 7, 0.3)  # no room for 7 now: it loses its grant and waits
    assert later.decision is Decision.LATER and not led.holds("t1") and led.is_waiting("t1")
    assert led.in_use == 4 and led.peer_credit("p1").in_use == 0
    assert not led.release("t1")  # waiting only: no credit to return
    assert led.in_use == 4


def test_an_admitted_transfer_growing_past_the_budget_is_refused_and_holds_nothing() -> None:
    led = ledger(budget=10, cap=10)
    assert led.request("t1", "p1", 8, 0.0).admitted
    assert led.request("t1", "p1", 11, 0.1).decision is Decision.REFUSE
    assert led.in_use == 0 and not led.holds("t1")


def test_the_same_transfer_asked_for_from_another_peer_is_a_protocol_error() -> None:
    led = ledger()
    led.request("t1", "p1", 3, 0.0)
    with pytest.raises(ProtocolError, match=r"'t1'.*3 blocks.*'p1'.*4.*'p2'"):
        led.request("t1", "p2", 4, 0.0)


def test_a_negative_request_is_a_protocol_error_naming_the_value() -> None:
    with pytest.raises(ProtocolError, match="-1"):
        ledger().request("t1", "p1", -1, 0.0)


def test_a_zero_block_request_is_admitted_without_using_credit() -> None:
    led = ledger(budget=1, cap=1)
    led.request("full", "p1", 1, 0.0)
    assert led.request("empty", "p1", 0, 0.0).admitted
    assert led.in_use == 1


def test_an_aged_waiter_holds_back_newcomers_until_it_fits() -> None:
    led = ledger(budget=10, cap=10, aging=2.0)
    assert led.request("a", "p1", 6, 0.0).admitted
    assert led.request("big", "p2", 8, 0.0).decision is Decision.LATER
    # Before the aging bound, a small newcomer may pass the big waiter.
    assert led.request("small1", "p3", 2, 1.0).admitted
    # After it, newcomers that would eat the big waiter's room are held back.
    held = led.request("small2", "p3", 1, 2.5)
    assert held.decision is Decision.LATER and "'big'" in held.reason
    led.release("a")
    assert led.request("small2", "p3", 1, 3.0).decision is Decision.LATER  # 7 left < 8
    assert led.request("big", "p2", 8, 3.0).admitted
    led.release("small1")
    assert led.request("small2", "p3", 1, 3.0).admitted


def test_newcomers_that_leave_room_for_the_aged_waiter_still_get_in() -> None:
    led = ledger(budget=20, cap=5, aging=1.0)
    assert led.request("a", "p1", 5, 0.0).admitted
    assert led.request("b", "p1", 4, 0.0).decision is Decision.LATER  # p1 at its cap
    # b is aged now, blocked only by its peer's cap: another peer still fits beside it.
    assert led.request("c", "p2", 5, 2.0).admitted
    assert led.request("d", "p2", 0, 2.0).admitted
    # but nothing that would leave less than b's 4 blocks of budget.
    assert led.request("e", "p3", 5, 2.0).admitted  # 15 used, 5 free >= 4
    held = led.request("f", "p4", 2, 2.0)  # would leave 3 < 4
    assert held.decision is Decision.LATER and "'b'" in held.reason


def test_a_waiter_that_stopped_asking_is_forgotten_and_blocks_nobody() -> None:
    led = ledger(budget=10, cap=10, aging=1.0, stale=5.0)
    led.request("a", "p1", 6, 0.0)
    assert led.request("ghost", "p2", 8, 0.0).decision is Decision.LATER
    # ghost is aged but silent; after stale_waiter_s it no longer holds others back
    assert led.request("x", "p3", 1, 2.0).decision is Decision.LATER
    assert led.request("x", "p3", 1, 6.0).admitted
    assert not led.is_waiting("ghost")
    assert led.stats().stale_waiters_dropped == 1


def test_release_of_a_waiting_transfer_forgets_it() -> None:
    led = ledger(budget=10, cap=10, aging=0.0)
    led.request("a", "p1", 6, 0.0)
    led.request("aborted", "p2", 8, 0.0)
    assert led.release("aborted") is False  # it held nothing
    assert not led.is_waiting("aborted")
    assert led.request("x", "p3", 4, 0.0).admitted


@pytest.mark.parametrize(
    "kwargs",
    [
        {"budget_blocks": -1, "per_peer_cap_blocks": 1},
        {"budget_blocks": 1, "per_peer_cap_blocks": -1},
        {"budget_blocks": 1, "per_peer_cap_blocks": 1, "aging_s": -1.0},
        {"budget_blocks": 1, "per_peer_cap_blocks": 1, "stale_waiter_s": 0.0},
    ],
)
def test_invalid_settings_are_config_errors(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        CreditSettings(**kwargs)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- properties


class LedgerMachine(RuleBasedStateMachine):
    """Random request / release sequences never break the budget or cap invariants."""

    def __init__(self) -> None:
        super().__init__()
        self.led = ledger(budget=12, cap=7, aging=1.5, stale=4.0)
        self.now = 0.0
        self.held: dict[str, tuple[str, int]] = {}

    @rule(
        tid=st.sampled_from([f"t{i}" for i in range(12)]),
        peer=st.sampled_from(["p1", "p2", "p3"]),
        n=st.integers(0, 14),
    )
    def request(self, tid: str, peer: str, n: int) -> None:
        if tid in self.held:
            peer, n = self.held[tid]
        a = self.led.request(tid, peer, n, self.now)
        if a.decision is Decision.ADMIT:
            self.held[tid] = (peer, n)
        if a.decision is Decision.REFUSE:
            assert n > 12 or n > 7
        else:
            assert n <= 12 and n <= 7

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(sorted(self.held)))
        del self.held[tid]
        assert self.led.release(tid)
        assert not self.led.release(tid)

    @rule(dt=st.floats(0.0, 3.0))
    def advance(self, dt: float) -> None:
        self.now += dt

    @invariant()
    def blocks_in_use_never_exceed_budget_nor_cap(self) -> None:
        assert self.led.in_use == sum(n for _, n in self.held.values())
        assert 0 <= self.led.in_use <= 12
        for peer in ("p1", "p2", "p3"):
            c = self.led.peer_credit(peer)
            assert c.in_use == sum(n for p, n in self.held.values() if p == peer)
            assert 0 <= c.in_use <= 7
            assert c.granted_total >= c.released_total >= 0


TestLedgerInvariants = LedgerMachine.TestCase
TestLedgerInvariants.settings = settings(CORE, stateful_step_count=40)


@CORE
@given(
    budget=st.integers(1, 12),
    cap_frac=st.floats(0.3, 1.0),
    aging=st.integers(0, 4),
    hold_max=st.integers(1, 5),
    arrivals=st.lists(
        st.tuples(
            st.integers(0, 15), st.sampled_from("abc"), st.integers(1, 12), st.integers(1, 5)
        ),
        min_size=1,
        max_size=25,
    ),
    order_seed=st.randoms(use_true_random=False),
)
def test_every_transfer_that_keeps_asking_is_admitted_within_the_aging_bound(
    budget: int,
    cap_frac: float,
    aging: int,
    hold_max: int,
    arrivals: list[tuple[int, str, int, int]],
    order_seed: random.Random,
) -> None:
    """Bound: admitted within ceil(aging) + (k + 1) * hold_max steps of the first ask,
    k = transfers already waiting then, when every holder keeps credit <= hold_max steps."""
    cap = max(1, math.floor(budget * cap_frac))
    led = ledger(budget=budget, cap=cap, aging=float(aging), stale=1e9)
    pending = sorted(
        (step, f"t{i}", peer, n, min(hold, hold_max))
        for i, (step, peer, n, hold) in enumerate(arrivals)
    )
    waiting: dict[str, tuple[str, int, int, int]] = {}  # tid -> peer, n, hold, first ask
    ahead: dict[str, int] = {}
    holders: dict[str, int] = {}  # tid -> release step
    admitted_wait: dict[str, int] = {}
    step = 0
    while pending or waiting or holders:
        assert step < 10_000, "simulation did not finish: some wait never ended"
        for tid, end in list(holders.items()):
            if end <= step:
                del holders[tid]
                led.release(tid)
        while pending and pending[0][0] <= step:
            _, tid, peer, n, hold = pending.pop(0)
            waiting[tid] = (peer, n, hold, step)
        order = list(waiting)
        order_seed.shuffle(order)
        for tid in order:
            peer, n, hold, first = waiting[tid]
            if tid not in ahead:
                # The ledger queues waiters in the order they first asked: k counts those
                # still waiting that asked before (same-step arrivals ask in any order).
                ahead[tid] = sum(1 for t in waiting if t in ahead)
            a = led.request(tid, peer, n, float(step))
            if a.decision is Decision.REFUSE:
                assert n > budget or n > cap
                del waiting[tid]
            elif a.decision is Decision.ADMIT:
                del waiting[tid]
                holders[tid] = step + hold
                admitted_wait[tid] = step - first
        assert led.in_use <= budget
        step += 1
    for tid, wait in admitted_wait.items():
        bound = aging + (ahead[tid] + 1) * hold_max
        assert wait <= bound, f"{tid} waited {wait} steps > bound {bound}"


def test_a_grant_never_exceeds_the_capacity_d_has_now() -> None:
    led = ledger(budget=10, cap=10)
    full = led.request("t1", "p1", 4, 0.0, capacity=3)
    assert full.decision is Decision.LATER and "KV cache full: 3 blocks free" in full.reason
    assert led.in_use == 0 and led.is_waiting("t1")
    assert led.request("t1", "p1", 4, 0.1, capacity=4).admitted


def test_capacity_never_refuses_only_the_budget_does() -> None:
    # Room comes back as requests finish: a wait for capacity ends; one for budget never.
    led = ledger(budget=10, cap=10)
    assert led.request("t1", "p1", 8, 0.0, capacity=0).decision is Decision.LATER
    assert led.request("t2", "p1", 11, 0.0, capacity=1000).decision is Decision.REFUSE


def test_with_room_in_the_cache_the_budget_is_the_cap() -> None:
    led = ledger(budget=10, cap=10)
    assert led.request("t1", "p1", 6, 0.0, capacity=1000).admitted
    later = led.request("t2", "p1", 5, 0.0, capacity=1000)
    assert later.decision is Decision.LATER and "budget full" in later.reason


def test_the_aged_head_keeps_its_room_within_the_capacity() -> None:
    led = ledger(budget=100, cap=100, aging=1.0)
    assert led.request("big", "p1", 8, 0.0, capacity=5).decision is Decision.LATER
    # Past aging, a small one may not take what the head needs of the real room.
    held = led.request("small", "p2", 2, 2.0, capacity=9)
    assert held.decision is Decision.LATER and "held back" in held.reason
    assert led.request("small", "p2", 2, 2.1, capacity=10).admitted


@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.integers(1, 6), st.integers(0, 12), st.booleans()),
        max_size=60,
    )
)
@CORE
def test_grants_fit_the_capacity_of_each_ask(steps: list[tuple[int, int, int, bool]]) -> None:
    led = ledger(budget=12, cap=12)
    for i, (tid, n, capacity, release) in enumerate(steps):
        key = f"t{tid}"
        if release:
            led.release(key)
            continue
        held_before = led.holds(key)
        admitted = led.request(key, "p", n, float(i), capacity=capacity).admitted
        if admitted and not held_before:
            assert n <= capacity  # a new grant fits the room D has now
        assert led.in_use <= 12
