"""Start and stop real engines and the router as child processes (demo, tests, benchmarks, chaos).

Engines are plain children (not new sessions: two CPU engines in separate sessions hang on
their first P/D request), and each is stopped with its whole process tree.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from kvpush_prod.control.endpoint import ephemeral_range
from kvpush_prod.lab.tinymodel import write_tiny_model

DEFAULT_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


RUN_MARKER = "=== kvpush: start of"
_CAUSE = re.compile(r"Error|Exception|error:|Traceback|Killed|Address already in use")


def _port_range() -> tuple[int, int]:
    """Ports to hand out: below Linux's ephemeral range (32768+ by default), so that an
    outgoing connection of another process cannot take an engine's port while it restarts."""
    lo, hi = ephemeral_range() or (32768, 60999)
    if lo > 11000:
        return 10000, lo
    return (hi + 1, 65500) if hi < 64000 else (10000, 60000)


def router_command(port: int) -> list[str]:
    """The command that starts a kvpush router on 127.0.0.1:``port``; its backends and
    options follow."""
    return [sys.executable, "-m", "kvpush_prod.router", "--host", "127.0.0.1", "--port", str(port)]


def free_port() -> int:
    """A port free now, outside the ephemeral range."""
    return free_port_block(1)


def free_port_block(n: int) -> int:
    """A base port p such that p..p+n-1 are all free now, outside the ephemeral range."""
    import random

    start, end = _port_range()
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(200):
        base = rng.randrange(start, end - n)
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port block found")


@dataclass
class EngineSpec:
    """One vLLM OpenAI server to start."""

    name: str
    model: str
    port: int
    kv_transfer_config: dict[str, Any] | None = None
    dtype: str = "float32"
    block_size: int | None = None
    max_model_len: int = 2048
    max_num_seqs: int | None = None
    cpu_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0" or "1"
    kv_cache_gib: int = 1
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # A network namespace to run in (``ip netns exec``; the caller made it), and the address
    # the engine is reached at there (it then listens on every address of the namespace).
    netns: str | None = None
    address: str = "127.0.0.1"
    # Another kvpush-prod release to run (``lab.release``): a directory holding it installed
    # (``pip install --target``), put alone on the engine's PYTHONPATH so that its
    # kvpush_prod is the one imported; vLLM and NIXL come from this interpreter. None: this
    # checkout's, as the test process imports it.
    release: str | None = None

    def command(self) -> list[str]:
        inside = ["ip", "netns", "exec", self.netns] if self.netns else []
        cmd = [
            *inside,
            sys.executable,
            "-m",
            "kvpush_prod.lab.serve",
            self.model,
            "--host",
            "0.0.0.0" if self.netns else "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--enforce-eager",
            "--seed",
            "0",
            "--max-model-len",
            str(self.max_model_len),
            "--served-model-name",
            "tiny",
        ]
        if self.block_size:
            cmd += ["--block-size", str(self.block_size)]
        if self.max_num_seqs:
            cmd += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return cmd + self.extra_args


