"""The crc32 of a transfer's KV blocks (``verify.checksums``): P states it in the DONE, D checks it.

Pure over memory: regions and block (or unit) ids in, one crc32 out; both sides read the same
bytes in the same order (region by region, block by block) whatever their block sizes.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Sequence

from kvpush_prod.core.messages import Region
from kvpush_prod.transport.layout import unit_pieces


def kv_crc32(regions: Sequence[Region], blocks: Sequence[int], units: int = 0) -> int:
    """crc32 of ``blocks`` over ``regions``, region by region, block by block.

    ``units`` > 0: the ids are units, that many per block (P and D block sizes differ),
    read piece by piece in the order region, unit, token group: the same bytes in the
    same order on both sides whatever their block sizes."""
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
