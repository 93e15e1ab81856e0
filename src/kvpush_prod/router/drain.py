"""``kvpush drain ENGINE_URL --router URL``: take an engine out of rotation and wait until it
holds nothing, so it can be restarted without losing a request.

The router(s) stop giving the engine new requests (admin API); then the engine's own
/metrics are watched until no request runs or waits and the connector holds no transfer and
no block (a prefill engine keeps blocks until the decode engines took them), and the routers
until they have no leg open to it (a request not yet in the engine's queue, or an answer
still on its way back). Ends with a
one-line verdict; exit 0 once drained, 1 at the deadline, 2 on bad input, 3 when the
engine's /metrics cannot be read (then nothing says it is idle).
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
BUSY_SERIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "kvpush_transfers_active",
    "kvpush_connector_blocks",
)
# Every vLLM engine exports this one: a /metrics without it is not an engine's (the
# router's own, a proxy's), and reading "nothing busy" there would prove nothing.
ENGINE_SERIES = "vllm:num_requests_running"
# Readings that may fail in a row (an engine too busy to answer /metrics in time) before
# the drain gives up on watching it.
MAX_FAILED_READS = 3
EXIT_UNREADABLE = 3


class MetricsUnreadable(RuntimeError):
    """The engine's /metrics cannot be read: whether it is drained is unknown."""


def busy(metrics_text: str) -> dict[str, float]:
    """The sum of each of BUSY_SERIES on an engine's /metrics (absent: 0)."""
    out = dict.fromkeys(BUSY_SERIES, 0.0)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


def read_busy(client: httpx.Client, engine: str) -> dict[str, float]:
    """``busy`` of the engine's /metrics now; MetricsUnreadable saying why if it cannot be
    read or is not a vLLM engine's."""
    url = engine.rstrip("/") + "/metrics"
    try:
        r = client.get(url)
    except httpx.HTTPError as exc:
        raise MetricsUnreadable(f"GET {url} failed ({type(exc).__name__}: {exc})") from None
    if r.status_code != 200:
        raise MetricsUnreadable(
            f"GET {url} answered HTTP {r.status_code}: {r.text[:200].strip()!r}"
        )
    try:
        families = list(text_string_to_metric_families(r.text))
    except ValueError as exc:
        raise MetricsUnreadable(f"GET {url} is not Prometheus text ({exc})") from None
    if not any(s.name == ENGINE_SERIES for f in families for s in f.samples):
        raise MetricsUnreadable(
            f"GET {url} has no {ENGINE_SERIES}: it is not a vLLM engine's /metrics (the "
            "router's, or a proxy's?)"
        )
    return busy(r.text)


def _admin(
    client: httpx.Client, router: str, token: str, path: str, engine: str
) -> dict[str, object]:
    r = client.post(
        router.rstrip("/") + path,
        json={"backend": engine},
        headers={"Authorization": f"Bearer {token}"},
    )
    if r.status_code != 200:
        raise RuntimeError(f"{router}{path}: {r.status_code} {r.text[:300]}")
    return dict(r.json())


def router_legs(client: httpx.Client, routers: list[str], token: str, engine: str) -> int:
    """The legs ``routers`` still have open to ``engine`` (GET /admin/backends): a request
    the engine's /metrics do not show yet (still on its way in) or no more (its answer still
    on its way back to the router). A router that cannot be read counts none."""
    total = 0
    for router in routers:
        try:
            r = client.get(
                router.rstrip("/") + "/admin/backends",
                headers={"Authorization": f"Bearer {token}"},
            )
            listed = r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            continue
        for side in listed.values() if isinstance(listed, dict) else ():
            for b in side if isinstance(side, list) else ():
                if isinstance(b, dict) and str(b.get("url", "")).rstrip("/") == engine.rstrip("/"):
                    total += int(b.get("inflight") or 0)
    return total


