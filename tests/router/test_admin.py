"""The router's admin API and `kvpush drain`: a drained engine gets no new request, comes
back by itself after a restart, and requests can wait for it instead of failing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from kvpush_prod.router.drain import EXIT_UNREADABLE, MetricsUnreadable, busy, drain, main
from tests.router.test_proxy import COMPLETION

TOKEN = "t" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def admin(r, path: str, backend: str, token: str = TOKEN) -> httpx.Response:
    return await r.client.post(
        r.url + path, json={"backend": backend}, headers={"Authorization": f"Bearer {token}"}
    )


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "admin.token"
    path.write_text(TOKEN + "\n")
    return str(path)


async def test_the_admin_api_is_off_without_a_token_and_refuses_a_wrong_one(
    fakes, router, token_file
):
    p, d = await fakes("prefill"), await fakes("decode")
    off = await router([p], [d])
    assert (await admin(off, "/admin/drain", d.url)).status_code == 404
    on = await router([p], [d], admin_token_file=token_file)
    assert (await admin(on, "/admin/drain", d.url, token="x" * 32)).status_code == 401
    assert (await on.client.get(on.url + "/admin/backends")).status_code == 401
    assert (await admin(on, "/admin/drain", "http://nowhere:1")).status_code == 404
    assert (
        await on.client.post(on.url + "/admin/drain", content=b"junk", headers=AUTH)
    ).status_code == 400


async def test_a_drained_engine_gets_no_new_request_and_the_other_takes_them(
    fakes, router, token_file
):
    p = await fakes("prefill")
    d1, d2 = await fakes("decode"), await fakes("decode")
    r = await router([p], [d1, d2], admin_token_file=token_file)
    assert (await admin(r, "/admin/drain", d1.url)).json()["draining"] is True
    for _ in range(4):
        assert (await r.post("/v1/completions", COMPLETION)).status_code == 200
    assert len(d1.requests) == 0 and len(d2.requests) == 4
    listed = (await r.client.get(r.url + "/admin/backends", headers=AUTH)).json()
    assert [b["draining"] for b in listed["decode"]] == [True, False]
    await admin(r, "/admin/undrain", d1.url)
    for _ in range(4):
        await r.post("/v1/completions", COMPLETION)
    assert len(d1.requests) > 0


async def test_a_drained_engine_rejoins_by_itself_after_a_restart(fakes, router, token_file):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], admin_token_file=token_file, no_backend_wait_s=10.0)
    await admin(r, "/admin/drain", d.url)
    await d.stop()
    # The request waits for the engine instead of failing; the restart brings it back.
    pending = asyncio.create_task(r.post("/v1/completions", COMPLETION))
    await asyncio.sleep(0.5)
    assert not pending.done()
    await d.restart()
    resp = await asyncio.wait_for(pending, 10)
    assert resp.status_code == 200, resp.text
    listed = (await r.client.get(r.url + "/admin/backends", headers=AUTH)).json()
    assert listed["decode"][0]["draining"] is False


async def test_without_a_wait_no_backend_is_503_at_once(fakes, router, token_file):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], admin_token_file=token_file)
    await admin(r, "/admin/drain", d.url)
    resp = await r.post("/v1/completions", COMPLETION)
    assert resp.status_code == 503 and "draining" in resp.text


def test_busy_reads_vllms_and_kvpushs_series():
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0"} 2.0\n'
        "# TYPE kvpush_connector_blocks gauge\n"
        'kvpush_connector_blocks{role="producer"} 5.0\n'
    )
    assert busy(text) == {
        "vllm:num_requests_running": 2.0,
        "vllm:num_requests_waiting": 0.0,
        "kvpush_transfers_active": 0.0,
        "kvpush_connector_blocks": 5.0,
    }


def test_drain_waits_until_the_engine_holds_nothing_and_says_so():
    values = iter([3.0, 1.0, 0.0])
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/admin/drain":
            return httpx.Response(200, json={"inflight": 1})
        if request.url.path == "/admin/backends":
            return httpx.Response(200, json={"prefill": [{"url": "http://p:8000", "inflight": 0}]})
        v = next(values)
        return httpx.Response(
            200,
            text=f'vllm:num_requests_running{{engine="0"}} 0\n'
            f'kvpush_connector_blocks{{role="producer"}} {v}\n',
        )

    said: list[str] = []
    client = httpx.Client(transport=httpx.MockTransport(handler))
    assert drain("http://p:8000", ["http://router:9000"], TOKEN, 60, said.append, 0.0, client)
    assert calls[0] == "/admin/drain" and calls.count("/metrics") == 3
    assert said[-1].endswith("idle")


def test_drain_waits_for_the_routers_legs_to_the_engine_to_close():
    """The engine's /metrics may say idle while a router still has a leg open to it (the
    answer on its way back): a restart then would cut that answer short."""
    legs = iter([1, 1, 0])
    said: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/admin/drain":
            return httpx.Response(200, json={"inflight": 1})
        if request.url.path == "/admin/backends":
            d = {"url": "http://d:8000/", "inflight": next(legs)}
            return httpx.Response(200, json={"prefill": [], "decode": [d]})
        return httpx.Response(200, text=IDLE)

    client = httpx.Client(transport=httpx.MockTransport(handler))
    assert drain("http://d:8000", ["http://r:9000"], TOKEN, 60, said.append, 0.0, client)
    assert [s for s in said if "router_legs_open=1" in s] and said[-1].endswith("idle")
    with pytest.raises(StopIteration):
        next(legs)


def test_drain_gives_up_at_the_deadline():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/admin/drain":
            return httpx.Response(200, json={})
        return httpx.Response(200, text="vllm:num_requests_running 1\n")

    client = httpx.Client(transport=httpx.MockTransport(handler))
    assert not drain("http://d:8000", ["http://r:9000"], TOKEN, 0.0, lambda s: None, 0.0, client)


IDLE = 'vllm:num_requests_running{engine="0"} 0\nvllm:num_requests_waiting{engine="0"} 0\n'


def engine_answering(metrics: Callable[[], httpx.Response]) -> httpx.MockTransport:
    """A router that drains anything and an engine whose /metrics answer ``metrics()``."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/admin/"):
            return httpx.Response(200, json={"inflight": 0})
        return metrics()

    return httpx.MockTransport(handler)


