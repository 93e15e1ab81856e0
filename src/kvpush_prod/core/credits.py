"""D's inbound credit ledger: admits transfers only within a KV-block budget and per-peer caps.

Answers ADMIT / LATER / REFUSE per waiting request, never a wait that cannot end, with aging.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvpush_prod.errors import ConfigError, ProtocolError

TransferId = str
PeerId = str


class Decision(enum.Enum):
    """What D's scheduler does with a request that needs KV blocks from a peer."""

    ADMIT = "admit"  # allocate the blocks now and send REGISTER (the REGISTER is the grant)
    LATER = "later"  # ask again on a later scheduler step
    REFUSE = "refuse"  # can never fit: compute the prompt locally instead


@dataclass(frozen=True, slots=True)
class Admission:
    """The answer to one ``CreditLedger.request``; ``reason`` says why, with the numbers."""

    decision: Decision
    reason: str

    @property
    def admitted(self) -> bool:
        return self.decision is Decision.ADMIT


@dataclass(frozen=True, slots=True)
class CreditSettings:
    """Sizes and bounds of the ledger (the shell derives the budget from D's KV cache).

    ``aging_s``: a transfer told LATER for this long gets priority; others are held back
    until it fits. ``stale_waiter_s``: a waiter that has not asked again for this long is
    forgotten (its request was aborted without a ``release``), so it cannot block others.
    """

    budget_blocks: int
    per_peer_cap_blocks: int
    aging_s: float = 2.0
    stale_waiter_s: float = 30.0

    @classmethod
    def from_fractions(
        cls, num_blocks: int, budget_fraction: float, per_peer_fraction: float
    ) -> CreditSettings:
        """A budget of ``budget_fraction`` of D's ``num_blocks`` KV blocks, a peer cap of
        ``per_peer_fraction`` of the budget (each at least one block)."""
        budget = max(1, int(budget_fraction * num_blocks))
        return cls(
            budget_blocks=budget, per_peer_cap_blocks=max(1, int(per_peer_fraction * budget))
        )

    def __post_init__(self) -> None:
        if self.budget_blocks < 0:
            raise ConfigError(f"credit budget_blocks must be >= 0, got {self.budget_blocks}")
        if self.per_peer_cap_blocks < 0:
            raise ConfigError(
                f"credit per_peer_cap_blocks must be >= 0, got {self.per_peer_cap_blocks}"
            )
        if not self.aging_s >= 0:
            raise ConfigError(f"credit aging_s must be >= 0 seconds, got {self.aging_s}")
        if not self.stale_waiter_s > 0:
            raise ConfigError(
                f"credit stale_waiter_s must be > 0 seconds, got {self.stale_waiter_s}"
            )


@dataclass(frozen=True, slots=True)
class PeerCredit:
    """Absolute, cumulative counters for one peer (re-sending them is idempotent)."""

    granted_total: int
    released_total: int
    cap: int

    @property
    def in_use(self) -> int:
        return self.granted_total - self.released_total


@dataclass(frozen=True, slots=True)
class CreditStats:
    """Counters for metrics; all are cumulative since the ledger was made."""

    admitted: int
    later: int
    refused: int
    released: int
    duplicate_releases: int
    stale_waiters_dropped: int


@dataclass(slots=True)
class _Holding:
    peer: PeerId
    nblocks: int


@dataclass(slots=True)
class _Waiter:
    peer: PeerId
    nblocks: int
    since: float  # first LATER: aging counts from here
    last_asked: float


@dataclass(slots=True)
class _PeerCounters:
    granted_total: int = 0
    released_total: int = 0


