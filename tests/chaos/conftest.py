"""Chaos CI: real clusters shared between scenarios, one cluster alive at a time.

Scenarios that can share a cluster run on it in a row; a cluster left broken by a failed
scenario is replaced before the next one.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpush_prod.chaos.harness import Needs, cluster_spec, fault_switch, placed
from kvpush_prod.lab.cluster import Cluster, SharedReference


def _healthy(cluster: Cluster) -> bool:
    if not all(p.alive() for p in cluster.procs.values()):
        return False
    try:
        return httpx.get(cluster.urls["router"] + "/health", timeout=3).status_code == 200
    except httpx.HTTPError:
        return False


class ClusterPool:
    """Hands out the cluster of a group, starting it (and stopping the previous one) on demand."""

    def __init__(self, root: Path, reference: SharedReference) -> None:
        self.root = root
        self.reference = reference
        self.current: tuple[str, Cluster] | None = None
        self.starts: list[tuple[str, float]] = []
        self.network = contextlib.ExitStack()  # the current cluster's namespaces, if any

    def get(self, group: str, needs: Needs) -> Cluster:
        if self.current is not None:
            name, cluster = self.current
            if name == group and _healthy(cluster):
                fault_switch(cluster.spec.workdir).unlink(missing_ok=True)
                return cluster
            self.close()
        workdir = self.root / f"{group}-{len(self.starts)}"
        workdir.mkdir(parents=True, exist_ok=True)
        # One reference engine for the session, not one per cluster; engines in network
        # namespaces (needs.netns) have theirs removed after the cluster stops.
        spec = placed(needs, self.reference.attach(cluster_spec(needs, workdir)), self.network)
        cluster = Cluster(spec)
        t0 = time.monotonic()
        self.current = (group, cluster)
        cluster.start()
        self.starts.append((group, time.monotonic() - t0))
        return cluster

    def close(self) -> None:
        if self.current is not None:
            self.current[1].stop()
            self.current = None
        self.network.close()


@pytest.fixture(scope="session")
def cluster_pool(
    tmp_path_factory: pytest.TempPathFactory, shared_reference: SharedReference
) -> Iterator[ClusterPool]:
    root_env = os.environ.get("KVPUSH_TEST_WORKDIR")
    root = Path(root_env) / "chaos" if root_env else tmp_path_factory.mktemp("chaos")
    root.mkdir(parents=True, exist_ok=True)
    pool = ClusterPool(root, shared_reference)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def reports_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = os.environ.get("KVPUSH_CHAOS_REPORTS")
    path = Path(d) if d else tmp_path_factory.mktemp("chaos-reports")
    path.mkdir(parents=True, exist_ok=True)
    return path
