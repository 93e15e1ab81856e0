"""Descriptors per transfer when P's core cuts a push by layers or by blocks (``push.chunk_by``).

Two NIXL agents in this process over UCX loopback, a KV cache shaped like vLLM's CPU cache
(one region per layer, K and V in a block slot), and P's own core (``core.sender.Sender``)
cutting one transfer into ``push.chunk_bytes`` chunks; each WRITE it emits is posted through
``transport.nixl.NixlTransport`` with its region range, as the connector's worker posts it.
For D's cache fresh (the transfer's blocks consecutive) and fragmented (scattered, in random
order), it reports the descriptors the transfer posted in all (NIXL's, after merging runs;
what ``kvpush_post_descriptors`` sums), the posts, and checks D's bytes against P's.

    PYTHONPATH=src python benchmarks/chunk_by_descriptors.py [--layers 32] [--block 32]
        [--tokens 1900] [--kv-heads 2] [--head-dim 32] [--chunk-bytes 4194304]

Ends with one verdict line: PASS when cutting by layers posts at most regions x runs in all
(one descriptor per region per run of adjacent blocks) and D holds P's bytes.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import replace

import torch

from kvpush_prod.core import messages as m
from kvpush_prod.core.actions import PostWrite
from kvpush_prod.core.identity import agent_name as ag
from kvpush_prod.core.scheduler import SchedulerSettings
from kvpush_prod.core.sender import Sender, SenderSettings
from kvpush_prod.transport.layout import Heads, layout_from_kv_caches
from kvpush_prod.transport.nixl import NixlTransport, make_agent


def cache(a: argparse.Namespace, blocks: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (blocks, a.kv_heads, a.block, 2 * a.head_dim)
    return {f"l{i}": torch.rand(shape, generator=g) for i in range(a.layers)}


def push(
    tp: NixlTransport, peer: object, s: Sender, d: m.PeerInfo, src: list[int], dst: list[int],
    tokens: int,
) -> tuple[int, int]:  # fmt: skip
    """One transfer through ``s``: (descriptors posted in all, posts)."""
    s.on_message(
        m.Register(m.PROTOCOL_VERSION, "t", d, dst, 0, tokens, 1, 60_000), 0.0, origin=d.control
    )
    writes = [a for a in s.blocks_ready("t", src, 0.0, owner=d.control) if isinstance(a, PostWrite)]
    descriptors = posts = 0
    while writes:
        w = writes.pop(0)
        h = tp.post("WRITE", peer, list(w.src_blocks), list(w.dst_blocks), b"", w.regions)  # type: ignore[arg-type]
        assert tp.last_post is not None
        descriptors, posts = descriptors + tp.last_post.descriptors, posts + 1
        while (state := tp.state(h)) == "PROC":
            time.sleep(0.0002)
        assert state == "DONE", state
        tp.release(h)
        writes += [a for a in s.on_chunk(w.chunk_id, True, "", 0.0) if isinstance(a, PostWrite)]
    return descriptors, posts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=1900)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--chunk-bytes", type=int, default=4 << 20)
    a = ap.parse_args()
    n = -(-a.tokens // a.block)
    nb = 4 * n  # D's cache: 4x the transfer, so fragmented ids can lie apart
    heads = Heads(a.kv_heads, a.kv_heads, 1, 0, block_size=a.block, head_size=a.head_dim)
    pc, dc = cache(a, nb, 1), cache(a, nb, 2)
    play = layout_from_kv_caches(pc, nb, "sig", {}, heads)
    dlay = layout_from_kv_caches(dc, nb, "sig", {}, heads)
    tag = os.getpid()
    tp = NixlTransport(make_agent(f"chunkby-p-{tag}", "UCX", True, 1000), play, producer=True)
    td = NixlTransport(make_agent(f"chunkby-d-{tag}", "UCX", True, 1000), dlay, producer=False)
    peer = tp.connect(td.metadata(), dlay, td.name)
    me = m.PeerInfo("P", 1, 0, "tcp://p:1", ag("agent-p", "tcp://p:1"), b"m", play)
    d = m.PeerInfo("D", 2, 0, "tcp://d:1", ag("agent-d", "tcp://d:1"), b"m", dlay)
    base = SenderSettings(
        block_bytes=sum(r.block_len for r in play.regions),
        scheduler=SchedulerSettings(chunk_bytes=a.chunk_bytes, stop_margin_s=0.0),
        stop_margin_s=0.0,
    )
    regions, rng, src, ok = len(play.regions), random.Random(0), list(range(n)), True
    print(f"{a.layers} layers ({regions} regions), block {a.block}, {a.tokens} tokens: {n} blocks")
    print("| D's cache | chunk_by | descriptors per transfer | posts | runs x regions |")
    print("|---|---|---|---|---|")
    for kind in ("fresh", "fragmented"):
        dst = list(range(n)) if kind == "fresh" else rng.sample(range(nb), n)
        runs = 1 + sum(1 for i in range(1, n) if dst[i] != dst[i - 1] + 1)
        for by in ("blocks", "layers"):
            s = Sender(me, replace(base, chunk_by_regions=by == "layers"), random.Random(0))
            got, posts = push(tp, peer, s, d, src, dst, a.tokens)
            same = all(torch.equal(pc[k][src], dc[k][dst]) for k in pc)
            ok = ok and same and (by == "blocks" or got <= runs * regions)
            print(
                f"| {kind} | {by} | {got} | {posts} | {runs * regions} |"
                + ("" if same else " BAD BYTES")
            )
    tp.close()
    td.close()
    print(
        f"{'PASS' if ok else 'FAIL'}: by layers a transfer posts at most one descriptor per region per run"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
