"""kv_crc32 reads the bytes it is given, in order, without copies: its value is the crc32 of
each slot read one by one, whatever runs it reads them in."""

from __future__ import annotations

import ctypes
import random
import zlib

import pytest

from kvpush_prod.core.messages import Region
from kvpush_prod.transport import checksum
from kvpush_prod.transport.checksum import id_runs, kv_crc32
from kvpush_prod.transport.layout import unit_pieces

SLOT, NBLOCKS = 96, 40


def memory(regions: int, stride: int = SLOT) -> tuple[ctypes.Array[ctypes.c_char], list[Region]]:
    size = regions * NBLOCKS * stride
    rng = random.Random(regions * 1000 + stride)
    buf = ctypes.create_string_buffer(bytes(rng.randrange(256) for _ in range(size)), size)
    base = ctypes.addressof(buf)
    return buf, [
        Region(base + r * NBLOCKS * stride, stride, SLOT, NBLOCKS, tok_groups=2)
        for r in range(regions)
    ]


def one_by_one(regions: list[Region], blocks: list[int], units: int = 0) -> int:
    """The crc32 as the pump computed it before kv_crc32: a copy of every slot (or piece)."""
    crc = 0
    for region in regions:
        for b in blocks:
            if units:
                for addr, size in unit_pieces(region, b, units):
                    crc = zlib.crc32(ctypes.string_at(addr, size), crc)
                continue
            addr = region.base + b * region.block_stride
            crc = zlib.crc32(ctypes.string_at(addr, region.block_len), crc)
    return crc


ORDERS = {
    "contiguous": list(range(3, 30)),
    "runs": [5, 6, 7, 20, 21, 2, 3, 39],
    "scattered": random.Random(1).sample(range(NBLOCKS), 25),
    "one": [0],
    "none": [],
}


@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("stride", [SLOT, 2 * SLOT])  # a slab of each block: stride > length
@pytest.mark.parametrize("gather_below", [0, 1 << 30])  # runs read in place, or gathered
@pytest.mark.parametrize("gather_bytes", [1, 5 * SLOT, 1 << 18])  # a slot or more at a time
def test_the_crc_is_that_of_every_slot_read_in_order(
    order: str, stride: int, gather_below: int, gather_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checksum, "GATHER_BELOW", gather_below)
    monkeypatch.setattr(checksum, "GATHER_BYTES", gather_bytes)
    buf, regions = memory(3, stride)
    blocks = ORDERS[order]
    assert kv_crc32(regions, blocks) == one_by_one(regions, blocks)
    assert buf  # the memory lives until here


def test_units_read_piece_by_piece_give_the_same_crc() -> None:
    buf, regions = memory(2)
    units = [0, 1, 7, 8, 9, 30, 31]  # 4 units per block
    assert kv_crc32(regions, units, 4) == one_by_one(regions, units, 4)
    assert buf


def test_a_changed_byte_changes_the_crc() -> None:
    buf, regions = memory(2)
    before = kv_crc32(regions, [4, 5, 6])
    buf[NBLOCKS * SLOT + 5 * SLOT + 17] = bytes([buf[NBLOCKS * SLOT + 5 * SLOT + 17][0] ^ 1])
    assert kv_crc32(regions, [4, 5, 6]) != before
    assert kv_crc32(regions, [4, 6, 5]) != kv_crc32(regions, [4, 5, 6])  # order matters


def test_runs_are_consecutive_ascending_ids_in_their_order() -> None:
    assert id_runs([5, 6, 7, 20, 21, 2, 3, 39, 38]) == [(5, 3), (20, 2), (2, 2), (39, 1), (38, 1)]
    assert id_runs([]) == []
