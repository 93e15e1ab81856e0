"""Describe a vLLM KV cache as NIXL regions of equal block slots, whatever its tensor layout.

A region is a run of ``num_blocks`` slots ``block_stride`` apart, each ``block_len`` bytes.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import TYPE_CHECKING, Literal

from kvpush_prod.core.messages import Layout, Region
from kvpush_prod.errors import ConfigError

if TYPE_CHECKING:
    import torch


def _regions_of(name: str, t: torch.Tensor, num_blocks: int, dev_id: int) -> list[Region]:
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
    return regions


def layout_from_kv_caches(
    kv_caches: dict[str, torch.Tensor], num_blocks: int, signature: str,
    facts: dict[str, str] | None = None,
) -> Layout:
    """The NIXL view of ``kv_caches``; ``signature`` hashes what must match on both sides,
    ``facts`` name it (and the model and versions) for the error when it does not."""
    regions: list[Region] = []
    seen: set[tuple[int, int]] = set()
    mem_type: Literal["DRAM", "VRAM"] = "DRAM"
    for name, t in kv_caches.items():
        dev_id = 0
        if t.device.type == "cuda":
            mem_type, dev_id = "VRAM", t.device.index or 0
        elif t.device.type != "cpu":
            raise ConfigError(
                f"KV cache tensor {name!r} is on {t.device}; kvpush supports cpu and cuda"
            )
        for r in _regions_of(name, t, num_blocks, dev_id):
            if (r.base, r.block_len) not in seen:  # layers may share one storage view
                seen.add((r.base, r.block_len))
                regions.append(r)
    shape = ",".join(str(r.block_len) for r in regions)
    compat = hashlib.sha256(f"{signature}|{mem_type}|{shape}".encode()).hexdigest()[:16]
    return Layout(compat=compat, mem_type=mem_type, regions=regions,
                  facts=dict(facts or {}))


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
