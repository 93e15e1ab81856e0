"""The per-transfer state machine, shared by P and D: one (state, event) -> state table.

Every transition is in TRANSITIONS; the machine does not know its side. Phases only move
forward, DONE / FAILED / CANCELLED are terminal and sticky, and every live state has a deadline.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvpush_prod.errors import ConfigError, ProtocolError


class TransferState(enum.Enum):
    NEW = "NEW"  # known by id only
    WAITING_BLOCKS = "WAITING_BLOCKS"  # registration known, this side's blocks not yet
    WAITING_REGISTER = "WAITING_REGISTER"  # this side's blocks ready, registration not yet
    REGISTERED = "REGISTERED"  # both known: data may move
    PUSHING = "PUSHING"  # chunks (WRITEs) posted
    RETRYING = "RETRYING"  # a chunk failed and waits for its backoff to re-post
    FALLBACK = "FALLBACK"  # D pulls (READs) what the push did not deliver
    DONE = "DONE"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


class TransferEvent(enum.Enum):
    REGISTER = "REGISTER"  # D: REGISTER sent; P: REGISTER received
    BLOCKS_READY = "BLOCKS_READY"  # D: receive blocks reserved; P: prefill's blocks held
    CHUNK_POSTED = "CHUNK_POSTED"
    CHUNK_DONE = "CHUNK_DONE"
    CHUNK_ERROR = "CHUNK_ERROR"
    RETRY = "RETRY"  # every failed chunk has been posted again
    FALLBACK = "FALLBACK"  # P: FALLBACK sent; D: FALLBACK received
    PULL_DONE = "PULL_DONE"  # D: every READ done; P: PullDone(ok) received
    DONE = "DONE"  # D: DONE notification matched; P: last WRITE (or bare DONE) completed
    CANCEL = "CANCEL"  # D aborted (D: decided; P: CANCEL received)
    FAIL = "FAIL"  # given up (FATAL error, Failed received, failed pull)
    EXPIRE = "EXPIRE"  # a deadline or a lease ran out


S, E = TransferState, TransferEvent

TERMINAL: frozenset[TransferState] = frozenset({S.DONE, S.FAILED, S.CANCELLED})
LIVE: tuple[TransferState, ...] = tuple(s for s in TransferState if s not in TERMINAL)

# Phases only grow along any transition (PUSHING and RETRYING share one phase).
PHASE: Mapping[TransferState, int] = MappingProxyType({
    S.NEW: 0,
    S.WAITING_BLOCKS: 1, S.WAITING_REGISTER: 1,
    S.REGISTERED: 2,
    S.PUSHING: 3, S.RETRYING: 3,
    S.FALLBACK: 4,
    S.DONE: 5, S.FAILED: 5, S.CANCELLED: 5,
})  # fmt: skip

_TABLE: dict[tuple[TransferState, TransferEvent], TransferState] = {
    # Either the registration or the blocks come first; both are needed to move data.
    (S.NEW, E.REGISTER): S.WAITING_BLOCKS,
    (S.NEW, E.BLOCKS_READY): S.WAITING_REGISTER,
    (S.WAITING_BLOCKS, E.BLOCKS_READY): S.REGISTERED,
    (S.WAITING_REGISTER, E.REGISTER): S.REGISTERED,
    # Push. DONE straight from REGISTERED: D sees no chunk, and a transfer with no block to
    # write sends a bare DONE. FALLBACK straight from REGISTERED: the peer's breaker is open.
    (S.REGISTERED, E.CHUNK_POSTED): S.PUSHING,
    (S.REGISTERED, E.DONE): S.DONE,
    (S.REGISTERED, E.FALLBACK): S.FALLBACK,
    (S.PUSHING, E.CHUNK_POSTED): S.PUSHING,
    (S.PUSHING, E.CHUNK_DONE): S.PUSHING,
    (S.PUSHING, E.CHUNK_ERROR): S.RETRYING,
    (S.PUSHING, E.DONE): S.DONE,
    (S.PUSHING, E.FALLBACK): S.FALLBACK,
    # Chunks posted before the error keep completing (or failing) while one waits.
    (S.RETRYING, E.CHUNK_POSTED): S.RETRYING,
    (S.RETRYING, E.CHUNK_DONE): S.RETRYING,
    (S.RETRYING, E.CHUNK_ERROR): S.RETRYING,
    (S.RETRYING, E.RETRY): S.PUSHING,
    # The last chunk failed at P, but D confirms its DONE arrived (DoneState done).
    (S.RETRYING, E.DONE): S.DONE,
    (S.RETRYING, E.FALLBACK): S.FALLBACK,
    # Pull: D's READs are chunks too.
    (S.FALLBACK, E.CHUNK_POSTED): S.FALLBACK,
    (S.FALLBACK, E.CHUNK_DONE): S.FALLBACK,
    (S.FALLBACK, E.CHUNK_ERROR): S.FALLBACK,
    (S.FALLBACK, E.PULL_DONE): S.DONE,
}
# Any live state can be cancelled, failed or expire.
for _state in LIVE:
    _TABLE[(_state, E.CANCEL)] = S.CANCELLED
    _TABLE[(_state, E.FAIL)] = S.FAILED
    _TABLE[(_state, E.EXPIRE)] = S.FAILED

TRANSITIONS: Mapping[tuple[TransferState, TransferEvent], TransferState] = MappingProxyType(_TABLE)
del _TABLE, _state


def next_state(state: TransferState, event: TransferEvent) -> TransferState:
    """The table's answer; terminal states absorb every event (sticky).

    Raises ProtocolError for a live state and an event the table has no entry for.
    """
    if state in TERMINAL:
        return state
    target = TRANSITIONS.get((state, event))
    if target is None:
        raise ProtocolError("event not allowed", _not_allowed(state, event))
    return target


def _not_allowed(state: TransferState, event: TransferEvent) -> str:
    allowed = [e.value for e in TransferEvent if (state, e) in TRANSITIONS]
    return f"event {event.value} in state {state.value}; allowed there: {', '.join(allowed)}"


def transition_table_markdown() -> str:
    """TRANSITIONS as a markdown table, rows in state then event declaration order."""
    order_s = {s: i for i, s in enumerate(TransferState)}
    order_e = {e: i for i, e in enumerate(TransferEvent)}
    rows = sorted(TRANSITIONS.items(), key=lambda kv: (order_s[kv[0][0]], order_e[kv[0][1]]))
    lines = ["| state | event | next state |", "|---|---|---|"]
    lines += [f"| {s.value} | {e.value} | {t.value} |" for (s, e), t in rows]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, slots=True)
class TransferTimeouts:
    """Longest stay in each live state, and of the whole transfer, in seconds.

    Each state's clock starts when the state is entered (self-loops do not restart it);
    ``total_s`` bounds the whole transfer even if PUSHING and RETRYING alternate.
    """

    # The defaults are ``within(leases.transfer_timeout_s, fallback.pull_permit_s)`` of the
    # configuration's defaults (120 s, 30 s).
    new_s: float = 120.0
    waiting_s: float = 120.0  # WAITING_BLOCKS and WAITING_REGISTER
    registered_s: float = 120.0
    pushing_s: float = 120.0
    retrying_s: float = 120.0
    fallback_s: float = 60.0
    total_s: float = 120.0

    @classmethod
    def within(cls, total_s: float, pull_permit_s: float) -> TransferTimeouts:
        """Every live state may last the whole transfer (leases end a stuck phase sooner); a
        fallback lasts D's read permit plus a quarter of the whole (the shells' relation)."""
        return cls(
            new_s=total_s,
            waiting_s=total_s,
            registered_s=total_s,
            pushing_s=total_s,
            retrying_s=total_s,
            fallback_s=pull_permit_s + total_s / 4,
            total_s=total_s,
        )

    def __post_init__(self) -> None:
        for name in (
            "new_s", "waiting_s", "registered_s", "pushing_s", "retrying_s", "fallback_s",
            "total_s",
        ):  # fmt: skip
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"transfer timeout {name} must be a finite > 0, got {value}")

    def timeout_for(self, state: TransferState) -> float | None:
        """Seconds allowed in ``state``; None for a terminal state."""
        match state:
            case S.NEW:
                return self.new_s
            case S.WAITING_BLOCKS | S.WAITING_REGISTER:
                return self.waiting_s
            case S.REGISTERED:
                return self.registered_s
            case S.PUSHING:
                return self.pushing_s
            case S.RETRYING:
                return self.retrying_s
            case S.FALLBACK:
                return self.fallback_s
            case _:
                return None

    def deadline_for(self, state: TransferState, entered_at: float) -> float | None:
        timeout = self.timeout_for(state)
        return None if timeout is None else entered_at + timeout


class TransferMachine:
    """One transfer's state, fed events with the time they happened.

    ``fire`` returns False for an event that arrives after the end (ignored, counted):
    late completions and crossing messages (CANCEL vs DONE) are normal, not errors.
    """

    __slots__ = ("transfer_id", "timeouts", "state", "entered_at", "created_at", "ignored")

    def __init__(self, transfer_id: str, now: float, timeouts: TransferTimeouts) -> None:
        self.transfer_id = transfer_id
        self.timeouts = timeouts
        self.state = TransferState.NEW
        self.entered_at = now
        self.created_at = now
        self.ignored = 0

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def can_fire(self, event: TransferEvent) -> bool:
        return self.state in TERMINAL or (self.state, event) in TRANSITIONS

    def fire(self, event: TransferEvent, now: float) -> bool:
        if self.state in TERMINAL:
            self.ignored += 1
            return False
        target = TRANSITIONS.get((self.state, event))
        if target is None:
            raise ProtocolError(
                "event not allowed",
                f"transfer {self.transfer_id!r}: {_not_allowed(self.state, event)}",
            )
        if target is not self.state:
            self.state = target
            self.entered_at = now
        return True

    def deadline(self) -> float | None:
        """When this transfer must have left its state (None once terminal)."""
        state_deadline = self.timeouts.deadline_for(self.state, self.entered_at)
        if state_deadline is None:
            return None
        return min(state_deadline, self.created_at + self.timeouts.total_s)

    def expired(self, now: float) -> bool:
        deadline = self.deadline()
        return deadline is not None and now >= deadline

    def __repr__(self) -> str:
        return f"TransferMachine({self.transfer_id!r}, {self.state.value})"
