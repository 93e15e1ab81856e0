"""The skeleton every chaos scenario runs in: options, cluster, load, fault, quiescence,
references, report and the verdict line. A scenario only supplies its fault plan.

A scenario is a module with ``NAME``, ``DESCRIPTION``, ``needs(opts)`` (the cluster it
requires) and ``async run(ctx)`` (load + faults); see ``scenarios/kill_prefill.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import secrets
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

from kvpush_prod.chaos.load import LoadGenerator, Record
from kvpush_prod.chaos.observe import TRANSFERS, Observer, idle_problems
from kvpush_prod.chaos.verdict import (
    Kill,
    Report,
    Tally,
    attribute_streaming,
    describe_wrong,
    failures_beyond_kills,
    tally,
)
from kvpush_prod.chaos.workload import Mix, RequestSpec, workload
from kvpush_prod.lab.cluster import Cluster, ClusterSpec
from kvpush_prod.lab.netns import cluster_namespaces

ENGINES = ("prefill", "decode")  # the first engine of each role (the single-pair names)
FAULTS_ENV = "KVPUSH_FAULTS"


@dataclass
class Options:
    """What every scenario takes on its command line."""

    requests: int = 200
    concurrency: int = 16
    seed: int = 0
    report: Path | None = None
    timeout: float = 120.0  # a request not ended after this is hung
    policy: str | None = None  # kv_load_failure_policy (None: the scenario's default)
    decode_blocks: int = 256  # D's KV cache in blocks (small: freed blocks are reused soon)
    quiesce_timeout: float = 100.0
    workdir: Path | None = None
    progress_every: int = 20
    # The load's mix (``mix``), by default the Mix's own.
    min_prompt: int = Mix.min_prompt
    max_prompt: int = Mix.max_prompt
    min_tokens: int = Mix.min_tokens
    max_tokens: int = Mix.max_tokens
    stream_fraction: float = Mix.stream_fraction
    chat_fraction: float = Mix.chat_fraction
    poke: bool = True  # after a failed quiescence, send each engine one request and re-read
    trace: bool = False  # engines write kvpush event traces (KVPUSH_TRACE_DIR) to workdir/traces
    extra: dict[str, Any] = field(default_factory=dict)  # the scenario's own options

    def mix(self, **over: Any) -> Mix:
        base = Mix(
            self.min_prompt,
            self.max_prompt,
            self.min_tokens,
            self.max_tokens,
            self.stream_fraction,
            self.chat_fraction,
        )
        return Mix(**{**asdict(base), **over})

    def as_dict(self) -> dict[str, Any]:
        return {
            f.name: (str(v) if isinstance(v := getattr(self, f.name), Path) else v)
            for f in fields(self)
        }


@dataclass(frozen=True)
class Needs:
    """The cluster a scenario requires (scenarios with equal needs can share one)."""

    policy: str = "recompute"
    prefill_faults: tuple[tuple[str, Any], ...] = ()  # KVPUSH_FAULTS fields for P
    decode_blocks: int = 256
    # The router's admin API (token in workdir/ADMIN_TOKEN_FILE) and how long requests wait
    # for an engine that is drained or restarting (router no_backend_wait_s; 0: off).
    admin: bool = False
    no_backend_wait_s: float = 0.0
    profile: str | None = None  # the engines' profile (None: the lab's cpu-loopback)
    # How many prefill and decode engines (prefill, prefill-1, ...; decode, decode-1, ...)
    # and the router's policy (None: its default).
    prefills: int = 1
    decodes: int = 1
    router_policy: str | None = None
    # Every prefill and decode engine in its own network namespace (``lab.netns``; root),
    # KV over TCP between them: the nemesis's partition and throttle faults need it.
    netns: bool = False

    def faults_json(self, workdir: Path) -> str | None:
        if not self.prefill_faults:
            return None
        d = dict(self.prefill_faults)
        if d.get("active_file") == "{workdir}":
            d["active_file"] = str(fault_switch(workdir))
        return json.dumps(d)


def fault_switch(workdir: Path) -> Path:
    """The file whose presence turns P's injected faults on (``active_file``)."""
    return workdir / "faults-active"


