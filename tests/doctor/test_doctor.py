"""``kvpush doctor``: exit 0 on a correct local setup; exit 1 naming the fix for each seeded
mistake (world-readable key, missing allow-list, port taken, a profile whose backend does not
load here, RDMA asked for where UCX would use TCP); exit 2 for usage errors; --peer against a
control endpoint prints latency, bandwidth and skew."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpush_prod.config import load_config
from kvpush_prod.control import ControlCodec, ControlEndpoint, EndpointSecurity
from kvpush_prod.control.keys import generate
from kvpush_prod.doctor import checks
from kvpush_prod.doctor.checks import Status
from kvpush_prod.doctor.cli import EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, main
from kvpush_prod.doctor.peer import ProbePlan
from kvpush_prod.doctor.peercheck import check_peer
from kvpush_prod.lab.launch import free_port
from kvpush_prod.transport import fabric as transports

UCX_ONLY = {"UCX": "", "LIBFABRIC": "nixlNotFoundError: NIXL_ERR_NOT_FOUND"}


class Setup:
    """Keys for an engine and its peer, an allow-list, and the engine's extra config."""

    def __init__(self, root: Path) -> None:
        self.keys, self.allowed = root / "keys", root / "allowed"
        self.allowed.mkdir()
        for name in ("prefill-0", "decode-0"):
            public, _ = generate(name, self.keys)
            (self.allowed / public.name).write_bytes(public.read_bytes())
        self.key_file = self.keys / "prefill-0.key_secret"
        self.port = free_port()
        self.path = root / "extra.yaml"
        self.extra: dict[str, Any] = {
            "control": {
                "key_file": str(self.key_file),
                "allowed_keys": str(self.allowed),
                "port": self.port,
            }
        }

    def write(self, profile: str | None = None, **sections: dict[str, Any]) -> str:
        data = json.loads(json.dumps(self.extra))
        if profile is not None:
            data["profile"] = profile
        for name, values in sections.items():
            data.setdefault(name, {}).update(values)
        self.path.write_text(json.dumps(data))
        return str(self.path)


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    return Setup(tmp_path)


@pytest.fixture
def ucx_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """NIXL's backends as they load on this box (measured once in the exit-0 test)."""
    monkeypatch.setattr(transports, "backends_loading", lambda: dict(UCX_ONLY))


