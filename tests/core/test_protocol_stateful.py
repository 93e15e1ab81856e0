"""The push protocol under fire: N prefill x M decode engines in a simulated world.

Hypothesis drives the real Sender/Receiver engines (``sim_world.World`` plays the shells,
the network and the NICs) through lost, duplicated, reordered, delayed and stuck control
messages, one-way and two-way control partitions, slow, failing, torn and ambiguous
(failed at P but landed) chunks, pump stalls, crashes and restarts (with the dead
process's messages arriving late), aborts on both sides, late prefill legs, credit
pressure, replays with stale generations, and two kinds of attacker:

- forgers (``forge``): forged control messages (REGISTER, heartbeat, CANCEL, PullDone,
  Failed, CancelAck, FALLBACK, DoneQuery, DoneState) and DONE notifications, mostly about
  live transfers, that claim any engine's id, rank, address and incarnation (current, past
  or new) and name the current, a near, a past or a random generation, sent under an
  identity of the forger's own or under that of a real engine that does not own the
  transfer;
- the intruder (``intrude``; in the calm world also right after the router sends a
  request, ahead of the decode's REGISTER): a third engine
  with a valid key of its own (``sim_world.INTRUDER_KEY``), a control address (replies to
  its key reach it) and a NIXL agent named for its key. It owns no transfer, knows every
  transfer id the router used and the next one, every engine's address, engine id, agent
  name and incarnation, the generations it was told and any that leaked (even the current
  one), and at any step sends any control message about any transfer to any engine, or a
  DONE from its own agent, claiming its own identity (or a restart of it) or its victim's
  (engine id, address, agent name, incarnation), with block ids of its own, of the
  transfer's decode or of another transfer, any permit term and any clock (``Move``).

The router names the decode engine to P for most requests (owner=, ``decode_key``); for the
rest P's first REGISTER binds the transfer (a documented limitation: for those only safety
is checked, not that the real D gets the push).

The world checks, where each can break and after every step: credit within budget and
blocks in flight within credit; no double free; no WRITE posted after its permit; no chunk
landing in a block freed or reused since it was posted; no block freed under a live permit;
P writes a transfer whose decode the router named only into that decode's NIXL agent (never
the intruder's, never one a message names), from the transfer's own blocks, into blocks
that decode reserved for it; D reads only from the agent of the transfer's prefill; stale
generations (and messages of dead processes) change nothing; a forged or intruder message
is only refused (notes "rejected"/"fenced", replies that only the sender's own channel can
take) and changes nothing of any other identity (its transfers, the router-named decode's
REGISTER that P holds, bound or kept while the prefill leg is late, peer entries, liveness,
tombstones, leases; only the sender's own bookkeeping may change); a message goes only to
the identity it names; D reports a transfer received only with P's bytes of that very
transfer in every block; every transfer ends within its bound; and at quiescence, once
every lease ran out, nothing leaked.

``TestCalmWorldWithIntruder`` adds the liveness half: in a calm world (nothing lost, failed,
stalled or crashed) with the intruder, every transfer whose decode the router named ends
pushed on both sides, exactly as without it (``World.check_outcomes``). Where the router
names no decode, the intruder can take the prompt's KV by registering first, or cancel the
push before anyone registers; D then recomputes (test_intruder.py shows both).

Core bugs the attackers found are reproduced in test_attacker_findings.py and
test_intruder_findings.py (a strict xfail naming each while open, a regression test once
fixed); sim_world.KNOWN_BUGS keeps the attackers off an open one's move, and
test_world_checks.py shows the checks that found them catch what they look for.

Examples (CI: ``HYPOTHESIS_PROFILE=ci``): ``TestProtocolWorld`` runs the profile's
examples (300), ``TestCalmWorldWithIntruder`` a fifth of them (60) at two fifths of the
steps (40); ``KVPUSH_HYPOTHESIS_EXAMPLES`` sets the examples and ``KVPUSH_HYPOTHESIS_STEPS``
the steps per example (100). About 16 s of CPU for this module on a 2-core box
(2026-12-02; 13 s before the intruder and the calm world).
Nightly size: ``HYPOTHESIS_PROFILE=ci KVPUSH_HYPOTHESIS_EXAMPLES=3000
KVPUSH_HYPOTHESIS_STEPS=150 pytest tests/core/test_protocol_stateful.py``: 3000 x 150 of
the world and 600 x 60 of the calm world, 3.5 to 7 minutes on a 2-core box (quiet to
loaded) when it passes (2026-12-02), plus up to ~5 minutes of shrinking when it finds
something. That size found a world false positive the CI size did not (an engine's
first message after its own restart, sent under its key, counted as a forgery acted on);
after the fix it ran 3000 x 150 with no violation, and with the intruder too (2026-12-02).
The intruder's three findings: the calm world found the first two at CI size (in about one
run in six) and all three at the nightly size (every run tried, before the fixes).
A failure prints the steps, the world (sizes, chaos, seed), its events around the broken
invariant and ``@reproduce_failure`` (the blob; ``print_blob``).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvpush_prod.core.vocabulary import Outcome

from .sim_world import (
    CHUNK_MAX_S,
    DISCONNECT,
    INTRUDER_FOR,
    INTRUDER_KINDS,
    INVALID,
    P_LAG_MAX_S,
    PAUSE_MAX_S,
    RESTART_MIN_S,
    RETRYABLE,
    Attack,
    Chaos,
    Move,
    World,
)

EXAMPLES = int(os.environ.get("KVPUSH_HYPOTHESIS_EXAMPLES", settings.default.max_examples))
STEPS = int(os.environ.get("KVPUSH_HYPOTHESIS_STEPS", "100"))
# The calm world with the intruder: its transfers end within a second, so shorter runs.
CALM_EXAMPLES = max(1, EXAMPLES // 5)
CALM_STEPS = max(10, STEPS * 2 // 5)
MAX_OPEN = 12  # requests in flight at once (each counted on P and on D)
MAX_CRASHES = 2  # per example: more leaves too little alive to test
MAX_PARTITIONS = 3

chaos_st = st.builds(
    Chaos,
    drop=st.sampled_from([0.0, 0.02, 0.1, 0.3]),
    dup=st.sampled_from([0.0, 0.05, 0.2]),
    delay_max_s=st.sampled_from([0.002, 0.02, 0.3]),
    spike=st.sampled_from([0.0, 0.02, 0.1]),
    chunk_fail=st.sampled_from([0.0, 0.05, 0.2, 0.5]),
    fatal_share=st.sampled_from([0.0, 0.1]),
    slow=st.sampled_from([0.0, 0.1, 0.3, 1.0]),
    notif_loss=st.sampled_from([0.0, 0.1]),
    skew=st.booleans(),
    ambiguous=st.sampled_from([0.0, 0.0, 0.3]),
    zombie=st.booleans(),
    forward_fail=st.sampled_from([0.0, 0.0, 0.1]),
    layerwise=st.sampled_from([0.0, 0.5, 1.0]),
)


attack_st = st.builds(
    Attack,
    kind=st.integers(0, 6),
    forger=st.sampled_from(["attacker", "attacker", "attacker-2", "engine"]),
    claim=st.sampled_from(["owner", "owner", "owner_new", "owner_old", "own", "other"]),
    guess=st.sampled_from(["current", "current", "near", "past", "random", "zero"]),
    target=st.sampled_from(["live", "live", "live", "live", "live", "any", "future", "bogus"]),
    rank=st.sampled_from([0, 0, 1, 2]),
    delay=st.sampled_from([0.0, 0.0, 0.01, 0.5]),
    layout=st.sampled_from(["full", "full", "slim", "foreign"]),
    ttl_ms=st.sampled_from([3000, 86_400_000, 0]),
)


move_st = st.builds(
    Move,
    kind=st.sampled_from(INTRUDER_KINDS),
    to=st.sampled_from(["natural", "natural", "natural", "all", "all", "other"]),
    target=st.sampled_from(["newest", "newest", "live", "live", "seen", "future", "bogus"]),
    claim=st.sampled_from(
        [
            "self",
            "self",
            "self",
            "self",
            "self",
            "self_new",
            "victim",
            "victim_new",
            "victim_dp",
            "victim_agent",
            "slim",
            "foreign",
        ]
    ),
    gen=st.sampled_from(["observed", "leaked", "current", "current", "near", "random", "zero"]),
    delay=st.sampled_from([0.0, 0.0, 0.0, 0.005, 0.05, 0.5, 3.0]),
    detail=st.integers(0, 2**16),
)


class IntruderRules(RuleBasedStateMachine):
    """The intruder, a third engine with a key of its own (sim_world.INTRUDER_KEY): at any
    step it sends a few control messages or DONEs of its choice (``Move``) about any transfer
    id to any engine, interleaved with the engines' traffic. Each is checked where it arrives
    (``World._under_attack``: refused, nothing of another identity changed); the world checks
    the rest (P writes a named transfer only into its decode's agent, D reads only from its
    prefill's, D's bytes are P's, no block freed or reused early, every transfer ends)."""

    world: World

    # Rules both worlds share (hypothesis collects a machine's rules from its bases too).
    @rule(data=st.data(), side=st.sampled_from(["D", "P"]))
    def abort(self, data: st.DataObject, side: str) -> None:
        """A client goes away: D's request ends (any time), or P's before its prompt is done."""
        self._abort(data, side)

    @rule(dt=st.floats(0.0, 0.3))
    def advance(self, dt: float) -> None:
        self.world.run_until(self.world.now + dt)

    @rule(dt=st.floats(0.3, 8.0))
    def advance_long(self, dt: float) -> None:
        self.world.run_until(self.world.now + dt)

    def _pick(self, data: st.DataObject, items: list[Any]) -> Any:
        return data.draw(st.sampled_from(sorted(items)))

    def _abort(self, data: st.DataObject, side: str) -> None:
        w = self.world
        if side == "D":
            open_ = [
                (n.name, t)
                for n in w.nodes.values()
                for t, d in n.dreqs.items()
                if d.state != "ended" and not d.aborting
            ]
            if open_:
                name, tid = self._pick(data, open_)
                w.abort_d(w.nodes[name], tid)
        else:
            queued = [
                (n.name, t)
                for n in w.nodes.values()
                for t, p in n.preqs.items()
                if p.state == "queued"
            ]
            if queued:
                name, tid = self._pick(data, queued)
                w.abort_p(w.nodes[name], tid)

    @rule(data=st.data(), moves=st.lists(move_st, min_size=1, max_size=2))
    def intrude(self, data: st.DataObject, moves: list[Move]) -> None:
        self._intrude(data, moves)

    def _intrude(self, data: st.DataObject, moves: list[Move], tid: str = "") -> None:
        """Send ``moves``, about ``tid`` if given (the router's request it just saw), else
        about the ids each move targets."""
        w = self.world
        for mv in moves:
            role = INTRUDER_FOR[mv.kind]
            if mv.to == "other" and mv.kind != "Done":  # a DONE only ever reaches D
                role = "D" if role == "P" else "P"
            names = [n.name for n in w.nodes.values() if n.alive and n.role == role]
            if not names:
                continue
            if mv.to == "all":
                t = tid or self._pick(data, w.intruder_targets(w.nodes[names[0]], mv.target))
                for name in names:
                    w.intrude(w.nodes[name], t, mv)
            else:
                node = w.nodes[self._pick(data, names)]
                w.intrude(node, tid or self._pick(data, w.intruder_targets(node, mv.target)), mv)


class ProtocolWorld(IntruderRules):
    """The rules are the world's events; hypothesis picks them, their order and their timing."""

    @initialize(
        n_p=st.integers(1, 3), n_d=st.integers(1, 2), chaos=chaos_st, seed=st.integers(0, 2**32 - 1)
    )
    def setup(self, n_p: int, n_d: int, chaos: Chaos, seed: int) -> None:
        note(f"world: {n_p} P x {n_d} D, {chaos}, seed {seed}")
        self.world = World(n_p, n_d, chaos, seed)

    # ------------------------------------------------------------------ work
    @precondition(lambda self: self.world.open_requests() < 2 * MAX_OPEN)
    @rule(
        data=st.data(),
        sizes=st.lists(st.tuples(st.integers(1, 8), st.integers(0, 8)), min_size=1, max_size=3),
    )
    def new_requests(self, data: st.DataObject, sizes: list[tuple[int, int]]) -> None:
        """The router sends a few requests, each to a prefill and a decode engine."""
        w = self.world
        for total, first in sizes:
            p = w.nodes[self._pick(data, [n for n in w.nodes if n.startswith("P")])]
            d = w.nodes[self._pick(data, [n for n in w.nodes if n.startswith("D")])]
            # Mostly no prefix hit on D; sometimes part of the prompt, rarely all of it.
            w.new_request(p, d, total, first if first <= total and first % 3 == 0 else 0)

    # ------------------------------------------------------------------ network
    @precondition(lambda self: bool(self.world.wires) or bool(self.world.history))
    @rule(
        data=st.data(),
        kind=st.sampled_from(["drop", "reorder", "delay", "duplicate"]),
        extra=st.floats(0.0, 6.0),
    )
    def network_fault(self, data: st.DataObject, kind: str, extra: float) -> None:
        """Lose, reorder (deliver now), delay or duplicate (a recent) control message."""
        w = self.world
        if kind == "duplicate":
            if not w.history:  # only forged messages on the wire: not the network's to copy
                return
            old = data.draw(st.sampled_from(list(w.history)))
            src = w.nodes[old.src]
            if src.alive and src.inc == old.src_inc:  # a dead process sends nothing more
                w.count("rule:duplicate")
                w.enqueue(old.src, old.src_inc, old.dst, old.msg, w.now + extra, old.origin)
            return
        if not w.wires:
            return
        wire = w.wires[self._pick(data, list(w.wires))]
        w.count(f"rule:{kind}")
        if kind == "drop":
            del w.wires[wire.id]
        elif kind == "reorder":
            w.deliver(wire)
        else:
            wire.at += extra
            w._push(wire.at, "wire", wire.id)

    @precondition(lambda self: self.world.stats.get("partition", 0) < MAX_PARTITIONS)
    @rule(
        data=st.data(),
        dt=st.floats(0.5, 8.0),
        way=st.sampled_from(["both", "P->D", "D->P", "none"]),
        slow=st.booleans(),
    )
    def partition(self, data: st.DataObject, dt: float, way: str, slow: bool) -> None:
        """The control network between a P and a D fails for a while, both ways or one way;
        the RDMA link between them keeps working, maybe slowly (and maybe only that)."""
        w = self.world
        p = self._pick(data, [n for n in w.nodes if n.startswith("P")])
        d = self._pick(data, [n for n in w.nodes if n.startswith("D")])
        if slow or way == "none":
            w.slow_down(p, d, dt)
        if way == "D->P":
            w.partition(d, p, dt, both=False)
        elif way != "none":
            w.partition(p, d, dt, both=way == "both")

    @rule(
        data=st.data(),
        role=st.sampled_from(["D", "P"]),
        kind=st.sampled_from(
            [
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
        ),
        shift=st.sampled_from([-2, -1, 1, 4]),
    )
    def stale_message(self, data: st.DataObject, role: str, kind: str, shift: int) -> None:
        """A message about a live transfer with another generation than its current one
        (a late message about an earlier grant) reaches its receiver: it must be fenced."""
        w = self.world
        cands = w.stale_candidates(role)
        if cands:
            w.deliver_stale(self._pick(data, cands), kind, shift)

    @rule(data=st.data(), kind=st.sampled_from(["heartbeat", "notice"]))
    def message_of_a_dead_process(self, data: st.DataObject, kind: str) -> None:
        """A message a crashed engine sent before it died arrives after its restart."""
        w = self.world
        cands = w.dead_candidates()
        w.count(f"dead_cands:{bool(cands)}")
        if cands:
            w.deliver_from_dead(self._pick(data, cands), kind)

    @precondition(lambda self: bool(self.world.live_transfers()))
    @rule(
        data=st.data(),
        role=st.sampled_from(["P", "D"]),
        attacks=st.lists(attack_st, min_size=1, max_size=4),
    )
    def forge(self, data: st.DataObject, role: str, attacks: list[Attack]) -> None:
        """While transfers are live, the attacker (no engine's key: an identity of its own),
        or an engine that does not own the transfer, sends a few forged control messages or
        DONEs, mostly about live transfers: each must be refused and change nothing that is
        not the forger's own."""
        w = self.world
        for attack in attacks:
            live = w.live_transfers()
            if attack.target == "live" and live:
                name, tid = self._pick(data, live)
                w.attack(w.nodes[name], tid, attack)
                continue
            nodes = [n for n in w.nodes if n.startswith(role) and w.nodes[n].alive]
            if nodes:
                node = w.nodes[self._pick(data, nodes)]
                tids = w.attack_targets(node, attack.target) or w.attack_targets(node, "future")
                w.attack(node, self._pick(data, tids), attack)

    # ------------------------------------------------------------------ NICs
    @precondition(lambda self: bool(self.world.flights))
    @rule(
        data=st.data(),
        kind=st.sampled_from(["fail", "complete", "slow"]),
        error=st.sampled_from([*RETRYABLE, DISCONNECT, INVALID]),
        torn=st.booleans(),
    )
    def chunk_fault(self, data: st.DataObject, kind: str, error: str, torn: bool) -> None:
        """A chunk fails now (maybe having written part of its blocks), completes now, or
        takes as long as a chunk may (CHUNK_MAX_S)."""
        w = self.world
        fl = w.flights[self._pick(data, list(w.flights))]
        w.count(f"rule:chunk_{kind}")
        if kind == "fail":
            w.complete(fl, error=error, torn=torn)
        elif kind == "complete":
            w.complete(fl, error="", torn=False)
        elif fl.posted + CHUNK_MAX_S > w.now:
            fl.at = fl.posted + CHUNK_MAX_S
            w._push(fl.at, "flight", fl.key)

    # ------------------------------------------------------------------ engines
    @rule(
        data=st.data(),
        kind=st.sampled_from(["stall", "tick", "poll"]),
        dt=st.floats(0.05, PAUSE_MAX_S),
    )
    def pump(self, data: st.DataObject, kind: str, dt: float) -> None:
        """A pump stalls (GC, overload), or ticks or polls its engine out of turn."""
        w = self.world
        node = w.nodes[self._pick(data, list(w.nodes))]
        if kind == "stall":
            w.pause(node, dt)
        elif kind == "tick":
            w.call(node, lambda eng, now: eng.tick(now))
        else:
            w.call(node, lambda eng, now: eng.poll(now))

    @precondition(lambda self: self.world.stats.get("crash", 0) < MAX_CRASHES)
    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        w = self.world
        alive = [n.name for n in w.nodes.values() if n.alive]
        if alive:
            w.crash(w.nodes[self._pick(data, alive)])

    @precondition(
        lambda self: any(
            not n.alive and self.world.now - n.died_at >= RESTART_MIN_S
            for n in self.world.nodes.values()
        )
    )
    @rule(data=st.data())
    def restart(self, data: st.DataObject) -> None:
        """A crashed engine comes back: a new incarnation at the same address."""
        w = self.world
        dead = [
            n.name for n in w.nodes.values() if not n.alive and w.now - n.died_at >= RESTART_MIN_S
        ]
        w.start(w.nodes[self._pick(data, dead)])

    # ------------------------------------------------------------------ invariants
    @invariant()
    def invariants_hold(self) -> None:
        self.world.check()

    def teardown(self) -> None:
        w = getattr(self, "world", None)
        if w is None or w.broken:
            return  # a step failed: that failure is the report
        try:
            w.quiesce()
        finally:
            note(f"world stats: {dict(sorted(w.stats.items()))}")


ProtocolWorld.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
    ],
)
TestProtocolWorld = ProtocolWorld.TestCase


