"""Head slabs across tensor-parallel sizes, on real tensors: the region views two ranks
exchange (``pair_views``) move exactly the right KV heads into the right place of each D
block, for several head counts, dtypes and sizes; a block interior that is not head-major
is refused, never written wrongly."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvpush_prod.core import compat, tpmap
from kvpush_prod.core.messages import Layout
from kvpush_prod.errors import ConfigError
from kvpush_prod.transport.layout import Heads, layout_from_kv_caches, pair_views

NUM_BLOCKS, BLOCK, HEAD, LAYERS = 6, 32, 8, 2


def cpu_caches(
    total: int, tp: int, rank: int, dtype: torch.dtype, fill: bool
) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout [num_blocks, kv_heads, block_size, 2*head_size] per layer; with
    ``fill`` every element says which (layer, block, global head) it belongs to."""
    local = total // tp
    out = {}
    for layer in range(LAYERS):
        t = torch.zeros(NUM_BLOCKS, local, BLOCK, 2 * HEAD, dtype=dtype)
        if fill:
            for b in range(NUM_BLOCKS):
                for h in range(local):
                    t[b, h] = float(layer * 100 + b * 10 + rank * local + h)
        out[f"l{layer}"] = t
    return out


def layout_of(caches: dict[str, torch.Tensor], total: int, tp: int, rank: int) -> Layout:
    return layout_from_kv_caches(caches, NUM_BLOCKS, "sig", {}, Heads(total // tp, total, tp, rank))


def write(src: Layout, dst: Layout, src_blocks: list[int], dst_blocks: list[int]) -> None:
    """What a NIXL WRITE of these views does: each region's slot, byte for byte."""
    for rs, rd in zip(src.regions, dst.regions, strict=True):
        assert rs.block_len == rd.block_len
        for bs, bd in zip(src_blocks, dst_blocks, strict=True):
            ctypes.memmove(
                rd.base + bd * rd.block_stride, rs.base + bs * rs.block_stride, rs.block_len
            )


# (total KV heads, P's TP size, D's TP size): every pair of sizes up to 4 over each head
# count both sizes divide. The others (2 heads over 4 ranks) do not split evenly and are
# refused (tpmap.problem: test_tpmap; the layouts: test_sizes_that_do_not_map_... below).
TP_PAIRS = [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 4), (4, 2), (2, 2)]
SPLITS = [
    (total, p_tp, d_tp)
    for total in (2, 4, 8)
    for p_tp, d_tp in TP_PAIRS
    if total % max(p_tp, d_tp) == 0
]


def test_the_splits_cover_every_pair_of_sizes_and_drop_only_those_that_do_not_map() -> None:
    assert {(p, d) for _, p, d in SPLITS} == set(TP_PAIRS)
    dropped = [(t, p, d) for t in (2, 4, 8) for p, d in TP_PAIRS if (t, p, d) not in SPLITS]
    assert dropped and all(t % max(p, d) for t, p, d in dropped)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("total", "p_tp", "d_tp"), SPLITS)
def test_each_d_rank_receives_exactly_its_heads_from_the_right_p_ranks(
    dtype: torch.dtype, total: int, p_tp: int, d_tp: int
) -> None:
    p_caches = [cpu_caches(total, p_tp, s, dtype, fill=True) for s in range(p_tp)]
    d_caches = [cpu_caches(total, d_tp, r, dtype, fill=False) for r in range(d_tp)]
    p_lay = [layout_of(c, total, p_tp, s) for s, c in enumerate(p_caches)]
    d_lay = [layout_of(c, total, d_tp, r) for r, c in enumerate(d_caches)]
    assert len({lay.compat for lay in p_lay + d_lay}) == 1  # the TP size is not in the hash
    src, dst = [1, 4], [3, 0]  # P's blocks land in other D block ids
    for s in range(p_tp):
        for r in range(d_tp):
            if tpmap.piece(s, r, p_tp, d_tp, total) is None:
                continue  # these two ranks share no heads (equal sizes: rank to rank)
            assert compat.layout_problem(p_lay[s], d_lay[r]) == ""
            local, remote = pair_views(p_lay[s], d_lay[r], producer=True)
            write(local, remote, src, dst)
            # The decode side's own view of the pair (a READ in a pull fallback) agrees.
            d_local, p_remote = pair_views(d_lay[r], p_lay[s], producer=False)
            assert d_local.regions == remote.regions and p_remote.regions == local.regions
    local_d = total // d_tp
    for r, caches in enumerate(d_caches):
        for layer, t in enumerate(caches.values()):
            for bs, bd in zip(src, dst, strict=True):
                for h in range(local_d):
                    want = float(layer * 100 + bs * 10 + r * local_d + h)
                    assert torch.all(t[bd, h] == want), (r, layer, bd, h)
            untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
            assert torch.all(t[untouched] == 0)


