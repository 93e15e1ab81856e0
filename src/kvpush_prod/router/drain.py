"""``kvpush drain ENGINE_URL --router URL``: take an engine out of rotation and wait until it
holds nothing, so it can be restarted without losing a request.

The router(s) stop giving the engine new requests (admin API); then the engine's own
/metrics are watched until no request runs or waits and the connector holds no transfer and
no block (a prefill engine keeps blocks until the decode engines took them). Ends with a
one-line verdict; exit 0 once drained, 1 at the deadline, 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

# What must be zero on a drained engine: vLLM's requests, then ours.
BUSY_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
               "kvpush_transfers_active", "kvpush_connector_blocks")


def busy(metrics_text: str) -> dict[str, float]:
    """The sum of each of BUSY_SERIES on an engine's /metrics (absent: 0)."""
    out = dict.fromkeys(BUSY_SERIES, 0.0)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


def _admin(client: httpx.Client, router: str, token: str, path: str,
           engine: str) -> dict[str, object]:
    r = client.post(router.rstrip("/") + path, json={"backend": engine},
                    headers={"Authorization": f"Bearer {token}"})
    if r.status_code != 200:
        raise RuntimeError(f"{router}{path}: {r.status_code} {r.text[:300]}")
    return dict(r.json())


def drain(engine: str, routers: list[str], token: str, deadline_s: float,
          say: Callable[[str], None] = print, poll_s: float = 1.0,
          client: httpx.Client | None = None) -> bool:
    """Drain ``engine`` behind ``routers``; True once it is idle within ``deadline_s``."""
    client = client or httpx.Client(timeout=10.0, trust_env=False)
    for router in routers:
        state = _admin(client, router, token, "/admin/drain", engine)
        say(f"[drain] {router}: {engine} draining ({state.get('inflight', 0)} legs open)")
    start = time.monotonic()
    while True:
        try:
            now = busy(client.get(engine.rstrip("/") + "/metrics").text)
        except httpx.HTTPError as exc:
            say(f"[drain] {engine}/metrics unreachable ({type(exc).__name__}): stopped?")
            return True
        waited = time.monotonic() - start
        left = {k.split(":")[-1]: int(v) for k, v in now.items() if v}
        say(f"[drain] {waited:5.1f}s " + (", ".join(f"{k}={v}" for k, v in left.items())
                                           or "idle"))
        if not left:
            return True
        if waited >= deadline_s:
            return False
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpush drain", description=__doc__.split("\n\n")[0])
    ap.add_argument("engine", help="the engine's OpenAI server URL, as the router lists it")
    ap.add_argument("--router", action="append", required=True, metavar="URL",
                    help="a router fronting the engine (repeat for several)")
    ap.add_argument("--admin-token-file", required=True, metavar="PATH",
                    help="the routers' admin token (their --admin-token-file)")
    ap.add_argument("--deadline", type=float, default=300.0, metavar="S",
                    help="give up after this many seconds (default 300)")
    ap.add_argument("--undo", action="store_true",
                    help="put the engine back in rotation (an engine that restarted comes "
                    "back by itself)")
    args = ap.parse_args(argv)
    try:
        token = Path(args.admin_token_file).read_text().strip()
    except OSError as exc:
        print(f"kvpush drain: cannot read {args.admin_token_file}: {exc.strerror}",
              file=sys.stderr)
        return 2
    try:
        if args.undo:
            with httpx.Client(timeout=10.0, trust_env=False) as client:
                for router in args.router:
                    _admin(client, router, token, "/admin/undrain", args.engine)
            print(f"UNDRAINED: {args.engine} takes requests again")
            return 0
        ok = drain(args.engine, args.router, token, args.deadline)
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"kvpush drain: {exc}", file=sys.stderr)
        return 2
    if ok:
        print(f"DRAINED: {args.engine} holds no request, transfer or block; restart it now "
              "(it rejoins the routers once healthy)")
        return 0
    print(f"NOT DRAINED: {args.engine} still busy after {args.deadline:.0f}s (see above); "
          "raise --deadline or restart anyway (open requests fail)")
    return 1
