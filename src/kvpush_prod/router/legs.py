"""What the router sends on each leg and how it reads what comes back, without any I/O.

Body builders for the P and D legs, httpx error classification and response-body helpers.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx

from kvpush_prod.router.errors import BackendClientError, LegFailure
from kvpush_prod.router.types import Backend, PrefillIdentity
from kvpush_prod.signing import DECODE, LEG_FIELDS, sign_params

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

# 408 and 429 say "not now" rather than "bad request": another pair may well take it.
_RETRYABLE_4XX = frozenset({408, 429})


def dumps(obj: Any) -> bytes:
    """Compact JSON, as vLLM's own server writes it."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


# vLLM's request header that pins a request to one data-parallel engine core of an API
# server (vllm/entrypoints: ``_get_data_parallel_rank``).
DP_RANK_HEADER = "X-data-parallel-rank"


def prefill_body(
    body: dict[str, Any], path: str, transfer_id: str, decode_key: str | None = None
) -> dict[str, Any]:
    """P's leg: the client's request cut to one token, non-streaming, producing KV for D.

    ``decode_key`` (the chosen D's control-channel key, when known) tells P to accept the
    transfer from that D only.
    """
    out = dict(body)
    out["max_tokens"] = 1
    if path == CHAT_PATH:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    # min_tokens > 1 would make P reject max_tokens=1 with a 400.
    out.pop("min_tokens", None)
    out["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": transfer_id,
    }
    if decode_key is not None:
        out["kv_transfer_params"]["decode_key"] = decode_key
    return out


def decode_body(body: dict[str, Any], p: PrefillIdentity, transfer_id: str) -> dict[str, Any]:
    """D's leg: the client's request unchanged, told to receive the KV pushed by P (and,
    when P has one, which control-channel key P's messages must carry)."""
    out = dict(body)
    out["kv_transfer_params"] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": p.engine_id,
        "remote_host": p.host,
        "remote_port": p.port,
        "tp_size": p.tp_size,
        "transfer_id": transfer_id,
    }
    if p.remote_key is not None:
        out["kv_transfer_params"]["remote_key"] = p.remote_key
    return out


def direct_body(body: dict[str, Any]) -> dict[str, Any]:
    """D's leg when D alone serves the request (a short prompt): the client's request
    without ``kv_transfer_params`` (only a null one can be there: a request with its own
    takes both legs), so D computes the prompt as a single engine would."""
    out = dict(body)
    out.pop("kv_transfer_params", None)
    return out


def signed(
    body: dict[str, Any], key: bytes | None, now: float, ttl_s: float, leg: str
) -> dict[str, Any]:
    """``body`` with its ``kv_transfer_params`` signed by the params key for ``leg``
    (``signing.PREFILL``/``DECODE``), valid ``ttl_s`` from ``now`` (wall-clock: the engines
    check it against theirs) and once (a fresh nonce); unchanged without a key."""
    if key is None:
        return body
    return {
        **body,
        "kv_transfer_params": sign_params(body["kv_transfer_params"], key, now, leg, ttl_s),
    }


