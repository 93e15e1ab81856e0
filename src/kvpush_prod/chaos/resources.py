"""Resource flatness over a long chaos run: what each engine's process tree and the router
hold (RSS, open fds, threads, sockets, and every table their /metrics count), sampled every
few seconds, and ``flatness``, which fails a series that grows with time, not with load.

Growth is judged at quiet windows (no request in flight for ``settle_s``), where what load
holds has been let go: the values there are compared across the run with a Theil-Sen slope
(the median of the pairwise slopes, so a few odd windows do not move it). A series fails
when that slope is above its bound per hour *and* the growth it implies over the run is
above the series' slack (one fd opened by a late connection is not a leak; one per minute
is). A table with a capacity of its own (``kvpush_table_capacity``) cannot grow past it: it
passes while within it, and its row says so.

vLLM's own processes grow with the work itself for minutes (measured here: a plain engine's
worker, no connector, +350 MiB over its first 2.9 M prompt tokens and still ~40 MiB a minute
after 4 minutes; a prefill engine's worker alike; a decode engine's flat). A prefill engine's RSS is
therefore judged against a *control*: a plain engine fed the same prompts (the chaos runs'
reference engine, ``Target.control``), whose slope is subtracted from the engine's: what the
connector adds is what remains. A decode engine's is judged alone. A prefill worker started
during the run warms up faster than the control, started before it, so its RSS is judged
only after ``VLLM_WARMUP_S`` of its samples (``Target.slow_warmup``); shorter runs report it,
not judged, and say so.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import psutil

if TYPE_CHECKING:
    from kvpush_prod.lab.cluster import Cluster

MIB = 1 << 20
HOUR = 3600.0
RESOURCE_KINDS = ("rss_bytes", "fds", "threads", "sockets")
TABLE_KIND = "table_entries"
TABLE_SERIES = {
    "kvpush_table_entries": "kvpush_table_capacity",
    "kvpush_router_table_entries": "kvpush_router_table_capacity",
}
MAX_POINTS = 400  # Theil-Sen is O(n^2): longer series are thinned evenly to this many points
# A prefill engine's vLLM worker RSS is judged from this long after its process started, and
# only with at least MIN_JUDGED_S of samples after that (measured: still growing ~40 MiB a
# minute after 4 minutes of new prompt shapes, with or without the connector; a process
# restarted by a fault starts again).
VLLM_WARMUP_S = 1200.0
SLOW_WARMUP = ("VLLM::Worker", "tree")
MIN_JUDGED_S = 300.0


@dataclass(frozen=True)
class Bound:
    """How much a series may grow: ``per_hour`` (its slope) and ``slack`` (its total growth
    over the run); it fails only past both."""

    per_hour: float
    slack: float


# Documented in docs/chaos.md ("Resource flatness"). RSS: a Python process's allocator and
# caches settle over minutes (arenas, vLLM's and torch's caches); 64 MiB an hour beyond
# what load explains is a leak worth a look, 32 MiB over a run is noise. Counts (fds,
# threads, sockets, table entries): a flat process keeps the same number at every quiet
# window; a few more over a run (a reconnected peer, a lazily made pool connection) are
# slack; 6 an hour is one every 10 minutes.
BOUNDS: dict[str, Bound] = {
    "rss_bytes": Bound(64 * MIB, 32 * MIB),
    "fds": Bound(6.0, 4.0),
    "threads": Bound(6.0, 4.0),
    "sockets": Bound(6.0, 4.0),
    TABLE_KIND: Bound(6.0, 4.0),
}


@dataclass(frozen=True)
class Target:
    """One thing to sample: a process tree (``pid()``: its root now, None while it is down;
    an engine's API server has vLLM's EngineCore and workers as children) and, optionally,
    the base URL whose /metrics has its tables."""

    name: str
    pid: Callable[[], int | None]
    metrics_url: str | None = None
    # The target whose process RSS this one's is judged against (a plain engine fed the same
    # prompts), or None; ``judged`` False: sampled as a control, never judged itself.
    control: str | None = None
    judged: bool = True
    # Processes (label prefixes: "VLLM::Worker", "tree") whose RSS is judged only after
    # ``VLLM_WARMUP_S`` of their life: a prefill engine's vLLM worker, whose own caches grow
    # with new prompt shapes for longer than a CI run (module docstring).
    slow_warmup: tuple[str, ...] = ()


@dataclass
class Series:
    """One sampled quantity: (time, value) pairs, its kind, and its bound of its own."""

    name: str
    kind: str
    points: list[tuple[float, float]] = field(default_factory=list)
    capacity: float | None = None
    # The same quantity of the control: its slope (what the work itself explains) is
    # subtracted from this one's.
    control: Series | None = None
    # Judged only with this much of samples after the warm-up (a process restarted late in
    # a run: a minute of new connections is no trend); 0: always.
    min_span_s: float = 0.0


@dataclass(frozen=True)
class Row:
    """The verdict on one series."""

    name: str
    kind: str
    first: float
    last: float
    slope_per_hour: float
    bound_per_hour: float
    growth: float
    slack: float
    passed: bool
    method: str
    note: str = ""
    control_per_hour: float | None = None  # the control's slope, already subtracted

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


# ---------------------------------------------------------------------------- measuring


def socket_fds(pid: int) -> int:
    """Sockets among the open fds of ``pid`` (ZMQ, NIXL/UCX, HTTP): /proc/PID/fd links."""
    fd_dir = f"/proc/{pid}/fd"
    n = 0
    for fd in os.listdir(fd_dir):
        try:
            if os.readlink(os.path.join(fd_dir, fd)).startswith("socket:"):
                n += 1
        except OSError:  # closed meanwhile
            continue
    return n


def process_stats(proc: psutil.Process) -> dict[str, float]:
    """RSS, open fds, threads and sockets of one process."""
    with proc.oneshot():
        return {
            "rss_bytes": float(proc.memory_info().rss),
            "fds": float(proc.num_fds()),
            "threads": float(proc.num_threads()),
            "sockets": float(socket_fds(proc.pid)),
        }


def tree_labels(root: psutil.Process) -> list[tuple[str, psutil.Process]]:
    """The root ("main") and its descendants, each named by its process name (vLLM names
    its EngineCore and workers), numbered when two share a name: stable across restarts."""
    out: list[tuple[str, psutil.Process]] = [("main", root)]
    seen: dict[str, int] = {}
    for child in sorted(root.children(recursive=True), key=lambda p: p.pid):
        try:
            name = child.name() or "child"
        except psutil.Error:
            continue
        seen[name] = seen.get(name, 0) + 1
        out.append((name if seen[name] == 1 else f"{name}#{seen[name]}", child))
    return out


def tree_stats(pid: int) -> dict[str, dict[str, float]]:
    """Per process of the tree rooted at ``pid``: its stats, and their sum ("tree")."""
    out: dict[str, dict[str, float]] = {}
    for label, proc in tree_labels(psutil.Process(pid)):
        try:
            out[label] = process_stats(proc)
        except (psutil.Error, OSError):  # ended between the listing and the look
            continue
    out["tree"] = {k: sum(s[k] for s in out.values()) for k in RESOURCE_KINDS}
    return out


def parse_tables(text: str) -> dict[str, tuple[float, float | None]]:
    """Every table series of a /metrics text: "role/table" (engines) or "table" (router),
    with the engine index when vLLM runs several, -> (entries, capacity or None)."""
    from prometheus_client.parser import text_string_to_metric_families

    entries: dict[str, float] = {}
    caps: dict[str, float] = {}
    wanted = {**{k: entries for k in TABLE_SERIES}, **{v: caps for v in TABLE_SERIES.values()}}
    for fam in text_string_to_metric_families(text):
        into = wanted.get(fam.name)
        if into is None:
            continue
        for s in fam.samples:
            into[_table_key(s.labels)] = s.value
    return {k: (v, caps.get(k)) for k, v in entries.items()}


def _table_key(labels: dict[str, str]) -> str:
    parts = [labels.get("role", ""), labels.get("table", "")]
    if labels.get("engine", "0") != "0":
        parts.insert(0, "engine" + labels["engine"])
    return "/".join(p for p in parts if p)


def scrape_text(url: str, timeout: float = 5.0) -> str:
    import httpx

    return httpx.get(url.rstrip("/") + "/metrics", timeout=timeout).text


# ---------------------------------------------------------------------------- sampling


def listening_pid(url: str) -> int | None:
    """The pid of the local process that listens on ``url``'s port (None if none does)."""
    port = urlsplit(url).port
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            return conn.pid
    return None


