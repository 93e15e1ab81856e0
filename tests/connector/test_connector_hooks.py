"""No connector hook takes the engine down: what raises in our code is contained, counted in
``kvpush_hook_errors`` and turned into an outcome for the requests concerned (recompute, or
a failed receive under vLLM's kv_load_failure_policy), without a block freed while a WRITE
may land in it and without a block or a credit leaked."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvpush_prod.config import KvpushConfig, config_from_extra
from kvpush_prod.connector import PushConnector
from kvpush_prod.connector.metadata import PeerRef, PushMetadata, RecvSpec
from kvpush_prod.connector.scheduler import ConsumerSide, ProducerSide, scheduler_side
from kvpush_prod.core.vocabulary import Side
from kvpush_prod.metrics import StatsBuffer

BS = 16
PREFILL = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill-0",
    "remote_host": "10.0.0.1",
    "remote_port": 15500,
    "tp_size": 1,
}
DECODE = {"do_remote_decode": True, "transfer_id": "t1", "remote_engine_id": "decode-0"}


class Boom(RuntimeError):
    pass


def boom(*_: Any, **__: Any) -> Any:
    raise Boom("a bug in our code")


def request(rid: str, prompt: int, params: dict[str, Any] | None, computed: int = 0) -> Any:
    return SimpleNamespace(
        request_id=rid,
        num_prompt_tokens=prompt,
        num_computed_tokens=computed,
        kv_transfer_params=params,
        prompt_token_ids=[hash(rid) % 1000 + i for i in range(prompt)],
    )


def blocks(ids: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def output(**kw: Any) -> Any:
    base: dict[str, Any] = {
        "finished_sending": None,
        "finished_recving": None,
        "failed_recving": None,
        "kv_connector_worker_meta": None,
    }
    return SimpleNamespace(**{**base, **kw})


def connector(side: Side, scheduler: Any = None, worker: Any = None) -> Any:
    """A PushConnector around the given halves (vLLM's config is not needed to test hooks)."""
    c: Any = object.__new__(PushConnector)
    c.kv_role = side
    c._scheduler = scheduler
    c._worker = worker
    c._hook_stats = StatsBuffer()
    c._failed_here = set()
    return c


def d_connector(cfg: KvpushConfig | None = None) -> tuple[Any, ConsumerSide]:
    d = scheduler_side(
        cfg or config_from_extra({"credits": {"budget_fraction": 0.5}}),
        Side.CONSUMER,
        "decode-0",
        BS,
        1000,
        1,
        0,
        100,
    )
    assert isinstance(d, ConsumerSide)
    return connector(Side.CONSUMER, scheduler=d), d


def p_connector() -> tuple[Any, ProducerSide]:
    p = scheduler_side(KvpushConfig(), Side.PRODUCER, "prefill-0", BS, 1000, 1, 0, 100)
    assert isinstance(p, ProducerSide)
    return connector(Side.PRODUCER, scheduler=p), p


def hook_errors(c: Any) -> dict[tuple[str, ...], float]:
    stats = c.get_kv_connector_stats()
    data = stats.data if stats is not None else {}
    return {
        tuple(labels): v for name, labels, v in data.get("c", []) if name == "kvpush_hook_errors"
    }


# ------------------------------------------------------------------ D, scheduler side


def test_an_ask_that_raises_computes_the_prompt_locally_and_frees_p_and_the_credit() -> None:
    c, d = d_connector()
    req = request("r", 100, {**PREFILL, "transfer_id": "t1"})
    assert c.get_num_new_matched_tokens(req, 0) == (100, True)
    d.admissions.ask = boom  # type: ignore[method-assign]
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    assert d.credits.in_use == 0
    assert c.build_connector_meta(None).not_needed == [PeerRef("t1", "10.0.0.1", 15500, p_tp=1)]
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)  # not asked about again
    assert hook_errors(c) == {("consumer", "get_num_new_matched_tokens"): 1}


