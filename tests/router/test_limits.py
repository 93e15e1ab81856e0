"""The router's limits, each met the way a hostile or broken client would meet it.

Body size and deadline, header deadline and size, JSON nesting, n > 1, concurrency, a
client that stops reading, health checks on their own pool. Timing bounds are generous.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlsplit

import pytest
from starlette.responses import Response

from kvpush_prod.router.errors import RequestRejected
from kvpush_prod.router.limits import read_body
from kvpush_prod.router.metrics import RejectReason
from tests.router.fakes import MODEL, FakeVLLM, Seen, wait_until

COMPLETION = {"model": MODEL, "prompt": "w10 w11 w12", "max_tokens": 4, "temperature": 0}


def rejected(r: Any, reason: str) -> float:
    return r.sample("kvpush_router_requests_rejected_total", reason=reason)


async def raw_exchange(url: str, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a new connection and read until the router closes it."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def head(path: str = "/v1/completions", **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: router"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def status_and_body(answer: bytes) -> tuple[int, dict[str, Any]]:
    head_bytes, _, body = answer.partition(b"\r\n\r\n")
    status = int(head_bytes.split(b" ", 2)[1])
    return status, json.loads(body) if body else {}


# -- body size --------------------------------------------------------------------------------


async def test_declared_body_over_the_limit_is_413_before_any_byte_is_read(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], max_body_bytes=4096)

    # Expect: 100-continue: the router answers without asking for the 64 MiB.
    answer = await raw_exchange(
        r.url,
        head(
            content_length=str(64 << 20), expect="100-continue", content_type="application/json"
        ),  # fmt: skip
    )

    status, body = status_and_body(answer)
    assert status == 413
    assert b"100 Continue" not in answer and b"connection: close" in answer.lower()
    assert "at most 4096 bytes (max_body_bytes)" in body["error"]["message"]
    assert body["error"]["code"] == "body_too_large"
    assert not p.requests and not d.requests
    assert rejected(r, "body_too_large") == 1
    assert r.sample("kvpush_router_requests_total", endpoint="/v1/completions",
                    outcome="rejected") == 1  # fmt: skip


async def test_chunked_body_without_a_length_is_cut_at_the_limit(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], max_body_bytes=4096)
    chunk = b"x" * 3000
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(3))

    answer = await raw_exchange(r.url, head(transfer_encoding="chunked") + chunks)

    status, body = status_and_body(answer)
    assert status == 413 and "more than 4096 bytes received" in body["error"]["message"]
    assert not p.requests and not d.requests
    assert rejected(r, "body_too_large") == 1


async def test_an_honest_client_over_the_limit_reads_a_413(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], max_body_bytes=1 << 20)
    big = {**COMPLETION, "prompt": "w " * (2 << 20)}

    resp = await r.post("/v1/completions", big)

    assert resp.status_code == 413, resp.text
    assert not p.requests and not d.requests


async def test_read_body_never_holds_more_than_the_limit_plus_one_message():
    received = 0

    async def endless() -> dict[str, Any]:
        nonlocal received
        received += 1000
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}

    with pytest.raises(RequestRejected) as e:
        await read_body(endless, None, 10_000, 5.0)

    assert e.value.status == 413 and e.value.reason is RejectReason.BODY_TOO_LARGE
    assert received <= 11_000


async def test_body_slower_than_its_deadline_is_408_and_closed(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], body_timeout_s=0.5)

    # Declares 100 bytes, sends 10 and stops: a lying Content-Length only costs the deadline.
    started = time.monotonic()
    answer = await raw_exchange(r.url, head(content_length="100") + b'{"model":')

    status, body = status_and_body(answer)
    assert status == 408 and "body_timeout_s" in body["error"]["message"]
    assert b"connection: close" in answer.lower()
    assert 0.4 < time.monotonic() - started < 5
    assert rejected(r, "body_timeout") == 1
    assert r.app.state.admission.inflight == 0


# -- headers ----------------------------------------------------------------------------------


async def test_headers_slower_than_their_deadline_are_408_and_closed(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], header_timeout_s=0.5)

    started = time.monotonic()
    answer = await raw_exchange(r.url, b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n")

    status, body = status_and_body(answer)
    assert status == 408 and "header_timeout_s" in body["error"]["message"]
    assert 0.4 < time.monotonic() - started < 5
    # A connection that never sends a byte is closed too, without an answer.
    assert await raw_exchange(r.url, b"") == b""
    assert rejected(r, "header_timeout") == 2


async def test_headers_over_the_size_limit_are_431(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], max_header_bytes=2048)

    answer = await raw_exchange(r.url, head(x_filler="a" * 4000, content_length="2") + b"{}")

    status, body = status_and_body(answer)
    assert status == 431 and "max_header_bytes" in body["error"]["message"]
    assert rejected(r, "header_too_large") == 1
    # Within the limit all is as before, keep-alive included.
    resp = await r.post("/v1/completions", COMPLETION, headers={"x-filler": "a" * 1000})
    assert resp.status_code == 200


async def test_a_keep_alive_connection_gets_the_header_deadline_per_request(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], header_timeout_s=0.5)

    for _ in range(3):  # idle longer than the deadline between requests: keep-alive rules
        resp = await r.post("/v1/completions", COMPLETION)
        assert resp.status_code == 200
        await asyncio.sleep(0.7)
    assert rejected(r, "header_timeout") == 0


# -- JSON and request shape -------------------------------------------------------------------


@pytest.mark.parametrize("depth", [100_000, 200])
async def test_body_nested_too_deep_is_400(fakes, router, depth):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d])
    raw = b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"

    resp = await r.client.post(
        r.url + "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )

    assert resp.status_code == 400
    err = resp.json()["error"]
    assert "more than 128 deep (max_json_depth)" in err["message"]
    assert err["code"] == "too_deep" and err["type"] == "invalid_request_error"
    assert not p.requests and not d.requests
    assert rejected(r, "too_deep") == 1


@pytest.mark.parametrize(
    ("extra", "reason", "needle"),
    [
        ({"n": 2}, "n_gt_1", "send 2 separate requests with n = 1"),
        ({"n": 10**400}, "n_gt_1", "`n` = 1000"),  # too big for a float: still a 400
        ({"best_of": 3}, "n_gt_1", "`best_of` = 3"),
        ({"use_beam_search": True}, "beam_search", "use_beam_search"),
        # vLLM's request models are lax: each of these would become n = 2 (or 1 by luck).
        ({"n": "2"}, "n_gt_1", '`n` = "2" (a string)'),
        ({"n": "1"}, "n_gt_1", '`n` = "1" (a string)'),
        ({"n": 1.0}, "n_gt_1", "`n` = 1.0 (a fraction)"),
        ({"n": True}, "n_gt_1", "`n` = true (a boolean)"),
        ({"n": 0}, "n_gt_1", "`n` = 0 (a number)"),
        ({"n": [2]}, "n_gt_1", "`n` = [2] (an array)"),
        ({"best_of": "3"}, "n_gt_1", '`best_of` = "3" (a string)'),
        ({"use_beam_search": "true"}, "beam_search", '`use_beam_search` = "true" (a string)'),
        ({"use_beam_search": 1}, "beam_search", "`use_beam_search` = 1 (a number)"),
        ({"n": "x" * 100}, "n_gt_1", '`n` = "' + "x" * 36 + "..."),  # never echoed whole
    ],
)
async def test_anything_but_one_sequence_is_400_before_any_engine_sees_it(
    fakes, router, extra, reason, needle
):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d])

    resp = await r.post("/v1/completions", {**COMPLETION, **extra})

    assert resp.status_code == 400
    err = resp.json()["error"]
    assert needle in err["message"] and "not supported through the P/D router" in err["message"]
    key = next(iter(extra))
    want = "false" if key == "use_beam_search" else "the JSON number 1"
    assert f"`{key}` must be absent or {want}" in err["message"]  # and how to fix it
    assert err["param"] == key and err["type"] == "invalid_request_error"
    assert not p.requests and not d.requests
    assert rejected(r, reason) == 1


@pytest.mark.parametrize(
    "extra",
    [{"n": 1, "best_of": 1, "use_beam_search": False}, {"n": None, "best_of": None}, {}],
)
async def test_one_sequence_asked_for_exactly_is_served(fakes, router, extra):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d])

    resp = await r.post("/v1/completions", {**COMPLETION, **extra})

    assert resp.status_code == 200, resp.text
    assert {k: d.requests[0].body.get(k) for k in extra} == extra  # passed on unchanged


# -- concurrency ------------------------------------------------------------------------------


async def test_requests_past_the_concurrency_limit_get_503_with_retry_after(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    d.gate = asyncio.Event()
    r = await router([p], [d], max_concurrent_requests=1)

    async with r.client.stream(
        "POST", r.url + "/v1/completions", json={**COMPLETION, "stream": True}
    ) as first:
        chunks = first.aiter_raw()
        await asyncio.wait_for(chunks.__anext__(), 5)  # the stream is open

        second = await r.post("/v1/completions", COMPLETION)
        assert second.status_code == 503 and second.headers["retry-after"] == "1"
        err = second.json()["error"]
        assert "max_concurrent_requests" in err["message"] and err["code"] == "concurrency"
        # /health and /metrics are not completion requests: never refused for load.
        assert (await r.client.get(r.url + "/health")).status_code == 200

        d.gate.set()
        async for _ in chunks:
            pass
    assert len(d.requests) == 1 and rejected(r, "concurrency") == 1
    await wait_until(lambda: r.app.state.admission.inflight == 0, what="the stream to end")
    assert (await r.post("/v1/completions", COMPLETION)).status_code == 200


async def test_clients_still_sending_their_body_hold_no_slot_and_others_are_served(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], max_concurrent_requests=2, body_timeout_s=5.0)
    parts = urlsplit(r.url)

    # Six connections each declare a 100-byte body and send one byte of it: three times
    # the limit, all reading at once.
    async def slow_sender() -> bytes:
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            writer.write(head(content_length="100", content_type="application/json") + b"{")
            await writer.drain()
            return await asyncio.wait_for(reader.read(), 20)
        finally:
            writer.close()

    slow = [asyncio.create_task(slow_sender()) for _ in range(6)]
    uvicorn_state = r.server._server.server_state  # test-only look at uvicorn's requests
    await wait_until(lambda: len(uvicorn_state.tasks) >= 6, what="six bodies being read")

    assert r.app.state.admission.inflight == 0
    for _ in range(3):  # everyone else is served meanwhile
        resp = await r.post("/v1/completions", COMPLETION)
        assert resp.status_code == 200, resp.text
    assert not any(t.done() for t in slow)
    # Each slow sender gets its own 408 at its own deadline; none was refused for load.
    for answer in await asyncio.gather(*slow):
        status, body = status_and_body(answer)
        assert status == 408 and "body_timeout_s" in body["error"]["message"]
    assert rejected(r, "body_timeout") == 6 and rejected(r, "concurrency") == 0
    assert r.app.state.admission.inflight == 0
    assert len(d.requests) == 3


# -- a client that stops reading --------------------------------------------------------------


async def test_a_client_that_stops_reading_is_dropped_and_its_legs_closed(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    d.tokens = ["x" * 65536] * 2000  # ~130 MB: far more than the socket buffers hold
    d.chunk_delay = 0.001  # like an engine, D yields between tokens (and notices a close)
    r = await router([p], [d], client_write_timeout_s=0.5)
    body = json.dumps({**COMPLETION, "stream": True}).encode()

    parts = urlsplit(r.url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    writer.write(head(content_length=str(len(body)), content_type="application/json") + body)
    await writer.drain()  # ... and never read
    try:
        await wait_until(lambda: bool(d.requests), what="D's leg")
        await asyncio.wait_for(d.requests[0].disconnected.wait(), 20)
    finally:
        writer.close()

    assert rejected(r, "write_stall") == 1
    await wait_until(lambda: r.app.state.admission.inflight == 0, what="the request to end")
    await wait_until(
        lambda: r.sample("kvpush_router_inflight", role="decode", backend=d.url) == 0,
        what="D's leg to be released",
    )
    assert r.sample("kvpush_router_requests_total", endpoint="/v1/completions",
                    outcome="client_cancelled") == 1  # fmt: skip


# -- pools ------------------------------------------------------------------------------------


def hang_until_gone(fake: FakeVLLM) -> None:
    async def hook(_: FakeVLLM, seen: Seen) -> Response | None:
        await asyncio.Event().wait()
        return None

    fake.hook = hook


async def test_health_checks_do_not_wait_on_a_full_legs_pool(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    hang_until_gone(p)
    d.hang = True
    # Two connections for the legs, both held by one request that never answers.
    r = await router([p], [d], max_connections=2, max_concurrent_requests=1,
                     health_timeout_s=0.3)  # fmt: skip

    request = asyncio.create_task(r.post("/v1/completions", COMPLETION))
    await wait_until(lambda: bool(p.requests) and bool(d.requests), what="both legs")
    await asyncio.sleep(1.0)  # several polls, each with a 0.3 s limit that covers the pool

    assert r.sample("kvpush_router_backend_up", role="prefill", backend=p.url) == 1
    assert r.sample("kvpush_router_backend_up", role="decode", backend=d.url) == 1
    assert (await r.client.get(r.url + "/health")).status_code == 200
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)


async def test_a_leg_waits_for_a_pool_slot_no_longer_than_pool_timeout(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    hang_until_gone(p)  # P legs never end: each keeps its connection once D has answered
    r = await router([p], [d], max_connections=2, max_concurrent_requests=1,
                     pool_timeout_s=0.3, max_retries=0)  # fmt: skip

    first = await r.post("/v1/completions", COMPLETION)  # D answers; P stays, detached
    assert first.status_code == 200
    started = time.monotonic()
    second = await r.post("/v1/completions", COMPLETION)  # P takes the last slot, D waits

    assert second.status_code == 502
    assert "decode" in second.text and "pool" in second.text
    assert time.monotonic() - started < 5
    assert r.sample("kvpush_router_inflight", role="decode", backend=d.url) == 0
