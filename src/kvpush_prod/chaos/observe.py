"""What the chaos harness reads from the engines' ``/metrics``: counters over a whole run
(across restarts), in-flight transfers (the fault triggers) and the idle state (leak checks).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvpush_prod.lab.client import metric_sum, scrape
from kvpush_prod.lab.cluster import Cluster

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
Key = tuple[str, tuple[tuple[str, str], ...]]

BLOCKS = "kvpush_connector_blocks"
ACTIVE = "kvpush_transfers_active"
CREDITS = "kvpush_credits_in_use_blocks"
KV_USAGE = "vllm:kv_cache_usage_perc"
TRANSFERS = "kvpush_transfers_total"
BREAKER_STATE = "kvpush_breaker_state"
BREAKER_TRIPS = "kvpush_breaker_trips_total"
START_TIME = "process_start_time_seconds"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
SUCCESS = "vllm:request_success_total"
ROUTER_INFLIGHT = "kvpush_router_inflight"
ROUTER_BACKEND_UP = "kvpush_router_backend_up"

# Gauges whose highest value over the run goes into the report (evidence of what happened).
PEAK_GAUGES = (
    BLOCKS,
    ACTIVE,
    CREDITS,
    BREAKER_STATE,
    KV_USAGE,
    "kvpush_inflight_bytes",
    "kvpush_credits_waiting_transfers",
)


def role_of(engine: str) -> str:
    """``decode`` for the decode engines (``decode``, ``decode-1``, ...), else ``prefill``."""
    return "decode" if engine == "decode" or engine.startswith("decode-") else "prefill"


def has_series(samples: Samples | None, name: str) -> bool:
    return samples is not None and any(n == name for n, _ in samples)


def engine_url(cluster: Cluster, name: str) -> str:
    return cluster.urls[name]


def try_scrape(url: str, timeout: float = 3.0) -> Samples | None:
    """The samples of ``url``/metrics, or None when the engine does not answer."""
    try:
        return scrape(url, timeout=timeout)
    except (httpx.HTTPError, OSError, ValueError):
        return None


@dataclass
class Reading:
    """The connector's state on one engine at one moment (None: series not exported)."""

    engine: str
    at: float
    alive: bool
    blocks: float | None = None
    active: float | None = None
    credits: float | None = None
    kv_usage: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "at": round(self.at, 3),
            "alive": self.alive,
            "connector_blocks": self.blocks,
            "transfers_active": self.active,
            "credits_in_use_blocks": self.credits,
            "kv_cache_usage_perc": self.kv_usage,
        }


def reading(engine: str, samples: Samples | None, at: float) -> Reading:
    if samples is None:
        return Reading(engine, at, alive=False)

    def val(name: str) -> float | None:
        return metric_sum(samples, name) if has_series(samples, name) else None

    return Reading(engine, at, True, val(BLOCKS), val(ACTIVE), val(CREDITS), val(KV_USAGE))


@dataclass
class _Track:
    prev: dict[Key, float] = field(default_factory=dict)
    acc: dict[Key, float] = field(default_factory=dict)
    start_time: float | None = None
    restarts_seen: int = 0


