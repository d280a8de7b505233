"""Giving freed memory back to the system.

A long reply passes through the daemon as thousands of few-kilobyte pieces (SSE lines,
decoded deltas, events, journal records). Python frees them when the turn ends, but
glibc's allocator keeps the freed pages of its heap unless they sit at its very top, so
the daemon's resident set stayed at its high-water mark for good (a 10 MB reply: +47 MB,
never returned). ``malloc_trim(0)`` hands every free page back (glibc >= 2.8 releases
pages in the middle of the heap too). It walks the heap once, about a millisecond for
tens of megabytes, so it runs at the end of a turn and when a session is removed, not on
any hot path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)


def _load() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "malloc_trim"):
        return None  # not glibc (musl has no heap to trim this way)
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


_libc = _load()


def give_back() -> None:
    """Return the allocator's free pages to the system (a no-op without glibc)."""
    if _libc is not None:
        _libc.malloc_trim(0)
