"""Posts through real NIXL (two UCX agents in this process, loopback): for fragmented,
contiguous and mixed block ids, whole blocks, units of different block sizes and head slabs
of different tensor-parallel sizes, each request builder (prepared indices, run-built
descriptors) and split posts, the destination holds byte for byte what the old
one-descriptor-per-block path would have written there, and nothing else changed."""

from __future__ import annotations

import itertools
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from kvpush_prod.core import blocksize
from kvpush_prod.core.messages import Layout
from kvpush_prod.core.retry import ChunkError, ErrorKind
from kvpush_prod.errors import TransportError
from kvpush_prod.transport.layout import (
    Heads,
    all_descriptors,
    descriptor_indices,
    layout_from_kv_caches,
    unit_descriptors,
    unit_indices,
)

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl

from kvpush_prod.transport.nixl import NixlTransport, make_agent  # noqa: E402

NUM_BLOCKS, HEAD, LAYERS = 24, 8, 3
_names = itertools.count()


@pytest.fixture(scope="module")
def agents() -> tuple[Any, Any]:
    """P's and D's agents, shared by the module's tests (each test registers and releases
    its own caches through its own transports)."""
    tag = f"{os.getpid()}-{next(_names)}"
    return (
        make_agent(f"kvpush-test-p-{tag}", "UCX", True, 1000),
        make_agent(f"kvpush-test-d-{tag}", "UCX", True, 1000),
    )


@dataclass
class Cache:
    """An engine rank's KV cache: per-layer views of one byte buffer, and its layout."""

    buf: torch.Tensor  # uint8, every layer's bytes
    layout: Layout

    def offset(self, addr: int) -> int:
        return addr - self.buf.data_ptr()


def cache(
    shape: Callable[[int], tuple[int, ...]],
    block: int,
    num_blocks: int,
    heads: int,
    total: int,
    tp: int,
    rank: int,
    seed: int,
) -> Cache:
    """``LAYERS`` float32 tensors of ``shape(num_blocks)`` carved from one random buffer."""
    numel = int(np.prod(shape(num_blocks)))
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, (LAYERS * numel * 4,), dtype=torch.uint8, generator=gen)
    layers = {
        f"l{i}": buf[i * numel * 4 : (i + 1) * numel * 4]
        .view(torch.float32)
        .view(shape(num_blocks))
        for i in range(LAYERS)
    }
    lay = layout_from_kv_caches(
        layers,
        num_blocks,
        "sig",
        {},
        Heads(heads, total, tp, rank, block_size=block, head_size=HEAD),
    )
    return Cache(buf, lay)


def cpu(heads: int, block: int) -> Callable[[int], tuple[int, ...]]:
    return lambda n: (n, heads, block, 2 * HEAD)  # vLLM's CPU backend: K and V in a block


def nhd(heads: int, block: int) -> Callable[[int], tuple[int, ...]]:
    return lambda n: (2, n, block, heads, HEAD)  # GPU NHD: K and V regions, tokens outer


def hnd(heads: int, block: int) -> Callable[[int], tuple[int, ...]]:
    return lambda n: (2, n, heads, block, HEAD)  # GPU HND: a token group per head


def ids_of(kind: str, n: int, limit: int, rng: random.Random) -> list[int]:
    if kind == "contiguous":
        start = rng.randrange(limit - n + 1)
        return list(range(start, start + n))
    if kind == "fragmented":
        return rng.sample(range(limit), n)
    out: list[int] = []  # mixed: runs of 1-5 blocks at random free places
    free = list(range(limit))
    while len(out) < n:
        start = rng.choice(free)
        run = [b for b in range(start, start + rng.randint(1, 5)) if b in free][: n - len(out)]
        run = run or [start]
        out += run
        free = [b for b in free if b not in run]
    return out


def old_pairs(
    t: NixlTransport, peer: Any, lids: list[int], rids: list[int]
) -> list[tuple[int, int, int]]:
    """(local addr, remote addr, bytes) of every descriptor the old path posted."""
    local = peer.local or t.layout
    if peer.unit_tokens:
        ld, rd = unit_descriptors(local, peer.local_k), unit_descriptors(peer.layout, peer.remote_k)
        li = unit_indices(lids, local, peer.local_k)
        ri = unit_indices(rids, peer.layout, peer.remote_k)
    else:
        ld, rd = np.asarray(all_descriptors(local)), np.asarray(all_descriptors(peer.layout))
        li, ri = descriptor_indices(lids, local), descriptor_indices(rids, peer.layout)
    return [(int(ld[a, 0]), int(rd[b, 0]), int(ld[a, 1])) for a, b in zip(li, ri, strict=True)]