def refused() -> httpx.Response:
    raise httpx.ConnectError("[Errno 111] Connection refused")


@pytest.mark.parametrize(
    ("metrics", "needle"),
    [
        (refused, "ConnectError: [Errno 111] Connection refused"),
        (lambda: httpx.Response(404, text="Not Found"), "answered HTTP 404"),
        # The router's own /metrics, say: nothing there is an engine's.
        (
            lambda: httpx.Response(200, text="kvpush_router_inflight 0\n"),
            "has no vllm:num_requests_running",
        ),
    ],
)
def test_drain_never_says_drained_about_an_engine_whose_metrics_it_cannot_read(
    tmp_path, capsys, metrics, needle
):
    token = tmp_path / "admin.token"
    token.write_text(TOKEN)
    said: list[str] = []
    with pytest.raises(MetricsUnreadable) as e:
        drain(
            "http://d:8000",
            ["http://r:9000"],
            TOKEN,
            60,
            said.append,
            0.0,
            httpx.Client(transport=engine_answering(metrics)),
        )
    assert needle in str(e.value) and "cannot tell whether http://d:8000 is drained" in str(e.value)
    assert len([s for s in said if needle in s]) == 3  # tried again before giving up

    rc = main(
        [
            "http://d:8000",
            "--router",
            "http://r:9000",
            "--admin-token-file",
            str(token),
            "--deadline",
            "60",
        ],
        transport=engine_answering(metrics),
    )

    out, err = capsys.readouterr()
    assert rc == EXIT_UNREADABLE != 0
    assert "DRAINED:" not in out and "NOT DRAINED: cannot tell whether" in err and needle in err


def test_one_failed_reading_is_tried_again():
    answers = iter([refused, lambda: httpx.Response(200, text=IDLE)])
    said: list[str] = []
    assert drain(
        "http://d:8000",
        ["http://r:9000"],
        TOKEN,
        60,
        said.append,
        0.0,
        httpx.Client(transport=engine_answering(lambda: next(answers)())),
    )
    assert said[-1].endswith("idle") and "(1 of 3)" in said[-2]
