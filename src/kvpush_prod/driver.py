"""The one interpreter of the core's actions: it feeds events to a Sender or Receiver and
carries out what they answer through the ``Effects`` a shell supplies.

The vLLM connector's transfer pump, the simulator and the stateful test world each supply
their Effects (a NIXL agent and a control socket; a simulated wire; a simulated network and
NIC) and run the same driver, so what the property tests check is what runs in vLLM. Each
event and each action is carried out on its own: one that raises is handed to
``Effects.contained`` (the pump counts and logs it, a test re-raises) and never drops another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

import msgspec

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
from kvpush_prod.core.commands import Command
from kvpush_prod.core.messages import ControlMessage, PeerInfo
from kvpush_prod.core.retry import ChunkError, ErrorKind, classify
from kvpush_prod.core.vocabulary import NoteKind, Word

MAX_MESSAGE_AGE_S = 3600.0  # a sent_at further back is a broken clock, not a slow network

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
P = TypeVar("P")  # the shell's handle of a connected peer


class Stage(Word):
    """Where an exception was contained: the ``stage`` label of ``kvpush_pump_errors_total``."""

    MESSAGE = "message"  # a control message fed to the engine
    COMMAND = "command"  # an engine-thread command
    ACTION = "action"  # carrying out one action
    COMPLETION = "completion"  # a chunk's completion or a DONE notification
    TIMER = "timer"  # polls, ticks and the pump's own pass


class Deferred:
    """What ``Effects.connect`` returns when it makes the connection off the caller's thread:
    the shell hands the result to ``Driver.connected`` once it is there."""

    def __repr__(self) -> str:
        return "DEFERRED"


DEFERRED = Deferred()


class ActionHandler(Protocol[R_co]):
    """One method per action type; ``visit`` calls the one an action is for."""

    def connect_peer(self, action: ConnectPeer, /) -> R_co: ...
    def drop_peer(self, action: DropPeer, /) -> R_co: ...
    def post_write(self, action: PostWrite, /) -> R_co: ...
    def post_read(self, action: PostRead, /) -> R_co: ...
    def send_message(self, action: SendMessage, /) -> R_co: ...
    def release_send(self, action: ReleaseSend, /) -> R_co: ...
    def report_finished(self, action: ReportFinished, /) -> R_co: ...
    def report_failed(self, action: ReportFailed, /) -> R_co: ...
    def note(self, action: Note, /) -> R_co: ...


def visit(action: Action, handler: ActionHandler[R]) -> R:
    """``handler``'s method for the type of ``action`` (the one dispatch on action types)."""
    if isinstance(action, PostWrite):
        return handler.post_write(action)
    if isinstance(action, Note):
        return handler.note(action)
    if isinstance(action, SendMessage):
        return handler.send_message(action)
    if isinstance(action, PostRead):
        return handler.post_read(action)
    if isinstance(action, ReleaseSend):
        return handler.release_send(action)
    if isinstance(action, ReportFinished):
        return handler.report_finished(action)
    if isinstance(action, ReportFailed):
        return handler.report_failed(action)
    if isinstance(action, ConnectPeer):
        return handler.connect_peer(action)
    if isinstance(action, DropPeer):
        return handler.drop_peer(action)
    raise TypeError(f"{action!r} is not an action of kvpush_prod.core.actions")


def split_notes(actions: Iterable[Action]) -> tuple[list[Note], list[Action]]:
    """The notes among ``actions``, and everything else (what would change the world)."""
    notes: list[Note] = []
    others: list[Action] = []
    for a in actions:
        if isinstance(a, Note):
            notes.append(a)
        else:
            others.append(a)
    return notes, others


class Observer:
    """Sees every action just before the driver carries it out (all methods do nothing):
    a test world checks its invariants here; raising stops that action."""

    def connect_peer(self, action: ConnectPeer, /) -> None: ...
    def drop_peer(self, action: DropPeer, /) -> None: ...
    def post_write(self, action: PostWrite, /) -> None: ...
    def post_read(self, action: PostRead, /) -> None: ...
    def send_message(self, action: SendMessage, /) -> None: ...
    def release_send(self, action: ReleaseSend, /) -> None: ...
    def report_finished(self, action: ReportFinished, /) -> None: ...
    def report_failed(self, action: ReportFailed, /) -> None: ...
    def note(self, action: Note, /) -> None: ...


