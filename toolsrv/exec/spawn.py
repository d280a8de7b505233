"""Spawning a tool: a fresh thread enters the call's sandbox, then vforks and execs it.

Each spawn needs a brand-new OS thread: the sandbox (`toolsrv.sandbox.Prepared.enter`) is
applied to the spawning thread for good, and the child inherits it from that thread. A
``preexec_fn`` would force a full fork of the server and run Python between fork and exec:
2 ms more per call on a VM, which alone would triple the cost of running ``true``; it is only
used to set rlimits, when a profile asks for ``max_memory`` (see `spawn_in_thread`).

The next threads are started ahead (`Spawner.prestart`) while a tool runs, off the critical
path, one of them already in the sandbox of the call that just started (most calls have
the sandbox of the call before). For the microseconds the spawning thread lives on after
the spawn, it shares the tool's sandbox: the server is non-dumpable for as long as it can
spawn, so the tool cannot ptrace it nor read its memory through /proc.
"""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import logging
import os
import resource
import subprocess
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import trio

from toolsrv import namespaces
from toolsrv.exec.cgroup import Cgroup, CgroupBackend
from toolsrv.sandbox import Prepared

log = logging.getLogger(__name__)

SPAWN_BLOCK = 0.002
"""Seconds the event loop blocks waiting for a spawn before it awaits it the trio way."""
_PR_GET_DUMPABLE = 3
_PR_SET_DUMPABLE = 4
_libc = ctypes.CDLL(None, use_errno=True)
_T = TypeVar("_T")


class SetupError(Exception):
    """The spawning thread could not enter the sandbox: nothing was spawned."""


class Spare:
    """A thread started ahead of time, waiting for the one job it will run before ending.

    With a v1 cgroup backend (pids, or memory) the spare also takes the next call's cgroup
    and joins it at once: joining (a write to ``tasks``) waits for an RCU grace period
    inside the kernel, which was measured at 15-20 ms on an idle VM. Done ahead, nobody
    waits for it.

    ``ahead``: a sandbox (a `Prepared.copy`, whose descriptors the spare closes) that the
    thread enters right away, for a call whose sandbox has the same `Prepared.key`, which
    ``key`` is. Entering costs ~150 µs (the seccomp filter is compiled on every load);
    done ahead, the call only spawns. The thread waits in that sandbox, in a Landlock
    domain of its own that no process is in yet, so no tool can signal or trace it.
    """

    def __init__(
        self,
        cg: Cgroup | None = None,
        *,
        version: int = 0,
        bounding_empty: bool = False,
        ahead: Prepared | None = None,
        key: tuple[object, ...] | None = None,
    ) -> None:
        self.cg = cg
        self.version = version  # of the cgroup backend
        self.joined: Cgroup | None = None  # set by the thread once it joined ``cg``
        # Set by the thread once its bounding set is empty (inherited so: ``bounding_empty``).
        self.bounding_dropped = bounding_empty
        self.key = key if ahead is not None else None
        self.ahead_error: Exception | None = None  # entering ``ahead`` failed
        self._ahead = ahead
        self._go = _thread.allocate_lock()
        self._go.acquire()
        self._running = _thread.allocate_lock()  # held while the thread lives
        self._running.acquire()
        self._job: Callable[[], None] | None = None
        # Released by the thread once it waits for its job, everything ahead done (a
        # cgroup join can take a while: see `Spawner.take_spare`).
        self._setup = _thread.allocate_lock()
        self._setup.acquire()
        _thread.start_new_thread(self._main, ())

    def _main(self) -> None:
        # Emptying the bounding set is ~40 credential commits: done here, ahead of the job.
        if not self.bounding_dropped:
            try:
                self.bounding_dropped = namespaces.drop_bounding_set()
            except OSError as err:  # the job tries again, and fails the call if it must
                log.debug("spare thread kept its bounding set: %s", err.strerror)
        if self.cg is not None:
            try:
                self.cg.join_thread(self.version)
                self.joined = self.cg
            except OSError as err:  # the job joins (or fails) the usual way
                log.debug("spare thread could not join %s: %s", self.cg.path, err.strerror)
        if self._ahead is not None:
            try:
                self._ahead.enter(bounding_dropped=self.bounding_dropped)
            except Exception as err:  # the call fails as it would have, entering itself
                self.ahead_error = err
            finally:
                self._ahead.close()
        self._setup.release()
        self._go.acquire()
        try:
            if self._job is not None:
                self._job()
        finally:
            self._running.release()

    @property
    def ready(self) -> bool:
        """Whether the thread is waiting for its job, all it does ahead done."""
        return not self._setup.locked()

    def wait_ready(self, timeout: float) -> bool:
        if self._setup.acquire(timeout=timeout):
            self._setup.release()
            return True
        return False

    def run(self, job: Callable[[], None]) -> None:
        self._job = job
        self._go.release()

    def join(self, timeout: float) -> bool:
        """Wait (a bounded time; 0: not at all) for the thread to end, e.g. to leave its
        cgroup; whether it has."""
        if self._running.acquire(timeout=timeout) if timeout > 0 else self._running.acquire(False):
            self._running.release()
            return True
        return False


