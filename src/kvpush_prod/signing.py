"""Router-signed kv_transfer_params: a MAC that binds one leg of one request (its role, its
fields, an expiry and a single-use nonce), so an engine can tell params the router issued for
this very leg from params a client wrote, replayed or moved to another leg or prompt.

One shared secret (the params key) between the router and the engines; HMAC-SHA256 from the
standard library. Pure but for the key file reader: time is passed in.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import secrets
import stat
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush_prod.vocabulary import KeyProblem, ParamsRejectReason

SIG_FIELD = "kvpush_sig"
PARAMS_KEY_ENV = "KVPUSH_PARAMS_KEY"
_DOMAIN = b"kvpush-params-v2\n"
SIG_VERSION = 2
DEFAULT_TTL_S = 120.0
MAX_TTL_S = 3600.0
MIN_KEY_BYTES = 32
_MIN_DISTINCT = 12  # distinct characters a random key of 32+ bytes shows (hex: ~16 of 16)
NONCE_BYTES = 16
_NONCE = re.compile(r"^[0-9a-f]{32}$")

PREFILL = "prefill"
DECODE = "decode"
LEGS = (PREFILL, DECODE)

# The fields a signing router puts on each leg (router/legs.py); anything else is refused
# under a signature, so no field can ride along unauthorised.
LEG_FIELDS: dict[str, frozenset[str]] = {
    PREFILL: frozenset({"do_remote_decode", "do_remote_prefill", "transfer_id", "decode_key"}),
    DECODE: frozenset(
        {
            "do_remote_prefill",
            "do_remote_decode",
            "remote_engine_id",
            "remote_host",
            "remote_port",
            "tp_size",
            "transfer_id",
            "remote_key",
        }
    ),
}


class SignatureError(ValueError):
    """Why signed params were refused; ``reason`` is a short metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class Signed:
    """What a valid signature vouches for beyond the fields: which leg, until when, and the
    nonce an engine accepts once (``NonceMemory``)."""

    leg: str
    nonce: str
    expires_at: float


def _canonical(params: dict[str, Any], leg: str, nonce: str, expires_at: float) -> bytes:
    # The fields and the signature's own terms in separate members: no field of the params
    # can pose as a term of the signature (or the other way round).
    body = {k: v for k, v in params.items() if k != SIG_FIELD}
    doc = {
        "params": body,
        "sig": {"v": SIG_VERSION, "leg": leg, "nonce": nonce, "expires_at": expires_at},
    }
    return (
        _DOMAIN
        + json.dumps(
            doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        ).encode()
    )


def _hex_bytes(key: bytes) -> int | None:
    """How many bytes ``key`` holds if it is written in hex (``openssl rand -hex``), else None."""
    text = key.strip()
    if len(text) % 2 == 0 and re.fullmatch(rb"[0-9a-fA-F]+", text):
        return len(text) // 2
    return None


def check_key(key: bytes, where: str = "the params key") -> bytes:
    """``key`` if it holds at least 32 random bytes, else SignatureError naming the fix."""
    fix = (
        "make one with `openssl rand -hex 32 > params.key` and give it to the router and "
        "every engine"
    )
    n = _hex_bytes(key)
    size = n if n is not None else len(key)
    if size < MIN_KEY_BYTES:
        raise SignatureError(
            KeyProblem.WEAK_KEY,
            f"{where} holds {size} bytes; it must hold at least {MIN_KEY_BYTES} "
            f"random bytes: {fix}",
        )
    if len(set(key)) < _MIN_DISTINCT:
        raise SignatureError(
            KeyProblem.WEAK_KEY,
            f"{where} uses {len(set(key))} distinct characters: it is not random; {fix}",
        )
    return key