class Proc:
    """A started child process and its log file."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.log_path = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log, "ab")  # noqa: SIM115 - lives as long as the process
        # Restarts append to the same log: a marker lets tail() show this run only.
        self._log.write(f"{RUN_MARKER} {name} {time.strftime('%H:%M:%S')}\n".encode())
        self._log.flush()
        self.popen = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def signal_tree(self, sig: int) -> None:
        for p in self.tree():
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL the whole tree (what a crash looks like) and wait until every process of it
        is gone: a restart must not race a dying child that still holds a port."""
        procs = self.tree()
        shm = _shared_memory_of(procs)
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(procs, timeout=30)
        self.popen.wait(timeout=30)
        # A killed tree cannot unlink its shared memory (vLLM's engine core maps a segment
        # of 160-240 MiB): remove it, as a container restart would.
        for path in shm:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def stop(self, timeout: float = 20.0) -> None:
        procs = self.tree()
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=timeout)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(alive, timeout=10)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        self._log.close()

    def tail(self, n: int = 40) -> str:
        """The last ``n`` lines of this run's log, after the lines that name an error earlier
        in it (vLLM's own message says only "see root cause above")."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        for i in range(len(lines) - 1, -1, -1):
            if lines[i].startswith(RUN_MARKER):
                lines = lines[i + 1 :]
                break
        head = len(lines) - n
        causes = [line for line in lines[: max(0, head)] if _CAUSE.search(line)][-20:]
        out = lines[-n:]
        if causes:
            out = ["[earlier lines naming an error]", *causes, "[last lines]", *out]
        return "\n".join(out)


def _shared_memory_of(procs: list[psutil.Process]) -> set[str]:
    """The /dev/shm files mapped by ``procs``. Read from /proc/PID/maps, not psutil's
    ``memory_maps()`` (smaps: ~2 s for an engine's tree), so that a kill follows its
    decision at once."""
    paths: set[str] = set()
    for p in procs:
        with contextlib.suppress(OSError), open(f"/proc/{p.pid}/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[5:]
                if path and path[0].startswith("/dev/shm/"):
                    paths.add(path[0].removesuffix(" (deleted)"))
    return paths


# The lab's engines talk over loopback: UCX is pinned to it unless the caller's environment
# names its devices (a namespace's veth, lab/netns.py, sets its own). UCX otherwise
# enumerates every interface of the host and advertises their addresses, so a veth that
# another program adds and removes during a run leaves engines with addresses that refuse
# connects (docs/operations.md, "Interfaces"; the hour-long nemesis saw one leaked UCX
# socket per refused connect).
LAB_UCX_NET_DEVICES = "lo"


def engine_env(spec: EngineSpec) -> dict[str, str]:
    env = dict(os.environ)
    env.update(DEFAULT_ENV)
    env.setdefault("UCX_NET_DEVICES", LAB_UCX_NET_DEVICES)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.kv_cache_gib)
    if spec.cpu_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpu_bind
    env.update(spec.env)
    if spec.release is not None:
        env["PYTHONPATH"] = spec.release
    return env


def start_engine(spec: EngineSpec, log_dir: Path) -> Proc:
    return Proc(spec.name, spec.command(), engine_env(spec), log_dir / f"{spec.name}.log")


def wait_healthy(
    url: str, proc: Proc | None = None, timeout: float = 300.0, ca_file: Path | None = None
) -> None:
    """Wait for ``url``/health to answer 200; raise with the log tail if the process died.
    An https:// ``url`` is verified against ``ca_file`` (the lab's CA) when given."""
    context = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited during start-up:\n{proc.tail()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2, context=context) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(
        f"{url} not healthy after {timeout}s" + (f":\n{proc.tail()}" if proc else "")
    )


def push_kv_config(
    role: str,
    profile: str | None,
    control_port: int,
    extra: dict[str, Any] | None = None,
    engine_id: str | None = None,
    kv_load_failure_policy: str | None = None,
    security: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``kv_transfer_config`` that loads PushConnector (``security``: the control keys and
    params key, merged before ``extra`` so a test can override them)."""
    extra_config: dict[str, Any] = {"control": {"port": control_port}}
    if profile:
        extra_config["profile"] = profile
    for key, value in [*(security or {}).items(), *(extra or {}).items()]:
        if isinstance(value, dict):
            extra_config.setdefault(key, {}).update(value)
        else:
            extra_config[key] = value
    cfg: dict[str, Any] = {
        "kv_connector": "PushConnector",
        "kv_connector_module_path": "kvpush_prod.connector",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": extra_config,
    }
    if engine_id:
        cfg["engine_id"] = engine_id
    if kv_load_failure_policy:
        cfg["kv_load_failure_policy"] = kv_load_failure_policy
    return cfg


def ensure_model(root: Path) -> str:
    return str(write_tiny_model(root / "tiny-llama"))


# -- TLS for the legs (the lab's own CA; never for production) -----------------------------

_CA_EXTENSIONS = """[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
"""
_LEAF_EXTENSIONS = """[leaf]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = {usage}
subjectAltName = {names}
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
"""


@dataclass(frozen=True)
class TlsFiles:
    """A CA and one certificate it signed, as PEM files."""

    ca: Path  # the CA's certificate: the router's --backend-ca-file
    ca_key: Path
    cert: Path  # an engine's --ssl-certfile (or a client certificate)
    key: Path  # its --ssl-keyfile (unencrypted)


# ``openssl req`` arguments for a new request with a new unencrypted P-256 key.
_NEW_P256_KEY = ("-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")


def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise RuntimeError(
            "the openssl command is not installed; the lab makes its TLS "
            "certificates with it: install openssl (apt-get install openssl)"
        )
    done = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"openssl {' '.join(args[:2])} failed ({done.returncode}): {done.stderr.strip()[-500:]}"
        )


def make_ca(directory: Path, name: str = "kvpush-lab") -> tuple[Path, Path]:
    """A fresh self-signed CA (P-256, 30 days) in ``directory``: (certificate, key)."""
    directory.mkdir(parents=True, exist_ok=True)
    ext = directory / f"{name}-ca.cnf"
    ext.write_text("[req]\ndistinguished_name = dn\n[dn]\n" + _CA_EXTENSIONS)
    cert, key = directory / f"{name}-ca.pem", directory / f"{name}-ca.key"
    _openssl(
        "req",
        "-x509",
        *_NEW_P256_KEY,
        "-keyout",
        key.name,
        "-out",
        cert.name,
        "-days",
        "30",
        "-subj",
        f"/CN={name} CA",
        "-config",
        ext.name,
        "-extensions",
        "ca",
        cwd=directory,
    )
    key.chmod(0o600)
    return cert, key


def issue_cert(
    ca: tuple[Path, Path],
    directory: Path,
    name: str,
    hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
    client: bool = False,
) -> TlsFiles:
    """A certificate ``ca`` signs for ``hosts`` (IP addresses and DNS names; a server's, or
    with ``client`` a client's for mutual TLS), with its key, in ``directory``."""
    ca_cert, ca_key = ca
    directory.mkdir(parents=True, exist_ok=True)
    names = ",".join(f"IP:{h}" if _is_ip(h) else f"DNS:{h}" for h in hosts)
    ext = directory / f"{name}.cnf"
    ext.write_text(
        "[req]\ndistinguished_name = dn\n[dn]\n"
        + _LEAF_EXTENSIONS.format(usage="clientAuth" if client else "serverAuth", names=names)
    )
    cert, key, csr = (directory / f"{name}{s}" for s in (".pem", ".key", ".csr"))
    _openssl(
        "req",
        *_NEW_P256_KEY,
        "-keyout",
        key.name,
        "-out",
        csr.name,
        "-subj",
        f"/CN={hosts[0]}",
        "-config",
        ext.name,
        cwd=directory,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        csr.name,
        "-CA",
        str(ca_cert),
        "-CAkey",
        str(ca_key),
        "-set_serial",
        str(int.from_bytes(os.urandom(8), "big")),
        "-days",
        "30",
        "-out",
        cert.name,
        "-extfile",
        ext.name,
        "-extensions",
        "leaf",
        cwd=directory,
    )
    key.chmod(0o600)
    return TlsFiles(ca_cert, ca_key, cert, key)


def make_tls(directory: Path, name: str = "kvpush-lab") -> TlsFiles:
    """A fresh CA and a server certificate it signed for 127.0.0.1 and localhost."""
    ca = make_ca(directory, name)
    return issue_cert(ca, directory, f"{name}-server")


def _is_ip(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
    except OSError:
        return False
    return True
