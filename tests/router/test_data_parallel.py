"""A prefill API server with data parallelism (vLLM ``--data-parallel-size N``): each engine
core has its own control port, so the router learns every DP rank's identity and pins each
P leg to one rank (vLLM's X-data-parallel-rank header), pointing D at that rank's port."""

from __future__ import annotations

from typing import Any

from tests.router.fakes import MODEL, wait_until

COMPLETION = {"model": MODEL, "prompt": "w10 w11 w12", "max_tokens": 4, "temperature": 0}


async def test_every_dp_rank_is_probed_and_each_leg_is_pinned_to_the_rank_d_is_told(
    fakes: Any, router: Any
) -> None:
    p = await fakes("prefill", engine_id="p", control_port=7000)
    p.dp_size = 3
    d = await fakes("decode")
    r = await router([p], [d])
    await wait_until(lambda: r.app.state.pool.prefill[0].up, what="p up with every rank")
    # Ranks 0, 1, 2 answered (rank 3 was refused as out of range): three engine cores.
    pinned = sorted(
        int(s.headers["x-data-parallel-rank"])
        for s in p.probes
        if "x-data-parallel-rank" in s.headers
    )
    assert pinned == [0, 1, 2]

    for _ in range(6):
        assert (await r.post("/v1/completions", COMPLETION)).status_code == 200
    ranks = []
    for p_seen, d_seen in zip(p.requests, d.requests, strict=True):
        rank = int(p_seen.headers["x-data-parallel-rank"])
        params = d_seen.body["kv_transfer_params"]
        # D registers with the engine core that computes the request's KV.
        assert (params["remote_engine_id"], params["remote_port"]) == (f"p_dp{rank}", 7000 + rank)
        ranks.append(rank)
    assert sorted(set(ranks)) == [0, 1, 2]  # the ranks share the load
    described = r.app.state.pool.prefill[0].describe()
    assert described["identity"]["dp_size"] == 3
    assert sorted(described["dp_ranks"]) == [0, 1, 2]


async def test_a_prefill_server_that_ignores_the_rank_header_is_not_used_and_says_why(
    fakes: Any, router: Any
) -> None:
    p = await fakes("prefill", engine_id="p")
    p.dp_size = 2
    p.dp_header_honoured = False
    d = await fakes("decode")
    r = await router([p], [d])
    await wait_until(lambda: len(p.probes) >= 2, what="p probed")

    resp = await r.post("/v1/completions", COMPLETION)

    assert resp.status_code == 503
    msg = resp.json()["error"]["message"]
    assert "ignores the X-data-parallel-rank header" in msg
    assert "--data-parallel-external-lb" in msg
    assert not p.requests


async def test_without_data_parallelism_no_rank_header_is_sent(fakes: Any, router: Any) -> None:
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d])
    assert (await r.post("/v1/completions", COMPLETION)).status_code == 200
    assert all("x-data-parallel-rank" not in s.headers for s in [*p.probes, *p.requests])
    assert "dp_rank" not in d.requests[0].body["kv_transfer_params"]


async def test_a_rank_that_knows_the_dp_size_must_agree_with_the_ranks_found(
    fakes: Any, router: Any
) -> None:
    p = await fakes("prefill", engine_id="p")
    p.dp_size, p.dp_size_known = 2, True
    d = await fakes("decode")
    r = await router([p], [d])
    await wait_until(lambda: r.app.state.pool.prefill[0].up, what="p up")
    assert r.app.state.pool.prefill[0].identity.dp_size == 2
    assert (await r.post("/v1/completions", COMPLETION)).status_code == 200
