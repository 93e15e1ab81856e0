"""Shared test settings: hypothesis profiles (CI runs with more examples)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("KVPUSH_HYPOTHESIS_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("dev", max_examples=50, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# The full real-engine run: tests marked ``full`` (long chaos scenarios, five-engine
# clusters) run only with KVPUSH_E2E_EXTRA=1, to keep CI's run short; README's "Tests"
# section lists them.
FULL_ENV = "KVPUSH_E2E_EXTRA"


def pytest_collection_modifyitems(config: object, items: list[pytest.Item]) -> None:
    if os.environ.get(FULL_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"full run only (long real-engine case): set {FULL_ENV}=1")
    for item in items:
        if item.get_closest_marker("full") is not None:
            item.add_marker(skip)
