"""The FUSE frontend: pyfuse3 ``Operations`` that only translate to the tree of ``spec.py``.

Inode numbers are handed out per node key and never reused while the daemon runs, so a
handle on ``s/a/chat`` keeps working after ``mv s/a s/b``. Every expected failure is a
typed ``OllieError`` mapped to an errno here; any other exception is logged and answered
with EIO, so no client request can end the daemon.

Kernel caching. A stat answered from the kernel's cache costs a few microseconds; one that
comes here costs a round trip through Python. So the kernel may cache (for
``nodes.CACHED_TTL``) what is announced when it changes, and only that:

* attributes of nodes with a ``watch()`` source (``chat``, ``stream``, ``events``,
  ``state``) and of nodes that never change: each time attributes are handed out, a
  one-shot observer is put on the source, and the source's next change calls it, which
  invalidates the attributes at once, in the same call (``invalidate_inode`` with
  ``attr_only``: the kernel takes no lock a request holds for that, so it cannot
  deadlock, and it bumps the inode's attribute version, so a getattr answer already on
  its way is not cached either). The next stat after an append sees the new size:
  ``tail -f`` and size-polling clients (Emacs's ellie) see every byte at once. At most one
  invalidation per change that someone could have cached: appends nobody stat'ed cost
  nothing.
* entries of session directories (``s/<id>``), whose names change behind the kernel's
  back (``ctl rn``, ``ctl kill``, a session ending): their ``entry_watch()`` source (the
  session's events) announces it, and the name is checked and, if it no longer leads to
  the same node, invalidated. ``invalidate_entry`` takes the parent directory's lock,
  which a request in flight there (a lookup, an rmdir) holds while waiting for this very
  process: it runs in a worker thread, drained by a system task, and a ``write`` (the
  ``ctl`` that renamed or killed) waits for the drain before it returns, so the old name
  is gone when ``echo kill > ctl`` returns.
* everything else (synthetic text rendered from the runtime's state, files on disk) is
  not cached by the kernel: each stat comes here. Nodes with an ``attrs_version``
  (a session's texts: ``Session.files_version``) have their attributes kept here with
  that version, and handed out again while it holds: a stat or a listing of a session
  directory renders nothing unless what the file shows changed.

xattr operations answer ENOSYS, which the kernel remembers for the mount: ``ls -l`` asks
for two attributes per entry, and would otherwise pay two round trips for each.

poll, select and epoll are answered from ``Handle.ready`` (``poll``): a follower in an
event loop sleeps until a blocking file has data, woken through the poll handle the
kernel gave with its last poll. Without FUSE_INTERRUPT (stock pyfuse3,
``olliefs.fs.patched``), a blocked read is served with the thread that opened its file
as its caller (``interrupt.Opener``).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import select
import stat
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterator, Sequence
from typing import Any, ParamSpec, TypeVar, cast

import pyfuse3
import trio

from olliefs import errors
from olliefs.fs import interrupt, patched
from olliefs.fs.nodes import (
    CACHED_TTL,
    Dir,
    File,
    Handle,
    LogHandle,
    Node,
    Open,
    Waiters,
    admit_wait,
)

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


def translated(fn: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except errors.OllieError as err:
            log.debug("%s: %s: %s", fn.__name__, type(err).__name__, err)
            raise pyfuse3.FUSEError(err.errno) from None
        except Exception:
            log.exception("unexpected failure in %s", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


_Op = TypeVar("_Op", bound=Callable[..., Awaitable[Any]])


def holds_dir(fn: _Op) -> _Op:
    """An operation on the directory named by its first argument (a parent inode): the
    kernel holds that directory's lock until this answers, and the stale names of that
    directory wait (see `Operations._drain_entries`)."""

    @functools.wraps(fn)
    async def wrapper(ops: Operations, ino: int, *args: Any, **kwargs: Any) -> Any:
        with ops.in_dir(ino):
            return await fn(ops, ino, *args, **kwargs)

    return cast(_Op, wrapper)


class Operations(pyfuse3.Operations):
    def __init__(self, root: Dir, max_waiters: int) -> None:
        super().__init__()
        self.root = root
        self.waiters = Waiters(max_waiters)
        self._ino: dict[Hashable, int] = {root.key: pyfuse3.ROOT_INODE}
        self._nodes: dict[int, Node] = {pyfuse3.ROOT_INODE: root}
        # How many times the kernel was told of each inode (lookup and readdirplus
        # replies) minus what it forgot: at zero the node is dropped, so memory follows
        # what the kernel holds, not every name ever looked up.
        self._lookups: Counter[int] = Counter()
        self._last_ino = pyfuse3.ROOT_INODE
        # Bumped whenever an inode leaves the table: a listing built before (which
        # names inode numbers) is built again.
        self._epoch = 0
        self._handles: dict[int, Handle] = {}
        self._dirs: dict[int, _Open] = {}  # open directories by fh
        # The last listing of each directory that says when its entries change
        # (``Dir.listing_version``), reused by the next opendir while that holds.
        self._listings: dict[int, _Listing] = {}
        self._parent: dict[int, int] = {}  # inode -> the directory it was found in
        self._next_fh = 1
        self.uid, self.gid = os.getuid(), os.getgid()
        # Inodes whose attributes, and (parent, name) entries, the kernel may hold in
        # cache with an observer waiting on their source for the next change.
        self._attr_watched: set[int] = set()
        # Attributes built once and handed out again: of nodes with fixed_attrs for as
        # long as the kernel knows them, of watched nodes until their source changes.
        self._kept: dict[int, pyfuse3.EntryAttributes] = {}
        # Attributes of nodes with an ``attrs_version``, with the version they were made
        # at: handed out again while it holds (a stat or a listing renders nothing).
        self._versioned: dict[int, tuple[Hashable, pyfuse3.EntryAttributes]] = {}
        self._entry_watched: set[tuple[int, str]] = set()
        # Entries to invalidate, by a worker thread (see the module's docstring).
        self._stale_entries: list[tuple[int, str]] = []
        self._draining = False
        self._drained = trio.Event()
        # Requests in flight per directory inode, and a wake-up when one ends: a name
        # is invalidated only while no request in its directory waits for this process
        # (the kernel holds the directory's lock meanwhile: were this process killed with
        # the invalidation waiting for that lock, the worker thread would sit in D state
        # for good, keep /dev/fuse open, and the mount could never be torn down).
        self._busy_dirs: dict[int, int] = {}
        self._dir_free = trio.Event()
        # Handles polled while a read would wait, with the kernel's handle to wake their
        # pollers (see ``poll``).
        self._polled: dict[int, _Polled] = {}
        self._closed = False
        # Without FUSE_INTERRUPT (stock pyfuse3): the thread that opened each file that
        # blocks, watched while a read of it waits (``interrupt.Opener``).
        self._watch = None if patched.INTERRUPT else interrupt.Watch()
        self._openers: dict[int, interrupt.Opener] = {}
        # Reads parked at the end of a log until it grows (``_park``).
        self._parked: set[_Parked] = set()
        # Counts for tests and the bench: invalidations sent to the kernel.

    # ---- inode table ----------------------------------------------------------------

    def _inode(self, node: Node) -> int:
        ino = self._ino.get(node.key)
        if ino is None:
            self._last_ino += 1
            ino = self._last_ino
            self._ino[node.key] = ino
        self._nodes[ino] = node
        return ino

    def _node(self, inode: int) -> Node:
        node = self._nodes.get(inode)
        if node is None or not node.valid():
            raise pyfuse3.FUSEError(errno.ENOENT)
        return node

    def _dir(self, inode: int) -> Dir:
        node = self._node(inode)
        if not isinstance(node, Dir):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return node

    def _attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        ino = self._inode(node)
        a = self._kept.get(ino)
        if a is not None:
            return a
        version = node.attrs_version()
        if version is not None:
            got = self._versioned.get(ino)
            if got is not None and got[0] == version:
                return got[1]
        a = self._make_attrs(node, ino)
        if node.fixed_attrs or ino in self._attr_watched:
            self._kept[ino] = a
        elif version is not None:
            self._versioned[ino] = (version, a)
        return a

    def _make_attrs(self, node: Node, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.st_mode = node.mode
        a.st_nlink = node.nlink() if isinstance(node, Dir) else 1
        a.st_size, ns = node.stat()
        a.st_uid, a.st_gid = self.uid, self.gid
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = ns
        a.st_blksize = 4096
        a.st_blocks = (a.st_size + 511) // 512
        a.entry_timeout = node.entry_ttl
        source = node.watch()
        if source is None:
            a.attr_timeout = node.attr_ttl
        else:
            a.attr_timeout = CACHED_TTL
            if ino not in self._attr_watched:
                self._attr_watched.add(ino)
                source.observers.append(functools.partial(self._attr_changed, ino))
        return a

    def _attr_changed(self, ino: int) -> None:
        """A watched source changed: the kernel's copy of ``ino``'s attributes goes now,
        and so does ours."""
        self._attr_watched.discard(ino)
        self._kept.pop(ino, None)
        try:
            pyfuse3.invalidate_inode(ino, attr_only=True)
        except OSError:
            pass  # the kernel forgot the inode already (ENOENT), or the mount is going

    def _watch_entry(self, parent_ino: int, name: str, node: Node) -> None:
        """``name`` in ``parent_ino`` leads to ``node`` and the kernel may cache that."""
        source = node.entry_watch()
        if source is None or (parent_ino, name) in self._entry_watched:
            return
        self._entry_watched.add((parent_ino, name))

        def changed() -> None:
            parent = self._nodes.get(parent_ino)
            now = parent.lookup(name) if isinstance(parent, Dir) else None
            if now is not None and now.key == node.key and now.valid():
                source.observers.append(changed)  # still there: watch on
                return
            self._entry_watched.discard((parent_ino, name))
            self._listings.pop(parent_ino, None)  # it holds the name as watched
            self._stale_entries.append((parent_ino, name))
            if not self._draining:
                self._draining = True
                trio.lowlevel.spawn_system_task(self._drain_entries)

        source.observers.append(changed)

    @contextlib.contextmanager
    def in_dir(self, ino: int) -> Iterator[None]:
        self._busy_dirs[ino] = self._busy_dirs.get(ino, 0) + 1
        try:
            yield
        finally:
            left = self._busy_dirs[ino] - 1
            if left:
                self._busy_dirs[ino] = left
            else:
                del self._busy_dirs[ino]
                self._dir_free.set()
                self._dir_free = trio.Event()

    async def _drain_entries(self) -> None:
        try:
            while self._stale_entries:
                while any(parent in self._busy_dirs for parent, _name in self._stale_entries):
                    await self._dir_free.wait()
                batch, self._stale_entries = self._stale_entries, []
                await trio.to_thread.run_sync(_invalidate_entries, batch)
        except Exception:  # a system task must not raise: it would end the daemon
            log.exception("invalidating cached names failed")
        finally:
            self._draining = False
            done, self._drained = self._drained, trio.Event()
            done.set()

    async def _entries_settled(self) -> None:
        """Wait until every name found stale so far is gone from the kernel's cache."""
        while self._draining:
            await self._drained.wait()

    def _entry(self, node: Node) -> pyfuse3.EntryAttributes:
        """Attributes for a reply the kernel counts as a lookup (lookup, readdirplus)."""
        a = self._attrs(node)
        self._lookups[a.st_ino] += 1
        return a

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            left = self._lookups.get(ino, 0) - n
            if left > 0:
                self._lookups[ino] = left
                continue
            self._lookups.pop(ino, None)
            if ino == pyfuse3.ROOT_INODE:
                continue
            self._drop(ino)

    def _drop(self, ino: int) -> None:
        """``ino`` leaves the table (the kernel forgot it, or never knew it)."""
        self._epoch += 1
        self._parent.pop(ino, None)
        self._kept.pop(ino, None)
        self._versioned.pop(ino, None)
        self._listings.pop(ino, None)  # a session directory's holds its session
        node = self._nodes.pop(ino, None)
        if node is not None and self._ino.get(node.key) == ino:
            del self._ino[node.key]

    @property
    def known_inodes(self) -> int:
        return len(self._nodes)

    @property
    def parked_reads(self) -> int:
        """Reads waiting at the end of a log as parked requests (``_park``)."""
        return len(self._parked)

    def drop_stale_listings(self) -> None:
        """Forget kept listings that the next opendir would build again anyway (their
        nodes hold what they show: a killed session, until then)."""
        for ino, listing in list(self._listings.items()):
            if listing.dir.listing_version() != listing.version:
                del self._listings[ino]

    def _fh(self, handle: Handle, ctx: pyfuse3.RequestContext) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = handle
        if self._watch is not None and handle.waits:
            self._openers[fh] = interrupt.Opener(ctx.pid, self._watch)
        return fh

    def _handle(self, fh: int) -> Handle:
        try:
            return self._handles[fh]
        except KeyError:
            raise pyfuse3.FUSEError(errno.EBADF) from None

    @staticmethod
    def _name(name: bytes) -> str:
        try:
            return name.decode()
        except UnicodeDecodeError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    # ---- lookups and attributes -----------------------------------------------------

    @translated
    @holds_dir
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        parent = self._dir(parent_inode)
        if name == b".":
            return self._entry(parent)
        await parent.prepare()
        node = parent.lookup(self._name(name))
        if node is None or not node.valid():
            raise pyfuse3.FUSEError(errno.ENOENT)
        if node.stat_prepares:
            await node.prepare()
        a = self._entry(node)
        self._parent[a.st_ino] = parent_inode
        if a.entry_timeout > 0:
            self._watch_entry(parent_inode, self._name(name), node)
        return a

    @translated
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = self._node(inode)
        if node.stat_prepares:
            await node.prepare()
        return self._attrs(node)

    @translated
    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        node = self._node(inode)
        # Giving a file to its owner again is what cp -p, tar and sed -i do: a no-op.
        if (fields.update_uid and attr.st_uid != self.uid) or (
            fields.update_gid and attr.st_gid != self.gid
        ):
            raise pyfuse3.FUSEError(errno.EPERM)
        if fields.update_size:
            # O_TRUNC on a control or prompt file (``echo x > ctl``): nothing to cut;
            # ftruncate on an open prompt cuts its unsubmitted text; a file on disk is cut.
            if not (isinstance(node, File) and node.writable):
                raise pyfuse3.FUSEError(errno.EACCES)
            if fh is not None:
                self._handle(fh).truncate(attr.st_size)
            else:
                await node.truncate(attr.st_size, ctx.pid)
        if fields.update_mode:
            await node.chmod(stat.S_IMODE(attr.st_mode))
        if fields.update_atime or fields.update_mtime:
            await node.set_times(
                attr.st_atime_ns if fields.update_atime else None,
                attr.st_mtime_ns if fields.update_mtime else None,
            )
        if not node.fixed_attrs:
            self._kept.pop(inode, None)
            self._versioned.pop(inode, None)
        return self._attrs(node)

    # ---- extended attributes: none (ENOSYS: the kernel stops asking) ------------------

    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> Sequence[bytes]:
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def setxattr(
        self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext
    ) -> None:
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise pyfuse3.FUSEError(errno.ENOSYS)

    @translated
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_namemax = 255
        return s

    # ---- directories ----------------------------------------------------------------

    @translated
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        d = self._dir(inode)
        await d.prepare()
        fh = self._next_fh
        self._next_fh += 1
        parent = self._nodes.get(self._parent.get(inode, pyfuse3.ROOT_INODE), d)
        version = d.listing_version()
        listing = self._listings.get(inode)
        if (
            listing is None
            or version is None
            or listing.version != version
            or listing.epoch != self._epoch
        ):
            # "." and ".." first, then the entries sorted by name, as ls and find expect.
            entries = [(".", d), ("..", parent), *sorted(d.entries(), key=_by_name)]
            listing = _Listing(
                d, version, self._epoch, entries, [self._attrs(n) for _, n in entries]
            )
            if version is None:
                self._listings.pop(inode, None)
            else:
                self._listings[inode] = listing
            attrs = listing.attrs
        else:
            attrs = list(listing.attrs)
            attrs[0], attrs[1] = self._attrs(d), self._attrs(parent)
            for i in listing.varying:
                attrs[i] = self._attrs(listing.nodes[i])
        self._dirs[fh] = _Open(inode, d, listing, attrs)
        return fh

    @translated
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        o = self._dirs.get(fh)
        if o is None:
            return
        with self.in_dir(o.inode):
            self._readdir(o, start_id, token)

    def _readdir(self, o: _Open, start: int, token: pyfuse3.ReaddirToken) -> None:
        """One READDIRPLUS reply: as many entries from ``start`` as fit, added in bulk.

        Each entry sent is a lookup the kernel counts (but "." and ".."). Entries whose
        node went away since the opendir are left out; while the directory's listing
        version and the inode table are as at the opendir, none can have, and the
        entries go out as built."""
        listing = o.listing
        n = len(listing.names)
        if listing.epoch == self._epoch and (
            listing.version is not None and o.dir.listing_version() == listing.version
        ):
            end = patched.readdir_reply_many(token, listing.names, o.attrs, start)
            self._sent(o, start, end)
            return
        # Checked per entry, a window at a time: what is checked is sent, or waits for
        # the next request when the reply is full.
        attrs = o.attrs = list(o.attrs)
        while start < n:
            stop = min(start + _WINDOW, n)
            for i in range(start, stop):
                node = listing.nodes[i]
                attrs[i] = self._attrs(node) if node.valid() else None
            end = patched.readdir_reply_many(token, listing.names, attrs, start, stop)
            self._sent(o, start, end)
            if end < stop:
                a = attrs[end]
                if a is not None and a.st_ino not in self._lookups:
                    self._drop(a.st_ino)  # not sent: the kernel never knew it
                return
            start = stop

    def _sent(self, o: _Open, start: int, end: int) -> None:
        """Entries ``start`` to ``end`` of ``o`` reached the kernel."""
        lo = max(start, 2)  # the kernel counts no lookup for "." and ".."
        if end <= lo:
            return
        listing = o.listing
        inos = [a.st_ino for a in o.attrs[lo:end] if a is not None]
        self._lookups.update(inos)
        self._parent.update(dict.fromkeys(inos, o.inode))
        unwatched = listing.unwatched
        if unwatched:
            for i in range(lo, end):
                if i in unwatched and o.attrs[i] is not None:
                    unwatched.discard(i)
                    self._watch_entry(o.inode, listing.names[i].decode(), listing.nodes[i])

    @translated
    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    # ---- files ----------------------------------------------------------------------

    @translated
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        node = self._node(inode)
        if not isinstance(node, File):
            raise pyfuse3.FUSEError(errno.EISDIR)
        acc = flags & os.O_ACCMODE
        # root bypasses default_permissions, so the modes are enforced here as well —
        # as a disk does for root: a read-only file is never written, but root may read
        # a write-only one (``ctl``, ``prompt``), which reads as empty (tar, rsync and
        # cp -a as root archive a session without an error).
        if acc in (os.O_WRONLY, os.O_RDWR) and not node.writable:
            raise pyfuse3.FUSEError(errno.EACCES)
        if acc in (os.O_RDONLY, os.O_RDWR) and not node.readable and ctx.uid != 0:
            raise pyfuse3.FUSEError(errno.EACCES)
        await node.prepare()
        handle = node.open(self._how(flags, ctx))
        return patched.file_info(self._fh(handle, ctx), node.direct_io, noflush(handle, flags))

    def _how(self, flags: int, ctx: pyfuse3.RequestContext) -> Open:
        nonblock = bool(flags & os.O_NONBLOCK)
        return Open(pid=ctx.pid, nonblock=nonblock, waiters=self.waiters, flags=flags)

    @translated
    async def read(self, fh: int, off: int, size: int) -> bytes:
        handle = self._handle(fh)
        if not handle.waits:
            return await handle.read(off, size)
        if patched.DEFER and isinstance(handle, LogHandle):
            data = handle.read_now(off, size)
            if data is not None:
                return data
            return self._park(handle, off, size)
        # The request (caller's thread, FUSE_INTERRUPT event) for a read that blocks;
        # without FUSE_INTERRUPT, the thread that opened the file.
        if self._watch is None:
            caller: interrupt.Caller | None = pyfuse3.current_request.get()
        else:
            caller = self._openers.get(fh)
        with interrupt.serving(caller):
            return await handle.read(off, size)

    def _park(self, handle: LogHandle, off: int, size: int) -> bytes:
        """A read at the end of a log: the request is parked on the log (``_Parked``)
        and answered by the append or close that gives it its answer."""
        admit_wait(handle.how)  # EAGAIN for O_NONBLOCK, EMFILE past the bound
        caller = pyfuse3.current_request.get()
        assert caller is not None  # a read handler's request is published
        parked = _Parked(pyfuse3.defer_reply(), handle, off, size, caller.pid, self._parked)
        self._parked.add(parked)
        handle.log.observers.append(parked.changed)
        caller.interrupted = parked  # FUSE_INTERRUPT calls set(), at once if it came
        # pyfuse3 sends the reply later (defer_reply): this object is the read's result.
        return cast(bytes, parked.reply)

    @translated
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        n = await self._handle(fh).write(off, buf)
        # A write to ctl may have renamed or ended a session: its old name is gone from
        # the kernel's cache before the writer goes on (``echo kill > ctl; ls s/x``).
        await self._entries_settled()
        return n

    @translated
    async def flush(self, fh: int) -> None:
        await self._handle(fh).flush()

    @translated
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self._handle(fh).fsync(datasync)

    @translated
    async def release(self, fh: int) -> None:
        self._openers.pop(fh, None)
        polled = self._polled.pop(fh, None)
        if polled is not None:
            polled.scope.cancel()
        handle = self._handles.pop(fh, None)
        if handle is not None:
            handle.release()

    # ---- poll, select, epoll ----------------------------------------------------------

    @translated
    async def poll(
        self,
        inode: int,
        fh: int,
        poll_handle: pyfuse3.PollHandle | None,
        ctx: pyfuse3.RequestContext,
    ) -> int:
        """Readable when a read would answer at once (``Handle.ready``), writable always
        (no write here waits). A handle that is not ready and comes with the kernel's
        poll handle gets a task that waits for the change that makes it ready and then
        wakes the pollers: a reader in poll, select, epoll (asyncio, Node, Go) sleeps
        until there is data, and costs nothing meanwhile. One such task per handle
        however often it is polled; it ends at the wake-up or at the close."""
        handle = self._handle(fh)
        if handle.ready():
            return _READABLE | _WRITABLE
        if poll_handle is not None:
            polled = self._polled.get(fh)
            if polled is None:
                polled = self._polled[fh] = _Polled(poll_handle)
                trio.lowlevel.spawn_system_task(
                    self._wake_when_ready, fh, handle, polled, name="olliefs.fs.fuse.poll"
                )
            else:  # the kernel's latest handle; the older one is destroyed as it goes
                polled.handle = poll_handle
        return _WRITABLE

    async def _wake_when_ready(self, fh: int, handle: Handle, polled: _Polled) -> None:
        try:
            with polled.scope:
                while not handle.ready():
                    await handle.changed()
                if not self._closed:  # after pyfuse3.close() the handle's session is gone
                    patched.notify_poll(polled.handle)
        except Exception:  # a system task must not raise: it would end the daemon
            log.exception("waking the pollers of a file failed")
        finally:
            if self._polled.get(fh) is polled:
                del self._polled[fh]

    def close(self) -> None:
        """Before ``pyfuse3.close()``: no poller is woken and no parked read answered
        any more (the poll handles and the requests name the session that call frees;
        the unmount ends those reads in the kernel)."""
        self._closed = True
        for polled in self._polled.values():
            polled.scope.cancel()
        for parked in list(self._parked):
            parked.end()
        self._polled.clear()

    # ---- namespace changes ----------------------------------------------------------

    @translated
    @holds_dir
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self._dir(parent_inode).unlink(self._name(name))

    @translated
    @holds_dir
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self._dir(parent_inode).rmdir(self._name(name))

    @translated
    @holds_dir
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        if parent_inode_old != parent_inode_new:
            raise pyfuse3.FUSEError(errno.EXDEV)
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise pyfuse3.FUSEError(errno.EINVAL)
        parent = self._dir(parent_inode_old)
        old, new = self._name(name_old), self._name(name_new)
        if flags & pyfuse3.RENAME_NOREPLACE and parent.lookup(new) is not None:
            raise pyfuse3.FUSEError(errno.EEXIST)
        await parent.rename(old, new)
        # The kernel moves its cached entry to the new name without a lookup: watch it
        # there, or a later ``ctl rn`` would leave the new name cached.
        node = parent.lookup(new)
        if node is not None and node.entry_ttl > 0:
            self._watch_entry(parent_inode_old, new, node)

    @translated
    @holds_dir
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        parent = self._dir(parent_inode)
        node, handle = await parent.create(self._name(name), mode, self._how(flags, ctx))
        # The kernel counts a create reply as a lookup of the new inode.
        attrs = self._entry(node)
        direct_io = isinstance(node, File) and node.direct_io
        return patched.file_info(self._fh(handle, ctx), direct_io, noflush(handle, flags)), attrs

    @translated
    @holds_dir
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        parent = self._dir(parent_inode)
        return self._entry(await parent.mkdir(self._name(name), mode))

    @translated
    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        raise pyfuse3.FUSEError(errno.EACCES)


