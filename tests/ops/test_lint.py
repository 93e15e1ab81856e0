"""The checks a reviewer would run, run by CI: ruff (lint over src and tests, format over the
whole tree), mypy --strict over the whole package (pyproject's [tool.mypy]: every module of
kvpush_prod, not only the core) and no function of the package over 60 lines."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    found = BIN / name
    if found.exists():
        return str(found)
    on_path = shutil.which(name)
    if on_path is None:
        pytest.fail(f"{name} is not installed: `pip install -e '.[dev]'` installs it")
    return on_path


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)


def test_ruff_finds_nothing() -> None:
    done = _run(_tool("ruff"), "check", "src", "tests")
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_strict_over_the_whole_package() -> None:
    done = _run(_tool("mypy"))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Success" in done.stdout, done.stdout


def test_ruff_format_finds_nothing_to_change() -> None:
    done = _run(_tool("ruff"), "format", "--check", ".")
    assert done.returncode == 0, (
        done.stdout[-4000:] + done.stderr + "\nrun `ruff format .` and commit the result"
    )


MAX_FUNCTION_LINES = 60


def test_no_function_in_the_package_is_over_60_lines() -> None:
    """Counted as printed by ``ruff format``: from the first decorator to the last line."""
    long: list[str] = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([d.lineno for d in node.decorator_list] + [node.lineno])
                lines = (node.end_lineno or node.lineno) - first + 1
                if lines > MAX_FUNCTION_LINES:
                    where = path.relative_to(ROOT)
                    long.append(f"{where}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "split these functions:\n" + "\n".join(long)
