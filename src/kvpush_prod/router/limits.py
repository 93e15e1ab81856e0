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

    ``inflight`` counts requests from the moment their whole body has arrived to their last
    byte sent: a client still sending its body holds no slot, so slow senders cannot keep
    everyone else out (their own deadline is ``body_timeout_s``).
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


# The ASGI scope key under which LimitsMiddleware hands a request its Ticket.
TICKET_SCOPE_KEY = "kvpush.ticket"


class Ticket:
    """One completion request's place in Admission: taken by the endpoint once the body
    has arrived (``take``), given back by LimitsMiddleware when the answer is sent."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.held = False

    def take(self) -> None:
        """Count the request in flight, or RequestRejected 503 (with Retry-After) if the
        router is at its limit or draining."""
        if self.held:
            return
        reason = self.admission.refusal()
        if reason is not None:
            raise RequestRejected(
                reason, 503, _refusal_message(reason, self.admission), retry_after=RETRY_AFTER_S
            )
        self.admission.inflight += 1
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.admission.inflight -= 1


def ticket_of(scope: Scope) -> Ticket | None:
    """The request's Ticket (None when the app runs without LimitsMiddleware)."""
    ticket = scope.get(TICKET_SCOPE_KEY)
    return ticket if isinstance(ticket, Ticket) else None


class LimitsMiddleware:
    """ASGI middleware in front of the completion endpoints: refuses at once while draining
    (503 with Retry-After), gives every other request a Ticket that the endpoint takes once
    the body has arrived, and holds it while the answer is sent, streaming included.

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
        if self.admission.draining:
            # Refused before its body: no request started now would be served anyway.
            reason = RejectReason.DRAINING
            self.metrics.count_rejected(reason)
            self.metrics.observe_request(path, Outcome.REJECTED, 0.0)
            body = error_body(_refusal_message(reason, self.admission), 503, "server_error",
                              reason.value)  # fmt: skip
            await send_json(send, 503, body, [(b"retry-after", str(RETRY_AFTER_S).encode())])
            return
        ticket = Ticket(self.admission)
        try:
            await self.app({**scope, TICKET_SCOPE_KEY: ticket}, receive, send)
        finally:
            ticket.release()


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


# The one value each field may have besides absent (or null: OpenAI's "default"): vLLM's
# own request models are lax (pydantic coerces "2", 2.0 and true to integers), so anything
# but this exact JSON value could still turn into more than one sequence on an engine.
_ONE_SEQUENCE: dict[str, tuple[Any, str, RejectReason]] = {
    "n": (1, "the JSON number 1", RejectReason.N_GT_1),
    "best_of": (1, "the JSON number 1", RejectReason.N_GT_1),
    "use_beam_search": (False, "false", RejectReason.BEAM_SEARCH),
}


def _json_of(v: Any) -> str:
    """``v`` as the client wrote it (JSON), cut short: a 16 MiB string is not echoed."""
    try:
        text = json.dumps(v, ensure_ascii=True)
    except (TypeError, ValueError):  # nothing json.loads gave; but never fail the answer
        text = f"<{type(v).__name__}>"
    return text if len(text) <= 40 else text[:37] + "..."


def _is_exactly(v: Any, want: Any) -> bool:
    # type() rather than isinstance(): True is an int and 1.0 == 1 in Python, yet neither
    # is the JSON the router passes on unchanged without vLLM coercing it.
    return type(v) is type(want) and v == want


_JSON_TYPE = {
    str: "a string",
    bool: "a boolean",
    int: "a number",
    float: "a fraction",
    list: "an array",
    dict: "an object",
}


def check_one_sequence(body: dict[str, Any]) -> None:
    """RequestRejected 400 unless ``n`` and ``best_of`` are absent, null or exactly 1 and
    ``use_beam_search`` absent, null or exactly false.

    P pushes the KV cache of one sequence to D, so parallel sampling and beam search
    cannot go through a P/D pair (and both legs carry one transfer id: two sequences of one
    request would share it).
    """
    for key, (want, want_text, reason) in _ONE_SEQUENCE.items():
        v = body.get(key)
        if v is None or _is_exactly(v, want):
            continue
        shown = _json_of(v)
        if key == "use_beam_search":
            fix = "send the request without it (or with false)"
        elif type(v) is int and v > 1 and key == "n":
            fix = f"send {shown} separate requests with n = 1 instead"
        elif type(v) is int and v > 1:
            fix = (
                "leave it out or send 1 (for the best of several, send several requests "
                "and compare them)"
            )
        else:
            fix = f"send {want_text} (not a string, boolean or fraction) or leave it out"
        raise RequestRejected(
            reason,
            400,
            f"`{key}` = {shown} ({_JSON_TYPE.get(type(v), type(v).__name__)}) is not supported "
            f"through the P/D router, which moves one KV cache for one sequence: `{key}` must "
            f"be absent or {want_text}; {fix}",
            param=key,
        )
