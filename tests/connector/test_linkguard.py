"""The slow-link guard: below the fraction for the whole window is slow (logged once, with the
transports); a single measured tick at or above clears it; idle ticks neither count nor clear;
no expectation, no guard."""

from __future__ import annotations

import logging

import pytest

from kvpush_prod.config import load_config
from kvpush_prod.connector.linkguard import GBIT, LinkGuard

EXPECTED = 100 * GBIT  # 100 Gbit/s = 12.5 GB/s


def guard() -> LinkGuard:
    return LinkGuard(EXPECTED, 0.5, 10.0, "NIXL backend UCX; UCX between hosts: tcp")


def test_below_the_fraction_for_the_window_is_slow_and_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    g = guard()
    slow = EXPECTED * 0.3
    with caplog.at_level(logging.INFO, "kvpush_prod.connector.linkguard"):
        got = [g.observe("decode-0", slow, True, t) for t in (0.0, 5.0, 9.9, 10.0, 11.0, 30.0)]
    assert got == [False, False, False, True, True, True]
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "link to decode-0 is slow: measured 3.750 GB/s (30.00 Gbit/s), below 50% of " \
           "links.expected_gbps=100 for 10 s" in record.getMessage()
    assert "transports in use: NIXL backend UCX; UCX between hosts: tcp" in record.getMessage()


def test_one_fast_tick_clears_it_and_the_window_starts_again(
        caplog: pytest.LogCaptureFixture) -> None:
    g = guard()
    for t in (0.0, 10.0):
        g.observe("d", EXPECTED * 0.1, True, t)
    with caplog.at_level(logging.INFO, "kvpush_prod.connector.linkguard"):
        assert g.observe("d", EXPECTED * 0.5, True, 11.0) is False  # at the fraction: fine
    assert "back to" in caplog.records[-1].getMessage()
    assert [g.observe("d", EXPECTED * 0.1, True, t) for t in (12.0, 21.9, 22.0)] == \
        [False, False, True]


def test_a_dip_shorter_than_the_window_is_not_slow() -> None:
    g = guard()
    ticks = [(0.0, 0.1), (5.0, 0.1), (9.0, 0.9), (12.0, 0.1), (21.0, 0.1)]
    assert not any(g.observe("d", EXPECTED * f, True, t) for t, f in ticks)


def test_idle_ticks_neither_count_nor_clear() -> None:
    g = guard()
    assert g.observe("d", EXPECTED * 0.1, False, 0.0) is False  # idle from the start: unknown
    g.observe("d", EXPECTED * 0.1, True, 1.0)
    assert g.observe("d", EXPECTED * 0.1, False, 50.0) is False  # idle: not measured
    assert g.observe("d", EXPECTED * 0.1, True, 51.0) is True  # measured low since t=1
    assert g.observe("d", EXPECTED, False, 52.0) is True  # idle: the slow verdict stays


def test_links_are_judged_apart() -> None:
    g = guard()
    for t in (0.0, 10.0):
        g.observe("slow", EXPECTED * 0.1, True, t)
        g.observe("fast", EXPECTED, True, t)
    assert g.observe("slow", EXPECTED * 0.1, True, 11.0) is True
    assert g.observe("fast", EXPECTED, True, 11.0) is False
    g.forget("slow")
    assert g.observe("slow", EXPECTED * 0.1, True, 12.0) is False


def test_the_profile_sets_the_guard_and_no_expectation_means_none() -> None:
    assert LinkGuard.from_config(load_config()) is None
    cfg = load_config(None, {"links": {"expected_gbps": 8, "slow_fraction": 0.25,
                                       "slow_window_s": 3}})
    g = LinkGuard.from_config(cfg)
    assert g is not None
    assert (g.expected, g.threshold, g.window_s) == (1e9, 0.25e9, 3)
    assert g.transports.startswith("NIXL backend UCX")
    efa = LinkGuard.from_config(load_config("efa-p5en"))
    assert efa is not None and efa.expected == 50e9 and "EFA devices" in efa.transports
