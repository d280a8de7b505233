"""The kinds of file the tree is made of, independent of FUSE or 9P.

A ``Node`` is what a path names; opening a ``File`` gives a ``Handle`` that serves reads
and writes. Nodes are cheap objects made on lookup from the declaration in ``spec.py``;
their identity (``key``) is stable across renames, so frontends can keep inode numbers.

Kinds:

* ``Text``     read-only synthetic text, snapshotted at open (a read sees one version);
* ``Script``   like ``Text`` but executable (``tail``);
* ``Control``  written one request per ``write(2)`` (at most ``MAX_CONTROL_WRITE`` bytes,
               what the kernel passes in one piece), applied before write returns; may be
               readable (``cfg``, ``s/new``), and may answer the request on the same handle
               (``s/new`` reads back the id it created, the Plan 9 clone-file way);
* ``PromptIn`` text collected per handle, submitted at flush (close); at most ``limit``
               bytes (``Cap``: past it, nothing of the text is taken);
* ``Query``    a request written in pieces and asked at the first read, which waits for
               the answer and returns it on the same handle (``complete``);
* ``LogFile``  a ``GrowingLog``: ``chat`` (EOF at the end) or, blocking, ``stream`` and
               ``events`` (a read at the end waits for more);
* ``StateWait`` one value per open: blocks until the state differs from the one at open.

Blocking reads wait on the log's parking lot and wake in the same scheduler tick as the
data, or when the frontend says the request was interrupted by a signal
(``olliefs.fs.interrupt``), and then fail with EINTR if the signal needs the reader back.
An idle blocked read never wakes.

A handle also says whether a read would answer at once (``ready``), and waits for the
change that may make it so (``changed``): what poll, select and epoll are answered with.
A log handle knows where its reader is by its last read (the kernel tells a poll nothing
of the file offset): after a read that ended at the end, it is ready again when the log
grows; a reader that seeks without reading is found ready once, and its read then tells
where it is.
"""

from __future__ import annotations

import codecs
import os
import stat
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from olliefs.caller import Caller
from olliefs.errors import (
    Busy,
    Denied,
    InvalidRequest,
    NotFound,
    NotPermitted,
    OllieError,
    TooLarge,
    TooMany,
    WouldBlock,
    size_text,
)
from olliefs.fs import interrupt
from olliefs.live import GrowingLog, StateCell

STARTED = time.time()  # the mtime of what never changes while the daemon runs

# How long the kernel may keep what it was told of a node whose every change is announced
# (a ``Watchable`` source) or that never changes: the frontend invalidates the kernel's
# copy at the change, so the figure only bounds the damage of a change left unannounced.
CACHED_TTL = 1.0

MAX_CONTROL_WRITE = (1 << 20) - os.sysconf("SC_PAGE_SIZE")
"""The longest control write (``s/new``, ``ctl``, ``cfg``) taken: the longest write(2)
the kernel always passes in one FUSE request (1,044,480 bytes with 4 KiB pages). A
request carries at most 1 MiB (libfuse's max_write) less the offset of the writer's
buffer in its page, so a longer write(2) comes in pieces at increasing offsets, the first
one longer than this. Refusing that one fails the whole write(2) with nothing applied;
applying the pieces one by one applied 95,322 of 100,000 ``maxsteps 8`` lines before the
``bogus`` one in the second piece was refused."""

MAX_TEXT = 1 << 20
"""The longest ``plan`` (and other small texts written whole, applied at close)."""


class Watchable(Protocol):
    """A source of content that announces its changes (``GrowingLog``, ``StateCell``).

    ``observers`` are called, once each, at the next change and then dropped (the source
    empties the list before calling them): a frontend registers one when it tells the
    kernel something it may cache, and the call is its cue to invalidate it.
    """

    observers: list[Callable[[], None]]


class Stamp:
    """When a synthetic file last changed.

    A synthetic file's text is rendered on demand, so it has no write time of its own:
    its stamp compares each rendering with the last one seen and moves the mtime only
    when the text changed. Editors (vim, nano, Emacs compare mtimes before saving), tar
    and rsync (files must stand still while read) see a file that changes when its
    content does, not one that is new at every stat.
    """

    __slots__ = ("_digest", "mtime")

    def __init__(self, born: float) -> None:
        self.mtime = born
        self._digest: int | None = None

    def seen(self, data: bytes) -> float:
        digest = hash(data)
        if self._digest is None:
            self._digest = digest
        elif digest != self._digest:
            self._digest = digest
            self.mtime = time.time()
        return self.mtime


def _ns(t: float) -> int:
    return int(t * 1e9)


