"""The scheduler-side halves on their own, fed the way vLLM's scheduler calls the hooks:
D admits through the credit budget and registers what it allocated, P marks the prompts a
step completes and holds their blocks until the push is over."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvpush_prod.config import KvpushConfig, config_from_extra
from kvpush_prod.connector.metadata import PeerRef, PushWorkerMeta
from kvpush_prod.connector.scheduler import (
    ConsumerSide,
    ProducerSide,
    SchedulerSide,
    scheduler_side,
)
from kvpush_prod.core.vocabulary import Side

BS = 16
PREFILL = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill-0",
    "remote_host": "10.0.0.1",
    "remote_port": 15500,
    "tp_size": 1,
}


def request(rid: str, prompt: int, params: dict[str, Any] | None, computed: int = 0) -> Any:
    return SimpleNamespace(
        request_id=rid,
        num_prompt_tokens=prompt,
        num_computed_tokens=computed,
        kv_transfer_params=params,
        prompt_token_ids=[hash(rid) % 1000 + i for i in range(prompt)],
    )


def d_side(
    budget: float = 0.5, cfg: KvpushConfig | None = None, blocks: int = 100, recompute: bool = False
) -> ConsumerSide:
    cfg = cfg or config_from_extra({"credits": {"budget_fraction": budget}})
    side = scheduler_side(
        cfg, Side.CONSUMER, "decode-0", BS, 1000, 1, 0, blocks, recompute_on_failure=recompute
    )
    assert isinstance(side, ConsumerSide)
    return side


def p_side() -> ProducerSide:
    side = scheduler_side(KvpushConfig(), Side.PRODUCER, "prefill-0", BS, 1000, 1, 0, 100)
    assert isinstance(side, ProducerSide)
    return side


def counters(side: SchedulerSide) -> dict[tuple[str, ...], float]:
    return {(name, *labels): v for name, labels, v in side.get_stats().get("c", [])}


def gauges(side: SchedulerSide) -> dict[tuple[str, ...], float]:
    """The gauges as they stand after a step (a drain carries only changed ones)."""
    side.get_stats()
    return {(name, *labels): v for (name, labels), v in side.stats.gauge_values().items()}


def allocate(side: ConsumerSide, req: Any, ids: list[int], external: int) -> None:
    blocks = SimpleNamespace(get_block_ids=lambda: (ids,))
    side.update_state_after_alloc(req, blocks, external)  # type: ignore[arg-type]


def output(**kw: Any) -> Any:
    base: dict[str, Any] = {
        "finished_sending": None,
        "finished_recving": None,
        "failed_recving": None,
        "kv_connector_worker_meta": None,
    }
    return SimpleNamespace(**{**base, **kw})


# ------------------------------------------------------------------------------ D


def test_a_request_without_a_prefill_loads_nothing() -> None:
    d = d_side()
    assert d.get_num_new_matched_tokens(request("r", 100, None), 0) == (0, False)
    assert d.build_connector_meta(None).empty()  # type: ignore[arg-type]


def test_an_admitted_transfer_loads_its_missing_tokens_and_registers_what_was_allocated() -> None:
    d = d_side()
    req = request("r", 100, {**PREFILL, "transfer_id": "t1"})
    assert d.get_num_new_matched_tokens(req, 16) == (84, True)  # block 0 is D's already
    allocate(d, req, [40, 41, 42, 43, 44, 45, 46], 84)
    (spec,) = d.build_connector_meta(None).recv  # type: ignore[arg-type]
    assert (spec.request_id, spec.transfer_id, spec.p_host, spec.p_port) == (
        "r",
        "t1",
        "10.0.0.1",
        15500,
    )
    assert (spec.block_ids, spec.first_block, spec.num_tokens) == ([41, 42, 43, 44, 45, 46], 1, 100)
    assert counters(d) == {
        ("kvpush_transfers_started", "consumer"): 1,
        ("kvpush_admissions", "consumer", "admit"): 1,
        ("kvpush_credits_granted_blocks", "consumer"): 6,
    }
    # Allocated: its transfer is in flight, the scheduler is told nothing more.
    assert d.get_num_new_matched_tokens(req, 16) == (0, False)


def test_a_transfer_waiting_for_credit_keeps_p_waiting_until_it_is_admitted() -> None:
    d = d_side(budget=0.1)  # 10 blocks of 100
    big = request("big", 160, {**PREFILL, "transfer_id": "t0"})
    assert d.get_num_new_matched_tokens(big, 0) == (160, True)
    req = request("r", 48, {**PREFILL, "transfer_id": "t1"})
    assert d.get_num_new_matched_tokens(req, 0) == (None, False)
    assert d.get_num_new_matched_tokens(req, 0) == (None, False)
    meta = d.build_connector_meta(None)  # type: ignore[arg-type]
    assert meta.wait_admission == [PeerRef("t1", "10.0.0.1", 15500, p_tp=1)]
    allocate(d, big, list(range(10)), 160)
    d.update_connector_output(output(finished_recving={"big"}))
    assert d.get_num_new_matched_tokens(req, 0) == (48, True)
    assert d.build_connector_meta(None).admission_over == ["t1"]  # type: ignore[arg-type]
    c = counters(d)
    assert c[("kvpush_admissions", "consumer", "later")] == 1
    assert c[("kvpush_admissions", "consumer", "admit")] == 2


def test_a_transfer_larger_than_the_budget_is_computed_locally_and_p_told() -> None:
    d = d_side(budget=0.05)
    req = request("r", 160, {**PREFILL, "transfer_id": "t1"})
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)
    assert d.build_connector_meta(None).not_needed == [  # type: ignore[arg-type]
        PeerRef("t1", "10.0.0.1", 15500, p_tp=1)
    ]
    assert counters(d) == {
        ("kvpush_transfers_started", "consumer"): 1,
        ("kvpush_admissions", "consumer", "refuse"): 1,
        ("kvpush_transfers", "consumer", "recompute"): 1,
    }
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)  # not asked about again
    assert d.build_connector_meta(None).empty()  # type: ignore[arg-type]


def test_a_prompt_in_the_prefix_cache_frees_p_at_once() -> None:
    d = d_side()
    req = request("r", 64, {**PREFILL, "transfer_id": "t1"})
    assert d.get_num_new_matched_tokens(req, 64) == (0, False)
    assert len(d.build_connector_meta(None).not_needed) == 1  # type: ignore[arg-type]
    assert counters(d) == {
        ("kvpush_transfers_started", "consumer"): 1,
        ("kvpush_transfers", "consumer", "prefix_hit"): 1,
    }


def test_refused_params_compute_locally_and_are_counted_once() -> None:
    d = d_side()
    req = request("r", 64, {**PREFILL, "remote_port": 0})
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)
    assert counters(d) == {("kvpush_kv_params_rejected", "consumer", "malformed"): 1}


def test_a_request_aborted_while_waiting_for_credit_frees_p() -> None:
    d = d_side()
    req = request("r", 48, {**PREFILL, "transfer_id": "t1"})
    d.get_num_new_matched_tokens(req, 0)
    assert d.request_finished(req, []) == (False, None)
    assert len(d.build_connector_meta(None).not_needed) == 1  # type: ignore[arg-type]
    assert counters(d)[("kvpush_transfers", "consumer", "aborted")] == 1
    assert gauges(d)[("kvpush_credits_in_use_blocks", "consumer")] == 0


def test_a_receive_aborted_in_flight_waits_for_its_fence() -> None:
    d = d_side()
    req = request("r", 48, {**PREFILL, "transfer_id": "t1"})
    d.get_num_new_matched_tokens(req, 0)
    allocate(d, req, [1, 2, 3], 48)
    d.build_connector_meta(None)  # type: ignore[arg-type]
    assert d.request_finished(req, [1, 2, 3]) == (False, None)
    assert d.build_connector_meta(None).abort_recv == ["t1"]  # type: ignore[arg-type]
    assert d.has_pending_push_work()
    d.update_connector_output(output(finished_recving={"r"}))
    assert not d.has_pending_push_work()
    assert gauges(d)[("kvpush_credits_in_use_blocks", "consumer")] == 0


@pytest.mark.parametrize(
    ("failed", "recompute", "reply", "counted"),
    [
        (
            False,
            False,
            {"transfer_id": "t1", "outcome": "pull_fallback", "blocks": 3, "bytes": 3000},
            {("kvpush_transfer_bytes", "consumer"): 3000},
        ),
        (
            # Counted by the worker that failed it (recompute under vLLM's recompute
            # policy): the scheduler counts nothing more (the transfer ends once).
            True,
            True,
            {"transfer_id": "t1", "outcome": "failed", "blocks": 0, "bytes": 0},
            {},
        ),
    ],
)
def test_a_finished_receive_is_summed_up_in_the_reply(
    failed: bool, recompute: bool, reply: dict[str, Any], counted: dict[tuple[str, ...], float]
) -> None:
    d = d_side(recompute=recompute)
    req = request("r", 48, {**PREFILL, "transfer_id": "t1"})
    d.get_num_new_matched_tokens(req, 0)
    allocate(d, req, [1, 2, 3], 48)
    d.get_stats()
    d.update_connector_output(
        output(
            finished_recving={"r"},
            failed_recving={"r"} if failed else None,
            kv_connector_worker_meta=PushWorkerMeta({"r": "pull_fallback"}),
        )
    )
    assert counters(d) == counted
    assert d.request_finished(req, []) == (False, {"kvpush": reply})


def test_the_consumer_gauges_follow_its_receives() -> None:
    d = d_side(budget=0.2)
    req = request("r", 48, {**PREFILL, "transfer_id": "t1"})
    d.get_num_new_matched_tokens(req, 0)
    allocate(d, req, [1, 2, 3], 48)
    g = gauges(d)
    assert g[("kvpush_connector_blocks", "consumer")] == 3
    assert g[("kvpush_transfers_active", "consumer")] == 1
    assert g[("kvpush_leases_active", "consumer", "permit")] == 1
    assert g[("kvpush_credits_budget_blocks", "consumer")] == 20
    assert g[("kvpush_credits_in_use_blocks", "consumer")] == 3


def test_a_probe_gets_this_engines_identity() -> None:
    d = d_side()
    assert d.request_finished(request("r", 1, {"kvpush_probe": True}), []) == (False, d.identity())
    assert d.identity()["remote_port"] == KvpushConfig().control.port


# ------------------------------------------------------------------------------ P

DECODE = {"do_remote_decode": True, "transfer_id": "t1"}


def test_p_pushes_a_prompt_once_computed_and_holds_its_blocks_until_sent() -> None:
    p = p_side()
    req = request("r", 40, DECODE)
    p.on_new_request(req)
    assert p.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).expect_send == [
        ("t1", "")
    ]
    p.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda rid: ([7, 8, 9, 10],)))
    partial = p.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r": 20}))
    assert partial.send == []  # chunked prefill: the prompt completes in a later step
    req.num_computed_tokens = 20
    (spec,) = p.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r": 20})).send
    assert (spec.request_id, spec.transfer_id, spec.block_ids) == ("r", "t1", [7, 8, 9])
    delay, params = p.request_finished(req, [7, 8, 9])
    assert delay and params is not None and params["transfer_id"] == "t1"
    assert p.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).hold == ["t1"]
    assert p.has_pending_push_work()
    assert gauges(p)[("kvpush_leases_active", "producer", "send")] == 1
    p.update_connector_output(output(finished_sending={"r"}))
    assert not p.has_pending_push_work()


def test_p_tells_d_at_once_about_a_request_that_ended_before_its_prompt() -> None:
    p = p_side()
    req = request("r", 40, DECODE)
    p.on_new_request(req)
    delay, params = p.request_finished(req, [])
    assert not delay and params is not None and params["transfer_id"] == "t1"
    assert p.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).abort_send == ["t1"]
    assert counters(p) == {
        ("kvpush_transfers_started", "producer"): 1,
        ("kvpush_transfers", "producer", "aborted"): 1,
    }


def test_p_ignores_what_is_not_its_to_push() -> None:
    p = p_side()
    assert p.get_num_new_matched_tokens(request("r", 40, PREFILL), 0) == (0, False)
    p.on_new_request(request("r", 40, None))
    assert p.request_finished(request("r", 40, None), []) == (False, None)
    probe = request("q", 1, {"do_remote_decode": True, "kvpush_probe": True})
    p.on_new_request(probe)
    assert p.request_finished(probe, []) == (False, p.identity())
    assert p.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).empty()


def test_asked_again_after_a_failed_allocation_with_a_larger_local_hit_registers_the_rest() -> None:
    # vLLM's sequence: get_num_new_matched_tokens admits, allocate_slots fails (no
    # update_state_after_alloc), another request with the same system prompt is cached
    # meanwhile, and the next step asks again with a larger block-aligned local hit.
    d = d_side()
    req = request("r", 100, {**PREFILL, "transfer_id": "t1"})
    assert d.get_num_new_matched_tokens(req, 0) == (100, True)
    assert d.get_num_new_matched_tokens(req, 32) == (68, True)
    allocate(d, req, [7, 8, 50, 51, 52, 53, 54], 68)
    (spec,) = d.build_connector_meta(None).recv  # type: ignore[arg-type]
    assert (spec.block_ids, spec.first_block) == ([50, 51, 52, 53, 54], 2)
    assert d.credits.in_use == 5
    d.update_connector_output(output(finished_recving={"r"}))
    assert d.credits.in_use == 0


def test_asked_again_with_a_smaller_local_hit_is_decided_afresh_not_a_crash() -> None:
    d = d_side()
    req = request("r", 100, {**PREFILL, "transfer_id": "t1"})
    assert d.get_num_new_matched_tokens(req, 64) == (36, True)
    assert d.get_num_new_matched_tokens(req, 0) == (100, True)  # the cached prefix was evicted
    assert d.credits.in_use == 7


class FakePool:
    """vLLM's BlockPool as D's admission reads it."""

    def __init__(self, free: int) -> None:
        self.free = free

    def get_num_free_blocks(self) -> int:
        return self.free


def bound(side: ConsumerSide, pool: FakePool) -> ConsumerSide:
    side.bind_kv_cache_manager(SimpleNamespace(block_pool=pool))
    return side


def test_d_admits_only_what_its_kv_cache_has_free_and_waits_for_room() -> None:
    pool = FakePool(free=5)
    d = bound(d_side(budget=1.0), pool)
    req = request("r", 100, {**PREFILL, "transfer_id": "t1"})  # 7 blocks
    assert d.get_num_new_matched_tokens(req, 0) == (None, False)
    assert d.build_connector_meta(None).wait_admission == [  # type: ignore[arg-type]
        PeerRef("t1", "10.0.0.1", 15500, p_tp=1)
    ]
    pool.free = 7  # running requests finished
    assert d.get_num_new_matched_tokens(req, 0) == (100, True)


def test_d_with_room_in_its_cache_is_capped_by_the_budget_fraction() -> None:
    d = bound(d_side(budget=0.1), FakePool(free=100))  # budget: 10 of 100 blocks
    a = request("a", 128, {**PREFILL, "transfer_id": "ta"})  # 8 blocks
    b = request("b", 48, {**PREFILL, "transfer_id": "tb"})  # 3 blocks
    assert d.get_num_new_matched_tokens(a, 0) == (128, True)
    assert d.get_num_new_matched_tokens(b, 0) == (None, False)


def test_grants_not_yet_allocated_are_taken_off_the_free_blocks() -> None:
    pool = FakePool(free=10)
    d = bound(d_side(budget=1.0), pool)
    a = request("a", 96, {**PREFILL, "transfer_id": "ta"})  # 6 blocks
    b = request("b", 96, {**PREFILL, "transfer_id": "tb"})  # 6 blocks
    assert d.get_num_new_matched_tokens(a, 0) == (96, True)
    assert d.get_num_new_matched_tokens(b, 0) == (None, False)  # 10 free, 6 promised to a
    allocate(d, a, list(range(6)), 96)
    pool.free = 4
    assert d.get_num_new_matched_tokens(b, 0) == (None, False)
    d.update_connector_output(output(finished_recving={"a"}))
    pool.free = 10  # a decoded and finished: its blocks are back
    assert d.get_num_new_matched_tokens(b, 0) == (96, True)


def test_the_budget_gauge_shows_what_d_can_grant_now() -> None:
    pool = FakePool(free=3)
    d = bound(d_side(budget=0.5), pool)
    assert gauges(d)[("kvpush_credits_budget_blocks", "consumer")] == 3
    pool.free = 90
    assert gauges(d)[("kvpush_credits_budget_blocks", "consumer")] == 50


def test_p_behind_a_data_parallel_api_server_names_its_rank_and_its_own_port() -> None:
    cfg = config_from_extra({"control": {"port": 15000}})
    # A dense model's DP rank: vLLM says only its index and suffixes the engine id.
    side = scheduler_side(cfg, Side.PRODUCER, "prefill-0_dp1", BS, 1000, 2, 1, 100)
    ident = side.identity()
    # Rank 1 with TP 2: its control ports start after rank 0's two.
    assert (ident["remote_port"], ident["dp_rank"]) == (15002, 1)
    assert "dp_size" not in ident
    rank0 = scheduler_side(cfg, Side.PRODUCER, "prefill-0_dp0", BS, 1000, 1, 0, 100)
    assert rank0.identity()["dp_rank"] == 0
    # A MoE model's ranks keep data_parallel_size: it is passed on.
    moe = scheduler_side(cfg, Side.PRODUCER, "prefill-0_dp1", BS, 1000, 1, 1, 100, dp_size=2)
    assert (moe.identity()["dp_rank"], moe.identity()["dp_size"]) == (1, 2)
    plain = scheduler_side(cfg, Side.PRODUCER, "prefill-0", BS, 1000, 1, 0, 100).identity()
    assert "dp_rank" not in plain and "dp_size" not in plain


# ------------------------------------------------------------------------------ one id, one request


def test_d_refuses_a_second_live_request_with_the_same_transfer_id_and_leaves_the_first() -> None:
    d = d_side()
    first, second = (
        request("r1", 100, {**PREFILL, "transfer_id": "t"}),
        request("r2", 100, {**PREFILL, "transfer_id": "t"}),
    )
    assert d.get_num_new_matched_tokens(first, 0) == (100, True)
    # The second computes its prompt here; P hears nothing of it (the transfer is r1's).
    assert d.get_num_new_matched_tokens(second, 0) == (0, False)
    assert d.get_num_new_matched_tokens(second, 0) == (0, False)  # asked again: same answer
    allocate(d, first, list(range(7)), 100)
    meta = d.build_connector_meta(None)  # type: ignore[arg-type]
    assert [s.request_id for s in meta.recv] == ["r1"] and meta.not_needed == []
    assert d.request_finished(second, []) == (False, None)
    assert d.build_connector_meta(None).empty()  # type: ignore[arg-type]
    assert counters(d)[("kvpush_kv_params_rejected", "consumer", "duplicate_transfer")] == 1
    # Once r1's receive ended, the id may be used again (a new request, after the first).
    d.update_connector_output(output(finished_recving={"r1"}))
    third = request("r3", 100, {**PREFILL, "transfer_id": "t"})
    assert d.get_num_new_matched_tokens(third, 0) == (100, True)


def test_d_states_the_digest_of_its_own_prompt_with_the_blocks_it_registers() -> None:
    from kvpush_prod.core.digest import prompt_digest

    d = d_side()
    req = request("r", 100, {**PREFILL, "transfer_id": "t"})
    d.get_num_new_matched_tokens(req, 0)
    allocate(d, req, list(range(7)), 100)
    (spec,) = d.build_connector_meta(None).recv  # type: ignore[arg-type]
    assert spec.prompt == prompt_digest(req.prompt_token_ids) and len(spec.prompt) == 16


def test_p_refuses_a_second_live_request_with_the_same_transfer_id_and_never_aborts_the_first() -> (
    None
):
    from kvpush_prod.core.digest import prompt_digest

    p = p_side()
    p.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda rid: ([7, 8, 9],)))
    first, second = request("r1", 40, DECODE), request("r2", 40, DECODE)
    p.on_new_request(first)
    p.on_new_request(second)
    meta = p.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r1": 40, "r2": 40}))
    assert meta.expect_send == [("t1", "")] and meta.abort_send == []
    (spec,) = meta.send
    assert spec.request_id == "r1" and spec.prompt == prompt_digest(first.prompt_token_ids)
    # The refused one ends: nothing is said of t1 (it is r1's), its blocks are not held.
    assert p.request_finished(second, [7, 8, 9]) == (False, None)
    assert p.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).empty()
    assert counters(p)[("kvpush_kv_params_rejected", "producer", "duplicate_transfer")] == 1
    delay, _ = p.request_finished(first, [7, 8, 9])
    assert delay
    p.update_connector_output(output(finished_sending={"r1"}))
    p.on_new_request(request("r3", 40, DECODE))  # the id is free again once r1's push ended
    assert p.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).expect_send == [
        ("t1", "")
    ]


def test_p_never_acts_on_a_transfer_id_from_params_that_failed_the_signature() -> None:
    import secrets

    from kvpush_prod.connector.trust import Trust
    from kvpush_prod.signing import PREFILL as P_LEG
    from kvpush_prod.signing import sign_params

    key = secrets.token_hex(32).encode()
    p = scheduler_side(
        KvpushConfig(), Side.PRODUCER, "prefill-0", BS, 1000, 1, 0, 100, trust=Trust(params_key=key)
    )
    import time

    leg = sign_params(DECODE, key, time.time(), P_LEG)
    p.on_new_request(request("victim", 40, leg))
    # An unsigned request naming the victim's transfer, then the victim's own leg replayed
    # by another request: both refused, and neither aborts the victim's push.
    for rid, params in (("forged", DECODE), ("replayed", leg)):
        req = request(rid, 40, params)
        p.on_new_request(req)
        assert p.request_finished(req, []) == (False, None)
    meta = p.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert meta.expect_send == [("t1", "")] and meta.abort_send == []
    c = counters(p)
    assert c[("kvpush_kv_params_rejected", "producer", "unsigned")] == 1
    assert c[("kvpush_kv_params_rejected", "producer", "replayed")] == 1
