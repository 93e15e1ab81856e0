"""The simulated world's own checks bite: its stale-generation, dead-process and forgery
checks find what they look for in the engines (keyed as the core keys them), and catch an
engine that acts on what it should refuse; the checks that found the intruder's findings
catch what they look for, and P's write target is checked."""

from __future__ import annotations

from typing import Any

import pytest

from kvpush_prod.core.actions import PostWrite

from .sim_world import KNOWN_BUGS, Attack, Chaos, Move, Violation, World, intruder_agent

KINDS = [
    "Failed",
    "CancelAck",
    "Fallback",
    "Done",
    "Register",
    "Cancel",
    "PullDone",
    "Heartbeat",
    "DoneQuery",
    "DoneState",
]


def pushing_world(seed: int) -> tuple[World, str]:
    """One P and one D, a request whose push crawls (so it stays live for a while)."""
    w = World(1, 1, Chaos(skew=True), seed)
    w.run_until(0.5)
    w.slow_down("P0", "D0", 30.0)
    tid = w.new_request(w.nodes["P0"], w.nodes["D0"], 8, 0)
    while not (w.stale_candidates("D") and w.stale_candidates("P")):
        w.run_until(w.now + 0.01)
        assert w.now < 5.0, "the transfer never got registered on both sides"
    return w, tid


@pytest.mark.parametrize("seed", range(5))
def test_stale_generations_are_checked_on_both_sides(seed: int) -> None:
    w, tid = pushing_world(seed)
    for role in ("D", "P"):
        for kind in KINDS:
            for shift in (-2, -1, 1, 4):
                cands = w.stale_candidates(role)
                if cands:
                    w.deliver_stale(cands[0], kind, shift)
    assert w.stats.get("rule:stale", 0) >= 40
    assert w.stats.get("stale_checked", 0) >= 30  # the DONEs are checked in deliver_notif
    assert w.stats.get("note:fenced:stale_generation", 0) >= 30
    w.run_until(w.now + 30.0)
    w.quiesce()


def test_generations_in_the_world_are_unguessable() -> None:
    w, tid = pushing_world(0)
    gen = w.nodes["D0"].engine._in[tid].generation
    assert gen >= 1 << 32  # a counter above 32 random bits
    assert w.nodes["P0"].engine._out[tid].reg.generation == gen


def test_a_stale_message_that_changes_state_is_caught(monkeypatch: Any) -> None:
    w, tid = pushing_world(0)
    d = w.nodes["D0"]
    real = d.engine.on_message

    def careless(msg: Any, now: float, age: float = 0.0, origin: str = "") -> Any:
        d.engine._in[tid].renew = False  # acts on whatever arrives
        return real(msg, now, age, origin)

    monkeypatch.setattr(d.engine, "on_message", careless)
    with pytest.raises(Violation, match="stale generation"):
        w.deliver_stale(w.stale_candidates("D")[0], "Failed", 1)


def restarted_world(seed: int, who: str) -> World:
    """``who`` crashed and came back; its peer heard the new incarnation."""
    w = World(1, 1, Chaos(skew=True), seed)
    p, d = w.nodes["P0"], w.nodes["D0"]
    w.slow_down("P0", "D0", 60.0)  # pushes long enough for both sides to heartbeat
    w.new_request(p, d, 8, 0)
    w.run_until(3.0)
    w.crash(w.nodes[who])
    w.run_until(w.now + 0.1)
    w.start(w.nodes[who])
    w.new_request(p, d, 8, 0)  # the peer meets the new process (REGISTER or heartbeats)
    while not w.dead_candidates():
        w.run_until(w.now + 0.05)
        assert w.now < 15.0, "the restart was never noticed"
    return w


@pytest.mark.parametrize("who", ["P0", "D0"])
@pytest.mark.parametrize("seed", range(3))
def test_messages_of_dead_processes_are_checked_on_both_sides(seed: int, who: str) -> None:
    w = restarted_world(seed, who)
    for kind in ("heartbeat", "notice"):
        for cand in w.dead_candidates():
            w.deliver_from_dead(cand, kind)
    assert w.stats.get("rule:dead", 0) >= 2
    w.run_until(w.now + 30.0)
    w.quiesce()


def test_a_message_of_a_dead_process_that_is_acted_on_is_caught(monkeypatch: Any) -> None:
    w = restarted_world(0, "P0")
    (r, peer, inc), *_ = w.dead_candidates()
    eng = w.nodes[r].engine
    real = eng.on_message

    def careless(msg: Any, now: float, age: float = 0.0, origin: str = "") -> Any:
        eng._peers.clear()  # forgets who it knows
        return real(msg, now, age, origin)

    monkeypatch.setattr(eng, "on_message", careless)
    with pytest.raises(Violation, match="dead incarnation"):
        w.deliver_from_dead((r, peer, inc), "heartbeat")


# ------------------------------------------------------------------ the attacker


def every_attack() -> list[Attack]:
    return [
        Attack(kind, forger, claim, guess, "live", layout=layout)
        for kind in range(7)
        for forger in ("attacker", "engine")
        for claim in ("owner", "owner_new", "own")
        for guess in ("current", "random")
        for layout in ("full", "slim")
    ]


