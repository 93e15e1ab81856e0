"""Command line of the router: ``python -m kvpush_prod.router`` or ``kvpush router``.

Flags override the YAML file given with --config; the merged settings are validated once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from kvpush_prod.errors import ConfigError
from kvpush_prod.router.config import (
    DIRECT_BELOW_TOKENS,
    RouterSettings,
    read_yaml,
    settings_from_mapping,
    with_params_key,
)
from kvpush_prod.signing import PARAMS_KEY_ENV


def build_parser(prog: str = "kvpush router") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Push-aware P/D proxy: sends each request to a prefill and a decode "
        "vLLM server at once, with the kv_transfer_params of push mode.",
    )
    p.add_argument(
        "--prefill",
        action="append",
        metavar="URL",
        help="prefill server base URL (repeat for several); replaces the YAML list",
    )
    p.add_argument(
        "--decode",
        action="append",
        metavar="URL",
        help="decode server base URL (repeat for several); replaces the YAML list",
    )
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default 8000)")
    _add_routing_flags(p)
    _add_limit_flags(p)
    _add_key_flags(p)
    p.add_argument("--config", help="router YAML file (same keys as RouterSettings)")
    p.add_argument(
        "--backend-api-key",
        dest="backend_api_key",
        default=os.environ.get("VLLM_API_KEY") or None,
        help="bearer token for the vLLM servers (default: $VLLM_API_KEY)",
    )
    p.add_argument(
        "--log-level", dest="log_level", choices=["critical", "error", "warning", "info", "debug"]
    )
    p.add_argument(
        "--access-log",
        dest="access_log",
        action="store_true",
        default=None,
        help="log every request (costs latency under load)",
    )
    return p


def _add_routing_flags(p: argparse.ArgumentParser) -> None:
    """How requests are routed: waiting for a pair, the policy, the flow, retries, health
    and short prompts."""
    p.add_argument(
        "--no-backend-wait",
        type=float,
        dest="no_backend_wait_s",
        metavar="S",
        help="a request that finds no routable pair waits this long for one (an engine "
        "restarting after a drain) before 503 (default 0)",
    )
    p.add_argument(
        "--policy",
        choices=["round_robin", "least_loaded", "engine_load", "link_aware"],
        help="how to pick backends (default round_robin; engine_load: the engines' own load "
        "from their /metrics; link_aware: P as engine_load, D by earliest expected finish "
        "over P's link to it, timed on streamed requests)",
    )
    p.add_argument(
        "--mode",
        choices=["push", "pull"],
        help="push (default): both legs at once, for push connectors; pull: prefill first, "
        "then decode with the prefill's kv_transfer_params (vLLM's NixlConnector)",
    )
    p.add_argument(
        "--vllm-push-compat",
        dest="vllm_push_compat",
        action="store_true",
        default=None,
        help="push mode: add remote_request_id to D's kv_transfer_params, as vLLM's "
        "NixlPushConnector needs",
    )
    p.add_argument(
        "--max-retries",
        type=int,
        dest="max_retries",
        help="retries on another pair before any byte was sent (default 1)",
    )
    p.add_argument(
        "--health-interval",
        type=float,
        dest="health_interval_s",
        help="seconds between health polls of each backend (default 2)",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        dest="connect_timeout_s",
        help="seconds to connect to a backend (default 2)",
    )
    p.add_argument(
        "--direct-below-tokens",
        type=int,
        dest="direct_below_tokens",
        metavar="N",
        help="send a request whose prompt is estimated below N tokens to a decode backend "
        "alone, which computes it (no KV transfer; counted in kvpush_router_direct_total); "
        f"0 turns it off (default {DIRECT_BELOW_TOKENS}, measured on the lab box; measure "
        'yours: docs/router.md, "Short prompts: straight to D")',
    )


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    """The most used limits (docs/router.md, "Limits"); the rest are YAML-only."""
    p.add_argument(
        "--max-body-bytes",
        type=int,
        dest="max_body_bytes",
        help="largest request body; a larger one gets 413 (default 16777216, 16 MiB)",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        dest="max_concurrent_requests",
        help="completion requests in progress at once; beyond it 503 (default 1024)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        dest="header_timeout_s",
        help="seconds a client may take to send a request's headers (default 10)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        dest="body_timeout_s",
        help="seconds a client may take to send a request's body (default 30)",
    )
    p.add_argument(
        "--client-write-timeout",
        type=float,
        dest="client_write_timeout_s",
        help="seconds a client may stop reading its answer before it is dropped (default 30)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        dest="drain_timeout_s",
        help="on SIGTERM, seconds to finish open requests before exiting (default 25)",
    )


def _add_key_flags(p: argparse.ArgumentParser) -> None:
    """Router-signed kv_transfer_params, the engines' control-channel keys, TLS to the engines."""
    p.add_argument(
        "--params-key-file",
        dest="params_key_file",
        metavar="PATH",
        help=f"file holding the params key shared with the engines: sign both legs' "
        f"kv_transfer_params (default: ${PARAMS_KEY_ENV} if set, else unsigned)",
    )
    # A trap, not an option: a key given here would be readable by every user of the
    # machine (ps, /proc/*/cmdline); refuse it without echoing the value.
    p.add_argument("--params-key", dest="params_key_on_command_line", help=argparse.SUPPRESS)
    p.add_argument(
        "--params-ttl",
        type=float,
        dest="params_ttl_s",
        help="seconds a signature on kv_transfer_params stays valid (default 120)",
    )
    p.add_argument(
        "--probe-decode",
        dest="probe_decode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="probe decode backends for their control-channel key and name it to P "
        "(decode_key), so P accepts the transfer only from that D (default: on, in push mode "
        "with kvpush engines); --no-probe-decode turns it off",
    )
    p.add_argument(
        "--backend-ca-file",
        dest="backend_ca_file",
        metavar="PATH",
        help="TLS to the engines: the CA certificate (PEM) their certificates (vLLM "
        "--ssl-certfile) must chain to; every backend URL is then https://",
    )
    p.add_argument(
        "--backend-client-cert-file",
        dest="backend_client_cert_file",
        metavar="PATH",
        help="mutual TLS: the router's client certificate (PEM) for engines that require one",
    )
    p.add_argument(
        "--backend-client-key-file",
        dest="backend_client_key_file",
        metavar="PATH",
        help="mutual TLS: the key (PEM, unencrypted) of --backend-client-cert-file",
    )
    p.add_argument(
        "--admin-token-file",
        dest="admin_token_file",
        metavar="PATH",
        help="file holding the bearer token of the admin API (drain, undrain, backends; "
        "`kvpush drain` uses it); without it the admin API is off",
    )


