"""P's hand-over after the forward: whatever raises in it, every prompt of the step still gets
an end (its decode engine hears, its blocks come back), and a transfer id another request
pushes is never taken over."""

from __future__ import annotations

from typing import Any

import pytest

from kvpush_prod.connector.metadata import SendSpec
from kvpush_prod.connector.worker import WorkerSide
from kvpush_prod.core.commands import Hold, RegisterBlocks
from kvpush_prod.core.vocabulary import Side
from kvpush_prod.metrics import StatsBuffer
from kvpush_prod.trace import Tracer
from tests.connector.test_pump import Pair


def worker(pair: Pair) -> Any:
    w: Any = object.__new__(WorkerSide)
    w.role, w._tx, w._rx, w._device = Side.PRODUCER, pair.p, None, "cpu"
    w.results, w.stats, w.trace = pair.p_results, StatsBuffer(), Tracer("")
    w._pending_sends = []
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
    with pytest.raises(RuntimeError):
        w.after_forward()
    assert w._pending_sends == []
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