@dataclass
class Waiters:
    """Bounds the number of reads blocked at once (each holds a FUSE worker, or with
    deferred replies a parked request: memory either way)."""

    limit: int
    count: int = 0


@dataclass
class Open:
    """What a frontend knows about an open: who opened it and how."""

    pid: int
    nonblock: bool
    waiters: Waiters
    flags: int = 0  # the open(2) flags: access mode, O_APPEND, O_TRUNC, O_EXCL

    @property
    def walker(self) -> bool:
        """Opened by a program that copies or searches a tree, not by a follower.

        ``cp -r``/``cp -a``, ``grep -r`` and ``tar`` open every file with O_NOFOLLOW (they
        copy a symlink as a symlink); ``cat``, ``tail -f``, shells' redirections and
        every language's plain open do not. A walker reads a blocking file as it is
        now: EOF at its current end, nothing from ``statewait``, and ``fifo.out`` gives
        it nothing and takes nothing off the queue (ollie(5), COPYING AND SEARCHING)."""
        return bool(self.flags & os.O_NOFOLLOW)


class Node:
    key: Hashable
    perm: int = 0o444
    # How long the kernel may keep this name -> node lookup. Names declared in spec.py
    # never change while their parent exists; session directories come and go.
    entry_ttl: float = 1.0
    # How long the kernel may keep the attributes of a node without a ``watch()`` source.
    # Synthetic text: never (its size changes as the runtime does, unannounced: each stat
    # renders it). Files that never change and directories: CACHED_TTL (with
    # default_permissions the kernel checks every directory of a path on every walk, so
    # caching them saves a round trip per path component). A node with a ``watch()``
    # source is cached CACHED_TTL and invalidated when the source changes.
    attr_ttl: float = 0.0
    # True where mode, size, mtime and nlink never change while the node lives (a
    # session's directory): the frontend may build its attributes once.
    fixed_attrs: bool = False

    @property
    def mode(self) -> int:
        return stat.S_IFREG | self.perm

    def size(self) -> int:
        return 0

    def mtime(self) -> float:
        return STARTED

    def stat(self) -> tuple[int, int]:
        """Size and mtime in nanoseconds together (a synthetic file renders once)."""
        return self.size(), self.mtime_ns()

    def mtime_ns(self) -> int:
        """The mtime to report, exact where the node has one in nanoseconds (a file on
        disk: rsync and tar compare what they set with what they read back)."""
        return int(self.mtime() * 1e9)

    def valid(self) -> bool:
        return True

    def watch(self) -> Watchable | None:
        """What announces every change of this node's size and mtime (None: nothing)."""
        return None

    def attrs_version(self) -> Hashable | None:
        """A value that changes whenever this node's size or mtime may have: while it
        stays equal, the attributes made last are still right, and the frontend hands
        them out again without rendering the content (a listing of a session's
        directory renders nothing). None: no such value (made at each stat)."""
        return None

    def entry_watch(self) -> Watchable | None:
        """What announces that this node may have left its name (renamed, removed)
        behind the kernel's back; None where the name is only changed through the
        mount (the kernel then updates its own cache) or never."""
        return None

    async def chmod(self, mode: int) -> None:
        raise NotPermitted("the mode of this file is fixed")

    async def set_times(self, atime_ns: int | None, mtime_ns: int | None) -> None:
        """``utimes``/``touch``: ignored where the node has no times of its own."""

    # A file whose ``prepare`` changes what it shows (models, ctxsz): it is prepared before
    # its attributes are given too, so the first stat has the size the first read gets.
    stat_prepares: bool = False

    async def prepare(self) -> None:
        """Bring what this node shows up to date before it is looked into or opened.

        Most nodes render from memory and need nothing; a node that shows what another
        process holds (toolsrv's catalogue) fetches it here, where awaiting is allowed.
        """


class Handle:
    # Whether a read may wait (``wait_until``): the frontend then tells the wait which
    # request it serves, so that a signal ends it. A handle whose reads never wait says
    # False and saves that (the default is the safe one).
    waits = True

    def ready(self) -> bool:
        """Whether a read now would answer without waiting (poll's POLLIN)."""
        return True

    async def changed(self) -> None:
        """Wait for the next change that may make ``ready()`` true (callers check again)."""
        raise NotImplementedError

    async def read(self, off: int, size: int) -> bytes:
        return b""  # a write-only file, opened for reading by root: empty

    async def write(self, off: int, data: bytes) -> int:
        raise Denied("not writable")

    async def flush(self) -> None:
        pass

    def truncate(self, size: int) -> None:
        """``ftruncate`` on this handle; only prompt text can be cut."""

    async def fsync(self, datasync: bool) -> None:
        pass

    def release(self) -> None:
        pass


