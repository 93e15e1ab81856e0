"""One client request through the router: both legs at once, first byte, retry, stream.

The Dispatcher owns the per-request flow; it holds no policy of its own beyond retry rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_none,
)

from kvpush_prod.router.backends import BackendPool
from kvpush_prod.router.config import RouterSettings
from kvpush_prod.router.errors import (
    BackendClientError,
    ClientGone,
    LegFailure,
    NoBackendError,
    RequestRejected,
)
from kvpush_prod.router.health import HealthMonitor
from kvpush_prod.router.legs import (
    DP_RANK_HEADER,
    FinishWatch,
    check_status,
    decode_body,
    direct_body,
    dumps,
    error_body,
    failure_from_exception,
    first_chunk_failure,
    has_choice,
    prefill_body,
    prefill_kv_params,
    pull_decode_body,
    pull_prefill_body,
    signed,
    sse_error_event,
    strip_null_kv_params,
    unfinished_answer,
    vllm_request_id,
)
from kvpush_prod.router.limits import check_one_sequence, parse_body, read_body, ticket_of
from kvpush_prod.router.metrics import Outcome, RouterMetrics
from kvpush_prod.router.prompt import PromptSize, prompt_tokens
from kvpush_prod.router.types import Backend
from kvpush_prod.signing import DECODE, PREFILL

log = logging.getLogger(__name__)

# Closed-by-client marker (nginx's 499): nobody reads it, but access logs show it.
_CLIENT_CLOSED = 499
# Whatever else a backend call raises is that leg failing too ("disconnect": retried on
# another pair before any byte went out, else a 502 or an SSE error event), never an
# exception out of the app, which drops the client's connection with no answer. httpcore
# raises AttributeError ('NoneType' object has no attribute 'getpeername') on a connection
# the backend tore down mid-connect (a prefill engine killed at that moment).
_CLIENT_FAULT = Exception
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, passed to the legs
# A policy that learns links (link_aware) counts a prompt this far (estimated tokens, no tokenizer): past it, the
# count only scales every pair's time alike.
LINK_COUNT_CAP = 1 << 20


def error_response(
    status: int,
    message: str,
    err_type: str,
    code: str | None = None,
    *,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    return Response(
        error_body(message, status, err_type, code, param),
        status,
        headers=headers,
        media_type="application/json",
    )


async def _wait_disconnect(receive: Receive) -> None:
    # Once the body is read, the server's receive() only returns on disconnect (or when
    # the response is complete, which cannot happen while this task is alive).
    while (await receive())["type"] != "http.disconnect":
        pass


async def _close_quietly(resp: httpx.Response) -> None:
    # Shielded: closing an unfinished response drops its connection, which is how the
    # backend learns to abort; a cancellation arriving here must not skip that.
    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
        await resp.aclose()


@dataclass(eq=False)
class DecodeStart:
    """D's leg once it produced its first byte: the open response and what came so far."""

    backend: Backend
    response: httpx.Response
    first: bytes
    rest: AsyncIterator[bytes] | None
    _release: Callable[[], None]
    watch: FinishWatch = field(default_factory=FinishWatch)
    _closed: bool = False

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await _close_quietly(self.response)
        self._release()


async def _first_choice(started: DecodeStart) -> DecodeStart:
    """Read D's stream on to its first choice event (vLLM's first token) before anything is
    relayed: a stream that ends before one (a usage event and [DONE]: D stopped) is a failed
    leg another pair can still answer."""
    assert started.rest is not None
    done = started.watch.feed(started.first)
    while done < 0 and not has_choice(started.first):
        try:
            more = await started.rest.__anext__()
        except StopAsyncIteration:
            break
        done = started.watch.feed(more)
        started.first += more
    if done >= 0 or not has_choice(started.first):
        why = started.watch.unfinished()
        if why is not None:
            # Nothing reached the client yet: another pair can still answer it.
            raise LegFailure(started.backend, "unfinished", why)
    return started


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator, so legs end deterministically.

    Without this an abandoned generator is closed whenever the garbage collector gets to it.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


@dataclass(eq=False)
class _Request:
    """One client request's state across attempts."""

    path: str
    body: dict[str, Any]
    model: str | None
    stream: bool
    start: float
    disconnect: asyncio.Task[None]
    exclude: set[Backend]
    failures: list[LegFailure]
    authorization: str | None
    attempts: int = 0
    # The prompt's estimated size, and whether it goes to D alone (below
    # direct_below_tokens): then it needs a D only, never a P.
    prompt: PromptSize | None = None
    direct: bool = False
    # The client's W3C trace context, passed to both legs: the engines' request spans (and
    # kvpush's transfer spans) join the client's trace.
    trace: dict[str, str] = field(default_factory=dict)


