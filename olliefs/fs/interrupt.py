"""Ending a blocked read when its reader gets a signal, at no cost while nobody does.

A process blocked in ``read(2)`` on a FUSE file sits in the kernel until the daemon
answers. When a signal arrives the kernel sends FUSE_INTERRUPT for that one request; from
then on it waits only for the answer, so if the daemon did not answer, not even SIGKILL
would free the reader. Stock pyfuse3 drops FUSE_INTERRUPT; olliefs runs a pyfuse3 built
with a small patch (``.ci/pyfuse3/``) that publishes the request being served in
``pyfuse3.current_request``, with the caller's thread id and a place for what the
interrupt sets. The FUSE frontend hands that to this module (``serving``), and a blocked
read (``wait``) puts a hook there whose ``set()`` cancels the read's wait: it sleeps until
its data comes or the interrupt cancels it. No timer, no polling, no task of its own, so
a thousand idle readers cost nothing and a woken one goes on in the same scheduler pass.
(The read used to race its data against a task waiting on a ``trio.Event``; the
nursery that took was most of what waking a reader cost, and its end took a pass more.)

An interrupt does not say which signal came, and not every signal should end the read:

* a signal whose default action ends the process (SIGINT, SIGTERM, SIGHUP, SIGPIPE,
  SIGALRM, ...), SIGKILL, or any signal the reader catches with a handler (Python's
  KeyboardInterrupt, a shell's trap): the read fails with EINTR at once, the process
  dies or runs its handler;
* a stop signal (SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU: Ctrl-Z), or one whose default is to
  be ignored and that has no handler (SIGCHLD, SIGWINCH, SIGURG, SIGCONT): the read goes
  on waiting. Failing it would make ``cat stream`` exit with "Interrupted system call"
  on Ctrl-Z or on a terminal resize, and FUSE has no way to ask the kernel to restart
  the call after the stop.

Which signals are pending is read once, at the interrupt, from ``/proc/<tid>/status`` of
the thread that made the request (the pid in a FUSE request is the thread id): its own
pending set (``SigPnd``, where a fatal signal also leaves SIGKILL on every thread), the
process's shared one (``ShdPnd``), minus what the thread blocks (``SigBlk``) or the
process ignores (``SigIgn``); ``SigCgt`` tells caught from default.

The kernel sends FUSE_INTERRUPT only once per request. So a read that decided to go on
waiting would not hear of a later Ctrl-C or SIGKILL; from then on, and only for that
request, it looks at its thread's status every ``WATCH_PERIOD`` seconds until it ends.
That is the one place left that polls, and it costs something only for a reader that
was stopped (or resized) while blocked: the price of not failing ``cat`` on Ctrl-Z.

When the thread's status cannot be read (the reader lives in a pid namespace the daemon
does not see, so the request carries pid 0 or a number that names nobody here), the read
fails with EINTR at the interrupt: a reader that can always be killed is worth more than
one that survives Ctrl-Z.

Stock pyfuse3 (``olliefs.fs.patched``) drops FUSE_INTERRUPT and tells a read nothing of
its caller. There the frontend serves a blocked read with the thread that opened the file
(``Opener``) as its caller, and one task (``Watch``) looks at the pending signals of each
such thread every ``WATCH_PERIOD`` while a read of its files waits, one look per thread
for all its reads: a Ctrl-C of ``cat stream`` ends the read, but a reader that only
inherited the descriptor is not seen, and waits on until data comes. A thread that is gone
(its reader was a child that lives on) is no longer looked at: its reads wait on.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import weakref
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from typing import Protocol

import trio

from olliefs.errors import Interrupted

log = logging.getLogger(__name__)

WATCH_PERIOD = 0.1

# Signals that leave a blocked read waiting when they are the only ones pending: the
# stop signals, and those whose default action is to do nothing (unless caught).
STOP = frozenset({signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})
HARMLESS = frozenset({signal.SIGCHLD, signal.SIGWINCH, signal.SIGURG, signal.SIGCONT})


class Settable(Protocol):
    def set(self) -> None: ...


class Caller(Protocol):
    """The request being served, as a frontend knows it (``pyfuse3.RequestContext``).

    A waiting handler puts its own object in ``interrupted``: FUSE_INTERRUPT calls its
    ``set()``, at once if the interrupt came already. (A frontend that cannot tell of
    interrupts serves its waits with no caller.)"""

    @property
    def pid(self) -> int: ...

    @property
    def interrupted(self) -> Settable | None: ...

    @interrupted.setter
    def interrupted(self, value: Settable) -> None: ...


class _Hook:
    """What FUSE_INTERRUPT sets while a read waits: it cancels the wait's scope."""

    __slots__ = ("__weakref__", "came", "out", "scope")

    def __init__(self) -> None:
        self.came = False
        self.out = False  # the reader certainly wants out (``Watch`` looked already)
        self.scope: trio.CancelScope | None = None

    def set(self) -> None:
        self.came = True
        if self.scope is not None:
            self.scope.cancel()

    def leave(self) -> None:
        self.out = True
        self.set()


