"""Layer-wise push in the core: P posts each layer's part of the blocks as the forward
computes it (``LayersReady``), DONE goes only after the forward ended and every part landed,
and fencing, retries, fallback and aborts hold per chunk as for a whole-block push."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush_prod.config.core import layerwise_on
from kvpush_prod.core import messages as m
from kvpush_prod.core.actions import PostWrite, ReleaseSend
from kvpush_prod.core.commands import BlocksReady, LayersReady
from kvpush_prod.core.scheduler import ChunkScheduler, SchedulerSettings
from kvpush_prod.core.sender import Sender

from .test_push_engines import SS, D, P, msgs, of, register

KD = D.control


def sender() -> Sender:
    return Sender(P, SS, random.Random(0))


def parts_of(writes: list[PostWrite]) -> list[tuple[int, int, tuple[int, ...]]]:
    return [(w.part, w.parts, w.src_blocks) for w in writes]


def test_each_layer_is_posted_as_soon_as_it_is_computed_and_done_waits_for_the_forward() -> None:
    s = sender()
    s.on_message(register(), 0.0, origin=KD)
    # 4 layers; each block's part is 25 bytes, a chunk 200 bytes: one chunk per layer.
    (w0,) = of(s.layers_ready("t", [1, 2, 3], 1, 4, 0.0, owner=KD), PostWrite)
    assert parts_of([w0]) == [(0, 4, (1, 2, 3))] and w0.dst_blocks == (10, 11, 12)
    assert w0.done is None and w0.nbytes == 75
    assert of(s.on_chunk(w0.chunk_id, True, "", 0.01), PostWrite) == []  # layer 1 not yet
    (w1, w2) = of(s.layers_ready("t", [1, 2, 3], 3, 4, 0.02), PostWrite)
    assert parts_of([w1, w2]) == [(1, 4, (1, 2, 3)), (2, 4, (1, 2, 3))]
    # Every layer computed, but the forward has not ended: the last part (DONE) waits.
    assert of(s.layers_ready("t", [1, 2, 3], 4, 4, 0.03), PostWrite) == []
    s.on_chunk(w1.chunk_id, True, "", 0.04)
    assert of(s.on_chunk(w2.chunk_id, True, "", 0.05), PostWrite) == []
    (last,) = of(s.blocks_ready("t", [1, 2, 3], 0.06, owner=KD), PostWrite)
    assert (last.part, last.parts) == (3, 4) and last.done is not None
    assert last.done.num_blocks == 3 and last.all_src == (1, 2, 3)
    s.on_chunk(last.chunk_id, True, "", 0.07)
    assert s.hold("t") == [ReleaseSend("t", "pushed", 300)]


def test_layers_computed_before_the_register_are_posted_when_it_comes() -> None:
    s = sender()
    s.expect_blocks("t", 0.0, owner=KD)
    assert of(s.layers_ready("t", [1, 2, 3], 2, 4, 0.0, owner=KD), PostWrite) == []
    out = s.on_message(register(), 0.01, origin=KD)
    assert parts_of(of(out, PostWrite)) == [(0, 4, (1, 2, 3)), (1, 4, (1, 2, 3))]


def test_a_register_after_the_forward_ended_pushes_every_layer() -> None:
    s = sender()
    s.layers_ready("t", [1, 2, 3], 2, 4, 0.0, owner=KD)
    s.blocks_ready("t", [1, 2, 3], 0.01, owner=KD)
    out = of(s.on_message(register(), 0.02, origin=KD), PostWrite)
    assert [w.part for w in out] == [0, 1, 2] and all(w.done is None for w in out)


def test_a_forward_that_raises_after_layers_were_posted_drains_then_tells_decode() -> None:
    s = sender()
    s.on_message(register(), 0.0, origin=KD)
    (w0,) = of(s.layers_ready("t", [1, 2, 3], 1, 4, 0.0, owner=KD), PostWrite)
    s.hold("t")
    out = s.forward_failed("t", [1, 2, 3], 0.01)
    # A WRITE is still in flight to D's blocks: D hears nothing yet, nothing is freed.
    assert msgs(out, m.Failed) == [] and of(out, ReleaseSend) == []
    assert of(s.layers_ready("t", [1, 2, 3], 3, 4, 0.015), PostWrite) == []
    out = s.on_chunk(w0.chunk_id, True, "", 0.02)
    (failed,) = msgs(out, m.Failed)
    assert failed.reason == "prefill_failed"
    assert of(out, ReleaseSend) == [ReleaseSend("t", "failed", 0)]


def test_a_fallback_waits_for_the_forward_to_end_before_decode_reads_the_blocks() -> None:
    s = sender()
    s.on_message(register(), 0.0, origin=KD)
    (w0,) = of(s.layers_ready("t", [1, 2, 3], 1, 4, 0.0, owner=KD), PostWrite)
    out = s.on_chunk(w0.chunk_id, False, "NOT_ALLOWED", 0.01)  # breaks the push path
    assert msgs(out, m.Fallback) == []  # layers 1-3 are not computed yet
    (fb,) = msgs(s.blocks_ready("t", [1, 2, 3], 0.02), m.Fallback)
    assert fb.block_ids == [1, 2, 3]


def test_a_retried_layer_chunk_is_posted_again_with_its_part() -> None:
    s = sender()
    s.on_message(register(), 0.0, origin=KD)
    (w0,) = of(s.layers_ready("t", [1, 2, 3], 1, 4, 0.0, owner=KD), PostWrite)
    s.on_chunk(w0.chunk_id, False, "ERR:nixlBackendError", 0.01)
    (again,) = of(s.poll(1.0), PostWrite)
    assert (again.part, again.src_blocks, again.dst_blocks) == (0, (1, 2, 3), (10, 11, 12))


def test_abort_mid_forward_drains_then_tells_decode() -> None:
    s = sender()
    s.on_message(register(), 0.0, origin=KD)
    (w0,) = of(s.layers_ready("t", [1, 2, 3], 1, 4, 0.0, owner=KD), PostWrite)
    assert msgs(s.abort("t", 0.01), m.Failed) == []
    (failed,) = msgs(s.on_chunk(w0.chunk_id, True, "", 0.02), m.Failed)
    assert failed.reason == "prefill_aborted"


def test_no_layer_is_posted_past_the_permit_stop_margin() -> None:
    s = sender()
    s.on_message(register(ttl_ms=2000), 0.0, origin=KD)  # stop margin 1 s: post until 1.0
    (w0,) = of(s.layers_ready("t", [1, 2, 3], 1, 4, 0.0, owner=KD), PostWrite)
    s.on_chunk(w0.chunk_id, True, "", 0.1)
    out = s.layers_ready("t", [1, 2, 3], 2, 4, 1.5)
    assert of(out, PostWrite) == []
    (failed,) = msgs(out, m.Failed)
    assert failed.reason == "permit_expired"


def test_commands_carry_layer_readiness_to_the_sender() -> None:
    s = sender()
    s.on_message(register(), 0.0, origin=KD)
    out = LayersReady("t", (1, 2, 3), 1, 2, KD).apply(s, 0.0)
    assert [w.part for w in of(out, PostWrite)] == [0]
    assert BlocksReady("t", (1, 2, 3), KD).apply(s, 0.1) == []  # the first is in flight


@settings(max_examples=200, deadline=None)
@given(
    nb=st.integers(0, 9),
    parts=st.integers(1, 5),
    chunk=st.integers(1, 4),
    steps=st.lists(st.integers(0, 5), max_size=8),
    seed=st.integers(0, 1000),
)
def test_scheduler_posts_each_part_once_within_readiness_and_the_last_after_the_seal(
    nb: int, parts: int, chunk: int, steps: list[int], seed: int
) -> None:
    rng = random.Random(seed)
    sch = ChunkScheduler(
        SchedulerSettings(chunk_bytes=chunk, stop_margin_s=0.0, max_inflight_chunks=3)
    )
    sch.add("t", "l", 1, nb, 100.0, 0.0, parts=parts, ready=0)
    ready, sealed, covered, done = 0, False, [], False
    inflight: list = []
    for r in [*steps, parts, -1]:
        if r < 0:
            sealed = True
            sch.extend("t", parts, final=True)
        elif r > ready:
            ready = min(r, parts)
            sch.extend("t", ready)
        for _ in range(50):
            inflight += sch.next_chunks(0.0)
            if not inflight:
                break
            c = inflight.pop(rng.randrange(len(inflight)))
            eff_parts = parts if nb else 1
            assert c.end <= (eff_parts * nb if sealed else ready * nb)
            if nb:
                assert c.start // nb == (c.end - 1) // nb  # never spans two parts
            if c.is_last:
                assert sealed and not inflight
            covered += list(range(c.start, c.end))
            done = sch.on_chunk_done(c.id, 0.0) or done
    assert done
    assert sorted(covered) == list(range((parts if nb else 1) * nb))


def test_a_cancel_during_a_layerwise_push_is_acked_even_if_the_forward_then_fails() -> None:
    s = sender()
    s.on_message(register(), 0.0, origin=KD)
    (w0,) = of(s.layers_ready("t", [1, 2, 3], 1, 4, 0.0, owner=KD), PostWrite)
    assert (
        msgs(s.on_message(m.Cancel(1, "t", 1, D, "aborted"), 0.01, origin=KD), m.CancelAck) == []
    )  # a WRITE is in flight
    assert msgs(s.forward_failed("t", [1, 2, 3], 0.02), m.Failed) == []
    out = s.on_chunk(w0.chunk_id, True, "", 0.03)
    assert len(msgs(out, m.CancelAck)) == 1 and msgs(out, m.Failed) == []


# -- push.layerwise auto's bandwidth --------------------------------------------------------

# Each chunk takes 0.1 ms on the link whatever its size (a post's fixed cost dominates): a
# whole push of 3 blocks is 2 chunks (200 + 100 B), a layer-wise one in 4 parts 4 chunks
# of 75 B, which measure the link 2-3x slower. Auto: 3 blocks of 16 tokens (at least 32)
# whose 300 B take at least 0.25 ms.
POST_S = 0.0001


def push_step(s: Sender, tid: str, layerwise: bool, now: float) -> float:
    """Push one step's 3 blocks to D, whole or in 4 layers, its chunks landing one after
    another ``POST_S`` apart; returns when the last landed."""
    s.on_message(register(tid), now, origin=KD)
    writes = of(s.layers_ready(tid, [1, 2, 3], 4, 4, now, owner=KD), PostWrite) if layerwise else []
    writes += of(s.blocks_ready(tid, [1, 2, 3], now, owner=KD), PostWrite)
    sizes = []
    while writes:
        now += POST_S
        sizes.append(writes[0].nbytes)
        writes = writes[1:] + of(s.on_chunk(writes[0].chunk_id, True, "", now), PostWrite)
    assert sizes == ([75] * 4 if layerwise else [200, 100])
    return now


def run_steps(decide_by: Callable[[Sender], float], steps: int) -> list[bool]:
    """A link measured by one whole push, then one layer-wise step (a longer prompt's, say),
    then ``steps`` steps of 3 blocks, each pushed as auto decides at ``decide_by``."""
    s, now, decisions = sender(), 0.0, []
    now = push_step(s, "w", False, now)
    now = push_step(s, "lw", True, now + 1.0)
    for i in range(steps):
        on = layerwise_on("auto", 3, 100, 16, decide_by(s), 32, 0.25)
        decisions.append(on)
        now = push_step(s, f"s{i}", on, now + 1.0)
    return decisions


def test_auto_decides_by_whole_pushes_so_layerwise_chunks_cannot_lock_it_on() -> None:
    link = D.agent_name
    s = sender()
    push_step(s, "w", False, 0.0)
    whole = s.sched.whole_bandwidth(link)  # EWMA of 200 and 100 B, each in 0.1 ms
    assert whole == pytest.approx(175 / POST_S)
    # At what whole pushes measured, the step's 300 B take 0.17 ms: under the 0.25 ms.
    assert not layerwise_on("auto", 3, 100, 16, whole, 32, 0.25)
    # Before: every chunk's estimate, which the layer-wise step pulled down, kept auto on.
    assert run_steps(lambda s: s.sched.bandwidth(link), 4) == [True] * 4
    # Now: whole pushes' estimate alone, so auto pushes the step whole.
    assert run_steps(lambda s: s.sched.slowest_whole_bandwidth([link]), 4) == [False] * 4