class Cap:
    """The limit of a text written in pieces and taken whole at close (a prompt, a plan,
    a profile). The write that passes ``limit`` bytes fails with EFBIG and the reason
    goes to ``refused``; from then on every write and the close fail too, so nothing of
    the text is taken (the part before the limit included), until ``ftruncate(fd, 0)``
    starts a new one (``reset``)."""

    __slots__ = ("limit", "outcome", "over", "refused", "what")

    def __init__(self, what: str, limit: int, refused: Callable[[str], None], outcome: str) -> None:
        self.what = what
        self.limit = limit
        self.refused = refused
        self.outcome = outcome
        self.over = False

    def error(self) -> TooLarge:
        return TooLarge(f"{self.what}: longer than {size_text(self.limit)} ({self.outcome})")

    def check(self, size: int) -> None:
        """The text is to be ``size`` bytes long."""
        if self.over:
            raise self.error()
        if size > self.limit:
            self.over = True
            err = self.error()
            self.refused(str(err))
            raise err

    def reset(self) -> None:
        self.over = False


class File(Node):
    direct_io = True

    @property
    def readable(self) -> bool:
        return bool(self.perm & 0o444)

    @property
    def writable(self) -> bool:
        return bool(self.perm & 0o222)

    def open(self, how: Open) -> Handle:
        raise NotImplementedError

    async def truncate(self, size: int, pid: int = 0) -> None:
        """``truncate(2)`` by path on a writable file (by the process ``pid``): nothing to
        cut in a control file."""

    async def set_times(self, atime_ns: int | None, mtime_ns: int | None) -> None:
        """A read-only file's times are its content's (``chat``'s last append, ...):
        EPERM, as on a disk for a file one may not write. A writable synthetic file
        (``ctl``, ``prompt``, ``cfg``) has none to set: ignored, like a chown to its
        owner."""
        if not self.writable:
            raise NotPermitted("the times of a read-only file are fixed")


class Dir(Node):
    perm = 0o555
    attr_ttl = CACHED_TTL

    @property
    def mode(self) -> int:
        return stat.S_IFDIR | self.perm

    def nlink(self) -> int:
        """2 plus one per sub-directory, as on a disk (``find`` relies on it)."""
        return 2 + sum(isinstance(n, Dir) for _, n in self.entries())

    def entries(self) -> Iterable[tuple[str, Node]]:
        raise NotImplementedError

    def listing_version(self) -> Hashable | None:
        """A value that changes whenever ``entries()`` would give other names or nodes,
        or a node listed would stop being ``valid()``; None: no such value (the frontend
        lists the directory afresh at each opendir and checks each entry as it sends it).
        """
        return None

    def lookup(self, name: str) -> Node | None:
        for n, node in self.entries():
            if n == name:
                return node
        return None

    async def unlink(self, name: str) -> None:
        raise Denied(f"cannot remove {name}")

    async def rmdir(self, name: str) -> None:
        raise Denied(f"cannot remove {name}")

    async def rename(self, old: str, new: str) -> None:
        raise Denied(f"cannot rename {old}")

    async def create(self, name: str, mode: int, how: Open) -> tuple[Node, Handle]:
        """``open(O_CREAT)`` of a new name: the new node and a handle opened as ``how``."""
        raise Denied(f"cannot create {name} here")

    async def mkdir(self, name: str, mode: int) -> Node:
        raise Denied(f"cannot make a directory {name} here")


# ---- read-only text ------------------------------------------------------------------


class SnapshotHandle(Handle):
    waits = False

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def read(self, off: int, size: int) -> bytes:
        return self.data[off : off + size]


@dataclass(eq=False)
class Text(File):
    key: Hashable
    render: Callable[[], str]
    live: Callable[[], bool] = lambda: True
    refresh: Callable[[], Awaitable[None]] | None = None
    stamp: Stamp | None = None
    source: Watchable | None = None  # announces each change of the rendered text
    # Changes whenever the rendered text may have (``Node.attrs_version``).
    version: Callable[[], Hashable | None] | None = None

    def size(self) -> int:
        return len(self.render().encode())

    def watch(self) -> Watchable | None:
        return self.source

    def attrs_version(self) -> Hashable | None:
        return None if self.version is None else self.version()

    def stat(self) -> tuple[int, int]:
        data = self.render().encode()
        return len(data), _ns(self.stamp.seen(data) if self.stamp else STARTED)

    def valid(self) -> bool:
        return self.live()

    @property
    def stat_prepares(self) -> bool:  # type: ignore[override]
        return self.refresh is not None

    async def prepare(self) -> None:
        if self.refresh is not None:
            await self.refresh()

    def open(self, how: Open) -> Handle:
        return SnapshotHandle(self.render().encode())


