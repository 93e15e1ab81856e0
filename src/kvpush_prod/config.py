"""One validated configuration object for the connector, router and tools.

Built from a YAML profile, then ``kv_connector_extra_config`` overrides, then env (secrets).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvpush_prod.errors import ConfigError
from kvpush_prod.transport.faults import FaultSettings

SECRET_ENV = "KVPUSH_SECRET"
PROFILE_ENV = "KVPUSH_PROFILE"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ControlSettings(_Section):
    """The control channel between engines (REGISTER, heartbeats, cancel, fallback notices)."""

    host: str = Field("127.0.0.1", description="Address the control endpoint binds to.")
    advertise_host: str | None = Field(
        None, description="Address peers use to reach this engine; defaults to `host`."
    )
    port: int = Field(
        15500,
        ge=1024,
        le=65000,
        description="Base port; tensor-parallel rank r of data-parallel rank d listens on "
        "port + d * tp_size + r.",
    )
    secret: str | None = Field(
        None,
        description="Shared HMAC-SHA256 secret; when set, unauthenticated messages are rejected. "
        f"Prefer the {SECRET_ENV} environment variable.",
    )
    max_message_bytes: int = Field(
        1 << 20, ge=1024, le=64 << 20, description="Largest control message accepted."
    )


class TransportSettings(_Section):
    """How KV bytes move (NIXL)."""

    backend: Literal["UCX", "LIBFABRIC"] = Field("UCX", description="NIXL backend plugin.")
    progress_thread: bool = Field(
        True, description="Run NIXL's progress thread (passive-side progress, wire-up)."
    )
    progress_delay_us: int = Field(
        10000,
        ge=100,
        le=1_000_000,
        description="Sleep of NIXL's progress thread between passes. nixl's Python API "
        "hard-codes 0, which spins a whole core per agent; our own poller drives progress "
        "while transfers are active.",
    )
    active_poll_us: int = Field(
        100, ge=10, le=100_000, description="Poll period while transfers are in flight."
    )
    idle_poll_ms: int = Field(
        50, ge=1, le=10_000, description="Longest sleep of the poller when nothing is in flight."
    )
    num_threads: int = Field(0, ge=0, le=64, description="NIXL backend worker threads (0: default).")


class PushSettings(_Section):
    """Push scheduling on P."""

    chunk_bytes: int = Field(
        4 << 20, ge=4096, le=1 << 30, description="Largest single WRITE posted for a transfer."
    )
    target_latency_ms: float = Field(
        2.0, gt=0, le=10_000, description="In-flight bytes per link = bandwidth x this."
    )
    max_inflight_chunks: int = Field(64, ge=1, le=100_000, description="Cap per link.")
    chunk_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="A chunk still in flight after this has failed (TIMEOUT)."
    )


class CreditSettings(_Section):
    """D's receive window for inbound transfers."""

    budget_fraction: float = Field(
        0.5, gt=0, le=1.0, description="Fraction of D's KV blocks inbound transfers may reserve."
    )
    per_peer_fraction: float = Field(
        1.0, gt=0, le=1.0, description="Fraction of the budget one prefill peer may hold."
    )


class LeaseSettings(_Section):
    """Permits (D lets P write) and send leases (P holds blocks for D)."""

    permit_ttl_s: float = Field(
        5.0, gt=0, le=3600, description="Write permit term (renewed while P is alive)."
    )
    send_lease_ttl_s: float = Field(
        60.0, gt=0, le=3600, description="How long P holds finished blocks for D without news."
    )
    heartbeat_interval_s: float = Field(1.0, gt=0, le=600, description="Lease renewal period.")
    stop_margin_s: float = Field(
        1.0, ge=0, le=600, description="P stops posting this long before its permit expires."
    )
    skew_margin_s: float = Field(
        1.0, ge=0, le=600, description="D reuses blocks only this long after permit expiry."
    )
    peer_timeout_s: float = Field(
        3.0, gt=0, le=600, description="A peer unheard this long is presumed dead (no renewals)."
    )
    transfer_timeout_s: float = Field(
        120.0, gt=0, le=86_400, description="Hard bound on one transfer, queueing included."
    )

    @model_validator(mode="after")
    def _margins_fit(self) -> LeaseSettings:
        if self.stop_margin_s >= self.permit_ttl_s:
            raise ValueError(
                f"stop_margin_s={self.stop_margin_s} must be below permit_ttl_s="
                f"{self.permit_ttl_s}: otherwise P could never write"
            )
        if self.heartbeat_interval_s * 2 > self.permit_ttl_s:
            raise ValueError(
                f"heartbeat_interval_s={self.heartbeat_interval_s} must be at most half of "
                f"permit_ttl_s={self.permit_ttl_s} so one lost heartbeat does not expire a permit"
            )
        return self