def cluster_spec(needs: Needs, workdir: Path, trace: bool = False) -> ClusterSpec:
    """A cluster for ``needs``: stable engine ids, so a restarted engine keeps its identity."""
    spec = ClusterSpec(
        workdir=workdir,
        prefill_engine_id="chaos-prefill",
        decode_engine_id="chaos-decode",
        kv_load_failure_policy=needs.policy,
        profile=needs.profile,
        prefills=needs.prefills,
        decodes=needs.decodes,
    )
    if needs.prefills + needs.decodes > 2:
        spec.prefill_kv_gib = spec.decode_kv_gib = 1  # five engines must fit beside others
    if needs.router_policy:
        spec.router_args += ["--policy", needs.router_policy]
    if trace:
        for env in (spec.prefill_env, spec.decode_env):
            env["KVPUSH_TRACE_DIR"] = str(workdir / "traces")
    faults = needs.faults_json(workdir)
    if faults:
        spec.prefill_env[FAULTS_ENV] = faults
    if needs.decode_blocks:
        spec.decode_args += ["--num-gpu-blocks-override", str(needs.decode_blocks)]
    if needs.admin:
        token = admin_token_file(workdir)
        token.write_text(secrets.token_hex(32) + "\n")
        token.chmod(0o600)
        spec.router_args += ["--admin-token-file", str(token)]
    if needs.no_backend_wait_s:
        spec.router_args += ["--no-backend-wait", str(needs.no_backend_wait_s)]
    return spec


def placed(needs: Needs, spec: ClusterSpec, stack: contextlib.ExitStack) -> ClusterSpec:
    """``spec``, its engines moved into network namespaces that ``stack`` removes, when
    ``needs.netns``; close ``stack`` after the cluster has stopped."""
    if needs.netns:
        stack.enter_context(cluster_namespaces(spec))
    return spec


def admin_token_file(workdir: Path) -> Path:
    """The router's admin token of a cluster started with ``Needs(admin=True)``."""
    return workdir / "router-admin.token"


async def _keep_loading(gen: LoadGenerator | None) -> None:
    while gen is not None:
        if gen.progress.sent >= gen.limit:
            gen.extend(gen.concurrency)
        await asyncio.sleep(0.2)


async def _pace(gen: LoadGenerator, per_s: float) -> None:
    """Steady load at about ``per_s`` requests a second (at most the generator's concurrency
    in flight), whatever its limit was."""
    while True:
        if gen.progress.sent >= gen.limit:
            gen.extend(1)
        await asyncio.sleep(1.0 / per_s)


def _compact(v: Any) -> str:
    """Evidence readings in a few characters: ``P[active=1 blocks=0] D[...]``."""
    if isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values()):
        short = {
            "transfers_active": "active",
            "connector_blocks": "blocks",
            "credits_in_use_blocks": "credits",
        }
        parts = []
        for eng, r in v.items():
            kv = " ".join(f"{short[k]}={r[k]:g}" for k in short if r.get(k) is not None)
            parts.append(f"{eng}[{kv}]")
        return " ".join(parts)
    return str(v)


class Context:
    """What a scenario's ``run`` works with."""

    def __init__(
        self,
        name: str,
        cluster: Cluster,
        opts: Options,
        needs: Needs,
        report: Report,
        observer: Observer,
        log: Callable[[str], None],
    ) -> None:
        self.name = name
        self.cluster = cluster
        self.opts = opts
        self.needs = needs
        self.report = report
        self.observer = observer
        self._log = log
        self.records: list[Record] = []
        self.specs: dict[int, RequestSpec] = {}
        self._stream: Iterator[RequestSpec] | None = None
        self._t0 = time.monotonic()
        self.generators: list[LoadGenerator] = []
        self.engines: tuple[str, ...] = tuple(cluster.engine_names)
        self.kills: list[Kill] = []
        # Reference answers a scenario already fetched (RequestSpec.reference_key -> text):
        # the final check reuses them instead of asking the reference engine again.
        self.reference_cache: dict[tuple[str, int, bool], str] = {}

    # -- output
    def now(self) -> float:
        return time.monotonic() - self._t0

    def log(self, msg: str) -> None:
        self._log(f"[{self.name}] {self.now():7.1f}s  {msg}")

    def event(self, what: str, **data: Any) -> None:
        """A phase or an injected fault: printed and kept in the report."""
        self.report.events.append({"at": round(self.now(), 3), "event": what, **data})
        extra = ", ".join(f"{k}={_compact(v)}" for k, v in data.items())
        self.log(what + (f" ({extra})" if extra else ""))

    # -- load
    def load(
        self,
        limit: int,
        *,
        concurrency: int | None = None,
        mix: Mix | None = None,
        phase: str = "load",
    ) -> LoadGenerator:
        """A load generator through the router; requests continue the run's numbering."""
        if self._stream is None or mix is not None:
            start = len(self.specs)
            base = workload(self.opts.seed, mix or self.opts.mix())
            self._stream = (s for s in base if s.idx >= start)
        gen = LoadGenerator(
            self.cluster.urls["router"],
            self._remember(self._stream),
            concurrency=concurrency or self.opts.concurrency,
            limit=limit,
            timeout=self.opts.timeout,
            progress_every=self.opts.progress_every,
            log=self.log,
            t0=self._t0,
        )
        gen.phase = phase
        self.generators.append(gen)
        return gen

    def _remember(self, it: Iterator[RequestSpec]) -> Iterator[RequestSpec]:
        for spec in it:
            self.specs[spec.idx] = spec
            yield spec

    # -- faults
    async def wait_in_flight(
        self,
        engines: tuple[str, ...] = ENGINES,
        timeout: float = 60.0,
        what: str = "fault",
        gen: LoadGenerator | None = None,
    ) -> dict[str, Any] | None:
        """Wait for transfers in progress on ``engines``; record a failed check if none come.

        With ``gen``, its limit is raised as needed so that load keeps coming meanwhile."""
        top_up = asyncio.create_task(_keep_loading(gen)) if gen is not None else None
        try:
            evidence = await self.observer.wait_in_flight(engines, timeout)
        finally:
            if top_up is not None:
                top_up.cancel()
        self.report.check(
            f"{what} injected mid-transfer",
            evidence is not None,
            ""
            if evidence
            else f"no transfer in flight on {engines} within {timeout:.0f} s; injected anyway",
        )
        return evidence

    def outstanding(self) -> int:
        return sum(g.outstanding for g in self.generators)

    async def kill(self, name: str) -> None:
        await asyncio.to_thread(self.cluster.procs[name].kill)

    async def restart(self, name: str, graceful: bool = False, timeout: float = 600.0) -> float:
        """Stop ``name`` (SIGTERM, or it is already dead), start it again; seconds taken."""
        t0 = time.monotonic()
        proc = self.cluster.procs[name]
        if proc.alive():
            if graceful:
                await asyncio.to_thread(proc.stop)
            else:
                await asyncio.to_thread(proc.kill)
        else:
            await asyncio.to_thread(proc.stop)  # reap it and close its log
        await asyncio.to_thread(self.cluster.start_engine, name, True, timeout)
        self.observer.note_restart(name)
        return time.monotonic() - t0

    async def wait_router_ready(
        self, timeout: float = 60.0, engine: str | None = None
    ) -> float | None:
        """Wait until the router reports both roles up (with ``engine``: until it routes to
        that engine again); seconds waited, None on timeout."""
        t0 = time.monotonic()
        url = self.cluster.urls["router"] + "/health"
        async with httpx.AsyncClient(trust_env=False) as client:
            while time.monotonic() - t0 < timeout:
                if engine is not None:
                    if await self.observer.router_has(engine):
                        return time.monotonic() - t0
                else:
                    try:
                        r = await client.get(url, timeout=2.0)
                        if r.status_code == 200:
                            return time.monotonic() - t0
                    except httpx.HTTPError:
                        pass
                await asyncio.sleep(0.25)
        return None

    def phase_records(self, phase: str) -> list[Record]:
        return [r for g in self.generators for r in g.records if r.phase == phase]


