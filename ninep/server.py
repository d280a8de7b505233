"""A 9P2000 file-server framework for trio: the protocol is here, the tree is the app's.

The application implements ``FileSystem`` (usually by subclassing ``BaseFileSystem``),
generic over its own node and handle types: the server only keeps them in per-connection
fid tables and calls back, so an app's methods take its own classes. Everything
9P-specific lives here so each application does not get it subtly wrong again: version
negotiation and session reset (version(5)), fid bookkeeping, partial walks (walk(5)),
open-mode checks (open(5)), directory reads in whole entries with the offset rule
(read(5)), and real cancellation on Tflush (flush(5)).

Concurrency model: the connection's reader task decodes frames in order. A request that
may wait (the application says which, `FileSystem.waits`: a tool's result, a pipe) gets
a task of its own, so it does not stall the other requests of that connection. Each such
request runs in its own cancel scope; Tflush cancels it, waits for it to finish and only
then answers Rflush, and a flushed request sends no reply unless its effect had already
been committed (then the reply goes first, which flush(5) allows). Fid-table changes are
made synchronously together with the decision to reply, so a client never sees Rflush for
a walk whose newfid nevertheless exists.

Every other request is answered by the reader itself, in frame order, before the next
frame is decoded: no task, no cancel scope, and its reply waits in an outbox that leaves
in one write, with the replies of the requests that came in the same read, when the
reader has no whole frame left (or sooner, ahead of any reply a task sends). A tool call
was a dozen messages each answered by a task and a write of its own; that bookkeeping,
not the file system, was most of the server's time. Nothing can overtake a reply in the
outbox: a Tflush of a request already answered is answered after it, in the same write.

A misbehaving peer (malformed frame, oversize frame, duplicate tag in flight, an
R-message, too many requests in flight) loses its connection and nothing else: the
connection's tasks are cancelled, every handle the application opened for it is clunked
exactly once, and the other connections go on. Application bugs (exceptions that are not
``NinePError``) are logged with a traceback and answered ``Rerror("internal error")``.
"""

from __future__ import annotations

import errno
import logging
import os
import socket as _socket
import stat as _stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, NoReturn, Protocol, TypeVar

import trio

from ninep.codec import (
    DMDIR,
    EFIDINUSE,
    EINTERNAL,
    EISDIR,
    ENOTDIR,
    EPERM,
    EUNKNOWNFID,
    IOHDRSZ,
    NOFID,
    ORCLOSE,
    ORDWR,
    OTRUNC,
    OWRITE,
    QTDIR,
    T_TYPES,
    NinePError,
    ProtocolError,
    Qid,
    Rattach,
    Rclunk,
    Rcreate,
    Rerror,
    Rflush,
    RMessage,
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
    Tauth,
    Tclunk,
    Tcreate,
    Tflush,
    TMessage,
    Topen,
    Tread,
    Tremove,
    Tstat,
    Tversion,
    Twalk,
    Twrite,
    Twstat,
    decode,
    encode,
    encode_stat,
)
from ninep.transport import Transport

logger = logging.getLogger("ninep.server")

MIN_MSIZE = 256  # room for headers, an Rerror and a typical stat; smaller is refused

# The application's node and handle types. A server is generic over them, so an app's
# methods take its own classes and need no casts or ``type: ignore[override]``.
N = TypeVar("N")
H = TypeVar("H")

# fid states
_FRESH = 0  # walked/attached, not open
_OPENING = 1  # Topen/Tcreate under way
_OPEN = 2


