"""``kvpush chaos <scenario> [args]``: run one scenario of the source checkout's ``chaos/``.

The scenarios live next to ``src/`` (like ``configs/``); ``kvpush chaos all`` runs each in turn.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _scenarios() -> tuple[str, ...]:
    if (ROOT / "chaos" / "__init__.py").is_file() and str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        from chaos import SCENARIOS
    except ImportError:
        return ()
    return tuple(SCENARIOS)


def usage(names: tuple[str, ...]) -> str:
    lines = ["usage: kvpush chaos <scenario> [--requests N --concurrency C --seed S "
             "--report out.json ...]", "       kvpush chaos all [--report-dir DIR] [args]", "",
             "scenarios:"]
    for name in names:
        mod = importlib.import_module(f"chaos.{name}")
        lines.append(f"  {name:20s} {mod.DESCRIPTION}")
    if not names:
        lines.append(f"  (none found: {ROOT / 'chaos'} is missing; run from a source checkout)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    names = _scenarios()
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(names))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "all":
        return _all(names, rest)
    if name not in names:
        print(f"kvpush chaos: unknown scenario {name!r}\n\n{usage(names)}", file=sys.stderr)
        return 2
    mod = importlib.import_module(f"chaos.{name}")
    from kvpush_prod.chaos.harness import main as run

    return run(mod, rest)


def _all(names: tuple[str, ...], rest: list[str]) -> int:
    """Each scenario on its own cluster, one after the other; a table of the verdicts."""
    from kvpush_prod.chaos.harness import main as run
    from kvpush_prod.chaos.verdict import table_markdown

    out_dir = Path("chaos-reports")
    if "--report-dir" in rest:
        i = rest.index("--report-dir")
        out_dir = Path(rest[i + 1])
        rest = rest[:i] + rest[i + 2:]
    out_dir.mkdir(parents=True, exist_ok=True)
    reports = []
    worst = 0
    for name in names:
        path = out_dir / f"{name}.json"
        worst = max(worst, run(importlib.import_module(f"chaos.{name}"),
                               [*rest, "--report", str(path)]))
        if path.is_file():
            reports.append(json.loads(path.read_text()))
    table = table_markdown(reports)
    (out_dir / "table.md").write_text(table + "\n")
    print(table)
    return worst
