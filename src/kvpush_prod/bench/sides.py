"""The sides a benchmark compares, and how each is started on this machine as plain child
processes: a single engine, vLLM's NixlConnector (pull) and NixlPushConnector (push), each
as shipped or with NIXL's busy-spinning progress thread neutralised, and kvpush.

Every P/D side binds P to core 0 and D to core 1, runs the same tiny model in float32 with
the same ``--max-num-seqs``, and is fronted by our router (``--mode pull`` for pull).

vLLM's NIXL connectors on CPU move the worker's main thread (which runs the forward) to the
last core of each NUMA node, "reserved for KV transfer" (``nixl/base_worker.py``,
``os.sched_setaffinity``): on a two-core box that puts vLLM's P on D's core. After a side
starts, every thread of each engine's worker is bound back to the engine's cores, and how
many were moved is recorded, so every side runs with the same placement.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush_prod.lab.launch import (
    EngineSpec,
    Proc,
    free_port,
    router_command,
    start_engine,
    wait_healthy,
)

SPINFIX_DIR = Path(__file__).resolve().parent / "spinfix"
SPINFIX_ENV = "KVPUSH_BENCH_PTHR_DELAY_US"
SPINFIX_MARKER = "kvpush-bench: nixl progress thread delay set to"
# Lines in an engine log that mean it will never become healthy although its API server
# process is still alive (vLLM's EngineCore died underneath it).
FATAL_MARKERS = (
    "EngineCore encountered a fatal error",
    "Engine core initialization failed",
    "Address already in use",
)


def parse_cores(text: str) -> set[int]:
    """``VLLM_CPU_OMP_THREADS_BIND``'s syntax for one rank: ``0``, ``0,2``, ``0-3``."""
    cores: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def rebind_threads(pid: int, cores: set[int]) -> int:
    """Bind every thread of process ``pid`` that may run outside ``cores`` to ``cores``;
    returns how many were moved (threads that end meanwhile are skipped)."""
    moved = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if os.sched_getaffinity(int(tid)) <= cores:
                continue
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, FileNotFoundError):
            continue
        moved += 1
    return moved


