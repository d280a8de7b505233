"""Kernel caching of attributes and names, and its invalidation (issue 10).

The kernel keeps the attributes of ``chat``, ``stream``, ``events`` and ``state`` and the
names of session directories for ``CACHED_TTL``; the daemon invalidates them at each
change. Each test first makes the kernel cache the old value (a stat), then changes it
and checks that the very next operation sees the new one: with the invalidation broken,
the stale value is served from the cache and the test fails (unless the machine is so slow
that the cache expired in between: then the test passes; it can never fail wrongly).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from olliefs.fs.spec import SESSION_SUBDIRS
from olliefs.testing import deadline
from tests.conftest import Daemon, oserror, script
from tests.fs.test_load import debug_counts


def test_a_size_change_is_visible_to_the_next_stat(daemon: Daemon) -> None:
    """A reader woken by new bytes at the end of ``stream`` stats ``chat``: the size
    counts them (the kernel had cached the size of a moment before)."""
    daemon.replay.add(script('{"reply": "first-part;second-part", "chunk": 11, "delay": 0.3}'))
    daemon.new(name="sz")
    chat = daemon.p("s/sz/chat")
    with open(daemon.p("s/sz/stream"), "rb") as stream:
        daemon.prompt("sz", "hello")
        seen = b""
        while b"first-part" not in seen:
            seen += stream.read1(65536)
        first = os.stat(chat)  # cached by the kernel from here on
        assert first.st_size >= len(seen)
        while b"second-part" not in seen:
            seen += stream.read1(65536)
        second = os.stat(chat)
        assert second.st_size >= len(seen) > first.st_size
        assert second.st_mtime_ns >= first.st_mtime_ns
        # stream is the same log: its cached size was invalidated as well.
        assert os.stat(daemon.p("s/sz/stream")).st_size >= len(seen)
    daemon.wait_idle("sz")
    assert os.stat(chat).st_size == len(chat.read_bytes())
    assert os.stat(daemon.p("s/sz/events")).st_size == len(daemon.snapshot("s/sz/events"))


def test_state_is_current_at_the_next_stat(daemon: Daemon) -> None:
    daemon.replay.add(script('{"reply": "x", "hang": true}'))
    daemon.new(name="st")
    state = daemon.p("s/st/state")
    assert os.stat(state).st_size == len("idle\n")  # cached
    with open(daemon.p("s/st/statewait"), "rb") as w:
        daemon.prompt("st", "go")
        changed = w.read()  # returns at the first change of state
    size = os.stat(state).st_size  # before any read (an open refreshes attributes)
    assert changed != b"idle\n"
    assert size == len(state.read_bytes()) != len(b"idle\n")
    daemon.write("s/st/ctl", "stop")
    daemon.wait_idle("st")
    assert os.stat(state).st_size == len(b"idle\n")


def test_a_size_polling_reader_sees_every_byte(daemon: Daemon) -> None:
    """What ``tail -f`` and Emacs's ellie do: stat, read what the size says is new."""
    reply = "".join(f"<{i:03d}>" for i in range(200))
    daemon.replay.add(script(f'{{"reply": "{reply}", "chunk": 5, "delay": 0.002}}'))
    daemon.new(name="poll")
    chat = daemon.p("s/poll/chat")
    got = bytearray()
    stop = threading.Event()
    stats = 0

    def poll() -> None:
        nonlocal stats
        fd = os.open(chat, os.O_RDONLY)
        try:
            while True:
                last = stop.is_set()
                size = os.fstat(fd).st_size
                stats += 1
                while len(got) < size:
                    data = os.pread(fd, size - len(got), len(got))
                    assert data, "stat promised bytes that read did not give"
                    got.extend(data)
                if last:
                    return
        finally:
            os.close(fd)

    t = threading.Thread(target=poll)
    t.start()
    try:
        daemon.prompt("poll", "count")
        daemon.wait_idle("poll")
    finally:
        stop.set()
        t.join()
    assert bytes(got) == chat.read_bytes()
    assert reply.encode() in got
    assert stats > 1


