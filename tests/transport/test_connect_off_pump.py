"""P's first NIXL connection to a decode engine is made off the transfer pump: over real NIXL
(three UCX agents in this process, loopback; the control channel and the pumps' passes by
hand, no vLLM), while P's connection to one D is held up, the pump posts and completes the
transfer of another D, byte for byte; the held D's transfer is pushed once its connection
lands."""

from __future__ import annotations

import itertools
import os
import threading
import time
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
from kvpush_prod.transport.base import RemotePeer

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl

from kvpush_prod.transport.nixl import NixlTransport, make_agent  # noqa: E402
from tests.connector.test_pump import CFG, Endpoint, Wire, _Rng  # noqa: E402
from tests.transport.test_post_nixl import Cache, cache, cpu  # noqa: E402

NUM_BLOCKS, BLOCK = 24, 16
SRC, DST = (1, 2, 3), (10, 11, 12)
BOUND_S = 60.0  # only a broken build gets near it
_tags = itertools.count()


class HeldConnects:
    """P's transport, whose connects to the agents in ``held`` wait until ``gate`` is set."""

    def __init__(self, inner: NixlTransport, held: str) -> None:
        self.inner, self.held = inner, held
        self.gate = threading.Event()
        self.waiting = threading.Event()  # a connect to the held agent has begun

    def connect(self, agent_meta: bytes, layout: m.Layout, expect_name: str = "") -> RemotePeer:
        if expect_name == self.held:
            self.waiting.set()
            assert self.gate.wait(BOUND_S), "the test never released the connect"
        return self.inner.connect(agent_meta, layout, expect_name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def until(step: Callable[[], None], what: Callable[[], bool]) -> None:
    """Pass the pumps (``step``) until ``what`` holds, within BOUND_S."""
    deadline = time.monotonic() + BOUND_S
    while not what():
        assert time.monotonic() < deadline, "nothing happened before the bound"
        step()
        time.sleep(0.001)


def holds(p: Cache, src: tuple[int, ...], d: Cache, dst: tuple[int, ...]) -> bool:
    """D's blocks ``dst`` hold P's blocks ``src``, region by region."""
    for rp, rd in zip(p.layout.regions, d.layout.regions, strict=True):
        for s, t in zip(src, dst, strict=True):
            a = p.offset(rp.base + s * rp.block_stride)
            b = d.offset(rd.base + t * rd.block_stride)
            if not bool((p.buf[a : a + rp.block_len] == d.buf[b : b + rd.block_len]).all()):
                return False
    return True


class Cluster:
    """P and two D's, each a real pump over its own NIXL agent."""

    def __init__(self) -> None:
        tag = f"{os.getpid()}-{next(_tags)}"
        self.wire = Wire()
        # Agent names are named for their control address (core.identity): one per run.
        self.control = {w: f"tcp://{w.lower()}-{tag}:1" for w in ("P", "D1", "D2")}
        self.made: list[NixlTransport] = []
        self.p_cache = cache(cpu(4, BLOCK), BLOCK, NUM_BLOCKS, 4, 4, 1, 0, 1)
        p_t = self._transport("P", self.control["P"], self.p_cache, producer=True)
        self.d_caches = {
            d: cache(cpu(4, BLOCK), BLOCK, NUM_BLOCKS, 4, 4, 1, 0, i + 10)
            for i, d in enumerate(("D1", "D2"))
        }
        d_ts = {
            d: self._transport(d, self.control[d], c, producer=False)
            for d, c in self.d_caches.items()
        }
        self.p_transport = HeldConnects(p_t, d_ts["D1"].name)
        block_bytes = sum(r.block_len for r in self.p_cache.layout.regions)
        settings = core_settings(CFG, block_bytes)
        self.p_stats = StatsBuffer()
        self.p = SenderPump(
            CFG,
            Sender(self._info("P", p_t), settings.sender, _Rng()),
            self.p_transport,  # type: ignore[arg-type]
            Endpoint(self.wire, self.control["P"]),  # type: ignore[arg-type]
            _Results(),
            self.p_stats,
        )
        self.d_results = {d: _Results() for d in d_ts}
        self.d = {
            d: ReceiverPump(
                CFG,
                Receiver(self._info(d, t), settings.receiver, _Rng()),
                t,
                Endpoint(self.wire, self.control[d]),  # type: ignore[arg-type]
                self.d_results[d],
                StatsBuffer(),
            )
            for d, t in d_ts.items()
        }

    def _transport(self, who: str, control: str, c: Cache, producer: bool) -> Any:
        agent = make_agent(agent_name(f"agent-{who}", control), "UCX", True, 1000)
        t = NixlTransport(agent, c.layout, producer=producer)
        self.made.append(t)
        return t

    def _info(self, who: str, t: NixlTransport) -> m.PeerInfo:
        control = self.control[who]
        return m.PeerInfo(who, 1, 0, control, t.name, t.metadata(), t.layout)

    def step(self) -> None:
        for pump in (self.p, *self.d.values()):
            with pump.lock:
                pump._pass(True)

    def until(self, what: Callable[[], bool]) -> None:
        until(self.step, what)

    def push(self, tid: str, d: str) -> None:
        self.d[d].request_of[tid] = f"{d}-{tid}"
        self.d[d].submit(RegisterBlocks(tid, self.control["P"], DST, 0, len(DST) * BLOCK))
        self.p.submit(ExpectBlocks(tid))
        self.step()
        self.p.request_of[tid] = f"p-{tid}"
        self.p.submit(BlocksReady(tid, SRC))
        self.p.submit(Hold(tid))

    def received(self, d: str) -> bool:
        outcomes = self.d_results[d].take_outcomes()
        assert set(outcomes.values()) <= {"pushed"}, outcomes
        return bool(outcomes)

    def landed(self, d: str) -> bool:
        """D's blocks DST hold P's blocks SRC, region by region."""
        return holds(self.p_cache, SRC, self.d_caches[d], DST)

    def close(self) -> None:
        self.p_transport.gate.set()
        for pump in (self.p, *self.d.values()):
            pump.connects.close()
        for t in self.made:
            t.close()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    yield c
    c.close()


def test_a_slow_connection_to_one_decode_does_not_hold_the_push_to_another(
    cluster: Cluster,
) -> None:
    c = cluster
    d1_agent = c.p_transport.held
    c.push("t1", "D1")  # P's first connection to D1 is held up
    c.until(c.p_transport.waiting.is_set)
    c.push("t2", "D2")
    done: list[bool] = []
    c.until(lambda: done.append(c.received("D2")) or done[-1])
    # D2's KV landed while P's connect to D1 still runs: the pump was not waiting for it.
    assert c.landed("D2") and not c.landed("D1")
    assert c.p.connects is not None and c.p.connects.pending(d1_agent)
    assert c.p.engine.connecting(d1_agent)
    c.p_transport.gate.set()
    done.clear()
    c.until(lambda: done.append(c.received("D1")) or done[-1])
    assert c.landed("D1")
    hist = [
        v for name, _, v in c.p_stats.drain().get("h", []) if name == "kvpush_peer_connect_seconds"
    ]
    assert len(hist) == 2  # one connection per decode engine
