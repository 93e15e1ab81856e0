"""Chaos scenarios: each starts real engines, breaks them mid-transfer and ends in a verdict.

Run one with ``kvpush chaos <name> [--requests N --concurrency C --seed S --report F]`` (or
``python -m kvpush_prod.chaos.scenarios.<name> ...``); ``kvpush chaos --list`` names them all.
They ship with the package; the harness they run on is ``kvpush_prod.chaos``.
"""

SCENARIOS = (
    "kill_prefill",
    "kill_decode",
    "stall_prefill",
    "write_failures",
    "bad_peer",
    "client_cancel",
    "restart_under_load",
    "drain",
    "nxm_kill",
    "nemesis",
)
# Scenarios that run for a set time (minutes to hours): ``kvpush chaos all`` leaves them out.
SOAKS = ("nemesis",)