def test_an_allocation_hook_that_raises_fails_the_receive_before_any_register() -> None:
    c, d = d_connector()
    req = request("r", 100, {**PREFILL, "transfer_id": "t1"})
    assert c.get_num_new_matched_tokens(req, 0) == (100, True)
    bad = SimpleNamespace(get_block_ids=boom)
    c.update_state_after_alloc(req, bad, 100)  # vLLM allocated: the request waits for the KV
    meta = c.build_connector_meta(None)
    assert meta.recv == []  # no REGISTER: nothing can be written into its blocks
    assert meta.fail_recv == ["r"]
    assert meta.not_needed == [PeerRef("t1", "10.0.0.1", 15500, p_tp=1)]
    assert d.credits.in_use == 0
    assert hook_errors(c) == {("consumer", "update_state_after_alloc"): 1}

    # The worker reports it failed at once: vLLM frees its blocks (recompute or fail).
    w = connector(Side.CONSUMER, worker=FakeWorker())
    w.bind_connector_metadata(meta)
    results = w.get_transfer_results(set())
    assert results.finished_recving == {"r"} and results.failed_recving == {"r"}
    assert w.get_transfer_results(set()).finished_recving == set()  # reported once
    c.update_connector_output(output(finished_recving={"r"}, failed_recving={"r"}))
    assert d.credits.in_use == 0 and not c.has_pending_push_work()


def test_an_allocation_whose_register_is_queued_is_not_failed() -> None:
    c, d = d_connector()
    req = request("r", 48, {**PREFILL, "transfer_id": "t1"})
    c.get_num_new_matched_tokens(req, 0)
    c.update_state_after_alloc(req, blocks([1, 2, 3]), 48)
    d.after_failed_alloc(req, 48)  # as if the hook had raised after queueing the REGISTER
    meta = c.build_connector_meta(None)
    assert [s.request_id for s in meta.recv] == ["r"] and meta.fail_recv == []
    assert d.credits.in_use == 3


def test_zero_external_tokens_after_an_admission_returns_the_credit() -> None:
    # vLLM may keep a local sub-block tail and load nothing (num_external_tokens == 0).
    c, d = d_connector()
    req = request("r", 100, {**PREFILL, "transfer_id": "t1"})
    c.get_num_new_matched_tokens(req, 0)
    c.update_state_after_alloc(req, blocks(list(range(7))), 0)
    meta = c.build_connector_meta(None)
    assert meta.recv == [] and meta.not_needed == [PeerRef("t1", "10.0.0.1", 15500, p_tp=1)]
    assert d.credits.in_use == 0


def test_a_finish_that_raises_on_a_receive_in_flight_aborts_it_behind_its_fence() -> None:
    c, d = d_connector()
    req = request("r", 48, {**PREFILL, "transfer_id": "t1"})
    c.get_num_new_matched_tokens(req, 0)
    c.update_state_after_alloc(req, blocks([1, 2, 3]), 48)
    c.build_connector_meta(None)
    d.admissions.finish = boom  # type: ignore[method-assign]
    assert c.request_finished(req, [1, 2, 3]) == (False, None)
    assert c.build_connector_meta(None).abort_recv == ["t1"]
    assert c.has_pending_push_work()  # the blocks stay vLLM's until the fence reports it
    assert d.credits.in_use == 3
    c.update_connector_output(output(finished_recving={"r"}))
    assert d.credits.in_use == 0 and not c.has_pending_push_work()
    assert hook_errors(c) == {("consumer", "request_finished"): 1}


def test_a_finish_that_raises_while_waiting_for_credit_frees_p() -> None:
    c, d = d_connector(config_from_extra({"credits": {"budget_fraction": 0.1}}))
    big = request("big", 160, {**PREFILL, "transfer_id": "t0"})
    c.get_num_new_matched_tokens(big, 0)
    req = request("r", 48, {**PREFILL, "transfer_id": "t1"})
    assert c.get_num_new_matched_tokens(req, 0) == (None, False)
    c.build_connector_meta(None)
    d.admissions.finish = boom  # type: ignore[method-assign]
    assert c.request_finished(req, []) == (False, None)
    assert c.build_connector_meta(None).not_needed == [PeerRef("t1", "10.0.0.1", 15500, p_tp=1)]
    assert d.credits.waiting == 0 and d.admissions.get("r") is None


