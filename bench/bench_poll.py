"""Followers in event loops: how fast poll wakes one, and what idle ones cost.

Run: ``.venv/bin/python bench/bench_poll.py`` (root, /dev/fuse). Prints a table; it
asserts nothing. Every figure is measured in this run, the reference too.

(a) Wake-up: a helper process holds ``s/<id>/stream`` open with O_NONBLOCK at its end
    and sleeps in ``poll(2)``; the bench writes a prompt and closes it (the close submits
    it, and the prompt's ``user:`` line is appended before the close returns). The time
    from just before the close to the helper's return from poll (both CLOCK_MONOTONIC),
    median and p99 of ``RUNS`` (each after the last turn ended). Reference: the same
    helper on a pipe, woken by a write of the same line: what the kernel alone takes to
    wake a poller.
(b) Idle: ``FOLLOWERS`` helpers (one process, epoll) sleep at the end of the stream of
    as many sessions while another session runs ``TURNS`` turns; their wake-ups, and the
    daemon's CPU meanwhile. Every wake-up would be a spurious one (nothing changed for
    them): when poll found every file readable it was thousands a second.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from olliefs.replay import ReplayServer
from olliefs.testing import Daemon

RUNS = 200
FOLLOWERS = 100
TURNS = 200

# argv: path ('-' reads fd 0), then per round it prints the monotonic time of its wake-up.
WAKER = r"""
import os, select, sys, time
fd = 0 if sys.argv[1] == '-' else os.open(sys.argv[1], os.O_RDONLY | os.O_NONBLOCK)
os.set_blocking(fd, False)
def drain():
    while True:
        try:
            if not os.read(fd, 65536):
                return
        except BlockingIOError:
            return
drain()
p = select.poll()
p.register(fd, select.POLLIN)
print('ready', flush=True)
while True:
    p.poll()
    t = time.monotonic()
    drain()
    print(repr(t), flush=True)
"""

IDLE = r"""
import os, selectors, sys, threading
sel = selectors.DefaultSelector()
for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    while True:
        try:
            if not os.read(fd, 65536):
                break
        except BlockingIOError:
            break
    sel.register(fd, selectors.EVENT_READ)
print('ready', flush=True)
wakes = 0
def count():
    global wakes
    while True:
        wakes += len(sel.select())
threading.Thread(target=count, daemon=True).start()
sys.stdin.readline()
print(wakes, flush=True)
"""


def cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def wake_times(
    argv: list[str],
    fire: Callable[[], object],
    settle: Callable[[], object],
    stdin: int | None = None,
) -> list[float]:
    proc = subprocess.Popen(
        [sys.executable, "-c", WAKER, *argv], stdin=stdin, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    out = []
    for _ in range(RUNS):
        settle()
        t0 = time.monotonic()
        fire()
        while (t := float(proc.stdout.readline())) < t0:
            pass  # a wake-up for what came after the last round's (the reply)
        out.append(t - t0)
    proc.kill()
    proc.wait()
    return out


def main() -> None:
    base = Path(tempfile.mkdtemp(prefix="bench-poll-"))
    with ReplayServer() as replay, Daemon(base, replay, {}).running() as d:
        sid = d.new(name="wake")

        def prompt() -> None:
            fd = os.open(d.p(f"s/{sid}/prompt"), os.O_WRONLY)
            os.write(fd, b"ping")
            os.close(fd)

        def settle() -> None:
            d.wait_idle(sid)
            time.sleep(0.005)  # the helper is back in poll (a bench, not a test)

        fuse = wake_times([str(d.p(f"s/{sid}/stream"))], prompt, settle)
        r, w = os.pipe()
        pipe = wake_times(
            ["-"], lambda: os.write(w, b"user: ping\n"), lambda: time.sleep(0.005), stdin=r
        )
        os.close(r)
        os.close(w)
        d.wait_idle(sid)

        sids = [d.new() for _ in range(FOLLOWERS)]
        paths = [str(d.p(f"s/{s}/stream")) for s in sids]
        idle = subprocess.Popen(
            [sys.executable, "-c", IDLE, *paths],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert idle.stdin is not None and idle.stdout is not None
        assert idle.stdout.readline() == "ready\n"
        busy = d.new(name="busy")
        assert d.proc is not None
        c0, t0 = cpu(d.proc.pid), time.monotonic()
        for _ in range(TURNS):
            d.prompt(busy, "elsewhere")
            d.wait_idle(busy)
        c1, t1 = cpu(d.proc.pid), time.monotonic()
        idle.stdin.write("\n")
        idle.stdin.flush()
        wakes = int(idle.stdout.readline())
        idle.wait()

    ms = 1000
    print(f"{'':38} {'median':>9} {'p99':>9}")
    print(
        f"{'poll wake-up, stream (prompt close)':38} {statistics.median(fuse) * ms:8.3f}ms"
        f" {pct(fuse, 0.99) * ms:8.3f}ms"
    )
    print(
        f"{'poll wake-up, pipe (reference)':38} {statistics.median(pipe) * ms:8.3f}ms"
        f" {pct(pipe, 0.99) * ms:8.3f}ms"
    )
    print(
        f"{FOLLOWERS} idle epoll followers, {TURNS} turns elsewhere ({t1 - t0:.1f}s):"
        f" {wakes} wake-ups; daemon CPU {100 * (c1 - c0) / (t1 - t0):.0f}%"
    )


if __name__ == "__main__":
    main()
