"""Shared settings for the core tests: a hypothesis profile sized for CI.

``KVPUSH_HYPOTHESIS_EXAMPLES`` sets the examples per property (default 60); the profile is
registered here and applied per test (not loaded globally), so other test trees keep theirs.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "kvpush-core",
    max_examples=int(os.environ.get("KVPUSH_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