class Dispatcher:
    """Routes completions and chat completions through a (P, D) pair, with one retry."""

    def __init__(
        self,
        settings: RouterSettings,
        pool: BackendPool,
        health: HealthMonitor,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.health = health
        self.client = client
        self.metrics = metrics
        # Every leg bounds waiting for a pool slot and sending its request: a full pool
        # or a backend that stopped reading fails the leg instead of holding it forever.
        bounded = {
            "connect": settings.connect_timeout_s,
            "write": settings.backend_write_timeout_s,
            "pool": settings.pool_timeout_s,
        }
        self._prefill_timeout = httpx.Timeout(settings.prefill_timeout_s, **bounded)
        # D streams for as long as generation lasts: reading is not bounded here; the wait
        # for the first byte is (first_byte_timeout_s), and a client that stops reading is
        # dropped by the server (client_write_timeout_s), which closes this leg.
        self._decode_timeout = httpx.Timeout(None, **bounded)
        # Detached P legs (D answered first); kept referenced so they are not collected.
        self._background: set[asyncio.Task[Any]] = set()
        if settings.direct_below_tokens:
            log.info(
                "requests whose prompt is estimated below %d tokens go to a decode "
                "backend alone, which computes it (direct_below_tokens; 0 turns this "
                "off); counted in kvpush_router_direct_total",
                settings.direct_below_tokens,
            )

    def tables(self) -> dict[str, tuple[int, int | None]]:
        """Entries of the dispatcher's tables (kvpush_router_table_entries)."""
        return {"legs.background": (len(self._background), None)}

    async def aclose(self) -> None:
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    # -- entry point -----------------------------------------------------------------------

    async def handle(self, request: Request, path: str) -> Response:
        start = time.perf_counter()
        try:
            body = await self._read_request(request)
            # Only now does the request count against max_concurrent_requests: a client
            # still sending its body must not hold a slot others could use.
            ticket = ticket_of(request.scope)
            if ticket is not None:
                ticket.take()
        except RequestRejected as e:
            return self._refuse(path, start, e)
        except ClientGone:
            self.metrics.observe_request(
                path, Outcome.CLIENT_CANCELLED, time.perf_counter() - start
            )
            return Response(status_code=_CLIENT_CLOSED)
        model = body.get("model")
        if model is not None and not await self.health.knows_model(model):
            served = ", ".join(self.pool.known_models()) or "none known (are the backends up?)"
            return self._reject(
                path,
                start,
                404,
                f"The model `{model}` does not exist; the backends serve: {served}",
                code="model_not_found",
            )

        req = _Request(
            path=path,
            body=body,
            model=model,
            stream=body.get("stream") is True,
            start=start,
            disconnect=asyncio.create_task(_wait_disconnect(request.receive)),
            exclude=set(),
            failures=[],
            authorization=None
            if self.settings.backend_api_key
            else request.headers.get("authorization"),
            trace={k: v[:512] for k in TRACE_HEADERS if (v := request.headers.get(k)) is not None},
        )
        threshold = self.settings.direct_below_tokens
        # A client's own kv_transfer_params ask for a transfer: such a request takes both
        # legs as it always did (the router's params replace the client's on each leg).
        links = self.pool.learns_links
        if (threshold or links) and body.get("kv_transfer_params") is None:
            # A policy that times each pair per prompt token needs the whole count.
            cap = LINK_COUNT_CAP if links else threshold
            req.prompt = prompt_tokens(path, body, self.settings.direct_chars_per_token, cap)
            req.direct = req.prompt.below(threshold)
            if req.direct:
                self.metrics.count_direct(path)
        try:
            await self._wait_for_pair(req)
            return await self._route(req)
        finally:
            req.disconnect.cancel()

    async def _wait_for_pair(self, req: _Request) -> None:
        """With no routable pair, wait up to ``no_backend_wait_s`` for one (an engine
        restarting after a drain), checking every 100 ms; the route then answers."""
        deadline = time.monotonic() + self.settings.no_backend_wait_s
        while not self._routable(req) and time.monotonic() < deadline and not req.disconnect.done():
            await asyncio.sleep(0.1)

    def _routable(self, req: _Request) -> bool:
        """Whether an attempt has backends left: a D for a request sent to D alone, else a
        (P, D) pair."""
        if req.direct:
            return self.pool.has_decode(req.model, req.exclude)
        return self.pool.has_pair(req.model, req.exclude)

    async def _read_request(self, request: Request) -> dict[str, Any]:
        """The client's body as a JSON object within every request limit, or
        RequestRejected (ClientGone if the client left while sending it)."""
        s = self.settings
        raw = await read_body(
            request.receive, request.headers.get("content-length"), s.max_body_bytes,
            s.body_timeout_s,
        )  # fmt: skip
        body = parse_body(raw, s.max_json_depth)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise RequestRejected(None, 400, f"`model` must be a string, got {model!r}")
        check_one_sequence(body)
        return body

    def _refuse(self, path: str, start: float, e: RequestRejected) -> Response:
        if e.reason is None:
            outcome, code = Outcome.CLIENT_ERROR, None
        else:
            self.metrics.count_rejected(e.reason)
            outcome, code = Outcome.REJECTED, e.reason.value
        self.metrics.observe_request(path, outcome, time.perf_counter() - start)
        headers: dict[str, str] = {}
        if e.close:
            # The rest of the body was not read: a new request on this connection would
            # start in the middle of it.
            headers["Connection"] = "close"
        if e.retry_after is not None:
            headers["Retry-After"] = str(e.retry_after)
        return error_response(
            e.status,
            e.message,
            "server_error" if e.status >= 500 else "invalid_request_error",
            code,
            param=e.param,
            headers=headers or None,
        )

    def _reject(
        self, path: str, start: float, status: int, message: str, code: str | None = None
    ) -> Response:
        self.metrics.observe_request(path, Outcome.CLIENT_ERROR, time.perf_counter() - start)
        return error_response(status, message, "invalid_request_error", code)

    def _seal(self, body: dict[str, Any], leg: str) -> bytes:
        """A leg's body as sent: its kv_transfer_params signed for ``leg`` when a params key
        is set."""
        s = self.settings
        return dumps(signed(body, s.params_key, time.time(), s.params_ttl_s, leg))

    def _finish(self, req: _Request, outcome: Outcome) -> None:
        self.metrics.observe_request(req.path, outcome, time.perf_counter() - req.start)

    # -- attempts ---------------------------------------------------------------------------

    async def _route(self, req: _Request) -> Response:
        def retry_on_other_pair(e: BaseException) -> bool:
            return isinstance(e, LegFailure) and self._routable(req)

        def count_retry(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            if isinstance(exc, LegFailure):
                self.metrics.count_retry(exc.reason)
                log.warning("retrying on another pair after: %s", exc)

        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.settings.max_retries + 1),
            retry=retry_if_exception(retry_on_other_pair),
            wait=wait_none(),
            before_sleep=count_retry,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    req.attempts += 1
                    try:
                        return await self._attempt(req)
                    except LegFailure as f:
                        req.exclude.add(f.backend)
                        req.failures.append(f)
                        raise
        except ClientGone:
            self._finish(req, Outcome.CLIENT_CANCELLED)
            return Response(status_code=_CLIENT_CLOSED)
        except BackendClientError as e:
            self._finish(req, Outcome.CLIENT_ERROR)
            return Response(e.body, e.status, media_type=e.content_type)
        except NoBackendError as e:
            if req.failures:
                return self._fail(req, f"no other healthy pair to retry on ({e})")
            self._finish(req, Outcome.NO_BACKEND)
            return error_response(503, f"{e}; check GET /health", "server_error", "no_backend")
        except LegFailure:
            if self._routable(req):
                return self._fail(req, f"gave up after max_retries={self.settings.max_retries}")
            return self._fail(req, "no other healthy pair to retry on")
        raise AssertionError("unreachable: tenacity either returns or reraises")

    def _fail(self, req: _Request, why: str) -> Response:
        tried = (
            "; ".join(f"attempt {i + 1}: {f}" for i, f in enumerate(req.failures))
            or "no attempt made"
        )
        self._finish(req, Outcome.BACKEND_ERROR)
        return error_response(
            502, f"request failed ({tried}); {why}", "server_error", "backend_error"
        )

    async def _attempt(self, req: _Request) -> Response:
        if req.direct:
            return await self._attempt_direct(req)
        if self.settings.mode == "pull":
            return await self._attempt_pull(req)
        p, d = self.pool.choose_pair(req.model, req.exclude)
        assert p.identity is not None  # choose_pair only returns prefill backends that are up
        tid = uuid.uuid4().hex
        headers = _leg_headers(req, tid)
        # With data parallelism behind P's API server: pin P's leg to one engine core, the
        # one whose control port D registers with.
        p_ident = p.pick_rank()
        p_headers = (
            headers
            if p_ident.dp_rank is None
            else {**headers, DP_RANK_HEADER: str(p_ident.dp_rank)}
        )
        p_content = self._seal(prefill_body(req.body, req.path, tid, d.remote_key), PREFILL)
        d_body = decode_body(req.body, p_ident, tid)
        if self.settings.vllm_push_compat:
            d_body["kv_transfer_params"]["remote_request_id"] = vllm_request_id(req.path, tid)
        d_content = self._seal(d_body, DECODE)
        p_task = asyncio.create_task(self._prefill_leg(p, req.path, p_content, p_headers))
        link_timed = self._link_timer(req, p, d, p_task)
        d_task = asyncio.create_task(self._decode_leg(d, req.path, d_content, headers, req.stream))
        try:
            while not d_task.done():
                waiting: set[asyncio.Future[Any]] = {d_task, req.disconnect}
                if not p_task.done():
                    waiting.add(p_task)
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if req.disconnect.done():
                    raise ClientGone()
                if p_task.done() and not d_task.done() and p_task.exception() is not None:
                    # D has not produced a byte: drop it (closing its connection makes vLLM
                    # abort it, and the connector cancels the transfer) and let the caller
                    # retry elsewhere.
                    raise p_task.exception()  # type: ignore[misc]
            started = d_task.result()
        except BaseException:
            await self._cancel_legs(p_task, d_task)
            raise
        now = time.perf_counter()
        self.metrics.observe_ttft(req.path, now - req.start)
        link_timed(now)
        self._detach_prefill(p_task)
        return await self._answer(req, started, tid, p_task)

    def _link_timer(
        self, req: _Request, p: Backend, d: Backend, p_task: asyncio.Task[None]
    ) -> Callable[[float], None]:
        """What to call at D's first token (``now``) so a policy that learns links gets this
        pair's time: from P's answer (its prefill done) to D's first token, the KV over the
        link and D's first step, without P's own queue (the same for every D). Only streamed
        requests are timed; D's first token before P's answer reached us: the KV crossed
        at once."""
        tokens = req.prompt.tokens if req.stream and self.pool.learns_links and req.prompt else None
        if not tokens:
            return lambda now: None
        answered: list[float] = []
        p_task.add_done_callback(
            lambda t: (
                None
                if t.cancelled() or t.exception() is not None
                else answered.append(time.perf_counter())
            )
        )

        def timed(now: float) -> None:
            link_s = now - answered[0] if answered else 0.0
            self.pool.observe_pair(p, d, max(0.0, link_s), tokens)

        return timed

    async def _attempt_direct(self, req: _Request) -> Response:
        """A short prompt: D alone, without kv_transfer_params, computes it as a single
        engine would (no P leg, no transfer)."""
        d = self.pool.choose_decode(req.model, req.exclude)
        tid = uuid.uuid4().hex
        assert req.prompt is not None and req.prompt.tokens is not None
        log.debug(
            "request %s: prompt of %s%d tokens is below direct_below_tokens = %d: sent "
            "to decode %s alone",
            tid,
            "" if req.prompt.exact else "~",
            req.prompt.tokens,
            self.settings.direct_below_tokens,
            d.url,
        )
        d_task = asyncio.create_task(
            self._decode_leg(
                d, req.path, dumps(direct_body(req.body)), _leg_headers(req, tid), req.stream
            )
        )
        started = await self._decode_started(req, d_task)
        return await self._answer(req, started, tid, None)

    async def _decode_started(
        self, req: _Request, d_task: asyncio.Task[DecodeStart]
    ) -> DecodeStart:
        """D's first byte (TTFT observed), or ClientGone when the client left first (D's leg
        cancelled, as on any error)."""
        try:
            await asyncio.wait({d_task, req.disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if req.disconnect.done() and not d_task.done():
                raise ClientGone()
            started = d_task.result()
        except BaseException:
            await self._cancel_legs(d_task)
            raise
        self.metrics.observe_ttft(req.path, time.perf_counter() - req.start)
        return started

    async def _answer(
        self, req: _Request, started: DecodeStart, tid: str, p_task: asyncio.Task[Any] | None
    ) -> Response:
        """The client's response from D's started leg: D's JSON, or its stream relayed
        (``p_task``, P's leg if one is still running, is cancelled if the client leaves)."""
        outcome = Outcome.OK if req.attempts == 1 else Outcome.RETRIED_OK
        resp_headers = {"X-Request-Id": tid}
        if not req.stream:
            content = strip_null_kv_params(started.first)
            status = started.response.status_code
            media = started.response.headers.get("content-type", "application/json")
            await started.aclose()
            self._finish(req, outcome)
            return Response(content, status, headers=resp_headers, media_type=media)
        req.disconnect.cancel()  # from here the streaming response watches the client
        media = started.response.headers.get("content-type", "text/event-stream")
        resp_headers["Cache-Control"] = "no-cache"
        return _ClosingStreamingResponse(
            self._relay(req, started, p_task, outcome),
            started.response.status_code,
            headers=resp_headers,
            media_type=media,
        )

    async def _attempt_pull(self, req: _Request) -> Response:
        """Pull mode: P computes the KV (one token), then D gets P's kv_transfer_params and
        READs it; the legs run one after the other, as vLLM's NixlConnector needs."""
        p, d = self.pool.choose_pair(req.model, req.exclude)
        tid = uuid.uuid4().hex
        headers = _leg_headers(req, tid)
        signing = self.settings.params_key is not None
        p_content = self._seal(pull_prefill_body(req.body, req.path, tid, signing), PREFILL)
        p_task = asyncio.create_task(self._pull_prefill_leg(p, req.path, p_content, headers))
        try:
            await asyncio.wait({p_task, req.disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if req.disconnect.done() and not p_task.done():
                raise ClientGone()
            params = p_task.result()
            if signing and params.get("transfer_mode", "push") != "push":
                # Signed, D's leg carries only the fields a kvpush D verifies: a pull
                # connector's answer would lose what makes D refuse it as unusable.
                raise LegFailure(
                    p,
                    "status",
                    (
                        f"prefill answered transfer_mode {str(params['transfer_mode'])[:20]!r} "
                        "(a pull connector such as vLLM's NixlConnector) while the router signs "
                        "legs for kvpush engines: run kvpush's connector on both engines, or "
                        "the router without a params key for vLLM's connectors"
                    ),
                )
            d_content = self._seal(
                pull_decode_body(req.body, params, tid if signing else None), DECODE
            )
            d_task = asyncio.create_task(
                self._decode_leg(d, req.path, d_content, headers, req.stream)
            )
        except BaseException:
            await self._cancel_legs(p_task)
            raise
        started = await self._decode_started(req, d_task)
        return await self._answer(req, started, tid, p_task)

    async def _pull_prefill_leg(
        self, p: Backend, path: str, content: bytes, headers: dict[str, str]
    ) -> dict[str, Any]:
        return prefill_kv_params(p, await self._post_prefill(p, path, content, headers))

    async def _cancel_legs(self, *tasks: asyncio.Task[Any]) -> None:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, DecodeStart):  # D finished just as we gave up on it
                await r.aclose()

    def _detach_prefill(self, p_task: asyncio.Task[None]) -> None:
        if p_task.done():
            self._log_late_prefill(p_task)
            return
        self._background.add(p_task)
        p_task.add_done_callback(self._background.discard)
        p_task.add_done_callback(self._log_late_prefill)

    @staticmethod
    def _log_late_prefill(t: asyncio.Task[None]) -> None:
        # D already answered, so a P failure now cannot affect this request; it still
        # says something about P's health.
        if not t.cancelled() and (exc := t.exception()) is not None:
            log.warning("prefill leg failed after decode answered: %s", exc)

    # -- legs ---------------------------------------------------------------------------------

    async def _prefill_leg(
        self, p: Backend, path: str, content: bytes, headers: dict[str, str]
    ) -> None:
        self.health.note_prefill_response(p, await self._post_prefill(p, path, content, headers))

    async def _post_prefill(
        self, p: Backend, path: str, content: bytes, headers: dict[str, str]
    ) -> bytes:
        """POST the prefill leg to ``p``; its body, or a LegFailure (P marked down on connect)."""
        self.pool.leg_started(p)
        try:
            r = await self.client.post(
                p.url + path, content=content, headers=headers, timeout=self._prefill_timeout
            )
        except httpx.HTTPError as e:
            raise self._leg_error(p, e) from None
        except _CLIENT_FAULT as e:
            raise self._leg_error(p, e) from None
        finally:
            self.pool.leg_ended(p)
        check_status(p, r.status_code, r.content, r.headers.get("content-type", ""))
        return r.content

    def _leg_error(self, b: Backend, e: BaseException) -> LegFailure:
        f = failure_from_exception(b, e)
        if f.kind == "connect":
            self.pool.mark_down(b, f"leg failed to connect: {f.detail}")
        return f

    async def _decode_leg(
        self, d: Backend, path: str, content: bytes, headers: dict[str, str], stream: bool
    ) -> DecodeStart:
        self.pool.leg_started(d)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.pool.leg_ended(d)

        try:
            opening = self._open_decode(d, path, content, headers, stream, release)
            limit = self.settings.first_byte_timeout_s
            if limit is None:
                return await opening
            try:
                return await asyncio.wait_for(opening, limit)
            except asyncio.TimeoutError:
                raise LegFailure(d, "timeout", f"no first byte within {limit} s") from None
        except httpx.HTTPError as e:
            release()
            raise self._leg_error(d, e) from None
        except (LegFailure, BackendClientError):
            release()
            raise
        except _CLIENT_FAULT as e:
            release()
            raise self._leg_error(d, e) from None
        except BaseException:
            release()
            raise

    async def _open_decode(
        self,
        d: Backend,
        path: str,
        content: bytes,
        headers: dict[str, str],
        stream: bool,
        release: Callable[[], None],
    ) -> DecodeStart:
        req = self.client.build_request(
            "POST", d.url + path, content=content, headers=headers, timeout=self._decode_timeout
        )
        resp = await self.client.send(req, stream=True)
        try:
            if not 200 <= resp.status_code < 300:
                check_status(
                    d, resp.status_code, await resp.aread(), resp.headers.get("content-type", "")
                )
            if not stream:
                body = await resp.aread()
                why = unfinished_answer(body)
                if why is not None:
                    raise LegFailure(d, "unfinished", why)
                return DecodeStart(d, resp, body, None, release)
            chunks = resp.aiter_raw()
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                raise LegFailure(d, "disconnect", "stream ended before any byte") from None
            failed = first_chunk_failure(d, first)
            if failed is not None:
                raise failed
            return await _first_choice(DecodeStart(d, resp, first, chunks, release))
        except BaseException:
            await _close_quietly(resp)
            raise

    # -- streaming -----------------------------------------------------------------------------

    async def _relay(
        self,
        req: _Request,
        d: DecodeStart,
        p_task: asyncio.Task[Any] | None,
        outcome: Outcome,
    ) -> AsyncIterator[bytes]:
        """D's SSE bytes to the client as they arrive; never retried once begun."""
        try:
            yield d.first
            assert d.rest is not None
            try:
                async for chunk in d.rest:
                    done_at = d.watch.feed(chunk)
                    if done_at >= 0 and d.watch.unfinished() is not None:
                        yield chunk[:done_at]
                        break
                    yield chunk
                why = d.watch.unfinished()
                if why is not None:
                    outcome = Outcome.BACKEND_ERROR
                    yield self._unfinished_stream(d, why)
            except _CLIENT_FAULT as e:  # httpx's errors and the client's own faults
                outcome = Outcome.BACKEND_ERROR
                log.warning("decode backend %s failed mid-stream: %s", d.backend.url, e)
                yield sse_error_event(
                    f"decode backend {d.backend.url} failed mid-stream "
                    f"({type(e).__name__}: {e}); the response is incomplete"
                )
        except (asyncio.CancelledError, GeneratorExit):
            outcome = Outcome.CLIENT_CANCELLED
            if p_task is not None:
                p_task.cancel()
            raise
        finally:
            await d.aclose()
            self._finish(req, outcome)

    @staticmethod
    def _unfinished_stream(d: DecodeStart, why: str) -> bytes:
        """The error event that ends a stream D ended unfinished (in place of its [DONE]):
        its first bytes were relayed already, so it cannot go to another pair."""
        log.warning(
            "decode backend %s ended a stream unfinished after it began (%s): the client "
            "gets an error event; drain an engine before stopping it (kvpush drain)",
            d.backend.url,
            why,
        )
        return sse_error_event(f"decode backend {d.backend.url}: {why}; the response is incomplete")


def _leg_headers(req: _Request, tid: str) -> dict[str, str]:
    """Headers of both legs: the pairing id, JSON, the client's credentials."""
    headers = {
        "X-Request-Id": tid,
        "Content-Type": "application/json",
        # Compressing on a datacenter hop costs more latency than it saves.
        "Accept-Encoding": "identity",
    }
    if req.authorization is not None:
        headers["Authorization"] = req.authorization
    headers.update(req.trace)
    return headers
