"""What the intruder of the stateful test (an engine with a valid key of its own, owner of
no transfer) found in P's handling of REGISTERs that arrive before P knows a transfer's
decode, each as the smallest event sequence on the core alone. Written as strict xfails
naming each finding; P now keeps the contenders (the registrant withdraws alone, their
permits are listed and renewed, an unclaimed registration's tombstone is its key's), so
they are regression tests of those fixes (sim_world.KNOWN_BUGS: the three flags are off).

- registrant_drops_contenders: the end of a transfer's first registration (its registrant's
  CANCEL, PullDone, incompatible REGISTER or restart, or its permit running out) dropped
  the named decode's REGISTER that P kept as a contender: the transfer was never pushed.
- contenders_not_renewed: P neither listed a contender's registration in its heartbeats nor
  took its decode's renewals: a prefill leg later than the decode's first permit term bound
  the named decode with a dead permit and the transfer failed.
- expired_registration_tombstones: a REGISTER for an id P had no request for, whose permit
  ran out, left P's own tombstone on the id: the router-named decode's REGISTER for the
  request that came later was answered prefill_aborted and P freed the blocks unpushed.

Two more came from the first version of those fixes (2026-12-02), fixed since (regression
tests too; their sim_world.KNOWN_BUGS flags are off):

- contender_zero_ttl: a REGISTER with a permit of 0 ms from a second key, kept as a
  contender, raised ProtocolError out of ``Sender.on_message`` (the contender's permit was
  built before the ``bad_permit`` refusal).
- contenders_outlive_bound: once the first registrant of an id P has no request for
  withdrew, the fresh transfer that kept the contenders lived as long as their permits (a
  day, or for ever while a contender renewed its own): the whole-transfer bound no longer
  ended it.

The first three need the decode leg to outrun the prefill leg (D's REGISTER reaches P before
P's request names its decode: the router sends both legs at once and P's scheduler may take
seconds), and the intruder to REGISTER the transfer id first. P then binds the intruder's
REGISTER and keeps the named decode's as a contender until the prefill leg names it. The
third needs the intruder to know a transfer id before the router sends its request (ids a
client or a third-party router chooses; the kvpush router's are random).
"""

from __future__ import annotations

import random

import msgspec
import pytest

from kvpush_prod.core import messages as m
from kvpush_prod.core.actions import Note, PostWrite, SendMessage
from kvpush_prod.core.identity import agent_name as ag
from kvpush_prod.core.sender import Sender

from .test_push_engines import SS, D, P, of, register

KD, KI = D.control, "key-of-the-intruder"
INTRUDER = msgspec.structs.replace(
    D,
    engine_id="intruder",
    incarnation=77,
    control="tcp://intruder:1",
    agent_name=ag("agent-intruder", KI),
)


def registered_first(ttl_ms: int = 5000) -> Sender:
    """The intruder registered ``t`` first; the decode's REGISTER is kept as a contender."""
    s = Sender(P, SS, random.Random(0))
    s.on_message(
        register(sender_info=INTRUDER, gen=5, blocks=[0, 1, 2], ttl_ms=ttl_ms), 0.0, origin=KI
    )
    s.on_message(register(), 0.1, origin=KD)
    o = s._out["t"]
    assert o.owner == KI and KD in o.contenders  # the setting the findings need
    return s


def ends_it(s: Sender, how: str) -> None:
    """The intruder's registration of the transfer it registered first ends, ``how``."""
    v = m.PROTOCOL_VERSION
    if how == "cancel":
        s.on_message(m.Cancel(v, "t", 0, INTRUDER, "gone"), 0.2, origin=KI)
    elif how == "pull_done":
        s.on_message(m.PullDone(v, "t", 5, INTRUDER, False), 0.2, origin=KI)
    elif how == "lapses":  # sends nothing more: its permit (1.5 s) runs out
        s.tick(1.0)
    elif how == "incompatible":
        other = m.Layout("another-model", "DRAM", [m.Region(0, 100, 100, 8)])
        again = msgspec.structs.replace(INTRUDER, incarnation=78, layout=other)
        s.on_message(register(sender_info=again, gen=6), 0.2, origin=KI)
    else:  # its process restarted: a new incarnation of its own rank
        again = msgspec.structs.replace(
            INTRUDER, incarnation=78, agent_name=ag("agent-intruder-2", KI)
        )
        s.on_message(m.Heartbeat(v, again, 0, [], 3000), 0.2, origin=KI)


def test_the_named_decode_kept_as_a_contender_is_pushed_when_its_leg_names_it() -> None:
    # Registering first alone takes nothing from the named decode.
    s = registered_first()
    s.expect_blocks("t", 0.3, owner=KD)
    writes = of(s.blocks_ready("t", [1, 2, 3], 0.4, owner=KD), PostWrite)
    assert writes and {w.peer for w in writes} == {D.agent_name}


