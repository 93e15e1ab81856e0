"""KV transfer times from kvpush's per-process event traces (``KVPUSH_TRACE_DIR``).

Per transfer: P ``blocks_ready`` (the prompt's last token is computed) -> D ``report`` (D
knows its KV arrived), and the narrower P ``post`` (first WRITE) -> P ``transfer_done``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_events(folder: Path) -> list[dict[str, Any]]:
    """Every event of every trace file under ``folder`` (order: by wall clock)."""
    events: list[dict[str, Any]] = []
    if not folder.is_dir():
        return events
    for path in sorted(folder.glob("*.jsonl")):
        role = "P" if "producer" in path.name else "D" if "consumer" in path.name else "?"
        for line in path.read_text(errors="replace").splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue  # a line cut by a killed process
            ev["role"] = role
            events.append(ev)
    events.sort(key=lambda e: e.get("t", 0.0))
    return events


def transfer_times(
    events: list[dict[str, Any]], since: float = 0.0, until: float = float("inf")
) -> dict[str, dict[str, float]]:
    """Per transfer id whose P ``blocks_ready`` lies in [since, until): the phases in seconds.

    Keys: ``kv_ready_to_d_knows`` (blocks_ready -> D report), ``ready_to_post``,
    ``post_to_done`` (first WRITE posted -> last WRITE completed on P), ``done_to_report``
    (D got DONE -> D reported it to vLLM).
    """
    first: dict[tuple[str, str], float] = {}
    for ev in events:
        tid = ev.get("tid") or ""
        if not tid:
            continue
        key = (f"{ev['role']}:{ev.get('e')}", tid)
        first.setdefault(key, float(ev["t"]))
    out: dict[str, dict[str, float]] = {}
    tids = {tid for (kind, tid) in first if kind == "P:blocks_ready"}
    for tid in tids:
        ready = first[("P:blocks_ready", tid)]
        if not since <= ready < until:
            continue
        row: dict[str, float] = {}
        report = first.get(("D:report", tid))
        post = first.get(("P:post", tid))
        done = first.get(("P:transfer_done", tid))
        done_in = first.get(("D:done_in", tid))
        if report is not None:
            row["kv_ready_to_d_knows"] = report - ready
        if post is not None:
            row["ready_to_post"] = post - ready
            if done is not None:
                row["post_to_done"] = done - post
        if done_in is not None and report is not None:
            row["done_to_report"] = report - done_in
        recv = first.get(("D:recv_spec", tid))
        if recv is not None:
            row["register_lead"] = ready - recv  # > 0: D registered before P was ready
        out[tid] = row
    return out
