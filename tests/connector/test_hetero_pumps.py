"""Different tensor-parallel sizes through the worker shell and real pumps (fake NIXL and
control channel, stepped by hand): P TP 2 -> D TP 1 (one D rank, two parts joined) and
P TP 1 -> D TP 2 (one P rank splits its transfer per D rank, releases after both)."""

from __future__ import annotations

from typing import Any

import msgspec

from kvpush_prod.config.core import core_settings
from kvpush_prod.connector.metadata import PeerRef, PushMetadata, RecvSpec, SendSpec
from kvpush_prod.connector.worker import WorkerSide
from kvpush_prod.core import messages as m
from kvpush_prod.core.identity import agent_name
from kvpush_prod.core.links import Splits
from kvpush_prod.core.receiver import Receiver
from kvpush_prod.core.sender import Sender
from kvpush_prod.core.vocabulary import Notice, Side
from kvpush_prod.transport.base import RemotePeer

from .test_pump import (
    CFG,
    Endpoint,
    Nic,
    SteppedReceiverPump,
    SteppedSenderPump,
    Transport,
    Wire,
    _Rng,
)

TOTAL_HEADS = 2


def layout(tp: int, rank: int) -> m.Layout:
    local = TOTAL_HEADS // tp
    return m.Layout(
        "c",
        "DRAM",
        [m.Region(0, 100, 50 * local, 64)],
        tp_size=tp,
        tp_rank=rank,
        kv_heads=local,
        total_kv_heads=TOTAL_HEADS,
    )


class TpTransport(Transport):
    def __init__(self, nic: Nic, name: str, lay: m.Layout) -> None:
        super().__init__(nic, name)
        self._lay = lay
        self.views: list[tuple[m.Layout, m.Layout]] = []

    @property
    def layout(self) -> m.Layout:
        return self._lay

    def connect(self, agent_meta: bytes, lay: m.Layout, expect_name: str = "") -> RemotePeer:
        from kvpush_prod.transport.layout import pair_views

        local, remote = pair_views(
            self._lay, lay, producer=self._lay is not None and self.side_is_p
        )
        self.views.append((local, remote))
        return RemotePeer(expect_name, remote, None, local)

    side_is_p = True


class World:
    def __init__(self, p_tp: int, d_tp: int) -> None:
        self.wire, self.nic = Wire(), Nic()
        settings = core_settings(CFG, 4096)
        self.p: list[WorkerSide] = []
        self.d: list[WorkerSide] = []
        for role, tp, out in ((Side.PRODUCER, p_tp, self.p), (Side.CONSUMER, d_tp, self.d)):
            for rank in range(tp):
                host = "p" if role is Side.PRODUCER else "d"
                control = f"tcp://{host}:{1 + rank}"
                lay = layout(tp, rank)
                me = m.PeerInfo(
                    host.upper(),
                    1,
                    rank,
                    control,
                    agent_name(f"agent-{host}{rank}", control),
                    b"meta",
                    lay,
                )
                t = TpTransport(self.nic, me.agent_name, lay)
                t.side_is_p = role is Side.PRODUCER
                ws = WorkerSide(CFG, role, host.upper(), rank, tp, 0, "sig", 64)
                ws.layout = lay
                ep: Any = Endpoint(self.wire, control)
                if role is Side.PRODUCER:
                    ws._tx = SteppedSenderPump(
                        CFG, Sender(me, settings.sender, _Rng()), t, ep, ws.results, ws.stats
                    )
                    ws._tx.splits = Splits(rank, tp, TOTAL_HEADS)
                else:
                    ws._rx = SteppedReceiverPump(
                        CFG, Receiver(me, settings.receiver, _Rng()), t, ep, ws.results, ws.stats
                    )
                out.append(ws)

    def step(self, n: int = 4) -> None:
        for _ in range(n):
            for ws in self.p + self.d:
                pump = ws._tx or ws._rx
                assert pump is not None
                with pump.lock:
                    pump._pass(True)

    def run(self, p_tp: int, blocks_ready_first: bool = False) -> None:
        recv = PushMetadata(recv=[RecvSpec("d-req", "t", "p", 1, [10, 11], 0, 200, p_tp=p_tp)])
        for ws in self.p:
            ws.on_metadata(PushMetadata(expect_send=[("t", "")]))
        if not blocks_ready_first:
            for ws in self.d:
                ws.on_metadata(recv)
            self.step()
        for ws in self.p:
            ws.on_metadata(PushMetadata(send=[SendSpec("p-req", "t", [1, 2])], hold=["t"]))
            ws.after_forward()
        if blocks_ready_first:
            for ws in self.d:
                ws.on_metadata(recv)
        self.step(8)

    def posts(self, ws: WorkerSide) -> list[Any]:
        pump = ws._tx or ws._rx
        assert pump is not None
        t = pump.transport
        assert isinstance(t, TpTransport)
        return t.posts


def test_two_p_ranks_fill_one_d_rank_and_d_reports_once_both_arrived() -> None:
    w = World(2, 1)
    w.run(p_tp=2)
    for ws in w.p:
        assert w.posts(ws) == [("WRITE", [1], [10]), ("WRITE", [2], [11])]
        # P's whole block into this rank's half of D's block.
        t = ws._tx.transport  # type: ignore[union-attr]
        assert isinstance(t, TpTransport)
        ((local, remote),) = t.views
        assert local.regions[0].block_len == 50 and remote.regions[0].block_len == 50
        assert remote.regions[0].base == 50 * ws.tp_rank
        assert ws.results.take()[0] == {"p-req"}
    sending, recving, failed = w.d[0].results.take()
    assert recving == {"d-req"} and not failed
    assert w.d[0].results.take_outcomes() == {"d-req": "pushed"}
    drained = {(n, *lab): v for n, lab, v in w.d[0].stats.drain().get("c", [])}
    assert drained[("kvpush_transfers", "consumer", "pushed")] == 1  # one request, once


