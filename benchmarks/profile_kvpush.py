"""Where a kvpush request's TTFT goes: client, router, P, transfer, D, from one timeline.

Starts the kvpush side (P on core 0, D on core 1, router), sends sequential requests with
event traces on, and lines up per request (wall clocks, one machine):
client send -> P blocks_ready (router hop + P prefill) -> P post -> D done_in -> D report
-> D step takes it (``taken``) -> client first token.

    PYTHONPATH=src python benchmarks/profile_kvpush.py [--requests 12] [--length 1024]
        [--concurrency 4 --max-tokens 64]   # the bench's c=4 cell
        [--model-shape layers=32,hidden=64,heads=2,kv_heads=2,head_dim=32 --block-size 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from kvpush_prod.bench.cli import _shape  # noqa: E402
from kvpush_prod.bench.runner import prompts_for  # noqa: E402
from kvpush_prod.bench.sides import SIDES, RunningSide, SideSettings  # noqa: E402
from kvpush_prod.bench.traces import read_events  # noqa: E402


async def _send(
    url: str, prompts: list[str], concurrency: int = 1, max_tokens: int = 8
) -> list[tuple[float, float, str]]:
    """Closed loop: ``concurrency`` clients, each sending its next prompt when its last
    one's tokens are in (alone, a 0.2 s pause between requests)."""
    import httpx

    out: list[tuple[float, float, str]] = []
    queue = list(reversed(prompts))
    async with httpx.AsyncClient(trust_env=False, timeout=120) as client:
        await asyncio.gather(
            *(
                _client(client, url, queue, out, concurrency == 1, max_tokens)
                for _ in range(concurrency)
            )
        )
    return out


async def _client(
    client: Any,
    url: str,
    queue: list[str],
    out: list[tuple[float, float, str]],
    pause: bool,
    max_tokens: int,
) -> None:
    while queue:
        prompt = queue.pop()
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        t0 = time.time()
        first = None
        rid = ""
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            rid = r.headers.get("x-request-id", "")
            async for line in r.aiter_lines():
                if line.startswith("data:") and first is None and '"text"' in line:
                    first = time.time()
        out.append((t0, first or t0, rid))
        if pause:
            await asyncio.sleep(0.2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="clients at once (closed loop; 1: sequential, 0.2 s apart)",
    )
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--block-size", type=int, default=None, help="KV block size")
    ap.add_argument(
        "--model-shape", type=_shape, default=None, help="as kvpush bench's (KEY=N,...)"
    )
    a = ap.parse_args()
    work = a.workdir or Path(tempfile.mkdtemp(prefix="kvpush-profile-"))
    settings = SideSettings(
        workdir=work.resolve(), block_size=a.block_size, model_shape=dict(a.model_shape or {})
    )
    side = RunningSide(SIDES["kvpush"], settings)
    side.start()
    try:
        asyncio.run(_send(side.entry, prompts_for(a.length, 1, 3, salt=7)))  # warm-up
        since = time.time()
        sent = asyncio.run(
            _send(
                side.entry,
                prompts_for(a.length, 1, a.requests, salt=8),
                a.concurrency,
                a.max_tokens,
            )
        )
        time.sleep(0.5)
    finally:
        side.stop()
    events = [e for e in read_events(side.trace_dir) if e["t"] >= since]
    first: dict[tuple[str, str, str], float] = {}
    taken: list[tuple[float, str]] = []  # (when, request ids vLLM took)
    for e in events:
        if e["e"] == "taken" and e["role"] == "D" and e.get("recving"):
            taken.append((e["t"], " ".join(e["recving"])))
        if e.get("tid"):
            first.setdefault((e["role"], e["e"], e["tid"]), e["t"])
    phases: dict[str, list[float]] = {}
    for t0, t_first, tid in sent:

        def at(role: str, ev: str, tid: str = tid) -> float | None:
            return first.get((role, ev, tid))

        ready, post, done_in, report = (
            at("P", "blocks_ready"),
            at("P", "post"),
            at("D", "done_in"),
            at("D", "report"),
        )
        if None in (ready, post, done_in, report):
            continue
        took = next((t for t, ids in taken if t >= report and tid in ids), None)
        steps = {
            "client -> P blocks_ready (router, P queue, prefill)": ready - t0,
            "P blocks_ready -> first WRITE posted (pump hand-off)": post - ready,
            "first WRITE posted -> D got DONE": done_in - post,
            "D got DONE -> D reported finished_recving": report - done_in,
            "D reported -> vLLM step took it (get_finished)": (took - report) if took else None,
            "vLLM took it -> client got the first token": (t_first - took) if took else None,
            "TTFT": t_first - t0,
        }
        for k, v in steps.items():
            if v is not None:
                phases.setdefault(k, []).append(v * 1000)
    print(f"{len(sent)} requests of {a.length} tokens, c={a.concurrency}; p50 / min / max in ms")
    for k, v in phases.items():
        print(f"  {k:58s} {statistics.median(v):8.2f} {min(v):8.2f} {max(v):8.2f}")
    print(json.dumps({k: statistics.median(v) for k, v in phases.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
