"""Mapping KV heads across different tensor-parallel sizes: every D rank receives exactly
the heads it serves, once, from the P ranks that hold them; what cannot map is refused
with both sizes named and what to change."""

from __future__ import annotations

import pytest

from kvpush_prod.core import tpmap

SIZES = [1, 2, 4]


def heads_of(rank: int, tp: int, total: int) -> list[int]:
    per = total // tp
    return list(range(rank * per, (rank + 1) * per))


@pytest.mark.parametrize("total", [4, 8, 16])
@pytest.mark.parametrize("p_tp", SIZES)
@pytest.mark.parametrize("d_tp", SIZES)
def test_every_d_rank_gets_exactly_its_heads_once_from_the_p_ranks_holding_them(
    total: int, p_tp: int, d_tp: int
) -> None:
    pieces = tpmap.pieces(p_tp, d_tp, total)
    for r in range(d_tp):
        got: list[int] = []
        for pc in tpmap.feeders(r, p_tp, d_tp, total):
            p_heads = heads_of(pc.p_rank, p_tp, total)[pc.p_first : pc.p_first + pc.heads]
            d_heads = heads_of(r, d_tp, total)[pc.d_first : pc.d_first + pc.heads]
            assert p_heads == d_heads  # the slab taken on P is the slab filled on D
            got += d_heads
        assert sorted(got) == heads_of(r, d_tp, total)
    # Every P rank sends (none idles holding blocks no one takes).
    assert {pc.p_rank for pc in pieces} == set(range(p_tp))


def test_two_p_ranks_fill_one_d_rank_half_each() -> None:
    assert tpmap.feeders(0, 2, 1, 2) == [
        tpmap.Piece(0, 0, 0, 0, 1, 1, 2),
        tpmap.Piece(1, 0, 0, 1, 1, 1, 2),
    ]


def test_one_p_rank_feeds_two_d_ranks_a_slab_each() -> None:
    assert tpmap.fed(0, 1, 2, 4) == [
        tpmap.Piece(0, 0, 0, 0, 2, 4, 2),
        tpmap.Piece(0, 1, 2, 0, 2, 4, 2),
    ]


def test_four_kv_heads_two_per_rank_map_onto_one_rank_in_order() -> None:
    pieces = tpmap.feeders(0, 2, 1, 4)
    assert [(p.p_rank, p.d_first, p.heads) for p in pieces] == [(0, 0, 2), (1, 2, 2)]
    assert all(p.whole_p and not p.whole_d for p in pieces)


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "total", "words"),
    [
        (3, 2, 6, "one must divide the other"),
        (2, 3, 6, "one must divide the other"),
        (4, 1, 2, "do not split evenly"),
        (1, 4, 2, "do not split evenly"),
        (2, 1, 3, "do not split evenly"),
    ],
)
def test_sizes_that_cannot_map_are_refused_naming_both_and_the_fix(
    p_tp: int, d_tp: int, total: int, words: str
) -> None:
    why = tpmap.problem(p_tp, d_tp, total)
    assert words in why
    assert f"prefill {p_tp}" in why or f"prefill --tensor-parallel-size {p_tp}" in why
    with pytest.raises(ValueError, match=words):
        tpmap.pieces(p_tp, d_tp, total)


def test_equal_sizes_map_rank_to_rank_even_with_replicated_heads() -> None:
    # TP 4 over 2 KV heads: vLLM replicates heads; equal sizes still pair rank r with r.
    assert tpmap.problem(4, 4, 2) == ""
    assert [(p.p_rank, p.d_rank) for p in tpmap.pieces(4, 4, 2)] == [(r, r) for r in range(4)]


@pytest.mark.parametrize("p_tp", SIZES)
@pytest.mark.parametrize("d_tp", SIZES)
def test_replicated_latent_reaches_every_d_rank_once_from_one_p_rank(p_tp: int, d_tp: int) -> None:
    pieces = tpmap.pieces(p_tp, d_tp, 1, replicated=True)
    assert sorted(p.d_rank for p in pieces) == list(range(d_tp))  # once each
    assert all(p.whole_p and p.whole_d for p in pieces)  # the whole block
    # The senders are spread: no P rank sends more than its share.
    per_p = [sum(1 for p in pieces if p.p_rank == s) for s in range(p_tp)]
    assert max(per_p) <= -(-d_tp // p_tp)


def test_sub_ids_leave_each_p_ranks_lead_link_unrenamed() -> None:
    # P TP 1 -> D TP 2: P's rank 0 feeds D ranks 0 and 1; the second link is a sub-transfer.
    lead = tpmap.lead(0, 1, 2, 2)
    ids = [tpmap.sub_id("t", pc, lead) for pc in tpmap.fed(0, 1, 2, 2)]
    assert ids == ["t", "t#d1"]
    assert {tpmap.base_of(i) for i in ids} == {"t"}
    # P TP 2 -> D TP 1: every P rank's only link is its lead: nothing renamed.
    for s in range(2):
        (pc,) = tpmap.fed(s, 2, 1, 2)
        assert tpmap.sub_id("t", pc, tpmap.lead(s, 2, 1, 2)) == "t"


def test_mapping_text_names_every_link() -> None:
    text = tpmap.mapping_text(2, 1, 2)
    assert text == ("prefill TP 2 -> decode TP 1, 2 KV heads: P0[0:1]->D0[0:1], P1[0:1]->D0[1:2]")


def test_idle_p_ranks_are_those_of_replicated_kv_beyond_d_ranks() -> None:
    assert tpmap.idle(2, 1, 1, replicated=True) == [1]
    assert tpmap.idle(4, 2, 1, replicated=True) == [2, 3]
    assert tpmap.idle(2, 2, 1, replicated=True) == []
    assert tpmap.idle(1, 2, 1, replicated=True) == []
    assert tpmap.idle(2, 1, 4) == []  # split heads: every P rank feeds the one D rank


def test_unfed_p_ranks_are_each_told_by_exactly_one_d_rank() -> None:
    def told(
        p_tp: int, d_tp: int, heads: int, replicated: bool = False, refused: bool = False
    ) -> list[list[int]]:
        return [tpmap.unfed_told_by(r, p_tp, d_tp, heads, replicated, refused) for r in range(d_tp)]

    assert told(3, 2, 2, refused=True) == [[0, 2], [1]]  # refused: every P rank, once
    assert told(2, 1, 1, replicated=True) == [[1]]  # MLA: P rank 1 feeds nobody
    assert told(4, 2, 1, replicated=True) == [[2], [3]]
    assert told(2, 1, 4) == [[]] and told(1, 2, 4) == [[], []]  # every P rank feeds
    assert told(0, 2, 4, refused=True) == [[0], [1]]  # P's size not told: same as D's
