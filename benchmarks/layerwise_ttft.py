"""TTFT with ``push.layerwise`` off, on and auto, one P/D pair of the lab's cluster through the
router: a 32-layer tiny model (hidden 64, 2 KV heads of 32), block 32, prompts of 32, 256
and 1,900 tokens, one request at a time (streamed, 4 output tokens), p50 per cell; and how
many layer WRITEs P posted during its forward and after it (``kvpush_layerwise_writes_total``).

Each mode starts its own pair (about a minute). Run under the engines' lock on a shared box:

    flock /tmp/kvpush-engines.lock python benchmarks/layerwise_ttft.py \
        [--modes off,on,auto] [--requests 16] [--out layerwise.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import httpx

from kvpush_prod.lab.client import completion_body, metric_sum, request, scrape
from kvpush_prod.lab.cluster import Cluster, ClusterSpec
from kvpush_prod.lab.tinymodel import TinyModelSpec, prompt_of_length

SHAPE = TinyModelSpec(
    num_layers=32, hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=2, head_dim=32
)
LENGTHS = (32, 256, 1900)
WARMUP = 3


async def cells(router: str, requests: int) -> dict[str, float]:
    out: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=120) as client:
        for n in LENGTHS:
            for w in range(WARMUP):
                await request(
                    client,
                    router,
                    completion_body(prompt_of_length(n, seed=10**6 + 100 * n + w), 4, True),
                )
            ttfts = []
            for i in range(requests):
                got = await request(
                    client, router, completion_body(prompt_of_length(n, seed=1000 * n + i), 4, True)
                )
                assert got.ok and got.ttft is not None, got.error
                ttfts.append(got.ttft)
            out[str(n)] = round(1000 * statistics.median(ttfts), 2)
    return out


def run_mode(mode: str, requests: int, root: Path) -> dict[str, Any]:
    spec = ClusterSpec(
        workdir=root / f"layerwise-{mode}",
        prefill_kv_gib=1,
        decode_kv_gib=1,
        block_size=32,
        model=SHAPE,
        reference=False,
        extra={"push": {"layerwise": mode}},
    )
    with Cluster(spec) as c:
        res: dict[str, Any] = asyncio.run(cells(c.urls["router"], requests))
        p = scrape(c.urls["prefill"])
        for when in ("during_forward", "after_forward"):
            res[when] = metric_sum(p, "kvpush_layerwise_writes_total", when=when)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="off,on,auto")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            results[mode] = run_mode(mode, args.requests, Path(tmp))
            print(mode, results[mode], flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
