"""The nxm_kill scenario in a short form, on its own cluster (2 prefill x 2 decode engines,
router policy engine_load), closed at the end: the verdict must be PASS. ~7 min on a
2-core box: part of the full run (KVPUSH_E2E_EXTRA=1), not of CI."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvpush_prod.chaos.cli import scenario
from kvpush_prod.chaos.harness import Options, print_report, run_on_cluster, write_report

pytestmark = [pytest.mark.chaos, pytest.mark.full, pytest.mark.timeout(900)]


def test_killing_one_of_two_engines_per_role_costs_at_most_its_requests(
    cluster_pool: Any, reports_dir: Path
) -> None:
    module = scenario("nxm_kill")
    opts = Options(
        requests=32,
        concurrency=4,
        timeout=180.0,
        quiesce_timeout=90.0,
        progress_every=8,
        policy="recompute",
        max_prompt=1200,
        extra={"outage_rate": 0.5},
    )
    needs = module.needs(opts)
    try:
        cluster = cluster_pool.get("nxm", needs)
        report = asyncio.run(run_on_cluster(module, cluster, opts, log=print, needs=needs))
    finally:
        cluster_pool.close()  # five engines: free their memory for what runs next
    print_report(report)
    write_report(report, reports_dir / "nxm_kill.json")
    assert report.passed, report.verdict_line()
