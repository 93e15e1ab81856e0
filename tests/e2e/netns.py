"""A throttled network link for end-to-end tests (shared/design/lab.md): a network namespace
joined to this one by a veth pair, with a ``tc tbf`` rate on the namespace side's egress.
Names carry this process's id; everything is removed at the end, after a failure too."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    netns: str
    host_dev: str  # this namespace's end
    ns_dev: str  # the namespace's end (throttled egress)
    host_ip: str
    ns_ip: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def why_not() -> str | None:
    """Why this machine cannot make the link (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    return None


@contextmanager
def throttled_link(rate: str = "100mbit", subnet: int = 231) -> Iterator[Link]:
    pid = os.getpid()
    third = pid % 250 + 1
    link = Link(
        f"kvpush{pid}", f"kvh{pid}", f"kvn{pid}", f"10.{subnet}.{third}.1", f"10.{subnet}.{third}.2"
    )
    try:
        _ip("netns", "add", link.netns)
        _ip("link", "add", link.host_dev, "type", "veth", "peer", "name", link.ns_dev)
        _ip("link", "set", link.ns_dev, "netns", link.netns)
        _ip("addr", "add", f"{link.host_ip}/24", "dev", link.host_dev)
        _ip("link", "set", link.host_dev, "up")
        inside = ("netns", "exec", link.netns)
        _ip(*inside, "ip", "addr", "add", f"{link.ns_ip}/24", "dev", link.ns_dev)
        _ip(*inside, "ip", "link", "set", link.ns_dev, "up")
        _ip(*inside, "ip", "link", "set", "lo", "up")
        _ip(
            *inside,
            "tc",
            "qdisc",
            "add",
            "dev",
            link.ns_dev,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "64kb",
            "latency",
            "50ms",
        )
        yield link
    finally:
        subprocess.run(
            ["ip", "link", "del", link.host_dev], capture_output=True, timeout=30, check=False
        )
        subprocess.run(
            ["ip", "netns", "del", link.netns], capture_output=True, timeout=30, check=False
        )
