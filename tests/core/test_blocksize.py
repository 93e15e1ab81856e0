"""Prefill and decode of different KV block sizes: P converts D's REGISTER (and its own
blocks) into units of the smaller block size, D converts its blocks for a pull; sizes
that do not divide, or a layout whose token geometry is unknown, are refused at the first
handshake naming both sizes."""

from __future__ import annotations

import random

import msgspec
import pytest

from kvpush_prod.core import blocksize, compat
from kvpush_prod.core import messages as m
from kvpush_prod.core.actions import Note, PostRead, PostWrite
from kvpush_prod.core.receiver import Receiver, ReceiverSettings
from kvpush_prod.core.scheduler import SchedulerSettings
from kvpush_prod.core.sender import Sender, SenderSettings

from .test_push_engines import D, P, msgs, of

GROUPS, TOKEN_BYTES = 4, 16  # 2 KV heads, K and V each: vLLM's CPU layout
SCHED = SchedulerSettings(chunk_bytes=1 << 20, stop_margin_s=1.0)


def layout(block: int, num_blocks: int = 64, groups: int = GROUPS) -> m.Layout:
    size = GROUPS * block * TOKEN_BYTES
    return m.Layout(
        "c",
        "DRAM",
        [m.Region(0, size, size, num_blocks, tok_groups=groups)] * 2,
        kv_heads=2,
        block_size=block,
    )


def info(base: m.PeerInfo, lay: m.Layout) -> m.PeerInfo:
    return msgspec.structs.replace(base, layout=lay)


def sender(block: int) -> Sender:
    lay = layout(block)
    settings = SenderSettings(block_bytes=sum(r.block_len for r in lay.regions), scheduler=SCHED)
    return Sender(info(P, lay), settings, random.Random(0))


def register(
    d: m.PeerInfo, blocks: list[int], first: int = 0, tokens: int = 150, gen: int = 1
) -> m.Register:
    return m.Register(m.PROTOCOL_VERSION, "t", d, blocks, first, tokens, gen, 5000)


def writes(out: list) -> tuple[list[int], list[int], list[PostWrite]]:
    posted = of(out, PostWrite)
    return (
        [b for w in posted for b in w.src_blocks],
        [b for w in posted for b in w.dst_blocks],
        posted,
    )


def test_units_expand_block_ids_in_order() -> None:
    assert blocksize.expand([3, 7], 2) == [6, 7, 14, 15]
    assert blocksize.expand([3, 7], 1) == [3, 7]
    assert blocksize.unit_tokens(32, 64) == blocksize.unit_tokens(64, 32) == 32
    assert blocksize.per_block(layout(64), 32) == 2


@pytest.mark.parametrize("blocks_first", [True, False])
def test_p_32_pushes_into_d_64_in_units_whichever_comes_first(blocks_first: bool) -> None:
    s = sender(32)
    d = info(D, layout(64))
    # 150 tokens: 5 P blocks of 32, 3 D blocks of 64 (units 20..25; the 6th is past the prompt)
    if blocks_first:
        s.blocks_ready("t", [1, 2, 3, 4, 5], 0.0)
        out = s.on_message(register(d, [10, 11, 12]), 0.0)
    else:
        assert of(s.on_message(register(d, [10, 11, 12]), 0.0), PostWrite) == []
        out = s.blocks_ready("t", [1, 2, 3, 4, 5], 0.0)
    src, dst, posted = writes(out)
    assert (src, dst) == ([1, 2, 3, 4, 5], [20, 21, 22, 23, 24])
    last = posted[-1]
    assert last.done is not None and last.done.num_blocks == 5 and last.done.unit_tokens == 32
    assert last.all_src == (1, 2, 3, 4, 5)
    assert sum(w.nbytes for w in posted) == 5 * 2 * GROUPS * 32 * TOKEN_BYTES
    assert s.held_blocks() == 0  # nothing handed over yet; P's blocks stay P's blocks


