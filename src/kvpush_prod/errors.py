"""The one exception hierarchy of kvpush-prod.

Every message says what was wrong, with the offending value, and what to do about it.
"""

from __future__ import annotations


class KvpushError(Exception):
    """Base of every error raised by kvpush-prod."""


class ConfigError(KvpushError, ValueError):
    """A configuration value (YAML profile, kv_connector_extra_config, env) is invalid."""


class ProtocolError(KvpushError):
    """A control message or notification broke the protocol (malformed, stale, unknown)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class TransportError(KvpushError):
    """A transfer could not be posted or completed by the transport."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


class KVTransferParamsError(KvpushError, ValueError):
    """A request's kv_transfer_params are missing a field, hold a bad value or are not
    trusted; ``reason`` is the short label the rejection is counted under."""

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason
