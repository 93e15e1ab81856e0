"""The Kubernetes recipe (deploy/kubernetes/) renders and validates offline: every object
against its schema (kubernetes-validate for core kinds, the vendored CRD schemas in
k8s_schemas/ for PodMonitor and PrometheusRule); the generated manifests equal what the
package renders; the Secrets are mounted read-only with mode 0400 and made by
make-secrets.sh with ``kvpush keys``; and every flag and config key it uses exists here:
vLLM's ``serve`` flags and kv_transfer_config, the connector's extra config, the router's
flags, the profile it names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvpush_prod.config.loading import config_from_extra
from kvpush_prod.ops.kubernetes import render
from kvpush_prod.router.cli import build_parser as router_parser

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).resolve().parent / "k8s_schemas"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the recipe is for
CORE_KINDS = {"Namespace", "Deployment", "Service", "ConfigMap"}
CRDS = {"PodMonitor": "podmonitor.json", "PrometheusRule": "prometheusrule.json"}
POD_IP = "10.0.0.5"  # what the kubelet puts for $(POD_IP)


@cache
def objects() -> list[tuple[str, dict[str, Any]]]:
    """(file, object) for every object the kustomization lists, in its order."""
    kustomization = yaml.safe_load((RECIPE / "kustomization.yaml").read_text())
    out = []
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((RECIPE / name).read_text()):
            if doc is not None:
                out.append((name, doc))
    return out


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [o for _, o in objects() if o["kind"] == kind]


def containers() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod spec, container) of every Deployment."""
    return [
        (d["spec"]["template"]["spec"], c)
        for d in of_kind("Deployment")
        for c in d["spec"]["template"]["spec"]["containers"]
    ]


