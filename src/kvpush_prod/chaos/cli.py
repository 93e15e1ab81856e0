"""``kvpush chaos <scenario> [args]``, ``kvpush chaos all`` and ``kvpush chaos --list``: the
scenarios shipped in ``kvpush_prod.chaos.scenarios``, run on the harness of this package.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

from kvpush_prod.chaos.scenarios import SCENARIOS, SOAKS

PACKAGE = "kvpush_prod.chaos.scenarios"


def scenario(name: str) -> ModuleType:
    """The module of the scenario ``name`` (one of ``SCENARIOS``)."""
    return importlib.import_module(f"{PACKAGE}.{name}")


def listing(names: tuple[str, ...] = SCENARIOS) -> list[str]:
    """One line per scenario: its name and what it does."""
    return [f"{name:20s} {scenario(name).DESCRIPTION}" for name in names]


def usage(names: tuple[str, ...] = SCENARIOS) -> str:
    lines = [
        "usage: kvpush chaos <scenario> [--requests N --concurrency C --seed S "
        "--report out.json ...]",
        "       kvpush chaos all [--report-dir DIR] [args]   (every scenario but the soaks: "
        + ", ".join(SOAKS)
        + ")",
        "       kvpush chaos --list",
        "",
        "scenarios:",
    ]
    lines += [f"  {line}" for line in listing(names)]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] == "--list":
        print("\n".join(listing()))
        return 0
    name, rest = argv[0], argv[1:]
    if name == "all":
        return _all(tuple(n for n in SCENARIOS if n not in SOAKS), rest)
    if name not in SCENARIOS:
        print(f"kvpush chaos: unknown scenario {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    from kvpush_prod.chaos.harness import main as run

    return run(scenario(name), rest)


def _all(names: tuple[str, ...], rest: list[str]) -> int:
    """Each scenario on its own cluster, one after the other; a table of the verdicts."""
    from kvpush_prod.chaos.harness import main as run
    from kvpush_prod.chaos.verdict import table_markdown

    out_dir = Path("chaos-reports")
    if "--report-dir" in rest:
        i = rest.index("--report-dir")
        out_dir = Path(rest[i + 1])
        rest = rest[:i] + rest[i + 2 :]
    out_dir.mkdir(parents=True, exist_ok=True)
    reports = []
    worst = 0
    for name in names:
        path = out_dir / f"{name}.json"
        worst = max(worst, run(scenario(name), [*rest, "--report", str(path)]))
        if path.is_file():
            reports.append(json.loads(path.read_text()))
    table = table_markdown(reports)
    (out_dir / "table.md").write_text(table + "\n")
    print(table)
    return worst
