"""The pure parts of the tree's sandbox rules: the path walk that never enters a tree,
and what a tool header asks for (olliefs.mounts.real_dir, olliefs.caller.tool_guard)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from olliefs.caller import tool_guard, tool_profiles
from olliefs.fs.disk import GUARDED_HEAD
from olliefs.mounts import FSTYPE, InsideTree, Mount, real_dir
from toolsrv.registry import HEADER_LIMIT


def _table(tree: Path) -> list[Mount]:
    # A plain directory stands for the tree: the walk must refuse it without a look
    # inside, which the unreadable mode would turn into EACCES if it did look.
    return [Mount("/", "ext4", "/dev/root", "rw"), Mount(str(tree), FSTYPE, "olliefs", "rw")]


def test_real_dir_never_enters_a_tree(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "m").mkdir(parents=True)
    table = _table(tree)
    (tmp_path / "abs").symlink_to(tree / "m")
    (tmp_path / "rel").symlink_to("tree/m")
    (tmp_path / "chain").symlink_to("abs")
    (tmp_path / "up").mkdir()
    for path in (tree, tree / "m", tmp_path / "abs", tmp_path / "rel", tmp_path / "chain"):
        with pytest.raises(InsideTree):
            real_dir(str(path), table)
    # ".." after a symlink climbs from where the link led (into the tree), as the kernel.
    for text in (f"{tmp_path}/up/../tree", f"{tmp_path}/chain/..", f"{tmp_path}/abs/../../up"):
        with pytest.raises(InsideTree):
            real_dir(text, table)
    assert real_dir(f"{tmp_path}/up/../up", table) == str(tmp_path / "up")


def test_real_dir_resolves_like_the_kernel(tmp_path: Path) -> None:
    table = _table(tmp_path / "elsewhere")
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "f").write_text("x")
    (tmp_path / "ln").symlink_to("d/e")
    (tmp_path / "loop").symlink_to("loop")
    assert real_dir(f"{tmp_path}/ln/", table) == os.path.realpath(tmp_path / "d" / "e")
    assert real_dir(f"{tmp_path}/./d//e/../e", table) == str(tmp_path / "d" / "e")
    for path, code in (
        (tmp_path / "f", errno.ENOTDIR),
        (tmp_path / "f" / "x", errno.ENOTDIR),
        (tmp_path / "none", errno.ENOENT),
        (tmp_path / "loop", errno.ELOOP),
    ):
        with pytest.raises(OSError) as got:
            real_dir(str(path), table)
        assert got.value.errno == code, path
    with pytest.raises(OSError):
        real_dir("relative/path", table)


TOOL = b'#!/bin/sh\n# ollie-tool\n# description: x\n# args: {"type": "object"}\n'


def test_tool_guard_reads_every_line_shaped_like_a_sandbox_entry() -> None:
    assert tool_guard(TOOL) is None
    assert tool_guard(TOOL + b"# sandbox: default\n") is None
    assert tool_guard(TOOL + b"-- sandbox: ollie\r\n") is None
    for wide in (b"# sandbox: network\n", b"//sandbox:unsandboxed", b"# sandbox: networkx"):
        assert tool_guard(TOOL + wide) is not None, wide
    # Past the header, where toolsrv would not look, still counts: no edit of the lines
    # above can then pull it into the header unseen.
    assert tool_profiles(TOOL + b"echo\n# sandbox: network\n") == ["network"]


def test_the_guard_sees_what_toolsrv_reads() -> None:
    assert GUARDED_HEAD == HEADER_LIMIT + 1
