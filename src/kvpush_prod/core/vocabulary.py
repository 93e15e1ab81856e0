"""The protocol's words as types: which side an engine plays, how a transfer ended, what a
note counts, and what P does once a transfer's chunks in flight have landed.

Each is a str-valued enum, so a member is the very string that goes on the wire, into a
metric label or a log line (``Outcome.PULL_FALLBACK == "pull_fallback"``).
"""

from __future__ import annotations

import enum


class Word(str, enum.Enum):
    """A str-valued enum whose ``str()`` and ``format()`` are its value (as ``StrEnum``)."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str.__str__(self), spec)


class Side(Word):
    """The part an engine plays in P/D disaggregation (vLLM's ``kv_role`` without ``kv_``)."""

    PRODUCER = "producer"  # P: computes the prompt's KV and pushes it
    CONSUMER = "consumer"  # D: reserves blocks, grants a permit, receives

    @classmethod
    def of_kv_role(cls, kv_role: str) -> Side | None:
        """``kv_producer`` / ``kv_consumer`` as a side; None for any other role."""
        return {"kv_producer": cls.PRODUCER, "kv_consumer": cls.CONSUMER}.get(kv_role)


class Outcome(Word):
    """How a transfer ended on one side: the ``outcome`` label of ``kvpush_transfers_total``."""

    PUSHED = "pushed"  # every chunk landed on its first post
    RETRIED = "retried"  # pushed, some chunk after a retry
    PULL_FALLBACK = "pull_fallback"  # the push failed and D pulled the blocks
    RECOMPUTE = "recompute"  # D computes the prompt itself (refused credit, or after a failure)
    FAILED = "failed"
    EXPIRED = "expired"  # a lease or deadline ran out
    ABORTED = "aborted"  # the request ended before the transfer did
    CANCELLED = "cancelled"  # D said it does not want it (CANCEL)
    PREFIX_HIT = "prefix_hit"  # D had the whole prompt cached: nothing to move

    @property
    def delivered(self) -> bool:
        """The KV reached D (pushed, retried or pulled)."""
        return self in (Outcome.PUSHED, Outcome.RETRIED, Outcome.PULL_FALLBACK)


class NoteKind(Word):
    """What a ``Note`` action counts; its ``reason`` is the label (where the metric has one)."""

    REJECTED = "rejected"  # a message refused (reason: why); kvpush_control_messages_rejected
    RETRY = "retry"  # a chunk posted again (reason: the error kind)
    FALLBACK = "fallback"  # the push gave way to D pulling (reason: why)
    LEASE_EXPIRED = "lease_expired"  # reason: permit | send | pull
    FENCED = "fenced"  # a stale generation or a replaced process: nothing changed
    BREAKER_TRIP = "breaker_trip"  # reason: the peer (agent) whose breaker opened
    PEER_RESTART = "peer_restart"  # reason: decode | prefill
    TRANSFER_DONE = "transfer_done"  # P: the last WRITE landed; detail: the transfer id
    QUEUE_WAIT = "queue_wait"  # P: value = seconds from ready to the first chunk posted
    # P: value = times a ready chunk waited for its link's in-flight cap since the last such
    # note; reason: the cap that bound (bytes | chunks)
    LINK_CAPPED = "link_capped"


class AfterDrain(Word):
    """What P does once the chunks a transfer has in flight have all completed."""

    NOTHING = ""  # not draining: release the blocks once the request is held
    ACK = "ack"  # D cancelled: answer CancelAck (nothing is in flight any more)
    FALLBACK = "fallback"  # the push gave up: send FALLBACK, D pulls
    FAILED = "failed"  # a fatal error: tell D (Failed) and free
    EXPIRED = "expired"  # a permit or the deadline ran out: tell D (Failed) and free
    DROPPED = "dropped"  # D's process restarted: nobody to tell, just free
