"""Chaos scenarios: each starts real engines, breaks them mid-transfer and ends in a verdict.

Run one with ``python -m chaos.<name> [--requests N --concurrency C --seed S --report F]``
or ``kvpush chaos <name> ...``; the harness is ``kvpush_prod.chaos``.
"""

SCENARIOS = (
    "kill_prefill",
    "kill_decode",
    "stall_prefill",
    "write_failures",
    "bad_peer",
    "client_cancel",
    "restart_under_load",
    "nxm_kill",
)
