"""Is the process behind a blocked read being signalled?

pyfuse3 never delivers FUSE INTERRUPT, so a reader blocked in ``read(2)`` on a FUSE file
would sit in the kernel until the daemon answers, Ctrl-C or not. The kernel does show the
signal, though: a fatal signal (default SIGINT, SIGTERM, SIGKILL) is queued as a pending
SIGKILL on the whole thread group, and a caught signal stays pending until the syscall
returns. So a blocked read looks at ``/proc/<pid>/task/*/status`` for a pending signal that
is not blocked (``SigPnd``/``ShdPnd`` against ``SigBlk``) and gives up with EINTR.

The pid is the one that opened the file. A reader that inherited the descriptor from its
opener (a forked child) is only seen while the opener lives; when the opener is gone the
read is ended as well, since nobody can tell whether its reader still wants it.
"""

from __future__ import annotations

import os


def _mask(line: str) -> int:
    return int(line.split(":", 1)[1].strip(), 16)


def _thread_signalled(status: str) -> bool:
    pending = shared = blocked = 0
    for line in status.splitlines():
        if line.startswith("SigPnd:"):
            pending = _mask(line)
        elif line.startswith("ShdPnd:"):
            shared = _mask(line)
        elif line.startswith("SigBlk:"):
            blocked = _mask(line)
    return bool((pending | shared) & ~blocked)


def signal_pending(pid: int) -> bool:
    """True when any thread of ``pid`` has an unblocked pending signal, or pid is gone."""
    if pid <= 0:
        return False
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                if _thread_signalled(f.read()):
                    return True
        except OSError:
            continue
    return False