class Observer:
    """Samples the engines' metrics in the background.

    Counters are accumulated as increases since ``start()``, reset-aware: a restarted engine
    (new ``process_start_time_seconds``) starts its counters from zero again, so a whole run's
    totals survive kills. What a killed engine counted after its last scrape is lost; scrapes
    run every ``interval`` s and once more right before each injected fault.
    """

    def __init__(
        self,
        cluster: Cluster,
        engines: tuple[str, ...] = ("prefill", "decode"),
        interval: float = 1.0,
    ) -> None:
        self.cluster = cluster
        self.engines = engines
        self.interval = interval
        self.last: dict[str, Samples | None] = {}
        self.tracks: dict[str, _Track] = {e: _Track() for e in engines}
        self.peaks: dict[str, dict[str, float]] = {e: {} for e in engines}
        self.missing_scrapes: dict[str, int] = {e: 0 for e in engines}
        self._task: asyncio.Task[None] | None = None
        self._t0 = time.monotonic()
        self._lock = asyncio.Lock()

    # -- lifecycle
    async def start(self) -> None:
        self._t0 = time.monotonic()
        await self.poll()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.poll()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            with contextlib.suppress(Exception):
                await self.poll()

    # -- sampling
    async def sample(self, engine: str, timeout: float = 3.0) -> Samples | None:
        proc = self.cluster.procs.get(engine)
        if proc is None or not proc.alive():
            return None
        return await asyncio.to_thread(try_scrape, engine_url(self.cluster, engine), timeout)

    async def poll(self) -> dict[str, Samples | None]:
        async with self._lock:
            got = await asyncio.gather(*(self.sample(e) for e in self.engines))
            for engine, samples in zip(self.engines, got, strict=True):
                self._ingest(engine, samples)
            return dict(zip(self.engines, got, strict=True))

    def _ingest(self, engine: str, samples: Samples | None) -> None:
        self.last[engine] = samples
        if samples is None:
            self.missing_scrapes[engine] += 1
            return
        tr = self.tracks[engine]
        started = metric_sum(samples, START_TIME) if has_series(samples, START_TIME) else None
        fresh = tr.start_time is None
        if not fresh and started is not None and started != tr.start_time:
            tr.prev = {}  # a new process: its counters begin at zero
            tr.restarts_seen += 1
        tr.start_time = started
        for key, value in samples.items():
            name = key[0]
            if not name.endswith("_total"):
                continue
            prev = tr.prev.get(key)
            if fresh and prev is None:
                tr.prev[key] = value  # the baseline: count from here
                continue
            inc = value - (prev or 0.0) if prev is not None and value >= prev else value
            if inc:
                tr.acc[key] = tr.acc.get(key, 0.0) + inc
            tr.prev[key] = value
        peaks = self.peaks[engine]
        for name in PEAK_GAUGES:
            if has_series(samples, name):
                v = (
                    metric_sum(samples, name)
                    if name != BREAKER_STATE
                    else max((val for (n, _), val in samples.items() if n == name), default=0.0)
                )
                peaks[name] = max(peaks.get(name, v), v)

    def note_restart(self, engine: str) -> None:
        """Tell the observer ``engine`` is a new process (its counters restart at zero)."""
        self.tracks[engine].prev = {}

    # -- reading
    def increase(self, engine: str, name: str, **labels: str) -> float:
        """How much counter ``name`` grew on ``engine`` since start (all matching labels)."""
        total = 0.0
        for (n, lbls), v in self.tracks[engine].acc.items():
            if n == name and all(dict(lbls).get(k) == val for k, val in labels.items()):
                total += v
        return total

    def by_label(self, engine: str, name: str, label: str, **labels: str) -> dict[str, float]:
        """How much counter ``name`` grew on ``engine``, per value of ``label``."""
        out: dict[str, float] = {}
        for (n, lbls), v in self.tracks[engine].acc.items():
            d = dict(lbls)
            if n == name and v and all(d.get(k) == val for k, val in labels.items()):
                key = d.get(label, "")
                out[key] = out.get(key, 0.0) + v
        return out

    def counters(self, engine: str, prefix: str = "kvpush_") -> dict[str, float]:
        """Every counter increase on ``engine`` whose name starts with ``prefix``."""
        out: dict[str, float] = {}
        for (n, lbls), v in sorted(self.tracks[engine].acc.items()):
            if not n.startswith(prefix) or not v:
                continue
            label = ",".join(f"{k}={val}" for k, val in lbls if k not in ("engine", "model_name"))
            out[f"{n}{{{label}}}" if label else n] = v
        return out

    def exported(self, engine: str, name: str) -> bool:
        """Whether ``engine`` has ever shown series ``name`` (gauge or counter)."""
        if has_series(self.last.get(engine), name):
            return True
        return any(n == name for n, _ in self.tracks[engine].acc) or any(
            n == name for n, _ in self.tracks[engine].prev
        )

    def now(self) -> float:
        return time.monotonic() - self._t0

    async def readings(self) -> dict[str, Reading]:
        got = await self.poll()
        at = self.now()
        return {e: reading(e, s, at) for e, s in got.items()}

    # -- triggers
    async def wait_in_flight(
        self, engines: tuple[str, ...], timeout: float, interval: float = 0.1
    ) -> dict[str, Any] | None:
        """Wait until every engine in ``engines`` shows a transfer in progress; None on timeout.

        P: a transfer active or blocks held for D; D: blocks reserved for an inbound transfer
        or a transfer active. Returns the readings that satisfied it (the evidence).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = await asyncio.gather(*(self.sample(e, timeout=2.0) for e in engines))
            at = self.now()
            rs = {e: reading(e, s, at) for e, s in zip(engines, got, strict=True)}
            if all(r.alive and ((r.blocks or 0) > 0 or (r.active or 0) > 0) for r in rs.values()):
                for e, s in zip(engines, got, strict=True):
                    self._ingest(e, s)
                return {e: r.as_dict() for e, r in rs.items()}
            await asyncio.sleep(interval)
        return None

    async def requests_on(self, engine: str) -> int:
        """The requests that depend on ``engine`` now by its own count: vLLM's running +
        waiting, and for a prefill engine also its transfers in progress (a request P has
        answered may still wait on D for P's KV); 0 when it does not answer."""
        s = await self.sample(engine, timeout=2.0)
        if s is None:
            return 0
        self._ingest(engine, s)
        n = metric_sum(s, RUNNING) + metric_sum(s, WAITING)
        if role_of(engine) == "prefill":
            n += metric_sum(s, ACTIVE)
        return int(n)

    async def router_legs(self, engine: str) -> int:
        """Legs the router has open to ``engine`` now (``kvpush_router_inflight``; 0 when the
        router does not answer)."""
        s = await asyncio.to_thread(try_scrape, self.cluster.urls["router"], 2.0)
        url = engine_url(self.cluster, engine)
        return int(
            sum(
                v
                for (n, lbls), v in (s or {}).items()
                if n == ROUTER_INFLIGHT and dict(lbls).get("backend") == url
            )
        )

    async def router_has(self, engine: str) -> bool:
        """Whether the router routes to ``engine`` (``kvpush_router_backend_up`` is 1)."""
        s = await asyncio.to_thread(try_scrape, self.cluster.urls["router"], 2.0)
        url = engine_url(self.cluster, engine)
        return any(
            v == 1.0
            for (n, lbls), v in (s or {}).items()
            if n == ROUTER_BACKEND_UP and dict(lbls).get("backend") == url
        )

    async def served(self, engine: str) -> float:
        """Requests the running process of ``engine`` has finished (vLLM's success counter
        since its start; 0 when it does not answer)."""
        s = await self.sample(engine, timeout=2.0)
        return metric_sum(s, SUCCESS) if s is not None else 0.0

    async def breaker_state(self, engine: str = "prefill") -> float | None:
        """The highest breaker state P reports (0 closed, 1 half-open, 2 open); None if absent."""
        s = await self.sample(engine)
        if s is None or not has_series(s, BREAKER_STATE):
            return None
        self._ingest(engine, s)
        return max(v for (n, _), v in s.items() if n == BREAKER_STATE)

    # -- quiescence
    async def quiesce(
        self, baseline_kv: dict[str, float], timeout: float, interval: float = 0.5
    ) -> tuple[bool, dict[str, Reading], float]:
        """Wait until every live engine holds no connector block, no credit (D), and its KV
        usage is back at its idle value. Returns (settled, last readings, seconds waited)."""
        t0 = time.monotonic()
        last: dict[str, Reading] = {}
        while True:
            last = await self.readings()
            # A series that is not exported cannot settle by waiting: reported separately.
            if all(
                not [p for p in idle_problems(r, baseline_kv.get(e)) if "not exported" not in p]
                for e, r in last.items()
                if r.alive
            ):
                return True, last, time.monotonic() - t0
            if time.monotonic() - t0 >= timeout:
                return False, last, time.monotonic() - t0
            await asyncio.sleep(interval)


def idle_problems(r: Reading, idle_kv: float | None, eps: float = 1e-9) -> list[str]:
    """Why ``r`` is not idle (empty when it is)."""
    if not r.alive:
        return []
    out = []
    if r.blocks is None:
        out.append(f"{r.engine}: {BLOCKS} not exported")
    elif r.blocks > 0:
        out.append(f"{r.engine}: {BLOCKS}={r.blocks:g}")
    if role_of(r.engine) == "decode":
        if r.credits is None:
            out.append(f"{r.engine}: {CREDITS} not exported")
        elif r.credits > 0:
            out.append(f"{r.engine}: {CREDITS}={r.credits:g}")
    if r.kv_usage is None:
        out.append(f"{r.engine}: {KV_USAGE} not exported")
    elif idle_kv is not None and r.kv_usage > idle_kv + eps:
        out.append(f"{r.engine}: {KV_USAGE}={r.kv_usage:.4f} (idle {idle_kv:.4f})")
    return out
