"""A fake world for the protocol core: N prefill x M decode engines, block pools, a lossy
network and NICs, driving the real Sender/Receiver engines the way the worker shells do,
an attacker that forges messages (``World.attack``), and the intruder, a third engine with
a valid key, an address and a NIXL agent of its own (``World.intrude``).

Every message carries the identity its channel authenticated (``origin``: a real engine's
address here, the attacker's own name for a forgery, ``INTRUDER_KEY`` for the intruder), and
a reply reaches only the identity it names (the intruder hears the replies to its key).

Every safety invariant is checked at the moment it could break (a WRITE posted, a chunk
landing, blocks freed); ``World.check`` adds the per-step ones, ``World.quiesce`` the
no-leak check and, in a calm world, ``World.check_outcomes`` that every transfer whose
decode the router named was pushed. A broken invariant raises ``Violation`` naming the
transfer and the times. The world counts the races it reaches (``race:...`` in ``stats``)
so that a scenario can assert its race did happen.
"""

from __future__ import annotations

import heapq
import itertools
import random
import re
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from kvpush_prod.core import identity
from kvpush_prod.core import messages as m
from kvpush_prod.core.actions import (
    Action,
    ConnectPeer,
    DropPeer,
    Note,
    PostRead,
    PostWrite,
    ReleaseSend,
    ReportFailed,
    ReportFinished,
    SendMessage,
)
from kvpush_prod.core.admission import Admissions, Verdict
from kvpush_prod.core.commands import (
    AbortReceive,
    AbortSend,
    BlocksReady,
    Command,
    ExpectBlocks,
    ForwardFailed,
    Hold,
    LayersReady,
    NotNeeded,
    RegisterBlocks,
)
from kvpush_prod.core.credits import CreditLedger, CreditSettings
from kvpush_prod.core.leases import LeaseState
from kvpush_prod.core.receiver import Receiver, ReceiverSettings
from kvpush_prod.core.retry import BreakerSettings, BudgetSettings, ChunkError, RetrySettings
from kvpush_prod.core.scheduler import SchedulerSettings
from kvpush_prod.core.sender import Sender, SenderSettings
from kvpush_prod.core.transfer import TransferState, TransferTimeouts
from kvpush_prod.core.vocabulary import AfterDrain, NoteKind, Outcome
from kvpush_prod.driver import (
    DEFERRED,
    Deferred,
    Driver,
    Observer,
    Stage,
    message_age,
    split_notes,
    visit,
)

T = TypeVar("T")


class Violation(AssertionError):
    """An invariant of the push protocol does not hold in the simulated world."""


# ------------------------------------------------------------------------------ settings
# Scaled-down numbers with the relations the shells use (config.core.core_settings):
# per-state limits equal the whole-transfer bound, fallback gets the pull permit plus a quarter.
BLOCK_BYTES = 1000
BLOCK_TOKENS = 16  # tokens per KV block
LAYERS = 3  # layers of a layer-wise push (its WRITEs move one layer's part of each block)


class Parts(tuple):  # type: ignore[type-arg]
    """A block's content layer by layer, when its layers differ (a layer-wise push in
    progress); a block whose layers all agree holds that one value instead."""


def layer_of(content: Any, part: int) -> Any:
    return content[part] if isinstance(content, Parts) else content


def with_layer(content: Any, part: int, value: Any) -> Any:
    layers = list(content) if isinstance(content, Parts) else [content] * LAYERS
    layers[part] = value
    return layers[0] if all(x == layers[0] for x in layers) else Parts(layers)


D_BLOCKS = 24  # decode KV cache, blocks
P_BLOCKS = 48
CREDIT_BUDGET = 16  # D's receive window, blocks
PEER_CAP = 12
TOTAL_S = 12.0
PERMIT_TTL_S = 3.0
STOP_MARGIN_S = 1.0
SKEW_MARGIN_S = 1.0
HEARTBEAT_S = 1.0
PEER_TIMEOUT_S = 2.5
SEND_LEASE_S = 6.0
PULL_PERMIT_S = 4.0
REGISTER_GRACE_S = 4.0  # P renews a REGISTER that came before its request this long
P_LAG_MAX_S = 3.0  # the prefill leg may reach P this long after the decode leg reached D
TICK_S = 0.1  # the pump ticks its engine every few tens of ms
# The world's physical bounds. Safety needs a chunk posted before the holder's stop point to
# land before the grantor's reuse point: CHUNK_MAX_S + 2 * WALL_SKEW_S < stop + skew margin.
CHUNK_MAX_S = 1.5  # a WRITE/READ completes (or is known failed) within this of its post
CONNECT_MAX_S = 4.0  # a connect made off the pump (Chaos.connect_slow) ends within this
WALL_SKEW_S = 0.2  # |wall clock offset| of one node: message ages are off by up to twice it
PAUSE_MAX_S = 1.5  # a pump stall (GC, overload)
SPIKE_MAX_S = 6.0  # a control message stuck this long (REGISTERs: the age covers it)
RESTART_MIN_S = 1.0  # a process takes at least this long to come back
COMPUTE_MAX_S = 2.0  # P computes a prompt within this of the request's arrival
NAMED_SHARE = 0.8  # of requests: the router names the decode engine to P (owner=)

TIMEOUTS = TransferTimeouts.within(TOTAL_S, PULL_PERMIT_S)
SCHED = SchedulerSettings(
    chunk_bytes=BLOCK_BYTES,
    target_latency_s=0.05,
    stop_margin_s=STOP_MARGIN_S,
    initial_bandwidth_bytes_per_s=1e5,
)
RETRY = RetrySettings(max_attempts=3, max_delay_s=5.0, backoff_base_s=0.02, backoff_max_s=0.2)
BUDGET = BudgetSettings(rate_per_s=5.0, burst=10.0)
BREAKER = BreakerSettings(
    failure_threshold=3, window_s=10.0, cooldown_s=5.0, max_cooldown_s=20.0, probe_timeout_s=5.0
)
# Peer directories small enough that the world can fill them: every engine, the attackers
# and the engines that forge fit at rank 0 (at most 3 P + 2 attackers + 1 D on a D).
PEER_DIR = 6
SENDER = SenderSettings(
    block_bytes=BLOCK_BYTES,
    scheduler=SCHED,
    retry=RETRY,
    budget=BUDGET,
    breaker=BREAKER,
    timeouts=TIMEOUTS,
    send_lease_s=SEND_LEASE_S,
    stop_margin_s=STOP_MARGIN_S,
    skew_margin_s=SKEW_MARGIN_S,
    heartbeat_s=HEARTBEAT_S,
    fallback=True,
    pull_permit_s=PULL_PERMIT_S,
    register_grace_s=REGISTER_GRACE_S,
    tombstone_s=60.0,
    max_peers=PEER_DIR,
    await_connect=True,  # as the connector: transfers wait for the driver's on_peer
)
RECEIVER = ReceiverSettings(
    block_bytes=BLOCK_BYTES,
    permit_ttl_s=PERMIT_TTL_S,
    skew_margin_s=SKEW_MARGIN_S,
    stop_margin_s=STOP_MARGIN_S,
    heartbeat_s=HEARTBEAT_S,
    peer_timeout_s=PEER_TIMEOUT_S,
    scheduler=SCHED,
    retry=RETRY,
    budget=BUDGET,
    timeouts=TIMEOUTS,
    max_peers=PEER_DIR,
    await_connect=True,  # as the connector: a pull's READs wait for the driver's on_peer
)
CREDITS = CreditSettings(budget_blocks=CREDIT_BUDGET, per_peer_cap_blocks=PEER_CAP)

_SLACK_S = 0.5
# How long a transfer may live: the whole-transfer bound plus what the leases add after it.
BOUND_D_S = (
    TOTAL_S
    + PERMIT_TTL_S
    + HEARTBEAT_S
    + SKEW_MARGIN_S
    + CHUNK_MAX_S
    + PAUSE_MAX_S
    + 2 * TICK_S
    + _SLACK_S
)
BOUND_P_S = (
    TOTAL_S + PULL_PERMIT_S + SKEW_MARGIN_S + CHUNK_MAX_S + PAUSE_MAX_S + 2 * TICK_S + _SLACK_S
)

# Transport errors a chunk may fail with (the classification table's rows and spellings).
RETRYABLE = ("ERR:nixlBackendError", "TIMEOUT", "NIXL_ERR_NOT_POSTED", "ERR")
DISCONNECT = "ERR:nixlRemoteDisconnectError"
INVALID = "NIXL_ERR_INVALID_PARAM"


ATTACKERS = ("attacker", "attacker-2")  # identities (keys) of no engine of the world
ATTACKER_ADDRESS = "tcp://attacker:6666"
# Known core bugs the attacker found, each with its deterministic reproduction (xfail) in
# test_attacker_findings.py. While a flag is set, the attacker leaves out the one move that
# trips it, so the world keeps testing everything else; clear it once that test passes.
KNOWN_BUGS: dict[str, bool] = {
    # P keys peers by (origin, rank) but knows their agents by the name a message claims: a
    # REGISTER under another key claiming a real decode's agent name makes P write into
    # that decode, and a "restart" of it fails the real decode's transfers. The attacker
    # then claims only agent names of its own.
    "agent_names": False,
    # A CANCEL of any origin for an id nobody owns on P replaces the tombstone that P's own
    # abort (or failed forward) or the owner's CANCEL left. The attacker then cancels no
    # tombstoned id.
    "tombstone_overwrite": False,
    # One LRU over (origin, rank) on D: a key with more ranks than PEER_DIR pushes out a
    # prefill's entry and retired incarnations; a late message of a replaced prefill process
    # then counts as a restart and D reuses blocks the live process may still write. The
    # attacker then speaks for rank 0 only (the directories never fill).
    "peer_eviction": False,
    # The intruder's three findings (test_intruder_findings.py), all about the REGISTERs P
    # keeps for a transfer whose decode its request has not named yet (the contenders):
    # - the end of the first registration (its registrant's CANCEL, PullDone, incompatible
    #   REGISTER or restart, or its permit running out) dropped the contenders. While set, a
    #   forger that first registered such a transfer sends P nothing more about it (and
    #   announces no restart of its own); the lapse is kept off by the next flag's skip.
    "registrant_drops_contenders": False,
    # - P neither listed the contenders in its heartbeats nor took their renewals: a
    #   prefill leg later than the decode's first permit term bound it with a dead permit.
    #   While set (or the next), a forger's REGISTER that would be the first P holds for an
    #   id a request may name is left out (an unnamed request's: first come, documented).
    "contenders_not_renewed": False,
    # - a lapsed registration of an id P had no request for left P's own tombstone on it:
    #   the request that came later was answered prefill_aborted.
    "expired_registration_tombstones": False,
    # Found in the fixes of those three (2026-12-02), fixed since:
    # - a forged REGISTER with a permit of 0 ms kept as a contender raised ProtocolError out
    #   of Sender.on_message. While set, no forger sends P such a REGISTER for a transfer
    #   another key registered first.
    "contender_zero_ttl": False,
    # - a transfer P keeps only for contenders (its first registrant withdrew, no request
    #   came) lived as long as their permits (a day; for ever while one renews its own),
    #   past the transfer bound. While set, no forger's REGISTER becomes a contender of a
    #   transfer P has no request for.
    "contenders_outlive_bound": False,
}


@dataclass(frozen=True)
class Attack:
    """One forged message: what it is, who forges it and what it claims.

    ``forger``: "attacker"/"attacker-2" (an identity of its own, no engine's key) or "engine"
    (an authenticated engine of the world that does not own the transfer). ``claim``: whose
    PeerInfo the message carries: the owner's (as is, with a new or a past incarnation),
    the forger's own, or another engine's. ``guess``: the generation it names (the current one
    tests that the origin alone is refused; a DONE names it only where the owner's agent is
    known). ``target``: a live transfer of the target engine, any transfer id seen, the next
    id the router will use, or a bogus one.
    """

    kind: int  # an index into the target role's message kinds (ATTACK_KINDS)
    forger: str
    claim: str  # owner | owner_new | owner_old | own | other
    guess: str  # current | near | past | random | zero
    target: str  # live | any | future | bogus
    rank: int = 0
    delay: float = 0.0
    layout: str = "full"  # full | slim | foreign
    ttl_ms: int = 3000


ATTACK_KINDS = {
    "P": ("Register", "Heartbeat", "Waiting", "Cancel", "PullDone", "Failed", "DoneState"),
    "D": ("Heartbeat", "Failed", "CancelAck", "Fallback", "Done", "Register", "DoneQuery"),
}

# ------------------------------------------------------------------------------ the intruder
# A third engine of the deployment, an authenticated peer of its own: the allow-lists hold its
# key, it has a control address (replies to its key reach it) and a NIXL agent named for its
# key, and it owns no transfer of the world. It knows every transfer id the router used (and
# the next one), every engine's control address, engine id, agent name and incarnation, and
# the generations it was told (messages to it) or that leaked (any D granted; the current one,
# even: that the origin alone is refused is what is tested). ``World.intrude`` sends one of
# its messages over the network (they interleave with the engines' traffic); the rules of
# test_protocol_stateful.py choose them.
INTRUDER = "intruder"  # its name in the world (the source of its messages)
INTRUDER_KEY = "intruder-key"  # the public key its channel authenticates: its origin
INTRUDER_ADDRESS = "tcp://intruder:7300"
INTRUDER_KINDS = (
    "Register",
    "Heartbeat",
    "Cancel",
    "CancelAck",
    "Failed",
    "Fallback",
    "PullDone",
    "DoneQuery",
    "DoneState",
    "Done",
)
# The engine each kind is meant for (the intruder also sends them to the other one).
INTRUDER_FOR = {
    "Register": "P",
    "Heartbeat": "P",
    "Cancel": "P",
    "PullDone": "P",
    "DoneState": "P",
    "CancelAck": "D",
    "Failed": "D",
    "Fallback": "D",
    "DoneQuery": "D",
    "Done": "D",
}


def intruder_agent(inc: int) -> str:
    """The NIXL agent of the intruder's process ``inc``, named for its key."""
    return identity.agent_name(f"agent-intruder-{inc}", INTRUDER_KEY)


@dataclass(frozen=True)
class Move:
    """One message of the intruder.

    ``kind``: a control message (INTRUDER_KINDS) or "Done" (a DONE notification from its own
    agent). ``to``: "natural" (an engine of the role the kind is for), "all" (every engine of
    that role) or "other" (one of the other role). ``target``: which transfer id it names: the
    router's newest, one live on that engine, any id the router used, the router's next id
    (it registers ahead of the decode), or a bogus one. ``claim``: whose PeerInfo it carries:
    its own (``self``; ``self_new``: its process restarted), the counterpart engine's as it is
    (``victim``), with a new incarnation (``victim_new``), with another data-parallel suffix
    (``victim_dp``), its own with the counterpart's agent name (``victim_agent``), its own
    without agent or layout (``slim``), or with a layout of another model (``foreign``).
    ``gen``: the generation it names: one it was told (``observed``), one that leaked, the
    current one, a near one, a random one, or 0. ``delay``: how long the message travels.
    ``detail`` picks the rest (``Move.details``): the block ids it names (its own KV
    cache's mostly; the counterpart's reserved ones, another transfer's, or out of range), its
    rank, the permit term, the clock it stamps, PullDone's ``ok`` / DoneState's state, the
    attempt it names, and how many transfers a heartbeat lists.
    """

    kind: str
    to: str = "natural"  # natural | all | other
    target: str = "live"  # newest | live | seen | future | bogus
    claim: str = (
        "self"  # self | self_new | victim | victim_new | victim_dp | victim_agent | slim | foreign
    )
    gen: str = "current"  # observed | leaked | current | near | random | zero
    delay: float = 0.0
    detail: int = 0  # 0: the plainest message (own blocks, rank 0, a 3 s term, true clock)

    def details(self) -> dict[str, Any]:
        """What ``detail`` picks (digit by digit, so 0 is the plainest and each shrinks)."""
        d = self.detail
        pick: list[Any] = []
        for choices in (
            ("own", "own", "own", "victim", "other", "wild"),  # blocks
            (0, 0, 0, 1, 3),  # rank
            (3000, 3000, 86_400_000, 1, 0),  # permit term, ms
            ("true", "true", "past", "future"),  # the sent_at it stamps
            (True, False),  # PullDone ok; DoneState "done" (else "gone")
            (0, 0, 1, 7),  # attempt
            (1, 1, 3),
        ):  # transfers a heartbeat lists
            pick.append(choices[d % len(choices)])
            d //= len(choices)
        return dict(
            zip(
                ("blocks", "rank", "ttl_ms", "clock", "flag", "attempt", "entries"),
                pick,
                strict=True,
            )
        )