def expected(
    src: Cache, dst: Cache, pairs: list[tuple[int, int, int]], write: bool
) -> torch.Tensor:
    """``dst``'s bytes after the old path's copies (``pairs`` as the poster sees them)."""
    out = dst.buf.clone()
    for la, ra, n in pairs:
        s, d = (la, ra) if write else (ra, la)
        out[dst.offset(d) : dst.offset(d) + n] = src.buf[src.offset(s) : src.offset(s) + n]
    return out


def wait_done(t: NixlTransport, handle: Any) -> None:
    deadline = time.monotonic() + 20
    while (state := t.state(handle)) == "PROC":
        assert time.monotonic() < deadline, "transfer never completed"
        time.sleep(0.0005)
    assert state == "DONE", state
    t.release(handle)


@pytest.fixture
def pair(agents: tuple[Any, Any]) -> Iterator[Callable[..., tuple[NixlTransport, NixlTransport]]]:
    made: list[NixlTransport] = []

    def connect(p: Cache, d: Cache, **kw: Any) -> tuple[NixlTransport, NixlTransport]:
        tp = NixlTransport(agents[0], p.layout, producer=True, **kw)
        td = NixlTransport(agents[1], d.layout, producer=False, **kw)
        made.extend((tp, td))
        return tp, td

    yield connect
    for t in made:
        t.close()


def push(
    tp: NixlTransport, td: NixlTransport, p: Cache, d: Cache, lids: list[int], rids: list[int]
) -> torch.Tensor:
    """P WRITEs ``lids`` into D's ``rids``; what the old path would have left in D."""
    peer = tp.connect(td.metadata(), d.layout, td.name)
    want = expected(p, d, old_pairs(tp, peer, lids, rids), write=True)
    wait_done(tp, tp.post("WRITE", peer, lids, rids))
    return want


KINDS = ["contiguous", "fragmented", "mixed"]
PATHS = ["auto", "prepped", "coalesced"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("p_kind", "d_kind"), [(k, k) for k in KINDS] + [("contiguous", "fragmented")]
)
@pytest.mark.parametrize("shape", [cpu, nhd])
@pytest.mark.parametrize("seed", [1, 2])
def test_whole_blocks_land_as_the_old_path_put_them(
    pair: Any, path: str, p_kind: str, d_kind: str, shape: Any, seed: int
) -> None:
    rng = random.Random(seed)
    p = cache(shape(4, 16), 16, NUM_BLOCKS, 4, 4, 1, 0, seed)
    d = cache(shape(4, 16), 16, NUM_BLOCKS, 4, 4, 1, 0, seed + 100)
    tp, td = pair(p, d, path=path)
    n = rng.randint(1, NUM_BLOCKS)
    lids, rids = ids_of(p_kind, n, NUM_BLOCKS, rng), ids_of(d_kind, n, NUM_BLOCKS, rng)
    want = push(tp, td, p, d, lids, rids)
    assert torch.equal(d.buf, want)
    stats = tp.last_post
    assert stats is not None and stats.ids == n
    runs = sum(
        1 for i in range(n) if i == 0 or (lids[i] != lids[i - 1] + 1 or rids[i] != rids[i - 1] + 1)
    )
    assert stats.runs == runs and stats.descriptors == runs * len(p.layout.regions)
    if path == "coalesced":
        assert stats.path == "coalesced" and stats.entries == stats.descriptors


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("p_block", "d_block"), [(16, 32), (32, 16), (16, 64)])
@pytest.mark.parametrize("shape", [nhd, hnd])
def test_units_of_different_block_sizes_land_as_the_old_path_put_them(
    pair: Any, path: str, kind: str, p_block: int, d_block: int, shape: Any
) -> None:
    rng = random.Random(p_block * 7 + d_block)
    p_nb, d_nb = NUM_BLOCKS * 64 // p_block // 4, NUM_BLOCKS * 64 // d_block // 4
    p = cache(shape(2, p_block), p_block, p_nb, 2, 2, 1, 0, 3)
    d = cache(shape(2, d_block), d_block, d_nb, 2, 2, 1, 0, 4)
    tokens = rng.randint(1, min(p_nb * p_block, d_nb * d_block) // 2)
    p_blocks = ids_of(kind, blocksize.cdiv(tokens, p_block), p_nb, rng)
    d_blocks = ids_of(kind, blocksize.cdiv(tokens, d_block), d_nb, rng)
    plan = blocksize.push_units(p.layout, d.layout, p_blocks, d_blocks, 0, tokens)
    assert isinstance(plan, blocksize.Units)
    tp, td = pair(p, d, path=path)
    want = push(tp, td, p, d, plan.src, plan.dst)
    assert torch.equal(d.buf, want)
    stats = tp.last_post
    assert stats is not None
    # NHD: a unit is one piece (linear); HND: a piece per head, never one per run.
    assert (stats.path == "coalesced") == (path == "coalesced" and shape is nhd)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("p_tp", "d_tp", "rank"), [(2, 1, 0), (2, 1, 1), (1, 2, 0), (1, 2, 1)])
