"""Building a post's descriptors from runs (transport.runs), as properties: a run-built list
moves exactly the bytes the old one-descriptor-per-block list moved, in the same pairs; the
prepared-list indices are the old ones; runs are maximal; splits respect the bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpush_prod.core.messages import Layout, Region
from kvpush_prod.transport.layout import (
    all_descriptors,
    descriptor_indices,
    unit_descriptors,
    unit_indices,
)
from kvpush_prod.transport.runs import (
    MAX_POST_DESCRIPTORS,
    choose_path,
    id_runs,
    pair_linear,
    pair_plan,
    prepped_indices,
    run_descriptors,
    run_starts,
    side_of,
    split_points,
)

NUM_BLOCKS = 24


def layout_of(regions: list[Region]) -> Layout:
    return Layout(compat="0" * 16, mem_type="DRAM", regions=regions)


def stacked(
    count: int,
    block_len: int,
    base: int = 1 << 20,
    stride: int = 0,
    num_blocks: int = NUM_BLOCKS,
    groups: int = 0,
) -> list[Region]:
    """``count`` regions one after the other in one buffer (vLLM's CPU backend: a layer per
    region); ``stride`` > ``block_len``: slots with a gap (a head slab's view)."""
    stride = stride or block_len
    span = stride * num_blocks
    return [
        Region(
            base=base + i * span,
            block_stride=stride,
            block_len=block_len,
            num_blocks=num_blocks,
            tok_groups=groups,
        )
        for i in range(count)
    ]


def id_pairs(n_max: int = NUM_BLOCKS) -> st.SearchStrategy[tuple[list[int], list[int]]]:
    """Two lists of distinct ids of one length: shuffled (fragmented), sorted runs
    (contiguous) or a mix of both."""

    @st.composite
    def build(draw: st.DrawFn) -> tuple[list[int], list[int]]:
        n = draw(st.integers(1, n_max))

        def side() -> list[int]:
            kind = draw(st.sampled_from(["contiguous", "fragmented", "mixed"]))
            if kind == "contiguous":
                start = draw(st.integers(0, n_max - n))
                return list(range(start, start + n))
            ids = draw(st.permutations(range(n_max)))[:n]
            return sorted(ids) if kind == "mixed" else list(ids)

        return side(), side()

    return build()


def old_pieces(descs: np.ndarray, indices: list[int]) -> np.ndarray:
    """The (addr, len) rows the old path posted: prepared list rows by index."""
    return np.asarray(descs, dtype=np.uint64).reshape(-1, 3)[indices][:, :2]


def expand(descs: np.ndarray, piece: np.ndarray, runs: int) -> np.ndarray:
    """A run-built list cut back into one (addr, len) row per id (region-major, as the old
    lists were): descriptor ``r * runs + j`` is ``len / piece[r]`` pieces in a row."""
    rows = []
    for i, (addr, length, _) in enumerate(descs.tolist()):
        size = int(piece[i // runs])
        assert length % size == 0
        rows += [(addr + o, size) for o in range(0, length, size)]
    return np.asarray(rows, dtype=np.uint64).reshape(-1, 2)


@given(id_pairs())
def test_runs_are_maximal_and_cover_the_pairs_in_order(ids: tuple[list[int], list[int]]) -> None:
    local, remote = (np.asarray(x, dtype=np.int64) for x in ids)
    ls, rs, n = id_runs(local, remote)
    assert int(n.sum()) == len(local) and bool(np.all(n >= 1))
    got_l = np.concatenate([np.arange(a, a + k) for a, k in zip(ls, n, strict=True)])
    got_r = np.concatenate([np.arange(b, b + k) for b, k in zip(rs, n, strict=True)])
    assert got_l.tolist() == ids[0] and got_r.tolist() == ids[1]
    for j in range(len(n) - 1):  # maximal: the next run does not continue this one on both
        assert not (ls[j] + n[j] == ls[j + 1] and rs[j] + n[j] == rs[j + 1])


@given(id_pairs(n_max=300))
def test_runs_of_short_lists_in_python_equal_numpys(ids: tuple[list[int], list[int]]) -> None:
    arrays = [np.asarray(x, dtype=np.int64) for x in ids]
    assert run_starts(*ids).tolist() == run_starts(*arrays).tolist()


@given(id_pairs(), st.integers(1, 6), st.sampled_from([64, 4096]))
def test_a_run_built_list_moves_what_the_old_block_list_moved(
    ids: tuple[list[int], list[int]], count: int, block_len: int
) -> None:
    p, d = layout_of(stacked(count, block_len)), layout_of(stacked(count, block_len, 1 << 30))
    plan = pair_plan(side_of(p.regions), side_of(d.regions))
    assert plan.linear
    local, remote = (np.asarray(x, dtype=np.int64) for x in ids)
    ls, rs, n = id_runs(local, remote)
    ld, rd = run_descriptors(plan.local, ls, n), run_descriptors(plan.remote, rs, n)
    assert len(ld) == len(rd) == count * len(n)  # one per run per region
    assert np.array_equal(ld[:, 1], rd[:, 1])  # each pair the same length
    want_l = old_pieces(np.asarray(all_descriptors(p)), descriptor_indices(ids[0], p))
    want_r = old_pieces(np.asarray(all_descriptors(d)), descriptor_indices(ids[1], d))
    assert np.array_equal(expand(ld, plan.local.size, len(n)), want_l)
    assert np.array_equal(expand(rd, plan.remote.size, len(n)), want_r)


@given(id_pairs(), st.integers(1, 4), st.sampled_from([1, 2, 4]), st.booleans())
def test_units_of_one_group_coalesce_like_the_old_unit_pieces(
    ids: tuple[list[int], list[int]], count: int, k: int, p_smaller: bool
) -> None:
    # One token group per block (an NHD or MLA cache): a unit is one piece, units in a row
    # are adjacent, on the side of k units per block as on the side of whole blocks.
    small = stacked(count, 512, groups=1, num_blocks=NUM_BLOCKS)
    big = stacked(count, 512 * k, 1 << 30, groups=1, num_blocks=NUM_BLOCKS // k)
    p_regions, d_regions = (small, big) if p_smaller else (big, small)
    pk, dk = (1, k) if p_smaller else (k, 1)
    p, d = layout_of(p_regions), layout_of(d_regions)
    plan = pair_plan(side_of(p.regions, pk, units=True), side_of(d.regions, dk, units=True))
    assert plan.linear
    limit = NUM_BLOCKS  # units per region on both sides
    local, remote = (np.asarray(x, dtype=np.int64) % limit for x in ids)
    ls, rs, n = id_runs(local, remote)
    ld, rd = run_descriptors(plan.local, ls, n), run_descriptors(plan.remote, rs, n)
    want_l = old_pieces(unit_descriptors(p, pk), unit_indices(local.tolist(), p, pk))
    want_r = old_pieces(unit_descriptors(d, dk), unit_indices(remote.tolist(), d, dk))
    assert np.array_equal(expand(ld, plan.local.size, len(n)), want_l)
    assert np.array_equal(expand(rd, plan.remote.size, len(n)), want_r)


@given(id_pairs(), st.integers(1, 5), st.integers(1, 3), st.sampled_from([1, 2, 4]))
def test_prepped_indices_are_the_old_indices(
    ids: tuple[list[int], list[int]], count: int, groups: int, k: int
) -> None:
    lay = layout_of(stacked(count, 96 * groups, groups=groups))
    arr = np.asarray(ids[0], dtype=np.int64)
    assert prepped_indices(side_of(lay.regions), arr).tolist() == descriptor_indices(ids[0], lay)
    units = arr % (NUM_BLOCKS * k)
    got = prepped_indices(side_of(lay.regions, k, units=True), units).tolist()
    assert got == unit_indices(units.tolist(), lay, k)


def test_regions_of_different_groups_index_region_by_region() -> None:
    regions = [*stacked(1, 128, groups=2), *stacked(1, 96, base=1 << 24, groups=3)]
    lay = layout_of(regions)
    ids = [5, 1, 2]
    assert prepped_indices(
        side_of(regions, 2, units=True), np.asarray(ids)
    ).tolist() == unit_indices(ids, lay, 2)


def test_slots_with_a_gap_or_units_of_several_groups_are_not_linear() -> None:
    slab = stacked(2, 256, stride=1024)  # a head slab: the other heads lie between slots
    whole = stacked(2, 256)
    assert not side_of(slab).linear and side_of(whole).linear
    assert not pair_linear(side_of(whole), side_of(slab))
    many = stacked(2, 512, groups=4)  # 4 token groups: a unit of k > 1 is 4 pieces apart
    assert not side_of(many, 2, units=True).linear
    assert side_of(many, 1, units=True).linear  # a whole block: its groups tile it
    assert side_of(stacked(2, 512, groups=1), 2, units=True).linear


def test_pieces_of_different_sizes_are_not_a_linear_pair() -> None:
    assert not pair_linear(side_of(stacked(2, 256)), side_of(stacked(2, 512)))


def test_sides_that_cannot_be_paired_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot be paired"):
        pair_plan(side_of(stacked(2, 256)), side_of(stacked(3, 256)))


@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=60), st.integers(1, 8), st.integers(1, 200)
)
def test_split_points_cut_runs_so_no_part_exceeds_the_bound(
    lengths: list[int], regions: int, bound: int
) -> None:
    n = np.asarray(lengths, dtype=np.int64)
    ends = set(np.cumsum(n).tolist())
    cuts = split_points(n, 1, regions, bound)
    assert cuts == sorted(set(cuts)) and all(c in ends for c in cuts)  # on run boundaries
    edges = [0, *cuts, int(n.sum())]
    starts = np.concatenate(([0], np.cumsum(n)))
    for a, b in zip(edges, edges[1:], strict=False):
        runs_in = int(np.sum((starts[:-1] >= a) & (starts[:-1] < b)))
        assert runs_in * regions <= bound or runs_in == 1
    per_id = split_points(n, regions, 0, bound)  # not linear: each id costs its pieces
    edges = [0, *per_id, int(n.sum())]
    assert all(
        (b - a) * regions <= bound or b - a == 1 for a, b in zip(edges, edges[1:], strict=False)
    )


def test_a_post_under_the_bound_is_one_part() -> None:
    n = np.asarray([512], dtype=np.int64)  # 8k tokens of block 16, contiguous
    assert split_points(n, 160, 160, MAX_POST_DESCRIPTORS) == []
    assert split_points(np.ones(512, dtype=np.int64), 160, 160, MAX_POST_DESCRIPTORS) != []


def test_the_path_follows_the_cost_of_each_builder() -> None:
    # fragmented: runs == ids, a run-built list would cost more than indices
    assert choose_path(entries=160 * 512, descriptors=160 * 512, linear=True) == "prepped"
    # contiguous over many regions: one descriptor per region instead of 512 indices each
    assert choose_path(entries=160 * 512, descriptors=160, linear=True) == "coalesced"
    # small posts: the fixed cost of a built list dominates
    assert choose_path(entries=2 * 4, descriptors=2, linear=True) == "prepped"
    assert choose_path(entries=160 * 512, descriptors=160, linear=False) == "prepped"
