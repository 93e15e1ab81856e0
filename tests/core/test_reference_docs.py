"""docs/core.md's tables of actions, events and words are rendered from the code, so they
cannot drift: each section must equal what ``core.reference`` renders now.

``KVPUSH_WRITE_DOCS=1`` rewrites the sections instead of failing.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpush_prod.core.reference import actions_markdown, events_markdown, words_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "core.md"


@pytest.mark.parametrize(
    ("name", "render"),
    [
        ("actions", actions_markdown),
        ("events", events_markdown),
        ("words", words_markdown),
    ],
)
def test_the_core_doc_lists_what_the_code_renders(name: str, render: Callable[[], str]) -> None:
    text = DOC.read_text()
    section = re.compile(rf"(<!-- {name}:start -->\n)(.*?)(<!-- {name}:end -->)", re.S)
    found = section.search(text)
    assert found, f"docs/core.md has no <!-- {name}:start/end --> section"
    if os.environ.get("KVPUSH_WRITE_DOCS") and found.group(2) != render():
        DOC.write_text(section.sub(lambda mt: mt.group(1) + render() + mt.group(3), text))
        return
    assert found.group(2) == render(), (
        f"docs/core.md's {name} table is out of date: regenerate it with "
        "`KVPUSH_WRITE_DOCS=1 pytest tests/core/test_reference_docs.py`"
    )


def test_every_action_and_command_is_in_the_doc() -> None:
    text = DOC.read_text()
    for cls in (
        "PostWrite",
        "PostRead",
        "SendMessage",
        "ConnectPeer",
        "DropPeer",
        "ReleaseSend",
        "ReportFinished",
        "ReportFailed",
        "Note",
        "RegisterBlocks",
        "BlocksReady",
        "AbortReceive",
    ):
        assert f"`{cls}`" in text, cls
    for gone in ("FreeBlocks", "SendNotif", "AbortChunk"):
        assert gone not in text, f"docs/core.md names {gone}, which is not an action"