async def break_and_recover(
    ctx: Context, gen: LoadGenerator, engine: str, how: str, tag: str = ""
) -> float:
    """Wait for transfers in flight, then ``kill`` (-9) or ``term`` (graceful stop) ``engine``
    and start it again with the same engine id and port; or ``rolling``: drain the load
    first (nothing in flight), stop gracefully, restart, then resume with a burst. Requests launched meanwhile are in
    phase ``outage<tag>``, those launched once the router has the pair again ``after<tag>``.
    Returns the time of the fault (``ctx.now()``)."""
    verb = {
        "kill": "kill -9",
        "term": "graceful stop (SIGTERM) of",
        "rolling": "rolling restart (drained, then SIGTERM) of",
    }[how]
    if how == "rolling":
        # A redeploy at a quiet moment: nothing in flight, so the peer hears of the new
        # process only from the traffic that follows (no cancel or ack in the queue).
        gen.pause()
        drained = await gen.wait_idle(timeout=ctx.opts.timeout)
        ctx.report.check(
            f"nothing in flight before the rolling restart{tag}",
            drained,
            "" if drained else f"{gen.outstanding} requests still in flight",
        )
        evidence: dict[str, Any] | None = None
    else:
        evidence = await ctx.wait_in_flight(ENGINES, what=f"{verb} {engine}", gen=gen)
    gen.phase = f"outage{tag}"
    at = ctx.now()
    if how == "kill":
        await ctx.kill(engine)
        ctx.event(
            f"{verb} {engine} (whole process tree)",
            evidence=evidence,
            outstanding=ctx.outstanding(),
        )
    else:
        ctx.event(f"{verb} {engine}", evidence=evidence, outstanding=ctx.outstanding())
    secs = await ctx.restart(engine, graceful=how != "kill")
    ctx.event(f"{engine} restarted and healthy", seconds=round(secs, 1))
    waited = await ctx.wait_router_ready()
    gen.phase = f"after{tag}"
    gen.resume()  # after a rolling restart: a burst of `concurrency` requests at once
    ctx.event(
        "router has the pair again"
        if waited is not None
        else "router did NOT report the pair healthy within 60 s",
        waited_s=None if waited is None else round(waited, 1),
    )
    ctx.report.check(
        f"router sees {engine} again after the restart{tag}",
        waited is not None,
        "" if waited is not None else "GET /health of the router stayed 503",
    )
    return at


