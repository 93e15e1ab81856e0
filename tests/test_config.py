"""Configuration: profile + overrides + env, and errors that name the key, value and fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpush_prod.config import config_from_extra, load_config
from kvpush_prod.errors import ConfigError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_every_shipped_profile_is_valid() -> None:
    profiles = sorted(CONFIGS.glob("*.yaml"))
    assert profiles
    for p in profiles:
        load_config(p, env={})


def test_overrides_win_over_the_profile_and_env_secret_wins_over_both() -> None:
    cfg = config_from_extra({"profile": str(CONFIGS / "cpu-loopback.yaml"),
                             "control": {"port": 17000}})
    assert cfg.control.port == 17000
    cfg = load_config(None, {"control": {"secret": "a"}}, env={"KVPUSH_SECRET": "b"})
    assert cfg.control.secret == "b"


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        ({"push": {"chunk_byts": 1}}, ["push.chunk_byts", "unknown key"]),
        ({"leases": {"permit_ttl_s": -1}}, ["leases.permit_ttl_s", "-1"]),
        ({"control": {"port": "abc"}}, ["control.port", "abc"]),
        ({"transport": {"backend": "TCP"}}, ["transport.backend", "TCP"]),
        ({"leases": {"permit_ttl_s": 1, "stop_margin_s": 2}}, ["stop_margin_s"]),
    ],
)
def test_mistakes_name_the_key_and_the_value(overrides: dict, needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides, env={})
    for needle in needles:
        assert needle in str(info.value)


def test_missing_profile_and_bad_yaml_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml", env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("control: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, env={})
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listy, env={})
