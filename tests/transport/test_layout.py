"""Describing vLLM KV caches as NIXL block regions, whatever the tensor layout."""

from __future__ import annotations

import pytest
import torch

from kvpush_prod.errors import ConfigError
from kvpush_prod.transport.layout import descriptor_indices, layout_from_kv_caches


def test_cpu_backend_layout_one_region_per_layer() -> None:
    # vLLM 0.32 CPU: [num_blocks, kv_heads, block_size, 2*head_dim], one buffer for all layers.
    buf = torch.zeros(2, 16, 2, 8, 8)
    caches = {"l0": buf[0], "l1": buf[1]}
    lay = layout_from_kv_caches(caches, 16, "sig")
    assert lay.mem_type == "DRAM" and len(lay.regions) == 2
    r0, r1 = lay.regions
    assert r0.block_len == r0.block_stride == 2 * 8 * 8 * 4
    assert r1.base - r0.base == 16 * r0.block_stride


def test_kv_split_layout_gives_a_region_per_k_and_v() -> None:
    # Legacy [2, num_blocks, block_size, heads, dim]: K and V blocks live apart.
    t = torch.zeros(2, 10, 4, 2, 8)
    lay = layout_from_kv_caches({"l0": t}, 10, "sig")
    assert len(lay.regions) == 2
    assert lay.regions[1].base - lay.regions[0].base == 10 * 4 * 2 * 8 * 4


def test_kernel_blocks_smaller_than_manager_blocks_are_grouped() -> None:
    t = torch.zeros(20, 2, 4, 8)  # 10 manager blocks of 2 kernel blocks each
    (r,) = layout_from_kv_caches({"l0": t}, 10, "sig").regions
    assert r.block_len == 2 * 2 * 4 * 8 * 4 and r.num_blocks == 10


def test_block_axis_inside_another_axis_becomes_one_region_per_outer_index() -> None:
    t = torch.zeros(8, 10, 4).permute(1, 0, 2)  # [blocks, heads, dim] stored head-major
    lay = layout_from_kv_caches({"l0": t}, 10, "sig")
    assert len(lay.regions) == 8 and lay.regions[0].block_len == 16


def test_strided_block_contents_are_refused_with_a_clear_error() -> None:
    t = torch.zeros(10, 4, 2)[:, :, 0]  # every other element: a block is not one run
    with pytest.raises(ConfigError, match="contiguous"):
        layout_from_kv_caches({"l0": t}, 10, "sig")


def test_layouts_differ_in_compat_when_the_signature_differs() -> None:
    t = torch.zeros(4, 2, 8)
    assert (
        layout_from_kv_caches({"a": t}, 4, "x").compat
        != layout_from_kv_caches({"a": t}, 4, "y").compat
    )


def test_descriptor_indices_are_region_major() -> None:
    t = torch.zeros(2, 10, 4)
    lay = layout_from_kv_caches({"l0": t}, 10, "s")
    assert descriptor_indices([3, 5], lay) == [3, 5, 13, 15]
