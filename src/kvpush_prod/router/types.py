"""The router's shared types: a backend's role, a prefill engine's identity and the backend
record that the pool, the policies, the legs and the errors all speak of.

Imports no other router module but its config, so none of them import each other for types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvpush_prod.router.config import PrefillBackendConfig


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class PrefillIdentity:
    """Where D's connector reaches P: what goes into D's ``kv_transfer_params``."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    # P's control-channel public key (Z85); None when P runs without keys.
    remote_key: str | None = None
    # With data parallelism behind one API server: which engine core (its control port is
    # its own) and how many there are (found by probing the ranks); None / 1 without.
    dp_rank: int | None = None
    dp_size: int = 1


@dataclass(frozen=True)
class EngineLoad:
    """What an engine's own /metrics said of its load (summed over its engine cores)."""

    running: float = 0.0  # vllm:num_requests_running
    waiting: float = 0.0  # vllm:num_requests_waiting
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc, 0..1 (the fullest core)
    at: float = 0.0  # time.monotonic() of the reading


@dataclass(eq=False)
class Backend:
    """One engine's OpenAI server as the router sees it. Compared by identity, not value."""

    role: Role
    url: str
    overrides: PrefillBackendConfig | None = None
    healthy: bool = False
    identity: PrefillIdentity | None = None
    models: tuple[str, ...] = ()
    models_known: bool = False
    inflight: int = 0
    last_error: str | None = "not checked yet"
    # Bumped by every mark_down, so a health check that started before a leg saw this
    # backend fail cannot bring it back up with stale results.
    epoch: int = 0
    served: frozenset[str] = field(default_factory=frozenset)
    # Push mode needs P's identity for D's leg; pull mode takes it from P's answer.
    needs_identity: bool = True
    # Decode only (probe_decode): D's control-channel key, and whether D answered the probe
    # (with a key or without: an engine without keys has none to give). With ``needs_key``
    # a D is routable only once probed, so P's legs always name the D when it has a key.
    remote_key: str | None = None
    key_probed: bool = False
    needs_key: bool = False
    # Drained by an operator: no new legs; cleared when the engine comes back after a
    # restart (it went down and up again) or by an undrain.
    draining: bool = False
    # The engine's own load from its /metrics (policy engine_load), None until read.
    load: EngineLoad | None = None
    # Prefill with data parallelism (identity.dp_size > 1): every engine core's identity,
    # by DP rank; a P leg is pinned to one of them (X-data-parallel-rank).
    ranks: dict[int, PrefillIdentity] = field(default_factory=dict)
    next_rank: int = 0

    @property
    def identity_complete(self) -> bool:
        """The identity is known, and with data parallelism that of every DP rank."""
        ident = self.identity
        return ident is not None and (ident.dp_rank is None or len(self.ranks) == ident.dp_size)

    @property
    def up(self) -> bool:
        """Routable: healthy, and for a prefill backend in push mode its identity is known,
        for a decode backend probed for its key (probe_decode) its probe answered."""
        if self.role is Role.DECODE:
            return self.healthy and (not self.needs_key or self.key_probed)
        return self.healthy and (not self.needs_identity or self.identity_complete)

    def pick_rank(self) -> PrefillIdentity:
        """The identity a new P leg goes to: the backend's own, or with data parallelism
        the next DP rank in turn (its ``dp_rank`` says which, for the leg's header)."""
        assert self.identity is not None
        if self.identity.dp_rank is None or not self.ranks:
            return self.identity
        ranks = sorted(self.ranks)
        chosen = self.ranks[ranks[self.next_rank % len(ranks)]]
        self.next_rank += 1
        return chosen

    def serves(self, model: str | None) -> bool:
        return model is None or model in self.served

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "url": self.url,
            "up": self.up,
            "healthy": self.healthy,
            "inflight": self.inflight,
            "draining": self.draining,
            "load": None
            if self.load is None
            else {
                "running": self.load.running,
                "waiting": self.load.waiting,
                "kv_usage": self.load.kv_usage,
            },
            "models": list(self.models),
        }
        if self.role is Role.PREFILL:
            ident = self.identity
            out["identity"] = (
                None
                if ident is None
                else {
                    "engine_id": ident.engine_id,
                    "control_host": ident.host,
                    "control_port": ident.port,
                    "tp_size": ident.tp_size,
                    "remote_key": ident.remote_key,
                }
            )
            if ident is not None and ident.dp_rank is not None:
                out["identity"]["dp_size"] = ident.dp_size
                out["dp_ranks"] = {
                    r: {"engine_id": i.engine_id, "control_port": i.port}
                    for r, i in sorted(self.ranks.items())
                }
        elif self.key_probed:
            out["remote_key"] = self.remote_key
        if not self.up:
            out["error"] = self.last_error
        return out
