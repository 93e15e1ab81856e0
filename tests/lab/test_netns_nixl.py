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


def test_a_partition_cuts_the_kv_path_and_healing_restores_it(tmp_path: Path) -> None:
    env = {**os.environ, **netns.UCX_ENV}
    with netns.namespaces(["p", "d"]) as links:
        procs = {
            role: subprocess.Popen(
                ["ip", "netns", "exec", links[role].netns, sys.executable, str(SIDE), role]
                + [str(tmp_path)],
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
            time.sleep(6)  # the partition's length
            netns.heal(links["d"].netns)
            (tmp_path / "healed").write_text("1")
            out_p, _ = procs["p"].communicate(timeout=180)
            (tmp_path / "end").write_text("1")
            out_d, _ = procs["d"].communicate(timeout=60)
        finally:
            for proc in procs.values():
                proc.kill()
    states = dict(line.split()[:2] for line in out_p.splitlines() if line[:1] in "bda")
    assert states.get("before") == "DONE", out_p
    assert states.get("during") == "PROC", out_p  # nothing crossed the cut link
    assert all(states.get(f"after{i}") == "DONE" for i in range(3)), out_p
    assert "b'after2'" in out_d, out_d
