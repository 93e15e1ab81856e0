"""Pairing policies: round robin alternates and skips the ineligible; least loaded picks idle.

Pure unit tests on Backend objects; no network.
"""

from __future__ import annotations

from kvpush_prod.router.health import parse_load
from kvpush_prod.router.policy import EngineLoadAware, LeastLoaded, RoundRobin
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
