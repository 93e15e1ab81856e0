"""Per-key quotas of the core: how many REGISTERs of transfers P does not know one key may
have P keep, and heartbeats cut small enough for the peer's codec."""

from __future__ import annotations

import random

import pytest

from kvpush_prod.control.codec import ControlCodec
from kvpush_prod.core import messages as m
from kvpush_prod.core.actions import Note, SendMessage
from kvpush_prod.core.identity import agent_name as ag
from kvpush_prod.core.quotas import (
    HEARTBEAT_LIVE_BYTES,
    SMALL_MESSAGE_BYTES,
    OriginBook,
    entry_bytes,
    live_batches,
)
from kvpush_prod.core.receiver import Receiver, ReceiverSettings
from kvpush_prod.core.sender import Sender, SenderSettings

V = m.PROTOCOL_VERSION
LAYOUT = m.Layout("c", "DRAM", [m.Region(0, 100, 100, 64)])
P = m.PeerInfo("P", 1, 0, "tcp://p:1", ag("agent-p", "tcp://p:1"), b"meta", LAYOUT)
QUOTA = 8


def sender(quota: int = QUOTA) -> Sender:
    return Sender(
        P, SenderSettings(block_bytes=100, max_unknown_per_origin=quota), random.Random(0)
    )


def decode_of(key: str) -> m.PeerInfo:
    """A decode rank whose agent is named for ``key`` (what P requires of it)."""
    return m.PeerInfo(f"D-{key}", 2, 0, f"tcp://{key}:1", ag(f"agent-{key}", key), b"meta", LAYOUT)


def register(tid: str, key: str, gen: int = 1, ttl_ms: int = 5000) -> m.Register:
    return m.Register(V, tid, decode_of(key), [10, 11, 12], 0, 300, gen, ttl_ms)


def reasons(actions: list) -> list[str]:
    return [a.reason for a in actions if isinstance(a, Note) and a.kind == "rejected"]


# ------------------------------------------------------------------ the book


def test_origin_book_counts_each_origin_on_its_own() -> None:
    book = OriginBook(2)
    book.add("a", "t1")
    book.add("a", "t1")  # the same id twice is one
    assert not book.full("a")
    book.add("a", "t2")
    assert book.full("a") and not book.full("b") and len(book) == 2
    book.discard("a", "t1")
    book.discard("b", "nothing")
    assert book.count("a") == 1 and not book.full("a")
    with pytest.raises(ValueError, match="at least 1"):
        OriginBook(0)


# ------------------------------------------------------------------ REGISTERs of unknown transfers


def test_a_key_at_its_registration_quota_is_refused_and_counted_and_another_key_is_not() -> None:
    s = sender()
    for i in range(QUOTA):
        assert reasons(s.on_message(register(f"x{i}", "evil"), 0.0, origin="evil")) == []
    out = s.on_message(register("x-over", "evil"), 0.0, origin="evil")
    assert reasons(out) == ["quota_registrations"]
    assert not [a for a in out if isinstance(a, SendMessage)]  # nothing goes to it
    assert s.active == QUOTA  # the refused one is not kept
    # The real decode engine registers its own transfers as before.
    assert reasons(s.on_message(register("real", "good"), 0.0, origin="good")) == []
    assert s.active == QUOTA + 1


def test_a_transfer_the_engine_names_no_longer_counts_and_makes_room() -> None:
    s = sender()
    for i in range(QUOTA):
        s.on_message(register(f"x{i}", "d"), 0.0, origin="d")
    assert reasons(s.on_message(register("later", "d"), 0.0, origin="d")) == ["quota_registrations"]
    s.expect_blocks("x0", 0.1)  # P's scheduler has it: a transfer of P's own now
    assert reasons(s.on_message(register("later", "d"), 0.2, origin="d")) == []
    s.blocks_ready("x1", [1, 2, 3], 0.3)
    assert reasons(s.on_message(register("later-2", "d"), 0.4, origin="d")) == []
    assert reasons(s.on_message(register("later-3", "d"), 0.5, origin="d")) == [
        "quota_registrations"
    ]