def test_the_kustomization_lists_every_manifest_and_nothing_else() -> None:
    listed = yaml.safe_load((RECIPE / "kustomization.yaml").read_text())["resources"]
    on_disk = sorted(p.name for p in RECIPE.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk


def test_generated_manifests_equal_what_the_package_renders() -> None:
    for name, text in render().items():
        assert (RECIPE / name).read_text() == text, (
            f"deploy/kubernetes/{name} is out of date: run "
            "`PYTHONPATH=src python -m kvpush_prod.ops.kubernetes deploy/kubernetes`"
        )


def test_every_object_validates_offline() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kinds = set()
    for name, obj in objects():
        kind = obj["kind"]
        kinds.add(kind)
        if kind in CORE_KINDS:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        else:
            assert kind in CRDS, f"{name}: {kind} has no schema here (add one to {SCHEMAS})"
            schema = json.loads((SCHEMAS / CRDS[kind]).read_text())
            jsonschema.validate(obj, schema)
    assert kinds == CORE_KINDS | set(CRDS)


def test_a_misspelt_field_fails_validation() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    bad = json.loads(json.dumps(of_kind("Deployment")[0]))
    bad["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    rule = json.loads(json.dumps(of_kind("PrometheusRule")[0]))
    rule["spec"]["groups"][0]["rules"][0]["fore"] = "5m"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(rule, json.loads((SCHEMAS / CRDS["PrometheusRule"]).read_text()))


def test_secrets_are_mounted_read_only_with_mode_0400() -> None:
    mounted = set()
    for pod, container in containers():
        secret_volumes = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
        for mount in container["volumeMounts"]:
            if mount["name"] in secret_volumes:
                assert mount.get("readOnly") is True, mount
                assert secret_volumes[mount["name"]]["defaultMode"] == 0o400
                mounted.add(secret_volumes[mount["name"]]["secretName"])
        assert "fsGroup" not in pod.get("securityContext", {})  # would add group read
    assert mounted == {"kvpush-prefill-key", "kvpush-decode-key", "kvpush-allowed", "kvpush-params"}


def test_the_prometheus_rule_holds_every_shipped_alert() -> None:
    from kvpush_prod.ops import ALERT_RULES

    (rule,) = of_kind("PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(ALERT_RULES.read_text())["groups"]


def test_the_pod_monitor_selects_every_pod_on_a_port_it_has() -> None:
    (monitor,) = of_kind("PodMonitor")
    wanted = monitor["spec"]["selector"]["matchLabels"]
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    for deployment in of_kind("Deployment"):
        template = deployment["spec"]["template"]
        assert wanted.items() <= template["metadata"]["labels"].items()
        for c in template["spec"]["containers"]:
            assert ports <= {p["name"] for p in c["ports"]}


def test_services_select_their_deployments_and_name_ports_they_have() -> None:
    pods = {d["metadata"]["name"]: d["spec"]["template"] for d in of_kind("Deployment")}
    for service in of_kind("Service"):
        template = pods[service["metadata"]["name"]]
        assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
        names = {p["name"] for c in template["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= names


def engine_args() -> dict[str, list[str]]:
    return {
        d["metadata"]["name"]: c["args"]
        for d in of_kind("Deployment")
        for c in d["spec"]["template"]["spec"]["containers"]
        if c["command"][0] == "vllm"
    }


def test_engines_use_only_flags_and_kv_transfer_config_this_vllm_takes() -> None:
    pytest.importorskip("vllm")
    code = (
        "import json, sys\n"
        "from kvpush_prod.lab.serve import patch_vllm_version\n"
        "patch_vllm_version()\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "out = {}\n"
        "for name, args in json.loads(sys.argv[1]).items():\n"
        "    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(args)\n"
        "    kv = ns.kv_transfer_config\n"
        "    out[name] = [kv.kv_connector, kv.kv_role, kv.kv_connector_module_path,\n"
        "                 kv.engine_id, ns.port]\n"
        "print('KVPUSH ' + json.dumps(out))\n"
    )
    args = {
        name: [a.replace("$(POD_IP)", POD_IP) for a in argv] for name, argv in engine_args().items()
    }
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("KVPUSH "))
    got = json.loads(line.removeprefix("KVPUSH "))
    assert got == {
        "kvpush-prefill": [
            "PushConnector",
            "kv_producer",
            "kvpush_prod.connector",
            "prefill-0",
            8000,
        ],
        "kvpush-decode": [
            "PushConnector",
            "kv_consumer",
            "kvpush_prod.connector",
            "decode-0",
            8000,
        ],
    }


def test_engines_extra_config_is_a_valid_kvpush_config_with_the_mounted_paths() -> None:
    mounts = {m["mountPath"] for _, c in containers() for m in c.get("volumeMounts", [])}
    for name, argv in engine_args().items():
        kv = json.loads(argv[argv.index("--kv-transfer-config") + 1].replace("$(POD_IP)", POD_IP))
        cfg = config_from_extra(kv["kv_connector_extra_config"])
        c = cfg.control
        assert (c.host, c.advertise_host, c.port) == ("0.0.0.0", POD_IP, 15500), name
        for path in (c.key_file, c.allowed_keys, c.params_key_file):
            assert path is not None and any(path.startswith(m) for m in mounts), path
        assert cfg.links.fabric == "rdma"  # ib-ucx: kvpush doctor fails a TCP-only host


def test_the_router_uses_only_flags_it_has_and_engine_services_that_exist() -> None:
    (router,) = [c for _, c in containers() if c["command"] == ["kvpush", "router"]]
    ns = router_parser().parse_args(router["args"])
    services = {s["metadata"]["name"] for s in of_kind("Service")}
    for url in [*ns.prefill, *ns.decode]:
        assert url.split("//")[1].split(":")[0] in services, url
    assert ns.params_key_file.startswith("/etc/kvpush/params/")


def test_make_secrets_makes_every_secret_the_manifests_mount(tmp_path: Path) -> None:
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "kvpush").write_text(f'#!/bin/sh\nexec {sys.executable} -m kvpush_prod.cli "$@"\n')
    (shim / "kvpush").chmod(0o755)
    keys = tmp_path / "keys"
    env = {
        **os.environ,
        "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}",
        "KVPUSH_KEYS_DIR": str(keys),
        "KVPUSH_DRY_RUN": "1",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    done = subprocess.run(
        ["bash", str(RECIPE / "make-secrets.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    made = {
        line.split(" create secret generic ")[1].split()[0]: line
        for line in done.stdout.splitlines()
        if " create secret generic " in line
    }
    assert set(made) == {
        "kvpush-prefill-key",
        "kvpush-decode-key",
        "kvpush-allowed",
        "kvpush-params",
    }
    assert "--from-file=engine.key_secret=" in made["kvpush-prefill-key"]
    assert "--from-file=params.key=" in made["kvpush-params"]
    assert (keys / "prefill-0.key_secret").stat().st_mode & 0o077 == 0
    assert done.stdout.splitlines()[-1].startswith("make-secrets: 4 Secrets")
    secret = (keys / "prefill-0.key_secret").read_bytes()
    again = subprocess.run(
        ["bash", str(RECIPE / "make-secrets.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
        env=env,
    )
    assert again.returncode == 0, again.stdout + again.stderr  # run again: keys kept
    assert "wrote" not in again.stdout and (keys / "prefill-0.key_secret").read_bytes() == secret
