"""Alert rules: promtool accepts them and their unit tests pass; every alert is documented,
tested firing and tested silent on a healthy cluster.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "configs" / "prometheus"
RULES = PROM / "alerts.yaml"
RULE_TESTS = PROM / "alerts_test.yaml"
OPERATIONS = ROOT / "docs" / "operations.md"
SEVERITIES = {"critical", "warning", "info"}
INSTALL_HINT = (
    "promtool is not on PATH: install it to test the alert rules, e.g. "
    "`apt-get install -y --no-install-recommends prometheus` (Debian/Ubuntu; `./run test` "
    "does this when run as root) or put promtool from a Prometheus release tarball "
    "(https://prometheus.io/download/) on PATH"
)


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(INSTALL_HINT)
    return path


def run_promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *map(str, args)], capture_output=True, text=True, timeout=120, cwd=PROM
    )


def rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(RULES.read_text())
    return [r for group in data["groups"] for r in group["rules"] if "alert" in r]


def test_promtool_accepts_the_rules() -> None:
    result = run_promtool("check", "rules", RULES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_unit_tests_pass() -> None:
    result = run_promtool("test", "rules", RULE_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_severity_summary_description_and_a_runbook_section() -> None:
    anchors = {
        re.sub(r"[^a-z0-9-]", "", h.strip().lower().replace(" ", "-"))
        for h in re.findall(r"^#+ (.+)$", OPERATIONS.read_text(), re.M)
    }
    names = [r["alert"] for r in rules()]
    assert len(names) == len(set(names)), "duplicate alert names"
    for rule in rules():
        name = rule["alert"]
        assert rule.get("labels", {}).get("severity") in SEVERITIES, name
        ann = rule.get("annotations", {})
        assert ann.get("summary") and ann.get("description"), name
        assert ann.get("runbook") == f"docs/operations.md#{name.lower()}", name
        assert name.lower() in anchors, f"docs/operations.md has no section '### {name}'"


def test_runbook_sections_say_what_it_means_what_to_look_at_and_what_to_do() -> None:
    text = OPERATIONS.read_text()
    for name in (r["alert"] for r in rules()):
        section = text.split(f"### {name}\n", 1)[1].split("\n### ", 1)[0]
        for part in ("**Means.**", "**Look at.**", "**Do.**"):
            assert part in section, f"{name}: runbook lacks {part}"


def test_every_alert_is_tested_firing_and_silent_on_a_healthy_cluster() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    healthy = next(t for t in tests if t["name"].startswith("healthy"))
    silent = {a["alertname"] for a in healthy["alert_rule_test"] if a["exp_alerts"] == []}
    firing = {a["alertname"] for t in tests for a in t["alert_rule_test"] if a["exp_alerts"]}
    names = {r["alert"] for r in rules()}
    assert names - silent == set(), "not checked silent on the healthy cluster"
    assert names - firing == set(), "never tested firing"
