"""Pull mode of the router (``--mode pull``): prefill first, then decode with P's answer.

The flow vLLM's NixlConnector needs: P computes one token and returns its block ids in
``kv_transfer_params``; D gets exactly those and READs the KV.
"""

from __future__ import annotations

import asyncio

from starlette.responses import JSONResponse, Response

from kvpush_prod.router.cli import settings_from_args
from tests.router.fakes import MODEL, FakeVLLM, Seen, wait_until

COMPLETION = {"model": MODEL, "prompt": "w10 w11 w12", "max_tokens": 4, "temperature": 0}


async def test_pull_mode_sends_decode_only_after_prefill_with_its_kv_params(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    order: list[str] = []

    async def note(role: str, fake: FakeVLLM, seen: Seen) -> Response | None:
        order.append(role)
        return None

    p.hook = lambda f, s: note("prefill", f, s)
    d.hook = lambda f, s: note("decode", f, s)
    r = await router([p], [d], mode="pull")

    resp = await r.post("/v1/completions", COMPLETION)

    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "w4 w5 w6 w7"
    assert order == ["prefill", "decode"]
    assert p.probes == []  # pull mode needs no identity probe
    (ps,), (ds,) = p.requests, d.requests
    tid = ps.headers["x-request-id"]
    assert ds.headers["x-request-id"] == tid
    assert ps.body["max_tokens"] == 1 and ps.body["stream"] is False
    assert ps.body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    # D's leg is the client's request plus P's answered params, unchanged.
    assert ds.body == {**COMPLETION, "kv_transfer_params": p.identity_params(tid)}


async def test_pull_mode_streams_decode_tokens(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], mode="pull")
    body = {**COMPLETION, "stream": True}
    async with r.client.stream("POST", r.url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        text = (await resp.aread()).decode()
    assert "data: [DONE]" in text
    assert d.requests[0].body["stream"] is True


async def test_pull_mode_prefill_without_kv_params_is_a_502_not_a_decode(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")

    async def no_params(fake: FakeVLLM, seen: Seen) -> Response | None:
        return JSONResponse({"choices": [{"text": "w4"}], "kv_transfer_params": None})

    p.hook = no_params
    r = await router([p], [d], mode="pull", max_retries=0)

    resp = await r.post("/v1/completions", COMPLETION)

    assert resp.status_code == 502
    assert "kv_transfer_params" in resp.json()["error"]["message"]
    assert d.requests == []


async def test_pull_mode_client_gone_during_prefill_never_reaches_decode(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    p.hang = True
    r = await router([p], [d], mode="pull")

    task = asyncio.create_task(r.post("/v1/completions", COMPLETION))
    await wait_until(lambda: bool(p.requests))
    task.cancel()
    await wait_until(lambda: p.requests[0].disconnected.is_set())
    await asyncio.sleep(0.1)
    assert d.requests == []


async def test_push_mode_is_still_the_default_and_probes_identity(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d])
    assert r.settings.mode == "push"
    resp = await r.post("/v1/completions", COMPLETION)
    assert resp.status_code == 200
    assert p.probes  # push mode learns P's identity first


def test_mode_flag_parses():
    s = settings_from_args(["--prefill", "http://a:1", "--decode", "http://b:2", "--mode", "pull"])
    assert s.mode == "pull"


async def test_vllm_push_compat_gives_decode_the_prefill_request_id(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], vllm_push_compat=True)
    resp = await r.post("/v1/completions", COMPLETION)
    assert resp.status_code == 200
    tid = p.requests[0].headers["x-request-id"]
    assert d.requests[0].body["kv_transfer_params"]["remote_request_id"] == f"cmpl-{tid}-0"
