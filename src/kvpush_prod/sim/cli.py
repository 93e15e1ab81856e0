"""``kvpush sim``: compare pull, plain push and kvpush on a simulated cluster (P5en preset by
default), or predict a CPU bench run from its own calibration (``--calibrate results.json``).
kvpush runs on the settings of a kvpush profile (the preset's, or ``--profile``)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvpush_prod.errors import ConfigError
from kvpush_prod.sim.model import D_POLICIES, MODES, ClusterModel, Workload, simulate
from kvpush_prod.sim.presets import PRESETS, SIDE_OF_MODE, calibrate, load_results
from kvpush_prod.sim.scaling import layerwise_table


def scenarios(
    m: ClusterModel, requests: int, lengths: tuple[int, ...], output: int, concurrency: list[int]
) -> list[tuple[str, Workload]]:
    """Closed-loop concurrency sweep, steady Poisson load at ~70% of prefill capacity, and
    the same load with bursts."""
    mean_len = sum(lengths) / len(lengths)
    p_rate = m.n_prefill / (m.prefill_step_s + mean_len * m.prefill_s_per_token)
    out = [
        (
            f"closed c={c}",
            Workload(
                requests=max(requests, 4 * c),
                lengths=lengths,
                output_tokens=output,
                kind="closed",
                concurrency=c,
            ),
        )
        for c in concurrency
    ]
    out.append(
        (
            f"steady {0.7 * p_rate:.1f} req/s",
            Workload(
                requests=requests * 2,
                lengths=lengths,
                output_tokens=output,
                kind="poisson",
                rate=0.7 * p_rate,
            ),
        )
    )
    burst = max(8, 4 * m.n_prefill)
    out.append(
        (
            f"bursts of {burst} every 2 s + {0.4 * p_rate:.1f} req/s",
            Workload(
                requests=requests * 2,
                lengths=lengths,
                output_tokens=output,
                kind="poisson",
                rate=0.4 * p_rate,
                burst=burst,
                burst_every_s=2.0,
            ),
        )
    )
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def compare(
    m: ClusterModel, work: list[tuple[str, Workload]], modes: list[str]
) -> tuple[str, list[dict[str, Any]]]:
    rows = []
    lines = [
        "| scenario | mode | TTFT p50 | TTFT p99 | TPOT p50 | KV transfer p50 | P queue p50 "
        "| pull/mode TTFT p50 | pull/mode TTFT p99 | pull/mode TPOT p50 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, w in work:
        res = {mode: simulate(m, mode, w) for mode in modes}
        pull = res.get("pull")
        for mode, r in res.items():

            def rat(
                metric: str, q: str, r: dict[str, Any] = r, pull: dict[str, Any] | None = pull
            ) -> str:
                if pull is None:
                    return "-"
                a, b = pull[metric][q], r[metric][q]
                return "-" if not a or not b else f"{a / b:.2f}x"

            lines.append(
                f"| {name} | {mode} | {_ms(r['ttft_ms']['p50'])} | "
                f"{_ms(r['ttft_ms']['p99'])} | {_ms(r['tpot_ms']['p50'])} | "
                f"{_ms(r['kv_transfer_ms']['p50'])} | {_ms(r['queue_p_ms']['p50'])} | "
                f"{rat('ttft_ms', 'p50')} | {rat('ttft_ms', 'p99')} | "
                f"{rat('tpot_ms', 'p50')} |"
            )
            rows.append({"scenario": name, "mode": mode, **r})
    return "\n".join(lines), rows


def predict(
    results: dict[str, Any], m: ClusterModel, modes: list[str]
) -> tuple[str, list[dict[str, Any]]]:
    """The simulator's TTFT/TPOT p50 for every measured cell, beside the measurement."""
    w0 = results.get("meta", {}).get("workload", {})
    lines = [
        "| prompt | conc | side | TTFT p50 measured | simulated | sim/meas | "
        "TPOT p50 measured | simulated | sim/meas |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for mode in modes:
        side = SIDE_OF_MODE[mode]
        for key, cell in sorted(
            results.get("cells", {}).get(side, {}).items(),
            key=lambda kv: (kv[1]["length"], kv[1]["concurrency"]),
        ):
            if not cell.get("ok"):
                continue
            w = Workload(
                requests=cell["requests"],
                lengths=(cell["length"],),
                output_tokens=w0.get("max_tokens", 64),
                kind="closed",
                concurrency=cell["concurrency"],
            )
            r = simulate(m, mode, w)
            mt, st = cell["ttft_ms"]["p50"], r["ttft_ms"]["p50"]
            mp, sp = cell["tpot_ms"]["p50"], r["tpot_ms"]["p50"]
            lines.append(
                f"| {cell['length']} | {cell['concurrency']} | {side} | {_ms(mt)} | "
                f"{_ms(st)} | {st / mt:.2f} | {_ms(mp)} | {_ms(sp)} | "
                f"{(sp / mp) if mp and sp else float('nan'):.2f} |"
            )
            rows.append(
                {
                    "side": side,
                    "key": key,
                    "measured_ttft_p50": mt,
                    "sim_ttft_p50": st,
                    "measured_tpot_p50": mp,
                    "sim_tpot_p50": sp,
                }
            )
    return "\n".join(lines), rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpush sim", description=__doc__)
    p.add_argument("--preset", choices=sorted(PRESETS), default="p5en")
    p.add_argument(
        "--profile",
        help="kvpush profile the kvpush mode runs on (a shipped "
        "profile's name or a path; default: the preset's, e.g. efa-p5en)",
    )
    p.add_argument("--modes", default=",".join(MODES), help="comma list of pull,push,kvpush")
    p.add_argument("--prefill", type=int, help="prefill engines (N)")
    p.add_argument("--decode", type=int, help="decode engines (M)")
    p.add_argument("--bandwidth-gbps", type=float, help="per prefill node NIC, Gbit/s")
    p.add_argument(
        "--decode-links",
        metavar="GBPS,...",
        help="per decode node, the path into it in Gbit/s after P's NIC (0: no limit), "
        "e.g. 0,0.2 for a second D behind a 200 Mbit/s link",
    )
    p.add_argument(
        "--d-policy",
        choices=D_POLICIES,
        help="how the router picks D: least_loaded (default), round_robin or link_aware "
        "(the router's policy, learning each pair's time to D's first token)",
    )
    p.add_argument("--rtt-us", type=float, help="data-path round trip, us")
    p.add_argument("--ctrl-us", type=float, help="one control message, us")
    p.add_argument("--http-us", type=float, help="one router leg each way, us")
    p.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel ranks per engine: each moves 1/tp of every block on 1/tp of "
        "the NIC with its own pump (one rank is simulated)",
    )
    p.add_argument("--prefill-us-per-token", type=float)
    p.add_argument("--decode-step-ms", type=float)
    _layerwise_args(p)
    p.add_argument("--lengths", default="1024,2048,4096", help="prompt lengths, mixed")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument(
        "--calibrate",
        type=Path,
        metavar="RESULTS_JSON",
        help="fit the cpu-loopback preset to a kvpush bench run and print the "
        "simulator's prediction beside each measured cell",
    )
    p.add_argument("--json", type=Path, help="also write the numbers here")
    return p


