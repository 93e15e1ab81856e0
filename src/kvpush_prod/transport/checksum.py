"""The crc32 of a transfer's KV blocks (``verify.checksums``): P states it in the DONE, D checks it.

Pure over memory: regions and block (or unit) ids in, one crc32 out; both sides read the same
bytes in the same order (region by region, block by block) whatever their block sizes.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Sequence

import numpy as np

from kvpush_prod.core.messages import Region
from kvpush_prod.transport.layout import unit_pieces

# A read-only memoryview of raw memory, without copying it (``ctypes.string_at`` copies every
# byte into a new bytes object first: measured ~1.5x the crc's own time). zlib.crc32 reads a
# view of more than 5 KiB with the GIL released.
_view = ctypes.pythonapi.PyMemoryView_FromMemory
_view.restype = ctypes.py_object
_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_READ = 0x100

# Runs shorter than this on average (a fragmented cache of small slots: the tiny model's 2 KiB)
# are gathered (numpy, at memcpy speed) ``GATHER_BYTES`` at a time and each gather is crc'd in
# one call: a call per slot costs ~0.4 us, as much as 2 KiB of crc (benchmarks/checksum_cost.py).
GATHER_BELOW = 16 << 10
GATHER_BYTES = 256 << 10


def kv_crc32(regions: Sequence[Region], blocks: Sequence[int], units: int = 0) -> int:
    """crc32 of ``blocks`` over ``regions``, region by region, block by block.

    ``units`` > 0: the ids are units, that many per block (P and D block sizes differ),
    read piece by piece in the order region, unit, token group: the same bytes in the
    same order on both sides whatever their block sizes. The value does not depend on how
    the bytes are read: adjacent blocks of a region are read as one run, and short runs are
    gathered into a buffer first (``GATHER_BELOW``)."""
    crc = 0
    runs = None if units else id_runs(blocks)
    ids = np.asarray(blocks, dtype=np.intp)
    for region in regions:
        span = (region.num_blocks - 1) * region.block_stride + region.block_len
        mem: memoryview = _view(region.base, span, _PYBUF_READ)
        if runs is None:
            for u in blocks:
                for addr, size in unit_pieces(region, u, units):
                    off = addr - region.base
                    crc = zlib.crc32(mem[off : off + size], crc)
        elif region.block_stride == region.block_len and (
            len(ids) * region.block_len >= GATHER_BELOW * len(runs)
        ):
            for first, count in runs:
                off = first * region.block_stride
                crc = zlib.crc32(mem[off : off + count * region.block_len], crc)
        else:
            crc = _gathered_crc(region, mem, ids, crc)
    return crc


def _gathered_crc(region: Region, mem: memoryview, ids: np.ndarray, crc: int) -> int:
    """The crc of ``ids``' slots of ``region`` (a slab of each block, or short runs), read
    ``GATHER_BYTES`` at a time through one numpy gather each."""
    rows = np.lib.stride_tricks.as_strided(
        np.frombuffer(mem, dtype=np.uint8),
        shape=(region.num_blocks, region.block_len),
        strides=(region.block_stride, 1),
        writeable=False,
    )
    per = max(1, GATHER_BYTES // region.block_len)
    for i in range(0, len(ids), per):
        crc = zlib.crc32(rows[ids[i : i + per]], crc)
    return crc


def id_runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """``ids`` as (first, count) runs of consecutive ascending ids, in their order."""
    out: list[tuple[int, int]] = []
    first, count = -1, 0
    for b in ids:
        if count and b == first + count:
            count += 1
            continue
        if count:
            out.append((first, count))
        first, count = b, 1
    if count:
        out.append((first, count))
    return out
