"""The chaos harness: load generator, fault triggers, quiescence checks and the verdict.

Scenario scripts (``chaos/<name>.py``, ``kvpush chaos <name>``) are built on these parts.
"""
