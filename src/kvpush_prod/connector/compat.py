"""The facts an engine's KV layout carries to its peers (see ``core.compat``)."""

from __future__ import annotations

from typing import Any

from kvpush_prod.core import protocol
from kvpush_prod.core.messages import PROTOCOL_VERSION


def kvpush_version() -> str:
    """The installed kvpush-prod's version ("unknown" from a bare source tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvpush-prod")
    except PackageNotFoundError:
        return "unknown"


def total_kv_heads(vllm_config: Any) -> int:
    """The model's KV heads over all ranks (a rank's own count differs with the TP size;
    1 for MLA's latent; 0 when the model config cannot tell)."""
    model = vllm_config.model_config
    if getattr(model, "use_mla", False):
        return 1
    get = getattr(model, "get_total_num_kv_heads", None)
    return int(get()) if callable(get) else 0


def layout_facts(vllm_config: Any, kv_cache_config: Any) -> dict[str, str]:
    """Model, revision, dtypes, block size, shape, attention kind (MLA or not),
    parallelism, layout and versions."""
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    model = vllm_config.model_config
    served = getattr(model, "served_model_name", None) or model.model
    if isinstance(served, list | tuple):
        served = served[0] if served else model.model
    facts = {
        "model": served,
        "revision": model.revision or "",
        "model_type": getattr(model.hf_config, "model_type", ""),
        "dtype": model.dtype,
        "kv_cache_dtype": getattr(vllm_config.cache_config, "cache_dtype", ""),
        "block_size": spec.block_size,
        "num_layers": getattr(model.hf_config, "num_hidden_layers", ""),
        "num_kv_heads": total_kv_heads(vllm_config),
        "head_size": getattr(spec, "head_size", ""),
        "tp_size": vllm_config.parallel_config.tensor_parallel_size,
        "kv_cache_layout": getattr(kv_cache_config, "kv_cache_layout", ""),
        "kvpush": kvpush_version(),
        "protocol": PROTOCOL_VERSION,
        protocol.FACT: protocol.spoken(),  # the versions this build speaks (negotiation)
    }
    facts.update(attention_facts(model))
    return {k: str(v)[:200] for k, v in facts.items()}


def attention_facts(model: Any) -> dict[str, Any]:
    """Whether the KV cache holds MLA latents (DeepSeek-style multi-head latent attention:
    one ``kv_lora_rank + qk_rope_head_dim`` vector per token and layer, the same on every
    tensor-parallel rank) or per-head K and V, and the latent's dimensions when it does.
    For MLA, vLLM's spec names one KV head of the latent's size (``num_kv_heads`` 1,
    ``head_size`` the latent size), which is right for the bytes but says nothing of MLA:
    the named facts make a refusal say why (an engine with ``VLLM_MLA_DISABLE=1`` beside
    one without, serving the same model)."""
    if not getattr(model, "use_mla", False):
        return {"use_mla": False}
    hf = getattr(model, "hf_text_config", None) or model.hf_config
    return {
        "use_mla": True,
        "kv_lora_rank": getattr(hf, "kv_lora_rank", ""),
        "qk_rope_head_dim": getattr(hf, "qk_rope_head_dim", ""),
    }
