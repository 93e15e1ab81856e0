"""Leases with generations: D's write permits (``LeaseTable``, grantor) and ``Permit`` (holder).

The holder stops before expiry; the grantor reuses only after expiry plus a clock-skew margin
or the holder's ack (Gray & Cheriton). A stale generation never renews, acks or extends.
P's send lease and its pull permit are plain deadlines of the Sender (``lease_until``,
``pull_until`` in ``core/sender.py``), not entries of a table here.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Hashable
from dataclasses import dataclass, replace
from typing import Generic, Protocol, TypeVar

from kvpush_prod.errors import ConfigError, ProtocolError

K = TypeVar("K", bound=Hashable)


class RandomBits(Protocol):
    def getrandbits(self, k: int, /) -> int: ...


@dataclass(frozen=True, slots=True)
class Lease(Generic[K]):
    """One grant: ``generation`` names it for its whole life; renewals move ``expires_at``."""

    key: K
    generation: int
    expires_at: float


class LeaseState(enum.Enum):
    LIVE = "live"  # granted, renewable
    RELEASED = "released"  # the grantor ended it; the holder may still act until expiry
    EXPIRED = "expired"  # past expires_at: never renewable again
    ACKED = "acked"  # the holder said it is done: reusable at once


class LeaseCheck(enum.Enum):
    """Outcome of ``renew`` / ``ack``; anything but OK means the message changed nothing."""

    OK = "ok"
    STALE = "stale"  # wrong generation: a late message about an earlier grant
    UNKNOWN = "unknown"  # no lease under that key
    EXPIRED = "expired"  # the lease already expired: it cannot come back
    ENDED = "ended"  # released or acked: no more renewals

    @property
    def ok(self) -> bool:
        return self is LeaseCheck.OK


@dataclass(frozen=True, slots=True)
class LeaseSettings:
    """``skew_margin_s`` covers clock drift and message delay between grantor and holder.

    Safety needs ``holder stop_margin + skew_margin_s`` to exceed the worst one-way delay
    of a grant plus the clock drift over one TTL: then no holder acts after reuse.
    """

    skew_margin_s: float = 1.0
    first_generation: int = 1
    # Low bits of every generation drawn at random (with ``rng``): a generation then names
    # its grant unguessably, so only the holder it was sent to can speak for it. The high
    # bits still count up, so generations of one key stay ordered.
    random_bits: int = 0

    def __post_init__(self) -> None:
        if not (self.skew_margin_s >= 0 and math.isfinite(self.skew_margin_s)):
            raise ConfigError(f"lease skew_margin_s must be >= 0 seconds, got {self.skew_margin_s}")
        if not 0 <= self.random_bits <= 32:
            raise ConfigError(f"lease random_bits must be 0-32, got {self.random_bits}")
        if self.first_generation < 1:
            raise ConfigError(
                f"lease first_generation must be >= 1 (0 means none), got {self.first_generation}"
            )


@dataclass(frozen=True, slots=True)
class LeaseStats:
    granted: int
    renewed: int
    expired: int
    rejected_stale: int
    rejected_other: int


@dataclass(slots=True)
class _Entry(Generic[K]):
    lease: Lease[K]
    ttl: float
    state: LeaseState


class LeaseTable(Generic[K]):
    """Grantor side: every lease this side handed out, by key (a transfer id, usually).

    Used by D alone (``Receiver.leases``): the write permits on its reserved blocks. P keeps
    no table: its send lease on finished blocks is a deadline per transfer in the Sender.
    Generations are unique and increasing over the whole table.
    """

    def __init__(
        self, settings: LeaseSettings | None = None, rng: RandomBits | None = None
    ) -> None:
        self._settings = settings if settings is not None else LeaseSettings()
        if self._settings.random_bits and rng is None:
            raise ConfigError("a LeaseTable with random_bits needs an rng")
        self._rng = rng
        self._entries: dict[K, _Entry[K]] = {}
        self._next_generation = self._settings.first_generation
        # (expires_at, generation, key): lazy heap, an entry is current only if it still
        # matches the lease's generation and expiry.
        self._expiry: list[tuple[float, int, K]] = []
        self._granted = 0
        self._renewed = 0
        self._expired = 0
        self._rejected_stale = 0
        self._rejected_other = 0

    def tables(self, prefix: str) -> dict[str, tuple[int, int | None]]:
        """Entries of the leases and of their expiry heap (lazy: replaced entries leave as
        they come up), named ``prefix.table``; no bound of their own."""
        return {
            f"{prefix}": (len(self._entries), None),
            f"{prefix}_expiry": (len(self._expiry), None),
        }

    @property
    def settings(self) -> LeaseSettings:
        return self._settings

    def grant(self, key: K, now: float, ttl: float) -> Lease[K]:
        """A new lease on ``key`` with a fresh generation, valid until ``now + ttl``.

        Refused while an earlier lease on ``key`` is not reusable yet: its holder may still
        act on it, so granting again could let two holders touch the same blocks.
        """
        if not (ttl > 0 and math.isfinite(ttl)):
            raise ProtocolError("bad lease ttl", f"ttl must be a finite number > 0, got {ttl!r}")
        old = self._entries.get(key)
        if old is not None and not self._reusable(old, now):
            raise ProtocolError(
                "lease still held",
                f"key {key!r} has generation {old.lease.generation} "
                f"({old.state.value}, expires at {old.lease.expires_at:.3f}); "
                "wait until reusable() or an ack before granting again",
            )
        generation = self._next_generation
        self._next_generation += 1
        bits = self._settings.random_bits
        if bits and self._rng is not None:
            # Counter bits wrap before 2**63: only one key's generations need to be ordered.
            counter = generation % (1 << (63 - bits - 1))
            generation = (counter << bits) | self._rng.getrandbits(bits)
            generation = generation or 1  # 0 means "none"
        lease = Lease(key, generation, now + ttl)
        self._entries[key] = _Entry(lease, ttl, LeaseState.LIVE)
        self._push_expiry(lease)
        self._granted += 1
        return lease

    def get(self, key: K) -> Lease[K] | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.lease

    def state(self, key: K) -> LeaseState | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.state

    def renew(self, key: K, generation: int, now: float, ttl: float | None = None) -> LeaseCheck:
        """Extend a live lease to ``now + ttl`` (default: its granted ttl); never shortens it.

        Never shortening matters: the holder computed its own expiry from the longer term.
        """
        entry, check = self._match(key, generation)
        if entry is None:
            return check
        # Past its expiry it is dead even before expire() reports it (expire() still will).
        if entry.state is LeaseState.EXPIRED or now >= entry.lease.expires_at:
            self._rejected_other += 1
            return LeaseCheck.EXPIRED
        if entry.state is not LeaseState.LIVE:
            self._rejected_other += 1
            return LeaseCheck.ENDED
        term = entry.ttl if ttl is None else ttl
        if not (term > 0 and math.isfinite(term)):
            raise ProtocolError("bad lease ttl", f"ttl must be a finite number > 0, got {term!r}")
        expires_at = now + term
        if expires_at > entry.lease.expires_at:
            entry.lease = replace(entry.lease, expires_at=expires_at)
            self._push_expiry(entry.lease)
        self._renewed += 1
        return LeaseCheck.OK

    def release(self, key: K) -> bool:
        """The grantor stops renewing ``key``; the holder may still act until expiry.

        Idempotent; returns whether a live lease was released.
        """
        entry = self._entries.get(key)
        if entry is None or entry.state is not LeaseState.LIVE:
            return False
        entry.state = LeaseState.RELEASED
        return True

    def ack(self, key: K, generation: int) -> LeaseCheck:
        """The holder of ``generation`` will not act on ``key`` again: reusable at once."""
        entry, check = self._match(key, generation)
        if entry is None:
            return check
        entry.state = LeaseState.ACKED
        return LeaseCheck.OK

    def expire(self, now: float) -> list[K]:
        """Keys whose lease passed its expiry since the last call, each reported once.

        A released lease that expires is reported too: its holder's term is over as well.
        """
        out: list[K] = []
        heap = self._expiry
        while heap and heap[0][0] <= now:
            expires_at, generation, key = heapq.heappop(heap)
            entry = self._entries.get(key)
            if (
                entry is None
                or entry.lease.generation != generation
                or entry.lease.expires_at != expires_at
                or entry.state not in (LeaseState.LIVE, LeaseState.RELEASED)
            ):
                continue  # superseded by a renewal, a new grant, an ack or forget()
            self._mark_expired(entry)
            out.append(key)
        return out

    def reusable(self, key: K, now: float) -> bool:
        """Whether what ``key`` guarded may be reused: acked, or expired plus the skew margin.

        A key with no lease is reusable (nothing fences it).
        """
        entry = self._entries.get(key)
        return entry is None or self._reusable(entry, now)

    def forget(self, key: K, now: float) -> None:
        """Drop a reusable lease from the table; raises if it is not reusable yet."""
        entry = self._entries.get(key)
        if entry is None:
            return
        if not self._reusable(entry, now):
            raise ProtocolError(
                "lease not reusable",
                f"key {key!r} generation {entry.lease.generation} is {entry.state.value} "
                f"until {entry.lease.expires_at + self._settings.skew_margin_s:.3f} "
                f"(now {now:.3f}); wait for its ack or for expiry plus the skew margin",
            )
        del self._entries[key]
        if not self._entries:
            # No lease left: every heap entry is stale. Dropped now, so an idle engine holds
            # none (expire() pops them only when called, and an idle pump does not call it).
            self._expiry.clear()

    def reusable_at(self, key: K) -> float | None:
        """The earliest time ``key`` becomes reusable without an ack (None: no lease)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.state is LeaseState.ACKED:
            return -math.inf
        return entry.lease.expires_at + self._settings.skew_margin_s

    def next_expiry(self) -> float | None:
        """When ``expire`` may next report something (for the shell's timer)."""
        return self._expiry[0][0] if self._expiry else None

    def keys(self) -> list[K]:
        return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def stats(self) -> LeaseStats:
        return LeaseStats(
            granted=self._granted,
            renewed=self._renewed,
            expired=self._expired,
            rejected_stale=self._rejected_stale,
            rejected_other=self._rejected_other,
        )

    # -- internals -------------------------------------------------------------------------

    def _match(self, key: K, generation: int) -> tuple[_Entry[K] | None, LeaseCheck]:
        entry = self._entries.get(key)
        if entry is None:
            self._rejected_other += 1
            return None, LeaseCheck.UNKNOWN
        if entry.lease.generation != generation:
            self._rejected_stale += 1
            return None, LeaseCheck.STALE
        return entry, LeaseCheck.OK

    def _push_expiry(self, lease: Lease[K]) -> None:
        heapq.heappush(self._expiry, (lease.expires_at, lease.generation, lease.key))
        if len(self._expiry) > 2 * len(self._entries) + 64:
            # Every renewal leaves a stale entry behind: rebuild (amortised O(1)).
            self._expiry = [
                (e.lease.expires_at, e.lease.generation, e.lease.key)
                for e in self._entries.values()
                if e.state in (LeaseState.LIVE, LeaseState.RELEASED)
            ]
            heapq.heapify(self._expiry)

    def _mark_expired(self, entry: _Entry[K]) -> None:
        entry.state = LeaseState.EXPIRED
        self._expired += 1

    def _reusable(self, entry: _Entry[K], now: float) -> bool:
        if entry.state is LeaseState.ACKED:
            return True
        return now >= entry.lease.expires_at + self._settings.skew_margin_s