def control_target(cluster: Cluster) -> Target | None:
    """The cluster's reference engine (its own or a shared one) as a control: a plain vLLM
    engine fed the same prompts (the chaos runs ask it for every answer they check)."""
    url = cluster.urls.get("reference")
    if url is None:
        return None
    found: list[int | None] = []

    def pid() -> int | None:
        proc = cluster.procs.get("reference")
        if proc is not None:
            return proc.pid if proc.alive() else None
        if not found or found[0] is None or not psutil.pid_exists(found[0]):
            found[:] = [listening_pid(url)]
        return found[0]

    return Target("reference", pid, None, judged=False)


def cluster_targets(cluster: Cluster) -> list[Target]:
    """Every engine of a lab cluster and its router (followed across restarts: the pid is
    looked up at each sample, None while the process is down), and its reference engine as
    the control the prefill engines' RSS is judged against (a decode engine's vLLM computes
    no prompt of a pushed request: its RSS is judged alone)."""

    def pid_of(name: str) -> Callable[[], int | None]:
        def pid() -> int | None:
            proc = cluster.procs.get(name)
            return proc.pid if proc is not None and proc.alive() else None

        return pid

    control = control_target(cluster)
    against = control.name if control is not None else None
    prefills = set(cluster.prefill_names)

    def engine(name: str) -> Target:
        if name not in prefills:
            return Target(name, pid_of(name), cluster.urls.get(name))
        return Target(name, pid_of(name), cluster.urls.get(name), against, True, SLOW_WARMUP)

    engines = [engine(n) for n in cluster.engine_names]
    routers = (
        [Target("router", pid_of("router"), cluster.urls["router"])]
        if "router" in cluster.urls
        else []
    )
    return [*engines, *routers, *([control] if control else [])]


