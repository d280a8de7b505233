"""The keeper: the tools of a toolsrv die with it, whatever killed it.

toolsrv forks once at start, before any thread exists. The parent becomes the *keeper*: a
few lines of Python that wait for the child, the actual server. Both are child subreapers,
the server nearer: while it lives, orphaned tool processes come back to it (and its reaper
deals with them); once it dies, however it died (SIGKILL, the OOM killer, a crash), every
process it left is re-parented to the keeper instead of init. The keeper then SIGKILLs its
children, round after round (a killed process's own children come back to it in turn), until
none is left, reaps them, and exits. Nothing escapes by setsid() or double forks: every
descendant of the server is a descendant of the keeper.

The other way round, the server has PR_SET_PDEATHSIG = SIGTERM: if the keeper is killed,
the server shuts down as on SIGTERM and its own cleanup kills every call. Only a SIGKILL of
both at the same instant (``kill -9`` of the process group) leaves tools running; the pids
cgroups of those calls are then removed, their processes killed, by the next toolsrv.

The daemon spawned (and waits for) the keeper, so it sees toolsrv gone only once the tools
are gone too.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
from typing import NoReturn

from toolsrv.exec.reaper import PR_SET_CHILD_SUBREAPER, children

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def split(socket: str) -> None:
    """Fork: returns in the server (the child); the keeper (the parent) never returns.

    ``socket`` is the server's: the keeper removes it once the server is gone."""
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    keeper = os.getpid()
    server = os.fork()
    if server == 0:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != keeper:  # the keeper died before the line above
            os._exit(1)
        return
    keep(server, socket)


def keep(server: int, socket: str) -> NoReturn:
    """Wait for ``server``, then kill and reap whatever is left below us, and exit."""
    # The pipes the spawner gave us are the server's: holding them would hide its death
    # (no EOF on stdout if it dies before saying ready).
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    status = 0
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == server:
            break
    # The socket goes first: the daemon takes its absence for "the server is gone" and
    # waits for us to end before it spawns the next one.
    with contextlib.suppress(OSError):
        os.unlink(socket)
    killed = kill_all()
    code = os.waitstatus_to_exitcode(status)
    if code < 0 or killed:
        how = f"signal {-code}" if code < 0 else f"status {code}"
        log.warning(
            "toolsrv server (pid %d) ended by %s; killed %d processes it left", server, how, killed
        )
    os._exit(128 - code if code < 0 else code)


def kill_all() -> int:
    """SIGKILL and reap every descendant, round after round; how many were killed."""
    killed = 0
    while kids := children():
        for pid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        with contextlib.suppress(ChildProcessError):
            os.waitpid(-1, 0)
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
    return killed