async def kill_in_flight(ctx: Context, gen: LoadGenerator, engine: str, tag: str = "") -> Kill:
    """Wait for a transfer in flight on ``engine`` (load topped up meanwhile), kill -9 its
    whole process tree, and record the requests it held: the most that may fail for it (the
    larger of its own running + waiting count and the router's legs open to it). Requests
    launched from here are in phase ``outage<tag>``."""
    evidence = await ctx.wait_in_flight((engine,), what=f"kill -9 {engine}", gen=gen)
    held = await ctx.observer.requests_on(engine)
    legs = await ctx.observer.router_legs(engine)
    gen.phase = f"outage{tag}"
    at = ctx.now()
    await ctx.kill(engine)
    until = ctx.now()
    legs = max(legs, await ctx.observer.router_legs(engine))
    kill = Kill(engine, at, max(held, legs), until)
    ctx.kills.append(kill)
    ctx.event(
        f"kill -9 {engine} (whole process tree)",
        evidence=evidence,
        in_flight=kill.in_flight,
        engine_requests=held,
        router_legs=legs,
        outstanding=ctx.outstanding(),
    )
    return kill


async def rejoin(
    ctx: Context,
    gen: LoadGenerator,
    engine: str,
    tag: str = "",
    timeout: float = 120.0,
    per_s: float = 2.0,
) -> bool:
    """Start the killed ``engine`` again (same port and engine id) under a steady load of
    ``per_s`` requests a second, wait until the router routes to it and its new process has
    finished a request of the load (phase ``after<tag>`` from then on); checks both. True if
    it took traffic again."""
    pacer = asyncio.create_task(_pace(gen, per_s))
    try:
        secs = await ctx.restart(engine)
    finally:
        pacer.cancel()
    ctx.event(
        f"{engine} restarted and healthy",
        seconds=round(secs, 1),
        sent_meanwhile=len([r for r in gen.records if r.phase == f"outage{tag}"]),
    )
    waited = await ctx.wait_router_ready(engine=engine)
    ctx.report.check(
        f"the router routes to {engine} again after its restart{tag}",
        waited is not None,
        "" if waited is not None else "kvpush_router_backend_up stayed 0 for 60 s",
    )
    gen.phase = f"after{tag}"
    top_up = asyncio.create_task(_keep_loading(gen))
    t0 = time.monotonic()
    served = 0.0
    try:
        while time.monotonic() - t0 < timeout:
            served = await ctx.observer.served(engine)
            if served > 0:
                break
            await asyncio.sleep(0.5)
    finally:
        top_up.cancel()
    took = served > 0
    ctx.event(
        f"{engine} {'takes traffic again' if took else 'took NO traffic'}",
        served=served,
        waited_s=round(time.monotonic() - t0, 1),
    )
    ctx.report.check(
        f"{engine} takes traffic again after its restart{tag}",
        took,
        "" if took else f"its new process finished no request in {timeout:.0f} s",
    )
    return took


async def traffic_resumes(ctx: Context, gen: LoadGenerator, i: int, per_phase: int) -> bool:
    """After recovery ``i``: let ``per_phase`` more requests go and wait until they succeed
    (phase ``after<i>``); False if they did not within 180 s."""
    gen.extend(max(0, gen.progress.sent + per_phase - gen.limit))
    resumed = await gen.wait_ok_in_phase(f"after{i}", per_phase, timeout=180)
    ctx.event(
        f"traffic after restart {i}: {'resumed' if resumed else 'NOT resumed'}",
        ok=gen.progress.by_phase_ok.get(f"after{i}", 0),
    )
    return resumed


def check_resumed(ctx: Context, phase: str, what: str, until: float | None = None) -> None:
    """Every request launched in ``phase`` (after a recovery) must have succeeded; with
    ``until``, only those that ended before it (the next fault) count."""
    recs = [r for r in ctx.phase_records(phase) if until is None or r.ended <= until]
    bad = [r for r in recs if not r.ok]
    detail = ""
    if not recs:
        detail = f"no request was sent in phase {phase}"
    elif bad:
        first = bad[0]
        detail = (
            f"{len(bad)}/{len(recs)} requests after recovery failed; first: "
            f"{first.status or first.error_kind} {first.error[:200]}"
        )
    ctx.report.check(what, bool(recs) and not bad, detail)


def check_all_answered(ctx: Context, records: list[Record], why: str) -> None:
    """A check that every request in ``records`` succeeded; the detail names the first failure."""
    failed = [r for r in records if not r.ok]
    ctx.report.check(
        f"every request answered ({why})",
        not failed,
        f"{len(failed)} failed; first: "
        f"{failed[0].status or failed[0].error_kind} {failed[0].error[:200]}"
        if failed
        else "",
    )