def _layerwise_args(p: argparse.ArgumentParser) -> None:
    """Layer-wise push, D's fragmentation and the model's depth."""
    p.add_argument(
        "--layerwise",
        choices=["off", "on", "auto"],
        help="kvpush's push.layerwise (default: the profile's): on posts each layer's KV "
        "as the forward computes it",
    )
    p.add_argument(
        "--fragment",
        type=float,
        metavar="P",
        help="D's cache fragmentation: probability that the next free block is not adjacent "
        "to the one before (0: fresh, 1: every block its own descriptor)",
    )
    p.add_argument(
        "--layers",
        type=int,
        help="model layers (sets kv_regions to 2 x N, K and V apart; KV per token stays "
        "--set kv_bytes_per_token)",
    )
    p.add_argument(
        "--layerwise-table",
        action="store_true",
        help="TTFT p50 / p90 per prompt length (--lengths, one at a time) and concurrency: "
        "vLLM push and kvpush with push.layerwise off / on / auto, D's cache fresh and "
        "fragmented (--fragment, default 1)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override any ClusterModel field (repeatable), e.g. --set pull_coord_s=0, or "
        "a key of the kvpush profile, e.g. --set credits.budget_fraction=0.1",
    )


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    modes = [x for x in a.modes.split(",") if x]
    if a.calibrate:
        results = load_results(a.calibrate)
        m, fitted = calibrate(results)
        m = _overrides(m, a)
        table, rows = predict(results, m, modes)
        print(f"# Simulator vs measurement ({results.get('meta', {}).get('cpu')})\n")
        print("Fitted: " + "; ".join(f"{k}: {v}" for k, v in fitted.items()) + "\n")
        print(table)
        if a.json:
            a.json.write_text(
                json.dumps({"model": asdict(m), "fitted": fitted, "rows": rows}, indent=1)
            )
        return 0
    m = _overrides(PRESETS[a.preset], a)
    lengths = tuple(int(x) for x in a.lengths.split(","))
    conc = [int(x) for x in a.concurrency.split(",") if x]
    if a.layerwise_table:
        return _layerwise_table(m, a, list(lengths), conc)
    work = scenarios(m, a.requests, lengths, a.output_tokens, conc)
    table, rows = compare(m, work, modes)
    print(f"# kvpush sim: {m.name} — {m.notes}\n")
    print(
        f"{m.n_prefill} prefill x {m.n_decode} decode, NIC {m.nic_bandwidth * 8 / 1e9:.0f} "
        f"Gbit/s effective, RTT {2 * m.one_way_s * 1e6:.0f} us, prompts {lengths}, "
        f"{a.output_tokens} output tokens\n"
    )
    print(ranks(m) + "\n")
    print(kvpush_settings(m) + "\n")
    print(table)
    if a.json:
        a.json.write_text(json.dumps({"model": asdict(m), "rows": rows}, indent=1))
    return 0


