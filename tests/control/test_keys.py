"""Key files: generated pairs load back, and every unusable file is a ConfigError with a fix."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zmq

from kvpush_prod.control import keys
from kvpush_prod.errors import ConfigError


def test_generated_pair_loads_back_with_its_name_and_a_private_secret(tmp_path: Path) -> None:
    public, secret = keys.generate("prefill-0", tmp_path)
    assert (public.name, secret.name) == ("prefill-0.key", "prefill-0.key_secret")
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    pair = keys.load_keypair(secret)
    assert pair.name == "prefill-0"
    assert len(pair.public) == 40
    assert zmq.curve_public(pair.secret) == pair.public
    assert keys.load_allowed(public) == {pair.public: "prefill-0"}
    assert list(tmp_path.iterdir()) != [] and not any(
        p.name.startswith(".kvpush-keys-") for p in tmp_path.iterdir()
    )


def test_key_pair_repr_never_shows_the_secret(tmp_path: Path) -> None:
    pair = keys.load_keypair(keys.generate("d0", tmp_path)[1])
    assert pair.secret.decode() not in repr(pair)


def test_generate_refuses_to_replace_a_key_pair_unless_forced(tmp_path: Path) -> None:
    _, secret = keys.generate("d0", tmp_path)
    before = keys.load_keypair(secret)
    with pytest.raises(ConfigError, match=r"d0\.key.*already exists.*--force"):
        keys.generate("d0", tmp_path)
    assert keys.load_keypair(secret) == before
    keys.generate("d0", tmp_path, force=True)
    assert keys.load_keypair(secret).public != before.public


@pytest.mark.parametrize("name", ["", "a b", "../x", "x/y", ".hidden", "-dash", "n" * 65, "é"])
def test_generate_refuses_a_bad_name(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match="key name"):
        keys.generate(name, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_loading_a_missing_key_file_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.key_secret: no such key file.*kvpush keys"):
        keys.load_keypair(tmp_path / "nope.key_secret")


def test_loading_the_public_file_as_key_file_names_the_secret_one(tmp_path: Path) -> None:
    public, secret = keys.generate("p1", tmp_path)
    with pytest.raises(ConfigError) as info:
        keys.load_keypair(public)
    assert "only a public key" in str(info.value)
    assert f"use {secret}" in str(info.value)


@pytest.mark.parametrize(
    "text",
    [
        "just some text\n",
        'curve\n    public-key = "short"\n',
        'curve\n    public-key = "' + "\x7f" * 40 + '"\n',
    ],
)
def test_a_corrupt_key_file_is_refused(tmp_path: Path, text: str) -> None:
    bad = tmp_path / "bad.key_secret"
    bad.write_text(text)
    with pytest.raises(ConfigError, match=r"bad\.key_secret"):
        keys.load_keypair(bad)


def test_a_secret_that_does_not_match_its_public_key_is_refused(tmp_path: Path) -> None:
    _, secret = keys.generate("a", tmp_path)
    other = zmq.curve_keypair()[0].decode()
    text = secret.read_text()
    pub = keys.load_keypair(secret).public.decode()
    secret.write_text(text.replace(pub, other))
    with pytest.raises(ConfigError, match="does not belong"):
        keys.load_keypair(secret)


def test_allow_list_directory_holds_every_public_key_and_ignores_secrets(tmp_path: Path) -> None:
    pairs = [keys.load_keypair(keys.generate(n, tmp_path)[1]) for n in ("p0", "p1", "d0")]
    assert keys.load_allowed(tmp_path) == {p.public: p.name for p in pairs}


def test_allow_list_name_comes_from_metadata_then_file_stem(tmp_path: Path) -> None:
    public, _ = keys.generate("decode-3", tmp_path / "gen")
    pair = keys.load_keypair(tmp_path / "gen" / "decode-3.key_secret")
    renamed = tmp_path / "list" / "whatever.key"
    renamed.parent.mkdir()
    renamed.write_text(public.read_text())
    assert keys.load_allowed(renamed.parent) == {pair.public: "decode-3"}
    bare = tmp_path / "bare" / "engine-7.key"
    bare.parent.mkdir()
    bare.write_text(f'curve\n    public-key = "{pair.public.decode()}"\n')
    assert keys.load_allowed(bare) == {pair.public: "engine-7"}


def test_allow_list_errors_name_the_path_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing: no such allow-list.*\.key"):
        keys.load_allowed(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"empty: no public certificates"):
        keys.load_allowed(empty)
    keys.generate("only", tmp_path / "secrets")
    (tmp_path / "secrets" / "only.key").unlink()
    with pytest.raises(ConfigError, match=r"only \.key_secret files"):
        keys.load_allowed(tmp_path / "secrets")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "x.key").write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"x\.key: no public-key"):
        keys.load_allowed(corrupt)


def test_allow_list_refuses_a_secret_key_in_it(tmp_path: Path) -> None:
    _, secret = keys.generate("p0", tmp_path)
    leaked = tmp_path / "list" / "p0.key"
    leaked.parent.mkdir()
    leaked.write_text(secret.read_text())
    with pytest.raises(ConfigError, match="holds a secret key"):
        keys.load_allowed(leaked.parent)


def test_allow_list_refuses_two_names_for_one_key(tmp_path: Path) -> None:
    public, _ = keys.generate("p0", tmp_path / "gen")
    listdir = tmp_path / "list"
    listdir.mkdir()
    text = public.read_text()
    (listdir / "p0.key").write_text(text)
    (listdir / "alias.key").write_text(text.replace("name = p0", "name = alias"))
    with pytest.raises(ConfigError, match="one key, one name"):
        keys.load_allowed(listdir)
    # The same key under the same name twice is harmless.
    (listdir / "alias.key").write_text(text)
    assert list(keys.load_allowed(listdir).values()) == ["p0"]


def test_fingerprint_is_short_stable_and_differs_per_key() -> None:
    a, b = zmq.curve_keypair()[0], zmq.curve_keypair()[0]
    assert keys.fingerprint(a) == keys.fingerprint(a.decode())
    assert len(keys.fingerprint(a)) == 16
    int(keys.fingerprint(a), 16)
    assert keys.fingerprint(a) != keys.fingerprint(b)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_secret_key_file_others_may_read_is_refused_naming_the_fix(
    tmp_path: Path, mode: int
) -> None:
    _, secret = keys.generate("decode-0", tmp_path)
    secret.chmod(mode)
    with pytest.raises(ConfigError, match=f"mode {mode:04o}.*chmod 600") as info:
        keys.load_keypair(secret)
    assert str(secret) in str(info.value)
    secret.chmod(0o400)
    assert keys.load_keypair(secret).name == "decode-0"
