"""Transfer spans (OpenTelemetry): one per transfer and side, under the request's trace
context, with an event per phase and the outcome; bounded; never in the transfer's way."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

from kvpush_prod.otel import TransferSpans, transfer_spans  # noqa: E402
from kvpush_prod.trace import Tracer  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
HEADERS = {"traceparent": f"00-{TRACE_ID}-{PARENT}-01"}


def setup(side: str, max_open: int = 100) -> tuple[Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spans = TransferSpans(provider.get_tracer("test"), side, max_open=max_open)
    return Tracer("", spans=spans), exporter


def test_a_receive_span_joins_the_request_trace_with_its_phases() -> None:
    trace, exported = setup("consumer")
    assert trace.on
    trace("recv_spec", "t1", blocks=8, trace_headers=HEADERS)
    trace("msg_out", "t1", kind="Register")
    trace("done_in", "t1")
    trace("report", "t1", ok=True, outcome="pushed")
    (span,) = exported.get_finished_spans()
    assert span.name == "kvpush.receive"
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT
    assert [e.name for e in span.events] == ["register", "done"]
    assert span.attributes["kvpush.outcome"] == "pushed"
    assert span.attributes["kvpush.transfer_id"] == "t1"
    assert span.attributes["kvpush.blocks"] == 8


def test_a_send_span_counts_its_chunks_and_marks_failures() -> None:
    trace, exported = setup("producer")
    trace("blocks_ready", "t2", blocks=3)  # no trace context: a root span
    trace("msg_in", "t2", kind="Register")
    trace("post", "t2", op="WRITE", chunk=1, nbytes=4096, last=False, descriptors=64, build_us=38.5)
    trace("post", "t2", op="WRITE", chunk=2, nbytes=2048, last=True)
    trace("release", "t2", outcome="failed")
    (span,) = exported.get_finished_spans()
    assert span.name == "kvpush.send" and span.parent is None
    assert [e.name for e in span.events] == ["register", "push", "push"]
    assert span.events[1].attributes["kvpush.bytes"] == 4096
    assert span.events[1].attributes["kvpush.descriptors"] == 64
    assert span.events[1].attributes["kvpush.build_us"] == 38.5
    assert "kvpush.descriptors" not in span.events[2].attributes  # not told: left out
    assert span.status.status_code.name == "ERROR"


def test_a_sub_transfers_events_join_the_span_of_its_transfer() -> None:
    """P TP 1 -> D TP 2: P's rank feeds two D ranks, the second link carries ``t3#d1``."""
    trace, exported = setup("producer")
    trace("blocks_ready", "t3", blocks=4, trace_headers=HEADERS)
    trace("msg_in", "t3", kind="Register")
    trace("msg_in", "t3#d1", kind="Register")
    trace("post", "t3#d1", op="WRITE", chunk=7, nbytes=1024, last=True, descriptors=2)
    trace("chunk_end", "t3#d1", chunk=7, state="DONE")
    trace("release", "t3#d1", outcome="pushed")  # the sub-transfer's end: not the span's
    assert exported.get_finished_spans() == ()
    trace("post", "t3", op="WRITE", chunk=8, nbytes=1024, last=True)
    trace("release", "t3", outcome="pushed")
    (span,) = exported.get_finished_spans()
    assert format(span.context.trace_id, "032x") == TRACE_ID
    names = [(e.name, e.attributes.get("kvpush.sub")) for e in span.events]
    assert names == [
        ("register", None),
        ("register", "d1"),
        ("push", "d1"),
        ("landed", "d1"),
        ("sub_end", "d1"),
        ("push", None),
    ]
    assert span.events[4].attributes["kvpush.outcome"] == "pushed"
    assert span.attributes["kvpush.outcome"] == "pushed"


def test_a_layer_wise_send_span_begins_at_its_first_layers_and_marks_the_forward_end() -> None:
    trace, exported = setup("producer")
    trace("layers_ready", "t3", ready=1, parts=2, blocks=3, trace_headers=HEADERS)
    trace("post", "t3", op="WRITE", chunk=1, nbytes=2048, last=False, layer=0)
    trace("chunk_end", "t3", chunk=1, state="DONE")
    trace("forward_end", "t3", trace_headers=HEADERS)
    trace("blocks_ready", "t3", blocks=3, trace_headers=HEADERS)  # the same span goes on
    trace("chunk_end", "t3", chunk=2, state="ChunkError(timeout)")  # failed: not landed
    trace("release", "t3", outcome="pushed")
    (span,) = exported.get_finished_spans()
    assert format(span.context.trace_id, "032x") == TRACE_ID
    names = [e.name for e in span.events]
    assert names == ["layers_ready", "push", "landed", "forward_end"]
    assert span.events[1].attributes["kvpush.layer"] == 0
    assert span.events[2].attributes["kvpush.chunk"] == 1
    stamps = [e.timestamp for e in span.events]
    assert stamps == sorted(stamps)  # one clock: the order the trace saw them in


def test_a_forward_end_told_before_the_first_layers_opens_the_span_once() -> None:
    trace, exported = setup("producer")
    trace("forward_end", "t4", trace_headers=HEADERS)  # the engine thread was first
    trace("layers_ready", "t4", ready=2, parts=2, blocks=1, trace_headers=HEADERS)
    trace("release", "t4", outcome="pushed")
    (span,) = exported.get_finished_spans()
    assert [e.name for e in span.events] == ["forward_end", "layers_ready"]
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT


def test_open_spans_are_bounded_and_ended_at_shutdown() -> None:
    trace, exported = setup("consumer", max_open=2)
    for tid in ("a", "b", "c"):
        trace("recv_spec", tid, blocks=1)
    assert [s.attributes["kvpush.outcome"] for s in exported.get_finished_spans()] == ["abandoned"]
    trace.spans.close()
    assert len(exported.get_finished_spans()) == 3


def test_a_broken_span_backend_turns_itself_off_and_the_caller_goes_on() -> None:
    class Broken:
        def on_event(self, *a: Any) -> None:
            raise RuntimeError("exporter gone")

    trace = Tracer("", spans=Broken())
    trace("recv_spec", "t", blocks=1)  # does not raise
    assert trace.spans is None and not trace.on


def test_no_endpoint_no_spans() -> None:
    assert transfer_spans("consumer", None) is None
    assert transfer_spans("consumer", "") is None