async def faults_under_load(
    ctx: Context, steps: int, fault: Callable[[LoadGenerator, int], Awaitable[None]]
) -> None:
    """Steady load (``ctx.opts.requests`` in all) through ``fault(gen, i)`` for i = 1 ..
    ``steps``: the load keeps coming through each fault, traffic must resume after each
    before the next (phase ``after<i>``; the rest is skipped when it does not), then the
    load finishes."""
    n = ctx.opts.requests
    per_phase = max(4, n // (2 * (steps + 1)))
    gen = ctx.load(n, phase="before")
    gen.hold_open = True  # load keeps coming through every fault
    task = asyncio.create_task(gen.run())
    try:
        await gen.wait_done(max(2, per_phase))
        for i in range(1, steps + 1):
            await fault(gen, i)
            if not await traffic_resumes(ctx, gen, i, per_phase):
                break
        allow_after(gen, n, per_phase)
        await task
    finally:
        gen.stop()
        await task


def allow_after(gen: LoadGenerator, total: int, at_least: int) -> None:
    """Let the generator finish: ``total`` requests in all, and ``at_least`` more from now."""
    gen.limit = max(gen.limit, total, gen.progress.sent + at_least)
    gen.hold_open = False
    gen.extend(0)


# ---------------------------------------------------------------------- the run


def _log_sizes(cluster: Cluster) -> dict[str, int]:
    out = {}
    for p in cluster.log_dir.glob("*.log"):
        with contextlib.suppress(OSError):
            out[p.name] = p.stat().st_size
    return out


_NOISE = re.compile(r"\b[0-9a-f]{32}\b|\b\d+(\.\d+)?\b")
_INTERESTING = re.compile(r"kvpush|Traceback|ERROR|Error|error", re.IGNORECASE)


def scan_logs(cluster: Cluster, since: dict[str, int], limit: int = 25) -> dict[str, Any]:
    """Warnings and errors the engines and router logged during the run, grouped by shape."""
    out: dict[str, Any] = {}
    for p in sorted(cluster.log_dir.glob("*.log")):
        try:
            with open(p, "rb") as f:
                f.seek(since.get(p.name, 0))
                text = f.read().decode(errors="replace")
        except OSError:
            continue
        groups: dict[str, dict[str, Any]] = {}
        for line in text.splitlines():
            # kvpush's own warnings reach the log through Python's last-resort handler: bare.
            if (
                "WARNING" not in line
                and "ERROR" not in line
                and "Traceback" not in line
                and "CRITICAL" not in line
                and not line.startswith("kvpush:")
            ):
                continue
            if not _INTERESTING.search(line):
                continue
            body = line.split("]", 1)[-1].strip() if "]" in line else line
            shape = _NOISE.sub("#", body)[:160]
            g = groups.setdefault(shape, {"count": 0, "first": line[:400]})
            g["count"] += 1
        top = sorted(groups.values(), key=lambda g: -g["count"])[:limit]
        if top:
            out[p.name] = top
    return out


async def _references(
    cluster: Cluster,
    specs: dict[int, RequestSpec],
    records: list[Record],
    known: dict[tuple[str, int, bool], str] | None = None,
) -> dict[int, str | None]:
    """The reference engine's greedy answer for every successful request (those in
    ``known`` are not asked again)."""
    want: dict[tuple[str, int, bool], list[int]] = {}
    out: dict[int, str | None] = {}
    for rec in records:
        if not rec.ok:
            continue
        key = specs[rec.idx].reference_key()
        if known is not None and key in known:
            out[rec.idx] = known[key]
        else:
            want.setdefault(key, []).append(rec.idx)
    sem = asyncio.Semaphore(4)
    url = cluster.urls["reference"]

    async def one(client: httpx.AsyncClient, idxs: list[int]) -> None:
        async with sem:
            text = await reference_answer(client, url, specs[idxs[0]])
        for i in idxs:
            out[i] = text

    async with httpx.AsyncClient(trust_env=False) as client:
        await asyncio.gather(*(one(client, idxs) for idxs in want.values()))
    return out


async def reference_answer(client: httpx.AsyncClient, url: str, spec: RequestSpec) -> str | None:
    """The single engine at ``url``'s greedy answer to ``spec`` (None: no answer in 3 tries)."""
    body = spec.body()
    body["stream"] = False
    body.pop("stream_options", None)
    path = "/v1/chat/completions" if spec.chat else "/v1/completions"
    for _ in range(3):
        try:
            r = await client.post(url + path, json=body, timeout=120)
            if r.status_code == 200:
                c = r.json()["choices"][0]
                return str(
                    (c.get("message") or {}).get("content") or ""
                    if spec.chat
                    else c.get("text") or ""
                )
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            pass
        await asyncio.sleep(1)
    return None


async def _healthy(url: str) -> bool:
    async with httpx.AsyncClient(trust_env=False) as client:
        try:
            return (await client.get(url + "/health", timeout=5)).status_code == 200
        except httpx.HTTPError:
            return False


async def _poke(cluster: Cluster) -> None:
    """One plain local request to each live engine: makes it step (and publish its gauges)."""
    async with httpx.AsyncClient(trust_env=False) as client:
        for name in cluster.engine_names:
            proc = cluster.procs.get(name)
            if proc is None or not proc.alive():
                continue
            with contextlib.suppress(httpx.HTTPError):
                await client.post(
                    cluster.urls[name] + "/v1/completions",
                    timeout=30,
                    json={"model": "tiny", "prompt": "w10 w11 w12", "max_tokens": 1},
                )


async def run_on_cluster(
    module: ModuleType,
    cluster: Cluster,
    opts: Options,
    log: Callable[[str], None] = print,
    needs: Needs | None = None,
) -> Report:
    """Run one scenario on a started cluster, which must meet ``module.needs(opts)`` or be
    started for ``needs`` (a compatible cluster shared with other scenarios)."""
    name = module.NAME
    needs = needs or module.needs(opts)
    report = Report(name, opts.as_dict())
    observer = Observer(cluster, tuple(cluster.engine_names))
    ctx = Context(name, cluster, opts, needs, report, observer, log)
    log_from = _log_sizes(cluster)
    t_start = time.monotonic()
    report.data["cluster"] = {
        "block_size": _safe(cluster.block_size),
        "policy": needs.policy,
        "prefill_faults": needs.faults_json(cluster.spec.workdir),
        "decode_blocks": needs.decode_blocks,
        "logs": str(cluster.log_dir),
    }
    baseline = await _check_idle_before(ctx)
    ctx.event(f"start: {module.DESCRIPTION}", policy=needs.policy)
    await observer.start()
    try:
        await module.run(ctx)
    except Exception as exc:  # noqa: BLE001 - the verdict must come, with the reason
        report.check("scenario ran to its end", False, f"{type(exc).__name__}: {exc}")
        for g in ctx.generators:
            g.stop()
    records = [r for g in ctx.generators for r in g.records]
    ctx.event("load over; waiting for quiescence", requests=len(records))
    leaked = await _check_quiescence(ctx, baseline)
    await _check_engines_up(cluster, report)
    _check_kills(ctx, records)

    # Correctness against the single engine.
    ctx.event("computing reference answers", ok=sum(1 for r in records if r.ok))
    refs = await _references(cluster, ctx.specs, records, ctx.reference_cache)
    t = tally(records, refs)
    streamed = attribute_streaming(t, _receives(cluster, observer))
    report.table = _table(t, streamed, leaked)
    _check_answers(report, t, opts)
    _record_details(report, t, streamed, observer, records)
    report.data["logs"] = scan_logs(cluster, log_from)
    report.data["duration_s"] = round(time.monotonic() - t_start, 1)
    return report


def _check_kills(ctx: Context, records: list[Record]) -> None:
    """With engines killed: the requests that failed were at most those in flight on them."""
    if not ctx.kills:
        return
    ctx.report.data["kills"] = [k.as_dict() for k in ctx.kills]
    beyond = failures_beyond_kills(records, ctx.kills)
    ctx.report.check(
        "requests that failed were at most those in flight on the victims",
        not beyond,
        "; ".join(beyond[:5]),
    )


def _receives(cluster: Cluster, observer: Observer) -> dict[str, float]:
    """Every decode engine's receives since start, added up, by outcome."""
    consumer: dict[str, float] = {}
    for engine in cluster.decode_names:
        for (n, lbls), v in observer.tracks[engine].acc.items():
            if n == TRANSFERS and dict(lbls).get("role") == "consumer":
                outcome = dict(lbls).get("outcome", "")
                consumer[outcome] = consumer.get(outcome, 0.0) + v
    return consumer


async def _check_idle_before(ctx: Context) -> dict[str, float]:
    """Idle values before any load: what "back to idle" means for this cluster."""
    idle = await ctx.observer.readings()
    baseline = {e: (r.kv_usage or 0.0) for e, r in idle.items()}
    ctx.report.data["idle_before"] = {e: r.as_dict() for e, r in idle.items()}
    not_idle = [
        p for e, r in idle.items() for p in idle_problems(r, 0.0) if "not exported" not in p
    ]
    if not_idle:
        ctx.report.check("idle before the run", False, "; ".join(not_idle))
    return baseline


async def _check_quiescence(ctx: Context, baseline: dict[str, float]) -> int:
    """Wait for the cluster to settle back to ``baseline``, check it did; the blocks leaked."""
    observer, report = ctx.observer, ctx.report
    settled, last, waited = await observer.quiesce(baseline, ctx.opts.quiesce_timeout)
    leaks = [p for e, r in last.items() for p in idle_problems(r, baseline.get(e))]
    poked: dict[str, Any] | None = None
    if not settled and ctx.opts.poke:
        await _poke(ctx.cluster)
        await asyncio.sleep(3)
        after = await observer.readings()
        still = [p for e, r in after.items() for p in idle_problems(r, baseline.get(e))]
        poked = {"readings": {e: r.as_dict() for e, r in after.items()}, "problems": still}
        if not still:
            leaks = [
                f"{p} (published only once the engine stepped again: stale gauge)" for p in leaks
            ]
    await observer.stop()
    ctx.event("quiescence", settled=settled, waited_s=round(waited, 1))
    report.data["quiescence"] = {
        "settled": settled,
        "waited_s": round(waited, 1),
        "readings": {e: r.as_dict() for e, r in last.items()},
        "after_poke": poked,
    }
    numeric = [p for p in leaks if "not exported" not in p]
    report.check(
        "idle after the run (no connector block, no credit, KV usage at idle)",
        settled and not numeric,
        "; ".join(numeric),
    )
    missing = sorted({p for p in leaks if "not exported" in p})
    report.check("the series the verdict reads are exported", not missing, "; ".join(missing))
    leaked = sum(int(r.blocks or 0) for r in last.values() if r.alive) if not settled else 0
    if poked is not None and not poked["problems"]:
        leaked = 0
    return leaked


async def _check_engines_up(cluster: Cluster, report: Report) -> None:
    for e in cluster.engine_names:
        p = cluster.procs.get(e)
        up = p is not None and p.alive() and await _healthy(cluster.urls[e])
        report.check(
            f"{e} up at the end",
            up,
            ""
            if up
            else f"{e} is not running"
            if p is None or not p.alive()
            else f"{e} runs but GET /health does not answer 200 (its readings were skipped)",
        )


def _table(t: Tally, streamed: dict[str, int], leaked: int) -> dict[str, int]:
    """The verdict's table: how the requests ended, streamed answers attributed."""
    return {
        "sent": t.sent,
        "push": t.served.get("push", 0) + streamed["push"],
        "pull_fallback": t.served.get("pull_fallback", 0) + streamed["pull_fallback"],
        "recompute": t.served.get("recompute", 0)
        + t.served.get("local", 0)
        + streamed["recompute"],
        "unattributed_ok": streamed["unknown"],
        "failed_clear": t.failed_clear,
        "failed_unclear": t.failed_unclear,
        "hung": t.hung,
        "wrong_tokens": t.wrong_tokens,
        "cancelled": t.cancelled,
        "leaked_blocks": leaked,
        "correct": t.correct,
    }


def _check_answers(report: Report, t: Tally, opts: Options) -> None:
    report.check(
        "every request ended within the bound",
        t.hung == 0,
        f"{t.hung} hung past {opts.timeout:.0f} s" if t.hung else "",
    )
    report.check(
        "every successful answer equals the single engine",
        t.wrong_tokens == 0,
        f"{t.wrong_tokens} answers differ from the reference; first: {describe_wrong(t.wrong[0])}"
        if t.wrong_tokens
        else "",
    )
    report.check(
        "every failure is a clear error",
        t.failed_unclear == 0,
        f"{t.failed_unclear} failures without a clear HTTP error or stream error event"
        if t.failed_unclear
        else "",
    )
    report.check(
        "reference answers available",
        t.unchecked == 0,
        f"{t.unchecked} answers could not be checked" if t.unchecked else "",
    )


def _record_details(
    report: Report, t: Tally, streamed: dict[str, int], observer: Observer, records: list[Record]
) -> None:
    report.data["served_non_streaming"] = t.served
    report.data["served_streaming_attributed"] = streamed
    report.data["clear_errors"] = dict(sorted(t.errors.items(), key=lambda kv: -kv[1])[:20])
    report.data["unclear_failures"] = t.unclear
    report.data["unclear_kinds"] = t.unclear_kinds
    report.data["wrong_answers"] = t.wrong
    report.data["hung_requests"] = t.hung_samples
    report.data["metrics"] = {e: observer.counters(e) for e in observer.engines}
    report.data["metric_peaks"] = observer.peaks
    report.data["phases"] = _phase_summary(records, t.classes)
    report.data["records"] = [{**r.to_json(), "class": t.classes.get(r.idx, "")} for r in records]


def _phase_summary(records: list[Record], classes: dict[int, str]) -> dict[str, dict[str, int]]:
    """Per phase: requests sent and how many ended in each class."""
    out: dict[str, dict[str, int]] = {}
    for r in records:
        d = out.setdefault(r.phase, {"sent": 0})
        d["sent"] += 1
        cls = classes.get(r.idx, "unknown")
        d[cls] = d.get(cls, 0) + 1
    return out


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - informational only
        return None


def print_report(report: Report, log: Callable[[str], None] = print) -> None:
    d = report.as_dict()
    t = report.table
    log(f"[{report.scenario}] table: " + ", ".join(f"{k}={v}" for k, v in t.items()))
    for c in report.checks:
        log(
            f"[{report.scenario}]   {'ok  ' if c.ok else 'FAIL'} {c.name}"
            + (f": {c.detail}" if c.detail else "")
        )
    if d.get("clear_errors"):
        log(f"[{report.scenario}] clear errors: {json.dumps(d['clear_errors'])[:800]}")
    if d.get("unclear_kinds"):
        log(f"[{report.scenario}] UNCLEAR failures: {json.dumps(d['unclear_kinds'])[:800]}")
    if d.get("phases"):
        log(f"[{report.scenario}] by phase: {json.dumps(d['phases'])[:1200]}")
    log(report.verdict_line())


def write_report(report: Report, path: Path | None) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.as_dict(), indent=2, default=str))


