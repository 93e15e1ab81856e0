"""What the attacker in the simulated world found in the trust rules, each as the smallest
event sequence that shows it: regression tests of the fixes, every one of them fixed.

A finding still open (of this attacker or of one that holds a key of its own) is a flag set in
sim_world.KNOWN_BUGS, which keeps the world's attacker off that one move, and a strict xfail
in a ``test_*findings.py`` module of this package whose reason names the flag; the last test
holds that rule.

The attacker holds no engine's key: its messages come with an identity of its own
(``origin``), but it may claim anything in them (engine id, rank, address, incarnation,
NIXL agent name)."""

from __future__ import annotations

import importlib
import random
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest

from kvpush_prod.core import messages as m
from kvpush_prod.core.actions import ConnectPeer, PostWrite, ReleaseSend, ReportFailed
from kvpush_prod.core.identity import agent_name as ag
from kvpush_prod.core.receiver import Receiver
from kvpush_prod.core.sender import Sender

from .sim_world import KNOWN_BUGS
from .test_push_engines import RS, SS, D, P, msgs, of, register, sender

KD, KP, KA = D.control, P.control, "key-of-attacker"


def hb(info: m.PeerInfo, live: list[tuple[str, int]] | None = None) -> m.Heartbeat:
    return m.Heartbeat(m.PROTOCOL_VERSION, info, 0, live or [], 3000)


# ------------------------------------------------------------------ agent names (P)
# P keyed its peers by (origin, rank) but took their NIXL agent name from what the message
# claimed, and matched transfers and connections by that name alone. Now an agent name is
# named for its engine's key (core.identity) and belongs to the first rank P met with it.


def test_a_restart_under_another_key_that_claims_the_decodes_agent_fails_nothing_of_it() -> None:
    s = sender()
    s.blocks_ready("t", [1, 2, 3], 0.0, owner=KD)
    (w1,) = of(s.on_message(register(), 0.0, origin=KD), PostWrite)
    assert w1.peer == D.agent_name
    # The attacker claims D's engine, address and agent name under its own key, then a
    # "restart" of that entry (a new incarnation).
    s.on_message(hb(replace_inc(D, 500)), 0.1, origin=KA)
    out = s.on_message(hb(replace_inc(D, 501)), 0.2, origin=KA)
    assert not any(isinstance(a, ConnectPeer) and a.replaces == D.agent_name for a in out)
    assert s._out["t"].outcome == "" and s._out["t"].drain_then == ""
    # The push goes on.
    assert of(s.on_chunk(w1.chunk_id, True, "", 0.3), PostWrite)


def test_a_register_under_another_key_never_makes_p_write_into_a_decode_met_for_another() -> None:
    s = sender()
    s.blocks_ready("t", [1, 2, 3], 0.0, owner=KD)
    assert of(s.on_message(register(), 0.0, origin=KD), PostWrite)  # P connected agent-d
    s.blocks_ready("u", [4, 5], 0.0)  # a router that names no decode: first come binds
    out = s.on_message(
        register(tid="u", blocks=[0, 1], sender_info=replace_inc(D, 500)), 0.1, origin=KA
    )
    assert [w for w in of(out, PostWrite) if w.peer == D.agent_name] == []


def replace_inc(info: m.PeerInfo, inc: int) -> m.PeerInfo:
    return msgspec.structs.replace(info, incarnation=inc)


# ------------------------------------------------------------------ tombstones (P)


def test_a_cancel_under_another_key_does_not_replace_ps_own_tombstone() -> None:
    s = sender()
    s.expect_blocks("t", 0.0, owner=KD)
    s.abort("t", 0.1)  # P's request ended: a late REGISTER must hear prefill_aborted
    s.on_message(m.Cancel(m.PROTOCOL_VERSION, "t", 0, D, "forged"), 0.2, origin=KA)
    out = s.on_message(register(), 0.3, origin=KD)
    assert [f.reason for f in msgs(out, m.Failed)] == ["prefill_aborted"]


