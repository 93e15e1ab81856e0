"""Per-key quotas: how much one authenticated engine can make this engine keep or do.

An engine of the deployment holds a valid key; what it sends is authenticated, not benign.
These books bound, per origin key, what the core keeps on its word, and cut heartbeats into
messages small enough that a peer's codec takes them without a long decode.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvpush_prod.core.messages import MAX_LIVE

# The bytes of (transfer id, generation) entries one heartbeat carries at most; a longer list
# goes out as several heartbeats. Each entry costs its id plus at most 13 bytes of msgpack
# (array header, string header, a 64-bit integer). Kept well under SMALL_MESSAGE_BYTES (the
# control codec's limit for every message but REGISTER and FALLBACK), with room for the
# heartbeat's other fields (a slim PeerInfo: ids and an address, about 1 KiB at most).
HEARTBEAT_LIVE_BYTES = 32 << 10
ENTRY_OVERHEAD = 13
# Largest message of any kind but REGISTER and FALLBACK (which carry an agent's metadata, a
# layout and block ids): a heartbeat, a notice or an answer. A peer's decode of one is a
# single call that holds the interpreter (~2 ms for 128 KiB of dense heartbeat entries,
# measured on a 2-core box), so a bigger one is refused before it is decoded.
SMALL_MESSAGE_BYTES = 128 << 10


def entry_bytes(tid: str) -> int:
    """The most bytes one heartbeat entry naming ``tid`` takes on the wire."""
    return len(tid.encode("utf-8", "surrogatepass")) + ENTRY_OVERHEAD


def live_batches(
    live: list[tuple[str, int]], max_bytes: int = HEARTBEAT_LIVE_BYTES
) -> Iterator[list[tuple[str, int]]]:
    """``live`` cut into consecutive batches of at most ``MAX_LIVE`` entries and
    ``max_bytes`` bytes (a batch holds at least one entry); none for an empty list."""
    batch: list[tuple[str, int]] = []
    size = 0
    for entry in live:
        cost = entry_bytes(entry[0])
        if batch and (len(batch) >= MAX_LIVE or size + cost > max_bytes):
            yield batch
            batch, size = [], 0
        batch.append(entry)
        size += cost
    if batch:
        yield batch


class OriginBook:
    """Origin key -> the transfer ids it holds under a quota of ``limit`` each.

    The caller adds an id when the origin's word makes it keep something (a REGISTER for a
    transfer the engine does not know yet) and discards it when that stops (the engine
    learns the transfer, or forgets it). ``full`` says whether the origin is at its quota.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a per-key quota of {limit}: must be at least 1")
        self.limit = limit
        self._by_origin: dict[str, set[str]] = {}

    def full(self, origin: str) -> bool:
        return len(self._by_origin.get(origin, ())) >= self.limit

    def add(self, origin: str, tid: str) -> None:
        self._by_origin.setdefault(origin, set()).add(tid)

    def discard(self, origin: str, tid: str) -> None:
        held = self._by_origin.get(origin)
        if held is None:
            return
        held.discard(tid)
        if not held:
            del self._by_origin[origin]

    def count(self, origin: str) -> int:
        return len(self._by_origin.get(origin, ()))

    def __len__(self) -> int:
        """Every id held, all origins together."""
        return sum(len(held) for held in self._by_origin.values())