def test_one_bad_finished_receive_does_not_keep_the_others_credit() -> None:
    c, d = d_connector()
    for rid, tid in (("a", "ta"), ("b", "tb")):
        req = request(rid, 32, {**PREFILL, "transfer_id": tid})
        c.get_num_new_matched_tokens(req, 0)
        c.update_state_after_alloc(req, blocks([1, 2]), 32)
    assert d.credits.in_use == 4

    class Exploding(dict):  # type: ignore[type-arg]
        def __setitem__(self, key: str, value: Any) -> None:
            if key == "a":
                raise Boom(key)
            super().__setitem__(key, value)

    d._received = Exploding()
    c.update_connector_output(output(finished_recving={"a", "b"}))
    assert d.credits.in_use == 0
    assert "b" in d._received
    assert hook_errors(c) == {("consumer", "update_connector_output"): 1}


def test_a_broken_update_connector_output_is_contained() -> None:
    c, _ = d_connector()
    c.update_connector_output(None)  # not even an output: contained, counted
    assert hook_errors(c) == {("consumer", "update_connector_output"): 1}


# ------------------------------------------------------------------ P, scheduler side


def p_step(c: Any, p: ProducerSide, reqs: list[Any], get_block_ids: Any) -> PushMetadata:
    p.bind_kv_cache_manager(SimpleNamespace(get_block_ids=get_block_ids))
    so = SimpleNamespace(num_scheduled_tokens={r.request_id: r.num_prompt_tokens for r in reqs})
    meta: PushMetadata = c.build_connector_meta(so)
    return meta


def test_one_request_that_raises_while_collecting_pushes_does_not_stop_the_others() -> None:
    c, p = p_connector()
    good = request("good", 32, {**DECODE, "transfer_id": "tg"})
    bad = request("bad", 32, {**DECODE, "transfer_id": "tb"})
    for r in (good, bad):
        c.on_new_request(r)

    def ids(rid: str) -> Any:
        if rid == "bad":
            raise Boom(rid)
        return ([5, 6],)

    meta = p_step(c, p, [bad, good], ids)
    assert [s.transfer_id for s in meta.send] == ["tg"]
    # The bad one was never pushed: its blocks are freed and D is told.
    delay, answer = c.request_finished(bad, [1, 2])
    assert not delay and answer is not None
    assert answer["transfer_id"] == "tb" and answer["do_remote_prefill"] is False
    assert c.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).abort_send == ["tb"]
    assert c.request_finished(good, [5, 6])[0] is True
    assert hook_errors(c) == {("producer", "build_connector_meta"): 1}


def test_a_finish_that_raises_after_the_push_was_handed_over_keeps_the_blocks() -> None:
    c, p = p_connector()
    req = request("r", 32, {**DECODE})
    c.on_new_request(req)
    p_step(c, p, [req], lambda rid: ([5, 6],))
    p.identity = boom  # type: ignore[method-assign]  # the reply's dict cannot be built
    assert c.request_finished(req, [5, 6]) == (True, None)
    assert c.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).hold == ["t1"]
    assert c.has_pending_push_work()
    c.update_connector_output(output(finished_sending={"r"}))
    assert not c.has_pending_push_work()
    assert hook_errors(c) == {("producer", "request_finished"): 1}


def test_a_finish_that_raises_before_the_prompt_was_computed_frees_and_tells_d() -> None:
    c, p = p_connector()
    req = request("r", 32, {**DECODE})
    c.on_new_request(req)
    p.request_finished = boom  # type: ignore[method-assign]
    assert c.request_finished(req, []) == (False, None)
    assert c.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).abort_send == ["t1"]


