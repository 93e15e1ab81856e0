"""The drain scenario in a short form, on its own cluster (a router with the admin API and
a wait for returning engines): the verdict must be PASS. ~4 min on a 2-core box: part of
the full run (KVPUSH_E2E_EXTRA=1), not of CI (tests/e2e/test_topology.py drains one of two
decode engines under load in CI)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvpush_prod.chaos.cli import scenario
from kvpush_prod.chaos.harness import Options, print_report, run_on_cluster, write_report

pytestmark = [pytest.mark.chaos, pytest.mark.full, pytest.mark.timeout(900)]


def test_a_rolling_restart_by_drain_loses_no_request(cluster_pool: Any, reports_dir: Path) -> None:
    module = scenario("drain")
    opts = Options(
        requests=32,
        concurrency=6,
        timeout=180.0,
        quiesce_timeout=90.0,
        progress_every=8,
        policy="recompute",
    )
    needs = module.needs(opts)
    cluster = cluster_pool.get("drain", needs)
    report = asyncio.run(run_on_cluster(module, cluster, opts, log=print, needs=needs))
    print_report(report)
    write_report(report, reports_dir / "drain.json")
    assert report.passed, report.verdict_line()
