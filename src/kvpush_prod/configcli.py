"""``kvpush config``: validate and explain configurations, and generate the reference docs.

``docs/configuration.md`` and ``docs/metrics.md`` are rendered here from the models, so they
cannot drift from them (tests compare the files with what this module renders).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from kvpush_prod.config import (
    ALLOWED_KEYS_ENV,
    CROSS_FIELD_RULES,
    KEY_FILE_ENV,
    MASK,
    PARAMS_KEY_ENV,
    PROFILE_ENV,
    ResolvedConfig,
    allowed_range,
    field_rows,
    is_secret,
    resolve_config,
    section_doc,
    split_extra,
    type_name,
)
from kvpush_prod.errors import ConfigError
from kvpush_prod.metrics import (
    LABELS,
    ROUTER_LABELS,
    SCRAPE_LABELS,
    VLLM_LABELS,
    Series,
    all_series,
    exported_name,
)

PROFILES_DIR = Path(__file__).resolve().parent.parent.parent / "configs"
EXIT_OK, EXIT_INVALID = 0, 2

SOURCE_MEANING = {
    "default": "built-in default",
    "profile": "the YAML profile",
    "extra": "kv_connector_extra_config (--extra)",
    "env": f"environment (${KEY_FILE_ENV}, ${ALLOWED_KEYS_ENV}, ${PARAMS_KEY_ENV})",
}


# --------------------------------------------------------------------------- loading


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


def resolve(path: str | None, extra_json: str | None,
            env: dict[str, str] | None = None) -> ResolvedConfig:
    """The configuration an engine given this profile and extra config would run with."""
    extra_profile, overrides = split_extra(parse_extra(extra_json))
    if path and extra_profile and Path(path).resolve() != Path(extra_profile).resolve():
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
    return json.dumps({"profile": resolved.profile, "config": data, "sources": sources},
                      indent=2) + "\n"


def summary(resolved: ResolvedConfig) -> str:
    cfg = resolved.config
    counts = {o: 0 for o in SOURCE_MEANING}
    for s, k, _ in field_rows():
        counts[resolved.source_of(s, k)] += 1
    where = resolved.profile or "built-in defaults"
    return (
        f"OK: {where} is a valid kvpush configuration (backend {cfg.transport.backend}, "
        f"chunk_bytes {cfg.push.chunk_bytes}, control {cfg.control.host}:{cfg.control.port}, "
        f"{_auth_summary(cfg)}; values: "
        + ", ".join(f"{n} {o}" for o, n in counts.items()) + ")"
    )


def _auth_summary(cfg: Any) -> str:
    c = cfg.control
    auth = "curve keys" if c.key_file else ("INSECURE" if c.insecure else "loopback only")
    signed = c.params_key or c.params_key_file
    return f"control auth {auth}, params {'router-signed' if signed else 'unsigned'}"


# --------------------------------------------------------------------------- docs


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default_text(f: Any) -> str:
    if is_secret(f):
        return "unset"
    value = f.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"`{value}`"


def shipped_profiles() -> list[tuple[str, str]]:
    """(file name, its first comment line) for every profile in configs/."""
    out = []
    for p in sorted(PROFILES_DIR.glob("*.yaml")):
        block = []
        for line in p.read_text().splitlines():
            if not line.startswith("#"):
                break
            block.append(line.lstrip("#").strip())
        text = " ".join(block)
        end = text.find(". ")
        out.append((p.name, text[: end + 1] if end >= 0 else text))
    return out


CONFIG_INTRO = f"""\
The connector reads one validated configuration. It is built in this order, later layers
winning key by key:

1. built-in defaults (the `default` column below);
2. a YAML profile: `kv_connector_extra_config.profile` (or `${PROFILE_ENV}` when that is
   absent), a path relative to the engine's working directory;
3. section overrides in `kv_connector_extra_config`, e.g.
   `{{"profile": "configs/efa-p5en.yaml", "control": {{"advertise_host": "10.0.0.11"}}}}`;
4. the environment: `${KEY_FILE_ENV}` and `${ALLOWED_KEYS_ENV}` set `control.key_file` and
   `control.allowed_keys`; `${PARAMS_KEY_ENV}` sets `control.params_key` (keep secrets out of
   files). See `docs/security.md` for keys and their rotation.

