"""Transcripts never replace one another: ``persist.keep_as`` picks a free name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from olliefs.session import persist


def test_a_taken_name_gets_the_next_number(tmp_path: Path) -> None:
    tr = tmp_path / "tr"
    tr.mkdir()
    kept = []
    for i in range(3):
        src = tmp_path / f"j{i}"
        src.write_text(f"journal {i}\n")
        kept.append(persist.keep_as(src, tr, "20261204T045101", "c5", ".jsonl"))
        assert not src.exists()
    assert [p.name for p in kept] == [
        "20261204T045101-c5.jsonl",
        "20261204T045101.2-c5.jsonl",
        "20261204T045101.3-c5.jsonl",
    ]
    assert [p.read_text() for p in kept] == [f"journal {i}\n" for i in range(3)]
    # The number sits in the stamp: the name still ends in -ID.EXT and sorts by time.
    assert sorted(os.listdir(tr)) == [p.name for p in kept]


def test_rename_noreplace_refuses_and_leaves_both(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("a")
    b.write_text("b")
    with pytest.raises(FileExistsError):
        persist.rename_noreplace(a, b)
    assert (a.read_text(), b.read_text()) == ("a", "b")
    persist.rename_noreplace(a, tmp_path / "c")
    assert not a.exists() and (tmp_path / "c").read_text() == "a"


def test_a_missing_source_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        persist.rename_noreplace(tmp_path / "none", tmp_path / "x")
