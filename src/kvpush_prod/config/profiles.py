"""The shipped profiles (package data in ``kvpush_prod/config/profiles/``) and how a profile
given to the connector or the CLI is found: a path, or a shipped profile by name.

The package copy is the source; ``configs/*.yaml`` in the checkout holds the same files for
operators (tests/config/test_profiles.py keeps them equal).
"""

from __future__ import annotations

import os
from pathlib import Path

from kvpush_prod.errors import ConfigError

SCHEME = "profile:"  # "profile:efa-p5en" names a shipped profile whatever files exist
SUFFIX = ".yaml"


# Next to this module in the source tree and in every install (pyproject's package-data).
SHIPPED_DIR = Path(__file__).resolve().with_name("profiles")


def shipped() -> dict[str, Path]:
    """Every shipped profile by name (the file name without ``.yaml``), sorted."""
    return {p.name.removesuffix(SUFFIX): p for p in sorted(SHIPPED_DIR.glob("*" + SUFFIX))}


def first_comment(profile: Path) -> str:
    """The first sentence of the comment block a profile starts with: what it is for."""
    block = []
    for line in profile.read_text().splitlines():
        if not line.startswith("#"):
            break
        block.append(line.lstrip("#").strip())
    text = " ".join(block)
    end = text.find(". ")
    return text[: end + 1] if end >= 0 else text


def _shipped_by_name(name: str) -> Path | None:
    return shipped().get(name.removesuffix(SUFFIX))


def _is_bare_name(spec: str) -> bool:
    return "/" not in spec and os.sep not in spec


def locate(spec: str | Path) -> Path:
    """The profile ``spec`` names: ``profile:NAME`` is a shipped profile; anything else is a
    path, or, when no such file exists and it has no directory part, a shipped profile's name
    (``efa-p5en`` or ``efa-p5en.yaml``). ConfigError says what was tried and what exists."""
    text = str(spec)
    if text.startswith(SCHEME):
        found = _shipped_by_name(text[len(SCHEME) :])
        if found is None:
            raise ConfigError(f"profile {text!r} is not a shipped profile: {_known()}")
        return found
    path = Path(spec)
    if path.is_file():
        return path
    found = _shipped_by_name(text) if _is_bare_name(text) else None
    if found is not None:
        return found
    raise ConfigError(
        f"profile {text!r} does not exist (a relative path is taken from the working "
        f"directory, {os.getcwd()}); pass an existing YAML file such as configs/default.yaml, "
        f"or a shipped profile: {_known()}"
    )


def same_profile(a: str | Path, b: str | Path) -> bool:
    """Whether two profile specs name the same profile (without requiring either to exist)."""
    return _identity(a) == _identity(b)


def _identity(spec: str | Path) -> str:
    try:
        return str(locate(spec).resolve())
    except ConfigError:
        return str(Path(spec).resolve())


def _known() -> str:
    names = ", ".join(shipped())
    return f"the shipped profiles are {names} (name one as efa-p5en or {SCHEME}efa-p5en)"
