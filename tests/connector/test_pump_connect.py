"""P's pump connects to D on a connect thread (fake NIXL and control channel): a connect
past ``transport.connect_timeout_s`` gives the waiting transfer up to D's pull, counted and
logged, and the connection that lands late carries the next transfer as a push."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kvpush_prod.config import config_from_extra
from kvpush_prod.connector.worker import SenderPump
from kvpush_prod.core import messages as m
from kvpush_prod.transport.base import RemotePeer

from .test_pump import Pair, Transport, counters

BOUND_S = 30.0  # only a broken build waits this long
CFG = config_from_extra(
    {
        "transport": {"progress_thread": True, "connect_timeout_s": 0.1},
        "push": {"chunk_bytes": 4096},
    }
)


class HeldTransport(Transport):
    """P's fake NIXL, whose connects wait until ``gate`` is set."""

    gate = threading.Event()

    def connect(self, agent_meta: bytes, layout: m.Layout, expect_name: str = "") -> RemotePeer:
        assert HeldTransport.gate.wait(BOUND_S)
        return super().connect(agent_meta, layout, expect_name)


class ThreadedPair(Pair):
    """The Pair, with P's pump connecting on its real connect threads."""

    def __init__(self) -> None:
        HeldTransport.gate = threading.Event()
        super().__init__(
            CFG,
            transport=lambda nic, name: (HeldTransport if "P" in name else Transport)(nic, name),
        )
        p = self.p
        self.p = SenderPump(p.cfg, p.engine, p.transport, p.endpoint, self.p_results, self.p_stats)

    def until(self, what: Callable[[], Any]) -> Any:
        deadline = time.monotonic() + BOUND_S
        while not (got := what()):
            assert time.monotonic() < deadline, "nothing happened before the bound"
            self.step(1)
            time.sleep(0.005)
        return got


def test_a_connect_past_its_bound_falls_back_and_the_late_connection_is_used_next() -> None:
    pair = ThreadedPair()
    pair.push("t1")
    outcomes = pair.until(pair.d_results.take_outcomes)
    assert outcomes == {"d-t1": "pull_fallback"}  # D read the KV P could not write
    c = counters(pair.p_stats)
    assert c[("kvpush_peer_connect_failures", "producer", "timeout")] == 1
    HeldTransport.gate.set()  # the connect lands, late
    pair.until(lambda: not pair.p.connects.pending(pair.rx.name))
    pair.step(2)
    pair.push("t2")
    assert pair.until(pair.d_results.take_outcomes) == {"d-t2": "pushed"}
