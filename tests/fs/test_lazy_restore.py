"""Saved sessions listed before their journals are read, each restored at its first use
(issue 10: mount-to-usable; ``olliefs.session.index``).

A clean stop writes the index of the sessions idle at rest; the next start lists them
from it and reads a journal only when its session is looked into. Checked here: the
listing, ``s/idx`` and the cost of a parent are what they were, with no session
restored; a session first touched after the restart is exactly the one before (chat,
events, state, usage, cost, cfg) and works on (a prompt, a rename); and the journal is
the record: after a crash (no index) and for a journal changed behind its entry, the
journal is read at the start.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import py9p

from olliefs.testing import Daemon
from tests.conftest import script
from tests.e2e.test_export9p import exported, py9p_listing, py9p_read_all, wait_left_clean
from tests.fs.test_load import debug_counts

FILES = ("chat", "state", "usage", "cost", "cfg", "env", "context", "tcct", "prompt.prev")


def saved(d: Daemon) -> dict[str, str]:
    """A few sessions with a history: a parent with a turn, a child with its cost, one
    with another model, and idle ones."""
    d.replay.add(
        script(
            '{"reply": "parent answers", "usage": {"prompt_tokens": 10,'
            ' "completion_tokens": 2, "cost": 0.25}}',
            '{"reply": "child answers", "usage": {"prompt_tokens": 7,'
            ' "completion_tokens": 1, "cost": 1.5}}',
        )
    )
    d.new(name="p")
    d.prompt("p", "hello")
    d.wait_idle("p")
    d.new(name="p__c")
    d.prompt("p__c", "help")
    d.wait_idle("p__c")
    d.new(name="m")
    d.write("s/m/cfg", "model=another-model\n")
    for i in range(20):
        d.new(name=f"idle{i:02d}")
    return view(d)


def view(d: Daemon) -> dict[str, str]:
    """What a user sees of all sessions without looking into them, and of ``p``."""
    out = {"s/": "\n".join(sorted(os.listdir(d.p("s")))), "s/idx": d.read("s/idx")}
    for sid in ("p", "p__c", "m"):
        for f in FILES:
            out[f"{sid}/{f}"] = d.read(f"s/{sid}/{f}")
        out[f"{sid}/events"] = d.snapshot(f"s/{sid}/events")
    return out


def test_a_restart_lists_the_sessions_then_restores_each_at_its_first_use(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory()
    d.start()
    before = saved(d)
    d.stop()
    assert (d.home / "state" / "sessions" / "index.json").is_file()
    d.start()
    assert not (d.home / "state" / "sessions" / "index.json").exists()  # taken
    assert "\n".join(sorted(os.listdir(d.p("s")))) == before["s/"]
    assert d.read("s/idx") == before["s/idx"]
    assert os.stat(d.p("s/idle00")).st_nlink == os.stat(d.p("s/p")).st_nlink
    assert debug_counts(d).alive == 0  # listed, idx read, stat'ed: no journal read
    # The parent's cost counts its child's, which stays unread.
    assert d.read("s/p/cost") == before["p/cost"]
    assert debug_counts(d).alive == 1
    assert view(d) == before
    assert debug_counts(d).alive == 3
    # A session first touched now works on: a prompt, a rename.
    d.replay.add(script('{"reply": "and again"}'))
    d.prompt("m", "once more")
    d.wait_idle("m")
    assert d.read("s/m/chat").startswith(before["m/chat"])
    assert "assistant: and again" in d.read("s/m/chat")
    d.write("s/idle05/ctl", "rn renamed")
    assert "renamed" in os.listdir(d.p("s")) and "idle05" not in os.listdir(d.p("s"))
    assert d.read("s/idx").count("\n") == before["s/idx"].count("\n")
    # A name of a session not restored yet is taken.
    try:
        d.new(name="idle06")
    except OSError:
        pass
    else:
        raise AssertionError("s/new took the name of a saved session")
    # Killed before it was ever restored: gone, its journal to the transcripts.
    os.rmdir(d.p("s/idle07"))
    assert "idle07" not in os.listdir(d.p("s"))
    after = view(d)
    d.stop()
    d.start()
    assert view(d) == after


def test_the_journal_is_read_where_the_index_is_not_the_truth(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory()
    d.start()
    saved(d)
    d.stop()
    sessions = d.home / "state" / "sessions"
    stale = d.base / "stale-index.json"
    shutil.copy(sessions / "index.json", stale)
    d.start()
    # A turn appended after the index was written, then a crash: no index at the next
    # start (it was taken), every journal read there.
    d.replay.add(script('{"reply": "after the index"}'))
    d.prompt("idle01", "news")
    d.wait_idle("idle01")
    d.crash()
    d.start()
    assert debug_counts(d).alive == 23
    assert "assistant: after the index" in d.read("s/idle01/chat")
    # An index older than a journal (restored from a backup, a stop cut short): the
    # changed journal is read at the start, the others are listed from the index.
    d.stop()
    shutil.copy(stale, sessions / "index.json")
    d.start()
    assert debug_counts(d).alive == 1
    assert "assistant: after the index" in d.read("s/idle01/chat")
    assert sorted(os.listdir(d.p("s"))).count("idle01") == 1
    assert "idle01\tidle\t" in d.read("s/idx")


def test_a_9p_walk_into_a_saved_session_restores_it(
    daemon_factory: Callable[..., Daemon],
) -> None:
    sockdir = Path(tempfile.mkdtemp(prefix="o9p-", dir="/tmp"))  # a unix socket's path: short
    try:
        walk_after_restart(daemon_factory, sockdir / "9p")
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)


def walk_after_restart(daemon_factory: Callable[..., Daemon], sock: Path) -> None:
    d = exported(daemon_factory, "--9p", f"unix:{sock}")
    d.replay.add(script('{"reply": "seen over 9P later"}'))
    d.new(name="w")
    d.prompt("w", "hello")
    d.wait_idle("w")
    chat = d.read("s/w/chat")
    d.stop()
    d.start()
    with py9p.Client.connect_unix(str(sock)) as cl:
        cl.negotiate()
        cl.attach(0, uname="someone", aname="")
        cl.walk(0, 1, "s")
        cl.open(1)
        assert "w" in py9p_listing(cl, 1)
        cl.clunk(1)
        assert debug_counts(d).alive == 0  # listed over 9P from the index
        cl.walk(0, 2, "s/w/chat")
        _, iounit = cl.open(2)
        assert py9p_read_all(cl, 2, iounit).decode() == chat
        cl.clunk(2)
        cl.clunk(0)
    assert debug_counts(d).alive == 1
    wait_left_clean(d)
