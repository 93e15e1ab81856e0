"""The simulated cluster: prefill and decode engines with step-based compute, NIC links, a
router, and three ways to move the KV: ``pull`` (vLLM NixlConnector behind a sequential
proxy), ``push`` (vLLM NixlPushConnector, both legs at once, one WRITE per request, no
credits, coordination on the engine step) and ``kvpush`` (our connector: the real Sender,
Receiver and ChunkScheduler from ``kvpush_prod.core``, and D's CreditLedger admission).

Only the protocol decisions come from the core, on the settings a kvpush profile gives them
(``config.core``, as in the connector; a layer-wise push as ``push.layerwise`` says, through
the core's ``LayersReady``); compute, wires and the cost of posting NIXL requests (fixed +
per descriptor, descriptors per run of adjacent blocks) are simple models whose parameters
live in :class:`ClusterModel` (see presets.py and docs/simulator.md). An engine of ``tp``
tensor-parallel ranks is simulated as one of its ranks (1/tp of the KV on 1/tp of the NIC,
its own pump): the ranks are alike.
"""

from __future__ import annotations

import functools
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

from kvpush_prod.config import KvpushConfig, load_config
from kvpush_prod.config.core import CoreSettings, core_settings, credit_settings, layerwise_on
from kvpush_prod.core import actions
from kvpush_prod.core.admission import Admissions, Verdict
from kvpush_prod.core.commands import BlocksReady, Hold, LayersReady, RegisterBlocks
from kvpush_prod.core.credits import CreditLedger, CreditSettings
from kvpush_prod.core.identity import agent_name
from kvpush_prod.core.messages import ControlMessage, Layout, PeerInfo, Region
from kvpush_prod.core.receiver import Receiver
from kvpush_prod.core.retry import ChunkError
from kvpush_prod.core.sender import Sender
from kvpush_prod.driver import Driver, Stage
from kvpush_prod.router.policy import Policy, make_policy
from kvpush_prod.router.types import Backend, Role
from kvpush_prod.sim.events import Link, Loop

MODES = ("pull", "push", "kvpush")
D_POLICIES = ("least_loaded", "round_robin", "link_aware")


