"""Sender (P) and Receiver (D) engines: pairing, chunking, cancel, expiry, stale input."""

from __future__ import annotations

from kvpush_prod.core import messages as m
from kvpush_prod.core.push import (
    FinishRecv,
    FinishSend,
    PostWrite,
    PushSettings,
    Receiver,
    Rejected,
    Sender,
    SendMessage,
)

LAYOUT = m.Layout("c", "DRAM", [m.Region(0, 100, 100, 64)])
P = m.PeerInfo("P", 1, 0, "tcp://p:1", "agent-p", b"", LAYOUT)
D = m.PeerInfo("D", 2, 0, "tcp://d:1", "agent-d", b"", LAYOUT)
S = PushSettings(block_bytes=100, chunk_blocks=2, send_lease_s=10, stop_margin_s=1,
                 permit_ttl_s=5, skew_margin_s=1)


def register(tid: str = "t", blocks: list[int] | None = None, first: int = 0, gen: int = 1,
             ttl_ms: int = 5000) -> m.Register:
    return m.Register(m.PROTOCOL_VERSION, tid, D, blocks if blocks is not None else [10, 11, 12],
                      first, 300, gen, ttl_ms)


def writes(actions: list) -> list[PostWrite]:
    return [a for a in actions if isinstance(a, PostWrite)]


def test_push_starts_when_blocks_and_register_meet_in_either_order() -> None:
    for blocks_first in (True, False):
        s = Sender(P, S)
        first = (s.blocks_ready("t", "req", [1, 2, 3], 0.0) if blocks_first
                 else s.on_message(register(), 0.0))
        assert writes(first) == []
        second = (s.on_message(register(), 0.0) if blocks_first
                  else s.blocks_ready("t", "req", [1, 2, 3], 0.0))
        posted = writes(second)
        # Two chunks of at most 2 blocks; the last (with DONE) waits for the first.
        assert [w.local_blocks for w in posted] == [[1, 2]]
        assert posted[0].remote_blocks == [10, 11] and posted[0].done is None


def test_last_chunk_carries_done_and_leaves_after_the_others() -> None:
    s = Sender(P, S)
    s.blocks_ready("t", "req", [1, 2, 3], 0.0)
    (w1,) = writes(s.on_message(register(), 0.0))
    (w2,) = writes(s.on_chunk(w1.chunk_id, True, "", 0.1))
    assert w2.local_blocks == [3] and w2.remote_blocks == [12]
    assert w2.done is not None and w2.done.generation == 1 and w2.done.num_blocks == 3
    assert w2.transfer_blocks == [1, 2, 3]
    # Blocks are freed only once the scheduler handed them over (request finished).
    assert s.on_chunk(w2.chunk_id, True, "", 0.2) == []
    (fin,) = s.hold("t")
    assert fin == FinishSend("req", "t", "pushed", 300)


def test_prefix_hit_on_decode_writes_only_the_missing_blocks() -> None:
    s = Sender(P, S)
    s.blocks_ready("t", "req", [1, 2, 3, 4], 0.0)
    (w,) = writes(s.on_message(register(blocks=[20], first=3), 0.0))
    assert w.local_blocks == [4] and w.remote_blocks == [20] and w.done is not None


def test_register_with_out_of_range_or_miscounted_blocks_writes_nothing() -> None:
    for reg in (register(blocks=[10, 11, 64]), register(blocks=[10, 11])):
        s = Sender(P, S)
        s.blocks_ready("t", "req", [1, 2, 3], 0.0)
        out = s.on_message(reg, 0.0)
        assert writes(out) == []
        failed = [a for a in out if isinstance(a, SendMessage)]
        assert isinstance(failed[0].msg, m.Failed) and failed[0].msg.reason == "bad_blocks"
        assert s.hold("t") == [FinishSend("req", "t", "failed", 0)]


def test_duplicate_register_is_idempotent_and_a_stale_one_is_rejected() -> None:
    s = Sender(P, S)
    s.on_message(register(gen=2), 0.0)
    assert s.on_message(register(gen=2), 0.0) == []
    (rej,) = s.on_message(register(gen=1), 0.0)
    assert isinstance(rej, Rejected) and rej.reason == "stale_generation"


def test_cancel_before_blocks_frees_them_on_arrival_without_writing() -> None:
    s = Sender(P, S)
    (ack,) = s.on_message(m.Cancel(1, "t", 0, D, "not_needed"), 0.0)
    assert isinstance(ack.msg, m.CancelAck)
    assert writes(s.blocks_ready("t", "req", [1, 2, 3], 0.1)) == []
    assert s.hold("t") == [FinishSend("req", "t", "cancelled", 0)]


def test_cancel_during_push_acks_only_after_in_flight_chunks_drain() -> None:
    s = Sender(P, S)
    s.blocks_ready("t", "req", [1, 2, 3], 0.0)
    s.hold("t")
    (w1,) = writes(s.on_message(register(), 0.0))
    assert s.on_message(m.Cancel(1, "t", 1, D, "aborted"), 0.1) == []
    out = s.on_chunk(w1.chunk_id, True, "", 0.2)
    assert writes(out) == []  # nothing more is posted after a cancel
    kinds = [type(a.msg).__name__ if isinstance(a, SendMessage) else type(a).__name__
             for a in out]
    assert kinds == ["CancelAck", "FinishSend"]


