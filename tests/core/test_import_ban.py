"""The core stays pure: no module in kvpush_prod/core imports I/O, clocks, threads or RNGs."""

from __future__ import annotations

import ast
from pathlib import Path

import kvpush_prod.core

BANNED = frozenset(
    {"vllm", "nixl", "torch", "zmq", "socket", "threading", "time", "asyncio", "random"}
)
CORE_DIR = Path(kvpush_prod.core.__file__).parent


def banned_imports(source: str, filename: str) -> list[str]:
    """Every banned import in ``source``, as 'file:line module'."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Name, ast.Attribute))
            and (getattr(node.func, "id", None) or getattr(node.func, "attr", None))
            in ("__import__", "import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        for name in names:
            top = name.split(".")[0]
            if top in BANNED or top.startswith("nixl"):
                found.append(f"{filename}:{node.lineno} {name}")
    return found


def test_no_core_module_imports_io_clocks_threads_or_random() -> None:
    modules = sorted(CORE_DIR.rglob("*.py"))  # subpackages (retry/) too
    assert len(modules) >= 7, f"expected the core modules in {CORE_DIR}, found {modules}"
    found: list[str] = []
    for path in modules:
        found += banned_imports(path.read_text(), str(path.relative_to(CORE_DIR)))
    assert not found, "core/ must stay sans-IO; banned imports: " + ", ".join(found)


def test_the_ban_check_catches_each_banned_import_form() -> None:
    src = (
        "import time\n"
        "from random import Random\n"
        "import os, threading\n"
        "from nixl_cu12._api import nixl_agent\n"
        "import importlib\n"
        "importlib.import_module('zmq')\n"
        "__import__('socket')\n"
        "from . import messages\n"
    )
    found = banned_imports(src, "x.py")
    assert [f.split()[1] for f in found] == [
        "time",
        "random",
        "threading",
        "nixl_cu12._api",
        "zmq",
        "socket",
    ]
