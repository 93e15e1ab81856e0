"""kv_transfer_params from the router: pairing ids and clear errors for bad values."""

from __future__ import annotations

import pytest

from kvpush_prod.connector.params import (
    base_request_id,
    is_probe,
    is_remote_decode,
    parse_remote_prefill,
    transfer_id_of,
)
from kvpush_prod.errors import KVTransferParamsError

GOOD = {
    "do_remote_prefill": True,
    "remote_engine_id": "p",
    "remote_host": "10.0.0.1",
    "remote_port": 15500,
    "tp_size": 1,
}


def test_both_legs_pair_on_the_request_id_without_vllms_random_suffix() -> None:
    assert base_request_id("cmpl-abc-0-1a2b3c4d") == "cmpl-abc-0"
    assert base_request_id("cmpl-abc-0") == "cmpl-abc-0"
    assert transfer_id_of("cmpl-abc-0-deadbeef", {}) == transfer_id_of("cmpl-abc-0-0badf00d", {})


def test_explicit_transfer_id_wins() -> None:
    assert transfer_id_of("cmpl-x-0-deadbeef", {"transfer_id": "tid"}) == "tid"


def test_remote_prefill_params_parse() -> None:
    rp = parse_remote_prefill("r-deadbeef", {**GOOD, "transfer_id": "t"})
    assert rp is not None and (rp.host, rp.port, rp.transfer_id) == ("10.0.0.1", 15500, "t")
    assert parse_remote_prefill("r", {"do_remote_decode": True}) is None
    assert parse_remote_prefill("r", None) is None


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"do_remote_prefill": True}, "remote_host, remote_port"),
        ({**GOOD, "remote_port": "x"}, "remote_port"),
        ({**GOOD, "remote_port": 70000}, "remote_port"),
        ({**GOOD, "remote_host": 5}, "remote_host"),
        ({**GOOD, "tp_size": 0}, "tp_size"),
        ({**GOOD, "transfer_id": ""}, "transfer_id"),
    ],
)
def test_bad_params_name_the_field(params: dict, needle: str) -> None:
    with pytest.raises(KVTransferParamsError, match=needle):
        parse_remote_prefill("r", params)


def test_roles_of_a_leg() -> None:
    assert is_remote_decode({"do_remote_decode": True})
    assert not is_remote_decode({"do_remote_prefill": True})
    assert is_probe({"do_remote_decode": True, "kvpush_probe": True})
