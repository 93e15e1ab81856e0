"""Different block sizes on prefill and decode, on real tensors: the unit descriptors the
NIXL transport prepares put each token's K and V where an engine of D's block size keeps
them. P's cache and the expected D cache are written by vLLM's own CPU attention kernel
(whose order inside a block is probed, not assumed: its "vec" kernel stores K transposed),
for several head counts, hetero TP, a D prefix hit and prompts of no whole block; the
checksums of both sides agree; the token geometry is derived for NHD, HND and MLA."""

from __future__ import annotations

import ctypes
import functools
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvpush_prod.connector.cpu_layout import cpu_token_pattern
from kvpush_prod.connector.worker import TransferPump
from kvpush_prod.core import blocksize, compat, tpmap
from kvpush_prod.core.messages import Layout
from kvpush_prod.transport.layout import Heads, head_slab, layout_from_kv_caches
from kvpush_prod.transport.nixl import NixlTransport

HEAD, LAYERS, NUM_BLOCKS = 32, 2, 12  # head sizes the CPU kernel takes: multiples of 32
EMPTY = -1.0


class FakeAgent:
    """What NixlTransport asks of a NIXL agent; a transfer copies every descriptor pair
    byte for byte (both sides live in this process), prepared (by index) or built for the
    post (``initialize_xfer``) alike."""

    name = "agent-p"

    def register_memory(self, regs: list[Any], mem: str) -> None:
        return None

    def prep_xfer_dlist(self, agent: str, descs: Any, mem: str) -> np.ndarray:
        return np.asarray(descs, dtype=np.uint64).reshape(-1, 3)

    def add_remote_agent(self, meta: bytes) -> str:
        return meta.decode()

    def make_prepped_xfer(
        self, op: str, local: np.ndarray, li: Any, remote: np.ndarray, ri: Any, notif: bytes
    ) -> tuple[Any, ...]:
        return (op, local[np.asarray(li)], remote[np.asarray(ri)])

    def get_xfer_descs(self, descs: np.ndarray, mem: str) -> np.ndarray:
        return descs

    def initialize_xfer(
        self, op: str, local: np.ndarray, remote: np.ndarray, agent: str, notif: bytes
    ) -> tuple[Any, ...]:
        return (op, local, remote)

    def transfer(self, handle: tuple[Any, ...]) -> str:
        op, local, remote = handle
        assert len(local) == len(remote)
        for (la, ln, _), (ra, rn, _) in zip(local.tolist(), remote.tolist(), strict=True):
            assert ln == rn, (ln, rn)
            dst, src = (int(ra), int(la)) if op == "WRITE" else (int(la), int(ra))
            ctypes.memmove(dst, src, int(ln))
        return "DONE"

    def check_xfer_state(self, handle: Any) -> str:
        return "DONE"

    def release_xfer_handle(self, handle: Any) -> None:
        return None


def values(layer: int, first_head: int, heads: int, kv: int, tokens: int) -> torch.Tensor:
    """[tokens, heads, HEAD]: every element names its layer, head, K or V, token (exact in
    float32)."""
    head = torch.arange(first_head, first_head + heads).view(1, -1, 1)
    tok = torch.arange(tokens).view(-1, 1, 1)
    return (
        ((layer * 8 + head) * 2 + kv) * 10_000 + tok * HEAD + torch.arange(HEAD).view(1, 1, -1)
    ).float()


@functools.cache
def pattern(block: int) -> tuple[tuple[int, int], ...]:
    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype="auto"),
        model_config=SimpleNamespace(dtype=torch.float32),
    )
    return cpu_token_pattern(cfg, block, HEAD)


