"""Describe a vLLM KV cache as NIXL regions of equal block slots, whatever its tensor layout.

A region is a run of ``num_blocks`` slots ``block_stride`` apart, each ``block_len`` bytes.
Inside a slot, ``tok_groups`` groups of ``block_size`` tokens when the tensor tells (units
of a smaller block size are then pieces of each group: ``unit_descriptors``).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import msgspec

from kvpush_prod.core import tpmap
from kvpush_prod.core.blocksize import group_lens
from kvpush_prod.core.messages import Layout, Region
from kvpush_prod.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import torch


@dataclass(frozen=True)
class Heads:
    """The KV heads of this rank, for the head-major check (0: not told, no check)."""

    local: int = 0  # heads this rank holds (vLLM's per-rank num_kv_heads)
    total: int = 0  # heads of the model
    tp_size: int = 1
    tp_rank: int = 0
    replicated: bool = False  # every rank holds all heads (MLA's latent)
    block_size: int = 0  # tokens per block (0: not told, no token geometry)
    head_size: int = 0  # elements per head and token (MLA: the latent's)
    # vLLM's CPU backend: one head's block as the attention kernel orders it, (groups,
    # elements per token) runs (``token_pattern_of``; the engine probes its kernel), () unknown
    token_pattern: Pattern = ()


def _head_major(name: str, t: torch.Tensor, inner: list[int], kstride: int, local: int) -> bool:
    """Whether a block of ``t`` is ``local`` equal slabs, one per KV head, head after head:
    the outermost axis inside the block (largest stride, size > 1) has ``local`` entries and
    no other axis inside the block could be it (a block size equal to the head count cannot
    be told from the head axis by shape and strides: not head-major, so never sliced)."""
    if local <= 1:
        return local == 1
    sized = [i for i in inner if t.shape[i] > 1]
    if not sized:
        return False
    outer_axis = max(sized, key=t.stride)
    if t.shape[outer_axis] != local or t.stride(outer_axis) * local != kstride:
        return False
    return sum(1 for i in sized if t.shape[i] == local) == 1


Pattern = tuple[tuple[int, int], ...]  # (groups, elements or bytes per token) runs


def token_pattern_of(owner: list[int], block_size: int) -> Pattern:
    """The token groups of one block of one head, from which token owns each element in
    memory order (``owner``): runs of (groups, elements per token), each group
    ``block_size`` tokens in order; () when memory is not made of such groups."""
    runs: list[tuple[int, int]] = []
    p, n = 0, len(owner)
    while p < n:
        size = 0
        while p + size < n and owner[p + size] == 0:
            size += 1
        if size == 0 or p + block_size * size > n:
            return ()
        for tok in range(block_size):
            if any(o != tok for o in owner[p + tok * size : p + (tok + 1) * size]):
                return ()
        if runs and runs[-1][1] == size:
            runs[-1] = (runs[-1][0] + 1, size)
        else:
            runs.append((1, size))
        p += block_size * size
    return tuple(runs)


def _token_groups(
    t: torch.Tensor, inner: list[int], kstride: int, heads: Heads
) -> tuple[int, list[tuple[int, int]]]:
    """How many groups of ``block_size`` tokens one block of ``t`` holds, each token's bytes
    together (``[groups][tokens][bytes]``), and their sizes when they differ (``Region.
    tok_pattern``, in bytes); 0 when the shape and strides do not tell.

    vLLM's CPU backend stores ``[blocks, heads, block_size, 2 * head_size]`` in an order
    its attention kernel chooses (K transposed on its "vec" kernel): for a tensor of that
    shape only the order the engine probed (``heads.token_pattern``) is believed. Elsewhere
    exactly one axis inside the block must have ``block_size`` entries: the axes outside it
    make the groups."""
    block_size, esz = heads.block_size, t.element_size()
    if block_size < 1:
        return 0, []
    sized = [i for i in inner if t.shape[i] > 1]  # innermost first
    hs = heads.head_size
    if (
        hs > 0
        and len(sized) >= 2
        and t.shape[sized[0]] == 2 * hs
        and t.shape[sized[1]] == block_size
    ):
        # The CPU backend's shape: its kernel's order, as probed, or unknown.
        pattern = heads.token_pattern
        per_head = block_size * sum(g * e for g, e in pattern)
        if not pattern or per_head != 2 * hs * block_size or kstride % per_head:
            return 0, []
        repeats = kstride // per_head
        return (repeats * sum(g for g, _ in pattern), [(g, e * esz) for g, e in pattern])
    tok = [i for i in inner if t.shape[i] == block_size]
    if len(tok) != 1:
        return 0, []
    groups = 1
    for i in inner:
        if t.stride(i) > t.stride(tok[0]):
            groups *= t.shape[i]
    if groups * block_size * t.stride(tok[0]) != kstride:
        return 0, []
    return groups, []


def _regions_of(
    name: str, t: torch.Tensor, num_blocks: int, dev_id: int, heads: Heads
) -> tuple[list[Region], bool]:
    esz = t.element_size()
    axes = [i for i in range(t.dim()) if t.shape[i] % num_blocks == 0 and t.shape[i] > 0]
    if not axes:
        raise ConfigError(
            f"KV cache tensor {name!r} of shape {tuple(t.shape)} has no axis of "
            f"{num_blocks} blocks (or a multiple); this KV layout is not supported"
        )
    bdim = max(axes, key=lambda i: t.stride(i))
    ratio = t.shape[bdim] // num_blocks  # kernel blocks per manager block
    kstride = t.stride(bdim)
    inner = sorted((i for i in range(t.dim()) if i != bdim and t.stride(i) < kstride), key=t.stride)
    expect = 1
    for i in inner:
        if t.shape[i] != 1 and t.stride(i) != expect:
            raise ConfigError(
                f"KV cache tensor {name!r} (shape {tuple(t.shape)}, strides {t.stride()}) does "
                "not store a block contiguously; use a block-contiguous KV layout"
            )
        expect *= t.shape[i]
    if expect != kstride:
        raise ConfigError(
            f"KV cache tensor {name!r}: block stride {kstride} elements but a block holds "
            f"{expect}; padded block layouts are not supported"
        )
    head_major = ratio == 1 and _head_major(name, t, inner, kstride, heads.local)
    # Kernel blocks smaller than the manager's: their token order is not the block size's.
    groups, pattern = _token_groups(t, inner, kstride, heads) if ratio == 1 else (0, [])
    outer = [i for i in range(t.dim()) if i != bdim and t.stride(i) >= kstride and t.shape[i] > 1]
    regions = []
    for idx in itertools.product(*(range(t.shape[i]) for i in outer)):
        base = t.data_ptr() + esz * sum(j * t.stride(i) for j, i in zip(idx, outer, strict=False))
        regions.append(
            Region(
                base=base,
                block_stride=kstride * ratio * esz,
                block_len=kstride * ratio * esz,
                num_blocks=num_blocks,
                dev_id=dev_id,
                tok_groups=groups,
                tok_pattern=pattern,
            )
        )
    return regions, head_major


def layout_from_kv_caches(
    kv_caches: dict[str, torch.Tensor],
    num_blocks: int,
    signature: str,
    facts: dict[str, str] | None = None,
    heads: Heads | None = None,
) -> Layout:
    """The NIXL view of ``kv_caches``; ``signature`` hashes what must match on both sides,
    ``facts`` name it (and the model and versions) for the error when it does not.

    ``heads``: this rank's KV heads and tensor-parallel place. The slab of one head inside a
    block is derived from the tensors (``Layout.kv_heads`` is set only when every tensor's
    block interior is head-major), so ranks of different tensor-parallel sizes can be mapped
    onto each other (``pair_views``); the hash then counts bytes per head, not per block."""
    heads = heads or Heads()
    regions: list[Region] = []
    seen: set[tuple[int, int]] = set()
    mem_type: Literal["DRAM", "VRAM"] = "DRAM"
    head_major = heads.local > 0
    for name, t in kv_caches.items():
        dev_id = 0
        if t.device.type == "cuda":
            mem_type, dev_id = "VRAM", t.device.index or 0
        elif t.device.type != "cpu":
            raise ConfigError(
                f"KV cache tensor {name!r} is on {t.device}; kvpush supports cpu and cuda"
            )
        found, major = _regions_of(name, t, num_blocks, dev_id, heads)
        head_major = head_major and major
        for r in found:
            if (r.base, r.block_len) not in seen:  # layers may share one storage view
                seen.add((r.base, r.block_len))
                regions.append(r)
    kv_heads = (
        heads.local if head_major and all(r.block_len % heads.local == 0 for r in regions) else 0
    )
    if kv_heads and any(not _slabs_whole(r, kv_heads) for r in regions):
        regions = [msgspec.structs.replace(r, tok_groups=0, tok_pattern=[]) for r in regions]
    # Bytes per head when the block is head-major: the same on every tensor-parallel size;
    # with the token geometry known, groups per head x bytes per token: the same on every
    # block size too (blocks of different sizes are converted, core.blocksize).
    shape = ",".join(_shape_of(r, kv_heads, heads.block_size) for r in regions)
    unit = "head" if kv_heads else "block"
    compat = hashlib.sha256(f"{signature}|{mem_type}|{unit}:{shape}".encode()).hexdigest()[:16]
    return Layout(
        compat=compat,
        mem_type=mem_type,
        regions=regions,
        facts=dict(facts or {}),
        tp_size=heads.tp_size,
        tp_rank=heads.tp_rank,
        kv_heads=kv_heads,
        total_kv_heads=heads.total,
        replicated=heads.replicated,
        block_size=heads.block_size,
    )


def _slabs_whole(r: Region, kv_heads: int) -> bool:
    """Whether each KV head's slab of a block holds whole token groups (whole pattern
    repeats), so a head slab (``head_slab``) keeps the token geometry."""
    if r.tok_groups % kv_heads:
        return False
    per = sum(g for g, _ in r.tok_pattern) if r.tok_pattern else 1
    return (r.tok_groups // kv_heads) % per == 0


def _shape_of(r: Region, kv_heads: int, block_size: int) -> str:
    """A region's part of the layout hash: groups per token (per KV head when head-major)
    and their bytes per token if the token geometry is known, else bytes per block (per KV
    head): never the block size."""
    if r.tok_groups and block_size:
        groups = r.tok_groups // kv_heads if kv_heads else r.tok_groups
        if r.tok_pattern:
            return f"{groups}x" + "+".join(f"{g}*{b}" for g, b in r.tok_pattern)
        return f"{groups}x{r.block_len // (r.tok_groups * block_size)}"
    return str(r.block_len // kv_heads) if kv_heads else str(r.block_len)


def head_slab(layout: Layout, first: int, count: int, local: int) -> Layout:
    """``layout`` (a rank holding ``local`` heads) narrowed to heads ``[first, first +
    count)`` of each block: the same slots (same stride), each starting ``first`` heads in
    and ``count`` heads long. The whole block needs no head-major interior."""
    if first == 0 and count == local:
        return layout
    if layout.kv_heads != local or first < 0 or first + count > local:
        raise ConfigError(
            f"cannot take KV heads [{first}, {first + count}) of a rank holding "
            f"{layout.kv_heads} heads (0: its block interior is not head-major); run prefill "
            "and decode with the same --tensor-parallel-size, or a KV layout whose blocks "
            "store head after head (vLLM's CPU backend, or HND on GPUs)"
        )
    regions = []
    for r in layout.regions:
        per = r.block_len // layout.kv_heads
        # The slab of ``count`` heads holds their token groups (head-major: per head alike).
        groups = r.tok_groups * count // layout.kv_heads
        regions.append(
            msgspec.structs.replace(
                r, base=r.base + first * per, block_len=count * per, tok_groups=groups
            )
        )
    return msgspec.structs.replace(layout, regions=regions, kv_heads=count)


def pair_views(mine: Layout, theirs: Layout, producer: bool) -> tuple[Layout, Layout]:
    """The bytes this rank and a peer rank exchange: (local view, remote view), each the
    layout narrowed to the heads of their piece (``core.tpmap``); equal tensor-parallel
    sizes exchange whole blocks. Raises ConfigError when the ranks cannot be mapped
    (``core.compat.layout_problem`` says why in words first)."""
    p, d = (mine, theirs) if producer else (theirs, mine)
    if p.tp_size == d.tp_size and not (p.replicated or d.replicated):
        return mine, theirs
    total = max(p.total_kv_heads, d.total_kv_heads)
    replicated = p.replicated and d.replicated
    why = tpmap.problem(p.tp_size, d.tp_size, total, replicated)
    if why:
        raise ConfigError(why)
    pc = tpmap.piece(p.tp_rank, d.tp_rank, p.tp_size, d.tp_size, total, replicated)
    if pc is None:
        raise ConfigError(
            f"prefill rank {p.tp_rank} of {p.tp_size} does not feed decode "
            f"rank {d.tp_rank} of {d.tp_size}"
        )
    pv = head_slab(p, pc.p_first, pc.heads, pc.p_local)
    dv = head_slab(d, pc.d_first, pc.heads, pc.d_local)
    return (pv, dv) if producer else (dv, pv)


def descriptor_indices(block_ids: list[int], layout: Layout) -> list[int]:
    """Indices into a dlist prepared region-major (region r, block b -> r * num_blocks + b)."""
    out: list[int] = []
    for r, region in enumerate(layout.regions):
        base = r * region.num_blocks
        out.extend(base + b for b in block_ids)
    return out


def all_descriptors(layout: Layout) -> list[tuple[int, int, int]]:
    """Every (addr, len, dev) of a layout, region-major, for ``prep_xfer_dlist``."""
    return [
        (r.base + b * r.block_stride, r.block_len, r.dev_id)
        for r in layout.regions
        for b in range(r.num_blocks)
    ]


def unit_pieces(region: Region, unit: int, k: int) -> list[tuple[int, int]]:
    """The (addr, len) pieces of unit ``unit`` of ``region`` whose blocks hold ``k`` units:
    block ``unit // k``, the ``unit % k``-th k-th of each token group, group by group."""
    start = region.base + (unit // k) * region.block_stride
    out, off = [], 0
    for glen in group_lens(region):
        out.append((start + off + (unit % k) * (glen // k), glen // k))
        off += glen
    return out


def unit_descriptors(layout: Layout, k: int) -> np.ndarray:
    """Every unit piece of ``layout`` (``k`` units per block) as an Nx3 uint64 array
    (addr, len, dev) for ``prep_xfer_dlist``: region r, unit v, group g at index
    ``offset_r + v * groups_r + g`` (``unit_indices``)."""
    import numpy as np

    parts = []
    for r in layout.regions:
        lens = np.asarray(group_lens(r), dtype=np.uint64)
        offs = np.concatenate([np.zeros(1, dtype=np.uint64), np.cumsum(lens)[:-1]])
        units = np.arange(r.num_blocks * k, dtype=np.uint64)
        start = r.base + (units // k) * r.block_stride
        addrs = start[:, None] + offs[None, :] + (units % k)[:, None] * (lens // k)[None, :]
        arr = np.empty((addrs.size, 3), dtype=np.uint64)
        arr[:, 0] = addrs.reshape(-1)
        arr[:, 1] = np.tile(lens // k, units.size)
        arr[:, 2] = r.dev_id
        parts.append(arr)
    return np.concatenate(parts) if parts else np.empty((0, 3), dtype=np.uint64)


def unit_indices(unit_ids: list[int], layout: Layout, k: int) -> list[int]:
    """Indices into ``unit_descriptors(layout, k)`` of ``unit_ids``, region by region,
    each unit's groups in order."""
    out: list[int] = []
    offset = 0
    for r in layout.regions:
        g = max(r.tok_groups, 1)
        out.extend(offset + v * g + i for v in unit_ids for i in range(g))
        offset += r.num_blocks * k * g
    return out
