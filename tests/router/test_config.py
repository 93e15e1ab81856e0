"""Router settings from YAML and flags: valid files load, bad ones name the key and value.

Also the CLI's exit status and message on a bad config.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvpush_prod.errors import ConfigError
from kvpush_prod.router import load_settings, main, settings_from_args


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "router.yaml"
    p.write_text(text)
    return p


def test_yaml_loads_backends_overrides_and_knobs(tmp_path):
    p = write(
        tmp_path,
        """
prefill:
  - http://127.0.0.1:8100/
  - url: http://10.0.0.2:8100
    control_host: 10.0.1.2
    control_port: 5601
    engine_id: p2
    tp_size: 2
decode: [http://127.0.0.1:8200]
policy: least_loaded
max_retries: 2
health_interval_s: 0.5
first_byte_timeout_s: null
""",
    )
    s = load_settings(p)
    assert [b.url for b in s.prefill] == ["http://127.0.0.1:8100", "http://10.0.0.2:8100"]
    assert s.prefill[0].full_identity_given is False
    assert s.prefill[1].full_identity_given is True and s.prefill[1].control_port == 5601
    assert s.decode[0].url == "http://127.0.0.1:8200"
    assert (s.policy, s.max_retries, s.health_interval_s) == ("least_loaded", 2, 0.5)
    assert s.first_byte_timeout_s is None


@pytest.mark.parametrize(
    ("yaml_text", "needles"),
    [
        (
            "prefill: [http://a:1]\ndecode: [http://b:2]\npolcy: round_robin\n",
            ["unknown key 'polcy'", "did you mean 'policy'"],
        ),
        (
            "prefill: [{url: http://a:1, control_port: 70000}]\ndecode: [http://b:2]\n",
            ["prefill[0].control_port = 70000", "less than or equal to 65535"],
        ),
        (
            "prefill: [{url: http://a:1, contrl_host: x}]\ndecode: [http://b:2]\n",
            ["unknown key 'prefill[0].contrl_host'", "did you mean 'control_host'"],
        ),
        (
            "prefill: [http://a:1]\ndecode: [localhost:8200]\n",
            ["decode[0].url = 'localhost:8200'", "http(s) base URL"],
        ),
        (
            "prefill: [http://a:1/v1]\ndecode: [http://b:2]\n",
            ["prefill[0].url = 'http://a:1/v1'", "without a path"],
        ),
        ("prefill: [http://a:1]\n", ["decode: missing"]),
        (
            "prefill: [http://a:1]\ndecode: [http://b:2]\npolicy: fastest\n",
            ["policy = 'fastest'", "round_robin", "least_loaded"],
        ),
        (
            "prefill: [http://a:1]\ndecode: [http://b:2]\nhealth_interval_s: 0\n",
            ["health_interval_s = 0", "greater than 0"],
        ),
        (
            "prefill: [http://a:1, http://a:1/]\ndecode: [http://b:2]\n",
            ["prefill[1].url = 'http://a:1' is listed twice"],
        ),
        (
            "prefill: [http://a:1]\ndecode: [http://b:2]\nmax_concurrent_requests: 3000\n",
            [
                "max_concurrent_requests = 3000 needs up to 6000 backend connections",
                "max_connections = 4096",
            ],
        ),
        (
            "prefill: [{url: http://a:1, remote_key: short}]\ndecode: [http://b:2]\n",
            ["prefill[0].remote_key = 'short'", "at least 40 characters"],
        ),
        (
            "prefill: [http://a:1]\ndecode: [http://b:2]\nparams_key: hunter2hunter2hunter2\n",
            ["params_key in", "never read from a config file", "params_key_file"],
        ),
    ],
)
def test_bad_yaml_names_key_and_value(tmp_path, yaml_text, needles):
    p = write(tmp_path, yaml_text)
    with pytest.raises(ConfigError) as e:
        load_settings(p)
    msg = str(e.value)
    assert str(p) in msg
    for n in needles:
        assert n in msg, msg


@pytest.mark.parametrize(
    ("text", "needle"),
    [("- a\n- b\n", "must be a mapping"), ("prefill: [\n", "not valid YAML")],
)
def test_yaml_that_is_not_a_mapping_is_rejected(tmp_path, text, needle):
    with pytest.raises(ConfigError, match=needle):
        load_settings(write(tmp_path, text))


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match="cannot read router config .*nope.yaml"):
        load_settings(tmp_path / "nope.yaml")


def test_flags_override_yaml(tmp_path):
    p = write(tmp_path, "prefill: [http://a:1]\ndecode: [http://b:2]\nport: 9000\n")
    s = settings_from_args(
        ["--config", str(p), "--decode", "http://c:3", "--decode", "http://d:4", "--policy",
         "least_loaded"]
    )  # fmt: skip
    assert [b.url for b in s.prefill] == ["http://a:1"]
    assert [b.url for b in s.decode] == ["http://c:3", "http://d:4"]
    assert (s.port, s.policy) == (9000, "least_loaded")


def test_cli_without_backends_says_which_flags_to_pass():
    with pytest.raises(ConfigError, match="pass --prefill URL and --decode URL"):
        settings_from_args(["--prefill", "http://a:1"])


def test_main_returns_2_and_prints_the_bad_key(tmp_path, capsys):
    p = write(tmp_path, "prefill: [http://a:1]\ndecode: [http://b:2]\nmax_retries: -1\n")
    assert main(["--config", str(p)]) == 2
    err = capsys.readouterr().err
    assert "kvpush router: error:" in err and "max_retries = -1" in err


def test_main_runs_uvicorn_with_the_settings_and_the_limited_protocol(monkeypatch):
    from kvpush_prod.router.server import LimitedHttpProtocol, RouterServer

    seen = {}
    monkeypatch.setattr(RouterServer, "run", lambda self: seen.update(server=self))
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)  # keep pytest's logging
    rc = main(["--prefill", "http://a:1", "--decode", "http://b:2", "--port", "8123",
               "--header-timeout", "3", "--drain-timeout", "7"])  # fmt: skip
    assert rc == 0
    server = seen["server"]
    config = server.config
    assert (config.host, config.port, config.access_log) == ("127.0.0.1", 8123, False)
    assert config.app.state.settings.prefill[0].url == "http://a:1"
    assert issubclass(config.http, LimitedHttpProtocol)
    assert config.http.settings.header_timeout_s == 3.0
    assert config.timeout_keep_alive == 75
    assert server.drain_timeout_s == 7.0
    assert server.admission is config.app.state.admission


# 32 random bytes written in hex, as `openssl rand -hex 32` writes them.
SECRET = "5f0c9a4be1d27386ac4f19e0b7d35a62c8e14f7a093bd6e2518c7fa40be96d13"
BACKENDS = ["--prefill", "http://a:1", "--decode", "http://b:2"]


def secret_file(path: Path, text: str = SECRET + "\n", mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_limits_have_their_defaults_and_flags():
    s = settings_from_args(BACKENDS)
    assert (s.max_body_bytes, s.max_concurrent_requests, s.max_json_depth) == (16 << 20, 1024, 128)
    assert (s.header_timeout_s, s.body_timeout_s, s.client_write_timeout_s) == (10, 30, 30)
    assert (s.drain_timeout_s, s.params_ttl_s, s.params_key) == (25, 120, None)
    s = settings_from_args(
        [
            *BACKENDS,
            "--max-body-bytes",
            "2048",
            "--max-concurrent-requests",
            "8",
            "--body-timeout",
            "5",
            "--params-ttl",
            "30",
        ]
    )
    assert (s.max_body_bytes, s.max_concurrent_requests, s.body_timeout_s) == (2048, 8, 5)
    assert s.params_ttl_s == 30


def test_decode_backends_are_probed_for_their_key_unless_turned_off():
    on = settings_from_args(BACKENDS)
    assert on.probe_decode is True and on.probes_decode is True
    assert settings_from_args([*BACKENDS, "--probe-decode"]).probes_decode is True
    assert settings_from_args([*BACKENDS, "--no-probe-decode"]).probes_decode is False
    # Pull mode names no D to P; vLLM's own connectors have no key to probe.
    assert settings_from_args([*BACKENDS, "--mode", "pull"]).probes_decode is False
    assert settings_from_args([*BACKENDS, "--vllm-push-compat"]).probes_decode is False


def test_the_params_key_comes_from_its_file_and_stays_out_of_repr(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPUSH_PARAMS_KEY", "from-the-environment-but-the-file-wins")
    key = secret_file(tmp_path / "params.key")
    s = settings_from_args([*BACKENDS, "--params-key-file", str(key)])
    assert s.params_key == SECRET.encode()
    assert SECRET not in repr(s) and SECRET not in str(s.model_dump())


def test_the_params_key_comes_from_the_environment_without_a_file(monkeypatch):
    monkeypatch.setenv("KVPUSH_PARAMS_KEY", SECRET)
    assert settings_from_args(BACKENDS).params_key == SECRET.encode()
    monkeypatch.delenv("KVPUSH_PARAMS_KEY")
    assert settings_from_args(BACKENDS).params_key is None


@pytest.mark.parametrize("weak", ["a" * 16, "hunter2hunter2hunter2hunter2hunter2", "ab" * 40])
def test_a_weak_params_key_in_the_environment_is_refused_and_named(monkeypatch, weak):
    monkeypatch.setenv("KVPUSH_PARAMS_KEY", weak)
    with pytest.raises(ConfigError) as e:
        settings_from_args(BACKENDS)
    msg = str(e.value)
    assert "$KVPUSH_PARAMS_KEY" in msg and "openssl rand -hex 32" in msg
    assert weak not in msg  # a key, even a weak one, is never echoed


def test_a_params_key_on_the_command_line_is_refused_without_echoing_it(capsys):
    for argv in (["--params-key", SECRET], [f"--params-key={SECRET}"]):
        assert main([*BACKENDS, *argv]) == 2
        err = capsys.readouterr().err
        assert "--params-key is not accepted" in err and "--params-key-file" in err
        assert SECRET not in err


@pytest.mark.parametrize(
    ("content", "mode", "needles"),
    [
        (None, 0o600, ["cannot read the params key file", "--params-key-file"]),
        ("\n", 0o600, ["holds 0 bytes", "at least 32 random bytes", "openssl rand -hex 32"]),
        ("short", 0o600, ["holds 5 bytes", "openssl rand -hex 32"]),
        ("a" * 64 + "\n", 0o600, ["not random", "openssl rand -hex 32"]),
        ("0123456789abcdef" * 2, 0o600, ["holds 16 bytes", "at least 32"]),
        (SECRET + "\n", 0o644, ["mode 0644", "chmod 600"]),
        (SECRET + "\n", 0o666, ["mode 0666", "chmod 600"]),
    ],
)
def test_a_bad_params_key_file_is_named_with_the_fix(tmp_path, content, mode, needles):
    key = tmp_path / "params.key"
    if content is not None:
        secret_file(key, content, mode)
    with pytest.raises(ConfigError) as e:
        settings_from_args([*BACKENDS, "--params-key-file", str(key)])
    msg = str(e.value)
    assert str(key) in msg
    for needle in needles:
        assert needle in msg, msg


def test_the_admin_token_is_read_apart_from_the_params_key(tmp_path):
    # Not a params key: readable by the operators' group, 16 bytes are enough.
    token = secret_file(tmp_path / "admin.token", "t" * 16 + "\n", 0o640)
    s = settings_from_args([*BACKENDS, "--admin-token-file", str(token)])
    assert s.admin_token == b"t" * 16 and s.params_key is None
    short = secret_file(tmp_path / "short.token", "t" * 8, 0o600)
    with pytest.raises(ConfigError, match="admin token in .*short.token.* is 8 bytes"):
        settings_from_args([*BACKENDS, "--admin-token-file", str(short)])


def test_vllm_push_compat_with_a_params_key_is_refused(tmp_path):
    key = secret_file(tmp_path / "params.key")
    with pytest.raises(ConfigError, match="vllm_push_compat .* with a params key"):
        settings_from_args([*BACKENDS, "--vllm-push-compat", "--params-key-file", str(key)])


# -- TLS to the engines ----------------------------------------------------------------------


def test_tls_flags_load_and_a_plain_http_backend_beside_a_ca_is_refused(tmp_path):
    from tests.router.tls import make_pki

    pki = make_pki(tmp_path)
    s = settings_from_args(
        [
            "--prefill",
            "https://127.0.0.1:1",
            "--decode",
            "https://localhost:2",
            "--backend-ca-file",
            str(pki.ca),
            "--backend-client-cert-file",
            str(pki.client_cert),
            "--backend-client-key-file",
            str(pki.client_key),
        ]
    )
    assert (s.backend_ca_file, s.backend_client_cert_file) == (str(pki.ca), str(pki.client_cert))
    with pytest.raises(ConfigError) as e:
        settings_from_args([*BACKENDS, "--backend-ca-file", str(pki.ca)])
    assert "prefill[0].url = 'http://a:1'" in str(e.value) and "use https://" in str(e.value)


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (
            ["--backend-ca-file", "{missing}"],
            ["backend_ca_file", "missing.pem", "No such file", "--backend-ca-file"],
        ),
        (["--backend-ca-file", "{not_pem}"], ["backend_ca_file", "not.pem", "PEM certificate"]),
        (["--backend-client-cert-file", "{cert}"], ["backend_client_key_file is not", "set both"]),
        (
            ["--backend-client-cert-file", "{cert}", "--backend-client-key-file", "{ca_key}"],
            ["backend_client_cert_file", "cannot be used", "its unencrypted PEM key"],
        ),
    ],
)
def test_unusable_tls_files_are_named_at_start(tmp_path, flags, needles):
    from tests.router.tls import make_pki

    pki = make_pki(tmp_path)
    (tmp_path / "not.pem").write_text("not a certificate\n")
    paths = {
        "missing": tmp_path / "missing.pem",
        "not_pem": tmp_path / "not.pem",
        "cert": pki.client_cert,
        "ca_key": pki.ca_key,
    }
    argv = [
        "--prefill",
        "https://a:1",
        "--decode",
        "https://b:2",
        *(f.format(**paths) for f in flags),
    ]
    with pytest.raises(ConfigError) as e:
        settings_from_args(argv)
    for needle in needles:
        assert needle in str(e.value), str(e.value)
