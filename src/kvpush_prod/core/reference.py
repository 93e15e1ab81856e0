"""The core's vocabulary as markdown, rendered from the code: the actions the engines
return, the events they take and the words their outcomes and notes use.

``docs/core.md`` holds these tables between markers; a test keeps them equal to what
renders here, as ``transition_table_markdown`` does for the transfer table.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable
from typing import Any, get_args

from kvpush_prod.core import commands
from kvpush_prod.core.actions import Action
from kvpush_prod.core.receiver import Receiver
from kvpush_prod.core.sender import Sender
from kvpush_prod.core.vocabulary import AfterDrain, NoteKind, Outcome, Side

# The events each engine takes from the network and the clock (its engine-thread events are
# the commands of core.commands).
ENGINE_EVENTS: tuple[tuple[type, str], ...] = (
    (Sender, "on_message"), (Sender, "on_chunk"), (Sender, "on_peer"), (Sender, "poll"),
    (Sender, "tick"),
    (Receiver, "on_message"), (Receiver, "on_done"), (Receiver, "on_chunk"),
    (Receiver, "on_peer"), (Receiver, "poll"), (Receiver, "tick"),
)  # fmt: skip
_SIDE_OF: dict[type, str] = {Sender: "P", Receiver: "D"}
_SOURCE = {
    "on_message": "control channel",
    "on_chunk": "NIC",
    "on_done": "NIC",
    "on_peer": "connect",
}


def _summary(obj: Any) -> str:
    """The first paragraph of ``obj``'s docstring, on one line."""
    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|")


def _fields(cls: type) -> str:
    return ", ".join(f"`{f.name}`" for f in dataclasses.fields(cls))


def _table(header: tuple[str, ...], rows: Iterable[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def actions_markdown() -> str:
    """Every action type (``core.actions.Action``): its fields and what it asks."""
    return _table(
        ("action", "fields", "what the shell does"),
        ((f"`{cls.__name__}`", _fields(cls), _summary(cls)) for cls in get_args(Action)),
    )


def _side_of_command(cls: Any) -> str:
    engine = inspect.signature(cls.apply).parameters["engine"].annotation
    return "P" if engine in ("Sender", Sender) else "D"


def events_markdown() -> str:
    """Every event an engine takes: the engine-thread commands, then the network's and the
    clock's (the engines' ``on_*``, ``poll`` and ``tick``)."""
    command_types: list[type] = [
        *get_args(commands.SendCommand),
        *get_args(commands.ReceiveCommand),
    ]
    rows = [
        (f"`{cls.__name__}`", _side_of_command(cls), "engine thread", _fields(cls), _summary(cls))
        for cls in command_types
    ]
    for engine, name in ENGINE_EVENTS:
        method: Callable[..., Any] = getattr(engine, name)
        params = [p for p in inspect.signature(method).parameters if p != "self"]
        rows.append(
            (
                f"`{engine.__name__}.{name}`",
                _SIDE_OF[engine],
                _SOURCE.get(name, "clock"),
                ", ".join(f"`{p}`" for p in params),
                _summary(method),
            )
        )
    return _table(("event", "side", "from", "arguments", "meaning"), rows)


def words_markdown() -> str:
    """The values of the core's enums (the strings on the wire and in metric labels)."""
    words: tuple[
        tuple[str, type[Side] | type[Outcome] | type[NoteKind] | type[AfterDrain]], ...
    ] = (
        ("`Side`", Side),
        ("`Outcome`", Outcome),
        ("`NoteKind`", NoteKind),
        ("`AfterDrain`", AfterDrain),
    )
    return _table(
        ("word", "values", "meaning"),
        (
            (name, ", ".join(f"`{m.value}`" if m.value else '`""`' for m in enum), _summary(enum))
            for name, enum in words
        ),
    )
