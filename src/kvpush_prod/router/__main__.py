"""``python -m kvpush_prod.router``: run the push-aware P/D router.

See ``kvpush_prod.router.cli`` for the flags.
"""

from __future__ import annotations

import sys

from kvpush_prod.router.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m kvpush_prod.router"))
