"""End-to-end behaviour of the router against fake vLLM servers over real HTTP.

Both legs at once, exact kv_transfer_params, streaming pass-through, errors and retries.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from starlette.responses import JSONResponse, Response

from kvpush_prod.router.metrics import ROUTER_TABLES
from tests.router.fakes import MODEL, FakeVLLM, Seen, wait_until

COMPLETION = {"model": MODEL, "prompt": "w10 w11 w12", "max_tokens": 4, "temperature": 0}
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "w10 w11"}],
    "max_tokens": 4,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def wait_for_peer(peer: FakeVLLM, timeout: float = 3.0):
    """A hook that answers only once ``peer`` got its request: proves the legs overlap."""

    async def hook(fake: FakeVLLM, seen: Seen) -> Response | None:
        try:
            await asyncio.wait_for(peer.arrived.wait(), timeout)
        except asyncio.TimeoutError:
            return JSONResponse({"error": f"{peer.role} leg never arrived"}, status_code=500)
        return None

    return hook


async def test_both_legs_are_sent_concurrently_with_one_transfer_id(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    # Each side waits for the other: a router that sends the legs one after the other
    # (in either order) deadlocks here until the fakes time out with a 500.
    p.hook, d.hook = wait_for_peer(d), wait_for_peer(p)
    r = await router([p], [d])

    resp = await r.post("/v1/completions", COMPLETION)

    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["choices"][0]["text"] == "w4 w5 w6 w7"
    assert "kv_transfer_params" not in out  # D's null is noise, stripped
    (ps,), (ds,) = p.requests, d.requests
    tid = ps.headers["x-request-id"]
    assert len(tid) == 32 and ds.headers["x-request-id"] == tid
    assert resp.headers["x-request-id"] == tid
    assert ps.body == {
        **COMPLETION,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": tid,
        },
    }
    assert ds.body == {
        **COMPLETION,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": p.engine_id,
            "remote_host": p.control_host,
            "remote_port": p.control_port,
            "tp_size": 1,
            "transfer_id": tid,
        },
    }


async def test_chat_stream_bytes_pass_through_in_order_as_they_arrive(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    d.gate = asyncio.Event()  # D holds its last token until the client has seen the first
    r = await router([p], [d])

    got = b""
    async with r.client.stream("POST", r.url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        chunks = resp.aiter_raw()
        while b'"w4"' not in got:
            got += await asyncio.wait_for(chunks.__anext__(), 3)
        assert b"[DONE]" not in got  # first token arrived while D was still generating
        d.gate.set()
        async for chunk in chunks:
            got += chunk

    (ps,), (ds,) = p.requests, d.requests
    tid = ds.headers["x-request-id"]
    assert got == b"".join(d.sse_events("/v1/chat/completions", ds.body, tid))
    assert ps.body["max_tokens"] == 1 and ps.body["max_completion_tokens"] == 1
    assert ps.body["stream"] is False and "stream_options" not in ps.body
    assert ds.body["stream"] is True and ds.body["stream_options"] == {"include_usage": True}
    assert ds.body["messages"] == CHAT["messages"]


async def test_non_streaming_chat_returns_decode_json(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d])
    resp = await r.post("/v1/chat/completions", {**CHAT, "stream": False})
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["message"]["content"] == "w4 w5 w6 w7"
    assert p.requests[0].body["max_completion_tokens"] == 1


@pytest.mark.parametrize(
    ("raw", "needle"),
    [(b"{not json", "not valid JSON"), (b"[1, 2]", "must be a JSON object, got a JSON list")],
)
async def test_bad_body_is_400_in_openai_shape(fakes, router, raw, needle):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d])
    resp = await r.client.post(
        r.url + "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    assert not p.requests and not d.requests
    assert (
        r.sample("kvpush_router_requests_total", endpoint="/v1/completions", outcome="client_error")
        == 1
    )


async def test_unknown_model_is_404_and_a_newly_served_one_is_found(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d])

    resp = await r.post("/v1/completions", {**COMPLETION, "model": "nope"})
    assert resp.status_code == 404
    err = resp.json()["error"]
    assert "`nope` does not exist" in err["message"] and MODEL in err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == "model"

    # Backends started serving another model: a miss refreshes the cached lists.
    p.models = d.models = (MODEL, "lora-a")
    resp = await r.post("/v1/completions", {**COMPLETION, "model": "lora-a"})
    assert resp.status_code == 200, resp.text


async def test_all_backends_down_is_503_naming_them(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d])
    await p.stop()
    await d.stop()
    await wait_until(lambda: not r.app.state.pool.ready(), what="backends marked down")

    resp = await r.post("/v1/completions", COMPLETION)

    assert resp.status_code == 503
    msg = resp.json()["error"]["message"]
    assert "no healthy prefill backend" in msg and p.url in msg
    assert "no healthy decode backend" in msg and d.url in msg
    health = await r.client.get(r.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    assert (
        r.sample("kvpush_router_requests_total", endpoint="/v1/completions", outcome="no_backend")
        == 1
    )


async def test_prefill_failure_before_decode_byte_retries_on_other_pair(fakes, router):
    p1, p2 = await fakes("prefill"), await fakes("prefill")
    d1, d2 = await fakes("decode"), await fakes("decode")
    p1.status = 500
    d1.hang_stream = True  # like vLLM: 200 headers, then waits for KV that never comes
    r = await router([p1, p2], [d1, d2])

    resp = await r.post("/v1/completions", {**COMPLETION, "stream": True})

    assert resp.status_code == 200, resp.text
    assert resp.content.endswith(b"data: [DONE]\n\n")
    assert len(p1.requests) == len(d1.requests) == len(p2.requests) == len(d2.requests) == 1
    # The first D leg was abandoned by closing its connection (vLLM then aborts it).
    await asyncio.wait_for(d1.requests[0].disconnected.wait(), 3)
    tid1 = p1.requests[0].headers["x-request-id"]
    tid2 = p2.requests[0].headers["x-request-id"]
    assert d1.requests[0].headers["x-request-id"] == tid1
    assert d2.requests[0].body["kv_transfer_params"]["transfer_id"] == tid2 != tid1
    assert d2.requests[0].body["kv_transfer_params"]["remote_engine_id"] == p2.engine_id
    assert r.sample("kvpush_router_retries_total", reason="prefill_status") == 1
    await wait_until(
        lambda: (
            r.sample(
                "kvpush_router_requests_total", endpoint="/v1/completions", outcome="retried_ok"
            )
            == 1
        )
    )


async def test_prefill_connect_error_marks_it_down_and_retries(fakes, router):
    p1, p2 = await fakes("prefill"), await fakes("prefill")
    d = await fakes("decode")
    r = await router([p1, p2], [d], health_interval_s=60)  # only the leg can notice
    await p1.stop()

    resp = await r.post("/v1/completions", COMPLETION)

    assert resp.status_code == 200, resp.text
    # D's first leg may be cancelled before it is sent: the legs' pool has no connection
    # to D yet (health checks use their own), and P's connect error comes first.
    assert len(p2.requests) == 1 and len(d.requests) in (1, 2)
    assert d.requests[-1].headers["x-request-id"] == p2.requests[0].headers["x-request-id"]
    assert r.sample("kvpush_router_retries_total", reason="prefill_connect") == 1
    health = (await r.client.get(r.url + "/health")).json()
    assert [b["up"] for b in health["prefill"]] == [False, True]
    assert "connect" in health["prefill"][0]["error"]
    assert r.sample("kvpush_router_backend_up", role="prefill", backend=p1.url) == 0


async def test_decode_5xx_before_any_byte_retries_and_4xx_passes_through(fakes, router):
    p = await fakes("prefill")
    d1, d2 = await fakes("decode"), await fakes("decode")
    d1.status = 503
    r = await router([p], [d1, d2])

    resp = await r.post("/v1/completions", COMPLETION)
    assert resp.status_code == 200, resp.text
    assert len(d2.requests) == 1
    assert r.sample("kvpush_router_retries_total", reason="decode_status") == 1

    # A 4xx is the client's fault: returned as is, never retried.
    d1.status = d2.status = 400
    resp = await r.post("/v1/completions", COMPLETION)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "fake decode failure"
    assert len(d1.requests) + len(d2.requests) == 3
    assert r.sample("kvpush_router_retries_total", reason="decode_status") == 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_an_answer_decode_ended_unfinished_before_any_byte_is_retried(fakes, router, stream):
    """vLLM stopping (SIGTERM) ends what it decodes with HTTP 200: finish_reason "abort",
    or an empty stream (usage and [DONE]). Nothing reached the client: another pair answers."""
    p = await fakes("prefill")
    d1, d2 = await fakes("decode"), await fakes("decode")
    d1.abort_after = 2 if not stream else 0
    r = await router([p], [d1, d2])

    for _ in range(2):  # whichever decode the policy picks first
        resp = await r.post("/v1/completions", {**COMPLETION, "stream": stream})
        assert resp.status_code == 200, resp.text
        if stream:
            events = [e for e in resp.content.split(b"\n\n") if e]
            text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
            assert events[-1] == b"data: [DONE]"
        else:
            text = resp.json()["choices"][0]["text"]
            assert resp.json()["choices"][0]["finish_reason"] == "length"
        assert text == "w4 w5 w6 w7"
    assert len(d2.requests) == 2
    assert r.sample("kvpush_router_retries_total", reason="decode_unfinished") >= 1


async def test_a_stream_decode_ends_unfinished_after_it_began_ends_with_an_error_event(
    fakes, router
):
    """Tokens already relayed cannot be taken back: the client gets an error event in place
    of [DONE], never a cut answer that looks whole."""
    p, d = await fakes("prefill"), await fakes("decode")
    d.abort_after = 2
    r = await router([p], [d])

    resp = await r.post("/v1/completions", {**COMPLETION, "stream": True})

    assert resp.status_code == 200
    events = [e for e in resp.content.split(b"\n\n") if e]
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:2]] == ["w4", " w5"]
    assert b"[DONE]" not in resp.content
    err = json.loads(events[-1][6:])["error"]
    assert d.url in err["message"] and "without a finish reason" in err["message"]
    await wait_until(
        lambda: (
            r.sample(
                "kvpush_router_requests_total", endpoint="/v1/completions", outcome="backend_error"
            )
            == 1
        )
    )


async def test_a_stream_split_anywhere_is_read_for_its_finish_reason():
    from kvpush_prod.router.legs import FinishWatch

    whole = (
        b'data: {"choices":[{"text":"a","finish_reason":null}]}\n\n'
        b'data: {"choices":[{"text":"\\"finish_reason\\":\\"stop\\"","finish_reason":null}]}\n\n'
        b'data: {"choices":[{"text":"b","finish_reason":"length"}]}\n\n'
        b"data: [DONE]\n\n"
    )
    for cut in range(1, len(whole)):
        w = FinishWatch()
        first, second = w.feed(whole[:cut]), w.feed(whole[cut:])
        assert w.reason == "length" and w.unfinished() is None
        assert first >= 0 or second >= 0
    w = FinishWatch()
    w.feed(whole.replace(b'"length"', b'"abort"'))
    assert w.unfinished() == "the stream ended with finish_reason 'abort'"
    w = FinishWatch()
    w.feed(whole.replace(b'"length"', b"null"))
    assert w.unfinished() == "the stream ended without a finish reason"


async def test_no_other_pair_gives_502_naming_backend_and_error(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    p.status = 500
    d.hang = True
    r = await router([p], [d])

    resp = await r.post("/v1/completions", COMPLETION)

    assert resp.status_code == 502
    msg = resp.json()["error"]["message"]
    assert f"prefill backend {p.url}" in msg and "HTTP 500" in msg
    assert "no other healthy pair" in msg
    await asyncio.wait_for(d.requests[0].disconnected.wait(), 3)
    assert (
        r.sample(
            "kvpush_router_requests_total", endpoint="/v1/completions", outcome="backend_error"
        )
        == 1
    )


async def test_failure_after_streaming_started_ends_with_error_event_and_no_retry(fakes, router):
    p1, p2 = await fakes("prefill"), await fakes("prefill")
    d1, d2 = await fakes("decode"), await fakes("decode")
    d1.die_after_chunks = 2
    r = await router([p1, p2], [d1, d2])

    resp = await r.post("/v1/completions", {**COMPLETION, "stream": True})

    assert resp.status_code == 200
    events = [e for e in resp.content.split(b"\n\n") if e]
    assert len(events) == 3
    assert json.loads(events[0][6:])["choices"][0]["text"] == "w4"
    assert json.loads(events[1][6:])["choices"][0]["text"] == " w5"
    err = json.loads(events[2][6:])["error"]
    assert d1.url in err["message"] and "mid-stream" in err["message"]
    assert not p2.requests and not d2.requests
    assert r.sample("kvpush_router_retries_total", reason="decode_disconnect") == 0
    await wait_until(
        lambda: (
            r.sample(
                "kvpush_router_requests_total", endpoint="/v1/completions", outcome="backend_error"
            )
            == 1
        )
    )


async def test_client_disconnect_before_first_byte_cancels_both_legs(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    p.hang = True
    d.hang_stream = True
    r = await router([p], [d])

    task = asyncio.create_task(r.post("/v1/completions", {**COMPLETION, "stream": True}))
    await wait_until(lambda: bool(p.requests and d.requests), what="both legs sent")
    task.cancel()  # closes the client's connection

    await asyncio.wait_for(p.requests[0].disconnected.wait(), 3)
    await asyncio.wait_for(d.requests[0].disconnected.wait(), 3)
    await wait_until(
        lambda: (
            r.sample(
                "kvpush_router_requests_total",
                endpoint="/v1/completions",
                outcome="client_cancelled",
            )
            == 1
        )
    )
    await wait_until(lambda: r.sample("kvpush_router_inflight", role="decode", backend=d.url) == 0)


async def test_client_disconnect_mid_stream_closes_decode_leg(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    d.gate = asyncio.Event()  # never set: D stalls before its last token
    r = await router([p], [d])

    async with r.client.stream(
        "POST", r.url + "/v1/completions", json={**COMPLETION, "stream": True}
    ) as resp:
        await asyncio.wait_for(resp.aiter_raw().__anext__(), 3)

    await asyncio.wait_for(d.requests[0].disconnected.wait(), 3)
    await wait_until(
        lambda: (
            r.sample(
                "kvpush_router_requests_total",
                endpoint="/v1/completions",
                outcome="client_cancelled",
            )
            == 1
        )
    )
    assert r.sample("kvpush_router_inflight", role="decode", backend=d.url) == 0


async def test_health_marks_killed_backend_down_and_back_up(fakes, router):
    p = await fakes("prefill")
    d1, d2 = await fakes("decode"), await fakes("decode")
    r = await router([p], [d1, d2])

    async def health_becomes(want: list[bool], timeout: float = 5.0) -> None:
        """/health's decode list equals ``want`` and answers 200 (d1 serves). Polled: on a
        loaded box one of d1's 0.1 s health rounds may time out and flap it for a round."""
        deadline = time.monotonic() + timeout
        while True:
            resp = await r.client.get(r.url + "/health")
            got = [b["up"] for b in resp.json()["decode"]]
            if got == want and resp.status_code == 200:
                return
            assert time.monotonic() < deadline, f"/health decode {got}, wanted {want}"
            await asyncio.sleep(0.05)

    await health_becomes([True, True])
    await d2.stop()
    await wait_until(lambda: not r.app.state.pool.decode[1].up, what="d2 down")
    await health_becomes([True, False])
    assert r.sample("kvpush_router_backend_up", role="decode", backend=d2.url) == 0

    await d2.restart()
    await wait_until(lambda: r.app.state.pool.decode[1].up, what="d2 back up")
    assert r.sample("kvpush_router_backend_up", role="decode", backend=d2.url) == 1


