"""Whether two engines may exchange KV: their layouts' named facts, compared one by one.

Each engine describes its KV cache with facts (``Layout.facts``): the model and its
revision, dtypes, block size, shape, parallelism, layout, and the versions it runs. A
prefill engine refuses a decode rank whose facts differ in any of ``MUST_MATCH`` (a push
into such a cache would be garbage, or worse, plausible tokens of another model), naming
each difference with both values. ``INFORMATIVE`` facts (the kvpush version) may differ
during a rolling upgrade: they are shown, never refused. Protocol versions are refused
earlier, when a message is decoded.
"""

from __future__ import annotations

from collections.abc import Mapping

# What both engines must share for a block's bytes to mean the same thing on both.
MUST_MATCH = ("model", "revision", "model_type", "dtype", "kv_cache_dtype", "block_size",
              "num_layers", "num_kv_heads", "head_size", "tp_size", "kv_cache_layout")
INFORMATIVE = ("kvpush",)


def differences(mine: Mapping[str, str], theirs: Mapping[str, str]) -> list[str]:
    """The MUST_MATCH facts both name with different values, as "name: ours here, theirs
    there" (facts one side does not name are not compared: an older peer names fewer)."""
    return [f"{k}: {mine[k]!r} here, {theirs[k]!r} on the peer{_HINTS.get(k, '')}"
            for k in (*MUST_MATCH, *ATTENTION_FACTS)
            if k in mine and k in theirs and mine[k] != theirs[k]]


# Also compared: the attention kind and an MLA latent's dimensions (a block of latents and
# a block of per-head K and V are not the same bytes, even for the same model).
ATTENTION_FACTS = ("use_mla", "kv_lora_rank", "qk_rope_head_dim")
_HINTS = {"use_mla": " (one engine stores MLA latents, the other per-head K and V: run both "
                     "with MLA, or both with VLLM_MLA_DISABLE=1)"}


def describe(mine: Mapping[str, str], theirs: Mapping[str, str]) -> str:
    """A refusal's detail: every differing fact with both values, then the informative
    ones that differ, then what to change."""
    diff = differences(mine, theirs)
    info = [f"{k}: {mine[k]!r} here, {theirs[k]!r} on the peer" for k in INFORMATIVE
            if k in mine and k in theirs and mine[k] != theirs[k]]
    parts = diff or ["the KV layouts differ (no named fact explains it: region sizes)"]
    return ("; ".join(parts + info) + ". Prefill and decode must serve the same model "
            "(same --served-model-name and --revision), with the same dtype, KV cache dtype, "
            "block size and tensor-parallel size")