class ResourceSampler:
    """Samples every target each ``every_s``: its process tree's resources (per process and
    summed) and its tables. A target that is down (no pid, or it does not answer) is skipped
    at that sample, never an error: the nemesis kills and restarts engines."""

    def __init__(
        self,
        targets: Sequence[Target],
        every_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        scrape: Callable[[str], str] = scrape_text,
    ) -> None:
        if every_s <= 0:
            raise ValueError(f"every_s={every_s}: sample at least once a second or so (> 0)")
        self.targets = list(targets)
        self.every_s = every_s
        self.clock = clock
        self.scrape = scrape
        self.series: dict[str, Series] = {}
        self.samples = 0

    def _add(self, name: str, kind: str, t: float, value: float, cap: float | None = None) -> None:
        s = self.series.get(name)
        if s is None:
            s = self.series[name] = Series(name, kind)
        s.points.append((t, value))
        if cap is not None:
            s.capacity = cap

    def sample_once(self) -> None:
        """One sample of every target (blocking: processes and /metrics)."""
        t = self.clock()
        for target in self.targets:
            self._sample_processes(target, t)
            self._sample_tables(target, t)
        self.samples += 1

    def _sample_processes(self, target: Target, t: float) -> None:
        pid = target.pid()
        if pid is None:
            return
        try:
            stats = tree_stats(pid)
        except (psutil.Error, OSError):
            return
        for proc, values in stats.items():
            for kind, value in values.items():
                self._add(f"{target.name}/{proc}/{kind}", kind, t, value)

    def _sample_tables(self, target: Target, t: float) -> None:
        if target.metrics_url is None:
            return
        try:
            tables = parse_tables(self.scrape(target.metrics_url))
        except Exception:  # noqa: BLE001 - a target that is down or restarting is skipped
            return
        for key, (value, cap) in tables.items():
            self._add(f"{target.name}/table/{key}", TABLE_KIND, t, value, cap)

    async def run(self, stop: asyncio.Event) -> None:
        """Sample every ``every_s`` until ``stop`` is set (the sampling in a thread)."""
        while not stop.is_set():
            await asyncio.to_thread(self.sample_once)
            try:
                await asyncio.wait_for(stop.wait(), self.every_s)
            except TimeoutError:
                continue

    def report(
        self, load: Sequence[tuple[float, float]], warmup_s: float = 60.0, settle_s: float = 2.0
    ) -> list[Row]:
        """``flatness`` of every series sampled of a judged target, failures first; a
        process's RSS against its target's control's, where it has one."""
        targets = {t.name: t for t in self.targets}
        rows = []
        for s in self.series.values():
            target = targets.get(s.name.split("/", 1)[0])
            if len(s.points) < 2 or (target is not None and not target.judged):
                continue
            proc = s.name.split("/")[1]
            if target is not None and target.control and s.kind == "rss_bytes":
                s.control = self.series.get(f"{target.control}/{s.name.split('/', 1)[1]}")
            wait, need, why = warmup_s, s.min_span_s, "the process started late in the run"
            if target is not None and s.kind == "rss_bytes" and proc.startswith(target.slow_warmup):
                wait, need, why = max(warmup_s, VLLM_WARMUP_S), MIN_JUDGED_S, "vLLM's warm-up"
            if need and s.points[-1][0] - s.points[0][0] < wait + need:
                rows.append(not_judged(s, wait, need, why))
                continue
            rows.append(flatness(s, load, warmup_s=wait, settle_s=settle_s))
        return sorted(rows, key=lambda r: (r.passed, r.name))