def test_one_p_rank_feeds_two_d_ranks_and_releases_after_both() -> None:
    w = World(1, 2)
    w.run(p_tp=1)
    (p,) = w.p
    assert sorted(w.posts(p)) == sorted([("WRITE", [1], [10]), ("WRITE", [2], [11])] * 2)
    assert p.results.take()[0] == {"p-req"}
    for ws in w.d:
        assert ws.results.take()[1] == {"d-req"}
    t = p._tx.transport  # type: ignore[union-attr]
    assert isinstance(t, TpTransport)
    # Each D rank gets its own half of P's blocks.
    assert sorted(lv.regions[0].base for lv, _ in t.views) == [0, 50]


def test_p_splits_even_when_its_blocks_were_ready_before_any_register() -> None:
    w = World(1, 2)
    w.run(p_tp=1, blocks_ready_first=True)
    (p,) = w.p
    assert len(w.posts(p)) == 4
    assert p.results.take()[0] == {"p-req"}
    for ws in w.d:
        assert ws.results.take()[1] == {"d-req"}


def test_a_prefill_size_that_cannot_map_fails_the_receive_at_once() -> None:
    w = World(1, 2)
    bad = PushMetadata(recv=[RecvSpec("d-req", "t", "p", 1, [10, 11], 0, 200, p_tp=3)])
    for ws in w.d:
        ws.on_metadata(bad)
    w.step()  # the pumps run the step's plan
    for ws in w.d:
        _, recving, failed = ws.results.take()
        assert recving == {"d-req"} and failed == {"d-req"}


def test_a_refused_size_lets_every_p_rank_free_its_blocks_at_once() -> None:
    w = World(1, 2)
    (p,) = w.p
    p.on_metadata(
        PushMetadata(expect_send=[("t", "")], send=[SendSpec("p-req", "t", [1, 2])], hold=["t"])
    )
    p.after_forward()
    w.step()
    bad = PushMetadata(recv=[RecvSpec("d-req", "t", "p", 1, [10, 11], 0, 200, p_tp=3)])
    for ws in w.d:
        ws.on_metadata(bad)
    w.step(8)
    # P rank 0 freed its blocks without a WRITE (not at the end of its send lease) ...
    assert p.results.take()[0] == {"p-req"} and w.posts(p) == []
    # ... and P ranks 1 and 2 were told too, each once (by D rank 1 and D rank 0).
    for rank in (1, 2):
        (msg,) = w.wire.inbox[f"tcp://p:{1 + rank}"]
        assert isinstance(msg, m.Cancel) and msg.transfer_id == "t"
        assert msg.reason == "not_needed"


def test_a_prefix_hit_from_a_refused_size_also_frees_every_p_rank() -> None:
    w = World(1, 2)
    for ws in w.d:
        ws.on_metadata(PushMetadata(notices=[(PeerRef("t", "p", 1, p_tp=3), Notice.NOT_NEEDED)]))
        ws._rx._pass(True)  # type: ignore[union-attr]
    assert sorted(
        a
        for a, box in w.wire.inbox.items()
        if a.startswith("tcp://p:") and any(isinstance(x, m.Cancel) for x in box)
    ) == ["tcp://p:1", "tcp://p:2", "tcp://p:3"]


def test_a_p_rank_that_feeds_no_d_rank_is_told_at_once() -> None:
    # Replicated KV (MLA) from P TP 2 to D TP 1: D reads rank 0; rank 1 holds the blocks too.
    w = World(2, 1)
    (d,) = w.d
    d.layout = msgspec.structs.replace(layout(1, 0), replicated=True)
    d.on_metadata(PushMetadata(recv=[RecvSpec("d-req", "t", "p", 1, [10, 11], 0, 200, p_tp=2)]))
    d._rx._pass(True)  # type: ignore[union-attr]
    kinds = {
        address: [type(x) for x in w.wire.inbox[address] if not isinstance(x, m.Heartbeat)]
        for address in ("tcp://p:1", "tcp://p:2")
    }
    assert kinds == {"tcp://p:1": [m.Register], "tcp://p:2": [m.Cancel]}
    (msg,) = [x for x in w.wire.inbox["tcp://p:2"] if isinstance(x, m.Cancel)]
    assert msg.reason == "not_needed" and msg.transfer_id == "t"


def test_one_part_failing_fails_the_request_only_after_the_other_part_ended() -> None:
    w = World(2, 1)
    # P rank 1 never gets its blocks: its part ends by a Failed (prefill aborted).
    recv = PushMetadata(recv=[RecvSpec("d-req", "t", "p", 1, [10, 11], 0, 200, p_tp=2)])
    w.d[0].on_metadata(recv)
    w.step()
    w.p[0].on_metadata(
        PushMetadata(expect_send=[("t", "")], send=[SendSpec("p-req", "t", [1, 2])], hold=["t"])
    )
    w.p[0].after_forward()
    w.step(8)
    assert w.d[0].results.take()[1] == set()  # P rank 1's part is still open: no report
    w.p[1].on_metadata(PushMetadata(abort_send=["t"]))
    w.step(8)
    _, recving, failed = w.d[0].results.take()
    assert recving == {"d-req"} and failed == {"d-req"}


def test_layout_fields_round_trip_on_the_wire() -> None:
    lay = layout(2, 1)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(lay), type=m.Layout)
    assert back == lay