def test_two_p_ranks_each_write_their_half_of_a_d_block() -> None:
    p = [layout_of(cpu_caches(2, 2, s, torch.float32, False), 2, 2, s) for s in range(2)]
    d = layout_of(cpu_caches(2, 1, 0, torch.float32, False), 2, 1, 0)
    assert d.kv_heads == 2 and p[0].kv_heads == 1
    half = d.regions[0].block_len // 2
    for s in range(2):
        local, remote = pair_views(p[s], d, producer=True)
        assert local.regions == p[s].regions  # P's whole block...
        assert remote.regions[0].base == d.regions[0].base + s * half  # ...into its half
        assert remote.regions[0].block_len == half
        assert remote.regions[0].block_stride == d.regions[0].block_stride


def nhd_caches(total: int, tp: int) -> dict[str, torch.Tensor]:
    # A GPU-style NHD layout [2, num_blocks, block_size, heads, head]: tokens outside heads.
    return {"l0": torch.zeros(2, NUM_BLOCKS, BLOCK, total // tp, HEAD)}


def test_a_block_interior_that_is_not_head_major_is_refused_across_tp_sizes() -> None:
    p = layout_from_kv_caches(nhd_caches(4, 2), NUM_BLOCKS, "sig", {}, Heads(2, 4, 2, 0))
    d = layout_from_kv_caches(nhd_caches(4, 1), NUM_BLOCKS, "sig", {}, Heads(4, 4, 1, 0))
    assert p.kv_heads == 0 and d.kv_heads == 0
    why = compat.layout_problem(p, d)
    assert "not stored head after head" in why
    assert "--tensor-parallel-size 2" in why and "--tensor-parallel-size 1" in why
    with pytest.raises(ConfigError, match="not head-major"):
        pair_views(p, d, producer=True)


def test_same_tp_size_needs_no_head_major_interior() -> None:
    p = layout_from_kv_caches(nhd_caches(4, 2), NUM_BLOCKS, "sig", {}, Heads(2, 4, 2, 1))
    d = layout_from_kv_caches(nhd_caches(4, 2), NUM_BLOCKS, "sig", {}, Heads(2, 4, 2, 1))
    assert compat.layout_problem(p, d) == ""
    assert pair_views(p, d, producer=True) == (p, d)


def test_block_size_equal_to_the_head_count_cannot_be_told_apart_and_is_not_sliced() -> None:
    t = torch.zeros(NUM_BLOCKS, 4, 4, 2 * HEAD)  # heads == block size: which axis is which?
    lay = layout_from_kv_caches({"l0": t}, NUM_BLOCKS, "sig", {}, Heads(4, 8, 2, 0))
    assert lay.kv_heads == 0


def test_one_head_per_rank_is_always_whole_blocks() -> None:
    lay = layout_from_kv_caches(nhd_caches(2, 2), NUM_BLOCKS, "sig", {}, Heads(1, 2, 2, 0))
    assert lay.kv_heads == 1


def test_sizes_that_do_not_map_are_refused_with_both_values() -> None:
    p = layout_of(cpu_caches(6, 3, 0, torch.float32, False), 6, 3, 0)
    d = layout_of(cpu_caches(6, 2, 0, torch.float32, False), 6, 2, 0)
    why = compat.layout_problem(p, d)
    assert "3" in why and "2" in why and "divide" in why