class Effects(Protocol[P]):
    """What a shell does for the driver: its clocks, its network and NIC, its engine."""

    def now(self) -> float:
        """The engine's clock (monotonic seconds): the ``now`` every event is fed with."""
        ...

    def wall(self) -> float:
        """Seconds since the epoch, stamped on a message's ``sent_at`` (0.0: no stamp)."""
        ...

    def send(self, peer: str, to: str, message: ControlMessage) -> None:
        """Send ``message`` to the endpoint at address ``peer`` that proves identity ``to``."""
        ...

    def connect(self, info: PeerInfo) -> P | None | Deferred:
        """Make ``info``'s NIXL agent reachable; None if it cannot be (posts to it fail).

        ``DEFERRED``: the connection is being made elsewhere (a connect thread); the shell
        calls ``Driver.connected`` with its result, once, and the engine holds what waits
        for it meanwhile (it must not block the caller: connecting to a peer can take
        seconds)."""
        ...

    def disconnect(self, agent: str) -> None:
        """Forget the agent ``agent`` (it may never have been connected)."""
        ...

    def write(self, action: PostWrite, peer: P) -> ChunkError | None:
        """Post a WRITE to ``peer``; the error if it could not be posted."""
        ...

    def read(self, action: PostRead, peer: P) -> ChunkError | None:
        """Post a READ from ``peer``; the error if it could not be posted."""
        ...

    def post_failed(self, action: PostWrite | PostRead, error: ChunkError) -> None:
        """A chunk could not be posted (the engine hears of it next, as a failed chunk)."""
        ...

    def release_send(self, action: ReleaseSend) -> None:
        """P: the send lease is over; vLLM may free the request's blocks."""
        ...

    def report_finished(self, action: ReportFinished) -> None:
        """D: the receive ended with the KV in place (or an aborted one may free)."""
        ...

    def report_failed(self, action: ReportFailed) -> None:
        """D: the receive failed; vLLM's ``kv_load_failure_policy`` applies."""
        ...

    def note(self, note: Note) -> None:
        """Count (and maybe log) what the note says."""
        ...

    def contained(self, stage: Stage, what: str) -> None:
        """Called inside ``except``: ``what`` raised at ``stage`` and was dropped (count and
        log it; a test re-raises)."""
        ...


class Engine(Protocol):
    """What the driver feeds: ``Sender`` (P) or ``Receiver`` (D)."""

    @property
    def busy(self) -> bool:
        """Chunks queued or in flight: poll often."""
        ...

    def on_message(
        self, msg: ControlMessage, now: float, age: float = 0.0, origin: str = ""
    ) -> list[Action]:
        """A control message from ``origin`` (the authenticated sender; "" when the channel
        has no keys: then the control address the message claims stands in for it), ``age``
        seconds after it was sent."""
        ...

    def on_chunk(
        self, chunk_id: int, ok: bool, error: ChunkError | str, now: float
    ) -> list[Action]: ...
    def on_peer(self, agent: str, problem: str, now: float) -> list[Action]: ...
    def poll(self, now: float) -> list[Action]: ...
    def tick(self, now: float) -> list[Action]: ...


E = TypeVar("E", bound=Engine)


def message_age(msg: ControlMessage, wall: float) -> float:
    """How long ``msg`` travelled, by its ``sent_at`` and this node's wall clock (0: unknown)."""
    sent_at = getattr(msg, "sent_at", 0.0)
    return min(max(0.0, wall - sent_at), MAX_MESSAGE_AGE_S) if sent_at else 0.0


# After a failed connect, the same agent is tried again only after this backoff, doubled
# at each failure up to the bound (seconds).
CONNECT_BACKOFF_S = 1.0
CONNECT_BACKOFF_MAX_S = 30.0


