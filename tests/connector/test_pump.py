"""The transfer pump as the driver's Effects, with a fake NIXL and control channel: P and
D pumps push a prompt end to end, and what breaks is contained, counted and fed back."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from kvpush_prod.config import config_from_extra
from kvpush_prod.config.core import core_settings
from kvpush_prod.connector.worker import ReceiverPump, SenderPump, _Results
from kvpush_prod.core import messages as m
from kvpush_prod.core.commands import AbortReceive, BlocksReady, ExpectBlocks, Hold, RegisterBlocks
from kvpush_prod.core.identity import agent_name
from kvpush_prod.core.receiver import Receiver
from kvpush_prod.core.retry import ChunkError, ErrorKind
from kvpush_prod.core.sender import Sender
from kvpush_prod.core.vocabulary import Outcome
from kvpush_prod.metrics import TABLES, StatsBuffer
from kvpush_prod.transport.base import ChunkFailed, Completion, Op, RemotePeer

LAYOUT = m.Layout("c", "DRAM", [m.Region(0, 100, 100, 64)])
# One 4 KiB block per chunk: a prompt of three blocks is three chunks, the last with DONE.
CFG = config_from_extra({"transport": {"progress_thread": True}, "push": {"chunk_bytes": 4096}})


class Wire:
    """The control network: what each address's endpoint has to read."""

    def __init__(self) -> None:
        self.inbox: dict[str, list[m.ControlMessage]] = {}


class Endpoint:
    def __init__(self, wire: Wire, address: str) -> None:
        self.wire, self.address = wire, address
        self.rejected: Counter[str] = Counter()
        self.protocol_fallbacks: Counter[str] = Counter()
        self.speaks = m.PROTOCOL_VERSION  # what it settled with every peer
        self.dones_heard: list[tuple[str, int]] = []
        wire.inbox[address] = []

    def receive(self, limit: int = 256) -> Iterator[tuple[m.ControlMessage, str]]:
        box = self.wire.inbox[self.address]
        while box:
            yield box.pop(0), ""  # no keys: the claimed address stands for the origin

    def send(self, address: str, msg: m.ControlMessage, to: str = "") -> None:
        self.wire.inbox.setdefault(address, []).append(msg)

    def protocol_of(self, address: str) -> int:
        return self.speaks

    def done_heard(self, address: str, engine_id: str, version: int) -> None:
        self.dones_heard.append((address, version))

    def wake(self) -> None: ...

    def close(self) -> None: ...


class Nic:
    """NIXL between the agents of the test: WRITEs complete at once (or as ``fates`` say)."""

    def __init__(self) -> None:
        self.notifs: dict[str, dict[str, list[bytes]]] = {}


class Transport:
    def __init__(self, nic: Nic, name: str) -> None:
        self.nic, self._name = nic, name
        nic.notifs[name] = {}
        self.posts: list[tuple[str, list[int], list[int]]] = []
        self.post_error: Exception | None = None
        self.fates: list[Completion] = []
        self._handles: dict[int, Completion] = {}
        self._ids = itertools.count(1)

    @property
    def layout(self) -> m.Layout:
        return LAYOUT

    @property
    def name(self) -> str:
        return self._name

    def metadata(self) -> bytes:
        return b"meta:" + self._name.encode()

    def connect(self, agent_meta: bytes, layout: m.Layout, expect_name: str = "") -> RemotePeer:
        return RemotePeer(expect_name, layout, None)

    def disconnect(self, agent_name: str) -> None: ...

    def post(
        self,
        op: Op,
        peer: RemotePeer,
        local_blocks: list[int],
        remote_blocks: list[int],
        notif: bytes = b"",
    ) -> Any:
        if self.post_error is not None:
            raise self.post_error
        self.posts.append((op, local_blocks, remote_blocks))
        fate = self.fates.pop(0) if self.fates else "DONE"
        if notif and fate == "DONE":
            self.nic.notifs[peer.agent_name].setdefault(self._name, []).append(notif)
        handle = next(self._ids)
        self._handles[handle] = fate
        return handle

    def state(self, handle: Any) -> Completion:
        return self._handles[handle]

    def release(self, handle: Any) -> None:
        del self._handles[handle]

    def notifications(self) -> dict[str, list[bytes]]:
        out, self.nic.notifs[self._name] = self.nic.notifs[self._name], {}
        return out

    def close(self) -> None: ...


class SteppedSenderPump(SenderPump):
    """P's pump stepped by hand: a connect runs when asked, its result handed over by the
    next pass (no connect threads: every step is deterministic)."""

    connect_threads = 0


