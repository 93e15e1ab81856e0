"""A local P/D cluster on one machine: prefill and decode engines with PushConnector, the
router, and optionally a plain single engine as the reference. Used by demo, tests, chaos, bench.
"""

from __future__ import annotations

import dataclasses
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush_prod.config.profiles import SCHEME
from kvpush_prod.control.keys import generate
from kvpush_prod.lab.client import metric_sum, scrape
from kvpush_prod.lab.launch import (
    EngineSpec,
    Proc,
    TlsFiles,
    free_port,
    free_port_block,
    make_tls,
    push_kv_config,
    router_command,
    start_engine,
    wait_healthy,
)
from kvpush_prod.lab.tinymla import TinyMlaSpec, write_tiny_mla_model
from kvpush_prod.lab.tinymodel import TinyModelSpec, write_tiny_model
from kvpush_prod.signing import sign_params


def default_profile() -> str:
    """The shipped cpu-loopback profile, by name (engines find it in the installed package)."""
    return SCHEME + "cpu-loopback"


@dataclass
class ClusterSpec:
    """What to start."""

    workdir: Path
    block_size: int | None = None
    profile: str | None = None
    reference: bool = True
    router: bool = True
    prefill_kv_gib: int = 1
    decode_kv_gib: int = 2
    max_num_seqs: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config overrides
    prefill_extra: dict[str, Any] = field(default_factory=dict)
    decode_extra: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: str | None = None
    prefill_env: dict[str, str] = field(default_factory=dict)
    decode_env: dict[str, str] = field(default_factory=dict)
    router_args: list[str] = field(default_factory=list)
    # The router's direct_below_tokens: prompts estimated below it go to D alone (no
    # transfer). 0 here, unlike the router's own default: the lab's tests, chaos runs and
    # benches send short prompts and mean them to be pushed; a cluster that tests the
    # direct path sets it (None: the router's default).
    direct_below_tokens: int | None = 0
    engine_args: list[str] = field(default_factory=list)
    prefill_args: list[str] = field(default_factory=list)  # extra engine args, P only
    decode_args: list[str] = field(default_factory=list)  # extra engine args, D only
    prefill_engine_id: str | None = None
    decode_engine_id: str | None = None
    # Shape of the generated model: the lab's tiny Llama, or a tiny DeepSeek-style MLA model.
    model: TinyModelSpec | TinyMlaSpec | None = None
    # Each engine gets its own CurveZMQ key pair and the allow-list of the cluster's keys
    # (plus ``extra_keys``, engines that may authenticate but own nothing: hostile tests).
    secure: bool = True
    extra_keys: tuple[str, ...] = ()
    # The router signs kv_transfer_params with a params key the engines require.
    signed_params: bool = True
    # How many prefill and decode engines: the first of each role is named "prefill" and
    # "decode", the others "prefill-1", "decode-1", ... (P on core 0, D on core 1).
    prefills: int = 1
    decodes: int = 1
    # Tensor-parallel sizes (at most 4: the control ports reserved per engine).
    prefill_tp: int = 1
    decode_tp: int = 1
    # A running single engine to compare answers with (``SharedReference``); the cluster
    # then starts none of its own.
    reference_url: str | None = None
    # TLS on the legs: the prefill and decode engines serve https:// (vLLM's --ssl-keyfile
    # and --ssl-certfile) with a certificate from the cluster's own CA (``Cluster.tls``), and
    # the router verifies them against it (--backend-ca-file). The reference engine stays
    # plain http. Other clients of the engines must trust ``Cluster.tls.ca`` (httpx's
    # default clients, such as lab.client.scrape, do with SSL_CERT_FILE set to it).
    tls: bool = False
    # Engines run in network namespaces the caller made (``lab.netns``): name -> (namespace,
    # the engine's address there). Such an engine's control listens on 0.0.0.0 and
    # advertises that address (the extras may override both).
    netns: dict[str, tuple[str, str]] = field(default_factory=dict)
    # Engines that run another kvpush-prod release: name -> the directory it is installed in
    # (``lab.release.install``; ``EngineSpec.release``). ``Cluster.upgrade`` moves one.
    releases: dict[str, str] = field(default_factory=dict)


