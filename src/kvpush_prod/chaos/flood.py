"""An engine's key flooding another engine's control port with valid, authenticated messages
(REGISTERs for transfers that do not exist), at a fixed rate: the nemesis's ``flood`` fault.

Runs as its own process (``python -m kvpush_prod.chaos.flood ...``) so the nemesis can stop it
at the fault's end; benchmarks/keyed_flood.py measures what such floods cost an engine.
"""

from __future__ import annotations

import argparse
import sys
import time

import zmq
import zmq.auth

from kvpush_prod.control.keys import load_keypair
from kvpush_prod.core import messages as m
from kvpush_prod.core.identity import agent_name

_LAYOUT = m.Layout("nemesis-flood", "DRAM", [m.Region(0, 4096, 4096, 4096)])


def registers(public: bytes, start: int, n: int) -> list[bytes]:
    """``n`` encoded REGISTERs for ghost transfers, numbered from ``start``."""
    me = m.PeerInfo(
        "nemesis-flood",
        1,
        0,
        "tcp://127.0.0.1:1",
        agent_name("flood", public.decode()),
        b"meta",
        _LAYOUT,
    )
    return [
        m.encode(m.Register(m.PROTOCOL_VERSION, f"ghost-{i}", me, [0, 1, 2], 0, 300, 1 + i, 60_000))
        for i in range(start, start + n)
    ]


def flood(endpoint: str, server_public: bytes, key_file: str, seconds: float, rate: int) -> int:
    """Send ``rate`` REGISTERs a second to ``endpoint`` for ``seconds``; how many were sent."""
    keys = load_keypair(key_file)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.curve_publickey, sock.curve_secretkey = keys.public, keys.secret
    sock.curve_serverkey = server_public
    sock.connect(endpoint)
    sent = 0
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < seconds:
            for body in registers(keys.public, sent, max(1, rate // 10)):
                try:
                    sock.send(body, zmq.NOBLOCK)
                except zmq.Again:
                    break  # the peer does not keep up: that is the point, drop the rest
                sent += 1
            time.sleep(0.1)
    finally:
        ctx.destroy(linger=0)
    return sent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpush_prod.chaos.flood", description=__doc__)
    ap.add_argument("--endpoint", required=True, help="the target's control endpoint tcp://H:P")
    ap.add_argument("--server-key-file", required=True, help="the target's public .key file")
    ap.add_argument("--key-file", required=True, help="the flooding engine's .key_secret")
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--rate", type=int, default=2000, help="messages a second (default 2000)")
    a = ap.parse_args(argv)
    server_public, _ = zmq.auth.load_certificate(a.server_key_file)
    n = flood(a.endpoint, server_public, a.key_file, a.seconds, a.rate)
    print(f"flood: {n} REGISTERs sent to {a.endpoint} in {a.seconds:g} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
