"""Transfer or recompute: where P/D's TTFT crosses a single engine's, on real engines.

``python benchmarks/direct_threshold.py [--lengths 16,32,...] [--requests 40]`` starts the
lab's P/D pair with its router (every request takes both legs: ``direct_below_tokens`` 0),
a second router that sends every request to D alone (D computes the prompt, as a single
engine would), and the lab's single reference engine; then, for each prompt length, sends
``--requests`` streamed requests to each of four sides in turn (the single engine, D's own
port without kv_transfer_params, the direct router, the P/D router; sequential unless
``--concurrency``), each with a prompt of its own (no prefix-cache hit), and reports TTFT
p50/p90 per side, the ratios, and the lengths where P/D stops costing more. The router's
``direct_below_tokens`` default is set from this (docs/router.md, "Short prompts: straight
to D"). Run it under ``flock /tmp/kvpush-engines.lock`` where others start engines too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import httpx  # noqa: E402

from kvpush_prod.lab.client import completion_body  # noqa: E402
from kvpush_prod.lab.cluster import Cluster, ClusterSpec  # noqa: E402
from kvpush_prod.lab.launch import Proc, free_port, router_command, wait_healthy  # noqa: E402
from kvpush_prod.lab.tinymodel import TinyModelSpec, prompt_of_length  # noqa: E402

# single: the reference engine, no router; decode: D's own port, no router, no
# kv_transfer_params (D as a single engine: what the router's hop adds shows against
# "direct"); direct: through a router that sends every request to D alone; pd: through the
# cluster's router with both legs (a transfer every request).
SIDES = ("single", "decode", "direct", "pd")
# Far above any prompt here: the second router sends everything to D alone.
ALL_DIRECT = str(1 << 20)


def start_direct_router(cluster: Cluster) -> tuple[Proc, str]:
    """A router in front of the cluster's engines that sends every request to D alone."""
    port = free_port()
    cmd = router_command(port) + [
        "--prefill",
        cluster.urls["prefill"],
        "--decode",
        cluster.urls["decode"],
        "--direct-below-tokens",
        ALL_DIRECT,
        "--params-key-file",
        str(cluster.params_key_file),
        "--probe-decode",
    ]
    proc = Proc("direct-router", cmd, dict(os.environ), cluster.log_dir / "direct-router.log")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 120)
    return proc, url


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def one(client: httpx.AsyncClient, url: str, n: int, seed: int, max_tokens: int) -> float:
    """TTFT of one streamed request: to its first SSE event with a choice (the first token
    event, whether or not the token prints as text: a special token decodes to "")."""
    body = completion_body(prompt_of_length(n, seed=seed), max_tokens, True)
    t0 = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(
                f"{url}: {n}-token prompt: HTTP {r.status_code}: {(await r.aread())[:300]!r}"
            )
        ttft = None
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            obj = json.loads(line[5:])
            if "error" in obj:
                raise RuntimeError(f"{url}: {n}-token prompt: {obj['error']}")
            if ttft is None and obj.get("choices"):
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError(f"{url}: {n}-token prompt: no token event")
    return ttft


