"""Commit subjects fit 72 characters; the figures go in the body. Checked on the commits made after
BASELINE, the last commit before the check existed: the history before it is published and cannot
be rewritten. Merge commits are left out (git writes their subjects)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from certify.files.paths import project_paths

LIMIT = 72
BASELINE = "96a4a0e97d3b45ca596fd67734cde3a5f152db4c"


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def long_subjects(repo: Path, baseline: str) -> list[str]:
    """'<hash> <subject> (<n> characters)' for each non-merge commit after ``baseline`` on HEAD whose
    subject is over LIMIT characters. Skips the calling test, saying why, where ``repo`` is no git
    checkout or ``baseline`` is absent (a shallow clone, an export without history)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: commit subjects cannot be read")
    if _git(repo, "rev-parse", "--is-inside-work-tree").stdout.strip() != "true":
        pytest.skip(f"{repo} is not a git checkout: commit subjects cannot be read")
    if _git(repo, "cat-file", "-e", f"{baseline}^{{commit}}").returncode != 0:
        pytest.skip(f"the baseline commit {baseline[:12]} is not in this clone (shallow?): the "
                    f"subjects after it cannot be told from those before")
    log = _git(repo, "log", "--no-merges", "--format=%h%x09%s", f"{baseline}..HEAD")
    assert log.returncode == 0, log.stderr
    rows = [line.split("\t", 1) for line in log.stdout.splitlines()]
    return [f"{h} {s} ({len(s)} characters)" for h, s in rows if len(s) > LIMIT]


def test_commit_subjects_after_the_baseline_fit_72_characters():
    long = long_subjects(project_paths().root, BASELINE)
    assert not long, (f"commit subjects over {LIMIT} characters (shorten them, figures in the body; "
                      f"amend before merging):\n" + "\n".join(long))


def _repo(tmp_path: Path, subjects: list[str]) -> list[str]:
    """A repository with one commit a subject; the hashes, oldest first."""
    _git(tmp_path, "init", "-q")
    hashes = []
    for i, subject in enumerate(subjects):
        (tmp_path / "f").write_text(str(i))
        _git(tmp_path, "add", "f")
        done = _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "-m", subject, "-m", "body")
        assert done.returncode == 0, done.stderr
        hashes.append(_git(tmp_path, "rev-parse", "HEAD").stdout.strip())
    return hashes


def test_the_check_names_a_long_subject_after_the_baseline_only(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    long_before, ok, long_after = "x" * (LIMIT + 5), "y" * LIMIT, "z" * (LIMIT + 1)
    hashes = _repo(tmp_path, [long_before, ok, long_after])
    found = long_subjects(tmp_path, hashes[0])
    assert len(found) == 1 and long_after in found[0] and f"({LIMIT + 1} characters)" in found[0]
    assert long_subjects(tmp_path, hashes[2]) == []


def test_the_check_skips_without_the_baseline_or_outside_a_checkout(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    with pytest.raises(pytest.skip.Exception, match="not a git checkout"):
        long_subjects(tmp_path, BASELINE)
    _repo(tmp_path, ["one"])
    with pytest.raises(pytest.skip.Exception, match="not in this clone"):
        long_subjects(tmp_path, BASELINE)