# ---------------------------------------------------------------------- command line


def parse_options(module: ModuleType, argv: list[str] | None) -> Options:
    base = Options(**getattr(module, "DEFAULTS", {}))
    ap = argparse.ArgumentParser(prog=f"kvpush chaos {module.NAME}", description=module.DESCRIPTION)
    ap.add_argument("--requests", type=int, default=base.requests, help="requests to send")
    ap.add_argument("--concurrency", type=int, default=base.concurrency)
    ap.add_argument("--seed", type=int, default=base.seed, help="seed of the load and faults")
    ap.add_argument("--report", type=Path, default=None, help="write the JSON report here")
    ap.add_argument(
        "--timeout",
        type=float,
        default=base.timeout,
        help="client bound per request in seconds; past it a request is hung",
    )
    ap.add_argument(
        "--policy",
        choices=["recompute", "fail"],
        default=base.policy,
        help="D's kv_load_failure_policy (default: the scenario's)",
    )
    ap.add_argument(
        "--decode-blocks",
        type=int,
        default=base.decode_blocks,
        help="D's KV cache size in blocks (0: the engine's default)",
    )
    ap.add_argument("--quiesce-timeout", type=float, default=base.quiesce_timeout)
    ap.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="model, logs and fault switch go here (default: a temporary folder)",
    )
    ap.add_argument("--progress-every", type=int, default=base.progress_every)
    ap.add_argument("--min-prompt", type=int, default=base.min_prompt)
    ap.add_argument("--max-prompt", type=int, default=base.max_prompt)
    ap.add_argument("--min-tokens", type=int, default=base.min_tokens)
    ap.add_argument("--max-tokens", type=int, default=base.max_tokens)
    ap.add_argument("--stream-fraction", type=float, default=base.stream_fraction)
    ap.add_argument("--chat-fraction", type=float, default=base.chat_fraction)
    ap.add_argument(
        "--trace",
        action="store_true",
        help="engines write kvpush event traces to WORKDIR/traces (for bug reports)",
    )
    ap.add_argument(
        "--no-poke",
        dest="poke",
        action="store_false",
        help="do not poke engines whose gauges look stale after quiescence",
    )
    own = getattr(module, "add_arguments", None)
    if own is not None:
        own(ap)
    ns = ap.parse_args(argv)
    known = {f.name for f in fields(Options)} - {"extra"}
    extra = {k: v for k, v in vars(ns).items() if k not in known}
    return Options(**{k: getattr(ns, k) for k in known}, extra=extra)