@dataclass(eq=False)
class Script(Text):
    perm: int = 0o555
    direct_io = False


# ---- control files -------------------------------------------------------------------


class ControlHandle(Handle):
    """Reads after a write that answered return the answer from its start, whether the
    reader seeks back to 0 (``pread``) or goes on reading where the write ended (a shell's
    ``exec 3<>s/new; echo ... >&3; read id <&3``)."""

    waits = False

    def __init__(self, node: Control, caller: Caller) -> None:
        self.node = node
        self.caller = caller
        self.answer: bytes | None = None
        self.base = 0  # file offset at which the answer starts

    async def read(self, off: int, size: int) -> bytes:
        if self.answer is None:
            if self.node.render is None:
                return b""  # write-only (ctl), read by root: empty
            self.answer = self.node.render().encode()
        pos = off - self.base if off >= self.base else off
        return self.answer[pos : pos + size]

    async def write(self, off: int, data: bytes) -> int:
        if len(data) > MAX_CONTROL_WRITE:
            # Maybe the first piece of a longer write(2): refused, the write(2) fails whole.
            reason = (
                f"{self.node.name}: a write longer than {MAX_CONTROL_WRITE} bytes"
                " (refused whole, nothing of it applied)"
            )
            self._refused(reason)
            raise TooLarge(reason)
        try:
            text = data.decode()
        except UnicodeDecodeError:
            self._refused(f"{self.node.name}: not valid UTF-8")
            raise InvalidRequest("not valid UTF-8") from None
        reply = await self.node.apply(text, self.caller)
        if reply is not None:
            self.answer = reply.encode()
            self.base = off + len(data)
        return len(data)

    def _refused(self, reason: str) -> None:
        # Refused before the request reaches its owner: say why here, so that err (and
        # chat) has the reason as for every other refused request.
        if self.node.refused is not None:
            self.node.refused(reason)


@dataclass(eq=False)
class Control(File):
    key: Hashable
    apply: Callable[[str, Caller], Awaitable[str | None]]
    render: Callable[[], str] | None = None
    perm: int = 0o222
    live: Callable[[], bool] = lambda: True
    stamp: Stamp | None = None
    # Where a refusal made here (not by ``apply``) is reported: the session's or the
    # root ``err``.
    refused: Callable[[str], None] | None = None
    # Changes whenever the rendered text may have (``Node.attrs_version``).
    version: Callable[[], Hashable | None] | None = None

    def attrs_version(self) -> Hashable | None:
        return None if self.version is None else self.version()

    @property
    def name(self) -> str:
        """How a reason names it: ``cfg`` in a session's err, ``s/new`` in the root's."""
        key = self.key
        if not isinstance(key, tuple):
            return str(key)
        return str(key[-1]) if len(key) == 3 else "/".join(map(str, key))

    def size(self) -> int:
        return len(self.render().encode()) if self.render else 0

    def stat(self) -> tuple[int, int]:
        if self.render is None:
            return 0, _ns(self.stamp.mtime if self.stamp else STARTED)
        data = self.render().encode()
        return len(data), _ns(self.stamp.seen(data) if self.stamp else STARTED)

    def valid(self) -> bool:
        return self.live()

    def open(self, how: Open) -> Handle:
        return ControlHandle(self, Caller(how.pid))


# ---- prompts -------------------------------------------------------------------------


