"""Whether two engines may exchange KV: their layouts' named facts, compared one by one.

Each engine describes its KV cache with facts (``Layout.facts``): the model and its
revision, dtypes, block size, shape, parallelism, layout, and the versions it runs. A
prefill engine refuses a decode rank whose facts differ in any of ``MUST_MATCH`` (a push
into such a cache would be garbage, or worse, plausible tokens of another model), naming
each difference with both values. ``INFORMATIVE`` facts (the kvpush version) may differ
during a rolling upgrade: they are shown, never refused. Protocol versions are refused
earlier, when a message is decoded. Block sizes may differ where one divides the other and
both layouts tell where each token's bytes are (``block_size_problem``, ``core.blocksize``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from kvpush_prod.core import blocksize, tpmap
from kvpush_prod.core.messages import Layout, Region

# What both engines must share for a block's bytes to mean the same thing on both. The
# tensor-parallel size may differ (``core.tpmap`` maps heads across ranks); ``num_kv_heads``
# is the model's total. So may the block size (``block_size_problem``).
MUST_MATCH = (
    "model",
    "revision",
    "model_type",
    "dtype",
    "kv_cache_dtype",
    "num_layers",
    "num_kv_heads",
    "head_size",
    "kv_cache_layout",
)
INFORMATIVE = ("kvpush", "tp_size", "block_size")


def signature_of(facts: Mapping[str, str]) -> str:
    """The layout hash of ``facts``: what must match for a KV head's bytes to mean the same
    on both sides (``MUST_MATCH`` and the attention kind; never the TP size: ranks are
    mapped onto each other by heads; nor the block size: blocks are converted through units,
    ``block_size_problem``). One list, so the hash and the named refusal agree."""
    text = "|".join(f"{k}={facts.get(k, '')}" for k in (*MUST_MATCH, *ATTENTION_FACTS))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def differences(mine: Mapping[str, str], theirs: Mapping[str, str]) -> list[str]:
    """The MUST_MATCH facts both name with different values, as "name: ours here, theirs
    there" (facts one side does not name are not compared: an older peer names fewer)."""
    return [
        f"{k}: {mine[k]!r} here, {theirs[k]!r} on the peer{_HINTS.get(k, '')}"
        for k in (*MUST_MATCH, *ATTENTION_FACTS)
        if k in mine and k in theirs and mine[k] != theirs[k]
    ]


# Also compared: the attention kind and an MLA latent's dimensions (a block of latents and
# a block of per-head K and V are not the same bytes, even for the same model).
ATTENTION_FACTS = ("use_mla", "kv_lora_rank", "qk_rope_head_dim")
_HINTS = {
    "use_mla": " (one engine stores MLA latents, the other per-head K and V: run both "
    "with MLA, or both with VLLM_MLA_DISABLE=1)"
}


def describe(mine: Mapping[str, str], theirs: Mapping[str, str]) -> str:
    """A refusal's detail: every differing fact with both values, then the informative
    ones that differ, then what to change."""
    diff = differences(mine, theirs)
    info = [
        f"{k}: {mine[k]!r} here, {theirs[k]!r} on the peer"
        for k in INFORMATIVE
        if k in mine and k in theirs and mine[k] != theirs[k]
    ]
    parts = diff or ["the KV layouts differ (no named fact explains it: region sizes)"]
    return (
        "; ".join(parts + info) + ". Prefill and decode must serve the same model "
        "(same --served-model-name and --revision), with the same dtype and KV cache "
        "dtype"
    )


def tp_problem(p: Layout, d: Layout) -> str:
    """Why prefill rank ``p`` cannot write into decode rank ``d`` across tensor-parallel
    sizes ("" if it can, or if both run the same size): the sizes must map (``tpmap``),
    the two ranks must share heads, and a side that gives or takes part of a block must
    store its blocks head after head (``Layout.kv_heads``)."""
    if p.tp_size == d.tp_size and not (p.replicated or d.replicated):
        return ""
    sizes = f"prefill --tensor-parallel-size {p.tp_size}, decode --tensor-parallel-size {d.tp_size}"
    if p.replicated != d.replicated:
        return f"{sizes}: one side replicates its KV (MLA) and the other does not"
    total = max(p.total_kv_heads, d.total_kv_heads)
    if p.total_kv_heads != d.total_kv_heads or total < 1:
        return (
            f"{sizes}: KV heads {p.total_kv_heads} on the prefill, {d.total_kv_heads} on "
            "the decode; both must name the model's KV heads (same model and kvpush)"
        )
    why = tpmap.problem(p.tp_size, d.tp_size, total, p.replicated)
    if why:
        return why
    pc = tpmap.piece(p.tp_rank, d.tp_rank, p.tp_size, d.tp_size, total, p.replicated)
    if pc is None:
        return (
            f"{sizes}: prefill rank {p.tp_rank} holds none of the KV heads of decode "
            f"rank {d.tp_rank}"
        )
    for side, lay, whole, local in (
        ("prefill", p, pc.whole_p, pc.p_local),
        ("decode", d, pc.whole_d, pc.d_local),
    ):
        if not whole and lay.kv_heads != local:
            return (
                f"{sizes}: the {side} rank {lay.tp_rank} would move part of each block "
                f"({pc.heads} of its {local} KV heads) but its KV cache blocks are not "
                "stored head after head (kv_cache_layout); use the same tensor-parallel "
                "size, or a head-major KV layout (vLLM's CPU backend, HND on GPUs)"
            )
    for a, b in zip(p.regions, d.regions, strict=False):
        pa = a.block_len if pc.whole_p else a.block_len // pc.p_local * pc.heads
        da = b.block_len if pc.whole_d else b.block_len // pc.d_local * pc.heads
        # Blocks of different sizes (block_size_problem): bytes per token must agree.
        pb, db = (p.block_size, d.block_size) if blocksize.converts(p, d) else (1, 1)
        if pa * db != da * pb:
            return (
                f"{sizes}: {pc.heads} KV heads are {pa} B per block on the prefill and "
                f"{da} B on the decode; the models' KV shapes differ"
            )
    return ""