def test_cat_stream_sees_every_byte(daemon: Daemon) -> None:
    reply = "".join(f"[{i:03d}]" for i in range(300))
    daemon.replay.add(script(f'{{"reply": "{reply}", "chunk": 3}}'))
    daemon.new(name="cat")
    with open(daemon.p("s/cat/stream"), "rb") as f:
        os.stat(daemon.p("s/cat/stream"))
        daemon.prompt("cat", "go")
        seen = b""
        while reply.encode() not in seen:
            chunk = f.read1(65536)
            assert chunk, "stream ended early"
            seen += chunk
    daemon.wait_idle("cat")
    assert daemon.p("s/cat/chat").read_bytes().startswith(seen)


def test_a_renamed_session_leaves_its_old_name_at_once(daemon: Daemon) -> None:
    daemon.new(name="old")
    os.stat(daemon.p("s/old"))  # the name is cached by the kernel from here on
    os.stat(daemon.p("s/old/state"))
    daemon.write("s/old/ctl", "rn fresh")
    assert oserror(os.stat, daemon.p("s/old")) == errno.ENOENT
    assert oserror(os.stat, daemon.p("s/old/state")) == errno.ENOENT
    assert daemon.read("s/fresh/state") == "idle\n"


def test_a_killed_session_leaves_the_tree_at_once(daemon: Daemon) -> None:
    daemon.new(name="gone")
    os.stat(daemon.p("s/gone"))
    os.listdir(daemon.p("s"))  # readdirplus: the kernel is told the name here as well
    daemon.write("s/gone/ctl", "kill")
    assert oserror(os.stat, daemon.p("s/gone")) == errno.ENOENT
    assert "gone" not in os.listdir(daemon.p("s"))


def test_a_session_renamed_through_the_mount(daemon: Daemon) -> None:
    daemon.new(name="a1")
    os.stat(daemon.p("s/a1/chat"))
    os.rename(daemon.p("s/a1"), daemon.p("s/b1"))
    assert oserror(os.stat, daemon.p("s/a1")) == errno.ENOENT
    assert daemon.read("s/b1/state") == "idle\n"
    # ... and back by ctl, with the kernel holding the new name.
    daemon.write("s/b1/ctl", "rn a1")
    assert oserror(os.stat, daemon.p("s/b1")) == errno.ENOENT
    assert daemon.read("s/a1/state") == "idle\n"


def test_cfg_write_then_stat(daemon: Daemon) -> None:
    daemon.new(name="c")
    cfg = daemon.p("s/c/cfg")
    before = os.stat(cfg)
    daemon.write("s/c/cfg", "model=a-much-longer-model-name-than-before\n")
    after = os.stat(cfg)
    assert after.st_size == len(cfg.read_bytes()) != before.st_size
    assert after.st_mtime_ns > before.st_mtime_ns


def test_session_dir_nlink(daemon: Daemon) -> None:
    """nlink is a constant for session directories (building its files costs): it must
    still be 2 plus the directories it holds, as find relies on."""
    daemon.new(name="n")
    d = daemon.p("s/n")
    subdirs = sorted(e.name for e in os.scandir(d) if e.is_dir())
    assert subdirs == sorted(SESSION_SUBDIRS)
    assert os.stat(d).st_nlink == 2 + len(subdirs)


def test_xattrs_are_not_supported(daemon: Daemon, tmp_path: Path) -> None:
    daemon.new(name="x")
    for p in (daemon.p("s"), daemon.p("s/x/chat")):
        assert oserror(os.listxattr, p) == errno.EOPNOTSUPP
        assert oserror(os.getxattr, p, "user.a") == errno.EOPNOTSUPP
        assert oserror(os.setxattr, p, "user.a", b"1") == errno.EOPNOTSUPP
    assert daemon.read("s/x/state") == "idle\n"


