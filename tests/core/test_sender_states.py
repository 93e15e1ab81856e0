"""P's transfer states: every event goes through the transfer table, and what P holds agrees
with its machine (an event out of turn is refused or raised, never skipped in silence)."""

from __future__ import annotations

import random
from dataclasses import replace

import msgspec
import pytest

from kvpush_prod.core import messages as m
from kvpush_prod.core.actions import Note, PostWrite, ReleaseSend
from kvpush_prod.core.identity import agent_name as ag
from kvpush_prod.core.sender import Sender
from kvpush_prod.core.transfer import TransferEvent, TransferState
from kvpush_prod.errors import ProtocolError
from tests.core.sim_world import sender_disagreements
from tests.core.test_push_engines import SS, D, msgs, of, register, sender
from tests.core.test_trust import KD, KX, X

S = TransferState
V = m.PROTOCOL_VERSION


def state(s: Sender, tid: str = "t") -> TransferState:
    return s._out[tid].machine.state


def consistent(s: Sender) -> None:
    assert sender_disagreements(s) == []


def pushing() -> tuple[Sender, list[PostWrite]]:
    """``t`` registered and computed, its first chunk out (the last waits for it)."""
    s = sender()
    s.blocks_ready("t", [1, 2, 3], 0.0, owner=KD)
    s.hold("t")
    writes = of(s.on_message(register(), 0.0, origin=KD), PostWrite)
    assert writes and state(s) is S.PUSHING
    return s, writes


def pull_done(ok: bool, gen: int = 1) -> m.PullDone:
    return m.PullDone(V, "t", gen, D, ok)


# ------------------------------------------------------------------------------ PullDone
def test_a_pull_done_while_pushing_is_refused_and_the_push_goes_on() -> None:
    s, (w,) = pushing()
    out = s.on_message(pull_done(True), 0.1, origin=KD)
    assert [(n.kind, n.reason) for n in of(out, Note)] == [("rejected", "out_of_order")]
    assert of(out, ReleaseSend) == [] and state(s) is S.PUSHING and s._out["t"].outcome == ""
    consistent(s)
    (last,) = of(s.on_chunk(w.chunk_id, True, "", 0.2), PostWrite)
    assert last.done is not None
    out = s.on_chunk(last.chunk_id, True, "", 0.3)
    assert of(out, ReleaseSend) == [ReleaseSend("t", "pushed", 300)]


def test_a_pull_done_before_the_push_began_is_refused() -> None:
    # Registered, blocks not computed yet (WAITING_BLOCKS).
    s = sender()
    s.expect_blocks("t", 0.0, owner=KD)
    s.on_message(register(), 0.0, origin=KD)
    assert state(s) is S.WAITING_BLOCKS
    out = s.on_message(pull_done(True), 0.1, origin=KD)
    assert [n.reason for n in of(out, Note)] == ["out_of_order"]
    assert state(s) is S.WAITING_BLOCKS and s._out["t"].reg is not None
    writes = of(s.blocks_ready("t", [1, 2, 3], 0.2, owner=KD), PostWrite)
    assert writes  # nothing was lost: the push starts as usual
    consistent(s)


def test_a_pull_done_after_a_fallback_ends_the_transfer_in_the_machine_too() -> None:
    s, (w,) = pushing()
    out = s.on_chunk(w.chunk_id, False, "NIXL_ERR_REMOTE_DISCONNECT", 0.1)
    assert msgs(out, m.Fallback) and state(s) is S.FALLBACK
    out = s.on_message(pull_done(True), 0.5, origin=KD)
    assert out == [ReleaseSend("t", "pull_fallback", 0)] and "t" not in s._out


def test_a_failed_pull_done_while_a_given_up_push_drains_frees_without_a_fallback() -> None:
    # D gives the transfer up (PullDone not ok) while P drains a push it gave up: once the
    # chunk lands the blocks are freed as failed; before, P sent FALLBACK and never freed.
    s = sender()
    s.blocks_ready("t", [1, 2, 3, 4, 5], 0.0, owner=KD)
    s.hold("t")
    c1, c2 = of(s.on_message(register(blocks=[10, 11, 12, 13, 14]), 0.0, origin=KD), PostWrite)
    out = s.on_chunk(c1.chunk_id, False, "NIXL_ERR_REMOTE_DISCONNECT", 0.1)  # give up, drain c2
    assert msgs(out, m.Fallback) == [] and s._out["t"].drain_then == "fallback"
    assert s.on_message(pull_done(False), 0.2, origin=KD) == []
    assert state(s) is S.FAILED and s._out["t"].outcome == "failed"
    consistent(s)
    out = s.on_chunk(c2.chunk_id, True, "", 0.3)
    assert msgs(out, m.Fallback) == [] and of(out, ReleaseSend) == [ReleaseSend("t", "failed", 0)]


def test_a_pull_done_after_a_cancel_changes_nothing_while_the_push_drains() -> None:
    s, (w,) = pushing()
    assert s.on_message(m.Cancel(V, "t", 1, D, "aborted"), 0.1, origin=KD) == []
    for ok in (True, False):
        assert s.on_message(pull_done(ok), 0.2, origin=KD) == []
        assert state(s) is S.CANCELLED and s._out["t"].outcome == ""
        consistent(s)
    out = s.on_chunk(w.chunk_id, True, "", 0.3)
    assert len(msgs(out, m.CancelAck)) == 1
    assert of(out, ReleaseSend) == [ReleaseSend("t", "cancelled", 0)]