def read_key_file(path: str | Path, what: str = "params key file") -> bytes:
    """The params key in ``path``, refused when others than its owner may read or write the
    file or when it is weak. Raises SignatureError(reason ``key_file``/``weak_key``)."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        key = p.read_bytes().strip()
    except OSError as exc:
        raise SignatureError(
            KeyProblem.KEY_FILE, f"cannot read the {what} {str(p)!r} ({exc.strerror})"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SignatureError(
            KeyProblem.KEY_FILE,
            f"the {what} {str(p)!r} has mode {stat.S_IMODE(mode):04o}: group and "
            f"others may read it; make it readable by its owner only: chmod 600 {p}",
        )
    return check_key(key, f"the {what} {str(p)!r}")


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def sign_params(
    params: dict[str, Any],
    key: bytes,
    now: float,
    leg: str,
    ttl_s: float = DEFAULT_TTL_S,
    nonce: str | None = None,
) -> dict[str, Any]:
    """``params`` plus a signature binding every field, the ``leg`` they are for, an expiry
    ``now + ttl_s`` and a fresh nonce."""
    if leg not in LEGS:
        raise ValueError(f"leg must be one of {LEGS}, got {leg!r}")
    check_key(key)
    expires_at = round(now + ttl_s, 3)
    nonce = nonce or new_nonce()
    mac = hmac.new(key, _canonical(params, leg, nonce, expires_at), hashlib.sha256).hexdigest()
    return {
        **{k: v for k, v in params.items() if k != SIG_FIELD},
        SIG_FIELD: {
            "v": SIG_VERSION,
            "leg": leg,
            "nonce": nonce,
            "expires_at": expires_at,
            "mac": mac,
        },
    }


def verify_params(
    params: dict[str, Any], key: bytes, now: float, leg: str, max_ttl_s: float = MAX_TTL_S
) -> Signed:
    """What the signature vouches for, once ``params`` carry a valid, unexpired signature by
    ``key`` for ``leg`` over the fields that leg may carry; else SignatureError."""
    sig = _signature_of(params, leg)
    expires_at = float(sig["expires_at"])
    if not math.isfinite(expires_at) or expires_at < now:
        raise SignatureError(
            ParamsRejectReason.EXPIRED, "the router's signature on kv_transfer_params expired"
        )
    if expires_at > now + max_ttl_s:
        raise SignatureError(
            ParamsRejectReason.EXPIRED,
            "the router's signature on kv_transfer_params expires too far ahead",
        )
    try:
        want = hmac.new(
            key, _canonical(params, leg, sig["nonce"], sig["expires_at"]), hashlib.sha256
        ).hexdigest()
    except (TypeError, ValueError) as exc:
        raise SignatureError(
            ParamsRejectReason.MALFORMED, f"kv_transfer_params cannot be signed: {exc}"
        ) from None
    if not hmac.compare_digest(want, sig["mac"]):
        raise SignatureError(
            ParamsRejectReason.BAD_SIGNATURE,
            "kv_transfer_params do not match the router's signature (changed, or signed with "
            "another params key)",
        )
    return Signed(leg, sig["nonce"], expires_at)


def _signature_of(params: dict[str, Any], leg: str) -> dict[str, Any]:
    """``params``' signature, well formed, for ``leg``, over the fields a router signs on that
    leg and naming a transfer id (not yet checked against the key); else SignatureError."""
    sig = params.get(SIG_FIELD)
    if sig is None:
        raise SignatureError(
            ParamsRejectReason.UNSIGNED,
            f"kv_transfer_params carry no {SIG_FIELD} while this engine requires router-signed "
            "params (control.params_key is set): send requests through a router that holds "
            "the same params key",
        )
    if (
        not isinstance(sig, dict)
        or set(sig) != {"v", "leg", "nonce", "expires_at", "mac"}
        or not isinstance(sig.get("mac"), str)
        or not isinstance(sig.get("nonce"), str)
        or isinstance(sig.get("expires_at"), bool)
        or not isinstance(sig.get("expires_at"), (int, float))
    ):
        raise SignatureError(
            ParamsRejectReason.MALFORMED,
            f"kv_transfer_params.{SIG_FIELD} is malformed (a router of another "
            "kvpush version?): run the router and the engines from the same release",
        )
    if sig["v"] != SIG_VERSION or not _NONCE.match(sig["nonce"]):
        raise SignatureError(
            ParamsRejectReason.MALFORMED,
            f"kv_transfer_params.{SIG_FIELD} has version {str(sig['v'])[:8]!r}; this "
            f"engine takes {SIG_VERSION}",
        )
    if sig["leg"] != leg:
        raise SignatureError(
            ParamsRejectReason.WRONG_LEG,
            f"kv_transfer_params were signed for the {str(sig['leg'])[:10]} leg "
            f"and sent to a {leg} engine",
        )
    unknown = sorted(k for k in params if k != SIG_FIELD and k not in LEG_FIELDS[leg])
    if unknown:
        raise SignatureError(
            ParamsRejectReason.UNKNOWN_FIELD,
            f"kv_transfer_params carry {', '.join(u[:40] for u in unknown[:5])}"
            f", which a router does not sign on the {leg} leg",
        )
    tid = params.get("transfer_id")
    if not isinstance(tid, str) or not tid:
        raise SignatureError(
            ParamsRejectReason.MALFORMED,
            "signed kv_transfer_params name no transfer_id: a signing router "
            "binds each leg to its transfer id (kvpush router does)",
        )
    return sig


class NonceMemory:
    """The nonces this engine accepted, each until its signature expires: a second request
    with a nonce already taken is a replay. Bounded: when ``capacity`` live nonces are held,
    new signed requests are refused (reason ``replay_memory_full``) rather than any nonce
    forgotten early, which would reopen its replay window."""

    def __init__(self, capacity: int = 1 << 18) -> None:
        self.capacity = capacity
        self._by_nonce: dict[str, tuple[float, str]] = {}  # nonce -> (expires_at, request)
        self._expiry: OrderedDict[str, float] = OrderedDict()  # in arrival order

    def __len__(self) -> int:
        return len(self._by_nonce)

    def tables(self) -> dict[str, tuple[int, int | None]]:
        """Live nonces (bounded by ``capacity``) and their expiry order."""
        return {
            "trust.nonces": (len(self._by_nonce), self.capacity),
            "trust.nonce_expiry": (len(self._expiry), self.capacity),
        }

    def take(self, signed: Signed, request_id: str, now: float) -> None:
        """Accept ``signed``'s nonce for ``request_id`` (again for the same request: vLLM asks
        about one request more than once); SignatureError(``replayed``) when another request
        took it."""
        self._expire(now)
        held = self._by_nonce.get(signed.nonce)
        if held is not None:
            if held[1] == request_id:
                return
            raise SignatureError(
                ParamsRejectReason.REPLAYED,
                "kv_transfer_params were already used by another request (a "
                "replayed leg); the router signs each leg once",
            )
        if len(self._by_nonce) >= self.capacity:
            raise SignatureError(
                ParamsRejectReason.REPLAY_MEMORY_FULL,
                f"{self.capacity} signed requests are remembered within "
                "their signatures' lifetime; lower the router's params_ttl_s",
            )
        self._by_nonce[signed.nonce] = (signed.expires_at, request_id)
        self._expiry[signed.nonce] = signed.expires_at

    def _expire(self, now: float) -> None:
        # Expiry times arrive nearly in order (one router's TTL): drop from the front while
        # expired, and stop at the first live one (a later-expiring one ahead of an earlier
        # one only stays a little longer, never less).
        while self._expiry:
            nonce, expires_at = next(iter(self._expiry.items()))
            if expires_at >= now:
                return
            self._expiry.popitem(last=False)
            self._by_nonce.pop(nonce, None)
