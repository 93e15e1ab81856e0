"""ChunkScheduler: chunking, order with aging, link fairness, caps, EWMA, cut-off, last chunk."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpush_prod.core.scheduler import Chunk, ChunkScheduler, SchedulerSettings
from kvpush_prod.errors import ConfigError, ProtocolError

CORE = settings.get_profile("kvpush-core")
FAR = 1e9  # a permit deadline that never matters


def sched(
    chunk_bytes: int = 1000,
    latency: float = 0.01,
    bandwidth: float = 1e6,
    aging: float = math.inf,
    stop: float = 0.5,
    alpha: float = 0.5,
    max_chunks: int = 100_000,
) -> ChunkScheduler:
    """Defaults: 10 blocks of 100 B per chunk, initial cap 10 kB (10 chunks); the chunk
    cap out of the way."""
    return ChunkScheduler(
        SchedulerSettings(
            chunk_bytes=chunk_bytes,
            target_latency_s=latency,
            initial_bandwidth_bytes_per_s=bandwidth,
            aging_bytes_per_s=aging,
            stop_margin_s=stop,
            ewma_alpha=alpha,
            max_inflight_chunks=max_chunks,
        )
    )


def drain(s: ChunkScheduler, now: float = 0.0, dt: float = 0.001) -> list[Chunk]:
    """Post one chunk at a time and complete it dt later, until nothing is left."""
    out: list[Chunk] = []
    while True:
        chunks = s.next_chunks(now, limit=1)
        if not chunks:
            return out
        now += dt
        s.on_chunk_done(chunks[0].id, now)
        out.append(chunks[0])


# ----------------------------------------------------------------------------- chunking


def test_a_transfer_smaller_than_a_chunk_is_one_last_chunk() -> None:
    s = sched()
    s.add("t", "L", block_bytes=100, num_blocks=5, permit_deadline=FAR, now=0.0)
    [c] = s.next_chunks(0.0)
    assert (c.start, c.end, c.nbytes, c.is_last, c.attempt) == (0, 5, 500, True, 0)
    assert c.blocks == range(0, 5)
    assert s.on_chunk_done(c.id, 0.001) is True
    assert s.transfers == 0 and s.queued == 0


def test_the_last_transfer_ending_leaves_no_cutoff_behind() -> None:
    s = sched()
    for tid in ("a", "b"):
        s.add(tid, "L", block_bytes=100, num_blocks=5, permit_deadline=FAR, now=0.0)
    drain(s)
    assert s.transfers == 0
    assert s.tables("push")["push.cutoffs"] == (0, None)
    assert s.next_wakeup() is None


def test_a_block_larger_than_a_chunk_travels_alone() -> None:
    s = sched(chunk_bytes=1000)
    s.add("t", "L", block_bytes=4000, num_blocks=3, permit_deadline=FAR, now=0.0)
    chunks = drain(s)
    assert [(c.start, c.end, c.nbytes) for c in chunks] == [
        (0, 1, 4000),
        (1, 2, 4000),
        (2, 3, 4000),
    ]


def test_a_zero_block_transfer_is_one_empty_last_chunk() -> None:
    s = sched()
    s.add("t", "L", block_bytes=100, num_blocks=0, permit_deadline=FAR, now=0.0)
    [c] = s.next_chunks(0.0)
    assert (c.start, c.end, c.nbytes, c.is_last) == (0, 0, 0, True)
    assert s.on_chunk_done(c.id, 0.0) is True
    assert s.bandwidth("L") == 1e6  # an empty chunk says nothing about the link


@CORE
@given(
    block_bytes=st.integers(1, 3000),
    num_blocks=st.integers(0, 120),
    chunk_bytes=st.integers(1, 5000),
)
def test_chunks_are_contiguous_runs_covering_every_block_once(
    block_bytes: int, num_blocks: int, chunk_bytes: int
) -> None:
    s = sched(chunk_bytes=chunk_bytes)
    s.add("t", "L", block_bytes, num_blocks, FAR, 0.0)
    chunks = drain(s)
    per_chunk = max(1, chunk_bytes // block_bytes)
    assert [c.start for c in chunks] == [c.end - (c.end - c.start) for c in chunks]
    assert sorted((c.start, c.end) for c in chunks) == [(c.start, c.end) for c in chunks]
    covered = [b for c in chunks for b in c.blocks]
    assert covered == list(range(num_blocks))
    for c in chunks:
        assert c.nbytes == (c.end - c.start) * block_bytes
        assert c.end - c.start <= per_chunk
        assert c.nbytes <= chunk_bytes or c.end - c.start == 1
    assert [c.is_last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert len(chunks) == max(1, -(-num_blocks // per_chunk))


# ----------------------------------------------------------------------------- order


def test_least_queued_bytes_go_first_on_a_link() -> None:
    s = sched(latency=0.0)  # cap: one chunk at a time
    s.add("big", "L", 100, 30, FAR, 0.0)
    s.add("small", "L", 100, 5, FAR, 0.0)
    s.add("medium", "L", 100, 15, FAR, 0.0)
    order = [c.transfer_id for c in drain(s)]
    assert order == ["small", "medium", "medium", "big", "big", "big"]


def test_aging_lets_an_old_big_transfer_go_before_later_small_ones() -> None:
    # aging 1000 B/s: big (3000 B at t=0) has key 3.0
    s = sched(latency=0.0, aging=1000.0)
    s.add("big", "L", 100, 30, FAR, 0.0)
    s.add("late-small", "L", 100, 5, FAR, 2.6)  # key 2.6 + 0.5 = 3.1 > 3.0
    assert s.next_chunks(2.6, limit=1)[0].transfer_id == "big"
    s2 = sched(latency=0.0, aging=1000.0)
    s2.add("big", "L", 100, 30, FAR, 0.0)
    s2.add("early-small", "L", 100, 5, FAR, 2.0)  # key 2.5 < 3.0
    assert s2.next_chunks(2.0, limit=1)[0].transfer_id == "early-small"


def _stream_of_small_transfers(aging: float, horizon: int) -> int | None:
    """A big transfer, then a new small one every step; the step the big one ends, if any."""
    s = sched(latency=0.0, aging=aging)
    s.add("big", "L", 100, 30, FAR, 0.0)
    for step in range(horizon):
        now = float(step)
        s.add(f"small{step}", "L", 100, 1, FAR, now)
        for c in s.next_chunks(now, limit=1):
            if s.on_chunk_done(c.id, now + 0.5) and c.transfer_id == "big":
                return step
    return None


def test_without_aging_a_stream_of_small_transfers_starves_a_big_one() -> None:
    assert _stream_of_small_transfers(aging=math.inf, horizon=500) is None


def test_with_aging_the_big_transfer_ends_despite_the_stream() -> None:
    done = _stream_of_small_transfers(aging=1000.0, horizon=500)
    assert done is not None and done < 40


@CORE
@given(
    aging=st.sampled_from([200.0, 1000.0, 5000.0]),
    arrivals=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40)), min_size=1, max_size=30),
    stream_every=st.integers(1, 3),
)
def test_a_transfer_ends_once_the_bounded_work_that_may_precede_it_is_done(
    aging: float, arrivals: list[tuple[int, int]], stream_every: int
) -> None:
    """One link, one chunk per step. Only transfers added no later than X.added +
    X.bytes / aging can go before X, so X ends within (their chunks + 1) steps of its add."""
    s = sched(latency=0.0, aging=aging)
    horizon = 400
    schedule = defaultdict(list)
    for i, (step, blocks) in enumerate(arrivals):
        schedule[step].append((f"t{i}", blocks))
    for step in range(0, horizon, stream_every):  # an endless stream of 1-chunk transfers
        schedule[step].append((f"s{step}", 3))
    added: dict[str, tuple[int, int]] = {}  # tid -> (step, blocks)
    finished: dict[str, int] = {}
    for step in range(horizon):
        for tid, blocks in schedule.get(step, []):
            s.add(tid, "L", 100, blocks, FAR, float(step))
            added[tid] = (step, blocks)
        for c in s.next_chunks(float(step), limit=1):
            if s.on_chunk_done(c.id, step + 0.5):
                finished[c.transfer_id] = step
    per_chunk = 10
    for tid, (step, blocks) in added.items():
        if not tid.startswith("t"):
            continue
        window = step + blocks * 100 / aging
        ahead = sum(max(1, -(-b // per_chunk)) for (a, b) in added.values() if a <= window)
        bound = step + ahead
        if bound < horizon:
            assert tid in finished and finished[tid] <= bound, (tid, finished.get(tid), bound)


# ----------------------------------------------------------------------------- fairness


def test_links_take_turns_one_chunk_each() -> None:
    s = sched()
    s.add("a", "A", 100, 100, FAR, 0.0)
    s.add("b", "B", 100, 30, FAR, 0.0)
    s.add("c", "C", 100, 20, FAR, 0.0)
    links = [c.link for c in drain(s)[:6]]
    assert links == ["A", "B", "C", "A", "B", "C"]


def test_one_call_without_limit_interleaves_links() -> None:
    s = sched(latency=0.002)  # cap: 2 chunks per link
    s.add("a", "A", 100, 100, FAR, 0.0)
    s.add("b", "B", 100, 100, FAR, 0.0)
    assert [c.link for c in s.next_chunks(0.0)] == ["A", "B", "A", "B"]


@CORE
@given(
    work=st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 60), st.integers(0, 30)),
        min_size=1,
        max_size=25,
    )
)
def test_a_link_with_ready_work_is_served_within_one_round_of_the_links(
    work: list[tuple[int, int, int]],
) -> None:
    s = sched()
    by_step = defaultdict(list)
    for i, (link, blocks, step) in enumerate(work):
        by_step[step].append((f"t{i}", f"L{link}", blocks))
    skipped: dict[str, int] = defaultdict(int)
    queued_on: dict[str, int] = defaultdict(int)  # link -> chunks not yet posted
    for step in range(200):
        for tid, link, blocks in by_step.get(step, []):
            s.add(tid, link, 100, blocks, FAR, float(step))
            queued_on[link] += max(1, -(-blocks // 10))
        ready = {link for link, n in queued_on.items() if n > 0}
        chunks = s.next_chunks(float(step), limit=1)
        if not ready:
            assert not chunks
            continue
        [c] = chunks
        queued_on[c.link] -= 1
        s.on_chunk_done(c.id, step + 0.5)
        for link in ready:
            skipped[link] = 0 if link == c.link else skipped[link] + 1
            assert skipped[link] < len(ready) + len(queued_on), (link, skipped[link])
        for link in set(skipped) - ready:
            skipped[link] = 0


# ----------------------------------------------------------------------------- caps, EWMA


def test_in_flight_bytes_stay_within_the_cap() -> None:
    s = sched(latency=0.003)  # 1e6 B/s * 3 ms = 3000 B: three chunks
    s.add("t", "L", 100, 100, FAR, 0.0)
    first = s.next_chunks(0.0)
    assert len(first) == 3 and s.inflight_bytes("L") == 3000
    assert s.next_chunks(0.0) == []
    s.on_chunk_done(first[0].id, 0.001)
    assert len(s.next_chunks(0.001)) >= 1


def test_a_link_never_has_more_chunks_in_flight_than_max_inflight_chunks() -> None:
    # The byte cap would allow 100 chunks; the chunk cap allows 4.
    s = ChunkScheduler(
        SchedulerSettings(
            chunk_bytes=100,
            target_latency_s=0.01,
            initial_bandwidth_bytes_per_s=1e6,
            max_inflight_chunks=4,
        )
    )
    s.add("t", "L", 100, 50, FAR, 0.0)
    s.add("u", "M", 100, 50, FAR, 0.0)
    first = s.next_chunks(0.0)
    assert s.inflight_chunks_on("L") == 4 and s.inflight_chunks_on("M") == 4
    assert len(first) == 8 and s.next_chunks(0.0) == []
    s.on_chunk_done(first[0].id, 0.001)
    again = s.next_chunks(0.001)
    assert len(again) == 1 and again[0].link == first[0].link
    assert s.inflight_chunks_on(first[0].link) == 4


def test_each_time_a_ready_chunk_finds_its_link_full_the_cap_that_bound_is_counted() -> None:
    by_chunks = ChunkScheduler(
        SchedulerSettings(
            chunk_bytes=100,
            target_latency_s=0.01,
            initial_bandwidth_bytes_per_s=1e6,
            max_inflight_chunks=2,
        )
    )
    by_chunks.add("t", "L", 100, 10, FAR, 0.0)
    by_chunks.next_chunks(0.0)
    assert by_chunks.capped() == (0, 1)
    by_bytes = sched(latency=0.003)  # three chunks of 1000 B fit
    by_bytes.add("t", "L", 100, 100, FAR, 0.0)
    by_bytes.next_chunks(0.0)
    assert by_bytes.capped() == (1, 0)
    assert by_bytes.stats().capped_bytes == 1
    idle = sched()
    idle.add("t", "L", 100, 5, FAR, 0.0)
    idle.next_chunks(0.0)
    assert idle.capped() == (0, 0)  # nothing waited


def test_an_idle_link_always_takes_one_chunk_even_above_the_cap() -> None:
    s = sched(chunk_bytes=1000, latency=0.0)
    s.add("t", "L", 5000, 2, FAR, 0.0)
    assert len(s.next_chunks(0.0)) == 1
    assert s.inflight_bytes("L") == 5000 > s.cap_bytes("L")


def test_the_cap_follows_the_measured_bandwidth() -> None:
    s = sched(chunk_bytes=1000, latency=0.01, bandwidth=1e5)  # cap: 1000 (one chunk)
    assert s.cap_bytes("L") == 1000
    s.add("t", "L", 100, 2000, FAR, 0.0)
    now = 0.0
    for _ in range(5):
        [c] = s.next_chunks(now, limit=1)
        now += 0.0001  # 1000 B in 0.1 ms: 1e7 B/s
        s.on_chunk_done(c.id, now)
    assert s.bandwidth("L") == pytest.approx(1e7)
    assert s.cap_bytes("L") == pytest.approx(1e5)
    assert len(s.next_chunks(now)) == 100


def test_the_first_sample_sets_the_estimate_then_ewma_of_bytes_over_service_time() -> None:
    s = sched(alpha=0.5)
    s.add("a", "L", 100, 10, FAR, 0.0)
    [c] = s.next_chunks(0.0)
    s.on_chunk_done(c.id, 0.001)
    assert s.bandwidth("L") == pytest.approx(1000 / 0.001)
    s.add("b", "L", 100, 10, FAR, 1.0)
    [c] = s.next_chunks(1.0)
    s.on_chunk_done(c.id, 1.003)
    # EWMA(bytes) = 1000, EWMA(time) = (0.001 + 0.003) / 2
    assert s.bandwidth("L") == pytest.approx(1000 / 0.002)


def test_chunks_sharing_a_link_measure_the_link_not_their_share() -> None:
    s = sched(alpha=0.5)
    s.add("t", "L", 100, 30, FAR, 0.0)
    a, b = s.next_chunks(0.0)  # both posted at once; the last chunk waits for them
    s.on_chunk_done(a.id, 1.0)  # 1000 B in 1 s
    s.on_chunk_done(b.id, 2.0)  # the next 1000 B in the next second
    assert s.bandwidth("L") == pytest.approx(1000.0)


# ----------------------------------------------------------------------------- cut-off


def test_no_chunk_is_emitted_within_the_stop_margin_of_the_permit_deadline() -> None:
    s = sched(stop=0.5)
    s.add("t", "L", 100, 5, permit_deadline=10.0, now=0.0)
    s.add("u", "L", 100, 5, permit_deadline=10.0, now=0.0)
    [c] = s.next_chunks(9.49, limit=1)
    assert c.transfer_id == "t"
    assert s.next_chunks(9.5) == []
    assert s.take_expired() == ["u"]
    assert not s.has_transfer("u")
    # t had posted everything before its cut-off: what flies may still land
    assert s.on_chunk_done(c.id, 9.8) is True


def test_a_chunk_failing_after_the_cut_off_expires_its_transfer() -> None:
    s = sched(stop=0.5)
    s.add("t", "L", 100, 5, permit_deadline=10.0, now=0.0)
    [c] = s.next_chunks(9.0)
    assert s.expire(9.6) == []
    s.on_chunk_failed(c.id, 9.7, retry_at=9.7)
    assert s.take_expired() == ["t"] and not s.has_transfer("t")


def test_a_transfer_past_its_cut_off_is_reported_expired_once() -> None:
    s = sched(stop=0.5)
    s.add("t", "L", 100, 5, permit_deadline=10.0, now=0.0)
    assert s.next_chunks(9.5) == []
    assert s.take_expired() == ["t"]
    assert s.take_expired() == []
    assert s.stats().transfers_expired == 1


def test_a_transfer_added_inside_the_stop_margin_is_expired_not_queued() -> None:
    s = sched(stop=0.5)
    s.add("t", "L", 100, 5, permit_deadline=10.0, now=9.6)
    assert not s.has_transfer("t") and s.queued == 0
    assert s.take_expired() == ["t"]


def test_expire_reports_without_scheduling() -> None:
    s = sched(stop=0.5)
    s.add("t", "L", 100, 5, permit_deadline=10.0, now=0.0)
    assert s.next_wakeup() == 9.5
    assert s.expire(9.4) == []
    assert s.expire(9.5) == ["t"]


def test_renew_moves_the_cut_off_later_never_earlier() -> None:
    s = sched(stop=0.5)
    s.add("t", "L", 100, 5, permit_deadline=10.0, now=0.0)
    assert s.renew("t", 20.0)
    assert s.renew("t", 5.0)  # ignored: earlier
    assert s.next_chunks(15.0) != []
    assert s.renew("nope", 20.0) is False


def test_chunks_in_flight_when_a_transfer_expires_are_still_accounted() -> None:
    s = sched(stop=0.5)
    s.add("t", "L", 100, 30, permit_deadline=10.0, now=0.0)
    chunks = s.next_chunks(9.0, limit=1)
    assert s.next_chunks(9.6) == [] and s.take_expired() == ["t"]
    assert s.inflight_bytes("L") == 1000
    assert s.on_chunk_done(chunks[0].id, 9.7) is False
    assert s.inflight_bytes("L") == 0


# ----------------------------------------------------------------------------- last chunk


def test_the_last_chunk_waits_for_every_other_chunk_to_complete() -> None:
    s = sched()
    s.add("t", "L", 100, 35, FAR, 0.0)
    first = s.next_chunks(0.0)
    assert [(c.start, c.end, c.is_last) for c in first] == [
        (0, 10, False),
        (10, 20, False),
        (20, 30, False),
    ]
    s.on_chunk_done(first[0].id, 0.1)
    s.on_chunk_done(first[2].id, 0.1)
    assert s.next_chunks(0.1) == []
    s.on_chunk_done(first[1].id, 0.2)
    [last] = s.next_chunks(0.2)
    assert (last.start, last.end, last.is_last) == (30, 35, True)


def test_a_failed_chunk_is_posted_again_before_the_last_chunk() -> None:
    s = sched()
    s.add("t", "L", 100, 25, FAR, 0.0)
    a, b = s.next_chunks(0.0)
    s.on_chunk_done(a.id, 0.1)
    s.on_chunk_failed(b.id, 0.1)
    [again] = s.next_chunks(0.1)
    assert (again.start, again.end, again.attempt, again.is_last) == (10, 20, 1, False)
    assert again.first_posted_at == 0.0
    s.on_chunk_done(again.id, 0.2)
    [last] = s.next_chunks(0.2)
    assert last.is_last and last.start == 20


# ----------------------------------------------------------------------------- retries, cancel


def test_a_retry_waits_for_its_retry_time() -> None:
    s = sched()
    s.add("t", "L", 100, 5, FAR, 0.0)
    [c] = s.next_chunks(0.0)
    s.on_chunk_failed(c.id, 0.1, retry_at=0.5)
    assert s.pending_retries("t") == 1
    assert s.next_wakeup() == 0.5
    assert s.next_chunks(0.4) == []
    [again] = s.next_chunks(0.5)
    assert again.attempt == 1 and again.is_last
    assert (again.posted_at, again.first_posted_at) == (0.5, 0.0)
    assert s.pending_retries("t") == 0


def test_an_immediate_retry_counts_as_pending_until_posted() -> None:
    s = sched()
    s.add("t", "L", 100, 5, FAR, 0.0)
    [c] = s.next_chunks(0.0)
    s.on_chunk_failed(c.id, 0.1)
    assert s.pending_retries("t") == 1
    s.next_chunks(0.1)
    assert s.pending_retries("t") == 0


def test_giving_up_on_a_chunk_drops_its_transfer() -> None:
    s = sched()
    s.add("t", "L", 100, 30, FAR, 0.0)
    a, b = s.next_chunks(0.0)
    s.on_chunk_failed(a.id, 0.1, give_up=True)
    assert not s.has_transfer("t") and s.queued == 0
    assert s.on_chunk_done(b.id, 0.2) is False
    assert s.next_chunks(0.2) == []


def test_cancel_returns_the_chunks_in_flight_and_is_idempotent() -> None:
    s = sched()
    s.add("t", "L", 100, 50, FAR, 0.0)
    posted = s.next_chunks(0.0, limit=2)
    assert s.inflight_chunks("t") == [c.id for c in posted]
    assert s.cancel("t") == [c.id for c in posted]
    assert s.cancel("t") == []
    assert s.queued == 0 and s.next_chunks(0.0) == []
    for c in posted:
        s.on_chunk_done(c.id, 0.1)
    assert s.inflight_bytes("L") == 0 and s.inflight == 0


def test_a_completion_for_an_unknown_chunk_is_a_protocol_error() -> None:
    s = sched()
    s.add("t", "L", 100, 5, FAR, 0.0)
    [c] = s.next_chunks(0.0)
    s.on_chunk_done(c.id, 0.1)
    with pytest.raises(ProtocolError, match=str(c.id)):
        s.on_chunk_done(c.id, 0.1)
    with pytest.raises(ProtocolError, match="999"):
        s.on_chunk_failed(999, 0.1)


def test_bad_adds_are_protocol_errors_naming_the_value() -> None:
    s = sched()
    s.add("t", "L", 100, 5, FAR, 0.0)
    with pytest.raises(ProtocolError, match="'t'"):
        s.add("t", "L", 100, 5, FAR, 0.0)
    with pytest.raises(ProtocolError, match="0"):
        s.add("u", "L", 0, 5, FAR, 0.0)
    with pytest.raises(ProtocolError, match="-2"):
        s.add("u", "L", 100, -2, FAR, 0.0)


def test_a_limit_of_zero_posts_nothing() -> None:
    s = sched()
    s.add("t", "L", 100, 5, FAR, 0.0)
    assert s.next_chunks(0.0, limit=0) == []
    assert s.queued == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chunk_bytes": 0},
        {"target_latency_s": -1.0},
        {"stop_margin_s": -0.1},
        {"aging_bytes_per_s": 0.0},
        {"ewma_alpha": 0.0},
        {"ewma_alpha": 1.5},
        {"initial_bandwidth_bytes_per_s": 0.0},
        {"min_sample_s": 0.0},
        {"max_inflight_chunks": 0},
    ],
)
def test_invalid_scheduler_settings_are_config_errors(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        SchedulerSettings(**kwargs)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- stateful


class SchedulerMachine(RuleBasedStateMachine):
    """Random adds, posts, completions, failures, cancels and renewals keep every rule."""

    def __init__(self) -> None:
        super().__init__()
        self.s = sched(chunk_bytes=1000, latency=0.002, stop=0.5, aging=2000.0, max_chunks=3)
        self.now = 0.0
        self.n = 0
        self.blocks: dict[str, int] = {}  # live transfer -> num_blocks
        self.cutoff: dict[str, float] = {}
        self.landed: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.flying: dict[int, Chunk] = {}

    @rule(
        link=st.sampled_from(["A", "B", "C"]),
        block_bytes=st.sampled_from([100, 300, 1500]),
        n=st.integers(0, 25),
        ttl=st.floats(0.1, 20.0),
    )
    def add(self, link: str, block_bytes: int, n: int, ttl: float) -> None:
        self.n += 1
        tid = f"t{self.n}"
        self.s.add(tid, link, block_bytes, n, self.now + ttl, self.now)
        if self.s.has_transfer(tid):
            self.blocks[tid] = n
            self.cutoff[tid] = self.now + ttl - 0.5
        else:
            assert ttl <= 0.5 and self.s.take_expired() == [tid]

    @rule(limit=st.one_of(st.none(), st.integers(1, 4)))
    def post(self, limit: int | None) -> None:
        inflight = defaultdict(int)
        count: dict[str, int] = defaultdict(int)
        for c in self.flying.values():
            inflight[c.link] += c.nbytes
            count[c.link] += 1
        for c in self.s.next_chunks(self.now, limit):
            assert c.transfer_id in self.blocks, "posted a chunk of an ended transfer"
            assert self.now < self.cutoff[c.transfer_id], "posted past the permit cut-off"
            if c.is_last:
                others = sorted(self.landed[c.transfer_id])
                expect = [b for b in range(c.start)]
                assert [b for s_, e in others for b in range(s_, e)] == expect
                assert not any(f.transfer_id == c.transfer_id for f in self.flying.values())
            before = inflight[c.link]
            assert before == 0 or before + c.nbytes <= self.s.cap_bytes(c.link)
            inflight[c.link] += c.nbytes
            count[c.link] += 1
            assert count[c.link] <= 3, "more chunks in flight than max_inflight_chunks"
            self.flying[c.id] = c
        for tid in self.s.take_expired():
            assert self.now >= self.cutoff[tid], "expired before its cut-off"
            self.end(tid)

    def end(self, tid: str) -> None:
        self.blocks.pop(tid, None)
        self.cutoff.pop(tid, None)

    @precondition(lambda self: bool(self.flying))
    @rule(data=st.data(), dt=st.floats(0.0, 0.01))
    def complete(self, data: st.DataObject, dt: float) -> None:
        cid = data.draw(st.sampled_from(sorted(self.flying)))
        c = self.flying.pop(cid)
        self.now += dt
        finished = self.s.on_chunk_done(cid, self.now)
        if c.transfer_id in self.blocks:
            self.landed[c.transfer_id].append((c.start, c.end))
        if finished:
            assert c.is_last
            got = sorted(b for s_, e in self.landed[c.transfer_id] for b in range(s_, e))
            assert got == list(range(self.blocks[c.transfer_id]))
            self.end(c.transfer_id)

    @precondition(lambda self: bool(self.flying))
    @rule(data=st.data(), mode=st.sampled_from(["now", "later", "give_up"]))
    def fail(self, data: st.DataObject, mode: str) -> None:
        cid = data.draw(st.sampled_from(sorted(self.flying)))
        c = self.flying.pop(cid)
        if mode == "give_up":
            self.s.on_chunk_failed(cid, self.now, give_up=True)
            self.end(c.transfer_id)
        else:
            retry_at = self.now + (0.05 if mode == "later" else 0.0)
            self.s.on_chunk_failed(cid, self.now, retry_at=retry_at)
        for tid in self.s.take_expired():  # a failure past the cut-off expires its transfer
            assert self.now >= self.cutoff[tid]
            self.end(tid)

    @precondition(lambda self: bool(self.blocks))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(sorted(self.blocks)))
        ids = self.s.cancel(tid)
        assert ids == sorted(c.id for c in self.flying.values() if c.transfer_id == tid)
        self.end(tid)

    @precondition(lambda self: bool(self.blocks))
    @rule(data=st.data(), extra=st.floats(0.0, 5.0))
    def renew(self, data: st.DataObject, extra: float) -> None:
        tid = data.draw(st.sampled_from(sorted(self.blocks)))
        new_cutoff = self.now + extra
        self.s.renew(tid, new_cutoff + 0.5)
        self.cutoff[tid] = max(self.cutoff[tid], new_cutoff)

    @rule(dt=st.floats(0.0, 3.0))
    def advance(self, dt: float) -> None:
        self.now += dt

    @invariant()
    def accounting_matches(self) -> None:
        assert self.s.transfers == len(self.blocks)
        assert self.s.inflight == len(self.flying)
        for link in ("A", "B", "C"):
            assert self.s.inflight_bytes(link) == sum(
                c.nbytes for c in self.flying.values() if c.link == link
            )
        assert self.s.queued >= 0 and self.s.queued_bytes >= 0


TestSchedulerRules = SchedulerMachine.TestCase
TestSchedulerRules.settings = settings(CORE, stateful_step_count=50)


def test_many_renewals_keep_the_cut_off_heap_small_and_cut_off_exact() -> None:
    s = sched(stop=0.5)
    s.add("t", "L", 100, 50, permit_deadline=10.0, now=0.0)
    s.add("u", "L", 100, 50, permit_deadline=10.0, now=0.0)
    for i in range(1, 2001):
        s.renew("t", 10.0 + i * 0.01)
    assert len(s._cutoffs) <= 2 * s.transfers + 64  # internal: stale entries were compacted
    assert s.expire(9.5) == ["u"]
    assert s.expire(29.49) == []
    assert s.expire(29.5) == ["t"]


# ----------------------------------------------------------------------------- whole-push bandwidth


def _layerwise_step(s: ChunkScheduler, tid: str, now: float, dt: float) -> float:
    """A layer-wise push of 10 blocks of 100 B in 4 parts (one 250 B chunk a part, 1000 B
    in all), each chunk landing ``dt`` after its post: its chunks' fixed post cost makes
    the link look slow. Returns the time it ended."""
    s.add(tid, "L", 25, 10, FAR, now, parts=4, whole=False)
    for c in drain(s, now, dt):
        assert c.nbytes == 250
        now += dt
    return now


def test_layerwise_chunks_move_the_cap_estimate_but_not_the_whole_push_estimate() -> None:
    s = sched(alpha=0.5, bandwidth=1e6)
    assert s.whole_bandwidth("L") == 1e6  # the initial guess until a whole push landed
    _layerwise_step(s, "lw", 0.0, 0.001)  # 250 B per ms: 2.5e5 B/s
    assert s.bandwidth("L") == pytest.approx(2.5e5)  # the cap follows every chunk, as before
    assert s.cap_bytes("L") == pytest.approx(2500)  # 2.5e5 B/s x 10 ms
    assert s.whole_bandwidth("L") == 1e6  # layer-wise chunks never lower it
    s.add("w", "L", 100, 10, FAR, 1.0)
    [c] = s.next_chunks(1.0)
    s.on_chunk_done(c.id, 1.0001)  # a whole push's 1000 B in 0.1 ms: 1e7 B/s
    assert s.whole_bandwidth("L") == pytest.approx(1e7)
    # Later layer-wise chunks leave it where whole pushes put it.
    _layerwise_step(s, "lw2", 2.0, 0.001)
    assert s.whole_bandwidth("L") == pytest.approx(1e7)
    assert s.bandwidth("L") < 1e6


def test_operators_see_whole_pushes_once_one_landed_and_every_chunk_before() -> None:
    """The gauge and the slow-link guard read ``measured_bandwidth``: with layer-wise
    pushes on the link, whole pushes' estimate once there is one (layer-wise chunks would
    make a healthy link look slow), every chunk's before (a lower bound, never the guess)."""
    s = sched(alpha=0.5, bandwidth=1e6)
    assert s.measured_bandwidth("L") == 1e6  # no link yet: the initial guess
    _layerwise_step(s, "lw", 0.0, 0.001)
    assert s.measured_bandwidth("L") == pytest.approx(2.5e5)  # only layer-wise so far
    s.add("w", "L", 100, 10, FAR, 1.0)
    [c] = s.next_chunks(1.0)
    s.on_chunk_done(c.id, 1.0001)
    _layerwise_step(s, "lw2", 2.0, 0.001)
    assert s.measured_bandwidth("L") == pytest.approx(1e7)
    assert s.bandwidth("L") < 1e6  # the cap still follows every chunk