PLAIN_SPARES = 4
"""Plain spares kept (`Spawner`): the calls that may come within one cgroup join of an
idle machine (v1: ~8 ms), besides the one that takes the spare made for it."""


class Spawner:
    """The spawning threads of one executor: the spares; and the process non-dumpable.

    Spares wait: one that entered the sandbox of the last call ahead (`Prepared.key`), for
    the next call like it, which then only spawns; and up to `PLAIN_SPARES` plain ones,
    for any call (it enters in the spare's thread). Each has joined its cgroup ahead
    (v1). On a v1 hierarchy a join waits for an RCU grace period when none happened in
    the last few milliseconds: ~8 ms on a VM after 20 ms of idle, so a spare started
    by the first call of a round after a pause (an agent's tool calls after the model's
    answer) is still joining when the next calls come. They take the plain spares that
    are ready instead (`take_spare`; measured: the second call after a pause took 8-10
    ms with one plain spare, ~2 ms now). Making a ready plain spare enter the next
    call's sandbox at once, rather than starting a thread for it, was tried: it cost
    ~140 us of the server's CPU per call in a run of calls (not understood), so no.
    """

    def __init__(self, cgroups: CgroupBackend | None, *, mount_ns: bool = False) -> None:
        self.cgroups = cgroups
        self.mount_ns = namespaces.MountNsCache() if mount_ns else None
        # Made in the event loop's thread, which starts every spawning thread: when its
        # bounding set is empty (toolsrv empties it at start), theirs are too.
        self.bounding_empty = namespaces.bounding_set_empty()
        self._plain: list[Spare] = []
        self._ahead: Spare | None = None
        self._ending: list[Spare] = []  # told to end; their cgroups go back once they did
        # A spawning thread shares its tool's sandbox (Landlock domain) for the moments it
        # lives on after the spawn, and a tool may ptrace-attach, or open /proc/<pid>/mem
        # of, a process of its domain (seccomp refuses ptrace itself, not /proc): while
        # the process is non-dumpable that takes CAP_SYS_PTRACE, which tools lack. It was
        # made so around each spawn (two prctls a call); for the executor's life it costs
        # nothing, and it is no weaker (py-spy and gdb then need root).
        self._was_dumpable = _libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) == 1
        if self._was_dumpable:
            _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)

    def _new(self, max_procs: int, memory_max: int, ahead: Prepared | None = None) -> Spare:
        cg = None
        version = self.cgroups.version if self.cgroups is not None else 0
        if self.cgroups is not None and self.cgroups.joins_threads:
            try:
                cg = self.cgroups.acquire(max_procs, memory_max)
            except OSError as err:
                log.debug("no cgroup for the spare thread: %s", err.strerror)
        key = ahead.key() if ahead is not None else None
        copy = ahead.copy() if ahead is not None and key is not None else None
        try:
            return Spare(
                cg, version=version, bounding_empty=self.bounding_empty, ahead=copy, key=key
            )
        except BaseException:
            if copy is not None:
                copy.close()
            if cg is not None and self.cgroups is not None:
                self.cgroups.release(cg)
            raise

    def prestart(self, max_procs: int, ahead: Prepared | None = None, memory_max: int = 0) -> None:
        """Start the next spawning threads now, while a tool runs and the server waits:
        plain ones up to `PLAIN_SPARES`, and one that enters ``ahead`` (the sandbox of
        the call that just spawned) if the one waiting has another.

        Their cgroups get the limits of the call that just spawned (``max_procs``,
        ``memory_max``): the next call most likely has the same profile, and then finds
        its limits set (`CgroupBackend.set_limit` writes only what differs). Set to
        anything else, each call wrote the memory limits twice more (v1: four writes,
        memory and memory+swap, there and back; 5% of the server's CPU, profiled)."""
        self._reap()
        try:
            while len(self._plain) < PLAIN_SPARES:
                self._plain.append(self._new(max_procs, memory_max))
            key = ahead.key() if ahead is not None else None
            if key is not None and (self._ahead is None or self._ahead.key != key):
                old, self._ahead = self._ahead, None  # (ended once, whatever follows)
                if old is not None:
                    self._end(old)
                self._ahead = self._new(max_procs, memory_max, ahead)
        except (OSError, RuntimeError) as err:
            # Spares only save the next call some time: it makes its own thread instead.
            log.info("no spare spawning thread for the next call: %s", err)

    def take_spare(self, key: tuple[object, ...] | None = None) -> Spare | None:
        """The spare that entered the sandbox ``key`` ahead if it is ready; else a plain
        one that is (the call enters there: ~0.2 ms, against a join that may have
        milliseconds to go); else whichever will be ready first, the one made for
        ``key`` before a plain one."""
        ahead = self._ahead
        if key is None or ahead is None or ahead.key != key:
            ahead = None
        elif ahead.ready:
            self._ahead = None
            return ahead
        for i, plain in enumerate(self._plain):
            if plain.ready:
                return self._plain.pop(i)
        if ahead is not None:
            self._ahead = None
            return ahead
        return self._plain.pop(0) if self._plain else None

    def return_spare(self, spare: Spare) -> None:
        """A spare taken but not used: keep it for the next call, or end it."""
        if spare.key is None and len(self._plain) < PLAIN_SPARES:
            self._plain.append(spare)
        elif spare.key is not None and self._ahead is None:
            self._ahead = spare
        else:
            self._end(spare)

    def _end(self, spare: Spare) -> None:
        spare.run(lambda: None)
        if spare.cg is not None and self.cgroups is not None:
            self._ending.append(spare)  # v1 counts its thread in the cgroup until it ends

    def _reap(self, timeout: float = 0.0) -> None:
        """Give back the cgroups of ended spares (waiting ``timeout`` for each at most)."""
        left = []
        for spare in self._ending:
            if spare.join(timeout) and spare.cg is not None and self.cgroups is not None:
                self.cgroups.release(spare.cg)
            else:
                left.append(spare)
        self._ending = left

    def close(self) -> None:
        for spare in (*self._plain, self._ahead):
            if spare is not None:
                self._end(spare)
        self._plain, self._ahead = [], None
        self._reap(1.0)
        if self.mount_ns is not None:
            self.mount_ns.close()
        if self._was_dumpable:  # (every spawning thread is gone: `_reap` waited)
            _libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
            self._was_dumpable = False

    async def in_fresh_thread(self, fn: Callable[[Spare], _T], spare: Spare | None) -> _T:
        """Run ``fn`` in a new OS thread that ends with it: never trio's thread cache, which
        would hand the restricted thread to unrelated work afterwards. The wait is shielded:
        a spawn takes about a millisecond and its result must not be lost."""
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        result: list[_T] = []
        error: list[BaseException] = []
        ready = _thread.allocate_lock()
        ready.acquire()
        # [finished, the loop waits for done]: a spawn that ends while the loop still
        # blocks on ``ready`` needs no wakeup through trio (a write to its socket).
        state = [False, False]
        mutex = _thread.allocate_lock()
        thread = spare or Spare(bounding_empty=self.bounding_empty)

        def body() -> None:
            try:
                result.append(fn(thread))
            except BaseException as err:
                error.append(err)
            finally:
                with mutex:
                    state[0] = True
                    wake = state[1]
                ready.release()
                if wake:
                    with contextlib.suppress(trio.RunFinishedError):
                        token.run_sync_soon(done.set)
                else:
                    # The loop, woken, needs the GIL, which this thread would otherwise keep
                    # through its own end: hand it over now (60 us -> 20 us, measured).
                    time.sleep(0)

        thread.run(body)
        # A spawn takes ~0.3 ms. Waiting for it on a lock, with the event loop blocked, is
        # ~0.1 ms faster than a trio wakeup from another thread; a slow spawn (a mount
        # namespace, a binary on a slow filesystem) blocks the loop SPAWN_BLOCK at most and
        # is then awaited the trio way.
        if not ready.acquire(timeout=SPAWN_BLOCK):
            with mutex:
                state[1] = not state[0]
            if state[1]:
                with trio.CancelScope(shield=True):
                    await done.wait()
            else:
                ready.acquire()  # it finished meanwhile: released in a moment
        if error:
            raise error[0]
        return result[0]


