"""The compatibility check at the first handshake: P refuses a decode rank whose layout
facts differ, names every difference with both values, and tells D at once (never a push
into a cache whose bytes mean something else: that would be plausible wrong tokens)."""

from __future__ import annotations

import msgspec

from kvpush_prod.core import compat
from kvpush_prod.core import messages as m
from kvpush_prod.core.actions import ConnectPeer, Note, PostWrite
from kvpush_prod.core.sender import Sender

from .test_push_engines import LAYOUT, SS, D, P, msgs, of, register

FACTS = {
    "model": "llama-3-8b",
    "revision": "main",
    "dtype": "torch.bfloat16",
    "block_size": "16",
    "tp_size": "1",
    "kvpush": "0.1.0",
    "protocol": "2",
}


def with_facts(info: m.PeerInfo, **changes: str) -> m.PeerInfo:
    layout = msgspec.structs.replace(LAYOUT, facts={**FACTS, **changes})
    return msgspec.structs.replace(info, layout=layout)


def sender_with_facts() -> Sender:
    import random

    return Sender(with_facts(P), SS, random.Random(0))


def test_differences_name_both_values_and_skip_what_one_side_does_not_name() -> None:
    mine = {**FACTS}
    theirs = {**FACTS, "dtype": "torch.float16", "kv_cache_dtype": "fp8"}
    mine["kv_cache_dtype"] = "auto"
    theirs.pop("revision")
    assert compat.differences(mine, theirs) == [
        "dtype: 'torch.bfloat16' here, 'torch.float16' on the peer",
        "kv_cache_dtype: 'auto' here, 'fp8' on the peer",
    ]
    assert compat.differences(mine, {}) == []  # an older peer names no facts


def test_another_kvpush_version_is_shown_never_refused() -> None:
    assert compat.differences(FACTS, {**FACTS, "kvpush": "0.2.0"}) == []
    detail = compat.describe(FACTS, {**FACTS, "kvpush": "0.2.0", "dtype": "torch.float16"})
    assert "kvpush: '0.1.0' here, '0.2.0' on the peer" in detail


def test_the_same_shapes_of_another_model_are_refused_at_the_handshake() -> None:
    """Same layout hash (same shapes): only the facts tell the two models apart."""
    s = sender_with_facts()
    s.blocks_ready("t", [1, 2, 3], 0.0)
    other = with_facts(D, model="mistral-7b")
    out = s.on_message(register(sender_info=other), 0.0, origin=D.control)
    assert of(out, ConnectPeer) == [] and of(out, PostWrite) == []
    (failed,) = msgs(out, m.Failed)
    assert failed.reason == "incompatible"
    assert "model: 'llama-3-8b' here, 'mistral-7b' on the peer" in failed.detail
    assert [a.reason for a in out if isinstance(a, Note)] == ["incompatible"]


def test_matching_facts_push_as_before() -> None:
    s = sender_with_facts()
    s.blocks_ready("t", [1, 2, 3], 0.0)
    out = s.on_message(register(sender_info=with_facts(D, kvpush="0.2.0")), 0.0, origin=D.control)
    assert of(out, PostWrite)


def test_a_long_list_of_differences_still_fits_a_message() -> None:
    s = sender_with_facts()
    s.blocks_ready("t", [1, 2, 3], 0.0)
    other = with_facts(
        D,
        model="x" * 200,
        revision="y" * 200,
        dtype="z" * 200,
        block_size="w" * 200,
        tp_size="v" * 200,
    )
    (failed,) = msgs(s.on_message(register(sender_info=other), 0.0, origin=D.control), m.Failed)
    assert len(failed.detail) <= m.MAX_TEXT_LEN
    m.decode_control(m.encode(failed))  # the receiver's bounds accept it


def test_the_refused_transfer_frees_its_blocks_at_once_not_after_the_send_lease() -> None:
    from kvpush_prod.core.actions import ReleaseSend

    s = sender_with_facts()
    s.blocks_ready("t", [1, 2, 3], 0.0, owner=D.control)
    out = s.on_message(
        register(sender_info=with_facts(D, dtype="torch.float16")), 0.0, origin=D.control
    )
    assert msgs(out, m.Failed)
    assert of(s.hold("t"), ReleaseSend)  # freed as soon as vLLM hands the blocks over


def test_a_refusal_before_p_knows_the_transfer_frees_it_once_the_router_names_that_d() -> None:
    """Seen on real engines (block sizes 32 and 64): D's REGISTER reached P before P's
    scheduler had the request; the refused D never registers again, so P held the prompt's
    blocks for its whole send lease."""
    from kvpush_prod.core.actions import ReleaseSend

    s = sender_with_facts()
    out = s.on_message(
        register(sender_info=with_facts(D, dtype="torch.float16")), 0.0, origin=D.control
    )
    assert msgs(out, m.Failed)
    s.expect_blocks("t", 0.1, owner=D.control)
    s.blocks_ready("t", [1, 2, 3], 0.2, owner=D.control)
    assert of(s.hold("t"), ReleaseSend)  # freed as soon as vLLM hands the blocks over
    assert s.held_blocks() == 0


