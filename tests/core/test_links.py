"""The worker shell's books for transfers split across tensor-parallel ranks: a request is
reported once every part ended (failed if any part failed), D tells apart the parts several
P ranks name by one id, and a P rank feeding several D ranks splits its transfer on the
first REGISTER, replaying what its engine already said."""

from __future__ import annotations

import msgspec

from kvpush_prod.core import messages as m
from kvpush_prod.core.links import Joins, Links, Splits, d_links
from kvpush_prod.core.vocabulary import Outcome

LAYOUT = m.Layout("c", "DRAM", [m.Region(0, 100, 100, 64)], tp_size=1, kv_heads=2, total_kv_heads=2)


def info(rank: int, tp: int) -> m.PeerInfo:
    layout = msgspec.structs.replace(LAYOUT, tp_size=tp, tp_rank=rank, kv_heads=2 // tp)
    return m.PeerInfo("E", 1, rank, f"tcp://e:{rank}", f"agent-{rank}", b"meta", layout)


def test_a_request_fed_by_two_p_ranks_ends_once_both_parts_ended() -> None:
    joins = Joins()
    joins.split("t", ["t#p0", "t#p1"])
    assert joins.end("t#p0", True, Outcome.PUSHED) is None
    join = joins.end("t#p1", True, Outcome.PUSHED)
    assert join is not None and join.base == "t" and join.ok and join.outcome is Outcome.PUSHED
    assert joins.of("t#p0") is None  # forgotten


def test_one_failed_part_fails_the_request_but_only_after_every_part_ended() -> None:
    joins = Joins()
    joins.split("t", ["t#p0", "t#p1"])
    assert joins.end("t#p1", False, Outcome.FAILED) is None  # p0 may still be writing
    join = joins.end("t#p0", True, Outcome.PUSHED)
    assert join is not None and not join.ok and join.outcome is Outcome.FAILED


def test_a_transfer_never_split_is_its_own_join() -> None:
    joins = Joins()
    assert joins.parts("t") == ["t"]
    join = joins.end("t", True, Outcome.PUSHED)
    assert join is not None and join.base == "t"


def test_d_rank_fed_by_two_p_ranks_names_each_part_and_the_slab_it_fills() -> None:
    links = d_links("t", 0, 1, 2, 2, False)
    assert [(lk.core_id, lk.wire_id, lk.p_rank, lk.d_first, lk.heads) for lk in links] == [
        ("t#p0", "t", 0, 0, 1),
        ("t#p1", "t", 1, 1, 1),
    ]
    assert d_links("t", 1, 2, 1, 2, False)[0].core_id == "t#d1"  # one feeder: no translation
    assert d_links("t", 1, 2, 2, 2, False)[0].core_id == "t"  # equal sizes: untouched


def test_d_translates_ids_both_ways_by_the_generation_it_granted() -> None:
    links = Links()
    for lk in d_links("t", 0, 1, 2, 2, False):
        links.add(lk)
    d = info(0, 1)
    reg0 = m.Register(m.PROTOCOL_VERSION, "t#p0", d, [1], 0, 10, 111, 5000)
    reg1 = m.Register(m.PROTOCOL_VERSION, "t#p1", d, [1], 0, 10, 222, 5000)
    out0, out1 = links.outbound(reg0), links.outbound(reg1)
    assert isinstance(out0, m.Register) and out0.transfer_id == "t"
    assert isinstance(out1, m.Register) and out1.transfer_id == "t"
    # P rank 1's DONE and FAILED name "t" with our generation for it.
    assert links.done(m.Done(m.PROTOCOL_VERSION, "t", 222, 1)).transfer_id == "t#p1"
    assert links.done(m.Done(m.PROTOCOL_VERSION, "t", 111, 1)).transfer_id == "t#p0"
    failed = m.Failed(m.PROTOCOL_VERSION, "t", 999, info(1, 2), "x")  # unknown generation
    back = links.inbound(failed)
    assert isinstance(back, m.Failed) and back.transfer_id == "t#p1"  # by the sender's rank
    hb = m.Heartbeat(m.PROTOCOL_VERSION, d, 0, [("t#p0", 111), ("u", 5)])
    out_hb = links.outbound(hb)
    assert isinstance(out_hb, m.Heartbeat) and out_hb.live == [("t", 111), ("u", 5)]


def test_ids_of_untranslated_transfers_pass_unchanged() -> None:
    links = Links()
    reg = m.Register(m.PROTOCOL_VERSION, "t", info(0, 1), [1], 0, 10, 1, 5000)
    assert links.outbound(reg) is reg and links.inbound(reg) is reg


def test_p_feeding_two_d_ranks_splits_on_the_first_register_and_replays() -> None:
    splits = Splits(p_rank=0, p_tp=1, total_heads=2)
    known = splits.note("t")
    known.expected, known.blocks, known.owner = True, (1, 2), "key-d"
    reg = m.Register(m.PROTOCOL_VERSION, "t#d1", info(1, 2), [5, 6], 0, 40, 7, 5000)
    base, parts, replay = splits.on_register(reg)
    assert (base, parts) == ("t", ["t#d1"]) and replay is known
    assert splits.parts("t") == ["t", "t#d1"]
    # The lead D rank's REGISTER comes later: nothing more to split.
    lead = m.Register(m.PROTOCOL_VERSION, "t", info(0, 2), [5, 6], 0, 40, 8, 5000)
    assert splits.on_register(lead)[1] == []
    assert splits.end("t", True, Outcome.PUSHED, 10) is None
    join = splits.end("t#d1", True, Outcome.PUSHED, 10)
    assert join is not None and join.base == "t" and join.nbytes == 20
    # A REGISTER after the request was released splits nothing (the core refuses it).
    late = m.Register(m.PROTOCOL_VERSION, "t#d1", info(1, 2), [5, 6], 0, 40, 9, 5000)
    assert splits.on_register(late)[1] == []


def test_p_does_not_split_for_a_decode_of_its_own_size_or_fewer_ranks() -> None:
    splits = Splits(p_rank=1, p_tp=2, total_heads=2)
    reg = m.Register(m.PROTOCOL_VERSION, "t", info(0, 1), [5], 0, 40, 7, 5000)
    assert splits.on_register(reg)[1] == []
    assert splits.parts("t") == ["t"]


def test_a_register_naming_a_part_this_rank_does_not_feed_splits_nothing() -> None:
    splits = Splits(p_rank=0, p_tp=1, total_heads=2)
    reg = m.Register(m.PROTOCOL_VERSION, "t#d3", info(1, 2), [5], 0, 40, 7, 5000)
    assert splits.on_register(reg)[1] == []
