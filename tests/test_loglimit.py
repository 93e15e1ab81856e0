"""A flood of one kind of event logs one line per interval, naming what it left out."""

from __future__ import annotations

import logging

import pytest

from kvpush_prod.loglimit import MAX_KEYS, LogLimiter


def test_one_line_per_key_and_interval_then_the_count_of_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    lim = LogLimiter(logging.getLogger("t"), every_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="t"):
        assert lim.log(logging.WARNING, "a", "bad %s", 1)
        for i in range(10_000):
            assert not lim.log(logging.WARNING, "a", "bad %s", i)
        assert lim.log(logging.WARNING, "b", "other")  # another kind is not held back
        now[0] = 10.0
        assert lim.log(logging.WARNING, "a", "bad %s", 2)
    assert [r.getMessage() for r in caplog.records] == [
        "bad 1",
        "other",
        "bad 2 (10000 more like it since the last such line)",
    ]


def test_the_key_table_stays_bounded() -> None:
    lim = LogLimiter(logging.getLogger("t"), clock=lambda: 0.0)
    for i in range(3 * MAX_KEYS):
        lim.log(logging.DEBUG, i, "x")
    assert len(lim._state) <= MAX_KEYS
