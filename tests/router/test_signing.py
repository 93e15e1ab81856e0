"""Router-signed kv_transfer_params and the engines' control-channel keys, with the fakes.

With a params key both legs (push and pull) are signed, each for its own leg, with a fresh
nonce; probes are not (they authorize nothing). P's probed key goes to D's leg, a probed
D's key to P's leg: decode backends are probed by default, and one whose probe fails is
not routed to.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvpush_prod.signing import (
    DECODE,
    LEG_FIELDS,
    PREFILL,
    SIG_FIELD,
    NonceMemory,
    SignatureError,
    verify_params,
)
from tests.router.fakes import MODEL, wait_until

COMPLETION = {"model": MODEL, "prompt": "w10 w11 w12", "max_tokens": 4, "temperature": 0}
# 32 random bytes in hex, as `openssl rand -hex 32 > params.key` leaves them.
KEY = b"9c1e5a7f03b84d26e1f0a5c7d93b624e8f17a0c5b2d94e6f3a81c07b5e29d4f6"
# Public keys in Z85, as CurveZMQ writes them (40 characters).
P_KEY = "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"
D_KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
D_KEY_2 = "JTKVSB%%)wK0E.X)V>+}o?pNmC{O&4W4b!Ni{Lh6"


def key_file(tmp_path: Path) -> str:
    path = tmp_path / "params.key"
    path.write_bytes(KEY + b"\n")
    path.chmod(0o600)  # the router refuses a params key others may read
    return str(path)


def verified(params: dict[str, Any], leg: str, ttl_s: float = 120.0) -> dict[str, Any]:
    """``params`` checked against KEY for ``leg`` (raises if not), without the signature."""
    now = time.time()
    verify_params(params, KEY, now, leg)
    sig = params[SIG_FIELD]
    assert set(sig) == {"v", "leg", "nonce", "expires_at", "mac"} and sig["leg"] == leg
    assert now + ttl_s - 5 < sig["expires_at"] <= now + ttl_s + 1
    return {k: v for k, v in params.items() if k != SIG_FIELD}


def refused_for(params: dict[str, Any], leg: str) -> str:
    with pytest.raises(SignatureError) as e:
        verify_params(params, KEY, time.time(), leg)
    return e.value.reason


async def test_each_leg_is_signed_for_its_own_leg_and_p_key_reaches_d(fakes, router, tmp_path):
    p, d = await fakes("prefill"), await fakes("decode")
    p.remote_key = P_KEY
    r = await router([p], [d], params_key_file=key_file(tmp_path), params_ttl_s=60)

    resp = await r.post("/v1/completions", COMPLETION)

    assert resp.status_code == 200, resp.text
    (ps,), (ds,) = p.requests, d.requests
    tid = ps.headers["x-request-id"]
    p_params, d_params = ps.body["kv_transfer_params"], ds.body["kv_transfer_params"]
    assert verified(p_params, PREFILL, 60) == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": tid,
    }
    assert verified(d_params, DECODE, 60) == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": p.engine_id,
        "remote_host": p.control_host,
        "remote_port": p.control_port,
        "tp_size": 1,
        "transfer_id": tid,
        "remote_key": P_KEY,
    }
    # A leg sent to the other role's engine is refused there.
    assert refused_for(p_params, DECODE) == "wrong_leg"
    assert refused_for(d_params, PREFILL) == "wrong_leg"
    # Probes authorize nothing and carry no signature; D is probed for its key by default.
    for probe in (*p.probes, *d.probes):
        assert SIG_FIELD not in probe.body["kv_transfer_params"]
    assert len(d.probes) == 1
    health = (await r.client.get(r.url + "/health")).json()
    assert health["prefill"][0]["identity"]["remote_key"] == P_KEY


async def test_every_leg_gets_its_own_nonce_and_an_engine_takes_each_once(fakes, router, tmp_path):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], params_key_file=key_file(tmp_path))

    for _ in range(2):
        assert (await r.post("/v1/completions", COMPLETION)).status_code == 200

    legs = [
        (s.headers["x-request-id"], s.body["kv_transfer_params"], leg)
        for fake, leg in ((p, PREFILL), (d, DECODE))
        for s in fake.requests
    ]
    nonces = [params[SIG_FIELD]["nonce"] for _, params, _ in legs]
    assert len(legs) == 4 and len(set(nonces)) == 4
    # What the engines do with them: the first request to use a leg's nonce takes it, a
    # replay of that leg for another request is refused.
    memory = NonceMemory()
    now = time.time()
    for tid, params, leg in legs:
        memory.take(verify_params(params, KEY, now, leg), tid, now)
    tid, params, leg = legs[0]
    with pytest.raises(SignatureError) as e:
        memory.take(verify_params(params, KEY, now, leg), "another-request", now)
    assert e.value.reason == "replayed"


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
    r = await router([p], [d_keyed, d_plain])  # probe_decode is on by default

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


async def test_without_probe_decode_d_is_not_probed_and_p_gets_no_decode_key(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    d.remote_key = D_KEY
    r = await router([p], [d], probe_decode=False)

    assert (await r.post("/v1/completions", COMPLETION)).status_code == 200

    assert not d.probes
    assert "decode_key" not in p.requests[0].body["kv_transfer_params"]


async def test_a_decode_whose_key_probe_fails_is_not_routed_to_until_it_answers(fakes, router):
    p = await fakes("prefill")
    d_good, d_bad = await fakes("decode"), await fakes("decode")
    d_good.remote_key = d_bad.remote_key = D_KEY
    d_bad.probe_status = 500
    r = await router([p], [d_good, d_bad])

    for _ in range(4):
        assert (await r.post("/v1/completions", COMPLETION)).status_code == 200

    # Every leg went to the D whose key is known, each naming it to P.
    assert len(d_good.requests) == 4 and not d_bad.requests
    assert all(s.body["kv_transfer_params"]["decode_key"] == D_KEY for s in p.requests)
    health = (await r.client.get(r.url + "/health")).json()
    bad = health["decode"][1]
    assert bad["up"] is False and "key probe answered HTTP 500" in bad["error"]
    d_bad.probe_status = 200
    await wait_until(lambda: r.app.state.pool.decode[1].up, what="D's probe to answer")
    for _ in range(2):
        assert (await r.post("/v1/completions", COMPLETION)).status_code == 200
    assert len(d_bad.requests) == 1


async def test_a_restarted_decode_is_probed_again_for_its_new_key(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    d.remote_key = D_KEY
    r = await router([p], [d])
    assert (await r.post("/v1/completions", COMPLETION)).status_code == 200

    d.remote_key = D_KEY_2
    await d.restart()
    await wait_until(
        lambda: r.app.state.pool.decode[0].remote_key == D_KEY_2 and r.app.state.pool.ready(),
        what="D's new key",
    )
    assert (await r.post("/v1/completions", COMPLETION)).status_code == 200
    assert p.requests[-1].body["kv_transfer_params"]["decode_key"] == D_KEY_2


async def test_pull_mode_signs_each_leg_with_only_the_fields_it_may_carry(fakes, router, tmp_path):
    p, d = await fakes("prefill"), await fakes("decode")
    p.remote_key = P_KEY
    r = await router([p], [d], mode="pull", params_key_file=key_file(tmp_path))

    assert (await r.post("/v1/completions", COMPLETION)).status_code == 200

    tid = p.requests[0].headers["x-request-id"]
    assert verified(p.requests[0].body["kv_transfer_params"], PREFILL) == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": tid,
    }
    d_params = verified(d.requests[0].body["kv_transfer_params"], DECODE)
    # P's answer, less what only vLLM's pull connector reads (block ids, its request id),
    # bound to the router's transfer id (this fake P, unlike kvpush's, names none).
    answer = p.identity_params(tid)
    assert "transfer_id" not in answer
    assert d_params == {
        **{k: v for k, v in answer.items() if k in LEG_FIELDS[DECODE]},
        "transfer_id": tid,
    }
    assert d_params["remote_key"] == P_KEY and "remote_block_ids" not in d_params
    assert not d.probes  # pull mode names no D to P: nothing to probe D for


async def test_pull_mode_refuses_to_sign_a_pull_connectors_answer_for_d(fakes, router, tmp_path):
    p, d = await fakes("prefill"), await fakes("decode")
    r = await router([p], [d], mode="pull", params_key_file=key_file(tmp_path), max_retries=0)
    identity = p.identity_params

    def pull_connector(rid: str) -> dict[str, Any]:
        return {**identity(rid), "transfer_mode": "pull"}

    p.identity_params = pull_connector  # type: ignore[method-assign]

    resp = await r.post("/v1/completions", COMPLETION)

    assert resp.status_code == 502
    assert "transfer_mode 'pull'" in resp.json()["error"]["message"]
    assert not d.requests


async def test_a_malformed_probed_key_keeps_p_out_of_rotation(fakes, router):
    p, d = await fakes("prefill"), await fakes("decode")
    p.remote_key = "not-a-key"
    r = await router([p], [d])

    resp = await r.post("/v1/completions", COMPLETION)

    assert resp.status_code == 503
    assert "not a control-channel public key" in resp.json()["error"]["message"]
