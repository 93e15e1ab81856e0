"""The router's request limits: admission (concurrency, drain), body size and read deadline,
JSON nesting, one sequence per request. Connection-level limits live in ``router/server.py``.

Each limit refuses with RequestRejected, naming the limit, its setting and what to do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpush_prod.router.errors import ClientGone, RequestRejected
from kvpush_prod.router.legs import error_body
from kvpush_prod.router.metrics import Outcome, RejectReason, RouterMetrics

# Seconds a client refused for load is told to wait: long enough to let a burst pass,
# short enough that a retry lands on this or another router soon.
RETRY_AFTER_S = 1
# A JSON string (valid JSON only: the body has been parsed before this is used).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
# Brackets of both kinds become one kind (valid JSON nests them properly); the rest goes.
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


class Admission:
    """Which completion requests may start now: the concurrency limit and the drain switch.

    ``inflight`` counts requests from their first byte read to their last byte sent.
    """

    def __init__(self, max_inflight: int) -> None:
        self.max_inflight = max_inflight
        self.inflight = 0
        self.draining = False

    def refusal(self) -> RejectReason | None:
        """Why a new request may not start now, or None."""
        if self.draining:
            return RejectReason.DRAINING
        if self.inflight >= self.max_inflight:
            return RejectReason.CONCURRENCY
        return None


def _refusal_message(reason: RejectReason, admission: Admission) -> str:
    if reason is RejectReason.DRAINING:
        return "this router is shutting down (draining); send the request to another router"
    return (
        f"the router is at its limit of {admission.max_inflight} requests in progress "
        f"(max_concurrent_requests); retry after {RETRY_AFTER_S} s"
    )


class LimitsMiddleware:
    """ASGI middleware in front of the completion endpoints: refuses what Admission refuses
    (503 with Retry-After) and counts the rest in flight while they run, streaming included.

    While draining, every answer (health included) carries ``Connection: close``, so
    clients and load balancers reconnect elsewhere.
    """

    def __init__(
        self, app: ASGIApp, admission: Admission, metrics: RouterMetrics, paths: Iterable[str]
    ) -> None:
        self.app = app
        self.admission = admission
        self.metrics = metrics
        self.paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.admission.draining:
            send = _closing(send)
        path = scope["path"]
        if path not in self.paths:
            await self.app(scope, receive, send)
            return
        reason = self.admission.refusal()
        if reason is not None:
            self.metrics.count_rejected(reason)
            self.metrics.observe_request(path, Outcome.REJECTED, 0.0)
            body = error_body(_refusal_message(reason, self.admission), 503, "server_error",
                              reason.value)  # fmt: skip
            await send_json(send, 503, body, [(b"retry-after", str(RETRY_AFTER_S).encode())])
            return
        self.admission.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.inflight -= 1


def _closing(send: Send) -> Send:
    async def send_closing(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [h for h in message.get("headers", []) if h[0].lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return send_closing


async def send_json(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """A whole JSON answer through ASGI ``send``."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _too_large(max_bytes: int, what: str) -> RequestRejected:
    return RequestRejected(
        RejectReason.BODY_TOO_LARGE,
        413,
        f"request body too large ({what}); the router accepts at most {max_bytes} bytes "
        "(max_body_bytes): send a smaller request",
        close=True,
    )


async def read_body(
    receive: Receive, content_length: str | None, max_bytes: int, timeout_s: float
) -> bytes:
    """The request body as it arrives, within ``max_bytes`` and ``timeout_s`` in all.

    RequestRejected 413 past the size (a declared Content-Length over it before any byte
    is read; a chunked or mis-declared body as soon as it grows past it), 408 past the
    deadline; ClientGone on disconnect. Never holds more than ``max_bytes`` plus one
    received message (uvicorn stops reading the socket at 64 KiB unread).
    """
    declared = (content_length or "").strip()
    if declared.isdigit() and (len(declared) > 20 or int(declared) > max_bytes):
        raise _too_large(max_bytes, f"Content-Length: {declared}")
    body = bytearray()
    try:
        with anyio.fail_after(timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone()
                body += message.get("body", b"")
                if len(body) > max_bytes:
                    raise _too_large(max_bytes, f"more than {max_bytes} bytes received")
                if not message.get("more_body", False):
                    return bytes(body)
    except TimeoutError:
        raise RequestRejected(
            RejectReason.BODY_TIMEOUT,
            408,
            f"request body not received within {timeout_s} s (got {len(body)} bytes so far; "
            "body_timeout_s): send the whole body without pausing",
            close=True,
        ) from None


def json_depth_exceeds(raw: bytes, limit: int) -> bool:
    """Whether valid JSON ``raw`` nests arrays and objects more than ``limit`` deep.

    Runs at C speed whatever the size: strings removed, brackets kept, then one pass per
    level deletes the innermost pairs, so a body of depth d empties in d passes.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False  # the usual request: too few brackets to nest that deep anyway
    brackets = _JSON_STRING.sub(b"", raw).translate(_BRACKETS, _NOT_BRACKETS)
    for _ in range(limit):
        if not brackets:
            return False
        brackets = brackets.replace(b"[]", b"")
    return bool(brackets)


def parse_body(raw: bytes, max_depth: int) -> dict[str, Any]:
    """The body as a JSON object; RequestRejected 400 if it is not one or nests too deep."""
    too_deep = RequestRejected(
        RejectReason.TOO_DEEP,
        400,
        f"request body nests arrays/objects more than {max_depth} deep (max_json_depth); "
        "no OpenAI request needs that: flatten it",
    )
    try:
        body = json.loads(raw)
    except RecursionError:  # nested past Python's own limit: refused like any too deep
        raise too_deep from None
    except ValueError as e:  # UnicodeDecodeError included
        raise RequestRejected(
            None,
            400,
            f"request body is not valid JSON ({e}); send a JSON object such as "
            '{"model": "...", "prompt": "..."}',
        ) from None
    if not isinstance(body, dict):
        raise RequestRejected(
            None, 400, f"request body must be a JSON object, got a JSON {type(body).__name__}"
        )
    if json_depth_exceeds(raw, max_depth):
        raise too_deep
    return body


def _more_than_one(v: Any) -> bool:
    # Compared as given: float() of a huge JSON integer (10**400) would overflow.
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 1


def check_one_sequence(body: dict[str, Any]) -> None:
    """RequestRejected 400 for a request that asks for more than one sequence.

    P pushes the KV cache of one sequence to D, so n > 1, best_of > 1 and beam search
    cannot go through a P/D pair.
    """
    for key in ("n", "best_of"):
        if _more_than_one(body.get(key)):
            raise RequestRejected(
                RejectReason.N_GT_1,
                400,
                f"`{key}` = {body[key]!r}: n > 1 (and best_of > 1) is not supported through "
                "the P/D router, which moves one KV cache for one sequence; send "
                f"{body[key]!r} separate requests with n = 1 instead",
                param=key,
            )
    if body.get("use_beam_search") is True:
        raise RequestRejected(
            RejectReason.BEAM_SEARCH,
            400,
            "`use_beam_search` is not supported through the P/D router, which moves one KV "
            "cache for one sequence; send the request without it",
            param="use_beam_search",
        )