@pytest.mark.parametrize("seed", range(3))
def test_forgeries_of_every_kind_about_a_live_transfer_are_refused(seed: int) -> None:
    w = World(2, 2, Chaos(skew=True), seed)
    w.run_until(0.5)
    for p, d in (("P0", "D0"), ("P1", "D1")):
        w.slow_down(p, d, 30.0)
    tids = [w.new_request(w.nodes[p], w.nodes[d], 8, 0) for p, d in (("P0", "D0"), ("P1", "D1"))]
    while not all(t in w.nodes["D0"].engine._in or t in w.nodes["D1"].engine._in for t in tids):
        w.run_until(w.now + 0.01)
    w.run_until(w.now + 0.2)  # P heard the REGISTERs: pushing
    for a in every_attack():
        for name, tid in w.live_transfers():
            w.attack(w.nodes[name], tid, a)
    assert w.stats["attack:delivered"] >= 300
    assert w.stats["attack:note:rejected:not_owner"] >= 50
    assert w.stats.get("attack:note:fenced:stale_generation", 0) > 0  # guessed DONEs
    w.run_until(w.now + 30.0)
    w.quiesce()
    assert w.stats["report:ReportFinished(pushed)"] == 2  # the attacks changed nothing


def test_an_engine_restarted_under_its_own_key_may_end_what_its_dead_process_held() -> None:
    # Found at 3000 x 150: P0 restarts; its first message D0 hears from the new process is
    # one "forged" about P1's transfer under P0's own key. D0 rightly fails what P0's dead
    # process held (P0's own receive), and must touch nothing of P1's.
    w = World(2, 1, Chaos(skew=False), 0)
    w.run_until(0.5)
    for p in ("P0", "P1"):
        w.slow_down(p, "D0", 60.0)
    t0 = w.new_request(w.nodes["P0"], w.nodes["D0"], 8, 0)
    t1 = w.new_request(w.nodes["P1"], w.nodes["D0"], 8, 0)
    d = w.nodes["D0"].engine
    while not all(t in d._in and d._in[t].p_incarnation is not None for t in (t0, t1)):
        w.run_until(w.now + 0.05)
        assert w.now < 10.0, "the pushes never started"
    w.crash(w.nodes["P0"])
    w.run_until(w.now + 0.1)
    w.start(w.nodes["P0"])
    w.attack(w.nodes["D0"], t1, Attack(0, "engine", "owner", "current", "live"))
    assert w.stats["report:ReportFailed(peer_restarted)"] == 1 and t0 not in d._in
    assert t1 in d._in
    w.run_until(w.now + 90.0)
    w.quiesce()


def test_a_forgery_that_is_acted_on_is_caught(monkeypatch: Any) -> None:
    w, tid = pushing_world(0)
    d = w.nodes["D0"]
    real = d.engine.on_message

    def trusting(msg: Any, now: float, age: float = 0.0, origin: str = "") -> Any:
        return real(msg, now, age, origin=d.engine._in[tid].owner)  # believes any claim

    monkeypatch.setattr(d.engine, "on_message", trusting)
    with pytest.raises(Violation, match="forged Failed from attacker was acted on"):
        w.attack(d, tid, Attack(1, "attacker", "owner", "current", "live"))


def test_a_reply_reaches_only_the_identity_it_names() -> None:
    w, tid = pushing_world(0)
    # A CANCEL for an id P does not hold, claiming D0's address under the attacker's key:
    # P acks it to that address, but only the attacker's own channel could take it.
    w.attack(w.nodes["P0"], "x-bogus", Attack(3, "attacker", "owner", "zero", "bogus"))
    assert w.stats["attack:action:SendMessage"] == 1
    assert w.stats["send:refused:CancelAck"] == 1


# ------------------------------------------------------------------ the intruder


def named_request_with_a_late_prefill_leg(lag: float) -> tuple[World, str]:
    """A calm world; the router names D0 to P0, and the prefill leg reaches P0 ``lag``
    seconds after the decode leg reached D0."""
    w = World(1, 1, Chaos(skew=False), 2)
    w.named_share = 1.0
    w.run_until(0.5)
    p = w.nodes["P0"]
    tid = w.new_request(p, w.nodes["D0"], 2, 0)
    p.preqs[tid].arrive_at = w.now + lag
    p.preqs[tid].compute_at = w.now + lag + 0.1
    return w, tid


@pytest.mark.parametrize("lag", [0.0, 1.0, 3.0])
def test_the_intruder_registering_ahead_of_the_named_decode_changes_nothing(lag: float) -> None:
    # The moves of the intruder's three findings (test_intruder_findings.py), now fixed:
    # it registers first (the decode's REGISTER waits as a contender), cancels, or lets its
    # registration lapse; the named transfer is pushed all the same.
    for then in ("", "Cancel", "lapse"):
        w, tid = named_request_with_a_late_prefill_leg(lag)
        p = w.nodes["P0"]
        w.intrude(p, tid, Move("Register"))
        w.run_until(w.now + 0.2)
        if then == "Cancel":
            w.intrude(p, tid, Move("Cancel", gen="zero"))
        w.run_until(w.now + 30.0)
        w.quiesce()
        w.check_outcomes()
        assert w.stats["outcome:named:pushed"] == 1, (lag, then)
        assert not w.intruder.kv


