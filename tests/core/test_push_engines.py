"""Sender (P) and Receiver (D) engines: pairing, chunking, retries, fallback, cancel, leases."""

from __future__ import annotations

import random
from dataclasses import replace

from kvpush_prod.core import messages as m
from kvpush_prod.core.actions import (
    ConnectPeer,
    Note,
    PostRead,
    PostWrite,
    ReleaseSend,
    ReportFailed,
    ReportFinished,
    SendMessage,
)
from kvpush_prod.core.digest import prompt_digest
from kvpush_prod.core.identity import agent_name as ag
from kvpush_prod.core.receiver import Receiver, ReceiverSettings
from kvpush_prod.core.retry import BreakerSettings, RetrySettings
from kvpush_prod.core.scheduler import SchedulerSettings
from kvpush_prod.core.sender import Sender, SenderSettings
from kvpush_prod.core.transfer import TransferTimeouts
from kvpush_prod.core.vocabulary import NoteKind

LAYOUT = m.Layout("c", "DRAM", [m.Region(0, 100, 100, 64)])
P = m.PeerInfo("P", 1, 0, "tcp://p:1", ag("agent-p", "tcp://p:1"), b"meta", LAYOUT)
D = m.PeerInfo("D", 2, 0, "tcp://d:1", ag("agent-d", "tcp://d:1"), b"meta", LAYOUT)
SCHED = SchedulerSettings(chunk_bytes=200, stop_margin_s=1.0)
SS = SenderSettings(
    block_bytes=100,
    scheduler=SCHED,
    send_lease_s=10,
    stop_margin_s=1,
    retry=RetrySettings(max_attempts=3, backoff_base_s=0.01, backoff_max_s=0.02),
    breaker=BreakerSettings(failure_threshold=2, window_s=10, cooldown_s=5, max_cooldown_s=10),
)
RS = ReceiverSettings(
    block_bytes=100,
    permit_ttl_s=5,
    skew_margin_s=1,
    stop_margin_s=1,
    scheduler=SCHED,
    peer_timeout_s=3,
)


def sender() -> Sender:
    return Sender(P, SS, random.Random(0))


def receiver() -> Receiver:
    return Receiver(D, RS, random.Random(0))


def register(
    tid: str = "t",
    blocks: list[int] | None = None,
    first: int = 0,
    gen: int = 1,
    ttl_ms: int = 5000,
    sender_info: m.PeerInfo = D,
) -> m.Register:
    return m.Register(
        m.PROTOCOL_VERSION,
        tid,
        sender_info,
        blocks if blocks is not None else [10, 11, 12],
        first,
        300,
        gen,
        ttl_ms,
    )


