"""The NIXL transport: one agent per worker rank, KV regions registered once, block WRITEs/READs.

Called by the transfer pump, and by P's connect threads for ``connect`` (connector/connects.py):
every call into the NIXL agent holds one lock (``SerializedAgent``), see there why.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import types
from collections import deque
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from kvpush_prod.core import blocksize
from kvpush_prod.core.messages import Layout
from kvpush_prod.core.retry import ChunkError, ErrorKind
from kvpush_prod.errors import ConfigError, TransportError
from kvpush_prod.transport.base import Completion, Op, RemotePeer
from kvpush_prod.transport.layout import all_descriptors, pair_views, unit_descriptors
from kvpush_prod.transport.runs import (
    MAX_POST_DESCRIPTORS,
    SMALL_POST,
    PairPlan,
    Path,
    Side,
    choose_path,
    id_runs,
    pair_plan,
    plan_slice,
    prepped_indices,
    run_descriptors,
    run_starts,
    side_of,
    side_slice,
    split_points,
)
from kvpush_prod.transport.staging import GatherArea

logger = logging.getLogger(__name__)


def _nixl_api() -> Any:
    try:
        from nixl import _api  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ConfigError(
            "the nixl package is not installed: pip install 'kvpush-prod[cpu]' (or [gpu])"
        ) from exc
    return _api


# UCX's TCP transport: how long transmitted data may stay unacknowledged before TCP closes
# the connection (Linux TCP_USER_TIMEOUT; UCX 1.21+, bundled with NIXL 1.5).
UCX_TCP_USER_TIMEOUT = "UCX_TCP_USER_TIMEOUT"


def bound_tcp_delivery(
    seconds: float, env: MutableMapping[str, str] | None = None
) -> tuple[str, bool]:
    """Make UCX's TCP transport drop a connection whose data stayed unacknowledged for
    ``seconds``, unless the operator set ``UCX_TCP_USER_TIMEOUT``; returns (the value in force,
    whether it was set here). Call before the agent is made (UCX reads it then).

    Why: a WRITE held by a partition sits in TCP's retransmission queue and, left alone,
    lands whenever the link comes back (TCP keeps retrying for 15-30 minutes), long after D
    gave the blocks back for another request once the permit ran out. Bounded below the
    permit, the connection dies first and the bytes never land."""
    env = os.environ if env is None else env
    if env.get(UCX_TCP_USER_TIMEOUT):
        return env[UCX_TCP_USER_TIMEOUT], False
    value = f"{max(1, round(seconds * 1000))}ms"
    env[UCX_TCP_USER_TIMEOUT] = value
    return value, True


def make_agent(
    name: str, backend: str, progress_thread: bool, progress_delay_us: int, num_threads: int = 0
) -> Any:
    """A ``nixl_agent`` whose progress thread sleeps ``progress_delay_us`` between passes.

    nixl's Python API hard-codes ``pthrDelay = 0``, which busy-spins a core per agent. The
    agent config is only reachable inside ``nixl_agent.__init__``, so for the duration of the
    constructor its bindings module is swapped for a proxy that overrides that one field.
    """
    api = _nixl_api()
    real = api.nixlBind

    class _Config:
        real: Any  # NIXL's own config object, set once in __init__

        def __init__(self) -> None:
            object.__setattr__(self, "real", real.nixlAgentConfig())

        def __setattr__(self, key: str, value: Any) -> None:
            if key == "pthrDelay":
                value = progress_delay_us
            setattr(self.real, key, value)

    class _Bindings(types.ModuleType):
        def __getattr__(self, key: str) -> Any:
            return getattr(real, key)

    proxy = _Bindings("nixl_bindings_proxy")
    proxy.nixlAgentConfig = _Config  # type: ignore[attr-defined]
    proxy.nixlAgent = lambda agent_name, cfg: real.nixlAgent(agent_name, cfg.real)  # type: ignore[attr-defined]
    conf = api.nixl_agent_config(
        enable_prog_thread=progress_thread, backends=[backend], num_threads=num_threads
    )
    api.nixlBind = proxy
    try:
        agent = api.nixl_agent(name, conf)
    finally:
        api.nixlBind = real
    if backend not in agent.backends:
        raise ConfigError(
            f"NIXL backend {backend!r} could not start on this machine (available plugins: "
            f"{agent.get_plugin_list()}); set transport.backend to one that works here"
        )
    return agent


class SerializedAgent:
    """A ``nixl_agent`` whose every call holds one lock: the pump's posts and polls and a
    connect thread's ``add_remote_agent`` / ``prep_xfer_dlist`` never run inside NIXL at the
    same time.

    Why: the agent is made with NIXL's default thread sync for an agent without a listener
    thread, ``NIXL_THREAD_SYNC_NONE``, under which ``nixlAgent`` takes no lock at all
    (``src/core/sync.h``: every lock callback is a no-op), while ``loadRemoteMD`` (what
    ``add_remote_agent`` calls) inserts into the maps of remote agents and sections that
    ``createXferReq``/``postXferReq`` and ``prepXferDlist`` read, and the UCX backend then
    runs its worker single-threaded (``ucx_utils.cpp`` ``makeMtType``: multi-threaded only
    with ``NIXL_THREAD_SYNC_RW`` or a progress thread). NIXL's bindings release the GIL in
    those calls, so without this lock they would truly overlap. The lock is held for one
    NIXL call at a time: a connect blocks the pump for at most its longest single call (on
    its NIXL calls only), not for the whole connect; the descriptor lists, the Python part
    of a connect's cost, are built outside it (``prep_xfer_dlist``). Measured on this CPU
    box, a connect to a layout of 1,048,576 descriptors (32 regions x 32,768 blocks) took
    0.31 s, of which the lock was held 14 ms, at most 9 ms at a time.
    """

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._agent, name)
        if not callable(attr):
            return attr
        lock = self.lock

        def call(*args: Any, **kwargs: Any) -> Any:
            with lock:
                return attr(*args, **kwargs)

        self.__dict__[name] = call  # a method of the agent never changes: wrap it once
        return call

    def prep_xfer_dlist(
        self, agent_name: str, xfer_list: Any, mem_type: str | None = None, **kwargs: Any
    ) -> Any:
        """NIXL's, with a list of (addr, len, dev) turned into NIXL's descriptor list first,
        outside the lock (a standalone object: no state of the agent is read but its table
        of memory types)."""
        if isinstance(xfer_list, list) and xfer_list and mem_type is not None:
            xfer_list = self._agent.get_xfer_descs(xfer_list, mem_type)
        with self.lock:
            return self._agent.prep_xfer_dlist(agent_name, xfer_list, mem_type, **kwargs)


@dataclass(frozen=True)
class PostStats:
    """What one ``post`` carried and cost on the calling thread (the worker reports it as
    ``kvpush_post_descriptors`` / ``kvpush_post_build_seconds`` and in its traces)."""

    # how the request was built (``runs.choose_path``), or "gathered" (from P's gather area)
    path: Path | Literal["gathered"]
    ids: int  # blocks posted (units when the two block sizes differ)
    runs: int  # runs of ids consecutive on both sides
    entries: int  # what NIXL was handed: prepared indices, or run-built descriptors
    # Descriptors the backend posts: a linear pair's runs x regions on either path (NIXL
    # merges consecutive prepared indices whose descriptors are adjacent on both sides);
    # otherwise one per entry (NIXL may still merge a few, e.g. units inside one block).
    descriptors: int
    parts: int  # NIXL requests (more than one only over ``max_descriptors``)
    build_s: float  # ids -> the first part's NIXL request (runs, lists, make/initialize)
    submit_s: float  # NIXL's transfer() of the first part (on loopback: the copy too)


class _Post:
    """A posted chunk: its NIXL requests, the parts not posted yet, the notification."""

    __slots__ = (
        "op", "peer", "plan", "handles", "pending", "done", "notif", "notified", "gathered"
    )  # fmt: skip

    def __init__(self, op: Op, peer: RemotePeer, notif: bytes, plan: PairPlan) -> None:
        self.op = op
        self.peer = peer
        self.plan = plan  # the regions it moves (all, or one layer's)
        self.handles: list[Any] = []
        # (local ids, remote ids, path) of each part still to post
        self.pending: deque[tuple[np.ndarray, np.ndarray, Path]] = deque()
        self.done = 0  # handles[:done] completed
        self.notif = notif  # sent by us once every part landed (split posts only)
        self.notified = not notif
        self.gathered = ""  # the key of its slots in P's gather area ("": none)


class NixlTransport:
    """Moves blocks between this rank's registered KV cache and connected peers.

    ``max_descriptors``: the most descriptors one NIXL request carries (a larger post is
    split, ``runs.MAX_POST_DESCRIPTORS``). ``path``: "auto" picks the cheaper request
    builder per post (``runs.choose_path``); "prepped" / "coalesced" force one (tests,
    ``kvpush bench transfer --post-cost``; "coalesced" only applies to linear pairs)."""

    def __init__(
        self,
        agent: Any,
        layout: Layout,
        producer: bool = True,
        max_descriptors: int = MAX_POST_DESCRIPTORS,
        path: Literal["auto", "prepped", "coalesced"] = "auto",
        gather: GatherArea | None = None,
    ) -> None:
        if max_descriptors < 1:
            raise ConfigError(f"max_descriptors must be >= 1, got {max_descriptors}")
        self.agent = agent if isinstance(agent, SerializedAgent) else SerializedAgent(agent)
        self.layout = layout
        self.producer = producer  # which side of a tensor-parallel mapping this rank is
        self.max_descriptors = max_descriptors
        self.path = path
        self.last_post: PostStats | None = None
        descs = all_descriptors(layout)
        self._reg = agent.register_memory(
            [
                (r.base, r.block_stride * (r.num_blocks - 1) + r.block_len, r.dev_id, "")
                for r in layout.regions
            ],
            layout.mem_type,
        )
        self._local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, layout.mem_type)
        # P's gather area (staging.send_mib): registered beside the KV cache
        self.gather = gather
        self._gather_reg = (
            agent.register_memory(
                [(gather.memory.ctypes.data, gather.memory.nbytes, 0, "")], "DRAM"
            )
            if gather is not None
            else None
        )
        self._peers: dict[str, RemotePeer] = {}
        # (agent, first region, end) -> (the peer's plan, its slice): layer-wise posts
        self._slices: dict[tuple[str, int, int], tuple[PairPlan, PairPlan]] = {}

    def tables(self) -> dict[str, tuple[int, int | None]]:
        """Entries of the remote agents connected and of the layer-wise slices made."""
        return {
            "nixl.peers": (len(self._peers), None),
            "nixl.slices": (len(self._slices), None),
        }

    @property
    def name(self) -> str:
        return str(self.agent.name)

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def connect(self, agent_meta: bytes, layout: Layout, expect_name: str = "") -> RemotePeer:
        """Add a remote agent (idempotent by name) and prepare its descriptors.

        ``expect_name``: the agent the peer announced; metadata naming another agent is
        refused before NIXL loads it (it could stand for an agent another engine owns)."""
        if layout.compat != self.layout.compat or len(layout.regions) != len(self.layout.regions):
            raise TransportError(
                "incompatible",
                f"peer KV layout {layout.compat} != local {self.layout.compat}: prefill and "
                "decode must run the same model, dtype and KV cache layout",
            )
        try:
            local_view, remote_view = pair_views(self.layout, layout, self.producer)
        except ConfigError as exc:
            raise TransportError("incompatible", str(exc)) from exc
        if expect_name and expect_name.encode() not in agent_meta:
            raise TransportError(
                "not_owner",
                f"the NIXL metadata announced for agent {expect_name[:64]} does not name it",
            )
        name = self.agent.add_remote_agent(agent_meta)
        name = name.decode() if isinstance(name, bytes) else str(name)
        if expect_name and name != expect_name:
            raise TransportError(
                "not_owner",
                f"the NIXL metadata announced for agent {expect_name[:64]} is agent {name[:64]}",
            )
        peer = self._peers.get(name)
        if peer is None and blocksize.converts(self.layout, layout):
            peer = self._connect_units(name, local_view, remote_view)
            self._peers[name] = peer
        if peer is None:
            # Planned first: a pair whose lists cannot be paired is refused before NIXL
            # prepares anything for it.
            plan = _plan(side_of(local_view.regions), side_of(remote_view.regions))
            dlist = self.agent.prep_xfer_dlist(name, all_descriptors(remote_view), layout.mem_type)
            peer = RemotePeer(name, remote_view, dlist, plan=plan)
            if local_view is not self.layout:
                # A head slab of our blocks (tensor-parallel sizes differ): its own dlist.
                peer.local = local_view
                peer.local_dlist = self.agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", all_descriptors(local_view), local_view.mem_type
                )
            self._peers[name] = peer
        return peer

    def _connect_units(self, name: str, local_view: Layout, remote_view: Layout) -> RemotePeer:
        """Block sizes differ: both sides' dlists list unit pieces (a unit is the smaller
        block size's tokens; each token group of a block is split into its units)."""
        u = blocksize.unit_tokens(self.layout.block_size, remote_view.block_size)
        lk, rk = blocksize.per_block(local_view, u), blocksize.per_block(remote_view, u)
        plan = _plan(
            side_of(local_view.regions, lk, units=True),
            side_of(remote_view.regions, rk, units=True),
        )
        remote = unit_descriptors(remote_view, rk)
        local = unit_descriptors(local_view, lk)
        dlist = self.agent.prep_xfer_dlist(name, remote, remote_view.mem_type)
        local_dlist = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, local_view.mem_type)
        logger.info(
            "kvpush: block size %d here, %d on %s: units of %d tokens, %d local and "
            "%d remote descriptors",
            self.layout.block_size,
            remote_view.block_size,
            name[:64],
            u,
            len(local),
            len(remote),
        )
        return RemotePeer(name, remote_view, dlist, local_view, local_dlist, u, lk, rk, plan)

    def _slice(self, peer: RemotePeer, plan: PairPlan, regions: tuple[int, int]) -> PairPlan:
        """``plan`` over regions ``[first, end)`` only (kept per peer and range)."""
        first, end = regions
        if not 0 <= first < end <= plan.local.regions:
            raise TransportError(
                "invalid_param",
                f"regions {first}..{end} of a layout of {plan.local.regions} regions",
            )
        key = (peer.agent_name, first, end)
        sliced = self._slices.get(key)
        if sliced is None or sliced[0] is not plan:
            sliced = self._slices[key] = (plan, plan_slice(plan, first, end))
        return sliced[1]

    def disconnect(self, agent_name: str) -> None:
        for key in [k for k in self._slices if k[0] == agent_name]:
            del self._slices[key]
        peer = self._peers.pop(agent_name, None)
        if peer is None:
            return
        peer.closed = True
        for dlist in (peer.dlist, peer.local_dlist):
            if dlist is None:
                continue
            try:
                self.agent.release_dlist_handle(dlist)
            except Exception:  # noqa: BLE001 - best effort on a dead peer
                logger.debug("release_dlist_handle failed for %s", agent_name, exc_info=True)
        try:
            self.agent.remove_remote_agent(agent_name)
        except Exception:  # noqa: BLE001
            logger.debug("remove_remote_agent failed for %s", agent_name, exc_info=True)

    def post(
        self,
        op: Op,
        peer: RemotePeer,
        local_blocks: list[int],
        remote_blocks: list[int],
        notif: bytes = b"",
        regions: tuple[int, int] | None = None,
    ) -> Any:
        """Start a WRITE (local -> remote) or READ (remote -> local) of whole blocks (of
        units, ``RemotePeer.unit_tokens``, when the two block sizes differ); a handle for
        ``state`` and ``release``. ``last_post`` then says what it carried and cost.

        Ids consecutive on both sides make a run; on a linear pair (``runs.pair_linear``) a
        run is one descriptor per region, built for this post when that is cheaper than
        indexing the lists prepared at connect (``runs.choose_path``). Over
        ``max_descriptors`` the post is split on run boundaries: the first part is posted
        now, one more per ``state`` call, and ``notif`` goes out only once every part
        landed (NIXL orders a request's notification after that request's own bytes only;
        its UCX backend ends every request with an endpoint flush, so a part's DONE means
        its bytes are at the peer, and ``send_notif`` after the last DONE follows them).

        ``regions``: only regions ``[first, end)`` of each block (layer-wise push: one
        layer's); None: all."""
        t0 = time.perf_counter()
        n = len(local_blocks)
        plan = self._post_plan(peer, local_blocks, remote_blocks, regions)
        lids = np.asarray(local_blocks, dtype=np.int32)  # < limit < 2**31: checked in _post_plan
        rids = np.asarray(remote_blocks, dtype=np.int32)
        starts = (
            run_starts(local_blocks, remote_blocks) if n <= SMALL_POST else run_starts(lids, rids)
        )
        if op == "WRITE" and self._gathers(peer, plan, starts.size, rids):
            gathered = self._gathered(peer, plan, lids, rids, notif, regions, t0)
            if gathered is not None:
                return gathered
        per_run = plan.descriptors_per_run
        entries = n * plan.local.entries_per_id
        descriptors = starts.size * per_run if per_run else entries
        path = self._path_for(plan, entries, descriptors)
        bounds = self._bounds(plan, starts, n, descriptors)
        post, handle = self._first_part(op, peer, plan, lids, rids, path, notif, bounds, starts)
        t1 = time.perf_counter()
        self._submit(post, handle)
        t2 = time.perf_counter()
        sent = descriptors if path == "coalesced" else entries
        self.last_post = PostStats(
            path,
            n,
            int(starts.size),
            int(sent),
            int(descriptors),
            len(bounds) - 1,
            t1 - t0,
            t2 - t1,
        )
        return post

    def _gathers(self, peer: RemotePeer, plan: PairPlan, runs: int, rids: np.ndarray) -> bool:
        """Whether a WRITE with ``runs`` runs goes through the gather area: one is set up,
        the pair moves whole blocks (no head slabs, no units), and P's scattered blocks
        at least double the runs D's side alone has."""
        if self.gather is None or not plan.linear or peer.local_dlist is not None:
            return False
        if runs < 2:
            return False
        d_runs = 1 + int(np.count_nonzero(np.diff(rids) != 1))
        return runs >= 2 * d_runs

    def _gathered(
        self,
        peer: RemotePeer,
        plan: PairPlan,
        lids: np.ndarray,
        rids: np.ndarray,
        notif: bytes,
        regions: tuple[int, int] | None,
        t0: float,
    ) -> _Post | None:
        """A WRITE of ``lids`` copied into the gather area first and posted from there, one
        descriptor per region and run of ``rids``; None (post from the KV blocks) when the
        area has no room or the descriptors would need more than one request."""
        gather = self.gather
        assert gather is not None
        first, end = regions if regions is not None else (0, len(self.layout.regions))
        got = gather.gather(lids, first, end)
        if got is None:
            return None
        key, slots = got
        starts = run_starts(slots, rids)
        if starts.size * plan.descriptors_per_run > self.max_descriptors:
            gather.give_back(key, complete=True)
            return None
        starts_l, starts_r, lengths = id_runs(slots, rids, starts)
        local = run_descriptors(side_slice(gather.side, first, end), starts_l, lengths)
        remote = run_descriptors(plan.remote, starts_r, lengths)
        post = _Post("WRITE", peer, b"", plan)
        post.gathered = key
        try:
            handle = self.agent.initialize_xfer(
                "WRITE",
                self.agent.get_xfer_descs(local, "DRAM"),
                self.agent.get_xfer_descs(remote, peer.layout.mem_type),
                peer.agent_name,
                notif,
            )
            t1 = time.perf_counter()
            self._submit(post, handle)
        except BaseException:
            gather.give_back(key, complete=True)  # nothing of it was posted
            raise
        self.last_post = PostStats(
            "gathered",
            int(lids.size),
            int(starts.size),
            int(local.shape[0]),
            int(local.shape[0]),
            1,
            t1 - t0,
            time.perf_counter() - t1,
        )
        return post

    def _first_part(
        self,
        op: Op,
        peer: RemotePeer,
        plan: PairPlan,
        lids: np.ndarray,
        rids: np.ndarray,
        path: Path,
        notif: bytes,
        bounds: list[int],
        starts: np.ndarray,
    ) -> tuple[_Post, Any]:
        """The post of ``lids`` to ``rids`` cut at ``bounds``, its later parts pending, and
        the NIXL request of its first part (it carries ``notif`` only if it is the whole)."""
        split = len(bounds) > 2
        post = _Post(op, peer, notif if split else b"", plan)
        for a, b in zip(bounds[1:-1], bounds[2:], strict=True):
            post.pending.append((lids[a:b], rids[a:b], path))
        first = bounds[1]
        handle = self._request(
            post,
            lids[:first],
            rids[:first],
            path,
            b"" if split else notif,
            None if split else starts,
        )
        return post, handle

    def _path_for(self, plan: PairPlan, entries: int, descriptors: int) -> Path:
        """How a post of ``entries`` prepared entries, ``descriptors`` as runs, goes: the
        configured path, or the cheaper one (``runs.choose_path``) under "auto"; coalesced
        only on a linear pair."""
        if self.path == "auto":
            return choose_path(entries, descriptors, plan.linear)
        return "coalesced" if self.path == "coalesced" and plan.linear else "prepped"

    def _post_plan(
        self,
        peer: RemotePeer,
        local_blocks: list[int],
        remote_blocks: list[int],
        regions: tuple[int, int] | None,
    ) -> PairPlan:
        """The plan a post of these ids over ``regions`` of ``peer`` uses, once the ids are
        checked (as many on both sides, each within its side's limit)."""
        if len(local_blocks) != len(remote_blocks):
            raise TransportError(
                "invalid_param",
                f"{len(local_blocks)} local blocks vs {len(remote_blocks)} remote blocks",
            )
        plan = peer.plan
        if plan is None:  # a peer made by hand (tests): its views as connect would see them
            plan = peer.plan = _plan(*_sides(self.layout, peer))
        if regions is not None and regions != (0, plan.local.regions):
            plan = self._slice(peer, plan, regions)
        _check_ids(local_blocks, plan.local, "local", peer)
        _check_ids(remote_blocks, plan.remote, "remote", peer)
        return plan

    def _bounds(self, plan: PairPlan, starts: np.ndarray, n: int, descriptors: int) -> list[int]:
        """Where a post of ``n`` ids (runs beginning at ``starts``) is split into parts of at
        most ``max_descriptors``: ``[0, cuts..., n]``, ``[0, n]`` when it is not split."""
        if descriptors <= self.max_descriptors:
            return [0, n]
        lengths = np.diff(np.append(starts, n))
        per_run = plan.descriptors_per_run
        return [
            0,
            *split_points(lengths, plan.local.entries_per_id, per_run, self.max_descriptors),
            n,
        ]

    def _request(
        self,
        post: _Post,
        lids: np.ndarray,
        rids: np.ndarray,
        path: Path,
        notif: bytes,
        starts: np.ndarray | None = None,
    ) -> Any:
        """One NIXL request of ``post`` moving ``lids`` to ``rids`` (in its op's direction)
        over the regions of its plan; ``starts``: their ``run_starts`` if known."""
        op, peer, plan = post.op, post.peer, post.plan
        if path == "coalesced":
            starts_l, starts_r, lengths = id_runs(lids, rids, starts)
            local = run_descriptors(plan.local, starts_l, lengths)
            remote = run_descriptors(plan.remote, starts_r, lengths)
            return self.agent.initialize_xfer(
                op,
                self.agent.get_xfer_descs(local, self.layout.mem_type),
                self.agent.get_xfer_descs(remote, peer.layout.mem_type),
                peer.agent_name,
                notif,
            )
        return self.agent.make_prepped_xfer(
            op,
            self._local if peer.local_dlist is None else peer.local_dlist,
            prepped_indices(plan.local, lids),
            peer.dlist,
            prepped_indices(plan.remote, rids),
            notif,
        )

    def _submit(self, post: _Post, handle: Any) -> None:
        state = self.agent.transfer(handle)
        if state == "ERR":
            self.agent.release_xfer_handle(handle)
            raise TransportError(
                "post_failed", f"NIXL refused to post a {post.op} to {post.peer.agent_name}"
            )
        post.handles.append(handle)

    def state(self, handle: Any) -> Completion:
        """'DONE', 'PROC', or the error: the completion state ERR, or the NIXL exception
        checking it raised (by its class; one of no known class counts as ERR). A split
        post posts its next part here (one per call: each call's work stays bounded) and
        sends its notification once every part is DONE."""
        post: _Post = handle
        if post.peer.closed:
            # Dropped under it: no later part goes out, no notification is sent (not on a
            # new connection to the same agent either); D ignores a FALLBACK after a DONE.
            post.pending.clear()
            post.notified = True
            return ChunkError(
                ErrorKind.NOT_FOUND,
                f"the connection to {post.peer.agent_name[:64]} was dropped under this post",
            )
        try:
            if post.pending:
                lids, rids, path = post.pending.popleft()
                self._submit(post, self._request(post, lids, rids, path, b""))
            while post.done < len(post.handles):
                state = str(self.agent.check_xfer_state(post.handles[post.done]))
                if state == "PROC":
                    return "PROC"
                if state != "DONE":
                    return ChunkError.from_text(state)
                post.done += 1
            if post.pending:
                return "PROC"
            if not post.notified:
                self.agent.send_notif(post.peer.agent_name, post.notif)
                post.notified = True
        except Exception as exc:  # noqa: BLE001 - classified by the caller
            return ChunkError.from_exception(exc, default=ErrorKind.ERR)
        return "DONE"

    def release(self, handle: Any) -> None:
        post: _Post = handle
        post.pending.clear()  # a released post never posts another part
        if post.gathered and self.gather is not None:
            # Its bytes are read from the slots until its request is done: a post given up
            # before that keeps them for the quarantine.
            self.gather.give_back(post.gathered, post.done == len(post.handles))
            post.gathered = ""
        for h in post.handles:
            try:
                self.agent.release_xfer_handle(h)
            except Exception:  # noqa: BLE001 - a handle of a dead peer may refuse release
                logger.debug("release_xfer_handle failed", exc_info=True)
        post.handles.clear()

    def notifications(self) -> dict[str, list[bytes]]:
        """New notifications by sender; the call also makes progress on the backend."""
        return dict(self.agent.get_new_notifs())

    def send_notification(self, peer: RemotePeer, payload: bytes) -> None:
        self.agent.send_notif(peer.agent_name, payload)

    def close(self) -> None:
        for name in list(self._peers):
            self.disconnect(name)
        try:
            self.agent.release_dlist_handle(self._local)
            self.agent.deregister_memory(self._reg)
            if self._gather_reg is not None:
                self.agent.deregister_memory(self._gather_reg)
        except Exception:  # noqa: BLE001
            logger.debug("deregister failed", exc_info=True)