# ---------------------------------------------------------------------------- judging


def theil_sen(points: Sequence[tuple[float, float]]) -> float:
    """The median of the slopes of every pair of points (0 with fewer than two times)."""
    if len(points) > MAX_POINTS:
        step = len(points) / MAX_POINTS
        points = [points[int(i * step)] for i in range(MAX_POINTS)]
    slopes = [
        (y2 - y1) / (t2 - t1)
        for i, (t1, y1) in enumerate(points)
        for t2, y2 in points[i + 1 :]
        if t2 != t1
    ]
    return statistics.median(slopes) if slopes else 0.0


def quiet_spans(load: Sequence[tuple[float, float]], settle_s: float) -> list[tuple[float, float]]:
    """The spans of time with nothing in flight for at least ``settle_s`` before (``load``:
    (time, in flight) samples, each holding until the next; before the first: busy)."""
    spans: list[tuple[float, float]] = []
    since: float | None = None
    for at, v in sorted(load):
        if v == 0 and since is None:
            since = at
        elif v != 0 and since is not None:
            if at > since + settle_s:
                spans.append((since + settle_s, at))
            since = None
    if since is not None:
        spans.append((since + settle_s, math.inf))
    return spans


def quiet_windows(
    points: Sequence[tuple[float, float]], load: Sequence[tuple[float, float]], settle_s: float
) -> list[tuple[float, float]]:
    """One point per quiet span with samples: their median time and median value."""
    spans = quiet_spans(load, settle_s)
    starts = [a for a, _ in spans]
    windows: dict[int, list[tuple[float, float]]] = {}
    for t, v in points:
        i = bisect.bisect_right(starts, t) - 1
        if i >= 0 and t < spans[i][1]:
            windows.setdefault(i, []).append((t, v))
    return [
        (statistics.median(t for t, _ in w), statistics.median(v for _, v in w))
        for _, w in sorted(windows.items())
    ]


MIN_WINDOWS = 3


