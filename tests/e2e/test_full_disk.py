"""A full disk under a real daemon: what cannot be made durable is refused, nothing more.

The daemon's whole home (journals, logs, transcripts) is a small tmpfs of the test's
own, filled by a filler file at the moment each test says (``SmallDisk``): during a
streamed reply, before an ``s/new``, while a prompt is open. Each test checks what SPEC 7
promises there: the write that cannot be made durable fails with ENOSPC and its reason
in ``err``, ``chat`` (for a session) and ``events``; nothing of it is acknowledged (a
refused prompt is never shown as ``user:``, never run, not even after a restart); the
daemon keeps serving; once the space is freed, writes work again, and a restart (clean,
or a SIGKILL) brings back exactly what was acknowledged. A SIGKILL while the disk is
still full brings back what reached the journal, which is always whole records.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from olliefs.replay import Entry
from olliefs.testing import SmallDisk, expect_log
from tests.conftest import Daemon, oserror, script
from tests.e2e.test_compaction import ANSWER
from tests.e2e.test_crash_matrix import context, crash, cut_once, journals, no_lost, restart
from tests.e2e.test_profiles import MINE, put
from tests.e2e.test_restart import snapshot

FULL = "No space left on device"
BIG = "a prompt longer than the slack a full disk leaves in a page " * 200  # ~12 KB


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    why = SmallDisk.unavailable()
    if why is not None:
        pytest.skip(reason=why)
    with SmallDisk(tmp_path / "home", 32 << 20) as disk:  # the daemon's OLLIE_HOME
        yield disk


@pytest.fixture
def d(disk: SmallDisk, daemon_factory: Callable[..., Daemon]) -> Daemon:
    # ``disk`` first: it is unmounted after the daemons are stopped.
    daemon = daemon_factory(OLLIE_READ_TIMEOUT="120")
    assert daemon.home == disk.path
    daemon.start()
    return daemon


def turn(d: Daemon, sid: str, text: str) -> None:
    d.prompt(sid, text)
    d.wait_idle(sid)


def events(d: Daemon, rel: str) -> list[dict[str, str]]:
    return [json.loads(line) for line in d.snapshot(rel).splitlines()]


def asked(d: Daemon) -> list[str]:
    """The last user message of every model request so far."""
    return [r["messages"][-1]["content"] for r in d.replay.requests]


def test_a_prompt_closed_on_a_full_disk_is_refused(d: Daemon, disk: SmallDisk) -> None:
    sid = d.new(name="p")
    turn(d, sid, "before")
    chat = d.read(f"s/{sid}/chat")
    fd = os.open(d.p(f"s/{sid}/prompt"), os.O_WRONLY)
    os.write(fd, BIG.encode())
    disk.fill()  # while the prompt is open: it is submitted at close
    with pytest.raises(OSError) as err:
        os.close(fd)
    assert err.value.errno == errno.ENOSPC
    reason = f"prompt not accepted: journal: {FULL}"
    assert d.read(f"s/{sid}/err") == reason + "\n"
    assert d.read(f"s/{sid}/chat") == chat + f"error: {reason}\n"  # no user: line
    assert events(d, f"s/{sid}/events")[-1]["content"] == reason
    assert any(e["content"] == reason for e in events(d, "events"))
    assert d.read(f"s/{sid}/state") == "idle\n"
    # Any request whose record the disk cannot take: the plan stays as it was.
    assert oserror(d.write, f"s/{sid}/plan", BIG) == errno.ENOSPC
    assert d.read(f"s/{sid}/plan") == "" and FULL in d.read(f"s/{sid}/err")

    disk.free()
    turn(d, sid, "after")
    assert "user: after\n" in d.read(f"s/{sid}/chat")
    assert asked(d) == ["before", "after"]  # the refused prompt never ran
    before = snapshot(d, sid)
    crash(d)
    restart(d)
    d.wait_idle(sid)
    assert snapshot(d, sid) == before
    assert asked(d) == ["before", "after"]  # nor after the restart
    assert BIG.strip() not in d.read(f"s/{sid}/chat")


def test_s_new_on_a_full_disk_is_refused_whole(d: Daemon, disk: SmallDisk) -> None:
    sessions = d.home / "state" / "sessions"
    first = d.new(name="first")
    files = sorted(os.listdir(sessions))
    disk.fill()
    assert oserror(lambda: d.new(name="second")) == errno.ENOSPC
    reason = f"s/new: journal: {FULL}"
    assert d.read("err") == reason + "\n"
    assert events(d, "events")[-1]["content"] == reason
    assert sorted(os.listdir(sessions)) == files  # no journal, no dot file left
    assert sorted(os.listdir(d.p("s"))) == [first, "idx", "new"]
    disk.free()
    assert d.new(name="second") == "second"
    turn(d, "second", "hello")
    assert d.read("s/second/chat").endswith("assistant: echo: hello\n")


@pytest.mark.parametrize("how", ["stop after freeing", "crash after freeing", "crash while full"])
def test_a_disk_full_during_a_streamed_reply(d: Daemon, disk: SmallDisk, how: str) -> None:
    # The journal meeting the full disk says so once (it keeps the records in memory).
    expect_log(r"session\.persist: \S+\.jsonl: journal: No space left on device", count=None)
    sid = d.new(name="st")
    turn(d, sid, "done before")
    # A slow reply, far longer than it takes the journal to meet the full disk.
    d.replay.add(script(json.dumps({"reply": "tick " * 5000, "chunk": 5, "delay": 0.02})))
    d.prompt(sid, "long one")
    d.prompt(sid, "queued behind")
    d.wait_chat(sid, "assistant: tick tick tick")
    chat0, ctx0 = d.read(f"s/{sid}/chat"), context(d, sid)
    disk.fill()

    # The turn stops, says why, and what is queued behind it waits.
    stopped = f"error: journal: {FULL}: turn stopped; queued prompts wait until the journal"
    d.wait_chat(sid, stopped, timeout=60)
    chat1 = d.read(f"s/{sid}/chat")
    assert chat1.startswith(chat0) and "echo: queued behind" not in chat1
    assert any(FULL in e["content"] for e in events(d, f"s/{sid}/events") if e["role"] == "error")
    assert d.read(f"s/{sid}/state") == "thinking\n"  # queued, not running
    # The daemon serves on; what cannot be journaled now is refused, with its reason.
    assert oserror(d.prompt, sid, "refused one") == errno.ENOSPC
    assert d.read(f"s/{sid}/err") == f"prompt not accepted: journal: {FULL}\n"
    assert oserror(lambda: d.new(name="other")) == errno.ENOSPC and FULL in d.read("err")
    assert "user: refused one" not in d.read(f"s/{sid}/chat")

    if how == "crash while full":
        crash(d)
        disk.free()
        restart(d)
        d.wait_idle(sid)
        # What reached the journal, whole: the cut turn, then the prompt queued behind it.
        after = no_lost(d, sid, chat0.rpartition("assistant:")[0], ctx0)
        assert "user: long one\n" in after and "user: queued behind\n" in after
        assert "assistant: tick tick" in after and "refused one" not in after
        assert after.endswith("assistant: echo: queued behind\n")
        cut_once(d, sid, after)
        assert "refused one" not in asked(d)
        return

    disk.free()
    d.prompt(sid, "after")  # tries the journal again: the queued prompt runs, then this
    d.wait_chat(sid, "assistant: echo: after")
    d.wait_idle(sid)
    chat2 = d.read(f"s/{sid}/chat")
    assert chat2.startswith(chat1)
    assert asked(d)[-2:] == ["queued behind", "after"] and "refused one" not in asked(d)
    assert context(d, sid)[: len(ctx0)] == ctx0
    before = snapshot(d, sid)
    if how == "crash after freeing":
        crash(d)
    else:
        d.stop()
    restart(d)
    d.wait_idle(sid)
    assert snapshot(d, sid) == before  # exactly what was acknowledged and journaled
    assert all(not name.startswith(".") for name in os.listdir(d.home / "state" / "sessions"))
    assert len(journals(d)) == 1


def owe(d: Daemon, sid: str) -> None:
    """Leave the session's journal owing a record on the full disk: a plan that takes
    what is left of the journal's last page, so the line that says so finds no room."""
    (path,) = (d.home / "state" / "sessions").glob("*.jsonl")
    st = path.stat()
    slack = st.st_blocks * 512 - st.st_size
    # Taken (and its "plan updated" line is owed), or refused (and the line saying so is).
    oserror(d.write, f"s/{sid}/plan", "p" * max(slack - 64, 0))
    # Owing: even a request whose record would fit in what is left is refused.
    assert oserror(d.write, f"s/{sid}/ctl", "maxsteps 7") == errno.ENOSPC