async def test_restarted_prefill_is_probed_again_and_its_new_identity_used(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d])
    assert len(p.probes) == 1
    old = p.engine_id

    await p.stop()
    await wait_until(lambda: not r.app.state.pool.prefill[0].up, what="p down")
    await p.restart(engine_id="engine-reborn")
    await wait_until(lambda: r.app.state.pool.prefill[0].up, what="p back up")

    assert len(p.probes) == 2  # probed again once it came back
    resp = await r.post("/v1/completions", COMPLETION)
    assert resp.status_code == 200
    assert d.requests[0].body["kv_transfer_params"]["remote_engine_id"] == "engine-reborn" != old


async def test_probe_body_and_yaml_overrides_win(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([{"url": p.url, "control_host": "p.internal", "control_port": 7777}], [d])

    (probe,) = p.probes
    assert probe.path == "/v1/completions"
    assert probe.body == {
        "model": MODEL,
        "prompt": "probe",
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "kvpush_probe": True},
    }
    # D gets the same probe, for its control-channel key (probe_decode, on by default).
    assert [s.body for s in d.probes] == [probe.body]
    await r.post("/v1/completions", COMPLETION)
    params = d.requests[0].body["kv_transfer_params"]
    assert (params["remote_host"], params["remote_port"]) == ("p.internal", 7777)
    assert params["remote_engine_id"] == p.engine_id  # not overridden: probed


