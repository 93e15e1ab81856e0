"""A rolling upgrade from the previous release to this checkout, under load: two prefill and
two decode engines of the previous release (installed from its tag, ``lab.release``), each
drained through the router's admin API, stopped, started on this build and undrained, one
at a time, while requests keep flowing through the router. Every answer equals the single
engine's and is pushed, pairs of mixed versions keep pushing (this build's DONE counter by
protocol version proves it: a DONE in protocol 2 to or from this build crossed versions),
and nothing is held at the end.

CI runs both pure orders, every P first (new P's with old D's) and every D first (old P's
with new D's), each on a cluster of its own, traffic checked after each step; the full run
(KVPUSH_E2E_EXTRA=1) adds a mixed order (P0, D1, D0, P1) where both kinds of mixed pairs
run at once. While an engine restarts the load is paced (RESTART_GAP_S), as an operator's
traffic would not saturate a 2-core box.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from kvpush_prod.lab import release
from kvpush_prod.lab.client import completion_body, metric_sum, request, scrape
from kvpush_prod.lab.cluster import Cluster, ClusterSpec, SharedReference
from kvpush_prod.lab.tinymodel import prompt_of_length
from kvpush_prod.router.drain import drain

from .conftest import release_shared_clusters

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
TOKEN = "u" * 64
MAX_TOKENS = 8
# Prompt tokens, cycled by the load. The router pairs P and D by round robin, one step of
# each per request, so with 2 P and 2 D a request stream meets only two of the four pairs
# (P0-D0 and P1-D1, or P0-D1 and P1-D0, whichever the last drain left): after D1's upgrade
# the second pairing has no pair of mixed versions at all. A prompt under the router's
# direct_below_tokens goes to D alone and moves only D's rotation, so once a cycle the
# pairing turns and every pair comes up.
SHORT = 4
DIRECT_BELOW = 16
LENGTHS = (40, 300, SHORT, 700, 150, 1000, 520)
CONCURRENCY = 2
# While an engine restarts, each load worker waits this long between its requests: traffic
# still flows through the other engines, but a closed loop on a 2-core box starved the new
# engine's start (147 s instead of ~40 s).
RESTART_GAP_S = 1.0
# Requests sent after a step, at most, before its mixed pairs must have pushed (a pair comes
# up within two cycles of LENGTHS).
MAX_AFTER_STEP = 48
ORDERS = {
    "mixed": ("prefill", "decode-1", "decode", "prefill-1"),
    "p_first": ("prefill", "prefill-1", "decode", "decode-1"),
    "d_first": ("decode", "decode-1", "prefill", "prefill-1"),
}


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The previous release installed apart; never skipped: without it the test fails
    saying how to fetch it."""
    try:
        commit = release.find_previous(REPO)
    except release.ReleaseMissing as exc:
        pytest.fail(str(exc))
    site = release.install(REPO, commit, tmp_path_factory.mktemp("previous-release"))
    where = release.imported_from(site)
    assert where.startswith(str(site)), f"an engine of {site} would import {where}"
    return str(site)


@dataclass
class Load:
    """Requests through the router, two at a time, each answer compared with the single
    engine's; ``phase`` names the records."""

    cluster: Cluster
    reference: dict[int, str]
    phase: str = "start"
    records: list[tuple[str, int, str]] = field(default_factory=list)  # phase, length, problem
    stop: bool = False
    _n: Iterator[int] = field(default_factory=itertools.count)

    def done(self, phase: str) -> int:
        return sum(1 for p, _, _ in self.records if p == phase)

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
            await asyncio.gather(*(self._worker(client) for _ in range(CONCURRENCY)))

    async def _worker(self, client: httpx.AsyncClient) -> None:
        while not self.stop:
            i = next(self._n)
            n, stream, phase = LENGTHS[i % len(LENGTHS)], i % 3 == 2, self.phase
            body = completion_body(prompt_of_length(n, seed=n), MAX_TOKENS, stream)
            got = await request(client, self.cluster.urls["router"], body, timeout=300)
            problem = ""
            if not got.ok:
                problem = f"failed: {got.status} {got.error}"
            elif got.text != self.reference[n]:
                problem = f"answer differs: {got.text!r} != {self.reference[n]!r}"
            elif not stream and n != SHORT:  # SHORT goes to D alone: no transfer
                outcome = (got.kv_transfer_params or {}).get("kvpush", {}).get("outcome")
                problem = "" if outcome == "pushed" else f"not pushed: {outcome}"
            self.records.append((phase, n, problem))
            if self.phase.startswith("restart"):
                await asyncio.sleep(RESTART_GAP_S)