def spawn_in_thread(
    thread: Spare,
    argv: list[str],
    cwd: str,
    env: dict[str, str],
    stdio: tuple[int, int, int],
    prepared: Prepared,
    cg: Cgroup | None,
    version: int,
    rlimits: list[tuple[int, int]],
) -> subprocess.Popen[bytes]:
    """The spawning thread: join the cgroup (v1), restrict itself, vfork+exec the tool.

    ``rlimits`` are per process, so the thread cannot pass them on: when there are any, the
    spawn forks and sets them in the child before exec (a Python ``preexec_fn``: a full
    fork of the server, ~2 ms, paid only by profiles with ``max_memory``, by servers
    without a memory cgroup and by non-root servers without a pids cgroup).
    """
    try:
        if cg is not None and thread.joined is not cg and (version == 1 or cg.mem_join_fd >= 0):
            cg.join_thread(version)
        if thread.key is None:
            prepared.enter(bounding_dropped=thread.bounding_dropped)
        elif thread.ahead_error is not None:  # (the caller checked: the same sandbox)
            raise SetupError(str(thread.ahead_error)) from thread.ahead_error
    except OSError as err:
        raise SetupError(str(err)) from err
    proc = subprocess.Popen(
        argv,
        stdin=stdio[0],
        stdout=stdio[1],
        stderr=stdio[2],
        cwd=cwd,
        env=env,
        close_fds=True,
        start_new_session=True,
        preexec_fn=partial(_set_rlimits, rlimits) if rlimits else None,
    )
    if cg is not None and version == 2:
        with contextlib.suppress(OSError):  # already gone
            os.write(cg.join_fd, str(proc.pid).encode())
    return proc


def _set_rlimits(rlimits: list[tuple[int, int]]) -> None:
    for res, value in rlimits:
        resource.setrlimit(res, (value, value))
