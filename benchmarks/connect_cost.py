"""What a NIXL connection to a peer engine costs, by the size of the peer's KV cache.

A connection (``NixlTransport.connect``: load the peer's agent, describe every block of every
region of its KV cache) is what D makes to each P it pulls from and P to each D it pushes
to. Until issue 23's follow-up D made it on its pump, where every other receive waited for
it; now both make it on a connect thread. Two NIXL agents in this process over UCX
loopback, KV caches shaped like vLLM's CPU cache (one region per layer) with tiny blocks so
that large block counts fit in memory (the cost is per descriptor, not per byte):

    PYTHONPATH=src python benchmarks/connect_cost.py [--layers 32] [--blocks 1024,4096,16384,65536]

Prints the time to connect and the cost per descriptor; ends with one verdict line.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from kvpush_prod.transport.layout import Heads, layout_from_kv_caches
from kvpush_prod.transport.nixl import NixlTransport, make_agent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", default="1024,4096,16384,65536")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    heads = Heads(1, 1, 1, 0, block_size=16, head_size=1)
    print(f"{a.layers} layers; connect time, best of {a.rounds} (a fresh agent pair each)")
    print("| peer's blocks | descriptors (regions x blocks) | connect (ms) | us per descriptor |")
    print("|---|---|---|---|")
    per: list[float] = []
    for i, n in enumerate(int(x) for x in a.blocks.split(",")):
        caches = [{f"l{j}": torch.zeros((n, 1, 16, 2)) for j in range(a.layers)} for _ in range(2)]
        lays = [layout_from_kv_caches(c, n, "sig", {}, heads) for c in caches]
        best = float("inf")
        for r in range(a.rounds):
            tag = f"{os.getpid()}-{i}-{r}"
            p = NixlTransport(make_agent(f"cc-p-{tag}", "UCX", True, 1000), lays[0], producer=True)
            d = NixlTransport(make_agent(f"cc-d-{tag}", "UCX", True, 1000), lays[1], producer=False)
            began = time.perf_counter()
            d.connect(p.metadata(), lays[0], p.name)  # D -> the P it pulls from
            best = min(best, time.perf_counter() - began)
            p.close()
            d.close()
        descs = len(lays[0].regions) * n
        per.append(best * 1e6 / descs)
        print(f"| {n:,} | {descs:,} | {best * 1e3:.1f} | {per[-1]:.2f} |", flush=True)
    print(
        f"verdict: a connection costs ~{sorted(per)[len(per) // 2]:.2f} us per descriptor of the "
        f"peer's KV cache ({a.layers} regions x its blocks), made off the pump on both sides"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