def dones(cluster: Cluster, names: list[str], version: str) -> float:
    """DONEs in protocol ``version`` this build's engines among ``names`` posted or took."""
    return sum(
        metric_sum(scrape(cluster.urls[n]), "kvpush_protocol_dones_total", version=version)
        for n in names
    )


def rose(cluster: Cluster, names: list[str], version: str, before: dict[str, float]) -> bool:
    return dones(cluster, names, version) > before[version]


async def until(load: Load, phase: str, ok: Callable[[], bool]) -> bool:
    """Wait, under load, until ``ok()`` holds (checked after each answer of ``phase``), at
    most MAX_AFTER_STEP answers."""
    seen = -1
    while load.done(phase) < MAX_AFTER_STEP:
        if load.done(phase) != seen:
            seen = load.done(phase)
            if seen >= 2 and await asyncio.to_thread(ok):
                return True
        await asyncio.sleep(0.2)
    return await asyncio.to_thread(ok)


async def upgrade_one(cluster: Cluster, load: Load, name: str, token: str, log: list[str]) -> None:
    """Drain ``name`` through the router, stop it, start it on this build, undrain it."""
    router = cluster.urls["router"]
    load.phase = f"drain {name}"
    drained = await asyncio.to_thread(drain, cluster.urls[name], [router], token, 180.0, log.append)
    assert drained, f"{name} still busy after 180 s of draining"
    load.phase = f"restart {name}"
    await asyncio.to_thread(cluster.procs[name].stop)
    cluster.upgrade(name, None)
    await asyncio.to_thread(cluster.start_engine, name)
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        auth = {"Authorization": f"Bearer {token}"}
        r = await client.post(
            router + "/admin/undrain", json={"backend": cluster.urls[name]}, headers=auth
        )
        assert r.status_code == 200, r.text
        for _ in range(240):
            r = await client.get(router + "/admin/backends", headers=auth)
            ours = [b for side in r.json().values() for b in side if b["url"] == cluster.urls[name]]
            if ours and ours[0]["up"] and not ours[0]["draining"]:
                break
            await asyncio.sleep(0.25)
        else:
            pytest.fail(f"the router did not take {name} back: {ours}")
    load.phase = f"after {name}"


async def rolling_upgrade(cluster: Cluster, order: tuple[str, ...], log: list[str]) -> Load:
    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        reference = {}
        for n in sorted(set(LENGTHS)):
            body = completion_body(prompt_of_length(n, seed=n), MAX_TOKENS, False)
            ref = await request(client, cluster.urls["reference"], body)
            assert ref.ok, ref.error
            reference[n] = ref.text
    load = Load(cluster, reference)
    runner = asyncio.create_task(load.run())
    new: set[str] = set()
    try:
        assert await until(load, "start", lambda: True)
        for name in cluster.engine_names:  # the previous release predates these series
            got = await asyncio.to_thread(scrape, cluster.urls[name])
            ours = [k for k, _ in got if k.startswith("kvpush_protocol_")]
            assert not ours, f"{name} should run the previous release, yet exports {ours}"
        for name in order:
            await upgrade_one(cluster, load, name, TOKEN, log)
            new.add(name)
            phase = f"after {name}"
            mine = sorted(new)
            mixed = len(new) < len(cluster.engine_names)  # some engine still runs the old one
            before = {v: await asyncio.to_thread(dones, cluster, mine, v) for v in ("2", "3")}
            # Mixed: a DONE in protocol 2 posted or taken by this build crossed versions.
            version = "2" if mixed else "3"
            pushed = await until(
                load, phase, functools.partial(rose, cluster, mine, version, before)
            )
            log.append(f"{phase}: pushes in protocol {version} by {mine}: {pushed}")
            assert pushed, f"{phase}: no push in protocol {version} in {MAX_AFTER_STEP} requests"
            if not mixed:
                assert dones(cluster, mine, "2") == before["2"], "all new, yet protocol 2 spoken"
    finally:
        load.stop = True
        await runner
    return load


