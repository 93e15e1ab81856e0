"""Engines on separate (simulated) hosts: network namespaces joined to this one by veth pairs
(shared/design/lab.md, "Separate hosts, simulated"). Root and iproute2 only.

``namespaces(names)`` gives each name its own namespace: a veth pair whose host end holds
``10.S.T.4k+1/30`` and whose namespace end, renamed ``NS_DEV`` there, holds ``10.S.T.4k+2/30``;
a route to the lab's ``10.S.T.0/24`` via the host end lets the namespaces reach each other
through this host, which forwards between them (``net.ipv4.ip_forward`` on while a lab is
up, restored after). This host (router, reference engine, test) reaches each namespace over
the /30. ``throttled_link()`` is one such namespace with a ``tc tbf`` rate on its egress.

Names carry this process's id (namespace ``kvpush<pid>-<k>``, host end ``kvh<pid>-<k>``) and
everything is removed on leaving the context, after a failure too; a process killed before
it could clean up leaves its namespaces behind, and the next lab removes those of every
dead pid (``remove_stale``).

``partition``/``heal`` and ``throttle``/``unthrottle`` are the nemesis's network faults.
Engines that move KV between namespaces must use UCX's TCP transport (``UCX_ENV``): its
cross-memory attach would copy past the network and neither fault would touch the data.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:  # lab.cluster imports torch: not for a lab without engines
    from kvpush_prod.lab.cluster import ClusterSpec

NS_DEV = "kveth0"  # the namespace end's name in every namespace
# KV over the network: cross-memory attach (UCX's default on one host) would bypass it.
UCX_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": NS_DEV}
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
SAVED_FORWARD = Path("/tmp/kvpush-netns-ip_forward")  # its value before the first lab
_serial = itertools.count()  # namespace numbers, unique in this process
_NAME = re.compile(r"^kv(?:push|h)(\d+)(?:-\d+)?$")


class NetnsError(RuntimeError):
    """A namespace lab cannot be made or changed."""


@dataclass(frozen=True)
class Link:
    """One namespace and its veth pair."""

    netns: str
    host_dev: str  # this namespace's end
    ns_dev: str  # the namespace's end
    host_ip: str
    ns_ip: str
    lab: str  # the lab's /24, routed via the host end

    @property
    def gateway(self) -> str:
        return self.host_ip


def why_not() -> str | None:
    """Why this machine cannot make namespaces (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (ip netns, tc): run as root or skip the network-namespace cases"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (the ip and tc commands): apt-get install iproute2"
    return None


def _run(*cmd: str, check: bool = True) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _owner(name: str) -> int | None:
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def remove_stale() -> list[str]:
    """Remove the namespaces and host ends of labs whose process is gone; what it removed."""
    removed = []
    for line in _run("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        pid = _owner(name)
        if pid is not None and not psutil.pid_exists(pid):
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    for line in _run("ip", "-o", "link", "show", check=False).splitlines():
        parts = line.split(":")
        dev = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        pid = _owner(dev)
        if pid is not None and not psutil.pid_exists(pid):
            _run("ip", "link", "del", dev, check=False)
            removed.append(dev)
    _restore_forwarding()
    return removed


def _free_lab(subnet: int) -> ipaddress.IPv4Network:
    """A /24 of 10.``subnet``.0.0/16 that no address here is in (tried from this pid's)."""
    used = _run("ip", "-o", "-4", "addr", "show", check=False)
    start = os.getpid() % 250
    for i in range(250):
        net = ipaddress.IPv4Network(f"10.{subnet}.{(start + i) % 250 + 1}.0/24")
        if f" 10.{subnet}.{net.network_address.packed[2]}." not in used:
            return net
    raise NetnsError(f"no free /24 in 10.{subnet}.0.0/16: remove old labs (ip netns list)")


def _links(lab: ipaddress.IPv4Network, n: int, pid: int) -> list[Link]:
    if not 1 <= n <= 63:
        raise NetnsError(f"{n} namespaces: a lab holds 1 to 63 (one /30 each in a /24)")
    base = int(lab.network_address)
    first = next(_serial)
    for _ in range(n - 1):
        next(_serial)
    return [
        Link(
            f"kvpush{pid}-{first + k}",
            f"kvh{pid}-{first + k}",
            NS_DEV,
            str(ipaddress.IPv4Address(base + 4 * k + 1)),
            str(ipaddress.IPv4Address(base + 4 * k + 2)),
            str(lab),
        )
        for k in range(n)
    ]


def _make(link: Link) -> None:
    tmp = link.host_dev.replace("kvh", "kvn", 1)  # the namespace end until it is moved
    _run("ip", "netns", "add", link.netns)
    _run("ip", "link", "add", link.host_dev, "type", "veth", "peer", "name", tmp)
    _run("ip", "link", "set", tmp, "netns", link.netns)
    _run("ip", "addr", "add", f"{link.host_ip}/30", "dev", link.host_dev)
    _run("ip", "link", "set", link.host_dev, "up")
    ns = ("ip", "-n", link.netns)
    _run(*ns, "link", "set", tmp, "name", link.ns_dev)
    _run(*ns, "addr", "add", f"{link.ns_ip}/30", "dev", link.ns_dev)
    _run(*ns, "link", "set", "lo", "up")
    heal(link.netns)


def _remove(link: Link) -> None:
    _run("ip", "link", "del", link.host_dev, check=False)
    _run("ip", "netns", "del", link.netns, check=False)


def _live_labs() -> list[str]:
    """The namespaces of labs whose process still runs (this one's are removed first)."""
    out = []
    for line in _run("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        pid = _owner(name)
        if pid is not None and psutil.pid_exists(pid):
            out.append(name)
    return out


def _restore_forwarding() -> None:
    """``ip_forward`` as it was before the first lab, once no lab is left."""
    if SAVED_FORWARD.exists() and not _live_labs():
        IP_FORWARD.write_text(SAVED_FORWARD.read_text())
        SAVED_FORWARD.unlink(missing_ok=True)


@contextmanager
def _forwarding() -> Iterator[None]:
    """``ip_forward`` on while labs are up. The value before the first is kept in a file, so
    that the last lab to leave (or the next one, after a killed lab) puts it back."""
    if not SAVED_FORWARD.exists():
        SAVED_FORWARD.write_text(IP_FORWARD.read_text())
    IP_FORWARD.write_text("1\n")
    try:
        yield
    finally:
        _restore_forwarding()


@contextmanager
def namespaces(names: Sequence[str], subnet: int = 232) -> Iterator[dict[str, Link]]:
    """One namespace per name, reachable from here and from each other; removed at the end."""
    why = why_not()
    if why is not None:
        raise NetnsError(f"cannot make network namespaces: {why}")
    if len(set(names)) != len(names):
        raise NetnsError(f"namespace names {list(names)} repeat one: give each engine one")
    remove_stale()
    links = dict(zip(names, _links(_free_lab(subnet), len(names), os.getpid()), strict=True))
    with contextlib.ExitStack() as stack:
        stack.enter_context(_forwarding())
        for link in links.values():
            stack.callback(_remove, link)
            _make(link)
        yield links


@contextmanager
def throttled_link(rate: str = "100mbit", subnet: int = 231) -> Iterator[Link]:
    """One namespace whose egress is limited to ``rate`` (``tc tbf``)."""
    with namespaces(["link"], subnet) as links:
        link = links["link"]
        _run("tc", "-n", link.netns, "qdisc", "add", "dev", link.ns_dev, *_tbf(rate, "64kb"))
        yield link


@contextmanager
def cluster_namespaces(spec: ClusterSpec, subnet: int = 232) -> Iterator[dict[str, Link]]:
    """Every prefill and decode engine of ``spec`` in its own namespace (``spec.netns``) with
    its KV over UCX's TCP transport on its link; the router and a reference engine stay
    here. Leave the context after the cluster stopped."""
    from kvpush_prod.lab.cluster import role_names

    names = [*role_names("prefill", spec.prefills), *role_names("decode", spec.decodes)]
    with namespaces(names, subnet) as links:
        spec.netns = {name: (link.netns, link.ns_ip) for name, link in links.items()}
        spec.prefill_env.update(UCX_ENV)
        spec.decode_env.update(UCX_ENV)
        yield links


# -- the nemesis's network faults --------------------------------------------------------------


def _tbf(rate: str, burst: str) -> tuple[str, ...]:
    return ("root", "tbf", "rate", rate, "burst", burst, "latency", "50ms")


def host_dev(netns: str) -> str:
    """The host end of the lab namespace ``netns``'s veth pair."""
    if not netns.startswith("kvpush"):
        raise NetnsError(f"{netns} is not a namespace of lab.netns (kvpush<pid>-<k>)")
    return "kvh" + netns[len("kvpush") :]


def partition(netns: str) -> list[str]:
    """Cut ``netns`` off: its end of the link down (the others' packets to it are dropped, its
    own fail at once). The commands run."""
    cmd = ["ip", "-n", netns, "link", "set", NS_DEV, "down"]
    _run(*cmd)
    return [" ".join(cmd)]


def heal(netns: str) -> list[str]:
    """Its end of the link up again, the route to the lab (a link going down drops it), and
    this host's neighbour entry for it forgotten: an address resolution that failed while
    the link was down would answer the next packets "host unreachable" for a while."""
    up = ["ip", "-n", netns, "link", "set", NS_DEV, "up"]
    _run(*up)
    flush = ["ip", "neigh", "flush", "dev", host_dev(netns)]
    _run(*flush)
    out = _run("ip", "-n", netns, "-o", "-4", "addr", "show", "dev", NS_DEV)
    m = re.search(r"inet (\S+)", out)
    if m is None:
        raise NetnsError(f"{netns}: {NS_DEV} has no IPv4 address: {out.strip()!r}")
    iface = ipaddress.IPv4Interface(m.group(1))
    gateway = next(iter(iface.network.hosts()))
    lab = ipaddress.IPv4Network(f"{iface.ip}/24", strict=False)
    route = ["ip", "-n", netns, "route", "replace", str(lab), "via", str(gateway)]
    _run(*route)
    return [" ".join(up), " ".join(flush), " ".join(route)]


def throttle(netns: str, rate: str) -> list[str]:
    """Both directions of ``netns``'s link limited to ``rate`` (``tc tbf`` on each end's
    egress). The commands run."""
    cmds = [
        ["tc", "-n", netns, "qdisc", "replace", "dev", NS_DEV, *_tbf(rate, "32kb")],
        ["tc", "qdisc", "replace", "dev", host_dev(netns), *_tbf(rate, "32kb")],
    ]
    for cmd in cmds:
        _run(*cmd)
    return [" ".join(c) for c in cmds]


def unthrottle(netns: str) -> list[str]:
    """The link's default queueing back on both ends (no error where there was no limit)."""
    cmds = [
        ["tc", "-n", netns, "qdisc", "del", "dev", NS_DEV, "root"],
        ["tc", "qdisc", "del", "dev", host_dev(netns), "root"],
    ]
    for cmd in cmds:
        _run(*cmd, check=False)
    return [" ".join(c) for c in cmds]
