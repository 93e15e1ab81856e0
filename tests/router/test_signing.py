"""Router-signed kv_transfer_params and the engines' control-channel keys, with the fakes.

With a params key both legs (push and pull) and the probes are signed; P's probed key goes
to D's leg, a probed D's key to P's leg.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvpush_prod.signing import SIG_FIELD, verify_params
from tests.router.fakes import MODEL, wait_until

COMPLETION = {"model": MODEL, "prompt": "w10 w11 w12", "max_tokens": 4, "temperature": 0}
KEY = b"0123456789abcdef0123456789abcdef"
# Public keys in Z85, as CurveZMQ writes them (40 characters).
P_KEY = "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"
D_KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
D_KEY_2 = "JTKVSB%%)wK0E.X)V>+}o?pNmC{O&4W4b!Ni{Lh6"


def key_file(tmp_path: Path) -> str:
    path = tmp_path / "params.key"
    path.write_bytes(KEY + b"\n")  # as `openssl rand -hex 16 > params.key` leaves it
    return str(path)


def verified(params: dict[str, Any], ttl_s: float = 120.0) -> dict[str, Any]:
    """``params`` checked against KEY (raises if not), without the signature."""
    now = time.time()
    verify_params(params, KEY, now)
    assert now + ttl_s - 5 < params[SIG_FIELD]["expires_at"] <= now + ttl_s + 1
    return {k: v for k, v in params.items() if k != SIG_FIELD}


async def test_both_legs_and_the_probe_are_signed_and_p_key_reaches_d(fakes, router, tmp_path):
    p, d = await fakes("prefill"), await fakes("decode")
    p.remote_key = P_KEY
    r = await router([p], [d], params_key_file=key_file(tmp_path), params_ttl_s=60)

    resp = await r.post("/v1/completions", COMPLETION)

    assert resp.status_code == 200, resp.text
    (ps,), (ds,) = p.requests, d.requests
    tid = ps.headers["x-request-id"]
    assert verified(ps.body["kv_transfer_params"], 60) == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": tid,
    }
    assert verified(ds.body["kv_transfer_params"], 60) == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": p.engine_id,
        "remote_host": p.control_host,
        "remote_port": p.control_port,
        "tp_size": 1,
        "transfer_id": tid,
        "remote_key": P_KEY,
    }
    assert verified(p.probes[0].body["kv_transfer_params"], 60) == {
        "do_remote_decode": True,
        "kvpush_probe": True,
    }
    assert not d.probes  # D is probed only with probe_decode
    health = (await r.client.get(r.url + "/health")).json()
    assert health["prefill"][0]["identity"]["remote_key"] == P_KEY


async def test_without_a_params_key_nothing_is_signed(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d])
    assert (await r.post("/v1/completions", COMPLETION)).status_code == 200
    for seen in (*p.requests, *d.requests, *p.probes):
        assert SIG_FIELD not in seen.body["kv_transfer_params"]
    assert "remote_key" not in d.requests[0].body["kv_transfer_params"]


async def test_a_probed_decode_key_is_named_to_p_and_a_keyless_d_is_left_out(fakes, router):
    p = await fakes("prefill")
    d_keyed, d_plain = await fakes("decode"), await fakes("decode")
    d_keyed.remote_key = D_KEY
    r = await router([p], [d_keyed, d_plain], probe_decode=True)

    for _ in range(2):  # round robin: one request to each D
        assert (await r.post("/v1/completions", COMPLETION)).status_code == 200

    by_tid = {s.headers["x-request-id"]: s.body["kv_transfer_params"] for s in p.requests}
    keyed_tid = d_keyed.requests[0].headers["x-request-id"]
    plain_tid = d_plain.requests[0].headers["x-request-id"]
    assert by_tid[keyed_tid]["decode_key"] == D_KEY
    assert "decode_key" not in by_tid[plain_tid]
    assert len(d_keyed.probes) == len(d_plain.probes) == 1  # answered once: not asked again
    health = (await r.client.get(r.url + "/health")).json()
    assert [b["remote_key"] for b in health["decode"]] == [D_KEY, None]


async def test_a_restarted_decode_is_probed_again_for_its_new_key(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    d.remote_key = D_KEY
    r = await router([p], [d], probe_decode=True)
    assert (await r.post("/v1/completions", COMPLETION)).status_code == 200

    d.remote_key = D_KEY_2
    await d.restart()
    await wait_until(
        lambda: r.app.state.pool.decode[0].remote_key == D_KEY_2 and r.app.state.pool.ready(),
        what="D's new key",
    )
    assert (await r.post("/v1/completions", COMPLETION)).status_code == 200
    assert p.requests[-1].body["kv_transfer_params"]["decode_key"] == D_KEY_2


async def test_pull_mode_signs_both_legs(fakes, router, tmp_path):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], mode="pull", params_key_file=key_file(tmp_path))

    assert (await r.post("/v1/completions", COMPLETION)).status_code == 200

    p_params = verified(p.requests[0].body["kv_transfer_params"])
    assert p_params["do_remote_decode"] is True
    d_params = verified(d.requests[0].body["kv_transfer_params"])
    assert d_params == p.identity_params(p.requests[0].headers["x-request-id"])


async def test_a_malformed_probed_key_keeps_p_out_of_rotation(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    p.remote_key = "not-a-key"
    r = await router([p], [d])

    resp = await r.post("/v1/completions", COMPLETION)

    assert resp.status_code == 503
    assert "not a control-channel public key" in resp.json()["error"]["message"]
