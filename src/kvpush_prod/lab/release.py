"""The previous kvpush-prod release, for rolling-upgrade tests: found in this clone's git
history (its tag, else its recorded commit) and installed apart, so an engine can run it.

Installed with this interpreter's pip from the tag's tree (``git archive``), without
dependencies and offline, into a directory of its own (``pip install --target``): an engine
started with that directory alone on its PYTHONPATH imports the old kvpush_prod and this
interpreter's vLLM and NIXL (``EngineSpec.release``). Nothing is downloaded.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvpush_prod.errors import KvpushError

# The release before this one: its tag and, should the tag be missing, its commit.
PREVIOUS_TAG = "v0.1.0"
PREVIOUS_COMMIT = "1f1b8013ce0019f3df90f0446b2335443e2307c5"


class ReleaseMissing(KvpushError):
    """The previous release is not in this clone (a shallow clone, or tags not fetched)."""


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, check=False)


def find_previous(repo: Path, tag: str = PREVIOUS_TAG, commit: str = PREVIOUS_COMMIT) -> str:
    """The commit of the previous release in ``repo``: its tag's, else ``commit`` when the
    clone has it; ReleaseMissing saying how to fetch it otherwise."""
    for ref in (tag, commit):
        found = _git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
        if found.returncode == 0:
            return found.stdout.decode().strip()
    raise ReleaseMissing(
        f"the previous release ({tag}, commit {commit[:12]}) is not in the clone at {repo}: "
        f"fetch it with `git fetch origin tag {tag}` (or `git fetch --unshallow --tags` in a "
        "shallow CI clone); the rolling-upgrade test runs engines of that release"
    )


def install(repo: Path, commit: str, dest: Path) -> Path:
    """``commit``'s kvpush-prod installed under ``dest`` (reused when already there); the
    directory to put on an engine's PYTHONPATH."""
    site = dest / f"site-{commit[:12]}"
    if (site / "kvpush_prod" / "__init__.py").is_file():
        return site
    src = dest / f"src-{commit[:12]}"
    src.mkdir(parents=True, exist_ok=True)
    archive = dest / f"{commit[:12]}.tar"
    tree = _git(repo, "archive", "--format=tar", "-o", str(archive), commit)
    if tree.returncode != 0:
        raise ReleaseMissing(f"git archive {commit} failed: {tree.stderr.decode()[-500:]}")
    subprocess.run(["tar", "-xf", str(archive), "-C", str(src)], check=True)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "--target", str(site), str(src)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"installing kvpush-prod {commit[:12]} into {site} failed: {done.stderr[-2000:]}"
        )
    return site


def imported_from(site: Path) -> str:
    """Where an interpreter with ``site`` on its PYTHONPATH imports kvpush_prod from (a
    probe: it must be under ``site``)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import kvpush_prod; print(kvpush_prod.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        cwd=site,
    )
    return probe.stdout.strip()
