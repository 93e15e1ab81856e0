"""``kvpush keys``: generate, list, check; exit 0 when fine, 2 with the reason otherwise."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvpush_prod import cli
from kvpush_prod.control import keys


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["keys", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_usage_lists_the_keys_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 0
    assert "keys" in capsys.readouterr().out


def test_generate_writes_each_pair_and_says_where_the_files_go(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = run(capsys, "generate", "prefill-0", "decode-0", "--dir", str(tmp_path))
    assert rc == 0
    for name in ("prefill-0", "decode-0"):
        assert str(tmp_path / f"{name}.key") in out
        assert str(tmp_path / f"{name}.key_secret") in out
        assert stat.S_IMODE(os.stat(tmp_path / f"{name}.key_secret").st_mode) == 0o600
    assert "stays on its engine" in out and "allow-list" in out
    assert sorted(keys.load_allowed(tmp_path).values()) == ["decode-0", "prefill-0"]


def test_generate_writes_nothing_when_one_name_is_bad_or_taken(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = run(capsys, "generate", "good", "bad name", "--dir", str(tmp_path))
    assert rc == 2 and "bad name" in err
    assert list(tmp_path.iterdir()) == []
    run(capsys, "generate", "taken", "--dir", str(tmp_path))
    before = (tmp_path / "taken.key").read_text()
    rc, _, err = run(capsys, "generate", "new", "taken", "--dir", str(tmp_path))
    assert rc == 2 and "taken.key" in err and "--force" in err
    assert not (tmp_path / "new.key").exists()
    rc, _, _ = run(capsys, "generate", "taken", "--dir", str(tmp_path), "--force")
    assert rc == 0 and (tmp_path / "taken.key").read_text() != before


def test_list_shows_name_fingerprint_key_and_whether_the_secret_is_beside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(capsys, "generate", "p0", "d0", "--dir", str(tmp_path))
    (tmp_path / "d0.key_secret").unlink()
    p0 = keys.load_keypair(tmp_path / "p0.key_secret")
    d0 = keys.load_allowed(tmp_path / "d0.key")
    rc, out, _ = run(capsys, "list", str(tmp_path))
    assert rc == 0
    lines = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert lines["p0"] == ["p0", keys.fingerprint(p0.public), p0.public.decode(), "yes"]
    ((d0_key, _),) = d0.items()
    assert lines["d0"] == ["d0", keys.fingerprint(d0_key), d0_key.decode(), "no"]


def test_list_reports_a_bad_file_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(capsys, "generate", "p0", "--dir", str(tmp_path))
    (tmp_path / "broken.key").write_text("garbage\n")
    rc, out, err = run(capsys, "list", str(tmp_path))
    assert rc == 2
    assert "broken.key" in err
    assert "p0" in out
    rc, _, err = run(capsys, "list", str(tmp_path / "nowhere"))
    assert rc == 2 and "not a directory" in err


def test_check_passes_for_a_listed_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(capsys, "generate", "p0", "--dir", str(tmp_path))
    rc, out, _ = run(
        capsys, "check", "--key-file", str(tmp_path / "p0.key_secret"), "--allowed", str(tmp_path)
    )
    assert rc == 0 and out.startswith("ok:")


def test_check_fails_with_the_reason_for_an_unlisted_key_or_a_bad_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(capsys, "generate", "p0", "--dir", str(tmp_path / "engine"))
    run(capsys, "generate", "d0", "--dir", str(tmp_path / "list"))
    rc, _, err = run(
        capsys,
        "check",
        "--key-file",
        str(tmp_path / "engine" / "p0.key_secret"),
        "--allowed",
        str(tmp_path / "list"),
    )
    assert rc == 2 and "not in the allow-list" in err and "p0.key" in err
    rc, _, err = run(
        capsys,
        "check",
        "--key-file",
        str(tmp_path / "engine" / "p0.key"),
        "--allowed",
        str(tmp_path / "list"),
    )
    assert rc == 2 and "p0.key_secret" in err
    rc, _, err = run(
        capsys,
        "check",
        "--key-file",
        str(tmp_path / "engine" / "p0.key_secret"),
        "--allowed",
        str(tmp_path / "missing"),
    )
    assert rc == 2 and "no such allow-list" in err


def test_bad_usage_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["keys", "generate", "p0"])  # --dir missing
    assert info.value.code == 2
