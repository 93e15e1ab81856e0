"""Generate a tiny DeepSeek-V2-style model with multi-head latent attention (MLA) for the lab.

One latent per token and layer (``kv_lora_rank + qk_rope_head_dim`` values) is all its KV
cache holds; seeded weights, the lab's local tokenizer, nothing downloaded.

vLLM 0.32's CPU MLA backend computes a token's attention one way in a prefill (SDPA over
up-projected keys) and another in a decode step (``mla_decode_kvcache_cpu`` over the
latents), and the two disagree in the rotary part: with random rotary weights the same
position gives other logits (measured: logprobs off by 0.1-0.5, other greedy tokens) on a
single engine. A disaggregated decode engine computes the last prompt token in a decode
step where a single engine prefills it, so the lab's model zeroes the rotary weights
(``rope_weights=False``): both paths then agree to 1e-5 and a P/D answer can be compared
token for token with a single engine's. Attention stays sharp and content-dependent.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvpush_prod.lab.tinymodel import (
    add_mlp,
    save_weights,
    seeded_weights,
    shared_config,
    write_config_and_tokenizer,
)


@dataclass(frozen=True)
class TinyMlaSpec:
    """Shape of the generated MLA model.

    vLLM's CPU MLA decode kernel (``mla_decode_kvcache_cpu``) is compiled for one latent
    size only: ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 (576 values), so those two
    keep DeepSeek's values; everything else is small. The engines run vLLM's reference CPU
    MLA backend (``engine_args``), for which the platform forces block size 16, whatever
    ``--block-size`` says.
    """

    num_layers: int = 2
    hidden_size: int = 128
    intermediate_size: int = 256
    num_heads: int = 4
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    vocab_size: int = 1024
    max_positions: int = 2048
    dtype: str = "float32"
    seed: int = 0
    weight_std: float = 0.5  # sharp attention, as the tiny Llama's (see TinyModelSpec)
    # Zero the rotary (position) part of queries and keys: attention then depends on the
    # tokens' content only. See the module notes on vLLM's CPU MLA paths.
    rope_weights: bool = False

    def engine_args(self) -> list[str]:
        """vLLM flags every engine serving this model needs. On a CPU with AMX tiles vLLM
        picks its AMX MLA backend, which takes bfloat16 weights only (a float32 engine dies
        at start-up: "expect weight to be bfloat16, ..."); the reference CPU MLA backend
        takes any dtype, so it is named unless the model is bfloat16."""
        return [] if self.dtype == "bfloat16" else ["--attention-backend", "CPU_MLA"]

    @property
    def latent_size(self) -> int:
        """Values per token and layer in the KV cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def write_tiny_mla_model(path: str | Path, spec: TinyMlaSpec | None = None) -> Path:
    """Write config.json, tokenizer and weights into ``path`` (idempotent) and return it."""
    spec = spec or TinyMlaSpec()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "moe_intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_heads,
        "kv_lora_rank": spec.kv_lora_rank,
        "q_lora_rank": None,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "v_head_dim": spec.v_head_dim,
        # Declared experts but every layer dense (first_k_dense_replace = all layers): vLLM's
        # weight loader needs an expert count, the lab needs no MoE.
        "n_routed_experts": 2,
        "n_shared_experts": 1,
        "num_experts_per_tok": 1,
        "first_k_dense_replace": spec.num_layers,
        "moe_layer_freq": 1,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
        "routed_scaling_factor": 1.0,
        "rope_scaling": None,
        "attention_bias": False,
        **shared_config(spec.vocab_size, spec.max_positions, spec.dtype),
    }
    write_config_and_tokenizer(out, config, spec.vocab_size, spec.max_positions)
    _write_weights(out / "model.safetensors", spec)
    return out


def _write_weights(path: Path, spec: TinyMlaSpec) -> None:
    """Seeded random weights, regenerated only when missing."""
    if path.exists():
        return
    import torch

    h, inter, heads = spec.hidden_size, spec.intermediate_size, spec.num_heads
    qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    rnd, tensors = seeded_weights(spec.seed, h, spec.vocab_size, spec.weight_std)
    for i in range(spec.num_layers):
        pre = f"model.layers.{i}."
        attn = pre + "self_attn."
        tensors[pre + "input_layernorm.weight"] = torch.ones(h)
        tensors[pre + "post_attention_layernorm.weight"] = torch.ones(h)
        q = rnd(heads, qk, h, fan_in=h)
        kv_a = rnd(spec.latent_size, h, fan_in=h)
        if not spec.rope_weights:
            q[:, spec.qk_nope_head_dim :] = 0
            kv_a[spec.kv_lora_rank :] = 0
        tensors[attn + "q_proj.weight"] = q.reshape(heads * qk, h)
        tensors[attn + "kv_a_proj_with_mqa.weight"] = kv_a
        tensors[attn + "kv_a_layernorm.weight"] = torch.ones(spec.kv_lora_rank)
        tensors[attn + "kv_b_proj.weight"] = rnd(
            heads * (spec.qk_nope_head_dim + spec.v_head_dim),
            spec.kv_lora_rank,
            fan_in=spec.kv_lora_rank,
        )
        tensors[attn + "o_proj.weight"] = rnd(
            h, heads * spec.v_head_dim, fan_in=heads * spec.v_head_dim
        )
        add_mlp(tensors, pre, rnd, h, inter)
    save_weights(path, tensors, spec.dtype)
