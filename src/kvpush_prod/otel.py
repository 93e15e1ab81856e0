"""Optional OpenTelemetry spans of each transfer, joined to vLLM's own request spans.

When vLLM's tracing is on (``--otlp-traces-endpoint``) and ``opentelemetry-sdk`` is
installed (``pip install kvpush-prod[otel]``; vLLM's own tracing needs it too), each engine
exports one span per transfer and side, to the same endpoint:

- D: ``kvpush.receive``, from the moment the worker learns of the transfer (blocks
  reserved and admitted) to its end, with events ``register`` (REGISTER sent to P),
  ``pull`` (a fallback READ posted), ``done`` (P's DONE arrived) and the outcome;
- P: ``kvpush.send``, from the prompt's KV being ready (with a layer-wise push: its first
  layers) to the blocks' release, with events ``register`` (D's REGISTER arrived), ``push``
  (a WRITE chunk posted: bytes, chunk id, last, NIXL descriptors, microseconds to build the
  request, and with a layer-wise push the ``layer``), ``landed`` (P saw that chunk's WRITE
  complete: its bytes are in D's memory), ``pull_done`` and the outcome; a layer-wise push
  adds ``layers_ready`` (the first layers computed) and ``forward_end`` (P's forward that
  computed the prompt ended: pushes before it overlapped the forward). A sub-transfer's
  events (``<id>#d<r>``, a P rank feeding several D ranks) go to its transfer's span with
  ``sub``, and its end is a ``sub_end`` event there.

Each span's parent is the request's W3C trace context (``traceparent`` header the client or
router sent, which vLLM keeps as the request's ``trace_headers``), so the spans sit under
vLLM's ``llm_request`` span of the same request. Spans are fed from the worker's event
trace (``kvpush_prod.trace.Tracer``); without an endpoint nothing is imported or recorded.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from kvpush_prod.vocabulary import base_of

logger = logging.getLogger(__name__)

MAX_OPEN = 65_536  # spans of transfers not ended yet; the oldest is ended "abandoned"
SPAN_NAME = {"consumer": "kvpush.receive", "producer": "kvpush.send"}
# The worker's trace events that mark a phase (event -> span event name).
PHASES = {"post": "", "done_in": "done", "msg_in": "", "msg_out": ""}
BEGIN = ("recv_spec", "blocks_ready", "layers_ready", "forward_end")
END = {"report": "outcome", "release": "outcome", "forward_failed": ""}


class TransferSpans:
    """One open span per transfer id; fed ``(event, transfer id, fields)`` by the Tracer."""

    def __init__(self, tracer: Any, side: str, max_open: int = MAX_OPEN) -> None:
        self._tracer = tracer
        self._side = side
        self._name = SPAN_NAME.get(side, f"kvpush.{side}")
        self._max_open = max_open
        self._open: OrderedDict[str, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    def on_event(self, event: str, tid: str, fields: Mapping[str, Any]) -> None:
        """The Tracer's hook: begin, annotate or end the span of ``tid``. A sub-transfer's
        events (``tid#d<r>``: a P rank feeding several D ranks) annotate the span of the
        transfer it belongs to, named by ``sub``; its end is an event there, not the end."""
        if not tid:
            return
        base = base_of(tid)
        if base != tid:
            self._on_sub(event, base, tid[len(base) + 1 :], fields)
            return
        if event in BEGIN:
            # A layer-wise push's first layers go out before its blocks_ready: whichever of
            # its events comes first opens the span (on the engine thread or the pump's).
            self.begin(tid, fields.get("trace_headers"), blocks=fields.get("blocks"))
            if event == "layers_ready":
                self.event(tid, event, ready=fields.get("ready"), parts=fields.get("parts"))
            elif event == "forward_end":
                self.event(tid, event)
        elif event in END:
            self.end(tid, _outcome(event, fields))
        else:
            named = _phase(event, fields)
            if named is not None:
                self.event(tid, named[0], **named[1])

    def _on_sub(self, event: str, base: str, sub: str, fields: Mapping[str, Any]) -> None:
        if event in BEGIN:
            return  # the transfer's own span opens with the transfer's events
        if event in END:
            self.event(base, "sub_end", sub=sub, outcome=_outcome(event, fields))
            return
        named = _phase(event, fields)
        if named is not None:
            self.event(base, named[0], sub=sub, **named[1])

    def begin(self, tid: str, headers: Mapping[str, str] | None = None, **attrs: Any) -> None:
        if tid in self._open:
            return
        from opentelemetry.trace.propagation.tracecontext import (
            TraceContextTextMapPropagator,
        )

        context = TraceContextTextMapPropagator().extract(dict(headers)) if headers else None
        span = self._tracer.start_span(
            self._name,
            context=context,
            attributes=_attrs(transfer_id=tid, side=self._side, **attrs),
        )
        self._open[tid] = span
        while len(self._open) > self._max_open:
            _, oldest = self._open.popitem(last=False)
            oldest.set_attribute("kvpush.outcome", "abandoned")
            oldest.end()

    def event(self, tid: str, name: str, **attrs: Any) -> None:
        span = self._open.get(tid)
        if span is not None:
            span.add_event(name, attributes=_attrs(**attrs), timestamp=time.time_ns())

    def end(self, tid: str, outcome: str) -> None:
        span = self._open.pop(tid, None)
        if span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("kvpush.outcome", outcome)
        if outcome in ("failed", "expired", "recompute"):
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end()

    def close(self) -> None:
        """At shutdown: end what is still open (``abandoned``)."""
        while self._open:
            _, span = self._open.popitem(last=False)
            span.set_attribute("kvpush.outcome", "abandoned")
            span.end()


def _outcome(event: str, fields: Mapping[str, Any]) -> str:
    """The outcome an END event reports (``failed`` when it names none)."""
    return str(fields.get(END[event], "failed") if END[event] else "failed")


def _phase(event: str, fields: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The span event (name, attributes) a phase event of the worker's trace makes, if any."""
    if event == "post":
        op = str(fields.get("op", ""))
        return "push" if op == "WRITE" else "pull", {
            "bytes": fields.get("nbytes"),
            "chunk": fields.get("chunk"),
            "last": fields.get("last"),
            "descriptors": fields.get("descriptors"),
            "build_us": fields.get("build_us"),
            "layer": fields.get("layer"),
        }
    if event == "chunk_end" and fields.get("state") == "DONE":
        return "landed", {"chunk": fields.get("chunk")}
    if event in ("msg_in", "msg_out"):
        kind = str(fields.get("kind", ""))
        if kind in ("Register", "PullDone", "Failed", "Cancel", "Fallback"):
            return _snake(kind), {}
        return None
    if event == "done_in":
        return "done", {}
    return None


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))


def _attrs(**kw: Any) -> dict[str, Any]:
    return {f"kvpush.{k}": v for k, v in kw.items() if isinstance(v, (str, bool, int, float))}


def transfer_spans(side: str, endpoint: str | None) -> TransferSpans | None:
    """Spans exported to ``endpoint`` (vLLM's ``otlp_traces_endpoint``); None when it is
    unset, or when OpenTelemetry is not installed (logged once: tracing was asked for)."""
    if not endpoint:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        logger.warning(
            "kvpush: vLLM tracing is on (%s) but OpenTelemetry is not installed "
            "(%s): no kvpush spans; pip install 'kvpush-prod[otel]'",
            endpoint,
            exc,
        )
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": f"kvpush-{side}"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    logger.info("kvpush: transfer spans go to %s", endpoint)
    return TransferSpans(provider.get_tracer("kvpush_prod"), side)
