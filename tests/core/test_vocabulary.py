"""The core's words are the wire's and the metrics' words: each enum member is the string
that goes into a label, and the metric label sets list exactly the core's outcomes."""

from __future__ import annotations

import json

import pytest

from kvpush_prod.core.vocabulary import AfterDrain, NoteKind, Outcome, Side
from kvpush_prod.metrics import OUTCOMES, PUMP_STAGES, ROLES


def test_a_member_is_its_string_in_labels_formats_and_json() -> None:
    assert Outcome.PULL_FALLBACK == "pull_fallback"
    assert str(Outcome.PULL_FALLBACK) == f"{Outcome.PULL_FALLBACK}" == "pull_fallback"
    assert {"pull_fallback": 1}[Outcome.PULL_FALLBACK] == 1
    assert json.dumps([NoteKind.RETRY]) == '["retry"]'


def test_the_metric_labels_are_the_core_words() -> None:
    assert set(OUTCOMES) == {o.value for o in Outcome}
    assert set(ROLES) == {s.value for s in Side}


def test_the_pump_stages_are_the_driver_stages() -> None:
    from kvpush_prod.driver import Stage

    assert set(PUMP_STAGES) == {s.value for s in Stage}


@pytest.mark.parametrize(
    ("role", "side"),
    [("kv_producer", Side.PRODUCER), ("kv_consumer", Side.CONSUMER), ("kv_both", None)],
)
def test_a_kv_role_names_a_side(role: str, side: Side | None) -> None:
    assert Side.of_kv_role(role) is side


def test_only_delivered_outcomes_count_as_delivered() -> None:
    assert {o for o in Outcome if o.delivered} == {
        Outcome.PUSHED,
        Outcome.RETRIED,
        Outcome.PULL_FALLBACK,
    }


def test_not_draining_is_the_empty_word() -> None:
    assert AfterDrain.NOTHING == "" and not AfterDrain.NOTHING
    assert all(a for a in AfterDrain if a is not AfterDrain.NOTHING)