# ------------------------------------------------------------------------------ CANCEL
def test_a_cancel_while_a_restarted_decode_drains_leaves_the_transfer_failed() -> None:
    s, (w,) = pushing()
    again = msgspec.structs.replace(D, incarnation=3, agent_name=ag("agent-d2", KD))
    s.on_message(register("u", blocks=[11], sender_info=again), 0.5, origin=KD)
    assert state(s) is S.FAILED and s._out["t"].drain_then == "dropped"
    # A CANCEL the old process sent before it died, delivered late.
    assert s.on_message(m.Cancel(V, "t", 1, D, "aborted"), 0.6, origin=KD) == []
    consistent(s)
    out = s.on_chunk(w.chunk_id, False, "NIXL_ERR_REMOTE_DISCONNECT", 0.7)
    assert msgs(out, m.CancelAck) == [] and of(out, ReleaseSend) == [ReleaseSend("t", "failed", 0)]


# ------------------------------------------------------------------------------ BlocksReady
def test_blocks_handed_over_again_mid_push_raise_and_change_nothing() -> None:
    s, _ = pushing()
    o = s._out["t"]
    before = (o.blocks, o.lease_until, o.parts, o.ready, o.partial, o.machine.state)
    with pytest.raises(ProtocolError, match="handed over again in state PUSHING"):
        s.blocks_ready("t", [7, 8, 9], 0.1, owner=KD)
    assert (o.blocks, o.lease_until, o.parts, o.ready, o.partial, o.machine.state) == before


def test_blocks_of_a_transfer_already_over_are_taken_as_before() -> None:
    # The table absorbs every event after the end (a late one is normal): no error.
    s = sender()
    s.blocks_ready("t", [1], 0.0, owner=KD)
    assert s.tick(11.0)  # no REGISTER within the send lease: expired
    assert state(s) is S.FAILED and s._out["t"].outcome == "expired"
    assert s.blocks_ready("t", [1], 11.1, owner=KD) == []
    consistent(s)


# ------------------------------------------------------------------------------ give up
def test_a_push_given_up_before_any_chunk_goes_straight_to_fallback() -> None:
    s = Sender(sender().me, replace(SS, await_connect=True), random.Random(0))
    s.blocks_ready("t", [1, 2, 3], 0.0, owner=KD)
    s.hold("t")
    s.on_message(register(), 0.0, origin=KD)
    assert state(s) is S.REGISTERED
    out = s.on_peer(D.agent_name, "timed out", 0.5)
    assert msgs(out, m.Fallback) and state(s) is S.FALLBACK
    consistent(s)


def test_an_event_the_table_does_not_take_raises_naming_state_and_event() -> None:
    s, _ = pushing()
    with pytest.raises(ProtocolError, match="event PULL_DONE in state PUSHING"):
        Sender._fire(s._out["t"], TransferEvent.PULL_DONE, 0.1)
    assert state(s) is S.PUSHING


# ------------------------------------------------------------------------------ ownership
def test_a_registration_withdrawn_for_the_named_decode_leaves_the_transfer_unregistered() -> None:
    # X registered first; the router names D when the blocks come: X's registration goes,
    # and the machine says the blocks wait for a registration (it said REGISTERED with none).
    s = sender()
    s.on_message(register(sender_info=X), 0.0, origin=KX)
    assert state(s) is S.WAITING_BLOCKS
    out = s.blocks_ready("t", [1, 2, 3], 0.1, owner=KD)
    assert [n.reason for n in of(out, Note)] == ["not_owner"] and of(out, PostWrite) == []
    assert state(s) is S.WAITING_REGISTER and s._out["t"].reg is None
    consistent(s)
    writes = of(s.on_message(register(), 0.2, origin=KD), PostWrite)
    assert writes and {w.peer for w in writes} == {D.agent_name} and state(s) is S.PUSHING
    consistent(s)


def test_a_withdrawn_registration_named_before_the_blocks_starts_again_from_new() -> None:
    s = sender()
    s.on_message(register(sender_info=X), 0.0, origin=KX)
    s.expect_blocks("t", 0.5, owner=KD)
    o = s._out["t"]
    assert state(s) is S.NEW and o.reg is None and o.machine.created_at == 0.0
    consistent(s)
    # Nobody registers: the send lease still ends it once the blocks came.
    s.blocks_ready("t", [1], 1.0, owner=KD)
    s.hold("t")
    assert state(s) is S.WAITING_REGISTER
    assert of(s.tick(11.5), ReleaseSend) == [ReleaseSend("t", "expired", 0)]


def test_a_layout_refused_from_the_owner_fails_the_transfer_in_the_machine_too() -> None:
    s = sender()
    s.blocks_ready("t", [1, 2, 3], 0.0, owner=KD)
    other = m.Layout("another-model", "DRAM", [m.Region(0, 100, 100, 8)])
    bad = msgspec.structs.replace(D, incarnation=7, layout=other)
    out = s.on_message(register(sender_info=bad), 0.1, origin=KD)
    assert [f.reason for f in msgs(out, m.Failed)] == ["incompatible"]
    assert state(s) is S.FAILED and s._out["t"].outcome == "failed"
    consistent(s)
