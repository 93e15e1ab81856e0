"""The NIXL transport: one agent per worker rank, KV regions registered once, block WRITEs/READs.

Not thread-safe by itself: the transfer pump is its only caller after setup.
"""

from __future__ import annotations

import logging
import types
from typing import Any

from kvpush_prod.core import blocksize
from kvpush_prod.core.messages import Layout
from kvpush_prod.core.retry import ChunkError, ErrorKind
from kvpush_prod.errors import ConfigError, TransportError
from kvpush_prod.transport.base import Completion, Op, RemotePeer
from kvpush_prod.transport.layout import (
    all_descriptors,
    descriptor_indices,
    pair_views,
    unit_descriptors,
    unit_indices,
)

logger = logging.getLogger(__name__)


def _nixl_api() -> Any:
    try:
        from nixl import _api  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ConfigError(
            "the nixl package is not installed: pip install 'kvpush-prod[cpu]' (or [gpu])"
        ) from exc
    return _api


def make_agent(name: str, backend: str, progress_thread: bool, progress_delay_us: int,
               num_threads: int = 0) -> Any:
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


class NixlTransport:
    """Moves blocks between this rank's registered KV cache and connected peers."""

    def __init__(self, agent: Any, layout: Layout, producer: bool = True) -> None:
        self.agent = agent
        self.layout = layout
        self.producer = producer  # which side of a tensor-parallel mapping this rank is
        descs = all_descriptors(layout)
        self._reg = agent.register_memory(
            [(r.base, r.block_stride * (r.num_blocks - 1) + r.block_len, r.dev_id, "")
             for r in layout.regions],
            layout.mem_type,
        )
        self._local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, layout.mem_type)
        self._peers: dict[str, RemotePeer] = {}

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
            dlist = self.agent.prep_xfer_dlist(name, all_descriptors(remote_view),
                                               layout.mem_type)
            peer = RemotePeer(name, remote_view, dlist)
            if local_view is not self.layout:
                # A head slab of our blocks (tensor-parallel sizes differ): its own dlist.
                peer.local = local_view
                peer.local_dlist = self.agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", all_descriptors(local_view), local_view.mem_type)
            self._peers[name] = peer
        return peer

    def _connect_units(self, name: str, local_view: Layout, remote_view: Layout) -> RemotePeer:
        """Block sizes differ: both sides' dlists list unit pieces (a unit is the smaller
        block size's tokens; each token group of a block is split into its units)."""
        u = blocksize.unit_tokens(self.layout.block_size, remote_view.block_size)
        lk, rk = blocksize.per_block(local_view, u), blocksize.per_block(remote_view, u)
        remote = unit_descriptors(remote_view, rk)
        local = unit_descriptors(local_view, lk)
        dlist = self.agent.prep_xfer_dlist(name, remote, remote_view.mem_type)
        local_dlist = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local,
                                                 local_view.mem_type)
        logger.info("kvpush: block size %d here, %d on %s: units of %d tokens, %d local and "
                    "%d remote descriptors", self.layout.block_size, remote_view.block_size,
                    name[:64], u, len(local), len(remote))
        return RemotePeer(name, remote_view, dlist, local_view, local_dlist, u, lk, rk)

    def disconnect(self, agent_name: str) -> None:
        peer = self._peers.pop(agent_name, None)
        if peer is None:
            return
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

    def post(self, op: Op, peer: RemotePeer, local_blocks: list[int], remote_blocks: list[int],
             notif: bytes = b"") -> Any:
        """Start a WRITE (local -> remote) or READ (remote -> local) of whole blocks (of
        units, ``RemotePeer.unit_tokens``, when the two block sizes differ)."""
        if len(local_blocks) != len(remote_blocks):
            raise TransportError(
                "invalid_param",
                f"{len(local_blocks)} local blocks vs {len(remote_blocks)} remote blocks",
            )
        local = peer.local or self.layout
        if peer.unit_tokens:  # ids are units (block sizes differ)
            local_idx = unit_indices(local_blocks, local, peer.local_k)
            remote_idx = unit_indices(remote_blocks, peer.layout, peer.remote_k)
        else:
            local_idx = descriptor_indices(local_blocks, local)
            remote_idx = descriptor_indices(remote_blocks, peer.layout)
        handle = self.agent.make_prepped_xfer(
            op,
            self._local if peer.local_dlist is None else peer.local_dlist,
            local_idx,
            peer.dlist,
            remote_idx,
            notif,
        )
        state = self.agent.transfer(handle)
        if state == "ERR":
            self.agent.release_xfer_handle(handle)
            raise TransportError("post_failed", f"NIXL refused to post a {op} to {peer.agent_name}")
        return handle

    def state(self, handle: Any) -> Completion:
        """'DONE', 'PROC', or the error: the completion state ERR, or the NIXL exception
        checking it raised (by its class; one of no known class counts as ERR)."""
        try:
            state = str(self.agent.check_xfer_state(handle))
        except Exception as exc:  # noqa: BLE001 - classified by the caller
            return ChunkError.from_exception(exc, default=ErrorKind.ERR)
        if state == "DONE":
            return "DONE"
        if state == "PROC":
            return "PROC"
        return ChunkError.from_text(state)

    def release(self, handle: Any) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001 - a handle of a dead peer may refuse release
            logger.debug("release_xfer_handle failed", exc_info=True)

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
        except Exception:  # noqa: BLE001
            logger.debug("deregister failed", exc_info=True)