class SteppedReceiverPump(ReceiverPump):
    """D's pump stepped by hand, its connects (for a pull) as P's above."""

    connect_threads = 0


def info(name: str, control: str) -> m.PeerInfo:
    return m.PeerInfo(name, 1, 0, control, agent_name(f"agent-{name}", control), b"meta", LAYOUT)


class Pair:
    """A P pump and a D pump on one wire and one NIC, stepped by hand (no threads)."""

    def __init__(self, cfg: Any = CFG, transport: Any = None, block_bytes: int = 4096) -> None:
        wire, nic = Wire(), Nic()
        make = transport or Transport
        self.tx = make(nic, agent_name("agent-P", "tcp://p:1"))
        self.rx = make(nic, agent_name("agent-D", "tcp://d:1"))
        p_info = m.PeerInfo("P", 1, 0, "tcp://p:1", self.tx.name, b"meta", self.tx.layout)
        d_info = m.PeerInfo("D", 1, 0, "tcp://d:1", self.rx.name, b"meta", self.rx.layout)
        settings = core_settings(cfg, block_bytes)
        self.p_stats, self.d_stats = StatsBuffer(), StatsBuffer()
        self.p_results, self.d_results = _Results(), _Results()
        self.p = SteppedSenderPump(
            cfg,
            Sender(p_info, settings.sender, _Rng()),
            self.tx,
            Endpoint(wire, p_info.control),
            self.p_results,  # type: ignore[arg-type]
            self.p_stats,
        )
        self.d = SteppedReceiverPump(
            cfg,
            Receiver(d_info, settings.receiver, _Rng()),
            self.rx,
            Endpoint(wire, d_info.control),
            self.d_results,  # type: ignore[arg-type]
            self.d_stats,
        )

    def step(self, n: int = 3) -> None:
        for _ in range(n):
            with self.p.lock:
                self.p._pass(True)
            with self.d.lock:
                self.d._pass(True)

    def push(self, tid: str = "t") -> None:
        """D registers three blocks, P computes the prompt and finishes the request."""
        self.d.request_of[tid] = f"d-{tid}"
        self.d.submit(RegisterBlocks(tid, "tcp://p:1", (10, 11, 12), 0, 300))
        self.p.submit(ExpectBlocks(tid))
        self.step()
        self.p.request_of[tid] = f"p-{tid}"
        self.p.run_now(BlocksReady(tid, (1, 2, 3)))
        self.p.submit(Hold(tid))


class _Rng:
    def uniform(self, a: float, b: float) -> float:
        return a

    def getrandbits(self, k: int, /) -> int:
        return 7


def counters(stats: StatsBuffer) -> dict[tuple[str, ...], float]:
    return {(name, *labels): v for name, labels, v in stats.drain().get("c", [])}


def test_a_prompt_is_pushed_end_to_end_through_both_pumps() -> None:
    pair = Pair()
    pair.push()
    pair.step()
    assert pair.tx.posts == [("WRITE", [1], [10]), ("WRITE", [2], [11]), ("WRITE", [3], [12])]
    assert pair.p_results.take()[0] == {"p-t"}
    assert pair.d_results.take()[1] == {"d-t"}
    assert pair.d_results.take_outcomes() == {"d-t": "pushed"}
    assert counters(pair.p_stats)[("kvpush_transfers", "producer", "pushed")] == 1
    assert counters(pair.d_stats)[("kvpush_transfers", "consumer", "pushed")] == 1


def test_d_tells_its_endpoint_of_a_done_in_the_previous_protocol_it_took() -> None:
    # An older P may push without any control message D hears: its DONE's version is the
    # only word of its release, counted in kvpush_protocol_fallbacks_total (CI: d_first).
    pair = Pair()
    pair.p.endpoint.speaks = 2  # type: ignore[attr-defined]
    pair.push()
    pair.step()
    assert pair.d_results.take_outcomes() == {"d-t": "pushed"}
    assert pair.d.endpoint.dones_heard == [("tcp://p:1", 2)]  # type: ignore[attr-defined]
    assert counters(pair.d_stats)[("kvpush_protocol_dones", "consumer", "2")] == 1
    again = Pair()
    again.push()
    again.step()
    assert again.d.endpoint.dones_heard == []  # type: ignore[attr-defined]