def wait_started(url: str, proc: Proc, timeout: float) -> None:
    """``wait_healthy``, but give up at once when the engine's log shows a fatal start-up
    error (vLLM keeps the API server alive when its EngineCore dies)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            wait_healthy(url, proc, min(5.0, max(0.1, left)))
            return
        except TimeoutError:
            if left <= 5.0:
                raise
        log = proc.tail(400)
        for marker in FATAL_MARKERS:
            if marker in log:
                raise RuntimeError(f"{proc.name} failed to start ({marker}):\n{proc.tail(30)}")


@dataclass(frozen=True)
class Side:
    """One configuration under test."""

    name: str
    kind: str  # single | vllm-pull | vllm-push | kvpush
    spin: str  # "neutralised" | "as shipped" | "n/a" (no NIXL)
    label: str

    @property
    def disaggregated(self) -> bool:
        return self.kind != "single"


SIDES: dict[str, Side] = {
    s.name: s
    for s in (
        Side("single", "single", "n/a", "single engine"),
        Side("vllm-pull", "vllm-pull", "neutralised", "vLLM NixlConnector (pull)"),
        Side("vllm-push", "vllm-push", "neutralised", "vLLM NixlPushConnector (push)"),
        Side(
            "vllm-pull-shipped", "vllm-pull", "as shipped", "vLLM NixlConnector (pull), as shipped"
        ),
        Side(
            "vllm-push-shipped",
            "vllm-push",
            "as shipped",
            "vLLM NixlPushConnector (push), as shipped",
        ),
        Side("kvpush", "kvpush", "neutralised", "kvpush (ours)"),
        # The same without keys or signed params: what authentication costs.
        Side("kvpush-insecure", "kvpush", "neutralised", "kvpush without keys (insecure)"),
        # The same engines behind a sequential router (P first, then D with P's answer), as
        # Ray Serve LLM and vLLM's example proxies run P/D: what the concurrent flow gains.
        Side("kvpush-sequential", "kvpush", "neutralised", "kvpush behind a sequential router"),
    )
}
DEFAULT_SIDES = [
    "single",
    "vllm-pull",
    "vllm-push",
    "vllm-pull-shipped",
    "vllm-push-shipped",
    "kvpush",
]


# Where each engine's API server and EngineCore run (``--frontends``); its worker always
# runs on the engine's own core (P 0, D 1; the single engine: ``single_cores``). Left to the
# OS, one start's placement moved a c=1 TPOT by up to ~30% from one start to the next;
# "own" (the default) keeps every process of an engine on its core, as if P and D had a
# host each: P's prefills and spinning waits never land on D's core, whatever the side.
FRONTENDS: dict[str, dict[str, str]] = {
    "crossed": {"prefill": "1", "decode": "0", "single": "1"},
    "own": {"prefill": "0", "decode": "1", "single": "0"},
    "os": {},
}


@dataclass
class SideSettings:
    """What every side shares."""

    workdir: Path
    max_num_seqs: int = 32
    block_size: int | None = None
    pthr_delay_us: int = 1000  # for vLLM's connectors when neutralised
    single_cores: str = "0"
    kv_cache_gib: int = 2
    # engine -> cores for its API server and EngineCore (its worker keeps the engine's own);
    # empty: the OS places them.
    frontend_cores: dict[str, str] = field(default_factory=lambda: dict(FRONTENDS["own"]))
    engine_args: list[str] = field(default_factory=list)
    kvpush_extra: dict[str, Any] = field(default_factory=lambda: {"verify": {"checksums": False}})
    # TinyModelSpec fields that differ from the lab's tiny Llama (``--model-shape``).
    model_shape: dict[str, int] = field(default_factory=dict)
    # Requests that churn the KV caches before the measured cells (``--fragment``).
    fragment: int = 0


class RunningSide:
    """A started side: the URL to send requests to, and its engines (for /metrics)."""

    def __init__(self, side: Side, settings: SideSettings) -> None:
        self.side = side
        self.settings = settings
        self.dir = settings.workdir / side.name
        self.log_dir = self.dir / "logs"
        self.trace_dir = self.dir / "trace"
        self.procs: dict[str, Proc] = {}
        self.engine_urls: dict[str, str] = {}
        self.entry = ""
        self._cluster: Any = None
        self._identity: dict[str, Any] = {}
        self._params_key: Path | None = None  # the router signs kv_transfer_params with it
        self.binding: dict[str, str] = {}  # engine -> VLLM_CPU_OMP_THREADS_BIND it was given
        self.rebound: dict[str, int] = {}  # engine -> worker threads bound back after start

    # -- start
    def start(self, timeout: float = 900.0) -> RunningSide:
        # Logs of an earlier attempt must not be read as this one's (start-up errors are
        # looked for in them); traces likewise. Keep the last attempt's for inspection.
        for folder in (self.log_dir, self.trace_dir):
            if folder.exists():
                old = folder.with_name(folder.name + ".prev")
                if old.exists():
                    shutil.rmtree(old)
                folder.rename(old)
        try:
            if self.side.kind == "single":
                self._start_single(timeout)
            elif self.side.kind == "kvpush":
                self._start_kvpush(timeout)
            else:
                self._start_vllm(timeout)
            self.rebound = self.rebind_workers()
        except BaseException:
            self.stop()
            raise
        return self

    def rebind_workers(self) -> dict[str, int]:
        """Bind every thread of each engine's worker process(es) back to the cores the engine
        was given; returns the number of threads moved per engine (see the module doc).
        With ``frontend_cores``, the engine's other processes (API server, EngineCore) are
        bound to theirs too (not counted)."""
        import psutil

        out: dict[str, int] = {}
        for name, bind in self.binding.items():
            if "|" in bind or name not in self.procs:
                continue  # one binding per TP rank: the bench runs TP 1
            cores = parse_cores(bind)
            front = self.settings.frontend_cores.get(name)
            front_cores = parse_cores(front) if front else None
            moved = 0
            for p in self.procs[name].tree():
                with contextlib.suppress(psutil.NoSuchProcess):
                    if p.name().startswith("VLLM::Worker"):
                        moved += rebind_threads(p.pid, cores)
                    elif front_cores:
                        rebind_threads(p.pid, front_cores)
            out[name] = moved
        return out

    def _model(self) -> str:
        from kvpush_prod.lab.tinymodel import TinyModelSpec, write_tiny_model

        shape = self.settings.model_shape
        spec = TinyModelSpec(**shape)  # type: ignore[arg-type]  # fields checked by the CLI
        name = "tiny-llama" + "".join(f"-{k}{v}" for k, v in sorted(shape.items()))
        return str(write_tiny_model(self.settings.workdir / name, spec))

    def _common(self) -> dict[str, Any]:
        s = self.settings
        return {
            "model": self._model(),
            "block_size": s.block_size,
            "max_num_seqs": s.max_num_seqs,
            "kv_cache_gib": s.kv_cache_gib,
            "extra_args": list(s.engine_args),
        }

    def _start_single(self, timeout: float) -> None:
        spec = EngineSpec(
            "single", port=free_port(), cpu_bind=self.settings.single_cores, **self._common()
        )
        self.binding["single"] = self.settings.single_cores
        self.procs["single"] = start_engine(spec, self.log_dir)
        self.engine_urls["single"] = f"http://127.0.0.1:{spec.port}"
        wait_started(self.engine_urls["single"], self.procs["single"], timeout)
        self.entry = self.engine_urls["single"]

    def _start_vllm(self, timeout: float) -> None:
        connector = "NixlConnector" if self.side.kind == "vllm-pull" else "NixlPushConnector"
        for name, role, core in (("prefill", "kv_producer", "0"), ("decode", "kv_consumer", "1")):
            side_port = free_port()
            env = {
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
            }
            if self.side.spin == "neutralised":
                env[SPINFIX_ENV] = str(self.settings.pthr_delay_us)
                env["PYTHONPATH"] = os.pathsep.join(
                    p for p in (str(SPINFIX_DIR), os.environ.get("PYTHONPATH", "")) if p
                )
            engine_id = f"bench-{self.side.name}-{name}-{uuid.uuid4().hex[:8]}"
            kv = {
                "kv_connector": connector,
                "kv_role": role,
                "kv_buffer_device": "cpu",
                "engine_id": engine_id,
                "kv_connector_extra_config": {},
            }
            if name == "prefill":
                # Handed to the router so it never sends P an identity probe: a probe leaves
                # vLLM push's P with finished blocks no D ever registers for, and its writer
                # thread then self-polls every 1 ms until their lease ends.
                self._identity = {
                    "engine_id": engine_id,
                    "control_host": "127.0.0.1",
                    "control_port": side_port,
                    "tp_size": 1,
                }
            self.binding[name] = core
            spec = EngineSpec(
                name,
                port=free_port(),
                kv_transfer_config=kv,
                cpu_bind=core,
                env=env,
                **self._common(),
            )
            self.procs[name] = start_engine(spec, self.log_dir)
            self.engine_urls[name] = f"http://127.0.0.1:{spec.port}"
        for name in ("prefill", "decode"):
            wait_started(self.engine_urls[name], self.procs[name], timeout)
        mode = "pull" if self.side.kind == "vllm-pull" else "push"
        self._start_router(mode)

    def _start_kvpush(self, timeout: float) -> None:
        from kvpush_prod.lab.cluster import Cluster, ClusterSpec

        s = self.settings
        trace = {"KVPUSH_TRACE_DIR": str(self.trace_dir)}
        spec = ClusterSpec(
            workdir=self.dir,
            block_size=s.block_size,
            reference=False,
            router=False,
            prefill_kv_gib=s.kv_cache_gib,
            decode_kv_gib=s.kv_cache_gib,
            max_num_seqs=s.max_num_seqs,
            extra=dict(s.kvpush_extra),
            prefill_env=dict(trace),
            decode_env=dict(trace),
            engine_args=list(s.engine_args),
            secure=self.side.name != "kvpush-insecure",
            signed_params=self.side.name != "kvpush-insecure",
        )
        cluster = Cluster(spec)
        if spec.signed_params:
            self._params_key = cluster.params_key_file
        cluster.model = self._model()
        cluster.log_dir = self.log_dir
        self._cluster = cluster
        cluster.start(timeout)
        self.procs.update(cluster.procs)
        for name in ("prefill", "decode"):
            if bind := cluster.specs[name].cpu_bind:
                self.binding[name] = bind
        self.engine_urls.update({n: cluster.urls[n] for n in ("prefill", "decode")})
        # The router's "pull" mode is the sequential flow: P first, D with P's answer.
        self._start_router("pull" if self.side.name == "kvpush-sequential" else "push")

    def _start_router(self, mode: str) -> None:
        port = free_port()
        prefill = ["--prefill", self.engine_urls["prefill"]]
        if self._identity and mode == "push":
            self.dir.mkdir(parents=True, exist_ok=True)
            cfg = self.dir / "router.yaml"
            entry = {"url": self.engine_urls["prefill"], **self._identity}
            cfg.write_text(json.dumps({"prefill": [entry]}))  # JSON is YAML
            prefill = ["--config", str(cfg)]
        cmd = [
            *router_command(port),
            *prefill,
            "--decode",
            self.engine_urls["decode"],
            "--mode",
            mode,
            # Every cell measures the transfer, however short its prompts.
            "--direct-below-tokens",
            "0",
            *(["--vllm-push-compat"] if self.side.kind == "vllm-push" else []),
            *(["--params-key-file", str(self._params_key)] if self._params_key else []),
            "--log-level",
            "warning",
        ]
        self.procs["router"] = Proc("router", cmd, dict(os.environ), self.log_dir / "router.log")
        self.entry = f"http://127.0.0.1:{port}"
        wait_healthy(self.entry, self.procs["router"], 180)

    # -- observe
    def engines(self) -> list[str]:
        return [n for n in ("single", "prefill", "decode") if n in self.engine_urls]

    def spin_markers(self) -> int:
        """How many NIXL agents the injected sitecustomize neutralised (from the logs)."""
        n = 0
        for name in ("prefill", "decode"):
            proc = self.procs.get(name)
            if proc is None:
                continue
            with contextlib.suppress(OSError):
                n += proc.log_path.read_text(errors="replace").count(SPINFIX_MARKER)
        return n

    def idle_cpu(self, seconds: float = 3.0, settle: float = 2.0) -> dict[str, float]:
        """CPU % of each engine's process tree while idle: ~100 per spinning NIXL agent."""
        import time

        import psutil

        time.sleep(settle)  # let the last warm-up request's work drain

        trees = {n: self.procs[n].tree() for n in self.engines()}
        for procs in trees.values():
            for p in procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.cpu_percent(None)
        time.sleep(seconds)
        out: dict[str, float] = {}
        for n, procs in trees.items():
            total = 0.0
            for p in procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    total += p.cpu_percent(None)
            out[n] = round(total, 1)
        return out

    def cpu_seconds(self, name: str) -> float:
        """User + system CPU seconds of engine ``name``'s whole process tree so far."""
        import psutil

        total = 0.0
        for p in self.procs[name].tree() if name in self.procs else ():
            with contextlib.suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            with contextlib.suppress(Exception):  # best effort: stop the others too
                proc.stop()
        self.procs.clear()
