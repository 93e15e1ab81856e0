"""The slow-link guard: a link whose measured bandwidth stays below a fraction of what the
profile expects (``links.*``) for a sustained window is slow, once, with its transports named.

Pure logic fed by P's pump each gauge tick (``observe``); the pump exports the answer as
``kvpush_link_slow``. Only ticks where the link's estimate moved count (a chunk completed
since the last tick): an idle link keeps its last estimate, which says nothing new, and
the scheduler's initial guess before the first completion is no measurement.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvpush_prod.config import KvpushConfig

logger = logging.getLogger(__name__)
GBIT = 1e9 / 8  # bytes per second in one gigabit per second


@dataclass
class _State:
    last: float  # the estimate seen at the previous tick
    below_since: float | None = None
    slow: bool = False


class LinkGuard:
    """Decides, per link, whether it is slow: below ``fraction`` x ``expected`` (bytes/s) on
    every measured tick for ``window_s``; one measured tick at or above clears it."""

    def __init__(
        self,
        expected_bytes_per_s: float,
        fraction: float,
        window_s: float,
        transports: str,
        log: logging.Logger = logger,
    ) -> None:
        self.expected, self.fraction, self.window_s = expected_bytes_per_s, fraction, window_s
        self.threshold = expected_bytes_per_s * fraction
        self.transports = transports
        self._log = log
        self._links: dict[str, _State] = {}

    def __len__(self) -> int:
        return len(self._links)

    @classmethod
    def from_config(cls, cfg: KvpushConfig) -> LinkGuard | None:
        """The guard ``cfg.links`` asks for (None when no bandwidth is expected)."""
        links = cfg.links
        if links.expected_gbps is None:
            return None
        from kvpush_prod.transport.fabric import describe

        return cls(
            links.expected_gbps * GBIT,
            links.slow_fraction,
            links.slow_window_s,
            describe(cfg.transport.backend),
        )

    def observe(self, link: str, bandwidth: float, now: float) -> bool:
        """Whether ``link`` is slow after this tick (its estimate ``bandwidth`` in bytes/s)."""
        state = self._links.get(link)
        if state is None:  # the first look: the scheduler's guess or an old estimate
            self._links[link] = _State(bandwidth)
            return False
        measured, state.last = bandwidth != state.last, bandwidth
        if not measured:
            return state.slow
        if bandwidth >= self.threshold:
            if state.slow:
                self._log.info(
                    "kvpush: link to %s is back to %.3f GB/s (at least %.0f%% of "
                    "links.expected_gbps)",
                    link,
                    bandwidth / 1e9,
                    self.fraction * 100,
                )
            state.below_since, state.slow = None, False
            return False
        if state.below_since is None:
            state.below_since = now
        if not state.slow and now - state.below_since >= self.window_s:
            state.slow = True
            self._log.warning(
                "kvpush: link to %s is slow: measured %.3f GB/s (%.2f Gbit/s), below %.0f%% "
                "of links.expected_gbps=%g for %.0f s; transports in use: %s. Run `kvpush "
                "doctor --peer` on this host against that peer (docs/operations.md#"
                "kvpushlinkslow)",
                link,
                bandwidth / 1e9,
                bandwidth / GBIT,
                self.fraction * 100,
                self.expected / GBIT,
                now - state.below_since,
                self.transports,
            )
        return state.slow

    def forget(self, link: str) -> None:
        self._links.pop(link, None)
