"""Configuration: profile + overrides + env, and errors that name the key, value and fix."""

from __future__ import annotations

import re
from pathlib import Path

import annotated_types
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic.fields import FieldInfo

from kvpush_prod.config import (
    KvpushConfig,
    allowed_range,
    config_from_extra,
    field_rows,
    load_config,
    resolve_config,
)
from kvpush_prod.config.profiles import SHIPPED_DIR
from kvpush_prod.errors import ConfigError

CONFIGS = SHIPPED_DIR  # the shipped profiles (configs/ holds the same files)


def test_every_shipped_profile_is_valid() -> None:
    profiles = sorted(CONFIGS.glob("*.yaml"))
    assert profiles
    for p in profiles:
        load_config(p, env={})


def test_overrides_win_over_the_profile_and_the_environment_wins_over_both() -> None:
    cfg = config_from_extra(
        {"profile": str(CONFIGS / "cpu-loopback.yaml"), "control": {"port": 17000}}
    )
    assert cfg.control.port == 17000
    cfg = load_config(
        None,
        {"control": {"key_file": "a", "allowed_keys": "d"}},
        env={"KVPUSH_KEY_FILE": "b", "KVPUSH_PARAMS_KEY": "p" * 32},
    )
    assert cfg.control.key_file == "b" and cfg.control.params_key == "p" * 32


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


# ---------------------------------------------------------------- profiles


def test_default_profile_spells_out_exactly_the_built_in_defaults() -> None:
    raw = yaml.safe_load((CONFIGS / "default.yaml").read_text())
    assert load_config(CONFIGS / "default.yaml", env={}) == KvpushConfig()
    assert {(s, k) for s, keys in raw.items() for k in keys} == {
        (s, k) for s, k, _ in field_rows()
    }, "default.yaml must list every key"


def test_cpu_loopback_keeps_the_values_tests_and_demo_rely_on() -> None:
    cfg = load_config(CONFIGS / "cpu-loopback.yaml", env={})
    assert cfg.verify.checksums is True
    assert cfg.control.host == "127.0.0.1"
    assert cfg.transport.backend == "UCX"
    assert cfg.transport.progress_delay_us == 10000
    assert cfg.push.chunk_bytes == 4 << 20
    assert (cfg.leases.permit_ttl_s, cfg.leases.send_lease_ttl_s) == (5, 60)


def test_efa_profile_uses_libfabric_and_megabyte_chunks() -> None:
    cfg = load_config(CONFIGS / "efa-p5en.yaml", env={})
    assert cfg.transport.backend == "LIBFABRIC"
    assert cfg.push.chunk_bytes >= 1 << 20
    # The in-flight window covers one link's 2 x 200 Gbps at the target latency.
    link_bytes_per_s = 2 * 200e9 / 8
    window = link_bytes_per_s * cfg.push.target_latency_ms / 1e3
    assert cfg.push.max_inflight_chunks * cfg.push.chunk_bytes >= window


def test_every_profile_explains_itself_in_comments() -> None:
    for p in sorted(CONFIGS.glob("*.yaml")):
        lines = p.read_text().splitlines()
        assert lines[0].startswith("#"), f"{p.name} must open with a comment saying what it is for"
        assert sum(ln.lstrip().startswith("#") for ln in lines) >= 3, p.name


# ---------------------------------------------------------------- errors


def test_errors_give_the_allowed_range_where_the_value_came_from_and_the_fix(
    tmp_path: Path,
) -> None:
    profile = tmp_path / "p.yaml"
    profile.write_text("push:\n  max_inflight_chunks: 0\n")
    with pytest.raises(ConfigError) as info:
        load_config(profile, {"control": {"port": 80}}, env={})
    msg = str(info.value)
    assert "push.max_inflight_chunks = 0 (from the profile)" in msg
    assert ">= 1 and <= 100000" in msg
    assert "control.port = 80 (from kv_connector_extra_config)" in msg
    assert ">= 1024 and <= 65000" in msg
    assert msg.count("Fix:") == 2
    assert "docs/configuration.md#push" in msg


def test_enum_errors_list_the_choices() -> None:
    with pytest.raises(ConfigError, match="one of 'UCX', 'LIBFABRIC'"):
        load_config(None, {"transport": {"backend": "EFA"}}, env={})


def test_unknown_keys_suggest_the_closest_and_list_the_known() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {"leases": {"permit_tll_s": 5}, "falback": {}}, env={})
    msg = str(info.value)
    assert "did you mean 'permit_ttl_s'" in msg and "did you mean 'fallback'" in msg
    assert "unknown section" in msg and "known: control, transport" in msg


def test_a_section_that_is_not_a_mapping_is_explained() -> None:
    with pytest.raises(ConfigError, match="a section must be a mapping"):
        load_config(None, {"push": 5}, env={})


def test_secrets_never_appear_in_errors() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {"control": {"params_kye": "hunter2", "port": 1}}, env={})
    assert "hunter2" not in str(info.value)
    assert "did you mean 'params_key'" in str(info.value)


def test_the_removed_shared_secret_says_what_replaced_it() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {"control": {"secret": "hunter2"}}, env={})
    assert "hunter2" not in str(info.value) and "kvpush keys generate" in str(info.value)
    with pytest.raises(ConfigError, match="KVPUSH_SECRET is set.*CurveZMQ"):
        load_config(None, None, env={"KVPUSH_SECRET": "hunter2"})


