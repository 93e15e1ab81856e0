"""The decode side (D) of one worker rank: grant P write permits on reserved blocks, renew
them while P is alive, wait for DONE, pull on FALLBACK, and release blocks only when fenced.

Sans-IO: events in (with ``now``), actions out. A block is handed back to vLLM only after
P acknowledged (DONE, Failed, CancelAck, FALLBACK) or the permit expired plus the skew margin.

Trust: each transfer has an owner, the prefill identity the router named (its public key;
without keys, its control address). Only messages whose authenticated ``origin`` is the owner
change the transfer, and a generation is unguessable, so DONE names a grant only its holder
knows.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvpush_prod.core import blocksize, compat
from kvpush_prod.core.actions import (
    Action,
    ConnectPeer,
    Note,
    PostRead,
    ReportFailed,
    ReportFinished,
    SendMessage,
)
from kvpush_prod.core.identity import owns_agent, peer_slot
from kvpush_prod.core.incarnations import RetiredIncarnations
from kvpush_prod.core.leases import LeaseCheck, LeaseSettings, LeaseTable, Permit, RandomBits
from kvpush_prod.core.messages import (
    MAX_TEXT_LEN,
    PROTOCOL_VERSION,
    Cancel,
    CancelAck,
    ControlMessage,
    Done,
    DoneQuery,
    DoneState,
    DoneStateName,
    Failed,
    Fallback,
    Heartbeat,
    PeerInfo,
    PullDone,
    Register,
)
from kvpush_prod.core.quotas import live_batches
from kvpush_prod.core.retry import (
    BudgetSettings,
    ChunkError,
    ErrorClass,
    RandomLike,
    RetryBudget,
    RetryPolicy,
    RetrySettings,
    decide_next,
)
from kvpush_prod.core.scheduler import Chunk, ChunkScheduler, SchedulerSettings
from kvpush_prod.core.transfer import TransferEvent as E
from kvpush_prod.core.transfer import TransferMachine, TransferState, TransferTimeouts
from kvpush_prod.core.vocabulary import NoteKind, Outcome, RejectReason

S = TransferState


@dataclass(frozen=True, slots=True)
class ReceiverSettings:
    """The numbers D's protocol runs on (defaults: the configuration's; the shell maps the
    configuration onto them in ``config.core``)."""

    block_bytes: int
    permit_ttl_s: float = 5.0
    skew_margin_s: float = 1.0
    stop_margin_s: float = 1.0  # for D's own READs under P's read permit
    heartbeat_s: float = 1.0
    peer_timeout_s: float = 3.0  # P unheard this long: stop renewing its permits
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    retry: RetrySettings = field(default_factory=RetrySettings)
    budget: BudgetSettings = field(default_factory=BudgetSettings)
    timeouts: TransferTimeouts = field(default_factory=TransferTimeouts)
    max_peers: int = 1024  # prefill ranks remembered (least recently heard forgotten first)
    # Transfers whose DONE arrived, remembered to answer a DoneQuery and to ignore a second
    # DONE of the same generation (oldest forgotten first).
    max_done_log: int = 65_536
    # The shell connects to a P (ConnectPeer) off its own thread and says when the connection
    # is ready (``on_peer``): a pull's READs wait for that. False: they are scheduled at
    # once (a shell, or a test, that connects before it carries out the next action).
    await_connect: bool = False


@dataclass(eq=False)
class _Receive:
    tid: str
    machine: TransferMachine
    address: str  # P's control endpoint
    blocks: list[int]
    generation: int
    registered_at: float
    listed_at: float  # last time P said it still holds this transfer
    # The P process that holds this transfer, once a message of it named the transfer with
    # our generation (so it got our REGISTER); None until then.
    p_incarnation: int | None
    owner: str = ""  # the prefill identity this transfer belongs to
    p_rank: int = -1  # the rank slot of that P process (identity.peer_slot)
    cancelling: bool = False
    renew: bool = True
    fallback: Fallback | None = None
    read_permit: Permit | None = None
    reads: set[int] = field(default_factory=set)
    read_failed: str = ""  # set once the pull is given up
    checksum: int = -1
    # DONEs of last-chunk posts below this attempt are void: D told P (DoneState pending)
    # they had not arrived, so P posts the last chunk again.
    void_below: int = 0
    # A pull: ``blocks`` as the ids the FALLBACK's pair with (units when P's block size
    # differs, core.blocksize), and the bytes of one of them on this rank.
    pull: list[int] = field(default_factory=list)
    pull_bytes: int = 0
    pull_per_block: int = 0  # units per block of ours in ``pull`` (0: whole blocks)
    connecting: bool = False  # a pull waits for D's connection to P's agent (on_peer)
    prompt: bytes = b""  # digest of this request's prompt token ids (core.digest)


@dataclass
class _Peer:
    last_heard: float = -1e18
    incarnation: int | None = None
    agent: str = ""  # NIXL agent of ``incarnation``
    # earlier processes at this address (their late messages are dropped)
    retired: RetiredIncarnations = field(default_factory=RetiredIncarnations)


class Receiver:
    """D side of one rank."""

    def __init__(
        self,
        me: PeerInfo,
        settings: ReceiverSettings,
        rng: RandomLike,
        tokens: RandomBits | None = None,
    ) -> None:
        """``tokens`` draws the random low bits of generations (a CSPRNG in the shells); without
        it generations only count up (tests that want to read them)."""
        self.me = me
        self.slim = PeerInfo(me.engine_id, me.incarnation, me.rank, me.control, me.agent_name)
        self.s = settings
        self.leases: LeaseTable[str] = LeaseTable(
            LeaseSettings(
                skew_margin_s=settings.skew_margin_s, random_bits=32 if tokens is not None else 0
            ),
            tokens,
        )
        self.reads = ChunkScheduler(settings.scheduler)
        self.policy = RetryPolicy.from_settings(settings.retry, rng)
        self.budget = RetryBudget(settings.budget)
        self._in: dict[str, _Receive] = {}
        # transfer waiting for credit -> (P address, P identity)
        self._waiting: dict[str, tuple[str, str]] = {}
        # P rank (origin, rank) -> liveness and incarnation, least recently heard first
        self._peers: OrderedDict[tuple[str, int], _Peer] = OrderedDict()
        self._heard: OrderedDict[str, float] = OrderedDict()  # origin -> last heard
        self._chunks: dict[int, tuple[Chunk, str]] = {}
        self._next_heartbeat = 0.0
        # transfer -> (generation, owner) of the receives that ended with their DONE
        self._done_log: OrderedDict[str, tuple[int, str]] = OrderedDict()

    # ------------------------------------------------------------------ introspection
    @property
    def active(self) -> int:
        return len(self._in)

    def tables(self) -> dict[str, tuple[int, int | None]]:
        """Entries of every table D's rank keeps (receives, peers, the DONE log, permits,
        its READ scheduler's and retry budget's), each with its bound (None: none)."""
        s = self.s
        return {
            "receiver.transfers": (len(self._in), None),
            "receiver.waiting": (len(self._waiting), None),
            "receiver.peers": (len(self._peers), s.max_peers),
            "receiver.heard": (len(self._heard), s.max_peers),
            "receiver.chunks": (len(self._chunks), None),
            "receiver.done_log": (len(self._done_log), s.max_done_log),
            "receiver.retry_budgets": (len(self.budget), None),
            **self.leases.tables("receiver.permits"),
            **self.reads.tables("pull"),
        }

    @property
    def busy(self) -> bool:
        return bool(self._chunks) or self.reads.queued > 0

    def reserved_blocks(self) -> int:
        return sum(len(i.blocks) for i in self._in.values())

    def blocks_of(self, tid: str) -> list[int] | None:
        rx = self._in.get(tid)
        return None if rx is None else rx.blocks

    def live_permits(self) -> int:
        return sum(1 for i in self._in.values() if i.fallback is None)

    # ------------------------------------------------------------------ engine events
    def await_admission(self, tid: str, address: str, owner: str = "") -> list[Action]:
        """D has no credit for ``tid`` yet: ask P (in heartbeats) to keep its blocks."""
        self._waiting[tid] = (address, owner or address)
        return []

    def admission_over(self, tid: str) -> list[Action]:
        self._waiting.pop(tid, None)
        return []

    def register(
        self,
        tid: str,
        address: str,
        blocks: list[int],
        first_block: int,
        num_tokens: int,
        now: float,
        owner: str = "",
        prompt: bytes = b"",
    ) -> list[Action]:
        """D reserved ``blocks`` for ``tid``: grant the prefill engine ``owner`` at ``address``
        a write permit on them (``owner`` "": the address stands in for it, no keys).
        ``prompt``: the digest of the request's token ids; KV stated for another prompt is
        refused."""
        self._waiting.pop(tid, None)
        if tid in self._in:
            return [
                Note(
                    NoteKind.REJECTED,
                    RejectReason.DUPLICATE,
                    f"transfer {tid} is already being received",
                )
            ]
        lease = self.leases.grant(tid, now, self.s.permit_ttl_s)
        # Not the incarnation last heard at ``address``: P may have restarted since, and the
        # new process is the one that gets this REGISTER.
        rx = _Receive(
            tid,
            TransferMachine(tid, now, self.s.timeouts),
            address,
            list(blocks),
            lease.generation,
            now,
            now,
            None,
            owner or address,
            prompt=prompt,
        )
        rx.machine.fire(E.REGISTER, now)
        rx.machine.fire(E.BLOCKS_READY, now)
        self._in[tid] = rx
        reg = Register(
            PROTOCOL_VERSION,
            tid,
            self.me,
            list(blocks),
            first_block,
            num_tokens,
            lease.generation,
            int(self.s.permit_ttl_s * 1000),
        )
        return [SendMessage(address, reg, rx.owner)]

    def not_needed(self, tid: str, address: str, owner: str = "") -> list[Action]:
        """D will not receive ``tid`` (it computes locally): P may free its blocks now."""
        self._waiting.pop(tid, None)
        return [
            SendMessage(
                address, Cancel(PROTOCOL_VERSION, tid, 0, self.slim, "not_needed"), owner or address
            )
        ]

    def abort(self, tid: str, now: float) -> list[Action]:
        """D's request was aborted while receiving: stop P; free only once fenced."""
        rx = self._in.get(tid)
        if rx is None or rx.cancelling:
            return []
        rx.cancelling, rx.renew = True, False
        if rx.fallback is not None:
            self.reads.cancel(tid)
            return self._finish_pull(rx, now)
        return [
            SendMessage(
                rx.address,
                Cancel(PROTOCOL_VERSION, tid, rx.generation, self.slim, "aborted"),
                rx.owner,
            )
        ]

    # ------------------------------------------------------------------ network events
    def on_done(
        self, done: Done, now: float, verified: bool = True, agent: str = ""
    ) -> list[Action]:
        """The DONE notification of a last WRITE, from NIXL agent ``agent`` ("" unknown)."""
        rx = self._in.get(done.transfer_id)
        if rx is None:
            return [self._done_of_unknown(done)]
        refusal = self._done_refusal(done, rx, agent)
        if refusal is not None:
            return [refusal]
        self.leases.ack(rx.tid, rx.generation)  # the last WRITE landed: P is done with them
        if rx.cancelling:
            return self._end(rx, now, ReportFinished(rx.tid, Outcome.ABORTED))
        if not verified:
            return self._end(
                rx,
                now,
                ReportFailed(rx.tid, "checksum_mismatch", "the pushed blocks differ from P's"),
            )
        if self._other_prompt(rx, done.prompt):
            # The KV is another prompt's (a replayed or re-bound leg): never usable here.
            return [
                Note(
                    NoteKind.REJECTED,
                    RejectReason.PROMPT_MISMATCH,
                    f"DONE {rx.tid}: the prefill computed its KV for another prompt",
                ),
                *self._end(
                    rx,
                    now,
                    ReportFailed(rx.tid, "prompt_mismatch", "the KV pushed is another prompt's"),
                ),
            ]
        rx.machine.fire(E.DONE, now)
        self._log_done(rx)
        out = self._end(rx, now, ReportFinished(rx.tid, Outcome.PUSHED))
        if done.v < PROTOCOL_VERSION:
            # A DONE travels as a NIXL notification: an older P may push to D without any
            # control message of its version reaching D, so its DONE says it.
            out.append(Note(NoteKind.OLDER_PREFILL, rx.owner, rx.address, float(done.v)))
        return out

    def _done_of_unknown(self, done: Done) -> Note:
        """A DONE for a transfer D does not receive: a duplicate of one delivered, or unknown."""
        logged = self._done_log.get(done.transfer_id)
        if logged is not None and logged[0] == done.generation:
            # A DONE is delivered once: a second one of the same generation (a re-post
            # whose first post landed after all) changes nothing.
            return Note(
                NoteKind.FENCED,
                "duplicate_done",
                f"DONE {done.transfer_id} gen {done.generation} again",
            )
        return Note(
            NoteKind.REJECTED, RejectReason.UNKNOWN_TRANSFER, f"DONE for {done.transfer_id}"
        )

    def _done_refusal(self, done: Done, rx: _Receive, agent: str) -> Note | None:
        """Why ``done`` (from NIXL agent ``agent``) does not end ``rx`` (None: it does): an
        agent not its prefill's, another generation, a pull under way, or a void post."""
        expected = self._owner_agent(rx)
        if agent and (not owns_agent(rx.owner, agent) or (expected and agent != expected)):
            return Note(
                NoteKind.REJECTED,
                RejectReason.NOT_OWNER,
                f"DONE {done.transfer_id} from agent {agent[:64]}, not its prefill's",
            )
        if done.generation != rx.generation or rx.fallback is not None:
            return Note(
                NoteKind.FENCED,
                "stale_generation",
                f"DONE {done.transfer_id} gen {done.generation}, expected {rx.generation}",
            )
        if done.attempt < rx.void_below:
            # D told P this post's DONE had not arrived; P re-posts the last chunk, and only
            # that post's DONE (after its bytes) ends the receive.
            return Note(
                NoteKind.FENCED,
                "void_attempt",
                f"DONE {done.transfer_id} attempt {done.attempt}, void below {rx.void_below}",
            )
        return None

    def _log_done(self, rx: _Receive) -> None:
        self._done_log[rx.tid] = (rx.generation, rx.owner)
        self._done_log.move_to_end(rx.tid)
        while len(self._done_log) > self.s.max_done_log:
            self._done_log.popitem(last=False)

    def on_message(
        self, msg: ControlMessage, now: float, age: float = 0.0, origin: str = ""
    ) -> list[Action]:
        """A control message from P: ``Heartbeat``, ``Failed``, ``CancelAck``, ``Fallback`` or
        ``DoneQuery`` (any other is rejected). ``origin``: the authenticated sender ("" when
        the channel has no keys: then the control address the message claims stands in)."""
        origin = origin or msg.sender.control
        if isinstance(msg, Heartbeat):
            return self._on_heartbeat(msg, now, origin)
        if not isinstance(msg, (Failed, CancelAck, Fallback, DoneQuery)):
            return [
                Note(
                    NoteKind.REJECTED,
                    RejectReason.UNEXPECTED,
                    f"{type(msg).__name__} is not for a decode engine",
                )
            ]
        out = self._note_peer(msg.sender, origin, now)
        if out is None:
            return [self._retired_note(msg.sender)]
        rx = self._in.get(msg.transfer_id)
        if rx is None and isinstance(msg, DoneQuery):
            return out + self._on_done_query_ended(msg, origin)
        refusal = self._message_refusal(msg, rx, origin)
        if refusal is not None:
            return [*out, refusal]
        assert rx is not None
        if isinstance(msg, DoneQuery):
            # Not arrived (or D no longer takes pushes: cancelling, pulling). From now on
            # the DONE of that post, or of an earlier one, is void: it may still land, late,
            # after P's re-post, and must not end the receive under the re-post's bytes.
            rx.void_below = max(rx.void_below, msg.attempt + 1)
            return [*out, self._done_state(rx.address, msg, origin, "pending")]
        if isinstance(msg, Fallback):
            return out + self._on_fallback(rx, msg, now, age)
        return out + self._on_push_ended(rx, msg, now)

    @staticmethod
    def _message_refusal(
        msg: Failed | CancelAck | Fallback | DoneQuery, rx: _Receive | None, origin: str
    ) -> Note | None:
        """Why ``msg`` from ``origin`` is not for ``rx`` (None: it is): an unknown transfer,
        an origin that does not own it, or another generation."""
        what = type(msg).__name__
        if rx is None:
            return Note(
                NoteKind.REJECTED,
                RejectReason.UNKNOWN_TRANSFER,
                f"{what} for unknown transfer {msg.transfer_id}",
            )
        if rx.owner != origin:
            return Note(
                NoteKind.REJECTED,
                RejectReason.NOT_OWNER,
                f"{what} {msg.transfer_id} from an engine that does not own it",
            )
        if msg.generation != rx.generation:
            return Note(
                NoteKind.FENCED,
                "stale_generation",
                f"{what} {msg.transfer_id} gen {msg.generation}, expected {rx.generation}",
            )
        return None

    def _on_push_ended(self, rx: _Receive, msg: Failed | CancelAck, now: float) -> list[Action]:
        """P says no WRITE of ``rx`` is or will be in flight (Failed, CancelAck): the receive
        ends (a pull under way is not P's to end)."""
        if rx.fallback is not None:
            return [
                Note(
                    NoteKind.REJECTED,
                    RejectReason.UNEXPECTED,
                    f"{type(msg).__name__} while pulling",
                )
            ]
        self.leases.ack(rx.tid, rx.generation)
        if rx.cancelling:
            return self._end(rx, now, ReportFinished(rx.tid, Outcome.ABORTED))
        if isinstance(msg, Failed):
            rx.machine.fire(E.FAIL, now)
            return self._end(rx, now, ReportFailed(rx.tid, msg.reason, msg.detail))
        return self._end(rx, now, ReportFailed(rx.tid, "cancelled_by_peer"))

    def _on_done_query_ended(self, q: DoneQuery, origin: str) -> list[Action]:
        """A DoneQuery about a transfer D no longer receives: its DONE arrived (if the log
        says so, for that generation and owner) or the receive ended otherwise."""
        logged = self._done_log.get(q.transfer_id)
        if logged is not None and logged[1] != origin:
            return [
                Note(
                    NoteKind.REJECTED,
                    RejectReason.NOT_OWNER,
                    f"DoneQuery {q.transfer_id} from an engine that does not own it",
                )
            ]
        if logged is not None and logged[0] == q.generation:
            return [self._done_state(q.sender.control, q, origin, "done")]
        # Unknown here (never, or long ago): the answer goes only to the asker's channel.
        return [self._done_state(q.sender.control, q, origin, "gone")]

    def _done_state(
        self, address: str, q: DoneQuery, origin: str, state: DoneStateName
    ) -> SendMessage:
        return SendMessage(
            address,
            DoneState(PROTOCOL_VERSION, q.transfer_id, q.generation, self.slim, q.attempt, state),
            origin,
        )

    def _on_heartbeat(self, hb: Heartbeat, now: float, origin: str) -> list[Action]:
        out = self._note_peer(hb.sender, origin, now)
        if out is None:
            return [self._retired_note(hb.sender)]
        for tid, gen in hb.live:
            rx = self._in.get(tid)
            if rx is not None and rx.owner == origin and gen == rx.generation:
                rx.listed_at = now
                rx.p_incarnation = hb.sender.incarnation
                rx.p_rank = peer_slot(hb.sender.engine_id, hb.sender.rank)
        return out

    def _note_peer(self, sender: PeerInfo, origin: str, now: float) -> list[Action] | None:
        """Track P's liveness; a new incarnation of a rank means that P rank restarted.

        Keyed by the authenticated ``origin`` and the rank: only P's own key can announce
        its restart. None: the sender is a process already replaced (a message it sent
        before dying, delivered late): the caller drops the message.
        """
        slot = peer_slot(sender.engine_id, sender.rank)
        key = (origin, slot)
        peer = self._peers.get(key)
        if peer is None:
            peer = self._peers[key] = _Peer()
        self._peers.move_to_end(key)
        if sender.incarnation in peer.retired:
            return None
        peer.last_heard = now
        self._heard[origin] = now
        self._heard.move_to_end(origin)
        if peer.incarnation == sender.incarnation:
            return self._prune_peers()
        old, peer.incarnation, peer.agent = peer.incarnation, sender.incarnation, sender.agent_name
        if old is not None:
            peer.retired.add(old)
        out: list[Action] = []
        for rx in list(self._in.values()):
            if rx.owner != origin or rx.p_incarnation is None or rx.p_rank != slot:
                continue  # not known to be held by the old process: its permit decides
            if rx.p_incarnation != sender.incarnation and rx.fallback is None:
                # The process that had this transfer is gone (its port is taken by a new
                # one): nothing of it can still be written, and it will never finish.
                self.leases.ack(rx.tid, rx.generation)
                rx.machine.fire(E.FAIL, now)
                if rx.cancelling:
                    out += self._end(rx, now, ReportFinished(rx.tid, Outcome.ABORTED))
                else:
                    out += self._end(
                        rx,
                        now,
                        ReportFailed(
                            rx.tid, "peer_restarted", f"prefill {sender.control} restarted"
                        ),
                    )
        if old is not None:
            out.append(
                Note(NoteKind.PEER_RESTART, "prefill", f"{sender.control} -> {sender.incarnation}")
            )
        return out + self._prune_peers()

    def _prune_peers(self) -> list[Action]:
        """Forget the least recently heard P ranks over ``max_peers``, never one a live
        transfer belongs to (its replaced incarnations must stay known: a late message of a
        dead process must not pass for a restart)."""
        if len(self._peers) > self.s.max_peers:
            in_use = {(i.owner, i.p_rank) for i in self._in.values()}
            for key in list(self._peers)[:-1]:  # never the one just heard
                if len(self._peers) <= self.s.max_peers:
                    break
                if key not in in_use:
                    del self._peers[key]
        if len(self._heard) > self.s.max_peers:
            owners = {i.owner for i in self._in.values()}
            for origin in list(self._heard)[:-1]:
                if len(self._heard) <= self.s.max_peers:
                    break
                if origin not in owners:
                    del self._heard[origin]
        return []

    def _owner_agent(self, rx: _Receive) -> str:
        """The NIXL agent of the P process known to hold ``rx`` ("" if not known yet)."""
        if rx.p_incarnation is None:
            return ""
        peer = self._peers.get((rx.owner, rx.p_rank))
        if peer is None or peer.incarnation != rx.p_incarnation:
            return ""
        return peer.agent

    @staticmethod
    def _retired_note(sender: PeerInfo) -> Note:
        # Fenced like a stale generation: it is about a process that no longer exists.
        return Note(
            NoteKind.FENCED,
            "stale_generation",
            f"{sender.control} incarnation {sender.incarnation} was replaced",
        )

    def _on_fallback(self, rx: _Receive, msg: Fallback, now: float, age: float) -> list[Action]:
        if rx.fallback is not None:
            return []  # duplicate
        # P drained its WRITEs before sending FALLBACK: the write permit is over.
        self.leases.ack(rx.tid, rx.generation)
        if rx.cancelling:
            ack = PullDone(PROTOCOL_VERSION, rx.tid, rx.generation, self.slim, False)
            return [
                SendMessage(rx.address, ack, rx.owner),
                *self._end(rx, now, ReportFinished(rx.tid, Outcome.ABORTED)),
            ]
        if self._other_prompt(rx, msg.prompt):
            rx.fallback = msg
            rx.read_failed = "prompt_mismatch"
            return [
                Note(
                    NoteKind.REJECTED,
                    RejectReason.PROMPT_MISMATCH,
                    f"FALLBACK {rx.tid}: the prefill holds the KV of another prompt",
                ),
                *self._finish_pull(rx, now),
            ]
        problem = self._fallback_problem(rx, msg)
        if problem:
            rx.fallback = msg
            rx.read_failed = "bad_fallback"
            return [
                Note(NoteKind.REJECTED, RejectReason.BAD_BLOCKS, f"FALLBACK {rx.tid}: {problem}"),
                *self._finish_pull(rx, now),
            ]
        rx.machine.fire(E.FALLBACK, now)
        rx.fallback, rx.renew, rx.checksum = msg, False, msg.checksum
        rx.read_permit = Permit.from_ttl(
            rx.tid, rx.generation, msg.permit_ttl_ms / 1000.0, now - age, self.s.stop_margin_s
        )
        out: list[Action] = [
            ConnectPeer(msg.sender),
            Note(NoteKind.FALLBACK, msg.reason.split(":")[0] or "push_failed", msg.reason),
        ]
        if self.s.await_connect:
            rx.connecting = True  # ``on_peer`` schedules its READs
            return out
        return out + self._schedule_reads(rx, now)

    def _schedule_reads(self, rx: _Receive, now: float) -> list[Action]:
        assert rx.fallback is not None and rx.read_permit is not None
        rx.connecting = False
        self.reads.add(
            rx.tid,
            rx.fallback.sender.agent_name,
            rx.pull_bytes,
            len(rx.pull),
            rx.read_permit.expires_at,
            now,
        )
        return self.poll(now)

    @staticmethod
    def _other_prompt(rx: _Receive, stated: bytes) -> bool:
        """P states KV for a prompt other than this request's (a P that states none, when
        this request has a digest, is not believed either)."""
        return bool(rx.prompt) and stated != rx.prompt

    def _fallback_problem(self, rx: _Receive, msg: Fallback) -> str:
        """Why D cannot READ what ``msg`` offers ("" if it can): P's layout must be ours, and
        the agent its own (not one D met for another prefill engine)."""
        if msg.permit_ttl_ms <= 0:
            return f"a read permit of {msg.permit_ttl_ms} ms"
        agent = msg.sender.agent_name
        if not owns_agent(rx.owner, agent):
            return f"agent {agent[:64]!r} is not named for the prefill's key"
        mine, theirs = self.me.layout, msg.sender.layout
        if theirs is None:
            return "no layout to read from"
        if mine is not None:
            problem = compat.layout_problem(theirs, mine)
            if problem:
                return (
                    f"prefill KV layout {theirs.compat} is not this engine's "
                    f"{mine.compat}: {problem}"
                )
        # P's block size differs: both sides' ids are units of the smaller block size.
        pull = blocksize.pull_units(mine, theirs, rx.blocks, len(msg.block_ids))
        if isinstance(pull, str):
            return pull
        u = blocksize.unit_of(theirs, mine)
        limit = blocksize.unit_limit(theirs, u)
        if any(b >= limit for b in msg.block_ids):
            what = f"units of {u} tokens" if u else "blocks"
            return f"block ids outside the prefill KV cache of {limit} {what}"
        rx.pull = pull
        rx.pull_bytes = self.s.block_bytes // blocksize.per_block(mine, u)
        rx.pull_per_block = blocksize.per_block(mine, u) if u else 0
        return ""

    def on_peer(self, agent: str, problem: str, now: float) -> list[Action]:
        """The shell's connection to P's agent ``agent`` ended: ready (``problem`` "") or
        not. The pulls that waited for it post their READs, or fail (vLLM's
        kv_load_failure_policy applies). Without ``await_connect`` nothing waits on it (a
        READ to an agent that could not be connected fails as a chunk)."""
        out: list[Action] = []
        for rx in list(self._in.values()):
            if not rx.connecting or rx.fallback is None or rx.fallback.sender.agent_name != agent:
                continue
            if problem:
                out += self._fail_unconnected(rx, f"connect_failed: {problem}", now)
            else:
                out += self._schedule_reads(rx, now)
        return out

    def on_chunk(
        self, chunk_id: int, ok: bool, error: ChunkError | str, now: float
    ) -> list[Action]:
        """A READ posted during a fallback completed or failed."""
        rec = self._chunks.pop(chunk_id, None)
        if rec is None:
            return []
        chunk, tid = rec
        rx = self._in.get(tid)
        if rx is not None:
            rx.reads.discard(chunk_id)
        if ok:
            completed = self.reads.on_chunk_done(chunk_id, now)
            if rx is None:
                return []
            late = self._late_read(rx, now)
            if late is not None:
                self.reads.cancel(rx.tid)  # post no more of its READs
                return [late, *self._finish_pull(rx, now)]
            if completed:
                return self._finish_pull(rx, now)
            if rx.read_failed or rx.cancelling:
                return self._finish_pull(rx, now)
            return self.poll(now)
        if rx is None or rx.read_failed or rx.cancelling:
            self.reads.on_chunk_failed(chunk_id, now, give_up=True)
            return self._finish_pull(rx, now) if rx is not None else []
        decision = decide_next(error, chunk, now, self.policy, self.budget, chunk.link)
        if decision.action is ErrorClass.RETRY and decision.retry_at is not None:
            self.reads.on_chunk_failed(chunk_id, now, retry_at=decision.retry_at)
            return [Note(NoteKind.RETRY, decision.classification.kind, decision.reason)]
        self.reads.on_chunk_failed(chunk_id, now, give_up=True)
        rx.read_failed = decision.reason or "pull_failed"
        return self._finish_pull(rx, now)

    @staticmethod
    def _late_read(rx: _Receive, now: float) -> Note | None:
        """A READ that completed after P's read permit ran out: P may have freed and reused
        its blocks while the READ's bytes were still being sent (a slow or partitioned link
        holds them), so they may be another prompt's KV. The pull fails (vLLM's
        kv_load_failure_policy applies) rather than use them."""
        permit = rx.read_permit
        if permit is None or now <= permit.expires_at or rx.read_failed:
            return None
        rx.read_failed = "pull_permit_expired: a READ completed after the read permit"
        return Note(NoteKind.LEASE_EXPIRED, "pull", f"{rx.tid}: a READ completed late")

    def _fail_unconnected(self, rx: _Receive, reason: str, now: float) -> list[Action]:
        """A pull that waited for its connection to P's agent fails (``reason``) unread."""
        rx.connecting = False
        rx.read_failed = reason[:MAX_TEXT_LEN]
        return self._finish_pull(rx, now)

    @staticmethod
    def _connect_too_late(rx: _Receive, now: float) -> bool:
        """Whether a pull still waiting for its connection is past P's read permit (less
        the stop margin): it can no longer READ in time."""
        permit = rx.read_permit
        return permit is not None and not permit.usable(now) and not rx.read_failed

    # ------------------------------------------------------------------ time
    def poll(self, now: float) -> list[Action]:
        """READs the scheduler lets out now, and pulls whose read permit ran out (call often
        while ``busy``)."""
        out: list[Action] = []
        for chunk in self.reads.next_chunks(now):
            rx = self._in.get(chunk.transfer_id)
            if rx is None or rx.fallback is None:
                self.reads.on_chunk_failed(chunk.id, now, give_up=True)
                continue
            self._chunks[chunk.id] = (chunk, rx.tid)
            rx.reads.add(chunk.id)
            out.append(
                PostRead(
                    rx.tid,
                    rx.generation,
                    chunk.id,
                    rx.fallback.sender.agent_name,
                    tuple(rx.pull[chunk.start : chunk.end]),
                    tuple(rx.fallback.block_ids[chunk.start : chunk.end]),
                    chunk.nbytes,
                )
            )
        for tid in self.reads.take_expired():
            rx = self._in.get(tid)
            if rx is not None and not rx.read_failed:
                rx.read_failed = "pull_permit_expired"
                out.append(Note(NoteKind.LEASE_EXPIRED, "pull", tid))
                out += self._finish_pull(rx, now)
        return out

    def tick(self, now: float) -> list[Action]:
        """Permits, deadlines and heartbeats (call every few tens of ms)."""
        out = self.poll(now)
        for rx in list(self._in.values()):
            if rx.fallback is not None:
                if rx.machine.expired(now) and not rx.read_failed:
                    self.reads.cancel(rx.tid)
                    rx.read_failed = "timeout"
                    out += self._finish_pull(rx, now)
                elif rx.connecting and self._connect_too_late(rx, now):
                    out.append(Note(NoteKind.LEASE_EXPIRED, "pull", f"{rx.tid}: not connected"))
                    out += self._fail_unconnected(
                        rx, "pull_permit_expired: no connection to the prefill's agent in time", now
                    )
                continue
            if rx.machine.expired(now):
                rx.renew = False  # bounded: the permit now runs out and fences the blocks
            lease = self.leases.get(rx.tid)
            if lease is not None and now >= lease.expires_at and self.leases.reusable(rx.tid, now):
                # Past expiry plus the skew margin: P has stopped writing into these blocks.
                out.append(Note(NoteKind.LEASE_EXPIRED, "permit", rx.tid))
                if rx.cancelling:
                    out += self._end(rx, now, ReportFinished(rx.tid, Outcome.ABORTED))
                else:
                    rx.machine.fire(E.EXPIRE, now)
                    out += self._end(
                        rx,
                        now,
                        ReportFailed(rx.tid, "permit_expired", "no DONE before the permit ran out"),
                    )
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.s.heartbeat_s
            out += self._heartbeats(now)
            for key in self.leases.keys():  # noqa: SIM118 - a snapshot list, not a dict view
                if key not in self._in and self.leases.reusable(key, now):
                    self.leases.forget(key, now)
            self._forget_gone_agents()
        return out

    def _forget_gone_agents(self) -> None:
        """Drop the READ scheduler's link and the retry budget of P processes no longer
        known and no longer read from (each restart of a P rank is a new agent name)."""
        keep = {p.agent for p in self._peers.values() if p.agent}
        keep |= {rx.fallback.sender.agent_name for rx in self._in.values() if rx.fallback}
        self.reads.forget_idle_links(keep)
        self.budget.forget_except(keep | set(self.reads.links()))

    # ------------------------------------------------------------------ internals
    def _heartbeats(self, now: float) -> list[Action]:
        """Renew the permits of transfers whose P is alive and still holds them."""
        per_peer: dict[tuple[str, str], list[tuple[str, int]]] = {}
        slot_of: dict[tuple[str, str], int] = {}  # the P rank slot heard for that address
        for tid, dest in self._waiting.items():
            per_peer.setdefault(dest, []).append((tid, 0))
        for rx in self._in.values():
            if not rx.renew or rx.fallback is not None:
                continue
            heard = self._heard.get(rx.owner)
            alive = heard is not None and now - heard < self.s.peer_timeout_s
            fresh = now - rx.registered_at < self.s.peer_timeout_s
            listed = now - rx.listed_at < self.s.peer_timeout_s
            if not (fresh or (alive and listed)):
                continue
            if self.leases.renew(rx.tid, rx.generation, now) is LeaseCheck.OK:
                per_peer.setdefault((rx.address, rx.owner), []).append((rx.tid, rx.generation))
                if rx.p_rank >= 0:
                    slot_of[(rx.address, rx.owner)] = rx.p_rank
        out: list[Action] = []
        for (address, owner), live in per_peer.items():
            peer = self._peers.get((owner, slot_of.get((address, owner), self.me.rank)))
            # Small enough for P's codec (core.quotas): a long list goes as several.
            for batch in live_batches(live):
                hb = Heartbeat(
                    PROTOCOL_VERSION,
                    self.slim,
                    peer.incarnation if peer and peer.incarnation is not None else 0,
                    batch,
                    int(self.s.permit_ttl_s * 1000),
                )
                out.append(SendMessage(address, hb, owner))
        return out

    def _finish_pull(self, rx: _Receive, now: float) -> list[Action]:
        """End a fallback once no READ is in flight: report, and tell P it may free."""
        if rx.reads:
            return []
        if not (rx.read_failed or rx.cancelling) and self.reads.has_transfer(rx.tid):
            return []
        ok = not rx.read_failed and not rx.cancelling
        msg = PullDone(PROTOCOL_VERSION, rx.tid, rx.generation, self.slim, ok)
        out: list[Action] = [SendMessage(rx.address, msg, rx.owner)]
        if rx.cancelling:
            return out + self._end(rx, now, ReportFinished(rx.tid, Outcome.ABORTED))
        if ok:
            rx.machine.fire(E.PULL_DONE, now)
            return out + self._end(
                rx,
                now,
                ReportFinished(
                    rx.tid, Outcome.PULL_FALLBACK, rx.checksum, tuple(rx.pull), rx.pull_per_block
                ),
            )
        rx.machine.fire(E.FAIL, now)
        return out + self._end(rx, now, ReportFailed(rx.tid, "pull_failed", rx.read_failed))

    def _end(self, rx: _Receive, now: float, report: Action) -> list[Action]:
        self._in.pop(rx.tid, None)
        self.reads.cancel(rx.tid)
        if self.leases.reusable(rx.tid, now):
            self.leases.forget(rx.tid, now)
        return [report]
