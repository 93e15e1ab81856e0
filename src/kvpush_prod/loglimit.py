"""Log lines a flood cannot multiply.

A peer that sends ten thousand bad messages must cost ten thousand counter increments, not
ten thousand log lines: formatting and writing them stalls the thread that also serves
every other request (measured in the hostile e2e test: 35,000 "rejected" lines on P during
one flood, and a normal request's permit ran out meanwhile). Every event is still counted
in a metric by the caller; the log shows the first of each kind at once and then at most
one line per kind and interval, naming how many it left out.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Hashable

MAX_KEYS = 1024  # kinds are bounded vocabularies; this only bounds a caller's mistake


class LogLimiter:
    """At most one log line per key every ``every_s`` seconds; the rest are counted and
    named in the key's next line."""

    def __init__(
        self,
        logger: logging.Logger,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._every_s = every_s
        self._clock = clock
        self._state: dict[Hashable, tuple[float, int]] = {}

    def log(self, level: int, key: Hashable, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless a line of ``key`` went out less than ``every_s`` ago;
        True if it was logged."""
        now = self._clock()
        last, quiet = self._state.get(key, (-math.inf, 0))
        if now - last < self._every_s:
            self._state[key] = (last, quiet + 1)
            return False
        if key not in self._state and len(self._state) >= MAX_KEYS:
            self._state.clear()
        self._state[key] = (now, 0)
        if quiet:
            msg += " (%d more like it since the last such line)"
            args = (*args, quiet)
        self._logger.log(level, msg, *args)
        return True
