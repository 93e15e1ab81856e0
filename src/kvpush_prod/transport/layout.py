"""Describe a vLLM KV cache as NIXL regions of equal block slots, whatever its tensor layout.

A region is a run of ``num_blocks`` slots ``block_stride`` apart, each ``block_len`` bytes.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import msgspec

from kvpush_prod.core import tpmap
from kvpush_prod.core.messages import Layout, Region
from kvpush_prod.errors import ConfigError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Heads:
    """The KV heads of this rank, for the head-major check (0: not told, no check)."""

    local: int = 0  # heads this rank holds (vLLM's per-rank num_kv_heads)
    total: int = 0  # heads of the model
    tp_size: int = 1
    tp_rank: int = 0
    replicated: bool = False  # every rank holds all heads (MLA's latent)


def _head_major(name: str, t: torch.Tensor, inner: list[int], kstride: int,
                local: int) -> bool:
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


def _regions_of(name: str, t: torch.Tensor, num_blocks: int, dev_id: int,
                local_heads: int = 0) -> tuple[list[Region], bool]:
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
    inner = sorted(
        (i for i in range(t.dim()) if i != bdim and t.stride(i) < kstride), key=t.stride
    )
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
    head_major = ratio == 1 and _head_major(name, t, inner, kstride, local_heads)
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
            )
        )
    return regions, head_major


def layout_from_kv_caches(
    kv_caches: dict[str, torch.Tensor], num_blocks: int, signature: str,
    facts: dict[str, str] | None = None, heads: Heads | None = None,
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
        found, major = _regions_of(name, t, num_blocks, dev_id, heads.local)
        head_major = head_major and major
        for r in found:
            if (r.base, r.block_len) not in seen:  # layers may share one storage view
                seen.add((r.base, r.block_len))
                regions.append(r)
    kv_heads = heads.local if head_major and all(r.block_len % heads.local == 0
                                                 for r in regions) else 0
    # Bytes per head when the block is head-major: the same on every tensor-parallel size.
    shape = ",".join(str(r.block_len // kv_heads) if kv_heads else str(r.block_len)
                     for r in regions)
    unit = "head" if kv_heads else "block"
    compat = hashlib.sha256(f"{signature}|{mem_type}|{unit}:{shape}".encode()).hexdigest()[:16]
    return Layout(compat=compat, mem_type=mem_type, regions=regions,
                  facts=dict(facts or {}), tp_size=heads.tp_size, tp_rank=heads.tp_rank,
                  kv_heads=kv_heads, total_kv_heads=heads.total,
                  replicated=heads.replicated)


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
            "store head after head (vLLM's CPU backend, or HND on GPUs)")
    regions = []
    for r in layout.regions:
        per = r.block_len // layout.kv_heads
        regions.append(msgspec.structs.replace(r, base=r.base + first * per,
                                               block_len=count * per))
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
        raise ConfigError(f"prefill rank {p.tp_rank} of {p.tp_size} does not feed decode "
                          f"rank {d.tp_rank} of {d.tp_size}")
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
