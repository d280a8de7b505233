"""The live primitives that blocking files wait on: ``GrowingLog`` and ``StateCell``.

Both the runtime (which appends and sets) and the tree (whose blocking reads wait) import
this module; it imports nothing of olliefs, so neither side has to know the other.

``GrowingLog`` is an append-only byte log whose readers wait on a
``trio.lowlevel.ParkingLot``: an append unparks every waiter at once, so a blocked
``cat stream`` is woken in the same scheduler tick as the token arrives, with no polling.

Memory stays bounded however long a log grows: when the log has a backing file, every
byte is written there as it is appended, only the newest ``window`` bytes stay in memory,
and reads of older bytes are served from the file (``pread``; the page cache makes that
as fast as memory for recently read parts). The backing file is a cache, not a record:
the journal is the record, and restoring a session renders its logs again from it, so the
file is never fsync'd. It is made when the log first outgrows twice its window (with
what the log held so far): most logs never do, and a restart that restored a thousand
sessions spent more time creating their files than doing anything else.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import trio

DEFAULT_WINDOW = 256 * 1024

log = logging.getLogger(__name__)


class GrowingLog:
    """Append-only bytes with a broadcast wake-up for readers waiting at the end."""

    def __init__(self, path: Path | None = None, window: int = DEFAULT_WINDOW) -> None:
        self._buf = bytearray()
        self._base = 0  # offset in the log of _buf[0]
        self._size = 0
        self._last = 0  # the last byte appended (0: none yet)
        self._lot = trio.lowlevel.ParkingLot()
        self._fd = -1
        self._path = path
        self._window = window
        self._holders = 0  # open handles reading the log
        self._finalizer: weakref.finalize[[int], None] | None = None
        self.closed = False
        self._discarded = False
        self.mtime = time.time()
        # Called once each at the next change of size or state, then dropped: the FUSE
        # frontend's cue to invalidate what the kernel caches of this log.
        self.observers: list[Callable[[], None]] = []

    def __len__(self) -> int:
        return self._size

    @property
    def waiting(self) -> int:
        """How many readers are parked at the end (for tests and stats)."""
        return len(self._lot)

    def _spill(self) -> None:
        """Make the backing file, holding every byte so far (the log outgrew its window)."""
        assert self._path is not None and self._base == 0
        try:
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except OSError as err:
            log.warning("log %s stays in memory: %s", self._path, err)
            self._path = None
            return
        # Closed when the last holder (the session, an open handle) lets go, or at
        # discard when no handle reads it: a session is often in a reference cycle,
        # and waiting for the garbage collector kept a removed session's files open
        # (and their disk space taken) for as long as the daemon stayed quiet.
        self._fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)  # type: ignore[arg-type]
        view = memoryview(self._buf)
        while view:
            view = view[os.write(fd, view) :]

    def append(self, data: bytes) -> None:
        if not data or self._discarded:
            return
        if self._fd < 0 and self._path is not None:
            if len(self._buf) + len(data) > 2 * self._window:
                self._spill()
        if self._fd >= 0:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            self._buf += data
            if len(self._buf) > 2 * self._window:
                cut = len(self._buf) - self._window
                del self._buf[:cut]
                self._base += cut
        else:
            self._buf += data
        self._size += len(data)
        self._last = data[-1]
        self.mtime = time.time()
        if self.observers:
            _notify(self)
        self._lot.unpark_all()

    def read(self, off: int, size: int) -> bytes:
        if off >= self._size or size <= 0:
            return b""
        if off >= self._base:
            return bytes(self._buf[off - self._base : off - self._base + size])
        # Older than the window: the backing file has every byte.
        return os.pread(self._fd, min(size, self._size - off), off)

    def endswith_newline(self) -> bool:
        return self._last == 0x0A

    def close(self) -> None:
        """Readers at the end get EOF from now on (the session is gone)."""
        self.closed = True
        if self.observers:
            _notify(self)
        self._lot.unpark_all()

    def discard(self) -> None:
        """Close, and give back the memory and the file's name (a killed session).

        Readers that still hold the log read on from the unlinked file, which the kernel
        frees when the last of them is gone; nothing more is appended.
        """
        self.close()
        self._discarded = True
        if self._fd < 0:
            if self._holders == 0:  # nobody reads it any more
                self._buf = bytearray()
                self._base = self._size
            return  # memory only: the bytes stay for those who hold the log
        self._buf = bytearray()
        self._base = self._size
        if self._path is not None:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
        if self._holders == 0:
            self._free()

    def hold(self) -> None:
        """An open handle reads the log: its file stays open until ``let_go``."""
        self._holders += 1

    def let_go(self) -> None:
        self._holders -= 1
        if self._holders == 0 and self._discarded:
            self._free()

    def _free(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # closes the descriptor once
        self._fd = -1

    async def wait(self) -> None:
        """Park until the next append or close. Callers re-check their condition."""
        await self._lot.park()


class StateCell:
    """A string value whose changes wake every waiter (no polling)."""

    def __init__(self, value: str = "idle") -> None:
        self.value = value
        # Counts changes, so a waiter sees idle -> thinking -> idle as a change even if it
        # looks only after the state came back (no lost wake-up).
        self.version = 0
        self.mtime = time.time()
        self._lot = trio.lowlevel.ParkingLot()
        self.observers: list[Callable[[], None]] = []  # as GrowingLog.observers

    @property
    def waiting(self) -> int:
        return len(self._lot)

    def set(self, value: str) -> bool:
        if value == self.value:
            return False
        self.value = value
        self.version += 1
        self.mtime = time.time()
        if self.observers:
            _notify(self)
        self._lot.unpark_all()
        return True

    def wake(self) -> None:
        """Wake waiters without a change (used when the session goes away)."""
        if self.observers:
            _notify(self)
        self._lot.unpark_all()

    async def wait(self) -> None:
        await self._lot.park()


def _notify(source: GrowingLog | StateCell) -> None:
    # Emptied first: an observer may register again for the change after this one.
    observers, source.observers = source.observers, []
    for observer in observers:
        observer()