@dataclass(frozen=True)
class ClusterModel:
    """Every number the simulator runs on (seconds, bytes, bytes/s)."""

    name: str
    n_prefill: int = 1
    n_decode: int = 1
    # wires
    nic_bandwidth: float = 50e9  # per prefill node, egress, shared by its transfers (1/tp a rank)
    one_way_s: float = 10e-6  # data-path latency (RTT / 2)
    # Per decode node: the bandwidth of the path into it (bytes/s, the node's; each rank
    # 1/tp), a second hop after P's NIC; () or 0: no limit beyond P's NIC. One slow entry is
    # a throttled or far decode node (benchmarks/link_aware.py's cell).
    decode_link_bandwidth: tuple[float, ...] = ()
    # How the router picks a request's D (P goes round robin): least_loaded (requests placed
    # and not finished, ties in turn), round_robin, or link_aware (the router's LinkAware
    # policy itself, learning each (P, D) pair's time from P's prefill end to D's first
    # token per prompt token).
    d_policy: str = "least_loaded"
    ctrl_s: float = 50e-6  # one control message between engines (ZMQ / NIXL notif)
    http_s: float = 300e-6  # one HTTP leg through the router, each way
    # compute
    prefill_s_per_token: float = 50e-6
    prefill_s_per_token2: float = 0.0  # attention: cost growing with the square of the length
    prefill_step_s: float = 2e-3  # fixed cost of a prefill step
    max_batched_tokens: int = 8192
    decode_step_s: float = 15e-3  # fixed cost of a decode step
    decode_s_per_seq: float = 0.1e-3  # extra per running sequence
    # KV cache
    kv_bytes_per_token: float = 320 * 1024
    block_tokens: int = 16
    kv_regions: int = 160  # registered KV regions per rank (layers x K/V): descriptors per block
    layers: int = 80  # model layers: a layer-wise WRITE moves kv_regions / layers regions
    decode_kv_blocks: int = 200_000  # per decode engine (a block spans every rank)
    # Tensor parallelism: ranks per engine. Each rank is its own NIXL agent with its own pump
    # and link and moves 1/tp of every block (its KV heads); vLLM's connectors work per rank
    # too. Ranks are symmetric and independent (same blocks, same steps), so one rank is
    # simulated: 1/tp of every block's bytes on 1/tp of the node's NIC bandwidth, with the
    # core's chunks and descriptors of that rank; a transfer is done when that rank's is,
    # which is when every rank's is (docs/simulator.md).
    tp: int = 1
    # D's cache: the probability that the next free block D hands out is not adjacent to
    # the one before (0: a fresh cache, runs as long as the transfer; 1: every block apart)
    fragment: float = 0.0
    # connector software costs
    vllm_xfer_overhead_s: float = 1e-3  # per vLLM transfer, beyond bytes / bandwidth
    pull_coord_s: float = 3e-3  # D engine-thread time per pulled request (handshake, descs, post)
    # Building and posting one NIXL request (a chunk, or vLLM's whole transfer) costs
    # post_fixed_s + desc_s x the descriptors it posts: one per run of blocks adjacent on
    # both sides per region (NIXL merges the rest; coalesce=0: one per block per region).
    # Fitted from `kvpush bench transfer --post-cost` (presets.py, docs/simulator.md).
    post_fixed_s: float = 19e-6
    desc_s: float = 0.94e-6
    coalesce: int = 1
    # Our pump is one thread: its posts of one prefill engine go one after another (0: each
    # post's cost runs apart from the others, the simulator before per-descriptor costs)
    post_serial: int = 1
    push_reg_coord_s: float = 0.3e-3  # D engine-thread time per vLLM push registration
    push_post_coord_s: float = 0.5e-3  # P engine-thread time per vLLM push post
    kvpush_chunk_overhead_s: float = 20e-6  # per posted chunk, beyond bytes / bandwidth
    kvpush_pump_s: float = 50e-6  # our pump thread's reaction time to an event
    # kvpush's own settings (chunks, pacing, leases, credits, retries): a profile, as the
    # connector takes it (a shipped profile's name or a path), then "section.key=value"
    # overrides (as kv_connector_extra_config would give them).
    profile: str = "default"
    overrides: tuple[str, ...] = ()
    notes: str = ""

    def with_(self, **kw: Any) -> ClusterModel:
        return replace(self, **kw)

    def config(self) -> KvpushConfig:
        """The kvpush configuration the ``kvpush`` mode runs on: ``profile``, then
        ``overrides`` (ConfigError names a bad one); the environment is not read."""
        extra: dict[str, dict[str, Any]] = {}
        for item in self.overrides:
            key, _, value = item.partition("=")
            section, _, name = key.partition(".")
            extra.setdefault(section, {})[name] = yaml.safe_load(value)
        return load_config(self.profile, extra, env={})

    def core(self) -> tuple[CoreSettings, CreditSettings]:
        """The core's settings for this cluster's blocks and D's credit budget over its KV
        cache: ``config.core``'s mapping of :meth:`config`, the connector's own."""
        cfg = self.config()
        return core_settings(cfg, self.rank_block_bytes), credit_settings(
            cfg, self.decode_kv_blocks
        )

    def kv_bytes(self, tokens: int) -> float:
        """The KV of ``tokens`` over the whole model (every rank)."""
        return self.kv_bytes_per_token * tokens

    def rank_kv_bytes(self, tokens: int) -> float:
        """One tensor-parallel rank's part of the KV of ``tokens``: what it moves."""
        return self.kv_bytes_per_token * tokens / self.tp

    @property
    def rank_block_bytes(self) -> int:
        """One rank's part of a KV block: the block the rank's core and NIXL agent see."""
        return int(self.kv_bytes_per_token * self.block_tokens) // self.tp

    @property
    def rank_bandwidth(self) -> float:
        """One rank's share of its prefill node's NIC bandwidth."""
        return self.nic_bandwidth / self.tp

    def blocks(self, tokens: int) -> int:
        return max(1, math.ceil(tokens / self.block_tokens))

    def descriptors(
        self,
        src: Sequence[int],
        dst: Sequence[int],
        parts: int = 1,
        regions: tuple[int, int] | None = None,
    ) -> int:
        """The descriptors one post of blocks ``src`` into ``dst`` hands the backend: one per
        region per run of blocks adjacent on both sides (per block with ``coalesce`` 0).
        The post covers the layout's regions ``[first, end)`` when ``regions`` names them
        (a chunk of a whole push cut by layers, or a layer-wise WRITE: the core names
        them), else one layer's (``parts`` layers) or every one."""
        if regions is not None:
            n_regions = max(1, regions[1] - regions[0])
        else:
            n_regions = max(1, self.kv_regions // max(1, parts))
        return n_regions * self._runs(src, dst)

    def _runs(self, src: Sequence[int], dst: Sequence[int]) -> int:
        """Runs of blocks adjacent on both sides (each block alone with ``coalesce`` 0)."""
        if not self.coalesce or not src:
            return len(src)
        return 1 + sum(
            1 for i in range(1, len(src)) if src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1
        )

    def post_cost(self, descriptors: int) -> float:
        """Time to build and post one NIXL request of ``descriptors``."""
        return self.post_fixed_s + self.desc_s * descriptors


@dataclass(frozen=True)
class Workload:
    """``closed``: ``concurrency`` requests in flight until ``requests`` were sent;
    ``poisson``: arrivals at ``rate`` per second; ``burst``: ``burst`` requests at once every
    ``burst_every_s`` on top of the Poisson load."""

    requests: int = 64
    lengths: tuple[int, ...] = (1024,)
    output_tokens: int = 64
    kind: str = "closed"
    concurrency: int = 1
    rate: float = 1.0
    burst: int = 0
    burst_every_s: float = 1.0
    seed: int = 0


@dataclass(eq=False)
class Req:
    rid: int
    length: int
    out: int
    arrive: float
    p: int = 0
    d: int = 0
    p_start: float = -1.0
    p_done: float = -1.0
    kv_at_d: float = -1.0
    first_token: float = -1.0
    done: float = -1.0
    tokens: int = 0
    stalls: int = 0
    d_blocks: list[int] = field(default_factory=list)
    p_blocks: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens P computed so far (chunked prefill)
    registered_at: float = -1.0  # P got D's registration (push modes)
    xfer_start: float = -1.0  # the first WRITE (or READ) posted
    done_posted: float = -1.0  # kvpush: the WRITE that carries DONE posted
    first_bytes: float = -1.0  # kvpush: the first WRITE's bytes on the wire
    refused: bool = False  # kvpush: D computes the prompt (no credit could ever fit it)

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrive

    @property
    def tpot(self) -> float | None:
        if self.tokens < 2 or self.done < 0:
            return None
        return (self.done - self.first_token) / (self.tokens - 1)


class PrefillEngine:
    """FIFO batches up to ``max_batched_tokens``; a step costs fixed + per-token time plus any
    engine-thread work a connector put on it (``debt``). A prompt longer than a step is
    computed in steps of ``max_batched_tokens`` (vLLM's chunked prefill); shorter ones are
    batched whole."""

    def __init__(self, sim: Sim, idx: int) -> None:
        self.sim, self.idx = sim, idx
        self.queue: deque[Req] = deque()
        self.busy = False
        self.debt = 0.0
        self.next_block = 0
        self.busy_time = 0.0

    def submit(self, req: Req) -> None:
        self.queue.append(req)
        if not self.busy:
            self._step()

    def _take(self) -> tuple[list[Req], int, int]:
        """This step's prompts that it completes, its tokens and its sum of (squared context
        after - squared context before) per prompt (attention); a prompt it only starts stays
        at the head of the queue."""
        m, now = self.sim.m, self.sim.loop.now
        batch: list[Req] = []
        tokens = squares = 0
        while self.queue and (
            not batch or tokens + self._left(self.queue[0]) <= m.max_batched_tokens
        ):
            r = self.queue[0]
            n = min(self._left(r), m.max_batched_tokens)
            if r.prefilled == 0:
                r.p_start = now
            squares += (r.prefilled + n) ** 2 - r.prefilled**2
            tokens += n
            r.prefilled += n
            if r.prefilled < r.length:
                break  # chunked prefill: the rest in later steps
            batch.append(self.queue.popleft())
        return batch, tokens, squares

    @staticmethod
    def _left(r: Req) -> int:
        return r.length - r.prefilled

    def _step(self) -> None:
        m, loop = self.sim.m, self.sim.loop
        if not self.queue:
            self.busy = False
            return
        self.busy = True
        batch, tokens, squares = self._take()
        quad = squares * m.prefill_s_per_token2
        dur = m.prefill_step_s + tokens * m.prefill_s_per_token + quad + self.debt
        self.debt = 0.0
        self.busy_time += dur
        for r in batch:  # the blocks the forward writes the prompts' KV into
            n = m.blocks(r.length)
            r.p_blocks = [(self.next_block + i) % 1_000_000 for i in range(n)]
            self.next_block += n
        self.sim.on_prefill_step(self.idx, batch, dur)

        def end() -> None:
            for r in batch:
                r.p_done = loop.now
                self.sim.on_prefill_done(r)
            self._step()

        loop.after(dur, end)


class DecodeEngine:
    """Continuous batching: each step admits new work (connector hook), adds requests whose
    KV arrived, and emits one token per running request at its end."""

    def __init__(self, sim: Sim, idx: int) -> None:
        self.sim, self.idx = sim, idx
        m = sim.m
        # Handed out from the end: a fresh cache's in order (kept sorted), a fragmented one's
        # in runs.
        self.free: list[int] = (
            scattered(m.decode_kv_blocks, m.fragment, random.Random(f"{sim.w.seed}-d{idx}"))
            if m.fragment > 0
            else list(range(m.decode_kv_blocks))
        )
        self.incoming: deque[Req] = deque()  # requests D's scheduler has not placed yet
        self.arrived: list[Req] = []  # KV here, joins the batch at the next step
        self.running: list[Req] = []
        self.waiting_kv = 0  # placed, KV not here yet (the engine keeps stepping)
        self.busy = False
        self.debt = 0.0
        self.busy_time = 0.0

    def alloc(self, n: int) -> list[int] | None:
        if len(self.free) < n:
            return None
        out = self.free[-n:]
        del self.free[-n:]
        return out

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)
        if not self.sim.m.fragment:
            # A fresh cache: D hands out its highest free ids in order, so a transfer's
            # blocks are one run (ids only: the timing does not depend on the order).
            self.free.sort()

    def submit(self, req: Req) -> None:
        self.incoming.append(req)
        self.wake()

    def kv_arrived(self, req: Req) -> None:
        req.kv_at_d = self.sim.loop.now
        self.waiting_kv -= 1
        self.arrived.append(req)
        self.wake()

    def wake(self) -> None:
        if not self.busy:
            self._step()

    def _step(self) -> None:
        m, loop = self.sim.m, self.sim.loop
        cost = self.sim.place_incoming(self)  # admits from incoming, returns engine time
        new, self.arrived = self.arrived, []
        self.running.extend(new)
        if not self.running and not self.waiting_kv and not self.incoming and not cost:
            self.busy = False
            return
        self.busy = True
        n = len(self.running)
        # New requests also compute their last prompt token in this step.
        dur = (
            m.decode_step_s
            + n * m.decode_s_per_seq
            + len(new) * m.prefill_s_per_token
            + cost
            + self.debt
        )
        self.debt = 0.0
        self.busy_time += dur
        batch = list(self.running)

        def end() -> None:
            now = loop.now
            done = []
            for r in batch:
                need = m.blocks(r.length + r.tokens + 1)
                if need > len(r.d_blocks):
                    more = self.alloc(need - len(r.d_blocks))
                    if more is None:
                        r.stalls += 1  # no block for the next token: it waits (vLLM preempts)
                        continue
                    r.d_blocks += more
                r.tokens += 1
                if r.tokens == 1:
                    r.first_token = now
                    self.sim.on_first_token(r)
                if r.tokens >= r.out:
                    r.done = now
                    done.append(r)
            for r in done:
                self.running.remove(r)
                self.release(r.d_blocks)
                r.d_blocks = []
                self.sim.on_request_done(r)
            self._step()

        loop.after(dur, end)


