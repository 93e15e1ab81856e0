"""The driver: the one interpreter of the core's actions, over a shell's Effects."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import pytest

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
from kvpush_prod.core.commands import Hold
from kvpush_prod.core.retry import ChunkError, ErrorKind
from kvpush_prod.core.vocabulary import NoteKind, Outcome
from kvpush_prod.driver import (
    DEFERRED,
    MAX_MESSAGE_AGE_S,
    Deferred,
    Driver,
    Observer,
    Stage,
    message_age,
    split_notes,
    visit,
)

LAYOUT = m.Layout("c", "DRAM", [m.Region(0, 100, 100, 8)])
D = m.PeerInfo("D", 2, 0, "tcp://d:1", "agent-d", b"meta", LAYOUT)
WRITE = PostWrite("t", 1, 7, "agent-d", (1,), (2,), 100)
READ = PostRead("t", 1, 8, "agent-d", (1,), (2,), 100)


class Engine:
    """Answers each event with the actions queued for it; records what it was fed."""

    def __init__(self) -> None:
        self.fed: list[tuple[Any, ...]] = []
        self.answers: list[Action] = []
        self.busy = False

    def _answer(self) -> list[Action]:
        out, self.answers = self.answers, []
        return out

    def on_message(
        self, msg: m.ControlMessage, now: float, age: float = 0.0, origin: str = ""
    ) -> list[Action]:
        self.fed.append(("message", type(msg).__name__, now, age, origin))
        return self._answer()

    def on_chunk(
        self, chunk_id: int, ok: bool, error: ChunkError | str, now: float
    ) -> list[Action]:
        self.fed.append(("chunk", chunk_id, ok, error, now))
        return self._answer()

    def on_peer(self, agent: str, problem: str, now: float) -> list[Action]:
        self.fed.append(("peer", agent, problem, now))
        return self._answer()

    def poll(self, now: float) -> list[Action]:
        self.fed.append(("poll", now))
        return self._answer()

    def tick(self, now: float) -> list[Action]:
        self.fed.append(("tick", now))
        return self._answer()

    def hold(self, tid: str) -> list[Action]:
        self.fed.append(("hold", tid))
        return self._answer()


class Effects:
    """Records every call; ``fail`` names the methods that raise; posts fail with ``post_error``."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail: set[str] = set()
        self.post_error: ChunkError | None = None
        self.contained_: list[tuple[Stage, str]] = []
        self.t = 5.0  # the shell's clock

    def _call(self, name: str, *args: Any) -> None:
        self.calls.append((name, *args))
        if name in self.fail:
            raise RuntimeError(f"{name} broke")

    def now(self) -> float:
        return self.t

    def wall(self) -> float:
        return 1000.0

    def send(self, peer: str, to: str, message: m.ControlMessage) -> None:
        self._call("send", peer, to, message)

    def connect(self, info: m.PeerInfo) -> str | None | Deferred:
        self._call("connect", info.agent_name)
        if "connect-later" in self.fail:
            return DEFERRED
        return None if "connect-none" in self.fail else f"peer:{info.agent_name}"

    def disconnect(self, agent: str) -> None:
        self._call("disconnect", agent)

    def write(self, action: PostWrite, peer: str) -> ChunkError | None:
        self._call("write", action.chunk_id, peer)
        return self.post_error

    def read(self, action: PostRead, peer: str) -> ChunkError | None:
        self._call("read", action.chunk_id, peer)
        return self.post_error

    def post_failed(self, action: PostWrite | PostRead, error: ChunkError) -> None:
        self._call("post_failed", action.chunk_id, error.kind)

    def release_send(self, action: ReleaseSend) -> None:
        self._call("release_send", action.transfer_id)

    def report_finished(self, action: ReportFinished) -> None:
        self._call("report_finished", action.transfer_id)

    def report_failed(self, action: ReportFailed) -> None:
        self._call("report_failed", action.transfer_id)

    def note(self, note: Note) -> None:
        self._call("note", note.kind)

    def contained(self, stage: Stage, what: str) -> None:
        self.contained_.append((stage, what))


def driver() -> tuple[Driver[Any, str], Engine, Effects]:
    engine, effects = Engine(), Effects()
    return Driver(engine, effects), engine, effects


def names(effects: Effects) -> list[str]:
    return [c[0] for c in effects.calls]


