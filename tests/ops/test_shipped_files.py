"""The dashboard and alert rules the package ships (kvpush_prod/ops/) are the files in
configs/ byte for byte, and pyproject's package data names them."""

from __future__ import annotations

from pathlib import Path

from kvpush_prod.ops import ALERT_RULES, ALERT_TESTS, CHECKOUT_COPIES, DASHBOARD, HERE

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_dashboard_and_rules_are_the_configs_files_byte_for_byte() -> None:
    assert set(CHECKOUT_COPIES) == {DASHBOARD, ALERT_RULES, ALERT_TESTS}
    for shipped, copy in CHECKOUT_COPIES.items():
        assert shipped.is_file(), shipped
        assert (ROOT / copy).read_bytes() == shipped.read_bytes(), (
            f"{copy} differs from {shipped.relative_to(ROOT)}: edit the package copy, then "
            f"cp {shipped.relative_to(ROOT)} {copy}"
        )


def test_every_file_under_ops_is_a_shipped_one() -> None:
    data = {
        p
        for p in HERE.rglob("*")
        if p.is_file() and p.suffix != ".py" and "__pycache__" not in p.parts
    }
    assert data == set(CHECKOUT_COPIES)
