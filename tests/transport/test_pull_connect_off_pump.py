"""D's NIXL connection to the prefill engine it pulls from is made off D's transfer pump: over
real NIXL (two UCX agents in this process, loopback; the control channel and the pumps'
passes by hand, no vLLM). P's first WRITE fails with an error that sends the transfer to D's
pull (a FALLBACK); while D's connection to P is held up, D's pump receives another push from
the same P, byte for byte; the pull reads its blocks once the connection lands."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvpush_prod.config.core import core_settings
from kvpush_prod.connector.worker import ReceiverPump, SenderPump, _Results
from kvpush_prod.core import messages as m
from kvpush_prod.core.commands import BlocksReady, ExpectBlocks, Hold, RegisterBlocks
from kvpush_prod.core.identity import agent_name
from kvpush_prod.core.receiver import Receiver
from kvpush_prod.core.sender import Sender
from kvpush_prod.metrics import StatsBuffer
from kvpush_prod.transport.faults import FaultSettings, FaultyTransport

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl

from kvpush_prod.transport.nixl import NixlTransport, make_agent  # noqa: E402
from tests.connector.test_pump import CFG, Endpoint, Wire, _Rng  # noqa: E402
from tests.transport.test_connect_off_pump import HeldConnects, holds, until  # noqa: E402
from tests.transport.test_post_nixl import Cache, cache, cpu  # noqa: E402

NUM_BLOCKS, BLOCK = 24, 16
SRC = (1, 2, 3)
DST = {"t1": (10, 11, 12), "t2": (14, 15, 16)}
_tags = itertools.count()


class Pair:
    """P and D, each a real pump over its own NIXL agent; P's first WRITE fails (an error
    the classification sends to D's pull), D's connects to P wait for ``gate``."""

    def __init__(self) -> None:
        tag = f"{os.getpid()}-{next(_tags)}"
        self.wire = Wire()
        self.control = {w: f"tcp://{w.lower()}-pull-{tag}:1" for w in ("P", "D")}
        self.made: list[NixlTransport] = []
        self.p_cache = cache(cpu(4, BLOCK), BLOCK, NUM_BLOCKS, 4, 4, 1, 0, 1)
        self.d_cache = cache(cpu(4, BLOCK), BLOCK, NUM_BLOCKS, 4, 4, 1, 0, 20)
        p_t = self._transport("P", self.p_cache, producer=True)
        d_t = self._transport("D", self.d_cache, producer=False)
        faults = FaultSettings(enabled=True, op="WRITE", fail_nth=1, error="injected_unknown")
        self.d_transport = HeldConnects(d_t, p_t.name)
        settings = core_settings(CFG, sum(r.block_len for r in self.p_cache.layout.regions))
        self.p = SenderPump(
            CFG,
            Sender(self._info("P", p_t), settings.sender, _Rng()),
            FaultyTransport(p_t, faults),  # type: ignore[arg-type]
            Endpoint(self.wire, self.control["P"]),  # type: ignore[arg-type]
            _Results(),
            StatsBuffer(),
        )
        self.d_results = _Results()
        self.d_stats = StatsBuffer()
        self.d = ReceiverPump(
            CFG,
            Receiver(self._info("D", d_t), settings.receiver, _Rng()),
            self.d_transport,  # type: ignore[arg-type]
            Endpoint(self.wire, self.control["D"]),  # type: ignore[arg-type]
            self.d_results,
            self.d_stats,
        )
        self.outcomes: dict[str, str] = {}

    def _transport(self, who: str, c: Cache, producer: bool) -> Any:
        agent = make_agent(agent_name(f"agent-{who}", self.control[who]), "UCX", True, 1000)
        t = NixlTransport(agent, c.layout, producer=producer)
        self.made.append(t)
        return t

    def _info(self, who: str, t: NixlTransport) -> m.PeerInfo:
        return m.PeerInfo(who, 1, 0, self.control[who], t.name, t.metadata(), t.layout)

    def step(self) -> None:
        for pump in (self.p, self.d):
            with pump.lock:
                pump._pass(True)
        self.outcomes.update({tid[2:]: o for tid, o in self.d_results.take_outcomes().items()})

    def until(self, what: Callable[[], bool]) -> None:
        until(self.step, what)

    def push(self, tid: str) -> None:
        self.d.request_of[tid] = f"d-{tid}"
        self.d.submit(RegisterBlocks(tid, self.control["P"], DST[tid], 0, len(SRC) * BLOCK))
        self.p.submit(ExpectBlocks(tid))
        self.step()
        self.p.request_of[tid] = f"p-{tid}"
        self.p.submit(BlocksReady(tid, SRC))
        self.p.submit(Hold(tid))

    def landed(self, tid: str) -> bool:
        """D's blocks of ``tid`` hold P's blocks SRC, region by region."""
        return holds(self.p_cache, SRC, self.d_cache, DST[tid])

    def close(self) -> None:
        self.d_transport.gate.set()
        for pump in (self.p, self.d):
            if pump.connects is not None:
                pump.connects.close()
        for t in self.made:
            t.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def test_a_slow_connection_for_a_pull_does_not_hold_the_receive_of_a_push(pair: Pair) -> None:
    c = pair
    p_agent = c.d_transport.held
    c.push("t1")  # P's WRITE fails: FALLBACK; D's connection to P is held up
    c.until(c.d_transport.waiting.is_set)
    c.push("t2")
    c.until(lambda: "t2" in c.outcomes)
    # t2's KV landed and was reported while D's connect to P still runs.
    assert c.outcomes == {"t2": "pushed"} and c.landed("t2") and not c.landed("t1")
    assert c.d.connects is not None and c.d.connects.pending(p_agent)
    c.d_transport.gate.set()
    c.until(lambda: "t1" in c.outcomes)
    assert c.outcomes["t1"] == "pull_fallback" and c.landed("t1")
    hist = [
        v for name, _, v in c.d_stats.drain().get("h", []) if name == "kvpush_peer_connect_seconds"
    ]
    assert len(hist) == 1  # one connection to the prefill engine
