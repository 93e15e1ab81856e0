"""Incarnations of a peer's processes that were replaced, remembered to drop their late
messages; only the latest few are kept, so a peer restarted many times over a long uptime
costs nothing (a message of a process 64 restarts ago is no longer in flight)."""

from __future__ import annotations

from collections.abc import Iterator

RETIRED_KEEP = 64


class RetiredIncarnations:
    """The last ``keep`` replaced incarnations of one peer."""

    def __init__(self, keep: int = RETIRED_KEEP) -> None:
        self.keep = keep
        self._order: dict[int, None] = {}

    def add(self, incarnation: int) -> None:
        self._order.pop(incarnation, None)
        self._order[incarnation] = None
        while len(self._order) > self.keep:
            del self._order[next(iter(self._order))]

    def __contains__(self, incarnation: object) -> bool:
        return incarnation in self._order

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)