def pull_prefill_body(
    body: dict[str, Any], path: str, transfer_id: str, for_signing: bool = False
) -> dict[str, Any]:
    """Pull mode, P's leg: one token, non-streaming; P keeps the KV for D to READ.

    The kv_transfer_params are those of vLLM's own disaggregation proxies for NixlConnector;
    ``for_signing``: those a kvpush engine verifies under a signature instead (only kvpush
    engines check signatures, and they refuse any field the prefill leg does not carry).
    """
    out = prefill_body(body, path, transfer_id)
    if for_signing:
        return out
    out["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return out


def pull_decode_body(
    body: dict[str, Any], p_params: dict[str, Any], transfer_id: str | None = None
) -> dict[str, Any]:
    """Pull mode, D's leg: the client's request with P's answered kv_transfer_params
    (P's block ids, engine id and side channel), so D READs the KV from P.

    With ``transfer_id`` (the legs are signed): only the fields a kvpush decode engine
    verifies under a signature (``signing.LEG_FIELDS``), bound to that transfer id when P
    named none; the rest of P's answer (block ids, vLLM's request id) is vLLM's connectors'
    business, and those verify no signature.
    """
    out = dict(body)
    if transfer_id is None:
        out["kv_transfer_params"] = dict(p_params)
        return out
    params = {k: v for k, v in p_params.items() if k in LEG_FIELDS[DECODE]}
    params.setdefault("transfer_id", transfer_id)
    out["kv_transfer_params"] = params
    return out


def prefill_kv_params(b: Backend, content: bytes) -> dict[str, Any]:
    """The ``kv_transfer_params`` of P's answer in pull mode; LegFailure if it has none."""
    try:
        params = json.loads(content).get("kv_transfer_params")
    except (ValueError, AttributeError):
        params = None
    if not isinstance(params, dict):
        snippet = content[:300].decode("utf-8", "replace").strip()
        raise LegFailure(
            b,
            "status",
            f"prefill answer has no kv_transfer_params (is it started with a kv_producer "
            f"NixlConnector?): {snippet}",
        )
    return params


def vllm_request_id(path: str, transfer_id: str) -> str:
    """The request id vLLM's OpenAI server gives a request sent with ``X-Request-Id``
    (without the engine's random suffix, which vLLM's NIXL connectors strip)."""
    return f"chatcmpl-{transfer_id}" if path == CHAT_PATH else f"cmpl-{transfer_id}-0"


def probe_body(model: str) -> dict[str, Any]:
    """The identity probe: one token whose response carries the engine's kv_transfer_params
    (P's identity; a D's control-channel key)."""
    return {
        "model": model,
        "prompt": "probe",
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "kvpush_probe": True},
    }


def tls_hint(text: str) -> str:
    """What to check when ``text`` (an error's description) is a TLS failure of an
    https:// backend ("" otherwise)."""
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return (
            "; the engine's TLS certificate does not chain to the router's CA or does "
            "not name the host of its URL: check --backend-ca-file against the engine's "
            "--ssl-certfile"
        )
    if "WRONG_VERSION_NUMBER" in text or "record layer failure" in text:
        return (
            "; the backend does not speak TLS: start the engine with --ssl-keyfile/"
            "--ssl-certfile, or list it as http://"
        )
    if "CERTIFICATE_REQUIRED" in text or "alert certificate required" in text:
        return (
            "; the engine requires a client certificate: give the router "
            "--backend-client-cert-file and --backend-client-key-file"
        )
    return ""


def _root_cause(e: BaseException) -> BaseException:
    seen = {id(e)}
    while (nxt := e.__cause__ or e.__context__) is not None and id(nxt) not in seen:
        seen.add(id(nxt))
        e = nxt
    return e


def describe_error(e: BaseException) -> str:
    """``e`` for a message: its type and text, its root cause when that says more (httpx's
    ReadError of a reset connection has no text of its own) and, for a TLS failure, what
    to check."""
    text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    root = _root_cause(e)
    if root is not e and str(root) and str(root) not in text:
        text += f" ({type(root).__name__}: {root})"
    return text + tls_hint(text)


def failure_from_exception(b: Backend, e: BaseException) -> LegFailure:
    """Name an httpx (or timeout) error as a LegFailure kind; a TLS handshake that fails
    (a certificate the CA did not sign) is a connect failure."""
    detail = describe_error(e)
    if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
        return LegFailure(b, "connect", detail)
    if isinstance(e, httpx.PoolTimeout):
        # The router's own pool is full (max_connections), not the backend's fault.
        return LegFailure(b, "pool", detail)
    if isinstance(e, (httpx.TimeoutException, TimeoutError)):
        return LegFailure(b, "timeout", detail)
    return LegFailure(b, "disconnect", detail)


def check_status(b: Backend, status: int, body: bytes, content_type: str) -> None:
    """Raise for a non-2xx answer: BackendClientError for a 4xx the client caused."""
    if 200 <= status < 300:
        return
    if 400 <= status < 500 and status not in _RETRYABLE_4XX:
        raise BackendClientError(b, status, body, content_type)
    snippet = body[:300].decode("utf-8", "replace").strip()
    raise LegFailure(b, "status", f"HTTP {status}: {snippet}")


_ERROR_EVENT_PREFIX = b'data: {"error"'


def first_chunk_failure(b: Backend, chunk: bytes) -> LegFailure | None:
    """A stream whose first event is a server-side error (vLLM: code >= 500) failed D-side.

    Nothing has reached the client yet, so the request can still go to another pair.
    """
    if not chunk.startswith(_ERROR_EVENT_PREFIX):
        return None
    event, sep, _ = chunk.partition(b"\n\n")
    if not sep:
        return None
    try:
        err = json.loads(event[len(b"data: ") :])["error"]
        code = int(err.get("code") or 0)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if code < 500:
        return None
    return LegFailure(b, "stream_error", f"error event before any token: {err.get('message')}")


