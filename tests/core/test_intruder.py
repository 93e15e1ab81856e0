"""The intruder in deterministic worlds: an engine with a valid key of its own
(sim_world.INTRUDER_KEY) that owns no transfer, knows every transfer id, every engine's
control address, engine id, agent name and incarnation, and the generations it was told or
that leaked. What it cannot do to a transfer whose decode the router named (every message
it can send is refused and the transfer is pushed as if it were not there), and what it can
do to one where the router names no decode (P's first REGISTER binds it, documented in
docs/security.md): take the prompt's KV, or cancel the push, after which D recomputes."""

from __future__ import annotations

import pytest

from kvpush_prod.core.vocabulary import Outcome

from .sim_world import INTRUDER_KINDS, Chaos, Move, World

CLAIMS = (
    "self",
    "self_new",
    "victim",
    "victim_new",
    "victim_dp",
    "victim_agent",
    "slim",
    "foreign",
)


def detail(**want: object) -> int:
    """The smallest ``Move.detail`` that picks ``want`` (see ``Move.details``)."""
    return next(
        d
        for d in range(1 << 16)
        if all(Move("Register", detail=d).details()[k] == v for k, v in want.items())
    )


# Plain; the decode's reserved blocks; another transfer's; out of range from rank 1; an
# endless permit term; a permit of 0 and of 1 ms; rank 3 stamped 5 s ago; PullDone not ok
# (DoneState "gone") naming attempt 1; a heartbeat listing three transfers, stamped 5 s
# ahead.
DETAILS = (
    detail(),
    detail(blocks="victim"),
    detail(blocks="other"),
    detail(blocks="wild", rank=1),
    detail(ttl_ms=86_400_000),
    detail(ttl_ms=0),
    detail(ttl_ms=1),
    detail(rank=3, clock="past"),
    detail(flag=False, attempt=1),
    detail(entries=3, clock="future"),
)


def pushing_world(seed: int, named: float = 1.0) -> tuple[World, list[str]]:
    """Two P and two D, one request per pair, each pushing on a crawling link."""
    w = World(2, 2, Chaos(skew=True), seed)
    w.named_share = named
    w.run_until(0.5)
    pairs = (("P0", "D0"), ("P1", "D1"))
    for p, d in pairs:
        w.slow_down(p, d, 30.0)
    tids = [w.new_request(w.nodes[p], w.nodes[d], 8, 0) for p, d in pairs]
    while not all(any(f.tid == t for f in w.flights.values()) for t in tids):
        w.run_until(w.now + 0.01)
        assert w.now < 10.0, "the pushes never started"
    return w, tids


@pytest.mark.parametrize("seed", range(2))
def test_no_message_of_the_intruder_changes_a_transfer_whose_decode_the_router_named(
    seed: int,
) -> None:
    w, tids = pushing_world(seed)
    for kind in INTRUDER_KINDS:
        for claim in CLAIMS:
            for gen in ("current", "observed", "random"):
                for detail in DETAILS:
                    for to in ("natural", "other"):
                        mv = Move(kind, to, "live", claim, gen, 0.0, detail)
                        for name, tid in w.live_transfers():
                            w.intrude(w.nodes[name], tid, mv)
    assert w.stats["attack:delivered"] >= 10_000
    assert w.stats["attack:note:rejected:not_owner"] >= 1_000
    assert w.stats["intruder:sent:D:Done"] >= 500
    w.run_until(w.now + 30.0)
    w.quiesce()
    w.check_outcomes()  # both pushed, with P's bytes
    assert w.stats["outcome:named:pushed"] == 2 and not w.intruder.kv


def test_a_register_of_the_intruder_after_the_prefill_leg_named_the_decode_is_refused() -> None:
    w = World(1, 1, Chaos(skew=False), 0)
    w.named_share = 1.0
    w.run_until(0.5)
    p, d = w.nodes["P0"], w.nodes["D0"]
    tid = w.new_request(p, d, 4, 0)
    while p.preqs[tid].state == "coming":
        w.run_until(w.now + 0.01)
    for blocks in (0, 3, 4):  # its own blocks, the decode's reserved ones, another's
        w.intrude(p, tid, Move("Register", detail=blocks))
    w.run_until(w.now + 30.0)
    w.quiesce()
    w.check_outcomes()
    assert w.stats["attack:note:rejected:not_owner"] == 3 and not w.intruder.kv


def unnamed_world() -> tuple[World, str]:
    """A router that names no decode to P (P's first REGISTER binds the transfer)."""
    w = World(1, 1, Chaos(skew=False), 3)
    w.named_share = 0.0
    w.run_until(0.5)
    return w, w.new_request(w.nodes["P0"], w.nodes["D0"], 4, 0)


def test_where_the_router_names_no_decode_the_intruder_registering_first_takes_the_kv() -> None:
    # The documented limitation, as it plays out: P writes the prompt's KV into the
    # intruder's memory, the real decode's REGISTER is refused, its permit runs out and D
    # computes the prompt itself. Nothing of another transfer moves.
    w, tid = unnamed_world()
    w.intrude(w.nodes["P0"], tid, Move("Register"))
    w.run_until(w.now + 30.0)
    w.quiesce()
    w.check_outcomes()
    assert w.intruder.kv == {tid}
    assert list(w.released.values()) == [Outcome.PUSHED]
    assert list(w.reported.values()) == ["ReportFailed(permit_expired)"]


def test_where_the_router_names_no_decode_the_intruder_can_cancel_the_push() -> None:
    # Before any REGISTER binds the transfer, a CANCEL of any key stands for it: P frees
    # its blocks unpushed and D computes the prompt itself.
    w, tid = unnamed_world()
    p = w.nodes["P0"]
    p.preqs[tid].arrive_at = p.preqs[tid].compute_at = w.now  # P computes before D registers
    w.p_step(p)
    w.intrude(p, tid, Move("Cancel", gen="zero"))
    w.run_until(w.now + 30.0)
    w.quiesce()
    w.check_outcomes()
    assert not w.intruder.kv
    assert list(w.released.values()) == [Outcome.CANCELLED]
    assert list(w.reported.values()) == ["ReportFailed(permit_expired)"]
