"""Side-by-side serving benchmark: ``python benchmarks/serving.py [kvpush bench options]``.

The same as ``kvpush bench``: a single engine, vLLM's NixlConnector (pull) and
NixlPushConnector (push), each as shipped and with NIXL's progress-thread spin neutralised,
and kvpush, on one workload. See docs/benchmarks.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from kvpush_prod.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