def test_registrations_that_end_make_room() -> None:
    s = sender()
    for i in range(QUOTA):
        s.on_message(register(f"x{i}", "d", ttl_ms=2000), 0.0, origin="d")
    s.abort("x0", 0.5)  # P's engine dropped it
    assert reasons(s.on_message(register("y0", "d", ttl_ms=60_000), 0.6, origin="d")) == []
    assert reasons(s.on_message(register("y1", "d"), 0.7, origin="d")) == ["quota_registrations"]
    s.tick(10.0)  # the others' permits ran out: P forgets them
    for i in range(1, QUOTA):
        assert reasons(s.on_message(register(f"z{i}", "d"), 10.1, origin="d")) == []


def test_a_register_for_a_transfer_p_knows_is_never_refused_by_the_quota() -> None:
    s = sender(quota=1)
    s.on_message(register("unknown", "d"), 0.0, origin="d")
    s.expect_blocks("mine", 0.0, owner="d")
    out = s.on_message(register("mine", "d"), 0.1, origin="d")
    assert reasons(out) == []
    assert s.on_message(register("mine", "d"), 0.2, origin="d") == []  # a duplicate


# ------------------------------------------------------------------ heartbeats


def test_live_batches_cut_at_the_byte_bound_and_keep_every_entry_in_order() -> None:
    live = [(f"t{i:05d}" + "x" * (i % 50), i) for i in range(5000)]
    batches = list(live_batches(live))
    assert len(batches) > 1
    assert [e for b in batches for e in b] == live
    for b in batches:
        assert sum(entry_bytes(t) for t, _ in b) <= HEARTBEAT_LIVE_BYTES
    assert list(live_batches([])) == []
    huge = [("y" * 256, 1)]
    assert list(live_batches(huge, max_bytes=10)) == [huge]  # at least one entry a batch


def test_every_heartbeat_batch_opens_under_the_codecs_small_limit_with_the_longest_fields() -> None:
    widest = m.PeerInfo(
        "e" * m.MAX_ID_LEN,
        (1 << 63) - 1,
        65_535,
        "tcp://" + "h" * (m.MAX_ADDRESS_LEN - 12) + ":65535",
        "a" * m.MAX_ID_LEN,
    )
    live = [(f"{i:04d}" + "t" * (m.MAX_ID_LEN - 4), (1 << 63) - 1) for i in range(1500)]
    codec = ControlCodec(1 << 20)
    for batch in live_batches(live):
        body = codec.seal(m.Heartbeat(V, widest, (1 << 63) - 1, batch, 86_400_000, 1e10))[0]
        assert len(body) <= SMALL_MESSAGE_BYTES
        codec.open([body])


def test_p_heartbeats_many_transfers_as_several_heartbeats_each_small() -> None:
    s = Sender(P, SenderSettings(block_bytes=100, max_unknown_per_origin=10_000), random.Random(0))
    tids = [f"{i:05d}-" + "t" * 120 for i in range(2000)]
    for tid in tids:
        s.expect_blocks(tid, 0.0)
        s.on_message(register(tid, "d"), 0.0, origin="d")
    hbs = [
        a.message
        for a in s.tick(0.5)
        if isinstance(a, SendMessage) and isinstance(a.message, m.Heartbeat)
    ]
    assert len(hbs) > 1
    assert sorted(t for hb in hbs for t, _ in hb.live) == sorted(tids)
    codec = ControlCodec(1 << 20)
    assert all(len(codec.seal(hb)[0]) <= SMALL_MESSAGE_BYTES for hb in hbs)


def test_d_heartbeats_many_transfers_as_several_heartbeats_each_small() -> None:
    d_info = m.PeerInfo("D", 2, 0, "tcp://d:1", ag("agent-d", "tcp://d:1"), b"meta", LAYOUT)
    r = Receiver(d_info, ReceiverSettings(block_bytes=100), random.Random(0))
    tids = [f"{i:05d}-" + "t" * 120 for i in range(2000)]
    for tid in tids:
        r.register(tid, "tcp://p:1", [1, 2], 0, 100, 0.0, owner="p")
    hbs = [
        a.message
        for a in r.tick(0.5)
        if isinstance(a, SendMessage) and isinstance(a.message, m.Heartbeat)
    ]
    assert len(hbs) > 1
    assert sorted(t for hb in hbs for t, _ in hb.live) == sorted(tids)
    codec = ControlCodec(1 << 20)
    assert all(len(codec.seal(hb)[0]) <= SMALL_MESSAGE_BYTES for hb in hbs)