def test_each_action_goes_to_its_effect() -> None:
    d, _, fx = driver()
    d.run(
        [
            ConnectPeer(D),
            WRITE,
            READ,
            ReleaseSend("t", Outcome.PUSHED),
            ReportFinished("t", Outcome.PUSHED),
            ReportFailed("t", "x"),
            Note(NoteKind.RETRY, "BACKEND"),
            DropPeer("agent-d"),
        ]
    )
    assert names(fx) == [
        "connect",
        "write",
        "read",
        "release_send",
        "report_finished",
        "report_failed",
        "note",
        "disconnect",
    ]
    assert fx.calls[1] == ("write", 7, "peer:agent-d")  # the shell's handle of the peer
    assert fx.contained_ == []


def test_a_peer_is_connected_once_and_a_replaced_one_is_dropped_first() -> None:
    d, _, fx = driver()
    d.run([ConnectPeer(D), ConnectPeer(D)])
    new = msgspec.structs.replace(D, agent_name="agent-d2", incarnation=3)
    d.run([ConnectPeer(new, replaces="agent-d")])
    assert fx.calls == [("connect", "agent-d"), ("disconnect", "agent-d"), ("connect", "agent-d2")]
    assert set(d.peers) == {"agent-d2"}


def test_the_engine_hears_each_connect_it_asked_for_as_soon_as_it_is_made() -> None:
    d, engine, _ = driver()
    d.run([ConnectPeer(D), ConnectPeer(D)])
    assert engine.fed == [("peer", "agent-d", "", 5.0)] * 2  # the second: already connected


def test_a_deferred_connect_is_asked_once_and_answered_when_the_shell_has_it() -> None:
    d, engine, fx = driver()
    fx.fail.add("connect-later")
    engine.answers = [WRITE]  # what the engine held for the peer
    d.run([ConnectPeer(D), ConnectPeer(D)])
    assert fx.calls == [("connect", "agent-d")] and engine.fed == []
    assert d.connecting == {"agent-d"} and not d.peers
    d.connected("agent-d", "peer:agent-d")
    assert engine.fed == [("peer", "agent-d", "", 5.0)]
    assert fx.calls[-1] == ("write", 7, "peer:agent-d")  # the engine's answer carried out
    assert d.peers == {"agent-d": "peer:agent-d"} and not d.connecting


def test_a_deferred_connect_that_failed_is_told_and_a_late_success_still_taken() -> None:
    d, engine, fx = driver()
    fx.fail.add("connect-later")
    d.run([ConnectPeer(D)])
    d.connected("agent-d", None, "timed out after 10 s")
    assert engine.fed == [("peer", "agent-d", "timed out after 10 s", 5.0)] and not d.peers
    d.connected("agent-d", "peer:agent-d")  # the connect thread finished after all
    assert engine.fed[-1] == ("peer", "agent-d", "", 5.0)
    assert d.peers == {"agent-d": "peer:agent-d"}


def test_a_deferred_connect_to_a_peer_dropped_meanwhile_is_undone_when_it_lands() -> None:
    d, engine, fx = driver()
    fx.fail.add("connect-later")
    d.run([ConnectPeer(D), DropPeer("agent-d")])
    d.connected("agent-d", "peer:agent-d")
    # Dropped at once (the shell undoes a connect still running), and again when it lands.
    assert fx.calls == [
        ("connect", "agent-d"),
        ("disconnect", "agent-d"),
        ("disconnect", "agent-d"),
    ]
    assert engine.fed == [] and not d.peers and not d.connecting
    d.connected("agent-d", None, "late failure")  # nothing waits: nothing to say
    assert engine.fed == []


def test_a_post_to_an_unconnected_agent_fails_at_once_and_the_engine_hears_it() -> None:
    d, engine, fx = driver()
    engine.answers = [Note(NoteKind.RETRY, "NOT_FOUND")]
    d.run([WRITE])
    assert fx.calls == [("post_failed", 7, ErrorKind.NOT_FOUND), ("note", NoteKind.RETRY)]
    ((_, cid, ok, error, now),) = engine.fed
    assert (cid, ok, now) == (7, False, 5.0)
    assert isinstance(error, ChunkError) and error.kind is ErrorKind.NOT_FOUND


def test_a_peer_that_cannot_be_connected_fails_its_posts() -> None:
    d, engine, fx = driver()
    fx.fail.add("connect-none")
    d.run([ConnectPeer(D), READ])
    assert names(fx) == ["connect", "post_failed"]
    assert engine.fed[0] == ("peer", "agent-d", "could not connect", 5.0)
    assert engine.fed[1][:3] == ("chunk", 8, False)


