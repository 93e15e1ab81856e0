"""Shared test settings: hypothesis profiles (CI runs with more examples)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, settings

if TYPE_CHECKING:
    from kvpush_prod.lab.cluster import SharedReference

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


@pytest.fixture(scope="session")
def shared_reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedReference]:
    """The session's single engine of the default tiny model, started at first use, that
    clusters of that model compare with (``ClusterSpec.reference_url``; ``serves`` says
    which may)."""
    from kvpush_prod.lab.cluster import SharedReference

    root = os.environ.get("KVPUSH_TEST_WORKDIR")
    workdir = Path(root) / "reference" if root else tmp_path_factory.mktemp("reference")
    workdir.mkdir(parents=True, exist_ok=True)
    ref = SharedReference(workdir)
    ref.start()
    try:
        yield ref
    finally:
        ref.stop()
