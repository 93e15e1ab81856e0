"""What an engine holding a valid key can do to another by flooding its control port: the
engine thread's longest time in the connector's calls (it hands the pump work and looks at
completions; it never waits for the pump's lock), and its longest step, per flood.

Floods (issue 22), each from an insider: a key in the allow-list that owns no transfer:
  heartbeats   64 heartbeats of ~720 KB (65,536 entries each) at P
  heartbeats_max  600 heartbeats as big as the codec takes now (128 KiB, dense), at P
  registers    65,536 REGISTERs for transfers that do not exist, at P
  cancels      20,000 CANCELs, each naming a fresh reply address, at P
  hb_d         the 64 heartbeats of 720 KB at D
  queries_d    20,000 DoneQuerys, each naming a fresh reply address, at D
  none         no flood (the baseline)

``pump`` mode (default; seconds, no vLLM): a real SenderPump or ReceiverPump over real
CurveZMQ endpoints on loopback and an in-memory transport, in this process, pinned to core 0
with an "engine thread" that steps like a decoding engine (``--work-ms`` of Python holding
the interpreter, ``--idle-ms`` without it, e.g. a forward in torch, then the pump's lock as
the connector's hooks take it); the insider floods from another process on core 1, while a
legitimate decode key registers a transfer every 20 ms (P targets: every one must be taken).

``engines`` mode (a real P/D pair and the router from the lab, 1-2 minutes to start): while
each flood runs, P/D requests go through the router one after another (so both engine
threads hand over pushes and look at completions under the pump's lock, as in service), and
a long greedy decode streams from P and one from D (direct requests): the largest gap
between two tokens of each is read on the client; ``none`` is the baseline. The P/D
requests must all answer, pushed.

Run the code of another tree by putting its ``src`` first: ``PYTHONPATH=/tmp/old/src``.

    python benchmarks/keyed_flood.py [--floods heartbeats,registers,...] [--out x.json]
    flock /tmp/kvpush-engines.lock python benchmarks/keyed_flood.py --mode engines
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import zmq

import kvpush_prod
from kvpush_prod.core import messages as m
from kvpush_prod.core.identity import agent_name

V = m.PROTOCOL_VERSION
FLOODS = ("none", "heartbeats", "heartbeats_max", "registers", "cancels", "hb_d", "queries_d")
AT_D = {"hb_d", "queries_d"}
LAYOUT = m.Layout("bench", "DRAM", [m.Region(0, 4096, 4096, 4096)])


# ------------------------------------------------------------------ the insider's messages


def flood_messages(kind: str, target: str, evil_key: str) -> list[bytes]:
    """The encoded messages of flood ``kind`` (what the insider sends, in order)."""
    rng = random.Random(22)
    if kind == "none":
        return []
    if kind in ("heartbeats", "hb_d"):
        slim = m.PeerInfo("insider", 1, 0, "tcp://127.0.0.1:1")
        live = [(str(i % 97), rng.getrandbits(63)) for i in range(m.MAX_LIVE)]
        return [m.encode(m.Heartbeat(V, slim, 0, live, 60_000))] * 64
    if kind == "heartbeats_max":
        slim = m.PeerInfo("insider", 1, 0, "tcp://127.0.0.1:1")
        live = [(str(i % 97), rng.getrandbits(63)) for i in range(9_000)]
        body = m.encode(m.Heartbeat(V, slim, 0, live, 60_000))
        while len(body) > (128 << 10):
            live = live[:-200]
            body = m.encode(m.Heartbeat(V, slim, 0, live, 60_000))
        return [body] * 600
    if kind == "registers":
        me = m.PeerInfo(
            "insider", 1, 0, "tcp://127.0.0.1:1", agent_name("insider", evil_key), b"meta", LAYOUT
        )
        return [
            m.encode(m.Register(V, f"ghost-{i}", me, [0, 1, 2], 0, 300, 1 + i, 60_000))
            for i in range(65_536)
        ]
    if kind == "cancels":
        return [
            m.encode(
                m.Cancel(
                    V,
                    f"c{i}",
                    0,
                    m.PeerInfo(
                        "insider",
                        1,
                        0,
                        f"tcp://127.0.{i // 60_000}.{1 + i % 250}:{1024 + i % 60_000}",
                    ),
                    "aborted",
                )
            )
            for i in range(20_000)
        ]
    if kind == "queries_d":
        return [
            m.encode(
                m.DoneQuery(
                    V,
                    f"q{i}",
                    1,
                    m.PeerInfo(
                        "insider",
                        1,
                        0,
                        f"tcp://127.0.{i // 60_000}.{1 + i % 250}:{1024 + i % 60_000}",
                    ),
                    0,
                )
            )
            for i in range(20_000)
        ]
    raise ValueError(f"unknown flood {kind!r}; one of {', '.join(FLOODS)}")


def _insider(
    kind: str,
    target: str,
    port: int,
    server_key: bytes,
    evil: tuple[bytes, bytes],
    good: tuple[bytes, bytes] | None,
    legit: list[bytes],
    ready: Any,
    go: Any,
    core: int = 1,
) -> None:
    """The insider's process (on ``core``): floods ``port``; a legitimate decode key
    registers ``legit`` transfers meanwhile, one every 20 ms."""
    with _pinned(core):
        msgs = flood_messages(kind, target, evil[0].decode())
        ctx = zmq.Context()
        socks = []
        for pub, sec in [evil] + ([good] if good else []):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 1_000_000)
            s.curve_publickey, s.curve_secretkey, s.curve_serverkey = pub, sec, server_key
            s.connect(f"tcp://127.0.0.1:{port}")
            socks.append(s)
        time.sleep(0.5)  # handshakes
        ready.set()
        go.wait()
        t0 = time.monotonic()
        next_legit = t0
        i = 0
        for body in msgs:
            socks[0].send(body, copy=False)
            if good and i < len(legit) and time.monotonic() >= next_legit:
                socks[1].send(legit[i])
                i, next_legit = i + 1, next_legit + 0.02
        while good and i < len(legit):
            time.sleep(max(0.0, next_legit - time.monotonic()))
            socks[1].send(legit[i])
            i, next_legit = i + 1, next_legit + 0.02
        time.sleep(1.0)
        ctx.destroy(linger=0)


class _pinned:
    def __init__(self, core: int) -> None:
        self.core = core

    def __enter__(self) -> None:
        if hasattr(os, "sched_setaffinity") and os.cpu_count() and os.cpu_count() > self.core:
            os.sched_setaffinity(0, {self.core})

    def __exit__(self, *exc: object) -> None: ...


# ------------------------------------------------------------------ pump mode


class _GcPauses:
    """The garbage collector's pauses (each holds the interpreter), by generation."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, int]] = []
        self._t = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.pauses.append((time.perf_counter() - self._t, info["generation"]))