class RetrySettings(_Section):
    """Retries of failed chunks (full-jitter exponential backoff, per-peer budget)."""

    max_attempts: int = Field(3, ge=1, le=100)
    base_backoff_ms: float = Field(2.0, gt=0, le=60_000)
    max_backoff_ms: float = Field(200.0, gt=0, le=600_000)
    budget_per_s: float = Field(10.0, gt=0, le=100_000, description="Retry tokens per second per peer.")
    budget_burst: int = Field(20, ge=1, le=100_000)


class BreakerSettings(_Section):
    """Per-peer circuit breaker."""

    failure_threshold: int = Field(3, ge=1, le=1000)
    window_s: float = Field(10.0, gt=0, le=3600)
    cooldown_s: float = Field(5.0, gt=0, le=3600)
    max_cooldown_s: float = Field(300.0, gt=0, le=86_400)


class FallbackSettings(_Section):
    """What happens when a push cannot complete."""

    pull: bool = Field(True, description="Let D pull (READ) the KV when the push fails.")
    pull_permit_s: float = Field(
        30.0, gt=0, le=3600, description="How long D may READ P's blocks after a FALLBACK."
    )


class VerifySettings(_Section):
    """Extra correctness checks (cost CPU; for tests and canaries)."""

    checksums: bool = Field(
        False, description="P sends a crc32 of the pushed blocks; D checks it on arrival."
    )


class KvpushConfig(_Section):
    """Everything the connector reads. Unknown keys are errors."""

    control: ControlSettings = ControlSettings()
    transport: TransportSettings = TransportSettings()
    push: PushSettings = PushSettings()
    credits: CreditSettings = CreditSettings()
    leases: LeaseSettings = LeaseSettings()
    retry: RetrySettings = RetrySettings()
    breaker: BreakerSettings = BreakerSettings()
    fallback: FallbackSettings = FallbackSettings()
    verify: VerifySettings = VerifySettings()
    faults: FaultSettings = FaultSettings()


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _format_validation(err: ValidationError, source: str) -> str:
    lines = [f"invalid kvpush configuration ({source}):"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        value = e.get("input")
        if e["type"] == "extra_forbidden":
            lines.append(
                f"  - {path}: unknown key (value {value!r}); remove it or fix its spelling "
                "(see docs/configuration.md for the keys)"
            )
        else:
            lines.append(f"  - {path}: {e['msg']} (got {value!r}); see docs/configuration.md")
    return "\n".join(lines)


def read_profile(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML profile, with clear errors for a missing file or bad YAML."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"profile {str(p)!r} does not exist; pass an existing YAML file "
            "(e.g. configs/default.yaml) as kv_connector_extra_config.profile"
        )
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"profile {str(p)!r} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"profile {str(p)!r} must hold a mapping of sections, got {type(data).__name__}"
        )
    return data


def load_config(
    profile: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> KvpushConfig:
    """Profile YAML, then overrides (kv_connector_extra_config), then env secrets."""
    env = dict(os.environ) if env is None else env
    profile = profile or env.get(PROFILE_ENV)
    data: dict[str, Any] = read_profile(profile) if profile else {}
    if overrides:
        data = _merge(data, overrides)
    secret = env.get(SECRET_ENV)
    if secret:
        data = _merge(data, {"control": {"secret": secret}})
    source = f"profile={str(profile)!r}" if profile else "defaults"
    try:
        return KvpushConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation(exc, source)) from None


def config_from_extra(extra: dict[str, Any] | None) -> KvpushConfig:
    """The config from vLLM's ``kv_connector_extra_config`` (``profile`` + section overrides)."""
    extra = dict(extra or {})
    profile = extra.pop("profile", None)
    if profile is not None and not isinstance(profile, str):
        raise ConfigError(
            f"kv_connector_extra_config.profile must be a path string, got {profile!r}"
        )
    return load_config(profile, extra)
