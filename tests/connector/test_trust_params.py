"""kv_transfer_params come from clients: the router's signature, the peer's address and the
peer's key are checked before an engine uses them, and a refusal names its reason."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import pytest
import zmq

from kvpush_prod.config import KvpushConfig
from kvpush_prod.connector.params import check_host
from kvpush_prod.connector.trust import Trust, read_params_key
from kvpush_prod.errors import ConfigError, KVTransferParamsError
from kvpush_prod.signing import DECODE, PREFILL, NonceMemory, sign_params

KEY = secrets.token_hex(32).encode()
P_KEY = zmq.curve_keypair()[0].decode()
D_KEY = zmq.curve_keypair()[0].decode()
OTHER = zmq.curve_keypair()[0].decode()
PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill-0",
    "remote_host": "10.0.0.1",
    "remote_port": 15500,
    "tp_size": 1,
    "transfer_id": "t1",
}


def keyed(**kw: object) -> Trust:
    return Trust(public_key=D_KEY, allowed={P_KEY: "prefill-0", D_KEY: "decode-0"}, **kw)  # type: ignore[arg-type]


def reason(fn: object, *args: object) -> str:
    with pytest.raises(KVTransferParamsError) as info:
        fn(*args)  # type: ignore[operator]
    return info.value.reason


def test_without_keys_or_params_key_well_formed_params_are_taken() -> None:
    remote = Trust().remote_prefill("r", PARAMS)
    assert remote is not None and (remote.host, remote.port, remote.key) == ("10.0.0.1", 15500, "")


@pytest.mark.parametrize("host", ["a b", "", "-bad", "x" * 300, "tcp://x", "h_1", "10.0.0.1;rm"])
def test_a_malformed_host_is_refused(host: str) -> None:
    assert reason(Trust().remote_prefill, "r", {**PARAMS, "remote_host": host}) == "malformed"


def test_ipv6_hosts_get_brackets_for_tcp_addresses() -> None:
    assert check_host("::1") == "[::1]" and check_host("[fd00::5]") == "[fd00::5]"


def test_signed_params_are_taken_and_anything_else_is_refused() -> None:
    trust = Trust(params_key=KEY)
    now = time.time()
    assert trust.remote_prefill("r", sign_params(PARAMS, KEY, now, DECODE)) is not None
    assert reason(trust.remote_prefill, "r", PARAMS) == "unsigned"
    forged = {**sign_params(PARAMS, KEY, now, DECODE), "remote_host": "10.6.6.6"}
    assert reason(trust.remote_prefill, "r", forged) == "bad_signature"
    other_key = secrets.token_hex(32).encode()
    assert (
        reason(trust.remote_prefill, "r", sign_params(PARAMS, other_key, now, DECODE))
        == "bad_signature"
    )
    assert (
        reason(trust.remote_prefill, "r", sign_params(PARAMS, KEY, now - 600, DECODE, 60))
        == "expired"
    )
    assert reason(trust.remote_prefill, "r", {**PARAMS, "kvpush_sig": "x"}) == "malformed"


def test_a_signed_leg_is_taken_once_for_its_own_leg_with_the_fields_the_router_signs() -> None:
    trust = Trust(params_key=KEY)
    now = time.time()
    leg = sign_params(PARAMS, KEY, now, DECODE)
    assert trust.remote_prefill("r1", leg) is not None
    assert trust.remote_prefill("r1", leg) is not None  # vLLM asks about one request again
    # The same leg under another request (captured and replayed, with any prompt): refused.
    assert reason(trust.remote_prefill, "r2", leg) == "replayed"
    # A prefill leg's signature does not open a decode engine (nor the other way round).
    p_leg = sign_params({"do_remote_decode": True, "transfer_id": "t1"}, KEY, now, PREFILL)
    assert reason(trust.remote_prefill, "r3", {**p_leg, **PARAMS}) == "wrong_leg"
    assert reason(Trust(params_key=KEY).decode_owner, "r4", leg) == "wrong_leg"
    # No field rides along unsigned, nor poses as a term of the signature.
    extra = sign_params({**PARAMS, "__expires_at": 9e9}, KEY, now, DECODE)
    assert reason(trust.remote_prefill, "r5", extra) == "unknown_field"
    unbound = sign_params({k: v for k, v in PARAMS.items() if k != "transfer_id"}, KEY, now, DECODE)
    assert reason(trust.remote_prefill, "r6", unbound) == "malformed"


def test_the_nonce_memory_is_bounded_and_forgets_only_expired_nonces() -> None:
    memory = NonceMemory(capacity=2)
    trust = Trust(params_key=KEY, nonces=memory)
    now = time.time()
    assert trust.remote_prefill("a", sign_params(PARAMS, KEY, now, DECODE, 1.0)) is not None
    assert trust.remote_prefill("b", sign_params(PARAMS, KEY, now, DECODE, 60.0)) is not None
    # Full of live nonces: a new one is refused rather than an old one forgotten early.
    assert (
        reason(trust.remote_prefill, "c", sign_params(PARAMS, KEY, now, DECODE))
        == "replay_memory_full"
    )
    assert len(memory) == 2
    time.sleep(1.1)  # the first signature expired: its nonce may go
    assert trust.remote_prefill("d", sign_params(PARAMS, KEY, time.time(), DECODE)) is not None
    assert len(memory) == 2


def test_weak_or_exposed_params_keys_are_refused_naming_the_fix(tmp_path: Path) -> None:
    def load(text: str, mode: int) -> bytes | None:
        path = tmp_path / "params.key"
        path.write_text(text)
        path.chmod(mode)
        return read_params_key(
            KvpushConfig.model_validate({"control": {"params_key_file": str(path)}})
        )

    good = secrets.token_hex(32)
    assert load(good + "\n", 0o600) == good.encode()
    with pytest.raises(ConfigError, match="chmod 600"):
        load(good, 0o644)
    with pytest.raises(ConfigError, match="openssl rand -hex 32"):
        load("a" * 16, 0o600)
    with pytest.raises(ConfigError, match="not random"):
        load("ab" * 32, 0o600)
    with pytest.raises(ConfigError, match="16 bytes"):
        load(secrets.token_hex(16), 0o600)


def test_a_prefill_outside_the_allowed_networks_is_refused() -> None:
    import ipaddress

    trust = Trust(networks=(ipaddress.ip_network("10.0.0.0/16"),))
    assert trust.remote_prefill("r", PARAMS) is not None
    assert (
        reason(trust.remote_prefill, "r", {**PARAMS, "remote_host": "192.168.1.1"})
        == "foreign_peer"
    )
    assert (
        reason(trust.remote_prefill, "r", {**PARAMS, "remote_host": "127.0.0.1"}) == "foreign_peer"
    )


def test_with_keys_the_prefill_key_must_be_in_the_allow_list() -> None:
    trust = keyed()
    remote = trust.remote_prefill("r", {**PARAMS, "remote_key": P_KEY})
    assert remote is not None and remote.key == P_KEY
    assert reason(trust.remote_prefill, "r", {**PARAMS, "remote_key": OTHER}) == "unknown_key"
    assert reason(trust.remote_prefill, "r", {**PARAMS, "remote_key": "short"}) == "malformed"


def test_with_keys_and_no_remote_key_the_engine_id_may_name_the_key() -> None:
    remote = keyed().remote_prefill("r", PARAMS)  # remote_engine_id "prefill-0" names P_KEY
    assert remote is not None and remote.key == P_KEY
    assert (
        reason(keyed().remote_prefill, "r", {**PARAMS, "remote_engine_id": "nobody"})
        == "unknown_key"
    )


def test_prefill_takes_the_decode_the_router_named_only_from_the_allow_list() -> None:
    params = {"do_remote_decode": True, "transfer_id": "t1"}
    assert keyed().decode_owner("r", {**params, "decode_key": D_KEY}) == D_KEY
    assert keyed().decode_owner("r", params) == ""
    assert reason(keyed().decode_owner, "r", {**params, "decode_key": OTHER}) == "unknown_key"
    assert Trust().decode_owner("r", {**params, "decode_key": D_KEY}) == ""  # no keys: unused
    assert reason(Trust(params_key=KEY).decode_owner, "r", params) == "unsigned"


def test_a_host_name_is_resolved_once_and_the_checked_address_is_the_one_used() -> None:
    import ipaddress

    trust = Trust(networks=(ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1")))
    remote = trust.remote_prefill("r", {**PARAMS, "remote_host": "localhost"})
    assert remote is not None and remote.host in ("127.0.0.1", "[::1]")
    assert (
        reason(
            Trust(networks=(ipaddress.ip_network("10.0.0.0/8"),)).remote_prefill,
            "r",
            {**PARAMS, "remote_host": "localhost"},
        )
        == "foreign_peer"
    )
