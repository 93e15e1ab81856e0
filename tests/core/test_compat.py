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

FACTS = {"model": "llama-3-8b", "revision": "main", "dtype": "torch.bfloat16",
         "block_size": "16", "tp_size": "1", "kvpush": "0.1.0", "protocol": "2"}


def with_facts(info: m.PeerInfo, **changes: str) -> m.PeerInfo:
    layout = msgspec.structs.replace(LAYOUT, facts={**FACTS, **changes})
    return msgspec.structs.replace(info, layout=layout)


def sender_with_facts() -> Sender:
    import random

    return Sender(with_facts(P), SS, random.Random(0))


def test_differences_name_both_values_and_skip_what_one_side_does_not_name() -> None:
    mine = {**FACTS}
    theirs = {**FACTS, "dtype": "torch.float16", "block_size": "32"}
    theirs.pop("revision")
    assert compat.differences(mine, theirs) == [
        "dtype: 'torch.bfloat16' here, 'torch.float16' on the peer",
        "block_size: '16' here, '32' on the peer"]
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
    out = s.on_message(register(sender_info=with_facts(D, kvpush="0.2.0")), 0.0,
                       origin=D.control)
    assert of(out, PostWrite)


def test_a_long_list_of_differences_still_fits_a_message() -> None:
    s = sender_with_facts()
    s.blocks_ready("t", [1, 2, 3], 0.0)
    other = with_facts(D, model="x" * 200, revision="y" * 200, dtype="z" * 200,
                       block_size="w" * 200, tp_size="v" * 200)
    (failed,) = msgs(s.on_message(register(sender_info=other), 0.0, origin=D.control),
                     m.Failed)
    assert len(failed.detail) <= m.MAX_TEXT_LEN
    m.decode_control(m.encode(failed))  # the receiver's bounds accept it


def test_the_refused_transfer_frees_its_blocks_at_once_not_after_the_send_lease() -> None:
    from kvpush_prod.core.actions import ReleaseSend

    s = sender_with_facts()
    s.blocks_ready("t", [1, 2, 3], 0.0, owner=D.control)
    out = s.on_message(register(sender_info=with_facts(D, block_size="32")), 0.0,
                       origin=D.control)
    assert msgs(out, m.Failed)
    assert of(s.hold("t"), ReleaseSend)  # freed as soon as vLLM hands the blocks over


def test_an_incompatible_engine_cannot_end_a_transfer_it_does_not_own() -> None:
    """Found by the hostile e2e test: an authenticated engine with a foreign layout that
    registers a transfer whose owner is not known yet must not end it."""
    s = sender_with_facts()
    s.blocks_ready("t", [1, 2, 3], 0.0)  # no decode named by the router
    intruder = msgspec.structs.replace(with_facts(D, block_size="32"), control="tcp://x:1")
    s.on_message(register(sender_info=intruder), 0.0, origin="key-of-intruder")
    assert of(s.on_message(register(sender_info=with_facts(D)), 0.1, origin=D.control),
              PostWrite)
