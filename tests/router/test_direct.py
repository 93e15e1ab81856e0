"""Transfer or recompute: a prompt estimated below ``direct_below_tokens`` goes to D alone,
with no P leg and no kv_transfer_params, counted in ``kvpush_router_direct_total``; longer
ones take both legs; ``0`` turns it off.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from kvpush_prod.errors import ConfigError
from kvpush_prod.router import settings_from_args, settings_from_mapping
from kvpush_prod.router.config import DIRECT_BELOW_TOKENS
from tests.router.fakes import MODEL, wait_until

SHORT = "w10 w11 w12"  # estimated 5 tokens (11 characters / 3, and a BOS)
LONG = " ".join(f"w{100 + i}" for i in range(40))  # estimated 68 (199 characters / 3 + 1)
COMPLETION = {"model": MODEL, "max_tokens": 4, "temperature": 0}


def direct_count(r, endpoint: str = "/v1/completions") -> float:
    return r.sample("kvpush_router_direct_total", endpoint=endpoint)


async def test_short_prompt_goes_to_decode_alone_without_kv_transfer_params(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], direct_below_tokens=16)
    # A null kv_transfer_params (what some clients send) is not passed on.
    body = {**COMPLETION, "prompt": SHORT, "kv_transfer_params": None}

    resp = await r.post("/v1/completions", body)

    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "w4 w5 w6 w7"
    assert "kv_transfer_params" not in resp.json()
    assert p.requests == []
    (ds,) = d.requests
    assert ds.body == {**COMPLETION, "prompt": SHORT}
    assert resp.headers["x-request-id"] == ds.headers["x-request-id"]
    assert direct_count(r) == 1 and direct_count(r, "/v1/chat/completions") == 0
    assert r.sample("kvpush_router_requests_total", endpoint="/v1/completions", outcome="ok") == 1
    assert r.sample("kvpush_router_ttft_seconds_count", endpoint="/v1/completions") == 1


async def test_a_short_prompt_with_the_clients_own_kv_transfer_params_takes_both_legs(
    fakes, router
):
    # As before this path existed: both legs, each with the router's params (never the
    # client's), and not counted as direct.
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], direct_below_tokens=16)
    client_params = {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 1}

    resp = await r.post(
        "/v1/completions", {**COMPLETION, "prompt": SHORT, "kv_transfer_params": client_params}
    )

    assert resp.status_code == 200, resp.text
    (ps,), (ds,) = p.requests, d.requests
    assert ps.body["kv_transfer_params"]["do_remote_decode"] is True
    assert ds.body["kv_transfer_params"]["remote_engine_id"] == p.engine_id
    assert ds.body["kv_transfer_params"]["remote_host"] != "10.9.9.9"
    assert direct_count(r) == 0


async def test_longer_prompt_takes_both_legs_and_is_not_counted(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], direct_below_tokens=16)

    resp = await r.post("/v1/completions", {**COMPLETION, "prompt": LONG})

    assert resp.status_code == 200, resp.text
    (ps,), (ds,) = p.requests, d.requests
    assert ps.body["kv_transfer_params"]["do_remote_decode"] is True
    assert ds.body["kv_transfer_params"]["do_remote_prefill"] is True
    assert ds.body["kv_transfer_params"]["remote_engine_id"] == p.engine_id
    assert direct_count(r) == 0


async def test_pull_mode_sends_short_prompts_to_decode_alone_too(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], mode="pull", direct_below_tokens=16)

    short = await r.post("/v1/completions", {**COMPLETION, "prompt": SHORT})
    long = await r.post("/v1/completions", {**COMPLETION, "prompt": LONG})

    assert short.status_code == long.status_code == 200
    assert len(p.requests) == 1 and p.requests[0].body["prompt"] == LONG
    assert [("kv_transfer_params" in s.body) for s in d.requests] == [False, True]
    assert direct_count(r) == 1


async def test_zero_turns_it_off_even_for_a_one_token_prompt(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], direct_below_tokens=0)

    resp = await r.post("/v1/completions", {**COMPLETION, "prompt": [7]})

    assert resp.status_code == 200, resp.text
    assert len(p.requests) == len(d.requests) == 1
    assert "kv_transfer_params" in d.requests[0].body
    # Exported at 0 from the start, so rate() and dashboards see the series.
    assert (
        r.registry.get_sample_value("kvpush_router_direct_total", {"endpoint": "/v1/completions"})
        == 0.0
    )


async def test_token_ids_count_exactly_at_the_threshold(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], direct_below_tokens=8)

    below = await r.post("/v1/completions", {**COMPLETION, "prompt": list(range(100, 107))})
    at = await r.post("/v1/completions", {**COMPLETION, "prompt": list(range(100, 108))})
    # A batch of token-id lists counts them all: 4 + 3 is below 8.
    batch = await r.post("/v1/completions", {**COMPLETION, "prompt": [[1, 2, 3, 4], [5, 6, 7]]})

    assert below.status_code == at.status_code == batch.status_code == 200
    assert [len(s.body["prompt"]) for s in d.requests] == [7, 8, 2]
    assert ["kv_transfer_params" in s.body for s in d.requests] == [False, True, False]
    assert len(p.requests) == 1 and len(p.requests[0].body["prompt"]) == 8
    assert direct_count(r) == 2


async def test_the_threshold_is_the_estimate_of_text(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    # SHORT is estimated 5 tokens: below 6, not below 5.
    r5 = await router([p], [d], direct_below_tokens=5)
    r6 = await router([p], [d], direct_below_tokens=6)

    assert (await r5.post("/v1/completions", {**COMPLETION, "prompt": SHORT})).status_code == 200
    assert len(p.requests) == 1 and direct_count(r5) == 0
    assert (await r6.post("/v1/completions", {**COMPLETION, "prompt": SHORT})).status_code == 200
    assert len(p.requests) == 1 and direct_count(r6) == 1
    assert len(d.requests) == 2


async def test_streamed_chat_short_goes_alone_long_takes_both_legs(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], direct_below_tokens=16)
    chat = {
        "model": MODEL,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    short = {**chat, "messages": [{"role": "user", "content": "w10 w11"}]}

    resp = await r.post("/v1/chat/completions", short)

    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    (ds,) = d.requests
    tid = ds.headers["x-request-id"]
    assert resp.content == b"".join(d.sse_events("/v1/chat/completions", ds.body, tid))
    assert ds.body == short and p.requests == []
    assert direct_count(r, "/v1/chat/completions") == 1

    long = {
        **chat,
        "messages": [{"role": "system", "content": LONG}, {"role": "user", "content": "w10 w11"}],
    }
    resp = await r.post("/v1/chat/completions", long)
    assert resp.status_code == 200 and resp.content.endswith(b"data: [DONE]\n\n")
    assert len(p.requests) == 1 and p.requests[0].body["max_completion_tokens"] == 1
    assert d.requests[1].body["kv_transfer_params"]["do_remote_prefill"] is True
    assert direct_count(r, "/v1/chat/completions") == 1
    await wait_until(
        lambda: (
            r.sample("kvpush_router_requests_total", endpoint="/v1/chat/completions", outcome="ok")
            == 2
        )
    )


async def test_a_chat_part_the_router_cannot_size_takes_both_legs(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], direct_below_tokens=1000)
    content = [
        {"type": "text", "text": "w10"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]

    resp = await r.post(
        "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    )

    assert resp.status_code == 200, resp.text
    assert len(p.requests) == 1 and direct_count(r, "/v1/chat/completions") == 0


async def test_short_prompts_are_served_while_every_prefill_is_down(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], direct_below_tokens=16)
    await p.stop()
    await wait_until(lambda: not r.app.state.pool.ready(), what="prefill marked down")

    short = await r.post("/v1/completions", {**COMPLETION, "prompt": SHORT})
    long = await r.post("/v1/completions", {**COMPLETION, "prompt": LONG})

    assert short.status_code == 200, short.text
    assert long.status_code == 503 and "no healthy prefill backend" in long.text
    assert len(d.requests) == 1


async def test_a_failed_decode_is_retried_on_another_decode_alone(fakes, router):
    p = await fakes("prefill")
    d1, d2 = await fakes("decode"), await fakes("decode")
    d1.status = 503
    r = await router([p], [d1, d2], direct_below_tokens=16)

    resp = await r.post("/v1/completions", {**COMPLETION, "prompt": SHORT})

    assert resp.status_code == 200, resp.text
    assert len(d1.requests) == len(d2.requests) == 1 and p.requests == []
    assert "kv_transfer_params" not in d2.requests[0].body
    assert r.sample("kvpush_router_retries_total", reason="decode_status") == 1
    assert (
        r.sample("kvpush_router_requests_total", endpoint="/v1/completions", outcome="retried_ok")
        == 1
    )
    assert direct_count(r) == 1  # one request, however many attempts

    d2.status = 503
    resp = await r.post("/v1/completions", {**COMPLETION, "prompt": SHORT})
    assert resp.status_code == 502
    assert "HTTP 503" in resp.json()["error"]["message"]


async def test_client_leaving_a_direct_stream_closes_the_decode_leg(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    d.chunk_delay = 0.2
    r = await router([p], [d], direct_below_tokens=16)

    async with r.client.stream(
        "POST", r.url + "/v1/completions", json={**COMPLETION, "prompt": SHORT, "stream": True}
    ) as resp:
        assert resp.status_code == 200
        async for _ in resp.aiter_raw():
            break

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
    assert p.requests == []


async def test_signed_router_sends_the_direct_leg_unsigned_and_bare(fakes, router, tmp_path):
    p, d = await fakes("prefill"), await fakes("decode")
    key = tmp_path / "params.key"
    key.write_bytes(b"9c1e5a7f03b84d26e1f0a5c7d93b624e8f17a0c5b2d94e6f3a81c07b5e29d4f6\n")
    key.chmod(0o600)
    r = await router([p], [d], direct_below_tokens=16, params_key_file=str(key))

    resp = await r.post("/v1/completions", {**COMPLETION, "prompt": SHORT})

    assert resp.status_code == 200, resp.text
    assert d.requests[0].body == {**COMPLETION, "prompt": SHORT}


async def test_each_direct_request_is_logged_at_debug(fakes, router, caplog):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], direct_below_tokens=16)

    with caplog.at_level(logging.DEBUG, logger="kvpush_prod.router.proxy"):
        await r.post("/v1/completions", {**COMPLETION, "prompt": [1, 2, 3]})
        await r.post("/v1/completions", {**COMPLETION, "prompt": SHORT})

    lines = [rec.getMessage() for rec in caplog.records if "alone" in rec.getMessage()]
    assert len(lines) == 2
    assert "prompt of 3 tokens is below direct_below_tokens = 16" in lines[0]
    assert "prompt of ~5 tokens" in lines[1] and d.url in lines[1]
    assert all(
        rec.levelno == logging.DEBUG for rec in caplog.records if "alone" in rec.getMessage()
    )


def test_the_default_threshold_is_the_measured_one_and_flags_set_it() -> None:
    backends = ["--prefill", "http://a:1", "--decode", "http://b:2"]
    assert settings_from_args(backends).direct_below_tokens == DIRECT_BELOW_TOKENS > 0
    assert settings_from_args([*backends, "--direct-below-tokens", "0"]).direct_below_tokens == 0
    assert (
        settings_from_args([*backends, "--direct-below-tokens", "200"]).direct_below_tokens == 200
    )


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        (
            "direct_below_tokens",
            -1,
            "direct_below_tokens = -1: Input should be greater than or equal to 0",
        ),
        ("direct_below_tokens", "many", "direct_below_tokens = 'many'"),
        (
            "direct_chars_per_token",
            0.5,
            "direct_chars_per_token = 0.5: Input should be greater than or equal to 1",
        ),
    ],
)
def test_bad_settings_name_the_key_and_value(key, value, needle) -> None:
    with pytest.raises(ConfigError) as e:
        settings_from_mapping({"prefill": ["http://a:1"], "decode": ["http://b:2"], key: value})
    assert needle in str(e.value)


def test_the_yaml_file_sets_both(tmp_path: Path) -> None:
    from kvpush_prod.router import load_settings

    path = tmp_path / "router.yaml"
    path.write_text(
        "prefill: [http://a:1]\ndecode: [http://b:2]\n"
        "direct_below_tokens: 48\ndirect_chars_per_token: 4\n"
    )
    s = load_settings(path)
    assert (s.direct_below_tokens, s.direct_chars_per_token) == (48, 4.0)