async def measure(
    urls: dict[str, str], lengths: list[int], requests: int, concurrency: int, max_tokens: int
) -> dict[str, dict[int, list[float]]]:
    """TTFT samples per side and length. Sequential (concurrency 1): the sides take turns
    request by request, so a slow spell of the box falls on all three alike."""
    out: dict[str, dict[int, list[float]]] = {s: {n: [] for n in lengths} for s in SIDES}
    seed = 1_000_000
    async with httpx.AsyncClient(timeout=300) as client:
        for side in SIDES:  # warm-up: the first requests pay for compiled kernels
            for n in lengths:
                for _ in range(3):
                    seed += 1
                    await one(client, urls[side], n, seed, max_tokens)
        for n in lengths:
            for i in range(requests // concurrency):
                k = i % len(SIDES)
                order = SIDES[k:] + SIDES[:k]
                for side in order:
                    seeds = range(seed, seed + concurrency)
                    seed += concurrency
                    got = await asyncio.gather(
                        *(one(client, urls[side], n, s, max_tokens) for s in seeds)
                    )
                    out[side][n].extend(got)
            p50 = {s: statistics.median(out[s][n]) * 1e3 for s in SIDES}
            print(
                f"  {n:5d} tokens: " + ", ".join(f"{s} {p50[s]:.1f} ms" for s in SIDES), flush=True
            )
    return out


def report(samples: dict[str, dict[int, list[float]]], lengths: list[int]) -> dict[str, Any]:
    rows = []
    for n in lengths:
        p50 = {s: statistics.median(samples[s][n]) * 1e3 for s in SIDES}
        p90 = {s: pct(samples[s][n], 0.9) * 1e3 for s in SIDES}
        rows.append(
            {
                "tokens": n,
                "p50_ms": p50,
                "p90_ms": p90,
                "direct_over_single": p50["direct"] / p50["single"],
                "decode_over_single": p50["decode"] / p50["single"],
                "pd_over_direct": p50["pd"] / p50["direct"],
                "pd_over_single": p50["pd"] / p50["single"],
            }
        )
    base = rows[0]["p50_ms"]["direct"]
    for r in rows:
        # What D pays to compute the prompt itself (its TTFT over the shortest prompt's)
        # against what P/D costs this request over D alone.
        r["recompute_ms"] = r["p50_ms"]["direct"] - base
        r["pd_overhead_ms"] = r["p50_ms"]["pd"] - r["p50_ms"]["direct"]
    cross_single = next((r["tokens"] for r in rows if r["pd_over_single"] <= 1.0), None)
    cross_direct = next((r["tokens"] for r in rows if r["pd_over_direct"] <= 1.0), None)
    cross_cost = next((r["tokens"] for r in rows if r["recompute_ms"] >= r["pd_overhead_ms"]), None)
    return {
        "rows": rows,
        "pd_at_or_below_single_from": cross_single,
        "pd_at_or_below_direct_from": cross_direct,
        "recompute_at_or_above_pd_overhead_from": cross_cost,
    }


def print_table(result: dict[str, Any]) -> None:
    print(
        "\n| prompt tokens | single p50 ms | D bare p50 ms | direct p50 ms | P/D p50 ms "
        "| D bare / single | direct / single | P/D / single | P/D / direct "
        "| D's recompute ms | P/D overhead ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        p = r["p50_ms"]
        print(
            f"| {r['tokens']} | {p['single']:.1f} | {p['decode']:.1f} | {p['direct']:.1f} "
            f"| {p['pd']:.1f} | {r['decode_over_single']:.2f} "
            f"| {r['direct_over_single']:.2f} | {r['pd_over_single']:.2f} "
            f"| {r['pd_over_direct']:.2f} | "
            f"{r['recompute_ms']:.1f} | {r['pd_overhead_ms']:.1f} |"
        )
    print(f"\nP/D TTFT p50 <= single engine's from: {result['pd_at_or_below_single_from']}")
    print(f"P/D TTFT p50 <= D alone's from: {result['pd_at_or_below_direct_from']}")
    print(
        f"D's recompute >= P/D's overhead from: {result['recompute_at_or_above_pd_overhead_from']}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--lengths",
        default="1,4,8,16,32,64,128,256,512,1024",
        help="prompt lengths in tokens, comma-separated (the first is the base "
        "of D's recompute cost)",
    )
    ap.add_argument("--requests", type=int, default=50, help="requests per side and length")
    ap.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="requests in flight per side at once (default 1: sequential)",
    )
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="the tiny model's layer count (default: the lab's model)",
    )
    ap.add_argument("--workdir", default=None, help="engines' folder (default: a temp dir)")
    ap.add_argument("--out", default=None, help="write the samples and table as JSON here")
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="kvpush-direct-"))
    # The cluster's router sends every request through both legs (the lab's default).
    spec = ClusterSpec(
        workdir=workdir,
        direct_below_tokens=0,
        model=TinyModelSpec(num_layers=a.layers) if a.layers else None,
    )
    t0 = time.monotonic()
    with Cluster(spec) as cluster:
        proc, direct_url = start_direct_router(cluster)
        try:
            print(
                f"engines up in {time.monotonic() - t0:.0f} s; measuring "
                f"{a.requests} requests per side and length, concurrency {a.concurrency}",
                flush=True,
            )
            urls = {
                "single": cluster.urls["reference"],
                "decode": cluster.urls["decode"],
                "direct": direct_url,
                "pd": cluster.urls["router"],
            }
            samples = asyncio.run(measure(urls, lengths, a.requests, a.concurrency, a.max_tokens))
        finally:
            proc.stop()
    result = report(samples, lengths)
    print_table(result)
    if a.out:
        Path(a.out).write_text(
            json.dumps({"args": vars(a), **result, "samples": samples}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
