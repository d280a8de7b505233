"""The cached scan of protected names (real directories; no mocks)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from toolsrv.protect import ProtectedScan

modes = pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "mtimes"])


def make(root: Path, *dirs: str) -> None:
    for d in dirs:
        (root / d).mkdir(parents=True, exist_ok=True)


def age(*paths: Path) -> None:
    """Date directories back a minute: a fresh mtime is never trusted (coarse clocks)."""
    for p in paths:
        for d in [p, *(q for q in p.rglob("*") if q.is_dir() and not q.is_symlink())]:
            os.utime(d, (1e9, 1e9), follow_symlinks=False)


@modes
def test_finds_every_depth_and_follows_changes(tmp_path: Path, inotify: bool) -> None:
    root = tmp_path / "r"
    make(root, ".git/hooks", "a/b/c/.git", "a/.ollie", "x/y", "node/pkg")
    (root / "wt").mkdir()
    (root / "wt" / ".git").write_text("gitdir: ../.git\n")
    age(root)
    scan = ProtectedScan(inotify=inotify)
    r = str(root)
    want = {f"{r}/.git", f"{r}/a/b/c/.git", f"{r}/a/.ollie", f"{r}/wt/.git"}
    assert set(scan.find([r])) == want
    listed = scan.listed
    assert set(scan.find([r])) == want and scan.listed == listed  # nothing listed again
    # With inotify, not even a stat per directory.
    assert scan.stats == (0 if inotify else 9)  # r, a, a/b, a/b/c, x, x/y, node, node/pkg, wt
    # A repository appears deep down: only the directory that changed is listed again.
    make(root, "x/y/new/.git")
    found = set(scan.find([r]))
    assert found == want | {f"{r}/x/y/new/.git"}
    assert scan.listed - listed == 2  # x/y (changed) and x/y/new (new)
    # A subtree goes away with its .git.
    os.rename(root / "a" / "b", tmp_path / "b-moved")
    assert set(scan.find([r])) == (want - {f"{r}/a/b/c/.git"}) | {f"{r}/x/y/new/.git"}
    # A directory moved within the tree is found at its new place.
    os.rename(root / "x" / "y", root / "y2")
    assert f"{r}/y2/new/.git" in scan.find([r])
    make(root, "y2/new/z/.ollie")
    assert f"{r}/y2/new/z/.ollie" in scan.find([r])
    scan.close()


@modes
def test_a_symlinked_entry_is_its_target_inside_the_roots(tmp_path: Path, inotify: bool) -> None:
    root = tmp_path / "r"
    make(root, "evil/hooks", "repo", "other")
    (root / "repo" / ".git").symlink_to("../evil")
    (root / "other" / ".git").symlink_to("/etc")  # outside: read-only anyway
    assert ProtectedScan(inotify=inotify).find([str(root)]) == [str(root / "evil")]


def test_a_fresh_directory_is_listed_again(tmp_path: Path) -> None:
    """By mtimes, a directory changed within the clock's granularity after the scan read
    its mtime would look unchanged: one modified in the last 100 ms is listed again."""
    root = tmp_path / "r"
    make(root, "a")
    before = os.stat(root / "a").st_mtime_ns
    scan = ProtectedScan(inotify=False)
    assert scan.find([str(root)]) == []
    (root / "a" / ".git").mkdir()
    os.utime(root / "a", ns=(before, before))  # as if the clock had not ticked meanwhile
    assert scan.find([str(root)]) == [str(root / "a" / ".git")]
