"""Every word the project counts or sends, as types: which side an engine plays, how a
transfer ended, what a note counts, what P does once a transfer's chunks in flight have
landed, and why a message, a connection, arrived KV or a request's kv_transfer_params were
refused. Metric labels, the core's notes and the wire all take their values from here.

Each is a str-valued enum, so a member is the very string that goes on the wire, into a
metric label or a log line (``Outcome.PULL_FALLBACK == "pull_fallback"``).
"""

from __future__ import annotations

import enum

__all__ = [
    "SIGNATURE_REASONS",
    "SUB_SEP",
    "AfterDrain",
    "KeyProblem",
    "NoteKind",
    "Notice",
    "Outcome",
    "ParamsRejectReason",
    "RejectReason",
    "Side",
    "Word",
    "base_of",
]

# A transfer split across ranks travels as ``<tid>#<tag>`` on the links that are not its
# lead link (``core.tpmap.sub_id``); ``base_of`` names the transfer such an id belongs to.
SUB_SEP = "#"


def base_of(wire_id: str) -> str:
    """The transfer a (sub-)transfer id belongs to."""
    return wire_id.split(SUB_SEP, 1)[0]


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
    # The transport closed a NIXL connection (REMOTE_DISCONNECT): dropped, made anew on next
    # use; detail: the agent
    CONNECTION_LOST = "connection_lost"
    TRANSFER_DONE = "transfer_done"  # P: the last WRITE landed; detail: the transfer id
    QUEUE_WAIT = "queue_wait"  # P: value = seconds from ready to the first chunk posted
    # P: value = times a ready chunk waited for its link's in-flight cap since the last such
    # note; reason: the cap that bound (bytes | chunks)
    LINK_CAPPED = "link_capped"
    # D: a push of an older prefill ended with its DONE taken (value: the DONE's protocol
    # version, reason: the prefill's identity, detail: its control address); the shell
    # settles that peer's version (counted and logged once per peer process)
    OLDER_PREFILL = "older_prefill"


class AfterDrain(Word):
    """What P does once the chunks a transfer has in flight have all completed."""

    NOTHING = ""  # not draining: release the blocks once the request is held
    ACK = "ack"  # D cancelled: answer CancelAck (nothing is in flight any more)
    FALLBACK = "fallback"  # the push gave up: send FALLBACK, D pulls
    FAILED = "failed"  # a fatal error: tell D (Failed) and free
    EXPIRED = "expired"  # a permit or the deadline ran out: tell D (Failed) and free
    DROPPED = "dropped"  # D's process restarted: nobody to tell, just free


