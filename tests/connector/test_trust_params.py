"""kv_transfer_params come from clients: the router's signature, the peer's address and the
peer's key are checked before an engine uses them, and a refusal names its reason."""

from __future__ import annotations

import time

import pytest
import zmq

from kvpush_prod.connector.params import check_host
from kvpush_prod.connector.trust import Trust
from kvpush_prod.errors import KVTransferParamsError
from kvpush_prod.signing import sign_params

KEY = b"k" * 32
P_KEY = zmq.curve_keypair()[0].decode()
D_KEY = zmq.curve_keypair()[0].decode()
OTHER = zmq.curve_keypair()[0].decode()
PARAMS = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_host": "10.0.0.1",
          "remote_port": 15500, "tp_size": 1, "transfer_id": "t1"}


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
    assert trust.remote_prefill("r", sign_params(PARAMS, KEY, now)) is not None
    assert reason(trust.remote_prefill, "r", PARAMS) == "unsigned"
    forged = {**sign_params(PARAMS, KEY, now), "remote_host": "10.6.6.6"}
    assert reason(trust.remote_prefill, "r", forged) == "bad_signature"
    assert reason(trust.remote_prefill, "r", sign_params(PARAMS, b"o" * 32, now)) == "bad_signature"
    assert reason(trust.remote_prefill, "r", sign_params(PARAMS, KEY, now - 600, 60)) == "expired"
    assert reason(trust.remote_prefill, "r", {**PARAMS, "kvpush_sig": "x"}) == "malformed"


def test_a_prefill_outside_the_allowed_networks_is_refused() -> None:
    import ipaddress

    trust = Trust(networks=(ipaddress.ip_network("10.0.0.0/16"),))
    assert trust.remote_prefill("r", PARAMS) is not None
    assert reason(trust.remote_prefill, "r", {**PARAMS, "remote_host": "192.168.1.1"}) \
        == "foreign_peer"
    assert reason(trust.remote_prefill, "r", {**PARAMS, "remote_host": "127.0.0.1"}) \
        == "foreign_peer"


def test_with_keys_the_prefill_key_must_be_in_the_allow_list() -> None:
    trust = keyed()
    remote = trust.remote_prefill("r", {**PARAMS, "remote_key": P_KEY})
    assert remote is not None and remote.key == P_KEY
    assert reason(trust.remote_prefill, "r", {**PARAMS, "remote_key": OTHER}) == "unknown_key"
    assert reason(trust.remote_prefill, "r", {**PARAMS, "remote_key": "short"}) == "malformed"


def test_with_keys_and_no_remote_key_the_engine_id_may_name_the_key() -> None:
    remote = keyed().remote_prefill("r", PARAMS)  # remote_engine_id "prefill-0" names P_KEY
    assert remote is not None and remote.key == P_KEY
    assert reason(keyed().remote_prefill, "r", {**PARAMS, "remote_engine_id": "nobody"}) \
        == "unknown_key"


def test_prefill_takes_the_decode_the_router_named_only_from_the_allow_list() -> None:
    params = {"do_remote_decode": True, "transfer_id": "t1"}
    assert keyed().decode_owner({**params, "decode_key": D_KEY}) == D_KEY
    assert keyed().decode_owner(params) == ""
    assert reason(keyed().decode_owner, {**params, "decode_key": OTHER}) == "unknown_key"
    assert Trust().decode_owner({**params, "decode_key": D_KEY}) == ""  # no keys: unused
    assert reason(Trust(params_key=KEY).decode_owner, params) == "unsigned"