class PromptHandle(Handle):
    """Text collected per handle and submitted at flush (close).

    A prompt is a stream, like a pipe: every write appends, whatever its offset (an
    ``O_APPEND`` writer's offset is the file's reported size, 0). Each write is checked
    as it comes, so that a shell, which ignores errors from close(), still sees a bad
    prompt refused: bytes that can never be UTF-8 fail that write with EINVAL and are
    not kept; a sequence cut at the end of a write may be completed by the next one.
    ``ftruncate`` cuts the text not yet submitted (``ftruncate(fd, 0)`` discards it).
    A prompt longer than ``limit`` bytes fails the write that passes the limit with
    EFBIG; the text is dropped, every later write fails too, and so does the close,
    which submits nothing (until ``ftruncate(fd, 0)`` starts a new prompt).
    """

    waits = False

    def __init__(
        self,
        submit: Callable[[str, Caller], Awaitable[None]],
        refused: Callable[[str], None],
        limit: int,
        caller: Caller,
    ) -> None:
        self.submit = submit
        self.refused = refused
        self.cap = Cap("prompt", limit, refused, "not submitted")
        self.caller = caller
        self.buf = bytearray()

    async def write(self, off: int, data: bytes) -> int:
        try:
            self.cap.check(len(self.buf) + len(data))
        except TooLarge:
            self.buf = bytearray()
            raise
        try:
            _utf8_prefix(bytes(self.buf) + data)
        except UnicodeDecodeError:
            self.refused("prompt: not valid UTF-8 (the write was refused)")
            raise InvalidRequest("prompt is not valid UTF-8") from None
        self.buf += data
        return len(data)

    def truncate(self, size: int) -> None:
        del self.buf[size:]
        if size == 0:
            self.cap.reset()

    async def flush(self) -> None:
        if self.cap.over:
            raise self.cap.error()
        if not self.buf:
            return
        data, self.buf = bytes(self.buf), bytearray()
        try:
            text = data.decode()
        except UnicodeDecodeError:
            self.refused("prompt: ends inside a UTF-8 sequence (not submitted)")
            raise InvalidRequest("prompt is not valid UTF-8") from None
        await self.submit(text, self.caller)


def _utf8_prefix(data: bytes) -> None:
    """Raise unless ``data`` is UTF-8, or UTF-8 cut inside its last character."""
    codecs.getincrementaldecoder("utf-8")().decode(data, final=False)


@dataclass(eq=False)
class PromptIn(File):
    key: Hashable
    submit: Callable[[str, Caller], Awaitable[None]]
    refused: Callable[[str], None]
    limit: int  # the longest prompt, in bytes (the runtime's MAX_PROMPT)
    perm: int = 0o222
    live: Callable[[], bool] = lambda: True
    attr_ttl = CACHED_TTL  # always empty, never changes
    fixed_attrs = True

    def valid(self) -> bool:
        return self.live()

    def open(self, how: Open) -> Handle:
        return PromptHandle(self.submit, self.refused, self.limit, Caller(how.pid))


# ---- a question and its answer on one handle -----------------------------------------


class Pending(Protocol):
    """A request on its way (``Query``): done once its answer or its error is in."""

    done: bool

    async def wait(self) -> None:
        """Return once ``done`` (may return early: the caller checks again)."""
        ...

    def result(self) -> str:
        """The answer; raises the ``OllieError`` the request ended with."""
        ...

    def cancel(self) -> None: ...


class QueryHandle(Handle):
    """The request is written in any number of writes (each appends, as to a prompt),
    and asked at the first read, which waits for the answer. Reads then return the
    answer from its start, whether the reader seeks back to 0 or goes on where its
    writes ended (``exec 3<>complete; ... >&3; cat <&3``), as on a control file. Where
    they ended is not one number: a ``pwrite`` leaves the file offset where it was, an
    O_APPEND write puts it at the end of the write as the kernel saw it. So the ends of
    the last writes are kept, and a first read at one of them starts the answer there;
    a first read anywhere else reads the answer at its own offset.

    ``check`` sees what was written so far at each write until it says there is nothing
    more to check before the read: a bad header fails the write that completes it,
    where a shell sees it. A write after the read is refused (EBUSY: one request per
    open). Closing the handle cancels a request still on its way, so a reader that died
    of its Ctrl-C costs nothing more. A read before any write is EOF, and asks nothing
    (``cat``, ``cp -r`` of the tree)."""

    def __init__(self, node: Query, how: Open) -> None:
        self.node = node
        self.how = how
        self.caller = Caller(how.pid)
        self.buf = bytearray()
        self.checked = False
        self.cap = Cap(node.name, MAX_TEXT, node.refused, "not asked")
        self.pending: Pending | None = None
        self.answer: bytes | None = None
        self.ends: deque[int] = deque(maxlen=64)  # where the last writes ended
        self.base: int | None = None  # file offset at which the answer starts

    async def write(self, off: int, data: bytes) -> int:
        if self.pending is not None:
            reason = f"{self.node.name}: one request per open, and this one was asked"
            self.node.refused(reason)
            raise Busy(reason)
        self.cap.check(len(self.buf) + len(data))
        self.buf += data
        if not self.checked:
            try:
                self.checked = self.node.check(bytes(self.buf))
            except OllieError:
                del self.buf[len(self.buf) - len(data) :]
                raise
        self.ends.append(off + len(data))
        return len(data)

    def truncate(self, size: int) -> None:
        if self.pending is None:
            del self.buf[size:]
            self.checked = False
            if size == 0:
                self.cap.reset()

    async def read(self, off: int, size: int) -> bytes:
        if self.answer is None:
            if self.pending is None:
                if not self.buf or self.how.walker:
                    return b""
                if self.cap.over:
                    raise self.cap.error()
                self.pending = self.node.ask(bytes(self.buf), self.caller)
                self.buf = bytearray()
            pending = self.pending
            await wait_until(lambda: pending.done, pending.wait, self.how)
            self.answer = pending.result().encode()
        if self.base is None:
            self.base = off if off in self.ends else 0
        pos = off - self.base if off >= self.base else off
        return self.answer[pos : pos + size]

    def release(self) -> None:
        if self.pending is not None and not self.pending.done:
            self.pending.cancel()


