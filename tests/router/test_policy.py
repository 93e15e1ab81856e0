"""Pairing policies: round robin alternates and skips the ineligible; least loaded picks idle.

Pure unit tests on Backend objects; no network.
"""

from __future__ import annotations

from kvpush_prod.router.health import parse_load
from kvpush_prod.router.policy import EngineLoadAware, LeastLoaded, LinkAware, RoundRobin
from kvpush_prod.router.types import Backend, EngineLoad, Role


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


def test_engine_load_prefers_the_engine_with_less_queued_work_and_a_kv_cache_not_full():
    bs, el = backends(3), EngineLoadAware()
    bs[0].load = EngineLoad(running=4, waiting=3)  # a queue: worst
    bs[1].load = EngineLoad(running=4, waiting=0, kv_usage=0.99)  # about to preempt
    bs[2].load = EngineLoad(running=6, waiting=0, kv_usage=0.3)
    assert el.choose(bs, bs) is bs[2]
    bs[2].inflight = 20  # legs the router sent since the last reading count too
    # d0: 7 busy + 2 x 3 queued = 13; d1: 4 busy + 50 x (0.99 - 0.8) = 13.5
    assert el.choose(bs, bs) is bs[0]
    bs[0].load = EngineLoad(running=4, waiting=5)
    assert el.choose(bs, bs) is bs[1]
    assert el.choose(bs, [bs[0]]) is bs[0]
    fresh = backends(2)  # never read: legs in flight only, ties round robin
    el = EngineLoadAware()
    assert [el.choose(fresh, fresh).url for _ in range(2)] == ["http://d0:1", "http://d1:1"]


def test_parse_load_sums_cores_and_takes_the_fullest_kv_cache():
    text = """# HELP vllm:num_requests_running x
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
kvpush_connector_blocks{role="consumer"} 7.0
"""
    assert parse_load(text, 5.0) == EngineLoad(5.0, 1.0, 0.75, 5.0)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_link_aware_tries_each_untimed_pair_then_prefers_the_faster_link() -> None:
    p = Backend(Role.PREFILL, "http://p0:1", healthy=True)
    ds, clock = backends(2), Clock()
    la = LinkAware(explore_every=0, clock=clock)
    # Nothing timed yet: every D in turn.
    assert [la.choose_for(p, ds, ds) for _ in range(2)] == [ds[0], ds[1]]
    # d1's link takes 4x as long per prompt token (prompts of different lengths).
    la.observe(p, ds[0], 0.5, 1000)
    la.observe(p, ds[1], 1.0, 500)
    assert [la.choose_for(p, ds, ds) for _ in range(3)] == [ds[0]] * 3
    # ... until d0's queue makes it the later finish: 0.5 + 4 x 1.25 (the median pair's
    # cost, per leg in flight) > 2 ms per 1000 tokens.
    ds[0].inflight = 4
    assert la.choose_for(p, ds, ds) is ds[1]
    ds[0].inflight = 0
    # Equal links share the requests: least legs in flight, ties in turn.
    e = LinkAware(explore_every=0, clock=clock)
    for d in ds:
        e.observe(p, d, 0.0, 1000)  # D's first token came before P's answer did
    ds[0].inflight = 1
    assert e.choose_for(p, ds, ds) is ds[1]
    ds[0].inflight = 0
    assert [e.choose_for(p, ds, ds) for _ in range(2)] == [ds[0], ds[1]]
    # A pair is timed per P: another P's link to d1 may be the fast one.
    q = Backend(Role.PREFILL, "http://p1:1", healthy=True)
    la.observe(q, ds[0], 2.0, 1000)
    la.observe(q, ds[1], 0.2, 1000)
    assert la.choose_for(q, ds, ds) is ds[1]
    assert la.choose_for(p, ds, ds) is ds[0]
    # An ineligible D is never chosen, however fast.
    assert la.choose_for(q, ds, [ds[0]]) is ds[0]


def test_link_aware_keeps_timing_the_slow_link_and_forgets_stale_times() -> None:
    p = Backend(Role.PREFILL, "http://p0:1", healthy=True)
    ds, clock = backends(2), Clock()
    la = LinkAware(explore_every=4, window=4, stale_s=60.0, clock=clock)
    la.observe(p, ds[0], 0.1, 1000)
    la.observe(p, ds[1], 10.0, 1000)
    clock.t = 1.0
    la.observe(p, ds[0], 0.1, 1000)  # d1 is now the least recently timed
    picks = [la.choose_for(p, ds, ds) for _ in range(8)]
    assert picks.count(ds[1]) == 2  # every 4th choice explores it, the rest go to d0
    # One outlier (a cold connection, a busy box) does not make d0's link slow ...
    la.observe(p, ds[0], 50.0, 1000)
    assert la.estimate(p, ds[0]) == 0.1 / 1000
    # ... but a link that stays slow for a window of requests is seen as slow.
    for _ in range(4):
        la.observe(p, ds[0], 20.0, 1000)
    assert la.estimate(p, ds[0]) == 20.0 / 1000
    # d1's link recovered: half its window fast is enough.
    la.observe(p, ds[1], 0.01, 1000)
    assert la.choose_for(p, ds, ds) is ds[1]
    # A time older than stale_s is not trusted: the pair is tried again as if new.
    clock.t = 100.0
    la.observe(p, ds[1], 10.0, 1000)
    assert la.estimate(p, ds[0]) is None
    assert la.estimate(p, ds[1]) == 10.0 / 1000
    assert la.choose_for(p, ds, ds) is ds[0]
    # Nonsense samples are ignored.
    la.observe(p, ds[1], -1.0, 1000)
    la.observe(p, ds[1], 1.0, 0)
    assert la.estimate(p, ds[1]) == 10.0 / 1000