def _plan(local: Side, remote: Side) -> PairPlan:
    try:
        return pair_plan(local, remote)
    except ValueError as exc:
        raise TransportError("incompatible", str(exc)) from None


def _sides(layout: Layout, peer: RemotePeer) -> tuple[Side, Side]:
    local = peer.local or layout
    if peer.unit_tokens:
        return (
            side_of(local.regions, peer.local_k, units=True),
            side_of(peer.layout.regions, peer.remote_k, units=True),
        )
    return side_of(local.regions), side_of(peer.layout.regions)


def _check_ids(ids: list[int], side: Side, which: str, peer: RemotePeer) -> None:
    """Each id must name a block (unit) of every region: an id past a region's end would
    address the next region's bytes. Python's min/max: cheaper than numpy's on the short
    lists most posts carry, and before any int32 conversion could wrap."""
    if not ids:
        raise TransportError(
            "invalid_param", f"a post to {peer.agent_name[:64]} names no {which} blocks"
        )
    low, high = min(ids), max(ids)
    if low < 0 or high >= side.limit:
        what = "units" if peer.unit_tokens else "blocks"
        raise TransportError(
            "invalid_param",
            f"{which} {what} {low}..{high} of a post to {peer.agent_name[:64]}: the "
            f"{which} KV cache has {side.limit} {what} per region",
        )