class _Transport:
    """An in-memory NIXL stand-in: every WRITE completes at once (none are posted here)."""

    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def layout(self) -> m.Layout:
        return LAYOUT

    @property
    def name(self) -> str:
        return self._name

    def metadata(self) -> bytes:
        return b"meta"

    def connect(self, agent_meta: bytes, layout: m.Layout, expect_name: str = "") -> Any:
        from kvpush_prod.transport.base import RemotePeer

        return RemotePeer(expect_name, layout, None)

    def disconnect(self, agent_name: str) -> None: ...

    def post(self, *args: Any, **kw: Any) -> Any:
        return 1

    def state(self, handle: Any) -> str:
        return "DONE"

    def release(self, handle: Any) -> None: ...

    def notifications(self) -> dict[str, list[bytes]]:
        return {}

    def close(self) -> None: ...


def _engine_thread(
    pump: Any, stop: threading.Event, work_s: float, idle_s: float, out: dict[str, list[float]]
) -> None:
    """Steps like a decoding engine: Python work, a GIL-free wait, then the connector's
    engine-thread calls (``offer``, ``progress_now``): ``waits`` is how long they took."""
    waits, steps, slow = out["waits"], out["steps"], out["slow"]
    last = time.perf_counter()
    while not stop.is_set():
        begin = time.perf_counter()
        end = begin + work_s
        x = 0
        while time.perf_counter() < end:  # holds the interpreter, as the engine's Python does
            x += 1
        a = time.perf_counter()
        time.sleep(idle_s)  # a forward in torch: the interpreter is free
        t0 = time.perf_counter()
        # What the connector's hooks do each step: hand the pump work (after_forward's
        # hand-over, run at once when the lock is free) and look at completions.
        pump.offer(lambda: None, "a bench step", now=True)
        pump.progress_now()
        t1 = time.perf_counter()
        waits.append(t1 - t0)
        steps.append(t1 - last)
        if t1 - last > 3 * (work_s + idle_s):
            # Where a long step went: the Python work (the interpreter or the core taken by
            # other threads), the sleep (woken late: the interpreter or the core), the lock.
            slow.append(
                [
                    round(t1, 3),
                    round(1e3 * (t1 - last), 1),
                    round(1e3 * (a - last), 1),
                    round(1e3 * (t0 - a - idle_s), 1),
                    round(1e3 * (t1 - t0), 2),
                ]
            )
        last = t1