def run_case(order_name: str, site: str, workdir: Path, shared: SharedReference) -> None:
    release_shared_clusters()  # five engines here: the session's shared pair must go
    (workdir / "admin.token").write_text(TOKEN)
    engines = ("prefill", "prefill-1", "decode", "decode-1")
    spec = ClusterSpec(
        workdir=workdir,
        prefills=2,
        decodes=2,
        prefill_kv_gib=1,
        decode_kv_gib=1,
        # Longer leases: the first push of each new pair waits for P's first NIXL connection
        # to D (seconds on a loaded 2-core box; test_compat.py).
        extra={"leases": {"permit_ttl_s": 30.0, "peer_timeout_s": 20.0}},
        router_args=["--admin-token-file", str(workdir / "admin.token")],
        releases=dict.fromkeys(engines, site),
        direct_below_tokens=DIRECT_BELOW,
    )
    t0 = time.monotonic()
    log: list[str] = []
    with Cluster(shared.attach(spec)) as cluster:
        load = asyncio.run(rolling_upgrade(cluster, ORDERS[order_name], log))
        held = cluster.wait_idle(timeout=90)
        fallbacks = {
            n: metric_sum(scrape(cluster.urls[n]), "kvpush_protocol_fallbacks_total")
            for n in engines
        }
        direct = metric_sum(scrape(cluster.urls["router"]), "kvpush_router_direct_total")
    bad = [r for r in load.records if r[2]]
    phases = {p: load.done(p) for p in dict.fromkeys(p for p, _, _ in load.records)}
    print(
        f"rolling upgrade {order_name}: {len(load.records)} requests {phases}, "
        f"{time.monotonic() - t0:.0f} s; fallbacks {fallbacks}; " + "; ".join(log[-8:])
    )
    assert not bad, bad[:10]
    shorts = sum(1 for _, n, _ in load.records if n == SHORT)
    assert direct >= shorts > 0, f"{shorts} short prompts, {direct} sent to D alone"
    assert all(v == 0 for v in held.values()), f"held at the end: {held}"
    # An engine that met a peer of the previous release counted (and logged) it: the first
    # one upgraded did (its pushes in protocol 2 were asserted above), P or D alike.
    first = ORDERS[order_name][0]
    assert fallbacks[first] >= 1, f"{first} upgraded first, yet counted none: {fallbacks}"
    during = sum(n for p, n in phases.items() if p.startswith(("drain", "restart")))
    assert during, f"no request ran while an engine drained or restarted: {phases}"


@pytest.mark.parametrize("order", ["p_first", "d_first"])
def test_rolling_upgrade_from_the_previous_release_under_load(
    order: str,
    previous_release: str,
    e2e_workdir,
    shared_reference: SharedReference,  # type: ignore[no-untyped-def]
) -> None:
    run_case(order, previous_release, e2e_workdir(f"e2e-upgrade-{order}"), shared_reference)


@pytest.mark.full
def test_rolling_upgrade_in_mixed_order(
    previous_release: str,
    e2e_workdir,
    shared_reference: SharedReference,  # type: ignore[no-untyped-def]
) -> None:
    run_case("mixed", previous_release, e2e_workdir("e2e-upgrade-mixed"), shared_reference)
