"""A multiplexing 9P2000 client for trio.

Many tasks share one connection: each request gets a tag, one reader task hands every
reply to the task waiting on its tag, and nothing else is spawned per request (the
calling task encodes and sends its own frame), because a tool call is a dozen round
trips and each one should cost little more than the socket.

Cancelling a task that waits for a reply does what 9P says it should (flush(5)): the
client sends Tflush(oldtag) and, shielded and for at most ``FLUSH_TIMEOUT`` seconds,
waits for Rflush before the tag is used again. The server cancels the work (that is how
a ``stop`` reaches a blocked tool read). If the original reply wins the race its effect
is honoured: a walk or attach that did create its fid gets that fid clunked.

Fids are numbers the client allocates and reuses; a fid number is free again only once
the server has answered its Tclunk/Tremove, so a reused number never races its old clunk.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar

import trio

from ninep.codec import (
    ENOTFOUND,
    IOHDRSZ,
    MAXWELEM,
    NOFID,
    NOTAG,
    OREAD,
    OTRUNC,
    OWRITE,
    VERSION,
    Message,
    NinePError,
    ProtocolError,
    Qid,
    Rattach,
    Rclunk,
    Rcreate,
    Rerror,
    Ropen,
    Rread,
    Rremove,
    Rstat,
    Rversion,
    Rwalk,
    Rwrite,
    Rwstat,
    Stat,
    Tattach,
    Tclunk,
    Tcreate,
    Tflush,
    Topen,
    Tread,
    Tremove,
    Tstat,
    Tversion,
    Twalk,
    Twrite,
    Twstat,
    decode,
    decode_stats,
    encode,
)
from ninep.transport import Transport

DEFAULT_MSIZE = (1 << 16) + IOHDRSZ  # 64 KiB of payload per read/write
FLUSH_TIMEOUT = 5.0  # seconds a cancelled call waits for Rflush (shielded)
SEND_TIMEOUT = 30.0  # seconds a shielded send may take before the connection is dropped
_MAX_TAG = NOTAG - 1
_R = TypeVar("_R", bound=Message)


class ConnectionLost(NinePError):
    """The connection is gone: every pending and later call raises this."""

    def __init__(self, why: str = "connection lost") -> None:
        super().__init__(why)


def split_path(path: str) -> list[str]:
    """``"a/b//c/"`` -> ``["a", "b", "c"]``; ``.`` elements are dropped, ``..`` kept."""
    return [p for p in path.split("/") if p and p != "."]


class _Slot:
    """A tag waiting for its reply. ``callback`` set: nobody waits, the reader handles it."""

    __slots__ = ("callback", "event", "reply")

    def __init__(self, callback: Callable[[Message], None] | None = None) -> None:
        self.event = trio.Event()
        self.reply: Message | None = None
        self.callback = callback


def _ignore(_: Message) -> None:
    return None


def _reply_of(slot: _Slot) -> Message | None:
    return slot.reply


class Client:
    """One 9P2000 session. Make it with ``Client.connect`` or ``Client.connect_unix``."""

    def __init__(self, stream: trio.abc.Stream, msize: int) -> None:
        self._stream = stream
        self.msize = msize
        self._slots: dict[int, _Slot] = {}
        self._free_tags: list[int] = []
        self._next_tag = 0
        self._free_fids: list[int] = []
        self._next_fid = 0
        self._send_lock = trio.Lock()
        self._outbox: list[bytes] = []
        self._outbox_lot = trio.lowlevel.ParkingLot()
        self._lost: ConnectionLost | None = None
        self._transport = Transport(stream)
        # What this session cost the wire: requests (T-messages, each with its tag) and
        # sends (writes to the stream, each carrying one request or several together).
        # Read by tests that hold a call to its count of messages and round trips.
        self.requests = 0
        self.sends = 0

    # ---- life -------------------------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def connect(
        cls, stream: trio.abc.Stream, *, msize: int = DEFAULT_MSIZE
    ) -> AsyncIterator[Client]:
        """Negotiate the version on ``stream`` and serve replies until the block ends.

        The negotiated msize is ``min(msize, server's)``. The stream is closed at the end.
        """
        try:
            client = cls(stream, msize)
            await client._handshake(msize)
            body_exc: BaseException | None = None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client._reader)
                nursery.start_soon(client._flusher)
                try:
                    yield client
                except BaseException as exc:
                    # Re-raised below, outside the nursery, so callers see their own
                    # exception rather than an ExceptionGroup around it.
                    body_exc = exc
                finally:
                    client._fail(ConnectionLost("client closed"))
                    nursery.cancel_scope.cancel()
            if body_exc is not None:
                raise body_exc
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()

    @classmethod
    @asynccontextmanager
    async def connect_unix(cls, path: str, *, msize: int = DEFAULT_MSIZE) -> AsyncIterator[Client]:
        """``connect`` over a fresh connection to the unix socket at ``path``."""
        stream = await trio.open_unix_socket(path)
        async with cls.connect(stream, msize=msize) as client:
            yield client

    @property
    def lost(self) -> ConnectionLost | None:
        """Why the connection is gone, or None while it is usable."""
        return self._lost

    @property
    def iounit(self) -> int:
        """Payload bytes that fit in one read or write."""
        return self.msize - IOHDRSZ

    async def _handshake(self, msize: int) -> None:
        """Tversion/Rversion. Whatever goes wrong is a NinePError (ConnectionLost when
        the peer is gone or is not a 9P2000 server), so callers need one except."""
        try:
            await self._transport.send(encode(Tversion(NOTAG, msize, VERSION)))
            frame = await self._transport.next_frame(msize)
            if frame is None:
                raise ConnectionLost("connection closed during version negotiation")
            reply = decode(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as err:
            raise ConnectionLost(f"connection lost during version negotiation: {err}") from None
        except ProtocolError as err:
            raise ConnectionLost(f"not a 9P2000 server: {err}") from None
        if isinstance(reply, Rerror):
            raise NinePError(reply.ename)
        if not isinstance(reply, Rversion) or reply.tag != NOTAG:
            raise ConnectionLost(f"not a 9P2000 server: it answered {type(reply).__name__}")
        if reply.version != VERSION:
            raise NinePError(f"server does not speak {VERSION} (it said {reply.version!r})")
        if reply.msize > msize or reply.msize <= IOHDRSZ:
            raise ConnectionLost(f"not a 9P2000 server: impossible msize {reply.msize}")
        self.msize = reply.msize

    def _fail(self, exc: ConnectionLost) -> None:
        """The connection is gone: wake every waiter; later calls fail at once."""
        if self._lost is None:
            self._lost = exc
        slots = list(self._slots.values())
        self._slots.clear()
        for slot in slots:
            slot.event.set()
        self._outbox.clear()
        self._outbox_lot.unpark_all()

    async def _reader(self) -> None:
        transport = self._transport
        slots = self._slots
        why = "connection closed by the server"
        try:
            while True:
                frame = await transport.next_frame(self.msize)
                if frame is None:
                    break
                msg = decode(frame)
                slot = slots.pop(msg.tag, None)
                if slot is None:
                    raise ProtocolError(f"reply with tag {msg.tag} that nobody asked for")
                if slot.callback is not None:
                    self._free_tag(msg.tag)
                    slot.callback(msg)
                else:
                    slot.reply = msg
                    slot.event.set()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as err:
            why = f"connection lost: {err}"
        except ProtocolError as err:
            why = f"protocol error from the server: {err}"
        self._fail(ConnectionLost(why))

    async def _flusher(self) -> None:
        """Sends what ``clunk_nowait`` queued when no other send took it along."""
        while True:
            if not self._outbox:
                await self._outbox_lot.park()
                continue
            try:
                await self._send(b"")
            except ConnectionLost:
                return

    # ---- tags, fids, sending ----------------------------------------------------------

    def _alloc_tag(self) -> int:
        if self._free_tags:
            self.requests += 1
            return self._free_tags.pop()
        tag = self._next_tag
        if tag > _MAX_TAG:
            raise NinePError("too many requests in flight")
        self._next_tag = tag + 1
        self.requests += 1
        return tag

    def _free_tag(self, tag: int) -> None:
        self._free_tags.append(tag)

    def _alloc_fid(self) -> int:
        if self._free_fids:
            return self._free_fids.pop()
        fid = self._next_fid
        if fid >= NOFID:
            raise NinePError("out of fids")
        self._next_fid = fid + 1
        return fid

    def _free_fid(self, fid: int) -> None:
        self._free_fids.append(fid)

    async def _send(self, frame: bytes) -> None:
        """Send ``frame`` (and anything queued) whole. Cancellable only before any byte
        went out; the send itself is shielded so a frame is never cut in half."""
        if self._lost is not None:
            raise self._lost
        lock = self._send_lock
        try:
            lock.acquire_nowait()
        except trio.WouldBlock:
            await lock.acquire()
        try:
            if self._lost is not None:
                raise self._lost
            if self._outbox:
                self._outbox.append(frame)
                data = b"".join(self._outbox)
                self._outbox.clear()
            else:
                data = frame
            if not data:
                return
            self.sends += 1
            try:
                await self._transport.send(data, shield_for=SEND_TIMEOUT)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as err:
                lost = ConnectionLost(f"connection lost: {err}")
                self._fail(lost)
                with trio.CancelScope(shield=True):
                    await trio.aclose_forcefully(self._stream)
                raise lost from None
        finally:
            lock.release()

    async def _call(
        self,
        make: Callable[[int], Message],
        late: Callable[[Message], None] | None = None,
    ) -> Message:
        """``_rpc`` for the message ``make(tag)`` builds with a fresh tag."""
        tag = self._alloc_tag()
        try:
            frame = encode(make(tag))
        except BaseException:
            self._free_tag(tag)
            raise
        return await self._rpc(tag, frame, late)

    async def _rpc(
        self,
        tag: int,
        frame: bytes,
        late: Callable[[Message], None] | None = None,
    ) -> Message:
        """Send a request and wait for its reply. ``late`` gets a reply that arrived
        although the call was cancelled (its effect happened and may need undoing)."""
        slot = _Slot()
        self._slots[tag] = slot
        try:
            await self._send(frame)
        except BaseException:
            if self._slots.get(tag) is slot:
                del self._slots[tag]
            self._free_tag(tag)
            raise
        try:
            await slot.event.wait()
        except trio.Cancelled:
            reply = await self._flush(tag, slot)
            if reply is not None and late is not None:
                late(reply)
            raise
        reply = slot.reply
        self._free_tag(tag)
        if reply is None:
            raise self._lost or ConnectionLost()
        if isinstance(reply, Rerror):
            raise NinePError(reply.ename)
        return reply

    def _expect(self, reply: Message, cls: type[_R]) -> _R:
        """The reply if it has the type the request calls for. A server that answers
        a tag with the wrong message cannot be trusted with the others: the
        connection is dropped (ConnectionLost, a NinePError callers already handle)."""
        if isinstance(reply, cls):
            return reply
        lost = ConnectionLost(
            f"protocol error: expected {cls.__name__}, got {type(reply).__name__}"
        )
        self._fail(lost)
        raise lost

    async def _flush(self, oldtag: int, slot: _Slot) -> Message | None:
        """flush(5) for a cancelled call: the reply to ``oldtag`` if it came first."""
        if slot.reply is not None or self._lost is not None:
            self._free_tag(oldtag)
            return slot.reply
        fslot: _Slot | None = None
        ftag = -1
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + FLUSH_TIMEOUT
            try:
                ftag = self._alloc_tag()
                fslot = _Slot()
                self._slots[ftag] = fslot
                await self._send(encode(Tflush(ftag, oldtag)))
                await fslot.event.wait()
            except NinePError:
                pass  # connection lost or out of tags: nothing more to do
        if fslot is not None and fslot.reply is not None:
            # Rflush came: the server will not answer oldtag any more.
            self._free_tag(ftag)
            if self._slots.get(oldtag) is slot:
                del self._slots[oldtag]
            self._free_tag(oldtag)
            return _reply_of(slot)
        # No Rflush in time (or the connection died): the tags stay taken until some
        # reply for them shows up, then the reader frees them.
        reply = _reply_of(slot)  # (mypy would keep the narrowing from before the await)
        if self._slots.get(oldtag) is slot:
            slot.callback = _ignore
        elif reply is not None:
            self._free_tag(oldtag)
        if fslot is not None and self._slots.get(ftag) is fslot:
            fslot.callback = _ignore
        return reply

    # ---- 9P operations ----------------------------------------------------------------

    async def attach(self, uname: str, aname: str = "") -> int:
        """A new fid for the root of the tree ``aname`` names, as user ``uname``."""
        fid = self._alloc_fid()
        created = False

        def late(reply: Message) -> None:
            nonlocal created
            created = isinstance(reply, Rattach)

        try:
            reply = await self._call(lambda t: Tattach(t, fid, NOFID, uname, aname), late)
            self._expect(reply, Rattach)
        except BaseException:
            if created:
                self.clunk_nowait(fid)
            else:
                self._free_fid(fid)
            raise
        return fid

    async def walk(self, fid: int, names: Sequence[str]) -> int:
        """A new fid for ``fid``/``names``; NinePError (nothing to clunk) if it fails."""
        names = list(names)
        newfid = self._alloc_fid()
        created = False
        pos = 0
        try:
            while True:
                chunk = tuple(names[pos : pos + MAXWELEM])
                src = newfid if created else fid

                def late(reply: Message, n: int = len(chunk)) -> None:
                    nonlocal created
                    if isinstance(reply, Rwalk) and len(reply.qids) == n:
                        created = True

                def make(t: int, src: int = src, chunk: tuple[str, ...] = chunk) -> Message:
                    return Twalk(t, src, newfid, chunk)

                reply = await self._call(make, late)
                if len(self._expect(reply, Rwalk).qids) != len(chunk):
                    raise NinePError(ENOTFOUND)
                created = True
                pos += len(chunk)
                if pos >= len(names):
                    return newfid
        except BaseException:
            if created:
                self.clunk_nowait(newfid)
            else:
                self._free_fid(newfid)
            raise

    async def clone(self, fid: int) -> int:
        """A second fid for the same file (a walk of no names)."""
        return await self.walk(fid, ())

    async def open(self, fid: int, mode: int) -> tuple[Qid, int]:
        """Open ``fid`` for I/O: its qid and the iounit the server advises (0: use msize)."""
        reply = await self._call(lambda t: Topen(t, fid, mode))
        ropen = self._expect(reply, Ropen)
        return ropen.qid, ropen.iounit

    async def create(self, fid: int, name: str, perm: int, mode: int) -> tuple[Qid, int]:
        """Create ``name`` in directory ``fid``; ``fid`` then is the new file, open."""
        reply = await self._call(lambda t: Tcreate(t, fid, name, perm, mode))
        rcreate = self._expect(reply, Rcreate)
        return rcreate.qid, rcreate.iounit

    async def read(self, fid: int, offset: int, count: int) -> bytes:
        """One Tread of at most ``min(count, iounit)`` bytes; b"" means end of file."""
        count = min(count, self.msize - IOHDRSZ)
        reply = await self._call(lambda t: Tread(t, fid, offset, count))
        return self._expect(reply, Rread).data

    async def write(self, fid: int, offset: int, data: bytes) -> int:
        """Write all of ``data`` in msize-sized Twrites; stops early on a short write."""
        chunk = self.msize - IOHDRSZ
        done = 0
        while True:
            piece = data[done : done + chunk]
            at = offset + done

            def make(t: int, at: int = at, piece: bytes = piece) -> Message:
                return Twrite(t, fid, at, piece)

            reply = await self._call(make)
            count = self._expect(reply, Rwrite).count
            if count > len(piece):
                lost = ConnectionLost(f"protocol error: Rwrite count {count} > {len(piece)}")
                self._fail(lost)
                raise lost
            done += count
            if count < len(piece) or done >= len(data):
                return done

    async def clunk(self, fid: int) -> None:
        """Forget ``fid`` (the server closes what it had open). The fid is gone even if
        the server answers Rerror."""
        await self._fid_gone(fid, Tclunk, Rclunk)

    async def remove(self, fid: int) -> None:
        """Remove the file; ``fid`` is clunked whether or not that succeeds."""
        await self._fid_gone(fid, Tremove, Rremove)

    async def _fid_gone(
        self, fid: int, tcls: type[Tclunk] | type[Tremove], rcls: type[Rclunk] | type[Rremove]
    ) -> None:
        answered = False

        def late(_: Message) -> None:
            nonlocal answered
            answered = True

        try:
            reply = await self._call(lambda t: tcls(t, fid), late)
            answered = True
        except NinePError:
            answered = True
            raise
        finally:
            if answered or self._lost is not None:
                self._free_fid(fid)
            else:
                self.clunk_nowait(fid)  # flushed before it was done: clunk it anyway
        self._expect(reply, rcls)

    def clunk_nowait(self, fid: int) -> None:
        """Clunk without waiting (no round trip on the caller's path): the Tclunk goes
        out with the next send or right after; the fid number is reused only after the
        server answered. Safe to call from ``finally`` blocks and cancelled tasks."""
        if self._lost is not None:
            return
        try:
            tag = self._alloc_tag()
        except NinePError:
            return  # 65535 requests in flight: the fid stays open until disconnect
        try:
            frame = encode(Tclunk(tag, fid))
        except ValueError:
            self._free_tag(tag)
            raise

        def done(_: Message) -> None:
            self._free_fid(fid)

        self._slots[tag] = _Slot(done)
        self._outbox.append(frame)
        self._outbox_lot.unpark()

    async def stat(self, fid: int) -> Stat:
        reply = await self._call(lambda t: Tstat(t, fid))
        return self._expect(reply, Rstat).stat

    async def wstat(self, fid: int, st: Stat) -> None:
        """Change what ``st`` says; use ``codec.NOCHANGE`` for fields to leave alone."""
        reply = await self._call(lambda t: Twstat(t, fid, st))
        self._expect(reply, Rwstat)

    async def transact(self, fid: int, data: bytes) -> bytes:
        """Write ``data`` to ``fid`` from offset 0, then read the answer from offset 0 to
        its end (a read shorter than asked for), for a request file on which a write
        holds a request and the next read its answer (toolsrv's ``proc/rpc``, factotum's
        ``rpc``). The writes and the first read go out in one send: one round trip
        where write-then-read takes two. ``fid`` must be open for reading and writing.

        A refused write is what this raises, even if the read failed too; a short write
        raises NinePError. Cancelled while the read waits, the read is flushed (which,
        on toolsrv, kills the call).
        """
        chunk = self.msize - IOHDRSZ
        sent: list[tuple[int, _Slot]] = []  # (tag, slot): the writes, then the read
        frames: list[bytes] = []
        try:
            for at in range(0, max(len(data), 1), chunk):
                tag = self._alloc_tag()
                slot = _Slot()
                self._slots[tag] = slot
                sent.append((tag, slot))
                frames.append(encode(Twrite(tag, fid, at, data[at : at + chunk])))
            rtag = self._alloc_tag()
            rslot = _Slot()
            self._slots[rtag] = rslot
            sent.append((rtag, rslot))
            frames.append(encode(Tread(rtag, fid, 0, chunk)))
            await self._send(b"".join(frames))
        except BaseException:
            for tag, slot in sent:
                if self._slots.get(tag) is slot:
                    del self._slots[tag]
                self._free_tag(tag)
            raise
        writes = sent[:-1]
        try:
            try:
                await rslot.event.wait()
            except trio.Cancelled:
                await self._flush(rtag, rslot)
                raise
            self._free_tag(rtag)
            reply = rslot.reply
            for _tag, slot in writes:
                if not slot.event.is_set():  # (a set Event's wait still yields)
                    await slot.event.wait()
            for (_tag, slot), at in zip(writes, range(0, max(len(data), 1), chunk), strict=True):
                wrote = slot.reply
                if isinstance(wrote, Rerror):
                    raise NinePError(wrote.ename)
                if wrote is not None:
                    want = len(data[at : at + chunk])
                    count = self._expect(wrote, Rwrite).count
                    if count != want:
                        raise NinePError(f"short write: {count} of {want} bytes at {at}")
            if reply is None:
                raise self._lost or ConnectionLost()
            if isinstance(reply, Rerror):
                raise NinePError(reply.ename)
            got = self._expect(reply, Rread).data
        finally:
            for tag, slot in writes:
                self._abandon(tag, slot)
        if len(got) < chunk:
            return got
        parts = [got]
        offset = len(got)
        while True:
            more = await self.read(fid, offset, chunk)
            parts.append(more)
            offset += len(more)
            if len(more) < chunk:
                return b"".join(parts)

    def _abandon(self, tag: int, slot: _Slot) -> None:
        """Nobody waits for ``slot`` any more: its tag is free now if its reply came (or
        the connection is gone), else once the reply comes."""
        if slot.reply is not None or self._lost is not None:
            if self._slots.get(tag) is slot:
                del self._slots[tag]
            self._free_tag(tag)
        elif self._slots.get(tag) is slot:
            slot.callback = _ignore

    # ---- helpers ----------------------------------------------------------------------

    async def _read_to_end(self, fid: int) -> list[bytes]:
        chunks: list[bytes] = []
        offset = 0
        while True:
            data = await self.read(fid, offset, self.msize - IOHDRSZ)
            if not data:
                return chunks
            chunks.append(data)
            offset += len(data)

    async def read_all(self, root: int, path: str) -> bytes:
        """The whole content of ``path`` under ``root`` (walk, open, read to EOF, clunk)."""
        fid = await self.walk(root, split_path(path))
        try:
            await self.open(fid, OREAD)
            return b"".join(await self._read_to_end(fid))
        finally:
            self.clunk_nowait(fid)

    async def write_all(self, root: int, path: str, data: bytes) -> None:
        """Replace the content of ``path`` (open OWRITE|OTRUNC, write all, clunk).

        The clunk is waited for: servers may act on it (a ctl file, a call)."""
        fid = await self.walk(root, split_path(path))
        try:
            await self.open(fid, OWRITE | OTRUNC)
            n = await self.write(fid, 0, data)
            if n < len(data):
                raise NinePError(f"short write: {n} of {len(data)} bytes")
        except BaseException:
            self.clunk_nowait(fid)
            raise
        await self.clunk(fid)

    async def listdir(self, root: int, path: str = "") -> list[Stat]:
        """The entries of directory ``path`` under ``root``."""
        fid = await self.walk(root, split_path(path))
        try:
            await self.open(fid, OREAD)
            return decode_stats(b"".join(await self._read_to_end(fid)))
        finally:
            self.clunk_nowait(fid)


__all__ = [
    "DEFAULT_MSIZE",
    "FLUSH_TIMEOUT",
    "Client",
    "ConnectionLost",
    "split_path",
]
