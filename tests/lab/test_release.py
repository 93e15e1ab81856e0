"""The previous release for rolling-upgrade tests: found by its tag, else by its recorded
commit, else a failure that says how to fetch it; engines of it import it, not this tree."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvpush_prod.lab import release
from kvpush_prod.lab.launch import EngineSpec, engine_env


def git_repo(path: Path) -> str:
    def git(*args: str) -> str:
        out = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    path.mkdir()
    git("init", "-q")
    (path / "f").write_text("x")
    git("add", "f")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return git("rev-parse", "HEAD")


def test_the_previous_release_is_found_by_its_tag_else_by_its_commit(tmp_path: Path) -> None:
    head = git_repo(tmp_path / "r")
    assert release.find_previous(tmp_path / "r", "v9.9.9", head) == head
    subprocess.run(["git", "-C", str(tmp_path / "r"), "tag", "v9.9.9"], check=True)
    assert release.find_previous(tmp_path / "r", "v9.9.9", "0" * 40) == head


def test_a_clone_without_the_previous_release_fails_saying_how_to_fetch_it(
    tmp_path: Path,
) -> None:
    git_repo(tmp_path / "r")
    with pytest.raises(release.ReleaseMissing) as info:
        release.find_previous(tmp_path / "r", "v9.9.9", "0" * 40)
    assert "git fetch origin tag v9.9.9" in str(info.value)
    assert "--unshallow" in str(info.value)


def test_an_engine_of_another_release_has_only_that_release_on_its_path() -> None:
    spec = EngineSpec("p", "m", 1, release="/opt/old-site", env={"PYTHONPATH": "/src"})
    assert engine_env(spec)["PYTHONPATH"] == "/opt/old-site"
    assert engine_env(EngineSpec("p", "m", 1, env={"PYTHONPATH": "/src"}))["PYTHONPATH"] == "/src"