def _layerwise_table(
    m: ClusterModel, a: argparse.Namespace, lengths: list[int], conc: list[int]
) -> int:
    fragment = 1.0 if a.fragment is None else a.fragment
    print(f"# kvpush sim --layerwise-table: {m.name}: {m.notes}\n")
    print(
        f"{m.layers} layers, {m.kv_regions} regions, {m.kv_bytes_per_token / 1024:g} KiB of KV "
        f"per token, block {m.block_tokens}; post {m.post_fixed_s * 1e6:g} us + "
        f"{m.desc_s * 1e6:g} us per descriptor; fragmented: {fragment:g}; "
        f"{a.output_tokens} output tokens\n"
    )
    print(ranks(m) + "\n")
    print(kvpush_settings(m) + "\n")
    table, rows = layerwise_table(
        m,
        lengths,
        conc,
        a.requests,
        a.output_tokens,
        fragment,
        lambda line: print(f"  ... {line}", file=sys.stderr, flush=True),
    )
    print("TTFT p50 / p90 (ms):\n")
    print(table)
    if a.json:
        a.json.write_text(json.dumps({"model": asdict(m), "rows": rows}, indent=1))
    print(f"\nverdict: {len(rows)} cells simulated", file=sys.stderr)
    return 0


def ranks(m: ClusterModel) -> str:
    """One line: what each tensor-parallel rank moves, on what share of the NIC."""
    return (
        f"TP {m.tp}: each rank moves {m.rank_block_bytes / 1024:g} KiB per block of "
        f"{m.block_tokens} tokens over {m.rank_bandwidth * 8 / 1e9:g} Gbit/s with its own pump "
        f"(one rank simulated; the {m.tp} are alike)"
    )


def kvpush_settings(m: ClusterModel) -> str:
    """One line: the profile kvpush runs on and the settings of it that shape a transfer."""
    core, credits = m.core()
    sched, rx = core.sender.scheduler, core.receiver
    sets = f" + {', '.join(m.overrides)}" if m.overrides else ""
    return (
        f"kvpush: profile {m.profile}{sets}: chunks of {sched.chunk_bytes / 2**20:g} MiB, "
        f"{sched.target_latency_s * 1e3:g} ms of data in flight per link (at most "
        f"{sched.max_inflight_chunks} chunks), permit {rx.permit_ttl_s:g} s, stop margin "
        f"{rx.stop_margin_s:g} s, credit budget {credits.budget_blocks} of "
        f"{m.decode_kv_blocks} blocks"
    )