def drain(
    engine: str,
    routers: list[str],
    token: str,
    deadline_s: float,
    say: Callable[[str], None] = print,
    poll_s: float = 1.0,
    client: httpx.Client | None = None,
) -> bool:
    """Drain ``engine`` behind ``routers``; True once its /metrics show it idle within
    ``deadline_s``, False at the deadline; MetricsUnreadable when its /metrics cannot be
    read MAX_FAILED_READS times in a row."""
    client = client or httpx.Client(timeout=10.0, trust_env=False)
    for router in routers:
        state = _admin(client, router, token, "/admin/drain", engine)
        say(f"[drain] {router}: {engine} draining ({state.get('inflight', 0)} legs open)")
    start = time.monotonic()
    failed = 0
    while True:
        try:
            now = read_busy(client, engine)
        except MetricsUnreadable as exc:
            # Never "drained" for an engine we cannot see: it may be busy behind a broken
            # URL, and a restart then would fail its open requests.
            failed += 1
            say(f"[drain] {exc} ({failed} of {MAX_FAILED_READS})")
            if failed >= MAX_FAILED_READS:
                raise MetricsUnreadable(
                    f"cannot tell whether {engine} is drained: {exc}. Pass the engine's "
                    "OpenAI server URL as the router lists it (GET /admin/backends); if the "
                    "engine has stopped it holds nothing, but check its log before "
                    "restarting"
                ) from None
            time.sleep(poll_s)
            continue
        failed = 0
        waited = time.monotonic() - start
        left = {k.split(":")[-1]: int(v) for k, v in now.items() if v}
        legs = router_legs(client, routers, token, engine)
        if legs:
            left["router_legs_open"] = legs
        say(f"[drain] {waited:5.1f}s " + (", ".join(f"{k}={v}" for k, v in left.items()) or "idle"))
        if not left:
            return True
        if waited >= deadline_s:
            return False
        time.sleep(poll_s)


def main(argv: list[str] | None = None, transport: httpx.BaseTransport | None = None) -> int:
    """``kvpush drain``; ``transport`` replaces the network (tests)."""
    ap = argparse.ArgumentParser(prog="kvpush drain", description=__doc__.split("\n\n")[0])
    ap.add_argument("engine", help="the engine's OpenAI server URL, as the router lists it")
    ap.add_argument(
        "--router",
        action="append",
        required=True,
        metavar="URL",
        help="a router fronting the engine (repeat for several)",
    )
    ap.add_argument(
        "--admin-token-file",
        required=True,
        metavar="PATH",
        help="the routers' admin token (their --admin-token-file)",
    )
    ap.add_argument(
        "--deadline",
        type=float,
        default=300.0,
        metavar="S",
        help="give up after this many seconds (default 300)",
    )
    ap.add_argument(
        "--undo",
        action="store_true",
        help="put the engine back in rotation (an engine that restarted comes back by itself)",
    )
    args = ap.parse_args(argv)
    try:
        token = Path(args.admin_token_file).read_text().strip()
    except OSError as exc:
        print(f"kvpush drain: cannot read {args.admin_token_file}: {exc.strerror}", file=sys.stderr)
        return 2
    try:
        with httpx.Client(timeout=10.0, trust_env=False, transport=transport) as client:
            if args.undo:
                for router in args.router:
                    _admin(client, router, token, "/admin/undrain", args.engine)
                print(f"UNDRAINED: {args.engine} takes requests again")
                return 0
            ok = drain(args.engine, args.router, token, args.deadline, client=client)
    except MetricsUnreadable as exc:
        print(f"NOT DRAINED: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"kvpush drain: {exc}", file=sys.stderr)
        return 2
    if ok:
        print(
            f"DRAINED: {args.engine} holds no request, transfer or block; restart it now "
            "(it rejoins the routers once healthy)"
        )
        return 0
    print(
        f"NOT DRAINED: {args.engine} still busy after {args.deadline:.0f}s (see above); "
        "raise --deadline or restart anyway (open requests fail)"
    )
    return 1
