"""A restart brings every session back exactly, and cheaply (issue 10: mount-to-usable).

What makes it cheap, each checked here where a user could tell it broke: a restored
session builds its profile's runtime at its first need, not at start
(``Session.ready``); the logs of the last run are set aside and removed behind the
mount's back; profiles are read once per change; the restored sessions are frozen out of
the garbage collector's walks, and still freed once killed (``olliefs.daemon.Collector``).
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path

from olliefs.live import GrowingLog
from olliefs.testing import Daemon
from tests.conftest import oserror, script
from tests.e2e.test_profiles import put
from tests.fs.test_load import debug_counts

# A prompt that only a built runtime shows expanded, a restriction and a hook that only
# a built runtime enforces.
LAZY = {
    "prompt": "You are terse. Working in $OLLIE_CWD.",
    "tools": ["client_9p"],
    "allowTools": ["client_9p", "file_*"],
    "hooks": {"preTurn": "grep -q forbidden && { echo 'no forbidden prompts' >&2; exit 2; }; true"},
}


def restarted(d: Daemon) -> Daemon:
    d.stop()
    d.start()
    return d


def test_a_restored_session_builds_its_profile_at_its_first_need(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory()
    d.start()
    put(d, "a/lazy.json", json.dumps(LAZY))
    sid = d.new(name="lazy", agent="lazy")
    # First need: a read of systemprompt (the prompt as built, $OLLIE_CWD expanded).
    restarted(d)
    assert f"Working in {d.work}." in d.read(f"s/{sid}/systemprompt")
    # First need: a ctl request (allowTools holds before any prompt).
    restarted(d)
    assert oserror(lambda: d.write(f"s/{sid}/ctl", "tool_load execute_code")) == errno.EINVAL
    assert "not permitted" in d.read(f"s/{sid}/err")
    # First need: a prompt (its preTurn hook runs).
    restarted(d)
    d.prompt(sid, "something forbidden")
    d.wait_idle(sid)
    assert "blocked by the preTurn hook: no forbidden prompts" in d.read(f"s/{sid}/chat")
    assert not d.replay.requests


def test_queued_prompts_of_a_restored_session_run_in_order(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """A session with prompts queued at the crash is not left for later: they run as
    soon as the daemon is back, in order, with the profile's runtime built first."""
    d = daemon_factory()
    d.start()
    put(d, "a/lazy.json", json.dumps(LAZY))
    d.replay.add(script('{"reply": "' + "tick " * 200 + '", "chunk": 5, "delay": 0.02}'))
    sid = d.new(name="q", agent="lazy")
    d.prompt(sid, "long one")
    d.wait_chat(sid, "assistant: tick tick")
    d.prompt(sid, "second, forbidden")
    d.prompt(sid, "third")
    d.crash()
    d.replay.add(script('{"reply": "after third"}'))
    d.start()
    d.wait_chat(sid, "assistant: after third")
    d.wait_idle(sid)
    chat = d.read(f"s/{sid}/chat")
    assert ":: interrupted by restart" in chat
    rest = chat.split(":: interrupted by restart", 1)[1]
    assert "blocked by the preTurn hook" in rest.split("user: third", 1)[0]
    assert d.replay.requests[-1]["messages"][-1]["content"] == "third"


def test_the_last_runs_logs_are_removed_after_a_restart(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory()
    d.start()
    sid = d.new(name="logs")
    d.prompt(sid, "hello")
    d.wait_idle(sid)
    chat, events = d.read(f"s/{sid}/chat"), d.snapshot(f"s/{sid}/events")
    restarted(d)
    state = d.home / "state"
    d.wait_for(lambda: not list(state.glob("logs.old-*")))
    assert d.read(f"s/{sid}/chat") == chat
    assert d.snapshot(f"s/{sid}/events") == events
    # Small logs have no backing file (live.GrowingLog): nothing of the last run is left.
    assert list((state / "logs").iterdir()) == []


def test_restored_then_killed_sessions_are_freed(daemon_factory: Callable[..., Daemon]) -> None:
    """Restored sessions are frozen out of the collector's walks; killed, they sit in
    reference cycles only a collection frees: the daemon must still free them."""
    d = daemon_factory()
    d.start()
    names = [d.new(name=f"k{i:02d}") for i in range(40)]
    # After a crash there is no index: every session is restored at the start (and
    # frozen); after a clean stop they would be restored at their first use.
    d.crash()
    d.start()
    frozen = debug_counts(d)
    assert frozen.alive == 40 and frozen.frozen > 0
    for name in names:
        os.rmdir(d.p(f"s/{name}"))
    d.wait_for(lambda: debug_counts(d).alive == 0, timeout=120)
    after = debug_counts(d)
    assert after.refreezes == 1 and after.frozen > 0  # what lives is frozen again
    assert sorted(os.listdir(d.p("s"))) == ["idx", "new"]


def test_sessions_made_while_running_are_frozen_and_still_freed(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Sessions made through s/new are frozen too (a full collection walked them all on
    every round while they streamed); killed, they are freed all the same."""
    d = daemon_factory()
    d.start()
    start = debug_counts(d)
    names = [d.new(name=f"m{i:02d}") for i in range(40)]
    d.wait_for(lambda: debug_counts(d).frozen > start.frozen + 40 * 100, timeout=60)
    assert debug_counts(d).refreezes == start.refreezes  # a freeze of its own, no kill's
    for name in names:
        os.rmdir(d.p(f"s/{name}"))
    d.wait_for(lambda: debug_counts(d).alive == 0, timeout=120)
    assert sorted(os.listdir(d.p("s"))) == ["idx", "new"]


def test_an_edited_profile_is_read_again(daemon_factory: Callable[..., Daemon]) -> None:
    """Built runtimes take the profile from a cache while its file stays the same."""
    d = daemon_factory()
    d.start()
    put(d, "a/lazy.json", json.dumps(LAZY))
    first = d.new(name="e1", agent="lazy")
    assert "You are terse." in d.read(f"s/{first}/systemprompt")
    put(d, "a/lazy.json", json.dumps({**LAZY, "prompt": "You are chatty."}))
    second = d.new(name="e2", agent="lazy")
    assert "You are chatty." in d.read(f"s/{second}/systemprompt")
    d.write(f"s/{first}/ctl", "agent lazy")
    assert "You are chatty." in d.read(f"s/{first}/systemprompt")


def test_a_log_makes_its_file_when_it_outgrows_its_window(tmp_path: Path) -> None:
    """A log keeps its bytes in memory until it outgrows twice its window; then its
    backing file is made and takes the oldest bytes as they leave memory, and every
    byte reads back from one or the other."""
    path = tmp_path / "x.chat"
    log = GrowingLog(path, window=1000)
    log.append(b"a" * 1500)
    assert not path.exists()
    log.append(b"b" * 600)
    assert path.exists()  # past twice the window
    log.append(b"c" * 3000)  # memory keeps about a window; the older pieces go to the file
    whole = b"a" * 1500 + b"b" * 600 + b"c" * 3000
    on_disk = path.read_bytes()
    assert on_disk == whole[: len(on_disk)] and len(on_disk) >= 2100
    assert b"".join(log.read(off, 700) for off in range(0, len(whole), 700)) == whole
    log.discard()
    assert not path.exists()
    small = GrowingLog(tmp_path / "y.chat", window=1000)
    small.append(b"hello")
    small.discard()
    assert not (tmp_path / "y.chat").exists()
