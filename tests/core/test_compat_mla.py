"""MLA in the compatibility check: an engine storing latents and one storing per-head K and V
are refused at the first handshake, naming both values and the fix; latent dims compared."""

from __future__ import annotations

from kvpush_prod.core import compat
from kvpush_prod.core import messages as m
from kvpush_prod.core.actions import PostWrite

from .test_compat import FACTS
from .test_push_engines import D, msgs, of, register

MLA = {
    **FACTS,
    "use_mla": "True",
    "kv_lora_rank": "512",
    "qk_rope_head_dim": "64",
    "num_kv_heads": "1",
    "head_size": "576",
}


def test_an_mla_engine_and_a_per_head_engine_differ_by_name_with_the_fix() -> None:
    plain = {**FACTS, "use_mla": "False", "num_kv_heads": "4", "head_size": "192"}
    diff = compat.differences(MLA, plain)
    (mla_line,) = [d for d in diff if d.startswith("use_mla:")]
    assert "'True' here, 'False' on the peer" in mla_line
    assert "VLLM_MLA_DISABLE" in mla_line
    assert any(d.startswith("head_size:") for d in diff)


def test_latent_dimensions_must_match() -> None:
    assert compat.differences(MLA, {**MLA, "kv_lora_rank": "256"}) == [
        "kv_lora_rank: '512' here, '256' on the peer"
    ]
    assert compat.differences(MLA, {**MLA, "qk_rope_head_dim": "32"}) == [
        "qk_rope_head_dim: '64' here, '32' on the peer"
    ]


def test_a_peer_that_names_no_attention_facts_is_compared_on_the_rest() -> None:
    older = {k: v for k, v in MLA.items() if k not in compat.ATTENTION_FACTS}
    assert compat.differences(MLA, older) == []


def test_a_per_head_decode_is_refused_by_an_mla_prefill_at_the_handshake() -> None:
    import random

    import msgspec

    from kvpush_prod.core.sender import Sender

    from .test_push_engines import LAYOUT, SS, P

    def info(base: m.PeerInfo, facts: dict[str, str]) -> m.PeerInfo:
        return msgspec.structs.replace(base, layout=msgspec.structs.replace(LAYOUT, facts=facts))

    s = Sender(info(P, MLA), SS, random.Random(0))
    s.blocks_ready("t", [1, 2, 3], 0.0)
    plain = {**FACTS, "use_mla": "False"}
    out = s.on_message(register(sender_info=info(D, plain)), 0.0, origin=D.control)
    assert of(out, PostWrite) == []
    (failed,) = msgs(out, m.Failed)
    assert failed.reason == "incompatible"
    assert "use_mla: 'True' here, 'False' on the peer" in failed.detail
    assert "VLLM_MLA_DISABLE" in failed.detail


def test_two_mla_engines_push() -> None:
    import random

    import msgspec

    from kvpush_prod.core.sender import Sender

    from .test_push_engines import LAYOUT, SS, P

    def info(base: m.PeerInfo) -> m.PeerInfo:
        return msgspec.structs.replace(base, layout=msgspec.structs.replace(LAYOUT, facts=MLA))

    s = Sender(info(P), SS, random.Random(0))
    s.blocks_ready("t", [1, 2, 3], 0.0)
    assert of(s.on_message(register(sender_info=info(D)), 0.0, origin=D.control), PostWrite)