class Watch:
    """Looks, every ``WATCH_PERIOD``, at the pending signals of the threads that opened
    the files whose reads wait, for a pyfuse3 without FUSE_INTERRUPT (see the module).

    One system task, running only while some read waits; one look per thread a round,
    however many of its reads wait. The hooks are held weakly: a wait that ended for
    any other reason drops out by itself."""

    def __init__(self) -> None:
        self._hooks: dict[int, weakref.WeakSet[_Hook]] = {}
        self._running = False

    def add(self, tid: int, hook: _Hook) -> None:
        if tid <= 0:
            return  # a thread in a pid namespace the daemon does not see: no status
        self._hooks.setdefault(tid, weakref.WeakSet()).add(hook)
        if not self._running:
            self._running = True
            trio.lowlevel.spawn_system_task(self._run, name="olliefs.fs.interrupt.Watch")

    @property
    def watched(self) -> int:
        """How many threads are looked at (for tests)."""
        return len(self._hooks)

    async def _run(self) -> None:
        try:
            while self._hooks:
                await trio.sleep(WATCH_PERIOD)
                for tid, hooks in list(self._hooks.items()):
                    if not hooks:
                        del self._hooks[tid]
                        continue
                    status = thread_status(tid)
                    if status is None:  # gone: whoever reads now is not known here
                        del self._hooks[tid]
                    elif wants_out(status):
                        del self._hooks[tid]
                        for hook in list(hooks):
                            hook.leave()
        except Exception:  # a system task must not raise: it would end the daemon
            log.exception("watching blocked readers' signals failed")
        finally:
            self._running = False
            self._hooks.clear()


class Opener:
    """The caller of a read as stock pyfuse3 lets the frontend know it: the thread that
    opened the file (``Caller``). The hook a wait puts in ``interrupted`` is set by
    ``watch`` when that thread has a signal that needs it out."""

    __slots__ = ("pid", "watch")

    def __init__(self, pid: int, watch: Watch) -> None:
        self.pid = pid
        self.watch = watch

    @property
    def interrupted(self) -> Settable | None:
        return None

    @interrupted.setter
    def interrupted(self, value: Settable) -> None:
        assert isinstance(value, _Hook)
        self.watch.add(self.pid, value)


_caller: ContextVar[Caller | None] = ContextVar("olliefs.fs.caller", default=None)


@contextlib.contextmanager
def serving(caller: Caller | None) -> Iterator[None]:
    """Make ``caller`` the request that a ``wait`` in this block belongs to."""
    token = _caller.set(caller)
    try:
        yield
    finally:
        _caller.reset(token)


def _mask(line: str) -> int:
    return int(line.split(":", 1)[1].strip(), 16)


def wants_out(status: str) -> bool:
    """From the text of a ``/proc/<tid>/status``: does a pending signal need the thread
    back in user space (to die or to run a handler)?"""
    masks = dict.fromkeys(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"), 0)
    for line in status.splitlines():
        key = line.partition(":")[0]
        if key in masks:
            masks[key] = _mask(line)
    live = (masks["SigPnd"] | masks["ShdPnd"]) & ~masks["SigBlk"] & ~masks["SigIgn"]
    caught = masks["SigCgt"]
    sig = 0
    while live:
        sig += 1
        bit = 1 << (sig - 1)
        if not live & bit:
            continue
        live &= ~bit
        if sig == signal.SIGKILL or caught & bit:
            return True
        if sig in STOP or sig in HARMLESS:
            continue
        return True  # default action: terminate (or dump core)
    return False


def thread_status(tid: int) -> str | None:
    """The text of ``/proc/<tid>/status``; None when there is no such thread here."""
    if tid <= 0:
        return None
    try:
        with open(f"/proc/{tid}/status") as f:
            return f.read()
    except OSError:
        return None


def thread_wants_out(tid: int) -> bool:
    """``wants_out`` for a thread by id; True when its status cannot be read."""
    status = thread_status(tid)
    return status is None or wants_out(status)


async def wait(ready: Callable[[], bool], park: Callable[[], Awaitable[None]]) -> None:
    """Wait until ``ready()``, re-checking after each ``park()`` returns.

    Raises ``Interrupted`` when the request being served (``serving``) is interrupted by
    a signal that needs the reader back. Outside a request that can be interrupted it
    just waits.
    """
    caller = _caller.get()
    if caller is None:
        while not ready():
            await park()
        return
    hook = _Hook()
    caller.interrupted = hook  # FUSE_INTERRUPT calls hook.set() (at once if it came)
    watching = False
    while not ready():
        if not hook.came:
            with trio.CancelScope() as hook.scope:
                await park()
            hook.scope = None
            continue
        # Interrupted (the check runs at once, then every WATCH_PERIOD: see the module).
        if hook.out or thread_wants_out(caller.pid):
            raise Interrupted("interrupted")
        if not watching:
            watching = True
            log.info("blocked read of thread %d: stopped or ignored signal, waiting on", caller.pid)
        with trio.move_on_after(WATCH_PERIOD):
            await park()