def test_an_agent_that_failed_to_connect_is_tried_again_only_after_a_growing_backoff() -> None:
    d, engine, fx = driver()
    fx.fail.add("connect-none")
    d.run([ConnectPeer(D)])
    fx.t = 5.5  # within the first backoff (1 s): told at once, not tried
    d.run([ConnectPeer(D)])
    assert names(fx) == ["connect"]
    assert engine.fed[-1][2].startswith("unreachable: its last connect failed; next try in 0.5")
    fx.t = 6.0  # the backoff is over: tried, fails again, the backoff doubles
    d.run([ConnectPeer(D)])
    assert names(fx) == ["connect", "connect"] and d.retry_at["agent-d"] == (8.0, 2.0)
    for t in range(8, 200):
        fx.t = float(t)
        d.run([ConnectPeer(D)])
    assert d.retry_at["agent-d"][1] == 30.0  # bounded
    assert names(fx).count("connect") < 12  # not once a second for 192 s
    fx.fail.discard("connect-none")
    fx.t = 1000.0
    d.run([ConnectPeer(D)])
    assert engine.fed[-1] == ("peer", "agent-d", "", 1000.0)
    assert "agent-d" not in d.retry_at and d.peers == {"agent-d": "peer:agent-d"}


def test_dropping_an_agent_forgets_its_backoff() -> None:
    d, _, fx = driver()
    fx.fail.add("connect-none")
    d.run([ConnectPeer(D), DropPeer("agent-d")])
    assert not d.retry_at and not d.unreachable
    d.run([ConnectPeer(D)])  # a new try at once
    assert names(fx) == ["connect", "disconnect", "connect"]


def test_a_post_the_shell_could_not_make_fails_the_chunk() -> None:
    d, engine, fx = driver()
    fx.post_error = ChunkError(ErrorKind.BACKEND, "busy")
    d.run([ConnectPeer(D), WRITE])
    assert names(fx) == ["connect", "write", "post_failed"]
    assert engine.fed[1:] == [("chunk", 7, False, fx.post_error, 5.0)]


def test_a_connection_the_transport_closed_is_dropped_and_made_anew_on_next_use() -> None:
    """REMOTE_DISCONNECT at completion: UCX never reopens that connection, so it is dropped
    (counted) and the next ConnectPeer makes a new one, which an old chunk's late failure
    does not drop again."""
    d, engine, fx = driver()
    cut = ChunkError(ErrorKind.REMOTE_DISCONNECT, "NIXL_ERR_REMOTE_DISCONNECT")
    d.run([ConnectPeer(D), WRITE, dataclasses.replace(WRITE, chunk_id=9)])
    old = d.peers["agent-d"]
    d.completed(7, cut)
    assert names(fx) == ["connect", "write", "write", "note", "disconnect"]
    assert fx.calls[3] == ("note", NoteKind.CONNECTION_LOST) and not d.peers
    assert engine.fed[-1] == ("chunk", 7, False, cut, 5.0)  # the engine hears it after
    d.run([ConnectPeer(D)])
    new = d.peers["agent-d"]
    assert new is not old and names(fx)[-1] == "connect"
    d.completed(9, cut)  # went out on the old connection: the new one is kept
    assert d.peers["agent-d"] is new and names(fx)[-1] == "connect"
    assert not d.posted  # nothing in flight is remembered any longer


def test_a_post_refused_because_the_connection_is_gone_drops_it() -> None:
    d, _, fx = driver()
    d.run([ConnectPeer(D)])
    fx.post_error = ChunkError(ErrorKind.REMOTE_DISCONNECT, "disconnected")
    d.run([READ])
    assert names(fx) == ["connect", "read", "note", "disconnect", "post_failed"]
    assert not d.peers
    fx.post_error = ChunkError(ErrorKind.BACKEND, "busy")  # any other error keeps it
    d.run([ConnectPeer(D), READ])
    assert "agent-d" in d.peers and names(fx)[-3:] == ["connect", "read", "post_failed"]
    d.completed(8, ChunkError(ErrorKind.TIMEOUT))
    assert "agent-d" in d.peers


def test_one_action_that_raises_is_contained_and_the_others_still_run() -> None:
    d, _, fx = driver()
    fx.fail.add("release_send")
    d.run([ReleaseSend("t", Outcome.PUSHED), Note(NoteKind.FENCED, "x"), ReportFailed("u", "y")])
    assert names(fx) == ["release_send", "note", "report_failed"]
    assert fx.contained_ == [(Stage.ACTION, "ReleaseSend")]