def scattered(n: int, fragment: float, rng: random.Random) -> list[int]:
    """Block ids ``0..n-1`` as a fragmented cache hands them out: runs of adjacent ids, each
    next id starting a new run with probability ``fragment``, the runs in random order."""
    runs: list[list[int]] = [[0]] if n else []
    for i in range(1, n):
        if rng.random() < fragment:
            runs.append([i])
        else:
            runs[-1].append(i)
    rng.shuffle(runs)
    return [i for run in runs for i in run]


class Sim:
    """One run of one mode on one cluster model and workload."""

    def __init__(self, m: ClusterModel, mode: str, w: Workload) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        self.m, self.mode, self.w = m, mode, w
        self.loop = Loop()
        self.rng = random.Random(w.seed)
        self.prefill = [PrefillEngine(self, i) for i in range(m.n_prefill)]
        self.decode = [DecodeEngine(self, i) for i in range(m.n_decode)]
        self.links = [
            Link(self.loop, m.rank_bandwidth, m.one_way_s, f"p{i}") for i in range(m.n_prefill)
        ]
        self.d_links = [
            Link(self.loop, bw / m.tp, 0.0, f"d{j}") if bw > 0 else None
            for j, bw in enumerate(m.decode_link_bandwidth[: m.n_decode])
        ]
        self.d_links += [None] * (m.n_decode - len(self.d_links))
        self._p_backends = [Backend(Role.PREFILL, f"p{i}") for i in range(m.n_prefill)]
        self._d_backends = [Backend(Role.DECODE, f"d{j}") for j in range(m.n_decode)]
        self.d_policy: Policy | None = None
        if m.d_policy != "least_loaded":
            self.d_policy = make_policy(m.d_policy, clock=lambda: self.loop.now)
        self.reqs: list[Req] = []
        self.finished = 0
        self._rr_p = 0
        self._rr_d = 0
        self._sent = 0
        self._by_tid: dict[str, Req] = {}
        self.registrations: dict[int, Req] = {}  # vLLM push: registered at P
        self.p_ready: dict[int, Req] = {}  # vLLM push: prefill done, waiting for registration
        self.counters: dict[str, int] = {}
        self.post_s = 0.0  # time spent building and posting NIXL requests, every engine
        self.pump_free = [0.0] * m.n_prefill  # when each P's pump is done with its posts
        if mode == "kvpush":
            self._setup_core()

    # -------------------------------------------------------------------- the core (kvpush)
    def _setup_core(self) -> None:
        m = self.m
        block_bytes = m.rank_block_bytes  # the simulated rank's (the ranks are alike)
        self.settings, credits = m.core()
        self.push = m.config().push
        self.senders: list[Sender] = []
        self.receivers: list[Receiver] = []
        self.tx: list[Driver[Sender, str]] = []
        self.rx: list[Driver[Receiver, str]] = []
        self.admissions: list[Admissions[None]] = []
        self.endpoint: dict[str, Driver[Sender, str] | Driver[Receiver, str]] = {}
        for i in range(m.n_prefill):
            s = Sender(
                self._peer_info(f"p{i}", 1_000_000, block_bytes),
                self.settings.sender,
                random.Random(i),
            )
            self.senders.append(s)
            self.tx.append(Driver(s, _SimEffects(self)))
            self.endpoint[s.me.control] = self.tx[-1]
        for j in range(m.n_decode):
            r = Receiver(
                self._peer_info(f"d{j}", m.decode_kv_blocks, block_bytes),
                self.settings.receiver,
                random.Random(100 + j),
            )
            self.receivers.append(r)
            self.rx.append(Driver(r, _SimEffects(self)))
            self.endpoint[r.me.control] = self.rx[-1]
            self.admissions.append(Admissions(CreditLedger(credits), m.block_tokens))
        self.ledgers = [a.ledger for a in self.admissions]
        self._tick_core()

    def _peer_info(self, name: str, blocks: int, block_bytes: int) -> PeerInfo:
        """An engine rank as the core sees it: ``kv_regions`` regions (layers x K/V, as the
        connector registers them) sharing the rank's block, so the core cuts a whole push
        by layers (``push.chunk_by``) and names each WRITE's regions as it does on engines."""
        n = max(1, min(self.m.kv_regions, block_bytes))
        lens = [block_bytes // n] * n
        lens[-1] += block_bytes - sum(lens)
        stride = max(lens)
        regions = [Region(r * stride * blocks, stride, ln, blocks) for r, ln in enumerate(lens)]
        layout = Layout("sim", "DRAM", regions)
        control = f"tcp://{name}"
        return PeerInfo(name, 1, 0, control, agent_name(f"agent-{name}", control), b"x", layout)

    def _tick_core(self) -> None:
        if self.finished >= self.w.requests:
            return
        for tx in self.tx:
            tx.tick()
        for rx in self.rx:
            rx.tick()
        self.loop.after(0.05, self._tick_core)

    def post_write(self, a: actions.PostWrite) -> None:
        """A WRITE on P's NIC: it lands after its posting cost and its bytes on the link;
        then P hears the completion and D, a pump reaction later, the DONE it carries."""
        m, loop = self.m, self.loop
        req = self._by_tid[a.transfer_id]
        if req.xfer_start < 0:
            req.xfer_start = loop.now
        if a.done is not None:
            req.done_posted = loop.now
        sender, receiver = self.tx[req.p], self.rx[req.d]

        def landed() -> None:
            sender.completed(a.chunk_id)
            done = a.done
            if done is not None:
                loop.after(
                    m.kvpush_pump_s,
                    lambda: receiver.feed(
                        Stage.COMPLETION, "DONE", lambda r, now: r.on_done(done, now)
                    ),
                )

        def send() -> None:
            if req.first_bytes < 0:
                req.first_bytes = loop.now
            self.ship(req, a.nbytes, landed)

        self.count("chunks")
        if a.layerwise:
            self.count("layer_writes")
            if req.p_done < 0:
                self.count("layer_writes_during_forward")
        cost = m.post_cost(self.descriptors(a.src_blocks, a.dst_blocks, a.parts, a.regions))
        if not m.post_serial:
            loop.after(m.kvpush_chunk_overhead_s + cost, send)
            return
        # The pump posts one request after another: this one once the ones before it are out.
        posted = max(loop.now, self.pump_free[req.p]) + cost
        self.pump_free[req.p] = posted
        loop.at(posted + m.kvpush_chunk_overhead_s, send)

    def descriptors(
        self,
        src: Sequence[int],
        dst: Sequence[int],
        parts: int = 1,
        regions: tuple[int, int] | None = None,
    ) -> int:
        """``ClusterModel.descriptors`` of one post, counted with the time it costs."""
        n = self.m.descriptors(src, dst, parts, regions)
        self.count("descriptors", n)
        self.count("posts")
        self.post_s += self.m.post_cost(n)
        return n

    def count(self, what: str, n: int = 1) -> None:
        self.counters[what] = self.counters.get(what, 0) + n

    def received(self, transfer_id: str, failed: bool) -> None:
        """D reported the receive: its credit is back and the request decodes (a failed one
        recomputes: counted, not modelled)."""
        if failed:
            self.count("failed")
        req = self._by_tid[transfer_id]
        self.admissions[req.d].ended(transfer_id)
        self.decode[req.d].kv_arrived(req)

    # -------------------------------------------------------------------- request flow
    def run(self) -> list[Req]:
        w = self.w
        if w.kind == "closed":
            for _ in range(min(w.concurrency, w.requests)):
                self._new_request()
        else:
            t = 0.0
            times = []
            for _ in range(w.requests):
                t += self.rng.expovariate(w.rate) if w.rate > 0 else 0.0
                times.append(t)
            if w.burst > 0:
                k, t = 0, 0.0
                while k < len(times):
                    for _ in range(w.burst):
                        if k < len(times):
                            times[k] = min(times[k], t)
                            k += 1
                    k += max(1, int(w.rate * w.burst_every_s))
                    t += w.burst_every_s
            for at in sorted(times):
                self.loop.at(at, self._new_request)
        self.loop.run()
        return self.reqs

    def _new_request(self) -> None:
        w, m = self.w, self.m
        if self._sent >= w.requests:
            return
        length = w.lengths[self._sent % len(w.lengths)]
        req = Req(self._sent, length, w.output_tokens, self.loop.now)
        self._sent += 1
        req.p = self._rr_p % m.n_prefill
        req.d = self._choose_d(req.p)
        self._d_backends[req.d].inflight += 1
        self._rr_p += 1
        self._rr_d += 1
        self.reqs.append(req)
        self._by_tid[f"t{req.rid}"] = req
        loop = self.loop
        p, d = self.prefill[req.p], self.decode[req.d]
        if self.mode == "pull":
            loop.after(m.http_s, lambda: p.submit(req))
        else:
            loop.after(m.http_s, lambda: p.submit(req))
            loop.after(m.http_s, lambda: d.submit(req))

    def _choose_d(self, p: int) -> int:
        """The router's D for a request on P ``p`` (``ClusterModel.d_policy``)."""
        ds = self._d_backends
        if self.d_policy is not None:
            return ds.index(self.d_policy.choose_for(self._p_backends[p], ds, ds))
        # Least loaded decode engine, ties round robin.
        loads = [len(d.running) + d.waiting_kv + len(d.incoming) for d in self.decode]
        best = min(loads)
        choices = [j for j, x in enumerate(loads) if x == best]
        return choices[self._rr_d % len(choices)]

    def ship(self, req: Req, nbytes: float, done: Callable[[], None]) -> None:
        """``nbytes`` of ``req``'s KV over P's NIC, then D's path when it has a limit."""
        hop = self.d_links[req.d]
        if hop is None:
            self.links[req.p].send(nbytes, done)
        else:
            self.links[req.p].send(nbytes, lambda: hop.send(nbytes, done))

    def on_first_token(self, req: Req) -> None:
        """D's first token of ``req``: a router that learns links times the pair."""
        if self.d_policy is not None and req.p_done >= 0:
            self.d_policy.observe(
                self._p_backends[req.p],
                self._d_backends[req.d],
                req.first_token - req.p_done,
                req.length,
            )

    def on_prefill_step(self, p: int, batch: list[Req], dur: float) -> None:
        """P ``p`` starts a step of ``dur`` that completes the prompts of ``batch``. kvpush
        with a layer-wise push (``push.layerwise``, decided per step as the connector does):
        layer ``l`` of the forward is computed at ``(l + 1) / layers`` of the step, and the
        pump hears each (the connector's save_kv_layer) a reaction later; the whole prompt,
        with DONE's last chunk, still goes at the step's end (``on_prefill_done``)."""
        m = self.m
        if self.mode != "kvpush" or not batch or m.layers < 2:
            return
        # The slowest link as whole pushes measured it, as the connector decides by.
        bandwidth = self.senders[p].sched.slowest_whole_bandwidth()
        blocks = sum(len(r.p_blocks) for r in batch)
        push = self.push
        if not layerwise_on(  # on the rank's blocks and link, as the rank's connector decides
            push.layerwise,
            blocks,
            m.rank_block_bytes,
            m.block_tokens,
            bandwidth,
            push.layerwise_min_tokens,
            push.layerwise_min_transfer_ms,
        ):
            return
        self.count("layerwise_steps")
        start = self.loop.now
        for layer in range(1, m.layers + 1):
            # Timed as the step's end is (start + dur, then the pump's reaction), so the last
            # layer is heard no later than the forward's end, in the same float arithmetic.
            computed = start + layer / m.layers * dur
            self.loop.at(
                computed + m.kvpush_pump_s,
                functools.partial(self._layers_ready, p, batch, layer),
            )

    def _layers_ready(self, p: int, batch: list[Req], ready: int) -> None:
        for r in batch:
            self.tx[p].command(LayersReady(f"t{r.rid}", tuple(r.p_blocks), ready, self.m.layers))

    def on_prefill_done(self, req: Req) -> None:
        m, loop = self.m, self.loop
        if self.mode == "pull":
            # P answers the router, which then sends D's leg with P's block ids.
            loop.after(2 * m.http_s, lambda: self.decode[req.d].submit(req))
        elif self.mode == "push":
            self.p_ready[req.rid] = req
            self._maybe_vllm_push(req)
        else:
            tx = self.tx[req.p]
            tid = f"t{req.rid}"

            def computed() -> None:
                tx.command(BlocksReady(tid, tuple(req.p_blocks)))
                tx.command(Hold(tid))

            loop.after(m.kvpush_pump_s, computed)

    def _maybe_vllm_push(self, req: Req) -> None:
        if req.rid not in self.p_ready or req.rid not in self.registrations:
            return
        del self.p_ready[req.rid], self.registrations[req.rid]
        m, loop = self.m, self.loop
        p = self.prefill[req.p]
        p.debt += m.push_post_coord_s  # the P worker posts on its engine thread

        def post() -> None:
            req.xfer_start = loop.now
            self.ship(
                req,
                m.rank_kv_bytes(req.length),
                lambda: loop.after(
                    m.vllm_xfer_overhead_s + m.ctrl_s, lambda: self.decode[req.d].kv_arrived(req)
                ),
            )

        # One WRITE of the whole KV: its descriptors follow D's runs, as NIXL merges them.
        descs = self.descriptors(req.p_blocks, req.d_blocks)
        loop.after(m.push_post_coord_s + m.post_cost(descs), post)

    def place_incoming(self, d: DecodeEngine) -> float:
        """D's scheduler at the start of a step: place new requests; returns engine time."""
        cost = 0.0
        keep: deque[Req] = deque()
        while d.incoming:
            req = d.incoming.popleft()
            placed = (
                self._admit(d, req, cost) if self.mode == "kvpush" else self._place(d, req, cost)
            )
            if placed is None:
                keep.append(req)  # no credit or no blocks yet: a later step
            else:
                cost = placed
        d.incoming = keep
        return cost

    def _place(self, d: DecodeEngine, req: Req, cost: float) -> float | None:
        """vLLM's connectors: allocate and start the transfer on D's engine thread at
        ``cost`` into the step; the step's engine time after it (None: no blocks yet)."""
        m, loop = self.m, self.loop
        blocks = d.alloc(m.blocks(req.length))
        if blocks is None:
            return None
        req.d_blocks = blocks
        d.waiting_kv += 1
        if self.mode == "pull":
            # vLLM pull posts the READ from D's engine thread (start_load_kv): the whole
            # descriptor list is built and posted there, holding up every running decode.
            cost += m.pull_coord_s + m.post_cost(self.descriptors(req.p_blocks, req.d_blocks))

            def read() -> None:
                req.xfer_start = loop.now
                # READ: the request travels to P, the data comes back.
                loop.after(
                    m.one_way_s,
                    lambda: self.ship(
                        req,
                        m.rank_kv_bytes(req.length),
                        lambda: loop.after(m.vllm_xfer_overhead_s, lambda: d.kv_arrived(req)),
                    ),
                )

            loop.after(cost, read)
            return cost
        cost += m.push_reg_coord_s

        def registered() -> None:
            self.registrations[req.rid] = req
            self._maybe_vllm_push(req)

        loop.after(cost + m.ctrl_s, registered)
        return cost

    def _admit(self, d: DecodeEngine, req: Req, cost: float) -> float | None:
        """kvpush: D admits through the core's admission (the real CreditLedger); admitted,
        it allocates and its Receiver registers the blocks with P."""
        m, loop = self.m, self.loop
        admissions = self.admissions[d.idx]
        tid = f"t{req.rid}"
        n = m.blocks(req.length)
        if not req.refused:
            admissions.track(tid, tid, f"p{req.p}", None)
            answer = admissions.ask(tid, req.length, 0, loop.now)
            for command in answer.commands(tid, f"tcp://p{req.p}"):
                self.rx[d.idx].command(command)  # what P must hear, as the connector says it
            if answer.verdict is Verdict.LATER:
                return None
            req.refused = answer.verdict is Verdict.LOCAL
        if req.refused:
            # Can never fit the credit budget: D computes the prompt itself.
            blocks = d.alloc(n)
            if blocks is None:
                return None
            self.count("refused")
            req.d_blocks = blocks
            req.kv_at_d = loop.now
            d.arrived.append(req)
            return (
                cost + req.length * m.prefill_s_per_token + req.length**2 * m.prefill_s_per_token2
            )
        blocks = d.alloc(n)
        if blocks is None:
            admissions.withdraw(tid)
            return None
        req.d_blocks = blocks
        d.waiting_kv += 1
        admissions.allocated(tid, len(blocks))
        self.rx[d.idx].command(RegisterBlocks(tid, f"tcp://p{req.p}", tuple(blocks), 0, req.length))
        return cost

    def on_request_done(self, req: Req) -> None:
        self.finished += 1
        self._d_backends[req.d].inflight -= 1
        if self.w.kind == "closed":
            self._new_request()


class _SimEffects:
    """The driver's hands in the simulator: control messages and WRITEs travel with the
    model's latencies; P's blocks, READs and connections are not modelled."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim

    def now(self) -> float:
        return self.sim.loop.now

    def wall(self) -> float:
        return 0.0  # no clocks to skew: messages carry no sent_at

    def send(self, peer: str, to: str, message: ControlMessage) -> None:
        target = self.sim.endpoint.get(peer)
        if target is not None:
            m = self.sim.m
            self.sim.loop.after(m.ctrl_s + m.kvpush_pump_s, lambda: target.message(message))

    def connect(self, info: PeerInfo) -> str:
        return info.agent_name

    def disconnect(self, agent: str) -> None:
        return None

    def write(self, action: actions.PostWrite, peer: str) -> ChunkError | None:
        self.sim.post_write(action)
        return None

    def read(self, action: actions.PostRead, peer: str) -> ChunkError | None:
        return None  # pulls are not modelled (no chunk fails in the simulator)

    def post_failed(self, action: actions.PostWrite | actions.PostRead, error: ChunkError) -> None:
        self.sim.count("post_failed")

    def release_send(self, action: actions.ReleaseSend) -> None:
        return None  # P's blocks are not modelled

    def report_finished(self, action: actions.ReportFinished) -> None:
        self.sim.received(action.transfer_id, failed=False)

    def report_failed(self, action: actions.ReportFailed) -> None:
        self.sim.received(action.transfer_id, failed=True)

    def note(self, note: actions.Note) -> None:
        self.sim.count(note.kind.value)

    def contained(self, stage: Stage, what: str) -> None:
        raise  # noqa: PLE0704 - a simulator bug must surface, not be counted


def simulate(m: ClusterModel, mode: str, w: Workload) -> dict[str, Any]:
    """Run one simulation; the summary has the same keys as a bench cell."""
    from kvpush_prod.bench.stats import summary_ms

    sim = Sim(m, mode, w)
    reqs = sim.run()
    done = [r for r in reqs if r.done >= 0]
    end = max((r.done for r in done), default=0.0)
    xfer = [r.kv_at_d - r.p_done for r in done if r.kv_at_d >= 0 and r.p_done >= 0]
    return {
        "mode": mode,
        "requests": len(reqs),
        "ok": len(done),
        "ttft_ms": summary_ms(r.ttft for r in done),
        "tpot_ms": summary_ms(t for r in done if (t := r.tpot) is not None),
        "kv_transfer_ms": summary_ms(xfer),
        "queue_p_ms": summary_ms(r.p_start - r.arrive for r in done),
        "throughput_tok_s": sum(r.tokens for r in done) / end if end > 0 else None,
        "stalls": sum(r.stalls for r in done),
        "p_busy": [round(p.busy_time / end, 3) if end else 0 for p in sim.prefill],
        "d_busy": [round(d.busy_time / end, 3) if end else 0 for d in sim.decode],
        "per_d": [sum(1 for r in done if r.d == j) for j in range(m.n_decode)],
        "counters": dict(sim.counters),
        "events": sim.loop.events,
        "sim_end_s": end,
    }