def settings_from_args(
    argv: list[str] | None = None, *, prog: str = "kvpush router"
) -> RouterSettings:
    """Parse flags (and the --config file) into validated settings; raises ConfigError."""
    args = build_parser(prog).parse_args(argv)
    if args.params_key_on_command_line is not None:
        raise ConfigError(
            "--params-key is not accepted: a key on the command line is visible to every "
            "user of the machine; write it to a file only the router can read and pass "
            f"--params-key-file PATH, or set ${PARAMS_KEY_ENV}"
        )
    data: dict[str, Any] = read_yaml(args.config) if args.config else {}
    skip = ("config", "params_key_on_command_line")
    flags = {k: v for k, v in vars(args).items() if k not in skip and v is not None}
    data.update(flags)
    source = f"{args.config} + command line" if args.config else "command line"
    if "prefill" not in data or "decode" not in data:
        raise ConfigError(
            f"router needs at least one prefill and one decode backend ({source}): "
            "pass --prefill URL and --decode URL, or list them under prefill:/decode: in --config"
        )
    return with_params_key(settings_from_mapping(data, source=source), os.environ)


def main(argv: list[str] | None = None, *, prog: str = "kvpush router") -> int:
    """Run the router until SIGTERM/SIGINT and its drain; returns the process exit status
    (2: bad config)."""
    try:
        settings = settings_from_args(argv, prog=prog)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    from kvpush_prod.router.server import serve

    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    serve(settings)
    return 0
