"""A minimal OTLP/gRPC trace collector for tests: keeps every span it is sent."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    parent_span_id: str
    attributes: dict[str, str]
    events: tuple[str, ...]
    # (name, time in ns since the epoch, attributes) of each event, in the span's order
    timed: tuple[tuple[str, int, dict[str, str]], ...] = ()


def _attributes(pairs: Iterable[Any]) -> dict[str, str]:
    return {a.key: str(getattr(a.value, a.value.WhichOneof("value") or "", "")) for a in pairs}


class _Service(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpSink) -> None:
        self.sink = sink

    def Export(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        for rs in request.resource_spans:
            service = next(
                (a.value.string_value for a in rs.resource.attributes if a.key == "service.name"),
                "",
            )
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs = _attributes(s.attributes)
                    self.sink.add(
                        Span(
                            service,
                            s.name,
                            s.trace_id.hex(),
                            s.parent_span_id.hex(),
                            attrs,
                            tuple(e.name for e in s.events),
                            tuple(
                                (e.name, e.time_unix_nano, _attributes(e.attributes))
                                for e in s.events
                            ),
                        )
                    )
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpSink:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spans: list[Span] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Service(self), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, span: Span) -> None:
        with self._lock:
            self.spans.append(span)

    def of_trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def stop(self) -> None:
        self.server.stop(grace=None)
