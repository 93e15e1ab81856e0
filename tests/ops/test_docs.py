"""The reference docs are generated from the models, so they cannot drift: each file must
equal what ``python -m kvpush_prod.config.docs`` / ``python -m kvpush_prod.metrics_docs``
renders now.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpush_prod.config import field_rows
from kvpush_prod.config.docs import render_config_doc
from kvpush_prod.metrics import exported_name
from kvpush_prod.metrics_docs import all_series, render_metrics_doc

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize(
    ("name", "render", "module"),
    [
        ("configuration.md", render_config_doc, "kvpush_prod.config.docs"),
        ("metrics.md", render_metrics_doc, "kvpush_prod.metrics_docs"),
    ],
)
def test_reference_doc_equals_what_the_model_renders(
    name: str, render: Callable[[], str], module: str
) -> None:
    text = (DOCS / name).read_text()
    assert text == render(), (
        f"docs/{name} is out of date: regenerate it with "
        f"`PYTHONPATH=src python -m {module} > docs/{name}`"
    )


def test_configuration_doc_has_one_row_per_field_with_type_default_range_meaning() -> None:
    text = (DOCS / "configuration.md").read_text()
    rows = re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \|(.+)\|$", text, re.M)
    assert [key for key, _ in rows] == [f"{s}.{k}" for s, k, _ in field_rows()]
    for key, rest in rows:
        cells = [c.strip() for c in rest.split(" | ")]
        assert len(cells) == 4 and all(cells), key


def test_every_field_has_a_meaning() -> None:
    for section, key, f in field_rows():
        assert f.description, f"{section}.{key} has no description"


def test_metrics_doc_lists_exactly_the_series_of_the_metrics_module() -> None:
    text = (DOCS / "metrics.md").read_text()
    listed = re.findall(r"^\| `(kvpush_[a-z_]+)` \|", text, re.M)
    assert sorted(listed) == sorted(exported_name(s) for s in all_series())
