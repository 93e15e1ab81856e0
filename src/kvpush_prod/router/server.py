"""How the router is served: uvicorn plus the connection limits it lacks, and a drain on SIGTERM.

``serve(settings)`` runs it; tests use ``uvicorn_config`` and ``RouterServer`` directly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType
from typing import Any, ClassVar

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvpush_prod.router.config import RouterSettings
from kvpush_prod.router.legs import error_body
from kvpush_prod.router.limits import Admission
from kvpush_prod.router.metrics import RejectReason, RouterMetrics

log = logging.getLogger(__name__)

# Keep-alive longer than the client pools' so the router is never the side that closes a
# connection a client is about to reuse (an idle connection costs one socket).
KEEP_ALIVE_S = 75
# After the drain (or its deadline), what is left (a /metrics scrape, a stream past the
# deadline) gets this long before uvicorn cancels it.
SHUTDOWN_GRACE_S = 2
# A connection answered before its request was all read (413, 431, an early 503) keeps
# reading and dropping the rest this long after the answer, so the client can finish
# sending and read the answer: closing with unread input makes the kernel reset the
# connection, and the client sees a reset instead of the 413 (and the OpenAI SDK retries).
LINGER_S = 5.0
_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large"}


class _HeadersTooLarge(Exception):
    """Raised inside the parser's callback to stop parsing; answered with 431."""


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the connection limits uvicorn has no knob for.

    - headers: a request's line and headers must arrive within ``header_timeout_s`` of its
      first byte (or of the connection opening) and fit ``max_header_bytes``: 408 / 431,
      then closed (an idle new connection is just closed);
    - a request answered before its body was all read (413, 431, 503) ends the connection
      with a lingering close: the answer, then the rest of the request is read and dropped
      for up to LINGER_S (never parsed), then closed;
    - writes: a client whose socket accepts nothing for ``client_write_timeout_s`` (buffers
      full: it stopped reading) is dropped at once, which cancels its legs.

    Configure a subclass with :func:`limited_protocol`.
    """

    settings: ClassVar[RouterSettings]
    metrics: ClassVar[RouterMetrics]

    _header_timer: asyncio.TimerHandle | None = None
    _stall_timer: asyncio.TimerHandle | None = None
    _linger_timer: asyncio.TimerHandle | None = None
    _header_bytes: int = 0
    _partial: bool = False  # some of a request's headers arrived, not all
    _too_large: bool = False
    _lingering: bool = False

    # -- headers ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._partial = True
        self._arm_header_timer()

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._partial = False
        self._cancel_header_timer()
        super().on_headers_complete()
        if self.cycle is not None and not isinstance(self.cycle.transport, _CycleTransport):
            # The cycle closes the connection after a "Connection: close" answer: let that
            # close linger when the request's body was not all read.
            self.cycle.transport = _CycleTransport(self)

    def _count_header_bytes(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > self.settings.max_header_bytes:
            self._too_large = True
            raise _HeadersTooLarge()

    def send_400_response(self, msg: str) -> None:
        # uvicorn answers any parser error with 400; an error we raised gets its own answer.
        if self.transport.is_closing():
            return
        if self._too_large:
            self.metrics.count_rejected(RejectReason.HEADER_TOO_LARGE)
            limit = self.settings.max_header_bytes
            self._answer(
                431,
                f"request line and headers exceed {limit} bytes (max_header_bytes); "
                "send fewer or shorter headers",
            )
            self._linger()
            return
        super().send_400_response(msg)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(
                self.settings.header_timeout_s, self._header_timed_out
            )

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # An earlier request's answer is still going out (a pipelined request behind
            # it): it is not this request's to cut short; look again later.
            self._arm_header_timer()
            return
        self.metrics.count_rejected(RejectReason.HEADER_TIMEOUT)
        if not self._partial:
            self.transport.close()  # nothing sent: nobody to answer
            return
        t = self.settings.header_timeout_s
        self._answer(
            408,
            f"request headers not received within {t} s (header_timeout_s); send the whole "
            "request line and headers at once",
        )
        self.transport.close()  # a slow client: no lingering for it

    def _answer(self, status: int, message: str) -> None:
        body = error_body(message, status, "invalid_request_error", _code(status))
        head = (
            f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)

    # -- bodies left unread --------------------------------------------------------------------

    def _body_unread(self) -> bool:
        # With nothing pipelined, self.cycle is the request being answered (a pipelined
        # one's body was complete before the next request could begin).
        return not self.pipeline and self.cycle is not None and self.cycle.more_body

    def close_after_answer(self) -> None:
        """Close after an answer: at once, or lingering if the body was not all read."""
        if self._body_unread() and not self.transport.is_closing():
            self._linger()
        elif not self._lingering:
            self.transport.close()

    def on_response_complete(self) -> None:
        if self._lingering or self._body_unread():
            # Answered early (keep-alive or not): the rest of the body is dropped, and the
            # connection ends, instead of being read for as long as the client sends it.
            self.server_state.total_requests += 1
            if not self._lingering and not self.transport.is_closing():
                self._linger()
            return
        super().on_response_complete()

    def _linger(self) -> None:
        self._lingering = True
        self._cancel_header_timer()
        self.flow.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the answer, then FIN: the client reads it all
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # the rest of a request already answered: dropped, never parsed
        super().data_received(data)

    # -- write stalls -----------------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(
                self.settings.client_write_timeout_s, self._write_stalled
            )

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _write_stalled(self) -> None:
        self._stall_timer = None
        self.metrics.count_rejected(RejectReason.WRITE_STALL)
        log.warning(
            "client %s read nothing for %s s (client_write_timeout_s): dropping it",
            self.client,
            self.settings.client_write_timeout_s,
        )
        # abort, not close: close would wait for the client to read what is buffered.
        # The ASGI side sees a disconnect and closes this request's legs.
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        for timer in (self._stall_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._stall_timer = self._linger_timer = None
        super().connection_lost(exc)


class _CycleTransport(asyncio.Transport):
    """The transport as one request's cycle sees it: the same, except that closing after
    an answer goes through the protocol (which may linger)."""

    def __init__(self, protocol: LimitedHttpProtocol) -> None:
        super().__init__()
        self._protocol = protocol
        self._transport = protocol.transport

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._transport.write(data)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self._protocol.close_after_answer()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)


def _code(status: int) -> str:
    return "header_too_large" if status == 431 else "header_timeout"


def limited_protocol(settings: RouterSettings, metrics: RouterMetrics) -> type[LimitedHttpProtocol]:
    """A :class:`LimitedHttpProtocol` that applies ``settings`` and counts in ``metrics``."""
    return type(
        "LimitedHttpProtocol",
        (LimitedHttpProtocol,),
        {"settings": settings, "metrics": metrics},
    )


def uvicorn_config(app: FastAPI, settings: RouterSettings, **overrides: Any) -> uvicorn.Config:
    """uvicorn's config for the router's ``app``: its protocol, keep-alive and shutdown."""
    kwargs: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "access_log": settings.access_log,
        "http": limited_protocol(settings, app.state.metrics),
        "timeout_keep_alive": KEEP_ALIVE_S,
        "timeout_graceful_shutdown": SHUTDOWN_GRACE_S,
        "lifespan": "on",
    }
    kwargs.update(overrides)
    return uvicorn.Config(app, **kwargs)


class RouterServer(uvicorn.Server):
    """uvicorn's server, with a drain: the first SIGTERM (or SIGINT) stops admitting
    requests (503, /health says draining) while the listener stays open, and exits when
    the open ones are done or after ``drain_timeout_s``; a second signal closes the open
    ones and exits at once (a third skips even closing the backend clients).
    """

    def __init__(self, config: uvicorn.Config, admission: Admission, drain_timeout_s: float):
        super().__init__(config)
        self.admission = admission
        self.drain_timeout_s = drain_timeout_s
        self.drain_deadline: float | None = None
        self._announced = False
        self._forced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: only flags here, the main loop (on_tick) acts on them.
        if self.drain_deadline is None and not self.should_exit:
            self.begin_drain()
        elif not self.should_exit:
            self.should_exit = True  # connections dropped, then uvicorn's quick shutdown
            self._forced = True
        else:
            self.force_exit = True  # a third: not even the shutdown (clients closed)

    def begin_drain(self) -> None:
        """Stop admitting requests; exit once the open ones end or the deadline passes."""
        self.admission.draining = True
        self.drain_deadline = time.monotonic() + self.drain_timeout_s

    async def on_tick(self, counter: int) -> bool:
        if self._forced:
            log.warning("second signal: closing %d open requests now", self.admission.inflight)
            self.drop_connections()
        if await super().on_tick(counter):
            return True
        if self.drain_deadline is None:
            return False
        open_now = self.admission.inflight
        if not self._announced:
            self._announced = True
            log.warning(
                "draining: refusing new requests, waiting up to %s s for %d open",
                self.drain_timeout_s,
                open_now,
            )
        if open_now == 0:
            log.warning("drained: no request open, exiting")
            return True
        if time.monotonic() >= self.drain_deadline:
            log.warning("drain deadline passed with %d requests open: closing them", open_now)
            self.drop_connections()
            return True
        return False

    def drop_connections(self) -> None:
        """Abort every client connection: each open request then ends as if its client
        had left (its legs closed, so the engines abort them), not cancelled mid-await."""
        for conn in list(self.server_state.connections):
            conn.transport.abort()


def serve(settings: RouterSettings) -> None:
    """Run the router until it has drained after SIGTERM (or a second signal)."""
    from kvpush_prod.router.app import build_app

    app = build_app(settings)
    server = RouterServer(
        uvicorn_config(app, settings), app.state.admission, settings.drain_timeout_s
    )
    server.run()
