"""Loading a configuration: a YAML profile, then ``kv_connector_extra_config`` overrides,
then the environment (secrets), validated into one `KvpushConfig` with clear errors.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from kvpush_prod.config.fields import allowed_text, lookup, sections, shown
from kvpush_prod.config.profiles import locate
from kvpush_prod.config.settings import (
    ALLOWED_KEYS_ENV,
    DOCS,
    KEY_FILE_ENV,
    PARAMS_KEY_ENV,
    PROFILE_ENV,
    REMOVED_KEYS,
    REMOVED_SECRET_ENV,
    KvpushConfig,
)
from kvpush_prod.errors import ConfigError

Source = Literal["default", "profile", "extra", "env"]


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _leaves(data: dict[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for key, value in data.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, (*prefix, str(key)))
        else:
            yield (*prefix, str(key))


_ORIGIN = {
    "profile": "from the profile",
    "extra": "from kv_connector_extra_config",
    "env": "from the environment",
}


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _format_validation(
    err: ValidationError, source: str, sources: dict[str, str] | None = None
) -> str:
    lines = [f"invalid kvpush configuration ({source}):"]
    for e in err.errors():
        loc = tuple(e["loc"])
        path = ".".join(str(p) for p in loc) or "<root>"
        value = e.get("input")
        origin = _ORIGIN.get((sources or {}).get(path, ""), "")
        where = f" ({origin})" if origin else ""
        anchor = f"{DOCS}#{loc[0]}" if loc else DOCS
        if e["type"] == "extra_forbidden":
            lines.append(_unknown_key(loc, path, value, where))
            continue
        f = lookup(loc)
        if f is not None:
            meaning = f" ({f.description.rstrip('.')})" if f.description else ""
            lines.append(
                f"  - {path} = {shown(loc, value)}{where}: {_lower_first(e['msg'])}; allowed: "
                f"{allowed_text(f)}{meaning}. Fix: set {path} to an allowed value (see {anchor})"
            )
        elif len(loc) == 1 and e["type"] in ("model_type", "model_attributes_type"):
            keys = ", ".join(sections()[str(loc[0])].model_fields)
            lines.append(
                f"  - {path} = {shown(loc, value)}{where}: a section must be a mapping of its "
                f"keys ({keys}). Fix: write it as '{path}: {{key: value}}' (see {anchor})"
            )
        elif e["type"] == "value_error":
            msg = str(e["msg"]).removeprefix("Value error, ")
            lines.append(f"  - {path}: {msg} (see {anchor})")
        else:
            lines.append(f"  - {path} = {shown(loc, value)}{where}: {e['msg']} (see {anchor})")
    return "\n".join(lines)


def _unknown_key(loc: tuple[str | int, ...], path: str, value: Any, where: str) -> str:
    removed = REMOVED_KEYS.get(tuple(str(p) for p in loc))  # type: ignore[arg-type]
    if removed is not None:
        return f"  - {path}{where}: no longer exists: {removed}"
    by_name = sections()
    if len(loc) == 1:
        known = list(by_name)
        what = "unknown section"
    else:
        model = by_name.get(str(loc[0]))
        known = list(model.model_fields) if model is not None else []
        what = f"unknown key of {loc[0]}"
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (
        f"  - {path} = {shown(loc, value)}{where}: {what}; {hint}known: "
        f"{', '.join(known)}. Fix: remove it or correct its spelling (see {DOCS})"
    )


def read_profile(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML profile (a path or a shipped profile's name, see
    `profiles.locate`), with clear errors for a missing file or bad YAML."""
    p = locate(path)
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"profile {str(p)!r} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"profile {str(p)!r} must hold a mapping of sections, got {type(data).__name__}"
        )
    return data


@dataclass(frozen=True)
class ResolvedConfig:
    """A validated config and where each ``section.key`` value came from."""

    config: KvpushConfig
    profile: str | None
    sources: dict[str, Source] = field(default_factory=dict)

    def source_of(self, section: str, key: str) -> Source:
        return self.sources.get(f"{section}.{key}", "default")


def resolve_config(
    profile: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> ResolvedConfig:
    """Profile YAML, then overrides (kv_connector_extra_config), then the environment."""
    env = dict(os.environ) if env is None else env
    profile = profile or env.get(PROFILE_ENV) or None
    layers: list[tuple[Source, dict[str, Any]]] = []
    if profile:
        layers.append(("profile", read_profile(profile)))
    if overrides:
        if not isinstance(overrides, dict):
            raise ConfigError(
                f"kv_connector_extra_config must be a mapping, got {type(overrides).__name__}"
            )
        layers.append(("extra", overrides))
    if env.get(REMOVED_SECRET_ENV):
        raise ConfigError(
            f"${REMOVED_SECRET_ENV} is set, but {REMOVED_KEYS[('control', 'secret')]}; unset "
            f"{REMOVED_SECRET_ENV}"
        )
    from_env = {
        key: env[name]
        for key, name in (
            ("params_key", PARAMS_KEY_ENV),
            ("key_file", KEY_FILE_ENV),
            ("allowed_keys", ALLOWED_KEYS_ENV),
        )
        if env.get(name)
    }
    if from_env:
        layers.append(("env", {"control": from_env}))
    data: dict[str, Any] = {}
    sources: dict[str, Source] = {}
    for origin, layer in layers:
        data = _merge(data, layer)
        for leaf in _leaves(layer):
            sources[".".join(leaf)] = origin
    source = f"profile={str(profile)!r}" if profile else "defaults"
    if overrides:
        source += " + kv_connector_extra_config"
    try:
        cfg = KvpushConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation(exc, source, dict(sources))) from None
    return ResolvedConfig(cfg, str(profile) if profile else None, sources)


def load_config(
    profile: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> KvpushConfig:
    """Profile YAML, then overrides (kv_connector_extra_config), then env secrets."""
    return resolve_config(profile, overrides, env).config


def split_extra(extra: dict[str, Any] | None) -> tuple[str | None, dict[str, Any]]:
    """``kv_connector_extra_config`` as (profile: a path or a shipped profile's name,
    section overrides)."""
    extra = dict(extra or {})
    profile = extra.pop("profile", None)
    if profile is not None and not isinstance(profile, str):
        raise ConfigError(
            f"kv_connector_extra_config.profile must be a path string, got {profile!r}"
        )
    return profile, extra


def config_from_extra(extra: dict[str, Any] | None) -> KvpushConfig:
    """The config from vLLM's ``kv_connector_extra_config`` (``profile`` + section overrides)."""
    profile, overrides = split_extra(extra)
    return load_config(profile, overrides)
