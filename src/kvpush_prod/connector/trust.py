"""What an engine believes of a request's kv_transfer_params: they come from a client, so the
router's signature, the peer's address and the peer's key are checked before any use.

One object per engine process, built from the configuration (key files are read once).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush_prod.config import KvpushConfig
from kvpush_prod.connector.params import RemotePrefill, decode_key_of, parse_remote_prefill
from kvpush_prod.core.vocabulary import ParamsRejectReason
from kvpush_prod.errors import ConfigError, KVTransferParamsError
from kvpush_prod.signing import (
    DECODE,
    PREFILL,
    NonceMemory,
    SignatureError,
    check_key,
    read_key_file,
    verify_params,
)

logger = logging.getLogger(__name__)

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_RESOLVED_KEEP = 1024  # host names resolved for the allowed_peers check
_RESOLVED_TTL_S = 60.0  # a prefill engine that moves is found again within this long


def read_params_key(cfg: KvpushConfig) -> bytes | None:
    """The router's params key (from the environment, or the file ``params_key_file``)."""
    c = cfg.control
    try:
        if c.params_key:
            return check_key(c.params_key.encode(), "control.params_key")
        if c.params_key_file:
            return read_key_file(Path(c.params_key_file), "control.params_key_file")
    except SignatureError as exc:
        raise ConfigError(str(exc)) from None
    return None


@dataclass
class Trust:
    """The checks one engine applies to kv_transfer_params (D: which P; P: which D)."""

    public_key: str = ""  # this engine's Z85 public key ("" without keys)
    allowed: Mapping[str, str] = field(default_factory=dict)  # Z85 key -> name
    params_key: bytes | None = None
    networks: tuple[IpNetwork, ...] = ()
    _resolved: OrderedDict[str, tuple[float, tuple[str, ...]]] = field(default_factory=OrderedDict)
    nonces: NonceMemory = field(default_factory=NonceMemory)

    @classmethod
    def from_config(cls, cfg: KvpushConfig) -> Trust:
        c = cfg.control
        public, allowed = "", {}
        if c.key_file and c.allowed_keys:
            from kvpush_prod.control.keys import load_allowed, load_keypair

            public = load_keypair(c.key_file).public.decode()
            allowed = {k.decode(): name for k, name in load_allowed(c.allowed_keys).items()}
        return cls(
            public,
            allowed,
            read_params_key(cfg),
            tuple(ipaddress.ip_network(n, strict=False) for n in c.allowed_peers),
        )

    def tables(self) -> dict[str, tuple[int, int | None]]:
        """Entries of the replay memory and of the host names resolved."""
        return {**self.nonces.tables(), "trust.resolved": (len(self._resolved), _RESOLVED_KEEP)}

    @property
    def keyed(self) -> bool:
        return bool(self.public_key)

    # ----------------------------------------------------------------- D: the prefill
    def remote_prefill(
        self, request_id: str, params: dict[str, Any] | None
    ) -> RemotePrefill | None:
        """The prefill engine a decode request names, once every check passed; None if the
        request is not a remote prefill. Raises KVTransferParamsError(reason)."""
        remote = parse_remote_prefill(request_id, params)
        if remote is None:
            return None
        assert params is not None
        self._check_signature(request_id, params, DECODE)
        # The address checked is the address used: a host name is resolved once, here, and
        # its checked address is what the control channel connects to (no second lookup
        # that DNS could answer differently).
        host = self._check_network(remote.host)
        key = self._prefill_key(remote) if self.keyed else remote.key
        return RemotePrefill(
            remote.transfer_id, host, remote.port, remote.engine_id, remote.tp_size, key
        )

    def _prefill_key(self, remote: RemotePrefill) -> str:
        if remote.key:
            if remote.key not in self.allowed:
                raise KVTransferParamsError(
                    f"kv_transfer_params.remote_key {remote.key[:8]}... is not in this engine's "
                    "allow-list (control.allowed_keys): add the prefill engine's .key file "
                    "there",
                    reason=ParamsRejectReason.UNKNOWN_KEY,
                )
            return remote.key
        # A router that does not pass keys: the engine id may name a key in the allow-list.
        by_name = [k for k, name in self.allowed.items() if name == remote.engine_id]
        if len(by_name) == 1:
            return by_name[0]
        raise KVTransferParamsError(
            "kv_transfer_params name no remote_key, and remote_engine_id "
            f"{remote.engine_id[:60]!r} is not the name of a key in control.allowed_keys: "
            "send the prefill engine's remote_key (kvpush router does), or name each engine's "
            "key after its engine_id",
            reason=ParamsRejectReason.UNKNOWN_KEY,
        )

    # ----------------------------------------------------------------- P: the decode
    def decode_owner(self, request_id: str, params: dict[str, Any]) -> str:
        """The decode engine a prefill request was routed to ("" if the router named none).
        Raises KVTransferParamsError(reason)."""
        self._check_signature(request_id, params, PREFILL)
        key = decode_key_of(params)
        if key and self.keyed and key not in self.allowed:
            raise KVTransferParamsError(
                f"kv_transfer_params.decode_key {key[:8]}... is not in this engine's allow-list "
                "(control.allowed_keys)",
                reason=ParamsRejectReason.UNKNOWN_KEY,
            )
        return key if self.keyed else ""

    # ----------------------------------------------------------------- checks
    def _check_signature(self, request_id: str, params: dict[str, Any], leg: str) -> None:
        """The router signed these params for ``leg`` and no other request used them."""
        if self.params_key is None:
            return
        now = time.time()
        try:
            signed = verify_params(params, self.params_key, now, leg)
            self.nonces.take(signed, request_id, now)
        except SignatureError as exc:
            raise KVTransferParamsError(str(exc), reason=exc.reason) from None

    def _check_network(self, host: str) -> str:
        """``host`` as the control channel must reach it: unchanged without
        control.allowed_peers; else the address it resolved to, once every address it
        resolves to is inside them."""
        if not self.networks:
            return host
        addrs = self._addresses(host)
        for addr in addrs:
            ip = ipaddress.ip_address(addr)
            if not any(ip in net for net in self.networks):
                raise KVTransferParamsError(
                    f"kv_transfer_params.remote_host {host!r} ({addr}) is outside "
                    "control.allowed_peers; add its network there if it is a prefill engine",
                    reason=ParamsRejectReason.FOREIGN_PEER,
                )
        ip = ipaddress.ip_address(addrs[0])
        return f"[{ip}]" if ip.version == 6 else str(ip)

    def _addresses(self, host: str) -> tuple[str, ...]:
        bare = host.strip("[]")
        try:
            return (str(ipaddress.ip_address(bare)),)
        except ValueError:
            pass
        now = time.monotonic()
        entry = self._resolved.get(host)
        cached = entry[1] if entry is not None and entry[0] > now else None
        if cached is None:
            try:
                infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
            except OSError as exc:
                raise KVTransferParamsError(
                    f"kv_transfer_params.remote_host {host!r} does not resolve ({exc})",
                    reason=ParamsRejectReason.FOREIGN_PEER,
                ) from None
            cached = tuple(sorted({str(i[4][0]) for i in infos}))
            self._resolved[host] = (now + _RESOLVED_TTL_S, cached)
            while len(self._resolved) > _RESOLVED_KEEP:
                self._resolved.popitem(last=False)
        self._resolved.move_to_end(host)
        return cached
