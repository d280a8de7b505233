"""Giving freed memory back to the system.

A long reply passes through the daemon as thousands of few-kilobyte pieces (SSE lines,
decoded deltas, events, journal records). Python frees them when the turn ends, but
glibc's allocator keeps the freed pages of its heap unless they sit at its very top, so
the daemon's resident set stayed at its high-water mark for good (a 10 MB reply: +47 MB,
never returned). ``malloc_trim(0)`` hands every free page back (glibc >= 2.8 releases
pages in the middle of the heap too). It walks the heap once, about a millisecond for
tens of megabytes, so it runs at the end of a turn and when a session is removed, not on
any hot path.

And taking memory from the system quickly: the daemon's heap is marked for transparent
huge pages (glibc's ``glibc.malloc.hugetlb=1`` tunable, which glibc reads only when a
program starts, so the daemon starts itself again with it: ``reexec_with_huge_pages``).
A 10 MB reply touches ~20 MB of fresh heap (the malloc_trim of the previous turn gave
the pages back); in 4 KiB pages that was ~5,000 page faults, a third of the daemon's
CPU for the reply (70 ms -> 47 ms per 10 MB on the bench VM). The tunable is taken
out of the environment again once the daemon runs, so toolsrv and the tools see the
user's environment.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)


def _load() -> ctypes.CDLL | None:
    # The C library as the interpreter has it loaded (CDLL(None): the program's own
    # symbols), not ctypes.util.find_library, which imports half the standard library
    # and runs ldconfig: ~30 ms of every daemon start.
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not hasattr(libc, "malloc_trim"):
        return None  # not glibc (musl has no heap to trim this way)
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


_libc = _load()


def give_back() -> None:
    """Return the allocator's free pages to the system (a no-op without glibc)."""
    if _libc is not None:
        _libc.malloc_trim(0)


TUNABLE = "glibc.malloc.hugetlb=1"
#: Set in the environment of a daemon started with TUNABLE: the GLIBC_TUNABLES it had
#: before ("" for none), put back by ``settle_environment``.
_WAS = "OLLIE_GLIBC_TUNABLES_WAS"
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_usable() -> bool:
    try:
        with open(_THP) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_page_environment(env: Mapping[str, str]) -> dict[str, str] | None:
    """``env`` for a daemon whose heap uses transparent huge pages; None when that does
    not apply: not glibc, THP off in the kernel, ``OLLIE_HUGEPAGES=0``, or ``env``
    already is such an environment."""
    if _libc is None or _WAS in env or env.get("OLLIE_HUGEPAGES", "1") == "0":
        return None
    if not _thp_usable():
        return None
    was = env.get("GLIBC_TUNABLES", "")
    new = dict(env)
    new["GLIBC_TUNABLES"] = f"{was}:{TUNABLE}" if was else TUNABLE
    new[_WAS] = was
    return new


def reexec_early(argv: Sequence[str]) -> None:
    """``reexec_with_huge_pages`` for a daemon's start (``mount -f`` or ``--ready-fd``),
    before the program imports anything else: started again later, it imported trio
    and the rest twice (~0.2 s of a mount). ``cmd_mount`` checks again, exactly, for
    the starts this quick look at the words misses."""
    if argv[:1] == ["mount"] and any(
        a in ("-f", "--foreground", "--ready-fd") or a.startswith("--ready-fd=") for a in argv[1:]
    ):
        reexec_with_huge_pages()


def reexec_with_huge_pages() -> None:
    """Start this program again, same pid and arguments, with ``huge_page_environment``
    (returns at once when it does not apply, or when the exec fails)."""
    env = huge_page_environment(os.environ)
    if env is None:
        return
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError as err:
        log.warning("huge pages for the heap: could not start again: %s", err)


def settle_environment() -> None:
    """Put GLIBC_TUNABLES back as it was before ``huge_page_environment``."""
    was = os.environ.pop(_WAS, None)
    if was is None:
        return
    if was:
        os.environ["GLIBC_TUNABLES"] = was
    else:
        os.environ.pop("GLIBC_TUNABLES", None)
