"""P's connection to a decode engine is made off the pump (``await_connect``): transfers to a
D whose connection is not ready are held (their permits renewed by D's heartbeats as usual),
start when ``on_peer`` says it is ready, and fall back or fail when it could not be made;
transfers to other D's go on meanwhile. D's connection to a prefill engine it pulls from
(a FALLBACK) is made off the pump too: the pull's READs wait for it, within P's read
permit, and the pull fails (vLLM's kv_load_failure_policy) when it cannot be made."""

from __future__ import annotations

import random
from dataclasses import replace

from kvpush_prod.core import messages as m
from kvpush_prod.core.actions import (
    ConnectPeer,
    PostRead,
    PostWrite,
    ReleaseSend,
    ReportFailed,
    ReportFinished,
)
from kvpush_prod.core.identity import agent_name as ag
from kvpush_prod.core.receiver import Receiver
from kvpush_prod.core.retry import ChunkError, ErrorKind
from kvpush_prod.core.sender import Sender
from tests.core.sim_world import Chaos, World
from tests.core.test_push_engines import LAYOUT, RS, SS, D, P, msgs, of, register

D2 = m.PeerInfo("D2", 3, 0, "tcp://d2:1", ag("agent-d2", "tcp://d2:1"), b"meta", LAYOUT)


def sender(fallback: bool = True) -> Sender:
    return Sender(P, replace(SS, await_connect=True, fallback=fallback), random.Random(0))


def heartbeat(tid: str = "t", info: m.PeerInfo = D) -> m.Heartbeat:
    return m.Heartbeat(1, info, P.incarnation, [(tid, 1)], 5000)


def test_a_transfer_to_a_decode_still_being_connected_is_held_then_posted_when_ready() -> None:
    s = sender()
    s.blocks_ready("t", [1, 2, 3], 0.0)
    out = s.on_message(register(), 0.0)
    assert of(out, ConnectPeer) and of(out, PostWrite) == []
    assert s.connecting(D.agent_name)
    posted = of(s.on_peer(D.agent_name, "", 0.5), PostWrite)
    assert [w.src_blocks for w in posted] == [(1, 2)] and not s.connecting(D.agent_name)


def test_the_permit_of_a_held_transfer_is_renewed_by_heartbeats_and_still_bounds_it() -> None:
    s = sender()
    s.blocks_ready("t", [1, 2, 3], 0.0)
    s.hold("t")
    s.on_message(register(ttl_ms=5000), 0.0)  # the permit ends at 5
    for now in (2.0, 4.0, 6.0, 8.0):  # the connection takes 9 s; D renews each 2 s
        assert of(s.on_message(heartbeat(), now), PostWrite) == []
        assert msgs(s.tick(now + 0.5), m.Failed) == []
    assert of(s.on_peer(D.agent_name, "", 9.0), PostWrite) != []
    # Without renewals the held transfer ends with its permit, as one not started would.
    s = sender()
    s.blocks_ready("u", [1], 0.0)
    s.hold("u")
    s.on_message(register("u", blocks=[10], ttl_ms=5000), 0.0)
    out = s.tick(5.1)
    assert [f.reason for f in msgs(out, m.Failed)] == ["permit_expired"]
    assert of(out, ReleaseSend) == [ReleaseSend("u", "expired", 0)]
    assert of(s.on_peer(D.agent_name, "", 6.0), PostWrite) == []  # nothing left to post


def test_a_connect_that_failed_falls_the_waiting_transfers_back_to_pull() -> None:
    s = sender()
    s.blocks_ready("t", [1, 2, 3], 0.0)
    s.hold("t")
    s.on_message(register(), 0.0)
    out = s.on_peer(D.agent_name, "timed out after 10 s", 1.0)
    (fb,) = msgs(out, m.Fallback)
    assert "connect_failed: timed out after 10 s" in fb.reason
    assert of(out, PostWrite) == []
    # A transfer registered after the failure falls back at once too (no post to try).
    s.blocks_ready("u", [4], 1.0)
    s.hold("u")
    out = s.on_message(register("u", blocks=[20], gen=1), 1.0)
    assert len(msgs(out, m.Fallback)) == 1 and of(out, PostWrite) == []


def test_a_connect_that_failed_fails_the_transfer_when_fallback_is_off() -> None:
    s = sender(fallback=False)
    s.blocks_ready("t", [1, 2, 3], 0.0)
    s.hold("t")
    s.on_message(register(), 0.0)
    out = s.on_peer(D.agent_name, "cannot load the agent's metadata", 1.0)
    assert [f.reason for f in msgs(out, m.Failed)]
    assert msgs(out, m.Fallback) == [] and of(out, PostWrite) == []


