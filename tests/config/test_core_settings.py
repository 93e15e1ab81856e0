"""One set of defaults: the core's settings dataclasses default to what the configuration
defaults to, and ``config.core`` is the one mapping between them."""

from __future__ import annotations

from kvpush_prod.config import KvpushConfig, config_from_extra
from kvpush_prod.config.core import core_settings, credit_settings
from kvpush_prod.core.credits import CreditSettings
from kvpush_prod.core.receiver import ReceiverSettings
from kvpush_prod.core.sender import SenderSettings
from kvpush_prod.core.transfer import TransferTimeouts


def test_the_default_configuration_maps_onto_the_core_defaults() -> None:
    settings = core_settings(KvpushConfig(), 4096)
    assert settings.sender == SenderSettings(block_bytes=4096, await_connect=True)
    assert settings.receiver == ReceiverSettings(block_bytes=4096, await_connect=True)


def test_every_mapped_key_reaches_the_core() -> None:
    cfg = config_from_extra(
        {
            "push": {"chunk_bytes": 1 << 20, "target_latency_ms": 7.0},
            "leases": {
                "permit_ttl_s": 8.0,
                "send_lease_ttl_s": 30.0,
                "heartbeat_interval_s": 2.0,
                "stop_margin_s": 0.5,
                "skew_margin_s": 0.25,
                "register_grace_s": 4.0,
                "peer_timeout_s": 6.0,
                "transfer_timeout_s": 40.0,
            },
            "retry": {
                "max_attempts": 5,
                "base_backoff_ms": 3.0,
                "max_backoff_ms": 30.0,
                "budget_per_s": 2.0,
                "budget_burst": 4,
            },
            "breaker": {
                "failure_threshold": 2,
                "window_s": 3.0,
                "cooldown_s": 4.0,
                "max_cooldown_s": 40.0,
            },
            "fallback": {"pull": False, "pull_permit_s": 12.0},
            "control": {"max_peers": 7},
        }
    )
    s = core_settings(cfg, 100)
    tx, rx = s.sender, s.receiver
    assert (
        tx.scheduler.chunk_bytes,
        tx.scheduler.target_latency_s,
        tx.scheduler.stop_margin_s,
    ) == (1 << 20, 0.007, 0.5)
    assert rx.scheduler == tx.scheduler and rx.retry == tx.retry and rx.budget == tx.budget
    assert (tx.retry.max_attempts, tx.retry.backoff_base_s, tx.retry.backoff_max_s) == (
        5,
        0.003,
        0.03,
    )
    assert (tx.budget.rate_per_s, tx.budget.burst) == (2.0, 4)
    assert (
        tx.breaker.failure_threshold,
        tx.breaker.window_s,
        tx.breaker.cooldown_s,
        tx.breaker.max_cooldown_s,
    ) == (2, 3.0, 4.0, 40.0)
    assert tx.timeouts == rx.timeouts == TransferTimeouts.within(40.0, 12.0)
    assert tx.timeouts.fallback_s == 12.0 + 10.0 and tx.timeouts.pushing_s == 40.0
    assert (
        tx.send_lease_s,
        tx.stop_margin_s,
        tx.skew_margin_s,
        tx.heartbeat_s,
        tx.fallback,
        tx.pull_permit_s,
        tx.register_grace_s,
        tx.max_peers,
    ) == (30.0, 0.5, 0.25, 2.0, False, 12.0, 4.0, 7)
    assert (
        rx.permit_ttl_s,
        rx.skew_margin_s,
        rx.stop_margin_s,
        rx.heartbeat_s,
        rx.peer_timeout_s,
        rx.max_peers,
    ) == (8.0, 0.25, 0.5, 2.0, 6.0, 7)


def test_the_credit_budget_is_a_fraction_of_the_kv_cache() -> None:
    cfg = config_from_extra({"credits": {"budget_fraction": 0.25, "per_peer_fraction": 0.5}})
    assert credit_settings(cfg, 1000) == CreditSettings(budget_blocks=250, per_peer_cap_blocks=125)
    assert credit_settings(cfg, 1) == CreditSettings(budget_blocks=1, per_peer_cap_blocks=1)


def test_a_staging_area_caps_the_credit_budget_at_the_blocks_it_holds() -> None:
    # 4 MiB of 64 KiB blocks: 64 slots, under a quarter of 1000 blocks (250).
    cfg = config_from_extra(
        {
            "credits": {"budget_fraction": 0.25, "per_peer_fraction": 0.5},
            "staging": {"receive_mib": 4},
        }
    )
    assert credit_settings(cfg, 1000, 64 << 10) == CreditSettings(
        budget_blocks=64, per_peer_cap_blocks=32
    )
    # An area larger than the budget leaves the budget as it is.
    assert credit_settings(cfg, 100, 64 << 10) == CreditSettings(
        budget_blocks=25, per_peer_cap_blocks=12
    )
    # Off: the fraction of the KV cache alone.
    off = config_from_extra({"credits": {"budget_fraction": 0.25, "per_peer_fraction": 0.5}})
    assert credit_settings(off, 1000, 64 << 10) == CreditSettings(
        budget_blocks=250, per_peer_cap_blocks=125
    )


def test_a_staging_area_that_holds_no_block_is_refused_with_the_size_it_needs() -> None:
    import pytest

    from kvpush_prod.config.core import staging_blocks
    from kvpush_prod.errors import ConfigError

    cfg = config_from_extra({"staging": {"receive_mib": 1}})
    assert staging_blocks(cfg, 1 << 19) == 2
    with pytest.raises(ConfigError, match=r"staging.receive_mib=1 holds no KV block.*at least 3"):
        staging_blocks(cfg, 5 << 19)
