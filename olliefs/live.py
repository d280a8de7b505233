"""The live primitives that blocking files wait on: ``GrowingLog`` and ``StateCell``.

Both the runtime (which appends and sets) and the tree (whose blocking reads wait) import
this module; it imports nothing of olliefs, so neither side has to know the other.

``GrowingLog`` is an append-only byte log whose readers wait on a
``trio.lowlevel.ParkingLot``: an append unparks every waiter at once, so a blocked
``cat stream`` is woken in the same scheduler tick as the token arrives, with no polling.

Memory stays bounded however long a log grows: when the log has a backing file, only the
newest bytes stay in memory (``window`` to twice that), everything older is in the file,
and reads of older bytes are served from there (``pread``; the page cache makes that as
fast as memory for recently read parts; a disk too full to take them leaves them in
memory until it does). Bytes go to the file when they leave memory, a
window's worth in one write, not as they are appended: a streamed reply is one append
per network read to ``chat``, ``events`` and the root ``events``, and a write per append
to each of their files was a tenth of what a token cost the daemon. The backing file is
a cache, not a record: the journal is the record, and restoring a session renders its
logs again from it, so the file is never fsync'd. It is made when the log first outgrows
twice its window: most logs never do, and a restart that restored a thousand sessions
spent more time creating their files than doing anything else.

In memory a log is a list of the byte strings appended (small ones merged), not one
buffer: an append keeps the caller's bytes as they are (a bytearray copied every append,
and moved its whole window after each spill), a spill is one ``pwritev`` of whole
pieces, and a reader at the end, who asks for what was appended since its last read,
is most often handed a piece as it is.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import trio

log = logging.getLogger(__name__)

DEFAULT_WINDOW = 256 * 1024
MERGE = 4096  # appends are merged into the last piece while it is smaller than this


class GrowingLog:
    """Append-only bytes with a broadcast wake-up for readers waiting at the end."""

    def __init__(self, path: str | Path | None = None, window: int = DEFAULT_WINDOW) -> None:
        self._pieces: list[bytes] = []  # the bytes in memory, oldest first
        self._starts: list[int] = []  # offset in the log of each piece
        self._base = 0  # offset in the log of the first byte in memory
        self._size = 0
        self._last = 0  # the last byte appended (0: none yet)
        self._lot = trio.lowlevel.ParkingLot()
        self._fd = -1
        self._path = path
        self._window = window
        self._spill_at = 0  # after a failed spill: no new try before the log is this long
        self._merge = min(MERGE, window)
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

    def append(self, data: bytes) -> None:
        if not data or self._discarded:
            return
        pieces = self._pieces
        if pieces and len(pieces[-1]) < self._merge and len(data) < self._merge:
            pieces[-1] += data
        else:
            pieces.append(bytes(data))
            self._starts.append(self._size)
        self._size += len(data)
        if (
            self._path is not None
            and self._size - self._base > 2 * self._window
            and self._size >= self._spill_at
        ):
            self._spill(self._size - self._window)
        self._last = data[-1]
        self.mtime = time.time()
        if self.observers:
            _notify(self)
        self._lot.unpark_all()

    def _open(self) -> bool:
        """Make the backing file (the log outgrew its window for the first time)."""
        assert self._path is not None
        try:
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except OSError as err:
            log.warning("log %s stays in memory: %s", self._path, err)
            self._path = None
            return False
        # Closed when the last holder (the session, an open handle) lets go, or at
        # discard when no handle reads it: a session is often in a reference cycle,
        # and waiting for the garbage collector kept a removed session's files open
        # (and their disk space taken) for as long as the daemon stayed quiet.
        self._fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)  # type: ignore[arg-type]
        return True

    def _spill(self, upto: int) -> bool:
        """Move the pieces that end at or before ``upto`` to the backing file; False if
        the file could not take them (they stay in memory)."""
        if self._fd < 0 and not self._open():
            return False
        if upto >= self._size:
            k, end = len(self._pieces), self._size
        else:
            k = bisect.bisect_right(self._starts, upto) - 1  # pieces before k: wholly old
            if k <= 0:
                return True
            end = self._starts[k]
        out, at = self._pieces[:k], self._base
        try:
            while at < end:  # pwritev may write less than asked: go on from where it stopped
                done = os.pwritev(self._fd, out, at)
                at += done
                while out and done >= len(out[0]):
                    done -= len(out[0])
                    out.pop(0)
                if done:
                    out[0] = out[0][done:]
        except OSError as err:
            # A full disk: the bytes stay in memory (the file is only a cache), and the
            # next try waits until the log has grown by another window.
            if self._spill_at == 0:
                log.warning("log %s stays in memory for now: %s", self._path, err)
            self._spill_at = self._size + self._window
            return False
        if self._spill_at:
            log.warning("log %s written again", self._path)
            self._spill_at = 0
        del self._pieces[:k]
        del self._starts[:k]
        self._base = end
        return True

    def read(self, off: int, size: int) -> bytes:
        """``size`` bytes from ``off``, fewer only at the end: a short read in a file
        without direct_io is taken by the kernel as its end."""
        if off >= self._size or size <= 0:
            return b""
        if off < self._base:  # older than what memory holds: the backing file has it
            old = b""
            while off + len(old) < self._base and len(old) < size:
                more = os.pread(self._fd, min(size, self._base - off) - len(old), off + len(old))
                if not more:
                    break
                old += more
            return old + self.read(off + len(old), size - len(old)) if len(old) < size else old
        i = bisect.bisect_right(self._starts, off) - 1
        piece, rel = self._pieces[i], off - self._starts[i]
        if rel == 0 and size >= len(piece) and i == len(self._pieces) - 1:
            return piece  # a reader at the end, given what came since: no copy
        if rel + size <= len(piece):
            return piece[rel : rel + size]
        out = [piece[rel:]]
        got = len(out[0])
        for piece in self._pieces[i + 1 :]:
            if got >= size:
                break
            out.append(piece[: size - got])
            got += len(out[-1])
        return b"".join(out)

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
        if self._fd < 0:  # memory only: the bytes stay for those who hold the log
            if self._holders == 0:  # nobody reads it any more
                self._pieces, self._starts = [], []
                self._base = self._size
            return
        # They read on from the file; or, when the disk cannot take the rest, from memory.
        if self._holders == 0 or self._spill(self._size):
            self._pieces, self._starts = [], []
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