def test_a_late_connect_after_a_failure_lets_later_transfers_push() -> None:
    s = sender()
    s.on_message(register(), 0.0)
    s.on_peer(D.agent_name, "timed out after 10 s", 1.0)
    s.on_peer(D.agent_name, "", 2.0)  # the connect thread finished after all
    s.blocks_ready("u", [4], 2.0)
    assert of(s.on_message(register("u", blocks=[20]), 2.0), PostWrite) != []


def test_a_decode_that_could_not_be_connected_is_asked_for_again_by_a_later_transfer() -> None:
    """A failed connect is not for good: a transfer a while later asks for the connection
    again and waits for it (the driver backs off further while connects keep failing)."""
    s = sender()
    s.on_message(register(), 0.0)
    s.on_peer(D.agent_name, "timed out after 10 s", 1.0)
    s.blocks_ready("u", [4], 1.5)
    out = s.on_message(register("u", blocks=[20], gen=1), 1.5)  # within CONNECT_RETRY_S
    assert len(msgs(out, m.Fallback)) == 1 and of(out, ConnectPeer) == []
    s.blocks_ready("v", [5], 2.5)
    out = s.on_message(register("v", blocks=[30], gen=1), 2.5)
    assert of(out, ConnectPeer) == [ConnectPeer(D)] and msgs(out, m.Fallback) == []
    assert s.connecting(D.agent_name)
    (w,) = of(s.on_peer(D.agent_name, "", 2.6), PostWrite)
    assert w.transfer_id == "v"


def test_a_chunk_cut_off_with_its_connection_asks_for_a_new_one_and_later_pushes_wait() -> None:
    """REMOTE_DISCONNECT: the shell drops the connection UCX closed (the cut push falls
    back); P asks for a new one to the same process once D is heard from again, and the push
    that asks waits for it."""
    s = sender()
    s.blocks_ready("t", [1], 0.0)
    s.on_message(register("t", blocks=[10]), 0.0)
    (w,) = of(s.on_peer(D.agent_name, "", 0.1), PostWrite)
    out = s.on_chunk(w.chunk_id, False, ChunkError(ErrorKind.REMOTE_DISCONNECT), 0.2)
    assert of(out, ConnectPeer) == [] and len(msgs(out, m.Fallback)) == 1
    # D's next REGISTER says the link is back: its transfer asks for a new connection and
    # waits for it.
    s.blocks_ready("u", [2], 0.3)
    out = s.on_message(register("u", blocks=[20]), 0.3)
    assert of(out, ConnectPeer) == [ConnectPeer(D)] and of(out, PostWrite) == []
    (w,) = of(s.on_peer(D.agent_name, "", 0.4), PostWrite)
    assert w.transfer_id == "u"
    # Any other error keeps the connection: nothing is asked for.
    out = s.on_chunk(w.chunk_id, False, ChunkError(ErrorKind.BACKEND), 0.5)
    assert of(out, ConnectPeer) == [] and not s.connecting(D.agent_name)


def test_no_connect_is_tried_into_silence_only_once_the_decode_is_heard_from_again() -> None:
    """A connect into a partition fails after seconds and UCX keeps a socket of each try:
    after a failed connect, a transfer whose blocks become ready without word from D since
    falls back without a new try; once D's heartbeat arrives (the link is back), the next
    one tries."""
    s = sender()
    s.on_message(register("t", blocks=[10], ttl_ms=60000), 0.0)  # before the forward ends
    s.on_message(register("u", blocks=[20], ttl_ms=60000), 0.0)
    s.on_peer(D.agent_name, "timed out after 3 s", 3.0)
    out = s.blocks_ready("t", [1], 5.0) + s.hold("t")  # P's forward ends; D silent since
    assert of(out, ConnectPeer) == [] and len(msgs(out, m.Fallback)) == 1
    s.on_message(m.Heartbeat(1, D, P.incarnation, [("u", 1)], 5000), 6.0)
    out = s.blocks_ready("u", [2], 6.5) + s.hold("u")
    assert of(out, ConnectPeer) == [ConnectPeer(D)] and msgs(out, m.Fallback) == []