def test_p_64_pushes_into_d_32_taking_each_block_in_halves() -> None:
    s = sender(64)
    s.blocks_ready("t", [1, 2, 3], 0.0)
    src, dst, posted = writes(
        s.on_message(register(info(D, layout(32)), [10, 11, 12, 13, 14]), 0.0)
    )
    assert (src, dst) == ([2, 3, 4, 5, 6], [10, 11, 12, 13, 14])
    assert posted[-1].done is not None and posted[-1].done.unit_tokens == 32
    # a unit is half of one of P's blocks
    assert sum(w.nbytes for w in posted) == 5 * 2 * GROUPS * 32 * TOKEN_BYTES


def test_a_decode_prefix_hit_of_one_d_block_skips_its_units_on_both_sides() -> None:
    s = sender(32)
    s.blocks_ready("t", [1, 2, 3, 4, 5], 0.0)
    src, dst, _ = writes(s.on_message(register(info(D, layout(64)), [11, 12], first=1), 0.0))
    assert (src, dst) == ([3, 4, 5], [22, 23, 24])
    s = sender(64)
    s.blocks_ready("t", [1, 2, 3], 0.0)
    src, dst, _ = writes(
        s.on_message(register(info(D, layout(32)), [11, 12, 13, 14], first=1), 0.0)
    )
    assert (src, dst) == ([3, 4, 5, 6], [11, 12, 13, 14])


def test_a_register_sent_again_is_converted_from_itself_never_twice() -> None:
    s = sender(32)
    d = info(D, layout(64))
    s.on_message(register(d, [10, 11, 12]), 0.0)
    assert s.on_message(register(d, [10, 11, 12]), 0.1) == []  # a duplicate: nothing
    s.on_message(register(d, [30, 31, 32], gen=2), 0.2)  # re-sent before the blocks came
    src, dst, _ = writes(s.blocks_ready("t", [1, 2, 3, 4, 5], 0.3))
    assert (src, dst) == ([1, 2, 3, 4, 5], [60, 61, 62, 63, 64])


def test_register_whose_blocks_do_not_cover_the_prompt_is_refused() -> None:
    s = sender(32)
    s.blocks_ready("t", [1, 2, 3, 4, 5], 0.0)
    out = s.on_message(register(info(D, layout(64)), [10, 11]), 0.0)  # 150 tokens need 3
    assert of(out, PostWrite) == []
    (failed,) = msgs(out, m.Failed)
    assert failed.reason == "bad_blocks" and "prompt of 150 tokens" in failed.detail


def test_unit_ids_past_the_decode_cache_are_refused_in_units() -> None:
    s = sender(32)
    s.blocks_ready("t", [1, 2, 3, 4, 5], 0.0)
    d = info(D, layout(64, num_blocks=8))  # 16 units of 32 tokens
    out = s.on_message(register(d, [6, 7, 8]), 0.0)
    (failed,) = msgs(out, m.Failed)
    # units 12..16 (the 6th unit, 17, is past the prompt: trimmed, never written)
    assert "[16] outside the decode KV cache of 16 units of 32 tokens" in failed.detail


def test_the_fallback_offers_units_and_d_pulls_them_into_its_own_blocks() -> None:
    s = sender(32)
    s.blocks_ready("t", [1, 2, 3, 4, 5], 0.0)
    d = info(D, layout(64))
    _, _, posted = writes(s.on_message(register(d, [11, 12], first=1), 0.0))
    out = s.on_chunk(posted[-1].chunk_id, False, "REMOTE_DISCONNECT", 0.1)
    (fb,) = msgs(out, m.Fallback)
    assert (fb.block_ids, fb.first_block) == ([3, 4, 5], 2)
    # D (block 64) pulls those units into its blocks 11, 12 (units 22, 23, 24)
    lay = layout(64)
    rs = ReceiverSettings(block_bytes=sum(r.block_len for r in lay.regions), scheduler=SCHED)
    r = Receiver(d, rs, random.Random(0))
    (reg,) = msgs(r.register("t", P.control, [11, 12], 1, 150, 0.0), m.Register)
    fb = msgspec.structs.replace(fb, generation=reg.generation)
    reads = of(r.on_message(fb, 0.2), PostRead)
    assert [b for x in reads for b in x.local_blocks] == [22, 23, 24]
    assert [b for x in reads for b in x.remote_blocks] == [3, 4, 5]
    assert sum(x.nbytes for x in reads) == 3 * rs.block_bytes // 2


