"""Shipped profiles: package data found by name from any install, the same files as configs/
in the checkout, and a path still wins over a name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvpush_prod.config import config_from_extra, load_config
from kvpush_prod.config.cli import main
from kvpush_prod.config.profiles import SHIPPED_DIR, locate, same_profile, shipped
from kvpush_prod.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


def test_configs_holds_exactly_the_shipped_profiles_byte_for_byte() -> None:
    # The package copy is the source: after editing it, `cp src/kvpush_prod/config/profiles/*.yaml
    # configs/` (and the reverse for a new profile's file).
    ours = {p.name: p.read_bytes() for p in CONFIGS.glob("*.yaml")}
    theirs = {p.name: p.read_bytes() for p in SHIPPED_DIR.glob("*.yaml")}
    assert sorted(ours) == sorted(theirs)
    stale = [name for name in ours if ours[name] != theirs[name]]
    assert not stale, (
        f"configs/{stale} differ from src/kvpush_prod/config/profiles/: copy the "
        "package's files over them"
    )


def test_the_profiles_are_package_data_of_the_distribution() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    section = re.search(r"^\[tool\.setuptools\.package-data\]\n(.*?)(?=^\[)", text, re.M | re.S)
    assert section and re.search(r'^kvpush_prod = \[.*"config/profiles/\*\.yaml"', section[1], re.M)


def test_every_shipped_profile_loads_by_name() -> None:
    assert set(shipped()) == {
        "cpu-loopback",
        "cpu-multichunk",
        "default",
        "efa-p5en",
        "high-concurrency",
        "ib-ucx",
    }
    for name, path in shipped().items():
        assert load_config(name, env={}) == load_config(path, env={})


@pytest.mark.parametrize(
    "spec", ["efa-p5en", "efa-p5en.yaml", "profile:efa-p5en", "profile:efa-p5en.yaml"]
)
def test_a_shipped_profile_is_found_with_or_without_scheme_and_suffix(spec: str) -> None:
    assert locate(spec) == SHIPPED_DIR / "efa-p5en.yaml"


def test_a_file_wins_over_a_name_and_the_scheme_always_means_the_shipped_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("efa-p5en").write_text("push: {chunk_bytes: 8192}\n")
    assert load_config("efa-p5en", env={}).push.chunk_bytes == 8192
    assert load_config("profile:efa-p5en", env={}).transport.backend == "LIBFABRIC"
    assert load_config(CONFIGS / "efa-p5en.yaml", env={}).transport.backend == "LIBFABRIC"


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("no-such-profile", "does not exist"),
        ("profile:no-such-profile", "is not a shipped profile"),
        ("some/dir/efa-p5en", "does not exist"),  # a path is never taken for a name
    ],
)
def test_an_unknown_profile_is_an_error_naming_the_shipped_ones(spec: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as err:
        load_config(spec, env={})
    assert "cpu-loopback, cpu-multichunk, default, efa-p5en, high-concurrency, ib-ucx" in str(
        err.value
    )


def test_the_connector_takes_a_shipped_profile_by_name_in_its_extra_config() -> None:
    by_name = config_from_extra({"profile": "efa-p5en", "control": {"port": 16000}})
    by_path = config_from_extra(
        {"profile": str(CONFIGS / "efa-p5en.yaml"), "control": {"port": 16000}}
    )
    assert by_name == by_path and by_name.transport.backend == "LIBFABRIC"


def test_kvpush_config_validate_takes_a_name(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVPUSH_PROFILE", raising=False)
    assert main(["validate", "efa-p5en"]) == 0
    assert capsys.readouterr().out.startswith("OK: efa-p5en is a valid")
    # The same profile named twice (positional and in the extra config) is not two profiles.
    assert main(["validate", "efa-p5en", "--extra", '{"profile": "profile:efa-p5en"}']) == 0


def test_same_profile_compares_what_the_names_point_at() -> None:
    assert same_profile("efa-p5en", "profile:efa-p5en.yaml")
    assert not same_profile("efa-p5en", "ib-ucx")
    assert not same_profile("efa-p5en", "missing.yaml")
