"""Every PromQL expression we ship (alert rules, Grafana dashboard, doc examples) names only
real series of kvpush_prod.metrics, with their real labels and label values, and parses.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpush_prod.metrics_docs import EXAMPLE_QUERIES
from tests.ops.promql import grafana_template_selectors, problems, selectors

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "configs" / "prometheus" / "alerts.yaml"
DASHBOARD = ROOT / "configs" / "grafana" / "kvpush.json"


def alert_exprs() -> list[tuple[str, str]]:
    data = yaml.safe_load(RULES.read_text())
    return [
        (r.get("alert") or r.get("record"), r["expr"]) for g in data["groups"] for r in g["rules"]
    ]


def _panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for p in panels:
        out.append(p)
        out += _panels(p.get("panels", []))
    return out


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[tuple[str, str]]:
    out = []
    for p in _panels(dashboard()["panels"]):
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r} {t['refId']}", t["expr"]))
    return out


def test_the_scanner_finds_names_labels_and_skips_functions_keywords_and_numbers() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, role) (rate(a_bucket{role="x",le!="1"}'
        "[$__rate_interval]))) > 1e-9 and on (job) b unless ignoring(x) c offset 5m"
        ' / clamp_min({__name__="d", k=~"p|q"}, 2)'
    )
    sels = selectors(expr)
    assert [s.name for s in sels] == ["a_bucket", "d", "b", "c"]
    assert sels[0].matchers == [("role", "=", "x"), ("le", "!=", "1")]
    assert sels[1].matchers == [("k", "=~", "p|q")]
    assert [s.name for s in grafana_template_selectors('label_values(m{job=~"$job"}, inst)')] == [
        "m"
    ]


def test_the_checker_catches_wrong_names_suffixes_labels_and_values() -> None:
    assert problems('rate(kvpush_transfers_total{role="consumer"}[5m])', "ok") == []
    assert problems("kvpush_transfers", "x")  # a counter is scraped with _total
    assert problems("kvpush_transfer_seconds", "x")  # a histogram has no bare sample
    assert problems("kvpush_nonexistent_total", "x")
    assert problems('kvpush_transfers_total{outcom="pushed"}', "x")
    assert problems('kvpush_transfers_total{outcome=~"pushed|pushd"}', "x")
    assert problems('kvpush_chunks_total{le="1"}', "x")  # le only on _bucket
    assert problems('vllm:anything_total{whatever="1"}', "x") == []


@pytest.mark.parametrize(("where", "expr"), alert_exprs(), ids=lambda v: str(v)[:40])
def test_alert_expressions_name_real_series(where: str, expr: str) -> None:
    assert problems(expr, where) == []


def test_dashboard_expressions_name_real_series() -> None:
    found = [msg for where, expr in dashboard_exprs() for msg in problems(expr, where)]
    assert found == []


def test_dashboard_variables_name_real_series() -> None:
    for var in dashboard()["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        sels = grafana_template_selectors(query)
        assert sels, query
        for sel in sels:
            assert problems(sel.name, f"variable {var['name']}") == []


def test_doc_example_queries_name_real_series() -> None:
    found = [msg for title, expr in EXAMPLE_QUERIES for msg in problems(expr, title)]
    assert found == []


def test_dashboard_covers_every_connector_series() -> None:
    from kvpush_prod.metrics import CONNECTOR_SERIES
    from kvpush_prod.metrics_docs import router_series

    named = {sel.name for _, expr in dashboard_exprs() for sel in selectors(expr)}
    for s in (*CONNECTOR_SERIES, *router_series()):
        assert any(n.startswith(s.name) for n in named), f"no panel shows {s.name}"


def test_dashboard_expressions_are_valid_promql(tmp_path: Path) -> None:
    # promtool parses every expression when it checks a rule file.
    tool = shutil.which("promtool")
    if tool is None:
        pytest.fail(
            "promtool is not on PATH: `apt-get install -y --no-install-recommends "
            "prometheus` (Debian/Ubuntu) or put promtool from a Prometheus release on PATH"
        )
    exprs = [e.replace("$__rate_interval", "5m") for _, e in dashboard_exprs()]
    exprs += [e for _, e in EXAMPLE_QUERIES]
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"kvpush:dashboard_check_{i}", "expr": e}
                    for i, e in enumerate(exprs)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run(
        [tool, "check", "rules", str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_is_importable_json_with_a_datasource_variable() -> None:
    d = dashboard()
    assert d["uid"] and d["title"]
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "job", "instance", "router_job"} <= names
    ids = [p["id"] for p in _panels(d["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in _panels(d["panels"]):
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