def test_failed_chunk_tells_decode_after_draining_and_frees() -> None:
    s = Sender(P, S)
    s.blocks_ready("t", "req", [1, 2, 3], 0.0)
    s.hold("t")
    (w1,) = writes(s.on_message(register(), 0.0))
    out = s.on_chunk(w1.chunk_id, False, "ERR:nixlBackendError", 0.1)
    msgs = [a.msg for a in out if isinstance(a, SendMessage)]
    assert isinstance(msgs[0], m.Failed) and msgs[0].reason == "ERR:nixlBackendError"
    assert FinishSend("req", "t", "failed", 0) in out


def test_no_write_is_posted_inside_the_stop_margin_of_the_permit() -> None:
    s = Sender(P, S)
    s.on_message(register(ttl_ms=5000), 0.0)
    # Blocks arrive 4.5 s later: permit ends at 5 s, stop margin 1 s -> too late to write.
    assert writes(s.blocks_ready("t", "req", [1, 2, 3], 4.5)) == []


def test_send_lease_expires_when_decode_never_registers() -> None:
    s = Sender(P, S)
    s.blocks_ready("t", "req", [1, 2, 3], 0.0)
    s.hold("t")
    assert s.tick(5.0) == []
    assert s.tick(10.5) == [FinishSend("req", "t", "expired", 0)]


def test_prefill_abort_fails_a_waiting_decode_at_once() -> None:
    s = Sender(P, S)
    s.on_message(register(), 0.0)
    (msg,) = s.abort("t", 0.1)
    assert isinstance(msg.msg, m.Failed) and msg.msg.reason == "prefill_aborted"
    # A REGISTER that arrives later for the aborted transfer is answered the same way.
    (late,) = s.on_message(register(tid="t", gen=2), 0.2)
    assert isinstance(late.msg, m.Failed)


# -------------------------------------------------------------------------------- receiver


def done(tid: str = "t", gen: int = 1) -> m.Done:
    return m.Done(m.PROTOCOL_VERSION, tid, gen, 3)


def test_receiver_registers_with_a_fresh_generation_and_finishes_on_done() -> None:
    r = Receiver(D, S)
    (send,) = r.expect("t", "req", "tcp://p:1", [10, 11, 12], 0, 300, 0.0)
    assert isinstance(send.msg, m.Register) and send.msg.generation == 1
    assert send.msg.permit_ttl_ms == 5000
    assert r.on_done(done(), 0.1) == [FinishRecv("req", "t", True, "pushed")]
    assert r.active == 0


def test_done_with_unknown_id_or_stale_generation_is_rejected() -> None:
    r = Receiver(D, S)
    r.expect("t", "req", "tcp://p:1", [10], 0, 10, 0.0)
    (a,) = r.on_done(done("other"), 0.1)
    (b,) = r.on_done(done("t", gen=7), 0.1)
    assert (a.reason, b.reason) == ("unknown_transfer", "stale_generation")
    assert r.active == 1


def test_checksum_mismatch_fails_the_receive() -> None:
    r = Receiver(D, S)
    r.expect("t", "req", "tcp://p:1", [10], 0, 10, 0.0)
    (fin,) = r.on_done(done(), 0.1, verified=False)
    assert not fin.ok and fin.reason == "checksum_mismatch"


def test_receive_fails_only_after_permit_expiry_plus_skew() -> None:
    r = Receiver(D, S)
    r.expect("t", "req", "tcp://p:1", [10], 0, 10, 0.0)
    assert r.tick(5.5) == []  # permit over, but P might still write within the skew margin
    (fin,) = r.tick(6.0)
    assert fin == FinishRecv("req", "t", False, "expired", "permit_expired")


def test_abort_releases_blocks_only_after_cancel_ack_or_fence() -> None:
    r = Receiver(D, S)
    r.expect("t", "req", "tcp://p:1", [10], 0, 10, 0.0)
    (cancel,) = r.abort("t", 0.1)
    assert isinstance(cancel.msg, m.Cancel) and cancel.msg.generation == 1
    assert r.tick(1.0) == []
    ack = m.CancelAck(1, "t", 1, P)
    assert r.on_message(ack, 1.1) == [FinishRecv("req", "t", True, "aborted")]
    r.expect("u", "req2", "tcp://p:1", [11], 0, 10, 2.0)
    r.abort("u", 2.0)
    assert r.tick(8.0) == [FinishRecv("req2", "u", True, "aborted")]


def test_failed_notice_from_prefill_fails_the_receive_at_once() -> None:
    r = Receiver(D, S)
    r.expect("t", "req", "tcp://p:1", [10], 0, 10, 0.0)
    out = r.on_message(m.Failed(1, "t", 1, P, "prefill_aborted"), 0.1)
    assert out == [FinishRecv("req", "t", False, "failed", "prefill_aborted")]
