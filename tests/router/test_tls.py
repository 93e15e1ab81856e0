"""TLS on the legs: fake engines served over https:// (as vLLM's --ssl-keyfile/--ssl-certfile
serve them) with certificates from a CA made in the test; the router verifies them against
its backend_ca_file.

Signed legs arrive over TLS; an engine whose certificate another CA signed gets nothing
(not even a health check's request) and a leg to it fails as a connect failure naming the
certificate; mutual TLS needs the router's client certificate.
"""

from __future__ import annotations

import ssl
import time
from pathlib import Path

import pytest

from kvpush_prod.signing import DECODE, PREFILL, SIG_FIELD, verify_params
from tests.router.fakes import MODEL
from tests.router.tls import Pki, make_pki

COMPLETION = {"model": MODEL, "prompt": "w10 w11 w12", "max_tokens": 4, "temperature": 0}
KEY = b"3b7e19c4a0d5f8261e9c7a4b0d3f5e8a1c6b9d2e7f4a0c3b5d8e1f6a9c2b7d40"


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path)


def serving(cert: Path, key: Path) -> dict[str, str]:
    return {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}


def params_key_file(tmp_path: Path) -> str:
    path = tmp_path / "params.key"
    path.write_bytes(KEY + b"\n")
    path.chmod(0o600)
    return str(path)


async def test_signed_legs_arrive_over_tls_verified_against_the_ca(fakes, router, pki, tmp_path):
    p = await fakes("prefill", tls=serving(pki.server_cert, pki.server_key))
    d = await fakes("decode", tls=serving(pki.server_cert, pki.server_key))
    assert p.url.startswith("https://") and d.url.startswith("https://")
    r = await router(
        [p], [d], backend_ca_file=str(pki.ca), params_key_file=params_key_file(tmp_path)
    )

    resp = await r.post("/v1/completions", COMPLETION)

    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "w4 w5 w6 w7"
    (ps,), (ds,) = p.requests, d.requests
    assert ps.scheme == ds.scheme == "https"
    assert all(s.scheme == "https" for s in (*p.probes, *d.probes)) and p.probes and d.probes
    now = time.time()
    verify_params(ps.body["kv_transfer_params"], KEY, now, PREFILL)
    verify_params(ds.body["kv_transfer_params"], KEY, now, DECODE)
    assert SIG_FIELD in ps.body["kv_transfer_params"]


async def test_a_backend_whose_certificate_another_ca_signed_gets_nothing(fakes, router, pki):
    p = await fakes("prefill", tls=serving(pki.server_cert, pki.server_key))
    good = await fakes("decode", tls=serving(pki.server_cert, pki.server_key))
    rogue = await fakes("decode", tls=serving(pki.rogue_cert, pki.rogue_key))
    r = await router([p], [good, rogue], backend_ca_file=str(pki.ca))

    for _ in range(4):
        assert (await r.post("/v1/completions", COMPLETION)).status_code == 200

    assert len(good.requests) == 4
    assert not rogue.requests and not rogue.probes  # the handshake fails before any request
    health = (await r.client.get(r.url + "/health")).json()
    down = health["decode"][1]
    assert down["up"] is False
    assert "CERTIFICATE_VERIFY_FAILED" in down["error"]
    assert "--backend-ca-file" in down["error"]  # what to check


async def test_a_leg_to_a_backend_that_changed_to_a_foreign_certificate_is_a_connect_failure(
    fakes, router, pki
):
    p = await fakes("prefill", tls=serving(pki.server_cert, pki.server_key))
    d1 = await fakes("decode", tls=serving(pki.server_cert, pki.server_key))
    d2 = await fakes("decode", tls=serving(pki.server_cert, pki.server_key))
    # No health poll after the first: the next leg is the first to meet the new certificate.
    r = await router([p], [d1, d2], backend_ca_file=str(pki.ca), health_interval_s=600)
    d1.tls = serving(pki.rogue_cert, pki.rogue_key)
    await d1.restart()

    resp = await r.post("/v1/completions", COMPLETION)  # round robin: d1 first

    assert resp.status_code == 200, resp.text
    assert not d1.requests and len(d2.requests) == 1
    assert r.sample("kvpush_router_retries_total", reason="decode_connect") == 1
    d1_state = r.app.state.pool.decode[0]
    assert not d1_state.up and "CERTIFICATE_VERIFY_FAILED" in (d1_state.last_error or "")


async def test_a_plain_http_engine_behind_an_https_url_is_named(fakes, router, pki):
    p = await fakes("prefill", tls=serving(pki.server_cert, pki.server_key))
    plain = await fakes("decode")
    url = plain.url.replace("http://", "https://")
    r = await router([p], [url], backend_ca_file=str(pki.ca))

    resp = await r.post("/v1/completions", COMPLETION)

    assert resp.status_code == 503
    assert "does not speak TLS" in resp.json()["error"]["message"]
    assert not plain.requests


async def test_mutual_tls_needs_the_routers_client_certificate(fakes, router, pki):
    strict = {
        **serving(pki.server_cert, pki.server_key),
        "ssl_ca_certs": str(pki.ca),
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
    }
    p, d = await fakes("prefill", tls=strict), await fakes("decode", tls=strict)

    anonymous = await router([p], [d], backend_ca_file=str(pki.ca))
    health = await anonymous.client.get(anonymous.url + "/health")
    assert health.status_code == 503  # the engines reset the handshake of a client without one
    assert "Connection reset" in health.json()["decode"][0]["error"]
    assert not p.requests and not d.requests

    r = await router(
        [p],
        [d],
        backend_ca_file=str(pki.ca),
        backend_client_cert_file=str(pki.client_cert),
        backend_client_key_file=str(pki.client_key),
    )
    resp = await r.post("/v1/completions", COMPLETION)
    assert resp.status_code == 200, resp.text
    assert p.requests[0].scheme == d.requests[0].scheme == "https"
