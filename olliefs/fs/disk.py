"""Folders on disk shown in the tree: ``m/ tmp/ t/ p/ sk/ tr/ u/ x/`` (SPEC 3.1).

Everything else in the tree is synthetic; these directories are real folders of the config,
state and data dirs, and a user's everyday tools must work on them as on a disk: ``sed -i``
and editors that write a temp file and rename it into place, ``cp -p``, ``tar``, ``rsync``,
``pread``/``pwrite`` at any offset, ``ftruncate``, ``O_APPEND``, ``chmod +x``. So a handle
here is a real file descriptor on the backing file (``os.pread``/``os.pwrite``), sizes and
mtimes are the disk's (to the nanosecond), and every failure of the disk is passed on with
its own errno (``ENOSPC`` stays ``ENOSPC``).

Node kinds
==========

``Folder``
    A folder on disk, optionally layered over read-only folders below it (the shipped
    defaults of the package: ``t/`` shows config ``tools/`` over ``agents/tools/``), and
    optionally with synthetic entries (``t/idx``) that win over any file of the same name.
    What it allows is its ``Rules``: writable (create, write, rename, chmod, utimes, unlink
    in the top folder), removable only (``tr/``), a tree (sub-folders, mkdir/rmdir:
    ``tmp/``), executable (``u/ x/``, shown ``r-x``), whether symlinks are followed.
    Only the top folder is ever changed; a file below it is read-only, and a file of the
    same name in the top folder hides it (removing that file shows it again).

``FolderFile``
    A file of a ``Folder``. Opening it opens the backing file (``O_APPEND`` and ``O_TRUNC``
    passed on, so an appender never clobbers a tool appending at the same time).

``Skills`` / ``Skill``
    ``sk/``: a skill is a folder ``skills/<name>/`` holding ``SKILL.md``; the tree shows it
    as ``sk/<name>.md`` plus a synthetic ``idx``. A SKILL.md is validated whole, so it is
    written through a buffer and put in place at close (flush) only if its front matter
    has ``name:`` and ``description:``; otherwise the close fails with EINVAL and the old
    file stays.

Identity
========

A node's inode must stay the same while the kernel holds it, across a rename: an editor
that renamed its temp file over ``m/notes`` and then stats it must see one file, not a
stale inode answering ENOENT. So a folder keeps the node of each name it handed out (weakly:
once the kernel forgot a node and no handle holds it, it goes) and a rename moves the node
to its new name; a node removed or renamed over is detached (it answers from its open
descriptors while it has any, like an unlinked open file, and is gone after). The node's
``key`` is a serial number, so the frontend's inode table follows the node, not the name.
Changes made outside the mount (a memory tool appending to a note) are seen at once:
nothing about a file is cached, every attribute is a fresh ``stat``.

Symlinks
========

``m/`` is written by sandboxed tools (memory_remember), and an agent may write the tree
through client_9p: a symlink planted in ``m/`` must not let a write through the mount
reach a file outside it. The data and state folders therefore never follow symlinks
(``O_NOFOLLOW``, ``lstat``; a symlink there is not shown). The config folders are the
user's own and follow them, as toolsrv does (dotfile managers link files into ~/.config).

Names
=====

Any name the kernel passes (it already refuses ``/`` and NUL) is allowed in a writable
folder, dotfiles included: vim's ``.notes.swp`` and sed's temp file must work in ``m/``
and ``tmp/``. A synthetic name (``idx``) cannot be created, removed or renamed (EACCES).
``sk/`` takes only ``<name>.md``.

The I/O is plain blocking syscalls on local files, done on the trio thread as the
read-only views always did; only ``fsync`` goes to a worker thread (it can take long).
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import re
import stat
import time
import weakref
from collections.abc import Awaitable, Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

from olliefs.caller import Caller
from olliefs.errors import (
    Denied,
    DiskError,
    Exists,
    InvalidRequest,
    NotFound,
    NotPermitted,
    OllieError,
    disk_error,
)
from olliefs.fs.nodes import Dir, File, Handle, Node, Open, Text, editors_own

_serial = itertools.count(1)


GUARDED_HEAD = 64 * 1024 + 1
"""How much of a file's start a folder's guard sees: toolsrv reads a tool's header from
its first 64 KiB (``toolsrv.registry.HEADER_LIMIT``), and one byte more tells that the
file goes on."""


def _key() -> tuple[str, int]:
    return ("disk", next(_serial))


# ---- errors of the disk --------------------------------------------------------------


@contextmanager
def _disk(what: str) -> Iterator[None]:
    try:
        yield
    except OSError as err:
        raise disk_error(err, what) from None


# ---- folders -------------------------------------------------------------------------


def _shown(name: str) -> bool:
    return True


@dataclass(frozen=True)
class Rules:
    """What a folder allows (SPEC 3.1 gives each one its mode)."""

    writable: bool = False  # create, write, rename, chmod, utimes, unlink (top folder)
    removable: bool = False  # unlink allowed although nothing can be written (tr/)
    tree: bool = False  # sub-folders shown; mkdir and rmdir allowed (tmp/)
    follow: bool = True  # follow symlinks (config folders) or never (data, state)
    new_mode: int | None = None  # a created file gets this mode whatever was asked (t/)
    executable: bool = False  # files shown r-x (u/, x/)
    shown: Callable[[str], bool] = _shown  # tr/ hides the daemon's partial writes
    # t/: what a sandboxed opener's writes may leave at the start of a file (its header):
    # the check gets the first bytes as they would be and says why not, or None.
    guard: Callable[[bytes], str | None] | None = None


@dataclass
class _Found:
    path: Path
    top: bool  # in the folder that may be changed (not a shipped one below it)
    st: os.stat_result

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.st.st_mode)


class Folder(Dir):
    """A folder on disk (see the module docstring); ``sub`` folders of a tree share the
    rules of their root and find their path through their parent, so a renamed folder's
    children follow it."""

    def __init__(
        self,
        key: Hashable,
        top: Path | None,
        below: Sequence[Path] = (),
        rules: Rules = Rules(),
        extra: Callable[[], dict[str, Node]] | None = None,
        refresh: Callable[[set[str]], Awaitable[None]] | None = None,
        refused: Callable[[str], None] | None = None,
    ) -> None:
        self.key = key
        self.refused = refused  # where a refusal of the guard is told (the root err)
        self._top = top
        self.below = list(below)
        self.rules = rules
        self.perm = 0o755 if rules.writable or rules.removable else 0o555
        self.extra = extra
        self.refresh = refresh
        self.parent: Folder | None = None
        self.name: str | None = None
        self.born = time.time()
        # Names changed through the mount since the last refresh (t/: toolsrv rescans).
        self.changed: set[str] = set()
        self._live: weakref.WeakValueDictionary[str, FolderFile | Folder] = (
            weakref.WeakValueDictionary()
        )

    @classmethod
    def _sub(cls, parent: Folder, name: str) -> Folder:
        sub = cls(_key(), None, (), parent.rules)
        sub.parent, sub.name = parent, name
        return sub

    # ---- where things are ---------------------------------------------------------

    def path(self) -> Path | None:
        if self.parent is None:
            return self._top
        if self.name is None:
            return None
        up = self.parent.path()
        return None if up is None else up / self.name

    def _layers(self) -> list[tuple[Path, bool]]:
        top = self.path()
        out = [] if top is None else [(top, True)]
        return out + [(b, False) for b in self.below]

    def _stat(self, path: Path | str) -> os.stat_result:
        return os.stat(path) if self.rules.follow else os.lstat(path)

    def _kind_ok(self, st: os.stat_result, top: bool) -> bool:
        if stat.S_ISREG(st.st_mode):
            return True
        return stat.S_ISDIR(st.st_mode) and self.rules.tree and top

    def find(self, name: str) -> _Found | None:
        """The file or sub-folder ``name`` stands for: the top folder's, else the first
        folder below that has one."""
        if not self.rules.shown(name):
            return None
        for layer, top in self._layers():
            p = layer / name
            try:
                st = self._stat(p)
            except OSError:
                continue
            if self._kind_ok(st, top):
                return _Found(p, top, st)
        return None

    def _scan(self) -> dict[str, bool]:
        """Every name shown (extra names aside) -> whether it is a folder."""
        out: dict[str, bool] = {}
        for layer, top in reversed(self._layers()):
            try:
                names = os.listdir(layer)
            except OSError:
                continue
            for name in names:
                if not self.rules.shown(name):
                    continue
                try:
                    st = self._stat(layer / name)
                except OSError:
                    continue
                if self._kind_ok(st, top):  # anything else hides nothing (as in toolsrv)
                    out[name] = stat.S_ISDIR(st.st_mode)
        return out

    def _node(self, name: str, is_dir: bool) -> FolderFile | Folder:
        node = self._live.get(name)
        if node is None or isinstance(node, Folder) != is_dir:
            node = Folder._sub(self, name) if is_dir else FolderFile(self, name)
            self._live[name] = node
        return node

    def _detach(self, name: str) -> None:
        node = self._live.pop(name, None)
        if node is not None:
            node.name = None

    def _extra(self) -> dict[str, Node]:
        return self.extra() if self.extra is not None else {}

    # ---- Dir ----------------------------------------------------------------------

    def valid(self) -> bool:
        if self.parent is None:
            return True
        p = self.path()
        try:
            return p is not None and stat.S_ISDIR(os.lstat(p).st_mode)
        except OSError:
            return False

    def mtime_ns(self) -> int:
        times = []
        for layer, _ in self._layers():
            try:
                times.append(os.stat(layer).st_mtime_ns)
            except OSError:
                pass
        return max(times) if times else int(self.born * 1e9)

    def mtime(self) -> float:
        return self.mtime_ns() / 1e9

    def _own_path(self, what: str) -> Path:
        """A sub-folder of a writable tree, for chmod and utimes (``cp -a``, ``tar x``);
        the declared folders themselves keep their mode."""
        p = self.path()
        if self.parent is None or p is None or not self.rules.writable:
            raise NotPermitted(f"{what}: the mode and times of this folder are fixed")
        return p

    async def chmod(self, mode: int) -> None:
        p = self._own_path("chmod")
        with _disk(f"chmod {self.name}"):
            os.chmod(p, mode)

    async def set_times(self, atime_ns: int | None, mtime_ns: int | None) -> None:
        if self.parent is None:
            return  # the declared folders: ignored, like other files of the tree
        p = self._own_path("utimes")
        with _disk(f"utimes {self.name}"):
            _utime(p, atime_ns, mtime_ns)

    async def prepare(self) -> None:
        if self.refresh is not None:
            changed, self.changed = self.changed, set()
            await self.refresh(changed)

    def touched(self, name: str) -> None:
        root = self
        while root.parent is not None:
            root = root.parent
        if root.refresh is not None:  # nobody else asks: keep nothing
            root.changed.add(name)

    def entries(self) -> Iterable[tuple[str, Node]]:
        extra = self._extra()
        out: dict[str, Node] = {n: self._node(n, d) for n, d in self._scan().items()}
        out.update(extra)
        return sorted(out.items())

    def lookup(self, name: str) -> Node | None:
        extra = self._extra()
        if name in extra:
            return extra[name]
        found = self.find(name)
        return None if found is None else self._node(name, found.is_dir)

    def _own(self, name: str, what: str) -> _Found:
        """The top folder's ``name``, for a change; EACCES for a synthetic or shipped one."""
        if name in self._extra():
            raise Denied(f"{what} {name}: generated by the daemon")
        found = self.find(name)
        if found is None:
            raise NotFound(f"{what} {name}: no such file")
        if not found.top:
            raise Denied(f"{what} {name}: a shipped default (read-only)")
        return found

    def _writable_top(self, name: str, what: str) -> Path:
        if not self.rules.writable:
            raise Denied(f"{what} {name}: read-only directory")
        if name in self._extra():
            raise Denied(f"{what} {name}: generated by the daemon")
        top = self.path()
        if top is None:
            raise NotFound(f"{what} {name}: the folder is gone")
        if self.parent is None:
            with _disk(f"{what} {name}"):
                top.mkdir(parents=True, exist_ok=True, mode=0o700)
        return top

    def closed_to(self, pid: int, what: str) -> None:
        """A guard that refuses even an empty file (``mcp/``) refuses a sandboxed caller's
        open for writing and create outright: nothing is made or truncated."""
        guard = self.rules.guard
        if guard is not None and Caller(pid).confined:
            reason = guard(b"")
            if reason is not None:
                if self.refused is not None:
                    self.refused(f"{what}: {reason}")
                raise Denied(f"{what}: {reason}")

    async def create(self, name: str, mode: int, how: Open) -> tuple[Node, Handle]:
        self.closed_to(how.pid, f"create {name}")
        path = self._writable_top(name, "create") / name
        acc = how.flags & os.O_ACCMODE
        keep = how.flags & (os.O_APPEND | os.O_TRUNC)
        base = acc | keep | os.O_CLOEXEC | (0 if self.rules.follow else os.O_NOFOLLOW)
        with _disk(f"create {name}"):
            try:
                fd = os.open(path, base | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                # Made meanwhile outside the mount: O_CREAT without O_EXCL opens it.
                if how.flags & os.O_EXCL:
                    raise
                fd = os.open(path, base)
            else:
                # The daemon's umask must not decide (the kernel applied the caller's).
                want = self.rules.new_mode if self.rules.new_mode is not None else mode
                os.fchmod(fd, stat.S_IMODE(want))
        node = self._node(name, False)
        assert isinstance(node, FolderFile)
        self.touched(name)
        return node, node.handle(fd, dirty=True, how=how)

    async def mkdir(self, name: str, mode: int) -> Node:
        if not self.rules.tree:
            raise Denied(f"mkdir {name}: no sub-folders here")
        path = self._writable_top(name, "mkdir") / name
        with _disk(f"mkdir {name}"):
            os.mkdir(path, 0o700)
            os.chmod(path, stat.S_IMODE(mode))
        return self._node(name, True)

    async def unlink(self, name: str) -> None:
        if not (self.rules.writable or self.rules.removable):
            raise Denied(f"remove {name}: read-only directory")
        found = self._own(name, "remove")
        with _disk(f"remove {name}"):
            os.unlink(found.path)
        self._detach(name)
        self.touched(name)

    async def rmdir(self, name: str) -> None:
        if not self.rules.tree:
            raise Denied(f"rmdir {name}: no sub-folders here")
        found = self._own(name, "rmdir")
        with _disk(f"rmdir {name}"):
            os.rmdir(found.path)
        self._detach(name)

    async def rename(self, old: str, new: str) -> None:
        found = self._own(old, "rename")
        dest = self._writable_top(new, "rename") / new
        with _disk(f"rename {old}"):
            os.rename(found.path, dest)
        if old == new:
            return
        moving = self._live.pop(old, None)
        self._detach(new)
        if moving is not None:
            moving.name = new
            self._live[new] = moving
        self.touched(old)
        self.touched(new)


# ---- files ---------------------------------------------------------------------------


class FileHandle(Handle):
    """An open file on disk: a descriptor of the daemon's, read and written at the offsets
    the kernel asks (``O_APPEND`` descriptors append whatever the offset, as Linux's
    ``pwrite`` does on them)."""

    waits = False

    def __init__(
        self,
        node: FolderFile,
        fd: int,
        dirty: bool,
        guard: Callable[[bytes], str | None] | None = None,
    ) -> None:
        self.node = node
        self.fd = fd
        self.dirty = dirty
        self.guard = guard

    async def read(self, off: int, size: int) -> bytes:
        with _disk("read"):
            return os.pread(self.fd, size, off)

    async def write(self, off: int, data: bytes) -> int:
        with _disk("write"):
            if self.guard is not None:
                if fcntl.fcntl(self.fd, fcntl.F_GETFL) & os.O_APPEND:
                    off = os.fstat(self.fd).st_size  # where pwrite really writes
                self._check(off, data, None)
            n = os.pwrite(self.fd, data, off)
        self.dirty = True
        return n

    def truncate(self, size: int) -> None:
        with _disk("truncate"):
            if self.guard is not None:
                self._check(0, b"", size)
            os.ftruncate(self.fd, size)
        self.dirty = True

    def _check(self, off: int, data: bytes, size: int | None) -> None:
        """Refuse a sandboxed writer's change that would leave the file's first bytes
        asking for more than it may (``guard``): checked before anything is written, on
        the start of the file as the change would leave it."""
        assert self.guard is not None
        # The handle may be write-only: the same file opened again for reading.
        rfd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            head = bytearray(os.pread(rfd, GUARDED_HEAD, 0))
        finally:
            os.close(rfd)
        if size is not None:
            del head[size:]
            head += bytes(max(0, min(size, GUARDED_HEAD) - len(head)))
        if data and off < GUARDED_HEAD:
            if off > len(head):
                head += bytes(off - len(head))
            head[off : off + len(data)] = data
        reason = self.guard(bytes(head[:GUARDED_HEAD]))
        if reason is not None:
            folder = self.node.folder
            where = "/".join(map(str, folder.key)) if isinstance(folder.key, tuple) else ""
            reason = f"{where}/{self.node.name}: {reason}"
            if folder.refused is not None:
                folder.refused(reason)
            raise Denied(reason)

    async def flush(self) -> None:
        if self.dirty and self.node.name is not None:
            self.node.folder.touched(self.node.name)
        self.dirty = False

    async def fsync(self, datasync: bool) -> None:
        sync = os.fdatasync if datasync else os.fsync
        with _disk("fsync"):
            await trio.to_thread.run_sync(sync, self.fd)

    def release(self) -> None:
        self.node.handles.discard(self)
        os.close(self.fd)


class FolderFile(File):
    """A regular file of a ``Folder`` (see the module docstring for its identity)."""

    direct_io = False  # the page cache works: mmap, exec of u/ scripts, fast cp

    def __init__(self, folder: Folder, name: str) -> None:
        self.key = _key()
        self.folder = folder
        self.name: str | None = name
        self.handles: set[FileHandle] = set()

    def _found(self) -> _Found | None:
        if self.name is None:
            return None
        found = self.folder.find(self.name)
        return None if found is None or found.is_dir else found

    def _st(self) -> tuple[os.stat_result, bool] | None:
        found = self._found()
        if found is not None:
            return found.st, found.top
        for h in self.handles:  # removed or renamed over, but still open
            try:
                return os.fstat(h.fd), True
            except OSError:
                pass
        return None

    def _perm(self, st: os.stat_result, top: bool) -> int:
        rules = self.folder.rules
        if rules.executable:
            return 0o555
        perm = stat.S_IMODE(st.st_mode) & 0o777
        return perm if top and rules.writable else perm & ~0o222

    @property
    def mode(self) -> int:
        got = self._st()
        return stat.S_IFREG | (self._perm(*got) if got else 0)

    @property
    def readable(self) -> bool:
        return bool(self.mode & 0o444)

    @property
    def writable(self) -> bool:
        return bool(self.mode & 0o222)

    def size(self) -> int:
        got = self._st()
        return got[0].st_size if got else 0

    def mtime_ns(self) -> int:
        got = self._st()
        return got[0].st_mtime_ns if got else 0

    def mtime(self) -> float:
        return self.mtime_ns() / 1e9

    def valid(self) -> bool:
        return self._st() is not None

    def _guard(self, pid: int) -> Callable[[bytes], str | None] | None:
        """The folder's guard when the process ``pid`` is sandboxed (`Caller`)."""
        guard = self.folder.rules.guard
        return guard if guard is not None and Caller(pid).confined else None

    def handle(self, fd: int, dirty: bool, how: Open | None = None) -> FileHandle:
        h = FileHandle(self, fd, dirty, None if how is None else self._guard(how.pid))
        self.handles.add(h)
        return h

    def _open_flags(self) -> int:
        return os.O_CLOEXEC | (0 if self.folder.rules.follow else os.O_NOFOLLOW)

    def open(self, how: Open) -> Handle:
        found = self._found()
        if found is None:
            raise NotFound(f"open {self.name}: gone")
        acc = how.flags & os.O_ACCMODE
        if acc != os.O_RDONLY and not (found.top and self.folder.rules.writable):
            raise Denied(f"open {self.name}: read-only")
        if acc != os.O_RDONLY:
            self.folder.closed_to(how.pid, f"open {self.name}")
        flags = acc | (how.flags & (os.O_APPEND | os.O_TRUNC)) | self._open_flags()
        with _disk(f"open {self.name}"):
            fd = os.open(found.path, flags)
        return self.handle(fd, dirty=bool(how.flags & os.O_TRUNC), how=how)

    def _own(self, what: str) -> Path:
        found = self._found()
        if found is None:
            raise NotFound(f"{what} {self.name}: gone")
        if not (found.top and self.folder.rules.writable):
            raise NotPermitted(f"{what} {self.name}: read-only")
        return found.path

    async def truncate(self, size: int, pid: int = 0) -> None:
        path = self._own("truncate")
        with _disk(f"truncate {self.name}"):
            fd = os.open(path, os.O_WRONLY | self._open_flags())
            try:
                FileHandle(self, fd, True, self._guard(pid)).truncate(size)
            finally:
                os.close(fd)
        assert self.name is not None
        self.folder.touched(self.name)

    async def chmod(self, mode: int) -> None:
        path = self._own("chmod")
        with _disk(f"chmod {self.name}"):
            if self.folder.rules.follow:
                os.chmod(path, mode)
            else:
                _chmod_nofollow(path, mode)
        assert self.name is not None
        self.folder.touched(self.name)

    async def set_times(self, atime_ns: int | None, mtime_ns: int | None) -> None:
        path = self._own("utimes")
        with _disk(f"utimes {self.name}"):
            _utime(path, atime_ns, mtime_ns, follow=self.folder.rules.follow)


def _chmod_nofollow(path: Path, mode: int) -> None:
    """chmod of the file itself even if a tool swapped it for a symlink since it was
    looked up (Linux has no lchmod): through a descriptor opened with O_NOFOLLOW."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except PermissionError:  # not readable by its owner (0200): no symlink can be there
        if stat.S_ISLNK(os.lstat(path).st_mode):
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP)) from None
        os.chmod(path, mode)
        return
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _utime(path: Path, atime_ns: int | None, mtime_ns: int | None, follow: bool = True) -> None:
    st = os.stat(path) if follow else os.lstat(path)
    a = st.st_atime_ns if atime_ns is None else atime_ns
    m = st.st_mtime_ns if mtime_ns is None else mtime_ns
    os.utime(path, ns=(a, m), follow_symlinks=follow)


# ---- generated files (idx) -----------------------------------------------------------


class Generated(Text):
    """A generated file of a folder (``t/idx``, ``sk/idx``) whose mtime is the time its
    text last changed, as seen by the daemon: tar, rsync and editors compare mtimes, and
    one that said "now" on every stat made tar fail with "file changed as we read it".

    Made once, in the declaration, so that it remembers the text it last rendered.
    """

    def __init__(
        self,
        key: Hashable,
        render: Callable[[], str],
        refresh: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(key, self._render, refresh=refresh)
        self._inner = render
        self._last: str | None = None
        self._since = time.time_ns()

    def _render(self) -> str:
        text = self._inner()
        if text != self._last:
            if self._last is not None:
                self._since = time.time_ns()
            self._last = text
        return text

    def mtime_ns(self) -> int:
        self._render()
        return self._since

    def mtime(self) -> float:
        return self.mtime_ns() / 1e9


# ---- skills --------------------------------------------------------------------------

SKILL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
SKILL_MAX = 1 << 20  # a SKILL.md is read whole into memory to be checked


def front_matter(data: bytes) -> dict[str, str]:
    """The ``key: value`` pairs of a SKILL.md's front matter; InvalidRequest (EINVAL)
    unless it opens the file, is closed by ``---`` and has ``name:`` and ``description:``.

    Only the top-level scalar keys are read (a value may be quoted, or a ``>``/``|``
    block of indented lines); lists and nested maps are left alone, so any front matter
    other tools write stays valid here.
    """
    try:
        lines = data.decode().splitlines()
    except UnicodeDecodeError:
        raise InvalidRequest("SKILL.md is not valid UTF-8") from None
    if not lines or lines[0].rstrip() != "---":
        raise InvalidRequest("SKILL.md must start with a '---' front matter line")
    try:
        end = next(i for i in range(1, len(lines)) if lines[i].rstrip() == "---")
    except StopIteration:
        raise InvalidRequest("SKILL.md: the front matter is not closed by '---'") from None
    fields: dict[str, str] = {}
    block: str | None = None
    for line in lines[1:end]:
        if not line.strip():
            continue  # a blank line inside a block scalar does not end it
        if line[:1] in (" ", "\t"):
            if block is not None:
                fields[block] = (fields[block] + " " + line.strip()).strip()
            continue
        block = None
        key, sep, value = line.partition(":")
        if not sep or not key.strip() or key.startswith("#"):
            continue
        key, value = key.strip(), value.strip()
        if value in (">", "|", ">-", "|-", ">+", "|+"):
            block, value = key, ""
        elif len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        fields[key] = value
    for need in ("name", "description"):
        if not fields.get(need):
            raise InvalidRequest(f"SKILL.md: the front matter has no {need}:")
    return fields


class Skills(Dir):
    """``sk/``: ``idx`` plus ``<name>.md`` for each ``<root>/<name>/SKILL.md``."""

    perm = 0o755

    def __init__(
        self, key: Hashable, root: Path, refused: Callable[[str], None] | None = None
    ) -> None:
        self.key = key
        self.root = root
        self.refused = refused  # the root err: where a refused SKILL.md says why
        self.born = time.time()
        self._live: weakref.WeakValueDictionary[str, Skill] = weakref.WeakValueDictionary()
        self.idx = Generated((key, "idx"), self.idx_text)

    def idx_text(self) -> str:
        """One line per skill with a valid front matter: name, tab, description."""
        out = []
        for name in self._names():
            try:
                with open(self.root / name / "SKILL.md", "rb") as f:
                    fields = front_matter(f.read(SKILL_MAX))
            except (OSError, InvalidRequest):
                continue  # edited outside into something invalid: not offered
            desc = " ".join(fields["description"].split())
            out.append(f"{name}\t{desc}\n")
        return "".join(out)

    def _names(self) -> list[str]:
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        return sorted(n for n in names if SKILL_NAME.fullmatch(n) and self.exists(n))

    def exists(self, skill: str) -> bool:
        return (self.root / skill / "SKILL.md").is_file()

    @staticmethod
    def skill_of(name: str, what: str) -> str:
        skill = name.removesuffix(".md")
        if not name.endswith(".md") or not SKILL_NAME.fullmatch(skill):
            raise InvalidRequest(f"{what} {name}: sk/ holds only <name>.md skill files")
        return skill

    def _node(self, skill: str) -> Skill:
        node = self._live.get(skill)
        if node is None:
            node = self._live[skill] = Skill(self, skill)
        return node

    def mtime_ns(self) -> int:
        try:
            return os.stat(self.root).st_mtime_ns
        except OSError:
            return int(self.born * 1e9)

    def mtime(self) -> float:
        return self.mtime_ns() / 1e9

    def entries(self) -> Iterable[tuple[str, Node]]:
        out: list[tuple[str, Node]] = [(f"{n}.md", self._node(n)) for n in self._names()]
        return sorted([("idx", self.idx), *out])

    def lookup(self, name: str) -> Node | None:
        if name == "idx":
            return self.idx
        skill = name.removesuffix(".md")
        if name.endswith(".md") and SKILL_NAME.fullmatch(skill) and self.exists(skill):
            return self._node(skill)
        return None

    @contextmanager
    def reported(self) -> Iterator[None]:
        """A refusal inside is also the root err's reason (shells ignore close errors)."""
        try:
            yield
        except OllieError as err:
            if self.refused is not None:
                self.refused(f"sk/: {err}")
            raise

    async def create(self, name: str, mode: int, how: Open) -> tuple[Node, Handle]:
        if editors_own(name):  # refused, but not the user's mistake: err keeps its reason
            raise Denied(f"create {name}: not a skill (an editor's own file)")
        with self.reported():
            return self._create(name, how)

    def _create(self, name: str, how: Open) -> tuple[Node, Handle]:
        if name == "idx":
            raise Denied("create idx: generated by the daemon")
        if editors_own(name):
            raise Denied(f"create {name}: not a skill (an editor's own file)")
        skill = self.skill_of(name, "create")
        node = self._node(skill)
        if self.exists(skill):  # made meanwhile outside the mount
            if how.flags & os.O_EXCL:
                raise Exists(f"create {name}: exists")
            return node, node.open(how)
        return node, node.open_new(how)

    async def unlink(self, name: str) -> None:
        if name == "idx":
            raise Denied("remove idx: generated by the daemon")
        skill = self.skill_of(name, "remove")
        folder = self.root / skill
        with _disk(f"remove {name}"):
            os.unlink(folder / "SKILL.md")
        try:
            os.rmdir(folder)  # the skill's other files, if any, stay
        except OSError:
            pass
        node = self._live.pop(skill, None)
        if node is not None:
            node.skill = None

    async def rename(self, old: str, new: str) -> None:
        if "idx" in (old, new):
            raise Denied("rename idx: generated by the daemon")
        a, b = self.skill_of(old, "rename"), self.skill_of(new, "rename")
        if not self.exists(a):
            raise NotFound(f"rename {old}: no such skill")
        if a == b:
            return
        if os.path.lexists(self.root / b):
            raise Exists(f"rename {old}: a skill {b} exists (remove it first)")
        with _disk(f"rename {old}"):
            os.rename(self.root / a, self.root / b)
        node = self._live.pop(a, None)
        if node is not None:
            node.skill = b
            self._live[b] = node


class SkillHandle(Handle):
    """A SKILL.md being read or rewritten: the whole text in a buffer, checked and put in
    place at flush (close) when it was changed; a refused text changes nothing on disk."""

    waits = False

    def __init__(self, node: Skill, data: bytes, dirty: bool, append: bool) -> None:
        self.node = node
        self.buf = bytearray(data)
        self.dirty = dirty
        self.append = append
        node.handles.add(self)

    async def read(self, off: int, size: int) -> bytes:
        return bytes(self.buf[off : off + size])

    async def write(self, off: int, data: bytes) -> int:
        if self.append:
            off = len(self.buf)
        if off + len(data) > SKILL_MAX:
            with self.node.skills.reported():
                raise disk_error(OSError(errno.EFBIG, "a SKILL.md is at most 1 MiB"), "write")
        if off > len(self.buf):
            self.buf.extend(bytes(off - len(self.buf)))
        self.buf[off : off + len(data)] = data
        self.dirty = True
        return len(data)

    def truncate(self, size: int) -> None:
        if size > SKILL_MAX:
            with self.node.skills.reported():
                raise disk_error(OSError(errno.EFBIG, "a SKILL.md is at most 1 MiB"), "truncate")
        if size < len(self.buf):
            del self.buf[size:]
        else:
            self.buf.extend(bytes(size - len(self.buf)))
        self.dirty = True

    async def flush(self) -> None:
        if not self.dirty:
            return
        self.dirty = False  # a refused text is reported once, at this close
        with self.node.skills.reported():
            self.node.commit(bytes(self.buf))

    def release(self) -> None:
        self.node.handles.discard(self)


class Skill(File):
    """``sk/<name>.md``: the SKILL.md of one skill folder."""

    perm = 0o644
    entry_ttl = 0.0  # a create refused at close makes no skill: the name must not linger

    def __init__(self, skills: Skills, skill: str) -> None:
        self.key = _key()
        self.skills = skills
        self.skill: str | None = skill
        self.handles: set[SkillHandle] = set()
        self.born = time.time()

    def _path(self) -> Path | None:
        return None if self.skill is None else self.skills.root / self.skill / "SKILL.md"

    def _stat(self) -> os.stat_result | None:
        p = self._path()
        try:
            return None if p is None else os.stat(p)
        except OSError:
            return None

    def valid(self) -> bool:
        return self._stat() is not None or bool(self.handles)

    def size(self) -> int:
        st = self._stat()
        if st is not None:
            return st.st_size
        return max((len(h.buf) for h in self.handles), default=0)

    def mtime_ns(self) -> int:
        st = self._stat()
        return st.st_mtime_ns if st is not None else int(self.born * 1e9)

    def mtime(self) -> float:
        return self.mtime_ns() / 1e9

    def _read(self) -> bytes:
        p = self._path()
        if p is None:
            raise NotFound("skill removed")
        with _disk(f"open {p.parent.name}.md"), open(p, "rb") as f:
            data = f.read(SKILL_MAX + 1)
        if len(data) > SKILL_MAX:
            raise disk_error(OSError(errno.EFBIG, "a SKILL.md is at most 1 MiB"), "open")
        return data

    def open(self, how: Open) -> Handle:
        writing = how.flags & os.O_ACCMODE != os.O_RDONLY
        if writing and self.skill is not None and self._stat() is None:
            # A create refused at close leaves the kernel a name (it keeps the entry
            # for its timeout): writing it again starts the new skill afresh, as the
            # create would, where reading the missing file would answer ENOENT.
            return self.open_new(how)
        trunc = bool(how.flags & os.O_TRUNC) and writing
        data = b"" if trunc else self._read()
        return SkillHandle(self, data, dirty=trunc, append=bool(how.flags & os.O_APPEND))

    def open_new(self, how: Open) -> Handle:
        """A skill created through the mount: nothing on disk until a valid close."""
        self.born = time.time()
        return SkillHandle(self, b"", dirty=True, append=bool(how.flags & os.O_APPEND))

    def commit(self, data: bytes) -> None:
        """Check ``data`` and make it the SKILL.md (durably, by rename); EINVAL and the
        old file kept if its front matter is not valid."""
        front_matter(data)
        p = self._path()
        if p is None:
            raise NotFound("skill removed")
        tmp = p.with_name(".SKILL.md.tmp")
        with _disk(f"write {p.parent.name}.md"):
            p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, p)

    async def truncate(self, size: int, pid: int = 0) -> None:
        data = self._read()
        self.commit(data[:size] + bytes(max(0, size - len(data))))

    async def set_times(self, atime_ns: int | None, mtime_ns: int | None) -> None:
        p = self._path()
        if p is None or self._stat() is None:
            return
        with _disk(f"utimes {p.parent.name}.md"):
            _utime(p, atime_ns, mtime_ns)


# ---- the declaration's helpers -------------------------------------------------------


def not_partial(name: str) -> bool:
    """tr/: the daemon writes ``<name>.tmp`` and renames it; dotfiles are not transcripts."""
    return not (name.startswith(".") or name.endswith(".tmp"))


__all__ = [
    "DiskError",
    "FileHandle",
    "Folder",
    "FolderFile",
    "Generated",
    "Rules",
    "Skill",
    "Skills",
    "disk_error",
    "front_matter",
    "not_partial",
]
