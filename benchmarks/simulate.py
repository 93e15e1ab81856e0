"""Discrete-event simulator of pull, plain push and kvpush on the pure core:
``python benchmarks/simulate.py [kvpush sim options]`` (the same as ``kvpush sim``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from kvpush_prod.sim.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