def doctor(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_a_correct_local_setup_passes_with_a_table_and_a_verdict(
    setup: Setup, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = doctor(capsys, "--config", setup.write())  # NIXL really loaded here
    assert code == EXIT_OK, out
    lines = out.splitlines()
    assert lines[0].split() == ["CHECK", "STATUS", "DETAIL"]
    for check in (
        "vLLM version",
        "NIXL version",
        "NIXL backends",
        "transports",
        "key file",
        "allow-list",
        "control ports",
    ):
        assert any(line.startswith(check) for line in lines), (check, out)
    assert "loads: UCX" in out and "2 keys" in out
    assert lines[-1].startswith("kvpush doctor: OK")


def test_a_world_readable_key_is_a_problem_with_its_chmod(
    setup: Setup, capsys: pytest.CaptureFixture[str], ucx_only: None
) -> None:
    setup.key_file.chmod(0o644)
    code, out = doctor(capsys, "--config", setup.write())
    assert code == EXIT_PROBLEMS
    assert "key file           FAIL" in out and "mode 0644" in out
    assert f"fix: make it readable by its owner only: chmod 600 {setup.key_file}" in out
    assert out.splitlines()[-1].startswith("kvpush doctor: 1 problem(s): key file")


def test_a_missing_allow_list_is_a_problem_naming_what_to_put_there(
    setup: Setup, capsys: pytest.CaptureFixture[str], ucx_only: None
) -> None:
    code, out = doctor(
        capsys, "--config", setup.write(control={"allowed_keys": str(setup.allowed) + "-gone"})
    )
    assert code == EXIT_PROBLEMS
    assert "allow-list         FAIL" in out and "no such allow-list" in out
    assert "fix: Give a directory holding every engine's public .key file" in out


def test_an_allow_list_without_this_engines_key_is_a_problem(
    setup: Setup, capsys: pytest.CaptureFixture[str], ucx_only: None
) -> None:
    (setup.allowed / "prefill-0.key").unlink()
    code, out = doctor(capsys, "--config", setup.write())
    assert code == EXIT_PROBLEMS
    assert "fix: copy prefill-0.key into" in out


def test_a_taken_control_port_is_a_problem(
    setup: Setup, capsys: pytest.CaptureFixture[str], ucx_only: None
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", setup.port))
        holder.listen()
        code, out = doctor(capsys, "--config", setup.write())
    assert code == EXIT_PROBLEMS
    assert f"127.0.0.1:{setup.port}: taken: {setup.port} (in use)" in out
    assert "fix: set control.port to a free port" in out


def test_a_profile_asking_for_a_backend_that_does_not_load_here_is_a_problem(
    setup: Setup, capsys: pytest.CaptureFixture[str]
) -> None:
    # efa-p5en: LIBFABRIC over EFA; NIXL really tries to start it (it cannot on this box).
    code, out = doctor(capsys, "--config", setup.write(profile="efa-p5en"))
    assert code == EXIT_PROBLEMS
    assert "NIXL backends      FAIL   profile wants LIBFABRIC" in out
    assert "fix: this host cannot start NIXL's LIBFABRIC backend" in out
    assert "LIBFABRIC with no EFA device" in out


def test_an_advertised_address_not_of_this_host_is_a_problem(
    setup: Setup, capsys: pytest.CaptureFixture[str], ucx_only: None
) -> None:
    ok, out = doctor(capsys, "--config", setup.write(control={"advertise_host": "127.0.0.1"}))
    assert ok == EXIT_OK and "advertise host     ok     127.0.0.1 is an address" in out
    code, out = doctor(
        capsys, "--config", setup.write(control={"advertise_host": "192.0.2.77"})
    )  # TEST-NET-1
    assert code == EXIT_PROBLEMS
    assert "192.0.2.77: not an address of this host" in out
    assert "fix: set control.advertise_host to this engine's own address" in out


def test_rdma_asked_for_where_ucx_would_use_tcp_is_a_problem_naming_the_fix() -> None:
    cfg = load_config("ib-ucx", {"control": {"key_file": None, "allowed_keys": None}})
    mlx = transports.RdmaDevice("mlx5_0", "mlx5_core")
    (none,) = checks.check_transports(cfg, [], {})
    assert none.status is Status.FAIL and "UCX between hosts: tcp" in none.detail
    assert "expose the HCAs" in none.fix
    (tls,) = checks.check_transports(cfg, [mlx], {"UCX_TLS": "tcp,self"})
    assert tls.status is Status.FAIL and "set UCX_TLS=rc" in tls.fix
    (ok,) = checks.check_transports(cfg, [mlx], {"UCX_TLS": "rc,cuda_copy,self"})
    assert ok.status is Status.OK and "rdma (verbs on mlx5_0)" in ok.detail
    (tcp_meant,) = checks.check_transports(load_config(), [], {})
    assert tcp_meant.status is Status.OK


def test_versions_outside_the_matrix_are_problems() -> None:
    found = {"vLLM": "0.31.2", "NIXL": None}
    rows = checks.check_versions(found.get)
    assert [(r.status, r.detail) for r in rows] == [
        (Status.FAIL, "0.31.2, not 0.32.x"),
        (Status.FAIL, "not installed"),
    ]
    assert "pip install 'kvpush-prod[cpu]'" in rows[1].fix


def test_rdma_devices_are_read_from_sysfs(tmp_path: Path) -> None:
    (tmp_path / "drivers" / "efa").mkdir(parents=True)
    root = tmp_path / "infiniband"
    (root / "rdmap0s6" / "device").mkdir(parents=True)
    (root / "rdmap0s6" / "device" / "driver").symlink_to(tmp_path / "drivers" / "efa")
    (dev,) = transports.rdma_devices(root)
    assert dev == transports.RdmaDevice("rdmap0s6", "efa") and dev.efa
    assert transports.rdma_devices(tmp_path / "absent") == []


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--peer", "nohostport"], "write it as HOST:PORT"),
        (["--peer", "h:99999"], "write it as HOST:PORT"),
        (["--config", "/nonexistent/extra.json"], "no such file"),
        (["--ranks", "0"], "must be at least 1"),
    ],
)
def test_usage_errors_exit_2_naming_the_value(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = doctor(capsys, *argv)
    assert code == EXIT_USAGE and says in out and argv[1] in out


@pytest.fixture
def engine(setup: Setup) -> Iterator[ControlEndpoint]:
    """decode-0's control endpoint, driven as its pump drives it."""
    security = EndpointSecurity.from_files(setup.keys / "decode-0.key_secret", setup.allowed)
    ep = ControlEndpoint(ControlCodec(1 << 20), "127.0.0.1", free_port(), security)
    stop = threading.Event()

    def pump() -> None:
        while not stop.is_set():
            list(ep.poll(0.02))

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    yield ep
    stop.set()
    thread.join(5)
    ep.close()


def test_peer_probe_prints_latency_bandwidth_and_skew(
    setup: Setup, engine: ControlEndpoint, capsys: pytest.CaptureFixture[str], ucx_only: None
) -> None:
    port = engine.address.rsplit(":", 1)[1]
    code, out = doctor(capsys, "--config", setup.write(), "--peer", f"127.0.0.1:{port}")
    assert code == EXIT_OK, out
    assert "peer handshake     ok     decode-0 at" in out and "authenticated (CurveZMQ)" in out
    assert "peer latency       ok     round trip p50" in out
    assert "GB/s" in out and "over the control channel" in out
    assert "clock skew         ok" in out
    assert engine.probes > 0


def test_peer_probe_to_a_silent_port_is_a_problem(setup: Setup) -> None:
    cfg = load_config(None, setup.extra)
    (row,) = check_peer(cfg, ("127.0.0.1", free_port()), "decode-0", ProbePlan(timeout_s=0.5))
    assert row.status is Status.FAIL and "no handshake" in row.detail
    assert "control.port" in row.fix


def test_peer_name_is_asked_for_when_the_allow_list_is_ambiguous(
    setup: Setup, capsys: pytest.CaptureFixture[str], ucx_only: None
) -> None:
    public, _ = generate("decode-1", setup.keys)
    (setup.allowed / public.name).write_bytes(public.read_bytes())
    code, out = doctor(capsys, "--config", setup.write(), "--peer", "127.0.0.1:1")
    assert code == EXIT_USAGE and "--peer-name NAME is needed" in out


def test_json_output_holds_every_row_and_the_verdict_follows(
    setup: Setup, capsys: pytest.CaptureFixture[str], ucx_only: None
) -> None:
    setup.key_file.chmod(0o640)
    code, out = doctor(capsys, "--config", setup.write(), "--json")
    body, verdict = out.rsplit("\n", 2)[0], out.splitlines()[-1]
    rows = json.loads(body)
    assert code == EXIT_PROBLEMS and verdict.startswith("kvpush doctor: 1 problem(s): key file")
    (bad,) = [r for r in rows if r["status"] == "FAIL"]
    assert bad["check"] == "key file" and bad["fix"].endswith(
        f"chmod 600 {setup.key_file} (a Kubernetes secret volume: defaultMode: 0400)"
    )
