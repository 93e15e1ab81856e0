"""No busy-spinning: an idle engine with the connector loaded spends < 5% of a core."""

from __future__ import annotations

import time

import pytest

from kvpush_prod.lab.cluster import Cluster

pytestmark = pytest.mark.e2e


def _cpu_seconds(cluster: Cluster, name: str) -> float:
    total = 0.0
    for p in cluster.procs[name].tree():
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except Exception:  # noqa: BLE001 - a helper process may exit meanwhile
            pass
    return total


def test_idle_engines_with_the_connector_do_not_spin(cluster: Cluster) -> None:
    assert cluster.wait_idle(60) == {"prefill": 0.0, "decode": 0.0}
    time.sleep(2)
    before = {n: _cpu_seconds(cluster, n) for n in ("prefill", "decode")}
    window = 8.0
    time.sleep(window)
    for name, start in before.items():
        share = (_cpu_seconds(cluster, name) - start) / window
        # NIXL's stock progress thread alone would burn ~100% of a core here.
        assert share < 0.05, f"{name} used {100 * share:.1f}% of a core while idle"