def main(module: ModuleType, argv: list[str] | None = None) -> int:
    """``kvpush chaos <name>``: start a cluster, run the scenario, print the verdict."""
    opts = parse_options(module, argv)
    needs: Needs = module.needs(opts)
    workdir = opts.workdir or Path(tempfile.mkdtemp(prefix=f"kvpush-chaos-{module.NAME}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"[{module.NAME}] {module.DESCRIPTION}", flush=True)
    where = " (each engine in its own network namespace)" if needs.netns else ""
    print(
        f"[{module.NAME}] starting {needs.prefills} prefill, {needs.decodes} decode{where}, "
        f"reference and router (policy {needs.policy}); logs in {workdir / 'logs'}",
        flush=True,
    )
    t0 = time.monotonic()
    report = Report(module.NAME, opts.as_dict())
    with contextlib.ExitStack() as network:  # the namespaces go after the cluster
        cluster = Cluster(placed(needs, cluster_spec(needs, workdir, opts.trace), network))
        try:
            cluster.start()
            print(f"[{module.NAME}] cluster ready in {time.monotonic() - t0:.0f} s", flush=True)
            report = asyncio.run(
                run_on_cluster(module, cluster, opts, log=lambda m: print(m, flush=True))
            )
        except Exception as exc:  # noqa: BLE001 - the verdict line must always come
            report.check("cluster started and scenario ran", False, f"{type(exc).__name__}: {exc}")
        finally:
            cluster.stop()
    report.data["total_s"] = round(time.monotonic() - t0, 1)
    print_report(report, lambda m: print(m, flush=True))
    write_report(report, opts.report)
    return 0 if report.passed else 1
