"""Lab engines of any tensor-parallel size: the flag, and every rank on the role's core."""

from __future__ import annotations

import pytest

from kvpush_prod.lab.cluster import tp_args


def test_tp_one_is_the_plain_engine_on_its_core() -> None:
    assert tp_args(1, "1") == ([], "1")


def test_tp_two_keeps_both_ranks_on_the_roles_core() -> None:
    assert tp_args(2, "0") == (["--tensor-parallel-size", "2"], "0|0")


def test_more_ranks_than_control_ports_reserved_is_refused() -> None:
    with pytest.raises(ValueError, match="1 to 4"):
        tp_args(8, "0")
