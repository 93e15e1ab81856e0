"""Every reason word lives in ``kvpush_prod.vocabulary``: the rejection counters' label values
are exactly its enums, and no refusal in the code names its reason with a bare string (so a
new reason cannot reach a metric, a log or an alert without being a word of the vocabulary)."""

from __future__ import annotations

import ast
from pathlib import Path

from kvpush_prod import metrics, vocabulary
from kvpush_prod.vocabulary import ParamsRejectReason, RejectReason

SRC = Path(__file__).resolve().parents[1] / "src" / "kvpush_prod"

# (call, which argument holds the reason, the enum it must be a member of)
REASON_SITES = (
    ("Note", 1, "RejectReason"),  # Note(NoteKind.REJECTED, <reason>, ...)
    ("KVTransferParamsError", "reason", "ParamsRejectReason"),
    ("SignatureError", 0, ("ParamsRejectReason", "KeyProblem")),
)


def test_the_rejection_counters_take_their_labels_from_the_vocabulary() -> None:
    assert tuple(r.value for r in RejectReason) == metrics.CONTROL_REJECT_REASONS
    assert tuple(r.value for r in ParamsRejectReason) == metrics.PARAMS_REJECT_REASONS
    series = metrics.SERIES_BY_NAME
    assert (
        dict(series["kvpush_control_messages_rejected"].values)["reason"]
        == metrics.CONTROL_REJECT_REASONS
    )
    assert (
        dict(series["kvpush_kv_params_rejected"].values)["reason"] == metrics.PARAMS_REJECT_REASONS
    )


def test_every_word_is_one_of_a_kind() -> None:
    for enum in (RejectReason, ParamsRejectReason, vocabulary.Outcome, vocabulary.NoteKind):
        values = [m.value for m in enum]
        assert len(values) == len(set(values)), enum


def _rejected_note(call: ast.Call) -> bool:
    first = call.args[0] if call.args else None
    return isinstance(first, ast.Attribute) and first.attr == "REJECTED"


def _reason_arg(call: ast.Call, where: int | str) -> ast.expr | None:
    if isinstance(where, int):
        return call.args[where] if len(call.args) > where else None
    return next((k.value for k in call.keywords if k.arg == where), None)


def _bare_reasons() -> list[str]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "vocabulary.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = (
                node.func.id
                if isinstance(node.func, ast.Name)
                else node.func.attr
                if isinstance(node.func, ast.Attribute)
                else ""
            )
            for call, where, enums in REASON_SITES:
                if name != call or (call == "Note" and not _rejected_note(node)):
                    continue
                arg = _reason_arg(node, where)
                if arg is None:
                    continue
                ok = (
                    isinstance(arg, ast.Attribute)
                    and isinstance(arg.value, ast.Name)
                    and arg.value.id in ((enums,) if isinstance(enums, str) else enums)
                )
                if (
                    not ok
                    and not isinstance(arg, (ast.Name, ast.Attribute, ast.Call))
                    or isinstance(arg, ast.Constant)
                ):
                    found.append(f"{path.relative_to(SRC)}:{node.lineno}: {call}")
            if (
                name == "inc"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value
                in ("kvpush_control_messages_rejected", "kvpush_kv_params_rejected")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Tuple)
                and any(isinstance(e, ast.Constant) for e in node.args[1].elts[1:])
            ):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: stats.inc")
    return found


def test_no_refusal_names_its_reason_with_a_bare_string() -> None:
    assert _bare_reasons() == []
