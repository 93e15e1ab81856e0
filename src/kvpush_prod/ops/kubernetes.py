"""The generated parts of the Kubernetes recipe (deploy/kubernetes/): the PrometheusRule
holding the shipped alert rules and the ConfigMap holding the Grafana dashboard, one source
each (``kvpush_prod.ops``). ``python -m kvpush_prod.ops.kubernetes DIR`` writes them;
tests/ops/test_kubernetes.py checks the files equal what this renders.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from kvpush_prod.ops import ALERT_RULES, DASHBOARD

NAMESPACE = "kvpush"
LABELS = {"app.kubernetes.io/part-of": "kvpush"}
RULE_FILE = "prometheusrule.yaml"
DASHBOARD_FILE = "grafana-dashboard.yaml"
_HEADER = (
    "# Generated from {source} by `python -m kvpush_prod.ops.kubernetes deploy/kubernetes`;"
    "\n# edit the source, then regenerate (tests/ops/test_kubernetes.py checks it).\n"
)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (PromQL, the dashboard JSON) as literal blocks, readable in review."""


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str)


def _dump(obj: dict[str, Any]) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=100)


def prometheus_rule() -> dict[str, Any]:
    """The shipped alert rules as a Prometheus Operator PrometheusRule."""
    rules = yaml.safe_load(ALERT_RULES.read_text())
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "kvpush", "labels": dict(LABELS)},
        "spec": {"groups": rules["groups"]},
    }


def dashboard_configmap() -> dict[str, Any]:
    """The dashboard as a ConfigMap Grafana's sidecar loads (label grafana_dashboard: "1")."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "kvpush-grafana-dashboard",
            "labels": {**LABELS, "grafana_dashboard": "1"},
        },
        "data": {
            "kvpush.json": json.dumps(json.loads(DASHBOARD.read_text()), indent=1, sort_keys=False)
            + "\n"
        },
    }


def render() -> dict[str, str]:
    """File name -> text of each generated manifest."""
    return {
        RULE_FILE: _HEADER.format(source="src/kvpush_prod/ops/prometheus/alerts.yaml")
        + _dump(prometheus_rule()),
        DASHBOARD_FILE: _HEADER.format(source="src/kvpush_prod/ops/grafana/kvpush.json")
        + _dump(dashboard_configmap()),
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print(
            "usage: python -m kvpush_prod.ops.kubernetes DIR (an existing directory, e.g. "
            "deploy/kubernetes)",
            file=sys.stderr,
        )
        return 2
    for name, text in render().items():
        (Path(args[0]) / name).write_text(text)
    print(f"wrote {', '.join(render())} in {args[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