class FileSystem(Protocol[N, H]):
    """What the application provides, generic over its node type ``N`` and handle type
    ``H``: the server never looks inside either, it only keeps them in its fid tables and
    hands them back (a node where a method takes a node, the handle ``open``/``create``
    returned where it takes a handle). Any type will do, ``None`` included.

    Refuse anything by raising ``NinePError(ename)``; other exceptions are treated as
    bugs (logged, answered "internal error"). Every method may be cancelled (Tflush,
    Tversion, connection loss) except ``clunk``, which runs shielded, and ``detach``,
    which is synchronous; neither may block for long.
    """

    async def attach(self, uname: str, aname: str) -> N:
        """The root node for this attach; ``aname`` carries credentials (no Tauth)."""
        ...

    def waits(self, op: int, node: N | None, handle: H | None) -> bool:
        """Whether answering a T-message of type ``op`` (``codec.TREAD``, ``TWALK``...)
        on a fid whose node is ``node`` (None for Tattach or an unknown fid) and whose
        handle is ``handle`` (None unless open) may wait: for data that is not there yet,
        a lock, a thread, a disk.

        Those that may get a task (concurrency, and Tflush can cancel them); the others
        are answered by the connection's reader, in frame order, and cannot be flushed
        (they are done before a Tflush is read). A request said not to wait that waits
        all the same is still answered right, but holds up the connection meanwhile.
        """
        ...

    def detach(self, root: N) -> None:
        """Once per successful attach, when that session ends (disconnect or Tversion):
        where an app keeps per-client state (toolsrv's agents), that is where it is
        dropped."""
        ...

    async def walk(self, node: N, name: str) -> N:
        """One path element (``..`` included) from a directory node."""
        ...

    def stat(self, node: N) -> Stat:
        """The node's stat; the server takes qids from ``stat(node).qid``."""
        ...

    async def open(self, node: N, mode: int) -> H:
        """A handle for reading/writing ``node`` (directories are opened too)."""
        ...

    async def read(self, handle: H, offset: int, count: int) -> bytes:
        """At most ``count`` bytes at ``offset`` of a file; b"" is end of file."""
        ...

    async def write(self, handle: H, offset: int, data: bytes) -> int:
        """Write ``data`` at ``offset``; the number of bytes taken."""
        ...

    async def readdir(self, node: N) -> list[Stat]:
        """All entries of a directory; called when it is opened (and on a rewind)."""
        ...

    async def clunk(self, handle: H) -> None:
        """Exactly once per handle ``open``/``create`` returned, whatever happens."""
        ...

    async def remove(self, node: N) -> None:
        """Remove the file; the server clunks the fid whether this succeeds or not."""
        ...

    async def create(self, node: N, name: str, perm: int, mode: int) -> tuple[N, H]:
        """Create ``name`` in directory ``node`` and open it: (new node, handle)."""
        ...

    async def wstat(self, node: N, stat: Stat) -> None:
        """Apply the fields of ``stat`` that are not "don't touch" (see codec.NOCHANGE)."""
        ...


class BaseFileSystem(FileSystem[N, H]):
    """Defaults for a read-only tree: subclass as ``BaseFileSystem[MyNode, MyHandle]``
    and override what the tree supports.

    ``attach``, ``walk``, ``stat`` and ``open`` have no sensible default and must be
    provided (a tree whose handle is the node itself writes ``return node``).
    """

    def detach(self, root: N) -> None:
        return None

    def waits(self, op: int, node: N | None, handle: H | None) -> bool:
        return True  # each request in a task of its own: safe for any application

    async def read(self, handle: H, offset: int, count: int) -> bytes:
        raise NinePError(EPERM)

    async def write(self, handle: H, offset: int, data: bytes) -> int:
        raise NinePError(EPERM)

    async def readdir(self, node: N) -> list[Stat]:
        raise NinePError(ENOTDIR)

    async def clunk(self, handle: H) -> None:
        return None

    async def remove(self, node: N) -> None:
        raise NinePError(EPERM)

    async def create(self, node: N, name: str, perm: int, mode: int) -> tuple[N, H]:
        raise NinePError(EPERM)

    async def wstat(self, node: N, stat: Stat) -> None:
        raise NinePError(EPERM)


@dataclass
class ServerStats:
    """Live counters, so tests (and operators) can see that nothing leaks."""

    connections: int = 0  # connections being served now
    fids: int = 0  # fids in all fid tables now
    in_flight: int = 0  # T-messages received and not yet answered or abandoned
    handles: int = 0  # handles the file system returned that are not clunked yet
    connections_total: int = 0
    violations: int = 0  # connections closed for breaking the protocol


class _Violation(Exception):
    """The peer broke the protocol: its connection is closed."""


class _Request:
    """One T-message in flight: its cancel scope (None when the reader answers it at
    once: nothing can cancel it), and whether a reply may still go out."""

    __slots__ = ("_event", "aborted", "committed", "finished", "running", "scope", "tag")

    def __init__(self, tag: int, scope: trio.CancelScope | None) -> None:
        self.tag = tag
        self.scope = scope
        self.running: trio.Event | None = None  # set when its task starts (`_read_loop`)
        self.aborted = False  # flushed or reset: no reply unless committed
        self.committed = False  # its effect is visible: the reply must go out
        self.finished = False
        self._event: trio.Event | None = None

    def finish(self) -> None:
        self.finished = True
        if self._event is not None:
            self._event.set()

    async def wait(self) -> None:
        if self.finished:
            return
        if self._event is None:
            self._event = trio.Event()
        await self._event.wait()


