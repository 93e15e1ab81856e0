"""Checking a peer's control address before a socket is opened to it.

Addresses come from the network (kv_transfer_params, REGISTER): only ``tcp://HOST:PORT``.
"""

from __future__ import annotations

import ipaddress
import re

MAX_ADDRESS_LEN = 300
_ADDRESS_RE = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})")
_LABEL_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def address_problem(address: object) -> str | None:
    """What is wrong with ``address`` as a peer to connect to, or None if it is usable.

    Usable: ``tcp://HOST:PORT`` with PORT 1-65535 and HOST an IPv4 address, a bracketed
    IPv6 address or a DNS name; never a wildcard, unspecified, multicast or broadcast host.
    """
    if not isinstance(address, str):
        return f"not a string but {type(address).__name__}"
    if len(address) > MAX_ADDRESS_LEN:
        return f"{len(address)} characters long, over {MAX_ADDRESS_LEN}"
    match = _ADDRESS_RE.fullmatch(address)
    if match is None:
        return "not of the form tcp://HOST:PORT"
    host, port = match.group(1), int(match.group(2))
    if not 1 <= port <= 65535:
        return f"port {port} is outside 1-65535"
    if host.startswith("["):
        try:
            ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"{host} is not an IPv6 address"
    else:
        try:
            ip = ipaddress.IPv4Address(host)
        except ValueError:
            return _name_problem(host)
    if ip.is_unspecified or ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
        return f"host {host} is not a single peer's address"
    return None


def _name_problem(host: str) -> str | None:
    if len(host) > 253:
        return f"host name is {len(host)} characters long, over 253"
    labels = host.removesuffix(".").split(".")
    if not all(_LABEL_RE.fullmatch(label) for label in labels):
        return f"host {host!r} is neither an IP address nor a valid DNS name"
    if labels[-1].isdigit():
        return f"host {host!r} looks numeric but is not an IPv4 address"
    return None


def is_ipv6(address: str) -> bool:
    """True for ``tcp://[v6]:port`` (ZMQ then needs the IPV6 socket option)."""
    return address.startswith("tcp://[")