class CreditLedger:
    """D's receive window in KV blocks, over all peers, with a cap per peer.

    Invariant: blocks in use never exceed ``budget_blocks`` and a peer's blocks in use never
    exceed ``per_peer_cap_blocks``. Bounded wait: a transfer that keeps asking is admitted
    within ``aging_s + (k + 1) * T`` of its first LATER, where ``k`` is the number of
    transfers already waiting then and ``T`` bounds how long an admitted transfer holds
    its credit (the transfer deadlines guarantee such a ``T``).
    """

    def __init__(self, settings: CreditSettings) -> None:
        self._settings = settings
        self._held: dict[TransferId, _Holding] = {}
        # Insertion order is the order of first LATER, so the first entry is the oldest.
        self._waiting: dict[TransferId, _Waiter] = {}
        self._peers: dict[PeerId, _PeerCounters] = {}
        self._in_use = 0
        self._admitted = 0
        self._later = 0
        self._refused = 0
        self._released = 0
        self._duplicate_releases = 0
        self._stale_dropped = 0

    def tables(self) -> dict[str, tuple[int, int | None]]:
        """Entries of the ledger's tables: transfers holding credit, waiting, and peers."""
        return {
            "credits.held": (len(self._held), None),
            "credits.waiting": (len(self._waiting), None),
            "credits.peers": (len(self._peers), None),
        }

    @property
    def settings(self) -> CreditSettings:
        return self._settings

    def request(
        self,
        transfer_id: TransferId,
        peer: PeerId,
        nblocks: int,
        now: float,
        capacity: int | None = None,
    ) -> Admission:
        """Decide whether ``transfer_id`` may reserve ``nblocks`` blocks for ``peer`` now.

        Asking again for an admitted transfer with the same peer and size answers ADMIT
        again (the scheduler may ask on every step until it allocates). A different size
        (the prefix hit changed between asks) adjusts the grant: a smaller one shrinks in
        place and stays admitted; a larger one is decided afresh, as a new request would
        be (so it may lose its credit and wait). Another peer is a ProtocolError.

        ``capacity``: the blocks D can hold for new grants now (its KV cache's free blocks
        less those promised to grants not yet allocated; None: unknown). A grant never
        exceeds it: the budget is a cap on top of D's real room, never a promise of room.
        Capacity comes and goes, so a request it cannot hold now waits (LATER); only the
        budget and the per-peer cap refuse.
        """
        if nblocks < 0:
            raise ProtocolError(
                "negative credit request",
                f"transfer {transfer_id!r} asked for {nblocks} blocks; ask for >= 0",
            )
        again = self._asked_again(transfer_id, peer, nblocks)
        if again is not None:
            return again
        s = self._settings
        if nblocks > s.budget_blocks or nblocks > s.per_peer_cap_blocks:
            # Never answer LATER to something that can never fit: that wait would not end.
            self._waiting.pop(transfer_id, None)
            self._refused += 1
            return Admission(
                Decision.REFUSE,
                f"needs {nblocks} blocks but the budget is {s.budget_blocks} and the "
                f"per-peer cap is {s.per_peer_cap_blocks}",
            )
        reason = self._why_not_now(transfer_id, peer, nblocks, now, capacity)
        if not reason:
            self._admit(transfer_id, peer, nblocks)
            return Admission(Decision.ADMIT, f"{nblocks} blocks granted")
        self._wait(transfer_id, peer, nblocks, now)
        return Admission(Decision.LATER, reason)

    def _asked_again(self, transfer_id: TransferId, peer: PeerId, nblocks: int) -> Admission | None:
        """The answer for a transfer already granted (None: decide it as a new one; a
        larger ask gives the grant back first)."""
        held = self._held.get(transfer_id)
        if held is None:
            return None
        if held.peer != peer:
            raise ProtocolError(
                "conflicting credit request",
                f"transfer {transfer_id!r} already holds {held.nblocks} blocks from peer "
                f"{held.peer!r} but asked for {nblocks} from {peer!r}; release it first",
            )
        if held.nblocks == nblocks:
            return Admission(Decision.ADMIT, "already admitted")
        if nblocks < held.nblocks:
            # The local prefix hit grew between asks (vLLM asks again after a failed
            # allocation): fewer blocks to receive, the credit shrinks in place.
            self._shrink(held, nblocks)
            return Admission(Decision.ADMIT, f"credit reduced to {nblocks} blocks")
        # More blocks than granted: give the grant back and ask like a new transfer.
        self._unhold(transfer_id)
        return None

    def _why_not_now(
        self, transfer_id: TransferId, peer: PeerId, nblocks: int, now: float, capacity: int | None
    ) -> str:
        """Why ``nblocks`` cannot be granted now ("" when they can)."""
        s = self._settings
        head = self._aged_head(now, exclude=transfer_id)
        peer_used = self._peer_in_use(peer)
        budget_free = s.budget_blocks - self._in_use
        free = budget_free if capacity is None else min(budget_free, max(0, capacity))
        peer_free = s.per_peer_cap_blocks - peer_used
        if nblocks > budget_free:
            return f"budget full: {self._in_use}/{s.budget_blocks} blocks in use"
        if nblocks > free:
            return f"KV cache full: {capacity} blocks free for new transfers, {nblocks} needed"
        if nblocks > peer_free:
            return f"peer {peer!r} at cap: {peer_used}/{s.per_peer_cap_blocks} blocks in use"
        if head is not None and not self._leaves_room(head, peer, nblocks, free, peer_free):
            head_id, head_waiter = head
            return (
                f"held back for transfer {head_id!r} ({head_waiter.nblocks} blocks), "
                f"waiting since {head_waiter.since:.3f}"
            )
        return ""

    def _wait(self, transfer_id: TransferId, peer: PeerId, nblocks: int, now: float) -> None:
        waiter = self._waiting.get(transfer_id)
        if waiter is None:
            self._waiting[transfer_id] = _Waiter(peer, nblocks, since=now, last_asked=now)
        else:
            # The size may change between asks (prefix-cache hits); the age is kept.
            waiter.peer = peer
            waiter.nblocks = nblocks
            waiter.last_asked = max(waiter.last_asked, now)
        self._later += 1

    def release(self, transfer_id: TransferId) -> bool:
        """Return a transfer's credit (done, failed, aborted, lease expired).

        Also forgets a transfer that was only waiting. Idempotent: a second release is a
        no-op, counted in ``duplicate_releases``; returns whether credit was returned.
        """
        self._waiting.pop(transfer_id, None)
        held = self._held.pop(transfer_id, None)
        if held is None:
            self._duplicate_releases += 1
            return False
        self._in_use -= held.nblocks
        self._peers[held.peer].released_total += held.nblocks
        self._released += 1
        return True

    def holds(self, transfer_id: TransferId) -> bool:
        return transfer_id in self._held

    def is_waiting(self, transfer_id: TransferId) -> bool:
        return transfer_id in self._waiting

    @property
    def in_use(self) -> int:
        """Blocks granted and not yet released, over all peers."""
        return self._in_use

    @property
    def free(self) -> int:
        return self._settings.budget_blocks - self._in_use

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def peer_credit(self, peer: PeerId) -> PeerCredit:
        c = self._peers.get(peer)
        cap = self._settings.per_peer_cap_blocks
        if c is None:
            return PeerCredit(0, 0, cap)
        return PeerCredit(c.granted_total, c.released_total, cap)

    def peers(self) -> list[PeerId]:
        return list(self._peers)

    def stats(self) -> CreditStats:
        return CreditStats(
            admitted=self._admitted,
            later=self._later,
            refused=self._refused,
            released=self._released,
            duplicate_releases=self._duplicate_releases,
            stale_waiters_dropped=self._stale_dropped,
        )

    # -- internals -------------------------------------------------------------------------

    def _peer_in_use(self, peer: PeerId) -> int:
        c = self._peers.get(peer)
        return 0 if c is None else c.granted_total - c.released_total

    def _admit(self, transfer_id: TransferId, peer: PeerId, nblocks: int) -> None:
        self._waiting.pop(transfer_id, None)
        self._held[transfer_id] = _Holding(peer, nblocks)
        self._in_use += nblocks
        counters = self._peers.get(peer)
        if counters is None:
            counters = self._peers[peer] = _PeerCounters()
        counters.granted_total += nblocks
        self._admitted += 1

    def _shrink(self, held: _Holding, nblocks: int) -> None:
        diff = held.nblocks - nblocks
        held.nblocks = nblocks
        self._in_use -= diff
        self._peers[held.peer].released_total += diff

    def _unhold(self, transfer_id: TransferId) -> None:
        held = self._held.pop(transfer_id)
        self._in_use -= held.nblocks
        self._peers[held.peer].released_total += held.nblocks

    def _aged_head(self, now: float, exclude: TransferId) -> tuple[TransferId, _Waiter] | None:
        """The oldest waiter if it has waited past the aging bound (and is not ``exclude``)."""
        s = self._settings
        while self._waiting:
            head_id = next(iter(self._waiting))
            head = self._waiting[head_id]
            if head_id != exclude and now - head.last_asked > s.stale_waiter_s:
                # Its request went away without a release; do not let it block everyone.
                del self._waiting[head_id]
                self._stale_dropped += 1
                continue
            if head_id == exclude or now - head.since < s.aging_s:
                return None
            return head_id, head
        return None

    @staticmethod
    def _leaves_room(
        head: tuple[TransferId, _Waiter], peer: PeerId, nblocks: int, free: int, peer_free: int
    ) -> bool:
        """Whether granting ``nblocks`` to ``peer`` still leaves the aged head able to fit.

        Admissions that keep the head's room never delay it, so they need not wait.
        """
        waiter = head[1]
        if free - nblocks < waiter.nblocks:
            return False
        return waiter.peer != peer or peer_free - nblocks >= waiter.nblocks
