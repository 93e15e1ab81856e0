"""D's staging area (transport.staging): the layout P writes into, and the copy into the KV
blocks, on real memory."""

from __future__ import annotations

import numpy as np
import pytest

from kvpush_prod.core.messages import Layout, Region
from kvpush_prod.transport.staging import area_bytes, scatter, staging_layout


def _layout(arrays: list[np.ndarray]) -> Layout:
    regions = [
        Region(
            base=a.ctypes.data,
            block_stride=a.shape[1],
            block_len=a.shape[1],
            num_blocks=a.shape[0],
            tok_groups=2,
        )
        for a in arrays
    ]
    return Layout(compat="x", mem_type="DRAM", regions=regions, block_size=16)


def test_a_landed_receive_is_copied_into_its_blocks_and_nothing_else() -> None:
    rng = np.random.default_rng(7)
    kv = [np.zeros((12, 64), dtype=np.uint8), np.zeros((12, 32), dtype=np.uint8)]
    layout = _layout(kv)
    area = np.empty(area_bytes(layout, 5), dtype=np.uint8)
    staged = staging_layout(layout, area.ctypes.data, 5)
    assert [r.num_blocks for r in staged.regions] == [5, 5]
    assert [r.base - area.ctypes.data for r in staged.regions] == [0, 5 * 64]
    assert staged.regions[0].tok_groups == 2 and staged.compat == layout.compat
    # What P wrote into slots 1, 2, 4 (two ranges), for D's blocks 9, 0, 5.
    slots = [area[: 5 * 64].reshape(5, 64), area[5 * 64 :].reshape(5, 32)]
    for s in slots:
        s[:] = rng.integers(0, 256, s.shape, dtype=np.uint8)
    copied = scatter(staged.regions, layout.regions, [1, 2, 4], [9, 0, 5])
    assert copied == 3 * (64 + 32)
    for k, s in zip(kv, slots, strict=True):
        for slot, block in [(1, 9), (2, 0), (4, 5)]:
            assert np.array_equal(k[block], s[slot])
        untouched = [b for b in range(12) if b not in (9, 0, 5)]
        assert not k[untouched].any()


def test_slots_and_blocks_must_pair_up() -> None:
    kv = [np.zeros((4, 8), dtype=np.uint8)]
    layout = _layout(kv)
    area = np.empty(area_bytes(layout, 2), dtype=np.uint8)
    staged = staging_layout(layout, area.ctypes.data, 2)
    with pytest.raises(ValueError, match="pair up"):
        scatter(staged.regions, layout.regions, [0, 1], [3])
    assert scatter(staged.regions, layout.regions, [], []) == 0