def test_a_layerwise_push_given_up_is_not_started_again_when_the_decode_is_heard_from() -> None:
    """A layer-wise push whose D's connection was closed gives up before any chunk goes
    out; its FALLBACK waits for the forward's end (D reads whole blocks). A heartbeat from D
    meanwhile (the link is back) must not start it again: P would WRITE into blocks D was
    told to read (found by the stateful world, seed 1267183846)."""
    ss = replace(SS, await_connect=True, breaker=replace(SS.breaker, failure_threshold=5))
    s = Sender(P, ss, random.Random(0))  # the breaker stays closed: a connect may be tried
    s.blocks_ready("a", [1], 0.0)
    s.on_message(register("a", blocks=[10], ttl_ms=60000), 0.0)
    s.on_message(register("t", blocks=[20, 21], ttl_ms=60000), 0.0)
    (w,) = of(s.on_peer(D.agent_name, "", 0.1), PostWrite)
    s.on_chunk(w.chunk_id, False, ChunkError(ErrorKind.REMOTE_DISCONNECT), 0.2)
    out = s.layers_ready("t", [2, 3], 1, 4, 0.4)  # D silent since: given up, no connect
    assert of(out, ConnectPeer) == [] and of(out, PostWrite) == [] and msgs(out, m.Fallback) == []
    out = s.on_message(heartbeat("t"), 0.5)
    out += s.on_peer(D.agent_name, "", 0.6) + s.layers_ready("t", [2, 3], 3, 4, 0.7)
    assert of(out, PostWrite) == [] and of(out, ConnectPeer) == []
    out = s.blocks_ready("t", [2, 3], 0.8)  # the forward ended: D reads the whole KV
    assert of(out, PostWrite) == [] and len(msgs(out, m.Fallback)) == 1
    assert of(s.poll(0.9), PostWrite) == []


def test_another_decode_is_pushed_to_while_one_is_being_connected() -> None:
    s = sender()
    s.blocks_ready("t", [1], 0.0)
    s.blocks_ready("u", [2], 0.0)
    s.on_message(register("t", blocks=[10]), 0.0)  # D: connecting
    out = s.on_message(register("u", blocks=[20], sender_info=D2), 0.0)
    assert of(out, PostWrite) == []  # D2 is being connected too
    (w,) = of(s.on_peer(D2.agent_name, "", 0.1), PostWrite)
    assert w.transfer_id == "u" and w.peer == D2.agent_name
    assert s.connecting(D.agent_name)


def test_an_answer_about_an_agent_p_no_longer_knows_changes_nothing() -> None:
    s = sender()
    assert s.on_peer("agent-nobody", "", 0.0) == []
    assert not s.connecting("agent-nobody")


def test_connects_made_off_the_pump_that_land_late_or_fail_break_no_invariant() -> None:
    """The stateful world, with P's connects to D made elsewhere: most land up to 4 s later,
    some fail. Transfers wait for them (D's heartbeats renewing their permits) or fall back
    to D's pull; each world checks every invariant (nothing written outside a permit, every
    request ends once on each side, nothing held). 16 worlds of 2 P x 2 D."""
    seen = worlds(Chaos(skew=True, connect_slow=0.7, connect_fail=0.3), 8, 0.05)
    assert seen.get("connect:slow", 0) > 0 and seen.get("connect:failed", 0) > 0
    assert seen.get("send:Fallback", 0) > 0  # a failed connect gave its transfers to D's pull


def test_connections_the_transport_closes_are_made_anew_and_break_no_invariant() -> None:
    """The stateful world with chunks failing (a fifth of them REMOTE_DISCONNECT, the rest
    retryable) and P's connects slow or failing: each closed connection is dropped by the
    driver and made anew, pushes go on over the new ones, and every invariant holds (nothing
    written outside a permit, every request ends once on each side, nothing held). 16
    worlds of 2 P x 2 D, 16 requests each."""
    seen = worlds(Chaos(skew=True, chunk_fail=0.3, connect_slow=0.5, connect_fail=0.1), 16, 0.3)
    lost = seen.get("note:connection_lost:", 0)
    assert lost > 0, seen
    assert seen.get("note:transfer_done:pushed", 0) > lost  # pushing went on after losses


def worlds(chaos: Chaos, requests: int, gap_s: float) -> dict[str, int]:
    """16 worlds of 2 P x 2 D under ``chaos``: ``requests`` each, ``gap_s`` apart, every
    pair in turn, then quiesced (each checks every invariant); their counts summed."""
    seen: dict[str, int] = {}
    for seed in range(16):
        w = World(2, 2, chaos, seed)
        w.run_until(0.5)
        for i in range(requests):
            p, d = w.nodes[f"P{i % 2}"], w.nodes[f"D{(i // 2) % 2}"]
            w.new_request(p, d, 1 + (seed + i) % 3, 0)
            w.run_until(w.now + gap_s)
        w.run_until(w.now + 40.0)
        w.quiesce()
        for k, n in w.stats.items():
            seen[k] = seen.get(k, 0) + n
    return seen