def test_idx_size_is_current_at_the_next_stat(daemon: Daemon) -> None:
    """``s/idx``'s attributes are kept (by the kernel and the daemon) until the root
    events log announces a change: every change of one of its lines must reach it."""
    daemon.replay.add(script('{"reply": "x", "hang": true}'))
    idx = daemon.p("s/idx")
    other = daemon.work / "elsewhere-with-a-long-name"
    other.mkdir()

    def stop_and_wait(sid: str) -> None:
        daemon.write(f"s/{sid}/ctl", "stop")
        daemon.wait_idle(sid)

    def changed_by(change: Callable[[], object]) -> None:
        before = os.stat(idx)  # cached from here on
        change()
        after = os.stat(idx)  # before any read: an open refreshes attributes
        assert after.st_size == len(idx.read_bytes()) != before.st_size

    changed_by(lambda: daemon.new(name="i1"))
    changed_by(lambda: daemon.new(name="i2"))
    changed_by(lambda: daemon.write("s/i1/ctl", "rn i1-renamed"))
    changed_by(lambda: daemon.write("s/i2/cfg", "model=a-much-longer-model-name\n"))
    changed_by(lambda: daemon.write("s/i2/ctl", "backend anthropic"))
    changed_by(lambda: daemon.write("s/i2/ctl", f"cwd {other}"))
    changed_by(lambda: daemon.prompt("i1-renamed", "go"))  # idle -> thinking
    # The turn ends after the stop returns: the change is announced when it comes.
    changed_by(lambda: stop_and_wait("i1-renamed"))
    changed_by(lambda: daemon.write("s/i2/ctl", "kill"))
    os.rename(daemon.p("s/i1-renamed"), daemon.p("s/i1-renamed-again"))
    assert os.stat(idx).st_size == len(idx.read_bytes())


def test_a_listing_follows_sessions_made_renamed_and_killed(daemon: Daemon) -> None:
    """A listing of s/ is built once and reused while the registry says its sessions
    stand: each change must show in the very next listing."""
    s = daemon.p("s")
    assert sorted(os.listdir(s)) == ["idx", "new"]
    daemon.new(name="l1")
    assert sorted(os.listdir(s)) == ["idx", "l1", "new"]
    daemon.new(name="l2")
    assert sorted(os.listdir(s)) == ["idx", "l1", "l2", "new"]
    daemon.write("s/l1/ctl", "rn l3")
    assert sorted(os.listdir(s)) == ["idx", "l2", "l3", "new"]
    os.rename(daemon.p("s/l2"), daemon.p("s/l0"))
    assert sorted(os.listdir(s)) == ["idx", "l0", "l3", "new"]
    os.rmdir(daemon.p("s/l0"))
    assert sorted(os.listdir(s)) == ["idx", "l3", "new"]
    # Every name listed leads where it says, through the kernel's cache and without.
    assert daemon.read("s/l3/state") == "idle\n"
    assert {e.name: e.is_dir() for e in os.scandir(s)} == {"idx": False, "l3": True, "new": False}


def test_listings_after_the_kernel_forgot_the_inodes(daemon: Daemon) -> None:
    """A kept listing names inode numbers; the kernel may forget them (memory pressure,
    here dropped caches) and the daemon then drops them from its table: the next
    listing must not hand out a number that no longer leads anywhere."""
    names = [daemon.new(name=f"f{i:02d}") for i in range(40)]
    s = daemon.p("s")
    for name in os.listdir(s):
        os.stat(s / name)
    before = debug_counts(daemon).inodes
    # s/ itself stays known (a descriptor holds it): its kept listing is what is tested.
    fd = os.open(s, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with deadline(60):
            while True:
                Path("/proc/sys/vm/drop_caches").write_text("2\n")
                if debug_counts(daemon).inodes < before - len(names):
                    break
                time.sleep(0.1)
        assert sorted(os.listdir(s)) == sorted([*names, "idx", "new"])
        for name in names:
            assert daemon.read(f"s/{name}/state") == "idle\n"
    finally:
        os.close(fd)


def test_a_long_listing_gives_each_name_once(daemon: Daemon) -> None:
    """A directory of more entries than one reply holds (and than the daemon checks in
    one step) is listed whole, each name once, in order."""
    tmp = daemon.p("tmp")
    want = [f"file-{i:04d}" for i in range(1500)]
    for name in want:
        (daemon.home / "data" / "scratch" / name).write_text("x")
    got = os.listdir(tmp)
    assert got == want
    assert sorted(e.name for e in os.scandir(tmp) if e.is_file()) == want
