"""Which transports a P-D pair would use on this host: the NIXL backends that load, the RDMA
devices the kernel shows (InfiniBand, RoCE, EFA), and what ``UCX_TLS`` allows. Shared by
``kvpush doctor`` and the slow-link guard's log line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SYS_RDMA = Path("/sys/class/infiniband")
# UCX transport names that move data over an RDMA device (ucx_info -d names them).
RDMA_TLS = (
    "rc",
    "rc_v",
    "rc_x",
    "rc_mlx5",
    "dc",
    "dc_x",
    "dc_mlx5",
    "ud",
    "ud_v",
    "ud_x",
    "ud_mlx5",
    "ib",
    "srd",
)
BACKENDS = ("UCX", "LIBFABRIC")  # transport.backend's choices

_LOAD_SCRIPT = """
import contextlib, json, os, sys
from kvpush_prod.transport.nixl import make_agent
out = {}
for name in sys.argv[1:]:
    try:
        make_agent("kvpush-doctor-" + name.lower(), name, False, 10000)
        out[name] = ""
    except Exception as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
print("KVPUSH_DOCTOR " + json.dumps(out))
"""


@dataclass(frozen=True)
class RdmaDevice:
    name: str
    driver: str  # e.g. mlx5_core, efa, irdma (from the device's driver link)

    @property
    def efa(self) -> bool:
        return self.driver == "efa" or self.name.startswith("efa")


def rdma_devices(root: Path = SYS_RDMA) -> list[RdmaDevice]:
    """The RDMA devices the kernel shows this container (none: no verbs, only TCP)."""
    if not root.is_dir():
        return []
    found = []
    for dev in sorted(root.iterdir()):
        driver = dev / "device" / "driver"
        found.append(RdmaDevice(dev.name, driver.resolve().name if driver.exists() else ""))
    return found


def ucx_tls(env: Mapping[str, str]) -> list[str] | None:
    """UCX_TLS as a list (None: unset, UCX picks from every transport it finds)."""
    raw = env.get("UCX_TLS", "").strip()
    if not raw or raw == "all":
        return None
    return [t.strip().lstrip("^") for t in raw.split(",") if t.strip()]


def inter_host_ucx(devices: list[RdmaDevice], env: Mapping[str, str]) -> tuple[str, str]:
    """What UCX would move KV over between two hosts: ("rdma" | "tcp", why)."""
    verbs = [d for d in devices if not d.efa]
    if not verbs:
        return "tcp", (
            f"no InfiniBand/RoCE device in {SYS_RDMA}"
            if not devices
            else "the only RDMA devices are EFA, which UCX does not drive"
        )
    tls = ucx_tls(env)
    negated = env.get("UCX_TLS", "").strip().startswith("^")
    if tls is not None and not negated and not any(t in RDMA_TLS for t in tls):
        return "tcp", f"UCX_TLS={env['UCX_TLS']} names no RDMA transport (rc, dc, ud)"
    return "rdma", "verbs on " + ", ".join(d.name for d in verbs)


def backends_loading(names: tuple[str, ...] = BACKENDS, timeout_s: float = 60.0) -> dict[str, str]:
    """Each NIXL backend -> "" when it starts here, else why not. In a child process: NIXL
    logs to stderr and a plugin may abort its process."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _LOAD_SCRIPT, *names],
            text=True,
            capture_output=True,
            timeout=timeout_s,
            check=False,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
    except subprocess.TimeoutExpired:
        return dict.fromkeys(names, f"starting NIXL took over {timeout_s:g} s")
    for line in proc.stdout.splitlines():
        if line.startswith("KVPUSH_DOCTOR "):
            got: dict[str, str] = json.loads(line.removeprefix("KVPUSH_DOCTOR "))
            return got
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return dict.fromkeys(names, f"NIXL did not start (exit {proc.returncode}): {tail}")


def describe(
    backend: str, env: Mapping[str, str] | None = None, devices: list[RdmaDevice] | None = None
) -> str:
    """One line of the transports a link would use (for logs): backend, UCX_TLS, devices."""
    env = os.environ if env is None else env
    devices = rdma_devices() if devices is None else devices
    parts = [f"NIXL backend {backend}"]
    if backend == "UCX":
        kind, why = inter_host_ucx(devices, env)
        parts.append(f"UCX between hosts: {kind} ({why})")
        parts.append(f"UCX_TLS={env.get('UCX_TLS', '(unset)')}")
        if env.get("UCX_NET_DEVICES"):
            parts.append(f"UCX_NET_DEVICES={env['UCX_NET_DEVICES']}")
    else:
        efa = [d.name for d in devices if d.efa]
        parts.append("EFA devices: " + (", ".join(efa) if efa else "none"))
    return "; ".join(parts)