Unknown sections or keys and out-of-range values stop the engine at start-up with an error
that names the key, the value, where it came from, the allowed range and the fix.

Check a configuration before deploying it, and see where each value comes from:

```bash
kvpush config validate configs/efa-p5en.yaml --extra '{{"control": {{"port": 15600}}}}'
kvpush config show configs/efa-p5en.yaml --extra @kv_transfer_config.json
```

`validate` prints `OK: ...` and exits 0, or prints the errors and exits 2. `show` prints
the effective configuration as YAML with the source of each value (`default`, `profile`,
`extra`, `env`); secrets are masked. `--extra` takes the JSON of
`kv_connector_extra_config` (or a whole `kv_transfer_config`), inline or as `@file`.
"""


def render_config_doc() -> str:
    """docs/configuration.md, from the config model and the shipped profiles."""
    out = [
        "# Configuration",
        "",
        "<!-- Generated from src/kvpush_prod/config.py by "
        "`python -m kvpush_prod.configcli docs config > docs/configuration.md`.",
        "     tests/ops/test_docs.py keeps this file equal to that output: edit the model "
        "(or configcli.py), then regenerate. -->",
        "",
        CONFIG_INTRO,
        "## Profiles",
        "",
        "| profile | for |",
        "|---|---|",
    ]
    out += [f"| `configs/{name}` | {_cell(first)} |" for name, first in shipped_profiles()]
    out += ["", "Each profile explains its values in comments.", ""]
    current = None
    for section, key, f in field_rows():
        if section != current:
            current = section
            out += [f"## {section}", "", section_doc(section), "",
                    "| key | type | default | range | meaning |", "|---|---|---|---|---|"]
        out.append(
            f"| `{section}.{key}` | {type_name(f)} | {_cell(_default_text(f))} | "
            f"{_cell(allowed_range(f))} | {_cell(f.description or '')} |"
        )
        if _is_last_of_section(section, key):
            out.append("")
    out += ["## Rules across keys", ""]
    out += [f"- {rule}" for rule in CROSS_FIELD_RULES]
    out.append("")
    return "\n".join(out)


def _is_last_of_section(section: str, key: str) -> bool:
    keys = [k for s, k, _ in field_rows() if s == section]
    return keys[-1] == key


# PromQL examples shown in docs/metrics.md (tests check they name only real series).
EXAMPLE_QUERIES: tuple[tuple[str, str], ...] = (
    ("Transfers per second by outcome (decode side)",
     'sum by (outcome) (rate(kvpush_transfers_total{role="consumer"}[5m]))'),
    ("Share of transfers that did not push (fallback, recompute, failure)",
     'sum(rate(kvpush_transfers_total{role="consumer",outcome!~"pushed|retried|prefix_hit"}'
     '[5m])) / sum(rate(kvpush_transfers_total{role="consumer"}[5m]))'),
    ("KV bytes pushed per second",
     'sum(rate(kvpush_transfer_bytes_total{role="producer"}[5m]))'),
    ("Transfer time p99 (producer: blocks ready to last WRITE done)",
     'histogram_quantile(0.99, sum by (le) '
     '(rate(kvpush_transfer_seconds_bucket{role="producer"}[5m])))'),
    ("Decode prompt tokens that came over the wire vs computed locally",
     'sum by (source) (rate(vllm:prompt_tokens_by_source_total[5m]))'),
    ("Router TTFT p99", 'histogram_quantile(0.99, sum by (le) '
     '(rate(kvpush_router_ttft_seconds_bucket[5m])))'),
)

def _codes(names: tuple[str, ...]) -> str:
    return " and ".join(f"`{n}`" for n in names)


METRICS_INTRO = f"""\
Every series is named in `src/kvpush_prod/metrics.py` (`CONNECTOR_SERIES`, and
`all_series()`, which adds the router's series from `src/kvpush_prod/router/metrics.py`).
Names follow `kvpush_<noun>_<unit>`; labels are few and bounded (never a request id).

**Where they appear.** The connector's series are on each vLLM engine's own `/metrics`
(the API server): the connector buffers observations in its engine processes, vLLM carries
them to the API server, and `MetricsSink` writes them. vLLM adds its labels
({_codes(VLLM_LABELS)}) to every connector series, and Prometheus adds
{_codes(SCRAPE_LABELS)} to every series. The router's series are on the router's
`/metrics`.

**How they are named on a scrape.** Counters gain `_total` (`kvpush_transfers` is scraped
as `kvpush_transfers_total`); histograms are scraped as `_bucket`, `_sum` and `_count`.
The tables give the scraped name.

**When they have samples.** A labelled series has no samples until its first observation.
The `samples` column says which series have samples on every healthy run (`every run`:
checked by `tests/e2e/test_metrics_e2e.py`) and which only after a fault or bad input
(`on faults`: retries, fallbacks, breaker trips, expired leases, rejected messages; absent
means zero). Alert rules in
`configs/prometheus/alerts.yaml` are written so that an absent series never fires; see
`docs/operations.md` for what each alert means and what to do.
"""


def _series_row(s: Series) -> str:
    labels = ", ".join(f"`{label}`" for label in s.labels) or "-"
    meaning = s.doc
    closed = [(label, vals) for label, vals in s.values if label != "role"]
    if closed:
        meaning += " " + "; ".join(f"`{label}`: " + ", ".join(f"`{v}`" for v in vals)
                                   for label, vals in closed) + "."
    samples = "every run" if s.healthy else "on faults"
    return f"| `{exported_name(s)}` | {s.kind} | {labels} | {samples} | {_cell(meaning)} |"


def render_metrics_doc() -> str:
    """docs/metrics.md, from the series tables."""
    series = all_series()
    out = [
        "# Metrics",
        "",
        "<!-- Generated from src/kvpush_prod/metrics.py by "
        "`python -m kvpush_prod.configcli docs metrics > docs/metrics.md`.",
        "     tests/ops/test_docs.py keeps this file equal to that output: edit the series "
        "tables, then regenerate. -->",
        "",
        METRICS_INTRO,
        "## Labels",
        "",
        "Connector series:",
        "",
        "| label | meaning |",
        "|---|---|",
    ]
    out += [f"| `{k}` | {_cell(v)} |" for k, v in LABELS.items()]
    out += ["", "Router series:", "", "| label | meaning |", "|---|---|"]
    out += [f"| `{k}` | {_cell(v)} |" for k, v in ROUTER_LABELS.items()]
    for title, where, source in (
        ("Connector series", "on each engine's vLLM `/metrics`", "connector"),
        ("Router series", "on the router's `/metrics`", "router"),
    ):
        out += ["", f"## {title}", "", f"Exported {where}.", "",
                "| series | type | labels | samples | meaning |", "|---|---|---|---|---|"]
        out += [_series_row(s) for s in series if s.source == source]
    out += ["", "## Example queries", ""]
    for title, query in EXAMPLE_QUERIES:
        out += [f"{title}:", "", "```promql", query, "```", ""]
    return "\n".join(out)


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpush config",
        description="Validate and explain kvpush configurations; render the reference docs.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("validate", "check a profile (+ extra config); exit 0 and 'OK: ...' or exit 2"),
        ("show", "print the effective configuration and where each value came from"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("path", nargs="?", help=f"YAML profile (default: ${PROFILE_ENV}, "
                       "kv_connector_extra_config.profile, or none)")
        p.add_argument("--extra", metavar="JSON",
                       help="kv_connector_extra_config as JSON (or a whole kv_transfer_config), "
                       "or @FILE holding it")
        if name == "show":
            p.add_argument("--format", choices=("yaml", "json"), default="yaml")
    d = sub.add_parser("docs", help="print docs/configuration.md or docs/metrics.md")
    d.add_argument("which", choices=("config", "metrics"))
    sub.add_parser("schema", help="print the JSON schema of the configuration")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "docs":
        sys.stdout.write(render_config_doc() if args.which == "config"
                         else render_metrics_doc())
        return EXIT_OK
    if args.command == "schema":
        from kvpush_prod.config import KvpushConfig

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
