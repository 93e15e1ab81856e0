"""The operator's files shipped in the package: the Grafana dashboard and the Prometheus alert
rules with their promtool tests, found from any install (no checkout needed).

The package copy is the source; ``configs/grafana`` and ``configs/prometheus`` in the checkout
hold the same files for operators (tests/ops/test_shipped_files.py keeps them equal).
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
DASHBOARD = HERE / "grafana" / "kvpush.json"
ALERT_RULES = HERE / "prometheus" / "alerts.yaml"
ALERT_TESTS = HERE / "prometheus" / "alerts_test.yaml"
# Checkout-relative names of the same files (configs/...), for messages and docs.
CHECKOUT_COPIES = {
    DASHBOARD: Path("configs/grafana/kvpush.json"),
    ALERT_RULES: Path("configs/prometheus/alerts.yaml"),
    ALERT_TESTS: Path("configs/prometheus/alerts_test.yaml"),
}
