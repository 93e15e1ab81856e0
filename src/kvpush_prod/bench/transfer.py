"""``kvpush bench transfer``: our NIXL transport's push (WRITE) latency and bandwidth between
two processes over loopback, chunk sizes 4 KiB to 64 MiB, against a plain memcpy of the same
sizes on this machine (the physical limit), as a ratio.

Both processes use ``make_agent`` with the progress-thread delay of our profiles (no spin);
the writer is bound to core 0, the target to core 1. Each chunk is posted, then polled to
completion, one at a time (latency); bandwidth is the chunk size over the median time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from typing import Any

KIB = 1024
MIB = 1024 * KIB
DEFAULT_SIZES = [4 * KIB * 2**i for i in range(15)]  # 4 KiB .. 64 MiB


def _layout(base: int, block: int, nblocks: int, compat: str, device: str = "cpu") -> Any:
    from kvpush_prod.core.messages import Layout, Region

    return Layout(
        compat=compat,
        mem_type="VRAM" if device == "cuda" else "DRAM",
        regions=[Region(base=base, block_stride=block, block_len=block, num_blocks=nblocks)],
    )


def _buffer(capacity: int, value: int, device: str) -> tuple[Any, int]:
    """A touched byte buffer on ``device`` and its address."""
    if device == "cuda":
        import torch

        t = torch.full((capacity,), value, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        return t, int(t.data_ptr())
    import numpy as np

    a = np.full(capacity, value, dtype=np.uint8)  # touched: no page faults in the timing
    return a, int(a.ctypes.data)


def _bind(core: int) -> None:
    try:
        if (os.cpu_count() or 1) > core:
            os.sched_setaffinity(0, {core})
    except (AttributeError, OSError):
        pass


def _target(conn: Any, capacity: int, delay_us: int, core: int, device: str = "cpu") -> None:
    """The passive side: a registered buffer per request, its agent metadata sent back."""
    from kvpush_prod.transport.nixl import NixlTransport, make_agent

    _bind(core)
    buf, base = _buffer(capacity, 1, device)
    transport = None
    while True:
        cmd = conn.recv()
        if cmd[0] == "setup":
            _, name, block, nblocks = cmd
            if transport is not None:
                transport.close()
            agent = make_agent(name, "UCX", True, delay_us)
            layout = _layout(base, block, nblocks, f"b{block}", device)
            transport = NixlTransport(agent, layout)
            conn.send((transport.metadata(), base))
        elif cmd[0] == "check":
            _, offset, nbytes, value = cmd
            conn.send(bool((buf[offset : offset + nbytes] == value).all()))
        else:
            if transport is not None:
                transport.close()
            conn.send("bye")
            return


def _time_writes(
    transport: Any, peer: Any, nblocks: int, min_time_s: float, max_iters: int
) -> list[float]:
    blocks = list(range(nblocks))
    times: list[float] = []
    t_end = time.perf_counter() + min_time_s
    while len(times) < 5 or (time.perf_counter() < t_end and len(times) < max_iters):
        t0 = time.perf_counter()
        handle = transport.post("WRITE", peer, blocks, blocks)
        while True:
            state = transport.state(handle)
            if state == "DONE":
                break
            if state != "PROC":
                raise RuntimeError(f"WRITE failed: {state}")
        times.append(time.perf_counter() - t0)
        transport.release(handle)
    return times


def _memcpy_times(
    src: Any, dst: Any, size: int, min_time_s: float, max_iters: int, device: str = "cpu"
) -> list[float]:
    """memcpy (numpy) or a device-to-device copy (torch, synchronised) of ``size`` bytes."""
    times: list[float] = []
    t_end = time.perf_counter() + min_time_s
    s, d = src[:size], dst[:size]
    if device == "cuda":
        import torch

        def copy() -> None:
            d.copy_(s)
            torch.cuda.synchronize()
    else:
        import numpy as np

        def copy() -> None:
            np.copyto(d, s)

    copy()
    while len(times) < 5 or (time.perf_counter() < t_end and len(times) < max_iters):
        t0 = time.perf_counter()
        copy()
        times.append(time.perf_counter() - t0)
    return times


def measure(
    sizes: list[int],
    block_bytes: int = 0,
    delay_us: int = 10000,
    min_time_s: float = 0.3,
    max_iters: int = 2000,
    device: str = "cpu",
) -> dict[str, Any]:
    """Push latency/bandwidth per size and memcpy of the same sizes; ``block_bytes`` > 0
    splits each chunk into KV-block-sized descriptors (as a real transfer is posted)."""
    from kvpush_prod.transport.nixl import NixlTransport, make_agent

    capacity = max(sizes)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, capacity, delay_us, 1, device), daemon=True)
    proc.start()
    _bind(0)
    src, src_base = _buffer(capacity, 7, device)
    dst, _ = _buffer(capacity, 1, device)
    rows = []
    try:
        for i, size in enumerate(sizes):
            block = block_bytes if 0 < block_bytes < size else size
            nblocks = max(1, size // block)
            name = f"kvpush-bench-{os.getpid()}-{i}"
            parent.send(("setup", name + "-t", block, nblocks))
            meta, remote_base = parent.recv()
            agent = make_agent(name + "-w", "UCX", True, delay_us)
            layout = _layout(src_base, block, nblocks, f"b{block}", device)
            transport = NixlTransport(agent, layout)
            try:
                remote = _layout(remote_base, block, nblocks, f"b{block}", device)
                peer = transport.connect(meta, remote)
                write = _time_writes(transport, peer, nblocks, min_time_s, max_iters)
            finally:
                transport.close()
            parent.send(("check", 0, nblocks * block, 7))
            landed = parent.recv()
            copy = _memcpy_times(src, dst, size, min_time_s, max_iters, device)
            w50, c50 = statistics.median(write), statistics.median(copy)
            rows.append(
                {
                    "bytes": size,
                    "descriptors": nblocks,
                    "iterations": len(write),
                    "push_latency_us_p50": w50 * 1e6,
                    "push_latency_us_p90": sorted(write)[int(0.9 * (len(write) - 1))] * 1e6,
                    "push_gb_s": size / w50 / 1e9,
                    "memcpy_latency_us_p50": c50 * 1e6,
                    "memcpy_gb_s": size / c50 / 1e9,
                    "ratio_of_memcpy": c50 / w50,
                    "data_landed": landed,
                }
            )
    finally:
        parent.send(("exit",))
        with contextlib.suppress(EOFError):
            parent.recv()
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    return {
        "rows": rows,
        "block_bytes": block_bytes,
        "progress_delay_us": delay_us,
        "device": device,
    }


def _human(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def markdown(results: list[dict[str, Any]], cpu: str) -> str:
    lines = [f"# NIXL loopback push vs memcpy ({cpu})", ""]
    for res in results:
        shape = (
            f"chunks of {_human(res['block_bytes'])} blocks"
            if res["block_bytes"]
            else "one descriptor per chunk"
        )
        lines += [
            f"## {shape}, progress thread delay {res['progress_delay_us']} us",
            "",
            "| chunk | descriptors | push p50 us | push GB/s | memcpy GB/s | push / memcpy | landed |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in res["rows"]:
            lines.append(
                f"| {_human(r['bytes'])} | {r['descriptors']} | "
                f"{r['push_latency_us_p50']:.1f} | {r['push_gb_s']:.2f} | "
                f"{r['memcpy_gb_s']:.2f} | {r['ratio_of_memcpy']:.0%} | "
                f"{'yes' if r['data_landed'] else 'NO'} |"
            )
        big = [r["ratio_of_memcpy"] for r in res["rows"] if r["bytes"] >= 4 * MIB]
        if big:
            lines += [
                "",
                f"Chunks >= 4 MiB: push reaches {min(big):.0%} - {max(big):.0%} of "
                f"memcpy (target >= 70%).",
                "",
            ]
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for res in results:
        tag = f"blocks {_human(res['block_bytes'])}" if res["block_bytes"] else "1 descriptor"
        xs = [r["bytes"] for r in res["rows"]]
        a1.plot(xs, [r["push_gb_s"] for r in res["rows"]], "-o", label=f"push ({tag})")
        a2.plot(xs, [r["push_latency_us_p50"] for r in res["rows"]], "-o", label=f"push ({tag})")
    xs = [r["bytes"] for r in results[0]["rows"]]
    a1.plot(xs, [r["memcpy_gb_s"] for r in results[0]["rows"]], "--k", label="memcpy")
    a2.plot(xs, [r["memcpy_latency_us_p50"] for r in results[0]["rows"]], "--k", label="memcpy")
    for ax, lab in ((a1, "GB/s"), (a2, "latency p50 (us)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("chunk bytes")
        ax.set_ylabel(lab)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    a2.set_yscale("log")
    fig.suptitle("kvpush NIXL transport (UCX loopback) vs memcpy", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpush bench transfer", description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    ap.add_argument(
        "--sizes",
        default="",
        help="comma list of chunk sizes in bytes (default 4 KiB .. 64 MiB, x2)",
    )
    ap.add_argument(
        "--block-bytes",
        default="0,32768",
        help="descriptor sizes to try: 0 = one descriptor per chunk (default 0,32768)",
    )
    ap.add_argument("--progress-delay-us", type=int, default=10000)
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds per size and shape")
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: VRAM to VRAM between two processes on GPU 0, against a device-to-device copy",
    )
    args = ap.parse_args(argv)
    from kvpush_prod.bench.machine import machine_facts

    sizes = [int(x) for x in args.sizes.split(",") if x] or DEFAULT_SIZES
    results = [
        measure(sizes, int(b), args.progress_delay_us, args.min_time, device=args.device)
        for b in args.block_bytes.split(",")
        if b != ""
    ]
    facts = machine_facts()
    where = f"{facts['cpu']}, {facts['simd']}, load {facts['loadavg_at_start']}"
    if args.device == "cuda":
        import torch

        facts["gpu"] = torch.cuda.get_device_name(0)
        where = f"{facts['gpu']}, VRAM to VRAM, vs device-to-device copy"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transfer.json").write_text(
        json.dumps({"meta": facts, "results": results}, indent=1)
    )
    md = markdown(results, where)
    (args.out / "transfer.md").write_text(md)
    plot(results, args.out / "transfer.png")
    print(md)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