ROUNDING_S = 1e-9  # holders stop this much early: float rounding never favours reuse


@dataclass(frozen=True, slots=True)
class Permit:
    """Holder side of a lease: P's permit to write D's blocks (``Sender``), or D's permit to
    READ P's blocks after a FALLBACK (``Receiver``: ``read_permit``).

    The holder stops ``stop_margin`` before ``expires_at``: its clock and the grantor's
    differ, and a chunk posted just before expiry still needs time to land.
    """

    key: str
    generation: int
    expires_at: float
    stop_margin: float

    def __post_init__(self) -> None:
        if not self.stop_margin >= 0:
            raise ProtocolError(
                "bad permit stop margin", f"stop_margin must be >= 0, got {self.stop_margin!r}"
            )

    @classmethod
    def from_ttl(
        cls, key: str, generation: int, ttl: float, received_at: float, stop_margin: float
    ) -> Permit:
        """A permit from a grant received at ``received_at`` (local clock) with ``ttl``."""
        if not (ttl > 0 and math.isfinite(ttl)):
            raise ProtocolError("bad permit ttl", f"ttl must be a finite number > 0, got {ttl!r}")
        return cls(key, generation, received_at + ttl, stop_margin)

    @property
    def stop_at(self) -> float:
        """The last instant (exclusive) at which the holder may start acting on the permit."""
        return self.expires_at - self.stop_margin

    def usable(self, now: float) -> bool:
        # ROUNDING_S: when the delay equals the stop margin exactly, ``received + ttl - stop``
        # can round one ulp past the grantor's ``grant + ttl``; the holder stops that much
        # earlier rather than later (found by the lease property test).
        return now < self.stop_at - ROUNDING_S

    def renewed(self, generation: int, expires_at: float) -> Permit:
        """This permit extended to ``expires_at``; a stale generation is rejected.

        The expiry never moves earlier: a late, shorter renewal changes nothing.
        """
        if generation != self.generation:
            raise ProtocolError(
                "stale permit generation",
                f"permit {self.key!r} is generation {self.generation}, renewal names "
                f"{generation}; drop the renewal",
            )
        if expires_at <= self.expires_at:
            return self
        return replace(self, expires_at=expires_at)
