"""A fault-injecting wrapper around the real transport, for chaos scripts and tests.

Deterministic by seed: fail a post, fail a completion, delay or stall it, drop DONE
notifications, at a rate or on the Nth operation, for some peers, while a switch file exists.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvpush_prod.core.messages import Layout
from kvpush_prod.core.retry import ChunkError
from kvpush_prod.errors import ConfigError
from kvpush_prod.transport.base import ChunkFailed, Completion, Op, RemotePeer, Transport

logger = logging.getLogger(__name__)

FAULTS_ENV = "KVPUSH_FAULTS"


class FaultSettings(BaseModel):
    """What to break (everything off by default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(False, description="Master switch of fault injection.")
    seed: int = Field(
        0, ge=0, le=2**31 - 1, description="Seed of the fault decisions (deterministic runs)."
    )
    op: Literal["WRITE", "READ", "ANY"] = Field("WRITE", description="Which operations fail.")
    peers: list[str] = Field(
        default_factory=list,
        description="Only operations to agents whose name contains one of these (empty: all).",
    )
    post_fail_rate: float = Field(0.0, ge=0, le=1, description="Probability a post raises.")
    complete_fail_rate: float = Field(
        0.0, ge=0, le=1, description="Probability a posted transfer completes in error."
    )
    error: str = Field("ERR:nixlBackendError", description="The error an injected failure shows.")
    fail_nth: int = Field(
        0, ge=0, le=10**9, description="Fail exactly the Nth matching operation (0: off)."
    )
    delay_ms: float = Field(0.0, ge=0, le=600_000, description="Extra completion latency.")
    stall_rate: float = Field(
        0.0, ge=0, le=1, description="Probability a transfer never completes (stays PROC)."
    )
    drop_done_rate: float = Field(
        0.0, ge=0, le=1, description="Probability an inbound DONE notification is dropped."
    )
    active_file: str | None = Field(
        None, description="Faults apply only while this file exists (lets a script clear them)."
    )


def fault_settings(section: dict[str, Any] | None) -> FaultSettings:
    """The config section, overridden by the JSON object in $KVPUSH_FAULTS."""
    data = dict(section or {})
    env = os.environ.get(FAULTS_ENV)
    if env:
        try:
            extra = json.loads(env)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{FAULTS_ENV} must be a JSON object, got {env!r}: {exc}") from None
        if not isinstance(extra, dict):
            raise ConfigError(f"{FAULTS_ENV} must be a JSON object, got {env!r}")
        data.update(extra)
        data["enabled"] = bool(extra.get("enabled", True))  # setting the env means "on"
    try:
        return FaultSettings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid fault settings {data!r}: {exc}") from None


class _Handle:
    """A wrapped transfer handle with the fate the injector chose for it."""

    def __init__(self, inner: Any, fate: str, ready_at: float) -> None:
        self.inner = inner
        self.fate = fate  # "ok" | "fail" | "stall"
        self.ready_at = ready_at


class FaultyTransport:
    """A ``Transport`` around another; decides each operation's fate from a seeded RNG."""

    def __init__(self, inner: Transport, settings: FaultSettings) -> None:
        self.inner = inner
        self.s = settings
        self._rng = random.Random(settings.seed)
        self._count = 0
        self.injected = 0
        self._posted_real = False  # whether the last post reached the wrapped transport
        # The error an injected failure shows, as the configured text reads.
        self._error = ChunkError.from_text(settings.error)
        logger.warning("kvpush: FAULT INJECTION enabled: %s", settings.model_dump())

    @property
    def layout(self) -> Layout:
        return self.inner.layout

    @property
    def name(self) -> str:
        return self.inner.name

    def metadata(self) -> bytes:
        return self.inner.metadata()

    @property
    def last_post(self) -> Any:
        """The wrapped transport's ``last_post`` when the last post reached it; None when
        an injected fault posted nothing real (or the wrapped transport keeps none)."""
        return getattr(self.inner, "last_post", None) if self._posted_real else None

    def connect(self, agent_meta: bytes, layout: Layout, expect_name: str = "") -> RemotePeer:
        return self.inner.connect(agent_meta, layout, expect_name)

    def disconnect(self, agent_name: str) -> None:
        self.inner.disconnect(agent_name)

    def tables(self) -> dict[str, tuple[int, int | None]]:
        """The wrapped transport's tables (none kept here)."""
        sizes = getattr(self.inner, "tables", None)
        return sizes() if callable(sizes) else {}

    def close(self) -> None:
        self.inner.close()

    def _active(self, op: str, peer_name: str) -> bool:
        s = self.s
        if s.op != "ANY" and s.op != op:
            return False
        if s.peers and not any(p in peer_name for p in s.peers):
            return False
        return s.active_file is None or Path(s.active_file).exists()

    def post(
        self,
        op: Op,
        peer: RemotePeer,
        local_blocks: list[int],
        remote_blocks: list[int],
        notif: bytes = b"",
        regions: tuple[int, int] | None = None,
    ) -> Any:
        self._posted_real = False
        if not self._active(op, peer.agent_name):
            handle = (
                self.inner.post(op, peer, local_blocks, remote_blocks, notif)
                if regions is None
                else self.inner.post(op, peer, local_blocks, remote_blocks, notif, regions)
            )
            self._posted_real = True
            return _Handle(handle, "ok", 0)
        self._count += 1
        nth = self.s.fail_nth and self._count == self.s.fail_nth
        if nth or self._rng.random() < self.s.post_fail_rate:
            self.injected += 1
            raise ChunkFailed(
                ChunkError(self._error.kind, f"{self.s.error} (injected post failure)")
            )
        roll = self._rng.random()
        fate = "ok"
        if roll < self.s.complete_fail_rate:
            fate = "fail"
        elif roll < self.s.complete_fail_rate + self.s.stall_rate:
            fate = "stall"
        if fate != "ok":
            self.injected += 1
            # A failed or stalled transfer must not move data: post nothing real.
            return _Handle(None, fate, time.monotonic() + self.s.delay_ms / 1000.0)
        inner = (
            self.inner.post(op, peer, local_blocks, remote_blocks, notif)
            if regions is None
            else self.inner.post(op, peer, local_blocks, remote_blocks, notif, regions)
        )
        self._posted_real = True
        return _Handle(inner, "ok", time.monotonic() + self.s.delay_ms / 1000.0)

    def state(self, handle: Any) -> Completion:
        h: _Handle = handle
        if h.fate == "stall":
            return "PROC"
        if time.monotonic() < h.ready_at:
            return "PROC"
        if h.fate == "fail":
            return self._error
        return self.inner.state(h.inner)

    def release(self, handle: Any) -> None:
        h: _Handle = handle
        if h.inner is not None:
            self.inner.release(h.inner)

    def notifications(self) -> dict[str, list[bytes]]:
        notifs: dict[str, list[bytes]] = self.inner.notifications()
        if not self.s.drop_done_rate or not (
            self.s.active_file is None or Path(self.s.active_file).exists()
        ):
            return notifs
        out: dict[str, list[bytes]] = {}
        for agent, items in notifs.items():
            kept = [n for n in items if self._rng.random() >= self.s.drop_done_rate]
            self.injected += len(items) - len(kept)
            if kept:
                out[agent] = kept
        return out
