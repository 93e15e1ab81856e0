"""NIXL loopback push (WRITE) latency and bandwidth vs memcpy, 4 KiB to 64 MiB:
``python benchmarks/transfer.py [--out DIR]`` (the same as ``kvpush bench transfer``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from kvpush_prod.bench.transfer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