def test_an_event_that_raises_is_contained_at_its_stage() -> None:
    d, engine, fx = driver()

    def broken(*_: Any) -> list[Action]:
        raise ValueError("bug")

    engine.on_message = broken  # type: ignore[method-assign]
    d.message(m.Heartbeat(m.PROTOCOL_VERSION, D, 1, []))
    d.command(_Broken())
    assert fx.contained_ == [(Stage.MESSAGE, "Heartbeat"), (Stage.COMMAND, "_Broken")]
    with pytest.raises(ValueError, match="command"):
        d.apply(_Broken())  # the engine thread's hand-off handles its own


class _Broken:
    def apply(self, engine: Any, now: float, /) -> list[Action]:
        raise ValueError("command")


def test_commands_events_and_timers_feed_the_engine_at_the_shell_clock() -> None:
    d, engine, fx = driver()
    engine.answers = [Note(NoteKind.QUEUE_WAIT, "")]
    d.apply(Hold("t"))  # type: ignore[arg-type]
    d.completed(3)
    d.completed(4, ChunkError(ErrorKind.TIMEOUT))
    d.poll()
    d.tick()
    assert engine.fed == [
        ("hold", "t"),
        ("chunk", 3, True, "", 5.0),
        ("chunk", 4, False, ChunkError(ErrorKind.TIMEOUT), 5.0),
        ("poll", 5.0),
        ("tick", 5.0),
    ]
    assert names(fx) == ["note"]


def test_a_message_is_fed_with_its_age_and_origin() -> None:
    d, engine, _ = driver()
    hb = m.Heartbeat(m.PROTOCOL_VERSION, D, 1, [], sent_at=998.5)
    d.message(hb, origin="key")
    assert engine.fed == [("message", "Heartbeat", 5.0, 1.5, "key")]


@pytest.mark.parametrize(
    ("sent_at", "wall", "age"),
    [
        (0.0, 1000.0, 0.0),
        (990.0, 1000.0, 10.0),
        (1010.0, 1000.0, 0.0),
        (1.0, 1e9, MAX_MESSAGE_AGE_S),
    ],
)
def test_the_age_of_a_message_is_bounded_and_never_negative(
    sent_at: float, wall: float, age: float
) -> None:
    assert message_age(m.Heartbeat(m.PROTOCOL_VERSION, D, 1, [], sent_at=sent_at), wall) == age


def test_a_sent_message_is_stamped_with_the_wall_clock_where_it_has_a_stamp() -> None:
    d, _, fx = driver()
    hb = m.Heartbeat(m.PROTOCOL_VERSION, D, 1, [])
    ack = m.CancelAck(m.PROTOCOL_VERSION, "t", 1, D)
    d.run([SendMessage("tcp://p:1", hb, "key"), SendMessage("tcp://p:1", ack, "key")])
    (_, peer, to, sent), (_, _, _, acked) = fx.calls
    assert (peer, to, sent.sent_at) == ("tcp://p:1", "key", 1000.0)
    assert acked == ack


def test_the_observer_sees_each_action_first_and_can_stop_it() -> None:
    seen: list[str] = []

    class Watch(Observer):
        def post_write(self, action: PostWrite, /) -> None:
            seen.append("write")
            raise AssertionError("not under a permit")

        def note(self, action: Note, /) -> None:
            seen.append("note")

    engine, fx = Engine(), Effects()
    d = Driver(engine, fx, Watch())
    d.run([ConnectPeer(D), WRITE, Note(NoteKind.FENCED, "x")])
    assert seen == ["write", "note"]
    assert names(fx) == ["connect", "note"]  # the WRITE never went out
    assert fx.contained_ == [(Stage.ACTION, "PostWrite")]


def test_visit_dispatches_on_the_action_type_and_refuses_anything_else() -> None:
    class Kind:
        def __getattr__(self, name: str) -> Any:
            return lambda action: name

    assert visit(WRITE, Kind()) == "post_write"
    assert visit(ReportFailed("t", "x"), Kind()) == "report_failed"
    with pytest.raises(TypeError, match="not an action"):
        visit("PostWrite", Kind())  # type: ignore[arg-type]


def test_split_notes_keeps_the_order_of_each_kind() -> None:
    a, b = Note(NoteKind.FENCED, "a"), Note(NoteKind.REJECTED, "b")
    assert split_notes([a, WRITE, b, READ]) == ([a, b], [WRITE, READ])
