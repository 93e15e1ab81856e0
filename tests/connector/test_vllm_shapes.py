"""P's answer has the shape of vLLM's own push connector's, so routers written for vLLM
(vllm-router, sequential proxies) drive kvpush in push mode; D refuses, loudly, parameters
that name a prefill engine in a way it cannot use.

The reference is the installed vLLM: its NixlPushConnectorScheduler.request_finished is
called for real (its constructor needs a whole engine, so the instance is built bare with
the attributes that method reads)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvpush_prod.connector.params import parse_remote_prefill
from kvpush_prod.errors import KVTransferParamsError
from tests.connector.test_scheduler_side import p_side, request

push_scheduler = pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler"
)


def vllm_push_answer(req: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
    from vllm.v1.request import RequestStatus

    cls = push_scheduler.NixlPushConnectorScheduler
    s = cls.__new__(cls)
    s.engine_id = "prefill-0"
    s.side_channel_host = "10.0.0.1"
    s.side_channel_port = 5600
    s.transfer_tp_size = 1
    s.vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, pipeline_parallel_size=1)
    )
    s._kv_lease_duration = 30
    s._heartbeat_req_engine, s._heartbeat_by_engine = {}, {}
    s._push_registration_deadlines = {}
    s._reqs_not_processed, s._reqs_need_save, s._reqs_need_send = set(), {}, {}
    s._finished_request_blocks, s._newly_finished_push_blocks = {}, {}
    s.get_exchange_clipped_blocks = lambda ids, clip_ssm=True: ids
    req.status = RequestStatus.FINISHED_STOPPED
    return s.request_finished(req, (block_ids,))


def test_p_answers_with_every_key_vllms_push_connector_answers_with() -> None:
    ours = p_side()
    req = request("r-1", 40, {"do_remote_decode": True, "transfer_id": "t1"}, computed=40)
    ours.on_new_request(req)
    ours.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda rid: ([7, 8, 9, 10],)))
    ours.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r-1": 1}))
    delay, mine = ours.request_finished(req, [7, 8, 9])
    vllm_delay, theirs = vllm_push_answer(
        request("r-1", 40, {"do_remote_decode": True}, computed=40), [7, 8, 9]
    )
    assert delay == vllm_delay is True
    assert mine is not None and theirs is not None
    missing = sorted(set(theirs) - set(mine))
    assert not missing, f"vLLM's push connector answers with {missing}; ours does not"
    for key, value in theirs.items():
        if key in ("remote_engine_id", "remote_host", "remote_port"):
            continue  # ours names our engine and our control port
        assert mine[key] == (list(value) if isinstance(value, tuple) else value), key
    assert (mine["remote_engine_id"], mine["remote_host"], mine["remote_port"]) == (
        "prefill-0",
        ours.control_host,
        ours.control_port,
    )
    assert mine["transfer_id"] == "t1" and mine["kvpush"] is True


def test_a_sequential_router_passing_ps_answer_to_d_gets_a_push() -> None:
    """What a router that runs P first hands D is P's answer unchanged: D reads it as a
    push from P, under the transfer id P used."""
    p = p_side()
    req = request("r-1", 40, {"do_remote_decode": True}, computed=40)
    p.on_new_request(req)
    p.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda rid: ([7, 8, 9],)))
    p.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r-1": 1}))
    _, answer = p.request_finished(req, [7, 8, 9])
    assert answer is not None
    remote = parse_remote_prefill("r-1-0a1b2c3d", answer)
    assert remote is not None
    assert (remote.transfer_id, remote.port) == ("r-1", p.control_port)


def test_no_kv_means_do_remote_prefill_false() -> None:
    p = p_side()
    req = request("r", 40, {"do_remote_decode": True})
    p.on_new_request(req)
    _, answer = p.request_finished(req, [])  # ended before its prompt was computed
    assert answer is not None and answer["do_remote_prefill"] is False
    assert parse_remote_prefill("r", answer) is None  # D computes it, nothing to refuse


@pytest.mark.parametrize(
    "params",
    [
        {"kvpush": True, "transfer_id": "t1", "remote_host": "10.0.0.1", "remote_port": 5600},
        {"transfer_id": "t1"},
        {
            "do_remote_prefill": True,
            "remote_host": "10.0.0.1",
            "remote_port": 5600,
            "transfer_mode": "pull",
        },
    ],
)
def test_d_refuses_kvpush_params_it_cannot_use_with_a_reason(params: dict[str, Any]) -> None:
    with pytest.raises(KVTransferParamsError) as info:
        parse_remote_prefill("r", params)
    assert info.value.reason == "unusable"


def test_d_reads_vllms_push_shape_without_our_fields() -> None:
    vllm_shape = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2]],
        "remote_engine_id": "prefill-0",
        "remote_request_id": "r-1",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 40,
        "transfer_mode": "push",
    }
    remote = parse_remote_prefill("r-1-0a1b2c3d", vllm_shape)
    assert remote is not None and remote.transfer_id == "r-1"
    assert parse_remote_prefill("r", {"do_remote_prefill": False}) is None
    assert parse_remote_prefill("r", {"some_other_connector": 1}) is None