def test_the_whole_push_estimate_is_the_same_ewma_as_the_cap_estimate() -> None:
    s = sched(alpha=0.5)
    for i, (start, end) in enumerate(((0.0, 0.001), (1.0, 1.003))):
        s.add(f"t{i}", "L", 100, 10, FAR, start)
        [c] = s.next_chunks(start)
        s.on_chunk_done(c.id, end)
        assert s.whole_bandwidth("L") == s.bandwidth("L")
    assert s.whole_bandwidth("L") == pytest.approx(1000 / 0.002)


def test_the_slowest_whole_push_link_is_the_auto_decisions_bandwidth() -> None:
    s = sched(alpha=1.0, bandwidth=1e6)
    assert s.slowest_whole_bandwidth() == 1e6  # no link yet: the initial guess
    for link, dt in (("A", 0.0001), ("B", 0.001)):
        s.add(link, link, 100, 10, FAR, 0.0)
        [c] = s.next_chunks(0.0)
        s.on_chunk_done(c.id, dt)
    assert s.slowest_whole_bandwidth() == pytest.approx(1e6)  # B: 1000 B in 1 ms
    assert s.slowest_whole_bandwidth(["A"]) == pytest.approx(1e7)
    assert s.slowest_whole_bandwidth(["A", "unknown"]) == 1e6  # an unknown link: the guess


def test_before_a_whole_push_faster_layerwise_chunks_raise_the_guess_never_lower_it() -> None:
    s = sched(alpha=1.0, bandwidth=1e5)
    _layerwise_step(s, "lw", 0.0, 0.001)  # 2.5e5 B/s: a lower bound of a whole push's
    assert s.whole_bandwidth("L") == pytest.approx(2.5e5)
    s.add("w", "L", 100, 10, FAR, 1.0)
    [c] = s.next_chunks(1.0)
    s.on_chunk_done(c.id, 1.01)  # a whole push measured: 1e5 B/s, and only that counts now
    assert s.whole_bandwidth("L") == pytest.approx(1e5)
    _layerwise_step(s, "lw2", 2.0, 0.0001)  # 2.5e6 B/s
    assert s.whole_bandwidth("L") == pytest.approx(1e5)
