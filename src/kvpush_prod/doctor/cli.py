"""``kvpush doctor [--config FILE] [--peer HOST:PORT]``: rows as each check ends, then one
verdict line. Exit 0: no problem; 1: problems, each with its fix; 2: a usage error."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from kvpush_prod.config.loading import config_from_extra
from kvpush_prod.doctor import checks
from kvpush_prod.doctor.checks import Row, Status
from kvpush_prod.errors import ConfigError
from kvpush_prod.transport import fabric as transports

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2
_WIDTH = 18


class UsageError(Exception):
    """Bad command-line input: exit 2 with the message."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvpush doctor",
        description="Preflight of this host for a kvpush engine (and, with --peer, of the path "
        "to a running engine): a table, then one verdict line. Exit 0 ok, 1 "
        "problems (each with its fix), 2 usage error.",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="the engine's kv_connector_extra_config (JSON or YAML; a whole "
        "kv_transfer_config works too); default: the built-in defaults and "
        "$KVPUSH_PROFILE",
    )
    p.add_argument(
        "--peer",
        metavar="HOST:PORT",
        help="a running engine's control port: authenticated latency, bandwidth "
        "and clock-skew probe",
    )
    p.add_argument(
        "--peer-name",
        metavar="NAME",
        help="the peer's name in the allow-list (needed with keys when the list "
        "holds more than one other engine)",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="control ports this engine uses (tensor x data-parallel ranks)",
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead")
    return p


def read_extra(path: str) -> dict[str, Any]:
    """The kv_connector_extra_config in ``path`` (a whole kv_transfer_config is unwrapped)."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(
            f"--config {path!r}: no such file; give the engine's "
            "kv_connector_extra_config as a JSON or YAML file"
        )
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UsageError(f"--config {path!r} is neither JSON nor YAML: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path!r} must hold a mapping, got {type(data).__name__}")
    inner = data.get("kv_connector_extra_config")
    return dict(inner) if isinstance(inner, dict) else data


def parse_peer(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(
            f"--peer {text!r}: write it as HOST:PORT, the engine's control port "
            "(control.port + rank), e.g. 10.0.0.5:15500"
        )
    return host.strip("[]"), int(port)


class Report:
    """Prints each row as it comes (progress), then the verdict."""

    def __init__(self, as_json: bool) -> None:
        self.rows: list[Row] = []
        self.as_json = as_json
        if not as_json:
            print(f"{'CHECK':<{_WIDTH}} {'STATUS':<6} DETAIL", flush=True)

    def add(self, rows: Iterable[Row]) -> None:
        for row in rows:
            self.rows.append(row)
            if self.as_json:
                continue
            print(f"{row.check:<{_WIDTH}} {row.status.value:<6} {row.detail}", flush=True)
            if row.fix and row.status is not Status.OK:
                print(f"{'':<{_WIDTH}} {'':<6} fix: {row.fix}", flush=True)

    def verdict(self) -> int:
        problems = [r for r in self.rows if r.problem]
        warns = [r for r in self.rows if r.status is Status.WARN]
        if self.as_json:
            print(
                json.dumps(
                    [
                        {
                            "check": r.check,
                            "status": r.status.value,
                            "detail": r.detail,
                            "fix": r.fix,
                        }
                        for r in self.rows
                    ],
                    indent=1,
                )
            )
        if problems:
            names = ", ".join(dict.fromkeys(r.check for r in problems))
            print(
                f"kvpush doctor: {len(problems)} problem(s): {names}; fix each as shown "
                "above, then run kvpush doctor again",
                flush=True,
            )
            return EXIT_PROBLEMS
        extra = f", {len(warns)} warning(s)" if warns else ""
        print(f"kvpush doctor: OK ({len(self.rows)} checks{extra})", flush=True)
        return EXIT_OK


def run(args: argparse.Namespace, report: Report) -> None:
    report.add(checks.check_versions())
    try:
        cfg = config_from_extra(read_extra(args.config) if args.config else None)
    except ConfigError as exc:
        report.add(
            [
                Row(
                    "config",
                    Status.FAIL,
                    str(exc).splitlines()[0],
                    "; ".join(line.strip(" -") for line in str(exc).splitlines()[1:]) or str(exc),
                )
            ]
        )
        return
    where = args.config or os.environ.get("KVPUSH_PROFILE") or "built-in defaults"
    report.add([Row("config", Status.OK, f"{where} is valid (links.fabric: {cfg.links.fabric})")])
    report.add(checks.check_backends(cfg, transports.backends_loading()))
    report.add(checks.check_transports(cfg, transports.rdma_devices(), os.environ))
    report.add(checks.check_keys(cfg))
    report.add(checks.check_ports(cfg, args.ranks))
    if args.peer:
        from kvpush_prod.doctor.peercheck import check_peer

        report.add(check_peer(cfg, parse_peer(args.peer), args.peer_name))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.peer:
            parse_peer(args.peer)
        if args.ranks < 1:
            raise UsageError(f"--ranks {args.ranks}: must be at least 1")
        if args.config:
            read_extra(args.config)
    except UsageError as exc:
        print(f"kvpush doctor: {exc}", file=sys.stderr)
        return EXIT_USAGE
    report = Report(args.json)
    try:
        run(args, report)
    except UsageError as exc:
        print(f"kvpush doctor: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return report.verdict()
