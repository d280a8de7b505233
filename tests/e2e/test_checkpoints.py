"""Checkpoints end to end: every tool call and ``!cmd`` captured through toolsrv's
overlay, shown under ``s/<id>/checkpoints/``, undone by ``ctl rewind``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.conftest import Daemon


def call(name: str, args: dict[str, Any], cid: str) -> dict[str, Any]:
    return {"name": name, "arguments": args, "id": cid}


def records(daemon: Daemon) -> list[dict[str, Any]]:
    root = daemon.home / "state" / "checkpoints"
    return [json.loads(p.read_text()) for p in sorted(root.glob("*/rec/*.json"))]


def test_bang_command_is_captured(daemon: Daemon) -> None:
    w: Path = daemon.work
    (w / "keep.txt").write_text("old\n")
    (w / "gone.txt").write_text("bye\n")
    (w / "moved.txt").write_text("travels\n")
    sid = daemon.new(name="cp")
    daemon.prompt(
        sid,
        "!echo new > keep.txt; rm gone.txt; mv moved.txt there.txt; echo hi > added.txt",
    )
    daemon.wait_idle(sid)
    assert (w / "keep.txt").read_text() == "new\n"
    assert not (w / "gone.txt").exists()
    assert (w / "there.txt").read_text() == "travels\n"
    recs = records(daemon)
    assert len(recs) == 1
    ops = {c["path"]: c for c in recs[0]["changes"]}
    print(recs)
    assert set(ops) == {"keep.txt", "gone.txt", "there.txt", "added.txt"}