# Entries checked per step where a listing is checked entry by entry (see _readdir).
_WINDOW = 128

_READABLE = select.POLLIN | select.POLLRDNORM
_WRITABLE = select.POLLOUT | select.POLLWRNORM


class _Polled:
    """A handle polled while not ready: the kernel's handle to wake its pollers, and the
    scope of the task that waits to do it."""

    __slots__ = ("handle", "scope")

    def __init__(self, handle: pyfuse3.PollHandle) -> None:
        self.handle = handle
        self.scope = trio.CancelScope()


class _Listing:
    """A directory's entries as READDIRPLUS sends them: names encoded, nodes, attributes
    and inode numbers made once, at an opendir, and used again by the next opendirs
    while the directory's ``listing_version`` stays the same. Attributes of nodes that
    are not ``fixed_attrs`` are made again at each opendir (``varying``)."""

    __slots__ = ("attrs", "dir", "epoch", "names", "nodes", "unwatched", "varying", "version")

    def __init__(
        self,
        d: Dir,
        version: Hashable | None,
        epoch: int,
        entries: list[tuple[str, Node]],
        attrs: list[pyfuse3.EntryAttributes],
    ) -> None:
        self.dir = d
        self.version = version
        self.epoch = epoch
        self.names = [name.encode() for name, _ in entries]
        self.nodes = [node for _, node in entries]
        self.attrs: list[pyfuse3.EntryAttributes | None] = list(attrs)
        self.varying = [i for i, n in enumerate(self.nodes) if i > 1 and not n.fixed_attrs]
        # Entries whose name the kernel may cache, not yet watched (see _watch_entry).
        self.unwatched = {
            i
            for i, n in enumerate(self.nodes)
            if i > 1 and n.entry_ttl > 0 and n.entry_watch() is not None
        }


