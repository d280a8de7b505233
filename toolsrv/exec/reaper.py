"""The subreaper: orphans of tool processes come back to the server, which kills and reaps.

As a child subreaper, processes whose parent died while they ran (a tool's background job,
or one that called setsid() to leave the call's process group) are re-parented to the
server rather than to init. A sweep reaps their zombies and SIGKILLs the live ones of
finished calls: at the end of each call, and on SIGCHLD when started from the main thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
from dataclasses import dataclass
from types import FrameType
from typing import Any

import trio

from toolsrv.exec.cgroup import MAX_STEP, read_seq

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(eq=False)
class CallRecord:
    """A call in flight, as the reaper needs to know it."""

    pid: int | None = None  # the leader, once spawned
    start: int | None = None  # the leader's start time in clock ticks (read when needed)


def proc_stat(pid: int) -> tuple[str, int, int, int, int] | None:
    """(state, ppid, pgrp, session, starttime) from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])


def _nnp(pid: int | str) -> bool:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            return b"\nNoNewPrivs:\t1" in f.read()
    except OSError:
        return False


def children() -> set[int]:
    """Our children: /proc/<pid>/task/*/children (a few µs), else a scan of all of /proc."""
    me = os.getpid()
    kids: set[int] = set()
    try:
        tids = os.listdir(f"/proc/{me}/task")
    except OSError:
        return kids
    found = False
    for tid in tids:
        try:
            data = read_seq(f"/proc/{me}/task/{tid}/children")
        except FileNotFoundError:
            continue
        found = True
        kids.update(map(int, data.split()))
    if not found:  # kernel without CONFIG_PROC_CHILDREN
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (st := proc_stat(int(entry))) is not None and st[1] == me:
                kids.add(int(entry))
    return kids


class Reaper:
    """Kills and reaps what finished calls left behind (see the module docstring).

    A child is taken for a tool process only if it runs in another session than ours and has
    NoNewPrivs set (every tool process has, for good) while we do not: children that other
    code of this process spawns are left alone. One process has one subreaper flag and one
    SIGCHLD handler: start one Reaper at a time.
    """

    def __init__(self) -> None:
        self.calls: set[CallRecord] = set()
        self._on = False
        self._prev_sigchld: Any = None
        self._own_sid = 0
        self._own_nnp = False
        self._sweeping = False
        self._sweep_again = False

    def start(self, *, sigchld: bool = True) -> None:
        """``sigchld``: sweep on SIGCHLD too (from the main thread only)."""
        if self._on:
            return
        if _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            log.warning("cannot become a child subreaper: %s", os.strerror(ctypes.get_errno()))
        self._own_sid = os.getsid(0)
        self._own_nnp = _nnp("self")
        if sigchld and threading.current_thread() is threading.main_thread():
            self._prev_sigchld = signal.signal(signal.SIGCHLD, self._on_sigchld)
        self._on = True

    def stop(self) -> None:
        """Undo `start`, after a last sweep."""
        if not self._on:
            return
        self.sweep()
        self._on = False
        if threading.current_thread() is threading.main_thread() and self._prev_sigchld is not None:
            signal.signal(signal.SIGCHLD, self._prev_sigchld)
            self._prev_sigchld = None
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)

    def _on_sigchld(self, signum: int, frame: FrameType | None) -> None:
        if self.orphans():
            self.sweep()
        if callable(self._prev_sigchld):
            self._prev_sigchld(signum, frame)

    def orphans(self) -> bool:
        """Whether a sweep may find work: a child has exited that is not the leader of a
        call in flight (whose call reaps it). One waitid, which looks without reaping.

        Nearly every SIGCHLD is a leader's exit, and a sweep lists every thread's children
        in /proc (a dozen syscalls). A zombie behind a leader's is found once the leader
        is reaped, by the sweep or check that ends its call. Live orphans of finished calls
        do not raise SIGCHLD: the sweep at the end of each call kills them (where a cgroup
        did not already).
        """
        try:
            ready = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False
        except OSError:
            return True
        if ready is None:
            return False
        return all(call.pid != ready.si_pid for call in self.calls)

    def sweep(self) -> int:
        """Reap and kill orphaned tool processes; how many it SIGKILLed.

        Never raises: it runs from the SIGCHLD handler, in the middle of whatever code.
        """
        if not self._on:
            return 0
        if self._sweeping:  # a SIGCHLD arrived during a sweep: go round once more
            self._sweep_again = True
            return 0
        self._sweeping = True
        killed = 0
        try:
            while True:
                self._sweep_again = False
                killed += self._sweep_once()
                if not self._sweep_again:
                    break
        except Exception:
            log.debug("reaper sweep failed", exc_info=True)
        finally:
            self._sweeping = False
        return killed

    async def sweep_until_clean(self, deadline: float) -> None:
        """Sweep until no orphan of a finished call is alive: a killed escapee's children
        are re-parented to us only once it is dead, so killing a chain takes a few rounds."""
        delay = 0.0002
        while self.sweep() and trio.current_time() < deadline:
            await trio.sleep(delay)
            delay = min(delay * 2, MAX_STEP)

    def _sweep_once(self) -> int:
        calls = list(self.calls)
        if any(c.pid is None for c in calls):
            # A leader being spawned may already be a zombie we do not know yet: touch
            # nothing. That call's end sweeps again.
            return 0
        kids = children() - {c.pid for c in calls}
        floor: int | None = None
        floor_known = False
        killed = 0
        for pid in kids:
            st = proc_stat(pid)
            if st is None or st[3] == self._own_sid or (not self._own_nnp and not _nnp(pid)):
                continue
            if st[0] in ("Z", "X"):
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                continue
            if not floor_known:
                floor, floor_known = _calls_floor(calls), True
            # Processes of calls in flight all started after their leader: anything older
            # belongs to a call that is over. Without a known floor, kill nothing.
            if calls and (floor is None or st[4] >= floor):
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # its zombie comes back through SIGCHLD
                killed += 1
        return killed

    def group_alive(self, pgid: int) -> bool:
        """Whether a live (non-zombie) process is in the group: a /proc scan, slow path."""
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (st := proc_stat(int(entry))) is not None:
                if st[2] == pgid and st[0] not in ("Z", "X"):
                    return True
        return False

    async def wait_group_gone(self, pgid: int, deadline: float) -> bool:
        delay = 0.0002
        waited = 0.0
        while True:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:  # a member switched to another uid: still there
                pass
            # Members left: dying, or zombies waiting for their reaper (us or init).
            self.sweep()
            if waited > 0.005 and not self.group_alive(pgid):
                return True
            if trio.current_time() > deadline:
                return False
            await trio.sleep(delay)
            waited += delay
            delay = min(delay * 2, MAX_STEP)


def _calls_floor(calls: list[CallRecord]) -> int | None:
    starts: list[int] = []
    for call in calls:
        if call.start is None and call.pid is not None:
            st = proc_stat(call.pid)
            if st is not None:
                call.start = st[4]
        if call.start is None:
            return None
        starts.append(call.start)
    return min(starts, default=None)