def test_head_slabs_across_tp_sizes_land_as_the_old_path_put_them(
    pair: Any, path: str, kind: str, p_tp: int, d_tp: int, rank: int
) -> None:
    total, rng = 4, random.Random(p_tp * 10 + d_tp + rank)
    p_rank, d_rank = (rank, 0) if p_tp > d_tp else (0, rank)
    p = cache(cpu(total // p_tp, 32), 32, NUM_BLOCKS, total // p_tp, total, p_tp, p_rank, 5)
    d = cache(cpu(total // d_tp, 32), 32, NUM_BLOCKS, total // d_tp, total, d_tp, d_rank, 6)
    tp, td = pair(p, d, path=path)
    n = rng.randint(1, NUM_BLOCKS)
    lids, rids = ids_of(kind, n, NUM_BLOCKS, rng), ids_of(kind, n, NUM_BLOCKS, rng)
    want = push(tp, td, p, d, lids, rids)
    assert torch.equal(d.buf, want)
    stats = tp.last_post
    assert stats is not None and stats.path == "prepped"  # a slab is never a whole slot


@pytest.mark.parametrize("kind", KINDS)
def test_a_pull_fallback_read_lands_as_the_old_path_put_it(pair: Any, kind: str) -> None:
    rng = random.Random(9)
    p = cache(cpu(2, 32), 32, NUM_BLOCKS, 2, 2, 1, 0, 7)
    d = cache(cpu(2, 32), 32, NUM_BLOCKS, 2, 2, 1, 0, 8)
    tp, td = pair(p, d)
    tp.connect(td.metadata(), d.layout, td.name)
    peer = td.connect(tp.metadata(), p.layout, tp.name)  # D reads from P
    n = rng.randint(1, NUM_BLOCKS)
    dids, pids = ids_of(kind, n, NUM_BLOCKS, rng), ids_of(kind, n, NUM_BLOCKS, rng)
    want = expected(p, d, old_pairs(td, peer, dids, pids), write=False)
    wait_done(td, td.post("READ", peer, dids, pids))
    assert torch.equal(d.buf, want)


@pytest.mark.parametrize("path", ["prepped", "coalesced"])
def test_a_post_over_the_bound_is_split_and_notifies_only_after_every_part(
    pair: Any, path: str
) -> None:
    p = cache(cpu(2, 32), 32, NUM_BLOCKS, 2, 2, 1, 0, 11)
    d = cache(cpu(2, 32), 32, NUM_BLOCKS, 2, 2, 1, 0, 12)
    tp, td = pair(p, d, path=path, max_descriptors=2 * LAYERS)  # two runs per part
    peer = tp.connect(td.metadata(), d.layout, td.name)
    lids = [0, 1, 5, 6, 7, 10, 12, 13, 20]
    rids = [3, 4, 8, 9, 10, 0, 22, 23, 15]  # five runs on both sides
    want = expected(p, d, old_pairs(tp, peer, lids, rids), write=True)
    handle = tp.post("WRITE", peer, lids, rids, b"done-1")
    assert tp.last_post is not None and tp.last_post.parts == 3
    assert tp.last_post.descriptors == 5 * LAYERS
    time.sleep(0.05)
    assert td.notifications() == {}  # parts are pending: no notification yet
    deadline = time.monotonic() + 20
    notifs: list[bytes] = []
    while (state := tp.state(handle)) == "PROC":
        notifs += td.notifications().get(tp.name, [])
        assert not notifs, "notified before every part landed"
        assert time.monotonic() < deadline
        time.sleep(0.0005)
    assert state == "DONE"
    assert torch.equal(d.buf, want)  # every part landed before the notification went out
    while not notifs and time.monotonic() < deadline:
        notifs += td.notifications().get(tp.name, [])
        time.sleep(0.001)
    assert notifs == [b"done-1"]
    assert tp.state(handle) == "DONE"  # asked again: no second notification
    time.sleep(0.02)
    assert td.notifications().get(tp.name, []) == []
    tp.release(handle)


@pytest.mark.parametrize("path", ["prepped", "coalesced"])
def test_the_parts_of_a_split_post_to_a_dropped_connection_never_go_out(
    pair: Any, path: str
) -> None:
    """The driver drops a connection UCX closed (and may make a new one to the same agent):
    a split post's parts not posted yet are not posted on freed descriptor lists nor on
    the new connection; the post fails, and no notification is sent."""
    p = cache(cpu(2, 32), 32, NUM_BLOCKS, 2, 2, 1, 0, 15)
    d = cache(cpu(2, 32), 32, NUM_BLOCKS, 2, 2, 1, 0, 16)
    tp, td = pair(p, d, path=path, max_descriptors=2 * LAYERS)
    peer = tp.connect(td.metadata(), d.layout, td.name)
    handle = tp.post("WRITE", peer, [0, 1, 5, 6, 7, 10], [3, 4, 8, 9, 10, 0], b"done-2")
    assert tp.last_post is not None and tp.last_post.parts == 2
    tp.disconnect(td.name)
    tp.connect(td.metadata(), d.layout, td.name)  # a new connection to the same agent
    state = tp.state(handle)
    assert isinstance(state, ChunkError) and state.kind is ErrorKind.NOT_FOUND, state
    assert isinstance(tp.state(handle), ChunkError)  # asked again: still failed
    tp.release(handle)
    time.sleep(0.05)
    assert td.notifications().get(tp.name, []) == []


def test_one_part_carries_its_notification_with_the_request(pair: Any) -> None:
    p = cache(cpu(2, 32), 32, NUM_BLOCKS, 2, 2, 1, 0, 13)
    d = cache(cpu(2, 32), 32, NUM_BLOCKS, 2, 2, 1, 0, 14)
    tp, td = pair(p, d)
    peer = tp.connect(td.metadata(), d.layout, td.name)
    wait_done(tp, tp.post("WRITE", peer, [2, 3, 4], [7, 8, 9], b"last"))
    deadline, notifs = time.monotonic() + 20, []
    while not notifs and time.monotonic() < deadline:
        notifs += td.notifications().get(tp.name, [])
        time.sleep(0.001)
    assert notifs == [b"last"]
    assert tp.last_post is not None and tp.last_post.parts == 1


def test_ids_outside_the_cache_or_of_unequal_counts_are_refused(pair: Any) -> None:
    p = cache(cpu(2, 32), 32, NUM_BLOCKS, 2, 2, 1, 0, 15)
    d = cache(cpu(2, 32), 32, NUM_BLOCKS, 2, 2, 1, 0, 16)
    tp, td = pair(p, d)
    peer = tp.connect(td.metadata(), d.layout, td.name)
    before = d.buf.clone()
    # block 24 of region 0 would be block 0 of region 1: never written
    with pytest.raises(TransportError, match=r"remote blocks 0\.\.24 .* 24 blocks per region"):
        tp.post("WRITE", peer, [1, 2], [0, NUM_BLOCKS])
    with pytest.raises(TransportError, match="local blocks -1"):
        tp.post("WRITE", peer, [-1], [0])
    with pytest.raises(TransportError, match="2 local blocks vs 1 remote"):
        tp.post("WRITE", peer, [1, 2], [0])
    with pytest.raises(TransportError, match="names no local blocks"):
        tp.post("WRITE", peer, [], [])
    assert torch.equal(d.buf, before)


def test_nixl_posts_the_descriptors_the_stats_count(monkeypatch: pytest.MonkeyPatch) -> None:
    # NIXL's own telemetry (on for these agents only) counts what it hands the backend after
    # merging consecutive prepared indices: a linear pair's runs x regions on either path.
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "y")
    tag = f"{os.getpid()}-{next(_names)}"
    ap, ad = (make_agent(f"kvpush-tel-{s}-{tag}", "UCX", True, 1000) for s in "pd")
    p = cache(cpu(2, 32), 32, NUM_BLOCKS, 2, 2, 1, 0, 17)
    d = cache(cpu(2, 32), 32, NUM_BLOCKS, 2, 2, 1, 0, 18)
    lids, rids = [0, 1, 2, 3, 9, 10, 15], [5, 6, 7, 8, 1, 2, 20]  # three runs
    for path in ("prepped", "coalesced"):
        tp = NixlTransport(ap, p.layout, path=path)
        td = NixlTransport(ad, d.layout, producer=False)
        try:
            peer = tp.connect(td.metadata(), d.layout, td.name)
            handle = tp.post("WRITE", peer, lids, rids)
            deadline = time.monotonic() + 20
            while tp.state(handle) == "PROC":
                assert time.monotonic() < deadline
                time.sleep(0.0005)
            (nixl_handle,) = handle.handles
            count = int(ap.get_xfer_telemetry(nixl_handle).descCount)
            assert tp.last_post is not None
            assert tp.last_post.path == path
            assert count == tp.last_post.descriptors == 3 * LAYERS
            tp.release(handle)
        finally:
            tp.close()
            td.close()


def test_the_post_cost_bench_counts_what_nixl_posts(monkeypatch: pytest.MonkeyPatch) -> None:
    # ``kvpush bench transfer --post-cost`` on a tiny shape: every path posts the same
    # descriptors (NIXL's count), the old path hands NIXL one index per block per region.
    from kvpush_prod.bench.transfer import post_cost, post_cost_markdown

    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "y")  # undone after the test

    res = post_cost(
        [2],
        [16],
        [256],
        ["contiguous", "fragmented"],
        ["old", "auto", "prepped", "coalesced"],
        iters=2,
    )
    rows = res["rows"]
    assert len(rows) == 8
    for kind, regions_runs in (("contiguous", 1), ("fragmented", 16)):
        cells = [r for r in rows if r["kind"] == kind]
        assert {r["descriptors"] for r in cells} == {4 * regions_runs}
        assert next(r for r in cells if r["path"] == "old")["entries"] == 4 * 16
    assert "| 2 | 16 | 256 | 16 | contiguous | old |" in post_cost_markdown(res, "here")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [cpu, nhd])
def test_layer_by_layer_posts_land_each_layer_alone_and_together_the_whole_blocks(
    pair: Any, path: str, kind: str, shape: Any
) -> None:
    """Layer-wise push: a post of regions ``[first, end)`` moves exactly those regions of
    each block; one post per layer leaves D as one whole post would."""
    rng = random.Random(7)
    p = cache(shape(4, 16), 16, NUM_BLOCKS, 4, 4, 1, 0, 11)
    d = cache(shape(4, 16), 16, NUM_BLOCKS, 4, 4, 1, 0, 12)
    tp, td = pair(p, d, path=path)
    n = rng.randint(2, NUM_BLOCKS)
    lids, rids = ids_of(kind, n, NUM_BLOCKS, rng), ids_of(kind, n, NUM_BLOCKS, rng)
    peer = tp.connect(td.metadata(), d.layout, td.name)
    regions = len(p.layout.regions)
    per = regions // LAYERS
    pairs = old_pairs(tp, peer, lids, rids)  # region-major: region r's are n in a row
    before = d.buf.clone()
    for layer in range(LAYERS):
        first, end = layer * per, (layer + 1) * per
        wait_done(tp, tp.post("WRITE", peer, lids, rids, regions=(first, end)))
        stats = tp.last_post
        assert stats is not None and stats.ids == n
        want = before.clone()
        for la, ra, size in pairs[: end * n]:
            want[d.offset(ra) : d.offset(ra) + size] = p.buf[p.offset(la) : p.offset(la) + size]
        assert torch.equal(d.buf, want), f"after layer {layer}"
    with pytest.raises(TransportError):
        tp.post("WRITE", peer, lids, rids, regions=(0, regions + 1))


@pytest.mark.parametrize("path", ["prepped", "coalesced"])
@pytest.mark.parametrize(
    ("p_block", "d_block", "shape", "p_tp", "d_tp"),
    [(16, 32, nhd, 1, 1), (32, 16, hnd, 1, 1), (32, 32, cpu, 2, 1), (32, 32, cpu, 1, 2)],
)
def test_layer_by_layer_posts_of_units_and_head_slabs_land_as_one_whole_post(
    pair: Any, path: str, p_block: int, d_block: int, shape: Any, p_tp: int, d_tp: int
) -> None:
    """Block sizes or tensor-parallel sizes differ: one post per layer's regions leaves D as
    one post of every region would."""
    rng, total = random.Random(p_block + d_block + p_tp), 4
    p_nb, d_nb = NUM_BLOCKS * 32 // p_block, NUM_BLOCKS * 32 // d_block
    p = cache(shape(total // p_tp, p_block), p_block, p_nb, total // p_tp, total, p_tp, 0, 21)
    d = cache(shape(total // d_tp, d_block), d_block, d_nb, total // d_tp, total, d_tp, 0, 22)
    tokens = rng.randint(1, min(p_nb * p_block, d_nb * d_block) // 2)
    p_blocks = ids_of("mixed", blocksize.cdiv(tokens, p_block), p_nb, rng)
    d_blocks = ids_of("mixed", blocksize.cdiv(tokens, d_block), d_nb, rng)
    plan = blocksize.push_units(p.layout, d.layout, p_blocks, d_blocks, 0, tokens)
    assert isinstance(plan, blocksize.Units)
    tp, td = pair(p, d, path=path)
    peer = tp.connect(td.metadata(), d.layout, td.name)
    want = expected(p, d, old_pairs(tp, peer, plan.src, plan.dst), write=True)
    per = len(p.layout.regions) // LAYERS
    for layer in range(LAYERS):
        wait_done(
            tp, tp.post("WRITE", peer, plan.src, plan.dst, regions=(layer * per, (layer + 1) * per))
        )
    assert torch.equal(d.buf, want)


def core_push(
    tp: NixlTransport,
    peer: Any,
    p: Cache,
    d: Cache,
    src: list[int],
    dst: list[int],
    tokens: int,
    chunk: int,
    by_regions: bool = True,
) -> list[int]:
    """P's core pushes ``src`` into D's ``dst`` (``tokens`` tokens) in chunks of ``chunk``
    bytes, each of its WRITEs posted through ``tp``; the descriptors of each post."""
    from dataclasses import replace as dc_replace

    from kvpush_prod.core import messages as m
    from kvpush_prod.core.actions import PostWrite
    from kvpush_prod.core.identity import agent_name as ag
    from kvpush_prod.core.scheduler import SchedulerSettings
    from kvpush_prod.core.sender import Sender, SenderSettings

    me = m.PeerInfo("P", 1, 0, "tcp://p:1", ag("agent-p", "tcp://p:1"), b"m", p.layout)
    them = m.PeerInfo("D", 2, 0, "tcp://d:1", ag("agent-d", "tcp://d:1"), b"m", d.layout)
    settings = SenderSettings(
        block_bytes=sum(r.block_len for r in p.layout.regions),
        scheduler=SchedulerSettings(chunk_bytes=chunk, stop_margin_s=0.0),
        stop_margin_s=0.0,
    )
    s = Sender(me, dc_replace(settings, chunk_by_regions=by_regions), random.Random(0))
    reg = m.Register(m.PROTOCOL_VERSION, "t", them, dst, 0, tokens, 1, 60_000)
    s.on_message(reg, 0.0, origin=them.control)
    writes = [
        a for a in s.blocks_ready("t", src, 0.0, owner=them.control) if isinstance(a, PostWrite)
    ]
    descriptors: list[int] = []
    while writes:
        w = writes.pop(0)
        assert w.done is None or not writes  # DONE after every other chunk
        handle = tp.post("WRITE", peer, list(w.src_blocks), list(w.dst_blocks), b"", w.regions)
        stats = tp.last_post
        assert stats is not None
        descriptors.append(stats.descriptors)
        wait_done(tp, handle)
        writes += [a for a in s.on_chunk(w.chunk_id, True, "", 0.0) if isinstance(a, PostWrite)]
    return descriptors


@pytest.mark.parametrize(
    ("kind", "p_block", "d_block", "p_tp", "d_tp"),
    [
        ("contiguous", 16, 16, 1, 1),
        ("fragmented", 16, 16, 1, 1),
        ("contiguous", 16, 32, 1, 1),
        ("mixed", 16, 16, 2, 1),
    ],
)
def test_a_whole_push_cut_by_layers_posts_one_descriptor_per_region_and_run(
    pair: Any, kind: str, p_block: int, d_block: int, p_tp: int, d_tp: int
) -> None:
    """``push.chunk_by: layers``: P's core cuts a push of many blocks into region groups;
    on a fresh cache the transfer posts one descriptor per region in all (not one per
    region per chunk), fragmented one per region per block, and D holds what one post of
    every region would have left (block sizes or tensor-parallel sizes differing too)."""
    rng, total = random.Random(hash((kind, p_block, d_block, p_tp)) & 0xFFFF), 4
    p_nb, d_nb = NUM_BLOCKS * 16 // p_block, NUM_BLOCKS * 16 // d_block
    shape = nhd if p_tp == d_tp else cpu  # head slabs: the CPU layout, K and V in a block
    p = cache(shape(total // p_tp, p_block), p_block, p_nb, total // p_tp, total, p_tp, 0, 31)
    d = cache(shape(total // d_tp, d_block), d_block, d_nb, total // d_tp, total, d_tp, 0, 32)
    tokens = (p_nb - 4) * p_block
    p_blocks = ids_of(kind, blocksize.cdiv(tokens, p_block), p_nb, rng)
    d_blocks = ids_of(kind, blocksize.cdiv(tokens, d_block), d_nb, rng)
    plan = blocksize.push_units(p.layout, d.layout, p_blocks, d_blocks, 0, tokens)
    assert isinstance(plan, blocksize.Units)
    tp, td = pair(p, d)
    peer = tp.connect(td.metadata(), d.layout, td.name)
    want = expected(p, d, old_pairs(tp, peer, plan.src, plan.dst), write=True)
    regions = len(p.layout.regions)  # 3 layers: K and V apart (NHD), or together (CPU)
    per_region = sum(r.block_len for r in p.layout.regions) // regions * len(p_blocks)
    # A layer's worth a chunk: 3 chunks by layers, where by blocks made 3 of every region.
    chunk = per_region * (regions // LAYERS)
    got = core_push(tp, peer, p, d, p_blocks, d_blocks, tokens, chunk)
    assert torch.equal(d.buf, want)
    assert len(got) == 3
    if kind == "contiguous" and p_tp == d_tp:
        assert sum(got) == regions  # one run of blocks: one descriptor per region
        by_blocks = core_push(tp, peer, p, d, p_blocks, d_blocks, tokens, chunk, False)
        assert sum(by_blocks) == len(by_blocks) * regions and len(by_blocks) >= 3
    if kind == "fragmented" and p_block == d_block:
        runs = sum(
            1
            for i in range(len(p_blocks))
            if i == 0 or (p_blocks[i] != p_blocks[i - 1] + 1 or d_blocks[i] != d_blocks[i - 1] + 1)
        )
        assert sum(got) == runs * regions


# -- P's gather area (staging.send_mib)


def gather_area(p: Cache, slots: int, quarantine_s: float = 30.0) -> Any:
    from kvpush_prod.transport.staging import GatherArea

    return GatherArea(p.layout, slots, quarantine_s)


@pytest.mark.parametrize("d_kind", ["contiguous", "fragmented", "mixed"])
@pytest.mark.parametrize("shape", [cpu, nhd])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_scattered_blocks_are_gathered_and_land_as_the_old_path_put_them(
    pair: Any, d_kind: str, shape: Any, seed: int
) -> None:
    rng = random.Random(seed)
    p = cache(shape(4, 16), 16, NUM_BLOCKS, 4, 4, 1, 0, seed)
    d = cache(shape(4, 16), 16, NUM_BLOCKS, 4, 4, 1, 0, seed + 100)
    area = gather_area(p, NUM_BLOCKS)
    tp, td = pair(p, d, gather=area)
    n = rng.randint(8, NUM_BLOCKS)
    lids = rng.sample(range(NUM_BLOCKS), n)  # P's blocks scattered
    rids = ids_of(d_kind, n, NUM_BLOCKS, rng)
    before = p.buf.clone()
    want = push(tp, td, p, d, lids, rids)
    assert torch.equal(d.buf, want)
    assert torch.equal(p.buf, before)  # the gather only read P's blocks
    stats = tp.last_post
    d_runs = sum(1 for i in range(n) if i == 0 or rids[i] != rids[i - 1] + 1)
    runs = sum(
        1 for i in range(n) if i == 0 or (lids[i] != lids[i - 1] + 1 or rids[i] != rids[i - 1] + 1)
    )
    assert stats is not None and stats.ids == n
    # Gathered where P's scattering at least doubles the runs: then a descriptor per region
    # and run of D's blocks; on a D as scattered, nothing to save.
    assert (stats.path == "gathered") == (runs >= 2 * d_runs)
    assert stats.descriptors == min(runs, d_runs if runs >= 2 * d_runs else runs) * len(
        p.layout.regions
    )
    assert area.pool.held == 0  # given back once the WRITE completed


def test_a_layer_of_scattered_blocks_is_gathered_alone(pair: Any) -> None:
    rng = random.Random(5)
    p = cache(cpu(4, 16), 16, NUM_BLOCKS, 4, 4, 1, 0, 5)
    d = cache(cpu(4, 16), 16, NUM_BLOCKS, 4, 4, 1, 0, 105)
    tp, td = pair(p, d, gather=gather_area(p, NUM_BLOCKS))
    peer = tp.connect(td.metadata(), d.layout, td.name)
    lids = rng.sample(range(NUM_BLOCKS), 12)
    rids = list(range(3, 15))
    layer = p.layout.regions[1]
    want = d.buf.clone()
    for lb, rb in zip(lids, rids, strict=True):
        s = p.offset(layer.base) + lb * layer.block_stride
        t = d.offset(d.layout.regions[1].base) + rb * layer.block_stride
        want[t : t + layer.block_len] = p.buf[s : s + layer.block_len]
    wait_done(tp, tp.post("WRITE", peer, lids, rids, regions=(1, 2)))
    assert torch.equal(d.buf, want)  # that layer's blocks, nothing of the others
    assert tp.last_post is not None and tp.last_post.path == "gathered"
    assert tp.last_post.descriptors == 1


def test_with_no_free_slots_a_write_goes_from_the_kv_blocks_and_is_counted(pair: Any) -> None:
    rng = random.Random(9)
    p = cache(cpu(4, 16), 16, NUM_BLOCKS, 4, 4, 1, 0, 9)
    d = cache(cpu(4, 16), 16, NUM_BLOCKS, 4, 4, 1, 0, 109)
    area = gather_area(p, 4)
    tp, td = pair(p, d, gather=area)
    lids = rng.sample(range(NUM_BLOCKS), 10)
    want = push(tp, td, p, d, lids, list(range(10)))
    assert torch.equal(d.buf, want)
    assert tp.last_post is not None and tp.last_post.path != "gathered"
    assert area.full == 1 and area.pool.held == 0


def test_a_contiguous_write_is_not_gathered(pair: Any) -> None:
    p = cache(cpu(4, 16), 16, NUM_BLOCKS, 4, 4, 1, 0, 11)
    d = cache(cpu(4, 16), 16, NUM_BLOCKS, 4, 4, 1, 0, 111)
    area = gather_area(p, NUM_BLOCKS)
    tp, td = pair(p, d, gather=area)
    want = push(tp, td, p, d, list(range(2, 12)), [9, 4, 17, 1, 20, 6, 13, 0, 22, 15])
    assert torch.equal(d.buf, want)
    # P's side is one run: gathering would save nothing.
    assert tp.last_post is not None and tp.last_post.path != "gathered"
    assert area.full == 0


def test_slots_of_a_write_given_up_in_flight_are_kept_for_the_quarantine() -> None:
    p = cache(cpu(4, 16), 16, NUM_BLOCKS, 4, 4, 1, 0, 13)
    area = gather_area(p, 6, quarantine_s=0.2)
    key, slots = area.gather(np.arange(6), 0, LAYERS)
    assert list(slots) == list(range(6))
    area.give_back(key, complete=False)  # given up while its bytes may still be read
    assert area.gather(np.arange(2), 0, LAYERS) is None and area.full == 1
    time.sleep(0.25)
    got = area.gather(np.arange(2), 0, LAYERS)
    assert got is not None and list(got[1]) == [0, 1]