class _Open:
    """An open directory: its listing, with the attributes this opendir hands out."""

    __slots__ = ("attrs", "dir", "inode", "listing")

    def __init__(
        self,
        inode: int,
        d: Dir,
        listing: _Listing,
        attrs: list[pyfuse3.EntryAttributes | None],
    ) -> None:
        self.inode = inode
        self.dir = d
        self.listing = listing
        self.attrs = attrs


def _invalidate_entries(entries: list[tuple[int, str]]) -> None:
    """In a worker thread: each call may wait for a request in the parent to finish."""
    for parent, name in entries:
        try:
            pyfuse3.invalidate_entry(parent, name.encode())
        except OSError:
            pass  # not cached (ENOENT): nothing to forget


def noflush(handle: Handle, flags: int) -> bool:
    """Whether the kernel may skip FLUSH at close (FOPEN_NOFLUSH): where a flush could
    have nothing to do. A flush is how a prompt is submitted and an edited file saved,
    so only handles without flush work, and opens that can write nothing (read-only,
    no O_TRUNC), go without; each of those closes saves a round trip."""
    if type(handle).flush is Handle.flush:
        return True
    return flags & os.O_ACCMODE == os.O_RDONLY and not flags & os.O_TRUNC


def _by_name(entry: tuple[str, Node]) -> str:
    return entry[0]


