"""The trust rules of the core: a message speaks only for the engine whose key sent it
(``origin``), P writes only to what it connected to for that engine, generations are
unguessable, and what the network can make an engine remember is bounded."""

from __future__ import annotations

import random
from dataclasses import replace

import msgspec

from kvpush_prod.core import messages as m
from kvpush_prod.core.actions import (
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
from kvpush_prod.core.identity import agent_name as ag
from kvpush_prod.core.receiver import Receiver
from kvpush_prod.core.sender import Sender

from .test_push_engines import (
    LAYOUT,
    RS,
    SS,
    D,
    P,
    msgs,
    of,
    receiver,
    register,
    sender,
)

KD, KX, KP = D.control, "key-of-intruder", P.control
# An authenticated engine that is not the transfer's decode: it claims D's names.
X = msgspec.structs.replace(D, incarnation=99, agent_name=ag("agent-intruder", KX))


def notes(actions: list, reason: str) -> list[Note]:
    return [a for a in actions if isinstance(a, Note) and a.reason == reason]


# ------------------------------------------------------------------------------- prefill (P)


def test_a_register_from_an_engine_the_router_did_not_name_writes_nothing() -> None:
    s = sender()
    s.expect_blocks("t", 0.0, owner=KD)
    s.blocks_ready("t", [1, 2, 3], 0.0, owner=KD)
    out = s.on_message(register(sender_info=X), 0.0, origin=KX)
    assert of(out, PostWrite) == [] and notes(out, "not_owner")
    # The named decode still gets its push.
    writes = of(s.on_message(register(), 0.1, origin=KD), PostWrite)
    assert writes and {w.peer for w in writes} == {D.agent_name}


def test_the_write_target_is_the_agent_met_for_that_engine_not_a_name_in_the_message() -> None:
    s = sender()
    s.on_message(register(tid="a"), 0.0, origin=KD)
    # Same engine, same incarnation, now claiming another agent and a bigger layout.
    liar = msgspec.structs.replace(
        D,
        agent_name=ag("agent-elsewhere", KD),
        layout=m.Layout("c", "DRAM", [m.Region(0, 100, 100, 10_000)]),
    )
    s.blocks_ready("b", [1, 2, 3], 0.0)
    out = s.on_message(register(tid="b", blocks=[10, 11, 5000], sender_info=liar), 0.0, origin=KD)
    assert of(out, PostWrite) == []  # block 5000 is outside the layout P connected to
    assert msgs(out, m.Failed)[0].reason == "bad_blocks"
    s.blocks_ready("c", [1, 2, 3], 0.0)
    writes = of(s.on_message(register(tid="c", sender_info=liar), 0.0, origin=KD), PostWrite)
    assert writes and {w.peer for w in writes} == {D.agent_name}


def test_a_register_contested_before_the_owner_is_known_goes_to_the_one_the_router_named() -> None:
    s = sender()
    s.on_message(register(sender_info=X), 0.0, origin=KX)  # first come, not the owner
    s.on_message(register(), 0.0, origin=KD)
    out = s.expect_blocks("t", 0.0, owner=KD)
    assert notes(out, "not_owner")
    writes = of(s.blocks_ready("t", [1, 2, 3], 0.1, owner=KD), PostWrite)
    assert writes and {w.peer for w in writes} == {D.agent_name}


def test_heartbeat_cancel_and_pull_done_of_another_engine_change_nothing() -> None:
    s = sender()
    s.blocks_ready("t", [1, 2, 3], 0.0, owner=KD)
    (w1,) = of(s.on_message(register(), 0.0, origin=KD), PostWrite)
    intruder = {"origin": KX}
    assert notes(
        s.on_message(m.Cancel(m.PROTOCOL_VERSION, "t", 1, X, "aborted"), 0.1, **intruder),
        "not_owner",
    )
    hb = m.Heartbeat(m.PROTOCOL_VERSION, X, 1, [("t", 1)], 60_000)
    s.on_message(hb, 0.1, **intruder)
    assert s._out["t"].permit.expires_at == 5.0  # not renewed by the intruder
    done = m.PullDone(m.PROTOCOL_VERSION, "t", 1, X, True)
    assert notes(s.on_message(done, 0.1, **intruder), "not_owner")
    assert of(s.on_chunk(w1.chunk_id, True, "", 0.2), PostWrite)  # the push goes on


def test_a_cancel_from_another_engine_does_not_tombstone_the_owners_transfer() -> None:
    s = sender()
    s.on_message(m.Cancel(m.PROTOCOL_VERSION, "t", 0, X, "not_needed"), 0.0, origin=KX)
    s.blocks_ready("t", [1, 2, 3], 0.0, owner=KD)
    assert of(s.on_message(register(), 0.0, origin=KD), PostWrite)


def test_a_restart_announced_by_another_engine_does_not_retire_the_real_decode() -> None:
    s = sender()
    s.blocks_ready("t", [1, 2, 3], 0.0)
    s.on_message(register(), 0.0, origin=KD)
    # The intruder claims D's engine id and rank with a new incarnation: a peer of its own.
    out = s.on_message(
        register(tid="u", sender_info=msgspec.structs.replace(D, incarnation=7)), 0.0, origin=KX
    )
    assert not notes(out, "peer_restart")
    assert s._out["t"].outcome == ""


def test_an_incompatible_decode_layout_is_refused_at_once_without_connecting() -> None:
    s = sender()
    other = msgspec.structs.replace(
        D, layout=m.Layout("other-model", "DRAM", [m.Region(0, 100, 100, 64)])
    )
    out = s.on_message(register(sender_info=other), 0.0, origin=KD)
    assert of(out, ConnectPeer) == [] and notes(out, "incompatible")
    (failed,) = msgs(out, m.Failed)
    assert failed.reason == "incompatible" and "other-model" in failed.detail


def test_a_decode_layout_of_absurdly_many_blocks_is_refused() -> None:
    s = Sender(P, replace(SS, max_peer_blocks_ratio=2, min_peer_blocks_limit=100), random.Random(0))
    huge = msgspec.structs.replace(
        D, layout=m.Layout("c", "DRAM", [m.Region(0, 100, 100, 1_000_000)])
    )
    out = s.on_message(register(sender_info=huge), 0.0, origin=KD)
    assert of(out, ConnectPeer) == [] and "1000000 blocks" in notes(out, "incompatible")[0].detail


def test_replies_name_the_identity_they_must_reach() -> None:
    s = sender()
    s.blocks_ready("t", [1, 2, 3], 0.0)
    s.on_message(register(), 0.0, origin=KD)
    out = s.on_message(m.Cancel(m.PROTOCOL_VERSION, "t", 1, D, "aborted"), 0.1, origin=KD)
    assert {a.to for a in out if isinstance(a, SendMessage)} <= {KD}
    assert all(a.to == KD for a in s.tick(5.0) if isinstance(a, SendMessage))


def test_registers_for_unknown_transfers_are_bounded() -> None:
    s = Sender(P, replace(SS, max_transfers=3), random.Random(0))
    for i in range(3):
        s.on_message(register(tid=f"t{i}"), 0.0, origin=KD)
    assert notes(s.on_message(register(tid="t3"), 0.0, origin=KD), "overloaded")
    assert s.active == 3
    s.blocks_ready("mine", [1], 0.0)  # the engine's own requests always count
    assert s.active == 4


def test_tombstones_are_bounded() -> None:
    s = Sender(P, replace(SS, max_tombstones=10), random.Random(0))
    for i in range(100):
        s.on_message(m.Cancel(m.PROTOCOL_VERSION, f"x{i}", 0, D, "not_needed"), 0.0, origin=KD)
    assert len(s._tombstones) == 10


def test_peers_over_the_bound_are_forgotten_least_recently_used_first() -> None:
    s = Sender(P, replace(SS, max_peers=2), random.Random(0))
    dropped = []
    for i in range(4):
        peer = msgspec.structs.replace(
            D, agent_name=ag(f"agent-{i}", f"key-{i}"), incarnation=100 + i
        )
        out = s.on_message(register(tid=f"t{i}", sender_info=peer), 0.0, origin=f"key-{i}")
        dropped += [a.agent_name for a in of(out, DropPeer)]
    # t0..t3 still wait for blocks and use their agents: nothing in use is dropped.
    assert dropped == []
    for i in range(4):
        s.abort(f"t{i}", 0.0)
    out = s.on_message(
        register(
            tid="t9",
            sender_info=msgspec.structs.replace(D, agent_name=ag("agent-9", "k9"), incarnation=9),
        ),
        0.0,
        origin="k9",
    )
    assert {a.agent_name for a in of(out, DropPeer)} == {
        ag(f"agent-{i}", f"key-{i}") for i in range(3)
    }


def test_a_fallback_whose_reads_are_in_flight_is_not_ended_by_a_stale_expiry() -> None:
    # Found by the stateful test: a chunk that failed after the permit's cut-off expired the
    # transfer in the push scheduler; another chunk then gave the push up (FALLBACK) and the
    # stale expiry ended the transfer, freeing P's blocks under D's READs.
    s = sender()
    s.blocks_ready("t", [1, 2, 3, 4, 5], 0.0)
    c1, c2 = of(s.on_message(register(blocks=[10, 11, 12, 13, 14]), 0.0, origin=KD), PostWrite)
    s.on_chunk(c1.chunk_id, False, "ERR:nixlBackendError", 4.5)  # retry, past the cut-off
    out = s.on_chunk(c2.chunk_id, False, "ERR:NIXL_ERR_REMOTE_DISCONNECT", 4.6)
    assert msgs(out, m.Fallback)
    s.hold("t")
    assert of(s.poll(4.7) + s.tick(4.7), ReleaseSend) == []  # D may still READ
    assert of(
        s.on_message(m.PullDone(m.PROTOCOL_VERSION, "t", 1, D, True), 5.0, origin=KD), ReleaseSend
    ) == [ReleaseSend("t", "pull_fallback", 0)]


# ------------------------------------------------------------------------------- decode (D)


def expecting(r: Receiver, tid: str = "t") -> int:
    (reg,) = msgs(r.register(tid, "tcp://p:1", [10, 11, 12], 0, 300, 0.0, owner=KP), m.Register)
    return reg.generation


def test_notices_from_an_engine_that_does_not_own_the_transfer_change_nothing() -> None:
    r = receiver()
    gen = expecting(r)
    intruder = msgspec.structs.replace(P, incarnation=77)
    for msg in (
        m.Failed(m.PROTOCOL_VERSION, "t", gen, intruder, "x"),
        m.CancelAck(m.PROTOCOL_VERSION, "t", gen, intruder),
        m.Fallback(
            m.PROTOCOL_VERSION,
            "t",
            gen,
            msgspec.structs.replace(intruder, layout=LAYOUT),
            [1, 2, 3],
            0,
            "x",
        ),
    ):
        out = r.on_message(msg, 0.1, origin=KX)
        assert notes(out, "not_owner") and not of(out, ReportFailed) and not of(out, PostRead)
    assert r.active == 1
    done = r.on_message(m.Failed(m.PROTOCOL_VERSION, "t", gen, P, "x"), 0.2, origin=KP)
    assert of(done, ReportFailed)


def test_a_forged_restart_of_the_prefill_fails_nothing() -> None:
    r = receiver()
    gen = expecting(r)
    r.on_message(m.Heartbeat(m.PROTOCOL_VERSION, P, 2, [("t", gen)]), 0.1, origin=KP)
    forged = msgspec.structs.replace(P, incarnation=12345)
    out = r.on_message(m.Heartbeat(m.PROTOCOL_VERSION, forged, 2, []), 0.2, origin=KX)
    assert not of(out, ReportFailed) and r.active == 1
    # The real P's own key announcing a new process does fail it (a real restart).
    out = r.on_message(m.Heartbeat(m.PROTOCOL_VERSION, forged, 2, []), 0.3, origin=KP)
    assert of(out, ReportFailed)


def test_done_from_another_agent_than_the_prefills_is_rejected() -> None:
    r = receiver()
    gen = expecting(r)
    r.on_message(m.Heartbeat(m.PROTOCOL_VERSION, P, 2, [("t", gen)]), 0.1, origin=KP)
    done = m.Done(m.PROTOCOL_VERSION, "t", gen, 3)
    assert notes(r.on_done(done, 0.2, agent=ag("agent-intruder", KX)), "not_owner")
    assert of(r.on_done(done, 0.3, agent=P.agent_name), ReportFinished)


def test_generations_are_unguessable_with_a_token_source() -> None:
    gens = []
    for seed in range(2):
        r = Receiver(D, RS, random.Random(0), tokens=random.Random(seed))
        gens.append([expecting(r, f"t{i}") for i in range(3)])
    assert gens[0] != gens[1]
    assert all(g >= 1 << 32 for g in gens[0])  # random low bits above a counter
    assert gens[0] == sorted(gens[0])  # still ordered


def test_a_fallback_offering_a_foreign_layout_or_out_of_range_blocks_is_not_read() -> None:
    for layout, blocks in (
        (m.Layout("other", "DRAM", [m.Region(0, 100, 100, 64)]), [1, 2, 3]),
        (LAYOUT, [1, 2, 64]),
    ):
        r = receiver()
        gen = expecting(r)
        fb = m.Fallback(
            m.PROTOCOL_VERSION, "t", gen, msgspec.structs.replace(P, layout=layout), blocks, 0, "x"
        )
        out = r.on_message(fb, 0.1, origin=KP)
        assert of(out, PostRead) == [] and of(out, ReportFailed)


def test_prefill_ranks_heard_are_bounded() -> None:
    r = Receiver(D, replace(RS, max_peers=5), random.Random(0))
    for i in range(50):
        r.on_message(
            m.Heartbeat(
                m.PROTOCOL_VERSION, msgspec.structs.replace(P, rank=i % 60000, incarnation=i), 0, []
            ),
            0.0,
            origin=f"k{i}",
        )
    assert len(r._peers) == 5 and len(r._heard) == 5


def test_an_agent_name_not_named_for_the_senders_key_is_refused_even_before_its_owner_came() -> (
    None
):
    # Found by the stateful attacker: first to announce the decode's agent name, an intruder
    # squatted it, so the real decode could no longer connect and P wrote the intruder's
    # (unnamed) transfer into the real decode's memory.
    s = sender()
    s.blocks_ready("t", [1, 2, 3], 0.0)
    squat = msgspec.structs.replace(D, incarnation=55)  # D's agent name, the intruder's key
    out = s.on_message(register(sender_info=squat), 0.0, origin=KX)
    assert of(out, ConnectPeer) == [] and notes(out, "not_owner")
    writes = of(s.on_message(register(), 0.1, origin=KD), PostWrite)
    assert writes and {w.peer for w in writes} == {D.agent_name}


def test_done_and_fallback_from_an_agent_not_named_for_the_prefills_key_are_refused() -> None:
    r = receiver()
    gen = expecting(r)  # no heartbeat yet: D does not know P's agent, the name still binds
    done = m.Done(m.PROTOCOL_VERSION, "t", gen, 3)
    assert notes(r.on_done(done, 0.1, agent=ag("agent-p", KX)), "not_owner")
    fb = m.Fallback(
        m.PROTOCOL_VERSION,
        "t",
        gen,
        msgspec.structs.replace(P, agent_name=ag("agent-p", KX)),
        [1, 2, 3],
        0,
        "x",
    )
    out = r.on_message(fb, 0.2, origin=KP)
    assert of(out, PostRead) == [] and of(out, ReportFailed)