class Driver(Generic[E, P]):
    """Runs one engine over one shell's ``Effects``; holds the peers connected for it."""

    def __init__(
        self, engine: E, effects: Effects[P], observer: ActionHandler[None] | None = None
    ) -> None:
        self.engine = engine
        self.effects = effects
        self.observer = observer
        self.peers: dict[str, P] = {}  # agent name -> the shell's handle of it
        # Agents whose deferred connect has not ended yet, and those whose connect failed
        # (a late success of one is still taken): both until the engine drops the agent.
        self.connecting: set[str] = set()
        self.unreachable: set[str] = set()
        # Unreachable agents: (when the next connect may be tried, the backoff that set it).
        # A connect that fails is not tried again at once for every transfer that needs the
        # agent: each try costs seconds and, in UCX, a socket it may never close (a soak
        # measured one fd per refused connect); the transfers meanwhile hear it failed.
        self.retry_at: dict[str, tuple[float, float]] = {}
        # Chunks in flight: the agent and the connection each went out on, so that a chunk
        # the transport says was cut off (REMOTE_DISCONNECT) drops that connection only if
        # it is still the one in use (not one made since).
        self.posted: dict[int, tuple[str, P]] = {}

    # ------------------------------------------------------------------ events in
    def feed(self, stage: Stage, what: str, event: Callable[[E, float], list[Action]]) -> None:
        """Feed ``event`` to the engine now and carry out its actions; if the event raises,
        it is contained at ``stage``."""
        try:
            actions = event(self.engine, self.effects.now())
        except Exception:  # noqa: BLE001 - contained, counted, logged by the shell
            self.effects.contained(stage, what)
            return
        self.run(actions)

    def message(self, msg: ControlMessage, origin: str = "") -> None:
        """A control message from ``origin`` (the identity its channel authenticated)."""
        age = message_age(msg, self.effects.wall())
        self.feed(
            Stage.MESSAGE,
            type(msg).__name__,
            lambda engine, now: engine.on_message(msg, now, age, origin),
        )

    def command(self, command: Command[E]) -> None:
        """An engine-thread command; one that raises is contained."""
        self.feed(Stage.COMMAND, type(command).__name__, command.apply)

    def apply(self, command: Command[E]) -> None:
        """An engine-thread command whose exception the caller handles (its actions are
        still each contained)."""
        self.run(command.apply(self.engine, self.effects.now()))

    def completed(self, chunk_id: int, error: ChunkError | None = None) -> None:
        """A posted chunk completed (``error`` None) or failed."""
        went = self.posted.pop(chunk_id, None)
        if error is not None and went is not None:
            self._check_lost(went[0], went[1], error)
        self.feed(
            Stage.COMPLETION,
            f"chunk {chunk_id}",
            lambda engine, now: engine.on_chunk(chunk_id, error is None, error or "", now),
        )

    def connected(self, agent: str, peer: P | None, problem: str = "") -> None:
        """A deferred connect to ``agent`` ended: ``peer`` the shell's handle, or None and
        ``problem`` why not. A result nobody waits for any more (the engine dropped the
        agent meanwhile) is disconnected at once."""
        if agent not in self.connecting and agent not in self.unreachable:
            if peer is not None:
                self.effects.disconnect(agent)
            return
        self.connecting.discard(agent)
        if peer is None:
            self.unreachable.add(agent)
            backoff = self.retry_at.get(agent, (0.0, 0.0))[1]
            backoff = min(CONNECT_BACKOFF_MAX_S, max(CONNECT_BACKOFF_S, 2 * backoff))
            self.retry_at[agent] = (self.effects.now() + backoff, backoff)
        else:
            self.unreachable.discard(agent)
            self.retry_at.pop(agent, None)
            self.peers[agent] = peer
        self._tell(agent, "" if peer is not None else problem or "could not connect")

    def poll(self) -> None:
        self.feed(Stage.TIMER, "poll", lambda engine, now: engine.poll(now))

    def tick(self) -> None:
        self.feed(Stage.TIMER, "tick", lambda engine, now: engine.tick(now))

    # ------------------------------------------------------------------ actions out
    def run(self, actions: Iterable[Action]) -> None:
        """Carry out each action on its own (the observer sees it first)."""
        for action in actions:
            try:
                if self.observer is not None:
                    visit(action, self.observer)
                visit(action, self)
            except Exception:  # noqa: BLE001 - contained, counted, logged by the shell
                self.effects.contained(Stage.ACTION, type(action).__name__)

    def connect_peer(self, action: ConnectPeer, /) -> None:
        """Connect (or take the connection being made); the engine hears the outcome
        through ``on_peer``, at once or, for a deferred connect, through ``connected``."""
        if action.replaces:
            self._drop(action.replaces)
        info, agent = action.info, action.info.agent_name
        if agent in self.connecting:
            return  # one connect per agent at a time: its result answers this one too
        if agent in self.peers:
            self._tell(agent, "")
            return
        if agent in self.retry_at:
            wait = self.retry_at[agent][0] - self.effects.now()
            if wait > 0:
                self._tell(agent, f"unreachable: its last connect failed; next try in {wait:.1f} s")
                return
        peer = self.effects.connect(info) if info.layout is not None else None
        if isinstance(peer, Deferred):
            self.connecting.add(agent)
            return
        self.connecting.add(agent)
        self.connected(agent, peer, "" if info.layout is not None else "no KV layout announced")

    def drop_peer(self, action: DropPeer, /) -> None:
        self._drop(action.agent_name)

    def post_write(self, action: PostWrite, /) -> None:
        peer = self.peers.get(action.peer)
        if peer is None:
            self._posted(action, _not_connected(action.peer))
            return
        self._posted(action, self.effects.write(action, peer), peer)

    def post_read(self, action: PostRead, /) -> None:
        peer = self.peers.get(action.peer)
        if peer is None:
            self._posted(action, _not_connected(action.peer))
            return
        self._posted(action, self.effects.read(action, peer), peer)

    def send_message(self, action: SendMessage, /) -> None:
        msg = action.message
        if "sent_at" in type(msg).__struct_fields__:
            msg = msgspec.structs.replace(msg, sent_at=self.effects.wall())
        self.effects.send(action.peer, action.to, msg)

    def release_send(self, action: ReleaseSend, /) -> None:
        self.effects.release_send(action)

    def report_finished(self, action: ReportFinished, /) -> None:
        self.effects.report_finished(action)

    def report_failed(self, action: ReportFailed, /) -> None:
        self.effects.report_failed(action)

    def note(self, action: Note, /) -> None:
        self.effects.note(action)

    # ------------------------------------------------------------------ internals
    def _drop(self, agent: str) -> None:
        self.peers.pop(agent, None)
        self.connecting.discard(agent)
        self.unreachable.discard(agent)
        self.retry_at.pop(agent, None)
        self.effects.disconnect(agent)

    def _tell(self, agent: str, problem: str) -> None:
        """The engine learns that its connection to ``agent`` is ready ("") or failed."""
        self.feed(
            Stage.COMPLETION,
            f"connect {agent[:64]}",
            lambda engine, now: engine.on_peer(agent, problem, now),
        )

    def _check_lost(self, agent: str, peer: P, error: ChunkError) -> None:
        """A chunk to or from ``agent`` over ``peer`` failed with ``error``. If the transport
        says the connection itself is gone (REMOTE_DISCONNECT: UCX closed it, e.g. TCP's
        user timeout under a partition) and it is still the one in use, it is dropped: UCX
        never reopens it, so every later post would fail the same way. The next ConnectPeer
        for the agent (P's engine asks at once; D's next fallback from that P) makes a new
        one. Counted as ``kvpush_peer_connections_lost_total``."""
        if classify(error).kind is not ErrorKind.REMOTE_DISCONNECT:
            return
        if self.peers.get(agent) is not peer:
            return  # that connection was already dropped (and maybe made anew)
        self.effects.note(Note(NoteKind.CONNECTION_LOST, "", agent, 0.0))
        self._drop(agent)

    def _posted(
        self, action: PostWrite | PostRead, error: ChunkError | None, peer: P | None = None
    ) -> None:
        """A chunk that could not be posted fails at once: the engine hears it as a failed
        chunk (and retries, falls back or gives up)."""
        if error is None:
            if peer is not None:
                self.posted[action.chunk_id] = (action.peer, peer)
            return
        if peer is not None:
            self._check_lost(action.peer, peer, error)
        self.effects.post_failed(action, error)
        self.run(self.engine.on_chunk(action.chunk_id, False, error, self.effects.now()))


def _not_connected(agent: str) -> ChunkError:
    return ChunkError(ErrorKind.NOT_FOUND, f"no connection to agent {agent[:64]}")