# ----------------------------------------------------------------------------- a calm world
# Nothing lost, failed, stalled or crashed: every transfer the router named a decode for
# would be pushed, so any other end is the intruder's doing.
calm_st = st.builds(
    Chaos,
    dup=st.sampled_from([0.0, 0.05]),
    delay_max_s=st.sampled_from([0.002, 0.02]),
    slow=st.sampled_from([0.0, 0.1]),
    skew=st.booleans(),
)
CALM_OPEN = 5  # requests open on P at once: their blocks always fit its KV cache


class CalmWorldWithIntruder(IntruderRules):
    """Legitimate requests in a calm world, and the intruder. The intruder must not change
    the end of any transfer whose decode the router named to P: D reports it received with
    P's bytes and P releases it as pushed (``World.check_outcomes``, at quiescence). Where the
    router names no decode (two worlds in three send some such requests) the first engine to
    REGISTER a transfer gets its KV: the intruder may take it (the real decode's REGISTER is
    refused and D recomputes the prompt) or CANCEL it before anyone registers; counted
    (``outcome:unnamed:...``), and only the safety invariants are checked for those. The
    decode of such a transfer, never told, holds its blocks and credit until its permit runs
    out: a named request that waited for that credit and outlived its bound is counted
    (``outcome:named:starved_by_unnamed``), not failed."""

    @initialize(
        n_p=st.integers(1, 2),
        n_d=st.integers(1, 2),
        chaos=calm_st,
        seed=st.integers(0, 2**32 - 1),
        named=st.sampled_from([1.0, 0.8, 0.3]),
    )
    def setup(self, n_p: int, n_d: int, chaos: Chaos, seed: int, named: float) -> None:
        note(f"calm world: {n_p} P x {n_d} D, {chaos}, seed {seed}, named share {named}")
        self.world = World(n_p, n_d, chaos, seed)
        self.world.named_share = named

    @precondition(lambda self: sum(len(n.preqs) for n in self.world.nodes.values()) < CALM_OPEN)
    @rule(
        data=st.data(),
        total=st.integers(1, 8),
        first=st.integers(0, 8),
        lag=st.sampled_from([-1.0, -1.0, -1.0, 2.0, P_LAG_MAX_S]),
        ahead=st.lists(move_st, max_size=2),
    )
    def new_request(
        self, data: st.DataObject, total: int, first: int, lag: float, ahead: list[Move]
    ) -> None:
        """The router sends a request (its prefill leg as late as the world draws it, or
        ``lag`` seconds late: the decode's REGISTER then waits at P); the intruder may act
        on its id right away."""
        w = self.world
        p = w.nodes[self._pick(data, [n for n in w.nodes if n.startswith("P")])]
        d = w.nodes[self._pick(data, [n for n in w.nodes if n.startswith("D")])]
        tid = w.new_request(p, d, total, first if first <= total and first % 3 == 0 else 0)
        w.late_prefill_leg(p, tid, lag)
        self._intrude(data, ahead, tid)

    @invariant()
    def invariants_hold(self) -> None:
        self.world.check()

    def teardown(self) -> None:
        w = getattr(self, "world", None)
        if w is None or w.broken:
            return
        try:
            w.quiesce()
            w.check_outcomes()
        finally:
            note(f"world stats: {dict(sorted(w.stats.items()))}")