async def test_full_yaml_identity_skips_the_probe(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    ident = {"control_host": "h", "control_port": 1234, "engine_id": "e1", "tp_size": 2}
    r = await router([{"url": p.url, **ident}], [d])
    await r.post("/v1/completions", COMPLETION)
    assert not p.probes
    params = d.requests[0].body["kv_transfer_params"]
    assert params["remote_engine_id"] == "e1" and params["tp_size"] == 2


async def test_prefill_without_identity_is_not_used(fakes, router):
    # A plain vLLM server without a kv connector answers the probe with null params.
    p, d = await fakes("decode"), await fakes("decode")
    r = await router([p], [d])

    resp = await r.post("/v1/completions", COMPLETION)

    assert resp.status_code == 503
    assert "kv_transfer_params lacks remote_engine_id" in resp.json()["error"]["message"]
    assert not p.requests


async def test_round_robin_alternates_pairs(fakes, router):
    ps = [await fakes("prefill"), await fakes("prefill")]
    ds = [await fakes("decode"), await fakes("decode")]
    r = await router(ps, ds)

    order = []
    for _ in range(4):
        resp = await r.post("/v1/completions", COMPLETION)
        tid = resp.headers["x-request-id"]
        pi = next(
            i for i, f in enumerate(ps) if any(s.headers["x-request-id"] == tid for s in f.requests)
        )
        di = next(
            i for i, f in enumerate(ds) if any(s.headers["x-request-id"] == tid for s in f.requests)
        )
        order.append((pi, di))
    assert order == [(0, 0), (1, 1), (0, 0), (1, 1)]


async def test_least_loaded_picks_the_idle_decode(fakes, router):
    p = await fakes("prefill")
    d1, d2 = await fakes("decode"), await fakes("decode")
    release = asyncio.Event()

    async def slow(fake: FakeVLLM, seen: Seen) -> None:
        await release.wait()

    d1.hook = slow
    r = await router([p], [d1, d2], policy="least_loaded")

    busy = asyncio.create_task(r.post("/v1/completions", COMPLETION))
    await wait_until(lambda: len(d1.requests) == 1, what="d1 busy")
    for _ in range(2):  # round robin would send the second of these to d1
        assert (await r.post("/v1/completions", COMPLETION)).status_code == 200
    assert len(d1.requests) == 1 and len(d2.requests) == 2
    assert r.sample("kvpush_router_inflight", role="decode", backend=d1.url) == 1
    release.set()
    assert (await busy).status_code == 200


async def test_metrics_endpoint_exposes_router_series(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d])
    await r.post("/v1/completions", COMPLETION)
    await r.post("/v1/chat/completions", {**CHAT, "stream": False})
    await r.client.post(r.url + "/v1/completions", content=b"nope")

    text = (await r.client.get(r.url + "/metrics")).text

    def line(name: str, labels: str) -> str:
        return next(ln for ln in text.splitlines() if ln.startswith(f"{name}{{{labels}}} "))

    assert line("kvpush_router_requests_total", 'endpoint="/v1/completions",outcome="ok"').endswith(
        " 1.0"
    )
    assert line(
        "kvpush_router_requests_total", 'endpoint="/v1/chat/completions",outcome="ok"'
    ).endswith(" 1.0")
    assert line(
        "kvpush_router_requests_total", 'endpoint="/v1/completions",outcome="client_error"'
    ).endswith(" 1.0")
    assert line("kvpush_router_request_seconds_count", 'endpoint="/v1/completions"').endswith(
        " 2.0"
    )
    assert line("kvpush_router_ttft_seconds_count", 'endpoint="/v1/completions"').endswith(" 1.0")
    assert line("kvpush_router_backend_up", f'backend="{p.url}",role="prefill"').endswith(" 1.0")
    assert line("kvpush_router_inflight", f'backend="{d.url}",role="decode"').endswith(" 0.0")
    assert "# TYPE kvpush_router_retries_total counter" in text
    assert "x-request-id" not in text.lower()


