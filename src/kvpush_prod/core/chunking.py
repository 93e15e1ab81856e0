"""How P cuts a whole push into chunks: groups of consecutive regions (layers) over all of
the transfer's blocks, so a chunk's descriptors are its regions x the blocks' runs.

A chunk of block ranges over every region (the old cut) costs regions x runs descriptors
per chunk, so a transfer of k chunks posts about k x regions on a fresh cache; a chunk of
a few regions over every block posts those regions x runs, and the transfer about regions.
"""

from __future__ import annotations

from collections.abc import Sequence


def region_groups(region_bytes: Sequence[float], ids: int, chunk_bytes: int) -> tuple[int, ...]:
    """Bounds ``(0, b1, ..., len(region_bytes))`` of groups of consecutive regions whose
    bytes over ``ids`` ids (``region_bytes``: one id's bytes in each region) are at most
    ``chunk_bytes`` each, a group holding at least one region (one region alone may be
    more: the scheduler then cuts it by blocks). Groups follow region order, each as full
    as it can be; ``(0, n)`` (one group) when the whole fits one chunk, there is at most
    one region, or no ids."""
    n = len(region_bytes)
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    if any(b < 0 for b in region_bytes) or ids < 0:
        raise ValueError(f"region sizes and ids must be >= 0, got {list(region_bytes)}, {ids}")
    if n <= 1 or ids == 0 or sum(region_bytes) * ids <= chunk_bytes:
        return (0, n)
    bounds = [0]
    acc = 0.0
    for r, size in enumerate(region_bytes):
        grown = acc + size * ids
        if r > bounds[-1] and grown > chunk_bytes:
            bounds.append(r)
            grown = size * ids
        acc = grown
    bounds.append(n)
    return tuple(bounds)


def group_bytes(region_bytes: Sequence[float], bounds: Sequence[int]) -> tuple[int, ...]:
    """One id's bytes in each group of ``bounds``, rounded (at least 1: the scheduler's
    unit)."""
    return tuple(
        max(1, round(sum(region_bytes[a:b]))) for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    )