CalmWorldWithIntruder.TestCase.settings = settings(
    ProtocolWorld.TestCase.settings, max_examples=CALM_EXAMPLES, stateful_step_count=CALM_STEPS
)
TestCalmWorldWithIntruder = CalmWorldWithIntruder.TestCase


# ----------------------------------------------------------------------------- scenarios
# The races the machine reaches only now and then, replayed on purpose over many seeds (the
# world's randomness: chunk timings, clock offsets). The world checks every invariant; each
# scenario also asserts that its race did happen (the world counts the interleaving).


def _scenario(seed: int, setup: Any) -> World:
    w = World(1, 1, Chaos(skew=True), seed)
    w.run_until(0.5)
    setup(w, w.nodes["P0"], w.nodes["D0"])
    w.run_until(w.now + 30.0)
    w.quiesce()
    return w


def _push_started(w: World, tid: str) -> None:
    """Run until P has a WRITE of ``tid`` on the wire (it got D's REGISTER and is pushing)."""
    while not any(f.tid == tid and f.op == "WRITE" for f in w.flights.values()):
        w.run_until(w.now + 0.01)
        assert w.now < 10.0, "the push never started"


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("way", ["P->D", "both"])
def test_a_slow_push_whose_control_path_fails_never_writes_into_reused_blocks(
    seed: int, way: str
) -> None:
    """D stops renewing the permit while P still pushes on a crawling link: P must stop in
    time for its last chunk to land before D reuses the blocks.

    The race is driven, and asserted: the prompt has 12 blocks (more than the permit lets P
    push on that link), the control path fails once P pushes (P->D: P's heartbeats are
    lost, D's renewals still reach P; both: nothing passes), and a WRITE posted within
    CHUNK_MAX_S of the end of D's permit takes CHUNK_MAX_S. In every world P's permit runs
    out under the push with chunks still on the wire, and D reuses the blocks (reports
    permit_expired) only after they land. With P->D, P's term follows D's, and some worlds
    land a chunk after D's permit ended, before D's reuse point (counted over the seeds in
    the next test)."""
    w = _slow_push_world(seed, way)
    assert w.stats.get("race:permit_ended_under_push") == 1, (
        f"seed {seed}: P's permit never ran out with chunks in flight: {w.stats}"
    )
    (report,) = w.reported.values()
    assert report == "ReportFailed(permit_expired)", report
    assert list(w.released.values()) == [Outcome.EXPIRED]


