"""End to end: the router's legs over TLS to real engines (vLLM's --ssl-keyfile/--ssl-certfile,
certificates from the cluster's own CA, the router verifying them with --backend-ca-file),
with keys and a params key: answers equal a single engine's, every transfer is pushed and no
signed leg is refused; the engines answer no plain HTTP; a router trusting another CA
routes nothing.

One P/D pair (and the session's shared reference engine when it serves this cluster).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator

import httpx
import pytest

from kvpush_prod.lab.client import completion_body, metric_sum, request, scrape
from kvpush_prod.lab.cluster import Cluster, ClusterSpec, SharedReference
from kvpush_prod.lab.launch import Proc, free_port, make_tls, router_command

# Full run only (KVPUSH_E2E_EXTRA=1): a TLS cluster of its own; the router's TLS client is unit-tested in CI; CI's budget (README, "Tests").
pytestmark = [pytest.mark.e2e, pytest.mark.full]

MAX_TOKENS = 16
_seeds = itertools.count(7100)


@pytest.fixture(scope="module")
def tls_cluster(e2e_workdir, shared_reference: SharedReference) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    spec = ClusterSpec(workdir=e2e_workdir("e2e-tls"), tls=True, prefill_kv_gib=1, decode_kv_gib=1)
    cluster = Cluster(shared_reference.attach(spec))
    assert cluster.tls is not None
    # The lab's httpx clients (scrape) trust the cluster's CA for the engines' https URLs.
    saved = os.environ.get("SSL_CERT_FILE")
    os.environ["SSL_CERT_FILE"] = str(cluster.tls.ca)
    try:
        with cluster as c:
            yield c
    finally:
        if saved is None:
            os.environ.pop("SSL_CERT_FILE", None)
        else:
            os.environ["SSL_CERT_FILE"] = saved


async def test_signed_legs_over_tls_answer_like_a_single_engine_and_push(
    tls_cluster: Cluster,
) -> None:
    from kvpush_prod.lab.tinymodel import prompt_of_length

    c = tls_cluster
    assert c.urls["prefill"].startswith("https://") and c.urls["decode"].startswith("https://")
    before = {n: scrape(c.urls[n]) for n in ("prefill", "decode")}
    lengths = [5, 300, 1000]
    async with httpx.AsyncClient(timeout=120) as client:
        for i, n in enumerate(lengths):
            prompt = prompt_of_length(n, seed=next(_seeds))
            ref = await request(
                client, c.urls["reference"], completion_body(prompt, MAX_TOKENS, False)
            )
            got = await request(
                client, c.urls["router"], completion_body(prompt, MAX_TOKENS, i == 1)
            )
            assert ref.ok and got.ok, (n, ref.error, got.error)
            assert got.text == ref.text, n
            if i != 1:
                assert (got.kv_transfer_params or {})["kvpush"]["outcome"] == "pushed", n
    after = {n: scrape(c.urls[n]) for n in ("prefill", "decode")}
    for name in ("prefill", "decode"):  # every signed leg was taken
        moved = metric_sum(after[name], "kvpush_kv_params_rejected_total") - metric_sum(
            before[name], "kvpush_kv_params_rejected_total"
        )
        assert moved == 0, name
    pushed = metric_sum(
        after["decode"], "kvpush_transfers_total", role="consumer", outcome="pushed"
    ) - metric_sum(before["decode"], "kvpush_transfers_total", role="consumer", outcome="pushed")
    assert pushed == len(lengths)


def test_the_engines_answer_no_plain_http(tls_cluster: Cluster) -> None:
    plain = tls_cluster.urls["decode"].replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(plain + "/health", timeout=10)


def test_a_router_trusting_another_ca_routes_nothing(tls_cluster: Cluster) -> None:
    c = tls_cluster
    rogue = make_tls(c.spec.workdir / "rogue-tls", "rogue")
    port = free_port()
    cmd = router_command(port) + [
        "--prefill",
        c.urls["prefill"],
        "--decode",
        c.urls["decode"],
        "--backend-ca-file",
        str(rogue.ca),
        "--params-key-file",
        str(c.params_key_file),
        "--direct-below-tokens",
        "0",
    ]
    proc = Proc("router-rogue-ca", cmd, dict(os.environ), c.log_dir / "router-rogue-ca.log")
    url = f"http://127.0.0.1:{port}"
    try:
        health = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.alive():
            try:
                health = httpx.get(url + "/health", timeout=5)
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert health is not None, proc.tail()
        assert health.status_code == 503
        for b in (*health.json()["prefill"], *health.json()["decode"]):
            assert not b["up"] and "CERTIFICATE_VERIFY_FAILED" in b["error"], b
        resp = httpx.post(
            url + "/v1/completions", timeout=30, json=completion_body("w1 w2 w3", 4, False)
        )
        assert resp.status_code in (404, 503), resp.text  # no model known, no backend up
    finally:
        proc.stop()
