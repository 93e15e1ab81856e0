"""Staging areas in memory: D's (``staging.receive_mib``), a layout like the KV cache's with
its own block slots and the copy of a landed transfer from its slots into the KV blocks;
P's (``staging.send_mib``, ``GatherArea``), scattered blocks copied together before a WRITE.

P sees the staging layout as D's KV cache (same regions, same block interior, ``slots``
blocks each, region after region in one buffer): its WRITEs (and D's READs on a fallback)
go to a receive's slots, consecutive whatever blocks D's cache handed out, and D copies
them into those blocks once everything has landed (``scatter``).
"""

from __future__ import annotations

import ctypes
import time
from collections import deque
from collections.abc import Sequence

import msgspec
import numpy as np

from kvpush_prod.core.messages import Layout, Region
from kvpush_prod.core.staging import StagingPool
from kvpush_prod.transport.checksum import id_runs
from kvpush_prod.transport.runs import side_of


def area_bytes(layout: Layout, slots: int) -> int:
    """Bytes of a staging area of ``slots`` blocks of every region of ``layout``."""
    return slots * sum(r.block_len for r in layout.regions)


def staging_layout(layout: Layout, base: int, slots: int) -> Layout:
    """``layout`` with each region moved to the staging area at ``base``: ``slots`` dense
    slots of the region's block length, region after region."""
    regions, at = [], base
    for r in layout.regions:
        regions.append(
            msgspec.structs.replace(r, base=at, block_stride=r.block_len, num_blocks=slots)
        )
        at += slots * r.block_len
    return msgspec.structs.replace(layout, regions=regions)


def _rows(region: Region) -> np.ndarray:
    """A writable (num_blocks, block_len) byte view of ``region``'s slots (no copy)."""
    span = (region.num_blocks - 1) * region.block_stride + region.block_len
    buf = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(region.base))
    return np.lib.stride_tricks.as_strided(
        buf, shape=(region.num_blocks, region.block_len), strides=(region.block_stride, 1)
    )


def scatter(
    src: Sequence[Region], dst: Sequence[Region], src_ids: Sequence[int], dst_ids: Sequence[int]
) -> int:
    """Copy slot ``src_ids[i]`` of each ``src`` region into block ``dst_ids[i]`` of the same
    ``dst`` region (equal block lengths); the bytes copied."""
    if len(src_ids) != len(dst_ids) or len(src) != len(dst):
        raise ValueError(
            f"{len(src_ids)} staging slots for {len(dst_ids)} blocks over {len(src)} and "
            f"{len(dst)} regions: they must pair up"
        )
    if not dst_ids:
        return 0
    to = np.asarray(dst_ids, dtype=np.intp)
    runs = id_runs(src_ids)
    copied = 0
    for s, d in zip(src, dst, strict=True):
        if s.block_len != d.block_len:
            raise ValueError(f"staging slot of {s.block_len} bytes for a block of {d.block_len}")
        rows_s, rows_d = _rows(s), _rows(d)
        at = 0
        for first, count in runs:
            rows_d[to[at : at + count]] = rows_s[first : first + count]
            at += count
        copied += len(to) * d.block_len
    return copied


class StagingArea:
    """D's staging area: its memory, its slots (``core.staging.StagingPool``) and, per
    receive staged, D's KV blocks its slots stand for."""

    def __init__(self, layout: Layout, slots: int) -> None:
        self.kv = list(layout.regions)
        self.memory = np.zeros(area_bytes(layout, slots), dtype=np.uint8)
        self.layout = staging_layout(layout, self.memory.ctypes.data, slots)
        self.pool = StagingPool(slots)
        # request -> (its slots, D's blocks they stand for, in the same order)
        self._staged: dict[str, tuple[list[int], list[int]]] = {}

    def __len__(self) -> int:
        return len(self._staged)

    def stage(self, tid: str, blocks: Sequence[int]) -> list[int] | None:
        """Slots for ``blocks`` of transfer ``tid``, in the same order (None: no room)."""
        slots = self.pool.take(tid, len(blocks))
        if slots is None:
            return None
        self._staged[tid] = (slots, list(blocks))
        return slots

    def land(self, tid: str) -> int:
        """``tid`` landed: copy its slots into its blocks and free them; the bytes copied."""
        staged = self._staged.get(tid)
        if staged is None:
            return 0
        try:
            return scatter(self.layout.regions, self.kv, *staged)
        finally:
            self.drop(tid)

    def drop(self, tid: str) -> None:
        """Free ``tid``'s slots without copying (its receive failed or was aborted)."""
        self._staged.pop(tid, None)
        self.pool.give_back(tid)


class GatherArea:
    """P's gather area (``staging.send_mib``): scattered KV blocks of a WRITE copied into
    consecutive slots, so the WRITE costs a descriptor per region and run of D's blocks.

    A post's slots come back when it completes; those of a post given up while in flight
    are kept ``quarantine_s`` first (its bytes may still be read), as D keeps its blocks
    until a permit has run out."""

    def __init__(self, layout: Layout, slots: int, quarantine_s: float) -> None:
        self.kv = list(layout.regions)
        self.memory = np.zeros(area_bytes(layout, slots), dtype=np.uint8)
        self.layout = staging_layout(layout, self.memory.ctypes.data, slots)
        self.pool = StagingPool(slots)
        self.side = side_of(self.layout.regions)  # the slots as post ids see them (linear)
        self.quarantine_s = quarantine_s
        self._kept: deque[tuple[float, str]] = deque()  # (until, key), in time order
        self._next = 0
        self.full = 0  # WRITEs posted from the KV blocks for want of slots (reported, reset)

    def __len__(self) -> int:
        return len(self.pool)

    def gather(self, ids: np.ndarray, first: int, end: int) -> tuple[str, np.ndarray] | None:
        """Copy blocks ``ids`` of regions ``[first, end)`` into free slots: (the key to give
        them back with, the slot ids in the order of ``ids``); None when none are free."""
        self._expire(time.monotonic())
        key = f"g{self._next}"
        self._next += 1
        taken = self.pool.take(key, len(ids))
        if taken is None:
            self.full += 1
            return None
        slots = np.asarray(taken, dtype=np.intp)
        runs = id_runs(taken)
        src_ids = np.asarray(ids, dtype=np.intp)
        for s, d in zip(self.kv[first:end], self.layout.regions[first:end], strict=True):
            rows_s, rows_d = _rows(s), _rows(d)
            at = 0
            for start, count in runs:
                np.take(rows_s, src_ids[at : at + count], axis=0, out=rows_d[start : start + count])
                at += count
        return key, slots

    def give_back(self, key: str, complete: bool) -> None:
        """The post of ``key`` ended: its slots are free now (``complete``) or once its
        quarantine is over."""
        if complete:
            self.pool.give_back(key)
        else:
            self._kept.append((time.monotonic() + self.quarantine_s, key))

    def _expire(self, now: float) -> None:
        while self._kept and self._kept[0][0] <= now:
            self.pool.give_back(self._kept.popleft()[1])
