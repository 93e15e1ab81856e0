"""Leg bodies and response helpers: exact kv_transfer_params, null stripping, error events.

Pure functions; no network.
"""

from __future__ import annotations

import json

import httpx
import pytest

from kvpush_prod.router.backends import resolve_identity
from kvpush_prod.router.config import PrefillBackendConfig
from kvpush_prod.router.errors import BackendClientError, LegFailure
from kvpush_prod.router.legs import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    check_status,
    decode_body,
    failure_from_exception,
    first_chunk_failure,
    prefill_body,
    sse_error_event,
    strip_null_kv_params,
)
from kvpush_prod.router.types import Backend, PrefillIdentity, Role

D = Backend(Role.DECODE, "http://d:1")
P = Backend(Role.PREFILL, "http://p:1")


def test_prefill_body_is_one_token_non_streaming_and_leaves_the_client_body_alone():
    body = {"model": "m", "messages": [], "max_tokens": 50, "stream": True, "min_tokens": 5,
            "stream_options": {"include_usage": True}}  # fmt: skip
    out = prefill_body(body, CHAT_PATH, "t1")
    assert out == {
        "model": "m",
        "messages": [],
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": "t1",
        },
    }
    assert body["max_tokens"] == 50 and "kv_transfer_params" not in body
    assert "max_completion_tokens" not in prefill_body(body, COMPLETIONS_PATH, "t1")


def test_decode_body_replaces_client_kv_transfer_params():
    ident = PrefillIdentity("e", "h", 5600, 2)
    out = decode_body({"prompt": "x", "kv_transfer_params": {"evil": 1}}, ident, "t")
    assert out["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "e",
        "remote_host": "h",
        "remote_port": 5600,
        "tp_size": 2,
        "transfer_id": "t",
    }


def test_identity_overrides_win_and_missing_fields_are_named():
    probed = {"remote_engine_id": "e", "remote_host": "0.0.0.0", "remote_port": 1, "tp_size": 1}
    over = PrefillBackendConfig(url="http://p:1", control_host="10.1.1.1")
    assert resolve_identity(probed, over) == PrefillIdentity("e", "10.1.1.1", 1, 1)
    with pytest.raises(ValueError, match="lacks remote_port, tp_size"):
        resolve_identity({"remote_engine_id": "e", "remote_host": "h"}, None)


@pytest.mark.parametrize(
    "body",
    [
        b'{"id":"x","choices":[],"kv_transfer_params":null}',
        b'{"kv_transfer_params":null,"id":"x","choices":[]}',
        b'{"id": "x", "choices": [], "kv_transfer_params": null}',
    ],
)
def test_null_kv_transfer_params_are_stripped(body):
    out = strip_null_kv_params(body)
    assert json.loads(out) == {"id": "x", "choices": []}


def test_other_bodies_pass_byte_for_byte():
    for body in (
        b'{"id":"x","kv_transfer_params":{"a":null}}',
        b'{"id": "x", "kv_transfer_params": {"a": 1}}',
        b'{"id":"x","text":"says \\"kv_transfer_params\\":null"}',
        b"not json",
    ):
        assert strip_null_kv_params(body) == body


def test_status_classification():
    check_status(D, 200, b"", "")
    with pytest.raises(BackendClientError) as e:
        check_status(D, 400, b'{"error":1}', "application/json")
    assert e.value.status == 400 and e.value.body == b'{"error":1}'
    for status in (429, 500, 503):
        with pytest.raises(LegFailure) as f:
            check_status(D, status, b"boom", "")
        assert f.value.reason == "decode_status" and f"HTTP {status}: boom" in str(f.value)
        assert "http://d:1" in str(f.value)


def test_httpx_errors_map_to_bounded_kinds():
    req = httpx.Request("POST", "http://p:1")
    assert failure_from_exception(P, httpx.ConnectError("x", request=req)).kind == "connect"
    assert failure_from_exception(P, httpx.ReadTimeout("x", request=req)).kind == "timeout"
    assert failure_from_exception(P, httpx.RemoteProtocolError("x", request=req)).reason == (
        "prefill_disconnect"
    )


def test_first_chunk_server_error_is_a_decode_failure_but_client_error_is_not():
    def event(code: int) -> bytes:
        err = {"error": {"message": "kv load failed", "type": "x", "param": None, "code": code}}
        return f"data: {json.dumps(err)}\n\n".encode()

    f = first_chunk_failure(D, event(500))
    assert f is not None and f.reason == "decode_stream_error" and "kv load failed" in str(f)
    assert first_chunk_failure(D, event(400)) is None
    assert first_chunk_failure(D, b'data: {"id":"x"}\n\n') is None


def test_sse_error_event_is_one_parseable_event():
    ev = sse_error_event("decode died")
    assert ev.startswith(b"data: ") and ev.endswith(b"\n\n")
    assert json.loads(ev[6:])["error"]["message"] == "decode died"
