"""Reading the ``kv_transfer_params`` a router puts on each leg of a request.

The same fields vLLM's NixlPushConnector takes, plus our optional ``transfer_id``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvpush_prod.errors import KVTransferParamsError

# vLLM appends "-<8 hex>" to the request id it got in X-Request-Id.
_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)


def base_request_id(request_id: str) -> str:
    """The request id without vLLM's random suffix (what both legs have in common)."""
    return _SUFFIX.sub("", request_id)


def transfer_id_of(request_id: str, params: dict[str, Any]) -> str:
    """Our transfer id if the router sent one, else the shared base request id."""
    tid = params.get("transfer_id")
    if tid is None:
        return base_request_id(request_id)
    if not isinstance(tid, str) or not tid or len(tid) > 256:
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


def parse_remote_prefill(request_id: str, params: dict[str, Any] | None) -> RemotePrefill | None:
    """None if the request is not a remote prefill; raises KVTransferParamsError if malformed."""
    if not params or not params.get("do_remote_prefill"):
        return None
    missing = [k for k in ("remote_host", "remote_port") if params.get(k) in (None, "")]
    if missing:
        raise KVTransferParamsError(
            f"kv_transfer_params has do_remote_prefill but no {', '.join(missing)}: the router "
            "must send the prefill engine's control host and port (from its kv_transfer_params)"
        )
    host, port = params["remote_host"], params["remote_port"]
    if not isinstance(host, str):
        raise KVTransferParamsError(f"kv_transfer_params.remote_host must be a string, got {host!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise KVTransferParamsError(
            f"kv_transfer_params.remote_port must be a port number 1-65535, got {port!r}"
        )
    tp = params.get("tp_size", 1)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise KVTransferParamsError(f"kv_transfer_params.tp_size must be >= 1, got {tp!r}")
    return RemotePrefill(
        transfer_id=transfer_id_of(request_id, params),
        host=host,
        port=port,
        engine_id=str(params.get("remote_engine_id", "")),
        tp_size=tp,
    )


def is_remote_decode(params: dict[str, Any] | None) -> bool:
    """True for the prefill leg of a disaggregated request."""
    return bool(params and params.get("do_remote_decode"))


def is_probe(params: dict[str, Any] | None) -> bool:
    """True for a router's identity probe (answer with our identity, hold nothing)."""
    return bool(params and params.get("kvpush_probe"))