def of(actions: list, kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def msgs(actions: list, kind: type) -> list:
    return [
        a.message for a in actions if isinstance(a, SendMessage) and isinstance(a.message, kind)
    ]


def test_push_starts_when_blocks_and_register_meet_in_either_order() -> None:
    for blocks_first in (True, False):
        s = sender()
        first = (
            s.blocks_ready("t", [1, 2, 3], 0.0) if blocks_first else s.on_message(register(), 0.0)
        )
        assert of(first, PostWrite) == []
        second = (
            s.on_message(register(), 0.0) if blocks_first else s.blocks_ready("t", [1, 2, 3], 0.0)
        )
        posted = of(second, PostWrite)
        # Two chunks of at most 2 blocks; the last (with DONE) waits for the first.
        assert [w.src_blocks for w in posted] == [(1, 2)]
        assert posted[0].dst_blocks == (10, 11) and posted[0].done is None


def test_first_register_connects_to_the_decode_agent() -> None:
    s = sender()
    (connect,) = of(s.on_message(register(), 0.0), ConnectPeer)
    assert connect.info.agent_name == D.agent_name and connect.replaces == ""


def test_last_chunk_carries_done_and_release_waits_for_the_request_to_finish() -> None:
    s = sender()
    s.blocks_ready("t", [1, 2, 3], 0.0)
    (w1,) = of(s.on_message(register(), 0.0), PostWrite)
    (w2,) = of(s.on_chunk(w1.chunk_id, True, "", 0.1), PostWrite)
    assert w2.src_blocks == (3,) and w2.dst_blocks == (12,)
    assert w2.done is not None and w2.done.generation == 1 and w2.done.num_blocks == 3
    assert w2.all_src == (1, 2, 3)
    done_note = s.on_chunk(w2.chunk_id, True, "", 0.2)
    assert done_note == [Note("transfer_done", "pushed", "t")]  # timed now, freed later
    assert s.hold("t") == [ReleaseSend("t", "pushed", 300)]


def test_prefix_hit_on_decode_writes_only_the_missing_blocks() -> None:
    s = sender()
    s.blocks_ready("t", [1, 2, 3, 4], 0.0)
    (w,) = of(s.on_message(register(blocks=[20], first=3), 0.0), PostWrite)
    assert w.src_blocks == (4,) and w.dst_blocks == (20,) and w.done is not None


def test_register_with_out_of_range_or_miscounted_blocks_writes_nothing() -> None:
    for reg in (register(blocks=[10, 11, 64]), register(blocks=[10, 11])):
        s = sender()
        s.blocks_ready("t", [1, 2, 3], 0.0)
        out = s.on_message(reg, 0.0)
        assert of(out, PostWrite) == []
        (failed,) = msgs(out, m.Failed)
        assert failed.reason == "bad_blocks"
        assert s.hold("t") == [ReleaseSend("t", "failed", 0)]


def test_duplicate_register_is_idempotent_and_a_stale_one_is_fenced() -> None:
    s = sender()
    s.on_message(register(gen=2), 0.0)
    assert of(s.on_message(register(gen=2), 0.0), Note) == []
    (note,) = of(s.on_message(register(gen=1), 0.0), Note)
    assert note.kind == "fenced"


def test_a_cancel_with_a_stale_generation_changes_nothing() -> None:
    # Found by test_protocol_stateful: the fenced CANCEL still left a tombstone, so the
    # prompt's blocks were dropped unpushed when they came (and D's permit ran out).
    s = sender()
    s.expect_blocks("t", 0.0)
    s.on_message(register(gen=2), 0.0)
    (note,) = s.on_message(m.Cancel(1, "t", 1, D, "aborted"), 0.1)
    assert note.kind == "fenced"
    assert of(s.blocks_ready("t", [1, 2, 3], 0.2), PostWrite) != []


def test_a_register_with_a_stale_generation_is_fenced_even_after_a_cancel() -> None:
    # Found by test_protocol_stateful: once the transfer was cancelled (tombstoned) while a
    # chunk was still draining, a late REGISTER of an earlier generation was answered with a
    # Failed notice instead of being fenced.
    s = sender()
    s.blocks_ready("t", [1, 2, 3], 0.0)
    (w,) = of(s.on_message(register(gen=2), 0.0), PostWrite)
    assert s.on_message(m.Cancel(1, "t", 2, D, "aborted"), 0.1) == []  # drains w first
    (note,) = s.on_message(register(gen=1), 0.2)
    assert (note.kind, note.reason) == ("fenced", "stale_generation")


def test_cancel_before_blocks_frees_them_on_arrival_without_writing() -> None:
    s = sender()
    (ack,) = msgs(s.on_message(m.Cancel(1, "t", 0, D, "not_needed"), 0.0), m.CancelAck)
    assert ack.transfer_id == "t"
    assert of(s.blocks_ready("t", [1, 2, 3], 0.1), PostWrite) == []
    assert s.hold("t") == [ReleaseSend("t", "cancelled", 0)]


def test_cancel_during_push_acks_only_after_in_flight_chunks_drain() -> None:
    s = sender()
    s.blocks_ready("t", [1, 2, 3], 0.0)
    s.hold("t")
    (w1,) = of(s.on_message(register(), 0.0), PostWrite)
    assert s.on_message(m.Cancel(1, "t", 1, D, "aborted"), 0.1) == []
    out = s.on_chunk(w1.chunk_id, True, "", 0.2)
    assert of(out, PostWrite) == []  # nothing more is posted after a cancel
    assert len(msgs(out, m.CancelAck)) == 1
    assert of(out, ReleaseSend) == [ReleaseSend("t", "cancelled", 0)]


def test_retryable_chunk_error_is_retried_and_counted() -> None:
    s = sender()
    s.blocks_ready("t", [1, 2, 3], 0.0)
    s.hold("t")
    (w1,) = of(s.on_message(register(), 0.0), PostWrite)
    out = s.on_chunk(w1.chunk_id, False, "ERR:nixlBackendError", 0.1)
    assert [n.kind for n in of(out, Note)] == ["retry"]
    (w2,) = of(s.poll(0.2), PostWrite)  # after the jittered backoff
    assert w2.src_blocks == (1, 2) and w2.done is None
    (w3,) = of(s.on_chunk(w2.chunk_id, True, "", 0.3), PostWrite)
    assert w3.done is not None
    assert of(s.on_chunk(w3.chunk_id, True, "", 0.4), ReleaseSend) == [
        ReleaseSend("t", "retried", 300)
    ]


def test_a_failed_last_chunk_is_not_posted_again_until_decode_says_its_done_did_not_arrive() -> (
    None
):
    # Found by test_protocol_stateful: the last chunk carries DONE; its WRITE can fail at P
    # after the bytes and DONE reached D (an ack lost with the connection). D then reported
    # the KV and released the blocks, so a blind retry would write into freed blocks: P asks.
    s = sender()
    s.blocks_ready("t", [1], 0.0)
    s.hold("t")
    (w,) = of(s.on_message(register(blocks=[10]), 0.0), PostWrite)
    assert w.done is not None and w.done.attempt == 0
    out = s.on_chunk(w.chunk_id, False, "ERR:nixlBackendError", 0.1)
    (q,) = msgs(out, m.DoneQuery)
    assert (q.transfer_id, q.generation, q.attempt) == ("t", 1, 0)
    assert of(out, PostWrite) == [] and of(s.poll(1.0), PostWrite) == []
    assert msgs(out, m.Fallback) == []
    out = s.on_message(m.DoneState(1, "t", 1, D, 0, "pending"), 0.2)
    assert [n.kind for n in of(out, Note)] == ["retry"]
    (again,) = of(out + s.poll(0.3), PostWrite)
    assert again.done is not None and again.done.attempt == 1 and again.dst_blocks == (10,)
    assert of(s.on_chunk(again.chunk_id, True, "", 0.4), ReleaseSend) == [
        ReleaseSend("t", "retried", 100)
    ]


def test_decode_confirming_the_done_ends_the_push_without_posting_again() -> None:
    s = sender()
    s.blocks_ready("t", [1, 2, 3], 0.0)
    s.hold("t")
    (w1,) = of(s.on_message(register(), 0.0), PostWrite)
    (w2,) = of(s.on_chunk(w1.chunk_id, True, "", 0.1), PostWrite)
    out = s.on_chunk(w2.chunk_id, False, "ERR:nixlBackendError", 0.2)
    assert len(msgs(out, m.DoneQuery)) == 1
    out = s.on_message(m.DoneState(1, "t", 1, D, 0, "done"), 0.3)
    assert of(out, ReleaseSend) == [ReleaseSend("t", "retried", 300)]
    assert of(s.poll(1.0) + s.tick(2.0), PostWrite) == [] and s.active == 0


def test_a_decode_that_does_not_answer_gets_a_fallback_after_the_done_query_bound() -> None:
    s = sender()
    s.blocks_ready("t", [1], 0.0)
    s.hold("t")
    (w,) = of(s.on_message(register(blocks=[10]), 0.0), PostWrite)
    s.on_chunk(w.chunk_id, False, "ERR:nixlBackendError", 0.1)
    resent = msgs(s.tick(0.1 + SS.done_query_s / 2), m.DoneQuery)
    assert len(resent) == 1  # asked again meanwhile (a lost question is not the answer)
    assert msgs(s.tick(0.1 + SS.done_query_s * 0.9), m.Fallback) == []
    (fb,) = msgs(s.tick(0.1 + SS.done_query_s), m.Fallback)
    assert fb.reason.startswith("done_query_timeout")
    # A late answer changes nothing: D pulls.
    assert s.on_message(m.DoneState(1, "t", 1, D, 0, "done"), 2.0) == []


def test_decode_gone_ends_the_push_as_failed_without_a_fallback() -> None:
    s = sender()
    s.blocks_ready("t", [1], 0.0)
    s.hold("t")
    (w,) = of(s.on_message(register(blocks=[10]), 0.0), PostWrite)
    s.on_chunk(w.chunk_id, False, "ERR:nixlBackendError", 0.1)
    out = s.on_message(m.DoneState(1, "t", 1, D, 0, "gone"), 0.2)
    assert of(out, ReleaseSend) == [ReleaseSend("t", "failed", 0)]
    assert msgs(out, m.Fallback) == []


def test_a_done_state_from_another_engine_or_generation_or_attempt_changes_nothing() -> None:
    s = sender()
    s.blocks_ready("t", [1], 0.0)
    s.hold("t")
    (w,) = of(s.on_message(register(blocks=[10]), 0.0), PostWrite)
    s.on_chunk(w.chunk_id, False, "ERR:nixlBackendError", 0.1)
    other = m.PeerInfo("X", 5, 0, "tcp://x:1", ag("agent-x", "tcp://x:1"), b"meta", LAYOUT)
    (a,) = s.on_message(m.DoneState(1, "t", 1, other, 0, "done"), 0.2)
    (b,) = s.on_message(m.DoneState(1, "t", 1, D, 0, "done"), 0.2, origin="tcp://x:1")
    (c,) = s.on_message(m.DoneState(1, "t", 9, D, 0, "done"), 0.2)
    assert (a.reason, b.reason, c.reason) == ("not_owner", "not_owner", "stale_generation")
    assert s.on_message(m.DoneState(1, "t", 1, D, 5, "done"), 0.2) == []  # another attempt
    assert s.active == 1 and of(s.poll(0.3), PostWrite) == []
    out = s.on_message(m.DoneState(1, "t", 1, D, 0, "done"), 0.3)  # the owner's answer
    assert of(out, ReleaseSend) == [ReleaseSend("t", "retried", 100)]


def test_exhausted_retries_fall_back_to_pull_and_free_after_pull_done() -> None:
    s = sender()
    s.blocks_ready("t", [1], 0.0)
    s.hold("t")
    (w,) = of(s.on_message(register(blocks=[10]), 0.0), PostWrite)
    now, fallback = 0.1, []
    for _ in range(5):
        out = s.on_chunk(w.chunk_id, False, "ERR:nixlBackendError", now)
        (q,) = msgs(out, m.DoneQuery)
        out = s.on_message(m.DoneState(1, "t", 1, D, q.attempt, "pending"), now)
        fallback = msgs(out, m.Fallback)
        if fallback:
            break
        now += 0.05
        (w,) = of(s.poll(now), PostWrite)
    (fb,) = fallback
    assert fb.block_ids == [1] and fb.sender.agent_meta == b"meta"
    assert fb.reason.startswith("retries_exhausted")
    # P keeps its blocks until D says the pull is over.
    assert of(s.tick(now + 1), ReleaseSend) == []
    done = m.PullDone(1, "t", 1, D, True)
    assert s.on_message(done, now + 2) == [ReleaseSend("t", "pull_fallback", 0)]


def test_a_fatal_error_on_the_last_chunk_fails_the_transfer_without_asking() -> None:
    s = sender()
    s.blocks_ready("t", [1], 0.0)
    (w,) = of(s.on_message(register(blocks=[10]), 0.0), PostWrite)
    out = s.on_chunk(w.chunk_id, False, "NIXL_ERR_INVALID_PARAM", 0.1)
    assert msgs(out, m.Fallback) == [] and msgs(out, m.DoneQuery) == []
    assert len(msgs(out, m.Failed)) == 1


def test_decode_answers_a_done_query_and_voids_that_attempts_done() -> None:
    r = receiver()
    (reg,) = msgs(r.register("t", "tcp://p:1", [10], 0, 10, 0.0), m.Register)
    g = reg.generation
    (ans,) = msgs(r.on_message(m.DoneQuery(1, "t", g, P, 0), 0.1), m.DoneState)
    assert (ans.state, ans.attempt, ans.generation) == ("pending", 0, g)
    # The first post's DONE, landing late, no longer ends the receive: the re-post's does.
    (late,) = r.on_done(done(gen=g), 0.2)
    assert (late.kind, late.reason) == ("fenced", "void_attempt") and r.active == 1
    again = m.Done(m.PROTOCOL_VERSION, "t", g, 1, attempt=1)
    assert r.on_done(again, 0.3) == [ReportFinished("t", "pushed")]
    # DONE is delivered once: a second one of the generation changes nothing.
    (dup,) = r.on_done(again, 0.4)
    assert (dup.kind, dup.reason) == ("fenced", "duplicate_done")
    (ans,) = msgs(r.on_message(m.DoneQuery(1, "t", g, P, 1), 0.5), m.DoneState)
    assert ans.state == "done"


def test_decode_answers_done_once_the_done_arrived_and_gone_when_it_never_knew() -> None:
    r = receiver()
    (reg,) = msgs(r.register("t", "tcp://p:1", [10], 0, 10, 0.0), m.Register)
    assert r.on_done(done(gen=reg.generation), 0.1) == [ReportFinished("t", "pushed")]
    assert r.on_done(done(gen=reg.generation), 0.15)[0].reason == "duplicate_done"
    (ans,) = msgs(r.on_message(m.DoneQuery(1, "t", reg.generation, P, 0), 0.2), m.DoneState)
    assert ans.state == "done"
    (ans,) = msgs(r.on_message(m.DoneQuery(1, "u", 5, P, 0), 0.2), m.DoneState)
    assert ans.state == "gone"


def test_only_the_owner_may_ask_whether_done_arrived() -> None:
    r = receiver()
    (reg,) = msgs(r.register("t", "tcp://p:1", [10], 0, 10, 0.0), m.Register)
    out = r.on_message(m.DoneQuery(1, "t", reg.generation, P, 0), 0.1, origin="intruder")
    assert msgs(out, m.DoneState) == [] and [n.reason for n in of(out, Note)] == ["not_owner"]
    # Its question voided nothing: the first post's DONE still counts.
    assert r.on_done(done(gen=reg.generation), 0.2) == [ReportFinished("t", "pushed")]
    out = r.on_message(m.DoneQuery(1, "t", reg.generation, P, 0), 0.3, origin="intruder")
    assert msgs(out, m.DoneState) == [] and [n.reason for n in of(out, Note)] == ["not_owner"]


def test_an_ambiguous_last_chunk_ends_pushed_once_on_both_sides() -> None:
    # The last WRITE lands with its DONE but fails at P: P asks, D says done.
    s, r = sender(), receiver()
    (reg,) = msgs(r.register("t", P.control, [10], 0, 10, 0.0), m.Register)
    s.blocks_ready("t", [1], 0.0)
    s.hold("t")
    (w,) = of(s.on_message(reg, 0.0), PostWrite)
    assert w.done is not None
    assert r.on_done(w.done, 0.1) == [ReportFinished("t", "pushed")]
    (q,) = msgs(s.on_chunk(w.chunk_id, False, "ERR:nixlBackendError", 0.1), m.DoneQuery)
    (ans,) = msgs(r.on_message(q, 0.2), m.DoneState)
    assert of(s.on_message(ans, 0.3, origin=D.control), ReleaseSend) == [
        ReleaseSend("t", "retried", 100)
    ]


def test_fatal_error_fails_the_transfer_without_fallback() -> None:
    s = sender()
    s.blocks_ready("t", [1], 0.0)
    s.hold("t")
    (w,) = of(s.on_message(register(blocks=[10]), 0.0), PostWrite)
    out = s.on_chunk(w.chunk_id, False, "NIXL_ERR_INVALID_PARAM", 0.1)
    assert msgs(out, m.Fallback) == []
    assert len(msgs(out, m.Failed)) == 1 and ReleaseSend("t", "failed", 0) in out


def test_open_breaker_sends_new_transfers_straight_to_pull() -> None:
    s = sender()
    for i in range(2):  # two fatal-to-the-push failures trip the breaker (threshold 2)
        tid, now = f"t{i}", 0.05 * i
        s.blocks_ready(tid, [1], now)
        out = s.on_message(register(tid, blocks=[10 + i]), now)
        if i:  # the first closed the connection: D's REGISTER lets P connect anew
            assert of(out, ConnectPeer) == [ConnectPeer(D)]
            out = s.on_peer(D.agent_name, "", now)
        (w,) = of(out, PostWrite)
        s.on_chunk(w.chunk_id, False, "NIXL_ERR_REMOTE_DISCONNECT", now + 0.01)
    s.blocks_ready("t9", [1], 0.2)
    out = s.on_message(register("t9", blocks=[30]), 0.2)
    assert of(out, PostWrite) == [] and len(msgs(out, m.Fallback)) == 1


def test_chunk_failures_that_retries_absorb_do_not_open_the_breaker() -> None:
    # The breaker counts failed pushes (threshold 2), not failed chunks: under a steady rate
    # of WRITE errors that retries absorb, pushes go on instead of all turning into pulls.
    s = sender()
    s.blocks_ready("t", [1, 2, 3], 0.0)
    s.hold("t")
    (w,) = of(s.on_message(register(), 0.0), PostWrite)
    now = 0.0
    for _ in range(2):
        now += 0.05
        assert [
            n.kind for n in of(s.on_chunk(w.chunk_id, False, "ERR:nixlBackendError", now), Note)
        ] == ["retry"]
        (w,) = of(s.poll(now + 0.05), PostWrite)
    assert [v.value for v in s.breaker_states(now).values()] == ["closed"]
    s.blocks_ready("u", [1], now)
    assert len(of(s.on_message(register("u", blocks=[30]), now), PostWrite)) == 1


def test_no_write_is_posted_inside_the_stop_margin_of_the_permit() -> None:
    s = sender()
    s.on_message(register(ttl_ms=5000), 0.0)
    # Blocks arrive 4.5 s later: permit ends at 5 s, stop margin 1 s -> too late to write.
    assert of(s.blocks_ready("t", [1, 2, 3], 4.5), PostWrite) == []


def test_permit_counts_from_when_decode_granted_it_not_when_it_arrived() -> None:
    s = sender()
    s.blocks_ready("t", [1, 2, 3], 10.0)
    # The REGISTER waited 4.5 s in a queue (e.g. P was stopped): only 0.5 s of term left.
    assert of(s.on_message(register(ttl_ms=5000), 10.0, age=4.5), PostWrite) == []


def test_a_permit_renewed_by_a_heartbeat_queued_behind_its_register_still_pushes() -> None:
    """P paused 4.5 s: its REGISTER (granted at 5.5) and D's heartbeats (renewing at 9.5)
    wait in P's queue. The blocks are computed between the two: P must not drop the
    transfer on the REGISTER's stale term, the heartbeat read next starts the push."""
    s = sender()
    assert of(s.on_message(register(ttl_ms=5000), 10.0, age=4.5), PostWrite) == []
    assert of(s.blocks_ready("t", [1, 2, 3], 10.0), PostWrite) == []
    assert msgs(s.tick(10.0), m.Failed) == []
    hb = m.Heartbeat(1, D, P.incarnation, [("t", 1)], 5000)
    assert of(s.on_message(hb, 10.0, age=0.5), PostWrite) != []


def test_a_register_read_late_waits_for_its_renewal_before_the_blocks_come() -> None:
    """The same pause with the REGISTER read before P's request: a tick between the REGISTER
    and the heartbeat behind it must not end the transfer while its term still runs."""
    s = sender()
    s.on_message(register(ttl_ms=5000), 10.0, age=4.5)  # the term ends at 10.5
    assert msgs(s.tick(10.1), m.Failed) == []
    s.on_message(m.Heartbeat(1, D, P.incarnation, [("t", 1)], 5000), 10.1, age=0.5)
    assert of(s.blocks_ready("t", [1, 2, 3], 10.2), PostWrite) != []


def test_a_permit_that_runs_out_before_the_push_begins_tells_decode_at_once() -> None:
    s = sender()
    s.on_message(register(ttl_ms=5000), 10.0, age=4.5)  # the term ends at 10.5
    s.blocks_ready("t", [1, 2, 3], 10.0)
    s.hold("t")
    assert msgs(s.tick(10.2), m.Failed) == []  # a renewal may still come
    out = s.tick(10.6)
    assert [f.reason for f in msgs(out, m.Failed)] == ["permit_expired"]
    assert of(out, PostWrite) == []
    assert of(out, ReleaseSend) == [ReleaseSend("t", "expired", 0)]


def test_heartbeat_from_decode_renews_the_permit_and_the_send_lease() -> None:
    s = sender()
    s.blocks_ready("t", [1], 0.0)
    s.hold("t")
    s.on_message(register(blocks=[10], ttl_ms=5000), 0.0)  # posts the only chunk
    hb = m.Heartbeat(1, D, P.incarnation, [("t", 1)], 5000)
    s.on_message(hb, 4.0)
    # Still within the renewed permit at 7 s (would have ended at 5 s).
    assert msgs(s.tick(7.0), m.Failed) == []


def test_send_lease_expires_when_decode_never_registers_nor_asks_to_wait() -> None:
    s = sender()
    s.blocks_ready("t", [1, 2, 3], 0.0)
    s.hold("t")
    assert of(s.tick(5.0), ReleaseSend) == []
    # D waiting for credit (generation 0) keeps the lease alive.
    s.on_message(m.Heartbeat(1, D, P.incarnation, [("t", 0)], 5000), 8.0)
    assert of(s.tick(12.0), ReleaseSend) == []
    assert of(s.tick(18.5), ReleaseSend) == [ReleaseSend("t", "expired", 0)]


def test_transfer_deadline_keeps_blocks_until_the_read_permit_of_a_fallback_ends() -> None:
    # Found by test_protocol_stateful: D registered late (after waiting for credit), the push
    # fell back near the whole-transfer deadline, and P freed its blocks at that deadline
    # while D could still READ them under the pull permit it had just been given.
    settings = replace(SS, timeouts=TransferTimeouts(total_s=5.0), pull_permit_s=4.0)
    s = Sender(P, settings, random.Random(0))
    s.blocks_ready("t", [1], 0.0)
    s.hold("t")
    (w,) = of(s.on_message(register(blocks=[10]), 3.0), PostWrite)
    (fb,) = msgs(s.on_chunk(w.chunk_id, False, "NIXL_ERR_REMOTE_DISCONNECT", 3.1), m.Fallback)
    assert fb.permit_ttl_ms == 4000  # D may read until 7.1
    assert of(s.tick(5.5), ReleaseSend) == []  # past the 5 s deadline, within the permit
    assert of(s.tick(8.2), ReleaseSend) == [ReleaseSend("t", "failed", 0)]  # permit + skew


def test_chunks_always_in_flight_do_not_keep_a_transfer_past_its_deadline() -> None:
    # Found by test_protocol_stateful: on a slow link one chunk was in flight at every tick,
    # and the deadline check waited for a tick with none, so the push went on (renewed
    # permit) far past the whole-transfer bound.
    settings = replace(SS, timeouts=TransferTimeouts(total_s=5.0))
    s = Sender(P, settings, random.Random(0))
    s.blocks_ready("t", [1, 2, 3, 4, 5], 0.0)
    s.hold("t")
    w1, w2 = of(s.on_message(register(blocks=[10, 11, 12, 13, 14]), 0.0), PostWrite)
    s.on_message(m.Heartbeat(1, D, P.incarnation, [("t", 1)], 5000), 4.0)  # permit to 9 s
    assert of(s.on_chunk(w1.chunk_id, True, "", 4.9), PostWrite) == []
    assert of(s.tick(5.1), PostWrite) == []  # past the deadline, w2 still in flight
    out = s.on_chunk(w2.chunk_id, True, "", 5.2)  # the last chunk would go now
    assert of(out, PostWrite) == []
    (failed,) = msgs(out, m.Failed)
    assert failed.reason == "timeout"
    assert of(out, ReleaseSend) == [ReleaseSend("t", "expired", 0)]


def test_prefill_abort_fails_a_waiting_decode_at_once() -> None:
    s = sender()
    s.on_message(register(), 0.0)
    (failed,) = msgs(s.abort("t", 0.1), m.Failed)
    assert failed.reason == "prefill_aborted"
    # A REGISTER that arrives later for the aborted transfer is answered the same way.
    assert len(msgs(s.on_message(register(gen=2), 0.2), m.Failed)) == 1


def test_a_prompt_whose_forward_raised_is_never_written_and_decode_hears_at_once() -> None:
    # Registered first: D is told at once, nothing is written, the blocks go when held.
    s = sender()
    s.on_message(register(), 0.0)
    out = s.forward_failed("t", [1, 2, 3], 0.1)
    assert of(out, PostWrite) == []
    (failed,) = msgs(out, m.Failed)
    assert failed.reason == "prefill_failed" and failed.generation == 1
    assert s.hold("t") == [ReleaseSend("t", "failed", 0)]
    # Not registered yet: a REGISTER that comes later is failed, never written to.
    s = sender()
    assert msgs(s.forward_failed("u", [1, 2, 3], 0.0), m.Failed) == []
    late = s.on_message(register(tid="u"), 0.1)
    assert of(late, PostWrite) == [] and len(msgs(late, m.Failed)) == 1
    assert s.hold("u") == [ReleaseSend("u", "failed", 0)]


def test_restarted_decode_supersedes_its_old_agent_and_frees_old_transfers() -> None:
    s = sender()
    s.blocks_ready("t", [1], 0.0)
    s.hold("t")
    (w,) = of(s.on_message(register(blocks=[10]), 0.0), PostWrite)
    d2 = m.PeerInfo("D", 3, 0, "tcp://d:1", ag("agent-d2", "tcp://d:1"), b"meta", LAYOUT)
    out = s.on_message(register("u", blocks=[11], sender_info=d2), 1.0)
    (connect,) = of(out, ConnectPeer)
    assert connect.replaces == D.agent_name
    assert [n.kind for n in of(out, Note)] == ["peer_restart"]
    # The in-flight chunk to the dead process drains, then the blocks are freed.
    assert s.on_chunk(w.chunk_id, False, "NIXL_ERR_REMOTE_DISCONNECT", 1.1) == [
        ReleaseSend("t", "failed", 0)
    ]


def test_restarts_of_a_decode_leave_no_per_agent_state_behind() -> None:
    # Scheduler link, breaker and retry budget are kept per D agent, and each restart of a
    # D rank is a new agent: once the old one is neither met nor written to, they go.
    s = sender()
    t = 0.0
    for incarnation in range(2, 12):
        d = m.PeerInfo(
            "D",
            incarnation,
            0,
            "tcp://d:1",
            ag(f"agent-d{incarnation}", "tcp://d:1"),
            b"meta",
            LAYOUT,
        )
        tid = f"t{incarnation}"
        s.blocks_ready(tid, [1], t)
        (w,) = of(s.on_message(register(tid, blocks=[10], sender_info=d), t), PostWrite)
        s.hold(tid)
        s.on_chunk(w.chunk_id, True, "", t + 0.1)
        t += 2.0
        s.tick(t)
    sizes = s.tables()
    assert sizes["sender.peers"][0] == sizes["sender.agents"][0] == 1
    assert sizes["push.links"][0] <= 1
    assert sizes["sender.breakers"][0] <= 1
    assert sizes["sender.retry_budgets"][0] <= 1


def test_a_late_register_of_a_replaced_decode_process_changes_nothing() -> None:
    # The sender-side twin of the receiver fix (test_protocol_stateful's late messages of a
    # dead process): the dead D's REGISTER was taken for yet another restart, so P dropped
    # the transfers of the live D and disconnected its agent.
    s = sender()
    d2 = m.PeerInfo("D", 3, 0, "tcp://d:1", ag("agent-d2", "tcp://d:1"), b"meta", LAYOUT)
    s.on_message(register("old", blocks=[10]), 0.0)  # D, incarnation 2
    s.blocks_ready("t", [1, 2, 3], 1.0)
    (connect,) = of(s.on_message(register("t", sender_info=d2), 1.0), ConnectPeer)
    assert connect.replaces == D.agent_name  # D restarted as incarnation 3
    (note,) = s.on_message(register("late", blocks=[11]), 1.1)  # the dead one's, late
    assert (note.kind, note.reason) == ("fenced", "stale_generation")
    assert s.on_message(m.Heartbeat(1, D, P.incarnation, [("t", 1)], 5000), 1.2) == [note]
    assert "late" not in s._out  # internal: no transfer made up for the dead process


# -------------------------------------------------------------------------------- receiver


def done(tid: str = "t", gen: int = 1) -> m.Done:
    return m.Done(m.PROTOCOL_VERSION, tid, gen, 3)


def test_receiver_registers_with_a_fresh_generation_and_finishes_on_done() -> None:
    r = receiver()
    (reg,) = msgs(r.register("t", "tcp://p:1", [10, 11, 12], 0, 300, 0.0), m.Register)
    assert reg.generation >= 1 and reg.permit_ttl_ms == 5000
    assert r.on_done(done(gen=reg.generation), 0.1) == [ReportFinished("t", "pushed")]
    assert r.active == 0


def test_a_done_of_the_previous_protocol_that_ends_a_push_says_which_prefill_sent_it() -> None:
    # A DONE is a NIXL notification: an older P may push without any control message of its
    # version reaching D, so the receive it ends is where D learns P's release.
    r = receiver()
    (reg,) = msgs(r.register("t", "tcp://p:1", [10, 11, 12], 0, 300, 0.0, owner="P"), m.Register)
    older = m.Done(m.PROTOCOL_VERSION - 1, "t", reg.generation, 3)
    assert r.on_done(older, 0.1) == [
        ReportFinished("t", "pushed"),
        Note(NoteKind.OLDER_PREFILL, "P", "tcp://p:1", float(m.PROTOCOL_VERSION - 1)),
    ]
    # Only a DONE that ends the push says it: one refused, or of the current protocol, not.
    (reg,) = msgs(r.register("u", "tcp://p:1", [10, 11, 12], 0, 300, 0.2, owner="P"), m.Register)
    bad = m.Done(m.PROTOCOL_VERSION - 1, "u", reg.generation, 3)
    assert not of(r.on_done(bad, 0.3, verified=False), Note)
    (reg,) = msgs(r.register("w", "tcp://p:1", [10, 11, 12], 0, 300, 0.4, owner="P"), m.Register)
    assert r.on_done(done("w", gen=reg.generation), 0.5) == [ReportFinished("w", "pushed")]


def test_done_with_unknown_id_or_stale_generation_is_rejected() -> None:
    r = receiver()
    (reg,) = msgs(r.register("t", "tcp://p:1", [10], 0, 10, 0.0), m.Register)
    (a,) = r.on_done(done("other"), 0.1)
    (b,) = r.on_done(done("t", gen=reg.generation + 7), 0.1)
    assert (a.kind, a.reason) == ("rejected", "unknown_transfer")
    assert (b.kind, b.reason) == ("fenced", "stale_generation")
    assert r.active == 1


def test_kv_stated_for_another_prompt_is_refused_pushed_or_pulled() -> None:
    mine, theirs = prompt_digest([1, 2, 3]), prompt_digest([1, 2, 4])
    # P states the digest of the prompt it computed on the DONE and on a FALLBACK.
    s = sender()
    s.blocks_ready("t", [1], 0.0, prompt=theirs)
    (w,) = of(s.on_message(register(blocks=[10]), 0.0), PostWrite)
    assert w.done is not None and w.done.prompt == theirs
    # D takes a DONE only for its own prompt: another prompt's KV never becomes usable.
    for stated, ok in ((mine, True), (theirs, False), (b"", False)):
        r = receiver()
        (reg,) = msgs(r.register("t", "tcp://p:1", [10], 0, 10, 0.0, prompt=mine), m.Register)
        out = r.on_done(m.Done(m.PROTOCOL_VERSION, "t", reg.generation, 1, prompt=stated), 0.1)
        if ok:
            assert out == [ReportFinished("t", "pushed")]
            continue
        assert of(out, ReportFailed) == [
            ReportFailed("t", "prompt_mismatch", "the KV pushed is another prompt's")
        ]
        assert [n.reason for n in of(out, Note)] == ["prompt_mismatch"]
        assert r.active == 0
    # A FALLBACK offering another prompt's KV is not read: D tells P and fails the receive.
    r = receiver()
    (reg,) = msgs(r.register("t", "tcp://p:1", [10], 0, 10, 0.0, prompt=mine), m.Register)
    fb = m.Fallback(1, "t", reg.generation, P, [1], 0, "push_failed", 30_000, prompt=theirs)
    out = r.on_message(fb, 0.1)
    assert of(out, PostRead) == [] and [d.ok for d in msgs(out, m.PullDone)] == [False]
    assert [n.reason for n in of(out, Note)] == ["prompt_mismatch"]
    (failed,) = of(out, ReportFailed)
    assert failed.detail == "prompt_mismatch"


def test_checksum_mismatch_fails_the_receive() -> None:
    r = receiver()
    (reg,) = msgs(r.register("t", "tcp://p:1", [10], 0, 10, 0.0), m.Register)
    (fin,) = r.on_done(done(gen=reg.generation), 0.1, verified=False)
    assert isinstance(fin, ReportFailed) and fin.reason == "checksum_mismatch"


def test_silent_prefill_fails_the_receive_only_after_permit_expiry_plus_skew() -> None:
    r = receiver()
    r.register("t", "tcp://p:1", [10], 0, 10, 0.0)
    assert of(r.tick(5.5), ReportFailed) == []  # permit over, P may still write: skew margin
    (fin,) = of(r.tick(6.1), ReportFailed)
    assert fin.reason == "permit_expired"


def test_live_prefill_keeps_the_permit_renewed() -> None:
    r = receiver()
    (reg,) = msgs(r.register("t", "tcp://p:1", [10], 0, 10, 0.0), m.Register)
    now = 0.0
    while now < 20.0:
        hb = m.Heartbeat(1, P, D.incarnation, [("t", reg.generation)])
        r.on_message(hb, now)
        assert of(r.tick(now), ReportFailed) == []
        now += 0.5
    assert r.active == 1


def test_abort_releases_blocks_only_after_cancel_ack_or_fence() -> None:
    r = receiver()
    (reg,) = msgs(r.register("t", "tcp://p:1", [10], 0, 10, 0.0), m.Register)
    (cancel,) = msgs(r.abort("t", 0.1), m.Cancel)
    assert cancel.generation == reg.generation
    assert of(r.tick(1.0), ReportFinished) == []
    ack = m.CancelAck(1, "t", reg.generation, P)
    assert of(r.on_message(ack, 1.1), ReportFinished) == [ReportFinished("t", "aborted")]
    r.register("u", "tcp://p:1", [11], 0, 10, 2.0)
    r.abort("u", 2.0)
    assert of(r.tick(6.5), ReportFinished) == []
    assert of(r.tick(8.1), ReportFinished) == [ReportFinished("u", "aborted")]


def test_failed_notice_from_prefill_fails_the_receive_at_once() -> None:
    r = receiver()
    (reg,) = msgs(r.register("t", "tcp://p:1", [10], 0, 10, 0.0), m.Register)
    out = r.on_message(m.Failed(1, "t", reg.generation, P, "prefill_aborted"), 0.1)
    assert of(out, ReportFailed) == [ReportFailed("t", "prefill_aborted", "")]


def test_fallback_pulls_every_block_then_tells_prefill() -> None:
    r = receiver()
    (reg,) = msgs(r.register("t", "tcp://p:1", [10, 11, 12], 0, 300, 0.0), m.Register)
    fb = m.Fallback(1, "t", reg.generation, P, [1, 2, 3], 0, "push_failed", 30_000)
    out = r.on_message(fb, 0.1)
    assert len(of(out, ConnectPeer)) == 1
    reads = of(out, PostRead)
    assert [(x.local_blocks, x.remote_blocks) for x in reads] == [((10, 11), (1, 2))]
    out = r.on_chunk(reads[0].chunk_id, True, "", 0.2)
    (last,) = of(out, PostRead)
    out = r.on_chunk(last.chunk_id, True, "", 0.3)
    (pull_done,) = msgs(out, m.PullDone)
    assert pull_done.ok
    assert of(out, ReportFinished) == [ReportFinished("t", "pull_fallback", -1, (10, 11, 12))]


def test_a_read_that_completes_after_the_read_permit_fails_the_pull() -> None:
    # Found by the nemesis over network namespaces: a READ posted in time completed after
    # P's read permit (its reply held by a throttled or partitioned link); P had freed and
    # reused its blocks meanwhile, so the bytes may be another prompt's KV.
    r = receiver()
    (reg,) = msgs(r.register("t", "tcp://p:1", [10], 0, 100, 0.0), m.Register)
    fb = m.Fallback(1, "t", reg.generation, P, [1], 0, "push_failed", 2_000)
    (read,) = of(r.on_message(fb, 0.1), PostRead)
    out = r.on_chunk(read.chunk_id, True, "", 2.2)  # the permit ran out at 2.1
    assert of(out, ReportFinished) == []
    assert ("lease_expired", "pull") in [(n.kind, n.reason) for n in of(out, Note)]
    (pull_done,) = msgs(out, m.PullDone)
    assert not pull_done.ok
    (failed,) = of(out, ReportFailed)
    assert failed.reason == "pull_failed" and "after the read permit" in failed.detail


def test_a_read_that_completes_within_the_read_permit_is_used() -> None:
    r = receiver()
    (reg,) = msgs(r.register("t", "tcp://p:1", [10], 0, 100, 0.0), m.Register)
    fb = m.Fallback(1, "t", reg.generation, P, [1], 0, "push_failed", 2_000)
    (read,) = of(r.on_message(fb, 0.1), PostRead)
    out = r.on_chunk(read.chunk_id, True, "", 2.1)  # at the permit's end: still in time
    assert of(out, ReportFinished) == [ReportFinished("t", "pull_fallback", -1, (10,))]


def test_restarted_prefill_fails_its_old_transfers_at_once() -> None:
    r = receiver()
    (reg,) = msgs(r.register("t", "tcp://p:1", [10], 0, 10, 0.0), m.Register)
    r.on_message(m.Heartbeat(1, P, D.incarnation, [("t", reg.generation)]), 0.5)
    p2 = m.PeerInfo("P", 99, 0, "tcp://p:1", ag("agent-p2", "tcp://p:1"))
    out = r.on_message(m.Heartbeat(1, p2, D.incarnation, []), 1.0)
    assert of(out, ReportFailed) == [
        ReportFailed("t", "peer_restarted", "prefill tcp://p:1 restarted")
    ]


def test_a_transfer_registered_after_prefill_restarted_survives_the_new_prefill() -> None:
    # Found by test_protocol_stateful: D stamped the transfer with the P incarnation it had
    # last heard at that address; P had restarted, the new process got the REGISTER and
    # pushed, and its first heartbeat made D fail the receive and free the blocks while the
    # push was still writing into them.
    r = receiver()
    r.on_message(m.Heartbeat(1, P, D.incarnation, []), 0.0)  # the old P
    (reg,) = msgs(r.register("t", "tcp://p:1", [10], 0, 10, 0.5), m.Register)
    p2 = m.PeerInfo("P", 99, 0, "tcp://p:1", ag("agent-p2", "tcp://p:1"))
    out = r.on_message(m.Heartbeat(1, p2, D.incarnation, [("t", reg.generation)]), 1.0)
    assert of(out, ReportFailed) == []
    assert r.on_done(done(gen=reg.generation), 1.1) == [ReportFinished("t", "pushed")]


def test_a_late_message_of_a_replaced_prefill_process_changes_nothing() -> None:
    # Found by test_protocol_stateful (messages of a crashed process delivered late): the
    # incarnation seen at an address flipped back to the dead process, so D took the live
    # P's transfers for the dead one's and freed their blocks while the live P pushed.
    r = receiver()
    p2 = m.PeerInfo("P", 99, 0, "tcp://p:1", ag("agent-p2", "tcp://p:1"))
    r.on_message(m.Heartbeat(1, P, D.incarnation, []), 0.0)  # P, incarnation 1
    r.on_message(m.Heartbeat(1, p2, D.incarnation, []), 5.0)  # P restarted: incarnation 99
    (reg,) = msgs(r.register("t", "tcp://p:1", [10], 0, 10, 5.1), m.Register)
    r.on_message(m.Heartbeat(1, p2, D.incarnation, [("t", reg.generation)]), 5.2)
    (note,) = r.on_message(m.Heartbeat(1, P, D.incarnation, []), 5.3)  # the dead one's, late
    assert (note.kind, note.reason) == ("fenced", "stale_generation")
    (note,) = r.on_message(m.Failed(1, "t", reg.generation, P, "x"), 5.4)
    assert (note.kind, note.reason) == ("fenced", "stale_generation")
    assert r.on_done(done(gen=reg.generation), 5.5) == [ReportFinished("t", "pushed")]


def test_waiting_for_credit_is_announced_to_prefill_with_generation_zero() -> None:
    r = receiver()
    r.await_admission("t", "tcp://p:1")
    (hb,) = msgs(r.tick(0.0), m.Heartbeat)
    assert hb.live == [("t", 0)]


def test_register_before_the_prefill_request_is_kept_alive_for_the_grace_period() -> None:
    s = sender()
    s.on_message(register(), 0.0)  # the decode leg was faster than the prefill leg
    (hb,) = msgs(s.tick(0.5), m.Heartbeat)
    assert hb.live == [("t", 1)]
    # Renewed by D meanwhile, the registration is still listed within the grace period...
    s.on_message(m.Heartbeat(1, D, P.incarnation, [("t", 1)], 5000), 9.0)
    assert msgs(s.tick(9.5), m.Heartbeat)[0].live == [("t", 1)]
    # ...and not after it, unless the prefill request showed up.
    s.on_message(m.Heartbeat(1, D, P.incarnation, [("t", 1)], 5000), 10.4)
    assert msgs(s.tick(10.6), m.Heartbeat) == []
    s.expect_blocks("t", 10.7)
    assert msgs(s.tick(11.7), m.Heartbeat)[0].live == [("t", 1)]


# Data-parallel engine cores behind one API server share one key (one origin) and have
# rank 0 each; vLLM names them <engine id>_dp<N>. Each is its own peer, not a restart of
# the other.
PKEY, DKEY = "p-key", "d-key"


def _core(engine_id: str, incarnation: int, port: int, key: str) -> m.PeerInfo:
    return m.PeerInfo(
        engine_id,
        incarnation,
        0,
        f"tcp://p:{port}",
        ag(f"agent-{engine_id}-{incarnation}", key),
        b"meta",
        LAYOUT,
    )


def test_prefill_dp_ranks_sharing_a_key_are_not_restarts_of_one_another() -> None:
    r = receiver()
    p0, p1 = _core("P_dp0", 1, 1, PKEY), _core("P_dp1", 2, 2, PKEY)
    (reg0,) = msgs(r.register("t0", "tcp://p:1", [10], 0, 10, 0.0, owner=PKEY), m.Register)
    (reg1,) = msgs(r.register("t1", "tcp://p:2", [11], 0, 10, 0.0, owner=PKEY), m.Register)
    out = r.on_message(
        m.Heartbeat(1, p0, D.incarnation, [("t0", reg0.generation)]), 0.1, origin=PKEY
    )
    out += r.on_message(
        m.Heartbeat(1, p1, D.incarnation, [("t1", reg1.generation)]), 0.2, origin=PKEY
    )
    out += r.on_message(
        m.Heartbeat(1, p0, D.incarnation, [("t0", reg0.generation)]), 0.3, origin=PKEY
    )
    assert of(out, ReportFailed) == []
    assert [n for n in of(out, Note) if n.kind in ("peer_restart", "fenced")] == []
    # A restart of one core (same engine id, new incarnation) still fails what it held.
    p1b = _core("P_dp1", 3, 2, PKEY)
    out = r.on_message(m.Heartbeat(1, p1b, D.incarnation, []), 0.4, origin=PKEY)
    assert of(out, ReportFailed) == [
        ReportFailed("t1", "peer_restarted", "prefill tcp://p:2 restarted")
    ]
    assert r.on_done(done("t0", reg0.generation), 0.5, agent=p0.agent_name) == [
        ReportFinished("t0", "pushed")
    ]


def test_decode_dp_ranks_sharing_a_key_each_get_their_own_agent() -> None:
    s = sender()
    d0, d1 = _core("D_dp0", 5, 1, DKEY), _core("D_dp1", 6, 2, DKEY)
    s.blocks_ready("t0", [1], 0.0)
    s.blocks_ready("t1", [2], 0.0)
    out0 = s.on_message(register("t0", blocks=[10], sender_info=d0), 0.1, origin=DKEY)
    out1 = s.on_message(register("t1", blocks=[11], sender_info=d1), 0.2, origin=DKEY)
    (c0,), (c1,) = of(out0, ConnectPeer), of(out1, ConnectPeer)
    assert (c0.replaces, c1.replaces) == ("", "")
    assert [n for n in of(out1, Note) if n.kind == "peer_restart"] == []
    assert [w.peer for w in of(out0 + out1, PostWrite)] == [d0.agent_name, d1.agent_name]
