"""``kvpush sim --layerwise-table``: TTFT by prompt length with layer-wise push off and on, on
a fresh and a fragmented decode cache, beside vLLM's push (docs/simulator.md)."""

from __future__ import annotations

from typing import Any

from kvpush_prod.sim.model import ClusterModel, Workload, simulate

# (column, mode, push.layerwise, D's cache fragmented)
COLUMNS: tuple[tuple[str, str, str, bool], ...] = (
    ("vLLM push, fresh", "push", "off", False),
    ("vLLM push, fragmented", "push", "off", True),
    ("kvpush off, fresh", "kvpush", "off", False),
    ("kvpush off, fragmented", "kvpush", "off", True),
    ("kvpush on, fresh", "kvpush", "on", False),
    ("kvpush on, fragmented", "kvpush", "on", True),
    ("kvpush auto, fresh", "kvpush", "auto", False),
)


def variant(m: ClusterModel, layerwise: str, fragmented: bool, fragment: float) -> ClusterModel:
    """``m`` with ``push.layerwise`` set (the last word on it) and D's cache fresh (0) or
    at ``fragment``."""
    kept = tuple(o for o in m.overrides if not o.startswith("push.layerwise="))
    return m.with_(
        overrides=(*kept, f"push.layerwise={layerwise}"),
        fragment=fragment if fragmented else 0.0,
    )


def layerwise_table(
    m: ClusterModel,
    lengths: list[int],
    concurrency: list[int],
    requests: int,
    output: int,
    fragment: float = 1.0,
    progress: Any = None,
) -> tuple[str, list[dict[str, Any]]]:
    """One row per prompt length and concurrency: TTFT p50 / p90 (ms) of each column, and
    the descriptors each column posts per transfer."""
    head = "| prompt | conc | " + " | ".join(c[0] for c in COLUMNS) + " |"
    lines = [head, "|---|---|" + "---|" * len(COLUMNS)]
    descs = ["| prompt | " + " | ".join(c[0] for c in COLUMNS) + " |"]
    descs.append("|---|" + "---|" * len(COLUMNS))
    rows: list[dict[str, Any]] = []
    for length in lengths:
        per_transfer: list[str] = []
        for conc in concurrency:
            w = Workload(
                requests=max(requests, 4 * conc),
                lengths=(length,),
                output_tokens=output,
                kind="closed",
                concurrency=conc,
            )
            cells = []
            for name, mode, layerwise, fragmented in COLUMNS:
                r = simulate(variant(m, layerwise, fragmented, fragment), mode, w)
                t = r["ttft_ms"]
                cells.append(f"{t['p50']:.1f} / {t['p90']:.1f}")
                n = r["counters"].get("descriptors", 0) / max(1, r["ok"])
                if conc == concurrency[0]:
                    per_transfer.append(f"{n:,.0f}")
                rows.append({"length": length, "concurrency": conc, "column": name, **r})
                if progress is not None:
                    progress(f"{length} tokens, c={conc}, {name}: TTFT p50 {t['p50']:.1f} ms")
            lines.append(f"| {length} | {conc} | " + " | ".join(cells) + " |")
        descs.append(f"| {length} | " + " | ".join(per_transfer) + " |")
    table = "\n".join(lines)
    table += "\n\nDescriptors posted per transfer:\n\n" + "\n".join(descs)
    return table, rows
