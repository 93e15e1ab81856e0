"""``kvpush doctor --peer`` against a running engine: the decode engine's control port answers
an allow-listed key's probe, and the doctor prints latency, bandwidth and clock skew (exit 0);
a key the engines do not list gets no handshake (exit 1, named)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpush_prod.lab.cluster import Cluster, ClusterSpec
from kvpush_prod.lab.launch import free_port

# Full run only (KVPUSH_E2E_EXTRA=1): an engine of its own for the doctor's probe; its checks are unit-tested; CI's budget (README, "Tests").
pytestmark = [pytest.mark.e2e, pytest.mark.full]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    spec = ClusterSpec(
        workdir=tmp_path_factory.mktemp("doctor-peer"),
        reference=False,
        router=False,
        extra_keys=("doctor",),
    )
    with Cluster(spec) as c:
        yield c


def doctor(tmp: Path, cluster: Cluster, key: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    config = tmp / "extra.json"
    config.write_text(
        json.dumps(
            {
                "profile": "cpu-loopback",
                "control": {
                    "key_file": str(key),
                    "allowed_keys": str(cluster.allowed_dir),
                    "port": free_port(),
                },
            }
        )
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpush_prod.cli",
            "doctor",
            "--config",
            str(config),
            "--peer",
            f"127.0.0.1:{cluster.d_control}",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_doctor_measures_a_running_engine_over_its_control_port(
    engines: Cluster, tmp_path: Path
) -> None:
    done = doctor(tmp_path, engines, engines.key_file("doctor"), "--peer-name", "decode")
    out = done.stdout
    print(out)  # the table, for the log: measured latency and bandwidth on this box
    assert done.returncode == 0, out + done.stderr
    assert f"decode at tcp://127.0.0.1:{engines.d_control}: authenticated (CurveZMQ)" in out
    latency = next(line for line in out.splitlines() if line.startswith("peer latency"))
    bandwidth = next(line for line in out.splitlines() if line.startswith("peer bandwidth"))
    assert "round trip p50" in latency and "GB/s" in bandwidth
    assert "clock skew         ok" in out
    assert out.splitlines()[-1].startswith("kvpush doctor: OK")


def test_a_key_the_engines_do_not_list_gets_no_handshake(engines: Cluster, tmp_path: Path) -> None:
    from kvpush_prod.control.keys import generate

    _, secret = generate("stranger", tmp_path / "keys")
    done = doctor(tmp_path, engines, secret, "--peer-name", "decode")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "peer               FAIL   the handshake with" in done.stdout
