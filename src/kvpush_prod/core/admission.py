"""D's admission of inbound transfers, one request at a time: the credit asks, the prefix
hit, a refusal turned into a recompute, and what P must hear of each (wait, not needed).

The shell (vLLM's scheduler side, the simulator, the test world) asks on every scheduler
step and says what the answers tell it to; the decisions and the bookkeeping are here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from kvpush_prod.core.commands import AdmissionOver, AwaitAdmission, NotNeeded, ReceiveCommand
from kvpush_prod.core.credits import CreditLedger, Decision
from kvpush_prod.core.vocabulary import Notice, Outcome, Word

T = TypeVar("T")


class Verdict(Word):
    """What D's scheduler does with the request now."""

    LOAD = "load"  # admitted: allocate the blocks; P pushes ``tokens`` tokens into them
    LATER = "later"  # no credit yet: ask again on a later step
    LOCAL = "local"  # no transfer: D computes the prompt (or already has it)


def blocks_to_receive(
    num_prompt_tokens: int, num_computed_tokens: int, block_size: int
) -> tuple[int, int]:
    """(first block, block count) of the prompt D must receive: every block from the first
    one D has not computed (whole blocks of a prefix-cache hit stay D's own)."""
    first = num_computed_tokens // block_size
    return first, -(-num_prompt_tokens // block_size) - first


@dataclass(eq=False)
class Inbound(Generic[T]):
    """One request's inbound transfer on D, from its first ask until it ends.

    ``remote``: whatever the shell needs to reach the prefill engine (kept for it).
    ``first_block`` / ``nblocks``: the span to receive, computed at each ask; ``nblocks`` is
    the number of blocks actually allocated once ``allocated``.
    """

    key: str  # the request (vLLM's request id)
    transfer_id: str
    peer: str  # the prefill engine, as the credit ledger counts it
    remote: T
    first_block: int = 0
    nblocks: int = 0
    waiting: bool = False  # told LATER (P has been asked to keep its blocks)
    admitted: bool = False  # credit granted
    allocated: bool = False  # blocks allocated, REGISTER sent
    aborting: bool = False  # the request ended while receiving: waiting for the fence


@dataclass(frozen=True, slots=True)
class Answer:
    """The answer to one ask, and what changed with it for the shell to say.

    ``decision`` is the credit ledger's (None where it was not asked: a prefix hit, a
    request whose transfer is over). ``first_admit``: count the admission and the
    ``nblocks`` credited. ``first_wait``: tell P to keep its blocks (AwaitAdmission).
    ``wait_over``: tell P the wait is over (AdmissionOver). ``not_needed``: tell P it may
    free its blocks (NotNeeded), and count this outcome.
    """

    verdict: Verdict
    decision: Decision | None = None
    tokens: int = 0
    nblocks: int = 0
    first_admit: bool = False
    first_wait: bool = False
    wait_over: bool = False
    not_needed: Outcome | None = None
    reason: str = ""

    @property
    def notices(self) -> tuple[Notice, ...]:
        """What P must hear of this answer, in order."""
        return tuple(
            n
            for n, due in (
                (Notice.WAIT, self.first_wait),
                (Notice.OVER, self.wait_over),
                (Notice.NOT_NEEDED, self.not_needed is not None),
            )
            if due
        )

    def commands(self, transfer_id: str, address: str, owner: str = "") -> list[ReceiveCommand]:
        """This answer's notices as D's commands for the prefill engine at ``address``
        (``owner``: its identity): a shell passes them on as they are."""
        return [notice_command(n, transfer_id, address, owner) for n in self.notices]


def notice_command(
    notice: Notice, transfer_id: str, address: str, owner: str = ""
) -> ReceiveCommand:
    """The one translation of an admission notice into D's command."""
    if notice is Notice.WAIT:
        return AwaitAdmission(transfer_id, address, owner)
    if notice is Notice.OVER:
        return AdmissionOver(transfer_id)
    return NotNeeded(transfer_id, address, owner)


@dataclass(frozen=True, slots=True)
class Finish(Generic[T]):
    """What a request that ended means for its transfer: nothing (``rx`` None), P may free
    its blocks (``not_needed``, before any block was allocated), or the receive must be
    aborted (``abort``: D's blocks stay until P acked or the permit expired)."""

    rx: Inbound[T] | None
    not_needed: Outcome | None = None
    abort: bool = False


class Admissions(Generic[T]):
    """D's inbound transfers by request, admitted through one ``CreditLedger``.

    A request is asked about on every scheduler step until it is admitted, refused or
    found in the prefix cache; once its transfer is over (or it never had one) it is not
    asked about again until the request ends (``finish``).
    """

    def __init__(self, ledger: CreditLedger, block_size: int) -> None:
        self.ledger = ledger
        self.block_size = block_size
        self._rx: dict[str, Inbound[T]] = {}
        self._over: set[str] = set()  # requests whose transfer is over (or that had none)
        # transfer id -> the one request receiving it: a transfer id is one request's KV,
        # so a second live request naming it is refused (it would get the first's KV).
        self._by_tid: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._rx)

    def tables(self) -> dict[str, tuple[int, int | None]]:
        """Entries of the inbound transfers, the requests whose transfer is over, the
        transfer ids held, and the credit ledger's tables."""
        return {
            "admission.inbound": (len(self._rx), None),
            "admission.over": (len(self._over), None),
            "admission.transfer_ids": (len(self._by_tid), None),
            **self.ledger.tables(),
        }

    def get(self, key: str) -> Inbound[T] | None:
        return self._rx.get(key)

    def entries(self) -> list[Inbound[T]]:
        return list(self._rx.values())

    @property
    def aborting(self) -> int:
        """Receives aborted and waiting for their fence."""
        return sum(1 for rx in self._rx.values() if rx.aborting)

    def is_over(self, key: str) -> bool:
        """The request's transfer is over or it never had one: it loads nothing more."""
        return key in self._over

    def skip(self, key: str) -> None:
        """The request will not receive (e.g. its transfer parameters were refused)."""
        self._over.add(key)

    def holder(self, transfer_id: str) -> str | None:
        """The request receiving ``transfer_id`` now (None: no live request does)."""
        return self._by_tid.get(transfer_id)

    def track(self, key: str, transfer_id: str, peer: str, remote: T) -> Inbound[T] | None:
        """The inbound transfer of ``key`` (made on first sight); None when another live
        request receives ``transfer_id`` already (``key`` is then not tracked: the shell
        refuses it, and nothing of the other request's transfer changes)."""
        rx = self._rx.get(key)
        if rx is None:
            holder = self._by_tid.get(transfer_id)
            if holder is not None and holder != key:
                return None
            rx = self._rx[key] = Inbound(key, transfer_id, peer, remote)
            self._by_tid[transfer_id] = key
        return rx

    def _untrack(self, key: str) -> Inbound[T] | None:
        rx = self._rx.pop(key, None)
        if rx is not None and self._by_tid.get(rx.transfer_id) == key:
            del self._by_tid[rx.transfer_id]
        return rx

    def ask(
        self,
        key: str,
        num_prompt_tokens: int,
        num_computed_tokens: int,
        now: float,
        free_blocks: int | None = None,
    ) -> Answer:
        """May the tracked request ``key`` load its prompt's missing tokens from P now?

        ``free_blocks``: the blocks free in D's KV cache now (None: unknown, the credit
        budget alone decides). Blocks already granted to other requests but not allocated
        yet are taken off it, so a grant never counts on blocks promised to another.
        """
        rx = self._rx.get(key)
        if rx is None:
            return Answer(Verdict.LOCAL)
        tokens = num_prompt_tokens - num_computed_tokens
        if tokens <= 0:
            # Everything is in D's prefix cache already: P can free its blocks now.
            return self._give_up(rx, Outcome.PREFIX_HIT)
        rx.first_block, rx.nblocks = blocks_to_receive(
            num_prompt_tokens, num_computed_tokens, self.block_size
        )
        capacity = None
        if free_blocks is not None:
            capacity = max(0, free_blocks - self.promised(exclude=key))
        admission = self.ledger.request(rx.transfer_id, rx.peer, rx.nblocks, now, capacity)
        decision = admission.decision
        if decision is Decision.ADMIT:
            first_admit, wait_over = not rx.admitted, rx.waiting
            rx.admitted, rx.waiting = True, False
            return Answer(
                Verdict.LOAD,
                decision,
                tokens,
                rx.nblocks,
                first_admit=first_admit,
                wait_over=wait_over,
                reason=admission.reason,
            )
        if decision is Decision.LATER:
            # An admitted request asked again with more blocks (a smaller prefix hit) may
            # lose its credit here: it waits like any other.
            rx.admitted = False
            first_wait, rx.waiting = not rx.waiting, True
            return Answer(
                Verdict.LATER,
                decision,
                nblocks=rx.nblocks,
                first_wait=first_wait,
                reason=admission.reason,
            )
        # It can never fit the credit budget: D computes the prompt itself.
        answer = self._give_up(rx, Outcome.RECOMPUTE)
        return Answer(
            Verdict.LOCAL,
            decision,
            nblocks=rx.nblocks,
            not_needed=answer.not_needed,
            reason=admission.reason,
        )

    def promised(self, exclude: str = "") -> int:
        """Blocks granted (credit held) whose allocation has not happened yet."""
        return sum(
            rx.nblocks
            for rx in self._rx.values()
            if rx.admitted and not rx.allocated and rx.key != exclude
        )

    def allocated(self, key: str, nblocks: int) -> Inbound[T] | None:
        """The blocks for ``key`` are allocated (``nblocks`` of them): it is received now."""
        rx = self._rx.get(key)
        if rx is None:
            return None
        rx.allocated, rx.nblocks = True, nblocks
        self._over.add(key)
        return rx

    def withdraw(self, key: str) -> None:
        """Admitted, but the blocks could not be allocated: give the credit back and ask
        again later (vLLM instead keeps the credit and asks again)."""
        rx = self._rx.get(key)
        if rx is not None and not rx.allocated:
            self.ledger.release(rx.transfer_id)
            rx.admitted = False

    def drop(self, key: str) -> Inbound[T] | None:
        """Forget ``key``'s transfer before any REGISTER left (a shell could not carry it
        out): its credit comes back, it is not asked about again. The entry, or None."""
        rx = self._untrack(key)
        self._over.add(key)
        if rx is not None:
            self.ledger.release(rx.transfer_id)
        return rx

    def finish(self, key: str) -> Finish[T]:
        """The request ended (finished or aborted)."""
        self._over.discard(key)
        rx = self._rx.get(key)
        if rx is None:
            return Finish(None)
        if not rx.allocated:
            # Aborted while waiting for admission: P can free now.
            return Finish(rx, self._give_up(rx, Outcome.ABORTED).not_needed)
        rx.aborting = True
        return Finish(rx, abort=True)

    def ended(self, key: str) -> tuple[Inbound[T] | None, bool]:
        """The receive of ``key`` ended (reported finished or failed): its credit is returned.
        The entry (None if unknown) and whether credit was held for it."""
        rx = self._untrack(key)
        if rx is None:
            return None, False
        return rx, self.ledger.release(rx.transfer_id)

    def _give_up(self, rx: Inbound[T], outcome: Outcome) -> Answer:
        self._untrack(rx.key)
        self._over.add(rx.key)
        self.ledger.release(rx.transfer_id)
        return Answer(Verdict.LOCAL, not_needed=outcome)