def test_an_intruder_register_of_an_id_before_its_request_changes_nothing() -> None:
    w = World(1, 1, Chaos(skew=False), 0)
    w.named_share = 1.0
    w.intrude(w.nodes["P0"], "t1", Move("Register", target="future"))
    w.run_until(3.0)  # its permit runs out before the request comes
    w.new_request(w.nodes["P0"], w.nodes["D0"], 1, 0)
    w.run_until(w.now + 30.0)
    w.quiesce()
    w.check_outcomes()
    assert w.stats["outcome:named:pushed"] == 1


def test_the_known_bugs_keep_the_intruder_off_those_moves(monkeypatch: Any) -> None:
    monkeypatch.setitem(KNOWN_BUGS, "contenders_not_renewed", True)
    w, tid = named_request_with_a_late_prefill_leg(3.0)
    w.intrude(w.nodes["P0"], tid, Move("Register"))
    assert w.stats["attack:skipped:contenders_not_renewed"] == 1
    assert tid not in w.nodes["P0"].engine._out


def test_a_forged_message_that_drops_the_named_decodes_register_is_caught(monkeypatch: Any) -> None:
    # The check that found "registrant_drops_contenders": a P that loses the named decode's
    # REGISTER it kept (here: on any message) while a forged one is handled.
    w, tid = named_request_with_a_late_prefill_leg(1.0)
    p = w.nodes["P0"]
    w.intrude(p, tid, Move("Register"))
    while "tcp://d0:7100" not in p.engine._out[tid].contenders:
        w.run_until(w.now + 0.01)
        assert w.now < 1.0, "the decode never registered"
    real = p.engine.on_message

    def forgetful(msg: Any, now: float, age: float = 0.0, origin: str = "") -> Any:
        p.engine._out[tid].contenders.clear()
        return real(msg, now, age, origin)

    monkeypatch.setattr(p.engine, "on_message", forgetful)
    with pytest.raises(
        Violation, match="forged Heartbeat from intruder-key was acted on.*named_registers"
    ):
        w.intrude(p, tid, Move("Heartbeat", gen="zero"))


def test_a_named_transfer_that_does_not_end_pushed_in_a_calm_world_is_caught() -> None:
    # The check that found the other two: here the decode's REGISTER never reaches P.
    w, tid = named_request_with_a_late_prefill_leg(0.0)
    w.partition("D0", "P0", 10.0, both=False)
    w.run_until(w.now + 30.0)
    w.quiesce()
    with pytest.raises(
        Violation,
        match=r"the decode named to P\) ended "
        r"\['ReportFailed\(permit_expired\)'\]",
    ):
        w.check_outcomes()


def test_a_write_of_a_named_transfer_to_another_agent_is_caught() -> None:
    w, tid = named_request_with_a_late_prefill_leg(0.0)
    p = w.nodes["P0"]
    while not any(f.tid == tid for f in w.flights.values()):
        w.run_until(w.now + 0.01)
    preq = p.preqs[tid]
    stray = PostWrite(tid, 1, 999, intruder_agent(1), tuple(preq.blocks[:1]), (0,), 1000, None, ())
    with pytest.raises(Violation, match="whose decode the router named"):
        w.check_write(p, stray)


@pytest.mark.parametrize("seed", range(3))
def test_layerwise_pushes_post_layers_during_the_forward_and_end_pushed(seed: int) -> None:
    w = World(1, 1, Chaos(skew=True, layerwise=1.0), seed)
    w.run_until(0.5)
    for n in (1, 3, 8):
        w.new_request(w.nodes["P0"], w.nodes["D0"], n, 0)
    w.run_until(w.now + 20.0)
    w.quiesce()
    assert w.stats.get("post:WRITE:layer:during_forward", 0) > 0
    assert w.stats.get("post:WRITE:layer", 0) > 0


def test_the_world_catches_a_write_of_a_layer_not_computed_yet(monkeypatch: Any) -> None:
    import kvpush_prod.core.sender as sender_mod

    real = sender_mod.Sender.layers_ready

    def eager(
        self: Any,
        tid: str,
        blocks: list[int],
        ready: int,
        parts: int,
        now: float,
        owner: str = "",
        prompt: bytes = b"",
    ) -> Any:
        return real(self, tid, blocks, parts, parts, now, owner, prompt)  # claims every layer

    monkeypatch.setattr(sender_mod.Sender, "layers_ready", eager)
    w = World(1, 1, Chaos(skew=False, layerwise=1.0), 0)
    w.run_until(0.5)
    w.new_request(w.nodes["P0"], w.nodes["D0"], 3, 0)
    with pytest.raises(Violation, match="while its forward has computed"):
        w.run_until(w.now + 20.0)