async def test_metrics_report_the_routers_tables_back_at_rest_after_requests(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d])
    for _ in range(3):
        await r.post("/v1/completions", COMPLETION)
    text = (await r.client.get(r.url + "/metrics")).text
    entries = {
        ln.split('"')[1]: float(ln.rsplit(" ", 1)[1])
        for ln in text.splitlines()
        if ln.startswith("kvpush_router_table_entries{")
    }
    assert set(entries) == set(ROUTER_TABLES)
    assert entries["requests.admitted"] == entries["legs.background"] == 0
    assert entries["health.tasks"] == 2  # one poller per backend
    assert 'kvpush_router_table_capacity{table="requests.admitted"}' in text


async def test_models_are_proxied_from_a_decode_backend(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode", models=(MODEL, "lora-a"))
    p.models = (MODEL, "lora-a")
    r = await router([p], [d])
    resp = await r.client.get(r.url + "/v1/models")
    assert resp.status_code == 200
    assert [m["id"] for m in resp.json()["data"]] == [MODEL, "lora-a"]


async def test_decode_kv_transfer_params_that_are_not_null_are_left_alone(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")

    async def with_params(fake: FakeVLLM, seen: Seen) -> Response:
        body: dict[str, Any] = fake.full_body(seen.path, seen.body, "x")
        body["kv_transfer_params"] = {"kvpush": {"recomputed": False}}
        return JSONResponse(body)

    d.hook = with_params
    r = await router([p], [d])
    resp = await r.post("/v1/completions", COMPLETION)
    assert resp.json()["kv_transfer_params"] == {"kvpush": {"recomputed": False}}


async def test_decode_first_byte_timeout_retries_on_other_decode(fakes, router):
    p = await fakes("prefill")
    d1, d2 = await fakes("decode"), await fakes("decode")
    d1.hang_stream = True
    r = await router([p], [d1, d2], first_byte_timeout_s=0.3)

    resp = await r.post("/v1/completions", {**COMPLETION, "stream": True})

    assert resp.status_code == 200 and resp.content.endswith(b"data: [DONE]\n\n")
    await asyncio.wait_for(d1.requests[0].disconnected.wait(), 3)
    assert len(d2.requests) == 1
    assert r.sample("kvpush_router_retries_total", reason="decode_timeout") == 1


async def test_prefill_4xx_is_returned_to_the_client_and_decode_dropped(fakes, router):
    p1, p2 = await fakes("prefill"), await fakes("prefill")
    d = await fakes("decode")
    p1.status = 400
    d.hang = True
    r = await router([p1, p2], [d])

    resp = await r.post("/v1/completions", COMPLETION)

    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "fake prefill failure"
    assert not p2.requests
    await asyncio.wait_for(d.requests[0].disconnected.wait(), 3)


async def test_client_authorization_is_forwarded_to_both_legs(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d])
    await r.post("/v1/completions", COMPLETION, headers={"Authorization": "Bearer client-key"})
    assert p.requests[0].headers["authorization"] == "Bearer client-key"
    assert d.requests[0].headers["authorization"] == "Bearer client-key"


async def test_the_clients_trace_context_goes_to_both_legs(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d])
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    await r.post(
        "/v1/completions",
        COMPLETION,
        headers={"traceparent": parent, "tracestate": "k=v", "x-other": "no"},
    )
    for leg in (p.requests[0], d.requests[0]):
        assert leg.headers["traceparent"] == parent and leg.headers["tracestate"] == "k=v"
        assert "x-other" not in leg.headers


