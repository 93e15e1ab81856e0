"""The per-transfer state machine: its one table, monotonic phases, sticky ends, deadlines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush_prod.core.transfer import (
    LIVE,
    PHASE,
    TERMINAL,
    TRANSITIONS,
    TransferEvent,
    TransferMachine,
    TransferState,
    TransferTimeouts,
    next_state,
    transition_table_markdown,
)
from kvpush_prod.errors import ConfigError, ProtocolError

CORE = settings.get_profile("kvpush-core")
S, E = TransferState, TransferEvent
DOC = Path(__file__).resolve().parents[2] / "docs" / "core.md"


def run(events: list[TransferEvent], now: float = 0.0) -> TransferMachine:
    m = TransferMachine("t1", now, TransferTimeouts())
    for e in events:
        m.fire(e, now)
    return m


def test_every_transition_keeps_or_advances_the_phase() -> None:
    for (src, event), dst in TRANSITIONS.items():
        assert PHASE[dst] >= PHASE[src], f"{src.value} --{event.value}--> {dst.value} goes back"


def test_terminal_states_have_no_outgoing_entries_and_every_live_state_can_end() -> None:
    assert not any(src in TERMINAL for src, _ in TRANSITIONS)
    for state in LIVE:
        assert TRANSITIONS[(state, E.CANCEL)] is S.CANCELLED
        assert TRANSITIONS[(state, E.FAIL)] is S.FAILED
        assert TRANSITIONS[(state, E.EXPIRE)] is S.FAILED


def test_every_live_state_has_a_timeout_and_terminal_states_none() -> None:
    t = TransferTimeouts()
    for state in LIVE:
        timeout = t.timeout_for(state)
        assert timeout is not None and timeout > 0
    for state in TERMINAL:
        assert t.deadline_for(state, 0.0) is None


def test_sender_push_path_either_order_of_register_and_blocks() -> None:
    for first, second in ((E.REGISTER, E.BLOCKS_READY), (E.BLOCKS_READY, E.REGISTER)):
        m = run([first, second, E.CHUNK_POSTED, E.CHUNK_POSTED, E.CHUNK_DONE, E.CHUNK_DONE])
        assert m.state is S.PUSHING
        m.fire(E.DONE, 1.0)
        assert m.state is S.DONE


def test_receiver_sees_only_register_then_done() -> None:
    assert run([E.BLOCKS_READY, E.REGISTER, E.DONE]).state is S.DONE


def test_a_chunk_error_retries_then_pushes_again() -> None:
    m = run([E.REGISTER, E.BLOCKS_READY, E.CHUNK_POSTED, E.CHUNK_POSTED, E.CHUNK_ERROR])
    assert m.state is S.RETRYING
    m.fire(E.CHUNK_DONE, 0.0)  # the other chunk still lands
    m.fire(E.RETRY, 0.0)
    assert m.state is S.PUSHING


def test_fallback_ends_done_after_the_pull() -> None:
    m = run([E.REGISTER, E.BLOCKS_READY, E.CHUNK_POSTED, E.CHUNK_ERROR, E.FALLBACK])
    assert m.state is S.FALLBACK
    for e in (E.CHUNK_POSTED, E.CHUNK_DONE, E.PULL_DONE):
        m.fire(e, 0.0)
    assert m.state is S.DONE


def test_an_open_breaker_goes_straight_from_registered_to_fallback() -> None:
    assert run([E.REGISTER, E.BLOCKS_READY, E.FALLBACK]).state is S.FALLBACK


def test_an_event_without_a_table_entry_raises_naming_state_and_event() -> None:
    m = run([E.REGISTER])
    with pytest.raises(ProtocolError, match=r"'t1'.*CHUNK_POSTED.*WAITING_BLOCKS"):
        m.fire(E.CHUNK_POSTED, 0.0)
    assert m.state is S.WAITING_BLOCKS  # unchanged
    with pytest.raises(ProtocolError, match="REGISTER in state RETRYING"):
        next_state(S.RETRYING, E.REGISTER)


def test_terminal_states_are_sticky_and_late_events_are_ignored_and_counted() -> None:
    for events in ([E.CANCEL], [E.FAIL], [E.REGISTER, E.BLOCKS_READY, E.DONE]):
        m = run(events)
        end = m.state
        assert m.terminal
        assert m.fire(E.CHUNK_DONE, 5.0) is False
        assert m.fire(E.DONE, 5.0) is False
        assert m.fire(E.CANCEL, 5.0) is False
        assert m.state is end and m.ignored == 3
        assert m.deadline() is None and not m.expired(1e9)


def test_the_state_deadline_starts_when_the_state_is_entered_not_on_self_loops() -> None:
    t = TransferTimeouts(pushing_s=5.0, total_s=100.0)
    m = TransferMachine("t1", 0.0, t)
    m.fire(E.REGISTER, 1.0)
    m.fire(E.BLOCKS_READY, 2.0)
    m.fire(E.CHUNK_POSTED, 3.0)
    m.fire(E.CHUNK_DONE, 6.0)
    m.fire(E.CHUNK_POSTED, 7.0)
    assert m.deadline() == 8.0
    assert not m.expired(7.99) and m.expired(8.0)


def test_the_total_timeout_bounds_a_transfer_that_keeps_retrying() -> None:
    t = TransferTimeouts(pushing_s=5.0, retrying_s=5.0, total_s=12.0)
    m = TransferMachine("t1", 0.0, t)
    for e in (E.REGISTER, E.BLOCKS_READY, E.CHUNK_POSTED):
        m.fire(e, 0.0)
    now = 0.0
    while not m.expired(now):
        now += 1.0
        m.fire(E.CHUNK_ERROR if m.state is S.PUSHING else E.RETRY, now)
    assert now == 12.0


def test_deadline_for_adds_the_state_timeout() -> None:
    t = TransferTimeouts(waiting_s=7.0)
    assert t.deadline_for(S.WAITING_BLOCKS, 3.0) == 10.0
    assert t.deadline_for(S.WAITING_REGISTER, 3.0) == 10.0


def test_invalid_timeouts_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="pushing_s"):
        TransferTimeouts(pushing_s=0.0)


@CORE
@given(st.lists(st.sampled_from(list(TransferEvent)), max_size=30))
def test_random_event_sequences_never_go_back_and_fail_only_without_an_entry(
    events: list[TransferEvent],
) -> None:
    m = TransferMachine("t1", 0.0, TransferTimeouts())
    for i, e in enumerate(events):
        before = m.state
        allowed = before in TERMINAL or (before, e) in TRANSITIONS
        assert m.can_fire(e) == allowed
        if allowed:
            m.fire(e, float(i))
            assert PHASE[m.state] >= PHASE[before]
            if before in TERMINAL:
                assert m.state is before
        else:
            with pytest.raises(ProtocolError):
                m.fire(e, float(i))
            assert m.state is before


def test_the_state_table_in_docs_core_md_matches_the_code() -> None:
    text = DOC.read_text()
    found = re.search(
        r"<!-- transfer-table:start -->\n(.*?)<!-- transfer-table:end -->", text, re.S
    )
    assert found, f"{DOC} lacks the transfer-table markers"
    assert found.group(1) == transition_table_markdown(), (
        "docs/core.md's transfer table drifted from core/transfer.py; regenerate it with "
        "`python -c 'from kvpush_prod.core.transfer import transition_table_markdown as t;"
        ' print(t(), end="")\'`'
    )
