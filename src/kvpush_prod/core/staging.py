"""D's staging area as ranges of block slots (``staging.receive_mib``): which slots each receive holds.

Pure: a receive of ``n`` blocks takes the lowest free range that holds them all, or, when the
free slots are scattered, the fewest ranges lowest first (P posts one descriptor per range
and layer); freeing merges neighbours. Bounded by the area: never more ranges than slots.
"""

from __future__ import annotations

import bisect

Extent = tuple[int, int]  # (first slot, count)


class StagingPool:
    """Slot ranges of a staging area of ``slots`` block slots.

    Invariants (``tests/core/test_staging.py``): free ranges are disjoint, sorted, never
    adjacent (merged), and free plus held slots is always ``slots``."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"a staging area needs at least one slot, got {slots}")
        self.slots = slots
        self._starts: list[int] = [0]  # free ranges, sorted by start
        self._counts: list[int] = [slots]
        self._held: dict[str, list[Extent]] = {}

    @property
    def free(self) -> int:
        return sum(self._counts)

    @property
    def held(self) -> int:
        return self.slots - self.free

    def __len__(self) -> int:
        return len(self._held)

    def take(self, key: str, n: int) -> list[int] | None:
        """``n`` slots for ``key``, as slot ids in order (None: not enough free, or ``key``
        already holds some: nothing taken)."""
        if n < 1 or key in self._held or n > self.free:
            return None
        whole = next((i for i, c in enumerate(self._counts) if c >= n), None)
        extents: list[Extent] = []
        if whole is not None:
            extents.append(self._cut(whole, n))
        else:
            # Scattered: the largest ranges first (fewest descriptors), then slot order.
            need = n
            for i in sorted(range(len(self._counts)), key=lambda j: -self._counts[j]):
                if need == 0:
                    break
                got = min(need, self._counts[i])
                extents.append((self._starts[i], got))
                need -= got
            for first, count in extents:
                self._cut(self._starts.index(first), count)
            extents.sort()
        self._held[key] = extents
        return [s for first, count in extents for s in range(first, first + count)]

    def _cut(self, i: int, n: int) -> Extent:
        """The first ``n`` slots of free range ``i``."""
        first = self._starts[i]
        if self._counts[i] == n:
            del self._starts[i], self._counts[i]
        else:
            self._starts[i] += n
            self._counts[i] -= n
        return first, n

    def give_back(self, key: str) -> int:
        """Free ``key``'s slots (nothing if it holds none); how many were freed."""
        extents = self._held.pop(key, None)
        if not extents:
            return 0
        for first, count in extents:
            self._insert(first, count)
        return sum(c for _, c in extents)

    def _insert(self, first: int, count: int) -> None:
        i = bisect.bisect_left(self._starts, first)
        if i > 0 and self._starts[i - 1] + self._counts[i - 1] == first:
            i -= 1
            self._counts[i] += count
        else:
            self._starts.insert(i, first)
            self._counts.insert(i, count)
        nxt = i + 1
        if nxt < len(self._starts) and self._starts[i] + self._counts[i] == self._starts[nxt]:
            self._counts[i] += self._counts[nxt]
            del self._starts[nxt], self._counts[nxt]

    def free_ranges(self) -> list[Extent]:
        return list(zip(self._starts, self._counts, strict=True))