def block_size_problem(p: Layout, d: Layout) -> str:
    """Why prefill rank ``p`` and decode rank ``d`` cannot exchange KV across their block
    sizes ("" if they can, or if the sizes are equal): the larger must be a multiple of the
    smaller, and every region on both sides must tell where each token's bytes are
    (``Region.tok_groups``), with the same token groups per KV head, of the same bytes per
    token."""
    if p.block_size == d.block_size or not (p.block_size and d.block_size):
        return ""
    sizes = f"--block-size {p.block_size} on the prefill, {d.block_size} on the decode"
    fix = (
        "; run both with the same --block-size, or sizes where one divides the other on "
        "a KV layout that stores tokens in an order kvpush can tell inside a block "
        "(vLLM's CPU backend, probed at start-up; NHD or HND on GPUs; MLA)"
    )
    small, large = sorted((p.block_size, d.block_size))
    if large % small:
        return f"KV block sizes differ ({sizes}): neither divides the other{fix}"
    if len(p.regions) != len(d.regions):
        return f"KV block sizes differ ({sizes}) and so do the region counts{fix}"
    for side, lay in (("prefill", p), ("decode", d)):
        count = unit_descriptor_count(lay, small)
        if count > MAX_UNIT_DESCRIPTORS:
            return (
                f"KV block sizes differ ({sizes}): moving {small}-token units of the "
                f"{side}'s KV cache takes {count} NIXL descriptors, over "
                f"{MAX_UNIT_DESCRIPTORS} (a KV cache this large, or one whose token "
                f"groups are this many, costs gigabytes of descriptors){fix}"
            )
    for i, (a, b) in enumerate(zip(p.regions, d.regions, strict=True)):
        if not (a.tok_groups and b.tok_groups):
            return (
                f"KV block sizes differ ({sizes}): the token layout inside a block of "
                f"KV region {i} is not known on the "
                f"{'prefill' if not a.tok_groups else 'decode'}{fix}"
            )
        ta, tb = _token_sizes(a, p), _token_sizes(b, d)
        if ta != tb:
            return (
                f"KV block sizes differ ({sizes}): a block of KV region {i} holds, per "
                f"KV head, token groups of {_sizes_text(ta)} B per token on the "
                f"prefill, {_sizes_text(tb)} B on the decode{fix}"
            )
    return ""


# Descriptors one side prepares for units when block sizes differ (each is 24 B in the
# list handed to NIXL, more inside it, per peer): past this the conversion is refused.
MAX_UNIT_DESCRIPTORS = 1 << 23


def unit_descriptor_count(lay: Layout, unit: int) -> int:
    """How many unit pieces ``lay`` lists for ``unit``-token units: per region, its blocks
    times units per block times token groups (an upper bound for a rank's head slab)."""
    k = blocksize.per_block(lay, unit)
    return sum(r.num_blocks * k * max(r.tok_groups, 1) for r in lay.regions)


def _token_sizes(r: Region, lay: Layout) -> list[int]:
    """Bytes per token of each token group of one KV head's slab of a block of ``r`` (the
    whole block when the layout is not head-major)."""
    sizes = [g // lay.block_size for g in blocksize.group_lens(r)]
    return sizes[: len(sizes) // lay.kv_heads] if lay.kv_heads else sizes


def _sizes_text(sizes: list[int]) -> str:
    runs: list[list[int]] = []
    for x in sizes:
        if runs and runs[-1][1] == x:
            runs[-1][0] += 1
        else:
            runs.append([1, x])
    return " + ".join(f"{n} x {x}" if n > 1 else str(x) for n, x in runs)


def layout_problem(p: Layout, d: Layout) -> str:
    """Why prefill rank layout ``p`` and decode rank layout ``d`` cannot exchange KV ("" if
    they can): the named facts (``differences``), then the tensor-parallel mapping, then
    the hashes and region counts (a difference no fact names)."""
    diff = differences(p.facts, d.facts)
    if diff:
        return describe(p.facts, d.facts)
    why = block_size_problem(p, d) or tp_problem(p, d)
    if why:
        return why
    if p.compat != d.compat or len(p.regions) != len(d.regions):
        return describe(p.facts, d.facts)
    if blocksize.converts(p, d):
        return ""
    if (
        p.tp_size == d.tp_size
        and not p.replicated
        and any(a.block_len != b.block_len for a, b in zip(p.regions, d.regions, strict=True))
    ):
        return (
            f"KV block sizes differ ({p.regions[0].block_len} B per block on the "
            f"prefill, {d.regions[0].block_len} B on the decode): run both with the "
            "same --block-size"
        )
    return ""


def mapping(p: Layout, d: Layout) -> str:
    """The tensor-parallel mapping of two compatible layouts, for the log."""
    return tpmap.mapping_text(p.tp_size, d.tp_size, max(p.total_kv_heads, 1), p.replicated)
