"""Injected into vLLM engines of the benchmark (on their PYTHONPATH only): neutralise NIXL's
busy-spinning progress thread without patching vLLM.

``nixl._api.nixl_agent.__init__`` hard-codes ``pthrDelay = 0``; this wraps it, once the
module is imported, so the agent config it builds gets ``KVPUSH_BENCH_PTHR_DELAY_US``
instead (the same trick as kvpush_prod.transport.nixl.make_agent). Each wrapped agent
writes one marker line to stderr, which the benchmark checks in the engine logs.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

_ENV = "KVPUSH_BENCH_PTHR_DELAY_US"
MARKER = "kvpush-bench: nixl progress thread delay set to"


def _patch(mod: types.ModuleType) -> None:
    agent_cls = getattr(mod, "nixl_agent", None)
    if agent_cls is None or getattr(agent_cls, "_kvpush_spinfix", False):
        return
    delay = int(os.environ.get(_ENV, "1000"))
    original = agent_cls.__init__
    api: Any = mod  # nixl_cu*._api: its nixlBind (the C++ bindings) is invisible to mypy

    def __init__(self: object, *args: Any, **kwargs: Any) -> None:
        real = api.nixlBind

        class _Config:
            real: Any  # NIXL's own config object, set once in __init__

            def __init__(self) -> None:
                object.__setattr__(self, "real", real.nixlAgentConfig())

            def __setattr__(self, key: str, value: object) -> None:
                if key == "pthrDelay":
                    value = delay
                setattr(self.real, key, value)

        class _Bindings(types.ModuleType):
            nixlAgentConfig: Any  # the two names overridden; the rest come from ``real``
            nixlAgent: Any

            def __getattr__(self, key: str) -> object:
                return getattr(real, key)

        proxy = _Bindings("nixl_bindings_spinfix")
        proxy.nixlAgentConfig = _Config
        proxy.nixlAgent = lambda name, cfg: real.nixlAgent(name, cfg.real)
        api.nixlBind = proxy
        try:
            original(self, *args, **kwargs)
        finally:
            api.nixlBind = real
        print(
            f"{MARKER} {delay} us (agent {args[0] if args else '?'}, pid {os.getpid()})",
            file=sys.stderr,
            flush=True,
        )

    agent_cls.__init__ = __init__
    agent_cls._kvpush_spinfix = True


class _After(importlib.abc.MetaPathFinder):
    """Patches ``nixl_cu*._api`` right after it is executed (nixl._api is an alias of it)."""

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not (name.startswith("nixl") and name.endswith("._api")):
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: types.ModuleType) -> None:
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if os.environ.get(_ENV):
    sys.meta_path.insert(0, _After())
