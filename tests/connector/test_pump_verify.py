"""Pushed and pulled KV are checked on D before any of it becomes usable: the prompt digest P
states must be D's own prompt's, and with ``verify.checksums`` the bytes D ends with must be
the bytes P computed, whether they were written by P or read by D after a fallback."""

from __future__ import annotations

import ctypes
from typing import Any

from kvpush_prod.config import config_from_extra
from kvpush_prod.core import messages as m
from kvpush_prod.core.commands import BlocksReady, ExpectBlocks, Hold, RegisterBlocks
from kvpush_prod.core.digest import prompt_digest
from kvpush_prod.transport.base import Op, RemotePeer
from tests.connector import test_pump as pump_test
from tests.connector.test_pump import Nic, Transport, counters

BLOCK, NBLOCKS = 100, 64
CFG = config_from_extra(
    {
        "transport": {"progress_thread": True},
        "push": {"chunk_bytes": 4096},
        "verify": {"checksums": True},
    }
)


class Memory(Transport):
    """The fake NIXL with real bytes: each agent's KV region is a buffer, and a WRITE or a
    READ copies whole blocks between them (``corrupt``: the READs flip a byte)."""

    buffers: dict[str, Any] = {}

    def __init__(self, nic: Nic, name: str) -> None:
        super().__init__(nic, name)
        self.buf = ctypes.create_string_buffer(BLOCK * NBLOCKS)
        Memory.buffers[name] = self.buf
        self.corrupt = False
        self._layout = m.Layout(
            "c", "DRAM", [m.Region(ctypes.addressof(self.buf), BLOCK, BLOCK, NBLOCKS)]
        )

    @property
    def layout(self) -> m.Layout:
        return self._layout

    def fill(self, block: int, byte: int) -> None:
        ctypes.memset(ctypes.addressof(self.buf) + block * BLOCK, byte, BLOCK)

    def post(
        self,
        op: Op,
        peer: RemotePeer,
        local_blocks: list[int],
        remote_blocks: list[int],
        notif: bytes = b"",
    ) -> Any:
        handle = super().post(op, peer, local_blocks, remote_blocks, notif)
        here, there = self.buf, Memory.buffers[peer.agent_name]
        src, dst = (here, there) if op == "WRITE" else (there, here)
        for s, d in zip(
            local_blocks if op == "WRITE" else remote_blocks,
            remote_blocks if op == "WRITE" else local_blocks,
            strict=True,
        ):
            ctypes.memmove(
                ctypes.addressof(dst) + d * BLOCK, ctypes.addressof(src) + s * BLOCK, BLOCK
            )
            if op == "READ" and self.corrupt:
                ctypes.memset(ctypes.addressof(dst) + d * BLOCK, 0xEE, 1)
        return handle


class Pair(pump_test.Pair):
    def __init__(self) -> None:
        super().__init__(CFG, Memory, BLOCK)
        for b, byte in ((1, 0x11), (2, 0x22), (3, 0x33)):
            self.tx.fill(b, byte)

    def push(self, d_prompt: bytes = b"", p_prompt: bytes = b"") -> None:
        self.d.request_of["t"] = "d-t"
        self.d.submit(RegisterBlocks("t", "tcp://p:1", (10, 11, 12), 0, 300, "", d_prompt))
        self.p.submit(ExpectBlocks("t"))
        self.step()
        self.p.request_of["t"] = "p-t"
        self.p.run_now(BlocksReady("t", (1, 2, 3), "", p_prompt))
        self.p.submit(Hold("t"))
        self.step(20)

    def d_block(self, b: int) -> bytes:
        return ctypes.string_at(ctypes.addressof(self.rx.buf) + b * BLOCK, BLOCK)


def test_a_push_for_the_same_prompt_with_the_same_bytes_is_taken() -> None:
    pair = Pair()
    pair.push(prompt_digest([5, 6]), prompt_digest([5, 6]))
    assert pair.d_results.take_outcomes() == {"d-t": "pushed"}
    assert pair.d_block(12) == bytes([0x33]) * BLOCK


def test_kv_computed_for_another_prompt_fails_the_receive_and_is_counted() -> None:
    pair = Pair()
    pair.push(prompt_digest([5, 6]), prompt_digest([5, 7]))
    _, recving, failed = pair.d_results.take()
    assert recving == {"d-t"} and failed == {"d-t"}
    assert (
        counters(pair.d_stats)[("kvpush_control_messages_rejected", "consumer", "prompt_mismatch")]
        == 1
    )
    assert pair.p_results.take()[0] == {"p-t"}  # P's blocks come back all the same


def test_pulled_blocks_are_verified_like_pushed_ones() -> None:
    for corrupt in (False, True):
        pair = Pair()
        pair.tx.post_error = RuntimeError("NIXL_ERR_NOT_FOUND: gone")  # every WRITE: D pulls
        pair.rx.corrupt = corrupt
        pair.push()
        _, recving, failed = pair.d_results.take()
        assert recving == {"d-t"}
        assert {p[0] for p in pair.rx.posts} == {"READ"}
        if not corrupt:
            assert failed == set() and pair.d_block(11) == bytes([0x22]) * BLOCK
            continue
        assert failed == {"d-t"}
        assert (
            counters(pair.d_stats)[
                ("kvpush_control_messages_rejected", "consumer", "checksum_mismatch")
            ]
            == 1
        )
