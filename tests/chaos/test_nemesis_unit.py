"""The nemesis's pure parts: the seeded schedule (bounds, quiet windows, replay from a report)
and the invariant checker on synthetic events. No engine."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpush_prod.chaos.invariants import Invariants, engines_named, in_flight_during
from kvpush_prod.chaos.load import Record
from kvpush_prod.chaos.schedule import (
    KINDS,
    Schedule,
    ScheduleConfig,
    ScheduleError,
    generate,
    quiet_every_for,
    restart_slot_for,
)
from kvpush_prod.chaos.workload import Mix, make_request
from kvpush_prod.lab import netns as lab_netns

P = ("prefill", "prefill-1")
D = ("decode", "decode-1")
URLS = {
    "http://127.0.0.1:8001": "prefill",
    "http://127.0.0.1:8002": "prefill-1",
    "http://127.0.0.1:8003": "decode",
    "http://127.0.0.1:8004": "decode-1",
}


def cfg(**over: object) -> ScheduleConfig:
    base: dict[str, object] = {"duration_s": 1800.0, "prefills": P, "decodes": D, "kinds": KINDS}
    return ScheduleConfig(**{**base, **over})  # type: ignore[arg-type]


def test_the_same_seed_draws_the_same_schedule_and_another_seed_another() -> None:
    assert generate(7, cfg()).to_dict() == generate(7, cfg()).to_dict()
    assert generate(7, cfg()).faults != generate(8, cfg()).faults


def test_the_restart_slot_follows_the_boxs_start_and_a_kill_fits_between_quiet_windows() -> None:
    # Not measured: the slot a 2-core box's restarts under load need.
    assert restart_slot_for(None) == 150.0
    # 2.5 x the cluster's start, within bounds.
    assert restart_slot_for(40.0) == 100.0
    assert restart_slot_for(10.0) == 60.0
    assert restart_slot_for(1000.0) == 300.0
    for start in (None, 20.0, 45.0, 60.0, 90.0):
        slot = restart_slot_for(start)
        c = cfg(
            duration_s=600.0,
            kinds=("kill", "stop", "drain"),
            restart_slot_s=slot,
            quiet_every_s=quiet_every_for(slot, 20.0),
        )
        sched = generate(13, c)
        kills = [f for f in sched.faults if f.kind == "kill"]
        # A kill fits between two windows on every box, so the plan never waits for one.
        assert kills, (start, slot, c.quiet_every_s)
        for f in kills:
            for q in sched.quiet:
                assert f.planned_end(slot) <= q.at or f.at >= q.at + q.duration
    # An asked-for spacing wide enough is kept.
    assert quiet_every_for(60.0, 20.0, asked=300.0) == 300.0
    assert quiet_every_for(150.0, 20.0) == 210.0


def test_a_schedule_replays_exactly_from_its_json_report() -> None:
    sched = generate(3, cfg())
    report = json.loads(json.dumps({"nemesis": {"schedule": sched.to_dict()}}))
    again = Schedule.from_dict(report["nemesis"]["schedule"])
    assert again == sched
    assert again.timeline() == sched.timeline()


def test_faults_overlap_but_never_take_a_whole_role_out_nor_run_in_quiet_windows() -> None:
    c = cfg(max_overlap=3)
    sched = generate(11, c)
    kinds = {f.kind for f in sched.faults}
    assert kinds == set(KINDS)
    ends = {f.id: f.planned_end(c.restart_slot_s) for f in sched.faults}
    overlapping = 0
    for f in sched.faults:
        live = [g for g in sched.faults if g.at <= f.at < ends[g.id]]
        assert len(live) <= c.max_overlap
        overlapping += len(live) > 1
        for g in live:
            if g is not f and f.out_of_service and g.out_of_service:
                assert c.role(f.engine) != c.role(g.engine), (f, g)
        for q in sched.quiet:
            assert ends[f.id] <= q.at or f.at >= q.at + q.duration, (f, q)
        assert ends[f.id] <= c.duration_s - c.tail_s
    assert overlapping > 0
    assert len(sched.quiet) == int((c.duration_s - c.tail_s - c.quiet_s) // c.quiet_every_s)


def test_write_failures_are_drawn_on_a_prefill_engine_and_floods_come_from_another() -> None:
    sched = generate(5, cfg())
    for f in sched.faults:
        if f.kind == "write_fail":
            assert f.engine in P
        if f.kind == "flood":
            assert f.peer is not None and f.peer != f.engine


def test_bad_settings_are_refused_naming_the_value() -> None:
    with pytest.raises(ScheduleError, match="'teleport'"):
        generate(1, cfg(kinds=("kill", "teleport")))
    with pytest.raises(ScheduleError, match="duration 30"):
        generate(1, cfg(duration_s=30.0))
    with pytest.raises(ScheduleError, match="not a nemesis schedule"):
        Schedule.from_dict({"seed": 1})


def rec(idx: int, t0: float, t1: float, **kw: object) -> Record:
    r = Record(idx, "nemesis", False, False, 100, 16, t0)
    r.ended = t1
    r.status = 200
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def checker() -> Invariants:
    return Invariants(dict(URLS), grace_s=5.0, role_bound_s=30.0)


def test_a_wrong_answer_is_a_violation_and_a_right_one_is_not() -> None:
    inv = checker()
    assert inv.request(rec(1, 0, 1, text="w5 w6"), "w5 w6") == "correct"
    assert inv.request(rec(2, 0, 1, text="w5 w7"), "w5 w6") == "wrong"
    assert [v.invariant for v in inv.violations] == ["every answer equals the single engine's"]
    assert "#2" in inv.violations[0].detail


def test_each_violation_is_told_as_it_is_kept_whatever_its_kind() -> None:
    told: list[str] = []
    inv = Invariants(
        dict(URLS), grace_s=5.0, role_bound_s=30.0, on_violation=lambda v: told.append(v.invariant)
    )
    inv.request(rec(1, 0, 1, text="w5 w7"), "w5 w6")
    inv.accounting("prefill", 5.0, started=10, ended=8, active=1, slack=0)
    inv.held("decode", 6.0, {"kvpush_held_blocks": 3.0, "other": 0.0})
    assert told == [v.invariant for v in inv.violations]
    assert len(told) == 3


def test_a_failure_without_any_fault_is_a_violation() -> None:
    inv = checker()
    failed = rec(3, 10, 12, status=502, error_kind="http", error="decode backend x: boom")
    assert inv.request(failed, None) == "failed_unexplained"
    assert len(inv.violations) == 1


def test_a_failure_during_a_fault_of_an_engine_it_touched_passes() -> None:
    inv = checker()
    inv.fault_started(1, "kill", {"decode-1"}, 9.0)
    err = '{"error": {"message": "decode backend http://127.0.0.1:8004: disconnect"}}'
    failed = rec(4, 8, 11, status=502, error_kind="http", error=err)
    assert inv.request(failed, None) == "failed_explained"
    inv.fault_ended(1, 20.0)
    late = rec(5, 23, 24, status=502, error_kind="http", error=err)  # within the grace
    assert inv.request(late, None) == "failed_explained"
    assert inv.violations == []
    assert inv.explained_by == {1: [4, 5]}


def test_a_failure_naming_an_engine_no_fault_touched_is_a_violation() -> None:
    inv = checker()
    inv.fault_started(1, "stop", {"prefill"}, 9.0)
    err = "decode backend http://127.0.0.1:8003 failed mid-stream"
    assert inv.request(rec(6, 8, 11, error_kind="sse", error=err), None) == "failed_unexplained"
    inv.fault_ended(1, 12.0)
    # A failure long after the fault's end (past the grace) is not explained by it either.
    err_p = "prefill backend http://127.0.0.1:8001: connect"
    assert inv.request(rec(7, 30, 31, error_kind="http", error=err_p), None) == (
        "failed_unexplained"
    )
    assert len(inv.violations) == 2


def test_cancelled_requests_are_not_failures_and_hung_ones_are_violations() -> None:
    inv = checker()
    assert inv.request(rec(8, 0, 1, error_kind="cancelled"), None) == "cancelled"
    assert inv.request(rec(9, 0, 120, error_kind="timeout", error="no answer"), None) == "hung"
    assert [v.invariant for v in inv.violations] == ["no request outlives its bound"]


def test_transfer_accounting_mismatch_fails_and_a_balanced_one_passes() -> None:
    inv = checker()
    inv.accounting("prefill", 5.0, started=10, ended=7, active=3, slack=0)
    inv.accounting("decode", 5.0, started=10, ended=7, active=1, slack=4)  # busy: within
    assert inv.violations == []
    inv.accounting("decode", 9.0, started=10, ended=8, active=0, slack=0)  # quiet: exact
    assert len(inv.violations) == 1
    assert "off by +2" in inv.violations[0].detail


def test_anything_held_after_a_quiet_window_is_a_violation() -> None:
    inv = checker()
    inv.held("decode", 1.0, {"kvpush_connector_blocks": 0.0, "kvpush_leases_active": 0.0})
    inv.held("prefill", 1.0, {"kvpush_connector_blocks": 3.0, "kvpush_leases_active": None})
    assert [v.detail for v in inv.violations] == ["prefill: kvpush_connector_blocks=3"]


def test_a_role_out_of_service_past_the_bound_is_reported_once() -> None:
    inv = checker()
    for t in range(0, 50):
        inv.roles_in_service(float(t), {"prefill": 1, "decode": 0 if 5 <= t < 45 else 2})
    assert len(inv.violations) == 1
    assert inv.longest_role_out["decode"] == pytest.approx(39.0)


def test_engines_named_and_requests_in_flight_during_a_fault() -> None:
    assert engines_named("x http://127.0.0.1:8003 y http://h:1", URLS) == {"decode"}
    inv = checker()
    inv.fault_started(1, "drain", {"decode"}, 10.0)
    inv.fault_ended(1, 20.0)
    records = [rec(1, 0, 9), rec(2, 5, 11), rec(3, 19, 25), rec(4, 21, 22)]
    assert in_flight_during(inv.spans[1], records) == [2, 3]


def test_shared_prefixes_keep_the_length_and_are_shared_only_when_asked() -> None:
    plain = Mix()
    shared = Mix(prefix_fraction=1.0, prefixes=1, prefix_len=64)
    a, b = make_request(1, 0, shared), make_request(2, 0, shared)
    assert a.prompt.split()[:64] == b.prompt.split()[:64]
    assert len(a.prompt.split()) == a.prompt_len
    # Without prefixes a request is what it always was (other scenarios' loads unchanged).
    assert make_request(1, 0, plain).prompt_len == a.prompt_len
    assert make_request(1, 0, plain).prompt.split()[64:] == a.prompt.split()[64:]


# -- the driver, on a fake cluster: a router answered in memory, faults that only set a flag


class _FakeObserver:
    """Readings of a balanced, idle cluster: started = ended + active on every engine."""

    def __init__(self, engines: list[str]) -> None:
        role = (("role", "producer"),)
        s = {
            ("kvpush_transfers_started_total", role): 5.0,
            ("kvpush_transfers_total", (*role, ("outcome", "pushed"))): 5.0,
            ("kvpush_transfers_active", role): 0.0,
            ("kvpush_connector_blocks", role): 0.0,
            ("kvpush_leases_active", role): 0.0,
        }
        self.last: dict[str, Any] = dict.fromkeys(engines, s)

    async def poll(self) -> dict[str, Any]:
        return dict(self.last)


def _fake_ctx(tmp_path: Path, broken: set[str]) -> Any:
    from types import SimpleNamespace

    from kvpush_prod.chaos.harness import Context, Options, admin_token_file
    from kvpush_prod.chaos.verdict import Report

    engines = ["prefill", "prefill-1", "decode", "decode-1"]
    cluster = SimpleNamespace(
        prefill_names=engines[:2],
        decode_names=engines[2:],
        engine_names=engines,
        urls={
            **{v: k for k, v in URLS.items()},
            "router": "http://router.test",
            "reference": "http://reference.test",
        },
        spec=SimpleNamespace(workdir=tmp_path, netns={}),
        procs={},
    )
    admin_token_file(tmp_path).write_text("t\n")

    async def answer(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.05)
        if "decode-1" in broken:
            return httpx.Response(
                502, json={"error": {"message": "decode backend http://127.0.0.1:8004: disconnect"}}
            )
        # Completions read "text", chat "message" or "delta": the same answer in each.
        choice = {"text": "w5 w6", "message": {"content": "w5 w6"}, "delta": {"content": "w5 w6"}}
        if json.loads(request.content).get("stream"):
            body = f"data: {json.dumps({'choices': [choice]})}\n\ndata: [DONE]\n\n"
            return httpx.Response(200, text=body)
        return httpx.Response(200, json={"choices": [choice]})

    class Ctx(Context):
        def load(self, limit: int, **kw: Any) -> Any:
            gen = super().load(limit, **kw)
            gen._transport = httpx.MockTransport(answer)
            return gen

    opts = Options(concurrency=4, timeout=5.0, progress_every=10**6)
    obs = _FakeObserver(engines)
    return Ctx("nemesis", cluster, opts, None, Report("nemesis", {}), obs, lambda m: None)


def test_the_driver_applies_each_fault_judges_requests_while_running_and_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpush_prod.chaos import nemesis
    from kvpush_prod.chaos.faults import Faults
    from kvpush_prod.chaos.schedule import Fault, Quiet

    broken: set[str] = set()
    applied: list[int] = []

    async def fake_apply(self: Faults, f: Fault, begun: asyncio.Event) -> dict[str, Any]:
        applied.append(f.id)
        if f.kind == "kill":
            broken.add(f.engine)
        begun.set()
        await asyncio.sleep(f.hold_s)
        broken.discard(f.engine)
        return {"fake": True}

    async def reference(*_: Any) -> str:
        return "w5 w6"

    async def no_poke(*_: Any) -> None:
        return None

    monkeypatch.setattr(Faults, "apply", fake_apply)
    monkeypatch.setattr(nemesis, "reference_answer", reference)
    monkeypatch.setattr(nemesis, "_poke", no_poke)
    c = ScheduleConfig(duration_s=3.0, prefills=P, decodes=D, warmup_s=0.1, tail_s=0.1)
    faults = [
        Fault(1, 0.3, "kill", "decode-1", 0.6),
        Fault(2, 0.4, "stop", "decode", 0.3),  # same role: waits for the kill to end
        Fault(3, 0.5, "flood", "prefill", 0.2, peer="decode"),
        Fault(4, 2.0, "drain", "prefill-1", 0.3),
    ]
    sched = Schedule(1, c, faults, [Quiet(1.5, 0.3)])
    ctx = _fake_ctx(tmp_path, broken)
    settings = nemesis.Settings(
        check_every_s=0.1, accounting_every_s=0.2, settle_s=1.0, rest_gap_s=0.05
    )
    asyncio.run(nemesis.Nemesis(ctx, sched, settings).run())
    data = ctx.report.data["nemesis"]
    assert applied == [1, 2, 3, 4]
    by_id = {f["id"]: f for f in data["faults"]}
    assert by_id[2]["start"] >= by_id[1]["end"]  # one engine of a role out at a time
    assert data["invariants"]["violations"] == []
    counts = data["invariants"]["counts"]
    assert counts["failed_explained"] > 0 and counts["correct"] > 0
    assert by_id[1]["failed_requests"] and set(by_id[1]["failed_requests"]) <= set(
        by_id[1]["requests_in_flight"]
    )
    assert [q["settled"] for q in data["quiet_windows"]] == [True, True]
    # Every check but resource flatness, which has no process to sample here.
    failed = [c.as_dict() for c in ctx.report.checks if not c.ok and "resource" not in c.name]
    assert failed == []
    assert data["resources"]["samples"] >= 4  # two at rest in each quiet window


def test_the_flood_sends_authenticated_registers_that_decode(tmp_path: Path) -> None:
    """The flood's messages pass CurveZMQ with an engine's key and decode as REGISTERs."""
    import zmq

    from kvpush_prod.chaos.flood import flood
    from kvpush_prod.control.keys import generate, load_keypair
    from kvpush_prod.core import messages as m

    generate("decode", tmp_path)
    _, secret = generate("prefill", tmp_path)
    server = load_keypair(tmp_path / "decode.key_secret")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.curve_server = True
    sock.curve_secretkey, sock.curve_publickey = server.secret, server.public
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        sent = flood(f"tcp://127.0.0.1:{port}", server.public, str(secret), 0.5, 200)
        got = []
        while sock.poll(2000):
            got.append(m.decode_control(sock.recv_multipart()[-1]))
            if len(got) == sent:
                break
    finally:
        ctx.destroy(linger=0)
    assert sent > 0 and len(got) == sent
    assert all(isinstance(x, m.Register) and x.transfer_id.startswith("ghost-") for x in got)


def test_a_fresh_engine_without_the_started_counter_balances_until_it_ends_a_transfer() -> None:
    from kvpush_prod.chaos.nemesis import accounting_of

    role = (("role", "consumer"),)
    fresh = {("kvpush_transfers_active", role): 0.0}
    assert accounting_of(fresh) == (0.0, 0.0, 0.0, 0.0)
    ended = {("kvpush_transfers_total", (*role, ("outcome", "pushed"))): 2.0}
    assert accounting_of(ended) is None  # transfers ended and nothing says they started


def test_replay_takes_the_schedule_and_the_load_seed_from_the_report(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from kvpush_prod.chaos.harness import Options
    from kvpush_prod.chaos.scenarios.nemesis import schedule_for

    sched = generate(9, cfg(duration_s=600.0, kinds=("kill", "stop")))
    report = tmp_path / "nemesis.json"
    report.write_text(
        json.dumps({"options": {"seed": 9}, "nemesis": {"schedule": sched.to_dict()}})
    )
    ctx = SimpleNamespace(opts=Options(seed=0, extra={"replay": report}), cluster=None)
    assert schedule_for(ctx) == sched  # type: ignore[arg-type]
    assert ctx.opts.seed == 9
    report.write_text("{}")
    with pytest.raises(ScheduleError, match="--replay"):
        schedule_for(ctx)  # type: ignore[arg-type]


def test_a_restarted_engine_is_judged_from_its_restart_on(tmp_path: Path) -> None:
    from kvpush_prod.chaos import nemesis
    from kvpush_prod.chaos.faults import Applied
    from kvpush_prod.chaos.resources import Series
    from kvpush_prod.chaos.schedule import Fault

    sched = Schedule(1, cfg(duration_s=600.0), [], [])
    nem = nemesis.Nemesis(_fake_ctx(tmp_path, set()), sched, nemesis.Settings())
    kill = Applied(Fault(1, 100.0, "kill", "decode-1", 0.0), {"decode-1"}, start=100.0, end=170.0)
    nem.applied = [kill]
    old_then_new = [(t, 900.0 if t < 100 else 200.0 + t) for t in range(0, 400, 10)]
    nem.sampler.series = {
        "decode-1/main/rss_bytes": Series("decode-1/main/rss_bytes", "rss_bytes", old_then_new),
        "decode/main/rss_bytes": Series("decode/main/rss_bytes", "rss_bytes", old_then_new),
        "decode-1/table/x": Series("decode-1/table/x", "table_entries", [(0.0, 1.0), (9.0, 1.0)]),
    }
    assert nem._trim_restarted() == {"decode-1": 170.0}
    assert nem.sampler.series["decode-1/main/rss_bytes"].points[0] == (170, 370.0)
    assert nem.sampler.series["decode/main/rss_bytes"].points == old_then_new  # not restarted
    assert "decode-1/table/x" not in nem.sampler.series  # nothing after the restart


def test_network_kinds_are_drawn_with_netns_and_only_asked_for_otherwise() -> None:
    from kvpush_prod.chaos.scenarios.nemesis import kinds_of
    from kvpush_prod.chaos.schedule import DEFAULT_KINDS, NETNS_KINDS

    assert kinds_of({}) == DEFAULT_KINDS and not set(NETNS_KINDS) & set(DEFAULT_KINDS)
    assert kinds_of({"netns": True}) == KINDS
    assert kinds_of({"netns": True, "kinds": "kill, partition"}) == ("kill", "partition")


def _link_state(ns: str) -> tuple[str, str, str]:
    import subprocess

    from kvpush_prod.lab.netns import NS_DEV

    def out(*cmd: str) -> str:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout

    link = out("ip", "-n", ns, "-o", "link", "show", NS_DEV)
    return (
        "DOWN" if "state DOWN" in link else "UP",
        out("ip", "-n", ns, "route", "show"),
        out("tc", "-n", ns, "qdisc", "show", "dev", NS_DEV),
    )


@pytest.mark.skipif(lab_netns.why_not() is not None, reason=str(lab_netns.why_not()))
def test_partition_and_throttle_change_the_link_while_they_hold_and_undo_it(
    tmp_path: Path,
) -> None:
    from types import SimpleNamespace

    from kvpush_prod.chaos.faults import Faults
    from kvpush_prod.chaos.schedule import Fault

    with lab_netns.namespaces(["decode"]) as links:
        ns = links["decode"].netns
        spec = SimpleNamespace(workdir=tmp_path, netns={"decode": (ns, links["decode"].ns_ip)})
        faults = Faults(SimpleNamespace(cluster=SimpleNamespace(spec=spec, procs={})))  # type: ignore[arg-type]
        seen: list[tuple[str, str, str]] = []

        async def apply(kind: str) -> dict[str, Any]:
            begun = asyncio.Event()
            task = asyncio.create_task(faults.apply(Fault(1, 0.0, kind, "decode", 0.5), begun))
            await begun.wait()
            seen.append(_link_state(ns))
            return await task

        healthy = _link_state(ns)
        assert healthy[0] == "UP" and links["decode"].lab in healthy[1]
        notes = asyncio.run(apply("partition"))
        assert seen[-1][0] == "DOWN" and _link_state(ns) == healthy  # the lab route is back
        assert any("down" in c for c in notes["commands"])
        asyncio.run(apply("throttle"))
        assert "tbf" in seen[-1][2] and "10Mbit" in seen[-1][2]
        assert "tbf" not in _link_state(ns)[2]
        lab_netns.partition(ns)
        lab_netns.throttle(ns, "1mbit")
        faults.release_all()  # what a run cut short leaves behind is undone
        assert _link_state(ns)[:2] == healthy[:2] and "tbf" not in _link_state(ns)[2]


def test_a_gap_while_busy_is_a_violation_only_if_the_next_check_still_sees_it(
    tmp_path: Path,
) -> None:
    from kvpush_prod.chaos import nemesis

    sched = Schedule(1, cfg(duration_s=600.0), [], [])
    nem = nemesis.Nemesis(_fake_ctx(tmp_path, set()), sched, nemesis.Settings())
    obs = nem.ctx.observer
    role = (("role", "producer"),)
    balanced = dict(obs.last["prefill"])
    off = {**balanced, ("kvpush_transfers_started_total", role): 6.0}  # +1, nothing running
    obs.last["prefill"] = off
    nem._accounting(exact=False)
    assert nem.inv.violations == []  # a snapshot between two steps: judged at the next check
    assert [t["engine"] for t in nem.accounting_transients] == ["prefill"]
    obs.last["prefill"] = {
        **balanced,
        ("kvpush_transfers_started_total", role): 7.0,
        ("kvpush_transfers_total", (*role, ("outcome", "pushed"))): 7.0,
    }
    nem._accounting(exact=False)
    assert nem.inv.violations == []  # gone by the next check: a transient
    obs.last["prefill"] = off
    nem._accounting(exact=False)
    nem._accounting(exact=False)  # still there at the next check: a violation
    assert len(nem.inv.violations) == 1
    assert "off by +1" in nem.inv.violations[0].detail
    nem.inv.violations.clear()
    nem._accounting(exact=True)  # at a quiet window: at once
    assert len(nem.inv.violations) == 1