@dataclass
class IntruderState:
    inc: int = 1  # its process; a "restart" (claim self_new) takes the next
    seen: deque[int] = field(default_factory=lambda: deque(maxlen=64))  # generations told
    kv: set[str] = field(default_factory=set)  # transfers whose KV P wrote into its memory
    spoken: set[str] = field(default_factory=set)  # transfer ids it named in a message


@dataclass(frozen=True)
class Chaos:
    """How hostile the background is (the rules add targeted faults on top)."""

    drop: float = 0.0  # a control message is lost
    dup: float = 0.0  # a control message arrives twice
    delay_max_s: float = 0.02  # control message delay in [0.2 ms, this]
    spike: float = 0.0  # a control message is held up to SPIKE_MAX_S (a stuck queue)
    chunk_fail: float = 0.0  # a chunk fails
    # A connect (P's to a D, D's to a P) is made off the pump and ends up to CONNECT_MAX_S later (the
    # driver's deferred connect), or fails then
    connect_slow: float = 0.0
    connect_fail: float = 0.0
    fatal_share: float = 0.0  # of failures: INVALID_PARAM (the rest: retryable / disconnect)
    slow: float = 0.0  # a chunk takes up to CHUNK_MAX_S
    notif_loss: float = 0.0  # a DONE notification is lost
    skew: bool = True  # nodes' wall clocks differ by up to WALL_SKEW_S
    # A failed chunk whose bytes (and DONE notification) did land: the sender cannot tell
    # (an RDMA ack lost with the connection, a shell-side timeout of a chunk that completes).
    ambiguous: float = 0.0
    # What a crashed process had sent is still delivered, possibly after its restart.
    zombie: bool = False
    # P's forward raises (vLLM still calls wait_for_save): the blocks hold garbage.
    forward_fail: float = 0.0
    # Share of prompts pushed layer by layer (push.layerwise): P computes LAYERS layers one
    # after the other (LayersReady after each), its blocks' layers fill in as it goes.
    layerwise: float = 0.0


# ------------------------------------------------------------------------------ world parts
class KeyedRandom:
    """splitmix64: a few draws from a seed, cheaper to make than ``random.Random``."""

    __slots__ = ("_s",)
    _M = (1 << 64) - 1

    def __init__(self, seed: int) -> None:
        self._s = seed & self._M

    def _next(self) -> int:
        self._s = (self._s + 0x9E3779B97F4A7C15) & self._M
        z = self._s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self._M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self._M
        return z ^ (z >> 31)

    def random(self) -> float:
        return (self._next() >> 11) * (1.0 / (1 << 53))

    def uniform(self, a: float, b: float) -> float:
        return a + (b - a) * self.random()

    def choice(self, seq: Sequence[T]) -> T:
        return seq[int(self.random() * len(seq))]


class BlockPool:
    """One engine's KV blocks: owner per block, an epoch bumped on every alloc and free,
    and a content tag (what the bytes are) to check that D ends up with P's bytes."""

    def __init__(self, n: int, name: str) -> None:
        self.name = name
        self.owner: list[Any] = [None] * n
        self.epoch = [0] * n
        self.content: list[Any] = [None] * n
        self._free = list(range(n - 1, -1, -1))  # a stack: the block freed last is reused first

    def alloc(self, k: int, owner: Any) -> list[int] | None:
        if len(self._free) < k:
            return None
        blocks = [self._free.pop() for _ in range(k)]
        for b in blocks:
            assert self.owner[b] is None
            self.owner[b] = owner
            self.epoch[b] += 1
            self.content[b] = ("fresh", self.name, b)
        return blocks

    def release(self, blocks: list[int], owner: Any, why: str) -> None:
        for b in blocks:
            if self.owner[b] != owner:
                raise Violation(
                    f"{self.name}: {why} frees block {b} owned by {self.owner[b]!r},"
                    f" not {owner!r} (double free or foreign block)"
                )
        for b in blocks:
            self.owner[b] = None
            self.epoch[b] += 1
            self.content[b] = ("freed", self.name, b)
            self._free.append(b)

    def used(self) -> int:
        return sum(o is not None for o in self.owner)


@dataclass
class PReq:
    """A request on P (the router's prefill leg)."""

    tid: str
    d_name: str
    nblocks: int
    compute_at: float
    created: float
    arrive_at: float = 0.0
    state: str = "coming"  # coming | queued | computed | held | released | aborted
    blocks: list[int] = field(default_factory=list)
    hold_at: float = 0.0
    # The decode identity the router named (D's address here); "" for a router that names
    # none: then the first REGISTER binds the transfer (a documented limitation).
    owner: str = ""
    # Layer-wise: the forward computes one layer at ``layer_at`` (state "computing"),
    # ``layers`` are done; it raises after ``fail_after`` layers (-1: it does not).
    layerwise: bool = False
    layers: int = 0
    layer_at: float = 0.0
    fail_after: int = -1


@dataclass
class DReq:
    """A request on D (the decode leg): asks for credit, then receives."""

    tid: str
    p_name: str
    p_address: str
    total_blocks: int
    first_block: int
    created: float
    state: str = "asking"  # asking | waiting | admitted | ended
    blocks: list[int] = field(default_factory=list)
    gen: int = 0
    admitted_at: float = 0.0
    aborting: bool = False

    @property
    def nblocks(self) -> int:
        return self.total_blocks - self.first_block


@dataclass
class Node:
    name: str
    role: str  # "P" | "D"
    address: str
    alive: bool = False
    inc: int = 0
    agent: str = ""
    mono_off: float = 0.0
    wall_off: float = 0.0
    engine: Any = None
    driver: Any = None  # the Driver of this incarnation's engine
    pool: BlockPool | None = None
    admissions: Admissions[None] | None = None  # D: its requests' admission (the core's)
    preqs: dict[str, PReq] = field(default_factory=dict)
    dreqs: dict[str, DReq] = field(default_factory=dict)
    closed: dict[str, PReq | DReq] = field(default_factory=dict)  # requests over, by id
    paused_until: float = 0.0
    deferred: deque[Callable[[], None]] = field(default_factory=deque)
    died_at: float = 0.0
    info: m.PeerInfo | None = None
    past: dict[int, m.PeerInfo] = field(default_factory=dict)  # earlier incarnations

    def local(self, now: float) -> float:
        return now + self.mono_off

    def wall(self, now: float) -> float:
        return 1_000_000.0 + now + self.wall_off


@dataclass
class Wire:
    """A control message on the network."""

    id: int
    src: str
    src_inc: int
    dst: str  # address
    msg: m.ControlMessage
    sent: float
    at: float
    # The identity the channel authenticated (the sender's key): a real engine's is its
    # address here, so ``origin == msg.sender.control`` unless the message is forged.
    origin: str = ""
    attack: bool = False  # forged by the attacker: checked to change nothing of others


@dataclass
class Flight:
    """A posted WRITE or READ on the NIC."""

    key: tuple[str, int, int]  # poster, its incarnation, chunk id
    op: str  # WRITE | READ
    tid: str
    gen: int
    peer: str  # target agent
    src: tuple[str, int, tuple[int, ...]]  # node, incarnation, blocks (P's side)
    dst: tuple[str, int, tuple[int, ...]]  # node, incarnation, blocks (D's side)
    dst_epochs: tuple[int, ...]
    src_epochs: tuple[int, ...]
    done: m.Done | None
    posted: float
    at: float
    error: str
    torn: bool
    part: int = 0  # a layer-wise WRITE: layer ``part`` of ``parts`` of each block
    parts: int = 1


def agent_name(node: str, inc: int) -> str:
    """The NIXL agent of one process (incarnation ``inc``) of ``node``, named for the node's
    identity (its address here), as the shells name theirs for their key."""
    return identity.agent_name(f"agent-{node}-{inc}", node_address(node))


def node_address(node: str) -> str:
    """The control address of ``node`` ("P0", "D1", ...): its identity in the world."""
    return f"tcp://{node.lower()}:{7000 if node.startswith('P') else 7100}"


# The machine's end each of P's outcome words means.
_P_END = {
    Outcome.PUSHED: TransferState.DONE,
    Outcome.RETRIED: TransferState.DONE,
    Outcome.PULL_FALLBACK: TransferState.DONE,
    Outcome.CANCELLED: TransferState.CANCELLED,
    Outcome.FAILED: TransferState.FAILED,
    Outcome.EXPIRED: TransferState.FAILED,
}
_REGISTERED = frozenset(
    {
        TransferState.WAITING_BLOCKS,
        TransferState.REGISTERED,
        TransferState.PUSHING,
        TransferState.RETRYING,
        TransferState.FALLBACK,
    }
)


def sender_disagreements(eng: Sender) -> list[str]:
    """Where a ``Sender``'s transfers' machines disagree with what P holds of them: the
    outcome word and the machine's end, a registration or blocks and the state that says
    whether they came. Empty when every transfer is consistent."""
    out: list[str] = []
    for o in eng._out.values():
        st, what = o.machine.state, f"{o.tid} ({o.machine}, outcome {o.outcome!r})"
        if o.outcome:
            if _P_END.get(o.outcome) is not st:
                out.append(f"{what}: the outcome and the machine's end disagree")
            continue
        if o.machine.terminal:
            # Ended by a CANCEL or D's restart while chunks drain: the end comes with them.
            if not (o.inflight and o.drain_then in (AfterDrain.ACK, AfterDrain.DROPPED)):
                out.append(f"{what}: ended in the machine, not in the outcome")
            continue
        if (st in _REGISTERED) != (o.reg is not None):
            out.append(f"{what}: registration {'kept' if o.reg else 'none'}")
        ready = st not in (TransferState.NEW, TransferState.WAITING_BLOCKS)
        if ready != (o.blocks is not None):
            out.append(f"{what}: blocks {'kept' if o.blocks is not None else 'none'}")
    return out


# ------------------------------------------------------------------------------ the shells
class NodeEffects:
    """The driver's hands on one node: its clocks, the world's network and NICs, and the
    engine's reports (each checked where the world receives it)."""

    def __init__(self, world: World, node: Node) -> None:
        self.world, self.node = world, node

    def now(self) -> float:
        return self.node.local(self.world.now)

    def wall(self) -> float:
        return self.node.wall(self.world.now)

    def send(self, peer: str, to: str, message: m.ControlMessage) -> None:
        self.world.send(self.node, peer, to, message)

    def connect(self, info: m.PeerInfo) -> str | Deferred:
        return self.world.connect(self.node, info.agent_name)

    def disconnect(self, agent: str) -> None:
        return None

    def write(self, action: PostWrite, peer: str) -> None:
        self.world.post_write(self.node, action)

    def read(self, action: PostRead, peer: str) -> None:
        self.world.post_read(self.node, action)

    def post_failed(self, action: PostWrite | PostRead, error: ChunkError) -> None:
        # As the pump: posting to an agent never connected fails at once.
        self.world.count("post_unconnected")

    def release_send(self, action: ReleaseSend) -> None:
        self.world.on_release(self.node, action)

    def report_finished(self, action: ReportFinished) -> None:
        self.world.on_finished(self.node, action)

    def report_failed(self, action: ReportFailed) -> None:
        self.world.on_failed(self.node, action)

    def note(self, note: Note) -> None:
        self.world.count(f"note:{note.kind}:{note.reason}")
        if (
            note.kind is NoteKind.LEASE_EXPIRED
            and note.reason == "permit"
            and self.node.role == "P"
        ):
            # P's permit ran out mid-push: are chunks of it still on the wire? (The race the
            # fence is for: they must land before D reuses the blocks.)
            found = re.match(r"permit of (\S+) ran out", note.detail)
            if found and any(
                fl.tid == found[1] and fl.key[:2] == (self.node.name, self.node.inc)
                for fl in self.world.flights.values()
            ):
                self.world.count("race:permit_ended_under_push")

    def contained(self, stage: Stage, what: str) -> None:
        raise  # noqa: PLE0704 - a broken invariant or an engine that raises ends the example


class NodeChecks(Observer):
    """What the world checks of each action before the driver carries it out."""

    def __init__(self, world: World, node: Node) -> None:
        self.world, self.node = world, node

    def post_write(self, action: PostWrite, /) -> None:
        self.world.check_write(self.node, action)

    def post_read(self, action: PostRead, /) -> None:
        self.world.check_read(self.node, action)


class Harmless:
    """Whether an action answering a forged message from ``origin`` is harmless: only notes
    (refusals, fences, the restart of the forger's own process), replies to the forger (its
    channel proves ``to``), its own agent connected, or a push of a transfer nobody else
    holds (first come, documented) may come of it."""

    def __init__(self, engine: Any, origin: str, before: dict[str, Any], others: set[str]) -> None:
        self.engine, self.origin, self.before, self.others = engine, origin, before, others

    def note(self, a: Note, /) -> bool:
        if a.kind is NoteKind.QUEUE_WAIT:  # a push of a transfer nobody else holds starts
            return a.detail not in self.before["transfers"]
        # LINK_CAPPED: the scheduler's count of chunks held back by a link's caps (the poll
        # that starts such a push reports it); what changes for others is checked anyway.
        return a.kind in (
            NoteKind.REJECTED,
            NoteKind.FENCED,
            NoteKind.PEER_RESTART,
            NoteKind.LINK_CAPPED,
        )

    def send_message(self, a: SendMessage, /) -> bool:
        return a.to == self.origin  # only the forger's own channel proves that identity

    def connect_peer(self, a: ConnectPeer, /) -> bool:
        # P met a peer of the forger's own key; its agent must not be anyone else's.
        eng = self.engine
        slot = identity.peer_slot(a.info.engine_id, a.info.rank)
        return (
            isinstance(eng, Sender)
            and eng._peers.get((self.origin, slot)) == a.info
            and a.info.agent_name not in self.others
            and a.replaces not in self.others
        )

    def drop_peer(self, a: DropPeer, /) -> bool:
        return a.agent_name not in self.others

    def post_write(self, a: PostWrite, /) -> bool:
        return self._first_come(a.transfer_id)

    def release_send(self, a: ReleaseSend, /) -> bool:
        return self._first_come(a.transfer_id)

    def post_read(self, a: PostRead, /) -> bool:
        return False

    def report_finished(self, a: ReportFinished, /) -> bool:
        # An aborted receive of the origin's own transfer, ended by its own restart (below).
        return a.outcome is Outcome.ABORTED and self._own_receive(a.transfer_id)

    def report_failed(self, a: ReportFailed, /) -> bool:
        # An engine forging with its own key speaks as its live process: the first message D
        # hears from a restarted prefill (here a "forged" one) rightly fails the transfers
        # its dead process held. Those are the origin's own; nobody else's may end.
        return a.reason == "peer_restarted" and self._own_receive(a.transfer_id)

    def _own_receive(self, tid: str) -> bool:
        """D's receive ``tid`` belonged to the origin (its owner is the forger's key)."""
        return isinstance(self.engine, Receiver) and tid not in self.before["transfers"]

    def _first_come(self, tid: str) -> bool:
        return isinstance(self.engine, Sender) and tid not in self.before["transfers"]