def _overrides(m: ClusterModel, a: argparse.Namespace) -> ClusterModel:
    kw: dict[str, Any] = {}
    if a.profile:
        kw["profile"] = a.profile
    if a.prefill:
        kw["n_prefill"] = a.prefill
    if a.decode:
        kw["n_decode"] = a.decode
    if a.bandwidth_gbps:
        kw["nic_bandwidth"] = a.bandwidth_gbps * 1e9 / 8
    if a.rtt_us is not None:
        kw["one_way_s"] = a.rtt_us / 2e6
    if a.ctrl_us is not None:
        kw["ctrl_s"] = a.ctrl_us / 1e6
    if a.http_us is not None:
        kw["http_s"] = a.http_us / 1e6
    if a.prefill_us_per_token:
        kw["prefill_s_per_token"] = a.prefill_us_per_token / 1e6
    if a.decode_step_ms:
        kw["decode_step_s"] = a.decode_step_ms / 1000
    if a.tp is not None:
        kw["tp"] = a.tp
    if a.decode_links:
        kw["decode_link_bandwidth"] = _gbps_list(a.decode_links)
    if a.d_policy:
        kw["d_policy"] = a.d_policy
    if a.fragment is not None:
        kw["fragment"] = a.fragment
    if a.layers is not None:
        kw["layers"], kw["kv_regions"] = a.layers, 2 * a.layers
    fields = ClusterModel.__dataclass_fields__
    numeric = [k for k in fields if isinstance(getattr(m, k), int | float)]
    overrides = list(m.overrides)
    for item in a.set:
        key, sep, value = item.partition("=")
        if sep and "." in key:
            overrides.append(item)  # a key of the kvpush profile: checked below
            continue
        if not sep or key not in numeric:
            raise SystemExit(
                f"kvpush sim: --set {item!r}: use FIELD=VALUE with a numeric field of "
                f"ClusterModel ({', '.join(numeric)}), or SECTION.KEY=VALUE with a key of the "
                "kvpush profile (docs/configuration.md)"
            )
        kw[key] = int(value) if isinstance(getattr(m, key), int) else float(value)
    if a.layerwise:
        overrides.append(f"push.layerwise={a.layerwise}")
    if overrides != list(m.overrides):
        kw["overrides"] = tuple(overrides)
    out = m.with_(**kw) if kw else m
    _check(out)
    return out


def _gbps_list(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(x) * 1e9 / 8 for x in text.split(","))
    except ValueError:
        rates = (-1.0,)
    if any(r < 0 for r in rates):
        raise SystemExit(
            f"kvpush sim: --decode-links {text!r}: give Gbit/s per decode node, comma "
            "separated, each >= 0 (0: no limit), e.g. 0,0.2"
        )
    return rates


def _check(m: ClusterModel) -> None:
    """A model the simulator can run, or SystemExit naming the value and the fix."""
    if not 0.0 <= m.fragment <= 1.0:
        raise SystemExit(
            f"kvpush sim: --fragment {m.fragment:g}: give a probability from 0 (a fresh cache) "
            "to 1 (every block apart)"
        )
    if m.tp < 1 or m.rank_block_bytes < 1:
        raise SystemExit(
            f"kvpush sim: tp {m.tp}: give --tp N with 1 <= N <= the bytes of a KV block "
            f"({m.kv_bytes_per_token * m.block_tokens:g}); N is the tensor-parallel size "
            "of every engine"
        )
    if len(m.decode_link_bandwidth) > m.n_decode:
        raise SystemExit(
            f"kvpush sim: --decode-links names {len(m.decode_link_bandwidth)} decode nodes, "
            f"the cluster has {m.n_decode}: give at most one rate per decode node (--decode N)"
        )
    if m.d_policy not in D_POLICIES:
        raise SystemExit(f"kvpush sim: d_policy {m.d_policy!r}: use one of {', '.join(D_POLICIES)}")
    if m.layers < 1 or m.kv_regions % m.layers:
        raise SystemExit(
            f"kvpush sim: {m.layers} layers over {m.kv_regions} KV regions: give --layers N "
            "(>= 1; kv_regions becomes 2 x N) or kv_regions a multiple of layers"
        )
    try:
        m.config()
    except ConfigError as exc:
        raise SystemExit(f"kvpush sim: {exc}") from None
