"""Router-signed kv_transfer_params: a MAC over every field and an expiry, so an engine can
tell params the router issued from params a client wrote (and names no peer it was not told).

One shared secret (the params key) between the router and the engines; HMAC-SHA256 from the
standard library. Pure: no I/O, time is passed in.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from typing import Any

SIG_FIELD = "kvpush_sig"
PARAMS_KEY_ENV = "KVPUSH_PARAMS_KEY"
_DOMAIN = b"kvpush-params-v1\n"
DEFAULT_TTL_S = 120.0
MIN_KEY_BYTES = 16


class SignatureError(ValueError):
    """Why signed params were refused; ``reason`` is a short metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _canonical(params: dict[str, Any], expires_at: float) -> bytes:
    body = {k: v for k, v in params.items() if k != SIG_FIELD}
    body["__expires_at"] = expires_at
    return _DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":"),
                                ensure_ascii=True, allow_nan=False).encode()


def check_key(key: bytes) -> bytes:
    if len(key) < MIN_KEY_BYTES:
        raise SignatureError(
            "weak_key",
            f"the params key is {len(key)} bytes; use at least {MIN_KEY_BYTES} random bytes "
            "(e.g. `openssl rand -hex 32`)",
        )
    return key


def sign_params(params: dict[str, Any], key: bytes, now: float,
                ttl_s: float = DEFAULT_TTL_S) -> dict[str, Any]:
    """``params`` plus a signature over every one of its fields, valid until ``now + ttl_s``."""
    check_key(key)
    expires_at = round(now + ttl_s, 3)
    mac = hmac.new(key, _canonical(params, expires_at), hashlib.sha256).hexdigest()
    return {**{k: v for k, v in params.items() if k != SIG_FIELD},
            SIG_FIELD: {"expires_at": expires_at, "mac": mac}}


def verify_params(params: dict[str, Any], key: bytes, now: float,
                  max_ttl_s: float = 3600.0) -> None:
    """Raise SignatureError unless ``params`` carry a valid, unexpired signature by ``key``."""
    sig = params.get(SIG_FIELD)
    if sig is None:
        raise SignatureError(
            "unsigned",
            f"kv_transfer_params carry no {SIG_FIELD} while this engine requires router-signed "
            "params (control.params_key is set): send requests through a router that holds "
            "the same params key",
        )
    if not isinstance(sig, dict) or not isinstance(sig.get("mac"), str) \
            or isinstance(sig.get("expires_at"), bool) \
            or not isinstance(sig.get("expires_at"), (int, float)):
        raise SignatureError("malformed", f"kv_transfer_params.{SIG_FIELD} is malformed")
    expires_at = float(sig["expires_at"])
    if not math.isfinite(expires_at) or expires_at < now:
        raise SignatureError("expired", "the router's signature on kv_transfer_params expired")
    if expires_at > now + max_ttl_s:
        raise SignatureError(
            "expired", "the router's signature on kv_transfer_params expires too far ahead")
    try:
        want = hmac.new(key, _canonical(params, sig["expires_at"]), hashlib.sha256).hexdigest()
    except (TypeError, ValueError) as exc:
        raise SignatureError("malformed", f"kv_transfer_params cannot be signed: {exc}") from None
    if not hmac.compare_digest(want, sig["mac"]):
        raise SignatureError(
            "bad_signature",
            "kv_transfer_params do not match the router's signature (changed, or signed with "
            "another params key)",
        )