async def test_backend_api_key_is_used_for_probe_and_legs(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], backend_api_key="sekret")
    await r.post("/v1/completions", COMPLETION, headers={"Authorization": "Bearer client-key"})
    assert p.probes[0].headers["authorization"] == "Bearer sekret"
    assert p.requests[0].headers["authorization"] == "Bearer sekret"
    assert d.requests[0].headers["authorization"] == "Bearer sekret"
    assert "sekret" not in repr(r.settings)


async def test_engine_load_routes_to_the_engine_its_metrics_say_is_idle(fakes, router):
    p = await fakes("prefill")
    d_busy, d_idle = await fakes("decode"), await fakes("decode")
    d_busy.running, d_busy.waiting, d_busy.kv_usage = 8, 4, 0.95
    r = await router([p], [d_busy, d_idle], policy="engine_load")
    for _ in range(3):
        assert (await r.post("/v1/completions", COMPLETION)).status_code == 200
    assert len(d_idle.requests) == 3 and not d_busy.requests


async def test_a_leg_whose_http_client_raises_is_a_failed_leg_not_a_dropped_client(
    fakes, router, monkeypatch
):
    """httpcore raised AttributeError on a connection P tore down mid-connect (P killed):
    the app let it out and the client's connection dropped with no answer. Now it is a
    failed leg: retried on another pair, or a 502 naming the backend when none is left."""
    p1, p2 = await fakes("prefill"), await fakes("prefill")
    d = await fakes("decode")
    r = await router([p1, p2], [d])
    client = r.app.state.dispatcher.client
    post = client.post

    async def broken_to_p1(url, *args, **kwargs):
        if url.startswith(p1.url):
            raise AttributeError("'NoneType' object has no attribute 'getpeername'")
        return await post(url, *args, **kwargs)

    monkeypatch.setattr(client, "post", broken_to_p1)
    for _ in range(2):  # one of them meets p1 first
        resp = await r.post("/v1/completions", COMPLETION)
        assert resp.status_code == 200, resp.text
    assert len(p2.requests) == 2
    assert r.sample("kvpush_router_retries_total", reason="prefill_disconnect") >= 1

    r2 = await router([p1], [d])
    monkeypatch.setattr(r2.app.state.dispatcher.client, "post", broken_to_p1)
    resp = await r2.post("/v1/completions", COMPLETION)
    assert resp.status_code == 502
    msg = resp.json()["error"]["message"]
    assert f"prefill backend {p1.url}" in msg and "AttributeError" in msg


async def test_link_aware_sends_most_streamed_requests_over_the_faster_link(fakes, router):
    """D1's first token comes 10x later than D0's (its link from P is throttled): with
    link_aware the router learns it from the streamed answers and sends D1 only the
    requests that keep its time fresh; round robin would split them evenly."""
    p = await fakes("prefill")
    d_fast, d_slow = await fakes("decode"), await fakes("decode")

    def after(seconds: float):  # type: ignore[no-untyped-def]
        async def hook(fake, seen):  # type: ignore[no-untyped-def]
            await asyncio.sleep(seconds)

        return hook

    d_fast.hook, d_slow.hook = after(0.01), after(0.1)
    r = await router([p], [d_fast, d_slow], policy="link_aware")
    body = {**COMPLETION, "stream": True}
    for _ in range(32):
        resp = await r.post("/v1/completions", body)
        assert resp.status_code == 200 and "[DONE]" in resp.text
    slow = len(d_slow.requests)
    assert len(d_fast.requests) + slow == 32
    # The first request of each D times it; then every 16th choice re-times D1.
    assert 1 <= slow <= 4, slow
    # Non-streamed requests are not timed but follow what the streamed ones taught.
    for _ in range(4):
        assert (await r.post("/v1/completions", COMPLETION)).status_code == 200
    assert len(d_slow.requests) <= slow + 1
