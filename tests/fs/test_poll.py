"""poll, select and epoll on the blocking files: a follower in an event loop sleeps.

The reader is what asyncio, Node or Go do with a file: opened with O_NONBLOCK, a wait
for readability (``select.poll``, ``select.select``, ``selectors``' epoll, asyncio's
``add_reader``), then reads until EAGAIN. A wake-up whose first read fails with EAGAIN
is spurious: when the daemon let the kernel answer every poll "readable", each turn of
such a loop was one, thousands a second while nothing happened. Here the reader first
gets to the end of the file and falls asleep in its wait (its thread sits in the
system call), the mount is busy with other things meanwhile (another session's turn,
stats and reads of the same session), and then the one change it waits for comes: it
must have woken for that change only, with the data there.
"""

from __future__ import annotations

import json
import os
import platform
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import Daemon, deadline, script
from tests.fs.test_blocking import state
from tests.fs.test_load import debug_counts

READER = r"""
import asyncio, json, os, select, selectors, signal, sys
path, how, want = sys.argv[1], sys.argv[2], sys.argv[3].encode()
fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
got = bytearray()
eof = False
wakes = spurious = 0

def take():
    '''Read what there is: whether there was anything (data or the end).'''
    global eof
    n = 0
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return n > 0
        if not chunk:
            eof = True
            return True
        got.extend(chunk)
        n += 1

def done():
    return eof or (want != b"" and want in got)

def woke():
    global wakes, spurious
    wakes += 1
    spurious += not take()

def report(*_):
    print(json.dumps({"wakes": wakes, "spurious": spurious, "got": got.decode(), "eof": eof}))
    sys.stdout.flush()
    os._exit(0 if done() else 3)

signal.signal(signal.SIGTERM, report)  # what it got, when the test gives up on it
take()
print("at the end", flush=True)
if how == "poll":
    p = select.poll()
    p.register(fd, select.POLLIN)
    while not done():
        p.poll()
        woke()
elif how == "select":
    while not done():
        select.select([fd], [], [])
        woke()
elif how == "epoll":
    s = selectors.DefaultSelector()
    s.register(fd, selectors.EVENT_READ)
    while not done():
        s.select()
        woke()
else:
    async def main():
        loop = asyncio.get_running_loop()
        finished = loop.create_future()
        def readable():
            woke()
            if done() and not finished.done():
                finished.set_result(None)
        loop.add_reader(fd, readable)
        await finished
        loop.remove_reader(fd)
    asyncio.run(main())
report()
"""

# System calls a reader sleeps in while it waits for readability, per machine: poll,
# select, pselect6, ppoll, epoll_wait, epoll_pwait, epoll_pwait2 (x86_64); ppoll,
# pselect6, epoll_pwait, epoll_pwait2 (aarch64).
WAITS = {"x86_64": {7, 23, 270, 271, 232, 281, 441}, "aarch64": {72, 73, 22, 441}}[
    platform.machine()
]


def asleep(pid: int) -> bool:
    """Is the reader asleep in its wait for readability?"""
    try:
        nr = Path(f"/proc/{pid}/syscall").read_text().split(" ", 1)[0]
    except OSError:
        return False
    return state(pid) == "S" and nr.isdigit() and int(nr) in WAITS


def follow(daemon: Daemon, rel: str, how: str, want: str) -> subprocess.Popen[str]:
    """Start a reader of ``rel`` and return once it has read what there is and sleeps in
    its wait (``how``: poll, select, epoll, asyncio) until ``want`` (or the end)."""
    argv = [sys.executable, "-c", READER, str(daemon.p(rel)), how, want]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        with deadline(30):
            assert proc.stdout.readline() == "at the end\n"
            while not asleep(proc.pid):
                assert proc.poll() is None, "the reader ended"
                time.sleep(0.005)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    return proc


def result(proc: subprocess.Popen[str]) -> dict[str, object]:
    try:
        out, _ = proc.communicate(timeout=60)  # a deadline for a hang, not a timing
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, _ = proc.communicate()
        raise AssertionError(f"the reader never got what it waits for: {out!r}") from None
    assert proc.returncode == 0, out
    got: dict[str, object] = json.loads(out)
    return got


def busy_elsewhere(daemon: Daemon, sid: str) -> None:
    """What must not wake a reader of ``sid``'s blocking files: a turn of another
    session, and stats and reads of ``sid``'s own files."""
    other = daemon.new()
    daemon.prompt(other, "elsewhere")
    daemon.wait_idle(other)
    for name in ("stream", "events", "statewait", "chat", "state"):
        os.stat(daemon.p(f"s/{sid}/{name}"))
    assert daemon.read(f"s/{sid}/state") == "idle\n"
    daemon.read(f"s/{sid}/chat")


@pytest.mark.parametrize("how", ["poll", "select", "epoll", "asyncio"])
def test_a_stream_follower_sleeps_until_the_reply(daemon: Daemon, how: str) -> None:
    sid = daemon.new(name="ev")
    proc = follow(daemon, f"s/{sid}/stream", how, "assistant: echo: ping\n")
    try:
        busy_elsewhere(daemon, sid)
        assert asleep(proc.pid)
        daemon.prompt(sid, "ping")
        got = result(proc)
    finally:
        proc.kill()
        proc.wait()
    assert got["spurious"] == 0, got
    assert "user: ping\n" in str(got["got"])
    daemon.wait_idle(sid)