@pytest.mark.parametrize(
    ("control", "needle"),
    [
        ({"host": "10.0.0.5"}, "without authentication"),
        ({"host": "0.0.0.0", "advertise_host": "10.0.0.5"}, "without authentication"),
        ({"key_file": "k"}, "allowed_keys is not"),
        ({"allowed_keys": "d"}, "key_file is not"),
        ({"key_file": "k", "allowed_keys": "d", "insecure": True}, "remove insecure"),
        ({"allowed_peers": ["10.0.0.0/33"]}, "not a network"),
    ],
)
def test_a_network_control_port_needs_keys_or_an_explicit_insecure(
    control: dict, needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(None, {"control": control}, env={})


def test_keys_or_an_explicit_insecure_allow_a_network_address() -> None:
    for control in (
        {"host": "10.0.0.5", "key_file": "k", "allowed_keys": "d"},
        {"host": "10.0.0.5", "insecure": True},
        {"host": "::1"},
        {"host": "localhost"},
    ):
        load_config(None, {"control": control}, env={})


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"control": {"host": "0.0.0.0"}}, "set advertise_host"),
        ({"control": {"host": "0.0.0.0", "advertise_host": "0.0.0.0"}}, "not an address peers"),
        ({"leases": {"send_lease_ttl_s": 1.5}}, "half of send_lease_ttl_s"),
        ({"retry": {"base_backoff_ms": 300}}, "max_backoff_ms=200.0 must be >= base_backoff_ms"),
        ({"breaker": {"cooldown_s": 600}}, "max_cooldown_s=300.0 must be >= cooldown_s"),
        ({"push": {"target_latency_ms": float("nan")}}, "push.target_latency_ms"),
    ],
)
def test_rules_across_keys_are_enforced(overrides: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, overrides, env={})


def test_a_wildcard_bind_with_an_advertised_address_is_fine() -> None:
    cfg = load_config(
        None,
        {"control": {"host": "0.0.0.0", "advertise_host": "10.0.0.5", "insecure": True}},
        env={},
    )
    assert cfg.control.advertise_host == "10.0.0.5"


def _numeric_fields() -> list[tuple[str, str, FieldInfo]]:
    return [(s, k, f) for s, k, f in field_rows() if f.annotation in (int, float)]


def _bounds(f: FieldInfo) -> tuple[float | None, bool, float | None, bool]:
    lo = hi = None
    lo_open = hi_open = False
    for m in f.metadata:
        if isinstance(m, annotated_types.Ge):
            lo = m.ge
        if isinstance(m, annotated_types.Gt):
            lo, lo_open = m.gt, True
        if isinstance(m, annotated_types.Le):
            hi = m.le
        if isinstance(m, annotated_types.Lt):
            hi, hi_open = m.lt, True
    return lo, lo_open, hi, hi_open


@given(data=st.data())
@settings(max_examples=200, deadline=None)
def test_any_out_of_range_number_is_refused_naming_key_value_and_range(data: st.DataObject) -> None:
    section, key, f = data.draw(st.sampled_from(_numeric_fields()))
    lo, lo_open, hi, hi_open = _bounds(f)
    assert lo is not None and hi is not None, f"{section}.{key} needs both bounds"
    below = (
        st.integers(max_value=int(lo) - (0 if lo_open else 1))
        if f.annotation is int
        else st.floats(max_value=lo, exclude_max=not lo_open, allow_nan=False, allow_infinity=False)
    )
    above = (
        st.integers(min_value=int(hi) + 1)
        if f.annotation is int
        else st.floats(min_value=hi, exclude_min=True, allow_nan=False, allow_infinity=False)
    )
    value = data.draw(st.one_of(below, above))
    with pytest.raises(ConfigError) as info:
        load_config(None, {section: {key: value}}, env={})
    msg = str(info.value)
    assert f"{section}.{key} = {value!r}" in msg
    assert allowed_range(f) in msg


@given(data=st.data())
@settings(max_examples=200, deadline=None)
def test_in_range_values_of_one_key_are_accepted(data: st.DataObject) -> None:
    section, key, f = data.draw(st.sampled_from(_numeric_fields()))
    if section in ("leases", "retry", "breaker"):
        return  # cross-field rules couple these keys; covered by the rule tests
    lo, lo_open, hi, hi_open = _bounds(f)
    assert lo is not None and hi is not None
    value = data.draw(
        st.integers(min_value=int(lo) + int(lo_open), max_value=int(hi))
        if f.annotation is int
        else st.floats(min_value=lo, max_value=hi, exclude_min=lo_open, exclude_max=hi_open)
    )
    cfg = load_config(None, {section: {key: value}}, env={})
    assert getattr(getattr(cfg, section), key) == value


# ---------------------------------------------------------------- provenance


def test_resolve_config_says_where_each_value_came_from(tmp_path: Path) -> None:
    profile = tmp_path / "p.yaml"
    profile.write_text("push:\n  chunk_bytes: 1048576\ncontrol:\n  port: 16000\n")
    r = resolve_config(profile, {"control": {"port": 17000}}, env={"KVPUSH_PARAMS_KEY": "s" * 32})
    assert r.source_of("push", "chunk_bytes") == "profile"
    assert r.source_of("control", "port") == "extra"
    assert r.source_of("control", "params_key") == "env"
    assert r.source_of("leases", "permit_ttl_s") == "default"
    assert r.config.control.port == 17000 and r.profile == str(profile)


def test_profile_can_come_from_the_environment() -> None:
    cfg = load_config(None, None, env={"KVPUSH_PROFILE": str(CONFIGS / "efa-p5en.yaml")})
    assert cfg.transport.backend == "LIBFABRIC"


def test_a_new_section_needs_only_a_field_on_the_model() -> None:
    # Room for later sections (e.g. faults): field_rows and the docs walk the model.
    sections = {s for s, _, _ in field_rows()}
    assert sections == set(KvpushConfig.model_fields)