@dataclass(eq=False)
class Query(File):
    """A file that answers what is written to it on the same handle (``complete``)."""

    key: Hashable
    check: Callable[[bytes], bool]
    ask: Callable[[bytes, Caller], Pending]
    refused: Callable[[str], None]
    perm: int = 0o666
    attr_ttl = CACHED_TTL  # stats as empty, always

    @property
    def name(self) -> str:
        key = self.key
        return "/".join(map(str, key)) if isinstance(key, tuple) else str(key)

    def open(self, how: Open) -> Handle:
        return QueryHandle(self, how)


# ---- a file written whole ------------------------------------------------------------


class CollectedHandle(Handle):
    """Written like a file on disk (O_TRUNC, writes at offsets, ftruncate), applied
    whole when the writer closes it: an editor's save replaces the content once."""

    waits = False

    def __init__(self, node: Collected, trunc: bool, append: bool = False) -> None:
        self.node = node
        # O_APPEND: every write goes to the end of this handle's text. The kernel's offset
        # is the size the file reported, which is the saved text, not this handle's.
        self.append = append
        self.buf = bytearray(b"" if trunc else node.render().encode())
        self.dirty = trunc  # as on a disk, ``: > plan`` empties it even with no write
        self.cap = Cap(str(node.key[-1]), MAX_TEXT, node.refused, "not saved")

    async def read(self, off: int, size: int) -> bytes:
        return bytes(self.buf[off : off + size])

    async def write(self, off: int, data: bytes) -> int:
        if self.append:
            off = len(self.buf)
        self.cap.check(off + len(data))
        if off > len(self.buf):
            self.buf += b"\0" * (off - len(self.buf))
        self.buf[off : off + len(data)] = data
        self.dirty = True
        return len(data)

    def truncate(self, size: int) -> None:
        # As on a disk: ftruncate cuts, or extends with NUL bytes.
        if size == 0:
            self.cap.reset()
        self.cap.check(size)
        del self.buf[size:]
        self.buf += b"\0" * (size - len(self.buf))
        self.dirty = True

    async def flush(self) -> None:
        if self.cap.over:
            raise self.cap.error()
        if not self.dirty:
            return
        try:
            text = bytes(self.buf).decode()
        except UnicodeDecodeError:
            self.node.refused(f"{self.node.key[-1]}: not valid UTF-8 (not saved)")
            raise InvalidRequest("not valid UTF-8") from None
        self.dirty = False
        self.node.apply(text)


@dataclass(eq=False)
class Collected(File):
    """A small rw text kept by the runtime (``plan``): read its text, replace it whole."""

    key: tuple[str, ...]
    apply: Callable[[str], None]
    render: Callable[[], str]
    refused: Callable[[str], None]
    live: Callable[[], bool] = lambda: True
    stamp: Stamp | None = None
    perm: int = 0o666
    direct_io = True
    # Changes whenever the rendered text may have (``Node.attrs_version``).
    version: Callable[[], Hashable | None] | None = None

    def attrs_version(self) -> Hashable | None:
        return None if self.version is None else self.version()

    def stat(self) -> tuple[int, int]:
        data = self.render().encode()
        return len(data), _ns(self.stamp.seen(data) if self.stamp else STARTED)

    def valid(self) -> bool:
        return self.live()

    def open(self, how: Open) -> Handle:
        return CollectedHandle(self, bool(how.flags & os.O_TRUNC), bool(how.flags & os.O_APPEND))


# ---- logs and blocking reads ---------------------------------------------------------


def editors_own(name: str) -> bool:
    """A name an editor makes beside the file it saves, never the user's document: Emacs'
    lock (``.#x``), vim's swap and backup (``.x.swp``, ``x~``) and the file vim makes to
    learn whether it may write a folder (``4913``, ``4914`` ...). Where such a name has
    no place (``a/``, ``sk/``) it is refused (EACCES) without a reason in ``err``: the
    reason there stays the one about what the user saved."""
    return name.startswith(".") or name.endswith("~") or name.isdigit()


