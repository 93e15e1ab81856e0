"""D's staging slots (core.staging): no slot is handed out twice, none is lost, one range
whenever one range can hold a receive."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpush_prod.core.staging import StagingPool


def _check(pool: StagingPool, held: dict[str, list[int]]) -> None:
    ranges = pool.free_ranges()
    for (a, n), (b, _) in zip(ranges, ranges[1:], strict=False):
        assert a + n < b  # sorted, disjoint, merged
    free = {s for a, n in ranges for s in range(a, a + n)}
    taken = [s for ids in held.values() for s in ids]
    assert len(taken) == len(set(taken))  # no slot held twice
    assert not free & set(taken)
    assert len(free) + len(taken) == pool.slots
    assert all(0 <= s < pool.slots for s in free | set(taken))


def test_one_range_when_one_holds_the_receive() -> None:
    pool = StagingPool(10)
    assert pool.take("a", 3) == [0, 1, 2]
    assert pool.take("b", 3) == [3, 4, 5]
    assert pool.give_back("a") == 3
    # 0-2 and 6-9 free: 4 slots fit in 6-9, whole
    assert pool.take("c", 4) == [6, 7, 8, 9]
    assert pool.free_ranges() == [(0, 3)]


def test_scattered_free_slots_are_taken_largest_range_first() -> None:
    pool = StagingPool(10)
    for key, n in [("a", 2), ("b", 1), ("c", 3), ("d", 1), ("e", 3)]:
        pool.take(key, n)
    pool.give_back("a")  # 0-1
    pool.give_back("c")  # 3-5
    pool.give_back("e")  # 7-9
    # No range holds 7: the two of 3 first, then one slot of 0-1; in slot order.
    assert pool.take("f", 7) == [0, 3, 4, 5, 7, 8, 9]
    assert pool.free_ranges() == [(1, 1)]


def test_refuses_what_does_not_fit_and_a_key_twice() -> None:
    pool = StagingPool(4)
    assert pool.take("a", 5) is None
    assert pool.take("a", 0) is None
    assert pool.take("a", 4) == [0, 1, 2, 3]
    assert pool.take("b", 1) is None
    assert pool.take("a", 1) is None  # already holds
    assert pool.give_back("x") == 0
    with pytest.raises(ValueError, match="at least one slot"):
        StagingPool(0)


@given(
    st.integers(1, 64),
    st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(1, 40)), max_size=80),
)
def test_no_slot_is_lost_or_handed_out_twice(slots: int, ops: list[tuple[bool, int, int]]) -> None:
    pool = StagingPool(slots)
    held: dict[str, list[int]] = {}
    for take, k, n in ops:
        key = f"t{k}"
        if take:
            one_range = any(c >= n for _, c in pool.free_ranges())
            fits = n <= pool.free and key not in held
            ids = pool.take(key, n)
            assert (ids is not None) == fits
            if ids is not None:
                assert len(ids) == n
                held[key] = ids
                if one_range:
                    assert ids == list(range(ids[0], ids[0] + n))
        else:
            assert pool.give_back(key) == len(held.pop(key, []))
        assert len(pool) == len(held)
        _check(pool, held)
