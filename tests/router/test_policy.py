"""Pairing policies: round robin alternates and skips the ineligible; least loaded picks idle.

Pure unit tests on Backend objects; no network.
"""

from __future__ import annotations

from kvpush_prod.router.policy import LeastLoaded, RoundRobin
from kvpush_prod.router.types import Backend, Role


def backends(n: int) -> list[Backend]:
    return [Backend(Role.DECODE, f"http://d{i}:1", healthy=True) for i in range(n)]


def test_round_robin_cycles_in_configured_order():
    bs, rr = backends(3), RoundRobin()
    assert [rr.choose(bs, bs).url for _ in range(4)] == [
        "http://d0:1", "http://d1:1", "http://d2:1", "http://d0:1",
    ]  # fmt: skip


def test_round_robin_skips_ineligible_and_stays_fair_when_it_returns():
    bs, rr = backends(3), RoundRobin()
    assert rr.choose(bs, bs) is bs[0]
    assert rr.choose(bs, [bs[0], bs[2]]) is bs[2]  # d1 out: skipped, not restarted at d0
    assert rr.choose(bs, bs) is bs[0]
    assert rr.choose(bs, bs) is bs[1]


def test_least_loaded_picks_fewest_inflight_ties_round_robin():
    bs, ll = backends(3), LeastLoaded()
    bs[0].inflight, bs[1].inflight, bs[2].inflight = 2, 0, 0
    assert ll.choose(bs, bs) is bs[1]
    assert ll.choose(bs, bs) is bs[2]  # tie with d1: rotation moves on
    bs[2].inflight = 5
    assert ll.choose(bs, bs) is bs[1]
    assert ll.choose(bs, [bs[0], bs[2]]) is bs[0]