@pytest.mark.parametrize("how", ["cancel", "pull_done", "incompatible", "restart", "lapses"])
def test_the_first_registrant_ending_a_transfer_keeps_the_named_decodes_register(how: str) -> None:
    # registrant_drops_contenders
    s = registered_first(ttl_ms=1500 if how == "lapses" else 5000)
    ends_it(s, how)
    # The prefill leg comes, naming the decode; its REGISTER (a 5 s term) is still good.
    s.expect_blocks("t", 1.1, owner=KD)
    writes = of(s.blocks_ready("t", [1, 2, 3], 1.2, owner=KD), PostWrite)
    assert writes and {w.peer for w in writes} == {D.agent_name}


def test_p_lists_a_contenders_registration_in_its_heartbeats() -> None:
    # contenders_not_renewed
    # D renews a permit only while P lists the transfer (or for its first peer timeout): P
    # must list the decode's registration it keeps, or D lets the permit run out.
    s = registered_first()
    out = s.tick(1.0)
    listed = [
        e
        for a in out
        if isinstance(a, SendMessage) and a.to == KD and isinstance(a.message, m.Heartbeat)
        for e in a.message.live
    ]
    assert ("t", 1) in listed


def test_a_contenders_permit_renewed_by_its_decode_is_the_one_p_binds() -> None:
    # contenders_not_renewed
    s = registered_first()
    # D renews the permit (5 s terms) every second while it waits for the push.
    for t in range(1, 7):
        s.on_message(
            m.Heartbeat(m.PROTOCOL_VERSION, D, P.incarnation, [("t", 1)], 5000), float(t), origin=KD
        )
    # The prefill leg comes at 6.5 s, after the REGISTER's own term (5.1 s), within D's.
    s.expect_blocks("t", 6.5, owner=KD)
    writes = of(s.blocks_ready("t", [1, 2, 3], 6.6, owner=KD), PostWrite)
    assert writes and {w.peer for w in writes} == {D.agent_name}


def test_an_expired_registration_of_another_key_does_not_cancel_the_request_to_come() -> None:
    # expired_registration_tombstones
    s = Sender(P, SS, random.Random(0))
    # The intruder registers an id the router has not used yet (a 5 s permit), and lets it
    # run out before any request of that id reaches P.
    s.on_message(register(sender_info=INTRUDER, gen=5), 0.0, origin=KI)
    s.tick(4.5)
    # The router sends the request, naming the decode; the decode registers it.
    s.expect_blocks("t", 5.0, owner=KD)
    out = s.on_message(register(), 5.0, origin=KD)
    assert not [a for a in out if isinstance(a, SendMessage) and isinstance(a.message, m.Failed)]
    writes = of(s.blocks_ready("t", [1, 2, 3], 5.1, owner=KD), PostWrite)
    assert writes and {w.peer for w in writes} == {D.agent_name}


def test_an_expired_registration_of_the_decode_itself_still_frees_the_blocks_to_come() -> None:
    # What the fix keeps: the named decode's own permit ran out before P's blocks came
    # (D fails the receive itself): the blocks are freed unpushed when they come.
    s = Sender(P, SS, random.Random(0))
    s.expect_blocks("t", 0.0, owner=KD)
    s.on_message(register(), 0.0, origin=KD)
    s.tick(4.5)
    assert not of(s.blocks_ready("t", [1, 2, 3], 5.1, owner=KD), PostWrite)


KX = "key-of-another-engine"
ANOTHER = msgspec.structs.replace(
    D,
    engine_id="another",
    incarnation=88,
    control="tcp://another:1",
    agent_name=ag("agent-another", KX),
)


def test_a_contenders_register_with_no_permit_is_refused_not_raised() -> None:
    s = Sender(P, SS, random.Random(0))
    s.on_message(register(sender_info=INTRUDER, gen=5), 0.0, origin=KI)
    out = s.on_message(register(sender_info=ANOTHER, gen=6, ttl_ms=0), 0.1, origin=KX)
    assert [a.reason for a in out if isinstance(a, Note)] == ["bad_permit"]


def test_a_transfer_kept_only_for_contenders_ends_within_the_transfer_bound() -> None:
    s = Sender(P, SS, random.Random(0))
    s.on_message(register(sender_info=INTRUDER, gen=5, ttl_ms=1500), 0.0, origin=KI)
    s.on_message(register(sender_info=ANOTHER, gen=6, ttl_ms=86_400_000), 0.1, origin=KX)
    s.tick(2.0)  # the intruder's term ended at 1.5 s: it withdraws, the contender stays
    s.tick(SS.timeouts.total_s + 10.0)
    assert "t" not in s._out