def test_a_cancel_under_another_key_does_not_replace_the_owners_tombstone() -> None:
    s = sender()
    s.expect_blocks("t", 0.0, owner=KD)
    s.on_message(m.Cancel(m.PROTOCOL_VERSION, "t", 0, D, "not_needed"), 0.1, origin=KD)
    s.on_message(m.Cancel(m.PROTOCOL_VERSION, "t", 0, D, "forged"), 0.2, origin=KA)
    s.blocks_ready("t", [1, 2, 3], 0.3, owner=KD)
    assert s.hold("t") == [ReleaseSend("t", "cancelled", 0)]


# ------------------------------------------------------------------ bounded directories (D)


def test_another_keys_ranks_do_not_make_a_late_message_of_a_replaced_prefill_free_blocks() -> None:
    r = Receiver(D, replace(RS, max_peers=2), random.Random(0))
    new = msgspec.structs.replace(P, incarnation=7, agent_name=ag("agent-p-7", KP))
    r.on_message(hb(P), 0.0, origin=KP)
    r.on_message(hb(new), 0.1, origin=KP)  # P restarted: its incarnation 1 is retired
    (reg,) = msgs(r.register("t", P.control, [10, 11, 12], 0, 300, 0.2, owner=KP), m.Register)
    r.on_message(hb(new, [("t", reg.generation)]), 0.3, origin=KP)  # held by process 7
    for rank in (1, 2):  # the attacker's own key, two ranks: P's entry is pushed out
        r.on_message(hb(msgspec.structs.replace(P, rank=rank)), 0.4, origin=KA)
    out = r.on_message(hb(P), 0.5, origin=KP)  # a late heartbeat of process 1
    assert of(out, ReportFailed) == []
    assert not r.leases.reusable("t", 0.5)


# ------------------------------------------------------------------ liveness (P)


def test_registers_of_other_keys_before_the_request_do_not_lock_out_the_named_decode() -> None:
    # Before the prefill leg names the decode, REGISTERs of other keys (each with an agent
    # of its own) bind and fill the contenders; the latest are kept, so the named decode's
    # REGISTER, which comes after them, is not dropped.
    s = Sender(P, SS, random.Random(0))
    for i in range(1 + SS.max_contenders):
        other = msgspec.structs.replace(
            replace_inc(D, 100 + i), agent_name=ag(f"agent-{i}", f"key-{i}")
        )
        s.on_message(register(sender_info=other), 0.0, origin=f"key-{i}")
    s.on_message(register(), 0.1, origin=KD)  # the decode leg outran the prefill leg
    s.expect_blocks("t", 0.2, owner=KD)
    writes = of(s.blocks_ready("t", [1, 2, 3], 0.3, owner=KD), PostWrite)
    assert writes and {w.peer for w in writes} == {D.agent_name}


# ------------------------------------------------------------------ what is still open


def _xfails() -> list[tuple[str, pytest.Mark]]:
    """(module.test, mark) for every xfail of the findings modules of this package."""
    out = []
    for path in sorted(Path(__file__).parent.glob("test_*findings.py")):
        module = importlib.import_module(f"{__package__}.{path.stem}")
        for name, fn in sorted(vars(module).items()):
            if name.startswith("test_"):
                out += [
                    (f"{path.stem}.{name}", mark)
                    for mark in getattr(fn, "pytestmark", [])
                    if mark.name == "xfail"
                ]
    return out


def test_every_open_finding_is_a_strict_xfail_naming_its_flag() -> None:
    xfails = _xfails()
    assert [name for name, mark in xfails if mark.kwargs.get("strict") is not True] == []
    reasons = " ".join(str(mark.kwargs.get("reason", "")) for _, mark in xfails)
    open_flags = [flag for flag, is_open in KNOWN_BUGS.items() if is_open]
    assert [flag for flag in open_flags if flag not in reasons] == [], (
        "a KNOWN_BUGS flag is set with no strict xfail naming it in a test_*findings.py module"
    )
