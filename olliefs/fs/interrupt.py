"""Is the process behind a blocked read being signalled?

pyfuse3 never delivers FUSE INTERRUPT, so a reader blocked in ``read(2)`` on a FUSE file
would sit in the kernel until the daemon answers, Ctrl-C or not. The kernel does show the
signal, though, in ``/proc/<pid>/status``: a fatal signal (default SIGINT, SIGTERM, SIGKILL)
is queued as a pending SIGKILL on every thread, the main one included (``SigPnd``), and a
process-directed signal that the reader catches (Ctrl-C on a terminal, ``kill``, SIGALRM)
stays in the shared queue (``ShdPnd``) until the syscall returns. A pending signal that is
not blocked means the reader wants out, and the blocked read gives up with EINTR.

Only the thread-group leader's status is read: reading every thread's would cost
(threads x blocked reads) per tick, which a thousand reader threads of one process turn
into a stall. A signal aimed at one particular non-main thread (``pthread_kill``) is
therefore not seen; the signals a shell or a terminal sends always are.

The pid is the one that opened the file. A reader that inherited the descriptor from its
opener (a forked child) is only seen while the opener lives; when the opener is gone the
read is ended as well, since nobody can tell whether its reader still wants it.

Many reads blocked by the same process share one look per ``CACHE_SECONDS``.
"""

from __future__ import annotations

import time

CACHE_SECONDS = 0.05

_cache: dict[int, tuple[float, bool]] = {}


def _mask(line: str) -> int:
    return int(line.split(":", 1)[1].strip(), 16)


def signalled(status: str) -> bool:
    """From the text of a ``/proc/<pid>/status``: is an unblocked signal pending?"""
    pending = shared = blocked = 0
    for line in status.splitlines():
        if line.startswith("SigPnd:"):
            pending = _mask(line)
        elif line.startswith("ShdPnd:"):
            shared = _mask(line)
        elif line.startswith("SigBlk:"):
            blocked = _mask(line)
    return bool((pending | shared) & ~blocked)


def _look(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
    except FileNotFoundError:
        return True  # the reader is gone
    except OSError:
        return False
    return signalled(status) or "\nState:\tZ" in status


def signal_pending(pid: int) -> bool:
    """True when ``pid`` has an unblocked pending signal, or is gone."""
    if pid <= 0:
        return False
    now = time.monotonic()
    hit = _cache.get(pid)
    if hit is not None and now - hit[0] < CACHE_SECONDS:
        return hit[1]
    if len(_cache) > 1024:
        _cache.clear()
    result = _look(pid)
    _cache[pid] = (now, result)
    return result