def mount_options(fsname: str = "olliefs") -> set[str]:
    opts = set(pyfuse3.default_options)
    opts.add(f"fsname={fsname}")
    opts.add("subtype=olliefs")
    opts.add("default_permissions")
    return opts


class _Parked:
    """A read waiting at the end of a log, as a request parked on it (pyfuse3's
    ``defer_reply``), not a task: the log's next append or close calls ``changed``,
    which answers it there and then, in the appender's own pass, or parks it again.
    A thousand followers of busy streams so cost no worker, no task and no hand-over
    each, and their next reads are served back to back.

    FUSE_INTERRUPT calls ``set`` (with libfuse holding the request: no reply there),
    and a task then applies the rule of ``interrupt.wait``: EINTR at once for a signal
    that needs the reader back, else the read waits on and its thread is looked at
    every ``interrupt.WATCH_PERIOD`` until it ends (a reader stopped by Ctrl-Z)."""

    __slots__ = ("handle", "off", "parked", "pid", "reply", "size")

    def __init__(
        self,
        reply: pyfuse3.DeferredReply,
        handle: LogHandle,
        off: int,
        size: int,
        pid: int,
        parked: set[_Parked],
    ) -> None:
        self.reply = reply
        self.handle = handle
        self.off = off
        self.size = size
        self.pid = pid
        self.parked = parked

    def end(self) -> bool:
        """Take it off the waiting reads; False if it had ended already."""
        if self not in self.parked:
            return False
        self.parked.discard(self)
        self.handle.how.waiters.count -= 1
        return True

    def changed(self) -> None:
        if self not in self.parked:
            return
        try:
            data = self.handle.read_now(self.off, self.size)
        except Exception:  # called by whoever appended: it must not fail them
            log.exception("answering a waiting read failed")
            if self.end():
                self.reply.reply_error(errno.EIO)
            return
        if data is None:  # still nothing where it reads (it read past the end)
            self.handle.log.observers.append(self.changed)
        elif self.end():
            self.reply.reply(data)

    def set(self) -> None:
        if self in self.parked:
            trio.lowlevel.spawn_system_task(self._interrupted, name="olliefs.fs.fuse.interrupted")

    async def _interrupted(self) -> None:
        try:
            logged = False
            while self in self.parked:
                if interrupt.thread_wants_out(self.pid):
                    if self.end():
                        self.reply.reply_error(errno.EINTR)
                    return
                if not logged:
                    logged = True
                    log.info(
                        "blocked read of thread %d: stopped or ignored signal, waiting on",
                        self.pid,
                    )
                await trio.sleep(interrupt.WATCH_PERIOD)
        except Exception:  # a system task must not raise: it would end the daemon
            log.exception("interrupting a waiting read failed")
