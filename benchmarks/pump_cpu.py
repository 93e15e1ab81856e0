"""CPU of the transfer pump, per thread, on real engines: idle P/D, and a receiving D.

Starts a P/D pair (P on core 0, D on core 1, router), warms it up, then reads per-thread
CPU time from /proc/<pid>/task/<tid>/stat over a wall interval:
  1. idle: both engines, nothing in flight;
  2. receiving D: P is stopped (SIGSTOP) and ``--requests`` requests are sent, so D has
     them admitted, their blocks reserved and REGISTERs out, and waits for remote KV the
     whole interval (its pump has receives pending); then P is continued.
The pump thread is the one named ``kvpush-pump`` (in a tree older than that it shows as its
process's name: look at the top threads; ``[main]`` marks a process's main thread). Shares
are of one core (1.0 = a whole core), at the kernel's clock-tick resolution (10 ms).

    PYTHONPATH=src python benchmarks/pump_cpu.py [--window 4] [--requests 4] [--out x.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from kvpush_prod.lab.client import completion_body, request
from kvpush_prod.lab.cluster import Cluster, ClusterSpec

PUMP = "kvpush-pump"
TICK = os.sysconf("SC_CLK_TCK")


def _threads(cluster: Cluster, name: str) -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, tid) -> (thread name, CPU seconds) for every thread of ``name``'s process tree."""
    out: dict[tuple[int, int], tuple[str, float]] = {}
    for proc in cluster.procs[name].tree():
        task = Path(f"/proc/{proc.pid}/task")
        try:
            tids = [int(t) for t in os.listdir(task)]
        except OSError:
            continue
        for tid in tids:
            try:
                stat = (task / str(tid) / "stat").read_text()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            if tid == proc.pid:
                comm += "[main]"  # the process's own thread (vLLM's step loop in a worker)
            fields = stat[stat.rindex(")") + 2 :].split()
            out[(proc.pid, tid)] = (comm, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def _shares(cluster: Cluster, names: tuple[str, ...], window: float) -> dict[str, Any]:
    before = {n: _threads(cluster, n) for n in names}
    t0 = time.monotonic()
    time.sleep(window)
    wall = time.monotonic() - t0
    after = {n: _threads(cluster, n) for n in names}
    report: dict[str, Any] = {}
    for n in names:
        per = [
            (comm, (cpu - before[n].get(key, (comm, 0.0))[1]) / wall, key[1])
            for key, (comm, cpu) in after[n].items()
        ]
        per.sort(key=lambda x: -x[1])
        report[n] = {
            "pump": round(sum(s for c, s, _ in per if c == PUMP), 4),
            "total": round(sum(s for _, s, _ in per), 4),
            "top": [(c, round(s, 4), tid) for c, s, tid in per[:5]],
        }
    return report


def _prompt(i: int, length: int) -> str:
    return " ".join(f"w{4 + (i * 131 + k * 7) % 1000}" for k in range(length))


async def _send(url: str, prompts: list[str], max_tokens: int) -> list[Any]:
    async with httpx.AsyncClient(trust_env=False, timeout=120) as client:
        bodies = [completion_body(p, max_tokens, stream=True) for p in prompts]
        return await asyncio.gather(*(request(client, url, b) for b in bodies))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=float, default=4.0)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    work = a.workdir or Path(tempfile.mkdtemp(prefix="kvpush-pump-cpu-"))
    spec = ClusterSpec(
        workdir=work.resolve(),
        reference=False,
        # P is stopped longer than the bench window: D must keep waiting.
        extra={"leases": {"permit_ttl_s": 60}},
    )
    result: dict[str, Any] = {}
    with Cluster(spec) as cluster:
        url = cluster.urls["router"]
        warm = asyncio.run(_send(url, [_prompt(i, a.length) for i in range(3)], 4))
        assert all(r.ok for r in warm), [r.error for r in warm]
        cluster.wait_idle(30)
        time.sleep(1.0)
        result["idle"] = _shares(cluster, ("prefill", "decode"), a.window)
        cluster.procs["prefill"].signal_tree(signal.SIGSTOP)
        done: list[Any] = []
        sender = threading.Thread(
            target=lambda: done.extend(
                asyncio.run(_send(url, [_prompt(100 + i, a.length) for i in range(a.requests)], 4))
            )
        )
        try:
            sender.start()
            time.sleep(1.5)  # admitted, blocks reserved, REGISTERs out
            result["receiving"] = _shares(cluster, ("decode",), a.window)
        finally:
            cluster.procs["prefill"].signal_tree(signal.SIGCONT)
        sender.join(120)
        result["requests_ok"] = sum(1 for r in done if r.ok)
        result["requests"] = a.requests
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
