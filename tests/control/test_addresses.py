"""Peer addresses: only tcp://HOST:PORT with a single peer's host and a port 1-65535."""

from __future__ import annotations

import pytest

from kvpush_prod.control.addresses import address_problem, is_ipv6


@pytest.mark.parametrize(
    "address",
    [
        "tcp://10.0.0.7:15500",
        "tcp://[fd00::7]:1",
        "tcp://decode-0.kv.svc.cluster.local.:65535",
        "tcp://localhost:15500",
    ],
)
def test_a_usable_address_has_no_problem(address: str) -> None:
    assert address_problem(address) is None


@pytest.mark.parametrize(
    ("address", "problem"),
    [
        ("tcp://a b:1", "tcp://HOST:PORT"),
        ("tcp://host:0", "port 0"),
        ("tcp://host:99999", "port 99999"),
        ("udp://x:1", "tcp://HOST:PORT"),
        ("tcp://0.0.0.0:1", "single peer"),
        ("tcp://[::]:1", "single peer"),
        ("tcp://255.255.255.255:1", "single peer"),
        ("tcp://[1::2::3]:1", "not an IPv6"),
        ("tcp://1.2.3.456:1", "not an IPv4"),
        ("tcp://a..b:1", "DNS name"),
        ("tcp://" + "a" * 64 + ":1", "DNS name"),
        (b"tcp://x:1", "not a string"),
    ],
)
def test_a_bad_address_says_what_is_wrong(address: object, problem: str) -> None:
    found = address_problem(address)
    assert found is not None and problem in found


def test_ipv6_addresses_are_told_apart() -> None:
    assert is_ipv6("tcp://[::1]:5") and not is_ipv6("tcp://127.0.0.1:5")
