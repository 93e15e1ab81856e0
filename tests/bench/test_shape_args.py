"""``kvpush bench --model-shape`` and ``--fragment``: what they parse to, and bad values
refused before anything starts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvpush_prod.bench.cli import _settings, _shape, build_parser, main
from kvpush_prod.bench.sides import SIDES, RunningSide
from kvpush_prod.lab.tinymodel import TinyModelSpec


def test_a_shape_names_the_model_fields_and_intermediate_follows_hidden() -> None:
    assert _shape("layers=32,hidden=64,heads=4,kv_heads=2,head_dim=16") == {
        "num_layers": 32,
        "hidden_size": 64,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
    }
    assert _shape("layers=8") == {"num_layers": 8}
    assert _shape("hidden=64,intermediate=96")["intermediate_size"] == 96


@pytest.mark.parametrize(
    "bad", ["layers", "layers=0", "layers=-1", "depth=4", "layers=x", "layers=32,,hidden=8"]
)
def test_a_bad_shape_is_refused_naming_the_keys(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="layers, hidden"):
        _shape(bad)


def test_the_shape_and_the_churn_reach_the_sides_and_the_model_written(tmp_path: Path) -> None:
    args = ["--out", str(tmp_path), "--model-shape", "layers=3,hidden=64", "--fragment", "2"]
    s = _settings(build_parser().parse_args(args), args)
    assert s.side.fragment == 2
    assert s.side.model_shape == {"num_layers": 3, "hidden_size": 64, "intermediate_size": 128}
    model = Path(RunningSide(SIDES["kvpush"], s.side)._model())
    assert model.name == "tiny-llama-hidden_size64-intermediate_size128-num_layers3"
    config = json.loads((model / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (3, 64)
    plain = _settings(build_parser().parse_args(["--out", str(tmp_path)]), [])
    default = Path(RunningSide(SIDES["kvpush"], plain.side)._model())
    assert default.name == "tiny-llama"
    assert (
        TinyModelSpec().num_layers
        == json.loads((default / "config.json").read_text())["num_hidden_layers"]
    )


def test_a_negative_churn_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path), "--fragment", "-1"]) == 2
    assert "--fragment -1" in capsys.readouterr().err
