"""D's admission of inbound transfers (core.admission): what each ask answers, what P must
hear of it, and when the credit comes back."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from kvpush_prod.core.admission import Admissions, Verdict, blocks_to_receive
from kvpush_prod.core.credits import CreditLedger, CreditSettings, Decision
from kvpush_prod.core.vocabulary import Outcome

BS = 16  # tokens per block
CORE = settings.get_profile("kvpush-core")


def admissions(budget: int = 10, cap: int = 10) -> Admissions[str]:
    return Admissions(CreditLedger(CreditSettings(budget, cap)), BS)


@pytest.mark.parametrize(
    ("prompt", "computed", "span"),
    [
        (100, 0, (0, 7)),
        (100, 16, (1, 6)),
        (100, 20, (1, 6)),
        (96, 95, (5, 1)),
        (16, 0, (0, 1)),
    ],
)
def test_the_span_starts_at_the_first_block_not_fully_computed(
    prompt: int, computed: int, span: tuple[int, int]
) -> None:
    assert blocks_to_receive(prompt, computed, BS) == span


def test_an_admitted_request_loads_its_missing_tokens_and_counts_once() -> None:
    a = admissions()
    rx = a.track("r", "t", "p:1", "remote")
    first = a.ask("r", 100, 20, 0.0)
    assert (first.verdict, first.decision, first.tokens, first.nblocks) == (
        Verdict.LOAD,
        Decision.ADMIT,
        80,
        6,
    )
    assert first.first_admit and not first.wait_over and first.not_needed is None
    again = a.ask("r", 100, 20, 1.0)
    assert again.verdict is Verdict.LOAD and not again.first_admit
    assert (rx.first_block, rx.nblocks, rx.admitted) == (1, 6, True)
    assert a.ledger.in_use == 6


def test_a_request_told_later_asks_p_to_wait_once_and_hears_when_it_is_over() -> None:
    a = admissions(budget=10)
    a.track("big", "t1", "p:1", "")
    assert a.ask("big", 160, 0, 0.0).verdict is Verdict.LOAD  # 10 blocks: the whole budget
    a.track("r", "t2", "p:1", "")
    later = a.ask("r", 32, 0, 0.0)
    assert (later.verdict, later.decision, later.first_wait) == (
        Verdict.LATER,
        Decision.LATER,
        True,
    )
    assert not a.ask("r", 32, 0, 0.1).first_wait
    a.ended("big")
    admitted = a.ask("r", 32, 0, 0.2)
    assert admitted.verdict is Verdict.LOAD and admitted.wait_over and admitted.first_admit


def test_a_prefix_hit_loads_nothing_and_tells_p_it_is_not_needed() -> None:
    a = admissions()
    a.track("r", "t", "p:1", "")
    answer = a.ask("r", 64, 64, 0.0)
    assert (answer.verdict, answer.decision, answer.not_needed) == (
        Verdict.LOCAL,
        None,
        Outcome.PREFIX_HIT,
    )
    assert a.get("r") is None and a.is_over("r") and a.ledger.in_use == 0


def test_a_request_that_can_never_fit_is_recomputed_and_p_told() -> None:
    a = admissions(budget=4)
    a.track("r", "t", "p:1", "")
    answer = a.ask("r", 100, 0, 0.0)
    assert (answer.verdict, answer.decision, answer.not_needed, answer.nblocks) == (
        Verdict.LOCAL,
        Decision.REFUSE,
        Outcome.RECOMPUTE,
        7,
    )
    assert "budget is 4" in answer.reason
    assert a.is_over("r") and a.ledger.waiting == 0


def test_an_allocated_receive_is_over_for_asks_and_aborted_when_the_request_ends() -> None:
    a = admissions()
    a.track("r", "t", "p:1", "")
    a.ask("r", 48, 0, 0.0)
    rx = a.allocated("r", 3)
    assert rx is not None and rx.allocated and a.is_over("r")
    finish = a.finish("r")
    assert finish.abort and finish.not_needed is None and a.aborting == 1
    assert not a.is_over("r")  # a request id is asked about again only once reused
    ended, credited = a.ended("r")
    assert ended is rx and credited and a.ledger.in_use == 0 and a.aborting == 0


def test_a_request_that_ends_before_its_blocks_frees_p_and_its_credit() -> None:
    a = admissions()
    a.track("r", "t", "p:1", "")
    a.ask("r", 48, 0, 0.0)
    finish = a.finish("r")
    assert finish.not_needed is Outcome.ABORTED and not finish.abort
    assert a.get("r") is None and a.ledger.in_use == 0


def test_a_request_without_a_transfer_finishes_with_nothing_to_do() -> None:
    a = admissions()
    assert a.ask("nobody", 10, 0, 0.0).verdict is Verdict.LOCAL
    assert a.finish("nobody").rx is None
    assert a.ended("nobody") == (None, False)


def test_a_withdrawn_admission_gives_its_credit_back_and_asks_again() -> None:
    a = admissions()
    a.track("r", "t", "p:1", "")
    a.ask("r", 48, 0, 0.0)
    a.withdraw("r")
    assert a.ledger.in_use == 0
    assert a.ask("r", 48, 0, 1.0).first_admit


def test_a_skipped_request_is_over() -> None:
    a = admissions()
    a.skip("r")
    assert a.is_over("r") and a.get("r") is None


def test_an_admitted_request_asked_again_with_a_larger_prefix_hit_loads_fewer_blocks() -> None:
    # vLLM asks again after allocate_slots failed; meanwhile another request with the same
    # system prompt was cached, so the local hit grew by two blocks.
    a = admissions()
    rx = a.track("r", "t", "p:1", "")
    assert a.ask("r", 100, 0, 0.0).nblocks == 7
    again = a.ask("r", 100, 32, 0.1)
    assert (again.verdict, again.tokens, again.nblocks) == (Verdict.LOAD, 68, 5)
    assert (rx.first_block, rx.nblocks, rx.admitted) == (2, 5, True)
    assert a.ledger.in_use == 5
    a.allocated("r", 5)
    a.ended("r")
    assert a.ledger.in_use == 0


def test_an_admitted_request_asked_again_with_a_smaller_hit_waits_when_there_is_no_room() -> None:
    a = admissions(budget=10)
    a.track("r", "t1", "p:1", "")
    assert a.ask("r", 100, 48, 0.0).nblocks == 4
    a.track("other", "t2", "p:1", "")
    assert a.ask("other", 96, 0, 0.0).verdict is Verdict.LOAD  # 6 blocks: budget full
    later = a.ask("r", 100, 0, 0.1)  # its cached prefix was evicted: 7 blocks now
    assert (later.verdict, later.first_wait) == (Verdict.LATER, True)
    assert not a.get("r").admitted  # type: ignore[union-attr]
    assert a.ledger.in_use == 6
    a.ended("other")
    back = a.ask("r", 100, 0, 0.2)
    assert back.verdict is Verdict.LOAD and back.wait_over and back.first_admit
    assert a.ledger.in_use == 7


def test_blocks_granted_but_not_allocated_are_not_counted_as_free_twice() -> None:
    a = admissions(budget=100, cap=100)
    a.track("r1", "t1", "p:1", "")
    a.track("r2", "t2", "p:1", "")
    assert a.ask("r1", 64, 0, 0.0, free_blocks=6).verdict is Verdict.LOAD  # 4 blocks promised
    assert a.promised() == 4
    later = a.ask("r2", 64, 0, 0.0, free_blocks=6)  # only 2 of the 6 are not promised
    assert later.verdict is Verdict.LATER
    a.allocated("r1", 4)  # now they are gone from the pool, and no longer promised
    assert a.promised() == 0
    assert a.ask("r2", 64, 0, 0.1, free_blocks=4).verdict is Verdict.LOAD


def test_asking_again_does_not_count_its_own_grant_against_itself() -> None:
    a = admissions(budget=100, cap=100)
    a.track("r", "t", "p:1", "")
    assert a.ask("r", 64, 0, 0.0, free_blocks=4).verdict is Verdict.LOAD
    assert a.ask("r", 64, 0, 0.1, free_blocks=4).verdict is Verdict.LOAD


def test_a_dropped_transfer_returns_its_credit_and_is_over() -> None:
    a = admissions()
    a.track("r", "t", "p:1", "")
    a.ask("r", 64, 0, 0.0)
    assert a.drop("r") is not None
    assert a.ledger.in_use == 0 and a.is_over("r") and a.get("r") is None
    assert a.drop("r") is None


class AdmissionsMachine(RuleBasedStateMachine):
    """vLLM's calls in any order (asks with changing prefix hits and free blocks, failed
    allocations, allocations, ends, aborts): no ask ever raises, a grant never exceeds the
    budget or the free blocks not promised to others, and once every request has ended no
    credit is held."""

    KEYS = [f"r{i}" for i in range(6)]

    def __init__(self) -> None:
        super().__init__()
        self.a: Admissions[str] = Admissions(CreditLedger(CreditSettings(12, 12)), BS)
        self.now = 0.0
        self.live: set[str] = set()

    @rule(
        key=st.sampled_from(KEYS),
        prompt=st.integers(1, 160),
        hit_blocks=st.integers(0, 10),
        free=st.one_of(st.none(), st.integers(0, 20)),
    )
    def ask(self, key: str, prompt: int, hit_blocks: int, free: int | None) -> None:
        if self.a.is_over(key):
            return
        rx = self.a.get(key)
        if rx is not None and rx.allocated:
            return
        self.a.track(key, f"t-{key}", "p:1", "")
        self.live.add(key)
        promised = self.a.promised(exclude=key)
        was_admitted = rx is not None and rx.admitted
        old = rx.nblocks if rx is not None else 0
        answer = self.a.ask(key, prompt, min(hit_blocks * BS, prompt), self.now, free)
        if answer.verdict is Verdict.LOAD and free is not None:
            grew = not was_admitted or answer.nblocks > old
            if grew:
                assert answer.nblocks <= max(0, free - promised)
        assert self.a.ledger.in_use <= 12

    @rule(key=st.sampled_from(KEYS))
    def allocate(self, key: str) -> None:
        rx = self.a.get(key)
        if rx is not None and rx.admitted and not rx.allocated:
            self.a.allocated(key, rx.nblocks)

    @rule(key=st.sampled_from(KEYS))
    def receive_ends(self, key: str) -> None:
        rx = self.a.get(key)
        if rx is not None and rx.allocated:
            self.a.ended(key)

    @rule(key=st.sampled_from(KEYS))
    def request_ends(self, key: str) -> None:
        finish = self.a.finish(key)
        if finish.abort:
            self.a.ended(key)  # the fence reported it
        self.live.discard(key)

    @rule(dt=st.floats(0.0, 3.0))
    def advance(self, dt: float) -> None:
        self.now += dt

    def teardown(self) -> None:
        for key in list(self.live):
            self.request_ends(key)
        assert self.a.ledger.in_use == 0
        assert len(self.a) == 0


AdmissionsMachine.TestCase.settings = CORE
test_admissions_machine = AdmissionsMachine.TestCase
