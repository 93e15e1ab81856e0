"""Layer-wise push through the pumps (``push.layerwise``): ``save_kv_layer`` only hands the
layers computed so far to the pump; the pump posts each layer's regions; the last layer (with
DONE) goes after the forward; ``auto`` decides by tokens and measured bandwidth."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from kvpush_prod.config import config_from_extra
from kvpush_prod.config.core import layerwise_on
from kvpush_prod.connector.layerwise import LayerStep, layer_parts
from kvpush_prod.connector.metadata import SendSpec
from kvpush_prod.core import messages as m
from kvpush_prod.core.commands import Hold, RegisterBlocks
from kvpush_prod.transport.base import Op, RemotePeer
from tests.connector.test_after_forward import worker
from tests.connector.test_pump import Nic, Pair, Spans, Transport, counters

# Two layers, one region each: a 4 KiB block is two 2 KiB parts; a chunk is 4 KiB.
TWO = m.Layout("c", "DRAM", [m.Region(0, 2048, 2048, 64), m.Region(1 << 20, 2048, 2048, 64)])
CFG = config_from_extra(
    {"transport": {"progress_thread": True}, "push": {"chunk_bytes": 4096, "layerwise": "on"}}
)


class TwoLayers(Transport):
    def __init__(self, nic: Nic, name: str) -> None:
        super().__init__(nic, name)
        self.regions: list[tuple[int, int] | None] = []

    @property
    def layout(self) -> m.Layout:
        return TWO

    def post(
        self,
        op: Op,
        peer: RemotePeer,
        local_blocks: list[int],
        remote_blocks: list[int],
        notif: bytes = b"",
        regions: tuple[int, int] | None = None,
    ) -> Any:
        self.regions.append(regions)
        return super().post(op, peer, local_blocks, remote_blocks, notif)


def layer_worker(pair: Pair) -> Any:
    w = worker(pair)
    w.cfg, w._layers, w._step = CFG, {"l0": 0, "l1": 1}, None
    w.heads = type("H", (), {"block_size": 16})()
    return w


def test_save_kv_layer_only_hands_over_and_the_pump_posts_each_layer_then_done() -> None:
    pair = Pair(CFG, TwoLayers)
    tx: Any = pair.tx
    w = layer_worker(pair)
    pair.d.request_of["t"] = "d-t"
    pair.d.submit(RegisterBlocks("t", "tcp://p:1", (10, 11, 12), 0, 300))
    pair.step()
    w._pending_sends = [SendSpec("p-t", "t", [1, 2, 3])]
    w.layer_saved("l0")
    assert tx.posts == []  # the engine thread posted nothing itself
    pair.step()
    # Layer 0 (region 0) of the three blocks, in chunks of two: posted during the forward.
    assert tx.posts == [("WRITE", [1, 2], [10, 11]), ("WRITE", [3], [12])]
    assert tx.regions == [(0, 1), (0, 1)]
    w.layer_saved("l1")
    pair.step()
    assert tx.regions[2:] == [(1, 2)]  # layer 1's first chunk; its last (DONE) waits
    assert pair.d_results.take_outcomes() == {}
    w.after_forward()
    pair.p.submit(Hold("t"))
    pair.step(5)
    assert tx.regions == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert tx.posts[-1] == ("WRITE", [3], [12])
    assert pair.d_results.take_outcomes() == {"d-t": "pushed"}
    assert pair.p_results.take()[0] == {"p-t"}
    c = counters(pair.p_stats)
    assert c[("kvpush_layerwise_writes", "producer", "during_forward")] == 3
    assert c[("kvpush_layerwise_writes", "producer", "after_forward")] == 1


def test_the_trace_shows_layers_posted_and_landed_before_the_forward_ended() -> None:
    """The event trace (and so the transfer span) of a layer-wise push: ``layers_ready``
    (with the request's trace context), layer 0's WRITEs posted and landed (chunk_end with
    the transfer id), then ``forward_end`` from the engine thread, then blocks_ready."""
    pair = Pair(CFG, TwoLayers)
    w = layer_worker(pair)
    spans = w.trace.spans = pair.p.trace.spans = Spans()
    pair.d.request_of["t"] = "d-t"
    pair.d.submit(RegisterBlocks("t", "tcp://p:1", (10, 11, 12), 0, 300))
    pair.step()
    headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    w._pending_sends = [SendSpec("p-t", "t", [1, 2, 3], trace_headers=headers)]
    w.layer_saved("l0")
    pair.step()
    w.layer_saved("l1")
    w.after_forward()
    pair.p.submit(Hold("t"))
    pair.step(5)
    assert pair.d_results.take_outcomes() == {"d-t": "pushed"}
    mine = [(e, f) for e, tid, f in spans.events if tid == "t" and not e.startswith("msg_")]
    names = [e for e, _ in mine]
    assert names[0] == "layers_ready" and mine[0][1]["trace_headers"] == headers
    end = names.index("forward_end")
    assert mine[end][1]["trace_headers"] == headers
    before = mine[:end]
    assert [f["layer"] for e, f in before if e == "post"] == [0, 0]
    assert [e for e, f in before if e == "chunk_end" and f["state"] == "DONE"]
    assert [f["layer"] for e, f in mine[end:] if e == "post"] == [1, 1]
    assert names.index("blocks_ready") > end


def test_save_kv_layer_never_waits_for_the_lock_the_pump_holds() -> None:
    pair = Pair(CFG, TwoLayers)
    w = layer_worker(pair)
    w._pending_sends = [SendSpec("p-t", "t", [1, 2, 3])]
    held, release = threading.Event(), threading.Event()

    def pump_at_work() -> None:
        with pair.p.lock:
            held.set()
            release.wait(10)

    threading.Thread(target=pump_at_work, daemon=True).start()
    assert held.wait(5)
    w.layer_saved("l0")
    w.layer_saved("l1")  # returned: it never took the lock
    assert pair.p.request_of == {}
    release.set()


def test_a_forward_that_raises_after_a_layer_was_posted_fails_the_receive_once_drained() -> None:
    pair = Pair(CFG, TwoLayers)
    w = layer_worker(pair)
    pair.d.request_of["t"] = "d-t"
    pair.d.submit(RegisterBlocks("t", "tcp://p:1", (10, 11, 12), 0, 300))
    pair.step()
    w._pending_sends = [SendSpec("p-t", "t", [1, 2, 3])]
    w.layer_saved("l0")
    pair.step()
    w.after_forward(forward_failed=True)
    pair.p.submit(Hold("t"))
    pair.step(5)
    _, recving, failed = pair.d_results.take()
    assert recving == failed == {"d-t"}
    assert pair.p_results.take()[0] == {"p-t"}


def test_layers_are_told_in_order_from_the_first() -> None:
    step = LayerStep([], True)
    assert step.saved(1) == 0  # layer 0 not computed yet
    assert step.saved(0) == 2
    assert step.saved(3) == 0 and step.saved(2) == 4


@pytest.mark.parametrize(
    ("mode", "blocks", "bandwidth", "want"),
    [
        ("on", 1, 1e12, True),
        ("off", 1000, 1.0, False),
        ("auto", 10, 1e6, False),  # 160 tokens: under layerwise_min_tokens
        ("auto", 100, 1e12, False),  # 1600 tokens but a fast link: the transfer is too short
        ("auto", 100, 1e6, True),  # 1600 tokens, 400 KB at 1 MB/s: 400 ms of transfer
    ],
)
def test_auto_chooses_by_prompt_tokens_and_measured_bandwidth(
    mode: str, blocks: int, bandwidth: float, want: bool
) -> None:
    assert layerwise_on(mode, blocks, 4096, 16, bandwidth, 1024, 2.0) is want


def test_layer_parts_maps_each_layer_to_its_regions_or_refuses() -> None:
    kv = {f"l{i}": torch.zeros(4, 8) for i in range(3)}
    regions = [m.Region(t.data_ptr(), 32, 32, 4) for t in kv.values()]
    lay = m.Layout("c", "DRAM", regions)
    assert layer_parts(kv, lay, "cpu") == {"l0": 0, "l1": 1, "l2": 2}
    assert layer_parts(kv, lay, "cuda") == {}
    assert layer_parts(kv, m.Layout("c", "DRAM", regions[:2]), "cpu") == {}
    shared = m.Layout("c", "DRAM", [regions[0]] * 3)
    assert layer_parts(kv, shared, "cpu") == {}


def test_push_layerwise_takes_yaml_switches_and_names_a_bad_value() -> None:
    from kvpush_prod.errors import ConfigError

    assert config_from_extra({"push": {"layerwise": True}}).push.layerwise == "on"
    assert config_from_extra({"push": {"layerwise": False}}).push.layerwise == "off"
    assert config_from_extra({}).push.layerwise == "off"
    with pytest.raises(ConfigError, match=r"push.layerwise = 'sometimes'.*'off', 'on' or 'auto'"):
        config_from_extra({"push": {"layerwise": "sometimes"}})
