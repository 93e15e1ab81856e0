"""A whole push cut by regions (``core.chunking``, ``push.chunk_by: layers``): groups of
consecutive regions of about ``chunk_bytes`` over every block, each (region, block) posted
exactly once, in region order, DONE after the rest, retries per chunk as before."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush_prod.core import messages as m
from kvpush_prod.core.actions import PostWrite, ReleaseSend
from kvpush_prod.core.chunking import group_bytes, region_groups
from kvpush_prod.core.identity import agent_name as ag
from kvpush_prod.core.retry import BudgetSettings
from kvpush_prod.core.scheduler import ChunkScheduler, SchedulerSettings
from kvpush_prod.core.sender import Sender

from .test_push_engines import SS, of

# -- the grouping ---------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 500), min_size=0, max_size=40),
    ids=st.integers(0, 64),
    chunk=st.integers(1, 20_000),
)
def test_groups_are_consecutive_full_and_within_a_chunk_unless_one_region_is_more(
    sizes: list[int], ids: int, chunk: int
) -> None:
    bounds = region_groups(sizes, ids, chunk)
    assert bounds[0] == 0 and bounds[-1] == len(sizes)
    assert all(a < b for a, b in zip(bounds[:-1], bounds[1:], strict=True)) or len(sizes) == 0
    if len(bounds) == 2:
        return  # one group: it fits a chunk, or there is nothing to cut
    assert sum(sizes) * ids > chunk
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        got = sum(sizes[a:b]) * ids
        assert got <= chunk or b - a == 1  # bounded, or one region alone
        if b < len(sizes):
            assert got + sizes[b] * ids > chunk  # as full as it can be: the next did not fit


def test_a_fresh_production_shape_is_cut_into_chunk_sized_layer_groups() -> None:
    # 32 regions of 16 KiB a block, 60 blocks (30 MiB), 4 MiB chunks: 8 groups of 4 regions.
    bounds = region_groups([16 << 10] * 32, 60, 4 << 20)
    assert bounds == tuple(range(0, 33, 4))
    assert group_bytes([16 << 10] * 32, bounds) == (64 << 10,) * 8
    # The whole within one chunk: one group over every region, as before.
    assert region_groups([16 << 10] * 32, 8, 4 << 20) == (0, 32)
    # Regions of different sizes are grouped by bytes.
    assert region_groups([100, 300, 100, 100, 100], 1, 400) == (0, 2, 5)


def test_bad_sizes_are_refused_with_the_value() -> None:
    with pytest.raises(ValueError, match="chunk_bytes must be >= 1, got 0"):
        region_groups([1], 1, 0)


# -- the scheduler's parts of different sizes -----------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    part_bytes=st.lists(st.integers(1, 50), min_size=1, max_size=6),
    nb=st.integers(0, 9),
    chunk=st.integers(1, 200),
    fail=st.lists(st.booleans(), max_size=30),
    seed=st.integers(0, 1000),
)
def test_parts_of_any_size_post_each_block_once_in_chunks_and_the_last_after_the_rest(
    part_bytes: list[int], nb: int, chunk: int, fail: list[bool], seed: int
) -> None:
    rng = random.Random(seed)
    sch = ChunkScheduler(
        SchedulerSettings(chunk_bytes=chunk, stop_margin_s=0.0, max_inflight_chunks=3)
    )
    sizes = tuple(part_bytes)
    sch.add("t", "l", 1, nb, 100.0, 0.0, len(sizes), part_bytes=sizes)
    assert sch.queued_bytes == nb * sum(sizes)
    covered: list[int] = []
    inflight: list = []
    done, fails = False, iter(fail)
    for _ in range(500):
        inflight += sch.next_chunks(0.0)
        if not inflight:
            break
        c = inflight.pop(rng.randrange(len(inflight)))
        if nb:
            part = c.start // nb
            assert part == (c.end - 1) // nb  # never spans two parts
            assert c.nbytes == (c.end - c.start) * sizes[part]
            assert c.nbytes <= chunk or c.end - c.start == 1
        if c.is_last:
            assert not inflight
        if next(fails, False):
            sch.on_chunk_failed(c.id, 0.0)
            continue
        covered += list(range(c.start, c.end))
        done = sch.on_chunk_done(c.id, 0.0) or done
    assert done
    assert sorted(covered) == list(range((len(sizes) if nb else 1) * nb))


def test_part_sizes_must_name_every_part() -> None:
    sch = ChunkScheduler()
    with pytest.raises(Exception, match="part_bytes names 2 parts, parts is 3"):
        sch.add("t", "l", 1, 4, 100.0, 0.0, 3, part_bytes=(1, 2))


# -- P's whole push cut by regions ----------------------------------------------------------


def peers(lens: list[int], blocks: int = 64) -> tuple[m.PeerInfo, m.PeerInfo]:
    regions = [m.Region(i * 10_000, n, n, blocks) for i, n in enumerate(lens)]
    lay = m.Layout("c", "DRAM", regions)
    p = m.PeerInfo("P", 1, 0, "tcp://p:1", ag("agent-p", "tcp://p:1"), b"meta", lay)
    d = m.PeerInfo("D", 2, 0, "tcp://d:1", ag("agent-d", "tcp://d:1"), b"meta", lay)
    return p, d


def register(d: m.PeerInfo, blocks: list[int], tid: str = "t") -> m.Register:
    return m.Register(m.PROTOCOL_VERSION, tid, d, blocks, 0, 16 * len(blocks), 1, 5000)


def push(
    lens: list[int],
    src: list[int],
    dst: list[int],
    chunk: int,
    by_regions: bool = True,
    patient: bool = False,
) -> tuple[Sender, list[PostWrite]]:
    """A sender of ``lens`` regions whose first WRITEs of ``src`` -> ``dst`` are returned
    (``patient``: it retries failed chunks many times rather than falling back)."""
    p, d = peers(lens)
    ss = replace(
        SS,
        block_bytes=sum(lens),
        scheduler=replace(SS.scheduler, chunk_bytes=chunk),
        chunk_by_regions=by_regions,
    )
    if patient:
        ss = replace(
            ss,
            retry=replace(ss.retry, max_attempts=1000),
            budget=BudgetSettings(rate_per_s=1000.0, burst=1000.0),
            breaker=replace(ss.breaker, failure_threshold=1000),
        )
    s = Sender(p, ss, random.Random(0))
    s.on_message(register(d, dst), 0.0, origin=d.control)
    return s, of(s.blocks_ready("t", src, 0.0, owner=d.control), PostWrite)


def test_a_whole_push_larger_than_a_chunk_goes_as_region_groups_over_every_block() -> None:
    # 4 regions of 25 B a block, 3 blocks (300 B), 200 B chunks: 2 groups of 2 regions.
    s, writes = push([25] * 4, [1, 2, 3], [10, 11, 12], 200)
    (w0,) = writes  # the last waits for the others
    assert (w0.part, w0.parts, w0.regions, w0.layerwise) == (0, 2, (0, 2), False)
    assert w0.src_blocks == (1, 2, 3) and w0.dst_blocks == (10, 11, 12)
    assert w0.nbytes == 150 and w0.done is None
    (last,) = of(s.on_chunk(w0.chunk_id, True, "", 0.01), PostWrite)
    assert (last.part, last.regions, last.src_blocks, last.nbytes) == (1, (2, 4), (1, 2, 3), 150)
    assert last.done is not None and last.done.num_blocks == 3 and last.all_src == (1, 2, 3)
    s.on_chunk(last.chunk_id, True, "", 0.02)
    assert s.hold("t") == [ReleaseSend("t", "pushed", 300)]
    # Whole-push chunks: they feed the estimate push.layerwise auto and the guard read.
    assert s.sched.whole_bandwidth(writes[0].peer) == s.sched.bandwidth(writes[0].peer)


def test_a_push_within_one_chunk_or_cut_by_blocks_is_as_before() -> None:
    _, (w,) = push([25] * 4, [1, 2], [10, 11], 200)
    assert (w.parts, w.regions, w.src_blocks, w.done is not None) == (1, None, (1, 2), True)
    _, (w,) = push([25] * 4, [1, 2, 3], [10, 11, 12], 200, by_regions=False)
    assert (w.parts, w.regions, w.src_blocks, w.nbytes) == (1, None, (1, 2), 200)


def test_a_region_over_a_chunk_is_cut_by_blocks_within_its_group() -> None:
    # 2 regions of 100 B a block, 5 blocks: each region is 500 B, chunks of 200 B.
    s, writes = push([100, 100], [1, 2, 3, 4, 5], [6, 7, 8, 9, 10], 200)
    seen = []
    while writes:
        w, writes = writes[0], writes[1:]
        seen.append((w.regions, w.src_blocks))
        writes += of(s.on_chunk(w.chunk_id, True, "", 0.01), PostWrite)
    assert seen == [
        ((0, 1), (1, 2)),
        ((0, 1), (3, 4)),
        ((0, 1), (5,)),
        ((1, 2), (1, 2)),
        ((1, 2), (3, 4)),
        ((1, 2), (5,)),
    ]


@settings(max_examples=150, deadline=None)
@given(
    lens=st.lists(st.integers(1, 60), min_size=1, max_size=8),
    n=st.integers(1, 12),
    chunk=st.integers(50, 1500),
    fail=st.lists(st.integers(0, 3), max_size=40),
    seed=st.integers(0, 1000),
)
def test_every_region_of_every_block_lands_exactly_once_despite_failed_chunks(
    lens: list[int], n: int, chunk: int, fail: list[int], seed: int
) -> None:
    rng = random.Random(seed)
    src = sorted(rng.sample(range(64), n))
    dst = sorted(rng.sample(range(64), n))
    s, writes = push(lens, src, dst, chunk, patient=True)
    landed: list[tuple[int, int, int]] = []
    fails, done_seen, t = iter(fail), False, 0.0
    while writes:
        w = writes.pop(rng.randrange(len(writes)))
        t += 0.001
        regions = w.regions or (0, len(lens))
        assert not done_seen
        if w.done is not None:
            assert not writes  # DONE rides after every other chunk landed
        # A failed chunk: retried; a failed last one: D is asked whether its DONE came.
        ok = next(fails, 1) != 0 or w.done is not None
        if ok:
            landed += [
                (r, a, b)
                for r in range(*regions)
                for a, b in zip(w.src_blocks, w.dst_blocks, strict=True)
            ]
            done_seen = w.done is not None
        writes += of(s.on_chunk(w.chunk_id, ok, "" if ok else "TIMEOUT", t), PostWrite)
        for _ in range(5):
            if writes:
                break
            t += 0.05  # a retry's backoff
            writes += of(s.tick(t), PostWrite)
    want = [(r, a, b) for r in range(len(lens)) for a, b in zip(src, dst, strict=True)]
    assert done_seen
    assert sorted(landed) == sorted(want) and len(landed) == len(set(landed))