def test_a_refusal_before_p_knows_the_transfer_never_ends_another_ds_transfer() -> None:
    from kvpush_prod.core.actions import ReleaseSend

    s = sender_with_facts()
    intruder = msgspec.structs.replace(with_facts(D, dtype="torch.float16"), control="tcp://x:1")
    s.on_message(register(sender_info=intruder), 0.0, origin="key-of-intruder")
    s.blocks_ready("t", [1, 2, 3], 0.1, owner=D.control)  # the router named another D
    assert of(s.hold("t"), ReleaseSend) == []
    assert of(s.on_message(register(sender_info=with_facts(D)), 0.2, origin=D.control), PostWrite)
    s2 = sender_with_facts()  # and no decode named (sequential flow): held, never ended
    s2.on_message(register(sender_info=intruder), 0.0, origin="key-of-intruder")
    s2.blocks_ready("t", [1, 2, 3], 0.1)
    assert of(s2.on_message(register(sender_info=with_facts(D)), 0.2, origin=D.control), PostWrite)


def test_a_second_refused_engine_does_not_hide_the_first() -> None:
    """Two engines' REGISTERs refused before P knew the transfer: each is remembered, so
    when the router names the first its decode, P still frees the blocks at once."""
    from kvpush_prod.core.actions import ReleaseSend

    s = sender_with_facts()
    other = msgspec.structs.replace(with_facts(D, dtype="torch.float16"), control="tcp://x:1")
    s.on_message(register(sender_info=with_facts(D, dtype="torch.float16")), 0.0, origin=D.control)
    s.on_message(register(sender_info=other), 0.05, origin="key-of-other")
    s.expect_blocks("t", 0.1, owner=D.control)
    s.blocks_ready("t", [1, 2, 3], 0.2, owner=D.control)
    assert of(s.hold("t"), ReleaseSend)
    assert s.held_blocks() == 0


def test_an_incompatible_engine_cannot_end_a_transfer_it_does_not_own() -> None:
    """Found by the hostile e2e test: an authenticated engine with a foreign layout that
    registers a transfer whose owner is not known yet must not end it."""
    s = sender_with_facts()
    s.blocks_ready("t", [1, 2, 3], 0.0)  # no decode named by the router
    intruder = msgspec.structs.replace(with_facts(D, dtype="torch.float16"), control="tcp://x:1")
    s.on_message(register(sender_info=intruder), 0.0, origin="key-of-intruder")
    assert of(s.on_message(register(sender_info=with_facts(D)), 0.1, origin=D.control), PostWrite)


def tp_info(
    info: m.PeerInfo, tp_size: int, rank: int, total: int = 2, kv_heads: int | None = None
) -> m.PeerInfo:
    """``info`` as rank ``rank`` of ``tp_size`` over ``total`` KV heads (head-major blocks
    of 50 B per head, as the layout would derive them)."""
    local = total // tp_size
    layout = msgspec.structs.replace(
        LAYOUT,
        facts={**FACTS, "tp_size": str(tp_size)},
        tp_size=tp_size,
        tp_rank=rank,
        kv_heads=local if kv_heads is None else kv_heads,
        total_kv_heads=total,
        regions=[m.Region(0, 50 * local, 50 * local, 64)],
    )
    return msgspec.structs.replace(info, rank=rank, layout=layout)


def test_a_decode_engine_of_another_tp_size_is_met_and_pushed_to() -> None:
    import random

    s = Sender(tp_info(P, 2, 1), SS, random.Random(0))
    s.blocks_ready("t", [1, 2, 3], 0.0)
    out = s.on_message(register(sender_info=tp_info(D, 1, 0)), 0.0, origin=D.control)
    assert of(out, ConnectPeer) and of(out, PostWrite)
    assert not msgs(out, m.Failed)


def test_tp_sizes_that_cannot_map_are_refused_at_the_first_handshake_naming_both() -> None:
    import random

    s = Sender(tp_info(P, 3, 0, total=6), SS, random.Random(0))
    s.blocks_ready("t", [1, 2, 3], 0.0)
    out = s.on_message(register(sender_info=tp_info(D, 2, 0, total=6)), 0.0, origin=D.control)
    assert of(out, PostWrite) == []
    (failed,) = msgs(out, m.Failed)
    assert failed.reason == "incompatible"
    assert "prefill --tensor-parallel-size 3" in failed.detail
    assert "decode --tensor-parallel-size 2" in failed.detail
    assert "one must divide the other" in failed.detail


def test_a_decode_rank_whose_blocks_cannot_be_sliced_by_head_is_refused() -> None:
    import random

    s = Sender(tp_info(P, 1, 0), SS, random.Random(0))
    s.blocks_ready("t", [1, 2, 3], 0.0)
    # P (TP 1) would send half of each block to this D rank: P's blocks must be head-major.
    p_flat = Sender(
        msgspec.structs.replace(
            tp_info(P, 1, 0), layout=msgspec.structs.replace(tp_info(P, 1, 0).layout, kv_heads=0)
        ),
        SS,
        random.Random(0),
    )
    p_flat.blocks_ready("t", [1, 2, 3], 0.0)
    out = p_flat.on_message(register(sender_info=tp_info(D, 2, 1)), 0.0, origin=D.control)
    (failed,) = msgs(out, m.Failed)
    assert "not stored head after head" in failed.detail
    ok = s.on_message(register(sender_info=tp_info(D, 2, 1)), 0.0, origin=D.control)
    assert of(ok, PostWrite)


def test_the_layout_hash_is_made_of_the_facts_that_must_match_and_nothing_else() -> None:
    from kvpush_prod.core.compat import MUST_MATCH, signature_of

    facts = {k: f"v-{k}" for k in MUST_MATCH} | {
        "use_mla": "False",
        "tp_size": "1",
        "kvpush": "0.1.0",
    }
    base = signature_of(facts)
    assert signature_of(facts | {"tp_size": "2", "kvpush": "0.2.0"}) == base
    for k in (*MUST_MATCH, "use_mla"):
        assert signature_of(facts | {k: "other"}) != base, k