def tp_args(tp: int, core: str) -> tuple[list[str], str]:
    """Engine arguments and the CPU binding (VLLM_CPU_OMP_THREADS_BIND) for ``tp`` ranks on
    the role's ``core``. Every rank stays on the role's core: an engine of TP > 1 whose
    requests wait on the connector keeps stepping, and its ranks then spin in vLLM's
    shared-memory queue; ranks spread over both cores were seen to starve the other
    engine for 9-27 s (its pump unheard, its leases expiring)."""
    if not 1 <= tp <= 4:
        raise ValueError(f"tensor-parallel size {tp}: the lab runs 1 to 4 ranks per engine")
    if tp == 1:
        return [], core
    return ["--tensor-parallel-size", str(tp)], "|".join([core] * tp)


def role_names(role: str, n: int) -> list[str]:
    """``role``, ``role-1``, ... (the first keeps the plain name tests and tools use)."""
    return [role] + [f"{role}-{i}" for i in range(1, n)]


def _engine_id(base: str | None, name: str, first: str) -> str | None:
    """The spec's engine id for the first engine of a role, ``<id>-<name>`` for the others
    (None: vLLM picks one)."""
    if base is None or name == first:
        return base
    return f"{base}-{name}"


class Cluster:
    """Start with ``start()``, stop with ``stop()`` (or use as a context manager)."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        if isinstance(spec.model, TinyMlaSpec):
            self.model = str(write_tiny_mla_model(spec.workdir / "tiny-mla", spec.model))
        else:
            self.model = str(write_tiny_model(spec.workdir / "tiny-llama", spec.model))
        self.log_dir = spec.workdir / "logs"
        self.procs: dict[str, Proc] = {}
        self.specs: dict[str, EngineSpec] = {}
        self.urls: dict[str, str] = {}
        self.start_s: float | None = None  # how long start() took until every engine served
        if spec.reference_url:
            self.urls["reference"] = spec.reference_url
        self.prefill_names = role_names("prefill", spec.prefills)
        self.decode_names = role_names("decode", spec.decodes)
        # Four control ports per engine (TP ranks), one block for all of them.
        ports = free_port_block(4 * (spec.prefills + spec.decodes))
        self.control_ports = {
            name: ports + 4 * i for i, name in enumerate(self.prefill_names + self.decode_names)
        }
        self.p_control, self.d_control = self.control_ports["prefill"], self.control_ports["decode"]
        self.router_port = free_port()
        self.keys_dir = spec.workdir / "keys"
        self.allowed_dir = spec.workdir / "allowed"
        self.params_key_file = spec.workdir / "params.key"
        if spec.secure:
            self._make_keys((*self.prefill_names, *self.decode_names, *spec.extra_keys))
        if spec.signed_params:
            self.params_key_file.write_text(secrets.token_hex(32) + "\n")
            self.params_key_file.chmod(0o600)
        # A fresh CA per cluster: nothing outside this cluster's workdir is trusted by it.
        self.tls: TlsFiles | None = make_tls(spec.workdir / "tls") if spec.tls else None

    def _make_keys(self, names: tuple[str, ...]) -> None:
        """A fresh key pair per engine name and an allow-list directory holding them all."""
        shutil.rmtree(self.allowed_dir, ignore_errors=True)
        self.allowed_dir.mkdir(parents=True)
        for name in names:
            public, _ = generate(name, self.keys_dir, force=True)
            shutil.copy(public, self.allowed_dir / public.name)

    def sign(self, params: dict[str, Any], leg: str) -> dict[str, Any]:
        """``params`` as the cluster's router would send them on ``leg`` (signed when it
        signs)."""
        if not self.spec.signed_params:
            return params
        return sign_params(
            params, self.params_key_file.read_text().strip().encode(), time.time(), leg
        )

    def key_file(self, name: str) -> Path:
        return self.keys_dir / f"{name}.key_secret"

    def _security_extra(self, name: str) -> dict[str, Any]:
        """The control settings the cluster chooses: keys, params key and, for an engine in a
        network namespace, listening on all its addresses and advertising its own."""
        control: dict[str, Any] = {}
        if name in self.spec.netns:
            control.update(host="0.0.0.0", advertise_host=self.spec.netns[name][1])
        if self.spec.secure:
            control.update(key_file=str(self.key_file(name)), allowed_keys=str(self.allowed_dir))
        if self.spec.signed_params:
            control["params_key_file"] = str(self.params_key_file)
        return {"control": control} if control else {}

    def _engine_spec(self, name: str) -> EngineSpec:
        s = self.spec
        profile = s.profile or default_profile()
        common: dict[str, Any] = {
            "model": self.model,
            "block_size": s.block_size,
            "max_num_seqs": s.max_num_seqs,
            "extra_args": list(s.engine_args),
        }
        if isinstance(s.model, TinyMlaSpec):
            common["extra_args"] += s.model.engine_args()
        if self.tls is not None and name in self.engine_names:
            common["extra_args"] += [
                "--ssl-keyfile",
                str(self.tls.key),
                "--ssl-certfile",
                str(self.tls.cert),
            ]
        if name in self.prefill_names:
            kv = push_kv_config(
                "kv_producer",
                profile,
                self.control_ports[name],
                {**s.extra, **s.prefill_extra},
                _engine_id(s.prefill_engine_id, name, "prefill"),
                security=self._security_extra(name),
            )
            args, bind = tp_args(s.prefill_tp, "0")
            common["extra_args"] += s.prefill_args + args
            return EngineSpec(
                name,
                port=free_port(),
                kv_transfer_config=kv,
                cpu_bind=bind,
                kv_cache_gib=s.prefill_kv_gib,
                env=dict(s.prefill_env),
                **common,
            )
        if name in self.decode_names:
            kv = push_kv_config(
                "kv_consumer",
                profile,
                self.control_ports[name],
                {**s.extra, **s.decode_extra},
                _engine_id(s.decode_engine_id, name, "decode"),
                s.kv_load_failure_policy,
                security=self._security_extra(name),
            )
            args, bind = tp_args(s.decode_tp, "1")
            common["extra_args"] += s.decode_args + args
            return EngineSpec(
                name,
                port=free_port(),
                kv_transfer_config=kv,
                cpu_bind=bind,
                kv_cache_gib=s.decode_kv_gib,
                env=dict(s.decode_env),
                **common,
            )
        return EngineSpec(name, port=free_port(), cpu_bind="0", **common)

    def start(self, timeout: float = 600.0) -> Cluster:
        names = [*self.prefill_names, *self.decode_names] + (
            ["reference"] if self.spec.reference and not self.spec.reference_url else []
        )
        t0 = time.monotonic()
        for name in names:
            self.start_engine(name, wait=False)
        try:
            for name in names:
                wait_healthy(self.urls[name], self.procs[name], timeout, self._ca)
            self.start_s = time.monotonic() - t0
            if self.spec.router:
                self.start_router()
        except BaseException:
            self.stop()
            raise
        return self

    def start_engine(self, name: str, wait: bool = True, timeout: float = 600.0) -> None:
        """(Re)start one engine; a restart keeps its port and engine id."""
        spec = self.specs.get(name) or self._placed(self._engine_spec(name))
        self.specs[name] = spec
        scheme = "https" if self.tls is not None and name in self.engine_names else "http"
        self.urls[name] = f"{scheme}://{spec.address}:{spec.port}"
        self.procs[name] = start_engine(spec, self.log_dir)
        if wait:
            wait_healthy(self.urls[name], self.procs[name], timeout, self._ca)

    def upgrade(self, name: str, release: str | None = None) -> None:
        """Run ``name`` on ``release`` (None: this checkout's) from its next (re)start."""
        if release is None:
            self.spec.releases.pop(name, None)
        else:
            self.spec.releases[name] = release
        if name in self.specs:
            self.specs[name] = dataclasses.replace(self.specs[name], release=release)

    def _placed(self, spec: EngineSpec) -> EngineSpec:
        if spec.name in self.spec.releases:
            spec = dataclasses.replace(spec, release=self.spec.releases[spec.name])
        if spec.name not in self.spec.netns:
            return spec
        netns, address = self.spec.netns[spec.name]
        return dataclasses.replace(spec, netns=netns, address=address)

    @property
    def _ca(self) -> Path | None:
        return self.tls.ca if self.tls is not None else None

    def start_router(self) -> None:
        cmd = router_command(self.router_port)
        for name in self.prefill_names:
            cmd += ["--prefill", self.urls[name]]
        for name in self.decode_names:
            cmd += ["--decode", self.urls[name]]
        if self.spec.direct_below_tokens is not None:
            cmd += ["--direct-below-tokens", str(self.spec.direct_below_tokens)]
        cmd += self.spec.router_args
        if self.spec.signed_params:
            cmd += ["--params-key-file", str(self.params_key_file)]
        if self.spec.secure:
            cmd.append("--probe-decode")  # D's key goes to P: only that D may register
        if self.tls is not None:
            cmd += ["--backend-ca-file", str(self.tls.ca)]
        import os

        self.procs["router"] = Proc("router", cmd, dict(os.environ), self.log_dir / "router.log")
        self.urls["router"] = f"http://127.0.0.1:{self.router_port}"
        wait_healthy(self.urls["router"], self.procs["router"], 120)

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- observation
    def metrics(self, name: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return scrape(self.urls[name])

    def block_size(self, name: str = "decode") -> int:
        """The engine's KV block size, as it reports it (never assumed)."""
        for (n, labels), _v in self.metrics(name).items():
            if n == "vllm:cache_config_info":
                return int(dict(labels)["block_size"])
        raise RuntimeError(f"{name} does not report vllm:cache_config_info")

    def connector_blocks(self, name: str) -> float:
        return metric_sum(self.metrics(name), "kvpush_connector_blocks")

    @property
    def engine_names(self) -> list[str]:
        """Every prefill and decode engine's name (not the reference)."""
        return [*self.prefill_names, *self.decode_names]

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Wait until both engines hold no blocks for the connector; return the last readings."""
        deadline = time.monotonic() + timeout
        last: dict[str, float] = {}
        while time.monotonic() < deadline:
            last = {
                n: self.connector_blocks(n)
                for n in self.engine_names
                if n in self.procs and self.procs[n].alive()
            }
            if all(v == 0 for v in last.values()):
                return last
            time.sleep(0.5)
        return last


class SharedReference:
    """One plain single engine of the lab's default tiny model (no connector) that many
    clusters compare with (``ClusterSpec.reference_url``): each engine start costs a 2-core
    box ~40 s of CPU. Only for clusters whose reference would be the same engine: the same
    model and block size (the attention kernel's block size could change float sums) and
    no engine arguments or batch limit of their own (``serves``)."""

    def __init__(self, workdir: Path) -> None:
        self.model = str(write_tiny_model(workdir / "tiny-llama", None))
        self.spec = EngineSpec("reference", model=self.model, port=free_port(), cpu_bind="0")
        self.log_dir = workdir / "logs"
        self.url = f"http://127.0.0.1:{self.spec.port}"
        self.proc: Proc | None = None

    def start(self, timeout: float = 600.0) -> str:
        if self.proc is None or not self.proc.alive():
            self.proc = start_engine(self.spec, self.log_dir)
            wait_healthy(self.url, self.proc, timeout)
        return self.url

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    @staticmethod
    def serves(spec: ClusterSpec) -> bool:
        return (
            spec.reference
            and spec.model is None
            and spec.block_size is None
            and spec.max_num_seqs is None
            and not spec.engine_args
        )

    def attach(self, spec: ClusterSpec) -> ClusterSpec:
        """``spec``, comparing with this engine when it ``serves`` it (else unchanged)."""
        if self.serves(spec):
            spec.reference_url = self.url
        return spec