# ------------------------------------------------------------------------------ the world
class World:
    """N prefill and M decode ranks, a network and NICs, in simulated (true) time ``now``."""

    def __init__(self, n_p: int, n_d: int, chaos: Chaos, seed: int) -> None:
        self.chaos = chaos
        self.seed = seed
        self._sends: dict[tuple[str, int], int] = {}  # per-process message counters
        self.now = 0.0
        self.nodes: dict[str, Node] = {}
        self.wires: dict[int, Wire] = {}
        self.flights: dict[tuple[str, int, int], Flight] = {}
        # id -> (at, D agent, done, the agent that sent it)
        self.notifs: dict[int, tuple[float, str, m.Done, str]] = {}
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count(1)
        self._ids = itertools.count(1)
        self._handles = itertools.count(1)  # connections made (``handle``)
        self._incs = itertools.count(101)
        self.tid_count = 0  # requests so far (ids t1, t2, ...)
        self.history: deque[Wire] = deque(maxlen=64)  # recent messages, for stale replays
        self.generations: deque[int] = deque(maxlen=64)  # granted ones, for the attacker
        self.reported: dict[tuple[str, int, str], str] = {}  # (D, inc, tid) -> report
        self.released: dict[tuple[str, int, str], str] = {}  # (P, inc, tid) -> outcome
        self.stats: dict[str, int] = {}
        self.trace: deque[str] = deque(maxlen=4000)
        self.broken = False
        self.cuts: list[tuple[str, str, float]] = []  # (from, to, until)
        self.slow_links: list[tuple[frozenset[str], float]] = []
        self.intruder = IntruderState()
        # A WRITE posted within CHUNK_MAX_S of the end of D's permit takes CHUNK_MAX_S (the
        # scenario that drives the race between P's stop point and D's reuse point).
        self.slowest_near_the_end = False
        self.named_share = NAMED_SHARE  # of requests: the router names the decode to P
        # Every request the router sent: id -> (P, D, named); those a client aborted; those
        # D took from its prefix cache or refused (never received).
        self.requests: dict[str, tuple[str, str, bool]] = {}
        self.client_aborted: set[str] = set()
        self.not_received: set[str] = set()
        # Requests D kept waiting for credit while it held blocks for a request whose decode
        # the router did not name and that the intruder had spoken of (see check_outcomes).
        self.starved_by_unnamed: set[str] = set()
        for i in range(n_p):
            self.nodes[f"P{i}"] = Node(f"P{i}", "P", node_address(f"P{i}"))
        for j in range(n_d):
            self.nodes[f"D{j}"] = Node(f"D{j}", "D", node_address(f"D{j}"))
        for node in self.nodes.values():
            self.start(node)

    # ------------------------------------------------------------------ bookkeeping
    def count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1

    def log(self, text: str) -> None:
        self.trace.append(f"{self.now:9.4f} {text}")

    def fail(self, text: str) -> Violation:
        """A Violation with the events of the transfers it names and the latest ones."""
        self.broken = True
        tids = set(re.findall(r"\bt\d+\b", text))
        mine = [e for e in self.trace if tids & set(re.findall(r"\bt\d+\b", e))]
        return Violation(
            f"at t={self.now:.4f}: {text}\nevents of {sorted(tids)}:\n"
            + "\n".join(mine[-60:])
            + "\nlatest events:\n"
            + "\n".join(list(self.trace)[-30:])
        )

    def r(self, *key: Any) -> KeyedRandom:
        """The world's randomness for one thing (a message, a chunk, a request): keyed by what
        it is rather than drawn from one stream, so removing an unrelated step while
        shrinking does not reshuffle every later outcome."""
        return KeyedRandom((self.seed << 32) ^ zlib.crc32(repr(key).encode()))

    def _push(self, at: float, kind: str, key: Any) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), kind, key))

    def connect(self, node: Node, agent: str) -> str | Deferred:
        """A connect to ``agent`` (P's to a D it pushes to, D's to a P it pulls from): at
        once, or (Chaos.connect_slow / connect_fail) made elsewhere and handed to the driver
        later, connected or failed."""
        c = self.chaos
        r = self.r("connect", node.name, node.inc, agent, self.now)
        fail = r.random() < c.connect_fail
        if not (fail or r.random() < c.connect_slow):
            return self.handle(agent)
        self.count("connect:failed" if fail else "connect:slow")
        at = self.now + r.uniform(0.001, CONNECT_MAX_S)
        self._push(at, "connect", (node.name, node.inc, agent, fail))
        return DEFERRED

    def handle(self, agent: str) -> str:
        """A connection's handle: one of its own for each connect (the driver tells a
        connection made since from the one a late failure went out on by identity)."""
        return f"{agent}#{next(self._handles)}"

    def _connected(self, key: tuple[str, int, str, bool]) -> None:
        node = self._node((key[0], key[1]))
        if node is None:
            return  # that process is gone, and its connect with it
        agent, failed = key[2], key[3]
        self.log(f"{node.name} {'could not connect' if failed else 'connected'} to {agent}")
        node.driver.connected(
            agent, None if failed else self.handle(agent), "injected connect failure"
        )
        self.check_sender(node)

    def by_address(self, address: str) -> Node | None:
        for node in self.nodes.values():
            if node.address == address:
                return node
        return None

    def by_agent(self, agent: str) -> Node | None:
        for node in self.nodes.values():
            if node.alive and node.agent == agent:
                return node
        return None

    # ------------------------------------------------------------------ life and death
    def start(self, node: Node) -> None:
        node.alive = True
        node.inc = next(self._incs)
        node.agent = agent_name(node.name, node.inc)
        r = self.r("start", node.name, node.inc)
        node.mono_off = r.uniform(0.0, 500.0)  # monotonic clocks share no origin
        node.wall_off = r.uniform(-WALL_SKEW_S, WALL_SKEW_S) if self.chaos.skew else 0.0
        n = D_BLOCKS if node.role == "D" else P_BLOCKS
        layout = m.Layout("sim", "DRAM", [m.Region(0, BLOCK_BYTES, BLOCK_BYTES, n)])
        if node.info is not None:
            node.past[node.info.incarnation] = node.info
        node.info = m.PeerInfo(node.name, node.inc, 0, node.address, node.agent, b"meta", layout)
        rng = random.Random(node.inc)
        node.pool = BlockPool(n, f"{node.name}#{node.inc}")
        node.paused_until = 0.0
        node.deferred.clear()
        node.preqs, node.dreqs, node.closed = {}, {}, {}
        if node.role == "P":
            node.engine = Sender(node.info, SENDER, rng)
        else:
            # As the shells: generations get random low bits (unguessable), here from the seed.
            tokens = random.Random(f"{self.seed}:tokens:{node.name}:{node.inc}")
            node.engine = Receiver(node.info, RECEIVER, rng, tokens=tokens)
            node.admissions = Admissions(CreditLedger(CREDITS), BLOCK_TOKENS)
        # As the shells: one driver carries out the engine's actions; the world's effects
        # are its network and NIC, and its checks see every action first.
        node.driver = Driver(node.engine, NodeEffects(self, node), NodeChecks(self, node))
        self._push(self.now + r.uniform(0.0, TICK_S), "tick", (node.name, node.inc))
        self.log(f"{node.name} starts as incarnation {node.inc}")

    def crash(self, node: Node) -> None:
        """The process dies: its engine, requests and blocks are gone; what it had sent on
        the control channel is lost (with ``zombie``: some of it comes late); its chunks in
        flight land now or never."""
        self.log(f"{node.name}#{node.inc} crashes")
        self.count("crash")
        for key, fl in list(self.flights.items()):
            if key[0] == node.name and key[1] == node.inc:
                del self.flights[key]
                if fl.op == "WRITE":
                    self._land(fl, ok=False, torn=True)  # whatever got out lands by now
        for wid, w in list(self.wires.items()):
            if w.src != node.name or w.src_inc != node.inc:
                continue
            if not self.chaos.zombie:
                del self.wires[wid]
            elif (r := self.r("zombie", wid)).random() < 0.5:
                # Stuck in a queue with the connection of the dead process: comes late.
                w.at = self.now + r.uniform(0.0, SPIKE_MAX_S)
                self._push(w.at, "wire", wid)
        node.alive = False
        node.engine = None
        node.driver = None
        node.admissions = None
        node.pool = None
        node.preqs, node.dreqs, node.closed = {}, {}, {}
        node.deferred.clear()
        node.died_at = self.now
        # A supervisor brings it back (the restart rule may do so earlier).
        self._push(
            self.now
            + self.r("restart", node.name, node.inc).uniform(RESTART_MIN_S, 4 * RESTART_MIN_S),
            "restart",
            (node.name, node.inc),
        )

    # ------------------------------------------------------------------ engine calls
    def command(self, node: Node, command: Command[Any]) -> None:
        """The engine thread hands the pump a typed command (as the connector's worker)."""
        self.call(node, command.apply)

    def call(self, node: Node, fn: Callable[[Any, float], list[Action]]) -> None:
        """Feed the engine an event (deferred while its pump is stalled), run its actions."""
        if not node.alive:
            return
        if node.paused_until > self.now:
            inc = node.inc
            node.deferred.append(lambda: self._call_now(node, inc, fn))
            return
        self._call_now(node, node.inc, fn)

    def call_completed(self, node: Node, cid: int, err: str) -> None:
        """The chunk ``cid`` of ``node`` ended (``err`` "": landed), through the driver's
        door for completions (it drops a connection the transport reports closed)."""
        if not node.alive:
            return
        inc = node.inc
        if node.paused_until > self.now:
            node.deferred.append(lambda: self._completed_now(node, inc, cid, err))
            return
        self._completed_now(node, inc, cid, err)

    def _completed_now(self, node: Node, inc: int, cid: int, err: str) -> None:
        if not node.alive or node.inc != inc:
            return
        try:
            node.driver.completed(cid, ChunkError.from_text(err) if err else None)
        except BaseException:
            self.broken = True
            raise
        self.check_sender(node)

    def _call_now(self, node: Node, inc: int, fn: Callable[[Any, float], list[Action]]) -> None:
        if not node.alive or node.inc != inc:
            return
        try:
            # Through the driver's one door in, as the pump feeds it (at the node's clock).
            node.driver.feed(Stage.COMMAND, "a world event", fn)
        except BaseException:
            self.broken = True  # the world is half-updated: no quiescence check after this
            raise
        self.check_sender(node)

    def check_sender(self, node: Node) -> None:
        """After every event P takes: its machines and what it holds agree."""
        if node.alive and isinstance(node.engine, Sender):
            wrong = sender_disagreements(node.engine)
            if wrong:
                raise self.fail(f"{node.name}: " + "; ".join(wrong))

    def execute(self, node: Node, actions: list[Action]) -> None:
        """Carry out ``actions`` through the node's driver (as the pump does)."""
        node.driver.run(actions)

    # ------------------------------------------------------------------ network
    def send(self, node: Node, peer: str, to: str, msg: m.ControlMessage) -> None:
        """``node`` sends ``msg`` (stamped with its wall clock by the driver) to the endpoint
        at ``peer`` that must prove identity ``to``."""
        if not to:
            raise self.fail(
                f"{node.name} sends {type(msg).__name__} to {peer} without "
                "naming the identity it must reach"
            )
        if peer == INTRUDER_ADDRESS and to == INTRUDER_KEY:
            self.intruder_hears(node, msg)
            return
        dst = self.by_address(peer)
        if dst is None or dst.address != to:
            # The channel to that address cannot prove ``to`` (a reply to a forged claim): the
            # handshake fails and nothing is delivered.
            self.count(f"send:refused:{type(msg).__name__}")
            self.log(
                f"{node.name} sends {type(msg).__name__} "
                f"{getattr(msg, 'transfer_id', '')} to {peer} as {to[:16]}: refused"
            )
            return
        self.count(f"send:{type(msg).__name__}")
        self.log(
            f"{node.name} sends {type(msg).__name__} {getattr(msg, 'transfer_id', '')}"
            f" g{getattr(msg, 'generation', '')} -> {peer}"
        )
        c = self.chaos
        n = self._sends[(node.name, node.inc)] = self._sends.get((node.name, node.inc), 0) + 1
        r = self.r("send", node.name, node.inc, n)
        copies = 0 if r.random() < c.drop else 1
        if copies and r.random() < c.dup:
            copies = 2
        for _ in range(copies):
            delay = r.uniform(0.0002, c.delay_max_s)
            if r.random() < c.spike:
                delay = r.uniform(0.0, SPIKE_MAX_S)
            self.enqueue(node.name, node.inc, peer, msg, self.now + delay, node.address)

    def partition(self, a: str, b: str, dt: float, both: bool = True) -> None:
        """Cut the control network from node ``a`` to ``b`` (and back if ``both``) for
        ``dt`` seconds; the RDMA fabric is a separate network and keeps working."""
        self.log(f"control network {a} {'<' if both else ''}-> {b} cut for {dt:.3f}s")
        self.count("partition")
        self.cuts.append((a, b, self.now + dt))
        if both:
            self.cuts.append((b, a, self.now + dt))

    def slow_down(self, a: str, b: str, dt: float) -> None:
        """The RDMA link between nodes ``a`` and ``b`` crawls: every chunk takes nearly as
        long as a chunk may, so pushes last long enough for permits to run out under them."""
        self.log(f"RDMA link {a} <-> {b} slow for {dt:.3f}s")
        self.count("slow_link")
        self.slow_links.append((frozenset((a, b)), self.now + dt))

    def slowed(self, a: str, b: str) -> bool:
        pair = frozenset((a, b))
        return any(p == pair and until > self.now for p, until in self.slow_links)

    def cut(self, src: str, dst: str) -> bool:
        return any(a == src and b == dst and until > self.now for a, b, until in self.cuts)

    def enqueue(
        self, src: str, src_inc: int, dst: str, msg: m.ControlMessage, at: float, origin: str
    ) -> Wire:
        w = Wire(next(self._ids), src, src_inc, dst, msg, self.now, at, origin)
        self.wires[w.id] = w
        self._push(w.at, "wire", w.id)
        self.history.append(w)
        return w

    # ------------------------------------------------------------------ stale generations
    _FOR_D = {
        "Failed": "Failed",
        "CancelAck": "CancelAck",
        "Fallback": "Fallback",
        "Done": "Done",
        "Register": "Failed",
        "Cancel": "CancelAck",
        "PullDone": "Fallback",
        "Heartbeat": "Done",
        "DoneQuery": "DoneQuery",
        "DoneState": "DoneQuery",
    }
    _FOR_P = {
        "Register": "Register",
        "Cancel": "Cancel",
        "PullDone": "PullDone",
        "Heartbeat": "Heartbeat",
        "Failed": "Register",
        "CancelAck": "Cancel",
        "Fallback": "PullDone",
        "Done": "Heartbeat",
        "DoneQuery": "DoneState",
        "DoneState": "DoneState",
    }

    def stale_candidates(self, role: str) -> list[tuple[str, str]]:
        """(node, transfer) pairs where a message with another generation can be made to
        look as if it came from the live peer incarnation the node already knows."""
        out: list[tuple[str, str]] = []
        for node in self.nodes.values():
            if not node.alive or node.role != role:
                continue
            eng = node.engine
            if isinstance(eng, Receiver):
                for tid, inc in eng._in.items():
                    p = self.by_address(inc.address)
                    peer = eng._peers.get((inc.owner, 0))
                    if (
                        p
                        and p.alive
                        and inc.owner == p.address
                        and peer
                        and peer.incarnation == p.inc
                    ):
                        out.append((node.name, tid))
            else:
                for tid, o in eng._out.items():
                    if o.reg is None:
                        continue
                    d = self.by_address(o.reg.sender.control)
                    known = eng._peers.get((o.owner, o.reg.sender.rank))
                    if (
                        d
                        and d.alive
                        and o.owner == d.address
                        and d.inc == o.reg.sender.incarnation
                        and known
                        and known.incarnation == d.inc
                    ):
                        out.append((node.name, tid))
        return out

    def deliver_stale(self, cand: tuple[str, str], kind: str, shift: int) -> None:
        node = self.nodes[cand[0]]
        tid = cand[1]
        eng = node.engine
        v = m.PROTOCOL_VERSION
        msg: m.ControlMessage
        if isinstance(eng, Receiver):
            inc = eng._in[tid]
            p = self.by_address(inc.address)
            assert p is not None and p.info is not None
            g = inc.generation + shift if inc.generation + shift > 0 else inc.generation + 3
            kind = self._FOR_D[kind]
            if kind == "Done":
                nid = next(self._ids)
                self.notifs[nid] = (
                    self.now,
                    node.agent,
                    m.Done(v, tid, g, len(inc.blocks)),
                    p.agent,
                )
                self.count("rule:stale")
                self.deliver_notif(nid)
                return
            if kind == "Failed":
                msg = m.Failed(v, tid, g, p.info, "stale")
            elif kind == "CancelAck":
                msg = m.CancelAck(v, tid, g, p.info)
            elif kind == "DoneQuery":
                msg = m.DoneQuery(v, tid, g, p.info, inc.void_below)
            else:
                msg = m.Fallback(
                    v,
                    tid,
                    g,
                    p.info,
                    list(range(len(inc.blocks))),
                    0,
                    "stale",
                    4000,
                    sent_at=p.wall(self.now),
                )
            src = p
        else:
            assert isinstance(eng, Sender)
            o = eng._out[tid]
            assert o.reg is not None
            d = self.by_address(o.reg.sender.control)
            assert d is not None and d.info is not None
            cur = o.reg.generation
            g = cur + shift if cur + shift > 0 else cur + 3
            kind = self._FOR_P[kind]
            if kind == "Register":
                msg = msgspec.structs.replace(o.reg, generation=g, sent_at=d.wall(self.now))
            elif kind == "Cancel":
                msg = m.Cancel(v, tid, g, d.info, "stale")
            elif kind == "PullDone":
                msg = m.PullDone(v, tid, g, d.info, True)
            elif kind == "DoneState":
                msg = m.DoneState(v, tid, g, d.info, o.confirm.attempt if o.confirm else 0, "done")
            else:
                msg = m.Heartbeat(v, d.info, node.inc, [(tid, g)], 3000, sent_at=d.wall(self.now))
            src = d
        if not self.stale_key(node, msg, src.address):
            return  # e.g. a newer REGISTER while P waits: a re-registration, not stale
        self.count("rule:stale")
        self.deliver(
            Wire(
                next(self._ids),
                src.name,
                src.inc,
                node.address,
                msg,
                self.now,
                self.now,
                src.address,
            )
        )

    def deliver(self, w: Wire) -> None:
        self.wires.pop(w.id, None)
        node = self.by_address(w.dst)
        if node is None or not node.alive or self.cut(w.src, node.name):
            return
        self.call(node, lambda eng, now: self._on_message(node, w, eng, now))

    def _on_message(self, node: Node, w: Wire, eng: Any, now: float) -> list[Action]:
        msg = w.msg
        # As the pump: how long the message travelled, by the two wall clocks.
        age = message_age(msg, node.wall(self.now))
        self.log(
            f"{node.name} gets {type(msg).__name__} {getattr(msg, 'transfer_id', '')}"
            f" g{getattr(msg, 'generation', '')} from {w.src}#{w.src_inc} age {age:.3f}"
        )
        if w.attack:
            tomb = getattr(eng, "_tombstones", {}).get(getattr(msg, "transfer_id", ""))
            if (
                KNOWN_BUGS.get("tombstone_overwrite")
                and isinstance(msg, m.Cancel)
                and tomb is not None
                and w.origin not in tomb
            ):
                self.count("attack:skipped:tombstone_overwrite")
                return []
            if (
                KNOWN_BUGS.get("registrant_drops_contenders")
                and isinstance(eng, Sender)
                and self._may_drop_contenders(eng, w.origin, msg)
            ):
                self.count("attack:skipped:registrant_drops_contenders")
                return []
            contends = self._would_contend(eng, w.origin, msg)
            if (
                KNOWN_BUGS.get("contender_zero_ttl")
                and contends
                and isinstance(msg, m.Register)
                and msg.permit_ttl_ms <= 0
            ):
                self.count("attack:skipped:contender_zero_ttl")
                return []
            if (
                KNOWN_BUGS.get("contenders_outlive_bound")
                and contends
                and not eng._out[msg.transfer_id].expected
            ):
                self.count("attack:skipped:contenders_outlive_bound")
                return []
            first = [
                f
                for f in ("contenders_not_renewed", "expired_registration_tombstones")
                if KNOWN_BUGS.get(f)
            ]
            if (
                first
                and isinstance(eng, Sender)
                and isinstance(msg, m.Register)
                and self._registers_first(eng, msg)
            ):
                self.count(f"attack:skipped:{first[0]}")
                return []
            return self._under_attack(
                node,
                w.origin,
                type(msg).__name__,
                lambda: eng.on_message(msg, now, age, origin=w.origin),
            )
        stale = self.stale_key(node, msg, w.origin)
        before = self.snapshot(node, stale) if stale else None
        out: list[Action] = eng.on_message(msg, now, age, origin=w.origin)
        if stale:
            self.count("stale_checked")
            notes, bad = split_notes(out)
            bad += [n for n in notes if n.kind not in (NoteKind.FENCED, NoteKind.REJECTED)]
            after = self.snapshot(node, stale)
            if bad or before != after:
                raise self.fail(
                    f"{node.name}: a {type(msg).__name__} of {stale} with a stale "
                    f"generation {getattr(msg, 'generation', msg)} changed state: "
                    f"actions {bad}, state {before} -> {after}"
                )
        return out

    def stale_key(self, node: Node, msg: m.ControlMessage, origin: str) -> str:
        """The transfer id if ``msg`` (from ``origin``, the transfer's owner) carries a stale
        generation for ``node`` (and comes from a sender incarnation ``node`` already knows,
        so only the generation is at stake)."""
        eng = node.engine
        if isinstance(eng, Receiver):
            if not isinstance(msg, (m.Failed, m.CancelAck, m.Fallback, m.DoneQuery)):
                return ""
            peer = eng._peers.get((origin, msg.sender.rank))
            if peer is None or peer.incarnation != msg.sender.incarnation:
                return ""
            inc = eng._in.get(msg.transfer_id)
            return (
                msg.transfer_id
                if (inc is not None and inc.owner == origin and inc.generation != msg.generation)
                else ""
            )
        assert isinstance(eng, Sender)
        if isinstance(msg, m.Heartbeat):
            if len(msg.live) != 1:
                return ""
            tid, gen = msg.live[0]
            o = eng._out.get(tid)
            ok = o is None or o.reg is None or o.owner != origin or gen in (0, o.reg.generation)
            return "" if ok else tid
        if not isinstance(msg, (m.Register, m.Cancel, m.PullDone, m.DoneState)):
            return ""
        known = eng._peers.get((origin, msg.sender.rank))
        if isinstance(msg, m.Register) and (
            known is None or known.incarnation != msg.sender.incarnation
        ):
            return ""
        o = eng._out.get(msg.transfer_id)
        if o is None or o.reg is None or o.owner != origin:
            return ""
        g, cur = msg.generation, o.reg.generation
        if isinstance(msg, m.Register):
            newer_ok = o.machine.state in (TransferState.NEW, TransferState.WAITING_BLOCKS)
            stale = g < cur or (g != cur and not newer_ok)
        elif isinstance(msg, m.Cancel):
            stale = g not in (0, cur)
        else:
            stale = g != cur
        return msg.transfer_id if stale else ""

    # ------------------------------------------------------------------ dead processes
    def dead_candidates(self) -> list[tuple[str, str, int]]:
        """(receiver, peer, old incarnation): the receiver saw the peer restart, so it knows
        that incarnation is gone. (One it never heard of cannot be told from a new process:
        incarnations are random, not ordered, so such a message is not checked here.)"""
        out: list[tuple[str, str, int]] = []
        for r in self.nodes.values():
            if not r.alive:
                continue
            for peer in self.nodes.values():
                if peer.role == r.role or not peer.alive:
                    continue
                eng = r.engine
                # Peers are keyed by (origin, rank): a real engine's origin is its address.
                if isinstance(eng, Receiver):
                    known = eng._peers.get((peer.address, 0))
                    retired = known.retired if known else set()
                else:
                    retired = eng._retired.get((peer.address, 0), set())
                out += [(r.name, peer.name, inc) for inc in sorted(retired) if inc in peer.past]
        return out

    def deliver_from_dead(self, cand: tuple[str, str, int], kind: str) -> None:
        """A message the dead incarnation sent before it died arrives now: nothing changes."""
        r, peer = self.nodes[cand[0]], self.nodes[cand[1]]
        old = peer.past[cand[2]]
        eng = r.engine
        v = m.PROTOCOL_VERSION
        msg: m.ControlMessage
        if isinstance(eng, Receiver):
            tids = sorted(t for t, i in eng._in.items() if i.address == peer.address)
            if kind == "notice" and tids:
                msg = m.Failed(v, tids[0], eng._in[tids[0]].generation, old, "zombie")
            else:
                msg = m.Heartbeat(
                    v,
                    old,
                    r.inc,
                    [(t, eng._in[t].generation) for t in tids],
                    sent_at=peer.wall(self.now),
                )
        elif kind == "notice":
            msg = m.Register(
                v,
                f"z{next(self._ids)}",
                old,
                [0],
                0,
                16,
                1,
                int(PERMIT_TTL_S * 1000),
                sent_at=peer.wall(self.now),
            )
        else:
            msg = m.Heartbeat(
                v, old, r.inc, [], int(PERMIT_TTL_S * 1000), sent_at=peer.wall(self.now)
            )
        self.count("rule:dead")

        def run(e: Any, now: float) -> list[Action]:
            before = self.full_snapshot(r)
            # Its key is the engine's: a restarted process speaks with the same identity.
            out: list[Action] = e.on_message(msg, now, 0.0, origin=peer.address)
            if split_notes(out)[1] or self.full_snapshot(r) != before:
                raise self.fail(
                    f"{r.name}: a {type(msg).__name__} of {peer.name}'s dead "
                    f"incarnation {old.incarnation} was acted on: {out}"
                )
            return out

        self.call(r, run)

    def full_snapshot(self, node: Node) -> tuple[Any, ...]:
        eng = node.engine
        tids = sorted(eng._in) if isinstance(eng, Receiver) else sorted(eng._out)
        peers = sorted((k, v.incarnation) for k, v in eng._peers.items() if v.incarnation)
        return tuple(self.snapshot(node, t) for t in tids), tuple(peers)

    def snapshot(self, node: Node, tid: str) -> tuple[Any, ...]:
        eng = node.engine
        if isinstance(eng, Receiver):
            inc = eng._in.get(tid)
            lease = eng.leases.get(tid)
            state = eng.leases.state(tid)
            return (
                None
                if inc is None
                else (
                    inc.generation,
                    inc.cancelling,
                    inc.renew,
                    inc.fallback,
                    inc.machine.state,
                    inc.listed_at,
                    inc.read_failed,
                    frozenset(inc.reads),
                ),
                lease,
                state,
                tid in eng._waiting,
            )
        assert isinstance(eng, Sender)
        o = eng._out.get(tid)
        return (
            None
            if o is None
            else (
                o.reg,
                o.permit,
                o.machine.state,
                o.lease_until,
                o.drain_then,
                o.queued,
                o.outcome,
                o.released,
                o.held,
                frozenset(o.inflight),
                o.pull_until,
                o.blocks,
            ),
            tid in eng._tombstones,
            eng.sched.has_transfer(tid),
        )

    # ------------------------------------------------------------------ the attacker
    def live_transfers(self) -> list[tuple[str, str]]:
        """(engine, transfer id) of every transfer an engine of the world holds now."""
        return [
            (n.name, t)
            for n in self.nodes.values()
            if n.alive
            for t in (n.engine._in if n.role == "D" else n.engine._out)
        ]

    def attack_targets(self, node: Node, how: str) -> list[str]:
        """Transfer ids the attacker aims at on ``node``: its live ones, or any id seen, or
        the router's next id, or a bogus one."""
        eng = node.engine
        if how == "live":
            return sorted(eng._in if isinstance(eng, Receiver) else eng._out)
        if how == "any":
            return sorted({t for n in self.nodes.values() for t in (*n.preqs, *n.dreqs, *n.closed)})
        if how == "future":
            return [f"t{self.tid_count + 1}"]
        return ["x-bogus"]

    def _owner_of(self, node: Node, tid: str) -> tuple[str, Node | None]:
        """The identity ``tid`` belongs to on ``node`` (or will: the router's pick) and the
        engine it names ("" and None if nobody yet)."""
        eng = node.engine
        owner = ""
        if isinstance(eng, Receiver):
            inc = eng._in.get(tid)
            waiting = eng._waiting.get(tid)
            owner = inc.owner if inc else waiting[1] if waiting else ""
            req = node.dreqs.get(tid) or node.closed.get(tid)
            if not owner and isinstance(req, DReq):
                owner = req.p_address
        else:
            o = eng._out.get(tid)
            owner = (o.owner or o.required) if o else ""
            req = node.preqs.get(tid) or node.closed.get(tid)
            if not owner and isinstance(req, PReq):
                owner = self.nodes[req.d_name].address
        return owner, self.by_address(owner) if owner else None

    def attack(self, node: Node, tid: str, a: Attack) -> None:
        """The attacker (or an engine that does not own ``tid``) sends ``node`` a forged message."""
        if not node.alive:
            return
        eng = node.engine
        r = self.r("attack", next(self._ids))
        kinds = ATTACK_KINDS[node.role]
        kind = kinds[a.kind % len(kinds)]
        owner, owner_node = self._owner_of(node, tid)
        # Who forges: an identity of its own, or an engine that does not own the transfer
        # (never the owner itself: it speaks for its own transfers).
        forger: Node | None = None
        if a.forger == "engine":
            others = sorted(
                n.name
                for n in self.nodes.values()
                if n.alive
                and n is not node
                and n.address != owner
                and (owner_node is None or n is not owner_node)
                and (node.role == "D" or n.name != self._d_of(node, tid))
            )
            forger = self.nodes[r.choice(others)] if others else None
        if forger is not None:
            origin, rank = forger.address, 0
            assert forger.info is not None
            own = forger.info
        else:
            origin = a.forger if a.forger in ATTACKERS else ATTACKERS[0]
            rank = 0 if KNOWN_BUGS.get("peer_eviction") else a.rank
            own = m.PeerInfo(
                origin,
                7000 + rank,
                rank,
                ATTACKER_ADDRESS,
                f"agent-{origin}-r{rank}",
                b"meta",
                self._layout("P" if node.role == "D" else "D"),
            )
        claim = self._claim(a, own, owner_node, node, r)
        if forger is not None:
            # With its own key an engine can only hurt itself by announcing a restart of its
            # own (its live process would then be cut off): it keeps its incarnation.
            claim = msgspec.structs.replace(claim, incarnation=forger.inc, rank=0)
        else:
            claim = msgspec.structs.replace(claim, rank=rank)
        if KNOWN_BUGS.get("agent_names") and claim.agent_name != own.agent_name:
            claim = msgspec.structs.replace(claim, agent_name=own.agent_name)
        if a.layout == "slim":
            claim = msgspec.structs.replace(claim, agent_meta=b"", layout=None)
        elif a.layout == "foreign":
            claim = msgspec.structs.replace(
                claim,
                layout=m.Layout(
                    "another-model", "DRAM", [m.Region(0, BLOCK_BYTES, BLOCK_BYTES, 8)]
                ),
            )
        gen = self._guess(node, tid, a.guess, kind, r)
        v = m.PROTOCOL_VERSION
        sent_at = (forger or node).wall(self.now)
        msg: m.ControlMessage
        if kind == "Done":
            self._attack_done(node, tid, gen, forger.agent if forger else own.agent_name, origin)
            return
        if node.role == "P":
            n = self._size(node, tid, r)
            if kind == "Register":
                o = eng._out.get(tid)
                if forger is not None and not (
                    o is not None and o.required and o.required != origin
                ):
                    # An engine registering a transfer nobody named with its own key gets
                    # P's writes into its own memory: its own doing, not the core's.
                    self.count("attack:skipped:engine_register")
                    return
                blocks = [r.choice(range(D_BLOCKS)) for _ in range(n)]
                msg = m.Register(v, tid, claim, blocks, 0, n * 16, gen, a.ttl_ms, sent_at=sent_at)
            elif kind in ("Heartbeat", "Waiting"):
                msg = m.Heartbeat(
                    v,
                    claim,
                    node.inc,
                    [(tid, 0 if kind == "Waiting" else gen)],
                    a.ttl_ms,
                    sent_at=sent_at,
                )
            elif kind == "Cancel":
                msg = m.Cancel(v, tid, gen if a.guess != "zero" else 0, claim, "forged")
            elif kind == "PullDone":
                msg = m.PullDone(v, tid, gen, claim, r.random() < 0.7)
            elif kind == "DoneState":
                # The attempt P asks about, where it asks (the attacker may have seen it).
                o = eng._out.get(tid)
                attempt = o.confirm.attempt if o is not None and o.confirm else 0
                msg = m.DoneState(
                    v, tid, gen, claim, attempt, r.choice(("done", "pending", "gone"))
                )
            else:
                msg = m.Failed(v, tid, gen, claim, "forged")
        else:
            inc = eng._in.get(tid)
            n = len(inc.blocks) if inc is not None else self._size(node, tid, r)
            if kind == "Heartbeat":
                msg = m.Heartbeat(v, claim, node.inc, [(tid, gen)], a.ttl_ms, sent_at=sent_at)
            elif kind == "Failed":
                msg = m.Failed(v, tid, gen, claim, "forged")
            elif kind == "CancelAck":
                msg = m.CancelAck(v, tid, gen, claim)
            elif kind == "Fallback":
                msg = m.Fallback(
                    v,
                    tid,
                    gen,
                    claim,
                    [r.choice(range(P_BLOCKS)) for _ in range(n)],
                    0,
                    "forged",
                    a.ttl_ms,
                    sent_at=sent_at,
                )
            elif kind == "DoneQuery":
                # A forged question must void nothing: the owner's DONE still counts.
                msg = m.DoneQuery(v, tid, gen, claim, inc.void_below if inc is not None else 0)
            else:
                msg = m.Register(
                    v, tid, claim, list(range(n)), 0, n * 16, gen, a.ttl_ms, sent_at=sent_at
                )
        self.count(f"attack:sent:{node.role}:{kind}")
        self.count(f"attack:target_live:{tid in (eng._in if node.role == 'D' else eng._out)}")
        w = Wire(
            next(self._ids),
            forger.name if forger else origin,
            forger.inc if forger else 0,
            node.address,
            msg,
            self.now,
            self.now + a.delay,
            origin,
            attack=True,
        )
        self.log(
            f"{origin[:20]} forges {kind} {tid} g{gen} claiming {claim.engine_id}#"
            f"{claim.incarnation} r{claim.rank} -> {node.name}"
        )
        if a.delay <= 0.0:
            self.deliver(w)
        else:
            self.wires[w.id] = w
            self._push(w.at, "wire", w.id)

    def _d_of(self, node: Node, tid: str) -> str:
        """The decode engine of ``tid`` as P's request names it ("" if none)."""
        req = node.preqs.get(tid) or node.closed.get(tid)
        return req.d_name if isinstance(req, PReq) else ""

    def _layout(self, role: str) -> m.Layout:
        n = D_BLOCKS if role == "D" else P_BLOCKS
        return m.Layout("sim", "DRAM", [m.Region(0, BLOCK_BYTES, BLOCK_BYTES, n)])

    def _claim(
        self, a: Attack, own: m.PeerInfo, owner: Node | None, node: Node, r: KeyedRandom
    ) -> m.PeerInfo:
        peers = sorted(
            n.name for n in self.nodes.values() if n.info is not None and n.role != node.role
        )
        if owner is None or owner.info is None:
            if a.claim == "own" or not peers:
                return own
            owner = self.nodes[r.choice(peers)]
            assert owner.info is not None
        info = owner.info
        if a.claim == "own":
            return own
        if a.claim == "owner_new":
            return msgspec.structs.replace(info, incarnation=int(r.random() * 2**40) + 1)
        if a.claim == "owner_old":
            old = sorted(owner.past)
            return (
                owner.past[r.choice(old)]
                if old
                else msgspec.structs.replace(info, incarnation=int(r.random() * 2**40) + 1)
            )
        if a.claim == "other":
            other = [p for p in peers if p != owner.name]
            if other:
                o_info = self.nodes[r.choice(other)].info
                assert o_info is not None
                return o_info
        return info

    def _size(self, node: Node, tid: str, r: KeyedRandom) -> int:
        """How many blocks the attacker says ``tid`` has (what the router sent, usually)."""
        o = node.engine._out.get(tid) if node.role == "P" else None
        if o is not None and o.blocks is not None and r.random() < 0.8:
            return len(o.blocks)
        req = node.preqs.get(tid) or node.dreqs.get(tid) or node.closed.get(tid)
        if isinstance(req, PReq) and r.random() < 0.8:
            return req.nblocks
        if isinstance(req, DReq) and r.random() < 0.8:
            return req.nblocks
        return 1 + int(r.random() * 8)

    def _guess(self, node: Node, tid: str, how: str, kind: str, r: KeyedRandom) -> int:
        """The generation a forged message names: the attacker does not know the current one
        (it is unguessable); a control message may carry it anyway (its origin alone must be
        refused), a DONE only where D knows the owner's agent (that alone must refuse it)."""
        eng = node.engine
        current = 0
        if isinstance(eng, Receiver):
            inc = eng._in.get(tid)
            current = inc.generation if inc is not None else 0
            if how == "current" and kind == "Done" and (inc is None or not eng._owner_agent(inc)):
                how = "near"
        else:
            o = eng._out.get(tid)
            if o is not None and o.reg is not None:
                current = o.reg.generation
            else:  # D's grant, if it made one: the REGISTER may still be on its way
                for n in self.nodes.values():
                    if n.alive and n.role == "D" and tid in n.engine._in:
                        current = n.engine._in[tid].generation
        if how == "current" and current:
            return current
        if how in ("current", "near") and current:
            return max(1, current + r.choice((-1, 1)))
        if how == "past" and self.generations:
            past = [g for g in self.generations if g != current]
            if past:
                return r.choice(past)
        if how == "zero":
            return 0
        return int(r.random() * 2**62) + 1

    def _attack_done(self, node: Node, tid: str, gen: int, agent: str, origin: str) -> None:
        eng = node.engine
        inc = eng._in.get(tid)
        done = m.Done(m.PROTOCOL_VERSION, tid, gen, len(inc.blocks) if inc else 1)
        self.count("attack:sent:D:Done")
        self.count(f"attack:target_live:{inc is not None}")
        self.log(f"{agent} forges DONE {tid} g{gen} -> {node.name}")
        self.call(
            node,
            lambda e, now: self._under_attack(
                node, origin, "DONE", lambda: e.on_done(done, now, agent=agent)
            ),
        )

    def _under_attack(
        self, node: Node, origin: str, what: str, run: Callable[[], list[Action]]
    ) -> list[Action]:
        """Run a forged message from ``origin``: it may only be refused. Nothing of any other
        identity may change (the origin's own peer entries and transfers may: they are its
        own), and the only actions are notes, replies to the forger (its channel proves
        ``to``), connecting the forger's own agent, or, for a transfer nobody named and
        nobody else holds (first come, documented), pushing it."""
        self.count("attack:delivered")
        before = self.trust_view(node, origin)
        others = self._agents_of_others(node, origin)
        out = run()
        after = self.trust_view(node, origin)
        notes, acts = split_notes(out)
        for n in notes:
            self.count(f"attack:note:{n.kind}:{n.reason}")
        for a in acts:
            self.count(f"attack:action:{type(a).__name__}")
        harmless = Harmless(node.engine, origin, before, others)
        bad = [a for a in out if not visit(a, harmless)]
        changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
        if bad or changed:
            diff = "; ".join(f"{k}: {self._diff(b, a)}" for k, (b, a) in changed.items())
            raise self.fail(
                f"{node.name}: a forged {what} from {origin} was acted on: "
                f"actions {bad}; changed {diff or 'nothing'}"
            )
        if not out:
            self.count("attack:silent")
        return out

    @staticmethod
    def _diff(before: Any, after: Any) -> str:
        if isinstance(before, dict) and isinstance(after, dict):
            keys = sorted({*before, *after}, key=repr)
            return ", ".join(
                f"{k!r}: {before.get(k)} -> {after.get(k)}"
                for k in keys
                if before.get(k) != after.get(k)
            )
        return f"{before} -> {after}"

    def trust_view(self, node: Node, origin: str) -> dict[str, Any]:
        """What ``node`` holds for identities other than ``origin``: the transfers they own
        (on P: named by the router, or bound by their first REGISTER), their peer entries,
        liveness and tombstones."""
        eng = node.engine
        if isinstance(eng, Receiver):
            return {
                "transfers": {
                    tid: (
                        self.snapshot(node, tid),
                        inc.owner,
                        inc.address,
                        tuple(inc.blocks),
                        inc.p_incarnation,
                        inc.p_rank,
                        inc.registered_at,
                        eng.reads.has_transfer(tid),
                    )
                    for tid, inc in eng._in.items()
                    if inc.owner != origin
                },
                "waiting": {t: v for t, v in eng._waiting.items() if v[1] != origin},
                "leases": {
                    k: (eng.leases.get(k), eng.leases.state(k))
                    for k in eng.leases.keys()  # noqa: SIM118 - a method, not a dict
                    if k not in eng._in or eng._in[k].owner != origin
                },
                # Other identities' entries that a live transfer relies on (an unused one may
                # be forgotten: the directory is bounded, least recently heard first).
                "peers": {
                    k: (v.incarnation, v.agent, tuple(v.retired), v.last_heard)
                    for k, v in eng._peers.items()
                    if k[0] != origin and k in {(i.owner, i.p_rank) for i in eng._in.values()}
                },
                "heard": {
                    k: v
                    for k, v in eng._heard.items()
                    if k != origin and k in {i.owner for i in eng._in.values()}
                },
                "chunks": {c: t for c, (_, t) in eng._chunks.items()},
            }
        assert isinstance(eng, Sender)
        ts: dict[str, Any] = {}
        for tid, o in eng._out.items():
            named = bool(o.required) and o.required != origin
            bound = not o.required and bool(o.owner) and o.owner != origin
            if named or bound:
                # A transfer nobody named may still gain contenders and be kept waiting by
                # anyone's heartbeat (its send lease): the router may name one of them later.
                ts[tid] = (
                    named,
                    o.reg,
                    o.owner,
                    o.required,
                    o.peer,
                    o.permit,
                    o.machine.state,
                    o.blocks,
                    o.held,
                    o.expected,
                    o.queued,
                    frozenset(o.inflight),
                    o.retried,
                    o.drain_then,
                    o.reason,
                    o.pull_until,
                    o.outcome,
                    o.released,
                    o.pushed_bytes,
                    eng.sched.has_transfer(tid),
                    o.lease_until if named else None,
                    tuple(sorted(o.contenders)) if named else None,
                )
        return {
            "transfers": ts,
            # The REGISTERs of router-named decodes that P holds, bound or kept while the
            # prefill leg has not come yet (P does not know the name then; the world does).
            "named_registers": self._named_registers(node, origin),
            # Other identities' entries in use by a transfer (unused ones may be forgotten).
            "peers": {
                k: v
                for k, v in eng._peers.items()
                if k[0] != origin and v.agent_name in {o.peer for o in eng._out.values()}
            },
            "retired": {
                k: tuple(v) for k, v in eng._retired.items() if k[0] != origin and k in eng._peers
            },
            "tombstones": {
                t: who - {origin} for t, who in eng._tombstones.items() if who - {origin}
            },
            "chunks": {c: t for c, (_, t) in eng._chunks.items() if t in ts},
        }

    def _agents_of_others(self, node: Node, origin: str) -> set[str]:
        """The NIXL agents ``node`` uses for identities other than ``origin``."""
        eng = node.engine
        if isinstance(eng, Receiver):
            return {p.agent for k, p in eng._peers.items() if k[0] != origin and p.agent}
        return (
            {p.agent_name for k, p in eng._peers.items() if k[0] != origin}
            | {o.peer for o in eng._out.values() if o.owner and o.owner != origin}
        ) - {""}

    def _named_registers(self, node: Node, origin: str) -> dict[str, str]:
        """On P: transfer id -> the decode the router named for it (P's request says, even
        before P got the prefill leg), where P holds that decode's REGISTER: bound, or kept
        among the contenders while P does not know the name yet."""
        eng = node.engine
        out: dict[str, str] = {}
        for tid, o in eng._out.items():
            req = node.preqs.get(tid) or node.closed.get(tid)
            named = o.required or (req.owner if isinstance(req, PReq) else "")
            if (
                named
                and named != origin
                and ((o.owner == named and o.reg is not None) or named in o.contenders)
            ):
                out[tid] = named
        return out

    def _may_drop_contenders(self, eng: Sender, origin: str, msg: m.ControlMessage) -> bool:
        """Whether ``msg`` from ``origin`` could end a transfer that ``origin`` registered
        first while other engines' REGISTERs wait on it (KNOWN_BUGS
        "registrant_drops_contenders"): one about that transfer, or a restart of its own."""
        held = {
            o.tid
            for o in eng._out.values()
            if o.owner == origin
            and o.contenders
            and o.blocks is None
            and self.requests.get(o.tid, ("", "", True))[2]
        }  # named, or not sent yet
        if not held:
            return False
        if getattr(msg, "transfer_id", None) in held:
            return True
        info = msg.sender
        known = eng._peers.get((origin, identity.peer_slot(info.engine_id, info.rank)))
        return known is not None and known.incarnation != info.incarnation

    @staticmethod
    def _would_contend(eng: Any, origin: str, msg: m.ControlMessage) -> bool:
        """Whether ``msg`` is a REGISTER P would keep as a contender: another key holds the
        transfer's registration and its request names no decode yet."""
        if not isinstance(eng, Sender) or not isinstance(msg, m.Register):
            return False
        o = eng._out.get(msg.transfer_id)
        return o is not None and o.reg is not None and o.owner != origin and not o.required

    def _registers_first(self, eng: Sender, reg: m.Register) -> bool:
        """Whether a forged ``reg`` would be the first REGISTER P holds for its id, for a
        request the router names a decode for, or may still send (KNOWN_BUGS
        "contenders_not_renewed", "expired_registration_tombstones")."""
        o = eng._out.get(reg.transfer_id)
        if o is not None and (o.reg is not None or o.required):
            return False  # a contender, or refused: the router named the decode already
        req = self.requests.get(reg.transfer_id)
        if req is None:  # an id the router may still use (t1, t2, ...)
            return re.fullmatch(r"t\d+", reg.transfer_id) is not None
        return req[2]

    # ------------------------------------------------------------------ the intruder
    @staticmethod
    def is_intruder_agent(agent: str) -> bool:
        return identity.owns_agent(INTRUDER_KEY, agent)

    def intruder_hears(self, node: Node, msg: m.ControlMessage) -> None:
        """A message reaches the intruder (its channel proves its key): it learns the
        generations it names (grants of its own, as it owns no transfer of the world)."""
        self.count(f"intruder:heard:{type(msg).__name__}")
        self.log(
            f"{node.name} sends {type(msg).__name__} {getattr(msg, 'transfer_id', '')} "
            f"g{getattr(msg, 'generation', '')} -> the intruder"
        )
        gens = (
            [g for _, g in msg.live]
            if isinstance(msg, m.Heartbeat)
            else [getattr(msg, "generation", 0)]
        )
        self.intruder.seen.extend(g for g in gens if g)

    def intruder_targets(self, node: Node, how: str) -> list[str]:
        """Transfer ids the intruder names to ``node``: the router's newest, one live there,
        any the router used, the router's next (registering ahead of its decode), or a bogus
        one."""
        eng = node.engine
        if how == "newest" and self.tid_count:
            return [f"t{self.tid_count}"]
        if how == "live":
            live = sorted(eng._in if isinstance(eng, Receiver) else eng._out)
            if live:
                return live
            how = "seen"
        if how == "seen" and self.requests:
            return sorted(self.requests)
        if how in ("seen", "future"):
            return [f"t{self.tid_count + 1}"]
        return ["x-bogus"]

    def intrude(self, node: Node, tid: str, mv: Move) -> None:
        """The intruder sends ``node`` one message (``mv``) about ``tid``, over the network
        under its own key; each is checked where it arrives (``_under_attack``)."""
        if not node.alive or (mv.kind == "Done" and node.role != "D"):
            return  # a DONE rides a WRITE into D's memory
        r = self.r("intrude", next(self._ids))
        v = m.PROTOCOL_VERSION
        x = mv.details()
        self.intruder.spoken.add(tid)
        info = self._intruder_info(node, tid, mv, x["rank"], r)
        gen = self._intruder_gen(node, tid, mv.gen, r)
        wall = 1_000_000.0 + self.now + {"true": 0.0, "past": -5.0, "future": 5.0}[x["clock"]]
        self.count(f"intruder:sent:{node.role}:{mv.kind}")
        if mv.kind == "Done":
            rx = node.engine._in.get(tid) if node.role == "D" else None
            done = m.Done(
                v, tid, gen, len(rx.blocks) if rx else 1 + int(r.random() * 8), attempt=x["attempt"]
            )
            nid = next(self._ids)
            self.log(f"the intruder's agent sends DONE {tid} g{gen} -> {node.name}")
            self.notifs[nid] = (
                self.now + mv.delay,
                node.agent,
                done,
                intruder_agent(self.intruder.inc),
            )
            if mv.delay <= 0.0:
                self.deliver_notif(nid)
            else:
                self._push(self.now + mv.delay, "notif", nid)
            return
        msg: m.ControlMessage
        if mv.kind == "Register":
            blocks = self._intruder_blocks(node, tid, x["blocks"], r)
            msg = m.Register(
                v, tid, info, blocks, 0, len(blocks) * BLOCK_TOKENS, gen, x["ttl_ms"], sent_at=wall
            )
        elif mv.kind == "Heartbeat":
            tids = [
                tid,
                *(r.choice(self.intruder_targets(node, "seen")) for _ in range(x["entries"] - 1)),
            ]
            live = [(t, gen if t == tid else self._intruder_gen(node, t, mv.gen, r)) for t in tids]
            peer_inc = node.inc if r.random() < 0.8 else int(r.random() * 2**40)
            msg = m.Heartbeat(v, info, peer_inc, live, x["ttl_ms"], sent_at=wall)
        elif mv.kind == "Cancel":
            msg = m.Cancel(v, tid, gen, info, "intruder")
        elif mv.kind == "CancelAck":
            msg = m.CancelAck(v, tid, gen, info)
        elif mv.kind == "Failed":
            msg = m.Failed(v, tid, gen, info, "intruder")
        elif mv.kind == "Fallback":
            blocks = self._intruder_blocks(node, tid, x["blocks"], r)
            msg = m.Fallback(v, tid, gen, info, blocks, 0, "intruder", x["ttl_ms"], sent_at=wall)
        elif mv.kind == "PullDone":
            msg = m.PullDone(v, tid, gen, info, x["flag"])
        elif mv.kind == "DoneQuery":
            msg = m.DoneQuery(v, tid, gen, info, x["attempt"])
        else:
            msg = m.DoneState(v, tid, gen, info, x["attempt"], "done" if x["flag"] else "gone")
        w = Wire(
            next(self._ids),
            INTRUDER,
            self.intruder.inc,
            node.address,
            msg,
            self.now,
            self.now + mv.delay,
            INTRUDER_KEY,
            attack=True,
        )
        self.log(
            f"the intruder sends {mv.kind} {tid} g{gen} as {info.engine_id}#"
            f"{info.incarnation} r{info.rank} -> {node.name}"
        )
        if mv.delay <= 0.0:
            self.deliver(w)
        else:
            self.wires[w.id] = w
            self._push(w.at, "wire", w.id)

    def _intruder_info(
        self, node: Node, tid: str, mv: Move, rank: int, r: KeyedRandom
    ) -> m.PeerInfo:
        """The PeerInfo a message of the intruder carries (see ``Move.claim``)."""
        poses_as = "D" if node.role == "P" else "P"
        if mv.claim == "self_new":
            self.intruder.inc += 1  # its process restarted: a new incarnation and agent
        me = self.intruder.inc
        own = m.PeerInfo(
            INTRUDER,
            me,
            rank,
            INTRUDER_ADDRESS,
            intruder_agent(me),
            b"meta",
            self._layout(poses_as),
        )
        if mv.claim in ("self", "self_new"):
            return own
        if mv.claim == "slim":
            return msgspec.structs.replace(own, agent_meta=b"", layout=None)
        if mv.claim == "foreign":
            return msgspec.structs.replace(
                own,
                layout=m.Layout(
                    "another-model", "DRAM", [m.Region(0, BLOCK_BYTES, BLOCK_BYTES, 8)]
                ),
            )
        _, victim = self._owner_of(node, tid)
        if victim is None or victim.info is None:
            names = sorted(
                n.name for n in self.nodes.values() if n.info is not None and n.role == poses_as
            )
            victim = self.nodes[r.choice(names)]
        assert victim.info is not None
        them = msgspec.structs.replace(victim.info, rank=rank)
        if mv.claim == "victim_new":
            return msgspec.structs.replace(them, incarnation=int(r.random() * 2**40) + 1)
        if mv.claim == "victim_dp":
            return msgspec.structs.replace(them, engine_id=them.engine_id + "_dp1")
        if mv.claim == "victim_agent":
            return msgspec.structs.replace(own, agent_name=them.agent_name)
        return them

    def _intruder_gen(self, node: Node, tid: str, how: str, r: KeyedRandom) -> int:
        """The generation the intruder names (see ``Move.gen``)."""
        eng = node.engine
        current = 0
        if isinstance(eng, Receiver):
            rx = eng._in.get(tid)
            current = rx.generation if rx is not None else 0
        else:
            o = eng._out.get(tid)
            if o is not None and o.reg is not None:
                current = o.reg.generation
            else:  # D's grant, if it made one (its REGISTER may still be on its way)
                for n in self.nodes.values():
                    if n.alive and n.role == "D" and tid in n.engine._in:
                        current = n.engine._in[tid].generation
        if how == "observed" and self.intruder.seen:
            return r.choice(list(self.intruder.seen))
        if how == "leaked" and self.generations:
            return r.choice(list(self.generations))
        if how in ("current", "observed", "leaked") and current:
            return current
        if how == "near" and current:
            return max(1, current + r.choice((-1, 1)))
        if how == "zero":
            return 0
        return int(r.random() * 2**62) + 1

    def _intruder_blocks(self, node: Node, tid: str, how: str, r: KeyedRandom) -> list[int]:
        """Block ids a REGISTER or FALLBACK of the intruder names (see ``Move.blocks``)."""
        n = self._size(node, tid, r)
        if how == "victim":
            # The blocks the transfer's decode reserved (where P would write its KV).
            for d in self.nodes.values():
                req = d.dreqs.get(tid) if d.alive else None
                if req is not None and req.blocks:
                    return list(req.blocks)
        if how == "other":
            # Blocks another transfer holds on some engine: its KV must not move.
            held = sorted(
                (t, tuple(q.blocks))
                for d in self.nodes.values()
                if d.alive
                for t, q in (*d.dreqs.items(), *d.preqs.items())
                if t != tid and q.blocks
            )
            if held:
                return list(r.choice(held)[1])
        if how == "wild":
            return [D_BLOCKS + P_BLOCKS + int(r.random() * 1000) for _ in range(n)]
        size = D_BLOCKS if node.role == "P" else P_BLOCKS  # its own KV cache
        return [int(r.random() * size) for _ in range(n)]

    def check_outcomes(self) -> None:
        """After quiescence in a calm world (nothing lost, failed or crashed): every request
        whose decode the router named to P, that no client aborted and that D received, was
        pushed: D reported it received once, with P's bytes (checked at the report), and P
        released it as pushed once. Whatever the intruder sent changed none of that.

        One exception, the documented one reaching further: where the router names no
        decode, the intruder may take a transfer (or cancel it) and its decode, never told,
        holds the blocks and their credit until its permit runs out; a named request that
        waited for that credit may then outlive its bound. Such an end is counted
        (``outcome:named:starved_by_unnamed``), not failed."""
        d_ends: dict[str, list[str]] = {}
        p_ends: dict[str, list[str]] = {}
        for (_, _, tid), what in self.reported.items():
            d_ends.setdefault(tid, []).append(what)
        for (_, _, tid), outcome in self.released.items():
            p_ends.setdefault(tid, []).append(str(outcome.value))
        for tid, (p, d, named) in sorted(self.requests.items()):
            if tid in self.client_aborted or tid in self.not_received:
                continue
            ends = (d_ends.get(tid, []), p_ends.get(tid, []))
            if named:
                if (
                    ends != (["ReportFinished(pushed)"], ["pushed"])
                    and tid in self.starved_by_unnamed
                ):
                    self.count("outcome:named:starved_by_unnamed")
                    continue
                if ends != (["ReportFinished(pushed)"], ["pushed"]):
                    raise self.fail(
                        f"{tid} ({p} -> {d}, the decode named to P) ended "
                        f"{ends[0]} on D and {ends[1]} on P in a calm world"
                    )
                self.count("outcome:named:pushed")
            else:
                self.count(
                    f"outcome:unnamed:{'/'.join(ends[0])}:{'/'.join(ends[1])}"
                    + (":intruder_got_kv" if tid in self.intruder.kv else "")
                )

    # ------------------------------------------------------------------ NIC
    def check_write(self, node: Node, a: PostWrite) -> None:
        """A WRITE about to be posted: from blocks P holds for the transfer, under a live
        permit of the D it targets, into blocks that D reserved (checked whether or not
        the agent is connected: a post that fails at once must be a correct one too)."""
        self.count("post:WRITE" + (":last" if a.done else ""))
        pool = node.pool
        assert pool is not None
        preq = node.preqs.get(a.transfer_id)
        for b in a.src_blocks:
            if pool.owner[b] != a.transfer_id:
                raise self.fail(
                    f"{node.name} posts a WRITE of {a.transfer_id} from its block "
                    f"{b} owned by {pool.owner[b]!r}"
                )
        if preq is None or preq.state not in ("computing", "computed", "held"):
            raise self.fail(f"{node.name} posts a WRITE of {a.transfer_id} it does not hold")
        if a.parts > 1:
            self.count(
                "post:WRITE:layer" + (":during_forward" if preq.state == "computing" else "")
            )
        if preq.state == "computing" and (
            a.done is not None or a.parts != LAYERS or a.part >= preq.layers
        ):
            raise self.fail(
                f"{node.name} posts a WRITE of {a.transfer_id} (layer {a.part} of "
                f"{a.parts}, DONE {a.done is not None}) while its forward has "
                f"computed {preq.layers} layers"
            )
        d_address = self.nodes[preq.d_name].address
        if not identity.owns_agent(d_address, a.peer):
            # Not into the decode engine the router sent the request to.
            if preq.owner:
                raise self.fail(
                    f"{node.name} posts a WRITE of {a.transfer_id}, whose decode "
                    f"the router named ({preq.d_name}), to agent {a.peer}"
                )
            # A router that names no decode: the first engine to register it gets the KV
            # (documented); counted.
            self.count(
                "unnamed:written_elsewhere"
                + (":intruder" if self.is_intruder_agent(a.peer) else "")
            )
        target = self.by_agent(a.peer)
        if target is not None:
            self._check_write_permit(node, target, a)
        self._check_chunk_id(node, a.chunk_id)

    def post_write(self, node: Node, a: PostWrite) -> None:
        """The WRITE goes out on P's NIC (the driver found its agent connected)."""
        target = self.by_agent(a.peer)
        dst = (
            (target.name, target.inc, a.dst_blocks)
            if target
            else (INTRUDER, self.intruder.inc, a.dst_blocks)
            if self.is_intruder_agent(a.peer)
            else ("", 0, a.dst_blocks)
        )
        self._post(
            node,
            "WRITE",
            a.transfer_id,
            a.generation,
            a.chunk_id,
            a.peer,
            (node.name, node.inc, a.src_blocks),
            dst,
            a.done,
            a.part,
            a.parts,
        )

    def _check_write_permit(self, node: Node, d: Node, a: PostWrite) -> None:
        """The WRITE is under a live permit of that very D and into blocks it reserved."""
        recv = d.engine
        assert isinstance(recv, Receiver) and d.pool is not None
        lease = recv.leases.get(a.transfer_id)
        state = recv.leases.state(a.transfer_id)
        d_now = d.local(self.now)
        if lease is None or lease.generation != a.generation:
            raise self.fail(
                f"{node.name} posts a WRITE of {a.transfer_id} g{a.generation} to "
                f"{d.name}, which holds no permit for it ({lease})"
            )
        if state not in (LeaseState.LIVE, LeaseState.RELEASED) or d_now >= lease.expires_at:
            raise self.fail(
                f"{node.name} posts a WRITE of {a.transfer_id} g{a.generation} after "
                f"its permit ended: {state}, expires {lease.expires_at - d.mono_off:.4f}"
            )
        slack = lease.expires_at - d_now
        self.count("post_slack<" + next(str(x) for x in (0.5, 1, 1.5, 2, 3, 99) if slack < x))
        want = (a.transfer_id, a.generation)
        for b in a.dst_blocks:
            if d.pool.owner[b] != want:
                raise self.fail(
                    f"{node.name} posts a WRITE of {a.transfer_id} into {d.name} "
                    f"block {b} owned by {d.pool.owner[b]!r}"
                )

    def check_read(self, node: Node, a: PostRead) -> None:
        """A READ about to be posted: into blocks D reserved for the transfer, from blocks P
        offers for pulling, within P's read permit."""
        self.count("post:READ")
        pool = node.pool
        assert pool is not None
        for b in a.local_blocks:
            if pool.owner[b] != (a.transfer_id, a.generation):
                raise self.fail(
                    f"{node.name} posts a READ of {a.transfer_id} into its block "
                    f"{b} owned by {pool.owner[b]!r}"
                )
        dreq = node.dreqs.get(a.transfer_id)
        if dreq is None or not identity.owns_agent(dreq.p_address, a.peer):
            raise self.fail(
                f"{node.name} READs {a.transfer_id} from agent {a.peer}, not one of "
                f"the prefill the router named ({dreq and dreq.p_name})"
            )
        target = self.by_agent(a.peer)
        if target is not None:
            send = target.engine
            assert isinstance(send, Sender) and target.pool is not None
            o = send._out.get(a.transfer_id)
            if o is None or o.machine.state is not TransferState.FALLBACK:
                raise self.fail(
                    f"{node.name} READs {a.transfer_id} from {target.name}, which "
                    f"does not offer it for pulling ({o and o.machine})"
                )
            if target.local(self.now) >= o.pull_until:
                raise self.fail(
                    f"{node.name} posts a READ of {a.transfer_id} after P's read "
                    f"permit ended at {o.pull_until - target.mono_off:.4f}"
                )
            for b in a.remote_blocks:
                if target.pool.owner[b] != a.transfer_id:
                    raise self.fail(
                        f"{node.name} READs {a.transfer_id} from {target.name} "
                        f"block {b} owned by {target.pool.owner[b]!r}"
                    )
        self._check_chunk_id(node, a.chunk_id)

    def post_read(self, node: Node, a: PostRead) -> None:
        """The READ goes out on D's NIC (the driver found P's agent connected)."""
        target = self.by_agent(a.peer)
        self._post(
            node,
            "READ",
            a.transfer_id,
            a.generation,
            a.chunk_id,
            a.peer,
            (target.name, target.inc, a.remote_blocks) if target else ("", 0, a.remote_blocks),
            (node.name, node.inc, a.local_blocks),
            None,
        )

    def _check_chunk_id(self, node: Node, cid: int) -> None:
        if (node.name, node.inc, cid) in self.flights:
            raise self.fail(f"{node.name} reuses chunk id {cid} while it is in flight")

    def _post(
        self,
        node: Node,
        op: str,
        tid: str,
        gen: int,
        cid: int,
        peer: str,
        src: tuple[str, int, tuple[int, ...]],
        dst: tuple[str, int, tuple[int, ...]],
        done: m.Done | None,
        part: int = 0,
        parts: int = 1,
    ) -> None:
        key = (node.name, node.inc, cid)
        c = self.chaos
        r = self.r("chunk", *key)
        latency = r.uniform(0.0005, 0.03)
        if r.random() < c.slow:
            latency = r.uniform(0.2, CHUNK_MAX_S)
        if self.slowed(src[0], dst[0]):
            latency = r.uniform(0.5 * CHUNK_MAX_S, CHUNK_MAX_S)
        if (
            self.slowest_near_the_end
            and op == "WRITE"
            and self._permit_left(dst, tid, gen) < CHUNK_MAX_S
        ):
            # A WRITE posted this close to the end of D's permit takes as long as a chunk may:
            # it lands after the permit ran out unless P stopped in time.
            latency = CHUNK_MAX_S
            self.count("race:held_to_the_bound")
        error = ""
        if r.random() < c.chunk_fail:
            x = r.random()
            error = (
                INVALID
                if x < c.fatal_share
                else (DISCONNECT if x < c.fatal_share + 0.2 else r.choice(RETRYABLE))
            )
        fl = Flight(
            key,
            op,
            tid,
            gen,
            peer,
            src,
            dst,
            self._epochs(dst),
            self._epochs(src),
            done,
            self.now,
            self.now + latency,
            error,
            bool(error) and r.random() < 0.5,
            part,
            parts,
        )
        self.flights[key] = fl
        self._push(fl.at, "flight", key)
        self.log(
            f"{node.name} posts {op} {tid} g{gen} chunk {cid} {src[2]}->{dst[2]}"
            f"{' +DONE' if done else ''} lands {fl.at:.4f} {error}"
        )

    def _epochs(self, side: tuple[str, int, tuple[int, ...]]) -> tuple[int, ...]:
        node = self.nodes.get(side[0])
        if node is None or not node.alive or node.inc != side[1] or node.pool is None:
            return ()
        return tuple(node.pool.epoch[b] for b in side[2])

    def _side(self, side: tuple[str, int, tuple[int, ...]]) -> Node | None:
        node = self.nodes.get(side[0])
        if node is None or not node.alive or node.inc != side[1]:
            return None
        return node

    def _permit_left(self, side: tuple[str, int, tuple[int, ...]], tid: str, gen: int) -> float:
        """How long D's permit of (``tid``, ``gen``) still runs, by D's clock (inf: none)."""
        d = self._side(side)
        if d is None or not isinstance(d.engine, Receiver):
            return float("inf")
        lease = d.engine.leases.get(tid)
        if lease is None or lease.generation != gen:
            return float("inf")
        return lease.expires_at - d.local(self.now)

    def _land(self, fl: Flight, ok: bool, torn: bool) -> None:
        """The chunk's bytes reach the destination blocks (all if ``ok``, some if ``torn``):
        those blocks must have been reserved for this transfer and generation all along."""
        src, dst = self._side(fl.src), self._side(fl.dst)
        if dst is None or dst.pool is None or (not ok and not torn):
            return
        if fl.op == "WRITE" and self._permit_left(fl.dst, fl.tid, fl.gen) <= 0.0:
            # Between the end of D's permit and its reuse point (the checks below catch a
            # landing after the reuse): the tightest the fence allows.
            self.count("race:landed_after_permit")
        if src is None or src.pool is None:
            ok = False  # the source is gone: nothing meaningful arrives
            torn = True
        want = (fl.tid, fl.gen)
        for i, b in enumerate(fl.dst[2]):
            if dst.pool.owner[b] != want or dst.pool.epoch[b] != fl.dst_epochs[i]:
                raise self.fail(
                    f"{fl.op} {fl.tid} g{fl.gen} chunk {fl.key} posted at {fl.posted:.4f} lands in "
                    f"{dst.name} block {b}, now owned by {dst.pool.owner[b]!r} (epoch "
                    f"{fl.dst_epochs[i]} -> {dst.pool.epoch[b]}): a write into a freed or reused "
                    "block"
                )
        if ok:
            assert src is not None and src.pool is not None
            for i, (s, b) in enumerate(zip(fl.src[2], fl.dst[2], strict=True)):
                if src.pool.owner[s] != fl.tid or src.pool.epoch[s] != fl.src_epochs[i]:
                    raise self.fail(
                        f"{fl.op} {fl.tid} chunk {fl.key} read {src.name} block {s}"
                        f" after it was freed (owner {src.pool.owner[s]!r})"
                    )
                dst.pool.content[b] = (
                    src.pool.content[s]
                    if fl.parts == 1
                    else with_layer(
                        dst.pool.content[b], fl.part, layer_of(src.pool.content[s], fl.part)
                    )
                )
        else:
            r = self.r("torn", *fl.key)
            for b in fl.dst[2]:
                if r.random() < 0.5:
                    # A torn layer-wise WRITE tears the layer it moved, not the others.
                    dst.pool.content[b] = (
                        ("torn", fl.tid)
                        if fl.parts == 1
                        else with_layer(dst.pool.content[b], fl.part, ("torn", fl.tid))
                    )

    def complete(self, fl: Flight, error: str | None = None, torn: bool | None = None) -> None:
        """The NIC reports the chunk: it landed (or failed, maybe torn), then the poster hears."""
        self.flights.pop(fl.key, None)
        err = fl.error if error is None else error
        tear = fl.torn if torn is None else torn
        target = self.by_agent(fl.peer)
        to_intruder = fl.op == "WRITE" and fl.dst[0] == INTRUDER
        if target is None and not to_intruder:
            err, tear = DISCONNECT, False  # the peer process is gone
        r = self.r("done", *fl.key)
        landed = not err or (target is not None and r.random() < self.chaos.ambiguous)
        if landed and err:
            self.count("ambiguous")
        if landed and to_intruder:
            self.intruder.kv.add(fl.tid)  # the prompt's KV, in the intruder's memory
            self.count("intruder:got_kv")
        self._land(fl, ok=landed, torn=tear)
        self.count(f"chunk:{fl.op}:{err or 'ok'}")
        self.log(f"{fl.op} {fl.tid} chunk {fl.key} completes {err or 'ok'}")
        poster = self.nodes[fl.key[0]]
        if (
            landed
            and fl.done is not None
            and target is not None
            and r.random() >= self.chaos.notif_loss
        ):
            nid = next(self._ids)
            at = self.now + r.uniform(0.0, 0.005)
            # From the agent of the process that posted the WRITE (even if it died since).
            self.notifs[nid] = (at, target.agent, fl.done, agent_name(*fl.key[:2]))
            self._push(at, "notif", nid)
        if poster.alive and poster.inc == fl.key[1]:
            self.call_completed(poster, fl.key[2], err)

    def deliver_notif(self, nid: int) -> None:
        rec = self.notifs.pop(nid, None)
        if rec is None:
            return
        _, agent, done, src_agent = rec
        node = self.by_agent(agent)
        if node is None:
            return
        self.log(f"{node.name} gets DONE {done.transfer_id} g{done.generation}")
        self.count("notif")

        if self.is_intruder_agent(src_agent):
            self.call(
                node,
                lambda e, now: self._under_attack(
                    node, INTRUDER_KEY, "DONE", lambda: e.on_done(done, now, agent=src_agent)
                ),
            )
            return

        def on_done(eng: Any, now: float) -> list[Action]:
            assert isinstance(eng, Receiver)
            rx = eng._in.get(done.transfer_id)
            stale = rx is not None and rx.generation != done.generation
            before = self.snapshot(node, done.transfer_id) if stale else None
            # NIXL names the agent a notification came from.
            out: list[Action] = eng.on_done(done, now, agent=src_agent)
            if stale and (before != self.snapshot(node, done.transfer_id) or split_notes(out)[1]):
                raise self.fail(f"{node.name}: a DONE with a stale generation changed state")
            return out

        self.call(node, on_done)

    # ------------------------------------------------------------------ shell-side reactions
    def on_release(self, node: Node, a: ReleaseSend) -> None:
        key = (node.name, node.inc, a.transfer_id)
        preq = node.preqs.get(a.transfer_id)
        if key in self.released:
            raise self.fail(
                f"{node.name} releases {a.transfer_id} twice "
                f"({self.released[key]}, then {a.outcome})"
            )
        if preq is None or preq.state != "held":
            was = preq or node.closed.get(a.transfer_id)
            raise self.fail(
                f"{node.name} releases {a.transfer_id} before the request finished "
                f"(state {was and was.state})"
            )
        self.released[key] = a.outcome
        self.count(f"release:{a.outcome}")
        self.log(f"{node.name} releases {a.transfer_id} ({a.outcome})")
        for fl in self.flights.values():
            if fl.tid == a.transfer_id and fl.src[0] == node.name and fl.src[1] == node.inc:
                raise self.fail(
                    f"{node.name} frees the blocks of {a.transfer_id} while its "
                    f"{fl.op} chunk {fl.key} is in flight"
                )
        assert node.pool is not None
        node.pool.release(preq.blocks, a.transfer_id, f"ReleaseSend {a.transfer_id}")
        self.close(node, preq, "released")

    def on_finished(self, node: Node, a: ReportFinished) -> None:
        """D reports the receive finished: with the KV in place, unless it was aborted."""
        self.on_report(
            node,
            a.transfer_id,
            f"ReportFinished({a.outcome})",
            a.outcome if a.outcome.delivered else None,
        )

    def on_failed(self, node: Node, a: ReportFailed) -> None:
        """D reports the receive failed."""
        dreq = node.dreqs.get(a.transfer_id)
        if a.reason == "permit_expired" and dreq is not None:
            p = self.nodes[dreq.p_name]
            preq = (p.preqs.get(a.transfer_id) or p.closed.get(a.transfer_id)) if p.alive else None
            o = p.engine._out.get(a.transfer_id) if p.alive else None
            self.count(
                f"expired_why:p_alive={p.alive}:preq={preq and preq.state}:"
                f"out={o and o.machine.state.value}:{o and o.outcome}"
            )
        self.on_report(node, a.transfer_id, f"ReportFailed({a.reason})", None)

    def on_report(self, node: Node, tid: str, what: str, delivered: Outcome | None) -> None:
        """D hands the blocks of ``tid`` back (``delivered``: how its KV arrived, if it did)."""
        key = (node.name, node.inc, tid)
        if key in self.reported:
            raise self.fail(f"{node.name} reports {tid} twice: {self.reported[key]}, then {what}")
        dreq = node.dreqs.get(tid)
        if dreq is None or dreq.state != "admitted":
            raise self.fail(
                f"{node.name} reports {tid} it never admitted ({dreq or node.closed.get(tid)})"
            )
        self.reported[key] = what
        self.count(f"report:{what}")
        self.log(f"{node.name} reports {tid}: {what}")
        recv = node.engine
        assert isinstance(recv, Receiver) and node.pool is not None
        assert node.admissions is not None
        local = node.local(self.now)
        if not recv.leases.reusable(tid, local):
            raise self.fail(
                f"{node.name} frees the blocks of {tid} under a live permit "
                f"({recv.leases.get(tid)}, {recv.leases.state(tid)})"
            )
        for fl in self.flights.values():
            if fl.tid == tid and fl.dst[0] == node.name and fl.dst[1] == node.inc:
                raise self.fail(
                    f"{node.name} frees the blocks of {tid} while {fl.op} chunk "
                    f"{fl.key} into them is in flight (posted {fl.posted:.4f})"
                )
        if delivered is not None:
            want = [(tid, dreq.first_block + i) for i in range(dreq.nblocks)]
            got = [node.pool.content[b] for b in dreq.blocks]
            if got != want:
                raise self.fail(
                    f"{node.name} reports {tid} received ({delivered}) but its "
                    f"blocks hold {got}, not P's {want}"
                )
        node.pool.release(dreq.blocks, (tid, dreq.gen), f"report of {tid}")
        if not node.admissions.ended(tid)[1]:
            raise self.fail(f"{node.name} released credit of {tid} it did not hold")
        self.close(node, dreq, "ended")

    # ------------------------------------------------------------------ schedulers
    def new_request(self, p: Node, d: Node, total: int, first: int) -> str:
        """The router sends both legs of a new request at once."""
        self.tid_count += 1
        tid = f"t{self.tid_count}"
        self.count("request")
        self.requests[tid] = (p.name, d.name, False)
        self.log(f"request {tid}: {p.name} -> {d.name}, {total} blocks from {first}")
        if p.alive:
            r = self.r("request", tid)
            lag = r.choice([0.0, 0.0, 0.0, r.uniform(0.0, P_LAG_MAX_S)])
            # Mostly the router names the decode engine; sometimes (a third-party router) not.
            owner = d.address if r.random() < self.named_share else ""
            if not owner:
                self.count("request:unnamed")
            self.requests[tid] = (p.name, d.name, bool(owner))
            p.preqs[tid] = PReq(
                tid,
                d.name,
                total,
                self.now + lag + r.uniform(0.0, COMPUTE_MAX_S),
                self.now,
                arrive_at=self.now + lag,
                owner=owner,
            )
            if not lag:
                self.p_step(p)
        if d.alive:
            dreq = d.dreqs[tid] = DReq(tid, p.name, p.address, total, first, self.now)
            if first >= total:
                # D has the whole prompt already: P may free at once.
                assert d.admissions is not None
                d.admissions.track(tid, tid, p.address, None)
                answer = d.admissions.ask(
                    tid, total * BLOCK_TOKENS, first * BLOCK_TOKENS, d.local(self.now)
                )
                assert answer.not_needed is Outcome.PREFIX_HIT, answer
                self.not_received.add(tid)
                self.close(d, dreq, "ended")
                self.command(d, NotNeeded(tid, p.address, owner=p.address))
        return tid

    def late_prefill_leg(self, p: Node, tid: str, lag: float) -> None:
        """The prefill leg of ``tid`` reaches ``p`` ``lag`` seconds after the router sent it
        (at most P_LAG_MAX_S, as any leg may); P computes it as long after that as drawn."""
        preq = p.preqs.get(tid)
        if preq is None or preq.state != "coming" or not 0.0 <= lag <= P_LAG_MAX_S:
            return
        preq.compute_at += preq.created + lag - preq.arrive_at
        preq.arrive_at = preq.created + lag

    def p_step(self, node: Node) -> None:
        for preq in list(node.preqs.values()):
            if preq.state == "coming" and preq.arrive_at <= self.now:
                preq.state = "queued"
                self.command(node, ExpectBlocks(preq.tid, preq.owner))
            if preq.state == "queued" and preq.compute_at <= self.now:
                assert node.pool is not None
                blocks = node.pool.alloc(preq.nblocks, preq.tid)
                if blocks is None:
                    continue  # no room yet: vLLM would keep it waiting
                fails = self.r("forward", preq.tid).random() < self.chaos.forward_fail
                if self.r("layerwise", preq.tid).random() < self.chaos.layerwise:
                    preq.blocks, preq.state, preq.layerwise = blocks, "computing", True
                    preq.layer_at = self.now
                    preq.fail_after = (
                        int(self.r("fail_at", preq.tid).random() * LAYERS) if fails else -1
                    )
                    for i, b in enumerate(blocks):
                        node.pool.content[b] = ("pending", preq.tid, i)
                    self.compute_layers(node, preq)
                    continue
                preq.blocks, preq.state = blocks, "computed"
                preq.hold_at = self.now + self.r("hold", preq.tid).uniform(0.0, 0.1)
                if fails:
                    # The forward raised (vLLM still calls wait_for_save): the blocks hold
                    # garbage that must never reach D as a pushed prompt.
                    self.count("forward_failed")
                    for i, b in enumerate(blocks):
                        node.pool.content[b] = ("garbage", preq.tid, i)
                    self.command(node, ForwardFailed(preq.tid, tuple(blocks)))
                    continue
                for i, b in enumerate(blocks):
                    node.pool.content[b] = (preq.tid, i)
                self.command(node, BlocksReady(preq.tid, tuple(blocks), preq.owner))
            elif preq.state == "computing":
                self.compute_layers(node, preq)
            elif preq.state == "computed" and preq.hold_at <= self.now:
                preq.state = "held"
                self.command(node, Hold(preq.tid))

    def compute_layers(self, node: Node, preq: PReq) -> None:
        """A layer-wise forward: the layers due by now are computed one by one, each handed
        over (LayersReady) at once; the forward's end hands the blocks over (BlocksReady),
        or it raises after ``fail_after`` layers (ForwardFailed, the blocks garbage)."""
        pool, tid, blocks = node.pool, preq.tid, preq.blocks
        assert pool is not None
        while preq.state == "computing" and preq.layer_at <= self.now:
            if preq.layers == preq.fail_after or preq.layers == LAYERS:
                preq.state = "computed"
                preq.hold_at = self.now + self.r("hold", tid).uniform(0.0, 0.1)
                if preq.layers == preq.fail_after:
                    self.count("forward_failed:layerwise")
                    for i, b in enumerate(blocks):
                        pool.content[b] = ("garbage", tid, i)
                    self.command(node, ForwardFailed(tid, tuple(blocks)))
                else:
                    self.command(node, BlocksReady(tid, tuple(blocks), preq.owner))
                return
            for i, b in enumerate(blocks):
                pool.content[b] = with_layer(pool.content[b], preq.layers, (tid, i))
            preq.layers += 1
            self.command(node, LayersReady(tid, tuple(blocks), preq.layers, LAYERS, preq.owner))
            if preq.layers < LAYERS:
                preq.layer_at += self.r("layer", tid, preq.layers).uniform(0.0005, 0.05)

    def d_step(self, node: Node) -> None:
        """D's scheduler step: ask for credit for every waiting request, as the connector
        (through the core's admission); admitted, it allocates and registers at once."""
        admissions, pool = node.admissions, node.pool
        assert admissions is not None and pool is not None
        local = node.local(self.now)
        for dreq in list(node.dreqs.values()):
            if dreq.state not in ("asking", "waiting"):
                continue
            admissions.track(dreq.tid, dreq.tid, dreq.p_address, None)
            answer = admissions.ask(
                dreq.tid, dreq.total_blocks * BLOCK_TOKENS, dreq.first_block * BLOCK_TOKENS, local
            )
            if answer.verdict is Verdict.LOAD:
                blocks = pool.alloc(answer.nblocks, (dreq.tid, None))
                if blocks is None:
                    raise self.fail(
                        f"{node.name} admitted {dreq.tid} but has no free blocks: "
                        f"{pool.used()} used, {admissions.ledger.in_use} credited"
                    )
                admissions.allocated(dreq.tid, len(blocks))
                dreq.blocks, dreq.state, dreq.admitted_at = blocks, "admitted", self.now
                self.count("admit")
                self.call(
                    node,
                    self._registered(
                        node, dreq, answer.commands(dreq.tid, dreq.p_address, dreq.p_address)
                    ),
                )
            elif answer.verdict is Verdict.LATER:
                if any(
                    not self.requests.get(t, ("", "", True))[2] and t in self.intruder.spoken
                    for t, q in node.dreqs.items()
                    if q.state == "admitted"
                ):
                    self.starved_by_unnamed.add(dreq.tid)
                if answer.first_wait:
                    dreq.state = "waiting"
                    self.count("later")
                for command in answer.commands(dreq.tid, dreq.p_address, dreq.p_address):
                    self.command(node, command)  # what P must hear, as the connector says it
            else:
                self.not_received.add(dreq.tid)
                self.close(node, dreq, "ended")
                self.count("refuse")
                for command in answer.commands(dreq.tid, dreq.p_address, dreq.p_address):
                    self.command(node, command)

    def _registered(
        self, node: Node, d: DReq, notices: list[Any]
    ) -> Callable[[Any, float], list[Action]]:
        """D's worker registers the blocks of ``d`` (after its admission's ``notices``: the
        wait for credit over, if any) and the world learns the generation D granted, to
        own the blocks under it."""

        def register(eng: Any, now: float) -> list[Action]:
            out = [a for c in notices for a in c.apply(eng, now)]
            acts = RegisterBlocks(
                d.tid,
                d.p_address,
                tuple(d.blocks),
                d.first_block,
                d.total_blocks * BLOCK_TOKENS,
                d.p_address,
            ).apply(eng, now)
            d.gen = eng._in[d.tid].generation
            self.generations.append(d.gen)
            assert node.pool is not None
            for b in d.blocks:
                node.pool.owner[b] = (d.tid, d.gen)
            return out + acts

        return register

    def abort_d(self, node: Node, tid: str) -> None:
        dreq = node.dreqs[tid]
        self.log(f"{node.name} aborts {tid} ({dreq.state})")
        self.count("abort_d")
        self.client_aborted.add(tid)
        assert node.admissions is not None
        if dreq.state in ("asking", "waiting"):
            node.admissions.finish(tid)  # its credit, if it was waiting for some, is back
            self.close(node, dreq, "ended")
            self.command(node, NotNeeded(tid, dreq.p_address, owner=dreq.p_address))
        elif dreq.state == "admitted" and not dreq.aborting:
            dreq.aborting = True
            finish = node.admissions.finish(tid)  # the receive is aborted: wait for the fence
            assert finish.abort, finish
            self.command(node, AbortReceive(tid))

    def abort_p(self, node: Node, tid: str) -> None:
        preq = node.preqs[tid]
        self.log(f"{node.name} aborts {tid} before computing it")
        self.count("abort_p")
        self.client_aborted.add(tid)
        self.close(node, preq, "aborted")
        self.command(node, AbortSend(tid))

    # ------------------------------------------------------------------ time
    def run_until(self, target: float) -> None:
        """Let the world run to ``target``: deliveries, completions, ticks and polls in order."""
        while self._heap and self._heap[0][0] <= target:
            at, _, kind, key = heapq.heappop(self._heap)
            if at > self.now:
                self.now = at
            if kind == "wire":
                w = self.wires.get(key)
                if w is not None and w.at == at:
                    self.deliver(w)
            elif kind == "flight":
                fl = self.flights.get(key)
                if fl is not None and fl.at == at:
                    self.complete(fl)
            elif kind == "notif":
                rec = self.notifs.get(key)
                if rec is not None and rec[0] == at:
                    self.deliver_notif(key)
            elif kind == "tick":
                self._tick(key)
            elif kind == "poll":
                self._poll(key)
            elif kind == "resume":
                self._resume(key)
            elif kind == "connect":
                self._connected(key)
            elif kind == "restart":
                node = self.nodes[key[0]]
                if not node.alive and node.inc == key[1]:
                    self.start(node)
        self.now = max(self.now, target)

    def _node(self, key: tuple[str, int]) -> Node | None:
        node = self.nodes[key[0]]
        return node if node.alive and node.inc == key[1] else None

    def _tick(self, key: tuple[str, int]) -> None:
        node = self._node(key)
        if node is None:
            return
        self._push(self.now + TICK_S, "tick", key)
        # The engine thread keeps scheduling while the pump is stalled; its commands wait.
        if node.role == "P":
            self.p_step(node)
        else:
            self.d_step(node)
        if node.paused_until <= self.now:
            self.call(node, lambda eng, now: eng.tick(now))
            self._schedule_poll(node)
        self.check_bounds(node)

    def _schedule_poll(self, node: Node) -> None:
        if not node.alive:
            return
        eng = node.engine
        sched = eng.sched if isinstance(eng, Sender) else eng.reads
        wake = sched.next_wakeup()
        if wake is not None:
            at = wake - node.mono_off
            if self.now < at < self.now + TICK_S:
                self._push(at, "poll", (node.name, node.inc))

    def _poll(self, key: tuple[str, int]) -> None:
        node = self._node(key)
        if node is None or node.paused_until > self.now:
            return
        self.call(node, lambda eng, now: eng.poll(now))
        self._schedule_poll(node)

    def pause(self, node: Node, dt: float) -> None:
        if not node.alive:
            return
        self.log(f"{node.name} stalls for {dt:.3f}s")
        self.count("pause")
        node.paused_until = max(node.paused_until, self.now + dt)
        self._push(node.paused_until, "resume", (node.name, node.inc))

    def _resume(self, key: tuple[str, int]) -> None:
        node = self._node(key)
        if node is None or node.paused_until > self.now:
            return
        while node.deferred and node.alive:
            node.deferred.popleft()()
        self._schedule_poll(node)

    # ------------------------------------------------------------------ invariants
    def check_bounds(self, only: Node | None = None) -> None:
        """Every live transfer is younger than its bound (it must have ended otherwise)."""
        for node in self.nodes.values() if only is None else (only,):
            if not node.alive:
                continue
            local = node.local(self.now)
            eng = node.engine
            if isinstance(eng, Receiver):
                for inc in eng._in.values():
                    if local - inc.registered_at > BOUND_D_S:
                        raise self.fail(
                            f"{node.name}: receive of {inc.tid} ({inc.machine}) is "
                            f"{local - inc.registered_at:.2f}s old, bound {BOUND_D_S}"
                        )
            else:
                for o in eng._out.values():
                    if local - o.machine.created_at > BOUND_P_S:
                        raise self.fail(
                            f"{node.name}: send of {o.tid} ({o.machine}, outcome "
                            f"{o.outcome!r}, held {o.held}) is "
                            f"{local - o.machine.created_at:.2f}s old, bound {BOUND_P_S}"
                        )

    def check(self) -> None:
        """The per-step invariants (the event-time ones raise where they happen)."""
        self.check_bounds()
        for node in self.nodes.values():
            self.check_sender(node)
            if not node.alive or node.role != "D":
                continue
            assert node.admissions is not None and node.pool is not None
            ledger, pool = node.admissions.ledger, node.pool
            if ledger.in_use > CREDIT_BUDGET or ledger.in_use < 0:
                raise self.fail(
                    f"{node.name}: {ledger.in_use} blocks of credit in use, budget {CREDIT_BUDGET}"
                )
            for peer in ledger.peers():
                if ledger.peer_credit(peer).in_use > PEER_CAP:
                    raise self.fail(f"{node.name}: peer {peer} over its cap")
            if pool.used() != ledger.in_use:
                raise self.fail(
                    f"{node.name}: {pool.used()} blocks reserved but {ledger.in_use} credited"
                )
            # Blocks in flight toward this D stay within what it credited, transfer by transfer.
            inflight = 0
            for fl in self.flights.values():
                if fl.op == "WRITE" and fl.dst[0] == node.name and fl.dst[1] == node.inc:
                    dreq = node.dreqs.get(fl.tid)
                    if (
                        dreq is None
                        or dreq.state != "admitted"
                        or not set(fl.dst[2]) <= set(dreq.blocks)
                    ):
                        raise self.fail(
                            f"WRITE {fl.key} of {fl.tid} targets {node.name} blocks "
                            f"{fl.dst[2]} outside its reservation"
                        )
                    # In layers: a layer-wise WRITE moves one layer of each of its blocks.
                    inflight += len(fl.dst[2]) * (1 if fl.parts > 1 else LAYERS)
            if inflight > ledger.in_use * LAYERS:
                raise self.fail(
                    f"{inflight} blocks in flight to {node.name} over its credit {ledger.in_use}"
                )
            recv = node.engine
            assert isinstance(recv, Receiver)
            for tid in recv._in:
                dreq = node.dreqs.get(tid)
                if dreq is None or dreq.state != "admitted":
                    raise self.fail(f"{node.name} receives {tid} that its scheduler ended")
        for node in self.nodes.values():
            if node.alive and node.role == "P":
                assert node.pool is not None
                held = sum(
                    len(p.blocks)
                    for p in node.preqs.values()
                    if p.state in ("computing", "computed", "held")
                )
                if node.pool.used() != held:
                    raise self.fail(f"{node.name}: {node.pool.used()} blocks used, {held} held")

    def busy(self) -> list[str]:
        """What is still going on (empty once the world is idle)."""
        out: list[str] = []
        for node in self.nodes.values():
            if not node.alive:
                continue
            assert node.pool is not None
            if node.pool.used():
                out.append(f"{node.name}: {node.pool.used()} blocks not free")
            eng = node.engine
            if isinstance(eng, Receiver):
                assert node.admissions is not None
                ledger = node.admissions.ledger
                if eng.active or eng._waiting or len(eng.leases) or eng.busy:
                    out.append(
                        f"{node.name}: receiver holds {sorted(eng._in)} waiting "
                        f"{sorted(eng._waiting)} leases {eng.leases.keys()}"
                    )
                if ledger.in_use or ledger.waiting:
                    out.append(
                        f"{node.name}: credit {ledger.in_use} in use, {ledger.waiting} waiting"
                    )
                open_ = [d.tid for d in node.dreqs.values() if d.state != "ended"]
                if open_:
                    out.append(f"{node.name}: requests not ended {open_}")
            else:
                if eng.active or eng.busy or eng._chunks:
                    out.append(
                        f"{node.name}: sender holds "
                        f"{[(o.tid, o.machine.state.value, o.outcome) for o in eng._out.values()]}"
                    )
                open_ = [
                    p.tid for p in node.preqs.values() if p.state not in ("released", "aborted")
                ]
                if open_:
                    out.append(f"{node.name}: requests not released {open_}")
        if self.flights:
            out.append(f"chunks in flight {sorted(self.flights)}")
        return out

    def open_requests(self) -> int:
        return sum(len(n.preqs) + len(n.dreqs) for n in self.nodes.values())

    def close(self, node: Node, req: PReq | DReq, state: str) -> None:
        """A request is over on ``node``: it leaves the open ones (kept for messages)."""
        req.state = state
        (node.preqs if isinstance(req, PReq) else node.dreqs).pop(req.tid, None)
        node.closed[req.tid] = req

    def quiesce(self) -> None:
        """No new work: run until every lease has run out; then nothing may be left held.

        The horizon is the credit ledger's bound on the wait for admission (each queued
        transfer may hold credit for a whole transfer bound) plus one transfer of each side.
        """
        self.log("quiesce")
        self.count("quiesce")
        queued = sum(len(n.dreqs) for n in self.nodes.values())
        end = (
            self.now
            + COMPUTE_MAX_S
            + P_LAG_MAX_S
            + CREDITS.aging_s
            + (queued + 1) * BOUND_D_S
            + BOUND_P_S
            + TOTAL_S
        )
        while self.now < end:
            self.run_until(self.now + 1.0)
            if not self.busy():
                break
        left = self.busy()
        if left:
            raise self.fail("leak at quiescence, " + "; ".join(left))
