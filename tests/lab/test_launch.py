"""Child-process helpers used by demo, tests, benchmarks and chaos: restarts must not race
the dying process, and a failed start-up must show its cause."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil

from kvpush_prod.lab.launch import (
    EngineSpec,
    Proc,
    _port_range,
    engine_env,
    free_port,
    free_port_block,
)

CHILD_TREE = """
import subprocess, sys, time
from multiprocessing import shared_memory
shm = shared_memory.SharedMemory(create=True, size=1 << 16)
print(shm.name, flush=True)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("ready", flush=True)
time.sleep(600)
"""


def test_kill_waits_for_every_process_of_the_tree(tmp_path: Path) -> None:
    proc = Proc("tree", [sys.executable, "-c", CHILD_TREE], {}, tmp_path / "tree.log")
    deadline = time.monotonic() + 30
    log = tmp_path / "tree.log"
    while "ready" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    procs = proc.tree()
    assert len(procs) >= 2  # the script, its sleeping child (and the resource tracker)
    shm_name = log.read_text().split()[-2]
    assert Path("/dev/shm", shm_name.lstrip("/")).exists()
    proc.kill()
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs)
    # The shared memory the killed tree could not unlink is gone too.
    assert not Path("/dev/shm", shm_name.lstrip("/")).exists()
    proc.stop()


def test_tail_shows_this_run_and_the_error_lines_above_it(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    failing = "print('RuntimeError: the root cause')\nfor i in range(100): print('filler', i)\n"
    first = Proc("engine", [sys.executable, "-c", "print('ValueError: a previous run')"], {}, log)
    first.popen.wait(timeout=30)
    first.stop()
    second = Proc("engine", [sys.executable, "-c", failing], {}, log)
    second.popen.wait(timeout=30)
    second.stop()
    tail = second.tail(10)
    assert "RuntimeError: the root cause" in tail
    assert "a previous run" not in tail
    assert tail.splitlines()[-1] == "filler 99"


def test_ports_are_handed_out_below_the_ephemeral_range() -> None:
    lo, hi = _port_range()
    for port in (free_port(), free_port_block(8)):
        assert lo <= port < hi
    assert free_port_block(8) + 8 <= hi


def test_an_engine_in_a_network_namespace_runs_there_and_listens_on_its_addresses() -> None:
    from kvpush_prod.lab.launch import EngineSpec

    plain = EngineSpec("prefill", "model", 8000)
    assert plain.command()[:3] == [sys.executable, "-m", "kvpush_prod.lab.serve"]
    assert plain.command()[plain.command().index("--host") + 1] == "127.0.0.1"
    placed = EngineSpec("prefill", "model", 8000, netns="kvpush1", address="10.231.1.2")
    cmd = placed.command()
    assert cmd[:4] == ["ip", "netns", "exec", "kvpush1"] and cmd[4] == sys.executable
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"


def test_lab_engines_pin_ucx_to_loopback_unless_told_otherwise(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Another program's veth appearing during a run must not reach the lab's engines."""
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    assert engine_env(EngineSpec("p", "m", 1))["UCX_NET_DEVICES"] == "lo"
    # A namespace's engine names its own device (lab/netns.py), as may the caller.
    spec = EngineSpec("p", "m", 1, env={"UCX_NET_DEVICES": "kveth0"})
    assert engine_env(spec)["UCX_NET_DEVICES"] == "kveth0"
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_0:1")
    assert engine_env(EngineSpec("p", "m", 1))["UCX_NET_DEVICES"] == "mlx5_0:1"
