"""Facts about the configuration's fields, read from the model: type, range, default,
secrecy, where a key lives. The docs, the CLI and the error messages all say them this way.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kvpush_prod.config.settings import MASK, KvpushConfig


def sections() -> dict[str, type[BaseModel]]:
    """Each section's name and settings model, in ``KvpushConfig`` order."""
    out = {}
    for name, f in KvpushConfig.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out[name] = ann
    return out


def lookup(path: tuple[str | int, ...]) -> FieldInfo | None:
    """The field at ``(section, key)``, or None."""
    if len(path) != 2:
        return None
    section = sections().get(str(path[0]))
    return None if section is None else section.model_fields.get(str(path[1]))


def is_secret(f: FieldInfo | None) -> bool:
    extra = f.json_schema_extra if f is not None else None
    return isinstance(extra, dict) and bool(extra.get("secret"))


def type_name(f: FieldInfo) -> str:
    """The field's type as the docs and errors say it (integer, number, boolean, ...)."""
    ann = f.annotation
    optional = False
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        optional = len(args) < len(typing.get_args(ann))
        ann = args[0] if len(args) == 1 else ann
    names: dict[Any, str] = {int: "integer", float: "number", bool: "boolean", str: "string"}
    if typing.get_origin(ann) is Literal:
        name = "enum"
    else:
        name = names.get(ann) or str(getattr(ann, "__name__", ann))
    return f"{name} or null" if optional else name


def allowed_range(f: FieldInfo) -> str:
    """What values the field takes, from its constraints (``>= 1024 and <= 65000``, ...)."""
    ann = f.annotation
    for arg in (ann, *typing.get_args(ann)):
        if typing.get_origin(arg) is Literal:
            return "one of " + ", ".join(repr(v) for v in typing.get_args(arg))
    parts = []
    for m in f.metadata:
        for attr, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if isinstance(m, getattr(annotated_types, attr.capitalize())):
                parts.append(f"{op} {getattr(m, attr)}")
    if parts:
        return " and ".join(parts)
    if ann is bool:
        return "true or false"
    return "any"


def field_rows() -> Iterator[tuple[str, str, FieldInfo]]:
    """(section, key, field) for every field, in model order."""
    for section, model in sections().items():
        for key, f in model.model_fields.items():
            yield section, key, f


def section_doc(section: str) -> str:
    model = sections()[section]
    return (model.__doc__ or "").strip().splitlines()[0]


def allowed_text(f: FieldInfo) -> str:
    """``integer >= 1024 and <= 65000``, ``one of 'UCX', 'LIBFABRIC'``, ``boolean``, ..."""
    rng = allowed_range(f)
    if rng.startswith("one of"):
        return rng
    if rng in ("any", "true or false"):
        return type_name(f)
    return f"{type_name(f)} {rng}"


_SECRETISH = ("secret", "password", "token", "key")


def shown(path: tuple[str | int, ...], value: Any) -> str:
    """``value`` for an error message, masked when it may be a secret (or a typo of one)."""
    f = lookup(path)
    name = str(path[-1]).lower() if path else ""
    secret_names = [k for s, k, fi in field_rows() if is_secret(fi)]
    if is_secret(f):
        return MASK
    # An unknown key that looks like a secret (or a typo of one) may hold one too.
    if f is None and (
        any(w in name for w in _SECRETISH)
        or difflib.get_close_matches(name, secret_names, n=1, cutoff=0.6)
    ):
        return MASK
    return repr(value)