def test_when_even_the_recovery_raises_p_keeps_its_blocks() -> None:
    c, p = p_connector()
    p.request_finished = boom  # type: ignore[method-assign]
    p.after_failed_finish = boom  # type: ignore[method-assign]
    assert c.request_finished(request("r", 32, DECODE), []) == (True, None)
    assert hook_errors(c) == {("producer", "request_finished"): 2}


def test_on_new_request_that_raises_is_contained() -> None:
    c, p = p_connector()
    p.on_new_request = boom  # type: ignore[method-assign]
    c.on_new_request(request("r", 32, DECODE))
    assert hook_errors(c) == {("producer", "on_new_request"): 1}


def test_has_pending_push_work_that_raises_keeps_the_engine_stepping() -> None:
    c, p = p_connector()
    p.has_pending_push_work = boom  # type: ignore[method-assign]
    assert c.has_pending_push_work() is True


def test_a_broken_meta_builder_still_sends_what_the_step_gathered() -> None:
    c, p = d_connector()
    req = request("r", 48, {**PREFILL, "transfer_id": "t1"})
    c.get_num_new_matched_tokens(req, 0)
    c.update_state_after_alloc(req, blocks([1, 2, 3]), 48)
    p.build_connector_meta = boom  # type: ignore[method-assign]
    meta = c.build_connector_meta(None)
    assert [s.transfer_id for s in meta.recv] == ["t1"]


# ------------------------------------------------------------------ worker side


class FakeWorker:
    def __init__(self) -> None:
        self.metas: list[PushMetadata] = []
        self.offered: PushMetadata | None = None

    def on_metadata(self, meta: PushMetadata) -> None:
        self.metas.append(meta)

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        return set(), set(), set()

    def take_outcomes(self) -> dict[str, str]:
        return {}

    def get_stats(self) -> dict[str, Any]:
        return {}

    def after_forward(self, forward_failed: bool = False) -> None:
        return None

    def shutdown(self) -> None:
        return None


def spec(rid: str, tid: str) -> RecvSpec:
    return RecvSpec(rid, tid, "10.0.0.1", 15500, [1, 2], 0, 32)


@pytest.mark.parametrize("reached", [False, True])
def test_metadata_that_fails_to_reach_the_pump_fails_its_receives_and_only_then(
    reached: bool,
) -> None:
    worker = FakeWorker()

    def on_metadata(meta: PushMetadata) -> None:
        if reached:  # the step's plan reached the pump, then something raised
            worker.offered = meta
        raise Boom("on_metadata")

    worker.on_metadata = on_metadata  # type: ignore[method-assign]
    c = connector(Side.CONSUMER, worker=worker)
    c.bind_connector_metadata(PushMetadata(recv=[spec("a", "ta"), spec("b", "tb")]))
    results = c.get_transfer_results(set())
    # A plan the pump has runs its course (its REGISTERs may be out: WRITEs may land); one
    # that never reached it can get no WRITE, so its receives fail now.
    want = set() if reached else {"a", "b"}
    assert results.failed_recving == want and results.finished_recving == want
    assert hook_errors(c) == {("consumer", "bind_connector_metadata"): 1}


@pytest.mark.parametrize(
    "hook", ["get_finished", "take_outcomes", "after_forward", "shutdown", "get_stats"]
)
def test_a_worker_hook_that_raises_is_contained(hook: str) -> None:
    worker = FakeWorker()
    setattr(worker, hook, boom)
    c = connector(Side.PRODUCER, worker=worker)
    results = c.get_transfer_results(set())
    assert results.finished_sending == set() and results.finished_recving == set()
    assert c.build_connector_worker_meta() is None
    c.wait_for_save()
    c.shutdown()
    label = {
        "take_outcomes": "build_connector_worker_meta",
        "after_forward": "wait_for_save",
        "get_stats": "get_kv_connector_stats",
    }.get(hook, hook)
    assert hook_errors(c) == {("producer", label): 1}
