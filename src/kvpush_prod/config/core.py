"""The one mapping from the configuration (``KvpushConfig``) to the protocol core's settings.

The core's settings dataclasses default to what the configuration defaults to (a test holds
them equal), so whatever is not mapped here reads the same in the core and in the config.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush_prod.config.settings import KvpushConfig
from kvpush_prod.core.credits import CreditSettings
from kvpush_prod.core.receiver import ReceiverSettings
from kvpush_prod.core.retry import BreakerSettings, BudgetSettings, RetrySettings
from kvpush_prod.core.scheduler import SchedulerSettings
from kvpush_prod.core.sender import SenderSettings
from kvpush_prod.core.transfer import TransferTimeouts
from kvpush_prod.errors import ConfigError


@dataclass(frozen=True, slots=True)
class CoreSettings:
    """Both sides' protocol settings for one worker rank (the role picks one)."""

    sender: SenderSettings
    receiver: ReceiverSettings


def core_settings(cfg: KvpushConfig, block_bytes: int) -> CoreSettings:
    """The Sender's and the Receiver's settings for a rank whose block is ``block_bytes``."""
    leases, retry = cfg.leases, cfg.retry
    scheduler = SchedulerSettings(
        chunk_bytes=cfg.push.chunk_bytes,
        target_latency_s=cfg.push.target_latency_ms / 1000.0,
        max_inflight_chunks=cfg.push.max_inflight_chunks,
        stop_margin_s=leases.stop_margin_s,
    )
    retries = RetrySettings(
        max_attempts=retry.max_attempts,
        backoff_base_s=retry.base_backoff_ms / 1000.0,
        backoff_max_s=max(retry.max_backoff_ms, retry.base_backoff_ms) / 1000.0,
    )
    budget = BudgetSettings(rate_per_s=retry.budget_per_s, burst=retry.budget_burst)
    timeouts = TransferTimeouts.within(leases.transfer_timeout_s, cfg.fallback.pull_permit_s)
    sender = SenderSettings(
        block_bytes=block_bytes,
        scheduler=scheduler,
        retry=retries,
        budget=budget,
        breaker=BreakerSettings(
            failure_threshold=cfg.breaker.failure_threshold,
            window_s=cfg.breaker.window_s,
            cooldown_s=cfg.breaker.cooldown_s,
            max_cooldown_s=cfg.breaker.max_cooldown_s,
        ),
        timeouts=timeouts,
        send_lease_s=leases.send_lease_ttl_s,
        stop_margin_s=leases.stop_margin_s,
        skew_margin_s=leases.skew_margin_s,
        heartbeat_s=leases.heartbeat_interval_s,
        fallback=cfg.fallback.pull,
        pull_permit_s=cfg.fallback.pull_permit_s,
        register_grace_s=leases.register_grace_s,
        max_peers=cfg.control.max_peers,
        done_query_s=retry.done_query_timeout_ms / 1000.0,
        await_connect=True,  # the connector's pump connects off its thread (ConnectPeer)
        chunk_by_regions=cfg.push.chunk_by == "layers",
    )
    receiver = ReceiverSettings(
        block_bytes=block_bytes,
        permit_ttl_s=leases.permit_ttl_s,
        skew_margin_s=leases.skew_margin_s,
        stop_margin_s=leases.stop_margin_s,
        heartbeat_s=leases.heartbeat_interval_s,
        peer_timeout_s=leases.peer_timeout_s,
        scheduler=scheduler,
        retry=retries,
        budget=budget,
        timeouts=timeouts,
        max_peers=cfg.control.max_peers,
        await_connect=True,  # the connector's pump connects off its thread (ConnectPeer)
    )
    return CoreSettings(sender, receiver)


def credit_settings(cfg: KvpushConfig, num_blocks: int, block_bytes: int = 0) -> CreditSettings:
    """D's credit budget over its ``num_blocks`` KV blocks of ``block_bytes`` each (every
    layer of one block on this rank), capped at the blocks of its staging area when on."""
    credits = CreditSettings.from_fractions(
        num_blocks, cfg.credits.budget_fraction, cfg.credits.per_peer_fraction
    )
    staged = staging_blocks(cfg, block_bytes)
    if not staged or staged >= credits.budget_blocks:
        return credits
    return CreditSettings.from_fractions(staged, 1.0, cfg.credits.per_peer_fraction)


def staging_blocks(cfg: KvpushConfig, block_bytes: int) -> int:
    """Blocks (of ``block_bytes``: every layer of one block) D's staging area holds; 0: off.

    The scheduler and each worker compute it from the same figures (vLLM's page size times
    layers), so the credit budget never promises more than a worker can stage."""
    return slots_of(cfg.staging.receive_mib, block_bytes, "staging.receive_mib")


def slots_of(mib: int, block_bytes: int, key: str) -> int:
    """Blocks of ``block_bytes`` an area of ``mib`` MiB holds (0: off); config ``key``
    named in the error when it holds none."""
    if not mib or block_bytes <= 0:
        return 0
    blocks = (mib << 20) // block_bytes
    if blocks < 1:
        raise ConfigError(
            f"{key}={mib} holds no KV block of this engine ({block_bytes} bytes over all "
            f"layers); set it to at least {-(-block_bytes // (1 << 20))} or 0 (off)"
        )
    return blocks


def layerwise_on(
    mode: str,
    blocks: int,
    block_bytes: int,
    block_tokens: int,
    bandwidth: float,
    min_tokens: int,
    min_transfer_ms: float,
) -> bool:
    """Whether a step whose prompts to push hold ``blocks`` blocks is pushed layer by layer
    (``push.layerwise``): always (on), never (off), or (auto) when they hold at least
    ``min_tokens`` tokens (blocks x block size) and their KV takes at least
    ``min_transfer_ms`` at ``bandwidth`` bytes/s (the slowest of P's links as whole pushes
    measured it, ``ChunkScheduler.slowest_whole_bandwidth``: a layer-wise push's small
    chunks measure a link slower and would keep auto on; short transfers gain little overlap
    and pay a post per layer). The connector and the simulator both decide here."""
    if mode != "auto":
        return mode == "on"
    if blocks * block_tokens < min_tokens:
        return False
    return blocks * block_bytes * 1000.0 / max(bandwidth, 1.0) >= min_transfer_ms
