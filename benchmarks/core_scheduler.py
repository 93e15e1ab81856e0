"""Cost of one ChunkScheduler decision (next_chunks(limit=1) + on_chunk_done) vs queue size.

Run: PYTHONPATH=src python benchmarks/core_scheduler.py [--links 1000] [--decisions 20000]
Prints a table (queued chunks, us per decision) and a PASS/FAIL verdict against the target
of < 20 us at 10k queued chunks over 1,000 links, with growth no worse than logarithmic.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass

from kvpush_prod.core.scheduler import ChunkScheduler, SchedulerSettings

TARGET_US_AT_10K = 20.0
BLOCK_BYTES = 256 * 1024
CHUNK_BYTES = 1024 * 1024  # 4 blocks per chunk


@dataclass(frozen=True)
class Result:
    queued: int
    mean_us: float
    p50_us: float
    p99_us: float


def measure(queued: int, links: int, decisions: int, rng: random.Random) -> Result:
    """Steady state: the queue is topped up to ``queued`` chunks between decisions (untimed),
    about one chunk per link is in flight, completions come back oldest first."""
    s = ChunkScheduler(
        SchedulerSettings(chunk_bytes=CHUNK_BYTES, target_latency_s=0.005, stop_margin_s=0.5)
    )
    serial = 0
    now = 0.0

    def add() -> None:
        nonlocal serial
        serial += 1
        nblocks = 4 * rng.randint(1, 16)  # 1..16 chunks
        s.add(f"t{serial}", f"link{rng.randrange(links)}", BLOCK_BYTES, nblocks, now + 3600.0, now)

    while s.queued < queued:
        add()
    inflight: deque[int] = deque()
    window = max(1, min(links, queued // 2))
    samples: list[float] = []
    clock = time.perf_counter_ns
    for _ in range(decisions):
        now += 1e-5
        t0 = clock()
        chunks = s.next_chunks(now, limit=1)
        if chunks:
            inflight.append(chunks[0].id)
        if inflight and (len(inflight) > window or not chunks):
            s.on_chunk_done(inflight.popleft(), now)
        samples.append(clock() - t0)
        while s.queued < queued:
            add()
    samples.sort()
    us = [x / 1000.0 for x in samples]
    return Result(
        queued=queued,
        mean_us=statistics.fmean(us),
        p50_us=us[len(us) // 2],
        p99_us=us[int(len(us) * 0.99)],
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--links", type=int, default=1000)
    ap.add_argument("--decisions", type=int, default=20000, help="timed decisions per run")
    ap.add_argument("--repeats", type=int, default=3, help="runs per size; the best is kept")
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1_000, 10_000, 100_000])
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)

    rng = random.Random(args.seed)
    results: list[Result] = []
    for size in args.sizes:
        best: Result | None = None
        for rep in range(args.repeats):
            print(
                f"  measuring {size:>7} queued chunks, run {rep + 1}/{args.repeats} ...",
                file=sys.stderr,
                flush=True,
            )
            r = measure(size, args.links, args.decisions, rng)
            if best is None or r.mean_us < best.mean_us:
                best = r
        assert best is not None
        results.append(best)

    print(f"\nChunkScheduler decision cost, {args.links} links, best of {args.repeats} runs")
    print(f"{'queued chunks':>14} | {'us/decision':>11} | {'p50 us':>7} | {'p99 us':>7}")
    print(f"{'-' * 14}-+-{'-' * 11}-+-{'-' * 7}-+-{'-' * 7}")
    for r in results:
        print(f"{r.queued:>14,} | {r.mean_us:>11.2f} | {r.p50_us:>7.2f} | {r.p99_us:>7.2f}")

    by_size = {r.queued: r for r in results}
    ok = True
    notes: list[str] = []
    if 10_000 in by_size:
        at10k = by_size[10_000].mean_us
        ok &= at10k < TARGET_US_AT_10K
        notes.append(f"{at10k:.2f} us at 10k (target < {TARGET_US_AT_10K:.0f} us)")
    small, large = min(by_size), max(by_size)
    if large > small:
        growth = by_size[large].mean_us / by_size[small].mean_us
        # Logarithmic growth from small to large, with 50% slack for cache effects.
        allowed = 1.5 * math.log(large) / math.log(small)
        ok &= growth <= allowed
        notes.append(
            f"x{growth:.2f} from {small:,} to {large:,} chunks "
            f"(log growth allows x{allowed:.2f}; linear would be x{large / small:.0f})"
        )
    print(f"\nVERDICT: {'PASS' if ok else 'FAIL'}: " + "; ".join(notes))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
