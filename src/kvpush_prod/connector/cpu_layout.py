"""The order in which vLLM's CPU attention kernel stores one head's tokens inside a block,
probed at start-up by writing one token at a time into a scratch block.

The CPU backend's tensor shape does not tell it (its "vec" kernel stores K transposed,
element after element, and V token after token); the probe reads what the kernel does.
"""

from __future__ import annotations

import logging
from typing import Any

from kvpush_prod.transport.layout import Pattern, token_pattern_of

logger = logging.getLogger(__name__)


def cpu_token_pattern(vllm_config: Any, block_size: int, head_size: int) -> Pattern:
    """One head's block as (groups, elements per token) runs, as this engine's CPU kernel
    writes it (``transport.layout.token_pattern_of``); () when it cannot be told (another
    platform, a quantized KV cache, a kernel that refuses the probe, an order of no token
    groups): then blocks of another size are refused, equal sizes work as ever."""
    try:
        import torch
        from vllm import _custom_ops as ops
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except Exception:  # noqa: BLE001 - not the CPU backend (or another vLLM): unknown
        return ()
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
    if not current_platform.is_cpu() or cache_dtype != "auto" or block_size < 1 or head_size < 1:
        return ()
    dtype = vllm_config.model_config.dtype
    try:
        isa = _get_attn_isa(dtype, block_size, head_size)
        scratch = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
        k_cache, v_cache = scratch.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
        owner = torch.full((scratch.numel(),), -1, dtype=torch.int64)
        one = torch.ones(1, 1, head_size, dtype=dtype)
        zero = torch.zeros(1, 1, head_size, dtype=dtype)
        for tok in range(block_size):
            slot = torch.tensor([tok], dtype=torch.int64)
            for key, value in ((one, zero), (zero, one)):
                scratch.zero_()
                ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slot, isa)
                written = scratch.reshape(-1) != 0
                if bool((owner[written] != -1).any()):
                    return ()  # two tokens in one place: not a layout of token groups
                owner[written] = tok
    except Exception:  # noqa: BLE001 - a kernel that refuses the probe: unknown
        logger.debug("kvpush: probing the CPU KV order failed", exc_info=True)
        return ()
    if bool((owner == -1).any()):
        return ()
    pattern = token_pattern_of(owner.tolist(), block_size)
    logger.info(
        "kvpush: CPU attention kernel %s stores a head's block of %d tokens as %s "
        "(token groups, elements per token)",
        isa,
        block_size,
        pattern or "unknown",
    )
    return pattern
