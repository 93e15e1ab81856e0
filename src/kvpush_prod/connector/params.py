"""Reading the ``kv_transfer_params`` a router puts on each leg of a request.

The same fields vLLM's NixlPushConnector takes, plus our optional ``transfer_id``,
``remote_key`` (the prefill engine's public key) and ``decode_key`` (the decode engine the
router chose). Everything here comes from a client: each field is checked before use.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from kvpush_prod.core.vocabulary import ParamsRejectReason
from kvpush_prod.errors import KVTransferParamsError

# vLLM appends "-<8 hex>" to the request id it got in X-Request-Id.
_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)
# RFC 1123 host names: dot-separated labels of letters, digits and inner hyphens.
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_Z85 = re.compile(r"^[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
MAX_ID_LEN = 256


def check_host(host: object, field: str = "remote_host") -> str:
    """``host`` if it is an IP address or a host name, else KVTransferParamsError."""
    if not isinstance(host, str) or not host:
        raise KVTransferParamsError(
            f"kv_transfer_params.{field} must be a host name or IP address, got {host!r}"
        )
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        pass
    else:  # an IPv6 address goes in brackets in tcp://HOST:PORT
        return f"[{ip}]" if ip.version == 6 else str(ip)
    name = host[:-1] if host.endswith(".") else host
    if len(name) > 253 or not all(_LABEL.match(label) for label in name.split(".")):
        raise KVTransferParamsError(
            f"kv_transfer_params.{field}={host[:80]!r} is neither an IP address nor a host "
            "name (letters, digits, hyphens, dots): send the prefill engine's control address "
            "from its kv_transfer_params"
        )
    return host


def check_key(key: object, field: str) -> str:
    """``key`` if it is a Z85 CurveZMQ public key (40 characters), else KVTransferParamsError."""
    if not isinstance(key, str) or not _Z85.match(key):
        raise KVTransferParamsError(
            f"kv_transfer_params.{field} must be a 40-character Z85 public key (as the engine "
            f"answers it in its kv_transfer_params), got {str(key)[:60]!r}"
        )
    return key


def base_request_id(request_id: str) -> str:
    """The request id without vLLM's random suffix (what both legs have in common)."""
    return _SUFFIX.sub("", request_id)


def transfer_id_of(request_id: str, params: dict[str, Any]) -> str:
    """Our transfer id if the router sent one, else the shared base request id."""
    tid = params.get("transfer_id")
    if tid is None:
        return base_request_id(request_id)
    if not isinstance(tid, str) or not tid or len(tid) > MAX_ID_LEN:
        raise KVTransferParamsError(
            f"kv_transfer_params.transfer_id must be a non-empty string of at most 256 "
            f"characters, got {tid!r}; send the same value to both legs (or omit it)"
        )
    return tid


@dataclass(frozen=True)
class RemotePrefill:
    """D's view of a request whose prompt KV is pushed by a prefill engine."""

    transfer_id: str
    host: str
    port: int
    engine_id: str
    tp_size: int
    key: str = ""  # the prefill engine's public key ("" if the params name none)


# Fields only a kvpush prefill engine's answer (or a router that read one) carries.
_KVPUSH_FIELDS = ("kvpush", "transfer_id", "remote_key")


def parse_remote_prefill(request_id: str, params: dict[str, Any] | None) -> RemotePrefill | None:
    """None if the request is not a remote prefill; raises KVTransferParamsError if malformed,
    or if it names a prefill engine in a way D cannot use (reason ``unusable``), so that such
    a request is counted and warned about rather than silently computed here."""
    if not params:
        return None
    if "do_remote_prefill" not in params:
        named = [k for k in _KVPUSH_FIELDS if k in params]
        if named:
            raise KVTransferParamsError(
                f"kv_transfer_params carry a prefill engine's {', '.join(named)} but no "
                "do_remote_prefill: the router did not pass the prefill engine's answer as it "
                "is (or stripped do_remote_prefill); send it unchanged (do_remote_prefill: true)",
                reason=ParamsRejectReason.UNUSABLE,
            )
        return None
    if not params.get("do_remote_prefill"):
        return None
    mode = params.get("transfer_mode", "push")
    if mode != "push":
        raise KVTransferParamsError(
            f"kv_transfer_params.transfer_mode={str(mode)[:20]!r}: the prefill engine runs a "
            "pull connector (vLLM's NixlConnector); a kvpush decode engine needs a kvpush "
            "prefill engine (kv_connector: PushConnector on both)",
            reason=ParamsRejectReason.UNUSABLE,
        )
    missing = [k for k in ("remote_host", "remote_port") if params.get(k) in (None, "")]
    if missing:
        raise KVTransferParamsError(
            f"kv_transfer_params has do_remote_prefill but no {', '.join(missing)}: the router "
            "must send the prefill engine's control host and port (from its kv_transfer_params)"
        )
    host, port = check_host(params["remote_host"]), params["remote_port"]
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise KVTransferParamsError(
            f"kv_transfer_params.remote_port must be a port number 1-65535, got {port!r}"
        )
    tp = params.get("tp_size", 1)
    if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= 1024:
        raise KVTransferParamsError(f"kv_transfer_params.tp_size must be 1-1024, got {tp!r}")
    engine_id = params.get("remote_engine_id") or ""
    if not isinstance(engine_id, str) or len(engine_id) > MAX_ID_LEN:
        raise KVTransferParamsError(
            f"kv_transfer_params.remote_engine_id must be a string of at most {MAX_ID_LEN} "
            f"characters, got {str(engine_id)[:60]!r}"
        )
    key = params.get("remote_key")
    return RemotePrefill(
        transfer_id=transfer_id_of(request_id, params),
        host=host,
        port=port,
        engine_id=engine_id,
        tp_size=tp,
        key=check_key(key, "remote_key") if key else "",
    )


def decode_key_of(params: dict[str, Any]) -> str:
    """P: the public key of the decode engine the router chose ("" if it named none)."""
    key = params.get("decode_key")
    return check_key(key, "decode_key") if key else ""


def is_remote_decode(params: dict[str, Any] | None) -> bool:
    """True for the prefill leg of a disaggregated request."""
    return bool(params and params.get("do_remote_decode"))


def is_probe(params: dict[str, Any] | None) -> bool:
    """True for a router's identity probe (answer with our identity, hold nothing)."""
    return bool(params and params.get("kvpush_probe"))
