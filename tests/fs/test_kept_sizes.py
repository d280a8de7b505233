"""Sizes kept, not rendered: every file of a session directory has, at the next stat
after any kind of change, the size its read returns (SPEC: st_size is what a read
gives), although a stat and a listing no longer render the synthetic texts (their
attributes are kept while the session's ``files_version`` holds: issue 10).

Each check lists the directory, stats every file (before any read: an open would
bring nothing up to date that a stat had not), and only then reads each one; a change
whose size the daemon kept stale fails it. The same walk runs over the directories
inside (``t/``, ``staged/``, ``checkpoints/``, ``compactions/``, ...).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from tests.conftest import Daemon, script

# Blocking files, read as they are now (O_NONBLOCK); fifo.out and statewait stat as
# empty and give one value per open, prompt and ctl are write-only (read as empty).
BLOCKING = {"stream", "events"}
ONE_VALUE = {"statewait", "fifo.out"}


def walk(d: Daemon, top: Path) -> dict[str, bytes]:
    """Stat every file under ``top`` (the listings first), then check each size against
    a read; returns what was read (relative path -> bytes)."""
    stats: dict[str, os.stat_result] = {}
    dirs = [top]
    while dirs:
        here = dirs.pop()
        for entry in sorted(os.scandir(here), key=lambda e: e.name):
            path = Path(entry.path)
            st = os.stat(path)
            if entry.is_dir(follow_symlinks=False):
                dirs.append(path)
            else:
                stats[str(path.relative_to(top))] = st
    got = {}
    for rel, st in stats.items():
        name = Path(rel).name
        if name in ONE_VALUE:
            assert st.st_size == 0, rel
            continue
        if name in BLOCKING:
            data = d.snapshot(str((top / rel).relative_to(d.path))).encode()
        else:
            data = (top / rel).read_bytes()
        assert st.st_size == len(data), (rel, st.st_size, len(data), data[-200:])
        got[rel] = data
    return got


def test_every_size_is_right_at_the_next_stat_after_each_kind_of_change(daemon: Daemon) -> None:
    d = daemon
    d.replay.add(
        script(
            '{"reply": "a first answer", "usage": {"prompt_tokens": 100,'
            ' "completion_tokens": 20, "cost": 0.25}}',
            '{"tool_calls": [{"id": "c1", "name": "file_read", "arguments": {"path": "x"}}],'
            ' "usage": {"prompt_tokens": 130, "completion_tokens": 5, "cost": 0.5}}',
            '{"reply": "done reading", "usage": {"prompt_tokens": 150,'
            ' "completion_tokens": 7, "cost": 0.125}}',
            '{"reply": "a child answers", "usage": {"prompt_tokens": 10,'
            ' "completion_tokens": 2, "cost": 1.5}}',
            '{"reply": "this is not json"}',
            '{"reply": "x", "hang": true}',
        )
    )
    sid = d.new(name="k")
    top = d.p(f"s/{sid}")
    seen: list[dict[str, bytes]] = [walk(d, top)]

    def after(change: Callable[[], object], *files: str) -> None:
        """``change``, then the walk; ``files`` must have changed (the change did reach
        them: a walk that compares nothing new proves nothing)."""
        change()
        now = walk(d, d.p(f"s/{name[0]}"))
        for f in files:
            assert now.get(f) != seen[-1].get(f), f
        seen.append(now)

    name = [sid]

    def turn(text: str) -> None:
        d.prompt(name[0], text)
        d.wait_idle(name[0])

    after(lambda: turn("hello"), "chat", "usage", "cost", "context", "offset", "prompt.prev")
    after(lambda: d.write(f"s/{sid}/cfg", "model=a-much-longer-model-name\n"), "cfg", "env")
    after(lambda: d.write(f"s/{sid}/ctl", "tool_load file_read"), "tools")
    after(lambda: turn("read x"), "tcct", "usage", "cost", "taskstate", "ctxsz")
    after(lambda: d.write(f"s/{sid}/plan", "1. read\n2. write\n"), "plan")
    after(lambda: _refused(d, sid), "err")

    # A subagent's cost shows in its parent's cost file, from its birth on.
    after(lambda: d.new(name="k__kid"), "cost")

    def child_turn() -> None:
        d.prompt("k__kid", "help")
        d.wait_idle("k__kid")

    after(child_turn, "cost")

    def compact() -> None:
        d.write(f"s/{sid}/ctl", "compact")
        d.wait_idle(sid)

    after(compact, "context", "compactions/1/summary")

    def rename() -> None:
        d.write(f"s/{sid}/ctl", "rn k2")
        name[0] = "k2"

    after(rename, "env")
    after(lambda: d.write("s/k2/ctl", "fork k3"))
    walk(d, d.p("s/k3"))
    after(lambda: d.write("s/k2/ctl", "clear"), "context")
    # A turn under way: its state, its chat.
    d.prompt("k2", "hang on")
    d.wait_state("k2", "thinking")
    walk(d, d.p("s/k2"))
    d.write("s/k2/ctl", "stop")
    d.wait_idle("k2")
    walk(d, d.p("s/k2"))
    # After a restart: what the daemon keeps is made afresh, from the journal.
    d.stop()
    d.start()
    for s in ("k2", "k3", "k__kid"):
        walk(d, d.p(f"s/{s}"))


def _refused(d: Daemon, sid: str) -> None:
    try:
        d.write(f"s/{sid}/ctl", "no-such-command")
    except OSError:
        pass