class RejectReason(Word):
    """Why a control message, a notification, a connection or arrived KV was refused: the
    ``reason`` label of ``kvpush_control_messages_rejected_total`` (and of the core's
    ``Note(NoteKind.REJECTED, ...)``); nothing refused is ever acted on."""

    # An inbound message, dropped before anything acted on it.
    OVERSIZE = "oversize"
    MALFORMED = "malformed"
    VERSION = "version"
    UNAUTHENTICATED = "unauthenticated"  # no allow-listed sender key on it (defence in depth)
    # Decided by the protocol core on a well-formed message.
    UNKNOWN_TRANSFER = "unknown_transfer"
    STALE_GENERATION = "stale_generation"
    BAD_BLOCKS = "bad_blocks"
    INCOMPATIBLE = "incompatible"
    DUPLICATE = "duplicate"  # a transfer already being received is registered again
    UNEXPECTED = "unexpected"  # a kind of message this side never takes
    NOT_OWNER = "not_owner"  # an authenticated engine spoke for a transfer not its own
    OVERLOADED = "overloaded"  # P knows the most transfers it keeps
    BAD_PERMIT = "bad_permit"  # a REGISTER granting no time
    OUT_OF_ORDER = "out_of_order"  # a message the transfer's state does not take (a PullDone
    # for blocks P never offered to be read)
    # KV that arrived and was refused before any of it was used (the prompt is recomputed):
    # computed for another prompt (core.digest), or bytes that differ from P's.
    PROMPT_MISMATCH = "prompt_mismatch"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    # One engine key over a quota of its own (what an engine holding a valid key can make
    # this one keep or do): messages waiting beyond its backlog, a control address beyond
    # those its messages and the replies to it may use, REGISTERs P keeps for transfers its
    # engine does not know (decided by the core).
    QUOTA_BACKLOG = "quota_backlog"
    QUOTA_ADDRESSES = "quota_addresses"
    QUOTA_REGISTRATIONS = "quota_registrations"
    # A connection to this engine's control port whose handshake failed (per attempt).
    HANDSHAKE_UNKNOWN_KEY = "handshake_unknown_key"  # client key not in the allow-list
    HANDSHAKE_CRYPTO = "handshake_crypto"  # client expects another key for us, or tampering
    HANDSHAKE_MECHANISM = "handshake_mechanism"  # plaintext client to CURVE, or the reverse
    HANDSHAKE_PROTOCOL = "handshake_protocol"  # any other ZMTP/CURVE protocol error
    HANDSHAKE_FAILED = "handshake_failed"  # dropped or timed out (HANDSHAKE_IVL) mid-way
    # An outbound message this engine did not send, or a connection of ours that failed.
    BAD_ADDRESS = "bad_address"  # not tcp://HOST:PORT with a sane host and port
    UNKNOWN_PEER_KEY = "unknown_peer_key"  # `to` empty or not in the allow-list
    OVERSIZE_OUTBOUND = "oversize_outbound"  # over control.max_message_bytes
    QUEUE_FULL = "queue_full"  # the peer's send queue is full (it is down or slow)
    NO_SOCKET = "no_socket"  # no socket could be opened (out of file descriptors)
    PEER_REFUSED_KEY = "peer_refused_key"  # the peer's allow-list lacks this engine's key
    PEER_HANDSHAKE_FAILED = "peer_handshake_failed"  # usually: its key is not the `to` we hold


class ParamsRejectReason(Word):
    """Why a request's kv_transfer_params were refused: the ``reason`` label of
    ``kvpush_kv_params_rejected_total``. D computes such a prompt locally; P does not push
    it."""

    MALFORMED = "malformed"  # a field missing or out of range
    UNSIGNED = "unsigned"  # a params key is set and the params carry no signature
    BAD_SIGNATURE = "bad_signature"  # changed, or signed with another key
    EXPIRED = "expired"  # the signature's term is over (or too far ahead)
    WRONG_LEG = "wrong_leg"  # signed for the other engine's leg
    UNKNOWN_FIELD = "unknown_field"  # a field the router does not sign on that leg
    REPLAYED = "replayed"  # the signature's nonce was taken by another request
    REPLAY_MEMORY_FULL = "replay_memory_full"  # too many live nonces to remember one more
    UNKNOWN_KEY = "unknown_key"  # a peer key outside the allow-list
    FOREIGN_PEER = "foreign_peer"  # a prefill address outside control.allowed_peers
    UNUSABLE = "unusable"  # a prefill engine's fields without do_remote_prefill, or a pull answer
    DUPLICATE_TRANSFER = "duplicate_transfer"  # another live request holds its transfer id


class KeyProblem(Word):
    """Why a params key was refused at start-up (an error naming the fix, never a metric)."""

    WEAK_KEY = "weak_key"  # under 32 random bytes
    KEY_FILE = "key_file"  # unreadable, or readable by group or others


# The params refusals that say the params are no one's word (they failed the router's
# signature): nothing in them, the transfer id included, may be acted on.
SIGNATURE_REASONS = frozenset(
    {
        ParamsRejectReason.UNSIGNED,
        ParamsRejectReason.MALFORMED,
        ParamsRejectReason.BAD_SIGNATURE,
        ParamsRejectReason.EXPIRED,
        ParamsRejectReason.WRONG_LEG,
        ParamsRejectReason.UNKNOWN_FIELD,
        ParamsRejectReason.REPLAYED,
        ParamsRejectReason.REPLAY_MEMORY_FULL,
    }
)


class Notice(Word):
    """What D's admission of a transfer tells its prefill engine (``Answer.notices``)."""

    WAIT = "wait"  # no credit yet: keep your blocks for me (AwaitAdmission)
    OVER = "over"  # admitted: the wait is over, a REGISTER follows (AdmissionOver)
    NOT_NEEDED = "not_needed"  # D computes the prompt itself: free your blocks (NotNeeded)
