"""The man pages: ``mandoc -T lint`` clean, and complete against what they document.

ollie(1) must name every subcommand and flag of the ``ollie`` parser; ollie(5) must have
an entry for every file and directory a live mount shows. Both are checked against the
real thing, so a new flag or a new file of the tree fails here until it is documented.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from olliefs.cli import parser
from olliefs.testing import Daemon

MAN = Path(__file__).parents[1] / "man"
PAGES = sorted(MAN.glob("*.[1-8]"))


def test_there_are_pages() -> None:
    assert {p.name for p in PAGES} >= {"ollie.1", "ollie.5", "toolsrv.8"}


@pytest.mark.skipif(shutil.which("mandoc") is None, reason="mandoc is not installed")
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_mandoc_lint_is_clean(page: Path) -> None:
    """Every message level, style included (lines over 80 bytes, sentence breaks...)."""
    r = subprocess.run(["mandoc", "-T", "lint", str(page)], capture_output=True, text=True)
    assert (r.returncode, r.stdout + r.stderr) == (0, "")


def _text(page: str) -> str:
    """The roff source with its escapes for - undone, enough to find names in."""
    return (MAN / page).read_text().replace("\\-", "-").replace("\\&", "")


def test_ollie_1_names_every_subcommand_and_flag() -> None:
    text = _text("ollie.1")
    ap = parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    for name, subparser in sub.choices.items():
        assert re.search(rf"^\.B ollie {re.escape(name)}\b", text, re.M), name
        for action in subparser._actions:
            if action.help == argparse.SUPPRESS:
                continue
            for flag in action.option_strings:
                assert flag in text, f"ollie {name} {flag}"


# The placeholder ollie(5) uses for the files of each folder on disk (generated ones and
# u/complete are named as they are).
FOLDER_FILES = {"a": "NAME.json", "m": "NAME", "mcp": "NAME.json", "p": "NAME",
                "sk": "NAME.md", "t": "TOOL", "tmp": "PATH", "tr": "STAMP-ID.md", "u": "NAME",
                "x": "NAME"}  # fmt: skip


def _doc_name(rel: Path, sessions: set[str]) -> str:
    """The name ollie(5) uses for a path of the tree: s/ID/..., peer/NAME, t/TOOL, K."""
    parts = list(rel.parts)
    if parts[0] == "s" and len(parts) > 1 and parts[1] in sessions:
        parts[1] = "ID"
        if len(parts) > 3 and parts[2] == "peer":
            parts[3] = "NAME"
        if len(parts) > 3 and parts[2] == "branches":
            parts[3] = "K"
        if len(parts) > 3 and parts[2] == "t" and parts[3] != "idx":
            parts[3] = "TOOL"
    if parts[0] in FOLDER_FILES and len(parts) > 1 and parts[1] != "idx":
        if "/".join(parts[:2]) != "u/complete":
            parts[1:] = [FOLDER_FILES[parts[0]]]
    return "/".join(parts)


def _bold(text: str) -> set[str]:
    """The words set in bold by ``.B`` lines, and by the odd arguments of ``.BR`` lines."""
    out: set[str] = set()
    for macro, args in re.findall(r"^\.(BR?) (.*)$", text, re.M):
        try:
            words = shlex.split(args)
        except ValueError:
            continue
        out.update(words if macro == "B" else words[::2])
    return out


def test_ollie_5_has_an_entry_for_every_file_of_the_tree(daemon: Daemon) -> None:
    for name in ("a", "a__b"):  # a child, so that peer/ holds a file
        with open(daemon.path / "s" / "new", "w") as f:
            f.write(f"name={name} cwd={daemon.work}")
    for folder in ("m", "tmp"):  # a file in each folder, so that its entry is looked for
        (daemon.path / folder / "note").write_text("x\n")
    x = daemon.home / "config" / "scripts" / "x"
    x.mkdir(parents=True)
    (x / "hello").write_text("#!/bin/sh\necho hello\n")
    sessions = {"a", "a__b"}
    documented = _bold(_text("ollie.5"))
    missing = set()
    for top, dirs, files in os.walk(daemon.path):  # names only: no file is read
        for entry in dirs:
            rel = (Path(top) / entry).relative_to(daemon.path)
            if _doc_name(rel, sessions) + "/" not in documented:
                missing.add(_doc_name(rel, sessions) + "/")
        for entry in files:
            rel = (Path(top) / entry).relative_to(daemon.path)
            if _doc_name(rel, sessions) not in documented:
                missing.add(_doc_name(rel, sessions))
    missing.discard("s/ID/")  # the session directory: described under s/ and in SYNOPSIS
    assert not missing, f"not in ollie(5): {sorted(missing)}"


def test_ollie_5_names_each_file_once() -> None:
    """One entry per file in THE WHOLE TREE (two helpers documenting the same new file
    in parallel once left two, saying different things)."""
    text = _text("ollie.5")
    start = text.index(".SH THE WHOLE TREE")
    section = text[start : text.index("\n.SH ", start + 1)]
    names = re.findall(r"^\.TP\n\.BR? (\S+)", section, re.M)
    assert len(names) > 40
    assert sorted({n for n in names if names.count(n) > 1}) == []