# ---------------------------------------------------------------- D's connect to P (a pull)
P2 = m.PeerInfo("P2", 4, 0, "tcp://p2:1", ag("agent-p2", "tcp://p2:1"), b"meta", LAYOUT)


def receiver() -> Receiver:
    return Receiver(D, replace(RS, await_connect=True), random.Random(0))


def fallback_to(
    r: Receiver, tid: str, blocks: list[int], ttl_ms: int = 30_000, p: m.PeerInfo = P
) -> m.Fallback:
    """D registers ``tid`` with ``p``; P's FALLBACK offers its blocks 1, 2, ... to read."""
    (reg,) = msgs(r.register(tid, p.control, blocks, 0, 300, 0.0), m.Register)
    theirs = list(range(1, len(blocks) + 1))
    return m.Fallback(1, tid, reg.generation, p, theirs, 0, "push_failed", ttl_ms)


def test_a_pull_waits_for_the_connection_to_the_prefill_then_reads() -> None:
    r = receiver()
    out = r.on_message(fallback_to(r, "t", [10, 11, 12]), 0.1)
    assert of(out, ConnectPeer) == [ConnectPeer(P)] and of(out, PostRead) == []
    assert of(r.tick(0.5), PostRead) == []  # nothing is read before the connection
    reads = of(r.on_peer(P.agent_name, "", 0.6), PostRead)
    assert [(x.local_blocks, x.remote_blocks) for x in reads] == [((10, 11), (1, 2))]
    (last,) = of(r.on_chunk(reads[0].chunk_id, True, "", 0.7), PostRead)
    out = r.on_chunk(last.chunk_id, True, "", 0.8)
    assert msgs(out, m.PullDone)[0].ok
    assert of(out, ReportFinished) == [ReportFinished("t", "pull_fallback", -1, (10, 11, 12))]


def test_a_connection_that_could_not_be_made_fails_the_pulls_waiting_for_it() -> None:
    r = receiver()
    r.on_message(fallback_to(r, "t", [10]), 0.1)
    r.on_message(fallback_to(r, "u", [20]), 0.2)
    out = r.on_peer(P.agent_name, "timed out after 10 s", 0.3)
    assert of(out, PostRead) == []
    assert sorted(f.transfer_id for f in of(out, ReportFailed)) == ["t", "u"]
    assert all(f.reason == "pull_failed" for f in of(out, ReportFailed))
    assert all("connect_failed: timed out after 10 s" in f.detail for f in of(out, ReportFailed))
    assert [d.ok for d in msgs(out, m.PullDone)] == [False, False]  # P may free its blocks
    assert r.on_peer(P.agent_name, "", 0.4) == []  # a late success finds nothing waiting


def test_a_pull_not_connected_when_the_read_permit_runs_out_fails() -> None:
    r = receiver()
    r.on_message(fallback_to(r, "t", [10], ttl_ms=2_000), 0.0)  # usable until 2 - stop margin
    assert of(r.tick(0.5), ReportFailed) == []
    out = r.tick(1.5)
    (failed,) = of(out, ReportFailed)
    assert failed.reason == "pull_failed" and "no connection" in failed.detail
    assert not msgs(out, m.PullDone)[0].ok
    assert of(r.on_peer(P.agent_name, "", 1.6), PostRead) == []  # too late: nothing is read


def test_a_pull_aborted_while_connecting_reads_nothing() -> None:
    r = receiver()
    r.on_message(fallback_to(r, "t", [10]), 0.1)
    out = r.abort("t", 0.2)
    assert of(out, ReportFinished) == [ReportFinished("t", "aborted")]
    assert not msgs(out, m.PullDone)[0].ok
    assert r.on_peer(P.agent_name, "", 0.3) == []


def test_a_pull_from_another_prefill_reads_while_one_is_being_connected() -> None:
    r = receiver()
    r.on_message(fallback_to(r, "t", [10]), 0.1)
    r.on_message(fallback_to(r, "u", [20], p=P2), 0.2)
    reads = of(r.on_peer(P2.agent_name, "", 0.3), PostRead)
    assert [x.transfer_id for x in reads] == ["u"]
    assert [x.transfer_id for x in of(r.on_peer(P.agent_name, "", 0.4), PostRead)] == ["t"]
