"""``kvpush bench transfer``: our NIXL transport's push (WRITE) latency and bandwidth between
two processes over loopback, chunk sizes 4 KiB to 64 MiB, against a plain memcpy of the same
sizes on this machine (the physical limit), as a ratio. ``--post-cost``: descriptors per
transfer and the cost of posting it (build + submit) on model shapes (layers, block size,
prompt length), contiguous and fragmented block ids, old path against new.

Both processes use ``make_agent`` with the progress-thread delay of our profiles (no spin);
the writer is bound to core 0, the target to core 1. Each chunk is posted, then polled to
completion, one at a time (latency); bandwidth is the chunk size over the median time.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass
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
            rows.append(_row(size, nblocks, write, copy, landed))
    finally:
        _stop_child(parent, proc)
    return {
        "rows": rows,
        "block_bytes": block_bytes,
        "progress_delay_us": delay_us,
        "device": device,
    }


def _stop_child(parent: Any, proc: Any) -> None:
    """Ask the target process to exit, wait for it (10 s), kill it if it did not."""
    parent.send(("exit",))
    with contextlib.suppress(EOFError):
        parent.recv()
    proc.join(timeout=10)
    if proc.is_alive():
        proc.kill()


def _row(
    size: int, nblocks: int, write: list[float], copy: list[float], landed: bool
) -> dict[str, Any]:
    """One size's result: push and memcpy latency (p50, p90) and bandwidth."""
    w50, c50 = statistics.median(write), statistics.median(copy)
    return {
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


# -- post cost: descriptors per transfer, build + submit, old path vs new

POST_KINDS = ("contiguous", "runs8", "fragmented")
POST_PATHS = ("old", "auto", "prepped", "coalesced")


def _post_target(conn: Any, delay_us: int, core: int) -> None:
    """D: per setup, ``regions`` regions of ``num_blocks`` slots of ``slot`` bytes, one after
    the other in one buffer (as a layer-split cache), registered through our transport."""
    from kvpush_prod.transport.nixl import NixlTransport, make_agent

    _bind(core)
    transport = None
    while True:
        cmd = conn.recv()
        if transport is not None:
            transport.close()
            transport = None
        if cmd[0] != "setup":
            conn.send("bye")
            return
        _, name, regions, num_blocks, slot = cmd
        buf, base = _buffer(regions * num_blocks * slot, 1, "cpu")
        agent = make_agent(name, "UCX", True, delay_us)
        transport = NixlTransport(
            agent, _post_layout(base, regions, num_blocks, slot), producer=False
        )
        conn.send((transport.metadata(), base))


def _post_layout(base: int, regions: int, num_blocks: int, slot: int) -> Any:
    from kvpush_prod.core.messages import Layout, Region

    span = num_blocks * slot
    return Layout(
        compat="post-cost",
        mem_type="DRAM",
        regions=[
            Region(base=base + i * span, block_stride=slot, block_len=slot, num_blocks=num_blocks)
            for i in range(regions)
        ],
    )


def _post_ids(kind: str, n: int, num_blocks: int, rng: Any) -> list[int]:
    """D's block ids for a transfer of ``n`` blocks: consecutive, runs of 8 at random free
    places, or every block somewhere else (a cache churned for hours)."""
    if kind == "contiguous":
        return list(range(n))
    if kind == "fragmented":
        return [int(x) for x in rng.permutation(num_blocks)[:n]]
    starts = rng.permutation(num_blocks // 8)[: -(-n // 8)] * 8
    return [int(s) + j for s in starts for j in range(8)][:n]


def _legacy_post(transport: Any, peer: Any, lids: list[int], rids: list[int]) -> tuple[Any, float]:
    """The path before runs (kvpush <= 2026-12-01): a Python list of one prepared index per
    block per region, handed to ``make_prepped_xfer``; its handle and build seconds."""
    from kvpush_prod.transport.layout import descriptor_indices

    t0 = time.perf_counter()
    li = descriptor_indices(lids, transport.layout)
    ri = descriptor_indices(rids, peer.layout)
    handle = transport.agent.make_prepped_xfer("WRITE", transport._local, li, peer.dlist, ri, b"")
    return handle, time.perf_counter() - t0


def post_cost(
    layers: list[int],
    blocks: list[int],
    tokens: list[int],
    kinds: list[str],
    paths: list[str],
    slot: int = 256,
    iters: int = 15,
    delay_us: int = 10000,
    seed: int = 0,
) -> dict[str, Any]:
    """One row per (layers, block size, tokens, ids kind, path): the whole transfer in one
    post (no chunking, no bound), its runs, what NIXL was handed (entries), what it posted
    after its own merging (its telemetry), and the median build and submit times.

    A layer is two regions (K and V apart, as on GPUs); a slot is ``slot`` bytes, small so
    that the copy does not hide the per-descriptor work. P's ids are consecutive (a fresh
    prefill); D's are ``kinds``."""
    import numpy as np

    # NIXL counts the descriptors it posts only with telemetry on (read at agent creation).
    os.environ.setdefault("NIXL_TELEMETRY_ENABLE", "y")
    rng = np.random.default_rng(seed)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_post_target, args=(child, delay_us, 1), daemon=True)
    proc.start()
    _bind(0)
    rows: list[dict[str, Any]] = []
    try:
        for n_layers, block, n_tokens in itertools.product(layers, blocks, tokens):
            name = f"kvpush-postcost-{os.getpid()}-{len(rows)}"
            shape = _PostShape(n_layers, block, n_tokens, slot)
            rows += _post_rows(parent, name, shape, kinds, paths, iters, delay_us, rng)
    finally:
        _stop_child(parent, proc)
    return {"rows": rows, "slot_bytes": slot, "progress_delay_us": delay_us, "fit": fit_costs(rows)}


@dataclass(frozen=True)
class _PostShape:
    """One transfer shape of ``post_cost``: its layers, block size, tokens and slot bytes."""

    layers: int
    block: int
    tokens: int
    slot: int

    @property
    def regions(self) -> int:
        return 2 * self.layers  # K and V apart, as on GPUs

    @property
    def blocks(self) -> int:
        return -(-self.tokens // self.block)


def _post_rows(
    parent: Any,
    name: str,
    shape: _PostShape,
    kinds: list[str],
    paths: list[str],
    iters: int,
    delay_us: int,
    rng: Any,
) -> list[dict[str, Any]]:
    """``post_cost``'s rows of one shape: a fresh pair of agents (D's in the child process
    behind ``parent``), every ids kind and path measured over it."""
    from kvpush_prod.transport.nixl import NixlTransport, make_agent

    regions, n, slot = shape.regions, shape.blocks, shape.slot
    num_blocks = 4 * n  # room for D's ids to scatter
    parent.send(("setup", name + "-d", regions, num_blocks, slot))
    meta, remote_base = parent.recv()
    buf, base = _buffer(regions * num_blocks * slot, 7, "cpu")
    transport = NixlTransport(
        make_agent(name + "-p", "UCX", True, delay_us),
        _post_layout(base, regions, num_blocks, slot),
        max_descriptors=10**9,
    )
    rows: list[dict[str, Any]] = []
    try:
        peer = transport.connect(meta, _post_layout(remote_base, regions, num_blocks, slot))
        for kind in kinds:
            lids, rids = list(range(n)), _post_ids(kind, n, num_blocks, rng)
            for path in paths:
                rows.append(
                    _post_cell(transport, peer, lids, rids, path, iters)
                    | {
                        "layers": shape.layers,
                        "regions": regions,
                        "block": shape.block,
                        "tokens": shape.tokens,
                        "blocks": n,
                        "kind": kind,
                        "path": path,
                    }
                )
    finally:
        transport.close()
        del buf
    return rows


def _post_cell(
    transport: Any, peer: Any, lids: list[int], rids: list[int], path: str, iters: int
) -> dict[str, Any]:
    builds, submits, posted = [], [], 0
    entries = runs = 0
    chosen = path
    for _ in range(iters):
        if path == "old":
            raw, build = _legacy_post(transport, peer, lids, rids)
            t1 = time.perf_counter()
            if transport.agent.transfer(raw) == "ERR":
                raise RuntimeError("NIXL refused the old path's post")
            submit = time.perf_counter() - t1
            _until_done(transport.agent.check_xfer_state, raw, "old path")
            posted = int(transport.agent.get_xfer_telemetry(raw).descCount)
            transport.agent.release_xfer_handle(raw)
            entries = len(lids) * len(transport.layout.regions)
        else:
            transport.path = path
            handle = transport.post("WRITE", peer, lids, rids)
            stats = transport.last_post
            _until_done(transport.state, handle, path)
            posted = int(transport.agent.get_xfer_telemetry(handle.handles[0]).descCount)
            transport.release(handle)
            build, submit = stats.build_s, stats.submit_s
            entries, runs, chosen = stats.entries, stats.runs, stats.path
        builds.append(build)
        submits.append(submit)
    b50, s50 = statistics.median(builds), statistics.median(submits)
    return {
        "entries": entries,
        "descriptors": posted,
        "runs": runs,
        "chosen": chosen,
        "build_us": b50 * 1e6,
        "submit_us": s50 * 1e6,
        "post_us": (b50 + s50) * 1e6,
        "iterations": iters,
    }


def _until_done(check: Any, handle: Any, what: str) -> None:
    """Poll a posted WRITE until it is DONE, sleeping between polls: only build and submit
    are timed, so its completion need not be seen at once."""
    while (state := str(check(handle))) == "PROC":
        time.sleep(50e-6)
    if state != "DONE":
        raise RuntimeError(f"{what} WRITE failed: {state}")


def fit_costs(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Least-squares build cost of each path over the cells that used it: fixed + per
    entry handed to NIXL + per descriptor NIXL posted (the constants
    ``transport.runs.choose_path`` uses). On the coalesced path entries are the posted
    descriptors: one per-descriptor figure."""
    import numpy as np

    out = {}
    for path in ("old", "prepped", "coalesced"):
        cells = [r for r in rows if r["path"] == path and r["chosen"] == path]
        cols = [[1.0, float(r["entries"]), float(r["descriptors"])] for r in cells]
        if path == "coalesced":
            cols = [[1.0, float(r["descriptors"])] for r in cells]
        if len(cells) < len(cols[0] if cols else [0, 0, 0]) + 1:
            continue
        y = np.asarray([r["build_us"] * 1e3 for r in cells])
        coef = np.linalg.lstsq(np.asarray(cols), y, rcond=None)[0].tolist()
        fit = {"fixed_ns": coef[0], "per_descriptor_ns": coef[-1]}
        if path != "coalesced":
            fit["per_entry_ns"] = coef[1]
        out[path] = fit
    return out


def post_cost_markdown(res: dict[str, Any], where: str) -> str:
    lines = [
        f"# Descriptors per transfer and post cost ({where})",
        "",
        f"One post per transfer (no chunking), {res['slot_bytes']}-byte slots, layers of two "
        "regions (K and V apart); P's block ids consecutive, D's as the kind says. entries: "
        "what NIXL was handed (indices or descriptors); posted: what NIXL posted after merging "
        "(its telemetry); build: ids to NIXL request; submit: NIXL's transfer() (on loopback "
        "it copies too).",
        "",
        "| layers | block | tokens | blocks | D ids | path | runs | entries | posted | "
        "build us | submit us | post us |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        path = r["path"] if r["path"] in ("old", r["chosen"]) else f"{r['path']}->{r['chosen']}"
        lines.append(
            f"| {r['layers']} | {r['block']} | {r['tokens']} | {r['blocks']} | {r['kind']} | "
            f"{path} | {r['runs'] or '-'} | {r['entries']} | {r['descriptors']} | "
            f"{r['build_us']:.0f} | {r['submit_us']:.0f} | {r['post_us']:.0f} |"
        )
    lines += [
        "",
        "Build cost fitted per path (fixed + per entry handed to NIXL + per "
        "descriptor NIXL posted):",
        "",
    ]
    for path, fit in res["fit"].items():
        per_entry = f" + {fit['per_entry_ns']:.1f} ns per entry" if "per_entry_ns" in fit else ""
        lines.append(
            f"- {path}: {fit['fixed_ns'] / 1e3:.1f} us{per_entry} + "
            f"{fit['per_descriptor_ns']:.1f} ns per posted descriptor"
        )
    return "\n".join(lines) + "\n"


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


def _post_cost_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--post-cost",
        action="store_true",
        help="measure descriptors per transfer and post cost (build + submit) instead",
    )
    ap.add_argument("--layers", default="32,80", help="--post-cost: model layers to try")
    ap.add_argument("--blocks", default="16,32", help="--post-cost: block sizes (tokens)")
    ap.add_argument("--tokens", default="1900,8192", help="--post-cost: prompt lengths")
    ap.add_argument(
        "--kinds",
        default=",".join(POST_KINDS),
        help="--post-cost: D's block ids: contiguous, runs8, fragmented",
    )
    ap.add_argument(
        "--paths",
        default=",".join(POST_PATHS),
        help="--post-cost: old (before runs), auto, prepped, coalesced",
    )
    ap.add_argument("--slot-bytes", type=int, default=256, help="--post-cost: bytes per slot")
    ap.add_argument("--iters", type=int, default=15, help="--post-cost: posts per cell")


def _csv(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def _run_post_cost(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from kvpush_prod.bench.machine import machine_facts

    for what, got, known in (
        ("--kinds", args.kinds, POST_KINDS),
        ("--paths", args.paths, POST_PATHS),
    ):
        if bad := [x for x in _csv(got) if x not in known]:
            ap.error(f"{what}: unknown {', '.join(bad)} (known: {', '.join(known)})")
    try:
        layers, blocks, tokens = (
            [int(x) for x in _csv(v)] for v in (args.layers, args.blocks, args.tokens)
        )
    except ValueError as exc:
        ap.error(f"--layers, --blocks and --tokens take comma lists of integers: {exc}")
    if (
        any(x < 1 for v in (layers, blocks, tokens) for x in v)
        or args.slot_bytes < 1
        or args.iters < 1
    ):
        ap.error("layers, block sizes, tokens, --slot-bytes and --iters must be >= 1")
    facts = machine_facts()
    where = f"{facts['cpu']}, {facts['simd']}, NIXL {facts['versions'].get('nixl', '?')}"
    res = post_cost(
        layers,
        blocks,
        tokens,
        _csv(args.kinds),
        _csv(args.paths),
        args.slot_bytes,
        args.iters,
        args.progress_delay_us,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "post_cost.json").write_text(json.dumps({"meta": facts, **res}, indent=1))
    md = post_cost_markdown(res, where)
    (args.out / "post_cost.md").write_text(md)
    print(md)
    return 0


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
    _post_cost_args(ap)
    args = ap.parse_args(argv)
    from kvpush_prod.bench.machine import machine_facts

    if args.post_cost:
        return _run_post_cost(ap, args)
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