class _CountedFirst:
    """A results lock that checks, each time a completion is published under it, that the
    transfer's end was counted before: the engine thread takes the results and then drains
    the stats, so an end counted after its result could miss the step that reports it."""

    def __init__(self, results: _Results, stats: StatsBuffer) -> None:
        self.inner, self.results, self.stats = results.lock, results, stats
        self.counted = 0.0
        self.late: list[str] = []

    def __enter__(self) -> None:
        self.inner.acquire()
        for name, _, v in self.stats.drain().get("c", []):
            self.counted += v if name == "kvpush_transfers" else 0

    def __exit__(self, *exc: object) -> None:
        published = len(self.results.sending | self.results.recving)
        if published > self.counted:
            self.late.append(f"{published} published, {self.counted:g} counted")
        self.inner.release()


def test_a_transfer_is_counted_as_ended_before_its_completion_is_published() -> None:
    pair = Pair()
    watches = [
        _CountedFirst(pair.p_results, pair.p_stats),
        _CountedFirst(pair.d_results, pair.d_stats),
    ]
    pair.p_results.lock, pair.d_results.lock = watches  # type: ignore[assignment]
    pair.push()
    pair.step()
    assert [w.counted for w in watches] == [1, 1]
    assert [w.late for w in watches] == [[], []]


def test_a_failed_receive_is_counted_before_vllm_hears_of_it() -> None:
    pair = Pair(config_from_extra({**CFG.model_dump(), "fallback": {"pull": False}}))
    watch = _CountedFirst(pair.d_results, pair.d_stats)
    pair.d_results.lock = watch  # type: ignore[assignment]
    pair.tx.post_error = ChunkFailed(ChunkError(ErrorKind.REMOTE_DISCONNECT, "injected"))
    pair.push()
    pair.step(10)
    assert watch.counted == 1
    assert watch.late == []


def test_a_chunk_that_fails_with_a_retryable_error_is_posted_again() -> None:
    pair = Pair()
    pair.tx.fates = [ChunkError(ErrorKind.BACKEND, "ERR:nixlBackendError")]
    pair.push()
    pair.step(30)
    assert pair.tx.posts[:2] == [("WRITE", [1], [10]), ("WRITE", [2], [11])]
    assert pair.tx.posts.count(("WRITE", [1], [10])) == 2
    c = counters(pair.p_stats)
    assert c[("kvpush_chunks", "producer", "error")] == 1
    assert c[("kvpush_retries", "producer", "BACKEND")] == 1
    assert c[("kvpush_transfers", "producer", "retried")] == 1


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (ChunkFailed(ChunkError(ErrorKind.REMOTE_DISCONNECT, "injected")), "REMOTE_DISCONNECT"),
        (RuntimeError("NIXL_ERR_NOT_FOUND: gone"), "NOT_FOUND"),
    ],
)
def test_a_post_that_raises_fails_the_chunk_by_its_kind_and_d_pulls(
    error: Exception, reason: str
) -> None:
    pair = Pair()
    pair.tx.post_error = error
    pair.push()
    pair.step(10)
    c = counters(pair.p_stats)
    assert c[("kvpush_chunks", "producer", "post_failed")] == 2  # both chunks before the last
    assert c[("kvpush_fallbacks", "producer", reason)] == 1
    assert [p[0] for p in pair.rx.posts] == ["READ"] * 3  # D pulled
    assert pair.d_results.take_outcomes() == {"d-t": "pull_fallback"}


def test_an_action_that_raises_is_contained_and_counted_and_the_pump_goes_on() -> None:
    pair = Pair()

    def broken(address: str, msg: m.ControlMessage, to: str = "") -> None:
        if isinstance(msg, m.Register):
            raise OSError("socket gone")

    pair.d.endpoint.send = broken  # type: ignore[method-assign]
    pair.d.request_of["t"] = "d-t"
    pair.d.submit(RegisterBlocks("t", "tcp://p:1", (10,), 0, 100))
    pair.d.submit(AbortReceive("nothing"))
    pair.step(1)
    assert counters(pair.d_stats)[("kvpush_pump_errors", "consumer", "action")] == 1
    assert pair.d.engine.active == 1  # the receive is there; only its REGISTER was lost


def test_a_malformed_done_notification_is_counted_as_rejected() -> None:
    pair = Pair()
    pair.d.request_of["t"] = "d-t"
    pair.d.submit(RegisterBlocks("t", "tcp://p:1", (10,), 0, 100))
    pair.step(1)
    pair.tx.nic.notifs[pair.rx.name][pair.tx.name] = [m.NOTIF_PREFIX + b"\xff\x00"]
    pair.step(1)
    assert (
        counters(pair.d_stats)[("kvpush_control_messages_rejected", "consumer", "malformed")] == 1
    )


