"""The layers of docs/architecture.md hold: every module under src/kvpush_prod imports only what
its layer may import, and the product never imports the lab, the tools or the CLI.

The table lives in docs/architecture.md alone; this test reads it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "kvpush_prod"
DOC = ROOT / "docs" / "architecture.md"
OUTSIDE_THE_PRODUCT = ("lab", "tools", "cli")


@dataclass(frozen=True)
class Layer:
    name: str
    modules: tuple[str, ...]  # dotted prefixes, e.g. "kvpush_prod.core"
    may_import: frozenset[str]


def read_layers(text: str) -> dict[str, Layer]:
    """The table under "## Layers": | layer | modules | may import |, in order."""
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers: dict[str, Layer] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("layer", "") or set(cells[0]) <= {"-"}:
            continue
        name, modules, may = cells
        names = re.findall(r"`([a-z_.]+)`", modules)
        prefixes = tuple(n if n == PACKAGE else f"{PACKAGE}.{n}" for n in names)
        allowed = frozenset() if may == "-" else frozenset(m.strip() for m in may.split(","))
        layers[name] = Layer(name, prefixes, allowed)
    return layers


LAYERS = read_layers(DOC.read_text())


def layer_of(module: str) -> Layer | None:
    """The layer whose longest module prefix covers ``module``."""
    best: tuple[int, Layer] | None = None
    for layer in LAYERS.values():
        for prefix in layer.modules:
            if prefix == PACKAGE:
                hit = module == PACKAGE
            else:
                hit = module == prefix or module.startswith(prefix + ".")
            if hit and (best is None or len(prefix) > best[0]):
                best = (len(prefix), layer)
    return None if best is None else best[1]


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(dotted: str, src: Path) -> bool:
    base = src.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports_of(path: Path, src: Path = SRC) -> set[str]:
    """Every kvpush_prod module ``path`` imports, anywhere in the file (in functions and under
    ``if TYPE_CHECKING:`` too)."""
    me = module_name(path, src)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from pkg import sub` imports the module pkg.sub when there is one.
            subs = [
                f"{target}.{a.name}" for a in node.names if _is_module(f"{target}.{a.name}", src)
            ]
            found.update(subs or [target])
    return {m for m in found if m == PACKAGE or m.startswith(PACKAGE + ".")}


MODULES = sorted((SRC / PACKAGE).rglob("*.py"))


def test_the_table_names_each_layer_it_allows_and_keeps_the_product_apart() -> None:
    assert LAYERS, f"no layer table found in {DOC}"
    for layer in LAYERS.values():
        unknown = layer.may_import - set(LAYERS)
        assert not unknown, f"layer {layer.name} may import unknown layers {sorted(unknown)}"
    product = [n for n in LAYERS if n not in OUTSIDE_THE_PRODUCT]
    for name in product:
        leaks = LAYERS[name].may_import & set(OUTSIDE_THE_PRODUCT)
        assert not leaks, f"product layer {name} may import {sorted(leaks)}"


def test_every_module_belongs_to_a_layer() -> None:
    orphans = [module_name(p) for p in MODULES if layer_of(module_name(p)) is None]
    assert not orphans, f"modules no row of {DOC.name}'s layer table names: {orphans}"


def not_allowed(path: Path, src: Path = SRC) -> list[str]:
    """The imports of ``path`` its layer may not make, each with the layer it reaches."""
    mine = layer_of(module_name(path, src))
    assert mine is not None
    wrong = []
    for target in sorted(imports_of(path, src)):
        theirs = layer_of(target)
        if theirs is None or (theirs is not mine and theirs.name not in mine.may_import):
            wrong.append(f"{target} ({theirs.name if theirs else 'no layer'})")
    return wrong


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_a_module_imports_only_what_its_layer_may(path: Path) -> None:
    wrong = not_allowed(path)
    assert not wrong, (
        f"{module_name(path)} imports {wrong}: not allowed by the layer table "
        "of docs/architecture.md"
    )


def test_lazy_relative_and_type_checking_imports_of_the_lab_are_caught(tmp_path: Path) -> None:
    pkg = tmp_path / PACKAGE
    for d in ("", "router", "lab"):
        (pkg / d).mkdir(exist_ok=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "lab" / "client.py").write_text("")
    (pkg / "router" / "types.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "router" / "bad.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import types\n"  # its own layer: allowed
        "from kvpush_prod import errors\n"  # allowed
        "def f():\n    from ..lab import client\n"
        "if TYPE_CHECKING:\n    import kvpush_prod.bench.stats\n"
    )
    assert not_allowed(pkg / "router" / "bad.py", tmp_path) == [
        "kvpush_prod.bench.stats (tools)",
        "kvpush_prod.lab.client (lab)",
    ]
    assert layer_of("kvpush_prod.config.profiles") is LAYERS["config"]
    assert layer_of(PACKAGE) is LAYERS["root"]