def test_a_fallback_of_more_units_than_d_blocks_hold_is_refused() -> None:
    d = info(D, layout(64))
    rs = ReceiverSettings(block_bytes=1, scheduler=SCHED)
    r = Receiver(d, rs, random.Random(0))
    (reg,) = msgs(r.register("t", P.control, [11, 12], 1, 150, 0.0), m.Register)
    fb = m.Fallback(
        m.PROTOCOL_VERSION,
        "t",
        reg.generation,
        info(P, layout(32)),
        [1, 2, 3, 4, 5],
        2,
        "push_failed",
    )
    out = r.on_message(fb, 0.1)
    assert of(out, PostRead) == []
    assert any(isinstance(a, Note) and a.reason == "bad_blocks" for a in out)


@pytest.mark.parametrize(("p_block", "d_block"), [(64, 96), (96, 64), (32, 48)])
def test_block_sizes_that_do_not_divide_are_refused_naming_both(p_block: int, d_block: int) -> None:
    why = compat.layout_problem(layout(p_block), layout(d_block))
    assert f"--block-size {p_block} on the prefill, {d_block} on the decode" in why
    assert "neither divides the other" in why and "same --block-size" in why
    s = sender(p_block)
    s.blocks_ready("t", [1, 2, 3], 0.0)
    out = s.on_message(register(info(D, layout(d_block)), [10, 11]), 0.0)
    (failed,) = msgs(out, m.Failed)
    assert failed.reason == "incompatible" and "neither divides" in failed.detail


def test_a_layout_whose_token_geometry_is_unknown_refuses_another_block_size() -> None:
    unknown = layout(64, groups=0)
    why = compat.layout_problem(layout(32), unknown)
    assert "token layout inside a block of KV region 0 is not known on the decode" in why
    assert compat.layout_problem(unknown, layout(64, groups=0)) == ""  # same size: as before
    assert compat.layout_problem(layout(32), layout(64)) == ""


def test_geometries_that_differ_are_refused() -> None:
    other = msgspec.structs.replace(
        layout(64), regions=[m.Region(0, 4096, 4096, 64, tok_groups=2)] * 2
    )  # 2 groups of 32 B per token
    why = compat.block_size_problem(layout(32), other)
    assert "token groups of 2 x 16 B per token on the prefill, 32 B on the decode" in why
    # the CPU "vec" kernel's order (K transposed, then V) against a plain one
    vec = msgspec.structs.replace(
        layout(64),
        regions=[m.Region(0, 4096, 4096, 64, tok_groups=2 * 17, tok_pattern=[(16, 1), (1, 16)])]
        * 2,
    )
    assert "16 x 1 + 16 B on the decode" in compat.block_size_problem(layout(32), vec)
    half = msgspec.structs.replace(vec.regions[0], block_len=2048, block_stride=2048)
    assert (
        compat.block_size_problem(
            vec, msgspec.structs.replace(vec, block_size=32, regions=[half] * 2)
        )
        == ""
    )


def test_a_kv_cache_needing_too_many_unit_descriptors_is_refused_naming_the_count() -> None:
    """Units are listed per token group: a large cache of many groups would cost gigabytes
    of NIXL descriptors, so the conversion is refused at the first handshake instead."""
    blocks = compat.MAX_UNIT_DESCRIPTORS // (2 * 2 * GROUPS) + 1  # 2 regions, 2 units each
    big_p, big_d = layout(32, num_blocks=blocks * 2), layout(64, num_blocks=blocks)
    assert compat.unit_descriptor_count(big_d, 32) > compat.MAX_UNIT_DESCRIPTORS
    why = compat.layout_problem(big_p, big_d)
    assert "NIXL descriptors, over" in why and "same --block-size" in why
    assert compat.layout_problem(layout(32), layout(64)) == ""  # a small cache converts