class _Cost:
    """What ``NixlTransport.last_post`` holds (``transport.nixl.PostStats``), as the pump
    reads it."""

    def __init__(self, descriptors: int) -> None:
        self.descriptors, self.runs, self.parts = descriptors, 1, 1
        self.path, self.build_s = "prepped", 0.000125


class CostingTransport(Transport):
    """The fake NIXL, keeping a record of each post's cost as the real transport does."""

    def __init__(self, nic: Nic, name: str) -> None:
        super().__init__(nic, name)
        self.last_post: _Cost | None = None

    def post(
        self,
        op: Op,
        peer: RemotePeer,
        local_blocks: list[int],
        remote_blocks: list[int],
        notif: bytes = b"",
    ) -> Any:
        handle = super().post(op, peer, local_blocks, remote_blocks, notif)
        self.last_post = _Cost(2 * len(local_blocks))
        return handle


class Spans:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def on_event(self, event: str, tid: str, fields: Any) -> None:
        self.events.append((event, tid, dict(fields)))


def test_each_post_reports_its_descriptors_and_build_time_in_metrics_and_trace() -> None:
    pair = Pair(transport=CostingTransport)
    spans = pair.p.trace.spans = Spans()
    pair.push()
    pair.step()
    hist = pair.p_stats.drain()["h"]
    posts = [v for name, _, v in hist if name == "kvpush_chunk_post_seconds"]
    assert len(posts) == 3
    assert [v for name, _, v in hist if name == "kvpush_post_descriptors"] == [2, 2, 2]
    assert [v for name, _, v in hist if name == "kvpush_post_build_seconds"] == [0.000125] * 3
    traced = [f for event, tid, f in spans.events if event == "post" and tid == "t"]
    assert [(f["descriptors"], f["build_us"], f["parts"]) for f in traced] == [(2, 125.0, 1)] * 3


def test_a_transport_without_a_cost_record_reports_no_descriptors() -> None:
    pair = Pair()
    pair.push()
    pair.step()
    names = {name for name, _, _ in pair.p_stats.drain()["h"]}
    assert "kvpush_chunk_post_seconds" in names
    assert not names & {"kvpush_post_descriptors", "kvpush_post_build_seconds"}


@pytest.mark.parametrize(("recompute", "counted"), [(False, "failed"), (True, "recompute")])
def test_a_failed_receive_is_counted_once_as_vllms_failure_policy_serves_it(
    recompute: bool, counted: str
) -> None:
    # No pull fallback: a push that cannot be posted fails the receive. Under vLLM's
    # recompute policy D computes the prompt itself, and the transfer ends as that.
    pair = Pair(config_from_extra({**CFG.model_dump(), "fallback": {"pull": False}}))
    if recompute:
        pair.d.failed_outcome = Outcome.RECOMPUTE
    pair.tx.post_error = ChunkFailed(ChunkError(ErrorKind.REMOTE_DISCONNECT, "injected"))
    pair.push()
    pair.step(10)
    assert pair.d_results.take()[2] == {"d-t"}  # vLLM hears the receive failed
    ended = {k: v for k, v in counters(pair.d_stats).items() if k[0] == "kvpush_transfers"}
    assert ended == {("kvpush_transfers", "consumer", counted): 1}


def test_the_pumps_report_the_size_of_every_table_they_keep() -> None:
    pair = Pair()
    pair.push()
    pair.step()
    for pump, stats in ((pair.p, pair.p_stats), (pair.d, pair.d_stats)):
        with pump.lock:
            pump.report_tables(pump.now(), force=True)
        sizes = {
            labels[1]: v
            for (name, labels), v in stats.gauge_values().items()
            if name == "kvpush_table_entries"
        }
        assert set(sizes) <= set(TABLES)
        assert {"pump.requests", "pump.chunks", "driver.peers"} <= set(sizes)
        assert sizes["pump.requests"] == sizes["pump.chunks"] == 0  # the push is over
        assert sizes["driver.peers"] == (1 if pump is pair.p else 0)  # D never read from P
    d_sizes = {k[1][1] for k in pair.d_stats.gauge_values() if k[0] == "kvpush_table_entries"}
    p_sizes = {k[1][1] for k in pair.p_stats.gauge_values() if k[0] == "kvpush_table_entries"}
    assert {"receiver.transfers", "receiver.done_log", "receiver.permits", "links.wire"} <= d_sizes
    assert {"sender.transfers", "sender.tombstones", "push.links", "splits.ended"} <= p_sizes
    caps = {k[1][1] for k in pair.p_stats.gauge_values() if k[0] == "kvpush_table_capacity"}
    assert {"sender.transfers", "sender.tombstones", "sender.peers"} <= caps
