"""Cluster presets for the simulator, and the CPU calibration from ``kvpush bench`` results.

Every number is an assumption stated here (docs/simulator.md says where each comes from);
change any of them from the command line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvpush_prod.sim.model import ClusterModel

# The post cost, both presets (ClusterModel.post_fixed_s, desc_s): building and posting one
# NIXL request costs 19 us + 0.94 us per descriptor it posts. Fitted (least squares on the
# relative error) to the 18 cells of one run of
#   kvpush bench transfer --post-cost --layers 8,32,80 --blocks 32 --tokens 512,1900 \
#       --kinds contiguous,runs8,fragmented --paths auto --iters 11
# (Intel Xeon AVX-512, NIXL 1.5.1, UCX loopback, 2026-12-02, 35 s): build + submit from 34 us
# (16 descriptors) to 19.1 ms (9,600). Per descriptor it grows with the post's size: ~0.75-1.3
# us up to 2,560 descriptors, 1.7-2 us at 3,776-9,600 (vLLM #35264 saw 2.4 us at 18,880 on
# GPUs). On loopback each descriptor is also a cross-process copy; on EFA the NIC copies, so
# P5en's per-descriptor cost may be lower: an assumption (docs/simulator.md).
# AWS P5en: 8 x H200 and 16 x 200 Gbps EFA per node (3.2 Tbps = 400 GB/s). Llama-3.1-70B,
# TP8 per engine, bf16: 80 layers x 2 (K, V) x 8 KV heads x 128 x 2 B = 320 KiB per token.
P5EN = ClusterModel(
    name="p5en",
    n_prefill=2,
    n_decode=1,
    # 400 GB/s of NICs at ~60% for KV-block-sized descriptors over EFA (Mooncake measured
    # 26% of line rate at 64 KB and ~91% at >= 1 MB slices).
    nic_bandwidth=0.6 * 400e9,
    one_way_s=15e-6,  # EFA SRD, same placement group
    ctrl_s=100e-6,  # a ZMQ/TCP message or NIXL notification between nodes
    http_s=500e-6,  # one leg through a Python proxy, each way
    # 2 x 70e9 FLOP per token over 8 x ~990 TFLOPS at ~50% MFU: ~35 us per prompt token.
    prefill_s_per_token=35e-6,
    prefill_step_s=5e-3,
    max_batched_tokens=16384,
    decode_step_s=12e-3,  # 70B TP8 decode step on H200s, small batch
    decode_s_per_seq=0.06e-3,
    kv_bytes_per_token=320 * 1024,  # the whole model's, over the 8 ranks
    block_tokens=16,
    # TP8: each GPU is a rank with its own NIXL agent, pump and 2 EFA NICs (1/8 of the node's
    # bandwidth), moving its KV head's 1/8 of every block: 640 KiB per block at block 16, so
    # a 4 MiB chunk is 6 blocks (configs/efa-p5en.yaml). One rank is simulated (model.py).
    tp=8,
    kv_regions=160,  # 80 layers x (K, V) per rank
    layers=80,
    decode_kv_blocks=8 * 100 * 1024**3 // (320 * 1024 * 16),  # ~100 GiB of KV per node
    # Connector software costs: CPU-side Python in the engine process; the AVX-512 CPU box
    # measured ~3 ms of vLLM transfer time for 512 KiB whose raw WRITE takes ~40 us.
    vllm_xfer_overhead_s=2e-3,
    pull_coord_s=3e-3,  # D's engine thread: handshake check, descriptor prep, READ post
    push_reg_coord_s=0.5e-3,
    push_post_coord_s=1e-3,
    kvpush_chunk_overhead_s=20e-6,
    kvpush_pump_s=50e-6,
    # kvpush's own settings: the shipped profile for this cluster (4 MiB chunks, 2 ms of data
    # in flight per link, at most 32 chunks, 10 s permits, 1 s stop margin, LIBFABRIC).
    profile="efa-p5en",
    notes="AWS P5en, 16 x 200 Gbps EFA per node, H200-class compute, Llama-3.1-70B TP8, 2 P nodes : 1 D node",
)

# The development box: tiny Llama (2 layers, 2 KV heads x 32, float32: 1 KiB per token),
# one core per engine, NIXL/UCX loopback. Defaults from the AVX2 box; calibrate() refits.
CPU_LOOPBACK = ClusterModel(
    name="cpu-loopback",
    nic_bandwidth=4e9,
    one_way_s=3e-6,
    ctrl_s=150e-6,
    http_s=1e-3,
    prefill_s_per_token=100e-6,
    prefill_step_s=3e-3,
    max_batched_tokens=8192,
    decode_step_s=6e-3,
    decode_s_per_seq=0.5e-3,
    kv_bytes_per_token=1024,
    block_tokens=128,
    kv_regions=4,  # 2 layers x (K, V)
    layers=2,
    decode_kv_blocks=2 * 1024**3 // (1024 * 128),
    vllm_xfer_overhead_s=3e-3,
    pull_coord_s=3e-3,
    push_reg_coord_s=0.5e-3,
    push_post_coord_s=1e-3,
    kvpush_chunk_overhead_s=50e-6,
    kvpush_pump_s=0.5e-3,
    profile="cpu-loopback",  # what kvpush bench's engines run on
    notes="2-core CPU box, tiny model, float32, UCX loopback",
)

PRESETS = {"p5en": P5EN, "cpu-loopback": CPU_LOOPBACK}

# bench side -> sim mode (baselines with the spin neutralised: the sim has no spinning thread)
SIDE_OF_MODE = {"pull": "vllm-pull", "push": "vllm-push", "kvpush": "kvpush"}


def _p50(cell: dict[str, Any] | None, metric: str) -> float | None:
    if not cell:
        return None
    v = (cell.get(metric) or {}).get("p50")
    return None if v is None else v / 1000.0


def calibrate(
    results: dict[str, Any], base: ClusterModel = CPU_LOOPBACK
) -> tuple[ClusterModel, dict[str, Any]]:
    """Fit the compute and transfer costs of ``base`` to a bench run; returns the model and
    what was fitted from which measurement. Only single-engine cells and the connectors'
    own transfer timings are used: P/D TTFTs are left for the prediction to match."""
    cells: dict[str, Any] = results.get("cells", {})
    single: dict[str, Any] = cells.get("single", {})
    fitted: dict[str, Any] = {}
    m = _fit_prefill(base, single, fitted)
    m = _fit_decode(m, single, fitted)
    m = _fit_vllm_transfer(m, cells, fitted)
    m = _fit_kvpush(m, cells.get("kvpush", {}), fitted)
    return m.with_(name="cpu-calibrated"), fitted


def _fit_prefill(m: ClusterModel, single: dict[str, Any], fitted: dict[str, Any]) -> ClusterModel:
    """Prefill cost per token (and per token squared) from single-engine TTFT at c=1."""
    pts = sorted(
        (c["length"], t)
        for c in single.values()
        if c["concurrency"] == 1 and (t := _p50(c, "ttft_ms")) is not None
    )
    overhead = 2 * m.http_s + m.decode_step_s  # the single engine's TTFT beyond the prefill
    if len(pts) >= 3:
        # TTFT = c0 + a L + b L^2 (attention grows with L^2): least squares.
        import numpy as np

        xs = np.array([p[0] for p in pts], dtype=float)
        ys = np.array([p[1] for p in pts], dtype=float)
        b, a, c0 = (float(v) for v in np.polyfit(xs, ys, 2))
        fitted["prefill"] = "quadratic fit of single-engine TTFT p50 at c=1: " + ", ".join(
            f"{n} tok {t * 1e3:.1f} ms" for n, t in pts
        )
        return m.with_(
            prefill_s_per_token=max(1e-7, a),
            prefill_s_per_token2=max(0.0, b),
            prefill_step_s=max(0.0, c0 - overhead),
        )
    if len(pts) == 2:
        (x0, y0), (x1, y1) = pts
        slope = (y1 - y0) / (x1 - x0)
        fitted["prefill"] = f"line through single-engine TTFT p50 at c=1: {pts}"
        return m.with_(
            prefill_s_per_token=max(1e-7, slope),
            prefill_step_s=max(0.0, y0 - slope * x0 - overhead),
        )
    if pts:
        length, t = pts[0]
        per = max(1e-6, (t - overhead - m.prefill_step_s) / length)
        fitted["prefill"] = f"single-engine TTFT p50 {t * 1e3:.1f} ms at {length} tokens, c=1"
        return m.with_(prefill_s_per_token=per)
    return m


def _fit_decode(m: ClusterModel, single: dict[str, Any], fitted: dict[str, Any]) -> ClusterModel:
    """Decode step cost, and its growth per running sequence, from single-engine TPOT."""
    tpots = {
        c["concurrency"]: t
        for c in single.values()
        if (t := _p50(c, "tpot_ms")) is not None and c["length"] == 1024
    } or {c["concurrency"]: t for c in single.values() if (t := _p50(c, "tpot_ms")) is not None}
    if 1 not in tpots:
        return m
    m = m.with_(decode_step_s=tpots[1])
    fitted["decode_step_s"] = f"single-engine TPOT p50 at c=1: {tpots[1] * 1e3:.2f} ms"
    higher = [c for c in tpots if c > 1]
    if higher:
        c = min(higher)
        m = m.with_(decode_s_per_seq=max(0.0, (tpots[c] - tpots[1]) / (c - 1)))
        fitted["decode_s_per_seq"] = f"single-engine TPOT slope c=1 -> c={c}"
    return m


def _fit_vllm_transfer(
    m: ClusterModel, cells: dict[str, Any], fitted: dict[str, Any]
) -> ClusterModel:
    """vLLM's per-transfer overhead beyond bytes / bandwidth, from its own NIXL timing."""
    for side in ("vllm-pull", "vllm-push"):
        for c in cells.get(side, {}).values():
            if c["concurrency"] != 1:
                continue
            t = c.get("transfer") or {}
            h = t.get("nixl_xfer_time_seconds_decode") or t.get("nixl_xfer_time_seconds_prefill")
            if h and h.get("p50_s") is not None:
                raw = m.rank_kv_bytes(c["length"]) / m.rank_bandwidth
                fitted["vllm_xfer_overhead_s"] = (
                    f"{side} vllm:nixl_xfer_time p50 {h['p50_s'] * 1e3:.2f} ms at {c['length']} tok"
                )
                return m.with_(vllm_xfer_overhead_s=max(0.0, h["p50_s"] - raw))
    return m


def _fit_kvpush(m: ClusterModel, kvpush: dict[str, Any], fitted: dict[str, Any]) -> ClusterModel:
    """Our pump's reaction time and per-chunk overhead, from a trace of a kvpush run."""
    for c in kvpush.values():
        t = c.get("transfer") or {}
        if c["concurrency"] != 1 or "ready_to_post_ms" not in t:
            continue
        m = m.with_(kvpush_pump_s=t["ready_to_post_ms"]["p50"] / 1000.0)
        fitted["kvpush_pump_s"] = (
            f"trace blocks_ready -> post p50 {t['ready_to_post_ms']['p50']:.2f} ms"
        )
        if "post_to_done_ms" in t:
            m = m.with_(
                kvpush_chunk_overhead_s=max(
                    0.0,
                    t["post_to_done_ms"]["p50"] / 1000.0
                    - m.rank_kv_bytes(c["length"]) / m.rank_bandwidth,
                )
            )
            fitted["kvpush_chunk_overhead_s"] = (
                f"trace post -> transfer_done p50 {t['post_to_done_ms']['p50']:.2f} ms"
            )
        return m
    return m


def load_results(path: str | Path) -> dict[str, Any]:
    results: dict[str, Any] = json.loads(Path(path).read_text())
    return results