async def wait_until(
    ready: Callable[[], bool], park: Callable[[], Awaitable[None]], how: Open
) -> None:
    """Wait for ``ready()``; EAGAIN for O_NONBLOCK, EINTR when the reader is signalled."""
    if ready():
        return
    admit_wait(how)
    try:
        await interrupt.wait(ready, park)
    finally:
        how.waiters.count -= 1


def admit_wait(how: Open) -> None:
    """A read is about to wait: EAGAIN for O_NONBLOCK, EMFILE past the bound of blocked
    reads; else it is counted (the caller takes it off ``how.waiters`` at its end)."""
    if how.nonblock:
        raise WouldBlock("no data yet")
    if how.waiters.count >= how.waiters.limit:
        raise TooMany("too many blocked readers")
    how.waiters.count += 1


class LogHandle(Handle):
    def __init__(self, log: GrowingLog, blocking: bool, how: Open) -> None:
        self.log = log
        self.blocking = blocking
        self.how = how
        self.pos = 0  # where the reader is, as its last read said (for ``ready``)
        log.hold()  # a removed session's log file stays readable while this is open

    def release(self) -> None:
        self.log.let_go()

    def ready(self) -> bool:
        log = self.log
        return not self.blocking or self.how.walker or self.pos < len(log) or log.closed

    async def changed(self) -> None:
        await self.log.wait()

    def _has(self, off: int) -> bool:
        """Whether a read at ``off`` answers now (data there, EOF, or no waiting)."""
        log = self.log
        return off < len(log) or log.closed or not self.blocking or self.how.walker

    def read_now(self, off: int, size: int) -> bytes | None:
        """The read's answer if it needs no wait, else None: then ``self.log``'s next
        change (its ``observers``) may bring it. The FUSE frontend parks such a read
        there instead of holding a task for it (``Operations.read``)."""
        self.pos = off
        if not self._has(off):
            return None
        data = self.log.read(off, size)
        self.pos = off + len(data)
        return data

    async def read(self, off: int, size: int) -> bytes:
        data = self.read_now(off, size)
        while data is None:
            await wait_until(lambda: self._has(off), self.log.wait, self.how)
            data = self.read_now(off, size)
        return data


@dataclass(eq=False)
class LogFile(File):
    key: Hashable
    log: GrowingLog
    blocking: bool = False

    def size(self) -> int:
        return len(self.log)

    def mtime(self) -> float:
        return self.log.mtime

    def watch(self) -> Watchable | None:
        return self.log

    def valid(self) -> bool:
        return not self.log.closed

    def open(self, how: Open) -> Handle:
        return LogHandle(self.log, self.blocking, how)


class StateWaitHandle(Handle):
    def __init__(self, cell: StateCell, gone: Callable[[], bool], how: Open) -> None:
        self.cell = cell
        self.gone = gone
        self.ref = cell.version
        self.how = how
        self.done = False

    def ready(self) -> bool:
        return self.done or self.how.walker or self.cell.version != self.ref or self.gone()

    async def changed(self) -> None:
        await self.cell.wait()

    async def read(self, off: int, size: int) -> bytes:
        if self.done or self.how.walker:
            return b""
        cell = self.cell
        await wait_until(lambda: cell.version != self.ref or self.gone(), cell.wait, self.how)
        self.done = True
        if cell.version == self.ref:
            return b""  # the session went away
        return (self.cell.value + "\n").encode()[:size]


@dataclass(eq=False)
class StateWait(File):
    key: Hashable
    cell: StateCell
    gone: Callable[[], bool]
    attr_ttl = CACHED_TTL  # reads as one value per open; stats as empty, always
    fixed_attrs = True

    def valid(self) -> bool:
        return not self.gone()

    def open(self, how: Open) -> Handle:
        return StateWaitHandle(self.cell, self.gone, how)


class FifoOutHandle(Handle):
    """One queued prompt per open: waits until one is queued, takes it, then EOF."""

    def __init__(self, node: FifoOut, how: Open) -> None:
        self.node = node
        self.how = how
        self.got: bytes | None = None

    def ready(self) -> bool:
        node = self.node
        return self.how.walker or self.got is not None or node.gone() or node.queued()

    async def changed(self) -> None:
        await self.node.park()

    async def read(self, off: int, size: int) -> bytes:
        node = self.node
        if self.how.walker:
            return b""
        if self.got is None:
            taken: list[str] = []

            def ready() -> bool:
                if node.gone():
                    return True
                text = node.pop()
                if text is not None:
                    taken.append(text)
                return bool(taken)

            await wait_until(ready, node.park, self.how)
            self.got = (taken[0] + "\n").encode() if taken else b""
        return self.got[off : off + size]


