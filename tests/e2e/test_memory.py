"""The daemon's memory follows what is alive, not everything that ever was.

What would grow without bound if nothing were given back: every node the kernel ever
looked up (no ``forget``), a killed session's chat/events, the bytes of a long reply in
every log. These tests measure the daemon's resident set through /proc: they assert
bounds on memory (a correctness property: no leak), never durations.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from olliefs.replay import Entry
from olliefs.testing import Daemon, deadline
from tests.fs.test_blocking import wait_blocked

KB = 1024
MB = 1024 * 1024


def rss(daemon: Daemon, what: str = "VmRSS") -> int:
    """The daemon's resident set in bytes (``VmHWM``: its peak so far)."""
    assert daemon.proc is not None
    with open(f"/proc/{daemon.proc.pid}/status") as f:
        for line in f:
            if line.startswith(f"{what}:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {what}")


def churn(daemon: Daemon, n: int) -> None:
    """Create ``n`` sessions, look into each as a user would, and remove them."""
    new = daemon.p("s/new")
    for i in range(n):
        fd = os.open(new, os.O_RDWR)
        try:
            os.write(fd, f"cwd={daemon.work} name=c{i}\n".encode())
            sid = os.pread(fd, 256, 0).decode().strip()
        finally:
            os.close(fd)
        d = daemon.p(f"s/{sid}")
        os.listdir(d)
        for name in ("chat", "cfg", "state", "usage"):
            with open(d / name, "rb") as f:
                f.read()
        shutil.rmtree(d)


def test_sessions_created_and_removed_give_their_memory_back(daemon: Daemon) -> None:
    churn(daemon, 100)  # warm up: imports, caches, allocator arenas
    before = rss(daemon)
    churn(daemon, 1000)
    after = rss(daemon)
    assert sorted(os.listdir(daemon.p("s"))) == ["idx", "new"]
    # 1,000 sessions kept alive by a leak cost far more than this (each holds logs,
    # an agent, tree nodes); what is left is allocator slack.
    assert after - before < 8 * MB, f"RSS grew {(after - before) / MB:.1f} MB"
    # Nothing of them is left on disk but their transcripts.
    assert not any((daemon.home / "state" / "logs").glob("*.chat"))
    assert len(list((daemon.home / "state" / "transcripts").glob("*.jsonl"))) == 1100


def test_a_large_reply_is_not_kept_in_memory_many_times(daemon: Daemon) -> None:
    size = 10 * MB
    daemon.replay.add(Entry(reply=r, chunk=4096) for r in ("small", "x" * size))
    sid = daemon.new(name="big")
    daemon.prompt(sid, "warm up")
    daemon.wait_idle(sid)
    before = rss(daemon)
    daemon.prompt(sid, "a big one")
    daemon.wait_idle(sid)
    grown = rss(daemon) - before
    # The history keeps the reply (the model needs it): one copy. chat and events keep
    # only a window in memory and the rest in their files.
    assert grown < 2.5 * size, f"RSS grew {grown / MB:.1f} MB for a {size // MB} MB reply"
    with open(daemon.p(f"s/{sid}/chat"), "rb") as f:
        chat = f.read()
    assert chat.count(b"x") >= size  # every byte still readable through the tree
    shutil.rmtree(daemon.p(f"s/{sid}"))
    daemon.wait_for(lambda: not any((daemon.home / "state" / "logs").glob("*.chat")))
    left = rss(daemon) - before
    assert left < 0.5 * size, f"{left / MB:.1f} MB still held after the session was removed"


# Threads that each open the file and read it to EOF (a read at the end blocks).
READERS = """
import os, sys, threading
threading.stack_size(1 << 18)
path, n = sys.argv[1], int(sys.argv[2])
def reader():
    fd = os.open(path, os.O_RDONLY)
    while os.read(fd, 65536):
        pass
threads = [threading.Thread(target=reader) for _ in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


def wait_readers_at(
    proc: subprocess.Popen[bytes], path: Path, n: int, size: Callable[[], int]
) -> None:
    """Wait until ``n`` descriptors of ``proc`` on ``path`` have read up to its current
    ``size`` and ``n`` of its threads wait in a FUSE read: every reader took what there
    was and waits for more. The size is looked at again each time: a line the session
    adds after the state said idle moves the end the readers wait at."""
    fds = f"/proc/{proc.pid}/fd"

    def at_offset() -> int:
        offset = size()
        count = 0
        for fd in os.listdir(fds):
            try:
                if os.readlink(f"{fds}/{fd}") != str(path):
                    continue
                with open(f"/proc/{proc.pid}/fdinfo/{fd}") as f:
                    count += int(f.readline().split()[1]) == offset
            except OSError:
                pass  # closed meanwhile
        return count

    with deadline(60):
        while at_offset() < n:
            assert proc.poll() is None, "the readers exited"
            time.sleep(0.01)
    wait_blocked(proc.pid, n)


def test_blocked_readers_cost_kilobytes_and_leave_them_for_the_next(daemon: Daemon) -> None:
    """A read blocked at the end of ``stream`` holds a few KiB of the daemon (its task and
    frames), not the ~1 MiB receive buffer of the FUSE worker serving it, and what
    readers held is used again by the next ones, not taken anew. The readers are woken
    once and wait again before the measure: it was the second wait of each that cost
    ~1 MiB (the first buffers come fresh from mmap, later ones from the heap, whose
    pages are transparent huge pages)."""
    n = 500
    held = []
    for wave in range(2):
        sid = daemon.new(name=f"wave{wave}")
        daemon.prompt(sid, "warm up")
        daemon.wait_idle(sid)
        before = rss(daemon)
        path = daemon.p(f"s/{sid}/stream")
        proc = subprocess.Popen([sys.executable, "-c", READERS, str(path), str(n)])
        try:
            chat = daemon.p(f"s/{sid}/chat")
            end = functools.partial(lambda p: os.stat(p).st_size, chat)
            wait_readers_at(proc, path, n, end)
            daemon.prompt(sid, "wake them all")
            daemon.wait_idle(sid)
            wait_readers_at(proc, path, n, end)
            held.append(rss(daemon) - before)
            daemon.write(f"s/{sid}/ctl", "kill")  # EOF for every reader
            assert proc.wait(timeout=60) == 0
        finally:
            proc.kill()
            proc.wait()
    first, second = held
    assert first < n * 64 * KB, f"{first / n / KB:.0f} KiB per blocked reader"
    # the first wave's memory went back to the allocator, and the second wave took it
    assert second < n * 4 * KB, f"a second wave took {second / n / KB:.1f} KiB per reader more"