def _slow_push_world(seed: int, way: str) -> World:
    def setup(w: World, p: Any, d: Any) -> None:
        w.slow_down("P0", "D0", 30.0)
        w.slowest_near_the_end = True
        tid = w.new_request(p, d, 12, 0)
        _push_started(w, tid)
        w.partition("P0", "D0", 30.0, both=way == "both")

    return _scenario(seed, setup)


def test_a_chunk_of_a_push_lands_after_the_permit_ended_and_before_the_blocks_are_reused() -> None:
    """The tightest case of the race above: over the P->D worlds, chunks held to the bound
    land after D's permit ran out (the fence then still holds the blocks)."""
    late = held = 0
    for seed in range(40):
        w = _slow_push_world(seed, "P->D")
        late += w.stats.get("race:landed_after_permit", 0)
        held += w.stats.get("race:held_to_the_bound", 0)
    assert held >= 10 and late >= 5, (held, late)


@pytest.mark.parametrize("seed", range(40))
def test_an_abort_on_decode_whose_cancel_is_lost_frees_only_after_the_fence(seed: int) -> None:
    """D aborts mid-push and its CANCEL never arrives: D may reuse the blocks only once P can
    no longer be writing into them. The race is asserted: chunks were on the wire when D
    aborted, P never heard the CANCEL (its permit ran out: expired, not cancelled), and D
    ended the receive by the fence (its permit's end), not by an ack or a DONE."""

    def setup(w: World, p: Any, d: Any) -> None:
        w.slow_down("P0", "D0", 30.0)
        tid = w.new_request(p, d, 8, 0)
        _push_started(w, tid)
        w.partition("P0", "D0", 30.0, both=True)
        w.abort_d(d, tid)

    w = _scenario(seed, setup)
    assert list(w.reported.values()) == ["ReportFinished(aborted)"]
    assert list(w.released.values()) == [Outcome.EXPIRED]
    assert w.stats.get("send:Cancel") == 1 and w.stats.get("race:permit_ended_under_push")
    assert w.stats.get("note:lease_expired:permit", 0) >= 2  # on D (the fence) and on P


def test_failed_last_chunks_are_confirmed_or_posted_again_never_into_reused_blocks() -> None:
    """Last chunks fail at P, some after their bytes and DONE landed, some with their DONE
    lost or late: P asks D; D's answer ends the push or lets P post it again, and a late DONE
    of a post D already called missing must not end the receive under the re-post (40 worlds;
    each checks every invariant)."""
    seen: dict[str, int] = {}
    for seed in range(40):
        w = World(
            1,
            1,
            Chaos(skew=True, chunk_fail=0.4, ambiguous=0.5, notif_loss=0.2, delay_max_s=0.02),
            seed,
        )
        w.run_until(0.5)
        for _ in range(6):
            w.new_request(w.nodes["P0"], w.nodes["D0"], 1 + seed % 3, 0)
            w.run_until(w.now + 0.05)
        w.run_until(w.now + 30.0)
        w.quiesce()
        for k, n in w.stats.items():
            seen[k] = seen.get(k, 0) + n
    assert seen.get("send:DoneQuery", 0) > 0 and seen.get("send:DoneState", 0) > 0
    assert seen.get("ambiguous", 0) > 0
