"""Two prefill and two decode engines behind the router (policy engine_load): answers equal
a single engine's and every engine takes traffic; one D drained under load and restarted
loses no request. (kill -9 of one D and then one P under steady load is the chaos scenario
``nxm_kill``, tests/chaos/test_nxm_kill.py.)

In the full run (KVPUSH_E2E_EXTRA=1): CI's nemesis (tests/chaos/test_nemesis.py) drains,
stops, kills and restarts engines of a 2 P x 2 D cluster under load and checks every answer,
and its rolling upgrade (tests/e2e/test_rolling_upgrade.py) checks that every P-D pair of
one pushes; this cluster would cost CI ~2 min more."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import httpx
import pytest

from kvpush_prod.lab.client import Result, completion_body, metric_sum, request, scrape
from kvpush_prod.lab.cluster import Cluster, ClusterSpec
from kvpush_prod.lab.tinymodel import prompt_of_length

from .conftest import release_shared_clusters

pytestmark = [pytest.mark.e2e, pytest.mark.full]

MAX_TOKENS = 16
_seeds = itertools.count(20_000)


TOKEN = "a" * 64


@pytest.fixture(scope="module")
def two_by_two(e2e_workdir, shared_reference) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    workdir = e2e_workdir("e2e-2x2")
    token = workdir / "admin.token"
    token.write_text(TOKEN)
    release_shared_clusters()  # five engines here: the session's shared pair must go
    spec = ClusterSpec(
        workdir=workdir,
        prefills=2,
        decodes=2,
        prefill_kv_gib=1,
        decode_kv_gib=1,
        kv_load_failure_policy="recompute",
        router_args=["--policy", "engine_load", "--admin-token-file", str(token)],
    )
    with Cluster(shared_reference.attach(spec)) as c:
        yield c


def served(cluster: Cluster, name: str) -> float:
    return metric_sum(scrape(cluster.urls[name]), "vllm:request_success_total")


async def reference(client: httpx.AsyncClient, cluster: Cluster, prompt: str) -> Result:
    ref = await request(
        client, cluster.urls["reference"], completion_body(prompt, MAX_TOKENS, False)
    )
    assert ref.ok, ref.error
    return ref


async def test_every_engine_takes_traffic_and_every_answer_is_right(two_by_two: Cluster) -> None:
    before = {n: served(two_by_two, n) for n in two_by_two.engine_names}
    prompts = [prompt_of_length(n, seed=next(_seeds)) for n in (40, 300, 700, 5, 1200, 90) * 2]
    async with httpx.AsyncClient(timeout=120) as client:
        refs = [await reference(client, two_by_two, p) for p in prompts]
        got = await asyncio.gather(
            *(
                request(
                    client, two_by_two.urls["router"], completion_body(p, MAX_TOKENS, i % 2 == 0)
                )
                for i, p in enumerate(prompts)
            )
        )
    for i, (g, r) in enumerate(zip(got, refs, strict=True)):
        assert g.ok, (i, g.error)
        assert g.text == r.text, i
    grew = {n: served(two_by_two, n) - before[n] for n in two_by_two.engine_names}
    assert all(v > 0 for v in grew.values()), grew
    assert two_by_two.wait_idle(timeout=60) == dict.fromkeys(two_by_two.engine_names, 0)


async def test_draining_one_of_two_decode_engines_under_load_fails_nothing(
    two_by_two: Cluster,
) -> None:
    """A rolling restart of one D by drain: the other D takes the traffic, 0 requests fail."""
    from kvpush_prod.router.drain import drain

    victim = "decode-1"
    prompts = [prompt_of_length(250 + 41 * i, seed=next(_seeds)) for i in range(16)]
    async with httpx.AsyncClient(timeout=180) as client:

        async def one(i: int) -> Result:
            await asyncio.sleep(0.4 * i)  # spread over the drain and the restart
            return await request(
                client,
                two_by_two.urls["router"],
                completion_body(prompts[i], MAX_TOKENS, i % 2 == 0),
            )

        load = asyncio.gather(*(one(i) for i in range(len(prompts))))
        await asyncio.sleep(1.0)
        drained = await asyncio.to_thread(
            drain,
            two_by_two.urls[victim],
            [two_by_two.urls["router"]],
            TOKEN,
            120.0,
            lambda _: None,
            0.5,
        )
        assert drained
        await asyncio.to_thread(two_by_two.procs[victim].stop)
        await asyncio.to_thread(two_by_two.start_engine, victim, True, 600.0)
        got = await load
        refs = [await reference(client, two_by_two, p) for p in prompts]
    assert [g.error for g in got if not g.ok] == []
    assert [i for i, (g, r) in enumerate(zip(got, refs, strict=True)) if g.text != r.text] == []