class _Fid(Generic[N, H]):
    """A fid: the node it names and, once open, the application's handle."""

    __slots__ = (
        "clunked",
        "dir_offset",
        "entries",
        "entry_index",
        "handle",
        "mode",
        "node",
        "qtype",
        "refs",
        "state",
    )

    handle: H  # set exactly while state == _OPEN (an app's handle may be None)

    def __init__(self, node: N, qtype: int) -> None:
        self.node = node
        self.qtype = qtype
        self.state = _FRESH
        self.mode = 0
        self.refs = 0  # requests using the fid right now; the last one clunks if clunked
        self.clunked = False
        self.entries: list[bytes] = []
        self.entry_index = 0
        self.dir_offset = 0


def _valid_name(name: str) -> bool:
    return bool(name) and "/" not in name


def _dir_mode_ok(mode: int) -> bool:
    """open(5): a directory may not be written, truncated or removed on close."""
    return mode & 3 not in (OWRITE, ORDWR) and not mode & (OTRUNC | ORCLOSE)


class _Conn(Generic[N, H]):
    def __init__(
        self,
        stream: trio.abc.Stream,
        fs: FileSystem[N, H],
        max_msize: int,
        max_fids: int,
        max_pending: int,
        stats: ServerStats,
    ) -> None:
        self.stream = stream
        self.transport = Transport(stream)
        self.fs = fs
        self.max_msize = max_msize
        self.max_fids = max_fids
        self.max_pending = max_pending
        self.stats = stats
        self.msize = 0  # 0: no successful Tversion yet
        self.fids: dict[int, _Fid[N, H]] = {}
        self.pending: dict[int, _Request] = {}
        self.roots: list[N] = []
        self.send_lock = trio.Lock()
        self.outbox: list[bytes] = []  # replies of requests answered by the reader
        self.nursery: trio.Nursery | None = None

    # ---- connection life ----------------------------------------------------------

    async def serve(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                try:
                    await self._read_loop(nursery)
                except _Violation as v:
                    self.stats.violations += 1
                    logger.info("closing 9P connection: %s", v)
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._reset()
                await self.stream.aclose()

    def _die(self) -> None:
        if self.nursery is not None:
            self.nursery.cancel_scope.cancel()

    async def _read_loop(self, nursery: trio.Nursery) -> None:
        transport = self.transport
        frames = transport.frames
        pending = self.pending
        stats = self.stats
        fids = self.fids
        waits = self.fs.waits
        started: _Request | None = None  # the last task started since the outbox went
        while True:
            limit = self.msize or self.max_msize
            try:
                frame = frames.next_frame(limit)
                if frame is None:
                    if self.outbox:  # nothing more to answer at once: send what we have
                        if started is not None and started.running is not None:
                            # ... once the tasks just started ran to their first wait:
                            # their work (toolsrv: a spawn) does not wait for our write
                            # and the wakeup of the peer, and a reply they made at once
                            # goes in the same write. (Waiting for an Event the task sets
                            # as it starts: the loop runs us again once it yields.)
                            await started.running.wait()
                        await self._send(None, None)
                    started = None
                    frame = await transport.next_frame(limit)
            except ProtocolError as err:
                raise _Violation(str(err)) from None
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # gone, possibly in the middle of a frame
            if frame is None:
                return
            try:
                msg = decode(frame)
            except ProtocolError as err:
                raise _Violation(f"malformed frame: {err}") from None
            if not isinstance(msg, T_TYPES):
                raise _Violation(f"{type(msg).__name__} sent by a client")
            if isinstance(msg, Tversion):
                await self._version(msg)
                continue
            tag = msg.tag
            if tag in pending:
                raise _Violation(f"tag {tag} reused while in flight")
            if isinstance(msg, Tflush):
                target = pending.get(msg.oldtag)
                if target is None:
                    # Nothing to cancel: its reply (if any) is sent or in the outbox,
                    # and Rflush goes after it.
                    self.outbox.append(encode(Rflush(tag)))
                    continue
                if len(pending) >= self.max_pending:
                    raise _Violation(f"more than {self.max_pending} requests in flight")
                # The target is cancelled now, in frame order, not when the task runs.
                target.aborted = True
                if target.scope is not None:
                    target.scope.cancel()
                req = _Request(tag, None)
                pending[tag] = req
                stats.in_flight += 1
                nursery.start_soon(self._flush, req, target)
                continue
            n = getattr(msg, "fid", None)
            fid = fids.get(n) if n is not None else None
            if fid is None:
                may_wait = waits(msg.TYPE, None, None)
            else:
                may_wait = waits(msg.TYPE, fid.node, fid.handle if fid.state == _OPEN else None)
            if not may_wait:
                reply = await self._answer(_Request(tag, None), msg)
                if reply is not None:  # (always: nothing flushes it meanwhile)
                    self.outbox.append(self._frame(reply))
                continue
            if len(pending) >= self.max_pending:
                raise _Violation(f"more than {self.max_pending} requests in flight")
            req = _Request(tag, trio.CancelScope())
            pending[tag] = req
            stats.in_flight += 1
            if self.outbox:
                req.running = trio.Event()
            started = req
            nursery.start_soon(self._handle, req, msg)

    async def _reset(self) -> None:
        """Clunk every fid and end every attach: connection end or Tversion."""
        with trio.CancelScope(shield=True):
            fids = list(self.fids.values())
            self.fids.clear()
            self.stats.fids -= len(fids)
            for fid in fids:
                fid.clunked = True
                if fid.refs == 0:
                    await self._destroy(fid)
            roots, self.roots = self.roots, []
            for root in roots:
                self._detach(root)

    def _detach(self, root: N) -> None:
        try:
            self.fs.detach(root)
        except Exception:
            logger.exception("9P detach failed")

    # ---- replies ------------------------------------------------------------------

    def _retire(self, req: _Request) -> None:
        if self.pending.get(req.tag) is req:
            del self.pending[req.tag]
            self.stats.in_flight -= 1
        if not req.finished:
            req.finish()

    def _rerror(self, tag: int, ename: str) -> Rerror:
        """An Rerror that always encodes and fits the msize, whatever the app said."""
        limit = min(0xFFFF, (self.msize or self.max_msize) - 9)
        b = ename.replace("\x00", "?").encode("utf-8", "replace")
        if len(b) > limit:
            b = b[:limit]
        return Rerror(tag, b.decode("utf-8", "ignore"))

    def _frame(self, reply: RMessage) -> bytes:
        try:
            frame = encode(reply)
        except ValueError:
            logger.exception("9P %s from the file system cannot be encoded", type(reply).__name__)
            return encode(Rerror(reply.tag, EINTERNAL))
        if len(frame) > (self.msize or self.max_msize):
            return encode(self._rerror(reply.tag, "reply does not fit in msize"))
        return frame

    async def _send(self, frame: bytes | None, req: _Request | None) -> None:
        """One whole frame under the lock, after whatever the outbox holds (so no reply
        overtakes one the reader queued); None sends only the outbox. A request is
        retired right before it is sent, so its tag is free again exactly when the
        client can see the reply."""
        lock = self.send_lock
        try:
            lock.acquire_nowait()
        except trio.WouldBlock:
            await lock.acquire()
        try:
            if req is not None:
                self._retire(req)
                if req.aborted and not req.committed:
                    frame = None
            outbox = self.outbox
            if outbox:
                if frame is not None:
                    outbox.append(frame)
                frame = b"".join(outbox)
                outbox.clear()
            if frame is not None:
                await self.transport.send(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._die()
        finally:
            lock.release()

    # ---- request tasks ------------------------------------------------------------

    async def _handle(self, req: _Request, msg: TMessage) -> None:
        assert req.scope is not None
        if req.running is not None:
            req.running.set()
        reply: RMessage | None = None
        try:
            with req.scope:
                reply = await self._answer(req, msg)
            if reply is not None:
                await self._send(self._frame(reply), req)
        finally:
            self._retire(req)

    async def _answer(self, req: _Request, msg: TMessage) -> RMessage | None:
        """The reply to ``msg`` (None: flushed before it committed anything)."""
        try:
            if not self.msize:
                raise NinePError("Tversion must come first")
            return await self._op(req, msg)
        except NinePError as err:
            return self._rerror(msg.tag, err.ename)
        except Exception:
            logger.exception("9P %s failed in the file system", type(msg).__name__)
            return Rerror(msg.tag, EINTERNAL)

    async def _flush(self, req: _Request, target: _Request) -> None:
        try:
            await target.wait()
            await self._send(encode(Rflush(req.tag)), req)
        finally:
            self._retire(req)

    async def _version(self, msg: Tversion) -> None:
        # version(5): all outstanding I/O is aborted and all fids are clunked.
        reqs = list(self.pending.values())
        for r in reqs:
            r.aborted = True
            if r.scope is not None:
                r.scope.cancel()
        for r in reqs:
            await r.wait()
        await self._reset()
        self.msize = 0
        reply: RMessage
        v = msg.version
        if msg.msize < MIN_MSIZE:
            reply = Rerror(msg.tag, f"msize {msg.msize} is too small (minimum {MIN_MSIZE})")
        elif v == "9P2000" or v.startswith("9P2000."):
            self.msize = min(msg.msize, self.max_msize)
            reply = Rversion(msg.tag, self.msize, "9P2000")
        else:
            reply = Rversion(msg.tag, min(msg.msize, self.max_msize), "unknown")
        await self._send(self._frame(reply), None)

    async def _op(self, req: _Request, msg: TMessage) -> RMessage | None:
        # Most frequent first.
        if isinstance(msg, Tread):
            return await self._read(msg)
        if isinstance(msg, Twalk):
            return await self._walk(req, msg)
        if isinstance(msg, Topen):
            return await self._open(req, msg)
        if isinstance(msg, Tclunk):
            return await self._clunk(req, msg)
        if isinstance(msg, Twrite):
            return await self._write(msg)
        if isinstance(msg, Tstat):
            return Rstat(msg.tag, self.fs.stat(self._get(msg.fid).node))
        if isinstance(msg, Tattach):
            return await self._attach(req, msg)
        if isinstance(msg, Tcreate):
            return await self._create(req, msg)
        if isinstance(msg, Tremove):
            return await self._remove(req, msg)
        if isinstance(msg, Twstat):
            return await self._wstat(msg)
        if isinstance(msg, Tauth):
            raise NinePError("authentication not required")
        raise AssertionError(f"unhandled {type(msg).__name__}")  # pragma: no cover

    # ---- fids ---------------------------------------------------------------------

    def _get(self, n: int) -> _Fid[N, H]:
        fid = self.fids.get(n)
        if fid is None:
            raise NinePError(EUNKNOWNFID)
        return fid

    def _check_newfid(self, n: int) -> None:
        if n == NOFID:
            raise NinePError("NOFID is not a valid fid")
        if n in self.fids:
            raise NinePError(EFIDINUSE)
        if len(self.fids) >= self.max_fids:
            raise NinePError("too many fids")

    def _add_fid(self, n: int, fid: _Fid[N, H]) -> None:
        self.fids[n] = fid
        self.stats.fids += 1

    async def _release(self, fid: _Fid[N, H]) -> None:
        fid.refs -= 1
        if fid.clunked and fid.refs == 0:
            await self._destroy(fid)

    async def _destroy(self, fid: _Fid[N, H]) -> str | None:
        """Clunk the fid's handle (and remove on close): the error to report, if any."""
        if fid.state != _OPEN:
            return None
        handle = fid.handle
        del fid.handle  # the fid may outlive this in a running request: drop the handle
        fid.state = _FRESH
        err = await self._clunk_handle(handle)
        if fid.mode & ORCLOSE:
            fid.mode &= ~ORCLOSE
            with trio.CancelScope(shield=True):
                try:
                    await self.fs.remove(fid.node)
                except NinePError as e:
                    err = err or e.ename
                except Exception:
                    logger.exception("9P remove-on-close failed in the file system")
                    err = err or EINTERNAL
        return err

    async def _clunk_handle(self, handle: H) -> str | None:
        with trio.CancelScope(shield=True):
            try:
                await self.fs.clunk(handle)
            except NinePError as e:
                return e.ename
            except Exception:
                logger.exception("9P clunk failed in the file system")
                return EINTERNAL
            finally:
                self.stats.handles -= 1
        return None

    async def _entries(self, node: N) -> list[bytes]:
        return [encode_stat(st) for st in await self.fs.readdir(node)]

    def _iounit(self) -> int:
        return self.msize - IOHDRSZ

    # ---- operations ---------------------------------------------------------------

    async def _attach(self, req: _Request, msg: Tattach) -> RMessage | None:
        if msg.afid != NOFID:
            raise NinePError("authentication not required")
        self._check_newfid(msg.fid)
        root = await self.fs.attach(msg.uname, msg.aname)
        try:
            qid = self.fs.stat(root).qid
            if req.aborted:
                self._detach(root)
                return None
            self._check_newfid(msg.fid)
        except BaseException:
            self._detach(root)
            raise
        self._add_fid(msg.fid, _Fid[N, H](root, qid.type))
        self.roots.append(root)
        req.committed = True
        return Rattach(msg.tag, qid)

    async def _walk(self, req: _Request, msg: Twalk) -> RMessage | None:
        fid = self._get(msg.fid)
        if fid.state != _FRESH:
            raise NinePError("cannot walk an open fid")
        if msg.newfid != msg.fid:
            self._check_newfid(msg.newfid)
        fs = self.fs
        fid.refs += 1
        try:
            node = fid.node
            qtype = fid.qtype
            qids: list[Qid] = []
            for i, name in enumerate(msg.wnames):
                try:
                    if not qtype & QTDIR:
                        raise NinePError(ENOTDIR)
                    if not _valid_name(name):
                        raise NinePError("invalid file name")
                    node = await fs.walk(node, name)
                    qid = fs.stat(node).qid
                except NinePError:
                    if i == 0:
                        raise
                    return Rwalk(msg.tag, tuple(qids))  # partial: newfid not created
                qids.append(qid)
                qtype = qid.type
            if req.aborted:
                return None
            if msg.newfid == msg.fid:
                if fid.state != _FRESH:
                    raise NinePError("fid was opened during the walk")
                fid.node = node
                fid.qtype = qtype
            else:
                self._check_newfid(msg.newfid)
                self._add_fid(msg.newfid, _Fid[N, H](node, qtype))
            req.committed = True
            return Rwalk(msg.tag, tuple(qids))
        finally:
            await self._release(fid)

    async def _open(self, req: _Request, msg: Topen) -> RMessage | None:
        fid = self._get(msg.fid)
        if fid.state != _FRESH:
            raise NinePError("fid already open")
        mode = msg.mode
        is_dir = bool(fid.qtype & QTDIR)
        if is_dir and not _dir_mode_ok(mode):
            raise NinePError(EISDIR)
        fs = self.fs
        fid.refs += 1
        fid.state = _OPENING
        try:
            handle = await fs.open(fid.node, mode)
            self.stats.handles += 1
            try:
                qid = fs.stat(fid.node).qid
                entries = await self._entries(fid.node) if is_dir else []
                if req.aborted:
                    return None
                self._commit_open(req, fid, handle, mode, entries)
                return Ropen(msg.tag, qid, self._iounit())
            finally:
                await self._unopen(req, fid, handle)
        finally:
            await self._end_open(req, fid)

    async def _create(self, req: _Request, msg: Tcreate) -> RMessage | None:
        fid = self._get(msg.fid)
        if fid.state != _FRESH:
            raise NinePError("fid already open")
        if not fid.qtype & QTDIR:
            raise NinePError(ENOTDIR)
        if not _valid_name(msg.name) or msg.name in (".", ".."):
            raise NinePError("invalid file name")
        mode = msg.mode
        if msg.perm & DMDIR and not _dir_mode_ok(mode):
            raise NinePError(EISDIR)
        fs = self.fs
        fid.refs += 1
        fid.state = _OPENING
        try:
            node, handle = await fs.create(fid.node, msg.name, msg.perm, mode)
            self.stats.handles += 1
            try:
                qid = fs.stat(node).qid
                entries = await self._entries(node) if qid.type & QTDIR else []
                if req.aborted:
                    return None
                fid.node = node
                fid.qtype = qid.type
                self._commit_open(req, fid, handle, mode, entries)
                return Rcreate(msg.tag, qid, self._iounit())
            finally:
                await self._unopen(req, fid, handle)
        finally:
            await self._end_open(req, fid)

    @staticmethod
    def _commit_open(
        req: _Request, fid: _Fid[N, H], handle: H, mode: int, entries: list[bytes]
    ) -> None:
        """Topen/Tcreate succeeded and will be answered: the fid holds the handle now."""
        fid.handle = handle
        fid.mode = mode
        fid.state = _OPEN
        fid.entries = entries
        fid.entry_index = fid.dir_offset = 0
        req.committed = True

    async def _unopen(self, req: _Request, fid: _Fid[N, H], handle: H) -> None:
        """After the app gave a handle to a Topen/Tcreate that was not committed (error,
        flush): the fid is fresh again and the handle is clunked, so it is never leaked."""
        if not req.committed:
            fid.state = _FRESH
            await self._clunk_handle(handle)

    async def _end_open(self, req: _Request, fid: _Fid[N, H]) -> None:
        """After every Topen/Tcreate: an uncommitted fid is fresh again; drop our ref."""
        if not req.committed:
            fid.state = _FRESH
        await self._release(fid)

    async def _read(self, msg: Tread) -> RMessage:
        fid = self._get(msg.fid)
        if fid.state != _OPEN:
            raise NinePError("fid not open")
        if fid.mode & 3 == OWRITE:
            raise NinePError("file not open for reading")
        count = min(msg.count, self.msize - IOHDRSZ)
        fid.refs += 1
        try:
            if fid.qtype & QTDIR:
                return await self._read_dir(fid, msg.tag, msg.offset, count)
            data = await self.fs.read(fid.handle, msg.offset, count)
        finally:
            await self._release(fid)
        if len(data) > count:
            logger.warning("9P read returned %d bytes for a count of %d", len(data), count)
            data = data[:count]
        return Rread(msg.tag, data)

    async def _read_dir(self, fid: _Fid[N, H], tag: int, offset: int, count: int) -> RMessage:
        # read(5): a directory read returns whole entries, and its offset must be 0 (a
        # rewind, which re-reads the directory) or where the previous read ended.
        if offset == 0 and fid.dir_offset != 0:
            entries = await self._entries(fid.node)
            fid.entries = entries
            fid.entry_index = fid.dir_offset = 0
        elif offset != fid.dir_offset:
            raise NinePError("bad offset in directory read")
        entries = fid.entries
        i = fid.entry_index
        n = len(entries)
        total = 0
        out = []
        while i < n and total + len(entries[i]) <= count:
            out.append(entries[i])
            total += len(entries[i])
            i += 1
        if not out and i < n:
            raise NinePError("read count too small for a directory entry")
        fid.entry_index = i
        fid.dir_offset = offset + total
        return Rread(tag, b"".join(out))

    async def _write(self, msg: Twrite) -> RMessage:
        fid = self._get(msg.fid)
        if fid.state != _OPEN:
            raise NinePError("fid not open")
        if fid.mode & 3 not in (OWRITE, ORDWR):
            raise NinePError("file not open for writing")
        fid.refs += 1
        try:
            n = await self.fs.write(fid.handle, msg.offset, msg.data)
        finally:
            await self._release(fid)
        if not isinstance(n, int) or not 0 <= n <= len(msg.data):
            logger.error("9P write returned %r for %d bytes", n, len(msg.data))
            raise NinePError(EINTERNAL)
        return Rwrite(msg.tag, n)

    async def _clunk(self, req: _Request, msg: Tclunk) -> RMessage:
        fid = self.fids.pop(msg.fid, None)
        if fid is None:
            raise NinePError(EUNKNOWNFID)
        self.stats.fids -= 1
        fid.clunked = True
        req.committed = True
        err = await self._destroy(fid) if fid.refs == 0 else None
        if err is not None:
            return self._rerror(msg.tag, err)  # the fid is gone all the same
        return Rclunk(msg.tag)

    async def _remove(self, req: _Request, msg: Tremove) -> RMessage:
        fid = self.fids.pop(msg.fid, None)
        if fid is None:
            raise NinePError(EUNKNOWNFID)
        self.stats.fids -= 1
        fid.clunked = True
        fid.mode &= ~ORCLOSE
        req.committed = True
        fid.refs += 1
        try:
            await self.fs.remove(fid.node)
        finally:
            await self._release(fid)  # remove(5): the fid is clunked even if remove fails
        return Rremove(msg.tag)

    async def _wstat(self, msg: Twstat) -> RMessage:
        fid = self._get(msg.fid)
        fid.refs += 1
        try:
            await self.fs.wstat(fid.node, msg.stat)
        finally:
            await self._release(fid)
        return Rwstat(msg.tag)


async def serve_connection(
    stream: trio.abc.Stream,
    fs: FileSystem[N, H],
    *,
    max_msize: int = 1 << 20,
    max_fids: int = 4096,
    max_pending: int = 256,
    stats: ServerStats | None = None,
) -> None:
    """Serve one client until it disconnects or breaks the protocol; closes ``stream``.

    Every handle opened for this connection is clunked before this returns.
    """
    if max_msize < MIN_MSIZE:
        raise ValueError(f"max_msize must be at least {MIN_MSIZE}")
    if stats is None:
        stats = ServerStats()
    conn = _Conn(stream, fs, max_msize, max_fids, max_pending, stats)
    stats.connections += 1
    stats.connections_total += 1
    try:
        await conn.serve()
    finally:
        stats.connections -= 1


def clear_stale_socket(path: str) -> None:
    """Remove a socket file nobody listens on; refuse to touch anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not _stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(errno.EEXIST, "exists and is not a socket", path)
    probe = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # stale: its server is gone
        return
    except FileNotFoundError:
        return
    except BlockingIOError:
        pass  # a live server with a full backlog
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, "a server is already listening", path)


# What accept(2) fails with when the process or the system runs short of descriptors or
# memory: that passes as connections close, so (as trio.serve_listeners does) the loop
# waits a little and tries again. Any other error will not mend by trying again.
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
ACCEPT_RETRY_SECONDS = 0.1

S = TypeVar("S", bound=trio.abc.AsyncResource)


async def accept_loop(
    listener: trio.abc.Listener[S], start: Callable[[S], object], name: str
) -> NoReturn:
    """Accept clients on ``listener`` for ever, giving each to ``start`` (which starts the
    task that serves it), by trio.serve_listeners' rule.

    Out of descriptors or memory (``ACCEPT_CAPACITY_ERRNOS``), the clients connected
    go on and the loop tries again every ``ACCEPT_RETRY_SECONDS``: logged once when it
    starts failing, once when it accepts again, not at every try. Any other ``OSError``
    ends the loop (raised), as it ends serve_listeners.
    """
    failing = False
    while True:
        try:
            stream = await listener.accept()
        except OSError as err:
            if err.errno not in ACCEPT_CAPACITY_ERRNOS:
                raise
            if not failing:
                logger.warning(
                    "9P accept on %s failed: %s; trying again every %g s",
                    name,
                    err,
                    ACCEPT_RETRY_SECONDS,
                )
                failing = True
            await trio.sleep(ACCEPT_RETRY_SECONDS)
            continue
        if failing:
            logger.info("9P accept on %s works again", name)
            failing = False
        start(stream)


async def _serve_logged(
    stream: trio.SocketStream,
    fs: FileSystem[N, H],
    max_msize: int,
    max_fids: int,
    max_pending: int,
    stats: ServerStats,
) -> None:
    try:
        await serve_connection(
            stream,
            fs,
            max_msize=max_msize,
            max_fids=max_fids,
            max_pending=max_pending,
            stats=stats,
        )
    except Exception:
        logger.exception("9P connection failed")


async def serve_unix(
    path: str,
    fs: FileSystem[N, H],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    mode: int = 0o600,
    max_msize: int = 1 << 20,
    max_fids: int = 4096,
    max_pending: int = 256,
    stats: ServerStats | None = None,
) -> None:
    """Listen on a unix socket at ``path`` (mode ``mode``) and serve each client.

    The socket file gets its mode before ``listen``: until then every connect is
    refused, so there is no moment when a wider mode would let anyone in. A stale socket
    file is replaced; a live one or a non-socket file is an error. The socket file is
    removed when serving stops. ``task_status.started()`` is called once clients can
    connect.
    """
    if max_msize < MIN_MSIZE:
        raise ValueError(f"max_msize must be at least {MIN_MSIZE}")
    if stats is None:
        stats = ServerStats()
    clear_stale_socket(path)
    sock = trio.socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    ino = -1
    try:
        await sock.bind(path)
        os.chmod(path, mode)
        st = os.lstat(path)
        ino = st.st_ino
        if not _stat.S_ISSOCK(st.st_mode) or _stat.S_IMODE(st.st_mode) != mode:
            raise OSError(errno.EPERM, "socket file changed under us", path)
        # As many as the kernel allows (net.core.somaxconn, 4096 by default): a daemon
        # whose sessions start together connects once per session at the same moment,
        # and a unix socket refuses the connects past a full backlog (trio then reports
        # ENOTCONN at the first read: "connection lost during version negotiation").
        sock.listen(_socket.SOMAXCONN)
        listener = trio.SocketListener(sock)
        task_status.started()
        async with trio.open_nursery() as nursery:

            def start(stream: trio.SocketStream) -> None:
                nursery.start_soon(
                    _serve_logged, stream, fs, max_msize, max_fids, max_pending, stats
                )

            await accept_loop(listener, start, path)
    finally:
        sock.close()
        try:
            if os.lstat(path).st_ino == ino:
                os.unlink(path)
        except OSError:
            pass


__all__ = [
    "ACCEPT_CAPACITY_ERRNOS",
    "MIN_MSIZE",
    "BaseFileSystem",
    "FileSystem",
    "NinePError",
    "ServerStats",
    "accept_loop",
    "serve_connection",
    "serve_unix",
]
