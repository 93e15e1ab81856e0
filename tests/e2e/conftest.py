"""Real engines for end-to-end tests: one P/D pair (+ router + plain reference engine),
started once per session and shared by every test that asks for it.

Other block sizes run on the clusters of their own modules (32: test_hetero_tp.py, 64:
test_model_shapes.py and test_pressure.py); a second shared pair at block 32 cost CI ~3
minutes for the same suite again and was dropped.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpush_prod.lab.cluster import Cluster, ClusterSpec, SharedReference

pytestmark = pytest.mark.e2e

# The engines' default block size (128 on the CPU backend).
BLOCK_SIZES: list[int | None] = [None]


def _workdir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    root = os.environ.get("KVPUSH_TEST_WORKDIR")
    if root:
        path = Path(root) / name
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp(name)


@pytest.fixture(scope="session")
def e2e_workdir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A fresh folder per cluster (under ``KVPUSH_TEST_WORKDIR`` when set, to keep logs)."""
    return lambda name: _workdir(tmp_path_factory, name)


@pytest.fixture(scope="session", params=BLOCK_SIZES, ids=lambda b: f"B{b or 'default'}")
def cluster(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    shared_reference: SharedReference,
) -> Iterator[Cluster]:
    """P (1 GiB KV) and D (2 GiB KV: the two engines differ in KV-cache size), router, reference."""
    block_size = request.param
    spec = ClusterSpec(
        workdir=_workdir(tmp_path_factory, f"e2e-b{block_size or 'default'}"),
        block_size=block_size,
        prefill_kv_gib=1,
        decode_kv_gib=2,
    )
    with Cluster(shared_reference.attach(spec)) as c:
        SHARED.append(c)
        yield c
        SHARED.remove(c)


@pytest.fixture(scope="session")
def secure_recompute(
    tmp_path_factory: pytest.TempPathFactory, shared_reference: SharedReference
) -> Iterator[Cluster]:
    """The secure setup (keys, allow-list, params key, signing router) with KV refused on
    arrival recomputed (vLLM's kv_load_failure_policy), as a P/D deployment runs, a key
    for an intruder and at most 64 control peers: test_hostile.py's attacks, then
    test_hostile_replay.py's replays (on engines the attacks have just been through) on
    one start. The second module stops it; it is in ``SHARED``, so a later user gets it
    started again."""
    spec = ClusterSpec(
        workdir=_workdir(tmp_path_factory, "e2e-secure-recompute"),
        extra_keys=("intruder",),
        kv_load_failure_policy="recompute",
        extra={"control": {"max_peers": SECURE_MAX_PEERS}},
    )
    with Cluster(shared_reference.attach(spec)) as c:
        SHARED.append(c)
        yield c
        SHARED.remove(c)


# The secure_recompute engines' control.max_peers: the socket bound test_hostile.py's flood
# must hit.
SECURE_MAX_PEERS = 64


# The session's shared clusters, so a module that needs the memory for a big cluster of its
# own (tests/e2e/test_topology.py: five engines) can stop them first; a test that asks for
# ``cluster`` afterwards gets it started again (``_shared_cluster_running``).
SHARED: list[Cluster] = []


def release_shared_clusters() -> None:
    for c in SHARED:
        c.stop()


@pytest.fixture(autouse=True)
def _shared_cluster_running(request: pytest.FixtureRequest) -> None:
    if "cluster" in request.fixturenames:
        c = request.getfixturevalue("cluster")
        if isinstance(c, Cluster) and not all(p.alive() for p in c.procs.values()):
            c.start()


async def answers_match_reference(
    cluster: Cluster,
    lengths: list[int],
    seeds: Iterator[int],
    max_tokens: int,
) -> Callable[..., float]:
    """Send a prompt of each length to the reference engine and through the router
    (streaming every other one): the answers must be equal, and every non-streamed one
    pushed. Returns ``delta(metric, **labels)``: how much a metric of D moved meanwhile."""
    import httpx

    from kvpush_prod.lab.client import completion_body, metric_sum, request, scrape
    from kvpush_prod.lab.tinymodel import prompt_of_length

    before = scrape(cluster.urls["decode"])
    async with httpx.AsyncClient(timeout=120) as client:
        for i, n in enumerate(lengths):
            prompt = prompt_of_length(n, seed=next(seeds))
            stream = i % 2 == 1
            ref = await request(
                client, cluster.urls["reference"], completion_body(prompt, max_tokens, False)
            )
            got = await request(
                client, cluster.urls["router"], completion_body(prompt, max_tokens, stream)
            )
            assert ref.ok and got.ok, (n, ref.error, got.error)
            assert got.text == ref.text, (n, stream)
            if not stream:
                summary = (got.kv_transfer_params or {})["kvpush"]
                assert summary["outcome"] == "pushed", (n, summary)
    after = scrape(cluster.urls["decode"])

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    return delta
