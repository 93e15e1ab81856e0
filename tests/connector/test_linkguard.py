"""The slow-link guard: below the fraction on every measured tick for the whole window is
slow (logged once, with the transports); one measured tick at or above clears it; ticks
where the estimate did not move (no chunk completed: idle) neither count nor clear; the
first look (the scheduler's guess) is no measurement; no expectation, no guard."""

from __future__ import annotations

import itertools
import logging

import pytest

from kvpush_prod.config import load_config
from kvpush_prod.connector.linkguard import GBIT, LinkGuard

EXPECTED = 100 * GBIT  # 100 Gbit/s = 12.5 GB/s
_jitter = itertools.count(1)


def measured(fraction: float) -> float:
    """An estimate at ``fraction`` of the expectation that differs from the previous one
    (a chunk completed since the last tick)."""
    return EXPECTED * fraction * (1 + next(_jitter) * 1e-9)


def guard() -> LinkGuard:
    g = LinkGuard(EXPECTED, 0.5, 10.0, "NIXL backend UCX; UCX between hosts: tcp")
    for link in ("d", "decode-0", "slow", "fast"):
        assert g.observe(link, EXPECTED * 0.01, -1.0) is False  # the first look: a guess
    return g


def test_below_the_fraction_for_the_window_is_slow_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    g = guard()
    with caplog.at_level(logging.INFO, "kvpush_prod.connector.linkguard"):
        got = [g.observe("decode-0", measured(0.3), t) for t in (0.0, 5.0, 9.9, 10.0, 11.0, 30.0)]
    assert got == [False, False, False, True, True, True]
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert (
        "link to decode-0 is slow: measured 3.750 GB/s (30.00 Gbit/s), below 50% of "
        "links.expected_gbps=100 for 10 s" in message
    )
    assert "transports in use: NIXL backend UCX; UCX between hosts: tcp" in message


def test_one_fast_tick_clears_it_and_the_window_starts_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    g = guard()
    for t in (0.0, 10.0):
        g.observe("d", measured(0.1), t)
    with caplog.at_level(logging.INFO, "kvpush_prod.connector.linkguard"):
        assert g.observe("d", EXPECTED * 0.5, 11.0) is False  # at the fraction: fine
    assert "back to" in caplog.records[-1].getMessage()
    assert [g.observe("d", measured(0.1), t) for t in (12.0, 21.9, 22.0)] == [False, False, True]


def test_a_dip_shorter_than_the_window_is_not_slow() -> None:
    g = guard()
    ticks = [(0.0, 0.1), (5.0, 0.1), (9.0, 0.9), (12.0, 0.1), (21.0, 0.1)]
    assert not any(g.observe("d", measured(f), t) for t, f in ticks)


def test_ticks_without_a_new_estimate_neither_count_nor_clear() -> None:
    g = guard()
    low = measured(0.1)
    assert g.observe("d", low, 1.0) is False  # measured low from t=1
    assert g.observe("d", low, 50.0) is False  # the same estimate: idle, nothing measured
    assert g.observe("d", measured(0.1), 51.0) is True  # measured low again: slow since t=1
    assert g.observe("d", EXPECTED * 0.1, 52.0) is True  # another low estimate
    assert g.observe("d", EXPECTED * 0.1, 80.0) is True  # idle: the verdict stays


def test_links_are_judged_apart_and_forgotten() -> None:
    g = guard()
    for t in (0.0, 10.0):
        g.observe("slow", measured(0.1), t)
        g.observe("fast", measured(1.0), t)
    assert g.observe("slow", measured(0.1), 11.0) is True
    assert g.observe("fast", measured(1.0), 11.0) is False
    g.forget("slow")
    assert g.observe("slow", measured(0.1), 12.0) is False


def test_the_profile_sets_the_guard_and_no_expectation_means_none() -> None:
    assert LinkGuard.from_config(load_config()) is None
    cfg = load_config(
        None, {"links": {"expected_gbps": 8, "slow_fraction": 0.25, "slow_window_s": 3}}
    )
    g = LinkGuard.from_config(cfg)
    assert g is not None
    assert (g.expected, g.threshold, g.window_s) == (1e9, 0.25e9, 3)
    assert g.transports.startswith("NIXL backend UCX")
    efa = LinkGuard.from_config(load_config("efa-p5en"))
    assert efa is not None and efa.expected == 50e9 and "EFA devices" in efa.transports
