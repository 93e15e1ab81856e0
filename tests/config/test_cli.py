"""``kvpush config validate|show|docs``: exit codes, messages, provenance, masking."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvpush_prod.cli import main as kvpush_main
from kvpush_prod.config import KvpushConfig, load_config
from kvpush_prod.config.cli import main
from kvpush_prod.config.docs import render_config_doc

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
EFA = str(CONFIGS / "efa-p5en.yaml")


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVPUSH_SECRET", "KVPUSH_PARAMS_KEY", "KVPUSH_KEY_FILE", "KVPUSH_ALLOWED_KEYS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("KVPUSH_PROFILE", raising=False)


def test_validate_ok_prints_ok_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", EFA]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: ") and "LIBFABRIC" in out


def test_validate_reaches_through_the_kvpush_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvpush_main(["config", "validate", EFA]) == 0
    assert capsys.readouterr().out.startswith("OK: ")


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        ('{"push": {"chunk_bytes": 10}}', ["push.chunk_bytes = 10", ">= 4096", "Fix:"]),
        ('{"push": {"chunk_byts": 1}}', ["push.chunk_byts", "did you mean 'chunk_bytes'"]),
        ('{"faultz": {}}', ["faultz", "unknown section"]),
        ("{bad json", ["not valid JSON"]),
        ("[1, 2]", ["JSON object"]),
        ('{"profile": "other.yaml"}', ["two profiles"]),
    ],
)
def test_validate_errors_exit_2_and_say_why(
    capsys: pytest.CaptureFixture[str], extra: str, needles: list[str]
) -> None:
    assert main(["validate", EFA, "--extra", extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    for needle in needles:
        assert needle in captured.err


def test_validate_missing_profile_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_extra_from_a_file_and_as_a_whole_kv_transfer_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ktc = {
        "kv_connector": "PushConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"profile": EFA, "control": {"port": 16000}},
    }
    path = tmp_path / "ktc.json"
    path.write_text(json.dumps(ktc))
    assert main(["show", "--extra", f"@{path}", "--format", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["profile"] == EFA
    assert shown["config"]["control"]["port"] == 16000
    assert shown["sources"]["control.port"] == "extra"
    assert shown["sources"]["transport.backend"] == "profile"
    assert shown["sources"]["control.max_message_bytes"] == "default"


def test_show_says_where_each_value_came_from_and_masks_the_secret(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVPUSH_PARAMS_KEY", "hunter2-very-secret")
    assert main(["show", EFA, "--extra", '{"control": {"port": 15600}}']) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out
    lines = {ln.split(":")[0].strip(): ln for ln in out.splitlines() if not ln.startswith("#")}
    assert lines["port"].endswith("# extra")
    assert lines["backend"].endswith("# profile")
    assert lines["params_key"].endswith("# env")
    assert lines["max_message_bytes"].endswith("# default")


def test_show_output_is_a_profile_that_loads_to_the_same_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", EFA, "--extra", '{"push": {"chunk_bytes": 1048576}}']) == 0
    path = tmp_path / "effective.yaml"
    path.write_text(capsys.readouterr().out)
    assert load_config(path, env={}) == load_config(EFA, {"push": {"chunk_bytes": 1048576}}, env={})


def test_profile_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVPUSH_PROFILE", EFA)
    assert main(["show"]) == 0
    assert f"# profile: {EFA}" in capsys.readouterr().out


def test_show_without_a_profile_is_all_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "--format", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert set(shown["sources"].values()) == {"default"}
    assert KvpushConfig.model_validate(shown["config"]) == KvpushConfig()


def test_docs_and_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["docs", "config"]) == 0
    assert capsys.readouterr().out == render_config_doc()
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "push" in schema["properties"]


def test_show_yaml_is_valid_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", EFA]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert data["transport"]["backend"] == "LIBFABRIC"
