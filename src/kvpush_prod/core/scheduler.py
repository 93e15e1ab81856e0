"""The chunk scheduler: cuts each transfer into chunks, orders and paces them per link, never
late; P queues its WRITEs here, and D its READs in a fallback.

Least queued bytes first with aging on each link, round robin across links, in-flight caps
from each link's measured bandwidth, and no chunk within ``stop_margin_s`` of a permit's end.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass

from kvpush_prod.errors import ConfigError, ProtocolError

TransferId = str
LinkId = str


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    """Knobs of the chunk scheduler.

    ``chunk_bytes``: the largest chunk (a single block larger than this is still one
    chunk). ``target_latency_s``: a link's in-flight cap is ``max(chunk_bytes,
    bandwidth * target_latency_s)``. ``stop_margin_s``: no chunk is posted this close to
    its permit's deadline (the chunk must land before the permit ends).
    ``aging_bytes_per_s``: a transfer's queued bytes count as ``queued / aging`` seconds
    of lateness, so one added more than that later can no longer overtake it; ``inf``
    gives pure least-queued-bytes-first (which can starve big transfers).
    ``ewma_alpha``: weight of the newest sample in the bandwidth estimate.
    ``max_inflight_chunks``: a link never has more chunks posted and not completed (beside
    the byte cap). The defaults of ``chunk_bytes``, ``target_latency_s``,
    ``max_inflight_chunks`` and ``stop_margin_s`` are the configuration's
    (``push.chunk_bytes``, ``push.target_latency_ms``, ``push.max_inflight_chunks``,
    ``leases.stop_margin_s``).
    """

    chunk_bytes: int = 4 * 1024 * 1024
    target_latency_s: float = 0.002
    max_inflight_chunks: int = 64
    stop_margin_s: float = 1.0
    aging_bytes_per_s: float = 1024.0**3
    ewma_alpha: float = 0.25
    initial_bandwidth_bytes_per_s: float = 1e9
    min_sample_s: float = 1e-6

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1:
            raise ConfigError(f"scheduler chunk_bytes must be >= 1, got {self.chunk_bytes}")
        if not (self.target_latency_s >= 0 and math.isfinite(self.target_latency_s)):
            raise ConfigError(
                f"scheduler target_latency_s must be >= 0, got {self.target_latency_s}"
            )
        if not (self.stop_margin_s >= 0 and math.isfinite(self.stop_margin_s)):
            raise ConfigError(f"scheduler stop_margin_s must be >= 0, got {self.stop_margin_s}")
        if self.max_inflight_chunks < 1:
            raise ConfigError(
                f"scheduler max_inflight_chunks must be >= 1, got {self.max_inflight_chunks}"
            )
        if not self.aging_bytes_per_s > 0:
            raise ConfigError(
                f"scheduler aging_bytes_per_s must be > 0 (inf: no aging), "
                f"got {self.aging_bytes_per_s}"
            )
        if not 0 < self.ewma_alpha <= 1:
            raise ConfigError(f"scheduler ewma_alpha must be in (0, 1], got {self.ewma_alpha}")
        if not (
            self.initial_bandwidth_bytes_per_s > 0
            and math.isfinite(self.initial_bandwidth_bytes_per_s)
        ):
            raise ConfigError(
                "scheduler initial_bandwidth_bytes_per_s must be a finite > 0, "
                f"got {self.initial_bandwidth_bytes_per_s}"
            )
        if not self.min_sample_s > 0:
            raise ConfigError(f"scheduler min_sample_s must be > 0, got {self.min_sample_s}")


@dataclass(frozen=True, slots=True)
class Chunk:
    """One WRITE to post: blocks ``[start, end)`` of the transfer's block list.

    ``is_last``: the final chunk, emitted only after all others completed; it carries the
    DONE notification. ``attempt``: 0 on the first post, n on the n-th re-post;
    ``first_posted_at``: when attempt 0 was posted (what a retry policy's delay counts from).
    """

    id: int
    transfer_id: TransferId
    link: LinkId
    start: int
    end: int
    nbytes: int
    is_last: bool
    attempt: int
    posted_at: float
    first_posted_at: float

    @property
    def blocks(self) -> range:
        return range(self.start, self.end)


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    chunks_posted: int
    chunks_done: int
    chunks_failed: int
    transfers_done: int
    transfers_expired: int
    transfers_cancelled: int
    # Times a chunk ready to post waited because its link was at a cap: its in-flight
    # bytes (``capped_bytes``) or ``max_inflight_chunks`` (``capped_chunks``).
    capped_bytes: int = 0
    capped_chunks: int = 0


# The last chunk's life: it waits for the others, then flies, may wait for a retry, lands.
# HELD: it failed, and whether its DONE arrived anyway is being asked (``hold``): it is
# posted again (``repost_last``) or counted as landed (``confirm_last``) on the answer.
_LAST_PENDING, _LAST_INFLIGHT, _LAST_DELAYED, _LAST_DONE, _LAST_HELD = range(5)


class _Transfer:
    __slots__ = (
        "tid", "link", "num_blocks", "cutoff", "added_at", "part_bytes", "part_chunks",
        "last_start", "cursor", "retry", "delayed", "inflight", "last", "last_attempt",
        "last_first_at", "total", "ready_end", "sealed", "whole",
        "queued_bytes", "queued_chunks", "heap_seq", "cutoff_seq", "alive",
    )  # fmt: skip

    def __init__(
        self, tid: TransferId, link: _Link, part_bytes: tuple[int, ...], num_blocks: int,
        cutoff: float, added_at: float, chunk_bytes: int, ready: int | None = None,
        whole: bool = True,
    ) -> None:  # fmt: skip
        self.tid = tid
        self.link = link
        parts = len(part_bytes)
        self.part_bytes = part_bytes  # one block of each part
        self.num_blocks = num_blocks  # per part
        self.cutoff = cutoff  # permit deadline minus the stop margin
        self.added_at = added_at
        # Blocks per chunk in each part: a chunk's worth of that part's bytes (at least 1).
        self.part_chunks = tuple(max(1, chunk_bytes // b) for b in part_bytes)
        # Its chunks alone feed the link's ``whole_bandwidth`` (not a layer-wise push's).
        self.whole = whole
        # Indices part by part: index i is block i % num_blocks of part i // num_blocks; a
        # chunk never spans two parts, and only parts below ``ready`` may be posted.
        per_part = [max(1, -(-num_blocks // c)) for c in self.part_chunks]
        self.total = parts * num_blocks
        # ``ready`` None: every part is ready and the last chunk may go once the others
        # landed; else only the first ``ready`` parts, and the last chunk waits for
        # ``extend(..., final=True)`` (the forward's end) even when every part is ready.
        self.sealed = ready is None
        self.ready_end = self.total if ready is None else min(ready, parts) * num_blocks
        self.last_start = (parts - 1) * num_blocks + (per_part[-1] - 1) * self.part_chunks[-1]
        self.cursor = 0  # next never-posted index below last_start
        # failed chunks ready to go again: (start, end, attempt, first_posted_at)
        self.retry: list[tuple[int, int, int, float]] = []
        self.delayed = 0  # failed chunks waiting for their retry time
        self.inflight: set[int] = set()
        self.last = _LAST_PENDING
        self.last_attempt = 0
        self.last_first_at = 0.0
        self.queued_bytes = num_blocks * sum(part_bytes)
        self.queued_chunks = sum(per_part)
        self.heap_seq = 0  # seq of its one current entry in the link heap, 0: not queued
        self.cutoff_seq = 0
        self.alive = True

    def peek(self) -> tuple[int, int, bool, int, float] | None:
        """The next chunk it could post now, or None:
        (start, end, is_last, attempt, first_posted_at; meaningless for attempt 0)."""
        if self.retry:
            start, end, attempt, first_at = self.retry[-1]
            return start, end, False, attempt, first_at
        if self.cursor < self.last_start:
            if self.cursor >= self.ready_end:
                return None  # its part is not computed yet (``extend`` releases it)
            return self.cursor, self._end_of(self.cursor), False, 0, 0.0
        if self.last == _LAST_PENDING and not self.inflight and not self.delayed and self.sealed:
            return self.last_start, self.total, True, self.last_attempt, self.last_first_at
        return None

    def nbytes(self, start: int, end: int) -> int:
        """Bytes of the chunk ``[start, end)`` (within one part)."""
        if end <= start:
            return 0
        return (end - start) * self.part_bytes[start // self.num_blocks]

    def _end_of(self, start: int) -> int:
        """Where the chunk starting at ``start`` ends: a chunk's worth, its part's end or
        the last chunk's start, whichever comes first."""
        part = start // self.num_blocks
        part_end = (part + 1) * self.num_blocks
        return min(start + self.part_chunks[part], part_end, self.last_start)

    def take(self, is_last: bool) -> None:
        """Mark what ``peek`` returned as posted."""
        if self.retry:
            self.retry.pop()
        elif is_last:
            self.last = _LAST_INFLIGHT
        else:
            self.cursor = self._end_of(self.cursor)


def _check_sizes(
    tid: TransferId,
    block_bytes: int,
    num_blocks: int,
    parts: int,
    ready: int | None,
    part_bytes: tuple[int, ...],
) -> None:
    """``ChunkScheduler.add``'s sizes, or a ``ProtocolError`` naming the bad one."""
    if block_bytes < 1 or any(b < 1 for b in part_bytes):
        raise ProtocolError(
            "bad block size",
            f"transfer {tid!r}: block_bytes and part_bytes must be >= 1, "
            f"got {block_bytes} and {part_bytes}",
        )
    if num_blocks < 0:
        raise ProtocolError(
            "bad block count", f"transfer {tid!r}: num_blocks must be >= 0, got {num_blocks}"
        )
    if parts < 1 or (ready is not None and ready < 0):
        raise ProtocolError(
            "bad parts",
            f"transfer {tid!r}: parts must be >= 1 and ready >= 0, got {parts} and {ready}",
        )
    if part_bytes and len(part_bytes) != parts:
        raise ProtocolError(
            "bad parts",
            f"transfer {tid!r}: part_bytes names {len(part_bytes)} parts, parts is {parts}; "
            "give one size per part",
        )


class _Link:
    __slots__ = (
        "id", "heap", "inflight_bytes", "inflight_chunks", "ewma_bytes", "ewma_time",
        "bandwidth", "cap", "last_done_at", "active", "whole_bytes", "whole_time",
        "whole_bandwidth",
    )  # fmt: skip

    def __init__(self, link_id: LinkId, bandwidth: float, cap: float) -> None:
        self.id = link_id
        self.heap: list[tuple[float, int, _Transfer]] = []
        self.inflight_bytes = 0
        self.inflight_chunks = 0
        self.ewma_bytes = 0.0  # 0 until the first sample
        self.ewma_time = 0.0
        self.bandwidth = bandwidth
        # The same estimate over whole pushes' chunks only (a layer-wise push's small
        # chunks, one part of a block each, pay a post's fixed cost per few bytes).
        self.whole_bytes = 0.0
        self.whole_time = 0.0  # 0 until the first such sample
        self.whole_bandwidth = bandwidth
        self.cap = cap
        self.last_done_at = -math.inf
        self.active = False  # in the round-robin queue


class ChunkScheduler:
    """Decides which chunk is posted next on which link (P's WRITEs, D's READs).

    Guarantees: on each link, chunks go least-queued-bytes-first with aging (a transfer is
    overtaken only by transfers added less than ``queued / aging_bytes_per_s`` after it);
    links with ready work take turns; a link's in-flight bytes stay within its cap (or one
    chunk) and its chunks in flight within ``max_inflight_chunks``; no chunk of a transfer within ``stop_margin_s`` of its permit deadline (it is
    reported expired instead); a transfer's last chunk only after its others completed.
    Each decision is O(log n) in the queued transfers.
    """

    def __init__(self, settings: SchedulerSettings | None = None) -> None:
        self._s = settings if settings is not None else SchedulerSettings()
        s = self._s
        self._no_aging = math.isinf(s.aging_bytes_per_s)
        self._inv_aging = 0.0 if self._no_aging else 1.0 / s.aging_bytes_per_s
        self._initial_cap = max(
            float(s.chunk_bytes), s.initial_bandwidth_bytes_per_s * s.target_latency_s
        )
        self._links: dict[LinkId, _Link] = {}
        self._transfers: dict[TransferId, _Transfer] = {}
        self._inflight: dict[int, tuple[Chunk, _Transfer, _Link]] = {}
        self._active: deque[_Link] = deque()
        self._cutoffs: list[tuple[float, int, _Transfer]] = []
        # (retry_at, seq, transfer, start, end, is_last, attempt, first_posted_at)
        self._delayed: list[tuple[float, int, _Transfer, int, int, bool, int, float]] = []
        self._seq = itertools.count(1)
        self._next_chunk_id = 1
        self._expired_out: list[TransferId] = []
        self._queued_chunks = 0
        self._queued_bytes = 0
        self._posted = 0
        self._done = 0
        self._failed = 0
        self._transfers_done = 0
        self._transfers_expired = 0
        self._transfers_cancelled = 0
        self._capped_bytes = 0
        self._capped_chunks = 0

    def tables(self, prefix: str) -> dict[str, tuple[int, int | None]]:
        """Entries of each table this scheduler keeps, named ``prefix.table``, with its bound
        (None: none of its own; the transfers it serves bound it)."""
        return {
            f"{prefix}.links": (len(self._links), None),
            f"{prefix}.transfers": (len(self._transfers), None),
            f"{prefix}.inflight": (len(self._inflight), None),
            f"{prefix}.delayed": (len(self._delayed), None),
            f"{prefix}.cutoffs": (len(self._cutoffs), None),
        }

    @property
    def settings(self) -> SchedulerSettings:
        return self._s

    # -- feeding it -----------------------------------------------------------------------

    def add(
        self,
        transfer_id: TransferId,
        link: LinkId,
        block_bytes: int,
        num_blocks: int,
        permit_deadline: float,
        now: float,
        parts: int = 1,
        ready: int | None = None,
        *,
        part_bytes: tuple[int, ...] = (),
        whole: bool = True,
    ) -> None:
        """Queue a transfer of ``num_blocks`` blocks of ``block_bytes`` each over ``link``.

        ``permit_deadline``: when D's write permit ends (holder clock). A transfer already
        within the stop margin is not queued but reported by ``take_expired``. A transfer
        of 0 blocks is one empty last chunk: the shell sends its DONE as a bare notification.

        ``parts`` > 1: each block is ``parts`` pieces of ``block_bytes`` (``block_bytes`` is
        then one part's; ``part_bytes``: each part's, when they differ), posted part by part:
        a chunk's ``start`` and ``end`` index ``parts * num_blocks`` ids, part
        ``i // num_blocks``, block ``i % num_blocks``, and never span two parts; a part is
        cut into chunks of at most ``chunk_bytes`` (or one block). Only the first ``ready``
        parts (all when None) may be posted until ``extend`` says more are; the last chunk
        (DONE) then waits for ``extend(..., final=True)``.

        ``whole``: a whole push's chunks (not a layer-wise push's), which alone feed the
        link's ``whole_bandwidth``.
        """
        if transfer_id in self._transfers:
            raise ProtocolError(
                "duplicate transfer", f"transfer {transfer_id!r} is already queued; cancel it first"
            )
        _check_sizes(transfer_id, block_bytes, num_blocks, parts, ready, part_bytes)
        sizes = part_bytes or (block_bytes,) * parts
        if num_blocks == 0:
            sizes = (block_bytes,)  # one empty last chunk: nothing to post part by part
        s = self._s
        lk = self._links.get(link)
        if lk is None:
            lk = self._links[link] = _Link(link, s.initial_bandwidth_bytes_per_s, self._initial_cap)
        cutoff = permit_deadline - s.stop_margin_s
        if not cutoff > now:
            self._expired_out.append(transfer_id)
            self._transfers_expired += 1
            return
        t = _Transfer(transfer_id, lk, sizes, num_blocks, cutoff, now, s.chunk_bytes, ready, whole)
        self._transfers[transfer_id] = t
        self._queued_chunks += t.queued_chunks
        self._queued_bytes += t.queued_bytes
        self._push_cutoff(t)
        self._push(t)
        self._wake(lk)

    def renew(self, transfer_id: TransferId, new_deadline: float) -> bool:
        """Move a queued transfer's permit deadline later (never earlier); False if unknown."""
        t = self._transfers.get(transfer_id)
        if t is None:
            return False
        cutoff = new_deadline - self._s.stop_margin_s
        if cutoff > t.cutoff:
            t.cutoff = cutoff
            self._push_cutoff(t)
        return True

    def extend(self, transfer_id: TransferId, ready: int, final: bool = False) -> bool:
        """The first ``ready`` parts of a layer-wise transfer may be posted now (never fewer
        than before); ``final``: all of them, and its last chunk once the others landed.
        False if the transfer is not queued."""
        t = self._transfers.get(transfer_id)
        if t is None:
            return False
        end = t.total if final else min(ready * t.num_blocks, t.total)
        if end > t.ready_end or (final and not t.sealed):
            t.ready_end = max(end, t.ready_end)
            t.sealed = t.sealed or final
            if t.heap_seq == 0 and t.peek() is not None:
                self._push(t)
                self._wake(t.link)
        return True

    def cancel(self, transfer_id: TransferId) -> list[int]:
        """Drop a transfer's queued chunks; returns its chunk ids still in flight.

        Those chunks still complete or fail through ``on_chunk_done`` / ``on_chunk_failed``
        (only their bytes are accounted). Unknown or finished transfers: [] (idempotent).
        """
        t = self._transfers.get(transfer_id)
        if t is None:
            return []
        self._end(t)
        self._transfers_cancelled += 1
        return sorted(t.inflight)

    # -- deciding ---------------------------------------------------------------------------

    def next_chunks(self, now: float, limit: int | None = None) -> list[Chunk]:
        """The chunks to post now, at most ``limit``, links taking turns.

        First expires transfers past their cut-off (see ``take_expired``) and releases
        retries whose time has come.
        """
        if limit is not None and limit <= 0:
            return []
        if self._cutoffs and self._cutoffs[0][0] <= now:
            self._expire_due(now)
        if self._delayed and self._delayed[0][0] <= now:
            self._release_delayed(now)
        out: list[Chunk] = []
        active = self._active
        while active:
            lk = active.popleft()
            lk.active = False
            chunk = self._emit_one(lk, now)
            if chunk is None:
                continue  # no ready work or no room: it rejoins when that changes
            out.append(chunk)
            self._wake(lk)  # back to the end of the round
            if limit is not None and len(out) >= limit:
                break
        return out

    def _landed(self, chunk_id: int) -> tuple[Chunk, _Transfer, _Link]:
        """Take ``chunk_id`` out of flight (its link's bytes and chunks in flight drop)."""
        rec = self._inflight.pop(chunk_id, None)
        if rec is None:
            raise ProtocolError(
                "unknown chunk",
                f"chunk {chunk_id} is not in flight (already completed, failed or never posted)",
            )
        chunk, t, lk = rec
        lk.inflight_bytes -= chunk.nbytes
        lk.inflight_chunks -= 1
        return rec

    def on_chunk_done(self, chunk_id: int, now: float) -> bool:
        """A chunk landed; True when that completed its transfer (its last chunk landed)."""
        chunk, t, lk = self._landed(chunk_id)
        self._done += 1
        if chunk.nbytes:
            self._sample(lk, chunk, now, t.whole)
        completed = False
        if t.alive:
            t.inflight.discard(chunk_id)
            if chunk.is_last:
                t.last = _LAST_DONE
                self._end(t)
                self._transfers_done += 1
                completed = True
            elif t.heap_seq == 0 and t.peek() is not None:
                self._push(t)  # e.g. its last chunk was waiting for this one
        self._wake(lk)
        return completed

    def on_chunk_failed(
        self,
        chunk_id: int,
        now: float,
        *,
        retry_at: float | None = None,
        give_up: bool = False,
        hold: bool = False,
    ) -> None:
        """A chunk failed. It is queued again (from ``retry_at`` if later than ``now``),
        or with ``give_up`` its transfer is dropped like ``cancel`` (the shell falls back).

        ``hold`` (a last chunk only): its DONE may have landed although the post failed, so
        it is neither re-posted nor given up until the shell knows: ``repost_last`` or
        ``confirm_last`` (or ``cancel``). The transfer still expires at its cut-off.
        """
        chunk, t, lk = self._landed(chunk_id)
        self._failed += 1
        if t.alive:
            t.inflight.discard(chunk_id)
            if give_up:
                self._end(t)
                self._transfers_cancelled += 1
            elif t.cutoff <= now:
                self._expire(t)  # it could never be posted again
            elif hold:
                if not chunk.is_last:
                    raise ProtocolError(
                        "hold of a chunk that is not last",
                        f"chunk {chunk_id} of {t.tid!r} carries no DONE: retry or give it up",
                    )
                self._count_queued(t, chunk.nbytes)
                t.last = _LAST_HELD
                t.last_attempt = chunk.attempt + 1
                t.last_first_at = chunk.first_posted_at
            else:
                self._requeue(t, chunk, now, retry_at)
        self._wake(lk)

    def repost_last(
        self, transfer_id: TransferId, now: float, retry_at: float | None = None
    ) -> bool:
        """A held last chunk did not land: queue it again (from ``retry_at``, as a retry).

        False if the transfer is gone (expired, cancelled) or holds no last chunk."""
        t = self._transfers.get(transfer_id)
        if t is None or t.last != _LAST_HELD:
            return False
        if retry_at is not None and retry_at > now:
            t.delayed += 1
            t.last = _LAST_DELAYED
            heapq.heappush(
                self._delayed,
                (
                    retry_at,
                    next(self._seq),
                    t,
                    t.last_start,
                    t.total,
                    True,
                    t.last_attempt,
                    t.last_first_at,
                ),
            )
            return True
        t.last = _LAST_PENDING
        if t.heap_seq == 0 and t.peek() is not None:
            self._push(t)
            self._wake(t.link)
        return True

    def confirm_last(self, transfer_id: TransferId) -> bool:
        """A held last chunk did land (its DONE arrived): the transfer is complete.

        False if the transfer is gone or holds no last chunk."""
        t = self._transfers.get(transfer_id)
        if t is None or t.last != _LAST_HELD:
            return False
        t.last = _LAST_DONE
        self._end(t)
        self._transfers_done += 1
        return True

    def take_expired(self) -> list[TransferId]:
        """Transfers dropped since the last call because their permit came within the stop
        margin while they still had chunks to post (their chunks in flight stay accounted)."""
        out, self._expired_out = self._expired_out, []
        return out

    def expire(self, now: float) -> list[TransferId]:
        """Expire what is due at ``now`` without scheduling, then ``take_expired``."""
        self._expire_due(now)
        return self.take_expired()

    # -- introspection ----------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Chunks not posted yet (gated last chunks and retries waiting included)."""
        return self._queued_chunks

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    @property
    def transfers(self) -> int:
        return len(self._transfers)

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def has_transfer(self, transfer_id: TransferId) -> bool:
        return transfer_id in self._transfers

    def inflight_bytes(self, link: LinkId) -> int:
        lk = self._links.get(link)
        return 0 if lk is None else lk.inflight_bytes

    def inflight_chunks(self, transfer_id: TransferId) -> list[int]:
        t = self._transfers.get(transfer_id)
        return [] if t is None else sorted(t.inflight)

    def pending_retries(self, transfer_id: TransferId) -> int:
        """Failed chunks of the transfer not posted again yet (0: fire RETRY)."""
        t = self._transfers.get(transfer_id)
        if t is None:
            return 0
        # ``delayed`` already counts a last chunk waiting for its retry time.
        last_ready_again = t.last in (_LAST_PENDING, _LAST_HELD) and t.last_attempt > 0
        return len(t.retry) + t.delayed + int(last_ready_again)

    def bandwidth(self, link: LinkId) -> float:
        """The link's estimated bandwidth in bytes/s (the initial guess before any sample):
        every chunk's; it sets the link's in-flight cap."""
        lk = self._links.get(link)
        return self._s.initial_bandwidth_bytes_per_s if lk is None else lk.bandwidth

    def whole_bandwidth(self, link: LinkId) -> float:
        """The link's estimated bandwidth in bytes/s over whole (not layer-wise) pushes'
        chunks only. A layer-wise push posts a part of each block per chunk, whose fixed
        post cost measures the link 2-3x slower than a whole push finds it;
        ``push.layerwise: auto`` decides by this estimate (``slowest_whole_bandwidth``), so
        layer-wise pushes cannot keep it on. Until a whole push's chunk landed: the initial
        guess, or ``bandwidth`` if higher (what layer-wise chunks measured is a lower bound
        of what a whole push would), so those chunks can raise it, never lower it."""
        lk = self._links.get(link)
        initial = self._s.initial_bandwidth_bytes_per_s
        if lk is None:
            return initial
        return lk.whole_bandwidth if lk.whole_time > 0 else max(initial, lk.bandwidth)

    def measured_bandwidth(self, link: LinkId) -> float:
        """What the link is measured to carry, in bytes/s, for operators (the
        ``kvpush_link_bandwidth_bytes_per_second`` gauge and the slow-link guard): whole
        pushes' estimate once one landed, every chunk's before (a link that only ever
        carries layer-wise pushes reads as their chunks measure it, a lower bound). Read
        from every chunk, ``push.layerwise: auto`` would make a healthy link look 2-3x
        slower whenever it turned layer-wise on."""
        lk = self._links.get(link)
        if lk is None:
            return self._s.initial_bandwidth_bytes_per_s
        return lk.whole_bandwidth if lk.whole_time > 0 else lk.bandwidth

    def slowest_whole_bandwidth(self, links: list[LinkId] | None = None) -> float:
        """The least ``whole_bandwidth`` of ``links`` (None: every link known), the
        initial guess when there are none: what ``push.layerwise: auto`` decides by, in
        the connector and in the simulator."""
        ids = self.links() if links is None else links
        if not ids:
            return self._s.initial_bandwidth_bytes_per_s
        return min(self.whole_bandwidth(link) for link in ids)

    def inflight_chunks_on(self, link: LinkId) -> int:
        """Chunks posted on ``link`` and not completed (at most ``max_inflight_chunks``)."""
        lk = self._links.get(link)
        return 0 if lk is None else lk.inflight_chunks

    def cap_bytes(self, link: LinkId) -> float:
        """The link's in-flight cap: max(chunk_bytes, bandwidth * target_latency_s)."""
        lk = self._links.get(link)
        return self._initial_cap if lk is None else lk.cap

    def forget_idle_links(self, keep: set[LinkId]) -> list[LinkId]:
        """Forget the links outside ``keep`` that have nothing queued or in flight (a peer
        process replaced or dropped: its agent name never comes back); the ids forgotten."""
        busy = {t.link.id for t in self._transfers.values()}
        gone = [
            link
            for link, lk in self._links.items()
            if link not in keep
            and link not in busy
            and not lk.active
            and not lk.heap
            and lk.inflight_chunks == 0
        ]
        for link in gone:
            del self._links[link]
        return gone

    def links(self) -> list[LinkId]:
        return list(self._links)

    def next_wakeup(self) -> float | None:
        """The earliest time a cut-off or a delayed retry is due (may be early, never late)."""
        times = [h[0][0] for h in (self._cutoffs, self._delayed) if h]
        return min(times) if times else None

    def capped(self) -> tuple[int, int]:
        """(capped_bytes, capped_chunks) of ``stats()``, cheaply (the shell polls it often)."""
        return self._capped_bytes, self._capped_chunks

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            chunks_posted=self._posted,
            chunks_done=self._done,
            chunks_failed=self._failed,
            transfers_done=self._transfers_done,
            transfers_expired=self._transfers_expired,
            transfers_cancelled=self._transfers_cancelled,
            capped_bytes=self._capped_bytes,
            capped_chunks=self._capped_chunks,
        )

    # -- internals --------------------------------------------------------------------------

    def _push(self, t: _Transfer) -> None:
        """(Re)queue ``t`` in its link heap under its current key; older entries go stale."""
        seq = next(self._seq)
        t.heap_seq = seq
        if self._no_aging:
            key = float(t.queued_bytes)
        else:
            key = t.added_at + t.queued_bytes * self._inv_aging
        heapq.heappush(t.link.heap, (key, seq, t))

    def _push_cutoff(self, t: _Transfer) -> None:
        seq = next(self._seq)
        t.cutoff_seq = seq
        heapq.heappush(self._cutoffs, (t.cutoff, seq, t))
        if len(self._cutoffs) > 2 * len(self._transfers) + 64:
            # Renewals and ended transfers leave stale entries: rebuild (amortised O(1)).
            self._cutoffs = [(x.cutoff, x.cutoff_seq, x) for x in self._transfers.values()]
            heapq.heapify(self._cutoffs)

    def _wake(self, lk: _Link) -> None:
        # A full link joins the round too: its turn finds it full, counts the cap that bound
        # and leaves it out until one of its chunks completes (O(1) per completion).
        if not lk.active and lk.heap:
            lk.active = True
            self._active.append(lk)

    def _end(self, t: _Transfer) -> None:
        """Forget a transfer's queued work; its in-flight chunks stay accounted."""
        t.alive = False
        del self._transfers[t.tid]
        self._queued_chunks -= t.queued_chunks
        self._queued_bytes -= t.queued_bytes
        if not self._transfers:
            # Every cut-off left is a stale one (lazy heap): dropped, so an idle engine holds
            # none (they left only as their time came and the pump looked).
            self._cutoffs.clear()

    def _expire_due(self, now: float) -> None:
        heap = self._cutoffs
        while heap and heap[0][0] <= now:
            _, seq, t = heapq.heappop(heap)
            if t.alive and t.cutoff_seq == seq and t.queued_chunks:
                # With everything posted there is nothing to stop: chunks posted before
                # the cut-off may still land; one that fails after it expires it then.
                self._expire(t)

    def _expire(self, t: _Transfer) -> None:
        self._end(t)
        self._expired_out.append(t.tid)
        self._transfers_expired += 1

    def _release_delayed(self, now: float) -> None:
        heap = self._delayed
        while heap and heap[0][0] <= now:
            _, _, t, start, end, is_last, attempt, first_at = heapq.heappop(heap)
            if not t.alive:
                continue
            t.delayed -= 1
            if is_last:
                t.last = _LAST_PENDING
                t.last_attempt = attempt
                t.last_first_at = first_at
            else:
                t.retry.append((start, end, attempt, first_at))
            if t.heap_seq == 0 and t.peek() is not None:
                self._push(t)
                self._wake(t.link)

    def _count_queued(self, t: _Transfer, nbytes: int) -> None:
        t.queued_bytes += nbytes
        t.queued_chunks += 1
        self._queued_bytes += nbytes
        self._queued_chunks += 1

    def _requeue(self, t: _Transfer, chunk: Chunk, now: float, retry_at: float | None) -> None:
        attempt = chunk.attempt + 1
        self._count_queued(t, chunk.nbytes)
        if retry_at is not None and retry_at > now:
            t.delayed += 1
            if chunk.is_last:
                t.last = _LAST_DELAYED
            heapq.heappush(
                self._delayed,
                (
                    retry_at,
                    next(self._seq),
                    t,
                    chunk.start,
                    chunk.end,
                    chunk.is_last,
                    attempt,
                    chunk.first_posted_at,
                ),  # fmt: skip
            )
            return
        if chunk.is_last:
            t.last = _LAST_PENDING
            t.last_attempt = attempt
            t.last_first_at = chunk.first_posted_at
        else:
            t.retry.append((chunk.start, chunk.end, attempt, chunk.first_posted_at))
        if t.peek() is not None:
            self._push(t)  # its queued bytes grew: a new key

    def _emit_one(self, lk: _Link, now: float) -> Chunk | None:
        heap = lk.heap
        while heap:
            _, seq, t = heap[0]
            if not t.alive or t.heap_seq != seq:
                heapq.heappop(heap)  # stale: re-keyed, ended or already taken
                continue
            if t.cutoff <= now:
                # The cut-off heap normally catches this first; never post past it anyway.
                heapq.heappop(heap)
                self._expire(t)
                continue
            nxt = t.peek()
            if nxt is None:
                heapq.heappop(heap)  # waiting on its own chunks; re-queued when they land
                t.heap_seq = 0
                continue
            start, end, is_last, attempt, first_at = nxt
            nbytes = t.nbytes(start, end)
            if lk.inflight_chunks >= self._s.max_inflight_chunks:
                self._capped_chunks += 1
                return None  # full; a completion on this link wakes it again
            if lk.inflight_chunks and lk.inflight_bytes + nbytes > lk.cap:
                self._capped_bytes += 1
                return None
            heapq.heappop(heap)
            t.take(is_last)
            t.queued_bytes -= nbytes
            t.queued_chunks -= 1
            self._queued_bytes -= nbytes
            self._queued_chunks -= 1
            cid = self._next_chunk_id
            self._next_chunk_id = cid + 1
            first = now if attempt == 0 else first_at
            chunk = Chunk(cid, t.tid, lk.id, start, end, nbytes, is_last, attempt, now, first)
            t.inflight.add(cid)
            self._inflight[cid] = (chunk, t, lk)
            lk.inflight_bytes += nbytes
            lk.inflight_chunks += 1
            self._posted += 1
            if t.peek() is not None:
                self._push(t)
            else:
                t.heap_seq = 0
            return chunk
        return None

    def _sample(self, lk: _Link, chunk: Chunk, now: float, whole: bool) -> None:
        """Fold one completion into the link's bandwidth estimate, and into its whole-push
        estimate when ``whole`` (the chunk is a whole push's).

        The chunk's service time runs from when it was posted or from the link's previous
        completion, whichever is later, so chunks that shared the link are not each charged
        the whole time (nor the time they queued behind each other in the backend). The
        estimate is EWMA(bytes) / EWMA(service time).
        """
        service = max(now - max(chunk.posted_at, lk.last_done_at), self._s.min_sample_s)
        if now > lk.last_done_at:
            lk.last_done_at = now
        a, nbytes = self._s.ewma_alpha, float(chunk.nbytes)
        lk.ewma_bytes, lk.ewma_time = _fold(lk.ewma_bytes, lk.ewma_time, nbytes, service, a)
        lk.bandwidth = lk.ewma_bytes / lk.ewma_time
        lk.cap = max(float(self._s.chunk_bytes), lk.bandwidth * self._s.target_latency_s)
        if whole:
            lk.whole_bytes, lk.whole_time = _fold(lk.whole_bytes, lk.whole_time, nbytes, service, a)
            lk.whole_bandwidth = lk.whole_bytes / lk.whole_time


def _fold(
    ewma_bytes: float, ewma_time: float, nbytes: float, service: float, alpha: float
) -> tuple[float, float]:
    """EWMA(bytes) and EWMA(service time) with one more sample (the first sets them)."""
    if ewma_time == 0.0:
        return nbytes, service
    return ewma_bytes + alpha * (nbytes - ewma_bytes), ewma_time + alpha * (service - ewma_time)