def caches(block: int, heads: int) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout [num_blocks, kv_heads, block_size, 2 * head_size] per layer."""
    return {f"l{i}": torch.full((NUM_BLOCKS, heads, block, 2 * HEAD), EMPTY) for i in range(LAYERS)}


def fill(
    c: dict[str, torch.Tensor], block: int, blocks: list[int], tokens: int, first_head: int = 0
) -> None:
    """What an engine of ``block`` tokens per block holds for a prompt in ``blocks``: the
    CPU attention kernel itself writes each token's K and V."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(torch.float32, block, HEAD)
    slots = torch.tensor(
        [blocks[t // block] * block + t % block for t in range(tokens)], dtype=torch.int64
    )
    for layer, t in enumerate(c.values()):
        heads = t.shape[1]
        k_cache, v_cache = t.view(NUM_BLOCKS, heads, 2 * block, HEAD).chunk(2, dim=2)
        key, val = (values(layer, first_head, heads, kv, tokens) for kv in (0, 1))
        ops.cpu_attn_reshape_and_cache(key, val, k_cache, v_cache, slots, isa)


def token_bytes(t: torch.Tensor, block: int, b: int, off: int) -> torch.Tensor:
    """Every element of token ``off`` of block ``b`` (as the probed order places them)."""
    owner = torch.tensor(owners(block))
    per_head = t[b].reshape(t.shape[1], -1)
    return per_head[:, owner == off]


def assert_tokens_match(
    got_caches: dict[str, torch.Tensor],
    want_caches: dict[str, torch.Tensor],
    d_block: int,
    d_blocks: list[int],
    tokens: range,
) -> None:
    """Each token of ``tokens`` (K and V) holds the same bytes in D's blocks as in a cache
    an engine of D's block size filled itself."""
    for got, exp in zip(got_caches.values(), want_caches.values(), strict=True):
        for tok in tokens:
            b, off = d_blocks[tok // d_block], tok % d_block
            assert torch.equal(
                token_bytes(got, d_block, b, off), token_bytes(exp, d_block, b, off)
            ), tok


_OWNERS: dict[int, list[int]] = {}


def owners(block: int) -> list[int]:
    """Which token owns each element of one head's block, in memory order."""
    if block not in _OWNERS:
        out: list[int] = []
        for groups, size in pattern(block):
            for _ in range(groups):
                out += [tok for tok in range(block) for _ in range(size)]
        _OWNERS[block] = out
    return _OWNERS[block]


def layout_of(
    c: dict[str, torch.Tensor], block: int, heads: int, total: int, tp: int, rank: int
) -> Layout:
    return layout_from_kv_caches(
        c,
        NUM_BLOCKS,
        "sig",
        {},
        Heads(
            heads, total, tp, rank, block_size=block, head_size=HEAD, token_pattern=pattern(block)
        ),
    )


def checksum(layout: Layout, blocks: list[int], regions: Any, units: int) -> int:
    shell = SimpleNamespace(transport=SimpleNamespace(layout=layout))
    return int(TransferPump._checksum(shell, blocks, regions, units))  # type: ignore[arg-type]


def push(
    p: Layout, d: Layout, p_blocks: list[int], d_blocks: list[int], first: int, tokens: int
) -> None:
    """P's transport WRITEs the units core.blocksize plans; P's and D's crc agree."""
    plan = blocksize.push_units(p, d, p_blocks, d_blocks, first, tokens)
    assert isinstance(plan, blocksize.Units), plan
    transport = NixlTransport(FakeAgent(), p, producer=True)
    peer = transport.connect(b"agent-d", d, "agent-d")
    assert peer.unit_tokens == min(p.block_size, d.block_size)
    assert transport.state(transport.post("WRITE", peer, plan.src, plan.dst)) == "DONE"
    crc_p = checksum(p, plan.src, peer.local.regions if peer.local else None, peer.local_k)
    kd = d.block_size // plan.unit_tokens
    pc = tpmap.piece(p.tp_rank, d.tp_rank, p.tp_size, d.tp_size, d.total_kv_heads)
    assert pc is not None
    view = head_slab(d, pc.d_first, pc.heads, pc.d_local).regions
    d_units = blocksize.expand(d_blocks, kd)[: len(plan.dst)]
    assert d_units == plan.dst
    assert checksum(d, d_units, view, kd) == crc_p


@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize(("p_block", "d_block"), [(32, 64), (64, 32), (32, 128)])
@pytest.mark.parametrize("tokens", [5, 33, 150, 250])
def test_d_holds_what_an_engine_of_its_block_size_would(
    heads: int, p_block: int, d_block: int, tokens: int
) -> None:
    p_blocks = [11, 3, 7, 0, 5, 9, 2, 8][: -(-tokens // p_block)]
    d_blocks = [4, 10, 1, 6, 2, 11, 0, 3][: -(-tokens // d_block)]
    pc, dc = caches(p_block, heads), caches(d_block, heads)
    fill(pc, p_block, p_blocks, tokens)
    p, d = (layout_of(pc, p_block, heads, heads, 1, 0), layout_of(dc, d_block, heads, heads, 1, 0))
    assert p.compat == d.compat and compat.layout_problem(p, d) == ""
    assert {r.tok_groups for r in p.regions + d.regions} == {(HEAD + 1) * heads}
    push(p, d, p_blocks, d_blocks, 0, tokens)
    want = caches(d_block, heads)
    fill(want, d_block, d_blocks, tokens)
    assert_tokens_match(dc, want, d_block, d_blocks, range(tokens))
    untouched = [b for b in range(NUM_BLOCKS) if b not in d_blocks]
    for got in dc.values():
        assert torch.all(got[untouched] == EMPTY)


@pytest.mark.parametrize(("p_block", "d_block"), [(32, 64), (64, 32)])
def test_a_d_prefix_hit_of_one_block_is_left_alone(p_block: int, d_block: int) -> None:
    tokens, heads = 170, 2
    p_blocks = list(range(-(-tokens // p_block)))
    d_all = [9, 4, 7, 1, 10, 2][: -(-tokens // d_block)]
    pc, dc = caches(p_block, heads), caches(d_block, heads)
    fill(pc, p_block, p_blocks, tokens)
    p, d = layout_of(pc, p_block, heads, heads, 1, 0), layout_of(dc, d_block, heads, heads, 1, 0)
    push(p, d, p_blocks, d_all[1:], 1, tokens)
    want = caches(d_block, heads)
    fill(want, d_block, d_all, tokens)
    for got in dc.values():
        assert torch.all(got[d_all[0]] == EMPTY)  # D had it already: never written
    assert_tokens_match(dc, want, d_block, d_all, range(d_block, tokens))


def test_two_p_ranks_of_block_32_fill_one_d_rank_of_block_64() -> None:
    total, tokens, p_block, d_block = 4, 150, 32, 64
    p_blocks, d_blocks = [5, 1, 8, 0, 3], [2, 7, 4]
    dc = caches(d_block, total)
    d = layout_of(dc, d_block, total, total, 1, 0)
    for s in range(2):
        pc = caches(p_block, 2)
        fill(pc, p_block, p_blocks, tokens, first_head=2 * s)
        p = layout_of(pc, p_block, 2, total, 2, s)
        assert compat.layout_problem(p, d) == ""
        push(p, d, p_blocks, d_blocks, 0, tokens)
    want = caches(d_block, total)
    fill(want, d_block, d_blocks, tokens)
    assert_tokens_match(dc, want, d_block, d_blocks, range(tokens))


def test_equal_block_sizes_keep_whole_block_descriptors() -> None:
    pc, dc = caches(32, 2), caches(32, 2)
    p, d = layout_of(pc, 32, 2, 2, 1, 0), layout_of(dc, 32, 2, 2, 1, 0)
    peer = NixlTransport(FakeAgent(), p).connect(b"agent-d", d, "agent-d")
    assert peer.unit_tokens == 0 and peer.local is None
    assert peer.dlist.shape == (LAYERS * NUM_BLOCKS, 3)


def test_unit_descriptor_counts() -> None:
    p, d = layout_of(caches(32, 2), 32, 2, 2, 1, 0), layout_of(caches(64, 2), 64, 2, 2, 1, 0)
    peer = NixlTransport(FakeAgent(), p).connect(b"agent-d", d, "agent-d")
    # region x unit x group: 2 layers x (12 blocks x 2 units) x 2 heads x (32 K + 1 V)
    # groups on D (the vec kernel's K is transposed: a group per element)
    groups = 2 * (HEAD + 1)
    assert peer.dlist.shape == (LAYERS * NUM_BLOCKS * 2 * groups, 3)
    assert peer.local_dlist.shape == (LAYERS * NUM_BLOCKS * groups, 3)


@pytest.mark.parametrize(
    ("shape", "groups"),
    [
        ((2, NUM_BLOCKS, 32, 4, 8), 1),  # NHD: tokens outermost in a block
        ((2, NUM_BLOCKS, 4, 32, 8), 4),  # HND: a group per head
        ((NUM_BLOCKS, 32, 576), 1),  # MLA latent
    ],
)
def test_token_geometry_of_gpu_layouts(shape: tuple[int, ...], groups: int) -> None:
    t = torch.zeros(shape)
    heads = 1 if len(shape) == 3 else 4
    lay = layout_from_kv_caches(
        {"l": t},
        NUM_BLOCKS,
        "sig",
        {},
        Heads(heads, heads, 1, 0, block_size=32, head_size=576 if len(shape) == 3 else 8),
    )
    assert {r.tok_groups for r in lay.regions} == {groups}
    assert lay.block_size == 32


def test_a_layout_whose_tokens_cannot_be_found_has_no_geometry() -> None:
    t = torch.zeros(NUM_BLOCKS, 32, 32, 8)  # two axes of the block size's length
    lay = layout_from_kv_caches(
        {"l": t}, NUM_BLOCKS, "sig", {}, Heads(1, 1, 1, 0, block_size=32, head_size=8)
    )
    assert {r.tok_groups for r in lay.regions} == {0}
    # the CPU backend's shape without a probed kernel order: unknown, never guessed
    cpu = layout_from_kv_caches(
        caches(32, 2), NUM_BLOCKS, "sig", {}, Heads(2, 2, 1, 0, block_size=32, head_size=HEAD)
    )
    assert {r.tok_groups for r in cpu.regions} == {0}
    assert "not known" in compat.layout_problem(cpu, layout_of(caches(64, 2), 64, 2, 2, 1, 0))


def test_the_probe_reads_the_vec_kernels_order() -> None:
    # K transposed (a group per element, one element per token), then V token by token
    assert pattern(32) == ((HEAD, 1), (1, HEAD))
    from kvpush_prod.transport.layout import token_pattern_of

    assert token_pattern_of([0, 1, 0, 1, 0, 0, 1, 1], 2) == ((2, 1), (1, 2))
    assert token_pattern_of([0, 1, 1, 0], 2) == ()


def test_the_layout_hash_no_longer_names_the_block_size() -> None:
    a = layout_of(caches(32, 2), 32, 2, 2, 1, 0)
    b = layout_of(caches(64, 2), 64, 2, 2, 1, 0)
    assert a.compat == b.compat
    flat = layout_from_kv_caches(caches(32, 2), NUM_BLOCKS, "sig", {}, Heads(2, 2, 1, 0))
    assert flat.compat != a.compat  # no token geometry: the old bytes-per-block hash


@pytest.mark.parametrize(("p_block", "d_block"), [(32, 64), (64, 32)])
def test_a_pull_fallback_reads_the_same_units_into_ds_blocks(p_block: int, d_block: int) -> None:
    tokens, heads = 150, 2
    p_blocks = [7, 2, 9, 4, 0][: -(-tokens // p_block)]
    d_blocks = [3, 8, 5, 1, 11][: -(-tokens // d_block)]
    pc, dc = caches(p_block, heads), caches(d_block, heads)
    fill(pc, p_block, p_blocks, tokens)
    p, d = layout_of(pc, p_block, heads, heads, 1, 0), layout_of(dc, d_block, heads, heads, 1, 0)
    plan = blocksize.push_units(p, d, p_blocks, d_blocks, 0, tokens)
    assert isinstance(plan, blocksize.Units)
    local = blocksize.pull_units(d, p, d_blocks, len(plan.src))  # what D's core reads into
    assert local == plan.dst
    transport = NixlTransport(FakeAgent(), d, producer=False)
    peer = transport.connect(b"agent-p", p, "agent-p")
    assert transport.state(transport.post("READ", peer, local, plan.src)) == "DONE"
    want = caches(d_block, heads)
    fill(want, d_block, d_blocks, tokens)
    assert_tokens_match(dc, want, d_block, d_blocks, range(tokens))