def test_rewind_save_and_compact_on_a_full_disk(d: Daemon, disk: SmallDisk) -> None:
    # The journal meeting the full disk says so once (it keeps the records in memory).
    expect_log(r"session\.persist: \S+\.jsonl: journal: No space left on device", count=None)
    sid = d.new(name="rw")
    for i in range(10):
        turn(d, sid, f"step {i}")
    ctx, chat = context(d, sid), d.read(f"s/{sid}/chat")
    state = d.home / "state"
    disk.fill()
    owe(d, sid)
    assert oserror(d.write, f"s/{sid}/ctl", "rewind 1") == errno.ENOSPC
    assert d.read(f"s/{sid}/err") == f"journal: {FULL}\n"
    assert oserror(d.write, f"s/{sid}/ctl", "save") == errno.ENOSPC
    assert d.read(f"s/{sid}/err") == f"save: the transcript: {FULL}\n"
    d.replay.add([Entry(reply=json.dumps(ANSWER))])
    # The journal owes records: nothing would run, so ctl compact is refused at once.
    assert oserror(d.write, f"s/{sid}/ctl", "compact") == errno.ENOSPC
    assert d.read(f"s/{sid}/err") == f"journal: {FULL}\n"
    # Nothing of them happened, nothing half-written is left.
    assert context(d, sid) == ctx and d.read(f"s/{sid}/chat").startswith(chat)
    assert d.read(f"s/{sid}/state") == "idle\n"
    assert os.listdir(state / "transcripts") == []
    assert not (state / "branches").exists()
    assert [p for p in (state / "compactions").rglob("*") if p.is_file()] == []

    disk.free()
    d.write(f"s/{sid}/ctl", "rewind 1")
    d.write(f"s/{sid}/ctl", "save")
    d.replay.add([Entry(reply=json.dumps(ANSWER))])
    d.write(f"s/{sid}/ctl", "compact")
    d.wait_idle(sid)
    assert os.listdir(d.p(f"s/{sid}/branches")) == ["1"]
    assert os.listdir(d.p(f"s/{sid}/compactions")) == ["1"]
    assert len(os.listdir(d.p("tr"))) == 1
    before = snapshot(d, sid)
    crash(d)
    restart(d)
    assert snapshot(d, sid) == before


def test_a_profile_saved_on_a_full_disk_keeps_the_old_one(d: Daemon, disk: SmallDisk) -> None:
    put(d, "a/mine.json", json.dumps(MINE))
    disk.fill()
    changed = {**MINE, "maxSteps": 9}
    assert oserror(lambda: put(d, "a/mine.json", json.dumps(changed))) == errno.ENOSPC
    assert d.read("err") == f"a/mine.json: not saved: {FULL}\n"
    assert json.loads(d.read("a/mine.json")) == MINE
    assert os.listdir(d.home / "config" / "agents") == ["mine.json"]  # no temp file left
    disk.free()
    put(d, "a/mine.json", json.dumps(changed))
    assert json.loads(d.read("a/mine.json")) == changed
