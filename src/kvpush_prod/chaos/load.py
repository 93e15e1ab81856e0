"""The chaos load generator: drives requests through the router at a fixed concurrency.

Every request ends within a bound (the client timeout: past it the request counts as hung);
what each one got is recorded exactly (status, error text, tokens, how D served it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from kvpush_prod.chaos.workload import RequestSpec

# A request answered with one of these (or not answered at all) says the router has no
# pair to offer right now: the generator slows to one probe at a time until one succeeds.
_OUTAGE_STATUSES = frozenset({0, 502, 503})


@dataclass
class Record:
    """What one request got."""

    idx: int
    phase: str
    stream: bool
    chat: bool
    prompt_len: int
    max_tokens: int
    started: float  # seconds since the load began
    ended: float = 0.0
    status: int = 0
    text: str = ""
    error: str = ""  # HTTP error body, SSE error event, or client-side exception
    # "" | http | sse | transport | truncated | aborted | timeout | cancelled
    error_kind: str = ""
    first_byte: float | None = None  # seconds after start
    done_marker: bool = False  # streaming: saw [DONE]
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    kvpush: dict[str, Any] | None = None  # D's summary (non-streaming answers)
    request_id: str = ""  # the router's X-Request-Id (= transfer id)
    cancel_after: float | None = None

    @property
    def latency(self) -> float:
        return self.ended - self.started

    @property
    def ok(self) -> bool:
        if self.status != 200 or self.error_kind:
            return False
        return self.done_marker if self.stream else True

    def to_json(self, with_text: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_text:
            d.pop("text")
        return d


class _Abandon(Exception):
    """The client closes the connection on purpose (a planned cancel)."""


def _error_message(raw: bytes | str) -> str:
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    return text.strip()[:600]


@dataclass(frozen=True)
class _Exchange:
    """One request on its way: where it goes, what it sends, how long the client waits
    (httpx's own timeouts, above the overall bound the caller enforces) and its record."""

    client: httpx.AsyncClient
    url: str
    spec: RequestSpec
    record: Record
    http_timeout: httpx.Timeout
    t0: float  # when the load began (time.monotonic)

    def since_start(self) -> float:
        """Seconds since the request started."""
        return time.monotonic() - self.t0 - self.record.started


async def send_one(
    client: httpx.AsyncClient,
    base_url: str,
    spec: RequestSpec,
    record: Record,
    timeout: float,
    t0: float,
) -> None:
    """Send ``spec``; fill ``record``. Never raises (except cancellation of the caller)."""
    url = base_url.rstrip("/") + ("/v1/chat/completions" if spec.chat else "/v1/completions")
    x = _Exchange(client, url, spec, record, httpx.Timeout(timeout + 30, connect=10.0), t0)
    try:
        await (_send_streamed(x) if spec.stream else _send_whole(x))
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        record.error_kind = "transport"
        record.error = f"{type(exc).__name__}: {exc}"[:600]
    if not record.error_kind and record.finish_reason == "abort":
        # vLLM ends a request it aborted (e.g. on shutdown) with HTTP 200 and this reason:
        # the client gets a success with a cut answer and no error.
        record.error_kind = "aborted"
        record.error = (
            f"HTTP 200 with finish_reason 'abort' after {len(record.text.split())} "
            "tokens: the engine aborted the request, nothing says so but the reason"
        )


async def _send_whole(x: _Exchange) -> None:
    spec, record = x.spec, x.record
    r = await x.client.post(x.url, json=spec.body(), timeout=x.http_timeout)
    record.status = r.status_code
    record.request_id = r.headers.get("x-request-id", "")
    record.first_byte = x.since_start()
    if r.status_code != 200:
        record.error_kind, record.error = "http", _error_message(r.content)
        return
    try:
        data = r.json()
    except ValueError:
        record.error_kind = "truncated"
        record.error = "200 with a body that is not JSON: " + _error_message(r.content)
        return
    choice = (data.get("choices") or [{}])[0]
    record.text = (
        (choice.get("message") or {}).get("content") or ""
        if spec.chat
        else choice.get("text") or ""
    )
    record.finish_reason = choice.get("finish_reason")
    record.prompt_tokens = (data.get("usage") or {}).get("prompt_tokens")
    record.kvpush = (data.get("kv_transfer_params") or {}).get("kvpush")


async def _send_streamed(x: _Exchange) -> None:
    spec, record = x.spec, x.record
    pieces = 0
    async with x.client.stream("POST", x.url, json=spec.body(), timeout=x.http_timeout) as r:
        record.status = r.status_code
        record.request_id = r.headers.get("x-request-id", "")
        if r.status_code != 200:
            record.error_kind, record.error = "http", _error_message(await r.aread())
            return
        async for line in r.aiter_lines():
            if record.first_byte is None:
                record.first_byte = x.since_start()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                record.done_marker = True
                break
            obj = json.loads(payload)
            if "error" in obj:
                record.error_kind = "sse"
                record.error = _error_message(json.dumps(obj["error"]))
                return
            got = _take_event(obj, spec, record)
            pieces += got
            if got and spec.cancel_after_tokens is not None and pieces >= spec.cancel_after_tokens:
                raise _Abandon(f"cancelled by the client after {pieces} tokens")
        if not record.done_marker:
            record.error_kind = "truncated"
            record.error = "the stream ended without [DONE] and without an error event"


def _take_event(obj: dict[str, Any], spec: RequestSpec, record: Record) -> int:
    """Add one stream event's text to ``record``; 1 when it carried a piece of text."""
    if obj.get("usage"):
        record.prompt_tokens = obj["usage"].get("prompt_tokens")
    choices = obj.get("choices") or []
    if not choices:
        return 0
    c = choices[0]
    piece = (c.get("delta") or {}).get("content") if spec.chat else c.get("text")
    record.text += piece or ""
    record.finish_reason = c.get("finish_reason") or record.finish_reason
    return 1 if piece else 0


@dataclass
class Progress:
    """Counts the generator keeps while it runs."""

    sent: int = 0
    done: int = 0
    ok: int = 0
    failed: int = 0
    hung: int = 0
    cancelled: int = 0
    by_phase_ok: dict[str, int] = field(default_factory=dict)


class LoadGenerator:
    """Sends requests from ``specs`` to ``url`` with at most ``concurrency`` in flight.

    Stops launching after ``limit`` requests (raise it while running to send more) or on
    ``stop()``. While the router answers 502/503 or cannot be reached, it sends one request
    at a time, one per ``probe_interval`` s, until one succeeds: an outage is observed
    without burning the whole load on it.
    """

    def __init__(
        self,
        url: str,
        specs: Iterator[RequestSpec],
        *,
        concurrency: int,
        limit: int,
        timeout: float = 120.0,
        probe_interval: float = 1.0,
        progress_every: int = 20,
        log: Callable[[str], None] = print,
        t0: float | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url
        self.specs = specs
        self.concurrency = concurrency
        self.limit = limit
        self.timeout = timeout
        self.probe_interval = probe_interval
        self.progress_every = max(1, progress_every)
        self.log = log
        self.phase = "load"
        self.hold_open = False  # at the limit, wait for extend() or stop() instead of ending
        self.paused = False  # launch nothing until resume()
        self.records: list[Record] = []
        self.progress = Progress()
        self.outstanding = 0
        self.outage = False
        self._outage_since = 0.0
        self._stop = asyncio.Event()
        self._changed = asyncio.Event()
        self._t0 = time.monotonic() if t0 is None else t0  # record times count from here
        self._tasks: set[asyncio.Task[None]] = set()
        self._transport = transport  # tests replace the network

    # -- control
    def now(self) -> float:
        return time.monotonic() - self._t0

    def stop(self) -> None:
        """Launch nothing more; requests in flight run to their end."""
        self._stop.set()
        self._changed.set()

    def pause(self) -> None:
        """Launch nothing more until ``resume()`` (requests in flight run to their end)."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self._changed.set()

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is in flight."""
        return await self._wait(lambda: self.outstanding == 0, timeout)

    def extend(self, n: int) -> None:
        """Allow ``n`` more requests."""
        self.limit += n
        self._changed.set()

    async def wait_done(self, count: int, timeout: float | None = None) -> bool:
        """Wait until ``count`` requests have ended."""
        return await self._wait(lambda: self.progress.done >= count, timeout)

    async def wait_ok_in_phase(self, phase: str, count: int, timeout: float | None = None) -> bool:
        return await self._wait(lambda: self.progress.by_phase_ok.get(phase, 0) >= count, timeout)

    async def _wait(self, cond: Callable[[], bool], timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not cond():
            self._changed.clear()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left if left else None)
        return True

    # -- the loop
    async def run(self) -> list[Record]:
        limits = httpx.Limits(
            max_connections=self.concurrency * 2 + 8,
            max_keepalive_connections=self.concurrency * 2 + 8,
        )
        async with httpx.AsyncClient(
            limits=limits, trust_env=False, transport=self._transport
        ) as client:
            last_probe = -1e9
            while not self._stop.is_set():
                if self.progress.sent >= self.limit:
                    self._changed.clear()
                    if self.outstanding == 0 and not self.hold_open:
                        break
                    await self._changed.wait()
                    continue
                cap = 1 if self.outage else self.concurrency
                if self.paused or self.outstanding >= cap:
                    self._changed.clear()
                    await self._changed.wait()
                    continue
                if self.outage:
                    wait = last_probe + self.probe_interval - time.monotonic()
                    if wait > 0:
                        self._changed.clear()
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(self._changed.wait(), wait)
                        continue
                    last_probe = time.monotonic()
                self._launch(client, next(self.specs))
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
        self.log(self._progress_line("end"))
        return self.records

    def _launch(self, client: httpx.AsyncClient, spec: RequestSpec) -> None:
        rec = Record(
            spec.idx,
            self.phase,
            spec.stream,
            spec.chat,
            spec.prompt_len,
            spec.max_tokens,
            self.now(),
            cancel_after=spec.cancel_after,
        )
        self.records.append(rec)
        self.progress.sent += 1
        self.outstanding += 1
        task = asyncio.create_task(self._one(client, spec, rec))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _one(self, client: httpx.AsyncClient, spec: RequestSpec, rec: Record) -> None:
        bound = self.timeout
        cancel = spec.cancel_after is not None and spec.cancel_after < bound
        try:
            await asyncio.wait_for(
                send_one(client, self.url, spec, rec, self.timeout, self._t0),
                spec.cancel_after if cancel else bound,
            )
        except _Abandon as exc:
            rec.error_kind, rec.error = "cancelled", str(exc)
        except asyncio.TimeoutError:
            if cancel:
                rec.error_kind, rec.error = (
                    "cancelled",
                    (f"cancelled by the client after {spec.cancel_after:.3f} s"),
                )
            else:
                rec.error_kind, rec.error = "timeout", f"no complete answer within {bound:.0f} s"
        except Exception as exc:  # noqa: BLE001 - a harness bug must not lose the record
            rec.error_kind, rec.error = "transport", f"harness: {type(exc).__name__}: {exc}"
        finally:
            rec.ended = self.now()
            self.outstanding -= 1
            self._account(rec)
            self._changed.set()

    def _account(self, rec: Record) -> None:
        p = self.progress
        p.done += 1
        if rec.ok:
            p.ok += 1
            p.by_phase_ok[rec.phase] = p.by_phase_ok.get(rec.phase, 0) + 1
            if rec.started >= self._outage_since:
                self.outage = False  # a request sent during the outage got through
        elif rec.error_kind == "timeout":
            p.hung += 1
        elif rec.error_kind == "cancelled":
            p.cancelled += 1
        else:
            p.failed += 1
            if (
                rec.status in _OUTAGE_STATUSES
                and rec.error_kind in ("http", "transport")
                and not self.outage
            ):
                self.outage, self._outage_since = True, rec.ended
        if p.done % self.progress_every == 0:
            self.log(self._progress_line(rec.phase))

    def _progress_line(self, phase: str) -> str:
        p = self.progress
        return (
            f"{p.done:4d}/{self.limit} done: {p.ok} ok, {p.failed} "
            f"failed, {p.hung} hung, {p.cancelled} cancelled; {self.outstanding} in flight"
            f"{' (outage: probing)' if self.outage else ''}  [{phase}]"
        )
