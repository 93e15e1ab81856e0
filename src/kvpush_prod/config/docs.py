"""``docs/configuration.md``, rendered from the settings model and the shipped profiles, so it
cannot drift from them (tests/ops/test_docs.py compares the file with this output).

``python -m kvpush_prod.config.docs > docs/configuration.md`` regenerates it.
"""

from __future__ import annotations

import sys
from typing import Any

from kvpush_prod.config.fields import allowed_range, field_rows, is_secret, section_doc, type_name
from kvpush_prod.config.profiles import SCHEME, first_comment, shipped
from kvpush_prod.config.settings import (
    ALLOWED_KEYS_ENV,
    CROSS_FIELD_RULES,
    KEY_FILE_ENV,
    PARAMS_KEY_ENV,
    PROFILE_ENV,
)


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


CONFIG_INTRO = f"""\
The connector reads one validated configuration. It is built in this order, later layers
winning key by key:

1. built-in defaults (the `default` column below);
2. a YAML profile: `kv_connector_extra_config.profile` (or `${PROFILE_ENV}` when that is
   absent): a path relative to the engine's working directory, or a shipped profile by name
   (`efa-p5en`, or `{SCHEME}efa-p5en` to name it even where a file of that name exists);
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
        "<!-- Generated from src/kvpush_prod/config/settings.py by "
        "`python -m kvpush_prod.config.docs > docs/configuration.md`.",
        "     tests/ops/test_docs.py keeps this file equal to that output: edit the model "
        "(or config/docs.py), then regenerate. -->",
        "",
        CONFIG_INTRO,
        "## Profiles",
        "",
        "| profile | file | for |",
        "|---|---|---|",
    ]
    out += [
        f"| `{name}` | `configs/{path.name}` | {_cell(first_comment(path))} |"
        for name, path in shipped().items()
    ]
    out += [
        "",
        "The profiles ship inside the package (`kvpush_prod/config/profiles/`), so an "
        "installed engine finds them by name; `configs/` in the source tree holds the same "
        "files. Each profile explains its values in comments.",
        "",
    ]
    current = None
    for section, key, f in field_rows():
        if section != current:
            current = section
            out += [
                f"## {section}",
                "",
                section_doc(section),
                "",
                "| key | type | default | range | meaning |",
                "|---|---|---|---|---|",
            ]
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


if __name__ == "__main__":
    sys.stdout.write(render_config_doc())
