"""The network-namespace lab (lab/netns.py) without engines: namespaces reach each other and
this host through it, a partition cuts one off and healing brings it back (routes too), a
throttle limits both ends, and nothing is left afterwards, after a kill -9 of its process
too. Root and iproute2 only; ~2 s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvpush_prod.lab import netns
from kvpush_prod.lab.launch import free_port

pytestmark = pytest.mark.skipif(netns.why_not() is not None, reason=str(netns.why_not()))

SERVE = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen()
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(b"ok")
    c.close()
"""
CONNECT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as c:
    assert c.recv(2) == b"ok"
"""


def _in(ns: str | None, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *cmd] if ns else list(cmd)


def _reaches(ns: str | None, ip: str, port: int, timeout: float = 10.0) -> bool:
    """Whether a TCP connection from ``ns`` (None: here) to ``ip`` succeeds within ``timeout``
    (a cut link drops the packets: the attempt waits it out)."""
    cmd = _in(ns, sys.executable, "-c", CONNECT, ip, str(port), str(timeout))
    return subprocess.run(cmd, capture_output=True, timeout=30, check=False).returncode == 0


def _lab_names() -> str:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    return out.stdout + links.stdout


@pytest.fixture(scope="module")
def three() -> Iterator[tuple[dict[str, netns.Link], int]]:
    port = free_port()
    with netns.namespaces(["a", "b", "c"]) as links:
        servers = [
            subprocess.Popen(
                _in(link.netns, sys.executable, "-c", SERVE, str(port)),
                stdout=subprocess.PIPE,
                text=True,
            )
            for link in links.values()
        ]
        try:
            for s in servers:
                assert s.stdout is not None and s.stdout.readline().strip() == "ready"
            yield links, port
        finally:
            for s in servers:
                s.kill()
                s.wait()


def test_namespaces_reach_each_other_and_the_host_reaches_them(
    three: tuple[dict[str, netns.Link], int],
) -> None:
    links, port = three
    a, b, c = links["a"], links["b"], links["c"]
    assert len({link.ns_ip for link in links.values()}) == 3
    assert netns.IP_FORWARD.read_text().strip() == "1"
    assert _reaches(a.netns, b.ns_ip, port) and _reaches(c.netns, a.ns_ip, port)
    assert _reaches(None, c.ns_ip, port)


def test_a_partition_cuts_one_namespace_off_until_healed(
    three: tuple[dict[str, netns.Link], int],
) -> None:
    links, port = three
    a, b, c = links["a"], links["b"], links["c"]
    netns.partition(b.netns)
    assert not _reaches(a.netns, b.ns_ip, port, timeout=1.0)
    assert not _reaches(None, b.ns_ip, port, timeout=1.0)
    assert _reaches(a.netns, c.ns_ip, port)  # the others still talk
    netns.heal(b.netns)  # the link and the route to the lab, which the link took with it
    assert _reaches(a.netns, b.ns_ip, port) and _reaches(b.netns, c.ns_ip, port)
    assert _reaches(None, b.ns_ip, port)


def test_a_throttle_limits_both_ends_and_goes_away(
    three: tuple[dict[str, netns.Link], int],
) -> None:
    links, port = three
    c = links["c"]

    def qdiscs() -> str:
        inside = subprocess.run(
            ["tc", "-n", c.netns, "qdisc", "show", "dev", netns.NS_DEV],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        host = subprocess.run(
            ["tc", "qdisc", "show", "dev", c.host_dev], capture_output=True, text=True, check=True
        ).stdout
        return inside + host

    netns.throttle(c.netns, "10mbit")
    assert qdiscs().count("tbf") == 2 and "10Mbit" in qdiscs()
    assert _reaches(None, c.ns_ip, port)
    netns.unthrottle(c.netns)
    assert "tbf" not in qdiscs()
    netns.unthrottle(c.netns)  # twice: no error


def test_everything_is_removed_at_the_end_and_after_a_failure() -> None:
    before = netns.IP_FORWARD.read_text()
    made: list[str] = []
    with pytest.raises(RuntimeError, match="boom"), netns.namespaces(["x", "y"]) as links:
        made = [name for link in links.values() for name in (link.netns, link.host_dev)]
        assert all(name in _lab_names() for name in made)
        raise RuntimeError("boom")
    assert made and not any(name in _lab_names() for name in made)
    assert netns.IP_FORWARD.read_text() == before


def test_a_killed_labs_leftovers_are_removed_by_the_next() -> None:
    before = netns.IP_FORWARD.read_text()
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from kvpush_prod.lab.netns import namespaces\n"
            "with namespaces(['x']):\n    print('ready', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert f"kvpush{child.pid}-0" in _lab_names()  # nothing ran its cleanup
    removed = netns.remove_stale()
    assert f"kvpush{child.pid}-0" in removed
    assert f"kvpush{child.pid}" not in _lab_names() and f"kvh{child.pid}" not in _lab_names()
    assert netns.IP_FORWARD.read_text() == before


def test_bad_input_is_refused_with_the_value() -> None:
    with pytest.raises(netns.NetnsError, match="repeat"), netns.namespaces(["a", "a"]):
        pass
    with pytest.raises(netns.NetnsError, match="not a namespace of lab.netns"):
        netns.host_dev("other")


def test_a_cluster_spec_is_placed_one_engine_per_namespace(tmp_path: object) -> None:
    from pathlib import Path

    from kvpush_prod.lab.cluster import Cluster, ClusterSpec

    assert isinstance(tmp_path, Path)
    spec = ClusterSpec(workdir=tmp_path, prefills=2, decodes=2)
    with netns.cluster_namespaces(spec) as links:
        cluster = Cluster(spec)
        assert sorted(links) == sorted(cluster.engine_names)
        for name in cluster.engine_names:
            engine = cluster._placed(cluster._engine_spec(name))
            control = engine.kv_transfer_config["kv_connector_extra_config"]["control"]  # type: ignore[index]
            assert (engine.netns, engine.address) == (links[name].netns, links[name].ns_ip)
            assert control["host"] == "0.0.0.0" and control["advertise_host"] == engine.address
            assert engine.env["UCX_TLS"] == "tcp,self" and engine.env["UCX_NET_DEVICES"] == "kveth0"
        assert cluster._placed(cluster._engine_spec("reference")).netns is None
