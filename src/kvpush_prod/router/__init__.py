"""Push-aware P/D router: an OpenAI-compatible proxy that sends both legs of a request at once.

Entry points: ``build_app(settings)``, ``load_settings(path)``, ``main(argv)``.
"""

from __future__ import annotations

from kvpush_prod.router.app import build_app
from kvpush_prod.router.cli import main, settings_from_args
from kvpush_prod.router.config import (
    DecodeBackendConfig,
    PrefillBackendConfig,
    RouterSettings,
    load_settings,
    settings_from_mapping,
)
from kvpush_prod.router.metrics import Outcome, RejectReason, RouterMetrics

__all__ = [
    "DecodeBackendConfig",
    "Outcome",
    "PrefillBackendConfig",
    "RejectReason",
    "RouterMetrics",
    "RouterSettings",
    "build_app",
    "load_settings",
    "main",
    "settings_from_args",
    "settings_from_mapping",
]
