"""vLLM calls wait_for_save from a ``finally``: when the forward raised (SIGTERM mid-step makes
vLLM's worker raise SystemExit), the step's prompts are not computed and must not be pushed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from kvpush_prod.connector import PushConnector


class _Worker:
    def __init__(self) -> None:
        self.calls: list[bool] = []

    def after_forward(self, forward_failed: bool = False) -> None:
        self.calls.append(forward_failed)


@contextlib.contextmanager
def _step(connector: Any) -> Iterator[None]:
    # What vLLM's KVConnectorModelRunnerMixin._get_kv_connector_output does around a forward.
    try:
        yield
    finally:
        connector.wait_for_save()


def _connector() -> tuple[Any, _Worker]:
    connector: Any = object.__new__(PushConnector)
    worker = _Worker()
    connector._worker = worker
    return connector, worker


def test_a_completed_forward_hands_its_prompts_over() -> None:
    connector, worker = _connector()
    with _step(connector):
        pass
    assert worker.calls == [False]


@pytest.mark.parametrize("exc", [SystemExit, KeyboardInterrupt, RuntimeError])
def test_a_forward_that_raised_is_reported_as_failed(exc: type[BaseException]) -> None:
    connector, worker = _connector()
    with pytest.raises(exc), _step(connector):
        raise exc()
    assert worker.calls == [True]