_NULL_PARAMS = (b',"kv_transfer_params":null', b'"kv_transfer_params":null,')


def strip_null_kv_params(body: bytes) -> bytes:
    """Drop a ``"kv_transfer_params": null`` member; leave any other body byte for byte.

    vLLM's D answers always carry that null; removing it in the bytes (an unescaped quote
    cannot occur inside a JSON string, so the pattern is always a real member) avoids
    re-encoding the common compact form. Other spacings are parsed and re-encoded.
    """
    if b'"kv_transfer_params"' not in body:
        return body
    for pattern in _NULL_PARAMS:
        if pattern in body:
            return body.replace(pattern, b"", 1)
    try:
        obj = json.loads(body)
    except ValueError:
        return body
    if isinstance(obj, dict) and "kv_transfer_params" in obj and obj["kv_transfer_params"] is None:
        del obj["kv_transfer_params"]
        return dumps(obj)
    return body


def sse_error_event(message: str, code: int = 502) -> bytes:
    """An OpenAI-style error as one SSE event, for a stream that cannot finish."""
    return (
        b"data: "
        + dumps(
            {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
        )
        + b"\n\n"
    )


def error_body(
    message: str, status: int, err_type: str, code: str | None = None, param: str | None = None
) -> bytes:
    """The OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    if param is None and code == "model_not_found":
        param = "model"
    return dumps(
        {"error": {"message": message, "type": err_type, "param": param, "code": code or status}}
    )


# -- how D's answer ended ---------------------------------------------------------------------

# vLLM ends a request it did not finish (its engine stopping: SIGTERM, a pod deleted without a
# drain; or an internal error) with HTTP 200: finish_reason "abort" (or "error") after the
# tokens so far, or, streaming, a usage event and [DONE] with no finish reason at all. Relayed
# as they are, a client would take a cut or empty answer for a whole one.
UNFINISHED_REASONS = frozenset({"abort", "error"})
_FINISH_REASON = re.compile(rb'"finish_reason"\s*:\s*"([^"\\]{0,32})"')
_DONE_EVENT = b"data: [DONE]"


_CHOICE = re.compile(rb'"choices"\s*:\s*\[\s*\{')


def has_choice(events: bytes) -> bool:
    """Whether ``events`` (SSE bytes) hold a choice event: a token, or a finish."""
    return _CHOICE.search(events) is not None


def unfinished_answer(body: bytes) -> str | None:
    """Why a non-streaming answer is not a whole one (a finish_reason of UNFINISHED_REASONS,
    or none), or None when every choice finished."""
    try:
        choices = json.loads(body).get("choices")
    except (ValueError, AttributeError):
        return None  # not an answer the router can read: passed on as it is
    if not isinstance(choices, list) or not choices:
        return None
    for choice in choices:
        reason = choice.get("finish_reason") if isinstance(choice, dict) else None
        if reason is None or reason in UNFINISHED_REASONS:
            return f"finish_reason {reason!r}: the decode engine ended it unfinished"
    return None


class FinishWatch:
    """Follows D's SSE bytes as they are relayed and tells when the stream's end is not an
    answer's end: [DONE] (or the end of the bytes) without a finish reason, or after "abort" /
    "error". Reads only the finish_reason members; holds the last bytes of a chunk so a
    member split across chunks is still seen."""

    _KEEP = 96

    def __init__(self) -> None:
        self.reason: str | None = None
        self._tail = b""

    def feed(self, chunk: bytes) -> int:
        """Take ``chunk``; the offset of [DONE] in it (0 when it began in the chunk before),
        or -1."""
        data = self._tail + chunk
        for m in _FINISH_REASON.finditer(data):
            self.reason = m.group(1).decode(errors="replace")
        done = data.find(_DONE_EVENT)
        offset = -1 if done < 0 else max(0, done - len(self._tail))
        self._tail = data[-self._KEEP :]
        return offset

    def unfinished(self) -> str | None:
        """Why the stream so far is not a finished answer, or None."""
        if self.reason is None:
            return "the stream ended without a finish reason"
        if self.reason in UNFINISHED_REASONS:
            return f"the stream ended with finish_reason {self.reason!r}"
        return None
