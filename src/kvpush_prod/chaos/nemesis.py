"""The nemesis's run: steady mixed load through the router, the fault schedule applied
(overlapping faults, quiet windows), and the invariant checker working while it runs.

The scenario module (``scenarios/nemesis.py``) builds the schedule and calls ``Nemesis.run``;
everything found goes into the report under ``nemesis``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvpush_prod.chaos.faults import Applied, Faults, touched_engines
from kvpush_prod.chaos.harness import (
    Context,
    _poke,
    admin_token_file,
    reference_answer,
)
from kvpush_prod.chaos.invariants import Invariants, in_flight_during
from kvpush_prod.chaos.load import LoadGenerator, Record
from kvpush_prod.chaos.observe import ACTIVE, BLOCKS, RUNNING, TRANSFERS, WAITING, Samples
from kvpush_prod.chaos.resources import (
    MIN_JUDGED_S,
    ResourceSampler,
    cluster_targets,
    report_lines,
)
from kvpush_prod.chaos.schedule import Fault, Quiet, Schedule
from kvpush_prod.lab.client import metric_sum

STARTED = "kvpush_transfers_started_total"
LEASES = "kvpush_leases_active"


@dataclass
class Settings:
    """The nemesis's own knobs (besides the schedule's)."""

    grace_s: float = 10.0  # a fault may explain failures this long after its end
    role_bound_s: float = 30.0  # longest a role may have no engine in service
    check_every_s: float = 1.0
    accounting_every_s: float = 5.0
    progress_every_s: float = 30.0
    settle_s: float = 60.0  # how long a quiet window may wait for nothing to be held
    flood_rate: int = 2000
    cancel_fraction: float = 0.08
    prefix_fraction: float = 0.3
    sample_every_s: float = 5.0  # resources of every engine and the router
    # Growth before this (from the start, or from an engine's restart) is warming up: vLLM's
    # CPU workers were seen to add ~100-160 MiB over their first minutes of mixed prompts.
    resource_warmup_s: float = 120.0
    rest_gap_s: float = 2.5  # at least this between the two samples at rest in a window


@dataclass
class QuietResult:
    planned_at: float
    start: float
    settled: bool
    waited_s: float
    readings: dict[str, dict[str, float | None]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "planned_at": self.planned_at,
            "start": round(self.start, 1),
            "settled": self.settled,
            "waited_s": round(self.waited_s, 1),
            "readings": self.readings,
        }


def _sum(s: Samples, name: str, **labels: str) -> float:
    return metric_sum(s, name, **labels) if any(n == name for n, _ in s) else 0.0


def accounting_of(s: Samples) -> tuple[float, float, float, float] | None:
    """(started, ended over all outcomes, active, requests running + waiting) from one
    scrape; None when the engine does not export the started counter although transfers
    ended or run there (a fresh process shows a labelled counter only once it counted)."""
    ended, active = _sum(s, TRANSFERS), _sum(s, ACTIVE)
    if not any(n == STARTED for n, _ in s) and (ended or active):
        return None
    return (_sum(s, STARTED), ended, active, _sum(s, RUNNING) + _sum(s, WAITING))


def held_of(s: Samples) -> dict[str, float | None]:
    """What an engine holds: connector blocks, live leases, transfers in progress."""
    return {
        BLOCKS: _sum(s, BLOCKS),
        LEASES: _sum(s, LEASES),
        ACTIVE: _sum(s, ACTIVE),
    }


class Nemesis:
    """One run of ``schedule`` on ``ctx``'s cluster."""

    def __init__(self, ctx: Context, schedule: Schedule, settings: Settings) -> None:
        self.ctx = ctx
        self.schedule = schedule
        self.s = settings
        c = ctx.cluster
        self.inv = Invariants(
            {c.urls[e]: e for e in c.engine_names},
            settings.grace_s,
            settings.role_bound_s,
            on_violation=lambda v: ctx.log(
                f"VIOLATION at {v.at:.0f} s ({v.invariant}): {v.detail}"
            ),
        )
        self.faults = Faults(ctx, settings.flood_rate)
        self.applied: list[Applied] = []
        self.quiet: list[QuietResult] = []
        self.gen: LoadGenerator | None = None
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._judged: set[int] = set()
        self._refs: asyncio.Queue[Record] = asyncio.Queue()
        self._t0 = time.monotonic()
        self._shift = 0.0  # how far the run is behind its plan
        self._no_started: set[str] = set()
        self._suspect: set[str] = set()  # engines whose last busy check saw a gap
        self.accounting_transients: list[dict[str, Any]] = []
        self.accounting_exact = 0
        self.sampler = ResourceSampler(
            cluster_targets(c), settings.sample_every_s, clock=self._load_clock
        )
        self.load_samples: list[tuple[float, float]] = []  # (time, requests in flight)

    # -- the run
    async def run(self) -> None:
        mix = self.ctx.opts.mix(
            cancel_fraction=self.s.cancel_fraction, prefix_fraction=self.s.prefix_fraction
        )
        self.gen = gen = self.ctx.load(10**9, mix=mix, phase="nemesis")
        self._t0 = time.monotonic()
        loading = asyncio.create_task(gen.run())
        sampling_done = asyncio.Event()
        sampling = asyncio.create_task(self.sampler.run(sampling_done))
        helpers = [
            asyncio.create_task(self._checker()),
            asyncio.create_task(self._progress()),
            # As many as the final check uses: the reference engine batches them.
            *(asyncio.create_task(self._reference_worker()) for _ in range(4)),
        ]
        try:
            await self._drive()
        finally:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            self.faults.release_all()
            gen.stop()
            await loading
            await self._judge_new()
            await self._refs.join()
            for t in helpers:
                t.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
        await self._quiet_window(Quiet(self.schedule.config.duration_s, 0.0), final=True)
        sampling_done.set()
        await sampling
        self._report()

    def now(self) -> float:
        return time.monotonic() - self._t0

    async def _until(self, planned: float) -> None:
        wait = planned + self._shift - self.now()
        if wait > 0:
            await asyncio.sleep(wait)

    async def _drive(self) -> None:
        for item in self.schedule.timeline():
            await self._until(item.at)
            if isinstance(item, Quiet):
                t = self.now()
                await asyncio.gather(*self._tasks.values(), return_exceptions=True)
                await self._quiet_window(item)
                self._shift += max(0.0, self.now() - t - item.duration)
            else:
                await self._start(item)
        await self._until(self.schedule.config.duration_s)

    async def _start(self, f: Fault) -> None:
        """Start ``f`` once no other fault keeps an engine of its role out of service."""
        cfg = self.schedule.config
        t = self.now()
        if f.out_of_service:
            blocking = [
                self._tasks[a.fault.id]
                for a in self.applied
                if a.fault.out_of_service
                and cfg.role(a.fault.engine) == cfg.role(f.engine)
                and not self._tasks[a.fault.id].done()
            ]
            await asyncio.gather(*blocking, return_exceptions=True)
        applied = Applied(f, touched_engines(self.ctx, f), delay_s=self.now() - t)
        self._shift += applied.delay_s
        self.applied.append(applied)
        begun = asyncio.Event()
        self._tasks[f.id] = asyncio.create_task(self._one(applied, begun))
        await begun.wait()

    async def _one(self, a: Applied, begun: asyncio.Event) -> None:
        f = a.fault
        self.inv.fault_started(f.id, f.kind, a.engines, self._load_clock())
        a.start = self._load_clock()
        self.ctx.event(
            f"fault {f.id} {f.kind} {f.engine}" + (f" (from {f.peer})" if f.peer else ""),
            hold_s=f.hold_s,
            active=sum(1 for t in self._tasks.values() if not t.done()),
        )
        try:
            a.notes = await self.faults.apply(f, begun)
        except Exception as exc:  # noqa: BLE001 - recorded; the run goes on
            a.notes = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            begun.set()
            a.end = self._load_clock()
            self.inv.fault_ended(f.id, a.end)
        self.ctx.event(f"fault {f.id} {f.kind} {f.engine} over", **a.notes)

    def _load_clock(self) -> float:
        """Now on the records' clock (seconds since the scenario began)."""
        return self.ctx.now()

    # -- the checker
    async def _checker(self) -> None:
        """While the run goes on: judge every finished request, watch the roles in service
        and the transfer accounting."""
        last_accounting = 0.0
        token = admin_token_file(self.ctx.cluster.spec.workdir).read_text().strip()
        async with httpx.AsyncClient(trust_env=False) as client:
            while True:
                await asyncio.sleep(self.s.check_every_s)
                self._note_load()
                await self._judge_new()
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    await self._roles(client, token)
                if self.now() - last_accounting >= self.s.accounting_every_s:
                    last_accounting = self.now()
                    self._accounting(exact=False)

    def _note_load(self) -> None:
        assert self.gen is not None
        self.load_samples.append((self._load_clock(), float(self.gen.outstanding)))

    async def _judge_new(self) -> None:
        assert self.gen is not None
        for rec in list(self.gen.records):
            if rec.idx in self._judged or rec.ended <= 0.0:
                continue
            self._judged.add(rec.idx)
            if rec.ok:
                self._refs.put_nowait(rec)  # judged once the reference answered
            else:
                self.inv.request(rec, None)

    async def _reference_worker(self) -> None:
        url = self.ctx.cluster.urls["reference"]
        cache = self.ctx.reference_cache
        async with httpx.AsyncClient(trust_env=False) as client:
            while True:
                rec = await self._refs.get()
                try:
                    key = self.ctx.specs[rec.idx].reference_key()
                    ref = cache.get(key)
                    if ref is None:
                        ref = await reference_answer(client, url, self.ctx.specs[rec.idx])
                        if ref is not None:
                            cache[key] = ref
                    self.inv.request(rec, ref)
                finally:
                    self._refs.task_done()

    async def _roles(self, client: httpx.AsyncClient, token: str) -> None:
        r = await client.get(
            self.ctx.cluster.urls["router"] + "/admin/backends",
            headers={"Authorization": f"Bearer {token}"},
            timeout=5,
        )
        if r.status_code != 200:
            return
        body = r.json()
        self.inv.roles_in_service(
            self._load_clock(),
            {
                role: sum(1 for b in body.get(role, []) if b.get("up") and not b.get("draining"))
                for role in ("prefill", "decode")
            },
        )

    def _accounting(self, exact: bool) -> None:
        """started = ended + active on every engine the observer read last (exact: quiet).

        While the load runs, one scrape is a snapshot of series an engine publishes at its
        steps (the scheduler's and the workers'), and a gap beyond what is in flight was
        seen once for a moment (+1 with nothing running, gone at the next check and exact
        at every quiet window). A gap while busy is therefore judged at the next check: it
        is a violation if it is still there, a transient (logged, counted in the report)
        if not. At a quiet window every gap is a violation at once."""
        at = self._load_clock()
        for engine in self.ctx.cluster.engine_names:
            s = self.ctx.observer.last.get(engine)
            if s is None:
                continue
            acc = accounting_of(s)
            if acc is None:
                self._no_started.add(engine)
                continue
            started, ended, active, requests = acc
            slack = 0.0 if exact else requests + active
            gap = started - ended - active
            if exact or abs(gap) <= slack:
                self._suspect.discard(engine)
            elif engine not in self._suspect:
                self._suspect.add(engine)
                self.accounting_transients.append(
                    {"engine": engine, "at": round(at, 1), "gap": gap, "slack": slack}
                )
                self.ctx.log(
                    f"accounting: {engine} off by {gap:+g} at {at:.0f} s (started "
                    f"{started:g}, ended {ended:g}, active {active:g}, {requests:g} requests) "
                    "while busy: judged again at the next check"
                )
                continue
            self.inv.accounting(engine, at, started, ended, active, slack)
            self.accounting_exact += int(exact)

    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(self.s.progress_every_s)
            c = self.inv.counts
            live = [
                f"{a.fault.kind} {a.fault.engine}"
                for a in self.applied
                if not self._tasks[a.fault.id].done()
            ]
            self.ctx.log(
                f"nemesis {self.now():.0f}/{self.schedule.config.duration_s:.0f} s: "
                f"{c.correct} correct, {c.failed_explained} failed under a fault, "
                f"{c.cancelled} cancelled; {len(self.inv.violations)} violations; "
                f"faults now: {', '.join(live) or 'none'}"
            )

    # -- quiet windows
    async def _quiet_window(self, q: Quiet, final: bool = False) -> None:
        """Pause the load for the window: let the cluster settle, check nothing is held and
        the accounting is exact, sample the resources at rest, then resume."""
        assert self.gen is not None
        start = self._load_clock()
        self.gen.pause()
        await self.gen.wait_idle(timeout=self.ctx.opts.timeout + 10)
        self._note_load()
        t0 = time.monotonic()
        settled, readings = await self._settle()
        await self.ctx.observer.poll()
        at = self._load_clock()
        for engine, held in readings.items():
            self.inv.held(engine, at, held)
        self._accounting(exact=True)
        res = QuietResult(q.at, start, settled, time.monotonic() - t0, readings)
        self.quiet.append(res)
        self.ctx.event(
            "final quiet check" if final else "quiet window",
            settled=settled,
            waited_s=round(res.waited_s, 1),
            violations=len(self.inv.violations),
        )
        # Resources at rest: two samples, the load still paused (what flatness compares).
        # A poke first: an engine publishes its gauges (the tables' sizes) at its steps, so
        # one that idled since its last transfer shows values from before it ended.
        await _poke(self.ctx.cluster)
        for _ in range(2):
            await asyncio.sleep(max(self.s.rest_gap_s, (q.duration - (time.monotonic() - t0)) / 2))
            await asyncio.to_thread(self.sampler.sample_once)
            self._note_load()
        if not final:
            self.gen.resume()

    async def _settle(self) -> tuple[bool, dict[str, dict[str, float | None]]]:
        """Wait (at most ``settle_s``) until every live engine holds nothing; poke the
        engines once halfway (an idle engine publishes its gauges only when it steps)."""
        deadline = time.monotonic() + self.s.settle_s
        poked = False
        readings: dict[str, dict[str, float | None]] = {}
        while True:
            got = await self.ctx.observer.poll()
            readings = {e: held_of(s) for e, s in got.items() if s is not None}
            if all(not any(v for v in h.values()) for h in readings.values()):
                return True, readings
            if time.monotonic() >= deadline:
                return False, readings
            if not poked and deadline - time.monotonic() < self.s.settle_s / 2:
                poked = True
                await _poke(self.ctx.cluster)
            await asyncio.sleep(1.0)

    # -- the report
    def _report(self) -> None:
        assert self.gen is not None
        records = self.gen.records
        faults = []
        for a in self.applied:
            span = self.inv.spans.get(a.fault.id)
            d = a.as_dict()
            if span is not None:
                d["requests_in_flight"] = in_flight_during(span, records)
                d["failed_requests"] = sorted(self.inv.explained_by.get(a.fault.id, []))
            faults.append(d)
        self.ctx.report.data["nemesis"] = {
            "schedule": self.schedule.to_dict(),
            "faults": faults,
            "quiet_windows": [q.as_dict() for q in self.quiet],
            "invariants": self.inv.as_dict(),
            "accounting_not_exported": sorted(self._no_started),
            "accounting_transients": self.accounting_transients,
            "requests": len(records),
            # How far the faults ran behind their plan: the waits for a role's engine and
            # for quiet windows (a restart slot shorter than the box's restarts shows here).
            "behind_plan_s": round(self._shift, 1),
        }
        self._resources()
        self._checks()

    def _trim_restarted(self) -> dict[str, float]:
        """A restarted engine is a new process tree: its series are judged from its last
        restart on (what the old process held is not growth of the new one), and only with
        ``MIN_JUDGED_S`` of samples after the warm-up. The time each engine's series start
        from."""
        back: dict[str, float] = {}
        for a in self.applied:
            if a.fault.kind in ("kill", "restart") and a.end is not None:
                back[a.fault.engine] = max(back.get(a.fault.engine, 0.0), a.end)
        for name, series in list(self.sampler.series.items()):
            since = back.get(name.split("/", 1)[0])
            if since is None:
                continue
            series.points = [p for p in series.points if p[0] >= since]
            series.min_span_s = MIN_JUDGED_S
            if len(series.points) < 2:
                del self.sampler.series[name]
        return {e: round(t, 1) for e, t in back.items()}

    def _resources(self) -> None:
        """Flatness of every sampled series: the report's rows, the failing ones printed."""
        restarted = self._trim_restarted()
        rows = self.sampler.report(self.load_samples, warmup_s=self.s.resource_warmup_s)
        grows = [r for r in rows if not r.passed]
        self.ctx.report.data["nemesis"]["resources"] = {
            "samples": self.sampler.samples,
            "series": len(rows),
            "restarted_from": restarted,
            "rows": [r.as_dict() for r in rows],
        }
        self.ctx.event("resource flatness", series=len(rows), grows=len(grows))
        for line in report_lines(grows or rows[:0]):
            self.ctx.log(line)
        self.ctx.report.check(
            "nemesis: every resource series is flat (no growth with time)",
            bool(rows) and not grows,
            "; ".join(
                f"{r.name} {r.first:g} -> {r.last:g}, {r.slope_per_hour:+.3g}/h "
                f"(bound {r.bound_per_hour:g}/h)"
                for r in grows[:5]
            )
            if grows
            else ("" if rows else "no resource was sampled"),
        )

    def _checks(self) -> None:
        report, inv = self.ctx.report, self.inv
        names = (
            "every answer equals the single engine's",
            "no request outlives its bound",
            "a request fails only when a fault touched an engine it used",
            "every transfer ends exactly once (started = ended + active)",
            "nothing held after a quiet window",
            "no role is left without an engine longer than the bound",
        )
        for name in names:
            bad = [v for v in inv.violations if v.invariant == name]
            report.check(
                f"nemesis: {name}",
                not bad,
                f"{len(bad)} violations; first at {bad[0].at:.0f} s: {bad[0].detail}"
                if bad
                else "",
            )
        report.check(
            "nemesis: the transfer accounting was checked at every quiet window",
            not self._no_started and self.accounting_exact > 0,
            f"{STARTED} not exported by {sorted(self._no_started)}" if self._no_started else "",
        )
        errors = [a for a in self.applied if "error" in a.notes]
        report.check(
            "nemesis: every planned fault was applied",
            len(self.applied) == len(self.schedule.faults) and not errors,
            f"{len(self.applied)} of {len(self.schedule.faults)} applied; errors: "
            + "; ".join(f"{a.fault.id} {a.fault.kind}: {a.notes['error']}" for a in errors[:3])
            if errors or len(self.applied) != len(self.schedule.faults)
            else "",
        )
        unsettled = [q for q in self.quiet if not q.settled]
        report.check(
            "nemesis: the cluster settled in every quiet window",
            not unsettled,
            f"{len(unsettled)} of {len(self.quiet)} did not settle within {self.s.settle_s:g} s"
            if unsettled
            else "",
        )
        report.check(
            "nemesis: answers were checked while it ran",
            inv.counts.correct > 0,
            "" if inv.counts.correct else "no answer was checked correct",
        )