def flatness(
    series: Series,
    load: Sequence[tuple[float, float]],
    warmup_s: float = 60.0,
    settle_s: float = 2.0,
    bounds: dict[str, Bound] | None = None,
) -> Row:
    """Whether ``series`` grew with time beyond its bound, judged at quiet windows after
    ``warmup_s`` (``load``: (time, requests in flight) samples). With fewer than
    ``MIN_WINDOWS`` quiet windows, every sample after the warm-up is used (and said)."""
    bound = (bounds or BOUNDS)[series.kind]
    start = series.points[0][0] + warmup_s
    points, method = _judged_points(series, start, load, settle_s)
    slope = theil_sen(points)
    control: float | None = None
    if series.control is not None and len(series.control.points) >= 2:
        # The control over the same span (a growing control explains growth; a shrinking
        # one explains none).
        cpoints, _ = _judged_points(series.control, max(start, points[0][0]), load, settle_s)
        control = max(0.0, theil_sen(cpoints))
        slope -= control
        method += ", less the control's slope"
    span = points[-1][0] - points[0][0] if len(points) > 1 else 0.0
    growth = slope * span
    passed = not (slope * HOUR > bound.per_hour and growth > bound.slack)
    note = ""
    top = max(v for _, v in series.points)
    if series.capacity is not None and not passed and top <= series.capacity:
        passed, note = True, f"grows, but capped at {series.capacity:g} by design"
    return Row(
        series.name,
        series.kind,
        points[0][1],
        points[-1][1],
        slope * HOUR,
        bound.per_hour,
        growth,
        bound.slack,
        passed,
        f"{method}: {len(points)}",
        note,
        None if control is None else control * HOUR,
    )


def not_judged(series: Series, wait_s: float, need_s: float, why: str) -> Row:
    """The row of a series without ``need_s`` of samples after ``wait_s`` of its process
    within the run: reported (its slope over every sample), not judged, and said so."""
    span = series.points[-1][0] - series.points[0][0]
    slope = theil_sen(series.points)
    bound = BOUNDS[series.kind]
    return Row(
        series.name,
        series.kind,
        series.points[0][1],
        series.points[-1][1],
        slope * HOUR,
        bound.per_hour,
        slope * span,
        bound.slack,
        True,
        f"all samples: {len(series.points)}",
        f"not judged: {why}, judged after {wait_s / 60:.0f} min of the process "
        f"and {need_s / 60:.0f} min of samples; {span / 60:.1f} min sampled",
    )


def _judged_points(
    series: Series, start: float, load: Sequence[tuple[float, float]], settle_s: float
) -> tuple[list[tuple[float, float]], str]:
    """The points a series is judged on: one per quiet window from ``start`` on, or every
    sample from then when there are fewer than ``MIN_WINDOWS`` windows."""
    after = [p for p in series.points if p[0] >= start] or list(series.points)
    points = quiet_windows(after, load, settle_s)
    if len(points) < MIN_WINDOWS:
        return after, "all samples (too few quiet windows)"
    return points, "quiet windows"


def _fmt(kind: str, value: float) -> str:
    if kind == "rss_bytes":
        return f"{value / MIB:.1f} MiB"
    return f"{value:g}" if math.isfinite(value) else str(value)


def report_lines(rows: Iterable[Row]) -> list[str]:
    """The flatness table of a chaos report (markdown), one row per series."""
    out = [
        "| series | first | last | control/hour | slope/hour | bound/hour | growth | slack "
        "| verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        verdict = ("flat" if r.passed else "GROWS") + (f" ({r.note})" if r.note else "")
        control = "" if r.control_per_hour is None else _fmt(r.kind, r.control_per_hour)
        out.append(
            f"| `{r.name}` | {_fmt(r.kind, r.first)} | {_fmt(r.kind, r.last)} | {control} | "
            f"{_fmt(r.kind, r.slope_per_hour)} | {_fmt(r.kind, r.bound_per_hour)} | "
            f"{_fmt(r.kind, r.growth)} | {_fmt(r.kind, r.slack)} | {verdict} |"
        )
    return out