def run_pump(kind: str, seconds: float, work_ms: float, idle_ms: float) -> dict[str, Any]:
    from kvpush_prod.config import config_from_extra
    from kvpush_prod.config.core import core_settings
    from kvpush_prod.connector.worker import ReceiverPump, SenderPump, _Results
    from kvpush_prod.control import ControlCodec, ControlEndpoint, EndpointSecurity, KeyPair
    from kvpush_prod.core.receiver import Receiver
    from kvpush_prod.core.sender import Sender
    from kvpush_prod.lab.launch import free_port
    from kvpush_prod.metrics import StatsBuffer

    keys = {n: zmq.curve_keypair() for n in ("prefill", "decode", "insider")}
    allowed = {pub: n for n, (pub, _) in keys.items()}
    at_d = kind in AT_D
    me = "decode" if at_d else "prefill"
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    cfg = config_from_extra({})
    settings = core_settings(cfg, 4096)
    info = m.PeerInfo(
        me, 1, 0, address, agent_name(f"kvpush-{me}", keys[me][0].decode()), b"meta", LAYOUT
    )
    endpoint = ControlEndpoint(
        ControlCodec(cfg.control.max_message_bytes),
        "127.0.0.1",
        port,
        EndpointSecurity(KeyPair(me, *keys[me]), allowed),
    )
    stats = StatsBuffer()
    rng = random.SystemRandom()
    pump: Any
    if at_d:
        pump = ReceiverPump(
            cfg,
            Receiver(info, settings.receiver, rng, tokens=rng),
            _Transport(info.agent_name),
            endpoint,
            _Results(),
            stats,
        )
    else:
        pump = SenderPump(
            cfg,
            Sender(info, settings.sender, rng),
            _Transport(info.agent_name),
            endpoint,
            _Results(),
            stats,
        )
    legit: list[bytes] = []
    legit_ids: list[str] = []
    if not at_d:
        d = m.PeerInfo(
            "decode",
            2,
            0,
            "tcp://127.0.0.1:9",
            agent_name("kvpush-decode", keys["decode"][0].decode()),
            b"meta",
            LAYOUT,
        )
        legit_ids = [f"legit-{i}" for i in range(int(seconds / 0.02))]
        legit = [
            m.encode(m.Register(V, tid, d, [5, 6, 7], 0, 300, 10 + i, 60_000))
            for i, tid in enumerate(legit_ids)
        ]
    ctx = mp.get_context("spawn")
    ready, go = ctx.Event(), ctx.Event()
    proc = ctx.Process(
        target=_insider,
        args=(
            kind,
            me,
            port,
            keys[me][0],
            keys["insider"],
            None if at_d else keys["decode"],
            legit,
            ready,
            go,
        ),
        daemon=True,
    )
    with _pinned(0):
        pump.start()
        proc.start()
        ready.wait(120)
        # As vLLM's engine core does once started (freeze_gc_heap): the start-up heap is
        # never scanned again, so a collection costs what was allocated since.
        gc.collect()
        gc.freeze()
        pauses = _GcPauses()
        gc.callbacks.append(pauses)
        out: dict[str, list[Any]] = {"waits": [], "steps": [], "slow": []}
        stop = threading.Event()
        engine = threading.Thread(
            target=_engine_thread, args=(pump, stop, work_ms / 1e3, idle_ms / 1e3, out)
        )
        engine.start()
        time.sleep(0.5)
        base = list(out["steps"])
        out["steps"].clear()
        out["waits"].clear()
        out["slow"].clear()
        t_go = time.perf_counter()
        pauses.pauses.clear()
        go.set()
        time.sleep(seconds)
        stop.set()
        engine.join()
        gc.callbacks.remove(pauses)
        gc.unfreeze()
        proc.join(30)
        taken = sum(
            1 for tid in legit_ids if getattr(pump.engine._out.get(tid), "reg", None) is not None
        )
        rejected: Counter[str] = Counter(endpoint.rejected)
        for name, labels, value in stats.drain().get("c", []):
            if name == "kvpush_control_messages_rejected" and labels[1] not in endpoint.rejected:
                rejected[labels[1]] += int(value)  # the core's (the endpoint's are forwarded)
        pump.stop()
    waits = sorted(out["waits"])
    steps = sorted(out["steps"])
    return {
        "flood": kind,
        "at": me,
        "seconds": seconds,
        "tree": str(Path(kvpush_prod.__file__).parent),
        "engine_steps": len(steps),
        "step_base_ms": round(1e3 * statistics.median(base), 2) if base else None,
        "step_p50_ms": round(1e3 * statistics.median(steps), 2),
        "step_max_ms": round(1e3 * steps[-1], 2),
        "lock_wait_p99_ms": round(1e3 * waits[int(0.99 * (len(waits) - 1))], 2),
        "lock_wait_max_ms": round(1e3 * waits[-1], 2),
        "gc_max_ms": round(1e3 * max((d for d, _ in pauses.pauses), default=0.0), 2),
        "legit_taken": f"{taken}/{len(legit_ids)}" if legit_ids else "-",
        "rejected": dict(rejected),
        # the longest steps: [s after the flood began, step ms, work ms, late wake-up ms,
        # lock wait ms]
        "slowest": [
            [round(r[0] - t_go, 3), *r[1:]] for r in sorted(out["slow"], key=lambda r: -r[1])[:5]
        ],
    }


