"""The chaos harness: load generator, fault triggers, quiescence checks and the verdict.

The scenarios (``scenarios/<name>.py``, ``kvpush chaos <name>``) are built on these parts.
"""
