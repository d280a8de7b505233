"""Whole 9P frames over a trio stream: the only part of the wire layer that does I/O.

``ninep.codec`` is pure (bytes in, messages out, and ``FrameBuffer`` for splitting a byte
stream into frames), so it can be used and tested without an event loop and imported by
code that never touches trio. This module puts it on a stream: ``Transport`` reads
bytes into a ``FrameBuffer`` until a whole frame is there, and writes frames so that a
cancellation never leaves half of one on the wire. The server's and the client's loops
both use it, so the framing rules (a size below the header or above msize is a
violation, end of stream inside a frame is a broken peer) are the same at both ends.
"""

from __future__ import annotations

import errno
import os

import trio

from ninep.codec import FrameBuffer


class Transport:
    """Whole frames over a trio stream, for the server's and the client's loops.

    Unix sockets are the transport that matters (toolsrv, the tool client), and trio's
    generic ``SocketStream`` path costs several context managers per call; for a
    ``trio.SocketStream`` this reads and writes its (already non-blocking) fd directly,
    waiting with ``trio.lowlevel.wait_readable/wait_writable`` only when the kernel says
    so. Any other stream goes through ``receive_some``/``send_all``. Errors are trio's:
    ``BrokenResourceError`` for a dead peer, ``ClosedResourceError`` once closed.
    """

    RECV_SIZE = 1 << 16

    __slots__ = ("_drained", "_fd", "frames", "stream")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.frames = FrameBuffer()
        self._fd = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else -1
        self._drained = False

    async def receive(self) -> bytes:
        """Some bytes, b"" at end of stream. A checkpoint, like ``receive_some``."""
        fd = self._fd
        if fd < 0:
            return bytes(await self.stream.receive_some(self.RECV_SIZE))
        if not self._drained:
            # The last read filled the buffer: more is probably waiting already.
            try:
                data = os.read(fd, self.RECV_SIZE)
            except BlockingIOError:
                pass
            except OSError as err:
                raise _stream_error(err) from err
            else:
                self._drained = len(data) < self.RECV_SIZE
                # Yield, but never raise Cancelled here: that would lose ``data``.
                await trio.lowlevel.cancel_shielded_checkpoint()
                return data
        while True:
            await trio.lowlevel.wait_readable(fd)
            try:
                data = os.read(fd, self.RECV_SIZE)
            except BlockingIOError:
                continue
            except OSError as err:
                raise _stream_error(err) from err
            self._drained = len(data) < self.RECV_SIZE
            return data

    async def next_frame(self, limit: int) -> bytes | None:
        """The next whole frame (ProtocolError past ``limit``), None at a clean end of
        stream; BrokenResourceError if the stream ends inside a frame."""
        frames = self.frames
        while True:
            frame = frames.next_frame(limit)
            if frame is not None:
                return frame
            data = await self.receive()
            if not data:
                if len(frames):
                    raise trio.BrokenResourceError("end of stream inside a frame")
                return None
            frames.feed(data)

    async def send(self, data: bytes, *, shield_for: float | None = None) -> None:
        """Send all of ``data``; not a checkpoint when the kernel takes it at once.

        If it must wait for room, a cancellation could cut a frame in half: with
        ``shield_for`` the rest is sent shielded, for at most that many seconds
        (BrokenResourceError after that: the stream is then unusable anyway).
        """
        fd = self._fd
        sent = 0
        if fd >= 0:
            try:
                sent = os.write(fd, data)
            except BlockingIOError:
                pass
            except OSError as err:
                raise _stream_error(err) from err
            if sent == len(data):
                return
        if shield_for is None:
            await self._send_rest(data, sent)
            return
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + shield_for
            await self._send_rest(data, sent)
        if scope.cancelled_caught:
            raise trio.BrokenResourceError("send timed out")

    async def _send_rest(self, data: bytes, sent: int) -> None:
        fd = self._fd
        if fd < 0:
            await self.stream.send_all(data)
            return
        view = memoryview(data)
        while sent < len(data):
            await trio.lowlevel.wait_writable(fd)
            try:
                sent += os.write(fd, view[sent:])
            except BlockingIOError:
                continue
            except OSError as err:
                raise _stream_error(err) from err


def _stream_error(err: OSError) -> trio.BrokenResourceError | trio.ClosedResourceError:
    if err.errno == errno.EBADF:
        return trio.ClosedResourceError("the stream was closed")
    return trio.BrokenResourceError(f"{err.strerror or err}")


__all__ = ["Transport"]
