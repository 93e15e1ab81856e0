"""The facts an MLA engine names about its KV cache (latents, not heads)."""

from __future__ import annotations

from types import SimpleNamespace

from kvpush_prod.connector.compat import attention_facts, layout_facts


def _configs(use_mla: bool) -> tuple[SimpleNamespace, SimpleNamespace]:
    hf = SimpleNamespace(
        model_type="deepseek_v2", num_hidden_layers=2, kv_lora_rank=512, qk_rope_head_dim=64
    )
    model = SimpleNamespace(
        model="m",
        served_model_name="tiny",
        revision=None,
        dtype="float32",
        hf_config=hf,
        hf_text_config=hf,
        use_mla=use_mla,
    )
    vllm_config = SimpleNamespace(
        model_config=model,
        cache_config=SimpleNamespace(cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    spec = SimpleNamespace(block_size=16, num_kv_heads=1, head_size=576 if use_mla else 192)
    kv = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)], kv_cache_layout="NHD"
    )
    return vllm_config, kv


def test_an_mla_engine_names_its_latent_dimensions() -> None:
    facts = layout_facts(*_configs(use_mla=True))
    assert facts["use_mla"] == "True"
    assert (facts["kv_lora_rank"], facts["qk_rope_head_dim"]) == ("512", "64")
    assert (facts["num_kv_heads"], facts["head_size"]) == ("1", "576")  # one latent "head"


def test_an_engine_without_mla_says_so_and_names_no_latent() -> None:
    facts = layout_facts(*_configs(use_mla=False))
    assert facts["use_mla"] == "False"
    assert "kv_lora_rank" not in facts


def test_a_config_without_use_mla_is_not_mla() -> None:
    assert attention_facts(SimpleNamespace(hf_config=None)) == {"use_mla": False}