@dataclass(eq=False)
class FifoOut(File):
    key: Hashable
    pop: Callable[[], str | None]
    park: Callable[[], Awaitable[None]]
    gone: Callable[[], bool]
    # Whether a prompt is queued (poll finds fifo.out readable; another reader may
    # still take it first, as with a pipe).
    queued: Callable[[], bool] = lambda: False
    attr_ttl = CACHED_TTL  # stats as empty, always
    fixed_attrs = True

    def valid(self) -> bool:
        return not self.gone()

    def open(self, how: Open) -> Handle:
        return FifoOutHandle(self, how)


# ---- directories ---------------------------------------------------------------------


@dataclass(eq=False)
class StaticDir(Dir):
    """A directory whose children are declared (``spec.py``) and bound to one target."""

    key: Hashable
    children: Callable[[], dict[str, Node]]
    live: Callable[[], bool] = lambda: True
    born: float = field(default_factory=time.time)
    refresh: Callable[[], Awaitable[None]] | None = None

    async def prepare(self) -> None:
        if self.refresh is not None:
            await self.refresh()

    def entries(self) -> Iterable[tuple[str, Node]]:
        return self.children().items()

    def lookup(self, name: str) -> Node | None:
        return self.children().get(name)

    def valid(self) -> bool:
        return self.live()

    def mtime(self) -> float:
        return self.born


# ---- views of files on disk ----------------------------------------------------------


class DiskHandle(Handle):
    waits = False

    def __init__(self, fd: int) -> None:
        self.fd = fd

    async def read(self, off: int, size: int) -> bytes:
        return os.pread(self.fd, size, off)

    def release(self) -> None:
        os.close(self.fd)


@dataclass(eq=False)
class DiskFile(File):
    """A read-only file of the daemon's own (a branch, a compaction snapshot): what the
    disk has, size and mtime included, read straight from it."""

    key: Hashable
    path: Path
    direct_io = False

    def _stat(self) -> os.stat_result | None:
        try:
            return os.stat(self.path)
        except OSError:
            return None

    def size(self) -> int:
        st = self._stat()
        return st.st_size if st else 0

    def mtime(self) -> float:
        st = self._stat()
        return st.st_mtime if st else 0.0

    def valid(self) -> bool:
        return self.path.is_file()

    def open(self, how: Open) -> Handle:
        try:
            return DiskHandle(os.open(self.path, os.O_RDONLY | os.O_CLOEXEC))
        except FileNotFoundError:
            raise NotFound(f"gone: {self.path.name}") from None


@dataclass(eq=False)
class DiskDir(Dir):
    """A read-only view of a folder of the daemon's (``branches/``, ``compactions/``):
    sub-folders and files as they are on disk, listed sorted (numbers by value)."""

    key: Hashable
    path: Path
    # Inside a session directory removal must succeed and do nothing, so that
    # ``rm -r s/<id>`` reaches the session's rmdir (SPEC 3.7).
    removal: Literal["ignore", "deny"] = "deny"
    # The mtime while the folder does not exist yet (a session's birth): not 1970.
    born: float = STARTED
    # Changes whenever the folder's nlink or mtime may have (``Node.attrs_version``): a
    # folder only the daemon writes, with a change of its own it counts.
    version: Callable[[], Hashable | None] | None = None

    def attrs_version(self) -> Hashable | None:
        return None if self.version is None else self.version()

    async def unlink(self, name: str) -> None:
        if self.removal == "deny":
            raise Denied(f"cannot remove {name}")

    async def rmdir(self, name: str) -> None:
        await self.unlink(name)

    def entries(self) -> Iterable[tuple[str, Node]]:
        try:
            names = sorted(os.listdir(self.path), key=_natural)
        except OSError:
            return []
        out: list[tuple[str, Node]] = []
        for name in names:
            node = self.lookup(name)
            if node is not None:
                out.append((name, node))
        return out

    def lookup(self, name: str) -> Node | None:
        if name.startswith(".") or name.endswith(".tmp"):
            return None
        p = self.path / name
        if p.is_dir():
            return DiskDir((self.key, name), p, self.removal, self.born)
        if p.is_file():
            return DiskFile((self.key, name), p)
        return None

    def mtime(self) -> float:
        try:
            return os.stat(self.path).st_mtime
        except OSError:
            return self.born


def _natural(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 62, name)


def owner() -> tuple[int, int]:
    return os.getuid(), os.getgid()
