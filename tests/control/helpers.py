"""Shared helpers of the control tests: messages, key pairs, endpoints, draining."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq

from kvpush_prod.control import ControlCodec, ControlEndpoint, EndpointSecurity, KeyPair
from kvpush_prod.core import messages as m
from kvpush_prod.core import protocol
from kvpush_prod.lab.launch import free_port

PEER = m.PeerInfo("engine-d", 7, 0, "tcp://127.0.0.1:1")
WAIT_S = 10.0  # generous: only a broken channel takes this long

Got = list[tuple[m.ControlMessage, str]]


def cancel(tid: str = "t1") -> m.Cancel:
    """A CANCEL as an endpoint sends it to a peer not heard from yet: in the oldest protocol
    version this build speaks (``core.protocol``)."""
    return m.Cancel(protocol.OLDEST, tid, 3, PEER, "aborted")


def keypair(name: str) -> KeyPair:
    public, secret = zmq.curve_keypair()
    return KeyPair(name, public, secret)


def two_keys() -> tuple[tuple[KeyPair, KeyPair], dict[bytes, str]]:
    a, b = keypair("prefill-0"), keypair("decode-0")
    return (a, b), {a.public: a.name, b.public: b.name}


def secure_endpoint(pair: KeyPair, allowed: dict[bytes, str], **kw: Any) -> ControlEndpoint:
    return ControlEndpoint(
        ControlCodec(4096), "127.0.0.1", free_port(), EndpointSecurity(pair, allowed), **kw
    )


def drain(
    ep: ControlEndpoint,
    count: int | None = None,
    until: Callable[[Got], bool] | None = None,
    seconds: float = WAIT_S,
) -> Got:
    """Messages ``ep`` receives until ``count`` arrived or ``until`` holds (or time is up)."""
    got: Got = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got.extend(ep.poll(0.05))
        if count is not None and len(got) >= count:
            break
        if until is not None and until(got):
            break
    return got


def settle(ep: ControlEndpoint, seconds: float = 0.5) -> Got:
    """Everything ``ep`` receives in ``seconds`` (to show that nothing more arrives)."""
    return drain(ep, seconds=seconds)
