"""Optional per-process event trace for latency profiles (``KVPUSH_TRACE_DIR``).

One JSON line per event with the wall clock, so traces of P, D and a client line up.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

TRACE_ENV = "KVPUSH_TRACE_DIR"


class Tracer:
    """Appends events to ``$KVPUSH_TRACE_DIR/<name>-<pid>.jsonl``, and hands them to
    ``spans`` (OpenTelemetry, ``kvpush_prod.otel``) when given; a no-op without either."""

    def __init__(self, name: str, spans: Any = None) -> None:
        folder = os.environ.get(TRACE_ENV)
        self._lock = threading.Lock()
        self._file = None
        self.spans = spans  # has on_event(event, tid, fields)
        if folder:
            os.makedirs(folder, exist_ok=True)
            self._file = open(os.path.join(folder, f"{name}-{os.getpid()}.jsonl"), "a")  # noqa: SIM115

    @property
    def on(self) -> bool:
        return self._file is not None or self.spans is not None

    def __call__(self, event: str, tid: str = "", **fields: Any) -> None:
        if self.spans is not None:
            try:
                with self._lock:
                    self.spans.on_event(event, tid, fields)
            except Exception as exc:  # noqa: BLE001 - tracing never breaks a transfer
                self.spans = None
                logging.getLogger(__name__).error(
                    "kvpush: transfer spans turned off after an error: %r", exc
                )
        if self._file is None:
            return
        line = json.dumps({"t": time.time(), "e": event, "tid": tid, **fields}, default=str)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()
