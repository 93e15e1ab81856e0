"""Generate the tiny Llama model used by tests, demo and benchmarks.

Nothing is downloaded: a config.json with ``load_format: dummy`` weights and a local
WordLevel tokenizer (tokens ``w0``..``w{vocab-1}``, whitespace split) are written to a folder.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} {{ message['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the generated model; the defaults are the lab's proven tiny Llama."""

    num_layers: int = 2
    hidden_size: int = 128
    intermediate_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 1024
    max_positions: int = 2048
    dtype: str = "bfloat16"
    seed: int = 0
    # Weight scale: large enough that attention is sharp, so every prompt token (and so
    # every transferred KV block) changes the greedy output. vLLM's dummy loader draws
    # weights in +-1e-3, which makes attention uniform and hides corrupted KV.
    weight_std: float = 0.5


def _special_tokens() -> list[str]:
    return ["<unk>", "<s>", "</s>", "<pad>", "user", "assistant", "system"]


def write_tiny_model(path: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write config.json + tokenizer files into ``path`` (idempotent) and return it."""
    spec = spec or TinyModelSpec()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        **shared_config(spec.vocab_size, spec.max_positions, spec.dtype),
    }
    write_config_and_tokenizer(out, config, spec.vocab_size, spec.max_positions)
    _write_weights(out / "model.safetensors", spec)
    return out


def shared_config(vocab_size: int, max_positions: int, dtype: str) -> dict[str, object]:
    """The config.json entries the lab's tiny models share (vocabulary, positions, norms,
    activation, dtype and the special token ids of the lab tokenizer)."""
    return {
        "vocab_size": vocab_size,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
    }


def write_config_and_tokenizer(
    out: Path, config: dict[str, object], vocab_size: int, max_positions: int
) -> None:
    """config.json, generation_config.json and the lab tokenizer of a tiny model in ``out``."""
    _write_if_changed(out / "config.json", json.dumps(config, indent=2))
    _write_if_changed(
        out / "generation_config.json",
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}),
    )
    write_tokenizer(out, vocab_size, max_positions)


def write_tokenizer(out: Path, vocab_size: int, max_positions: int) -> None:
    """The lab's WordLevel tokenizer (``w<id>`` words, whitespace split) and chat template."""
    specials = _special_tokens()
    vocab = {tok: i for i, tok in enumerate(specials)}
    for i in range(len(specials), vocab_size):
        vocab[f"w{i}"] = i
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": tok,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": tok.startswith("<"),
            }
            for i, tok in enumerate(specials)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    _write_if_changed(out / "tokenizer.json", json.dumps(tokenizer))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "model_max_length": max_positions,
        "chat_template": CHAT_TEMPLATE,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    _write_if_changed(out / "tokenizer_config.json", json.dumps(tok_config, indent=2))
    _write_if_changed(
        out / "special_tokens_map.json",
        json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
        ),
    )


def seeded_weights(
    seed: int, h: int, vocab: int, weight_std: float
) -> tuple[Callable[..., torch.Tensor], dict[str, torch.Tensor]]:
    """A tiny model's weight maker and its first tensors (embeddings, final norm, LM head),
    drawn from one generator seeded with ``seed``: ``rnd(*shape, fan_in=n)`` draws the next
    tensor with std ``weight_std * sqrt(h / n)``."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, fan_in: int) -> torch.Tensor:
        std: float = weight_std * (h / fan_in) ** 0.5  # float ** float is Any to mypy
        return torch.randn(*shape, generator=gen) * std

    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(vocab, h, generator=gen),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": rnd(vocab, h, fan_in=h),
    }
    return rnd, tensors


def _write_weights(path: Path, spec: TinyModelSpec) -> None:
    """Seeded random weights (a few MB), regenerated only when missing."""
    if path.exists():
        return
    import torch

    h, inter = spec.hidden_size, spec.intermediate_size
    q_out = spec.num_heads * spec.head_dim
    kv_out = spec.num_kv_heads * spec.head_dim
    rnd, tensors = seeded_weights(spec.seed, h, spec.vocab_size, spec.weight_std)
    for i in range(spec.num_layers):
        pre = f"model.layers.{i}."
        tensors[pre + "input_layernorm.weight"] = torch.ones(h)
        tensors[pre + "post_attention_layernorm.weight"] = torch.ones(h)
        tensors[pre + "self_attn.q_proj.weight"] = rnd(q_out, h, fan_in=h)
        tensors[pre + "self_attn.k_proj.weight"] = rnd(kv_out, h, fan_in=h)
        tensors[pre + "self_attn.v_proj.weight"] = rnd(kv_out, h, fan_in=h)
        tensors[pre + "self_attn.o_proj.weight"] = rnd(h, q_out, fan_in=q_out)
        add_mlp(tensors, pre, rnd, h, inter)
    save_weights(path, tensors, spec.dtype)


def add_mlp(
    tensors: dict[str, torch.Tensor],
    pre: str,
    rnd: Callable[..., torch.Tensor],
    h: int,
    inter: int,
) -> None:
    """Layer ``pre``'s dense MLP (gate, up, down), drawn next from ``rnd``."""
    tensors[pre + "mlp.gate_proj.weight"] = rnd(inter, h, fan_in=h)
    tensors[pre + "mlp.up_proj.weight"] = rnd(inter, h, fan_in=h)
    tensors[pre + "mlp.down_proj.weight"] = rnd(h, inter, fan_in=inter)


def save_weights(path: Path, tensors: dict[str, torch.Tensor], dtype_name: str) -> None:
    """``tensors`` in ``dtype_name`` (float32 unless bfloat16 or float16) as a safetensors
    file at ``path``, written whole or not at all."""
    import torch
    from safetensors.torch import save_file

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype_name, torch.float32)
    tmp = path.with_suffix(".tmp")
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(tmp))
    tmp.replace(path)


def prompt_of_length(num_tokens: int, seed: int = 0, vocab_size: int = 1024) -> str:
    """A deterministic prompt of exactly ``num_tokens`` tokens for the tiny tokenizer."""
    first = len(_special_tokens())
    span = vocab_size - first
    words = [f"w{first + (seed * 7919 + i * 104729) % span}" for i in range(num_tokens)]
    return " ".join(words)


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
