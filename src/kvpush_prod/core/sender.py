"""The prefill side (P) of one worker rank: pair finished blocks with D's REGISTERs, push them
through the chunk scheduler, retry, fall back to D pulling, and say when blocks may be freed.

Sans-IO: events in (with ``now``), actions out. Time comes from the shell; a message's
``age`` (how long it travelled, from its ``sent_at``) is subtracted from any term it grants.

Trust: every message comes with its ``origin``, the identity the channel authenticated (the
sender's public key; without keys, the control address it claims). A transfer belongs to
one decode origin, the one the router named or else the first to register it; nothing from
another origin changes it, and P writes only to the agent and layout it met for that origin.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

from kvpush_prod.core import blocksize, chunking, compat
from kvpush_prod.core.actions import (
    Action,
    ConnectPeer,
    DropPeer,
    Note,
    PostWrite,
    ReleaseSend,
    SendMessage,
)
from kvpush_prod.core.identity import owns_agent, peer_slot
from kvpush_prod.core.incarnations import RetiredIncarnations
from kvpush_prod.core.leases import Permit
from kvpush_prod.core.messages import (
    MAX_TEXT_LEN,
    PROTOCOL_VERSION,
    Cancel,
    CancelAck,
    ControlMessage,
    Done,
    DoneQuery,
    DoneState,
    Failed,
    Fallback,
    Heartbeat,
    PeerInfo,
    PullDone,
    Register,
)
from kvpush_prod.core.quotas import OriginBook, live_batches
from kvpush_prod.core.retry import BreakerSettings as CoreBreakerSettings
from kvpush_prod.core.retry import (
    BreakerState,
    BudgetSettings,
    ChunkError,
    ErrorClass,
    ErrorKind,
    PeerBreakers,
    RandomLike,
    RetryBudget,
    RetryPolicy,
    RetrySettings,
    classify,
    decide_next,
)
from kvpush_prod.core.scheduler import Chunk, ChunkScheduler, SchedulerSettings
from kvpush_prod.core.transfer import TransferEvent as E
from kvpush_prod.core.transfer import TransferMachine, TransferState, TransferTimeouts
from kvpush_prod.core.vocabulary import AfterDrain, NoteKind, Outcome, RejectReason
from kvpush_prod.errors import ProtocolError

S = TransferState
# A D whose connection failed or was closed is asked for again, once heard from since, at
# most this often (by the next transfer to it); the driver backs off further
# (``driver.CONNECT_BACKOFF_S`` up to its max) while connects keep failing, so a D that
# comes back is pushed to again without a restart.
CONNECT_RETRY_S = 1.0


@dataclass(frozen=True, slots=True)
class SenderSettings:
    """The numbers P's protocol runs on (defaults: the configuration's; the shell maps the
    configuration onto them in ``config.core``)."""

    block_bytes: int  # one block of this rank, all regions
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    retry: RetrySettings = field(default_factory=RetrySettings)
    budget: BudgetSettings = field(default_factory=BudgetSettings)
    breaker: CoreBreakerSettings = field(default_factory=CoreBreakerSettings)
    timeouts: TransferTimeouts = field(default_factory=TransferTimeouts)
    send_lease_s: float = 60.0  # finished blocks held without news from D
    stop_margin_s: float = 1.0  # no WRITE this close to the permit's end
    skew_margin_s: float = 1.0
    heartbeat_s: float = 1.0
    fallback: bool = True  # let D pull when the push fails
    pull_permit_s: float = 30.0  # how long D may READ P's blocks after a FALLBACK
    # How long P keeps renewing a REGISTER for a request it has not received yet: under load
    # the prefill leg can reach P seconds after the decode leg reached D.
    register_grace_s: float = 10.0
    tombstone_s: float = 300.0  # how long a cancelled/aborted transfer id is remembered
    # Bounds on what the network can make P remember (the engine's own requests are bounded
    # by its KV cache): transfers first named by a REGISTER, tombstones, peers.
    max_transfers: int = 65_536
    max_tombstones: int = 65_536
    max_peers: int = 1024
    max_contenders: int = 4  # other origins' REGISTERs kept while the owner is unknown
    # REGISTERs of one origin kept for transfers this engine does not know yet (its own
    # scheduler makes a transfer known): one key cannot fill the engine with them.
    max_unknown_per_origin: int = 1024
    # A decode layout may have at most this many times our blocks (its KV cache may be
    # bigger than ours, not absurdly so: describing 1M blocks costs seconds).
    max_peer_blocks_ratio: int = 16
    min_peer_blocks_limit: int = 65_536
    # A failed last chunk: how long P waits for D's answer to "did its DONE arrive?" before
    # falling back to pull (the question is re-sent a few times meanwhile).
    done_query_s: float = 1.0
    # The shell connects to a D (ConnectPeer) off its own thread and says when the connection
    # is ready (``on_peer``): transfers to a D wait for that. False: a ConnectPeer is taken
    # as done at once (a shell, or a test, that feeds no ``on_peer``).
    await_connect: bool = False
    # A whole push larger than one chunk is cut into chunks of consecutive regions over
    # every block (``core.chunking``; ``push.chunk_by: layers``); False: block ranges over
    # every region (``blocks``).
    chunk_by_regions: bool = True


@dataclass(eq=False, slots=True)
class _Confirm:
    """A last chunk that failed at P while its DONE may have landed: D is being asked."""

    attempt: int  # the failed post (the DONE it carried names it)
    error: ChunkError | str
    first_posted_at: float
    nbytes: int
    until: float  # no answer by then: fall back
    resend_at: float


@dataclass(eq=False)
class _Out:
    """One transfer as P sees it: where its push is (``machine``, the table shared with D)
    and what that table does not hold.

    The flags beside the machine, and why each is not one of its states:

    - ``held``: P's scheduler finished the request and lends us its blocks until
      ReleaseSend. The engine's side of the blocks; it comes in any state, before or
      after the push ended.
    - ``expected``: P's engine named the request (its blocks will come). With
      ``required`` and ``blocks`` it decides who may end the transfer (``_unclaimed``)
      and whether D's permit is kept renewed: trust, not the push's progress, and true
      already in NEW and WAITING_BLOCKS.
    - ``partial``: layer-wise, the forward that computes the blocks still runs. The
      engine's progress, orthogonal to the push's (true from WAITING_REGISTER to
      RETRYING). Not ``ready < parts``: a push stopped mid-forward clears it with parts
      still missing.
    - ``queued``: the chunk scheduler posts its chunks. The sender's own record of that:
      the scheduler may still report a push expired after P gave it up, and only one
      still queued is ended as expired. A push given up stays PUSHING or RETRYING in the
      machine while its chunks drain, not queued, ``drain_then`` saying what comes next.
    - ``drain_then`` (and ``reason``): what to do once the chunks in flight landed: ack a
      CANCEL, fall back, fail, expire. A P-only step between a decision and its end; as
      machine states it would make the shared table know its side, and entering them
      would restart the state clocks the deadlines count from.
    - ``confirm``: the open question to D about the last chunk's DONE (attempt, error,
      when to ask again and give up): data for a P-only step within RETRYING.
    - ``retried``: some chunk was retried or questioned: history, only the outcome word
      (RETRIED or PUSHED); RETRYING -> PUSHING forgets it.
    - ``outcome``: the result word once over (PUSHED, RETRIED, PULL_FALLBACK, CANCELLED,
      FAILED, EXPIRED), finer than the machine's DONE / FAILED / CANCELLED and reported
      in ReleaseSend. Every ``_close`` follows the machine's end and agrees with it (DONE:
      pushed, retried, pull_fallback; FAILED: failed, expired; CANCELLED: cancelled); the
      machine ends first only while a CANCEL's or a restarted D's chunks drain
      (``drain_then`` ACK or DROPPED). ``outcome`` says P is done with the transfer.
    - ``released``: ReleaseSend was given (the transfer is also dropped then): guards a
      reference still held after the release.

    The rest is data: ids and trust (``owner``, ``required``, ``contenders``, ``peer``,
    ``unknown_of``), terms (``permit``, ``lease_until``, ``pull_until``), chunk ids in
    flight, counters and timestamps (``pushed_bytes``, ``ready_at``, ``reg_at``), the plan
    (``blocks``, ``units``, ``parts``, ``ready``, ``prompt``).
    """

    tid: str
    machine: TransferMachine
    blocks: list[int] | None = None
    held: bool = False  # the scheduler left the blocks to us until ReleaseSend
    expected: bool = False  # P's scheduler has the request: blocks will come
    reg: Register | None = None
    reg_at: float = 0.0
    owner: str = ""  # origin of ``reg``: the decode engine this transfer belongs to
    required: str = ""  # the decode origin the router named for it ("" if none)
    # REGISTERs of other origins while the owner is not known yet: origin -> (reg, permit,
    # when it came); the permit as its decode engine renews it, so the one bound is current
    contenders: dict[str, tuple[Register, Permit, float]] = field(default_factory=dict)
    peer: str = ""  # D's agent name
    permit: Permit | None = None
    lease_until: float = 0.0  # send lease: blocks held without a registration
    queued: bool = False  # in the chunk scheduler
    ready_at: float = -1.0  # when it entered the scheduler (-1: its first chunk is out)
    inflight: set[int] = field(default_factory=set)
    retried: bool = False
    drain_then: AfterDrain = AfterDrain.NOTHING  # what to do once the chunks in flight landed
    reason: str = ""
    pull_until: float = 0.0  # D may read our blocks until then (+ skew)
    outcome: Outcome | Literal[""] = ""  # set when the transfer is over; ReleaseSend once held
    released: bool = False
    pushed_bytes: int = 0
    confirm: _Confirm | None = None  # the last chunk failed: waiting for D's DoneState
    # What is pushed, in units when D's block size differs (core.blocksize); planned from
    # ``blocks`` and ``reg`` as they are when the push starts, never from a plan before.
    units: blocksize.Units | None = None
    # The origin whose REGISTER made P keep this transfer before its own engine named it
    # (counted against that origin's quota until then); "": none.
    unknown_of: str = ""
    prompt: bytes = b""  # digest of the prompt's token ids (core.digest), stated to D
    # Layer-wise push: each block is ``parts`` pieces (one per layer), posted part by part
    # as the forward computes them. ``partial`` while the forward still runs (only the
    # first ``ready`` parts hold their KV): nothing may read the blocks whole until then
    # (a FALLBACK waits), and the last chunk, which carries DONE, waits for every part.
    parts: int = 1
    ready: int = 1
    partial: bool = False
    # A whole push larger than one chunk: the region bounds of its parts (``core.chunking``:
    # each part one chunk of consecutive regions over every block); (): not cut by regions.
    groups: tuple[int, ...] = ()


class _Origins:
    """Transfer id -> the origins that said something of it, each id until its newest
    ``add`` plus the caller's time to live. Bounded both ways: at most ``limit`` ids (the
    oldest dropped first) and ``per_id`` origins per id (one origin's word never replaces
    another's; past the bound new origins are not kept)."""

    def __init__(self, limit: int, per_id: int) -> None:
        self._limit, self._per_id = limit, per_id
        self._by_id: OrderedDict[str, tuple[float, frozenset[str]]] = OrderedDict()

    def add(self, tid: str, origin: str, until: float) -> None:
        _, origins = self._by_id.get(tid, (0.0, frozenset()))
        if origin not in origins and len(origins) < self._per_id:
            origins = origins | {origin}
        self._by_id[tid] = (until, origins)
        self._by_id.move_to_end(tid)
        while len(self._by_id) > self._limit:
            self._by_id.popitem(last=False)

    def get(self, tid: str) -> frozenset[str] | None:
        """The origins of ``tid`` (None: none is remembered)."""
        entry = self._by_id.get(tid)
        return None if entry is None else entry[1]

    def pop(self, tid: str, now: float) -> frozenset[str]:
        """Forget ``tid``; its origins if they had not expired by ``now``."""
        until, origins = self._by_id.pop(tid, (0.0, frozenset()))
        return origins if until > now else frozenset()

    def prune(self, now: float) -> None:
        for tid in [t for t, (until, _) in self._by_id.items() if until <= now]:
            del self._by_id[tid]

    def items(self) -> list[tuple[str, frozenset[str]]]:
        return [(tid, origins) for tid, (_, origins) in self._by_id.items()]

    def __contains__(self, tid: object) -> bool:
        return tid in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)


