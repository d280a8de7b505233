"""A call's pipes: stdin fed, stdout and stderr captured up to a cap, the leader's exit."""

from __future__ import annotations

import errno
import os
import select
import threading

import trio

CHUNK = 65536


class Capture:
    """One output stream: ``cap`` bytes kept, the rest read and counted, never stored, so a
    chatty tool never blocks on a full pipe and the server's memory stays bounded."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.buf = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.buf)
        if room > 0:
            self.buf += chunk[:room]
        self.dropped += max(0, len(chunk) - max(room, 0))


class Watch:
    """The call's pipes and its exit fd in one epoll set, serviced by the calling task.

    One trio wait per wakeup instead of a task and a stream per pipe: on the fast path a
    call's cost is mostly such scheduling rounds. Reads are bounded per wakeup, so a tool
    writing as fast as we read cannot keep the loop from its checkpoint (and its timeout).
    """

    def __init__(
        self,
        out_r: int,
        err_r: int,
        in_w: int | None,
        rest: memoryview,
        exit_fd: int,
        cap: int,
        held: tuple[int, ...] = (),
    ) -> None:
        """``held``: our copies of the pipes' write ends, kept open (and closed here) so
        that the pipes give no EOF before the leader's exit (`release`): a tool's exit
        then wakes the server once, not three times (stdout closed, stderr closed, gone)."""
        self.ep = select.epoll()
        self.held = list(held)
        self.out, self.err = Capture(cap), Capture(cap)
        self.readers = {out_r: self.out, err_r: self.err}
        self.writer, self.rest = in_w, rest
        self.exit_fd: int | None = exit_fd
        self.exited = False
        self._nowait = True  # reads past the first of a wakeup ask for RWF_NOWAIT
        for fd in (out_r, err_r):
            # Left blocking: the first read after epoll says readable cannot block, and
            # further ones (a chatty tool) say RWF_NOWAIT; two ioctls a call saved.
            self.ep.register(fd, select.EPOLLIN)
        self.ep.register(exit_fd, select.EPOLLIN)
        if in_w is not None:
            self.ep.register(in_w, select.EPOLLOUT)

    async def pump(self, *, until_exit: bool) -> None:
        """Move data until the leader has exited, or (``until_exit`` false) until EOF on
        both pipes, which comes once every process holding them is dead."""
        while not self.exited if until_exit else self.readers:
            await trio.lowlevel.wait_readable(self.ep.fileno())
            for fd, _events in self.ep.poll(0):
                if fd == self.exit_fd:
                    self.exited = True
                    self.forget_exit()
                elif fd == self.writer:
                    self._write()
                elif fd in self.readers:
                    self._read(fd)

    def release(self) -> None:
        """Close our write ends: EOF comes once no process of the call holds the pipes."""
        for fd in self.held:
            os.close(fd)
        self.held.clear()

    def drain(self) -> None:
        """Read what the pipes hold, without waiting (after `release`, and the call's
        processes dead, that is usually all of it, up to EOF)."""
        for fd in list(self.readers):
            capture = self.readers[fd]
            while True:
                try:
                    chunk = self._more(fd)
                except BlockingIOError:
                    break
                if not chunk:
                    os.close(fd)
                    del self.readers[fd]
                    break
                capture.add(chunk)

    def forget_exit(self) -> None:
        """Stop watching the exit fd (its owner closes it)."""
        if self.exit_fd is not None:
            self.ep.unregister(self.exit_fd)
            self.exit_fd = None

    def _read(self, fd: int) -> None:
        capture = self.readers[fd]
        chunk = os.read(fd, CHUNK)  # readable (epoll said so, and only we read it)
        for _ in range(16):
            if not chunk:
                os.close(fd)  # (which takes it out of the epoll set)
                del self.readers[fd]
                return
            capture.add(chunk)
            if len(chunk) < CHUNK:
                return
            try:
                chunk = self._more(fd)
            except BlockingIOError:
                return

    def _more(self, fd: int) -> bytes:
        """Another read, which must not block (BlockingIOError if nothing is there)."""
        if self._nowait:
            buf = bytearray(CHUNK)
            try:
                return bytes(buf[: os.preadv(fd, [buf], -1, os.RWF_NOWAIT)])
            except OSError as err:
                if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                self._nowait = False  # a kernel without RWF_NOWAIT on pipes
        for reader in self.readers:
            os.set_blocking(reader, False)
        return os.read(fd, CHUNK)

    def _write(self) -> None:
        """Stdin that did not fit in the pipe up front. A tool that exits without reading
        it gives EPIPE: the rest is dropped."""
        assert self.writer is not None
        try:
            self.rest = self.rest[os.write(self.writer, self.rest) :]
        except BlockingIOError:
            return
        except OSError:
            self.rest = self.rest[:0]
        if not self.rest:
            self.ep.unregister(self.writer)
            os.close(self.writer)
            self.writer = None

    def close(self) -> None:
        self.release()
        trio.lowlevel.notify_closing(self.ep.fileno())
        self.ep.close()
        for fd in [*self.readers, *([self.writer] if self.writer is not None else [])]:
            os.close(fd)
        self.readers.clear()
        self.writer = None


def prefill(fd: int, data: bytes) -> memoryview:
    """Put as much stdin as fits in the pipe before the spawn (usually all of it, so no
    writer task is needed); return the rest."""
    view = memoryview(data)
    if not view:
        return view
    if len(view) <= select.PIPE_BUF:
        # Into an empty pipe, whatever its size: written whole, at once (one syscall).
        return view[os.write(fd, view) :]
    os.set_blocking(fd, False)
    try:
        n = os.write(fd, view)
    except BlockingIOError:
        n = 0
    return view[n:]


def exit_fd(pid: int) -> int:
    """An fd that becomes readable when the leader exits: its pidfd, or on kernels before
    5.3 a pipe closed by a thread blocked in waitid() (WNOWAIT: reaping stays ours)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        pass
    r, w = os.pipe2(os.O_CLOEXEC)

    def wait() -> None:
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        finally:
            os.close(w)

    threading.Thread(target=wait, name=f"toolsrv-wait-{pid}", daemon=True).start()
    return r
