"""A post's block (or unit) ids as NIXL descriptors that scale with runs, not blocks.

Pure: numpy arrays in, arrays out (no NIXL, no tensors); ``transport.nixl`` posts them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvpush_prod.core.blocksize import group_lens
from kvpush_prod.core.messages import Region

# The most descriptors one NIXL request of a post may carry; a post with more is split into
# parts posted one per poll (``NixlTransport.state``), its notification sent once every part
# landed. Posting is P's engine thread's work when it hands a push over, and the backend's
# submit costs per descriptor (measured: ~2 us on UCX loopback, where each descriptor is a
# cross-process copy; ~0.1-0.5 us per RDMA WRITE on NICs), so one call stays under ~20 ms
# here whatever push.chunk_bytes is. A 4 MiB chunk of whole blocks is one part whenever a
# slot (one block of one region) is at least 512 bytes: every model shape we run (the tiny
# model's is 16 KiB, a 70B layer's K at block 16 is 32 KiB). Units across block sizes on the
# CPU backend (a piece per K element: ~250 bytes on average in float32) split in three at
# 4 MiB (five in bfloat16). Split,
# never refused: refusing a legal chunk would send its transfer to a pull fallback that the
# same bound would refuse too.
MAX_POST_DESCRIPTORS = 1 << 13

# Which NIXL call builds a post's request (``choose_path``): "prepped" (indices into lists
# prepared at connect, ``make_prepped_xfer``) or "coalesced" (one descriptor per run built
# for this post, ``get_xfer_descs`` + ``initialize_xfer``).
Path = Literal["prepped", "coalesced"]

# Build cost of each path on NIXL 1.5.1, fitted from ``kvpush bench transfer --post-cost``
# (docs/benchmarks.md, "Descriptors per post"; 32-80 layers, 64-160 regions). Prepped: a
# numpy index costs ~3 ns, and NIXL's make_prepped_xfer merges consecutive indices whose
# descriptors are adjacent on both sides, then spends ~25 ns per descriptor it keeps. A
# per-post list costs ~60 ns per descriptor (NIXL looks each up in the registrations) and
# more to set up. Both post the same descriptors on a linear pair, so the run-built list
# pays only when it saves many indices: long runs over many regions (a run of about 250
# blocks at 32 layers, 105 at 80), by tens to a hundred of us; never on a fragmented cache.
PREPPED_FIXED_NS = 25_000
PREPPED_PER_INDEX_NS = 3.0
PREPPED_PER_DESCRIPTOR_NS = 25.0
COALESCED_FIXED_NS = 70_000
COALESCED_PER_DESCRIPTOR_NS = 60.0
# Up to this many ids a Python loop finds a post's runs faster than numpy's per-call costs
# (measured: 16 ids ~1 us against ~4 us); the tiny models' posts are this small.
SMALL_POST = 128
# Prepared lists are indexed with int32 (``make_prepped_xfer``).
MAX_PREPARED = 2**31 - 1


@dataclass(frozen=True, eq=False)
class Side:
    """One side's regions as ids see them: where each id's entries sit in the list prepared
    at connect, and, when every region is *linear* (each id one piece, consecutive ids'
    pieces back to back), the grid that turns a run of ids into one descriptor per region.

    Prepared list order (``layout.all_descriptors`` / ``layout.unit_descriptors``): region
    by region, id by id, token group by token group; region ``r`` starts at ``offsets[r]``
    and holds ``groups[r]`` entries per id. Ids must be below ``limit`` (every region).
    """

    offsets: np.ndarray  # int64 [R]
    groups: np.ndarray  # int64 [R]
    limit: int
    linear: bool
    base: np.ndarray  # uint64 [R]: byte address of id 0's piece (linear only)
    size: np.ndarray  # uint64 [R]: bytes of one id's piece = bytes from one id to the next
    dev: np.ndarray  # uint64 [R]
    prepared: int  # entries in the prepared list
    offsets32: np.ndarray  # offsets as int32 (indices are built in int32 directly)
    uniform: int  # the entries per id of every region when they agree, else 0

    @property
    def regions(self) -> int:
        return int(self.offsets.size)

    @property
    def entries_per_id(self) -> int:
        """Prepared entries one id spans over all regions (indices a prepped post passes)."""
        return int(self.groups.sum())


def side_of(regions: list[Region], k: int = 1, units: bool = False) -> Side:
    """``regions`` seen through ids: whole blocks (``units`` False), or units of ``k`` per
    block, each unit one piece per token group (``layout.unit_pieces``).

    Linear: whole blocks where ``block_stride == block_len``; units where the block is also
    one slot wide and a unit is one piece (one token group, or the whole block when
    ``k == 1``, whose groups then lie back to back)."""
    count = len(regions)
    offsets = np.zeros(count, dtype=np.int64)
    groups = np.ones(count, dtype=np.int64)
    base = np.zeros(count, dtype=np.uint64)
    size = np.zeros(count, dtype=np.uint64)
    dev = np.zeros(count, dtype=np.uint64)
    linear = True
    at = 0
    for i, r in enumerate(regions):
        per = max(r.tok_groups, 1) if units else 1
        ids = r.num_blocks * (k if units else 1)
        offsets[i], groups[i] = at, per
        at += ids * per
        base[i], dev[i] = r.base, r.dev_id
        dense = r.block_stride == r.block_len
        if not units:
            size[i] = r.block_len
        elif k == 1:
            # One unit per block: its groups' pieces tile the block, so the unit is the block.
            dense = dense and sum(group_lens(r)) == r.block_len
            size[i] = r.block_len
        else:
            dense = dense and len(group_lens(r)) == 1 and r.block_len % k == 0
            size[i] = r.block_len // k
        linear = linear and dense
    limit = min((r.num_blocks * (k if units else 1) for r in regions), default=0)
    uniform = int(groups[0]) if count and bool(np.all(groups == groups[0])) else 0
    offsets32 = offsets.astype(np.int32) if at <= MAX_PREPARED else offsets
    return Side(offsets, groups, limit, linear, base, size, dev, at, offsets32, uniform)


def side_slice(side: Side, first: int, end: int) -> Side:
    """Regions ``[first, end)`` of ``side`` (layer-wise push: one layer's regions), indexing
    the same prepared list."""
    groups = side.groups[first:end]
    uniform = int(groups[0]) if groups.size and bool(np.all(groups == groups[0])) else 0
    return Side(
        side.offsets[first:end],
        groups,
        side.limit,
        side.linear,
        side.base[first:end],
        side.size[first:end],
        side.dev[first:end],
        side.prepared,
        side.offsets32[first:end],
        uniform,
    )


def plan_slice(plan: PairPlan, first: int, end: int) -> PairPlan:
    """Regions ``[first, end)`` of both sides of ``plan``."""
    return PairPlan(
        side_slice(plan.local, first, end), side_slice(plan.remote, first, end), plan.linear
    )


def pair_linear(local: Side, remote: Side) -> bool:
    """Whether a run of ids consecutive on both sides is one descriptor per region: both
    sides linear with pieces of the same size region by region (then the run's bytes are
    the same bytes in the same order on both sides)."""
    return (
        local.linear
        and remote.linear
        and local.regions == remote.regions
        and bool(np.array_equal(local.size, remote.size))
    )


def run_starts(local: Sequence[int] | np.ndarray, remote: Sequence[int] | np.ndarray) -> np.ndarray:
    """Where each maximal run of ``(local[i], remote[i])`` pairs whose ids both go up by
    one starts (int64 positions, 0 first; empty input: empty)."""
    n = len(local)
    if n <= SMALL_POST and not isinstance(local, np.ndarray):
        at = [
            i for i in range(1, n) if local[i] != local[i - 1] + 1 or remote[i] != remote[i - 1] + 1
        ]
        return np.array([0, *at] if n else [], dtype=np.int64)
    a = np.asarray(local, dtype=np.int64)
    b = np.asarray(remote, dtype=np.int64)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(
        np.concatenate((np.ones(1, dtype=bool), (np.diff(a) != 1) | (np.diff(b) != 1)))
    )


def id_runs(
    local: np.ndarray, remote: np.ndarray, starts: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of ``(local[i], remote[i])`` pairs whose ids both go up by one:
    (local starts, remote starts, lengths), in order (``starts``: ``run_starts`` if known).
    Empty input: three empty arrays."""
    if starts is None:
        starts = run_starts(local, remote)
    lengths = np.diff(np.append(starts, len(local))) if starts.size else starts
    return local[starts].astype(np.int64), remote[starts].astype(np.int64), lengths


def run_descriptors(side: Side, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """One side's Nx3 uint64 (addr, len, dev) list: a descriptor per run per region,
    region-major (the order of the other side's list, so row i pairs with row i)."""
    runs = int(starts.size)
    out = np.empty((side.regions * runs, 3), dtype=np.uint64)
    s = starts.astype(np.uint64)
    n = lengths.astype(np.uint64)
    out[:, 0] = (side.base[:, None] + s[None, :] * side.size[:, None]).reshape(-1)
    out[:, 1] = (side.size[:, None] * n[None, :]).reshape(-1)
    out[:, 2] = np.repeat(side.dev, runs)
    return out


def prepped_indices(side: Side, ids: np.ndarray) -> np.ndarray:
    """Indices (int32, as ``make_prepped_xfer`` takes them) of ``ids`` into the side's
    prepared list: region by region, id by id, group by group (the old
    ``descriptor_indices`` / ``unit_indices`` order, built without a Python loop per id)."""
    ids32 = ids.astype(np.int32, copy=False)
    g = side.uniform
    if g == 1:
        out: np.ndarray = np.add.outer(side.offsets32, ids32).reshape(-1)
        return out
    if g > 1:
        first: np.ndarray = np.add.outer(side.offsets32, ids32 * np.int32(g))
        return (first[:, :, None] + np.arange(g, dtype=np.int32)).reshape(-1)
    parts = [
        (off + ids32[:, None] * np.int32(per) + np.arange(per, dtype=np.int32)).reshape(-1)
        for off, per in zip(side.offsets32.tolist(), side.groups.tolist(), strict=True)
    ]
    return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, dtype=np.int32)


@dataclass(frozen=True, eq=False)
class PairPlan:
    """Both sides of a connected pair as ids see them (``NixlTransport.connect``);
    ``linear``: ``pair_linear`` of the two."""

    local: Side
    remote: Side
    linear: bool

    @property
    def descriptors_per_run(self) -> int:
        """Descriptors one run costs on a linear pair (one per region); 0 otherwise."""
        return self.local.regions if self.linear else 0


def pair_plan(local: Side, remote: Side) -> PairPlan:
    if local.regions != remote.regions or not np.array_equal(local.groups, remote.groups):
        raise ValueError(
            f"the two sides list {local.regions} and {remote.regions} regions "
            f"of {local.groups.tolist()} and {remote.groups.tolist()} pieces "
            "per id: their descriptors cannot be paired"
        )
    if max(local.prepared, remote.prepared) > MAX_PREPARED:
        raise ValueError(
            f"{max(local.prepared, remote.prepared)} prepared descriptors on one "
            f"side: NIXL indexes at most {MAX_PREPARED}"
        )
    return PairPlan(local, remote, pair_linear(local, remote))


def choose_path(entries: int, descriptors: int, linear: bool) -> Path:
    """The cheaper way to build a post (``*_NS`` above) of ``entries`` prepared indices
    that NIXL turns into ``descriptors``, or of those ``descriptors`` built from runs (only
    on a linear pair: elsewhere a run is not one descriptor and the prepared list is always
    at least as good)."""
    if not linear:
        return "prepped"
    prepped = (
        PREPPED_FIXED_NS + PREPPED_PER_INDEX_NS * entries + PREPPED_PER_DESCRIPTOR_NS * descriptors
    )
    coalesced = COALESCED_FIXED_NS + COALESCED_PER_DESCRIPTOR_NS * descriptors
    return "coalesced" if coalesced < prepped else "prepped"


def split_points(lengths: np.ndarray, per_id: int, per_run: int, bound: int) -> list[int]:
    """Where to cut a post's ids so no part exceeds ``bound`` descriptors: each run costs
    ``per_run`` descriptors (linear pairs: one per region) or each id ``per_id`` (others:
    one per prepared entry); cuts fall on run boundaries where runs count. Returns the id
    positions of the cuts, ascending, without 0 and the end ([] : one part)."""
    total_ids = int(lengths.sum())
    if per_run:
        runs_per_part = max(1, bound // per_run)
        if lengths.size <= runs_per_part:
            return []
        ends = np.cumsum(lengths)
        return [int(ends[i - 1]) for i in range(runs_per_part, int(lengths.size), runs_per_part)]
    ids_per_part = max(1, bound // max(per_id, 1))
    return list(range(ids_per_part, total_ids, ids_per_part))