@pytest.mark.parametrize(
    ("rel", "want"),
    [
        ("s/ID/events", '"content":"idle"'),  # the turn's end (its reply comes in pieces)
        ("events", '"content":"ping"'),  # every session's prompts (not their replies)
        ("s/ID/statewait", ""),  # the first change of state, then EOF
    ],
)
def test_events_and_statewait_followers_sleep(daemon: Daemon, rel: str, want: str) -> None:
    sid = daemon.new(name="ev")
    proc = follow(daemon, rel.replace("ID", sid), "poll", want)
    try:
        if rel == "events":  # every session's events: only reads elsewhere
            daemon.snapshot(f"s/{sid}/events")
            daemon.read(f"s/{sid}/chat")
            assert daemon.read(f"s/{sid}/state") == "idle\n"
        else:
            busy_elsewhere(daemon, sid)
        assert asleep(proc.pid)
        daemon.prompt(sid, "ping")
        got = result(proc)
    finally:
        proc.kill()
        proc.wait()
    assert got["spurious"] == 0, got
    if want:
        assert want in str(got["got"])
    else:
        assert got["eof"] and got["got"] in ("thinking\n", "idle\n"), got
    daemon.wait_idle(sid)  # the turn ends before the daemon does


def test_a_fifo_out_follower_sleeps_until_a_prompt_is_queued(daemon: Daemon) -> None:
    daemon.replay.add(script('{"reply": "x", "hang": true}'))
    sid = daemon.new(name="ff")
    daemon.prompt(sid, "running")
    daemon.wait_for(lambda: len(daemon.replay.requests) == 1)
    proc = follow(daemon, f"s/{sid}/fifo.out", "asyncio", "queued one\n")
    try:
        busy_elsewhere_during_a_turn(daemon, sid)
        assert asleep(proc.pid)
        daemon.write(f"s/{sid}/fifo.in", "queued one")
        got = result(proc)
    finally:
        proc.kill()
        proc.wait()
    assert got["spurious"] == 0 and got["got"] == "queued one\n", got
    daemon.write(f"s/{sid}/ctl", "stop")
    daemon.wait_idle(sid)


def busy_elsewhere_during_a_turn(daemon: Daemon, sid: str) -> None:
    other = daemon.new()
    daemon.prompt(other, "elsewhere")
    daemon.wait_idle(other)
    assert daemon.read(f"s/{sid}/state") != "idle\n"
    os.stat(daemon.p(f"s/{sid}/fifo.out"))


def polled(daemon: Daemon, rel: str, flags: int) -> int:
    """What one poll without waiting finds on a new handle of ``rel`` read to its end."""
    fd = os.open(daemon.p(rel), flags | os.O_NONBLOCK)
    try:
        if flags & os.O_ACCMODE != os.O_WRONLY:
            while True:
                try:
                    if not os.read(fd, 65536):
                        break
                except BlockingIOError:
                    break
        p = select.poll()
        p.register(fd, select.POLLIN | select.POLLOUT)
        return dict(p.poll(0)).get(fd, 0) & (select.POLLIN | select.POLLOUT)
    finally:
        os.close(fd)


def test_poll_finds_readable_what_a_read_would_answer_at_once(daemon: Daemon) -> None:
    """A blocking file is readable when a read would not wait; every file is writable (no
    write waits). The other files, and a walker's handle of a blocking file (it reads
    the file as it is now, ollie(5)), are readable always, as files on a disk."""
    sid = daemon.new(name="rd")
    both = select.POLLIN | select.POLLOUT
    for name in ("stream", "events", "statewait", "fifo.out"):
        assert polled(daemon, f"s/{sid}/{name}", os.O_RDONLY) == select.POLLOUT, name
        assert polled(daemon, f"s/{sid}/{name}", os.O_RDONLY | os.O_NOFOLLOW) == both, name
    assert polled(daemon, "events", os.O_RDONLY) == select.POLLOUT
    for name in ("chat", "state", "cfg"):
        assert polled(daemon, f"s/{sid}/{name}", os.O_RDONLY) == both, name
    assert polled(daemon, f"s/{sid}/prompt", os.O_WRONLY) == both


def test_a_poll_on_a_handle_closed_unwoken_leaves_nothing_behind(daemon: Daemon) -> None:
    """epoll waits on a file from the moment it is added: each handle not ready gets a
    task that waits for its change, and the close of the handle ends it."""
    sid = daemon.new(name="cl")
    before = debug_counts(daemon).tasks
    n = 20
    ep = select.epoll()
    fds = []
    try:
        for rel in ("stream", "events", "statewait") * n:
            fd = os.open(daemon.p(f"s/{sid}/{rel}"), os.O_RDONLY | os.O_NONBLOCK)
            fds.append(fd)
            if rel != "statewait":
                while True:  # to the end: the handle is no longer ready
                    try:
                        if not os.read(fd, 65536):
                            break
                    except BlockingIOError:
                        break
            ep.register(fd, select.EPOLLIN)
        assert ep.poll(0) == []
        assert debug_counts(daemon).tasks == before + len(fds)
    finally:
        ep.close()
        for fd in fds:
            os.close(fd)
    # The kernel sends RELEASE after close() returned: wait for the count, not a time.
    with deadline(30):
        while debug_counts(daemon).tasks != before:
            time.sleep(0.01)
    assert daemon.read(f"s/{sid}/state") == "idle\n"