# ------------------------------------------------------------------ engines mode


def run_engines(floods: list[str], max_tokens: int, workdir: Path) -> list[dict[str, Any]]:
    import httpx

    from kvpush_prod.control.keys import load_allowed, load_keypair
    from kvpush_prod.lab.client import completion_body, metric_sum, request, scrape
    from kvpush_prod.lab.cluster import Cluster, ClusterSpec
    from kvpush_prod.lab.tinymodel import prompt_of_length

    spec = ClusterSpec(
        workdir=workdir,
        extra_keys=("intruder",),
        reference=False,
        kv_load_failure_policy="recompute",
    )
    rows: list[dict[str, Any]] = []
    with Cluster(spec) as cluster:
        keys = {name: key for key, name in load_allowed(cluster.allowed_dir).items()}
        evil = load_keypair(cluster.key_file("intruder"))

        async def stream(name: str, seed: int) -> Any:
            body = completion_body(
                prompt_of_length(64, seed=seed), max_tokens, True, ignore_eos=True
            )
            async with httpx.AsyncClient(timeout=300) as client:
                began = time.time()
                res = await request(client, cluster.urls[name], body, timeout=300)
                res.began = began  # for when the largest gap happened
                return res

        async def measured(kind: str) -> dict[str, Any]:
            target = "decode" if kind in AT_D else "prefill"
            port = cluster.d_control if target == "decode" else cluster.p_control
            ctx = mp.get_context("spawn")
            ready, go = ctx.Event(), ctx.Event()
            proc = None
            if kind != "none":
                # On the other engine's core (P runs on core 0, D on core 1): the attacker is
                # another host in a deployment; here it takes CPU from the engine beside it.
                proc = ctx.Process(
                    target=_insider,
                    args=(
                        kind,
                        target,
                        port,
                        keys[target],
                        (evil.public, evil.secret),
                        None,
                        [],
                        ready,
                        go,
                        1 if target == "prefill" else 0,
                    ),
                    daemon=True,
                )
                proc.start()
                ready.wait(120)
            pushed_before = metric_sum(
                scrape(cluster.urls["decode"]), "kvpush_transfers_total", outcome="pushed"
            )
            done = asyncio.Event()
            background: list[Any] = []

            async def pd_traffic() -> None:
                async with httpx.AsyncClient(timeout=120) as client:
                    i = 0
                    while not done.is_set():
                        i += 1
                        body = completion_body(prompt_of_length(200, seed=1000 + i), 4, False)
                        background.append(await request(client, cluster.urls["router"], body))

            traffic = asyncio.create_task(pd_traffic())
            runs = asyncio.gather(stream("prefill", 1), stream("decode", 2))
            await asyncio.sleep(0.5)
            go.set()
            got = await runs
            done.set()
            await traffic
            if proc is not None:
                proc.join(60)
            await asyncio.sleep(1.0)  # the last transfers' counters reach /metrics
            pushed = (
                metric_sum(
                    scrape(cluster.urls["decode"]), "kvpush_transfers_total", outcome="pushed"
                )
                - pushed_before
            )
            row: dict[str, Any] = {
                "flood": kind,
                "at": target,
                "pd_requests": len(background),
                "pd_ok": sum(1 for r in background if r.ok),
                "pd_pushed": int(pushed),
            }
            for name, res in zip(("prefill", "decode"), got, strict=True):
                itl = sorted(res.itl)
                worst = max(range(len(res.itl)), key=res.itl.__getitem__, default=-1)
                row[name] = {
                    "ok": res.ok,
                    "tokens": len(itl) + 1,
                    "itl_p50_ms": round(1e3 * statistics.median(itl), 2) if itl else None,
                    "itl_max_ms": round(1e3 * itl[-1], 2) if itl else None,
                    # the wall time the largest gap ended (to read engine logs by)
                    "itl_max_at": round(
                        res.began + (res.ttft or 0.0) + sum(res.itl[: worst + 1]), 3
                    ),
                }
            return row

        async def main() -> None:
            await stream("prefill", 0)  # warm-up
            await stream("decode", 0)
            for kind in floods:
                rows.append(await measured(kind))
                print(json.dumps(rows[-1]), flush=True)

        asyncio.run(main())
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mode", choices=("pump", "engines"), default="pump")
    ap.add_argument("--floods", default=",".join(FLOODS))
    ap.add_argument("--seconds", type=float, default=8.0, help="pump mode: measured window")
    ap.add_argument("--work-ms", type=float, default=2.0)
    ap.add_argument("--idle-ms", type=float, default=6.0)
    ap.add_argument("--max-tokens", type=int, default=600, help="engines mode: decode length")
    ap.add_argument("--workdir", type=Path, help="engines mode: keep the cluster's files here")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    floods = [f for f in args.floods.split(",") if f]
    rows: list[dict[str, Any]] = []
    if args.mode == "pump":
        for kind in floods:
            rows.append(run_pump(kind, args.seconds, args.work_ms, args.idle_ms))
            print(json.dumps(rows[-1]), flush=True)
    elif args.workdir:
        rows = run_engines(floods, args.max_tokens, args.workdir)  # keeps the engines' logs
    else:
        with tempfile.TemporaryDirectory(prefix="kvpush-flood-") as tmp:
            rows = run_engines(floods, args.max_tokens, Path(tmp))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
