"""P's hand-over after the forward: whatever raises in it, every prompt of the step still gets
an end (its decode engine hears, its blocks come back), and a transfer id another request
pushes is never taken over."""

from __future__ import annotations

from typing import Any

from kvpush_prod.connector.metadata import SendSpec
from kvpush_prod.connector.worker import WorkerSide
from kvpush_prod.core.commands import Hold, RegisterBlocks
from kvpush_prod.core.vocabulary import Side
from kvpush_prod.metrics import StatsBuffer
from kvpush_prod.trace import Tracer
from tests.connector.test_pump import Pair, counters


def worker(pair: Pair) -> Any:
    w: Any = object.__new__(WorkerSide)
    w.role, w._tx, w._rx, w._device = Side.PRODUCER, pair.p, None, "cpu"
    w.results, w.stats, w.trace = pair.p_results, StatsBuffer(), Tracer("")
    w._pending_sends, w._layers, w._step = [], {}, None
    return w


def test_a_hand_over_that_raises_still_ends_every_push_and_frees_its_blocks() -> None:
    pair = Pair()
    w = worker(pair)
    pair.d.request_of["t"] = "d-t"
    pair.d.submit(RegisterBlocks("t", "tcp://p:1", (10, 11, 12), 0, 300))
    pair.step()

    def broken(tid: str) -> Any:
        raise RuntimeError("a bug in our bookkeeping")

    pair.p.splits.note = broken  # type: ignore[method-assign]
    w._pending_sends = [SendSpec("p-t", "t", [1, 2, 3])]
    w.after_forward()  # contained in the pump: the engine's step goes on
    assert w._pending_sends == []
    assert counters(pair.p_stats)[("kvpush_pump_errors", "producer", "command")] == 1
    pair.p.submit(Hold("t"))  # the request finished: its blocks are the core's
    pair.step(5)
    assert pair.tx.posts == []  # nothing of a prompt the hand-over lost is written
    assert pair.p_results.take()[0] == {"p-t"}  # ... and its blocks come back
    _, recving, failed = pair.d_results.take()
    assert recving == failed == {"d-t"}  # D heard at once (it recomputes)


def test_a_transfer_id_another_request_pushes_is_not_taken_over() -> None:
    pair = Pair()
    w = worker(pair)
    pair.p.request_of["t"] = "first"
    w._pending_sends = [SendSpec("second", "t", [4, 5])]
    w.after_forward()
    assert pair.p.request_of["t"] == "first"
    assert pair.p_results.take()[0] == {"second"}  # its blocks are free at once
    assert pair.tx.posts == []


def test_the_engine_thread_never_waits_for_the_lock_the_pump_holds() -> None:
    """While the pump works (its lock held, as through a flood), the engine thread's step
    calls return at once; what they handed over runs in the pump's next pass, in order."""
    import threading
    import time

    from kvpush_prod.connector.metadata import PushMetadata, RecvSpec

    pair = Pair()
    p, d = worker(pair), worker(pair)
    d.role, d._tx, d._rx, d.results, d.layout = Side.CONSUMER, None, pair.d, pair.d_results, None
    d.tp_rank, d.tp_size, d.offered = 0, 1, None
    held, release = threading.Event(), threading.Event()

    def pump_at_work(pump: Any) -> None:
        with pump.lock:
            held.set()
            release.wait(10)

    for pump in (pair.p, pair.d):
        held.clear()
        threading.Thread(target=pump_at_work, args=(pump,), daemon=True).start()
        assert held.wait(5)
        t0 = time.monotonic()
        if pump is pair.d:
            d.on_metadata(PushMetadata(recv=[RecvSpec("d-t", "t", "p", 1, [10, 11, 12], 0, 300)]))
            d.get_finished()
        else:
            p.on_metadata(PushMetadata(expect_send=[("t", "")]))
            p._pending_sends = [SendSpec("p-t", "t", [1, 2, 3])]
            p.after_forward()
            p.get_finished()
        assert time.monotonic() - t0 < 0.5  # nothing waited for the pump's lock
        assert pump.request_of == {}  # ... nor touched the pump's tables
        release.set()
        time.sleep(0.05)
        release.clear()
    pair.step(5)  # the pump's passes run what was handed over: the push happens
    assert pair.tx.posts == [("WRITE", [1], [10]), ("WRITE", [2], [11]), ("WRITE", [3], [12])]
    assert pair.d_results.take_outcomes() == {"d-t": "pushed"}
