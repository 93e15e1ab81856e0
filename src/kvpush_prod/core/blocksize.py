"""Prefill and decode engines of different KV block sizes: both sides' blocks as units.

A unit is ``u = min(Bp, Bd)`` tokens; block ``b`` of a side with ``k = B / u`` units per
block is units ``b * k .. b * k + k - 1``. Pure: no I/O, no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush_prod.core.messages import Layout, Region


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def unit_tokens(p: int, d: int) -> int:
    """Tokens per unit for block sizes ``p`` and ``d`` (the smaller one)."""
    return min(p, d)


def converts(p: Layout | None, d: Layout | None) -> bool:
    """Whether the two layouts exchange units rather than whole blocks (both known, block
    sizes known and different)."""
    return (
        p is not None
        and d is not None
        and p.block_size > 0
        and d.block_size > 0
        and p.block_size != d.block_size
    )


def unit_of(a: Layout | None, b: Layout | None) -> int:
    """Tokens per unit between two layouts; 0 when they exchange whole blocks."""
    if a is None or b is None or not converts(a, b):
        return 0
    return unit_tokens(a.block_size, b.block_size)


def per_block(layout: Layout | None, u: int) -> int:
    """Ids per block of ``layout`` for ``u``-token units (1: whole blocks, ``u`` 0; ``u``
    divides its block size: ``compat`` checked)."""
    return layout.block_size // u if layout is not None and u > 0 and layout.block_size > 0 else 1


def group_lens(region: Region) -> list[int]:
    """Bytes of each token group of a block slot of ``region``, in memory order (one group
    of the whole slot when the token geometry is unknown)."""
    g = region.tok_groups
    if g < 1:
        return [region.block_len]
    if not region.tok_pattern:
        return [region.block_len // g] * g
    sizes = [b for n, b in region.tok_pattern for _ in range(n)]
    sizes = sizes * (g // len(sizes))
    total = sum(sizes)
    return [region.block_len * b // total for b in sizes]


def expand(ids: list[int], k: int) -> list[int]:
    """Block ids as unit ids, ``k`` units per block, in order."""
    if k == 1:
        return list(ids)
    return [b * k + j for b in ids for j in range(k)]


@dataclass(frozen=True, slots=True)
class Units:
    """One push planned in units: P's units from the first one D lacks (``src``), D's units
    they go to (``dst``), and where ``dst`` starts in the prompt (``first``)."""

    src: list[int]
    dst: list[int]
    first: int
    unit_tokens: int  # 0: whole blocks (equal block sizes)


def push_units(
    p: Layout | None,
    d: Layout | None,
    p_blocks: list[int],
    d_blocks: list[int],
    first_block: int,
    num_tokens: int,
) -> Units | str:
    """P's prompt blocks and D's REGISTER (``d_blocks`` from D block ``first_block``) as
    units, each side trimmed to the prompt's ``cdiv(num_tokens, u)`` units; or why the
    blocks do not fit the prompt. Called on the raw REGISTER every time: never expands twice.
    Layouts not known (an older peer): whole blocks."""
    if p is None or d is None or not converts(p, d):
        if first_block + len(d_blocks) != len(p_blocks):
            return (
                f"{len(d_blocks)} blocks from block {first_block}, but the prompt "
                f"fills {len(p_blocks)} blocks here"
            )
        return Units(p_blocks[first_block:], list(d_blocks), first_block, 0)
    u = unit_tokens(p.block_size, d.block_size)
    kp, kd = per_block(p, u), per_block(d, u)
    if (
        num_tokens <= 0
        or len(p_blocks) != cdiv(num_tokens, p.block_size)
        or first_block + len(d_blocks) != cdiv(num_tokens, d.block_size)
    ):
        return (
            f"{len(d_blocks)} decode blocks of {d.block_size} tokens from block "
            f"{first_block} for a prompt of {num_tokens} tokens, which fills "
            f"{len(p_blocks)} blocks of {p.block_size} tokens here"
        )
    total = cdiv(num_tokens, u)
    first = first_block * kd
    src = expand(p_blocks, kp)[first:total]
    dst = expand(d_blocks, kd)[: total - first]
    return Units(src, dst, first, u)


def pull_units(
    d: Layout | None, p: Layout | None, d_blocks: list[int], count: int
) -> list[int] | str:
    """D's reserved blocks as the ``count`` units a FALLBACK from ``p`` offers; or why
    they do not match (whole blocks when the sizes are equal or a layout is not known)."""
    if p is None or d is None or not converts(p, d):
        if count != len(d_blocks):
            return f"{count} blocks for {len(d_blocks)}"
        return list(d_blocks)
    kd = per_block(d, unit_tokens(p.block_size, d.block_size))
    if count <= 0 or cdiv(count, kd) != len(d_blocks):
        return (
            f"{count} units of {unit_tokens(p.block_size, d.block_size)} tokens for "
            f"{len(d_blocks)} blocks of {d.block_size} tokens"
        )
    return expand(d_blocks, kd)[:count]


def unit_limit(layout: Layout, u: int) -> int:
    """Units in ``layout``'s smallest region (ids at or past it are out of bounds)."""
    blocks = min((r.num_blocks for r in layout.regions), default=0)
    return blocks * per_block(layout, u)
