"""The built wheel works installed, away from the checkout: ``pip wheel`` of the project,
installed (not editable) into a fresh venv, run from a directory outside the checkout:
``kvpush --help``, ``kvpush config validate`` of every shipped profile, the dashboard and
alert rules as package data, ``kvpush chaos --list`` naming every scenario, ``kvpush keys
generate``, and the connector loaded the way vLLM loads it. Nothing of the checkout's ``src/`` and no editable install is on that venv's path.

The fresh venv reaches the dependencies through a ``.pth`` line naming the project venv's
site-packages (no registry needed); a plain path line there is not a site directory, so the
``.pth`` files inside it (the editable install's ``src/``) are not read. ~30 s here, most of it
importing vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from kvpush_prod.chaos.scenarios import SCENARIOS, SOAKS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "kvpush_prod"
SCENARIO_FILES = sorted(
    p.stem for p in (PACKAGE / "chaos" / "scenarios").glob("*.py") if p.stem != "__init__"
)
PROFILES = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))

pytestmark = pytest.mark.timeout(300)


class Installed:
    """A venv holding the built wheel, and a working directory outside the checkout."""

    def __init__(self, venv: Path, cwd: Path) -> None:
        self.venv, self.cwd = venv, cwd
        self.python = venv / "bin" / "python"
        self.env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSAFEPATH")
        }
        self.env["PATH"] = f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"

    def run(self, *args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(a) for a in args],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert proc.returncode == 0, (
            f"{' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        )
        return proc

    def kvpush(self, *args: str | Path) -> str:
        return self.run(self.venv / "bin" / "kvpush", *args).stdout

    def python_json(self, code: str) -> object:
        return json.loads(self.run(self.python, "-c", code).stdout.strip().splitlines()[-1])


def _build_wheel(tmp: Path) -> Path:
    """``pip wheel`` of a copy of the project (the build leaves nothing in the checkout)."""
    project = tmp / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    shutil.copytree(
        ROOT / "src",
        project / "src",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
    )
    dist = tmp / "dist"
    # With the venv's own setuptools (no registry); should it be too old for pyproject.toml,
    # in an isolated build environment as pip does by default (from the registry).
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(project), "-w", str(dist)]
    local = subprocess.run(
        [*build, "--no-build-isolation", "--no-index"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if local.returncode != 0:
        isolated = subprocess.run(build, capture_output=True, text=True, timeout=120, check=False)
        assert isolated.returncode == 0, f"pip wheel failed:\n{local.stderr}\n{isolated.stderr}"
    (wheel,) = dist.glob("kvpush_prod-*.whl")
    return wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = _build_wheel(tmp)
    venv = tmp / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    # Installed before the dependencies are reachable: pip sees no other kvpush-prod.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    cwd = tmp / "elsewhere"
    cwd.mkdir()
    inst = Installed(venv, cwd)
    site = inst.python_json("import json, sysconfig; print(json.dumps(sysconfig.get_paths()))")
    assert isinstance(site, dict)
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site["purelib"]) / "kvpush_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    return inst


def test_the_installed_package_is_the_wheels_and_the_checkout_is_out_of_sight(
    installed: Installed,
) -> None:
    where = installed.python_json(
        "import json, sys, kvpush_prod, kvpush_prod.chaos.scenarios as s, "
        "kvpush_prod.config.profiles as p; "
        "print(json.dumps([kvpush_prod.__file__, s.__file__, str(p.SHIPPED_DIR), sys.path]))"
    )
    assert isinstance(where, list)
    package, scenarios, profiles, path = where
    venv = str(installed.venv.resolve())
    assert package.startswith(venv) and scenarios.startswith(venv) and profiles.startswith(venv)
    assert not any(str(ROOT) in entry and ".venv" not in entry for entry in path), path
    assert not Path(installed.cwd).resolve().is_relative_to(ROOT)


def test_kvpush_help_runs(installed: Installed) -> None:
    out = installed.kvpush("--help")
    assert "usage: kvpush" in out and "chaos" in out and "config" in out and "doctor" in out
    assert "usage: kvpush doctor" in installed.kvpush("doctor", "--help")


def test_every_shipped_profile_validates_by_name(installed: Installed) -> None:
    shipped = installed.python_json(
        "import json; from kvpush_prod.config.profiles import shipped; "
        "print(json.dumps(sorted(shipped())))"
    )
    assert shipped == PROFILES  # configs/ holds the same files (test_profiles.py)
    for name in PROFILES:
        out = installed.kvpush("config", "validate", name)
        assert out.startswith(f"OK: {name} is a valid kvpush configuration"), out


def test_the_dashboard_and_alert_rules_are_package_data(installed: Installed) -> None:
    got = installed.python_json(
        "import json, yaml\n"
        "from kvpush_prod.ops import ALERT_RULES, ALERT_TESTS, DASHBOARD\n"
        "rules = yaml.safe_load(ALERT_RULES.read_text())\n"
        "alerts = [r['alert'] for g in rules['groups'] for r in g['rules'] if 'alert' in r]\n"
        "print(json.dumps([str(DASHBOARD), json.loads(DASHBOARD.read_text())['title'],\n"
        "                  alerts, ALERT_TESTS.is_file()]))\n"
    )
    assert isinstance(got, list)
    dashboard, title, alerts, tests = got
    assert dashboard.startswith(str(installed.venv.resolve()))
    assert title == json.loads((ROOT / "configs" / "grafana" / "kvpush.json").read_text())["title"]
    ours = yaml.safe_load((ROOT / "configs" / "prometheus" / "alerts.yaml").read_text())
    assert alerts == [r["alert"] for g in ours["groups"] for r in g["rules"] if "alert" in r]
    assert tests


def test_chaos_list_names_every_scenario(installed: Installed) -> None:
    lines = installed.kvpush("chaos", "--list").splitlines()
    names = [line.split()[0] for line in lines]
    assert names == list(SCENARIOS)
    assert sorted(names) == SCENARIO_FILES
    assert all(len(line.split(maxsplit=1)) == 2 for line in lines)  # each with its description
    # Each scenario's own options parse (its module and the harness import), no engine starts.
    codes = installed.python_json(
        "import contextlib, io, json\n"
        "from kvpush_prod.chaos.cli import main\n"
        "from kvpush_prod.chaos.scenarios import SCENARIOS\n"
        "codes = {}\n"
        "for name in SCENARIOS:\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(io.StringIO()):\n"
        "            main([name, '--help'])\n"
        "    except SystemExit as exc:\n"
        "        codes[name] = exc.code\n"
        "print(json.dumps(codes))\n"
    )
    assert codes == dict.fromkeys(SCENARIOS, 0)


def test_keys_generate_writes_a_key_pair(installed: Installed) -> None:
    keys = installed.cwd / "keys"
    installed.kvpush("keys", "generate", "prefill-0", "decode-0", "--dir", keys)
    assert sorted(p.name for p in keys.iterdir()) == [
        "decode-0.key",
        "decode-0.key_secret",
        "prefill-0.key",
        "prefill-0.key_secret",
    ]
    installed.kvpush(
        "keys", "check", "--key-file", keys / "prefill-0.key_secret", "--allowed", keys
    )


def test_vllm_loads_the_connector_from_the_installed_package(installed: Installed) -> None:
    pytest.importorskip("vllm")  # the project venv has it; a bare install would not
    got = installed.python_json(
        "import importlib, json\n"
        "module = importlib.import_module('kvpush_prod.connector')\n"
        "cls = getattr(module, 'PushConnector')\n"
        "from vllm.config import KVTransferConfig\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1\n"
        "cfg = KVTransferConfig(kv_connector='PushConnector', kv_role='kv_producer',\n"
        "                       kv_connector_module_path='kvpush_prod.connector')\n"
        "found = KVConnectorFactory.get_connector_class(cfg)\n"
        "print(json.dumps([importlib.import_module(cls.__module__).__file__,\n"
        "                  found is cls, issubclass(cls, KVConnectorBase_V1)]))\n"
    )
    assert isinstance(got, list)
    path, same, subclass = got
    assert path.startswith(str(installed.venv.resolve())), path
    assert same and subclass


# ------------------------------------------------------------------ the chaos CLI, in process


def test_chaos_all_runs_every_scenario_in_order_and_writes_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import kvpush_prod.chaos.harness as harness
    from kvpush_prod.chaos.cli import main

    ran: list[str] = []

    def fake_run(module: ModuleType, argv: list[str]) -> int:  # no engine starts
        ran.append(module.NAME)
        report = Path(argv[argv.index("--report") + 1])
        report.write_text(
            json.dumps({"scenario": module.NAME, "verdict": "PASS", "table": {"sent": 1}})
        )
        return 0

    monkeypatch.setattr(harness, "main", fake_run)
    assert main(["all", "--report-dir", str(tmp_path), "--requests", "1"]) == 0
    # Soaks (the nemesis) run for a set time: `all` leaves them out, in order otherwise.
    runs = [name for name in SCENARIOS if name not in SOAKS]
    assert SOAKS and ran == runs
    table = (tmp_path / "table.md").read_text()
    assert all(f"| {name} | PASS |" in table for name in runs)
    assert main(["no_such_scenario"]) == 2
    assert "unknown scenario 'no_such_scenario'" in capsys.readouterr().err
