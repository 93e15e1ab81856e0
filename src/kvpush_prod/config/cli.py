"""``kvpush config``: validate a configuration, show the effective one and where each value
came from, print its JSON schema or docs/configuration.md (rendered by ``config.docs``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from kvpush_prod.config.docs import render_config_doc
from kvpush_prod.config.fields import field_rows, is_secret
from kvpush_prod.config.loading import ResolvedConfig, resolve_config, split_extra
from kvpush_prod.config.profiles import same_profile
from kvpush_prod.config.settings import (
    ALLOWED_KEYS_ENV,
    KEY_FILE_ENV,
    MASK,
    PARAMS_KEY_ENV,
    PROFILE_ENV,
    KvpushConfig,
)
from kvpush_prod.errors import ConfigError

EXIT_OK, EXIT_INVALID = 0, 2

SOURCE_MEANING = {
    "default": "built-in default",
    "profile": "the YAML profile",
    "extra": "kv_connector_extra_config (--extra)",
    "env": f"environment (${KEY_FILE_ENV}, ${ALLOWED_KEYS_ENV}, ${PARAMS_KEY_ENV})",
}


# --------------------------------------------------------------------------- resolving


def parse_extra(text: str | None) -> dict[str, Any]:
    """``--extra``: JSON of kv_connector_extra_config, ``@file`` to read it from a file.

    A whole ``kv_transfer_config`` (with a ``kv_connector_extra_config`` key) is accepted too,
    so an operator can paste the engine's ``--kv-transfer-config`` as is.
    """
    if not text:
        return {}
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"--extra {str(path)!r} cannot be read: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"--extra is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
            'pass an object such as \'{"push": {"chunk_bytes": 1048576}}\''
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"--extra must be a JSON object, got {type(data).__name__}")
    inner = data.get("kv_connector_extra_config")
    return dict(inner) if isinstance(inner, dict) else data


def resolve(
    path: str | None, extra_json: str | None, env: dict[str, str] | None = None
) -> ResolvedConfig:
    """The configuration an engine given this profile and extra config would run with."""
    extra_profile, overrides = split_extra(parse_extra(extra_json))
    if path and extra_profile and not same_profile(path, extra_profile):
        raise ConfigError(
            f"two profiles given: {path!r} and kv_connector_extra_config.profile="
            f"{extra_profile!r}; pass one of them"
        )
    return resolve_config(path or extra_profile, overrides, env)


# --------------------------------------------------------------------------- show


def _scalar_yaml(key: str, value: Any) -> str:
    dumped = yaml.safe_dump({key: value}, default_flow_style=True, width=10**9).strip()
    return dumped[1:-1]  # "{key: value}" -> "key: value"


def effective(resolved: ResolvedConfig) -> dict[str, dict[str, Any]]:
    """The effective config as plain data, secrets masked."""
    data: dict[str, dict[str, Any]] = {}
    dumped = resolved.config.model_dump(mode="json")
    for section, key, f in field_rows():
        value = dumped[section][key]
        if is_secret(f) and value is not None:
            value = MASK
        data.setdefault(section, {})[key] = value
    return data


def render_show(resolved: ResolvedConfig) -> str:
    """The effective config as YAML, each value followed by where it came from."""
    data = effective(resolved)
    lines = [
        "# kvpush effective configuration",
        f"# profile: {resolved.profile or '(none: built-in defaults)'}",
        "# after each value, where it came from: "
        + ", ".join(f"{k} = {v}" for k, v in SOURCE_MEANING.items()),
        "# secrets are masked",
    ]
    body: list[tuple[str, str]] = []
    for section, values in data.items():
        body.append((f"{section}:", ""))
        for key, value in values.items():
            body.append((f"  {_scalar_yaml(key, value)}", resolved.source_of(section, key)))
    width = max(len(text) for text, _ in body)
    for text, origin in body:
        lines.append(f"{text.ljust(width)}  # {origin}" if origin else text)
    return "\n".join(lines) + "\n"


def render_show_json(resolved: ResolvedConfig) -> str:
    data = effective(resolved)
    sources = {f"{s}.{k}": resolved.source_of(s, k) for s, k, _ in field_rows()}
    return (
        json.dumps({"profile": resolved.profile, "config": data, "sources": sources}, indent=2)
        + "\n"
    )


def summary(resolved: ResolvedConfig) -> str:
    cfg = resolved.config
    counts = {o: 0 for o in SOURCE_MEANING}
    for s, k, _ in field_rows():
        counts[resolved.source_of(s, k)] += 1
    where = resolved.profile or "built-in defaults"
    return (
        f"OK: {where} is a valid kvpush configuration (backend {cfg.transport.backend}, "
        f"chunk_bytes {cfg.push.chunk_bytes}, control {cfg.control.host}:{cfg.control.port}, "
        f"{_auth_summary(cfg)}; values: " + ", ".join(f"{n} {o}" for o, n in counts.items()) + ")"
    )


def _auth_summary(cfg: Any) -> str:
    c = cfg.control
    auth = "curve keys" if c.key_file else ("INSECURE" if c.insecure else "loopback only")
    signed = c.params_key or c.params_key_file
    return f"control auth {auth}, params {'router-signed' if signed else 'unsigned'}"


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpush config",
        description="Validate and explain kvpush configurations; render their reference doc.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("validate", "check a profile (+ extra config); exit 0 and 'OK: ...' or exit 2"),
        ("show", "print the effective configuration and where each value came from"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument(
            "path",
            nargs="?",
            help="YAML profile: a path or a shipped profile's "
            f"name (default: ${PROFILE_ENV}, kv_connector_extra_config.profile, "
            "or none)",
        )
        p.add_argument(
            "--extra",
            metavar="JSON",
            help="kv_connector_extra_config as JSON (or a whole kv_transfer_config), "
            "or @FILE holding it",
        )
        if name == "show":
            p.add_argument("--format", choices=("yaml", "json"), default="yaml")
    d = sub.add_parser(
        "docs",
        help="print docs/configuration.md (docs/metrics.md: python -m kvpush_prod.metrics_docs)",
    )
    d.add_argument("which", nargs="?", choices=("config",), default="config")
    sub.add_parser("schema", help="print the JSON schema of the configuration")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "docs":
        sys.stdout.write(render_config_doc())
        return EXIT_OK
    if args.command == "schema":
        print(json.dumps(KvpushConfig.model_json_schema(), indent=2))
        return EXIT_OK
    try:
        resolved = resolve(args.path, args.extra)
    except ConfigError as exc:
        print(f"kvpush config {args.command}: {exc}", file=sys.stderr)
        return EXIT_INVALID
    if args.command == "validate":
        print(summary(resolved))
    elif args.format == "json":
        sys.stdout.write(render_show_json(resolved))
    else:
        sys.stdout.write(render_show(resolved))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