class Sender:
    """P side of one rank."""

    def __init__(self, me: PeerInfo, settings: SenderSettings, rng: RandomLike) -> None:
        self.me = me
        self.slim = PeerInfo(me.engine_id, me.incarnation, me.rank, me.control, me.agent_name)
        self.s = settings
        self.sched = ChunkScheduler(settings.scheduler)
        self.policy = RetryPolicy.from_settings(settings.retry, rng)
        self.budget = RetryBudget(settings.budget)
        self.breakers = PeerBreakers(settings.breaker)
        self._out: dict[str, _Out] = {}
        # origin -> the transfers its REGISTERs made P keep that P's engine has not named
        self._unknown = OriginBook(settings.max_unknown_per_origin)
        self._chunks: dict[int, tuple[Chunk, str]] = {}  # chunk id -> (chunk, transfer id)
        # transfer id -> the origins that asked ("" for this engine): the blocks of a
        # cancelled or aborted transfer are freed unpushed when they come
        self._tombstones = _Origins(settings.max_tombstones, settings.max_contenders)
        # transfer id -> the origins whose REGISTER P refused as incompatible before it knew
        # the transfer's owner; ends it at once if the router names one of them its decode
        self._refused = _Origins(settings.max_tombstones, settings.max_contenders)
        # The peer directory: D rank (origin, rank slot: identity.peer_slot) -> the info P
        # met it with, least recently
        # used first. The only source of write targets and layouts.
        self._peers: OrderedDict[tuple[str, int], PeerInfo] = OrderedDict()
        # D rank -> replaced incarnations (their late messages are dropped)
        self._retired: OrderedDict[tuple[str, int], RetiredIncarnations] = OrderedDict()
        self._agents: dict[str, tuple[str, int]] = {}  # agent name -> the D rank it belongs to
        # Agents whose connection (ConnectPeer) the shell has not confirmed yet: transfers to
        # them are held, not posted, until ``on_peer`` says the connection is ready; and the
        # agents whose connection failed (why), pushes to which fall back or fail.
        self._connecting: set[str] = set()
        self._unreachable: dict[str, str] = {}
        # Unreachable agents: when a transfer to one may next ask for a new connection (the
        # driver backs off further while connects keep failing).
        self._connect_retry_at: dict[str, float] = {}
        # Agents whose connection was closed or could not be made, not heard from since: no
        # new connect is tried until a message of theirs arrives (a connect into a partition
        # fails after seconds and UCX keeps a socket of each such try).
        self._silent: set[str] = set()
        self._next_heartbeat = 0.0
        self._capped = (0, 0)  # the scheduler's capped counters last reported

    # ------------------------------------------------------------------ introspection
    @property
    def active(self) -> int:
        return len(self._out)

    def tables(self) -> dict[str, tuple[int, int | None]]:
        """Entries of every table P's rank keeps (transfers, tombstones, peers, and its
        scheduler's, breakers' and retry budget's), each with its bound (None: none)."""
        s = self.s
        return {
            "sender.transfers": (len(self._out), s.max_transfers),
            "sender.unknown": (len(self._unknown), None),
            "sender.chunks": (len(self._chunks), None),
            "sender.tombstones": (len(self._tombstones), s.max_tombstones),
            "sender.refused": (len(self._refused), s.max_tombstones),
            "sender.peers": (len(self._peers), s.max_peers),
            "sender.retired": (len(self._retired), s.max_peers),
            "sender.agents": (len(self._agents), None),
            "sender.connect_retry": (len(self._connect_retry_at), None),
            "sender.silent": (len(self._silent), None),
            "sender.breakers": (len(self.breakers), None),
            "sender.retry_budgets": (len(self.budget), None),
            **self.sched.tables("push"),
        }

    @property
    def busy(self) -> bool:
        """Chunks in flight or queued, or D pulling from us: the shell should poll often."""
        return bool(self._chunks) or self.sched.queued > 0 or self.pulling

    @property
    def pulling(self) -> bool:
        """Some D is reading our blocks (fallback): a transport that needs the passive side's
        progress (e.g. TCP) must be progressed meanwhile."""
        return any(o.machine.state is S.FALLBACK for o in self._out.values())

    def held_blocks(self) -> int:
        return sum(len(o.blocks or ()) for o in self._out.values() if o.held and not o.released)

    def agent_of(self, tid: str) -> str:
        """The NIXL agent of the decode engine that registered ``tid`` ("" if none did)."""
        o = self._out.get(tid)
        return o.peer if o is not None else ""

    def breaker_states(self, now: float) -> dict[str, BreakerState]:
        return {str(k): v for k, v in self.breakers.states(now).items()}

    # ------------------------------------------------------------------ engine events
    def expect_blocks(self, tid: str, now: float, owner: str = "") -> list[Action]:
        """P's scheduler has the request: its blocks will come (keeps D's permit renewed).

        ``owner``: the decode origin the router named for this transfer, if any; then only
        that origin's REGISTER is taken."""
        o = self._get(tid, now)
        o.expected = True
        self._uncount(o)
        return self._require(o, owner, now)

    def blocks_ready(
        self, tid: str, blocks: list[int], now: float, owner: str = "", prompt: bytes = b""
    ) -> list[Action]:
        """The prompt's KV is in ``blocks`` (this step's forward has finished); ``prompt``:
        the digest of its token ids, stated to D with the KV."""
        o = self._get(tid, now)
        if o.partial:
            return self._complete(o, now)
        return self._ready(o, blocks, now, owner, prompt)

    def _ready(
        self,
        o: _Out,
        blocks: list[int],
        now: float,
        owner: str,
        prompt: bytes,
        parts: int = 1,
        ready: int = 1,
    ) -> list[Action]:
        if not o.machine.can_fire(E.BLOCKS_READY):
            # The engine handed this transfer's blocks over twice (its push is under way):
            # refused before anything changes; the driver counts and logs it.
            raise ProtocolError(
                "event not allowed",
                f"blocks of transfer {o.tid!r} handed over again in state "
                f"{o.machine.state.value}: the engine gives each prompt's blocks once",
            )
        o.blocks, o.expected, o.prompt = list(blocks), True, prompt
        o.lease_until = now + self.s.send_lease_s
        self._uncount(o)
        out = self._require(o, owner, now)
        if self._tombstoned(o.tid, o.owner or o.required):
            # D does not want it (or P aborted it): free once the scheduler hands it over.
            self._fire(o, E.CANCEL, now)
            return out + self._close(o, Outcome.CANCELLED)
        o.parts, o.ready, o.partial = parts, min(ready, parts), parts > 1
        self._fire(o, E.BLOCKS_READY, now)
        return out + self._maybe_start(o, now)

    def layers_ready(
        self,
        tid: str,
        blocks: list[int],
        ready: int,
        parts: int,
        now: float,
        owner: str = "",
        prompt: bytes = b"",
    ) -> list[Action]:
        """Layer-wise push: the forward that computes this prompt has computed the first
        ``ready`` of the ``parts`` parts (layers) of ``blocks`` and is still running. Those
        parts may be pushed now; ``blocks_ready`` says when the forward is over (then the
        last chunk, with DONE, may go). ``parts`` < 2 or ``ready`` < 1: nothing to do."""
        o = self._out.get(tid)
        if (
            parts < 2
            or ready < 1
            or (o is not None and (o.outcome or (o.blocks is not None and not o.partial)))
        ):
            return []  # not layer-wise, already over, or the whole KV was handed over
        if o is not None and o.partial:
            if ready > o.ready:
                o.ready = min(ready, o.parts)
                if o.queued:
                    self.sched.extend(tid, o.ready)
                    return self.poll(now)
            return []
        return self._ready(self._get(tid, now), blocks, now, owner, prompt, parts, ready)

    def _complete(self, o: _Out, now: float) -> list[Action]:
        """The forward of a layer-wise push ended: every part holds its KV."""
        o.partial, o.ready = False, o.parts
        if o.outcome:
            return []
        if o.queued:
            self.sched.extend(o.tid, o.parts, final=True)
            return self.poll(now)
        if o.drain_then is AfterDrain.FALLBACK:
            return self._after_drain(o, now)  # a fallback that waited for the whole KV
        return self._maybe_start(o, now)

    def forward_failed(self, tid: str, blocks: list[int], now: float) -> list[Action]:
        """The forward that was to compute this prompt raised (a fatal error, or a shutdown
        signal mid-step): ``blocks`` hold no usable KV. Nothing is pushed; D hears at once
        (it recomputes the prompt or fails the request) and the blocks are freed once held.
        A layer-wise push that already posted parts stops and drains first: D hears once
        nothing is in flight to its blocks."""
        self._tombstone(tid, now, "")
        o = self._out.get(tid)
        if o is not None and o.partial and not o.outcome:
            return self._stop_partial(o, "prefill_failed", now)
        o = self._get(tid, now)
        o.blocks, o.expected = list(blocks), True
        self._uncount(o)
        self._fire(o, E.FAIL, now)
        out: list[Action] = []
        if o.reg is not None:
            out.append(
                self._failed(
                    o, "prefill_failed", "the prefill forward that computes this prompt raised"
                )
            )
        return out + self._close(o, Outcome.FAILED)

    def hold(self, tid: str) -> list[Action]:
        """The request finished; its blocks are ours until ReleaseSend."""
        o = self._out.get(tid)
        if o is None:
            return []
        o.held = True
        return self._maybe_release(o)

    def _stop_partial(self, o: _Out, reason: str, now: float) -> list[Action]:
        """A layer-wise push whose forward will not complete: post nothing more, let the
        chunks in flight land, then tell D (Failed ``reason``) and free once held."""
        o.partial = False
        if o.queued:
            self.sched.cancel(o.tid)
            o.queued = False
        o.confirm = None
        if o.inflight or o.drain_then is not AfterDrain.NOTHING:
            # D hears only once nothing is in flight to its blocks. (A CancelAck, an expiry
            # or a drop already owed to D is told as it was.)
            if o.drain_then in (AfterDrain.NOTHING, AfterDrain.FALLBACK):
                o.drain_then, o.reason = AfterDrain.FAILED, reason
            return self._after_drain(o, now)
        self._fire(o, E.FAIL, now)
        out = [self._failed(o, reason, "the prefill did not complete")] if o.reg else []
        return out + self._close(o, Outcome.FAILED)

    def abort(self, tid: str, now: float) -> list[Action]:
        """P's request ended before its KV was computed: the transfer can never happen."""
        self._tombstone(tid, now, "")
        po = self._out.get(tid)
        if po is not None and po.partial and not po.outcome:
            return self._stop_partial(po, "prefill_aborted", now)
        o = self._out.pop(tid, None)
        if o is not None:
            self._uncount(o)
        if o is not None and o.reg is not None:
            return [self._failed(o, "prefill_aborted", "the prefill request ended early")]
        return []

    # ------------------------------------------------------------------ network events
    def on_message(
        self, msg: ControlMessage, now: float, age: float = 0.0, origin: str = ""
    ) -> list[Action]:
        """A control message from D: ``Register``, ``Heartbeat``, ``Cancel``, ``PullDone`` or
        ``DoneState`` (any other is rejected). ``origin``: the authenticated sender ("" when
        the channel has no keys: then the control address the message claims stands in)."""
        origin = origin or msg.sender.control
        if isinstance(msg, Register):
            return self._on_register(msg, now, age, origin)
        if isinstance(msg, Heartbeat):
            return self._on_heartbeat(msg, now, age, origin)
        if isinstance(msg, Cancel):
            return self._on_cancel(msg, now, origin)
        if isinstance(msg, PullDone):
            return self._on_pull_done(msg, now, origin)
        if isinstance(msg, DoneState):
            return self._on_done_state(msg, now, origin)
        return [
            Note(
                NoteKind.REJECTED,
                RejectReason.UNEXPECTED,
                f"{type(msg).__name__} is not for a prefill engine",
            )
        ]

    def _on_register(self, reg: Register, now: float, age: float, origin: str) -> list[Action]:
        refusal = self._unbelieved(reg, self._out.get(reg.transfer_id), origin)
        if refusal is not None:
            return [refusal]
        met = self._learn_peer(reg.sender, origin, now)
        if met is None:
            return [self._retired_note(reg.sender)]
        out, refused = met
        o = self._out.get(reg.transfer_id)  # a peer restart may just have ended it
        if refused is not None and refused.reason == "incompatible":
            return self._incompatible(reg, o, origin, refused.detail, out, now)
        if refused is not None:
            return out  # an agent that is not the sender's own: nothing of it is believed
        if reg.permit_ttl_ms <= 0:
            # Before it is kept in any role (a contender's permit is built from it).
            return [
                *out,
                Note(
                    NoteKind.REJECTED,
                    RejectReason.BAD_PERMIT,
                    f"REGISTER with ttl {reg.permit_ttl_ms} ms",
                ),
            ]
        if o is not None and o.reg is not None and origin != o.owner:
            return out + self._contend(o, reg, origin, now, age)
        if o is not None and o.reg is not None:
            again = self._registered_again(o, reg)
            if again is not None:
                return out + again
        unwelcome = self._unwelcome(reg, o, origin)
        if unwelcome is not None:
            return [*out, unwelcome]
        if o is None:
            o = self._get(reg.transfer_id, now)
            o.unknown_of = origin
            self._unknown.add(origin, o.tid)
        return out + self._bind(o, reg, origin, now, age)

    def _unbelieved(self, reg: Register, o: _Out | None, origin: str) -> Note | None:
        """Why ``reg`` is refused before anything of it is believed (its agent, its layout);
        None: it is read on."""
        if o is not None and o.required and origin != o.required:
            return self._not_owner(reg, origin, "the router named another decode engine")
        if o is None and self._unknown.full(origin):
            # A key may have P keep only so many transfers P's own engine has not named
            # (D's permit runs out, and D computes the prompt itself).
            return Note(
                NoteKind.REJECTED,
                RejectReason.QUOTA_REGISTRATIONS,
                f"REGISTER {reg.transfer_id} from {origin[:16]}: it already has "
                f"{self._unknown.count(origin)} registrations of transfers this "
                "engine does not know, the most one key may have",
            )
        return None

    def _contend(self, o: _Out, reg: Register, origin: str, now: float, age: float) -> list[Action]:
        """``reg`` comes from another origin than the registrant of ``o``: refused if the
        router named the owner, else kept as a contender (the prefill leg may name it)."""
        if o.required:
            return [self._not_owner(reg, origin, "another decode engine registered it")]
        # The latest few are kept: the decode the router picked registers once, early.
        o.contenders.pop(origin, None)
        o.contenders[origin] = (
            reg,
            Permit.from_ttl(
                reg.transfer_id,
                reg.generation,
                reg.permit_ttl_ms / 1000.0,
                now - age,
                self.s.stop_margin_s,
            ),
            now,
        )
        if len(o.contenders) <= self.s.max_contenders:
            return []
        first = next(iter(o.contenders))
        dropped, _, _ = o.contenders.pop(first)
        return [self._not_owner(dropped, first, "too many decode engines registered it")]

    @staticmethod
    def _registered_again(o: _Out, reg: Register) -> list[Action] | None:
        """The registrant of ``o`` registers it again: nothing for a duplicate, a fence for
        an older generation or one too late to take; None: a newer generation, taken."""
        assert o.reg is not None
        if reg.generation == o.reg.generation:
            return []  # a duplicate: idempotent
        if reg.generation > o.reg.generation and o.machine.state in (S.NEW, S.WAITING_BLOCKS):
            return None
        return [
            Note(
                NoteKind.FENCED,
                "stale_generation",
                f"REGISTER {reg.transfer_id} gen {reg.generation} after {o.reg.generation}",
            )
        ]

    def _unwelcome(self, reg: Register, o: _Out | None, origin: str) -> Action | None:
        """Why P will not keep ``reg`` although it is believed: the transfer was cancelled
        or aborted (D hears at once), or P keeps as many transfers as it may."""
        if self._tombstoned(reg.transfer_id, origin):
            return self._fail(reg, origin, "prefill_aborted", "the prefill request is gone")
        if o is None and len(self._out) >= self.s.max_transfers:
            return Note(
                NoteKind.REJECTED,
                RejectReason.OVERLOADED,
                f"REGISTER {reg.transfer_id}: {len(self._out)} transfers known, "
                f"the most this engine keeps",
            )
        return None

    def _incompatible(
        self, reg: Register, o: _Out | None, origin: str, detail: str, out: list[Action], now: float
    ) -> list[Action]:
        """``reg`` names a layout P cannot write into: D hears at once instead of waiting
        out its permit; the transfer ends only where ``origin`` owns it."""
        out = [
            *out,
            self._fail(reg, origin, "incompatible", detail),
        ]
        if o is not None and o.owner == origin and self._drop_registrant(o, now):
            pass
        elif o is not None and (o.owner or o.required) == origin and not o.inflight:
            # The transfer's own decode engine (the one the router named, or its
            # registrant) can never take this KV: end it now rather than hold the
            # prompt's blocks for the whole send lease. Never for a transfer whose
            # owner is unknown: any authenticated engine could end it that way.
            self._tombstone(reg.transfer_id, now, origin)
            self._fire(o, E.FAIL, now)
            out += self._close(o, Outcome.FAILED)
        else:
            # Not known yet, or its owner not: remembered, and believed only for the
            # decode engine the router names for it (_require); then its blocks go.
            self._refused.add(reg.transfer_id, origin, now + self.s.tombstone_s)
        return out

    def _bind(
        self,
        o: _Out,
        reg: Register,
        origin: str,
        now: float,
        age: float,
        permit: Permit | None = None,
    ) -> list[Action]:
        """``reg`` (from ``origin``) becomes the registration of ``o`` (``permit``: its
        permit as renewed while it was a contender)."""
        info = self._peers.get((origin, peer_slot(reg.sender.engine_id, reg.sender.rank)))
        o.reg, o.reg_at, o.owner = reg, now, origin
        # The write target is the agent P met for that authenticated D rank, never a name the
        # message carries.
        o.peer = info.agent_name if info is not None else ""
        # The term counts from when D granted it: subtract how long the message travelled.
        o.permit = permit or Permit.from_ttl(
            reg.transfer_id,
            reg.generation,
            reg.permit_ttl_ms / 1000.0,
            now - age,
            self.s.stop_margin_s,
        )
        if o.machine.state in (S.NEW, S.WAITING_REGISTER):
            self._fire(o, E.REGISTER, now)
        return self._maybe_start(o, now)

    def _require(self, o: _Out, owner: str, now: float) -> list[Action]:
        """The router named ``owner`` as this transfer's decode engine: keep only its REGISTER.
        Named none: a registration is taken as it came (the earliest contender left, when
        the first registrant withdrew)."""
        if not owner:
            if o.reg is None and o.contenders:
                first = next(iter(o.contenders))
                reg, permit, _ = o.contenders.pop(first)
                return self._bind(o, reg, first, now, 0.0, permit)
            return []
        if o.required == owner:
            return []
        o.required = owner
        if owner in self._refused.pop(o.tid, now):
            # That engine already registered it with a layout P cannot write into: D has
            # heard (Failed incompatible) and will not register again. Free, do not hold.
            self._tombstone(o.tid, now, owner)
        out: list[Action] = []
        if o.reg is not None and o.owner != owner:
            if o.machine.state not in (S.NEW, S.WAITING_BLOCKS):
                return []  # already pushing (cannot happen: blocks come after expect_blocks)
            out.append(self._not_owner(o.reg, o.owner, "the router named another decode engine"))
            o.reg, o.owner, o.peer, o.permit = None, "", "", None
            self._unregister(o, now)
        contender = o.contenders.pop(owner, None)
        for origin, (reg, _, _) in o.contenders.items():
            out.append(self._not_owner(reg, origin, "the router named another decode engine"))
        o.contenders.clear()
        if contender is not None and o.reg is None:
            reg, permit, _ = contender
            out += self._bind(o, reg, owner, now, 0.0, permit)
        return out

    def _unregister(self, o: _Out, now: float) -> None:
        """The registration of ``o`` (WAITING_BLOCKS) was withdrawn: its machine starts again
        from NEW, as if none had come (a registration that comes later, or the blocks, move
        it on as usual); the whole-transfer bound still counts from its first event."""
        if o.machine.state is not S.WAITING_BLOCKS:
            return  # NEW: the registration had not moved it
        fresh = TransferMachine(o.tid, now, self.s.timeouts)
        fresh.created_at = o.machine.created_at
        o.machine = fresh

    def _unclaimed(self, o: _Out) -> bool:
        """P's engine has not named ``o`` yet (no request, no owner): its registrant is one
        candidate among its contenders, and may end only its own registration."""
        return not o.expected and not o.required and o.blocks is None

    def _drop_registrant(self, o: _Out, now: float) -> bool:
        """The registrant of unclaimed ``o`` ended its registration (a CANCEL, a failed
        PullDone, a layout P cannot write into, its process restarting, its permit running
        out): only its registration ends, remembered for its key alone, and the contenders
        are kept for the prefill leg to name. False (nothing done) when ``o`` is claimed or
        has no contenders: the caller ends the transfer."""
        if not (self._unclaimed(o) and o.contenders and not o.inflight):
            return False
        if o.owner:
            self._tombstone(o.tid, now, o.owner)
        self._uncount(o)
        # Born when the first REGISTER came: the whole-transfer bound still counts from then.
        fresh = self._out[o.tid] = _Out(o.tid, TransferMachine(o.tid, now, self.s.timeouts))
        fresh.machine.created_at = o.machine.created_at
        fresh.contenders, fresh.lease_until = o.contenders, o.lease_until
        return True

    def _not_owner(self, reg: Register, origin: str, why: str) -> Note:
        return Note(
            NoteKind.REJECTED,
            RejectReason.NOT_OWNER,
            f"REGISTER {reg.transfer_id} from {origin[:16]} ({reg.sender.engine_id} rank "
            f"{reg.sender.rank}): {why}",
        )

    def _on_heartbeat(self, hb: Heartbeat, now: float, age: float, origin: str) -> list[Action]:
        met = self._learn_peer(hb.sender, origin, now)
        if met is None:
            return [self._retired_note(hb.sender)]
        out = met[0]  # a refused announcement still speaks for the origin's own transfers
        ttl = hb.permit_ttl_ms / 1000.0
        for tid, gen in hb.live:
            o = self._out.get(tid)
            if o is None:
                continue
            if gen == 0:
                # D still waits for credit to admit it: keep the blocks.
                if not o.required or o.required == origin:
                    o.lease_until = max(o.lease_until, now + self.s.send_lease_s)
            elif origin in o.contenders:
                # A contender's decode renews its permit too: the prefill leg may name it.
                creg, cpermit, at = o.contenders[origin]
                if gen == creg.generation and ttl > 0:
                    o.contenders[origin] = (creg, cpermit.renewed(gen, now - age + ttl), at)
            elif o.owner != origin:
                continue  # only the transfer's own decode engine speaks for it
            elif o.reg is not None and o.permit is not None and gen == o.reg.generation:
                if ttl > 0:
                    o.permit = o.permit.renewed(gen, now - age + ttl)
                    if o.queued:
                        self.sched.renew(tid, o.permit.expires_at)
                    elif self._awaits_permit(o):
                        out += self._maybe_start(o, now)
                o.lease_until = max(o.lease_until, now + self.s.send_lease_s)
            elif o.reg is not None:
                out.append(
                    Note(
                        NoteKind.FENCED,
                        "stale_generation",
                        f"heartbeat for {tid} gen {gen}, current {o.reg.generation}",
                    )
                )
        return out

    def _on_cancel(self, msg: Cancel, now: float, origin: str) -> list[Action]:
        ack = SendMessage(
            msg.sender.control,
            CancelAck(PROTOCOL_VERSION, msg.transfer_id, msg.generation, self.slim),
            origin,
        )
        o = self._out.get(msg.transfer_id)
        owner = (o.owner or o.required) if o is not None else ""
        if owner and origin != owner:
            return [
                Note(
                    NoteKind.REJECTED,
                    RejectReason.NOT_OWNER,
                    f"CANCEL {msg.transfer_id} from an engine that does not own it",
                )
            ]
        if o is not None and o.reg is not None and msg.generation not in (0, o.reg.generation):
            # Checked before the tombstone: a stale CANCEL must not cancel the blocks to come.
            return [
                Note(
                    NoteKind.FENCED,
                    "stale_generation",
                    f"CANCEL {msg.transfer_id} gen {msg.generation}, current {o.reg.generation}",
                )
            ]
        if o is not None and origin in o.contenders:
            o.contenders.pop(origin)  # a contender withdraws: only its registration ends
            self._tombstone(msg.transfer_id, now, origin)
            return [ack]
        if o is not None and o.owner == origin and self._drop_registrant(o, now):
            return [ack]
        self._tombstone(msg.transfer_id, now, origin)
        if o is None:
            return [ack]  # blocks that still come are freed unpushed (tombstone)
        self._fire(o, E.CANCEL, now)
        if o.queued:
            self.sched.cancel(o.tid)
            o.queued = False
        if o.inflight:
            if o.drain_then is not AfterDrain.DROPPED:
                o.drain_then = AfterDrain.ACK  # the ack promises nothing is in flight any more
            # (DROPPED: failed when D's process restarted; that process is gone, nothing to
            # answer, and the transfer stays failed.)
            return []
        return [ack, *self._close(o, Outcome.CANCELLED)]

    def _on_pull_done(self, msg: PullDone, now: float, origin: str) -> list[Action]:
        o = self._out.get(msg.transfer_id)
        if o is None or o.reg is None or msg.generation != o.reg.generation:
            return [
                Note(
                    NoteKind.REJECTED,
                    RejectReason.UNKNOWN_TRANSFER,
                    f"PullDone for {msg.transfer_id}",
                )
            ]
        if origin != o.owner:
            return [
                Note(
                    NoteKind.REJECTED,
                    RejectReason.NOT_OWNER,
                    f"PullDone {msg.transfer_id} from an engine that does not own it",
                )
            ]
        if o.machine.terminal:
            # Over already (a late answer, or one crossing a CANCEL while the push drains):
            # it ends as decided then.
            return []
        if msg.ok and o.machine.state is not S.FALLBACK:
            # P never offered this generation's blocks for reading (no FALLBACK was sent):
            # D cannot have pulled them. Nothing changes; the push goes on.
            return [
                Note(
                    NoteKind.REJECTED,
                    RejectReason.OUT_OF_ORDER,
                    f"PullDone {msg.transfer_id} gen {msg.generation} in state "
                    f"{o.machine.state.value}: no FALLBACK was sent for it",
                )
            ]
        if msg.ok:
            self._fire(o, E.PULL_DONE, now)
            return self._close(o, Outcome.PULL_FALLBACK)
        if self._drop_registrant(o, now):
            return []
        self._fire(o, E.FAIL, now)
        return self._close(o, Outcome.FAILED)

    def on_peer(self, agent: str, problem: str, now: float) -> list[Action]:
        """The shell's connection to D's agent ``agent`` (a ``ConnectPeer``) is ready
        (``problem`` "") or could not be made (``problem`` says why): the transfers held for
        it start, or fall back (D pulls) or fail as a failed push would."""
        if agent not in self._agents:
            return []  # a peer forgotten (replaced, pruned) while it was being connected
        self._connecting.discard(agent)
        if problem:
            # Just tried: the transfers that waited for it fall back; a later one asks again.
            self._unreachable[agent] = problem[:MAX_TEXT_LEN]
            self._connect_retry_at[agent] = now + CONNECT_RETRY_S
            self._silent.add(agent)
        else:
            self._unreachable.pop(agent, None)
        out: list[Action] = []
        for o in list(self._out.values()):
            if o.peer == agent and not o.outcome and self._awaits_permit(o):
                out += self._maybe_start(o, now)
        return out

    def connecting(self, agent: str) -> bool:
        """P's connection to ``agent`` is being made (transfers to it are held)."""
        return agent in self._connecting

    def _forget_agent(self, agent: str) -> None:
        self._connecting.discard(agent)
        self._unreachable.pop(agent, None)
        self._connect_retry_at.pop(agent, None)
        self._silent.discard(agent)

    def on_chunk(
        self, chunk_id: int, ok: bool, error: ChunkError | str, now: float
    ) -> list[Action]:
        """A posted chunk completed (``ok``) or failed with transport error ``error`` (a
        ``ChunkError``, or the text NIXL reported)."""
        rec = self._chunks.pop(chunk_id, None)
        if rec is None:
            return []
        chunk, tid = rec
        o = self._out.get(tid)
        if o is not None:
            o.inflight.discard(chunk_id)
        if ok:
            return self._chunk_landed(chunk, o, now)
        self._connection_closed(chunk.link, error)
        return self._chunk_failed(chunk, o, error, now)

    def _connection_closed(self, agent: str, error: ChunkError | str) -> None:
        """A chunk to ``agent`` failed because its connection is gone (REMOTE_DISCONNECT:
        the shell drops a connection the transport closed). The next transfer to that D
        asks for a new one once D is heard from again (a heartbeat or a REGISTER: the link
        is back), and waits for it as for a first connection."""
        if classify(error).kind is not ErrorKind.REMOTE_DISCONNECT:
            return
        if agent not in self._agents or agent in self._connecting:
            return  # a process no longer met (its transfers end), or already connecting
        self._unreachable[agent] = "its connection was closed (REMOTE_DISCONNECT)"
        self._connect_retry_at.pop(agent, None)  # no wait beyond hearing from D
        self._silent.add(agent)

    def _retry_connect(self, o: _Out, now: float) -> list[Action]:
        """``o``'s D could not be connected (or its connection was closed): ask again
        (``o`` waits for the answer) once D was heard from since, at most every
        ``CONNECT_RETRY_S`` and not while the breaker to D is open; [] when it is not time
        (``o`` falls back)."""
        key = self._agents.get(o.peer)
        info = self._peers.get(key) if key is not None else None
        if info is None or o.peer in self._silent:
            return []
        if self.breakers[o.peer].state(now) is BreakerState.OPEN:
            return []  # straight to pull until the breaker lets a probe through
        if now < self._connect_retry_at.get(o.peer, 0.0):
            return []
        self._connect_retry_at[o.peer] = now + CONNECT_RETRY_S
        if self.s.await_connect:
            self._connecting.add(o.peer)  # transfers to it wait for the answer
        return [ConnectPeer(info)]

    def _chunk_landed(self, chunk: Chunk, o: _Out | None, now: float) -> list[Action]:
        """``chunk`` of ``o`` completed: the push is over with the last one, else the next
        chunks may go (or a drain that waited for it ends)."""
        self.breakers.record_success(chunk.link, now)
        completed = self.sched.on_chunk_done(chunk.id, now)
        if o is None:
            return []
        o.pushed_bytes += chunk.nbytes
        if completed:
            self._fire(o, E.DONE, now)
            outcome = Outcome.RETRIED if o.retried else Outcome.PUSHED
            return [Note(NoteKind.TRANSFER_DONE, outcome, o.tid), *self._close(o, outcome)]
        return self._after_drain(o, now) + self.poll(now)

    def _chunk_failed(
        self, chunk: Chunk, o: _Out | None, error: ChunkError | str, now: float
    ) -> list[Action]:
        """``chunk`` of ``o`` failed: retried after a backoff, asked about (the last chunk),
        or the push is given up. The peer's breaker counts failed pushes, not chunks: a
        chunk that a retry delivers is not evidence against the peer (``_give_up`` records
        them)."""
        if o is None or not o.queued:
            self.sched.on_chunk_failed(chunk.id, now, give_up=True)
            return self._after_drain(o, now) if o is not None else []
        kind = classify(error)
        if chunk.is_last and kind.action is ErrorClass.RETRY:
            return self._ask_if_done(o, chunk, error, now)
        if chunk.is_last:
            action, reason = kind.action, f"{kind.kind}: {kind.why}"
        else:
            decision = decide_next(error, chunk, now, self.policy, self.budget, chunk.link)
            if decision.action is ErrorClass.RETRY and decision.retry_at is not None:
                self.sched.on_chunk_failed(chunk.id, now, retry_at=decision.retry_at)
                o.retried = True
                self._fire(o, E.CHUNK_ERROR, now)
                return [Note(NoteKind.RETRY, decision.classification.kind, decision.reason)]
            action, reason = decision.action, decision.reason
        self.sched.on_chunk_failed(chunk.id, now, give_up=True)
        return self._give_up(o, action, reason, now)

    def _ask_if_done(
        self, o: _Out, chunk: Chunk, error: ChunkError | str, now: float
    ) -> list[Action]:
        """The last chunk of ``o``, which carries DONE, failed with an error worth a retry.

        A failed completion does not mean nothing landed (the ack can be lost after the
        bytes and the notification arrived): D may have reported the KV and released the
        blocks, so the WRITE is not posted again blindly: P asks D (DoneQuery) and re-posts
        only if D says DONE did not arrive. (An error that breaks the push path, e.g. the
        peer disconnected, falls back at once: D ignores the FALLBACK if DONE did arrive.)"""
        self.sched.on_chunk_failed(chunk.id, now, hold=True)
        o.retried = True
        self._fire(o, E.CHUNK_ERROR, now)
        if not self.sched.has_transfer(o.tid):
            return self.poll(now)  # past its cut-off: reported expired there
        o.confirm = _Confirm(
            chunk.attempt,
            error,
            chunk.first_posted_at,
            chunk.nbytes,
            now + self.s.done_query_s,
            now + self.s.done_query_s / 4,
        )
        return [self._done_query(o)]

    def _give_up(self, o: _Out, action: ErrorClass, reason: str, now: float) -> list[Action]:
        """Give up the push of ``o``: stop posting, let the rest drain, then fall back or
        fail. A push given up for the link's sake (not a request's own fatal error) counts
        against the peer's breaker."""
        out: list[Action] = []
        if action is not ErrorClass.FATAL and o.peer:
            before = self.breakers[o.peer].state(now)
            self.breakers.record_failure(o.peer, now)
            if (
                before is not BreakerState.OPEN
                and self.breakers[o.peer].state(now) is BreakerState.OPEN
            ):
                out.append(Note(NoteKind.BREAKER_TRIP, o.peer, reason))
        self.sched.cancel(o.tid)
        o.queued = False
        o.confirm = None
        if o.machine.state is not S.REGISTERED:
            # A chunk failed (PUSHING or RETRYING). A push given up before any chunk went
            # out (its D could not be connected) goes from REGISTERED straight to FALLBACK
            # or FAILED: no chunk failed.
            self._fire(o, E.CHUNK_ERROR, now)
        fallback = action is not ErrorClass.FATAL and self.s.fallback
        o.drain_then = AfterDrain.FALLBACK if fallback else AfterDrain.FAILED
        o.reason = reason
        return out + self._after_drain(o, now)

    def _done_query(self, o: _Out) -> SendMessage:
        assert o.reg is not None and o.confirm is not None
        q = DoneQuery(PROTOCOL_VERSION, o.tid, o.reg.generation, self.slim, o.confirm.attempt)
        return SendMessage(o.reg.sender.control, q, o.owner)

    def _on_done_state(self, msg: DoneState, now: float, origin: str) -> list[Action]:
        """D's answer to a DoneQuery: only the transfer's owner speaks, for its generation."""
        o = self._out.get(msg.transfer_id)
        refusal = self._done_state_refusal(msg, o, origin)
        if refusal is not None:
            return [refusal]
        assert o is not None
        c = o.confirm
        if c is None or msg.attempt != c.attempt or not o.queued:
            return []  # a duplicate or late answer: the question is settled
        o.confirm = None
        if msg.state == "done":
            # The DONE did land: the push is complete, the last chunk is not posted again.
            self.sched.confirm_last(o.tid)
            o.queued = False
            o.pushed_bytes += c.nbytes
            self.breakers.record_success(o.peer, now)
            self._fire(o, E.DONE, now)
            return [
                Note(NoteKind.TRANSFER_DONE, Outcome.RETRIED, o.tid),
                *self._close(o, Outcome.RETRIED),
            ]
        if msg.state == "gone":
            # D no longer receives it (it failed or ended the receive): nothing to push.
            self.sched.cancel(o.tid)
            o.queued = False
            self._fire(o, E.FAIL, now)
            return self._close(o, Outcome.FAILED)
        return self._repost_last(o, c, now)

    @staticmethod
    def _done_state_refusal(msg: DoneState, o: _Out | None, origin: str) -> Note | None:
        """Why ``msg`` is not taken (None: it is): an unknown transfer, an origin that does not
        own it, or an old generation."""
        if o is None or o.reg is None:
            return Note(
                NoteKind.REJECTED,
                RejectReason.UNKNOWN_TRANSFER,
                f"DoneState for {msg.transfer_id}",
            )
        if origin != o.owner:
            return Note(
                NoteKind.REJECTED,
                RejectReason.NOT_OWNER,
                f"DoneState {msg.transfer_id} from an engine that does not own it",
            )
        if msg.generation != o.reg.generation:
            return Note(
                NoteKind.FENCED,
                "stale_generation",
                f"DoneState {msg.transfer_id} gen {msg.generation}, current {o.reg.generation}",
            )
        return None

    def _repost_last(self, o: _Out, c: _Confirm, now: float) -> list[Action]:
        """D says the DONE of ``o``'s last chunk did not arrive (and now ignores that post's
        DONE): post the last chunk again, like any chunk, under the same policy and budget."""
        decision = decide_next(c.error, c, now, self.policy, self.budget, o.peer)
        if decision.action is ErrorClass.RETRY and decision.retry_at is not None:
            if not self.sched.repost_last(o.tid, now, decision.retry_at):
                return self.poll(now)
            return [
                Note(NoteKind.RETRY, decision.classification.kind, decision.reason),
                *self.poll(now),
            ]
        return self._give_up(o, decision.action, decision.reason, now)

    # ------------------------------------------------------------------ time
    def poll(self, now: float) -> list[Action]:
        """Chunks the scheduler lets out now (call often while ``busy``)."""
        out: list[Action] = []
        for chunk in self.sched.next_chunks(now):
            o = self._out.get(chunk.transfer_id)
            if o is None or o.reg is None or o.blocks is None or o.units is None:
                self.sched.on_chunk_failed(chunk.id, now, give_up=True)
                continue
            out += self._post(o, chunk, now)
        out += self._capped_notes()
        return out + self._expired_pushes(now)

    def _post(self, o: _Out, chunk: Chunk, now: float) -> list[Action]:
        """Post ``chunk`` of ``o`` (the last one carries DONE)."""
        reg, units = o.reg, o.units
        assert reg is not None and units is not None
        done = None
        if chunk.is_last:
            done = Done(
                PROTOCOL_VERSION,
                o.tid,
                reg.generation,
                len(units.dst),
                attempt=chunk.attempt,
                unit_tokens=units.unit_tokens,
                prompt=o.prompt,
            )
        # Layer-wise or region groups: the chunk's ids are part by part (``ChunkScheduler.add``).
        nb = len(units.dst)
        parts = len(o.groups) - 1 if o.groups else o.parts
        part = chunk.start // nb if parts > 1 and nb else 0
        start, end = chunk.start - part * nb, chunk.end - part * nb
        regions = self._part_regions(o, part, parts) if nb else None
        self._chunks[chunk.id] = (chunk, o.tid)
        o.inflight.add(chunk.id)
        if o.machine.state is S.RETRYING:
            self._fire(o, E.RETRY, now)
        self._fire(o, E.CHUNK_POSTED, now)
        out: list[Action] = []
        if o.ready_at >= 0:
            out.append(Note(NoteKind.QUEUE_WAIT, "", o.tid, now - o.ready_at))
            o.ready_at = -1.0
        write = PostWrite(
            o.tid,
            reg.generation,
            chunk.id,
            o.peer,
            tuple(units.src[start:end]),
            tuple(units.dst[start:end]),
            chunk.nbytes,
            done,
            tuple(units.src) if chunk.is_last else (),
            part,
            parts if nb else 1,
            regions,
            o.parts > 1,
        )
        return [*out, write]

    def _part_regions(self, o: _Out, part: int, parts: int) -> tuple[int, int] | None:
        """The layout's regions ``[first, end)`` a WRITE of part ``part`` moves: its region
        group (a whole push cut by regions), or layer ``part``'s equal share of the regions
        (a layer-wise push: the connector checks each layer is one); None: every region."""
        if o.groups:
            return o.groups[part], o.groups[part + 1]
        if parts < 2 or self.me.layout is None:
            return None
        per = len(self.me.layout.regions) // parts
        return part * per, (part + 1) * per

    def _capped_notes(self) -> list[Action]:
        """How many more times the scheduler held chunks back for a link's caps."""
        capped = self.sched.capped()
        if capped == self._capped:
            return []
        out: list[Action] = []
        for reason, now_n, before in zip(("bytes", "chunks"), capped, self._capped, strict=True):
            if now_n > before:
                out.append(Note(NoteKind.LINK_CAPPED, reason, "", float(now_n - before)))
        self._capped = capped
        return out

    def _expired_pushes(self, now: float) -> list[Action]:
        """Pushes whose permit ran out while queued: they end once their chunks drained."""
        out: list[Action] = []
        for tid in self.sched.take_expired():
            o = self._out.get(tid)
            # Only a push still queued: one given up meanwhile (falling back, D reading our
            # blocks) must not be ended as expired under D's READs.
            if o is not None and o.queued:
                o.queued = False
                out.append(
                    Note(NoteKind.LEASE_EXPIRED, "permit", f"permit of {tid} ran out mid-push")
                )
                o.drain_then, o.reason = AfterDrain.EXPIRED, "permit_expired"
                out += self._after_drain(o, now)
        return out

    def tick(self, now: float) -> list[Action]:
        """Leases, deadlines, heartbeats and tombstones (call every few tens of ms)."""
        out = self.poll(now)
        self._tombstones.prune(now)
        self._refused.prune(now)
        for o in list(self._out.values()):
            if o.outcome:
                continue
            asked, gave_up = self._confirm_due(o, now)
            out += asked
            if not gave_up:
                out += self._deadlines(o, now)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.s.heartbeat_s
            out += self._heartbeats(now)
            self._forget_gone_agents()
        return out

    def _forget_gone_agents(self) -> None:
        """Drop the per-agent state (scheduler link, breaker, retry budget) of D processes
        no longer met and no longer written to: an agent name is one process's, so each
        restart of a D rank would otherwise leave one of each behind for good."""
        keep = set(self._agents) | {o.peer for o in self._out.values()}
        self.sched.forget_idle_links(keep)
        keep |= set(self.sched.links())
        self.breakers.forget_except(keep)
        self.budget.forget_except(keep)

    def _confirm_due(self, o: _Out, now: float) -> tuple[list[Action], bool]:
        """A DONE of ``o`` D has not confirmed: ask again when due, or give up on D (pull)
        at the bound. True when the transfer was given up."""
        c = o.confirm
        if c is None or not o.queued:
            return [], False
        if now >= c.until:
            # D did not answer: maybe it never will (partitioned, dead). Pull.
            return self._give_up(
                o,
                ErrorClass.FALLBACK,
                "done_query_timeout: D did not say whether the last chunk's DONE arrived",
                now,
            ), True
        if now >= c.resend_at:
            c.resend_at = now + self.s.done_query_s / 4
            return [self._done_query(o)], False
        return [], False

    def _deadlines(self, o: _Out, now: float) -> list[Action]:
        """The leases and bounds of ``o`` that ran out by ``now``."""
        st = o.machine.state
        if st is S.WAITING_REGISTER and now >= o.lease_until:
            # D never registered nor asked us to wait: the send lease is over.
            self._fire(o, E.EXPIRE, now)
            return [Note(NoteKind.LEASE_EXPIRED, "send", o.tid), *self._close(o, Outcome.EXPIRED)]
        if st is S.WAITING_BLOCKS and o.permit is not None and now >= o.permit.expires_at:
            # The permit ran out before our blocks did: D fails the receive itself, and
            # blocks that still come are freed unpushed. A registration P's engine never
            # named says nothing of the request to come: only its own key's is over.
            # Judged at its end, not when it stops being usable: a heartbeat renewing
            # it may still wait in the queue behind the REGISTER.
            if self._drop_registrant(o, now):
                return []
            self._tombstone(o.tid, now, o.owner if self._unclaimed(o) else "")
            self._fire(o, E.EXPIRE, now)
            return self._close(o, Outcome.EXPIRED)
        if o.reg is None and st is S.NEW and o.contenders and not o.expected:
            # Only contenders, none bound: each lasts as long as its permit.
            for origin, (_, cpermit, _) in list(o.contenders.items()):
                if not cpermit.usable(now) or o.machine.expired(now):
                    del o.contenders[origin]
            if not o.contenders:
                self._out.pop(o.tid, None)
            return []
        if self._awaits_permit(o) and o.permit is not None and now >= o.permit.expires_at:
            # Registered and computed, but no renewal came before the permit ran out:
            # D hears at once (it recomputes or fails the request) instead of waiting.
            note = Note(
                NoteKind.LEASE_EXPIRED, "permit", f"permit of {o.tid} ran out before its push began"
            )
            self._fire(o, E.EXPIRE, now)
            return [
                note,
                self._failed(o, "permit_expired", "the permit ran out before P could push"),
                *self._close(o, Outcome.EXPIRED),
            ]
        if st is S.FALLBACK and now >= o.pull_until + self.s.skew_margin_s:
            # D's read permit is over: D no longer reads our blocks.
            self._fire(o, E.EXPIRE, now)
            return [Note(NoteKind.LEASE_EXPIRED, "pull", o.tid), *self._close(o, Outcome.FAILED)]
        if st is not S.FALLBACK and o.machine.expired(now):
            return self._past_bound(o, st, now)
        return []

    def _past_bound(self, o: _Out, st: S, now: float) -> list[Action]:
        """The whole-transfer bound (a FALLBACK ends only with its read permit: D may READ
        until then). Post nothing more; end once the chunks in flight drained (a chunk
        always in flight must not keep the transfer alive)."""
        if o.queued:
            self.sched.cancel(o.tid)
            o.queued = False
        if o.inflight:
            if o.drain_then is AfterDrain.NOTHING:
                o.drain_then, o.reason = AfterDrain.EXPIRED, "timeout"
            return []
        self._fire(o, E.EXPIRE, now)
        out: list[Action] = []
        if o.reg is not None:
            out.append(self._failed(o, "timeout", f"transfer stuck in {st.value}"))
        return out + self._close(o, Outcome.EXPIRED)

    # ------------------------------------------------------------------ internals
    def _get(self, tid: str, now: float) -> _Out:
        o = self._out.get(tid)
        if o is None:
            o = self._out[tid] = _Out(tid, TransferMachine(tid, now, self.s.timeouts))
        return o

    def _uncount(self, o: _Out) -> None:
        """``o`` no longer counts against the quota of the origin that registered it first
        (P's engine named it, or P forgets it)."""
        if o.unknown_of:
            self._unknown.discard(o.unknown_of, o.tid)
            o.unknown_of = ""

    @staticmethod
    def _fire(o: _Out, event: E, now: float) -> None:
        """Move ``o``'s machine by ``event``. After the end it changes nothing (counted: late
        completions and crossing messages are normal). A live state the table has no entry
        for raises ``ProtocolError`` naming both: every input a peer or the engine can send
        out of turn is refused before it gets here (a note, or the engine's misuse raised
        before anything changed), so reaching it is a bug of this class; the driver
        contains it (``kvpush_pump_errors_total``) and a test fails on it."""
        o.machine.fire(event, now)

    def _learn_peer(
        self, info: PeerInfo, origin: str, now: float
    ) -> tuple[list[Action], Note | None] | None:
        """Connect to a D rank on first sight; a new incarnation supersedes the old one.

        Peers are keyed by the authenticated ``origin`` and the rank: a message can speak
        only for ranks of its own engine. None: ``info`` is a process already replaced (a
        message it sent before dying, delivered late); the caller drops the message. Else
        the actions and, if P refuses the peer, the refusal (``Note(rejected, ...)``, also
        the only action): ``incompatible``, a layout P cannot write into, or ``not_owner``.
        """
        key = (origin, peer_slot(info.engine_id, info.rank))
        retired = self._retired.get(key)
        if retired is not None and info.incarnation in retired:
            return None
        known = self._peers.get(key)
        if known is not None and known.incarnation == info.incarnation:
            self._peers.move_to_end(key)
            self._silent.discard(known.agent_name)  # heard from: a connect may be tried
            return [], None
        if info.layout is None or not info.agent_meta:
            return [], None  # a slim message (heartbeat) of a rank not met: nothing to do
        refusal = self._peer_refusal(info, origin, key)
        if refusal is not None:
            return [refusal], refusal
        return self._meet(info, origin, key, known, now), None

    def _peer_refusal(self, info: PeerInfo, origin: str, key: tuple[str, int]) -> Note | None:
        """Why P will not meet ``info`` under ``origin`` (None: it will)."""
        problem = self._layout_problem(info)
        if problem:
            return Note(NoteKind.REJECTED, RejectReason.INCOMPATIBLE, problem)
        if not owns_agent(origin, info.agent_name):
            return Note(
                NoteKind.REJECTED,
                RejectReason.NOT_OWNER,
                f"{info.engine_id} rank {info.rank} announces agent "
                f"{info.agent_name[:64]}, which is not named for its key",
            )
        holder = self._agents.get(info.agent_name)
        if holder is not None and holder != key:
            # An agent name P already met for another engine rank: writing "to it" would
            # write into that engine's memory (and a restart of it would cut that engine off).
            return Note(
                NoteKind.REJECTED,
                RejectReason.NOT_OWNER,
                f"{info.engine_id} rank {info.rank} claims agent "
                f"{info.agent_name[:64]}, which belongs to another engine",
            )
        return None

    def _meet(
        self, info: PeerInfo, origin: str, key: tuple[str, int], known: PeerInfo | None, now: float
    ) -> list[Action]:
        """``info`` becomes the D rank ``key``; a process it replaces (``known``) is retired
        and the transfers to it end."""
        if known is not None:
            self._agents.pop(known.agent_name, None)
        self._peers[key] = info
        self._agents[info.agent_name] = key
        self._peers.move_to_end(key)
        out: list[Action] = [ConnectPeer(info, replaces=known.agent_name if known else "")]
        self._unreachable.pop(info.agent_name, None)
        if self.s.await_connect:
            self._connecting.add(info.agent_name)
        if known is not None:
            self._forget_agent(known.agent_name)
            self._retired.setdefault(key, RetiredIncarnations()).add(known.incarnation)
            self._retired.move_to_end(key)
            out.append(
                Note(
                    NoteKind.PEER_RESTART,
                    "decode",
                    f"{info.engine_id} rank {info.rank} incarnation {info.incarnation}",
                )
            )
            # Transfers to the old process: its blocks are gone; stop and free ours.
            for o in list(self._out.values()):
                kept = o.contenders.get(origin)
                if kept is not None and kept[0].sender.agent_name == known.agent_name:
                    del o.contenders[origin]  # its registration died with the old process
                if o.owner == origin and o.peer == known.agent_name and not o.outcome:
                    if self._drop_registrant(o, now):
                        continue
                    self._fire(o, E.FAIL, now)
                    if o.queued:
                        self.sched.cancel(o.tid)
                        o.queued = False
                    if o.inflight:
                        o.drain_then, o.reason = AfterDrain.DROPPED, "peer_restarted"
                    else:
                        out += self._close(o, Outcome.FAILED)
        return out + self._prune_peers()

    def _layout_problem(self, info: PeerInfo) -> str:
        """Why P cannot write into ``info``'s KV cache ("" if it can): the layout must be
        this engine's model facts (compat, regions, block sizes) with a sane block count."""
        mine, theirs = self.me.layout, info.layout
        if mine is None or theirs is None:
            return ""
        problem = (
            compat.layout_problem(mine, theirs)
            if theirs.mem_type in ("DRAM", "VRAM")
            else f"memory type {theirs.mem_type!r}"
        )
        if problem:
            return (
                f"{info.engine_id} rank {info.rank} is incompatible: {problem} (KV layout "
                f"{theirs.compat} with {len(theirs.regions)} regions, this engine's "
                f"{mine.compat} with {len(mine.regions)})"
            )[:MAX_TEXT_LEN]
        own = max((r.num_blocks for r in mine.regions), default=0)
        limit = max(own * self.s.max_peer_blocks_ratio, self.s.min_peer_blocks_limit)
        most = max((r.num_blocks for r in theirs.regions), default=0)
        if most > limit:
            return (
                f"{info.engine_id} rank {info.rank}: a KV cache of {most} blocks, over "
                f"{limit} ({self.s.max_peer_blocks_ratio}x this engine's {own})"
            )
        return ""

    def _prune_peers(self) -> list[Action]:
        """Forget the least recently used peers over ``max_peers`` that no transfer uses."""
        out: list[Action] = []
        if len(self._peers) <= self.s.max_peers:
            return out
        in_use = {o.peer for o in self._out.values()}
        for key in list(self._peers)[:-1]:  # never the one just met
            if len(self._peers) <= self.s.max_peers:
                break
            info = self._peers[key]
            if info.agent_name in in_use:
                continue
            del self._peers[key]
            self._agents.pop(info.agent_name, None)
            self._forget_agent(info.agent_name)
            out.append(DropPeer(info.agent_name))
        # Replaced incarnations of a rank still met are kept: forgetting them would let a
        # late message of a dead process pass for a restart.
        for key in list(self._retired):
            if len(self._retired) <= self.s.max_peers:
                break
            if key not in self._peers:
                del self._retired[key]
        return out

    def _tombstone(self, tid: str, now: float, origin: str) -> None:
        """Remember that ``origin`` ("": this engine) cancelled ``tid``; one origin's cancel
        never replaces another's (at most a few origins are kept per id)."""
        self._tombstones.add(tid, origin, now + self.s.tombstone_s)

    def _tombstoned(self, tid: str, origin: str) -> bool:
        """A cancel or abort stands for ``tid``: this engine's own, or that of ``origin``
        (or of anyone while the transfer has no owner yet)."""
        tomb = self._tombstones.get(tid)
        return tomb is not None and ("" in tomb or not origin or origin in tomb)

    @staticmethod
    def _retired_note(info: PeerInfo) -> Note:
        # Fenced like a stale generation: it is about a process that no longer exists.
        return Note(
            NoteKind.FENCED,
            "stale_generation",
            f"{info.engine_id} rank {info.rank} incarnation {info.incarnation} was replaced",
        )

    @staticmethod
    def _startable(o: _Out) -> bool:
        """Registered, its blocks ready, and its end not decided: a push given up before any
        chunk went out (its fallback waits for the forward's end) is not started again by a
        heartbeat or a connection made since, or P would WRITE after telling D to pull."""
        return (
            o.machine.state is S.REGISTERED
            and o.blocks is not None
            and o.reg is not None
            and o.drain_then is AfterDrain.NOTHING
        )

    def _maybe_start(self, o: _Out, now: float) -> list[Action]:
        if not self._startable(o):
            return []
        reg = o.reg
        assert reg is not None
        problem = self._check(o, reg)
        if problem:
            self._fire(o, E.FAIL, now)
            return [
                Note(NoteKind.REJECTED, RejectReason.BAD_BLOCKS, problem),
                self._failed(o, "bad_blocks", problem),
                *self._close(o, Outcome.FAILED),
            ]
        assert o.permit is not None
        if not o.permit.usable(now):
            # Not usable as last heard; D's renewals may be queued behind its REGISTER (this
            # engine was paused, or a pass ran out of budget before reading them). A
            # heartbeat that renews it starts the push; tick ends it once the permit is over.
            return []
        if o.peer in self._connecting:
            # P's connection to D is still being made (off the pump): held like a permit
            # not usable yet; D's heartbeats renew the permit meanwhile, ``on_peer`` starts it.
            return []
        if o.peer in self._unreachable:
            again = self._retry_connect(o, now)
            if again:
                return again  # ``on_peer`` starts it, or gives it up
            return self._give_up(
                o, ErrorClass.FALLBACK, f"connect_failed: {self._unreachable[o.peer]}", now
            )
        if (
            o.partial
            and self.s.fallback
            and self.breakers[o.peer].state(now) is not BreakerState.CLOSED
        ):
            return []  # a pull reads whole blocks: decided once the forward ended
        if self.s.fallback and not self.breakers.allow(o.peer, now):
            # Repeated failures to this D: straight to pull until a probe push succeeds.
            return [
                Note(NoteKind.FALLBACK, "breaker_open", o.peer),
                *self._fallback(o, now, "breaker_open"),
            ]
        assert o.units is not None
        unit_bytes, ids = self._unit_bytes(o.units), len(o.units.dst)
        o.groups, sizes = self._groups(o.units, ids) if o.parts == 1 else ((), ())
        self.sched.add(
            o.tid,
            o.peer,
            max(1, unit_bytes // o.parts),
            ids,
            o.permit.expires_at,
            now,
            len(sizes) or o.parts,
            o.ready if o.partial else None,
            part_bytes=sizes,
            whole=o.parts == 1,
        )
        o.queued, o.ready_at = True, now
        return self.poll(now)

    @staticmethod
    def _awaits_permit(o: _Out) -> bool:
        """Registered and its blocks ready, not queued: its permit was not usable when it
        could have started (a renewal may still come)."""
        return (
            o.machine.state is S.REGISTERED
            and o.blocks is not None
            and o.reg is not None
            and not o.queued
            and not o.inflight
        )

    def _check(self, o: _Out, reg: Register) -> str:
        """Why ``reg`` cannot be pushed into ("" if it can; then ``o.units`` is the plan)."""
        blocks = o.blocks or []
        o.units = None
        info = self._peers.get((o.owner, peer_slot(reg.sender.engine_id, reg.sender.rank)))
        if info is None or info.agent_name != o.peer or not o.peer:
            return (
                f"REGISTER of {reg.transfer_id}: no connected decode agent for "
                f"{reg.sender.engine_id} rank {reg.sender.rank}"
            )
        layout = info.layout  # what P connected to, not what the message says
        mine = self.me.layout
        if reg.first_block < 0:
            return (
                f"REGISTER of {reg.transfer_id} has {len(reg.block_ids)} blocks from block "
                f"{reg.first_block}, but the prompt fills {len(blocks)} blocks here"
            )
        plan = blocksize.push_units(
            mine, layout, blocks, list(reg.block_ids), reg.first_block, reg.num_tokens
        )
        if isinstance(plan, str):
            return f"REGISTER of {reg.transfer_id} has {plan}"
        what = f"units of {plan.unit_tokens} tokens" if plan.unit_tokens else "blocks"
        limit = blocksize.unit_limit(layout, plan.unit_tokens) if layout else 0
        bad = [b for b in plan.dst if b < 0 or b >= limit]
        if bad:
            return f"block ids {bad[:5]} outside the decode KV cache of {limit} {what}"
        o.units = plan
        return ""

    def _groups(self, units: blocksize.Units, ids: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A whole push of ``ids`` ids cut by regions (``SenderSettings.chunk_by_regions``):
        the region bounds of its parts and one id's bytes in each part; ((), ()) when it is
        one chunk (or one region). Sized from this rank's regions, scaled to its block."""
        lens = [r.block_len for r in self.me.layout.regions] if self.me.layout else []
        total = sum(lens)
        if not self.s.chunk_by_regions or total < 1:
            return (), ()
        unit_bytes = self._unit_bytes(units)
        # Each region's bytes per id, in the scheduler's terms (this rank's block).
        per_id = [unit_bytes * n / total for n in lens]
        bounds = chunking.region_groups(per_id, ids, self.s.scheduler.chunk_bytes)
        if len(bounds) <= 2:
            return (), ()
        return bounds, chunking.group_bytes(per_id, bounds)

    def _unit_bytes(self, units: blocksize.Units) -> int:
        """Bytes of one id of ``units`` on this rank (a block, or a unit of one)."""
        return self.s.block_bytes // blocksize.per_block(self.me.layout, units.unit_tokens)

    def _after_drain(self, o: _Out, now: float) -> list[Action]:
        if o.inflight:
            return []
        if o.drain_then is AfterDrain.NOTHING:
            return self._maybe_release(o)
        if o.drain_then is AfterDrain.FALLBACK and o.partial:
            return []  # D would READ layers not computed yet: the forward's end resumes it
        then, o.drain_then = o.drain_then, AfterDrain.NOTHING
        if then is AfterDrain.ACK and o.reg is not None:
            ack = CancelAck(PROTOCOL_VERSION, o.tid, o.reg.generation, self.slim)
            return [
                SendMessage(o.reg.sender.control, ack, o.owner),
                *self._close(o, Outcome.CANCELLED),
            ]
        if o.outcome or then is AfterDrain.DROPPED:
            # Ended meanwhile (D gave the transfer up while the push drained): nothing is
            # owed to D any more; free, as it ended.
            return self._close(o, Outcome.FAILED)
        if then is AfterDrain.FALLBACK:
            out: list[Action] = [
                Note(NoteKind.FALLBACK, o.reason.split(":")[0] or "push_failed", o.reason)
            ]
            return out + self._fallback(o, now, o.reason)
        assert o.reg is not None
        failed = then is AfterDrain.FAILED
        self._fire(o, E.FAIL if failed else E.EXPIRE, now)
        return [
            self._failed(o, o.reason or then.value, "the push could not complete"),
            *self._close(o, Outcome.FAILED if failed else Outcome.EXPIRED),
        ]

    def _fallback(self, o: _Out, now: float, reason: str) -> list[Action]:
        assert o.reg is not None and o.blocks is not None and o.units is not None
        self._fire(o, E.FALLBACK, now)
        o.pull_until = now + self.s.pull_permit_s
        reg = o.reg
        # In units when the block sizes differ: D converts its own blocks alike.
        msg = Fallback(
            PROTOCOL_VERSION,
            o.tid,
            reg.generation,
            self.me,
            list(o.units.src),
            o.units.first,
            reason,
            int(self.s.pull_permit_s * 1000),
            prompt=o.prompt,
        )
        return [SendMessage(reg.sender.control, msg, o.owner)]

    def _close(self, o: _Out, outcome: Outcome) -> list[Action]:
        o.outcome = o.outcome or outcome
        if o.queued:
            self.sched.cancel(o.tid)
            o.queued = False
        return self._maybe_release(o)

    def _maybe_release(self, o: _Out) -> list[Action]:
        if not o.outcome or o.inflight:
            return []
        if o.blocks is None:
            self._uncount(o)
            self._out.pop(o.tid, None)  # a registration only: nothing to free
            return []
        if not o.held or o.released:
            return []
        o.released = True
        self._uncount(o)
        self._out.pop(o.tid, None)
        nbytes = o.pushed_bytes if o.outcome in (Outcome.PUSHED, Outcome.RETRIED) else 0
        return [ReleaseSend(o.tid, o.outcome, nbytes)]

    def _failed(self, o: _Out, reason: str, detail: str) -> SendMessage:
        assert o.reg is not None
        return self._fail(o.reg, o.owner, reason, detail[:1000])

    def _fail(self, reg: Register, origin: str, reason: str, detail: str) -> SendMessage:
        """FAILED to the D of ``reg`` (``origin``): the transfer it registered ends."""
        return SendMessage(
            reg.sender.control,
            Failed(PROTOCOL_VERSION, reg.transfer_id, reg.generation, self.slim, reason, detail),
            origin,
        )

    def _heartbeats(self, now: float) -> list[Action]:
        """Tell each D which of its transfers we still hold (it renews their permits)."""
        per_peer: dict[tuple[str, str], tuple[int, list[tuple[str, int]]]] = {}
        for o in self._out.values():
            if o.outcome:
                continue
            for origin, (creg, _, at) in o.contenders.items():
                # Kept for the prefill leg to name: their decode engines renew them too,
                # for as long as a registrant's would be.
                if o.expected or now - at <= self.s.register_grace_s:
                    _, live = per_peer.setdefault(
                        (creg.sender.control, origin), (creg.sender.incarnation, [])
                    )
                    live.append((o.tid, creg.generation))
            if o.reg is None:
                continue
            if (
                o.machine.state is S.WAITING_BLOCKS
                and not o.expected
                and now - o.reg_at > self.s.register_grace_s
            ):
                continue  # the request never reached us: let D's permit run out
            dest = (o.reg.sender.control, o.owner)
            _, live = per_peer.setdefault(dest, (o.reg.sender.incarnation, []))
            live.append((o.tid, o.reg.generation))
        out: list[Action] = []
        for (addr, owner), (inc, live) in per_peer.items():
            # Small enough for D's codec (core.quotas): a long list goes as several.
            for batch in live_batches(live):
                out.append(
                    SendMessage(addr, Heartbeat(PROTOCOL_VERSION, self.slim, inc, batch), owner)
                )
        return out
