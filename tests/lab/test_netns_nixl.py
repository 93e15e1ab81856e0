"""KV over the network between namespaces (lab/netns.py): two NIXL agents, each in its own
namespace, UCX over TCP routed through this host (``UCX_ENV``). A WRITE lands; during a
partition of the receiver none completes (the data path is cut, not only the control
plane); after healing, WRITEs complete again on the same agents and connection. No engine;
full run only."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpush_prod.lab import netns
from kvpush_prod.transport.nixl import UCX_TCP_USER_TIMEOUT

pytest.importorskip("nixl")
pytestmark = [
    pytest.mark.nixl,
    pytest.mark.full,
    pytest.mark.skipif(netns.why_not() is not None, reason=str(netns.why_not())),
]

SIDE = Path(__file__).with_name("nixl_side.py")


def _wait(path: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, f"no {path.name}"
        time.sleep(0.1)


def _partitioned(
    tmp_path: Path, cut_s: float, extra: dict[str, str], *args: str
) -> tuple[str, str]:
    """P's and D's output around a partition of D lasting ``cut_s``."""
    env = {**os.environ, **netns.UCX_ENV, **extra}
    with netns.namespaces(["p", "d"]) as links:
        procs = {
            role: subprocess.Popen(
                ["ip", "netns", "exec", links[role].netns, sys.executable, str(SIDE), role]
                + [str(tmp_path), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for role in ("d", "p")
        }
        try:
            _wait(tmp_path / "ready", procs["p"])
            netns.partition(links["d"].netns)
            (tmp_path / "cut").write_text("1")
            time.sleep(cut_s)
            netns.heal(links["d"].netns)
            (tmp_path / "healed").write_text("1")
            out_p, _ = procs["p"].communicate(timeout=180)
            (tmp_path / "end").write_text("1")
            out_d, _ = procs["d"].communicate(timeout=60)
        finally:
            for proc in procs.values():
                proc.kill()
    return out_p, out_d


def test_a_partition_cuts_the_kv_path_and_healing_restores_it(tmp_path: Path) -> None:
    out_p, out_d = _partitioned(tmp_path, 6.0, {})
    states = dict(line.split()[:2] for line in out_p.splitlines() if line[:1] in "bda")
    assert states.get("before") == "DONE", out_p
    assert states.get("during") == "PROC", out_p  # nothing crossed the cut link
    assert all(states.get(f"after{i}") == "DONE" for i in range(3)), out_p
    assert "b'after2'" in out_d, out_d


def test_a_connection_ucx_closed_stays_closed_until_the_agent_is_added_again(
    tmp_path: Path,
) -> None:
    """The driver's rule on REMOTE_DISCONNECT (drop the connection, connect anew), checked
    against NIXL itself: a partition longer than UCX's TCP user timeout (the bound each
    worker sets below its permit) closes the connection; healing does not reopen it; removing
    and re-adding the agent does."""
    out_p, out_d = _partitioned(tmp_path, 8.0, {UCX_TCP_USER_TIMEOUT: "2000ms"}, "reconnect")
    states = {line.split()[0]: line for line in out_p.splitlines() if line[:1] in "bdag"}
    assert "DONE" in states["before"], out_p
    assert "RemoteDisconnect" in states["during"], out_p  # closed by the user timeout
    assert "RemoteDisconnect" in states["after0"], out_p  # and it stays closed
    assert all("DONE" in states[f"again{i}"] for i in range(3)), out_p
    assert "b'again2'" in out_d and "b'after0'" not in out_d, out_d
