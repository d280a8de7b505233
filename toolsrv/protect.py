"""Where the protected names (``.git``, ``.ollie``) are under a write root, without walking
the whole tree on every call.

A tool may write anywhere beneath its write roots, except into a ``.git`` (hooks and config
run unsandboxed the next time the user runs git there) or an ``.ollie``, at any depth. The
sandbox makes each of them read-only with a bind mount, so it must know where they are when
the call starts. Walking a big checkout for that on every call costs tens to hundreds of
milliseconds. `ProtectedScan` walks a root once, watching each directory with inotify
(created, removed and renamed entries), and then re-lists only the directories that had
events: a call with nothing changed costs one non-blocking read. Where inotify watches run
out (``fs.inotify.max_user_watches``) or its queue overflowed, a tree falls back to
comparing directory mtimes (an entry created, removed or renamed in a directory changes its
mtime): one ``stat`` per directory per call, still no listing. Figures in toolsrv(8).

The walk does not follow symlinks nor descend into the protected entries themselves. A
protected entry that is a symlink is reported as its target, when that target lies beneath
a write root (elsewhere everything is read-only anyway). It does not enter filesystems that
may be slow or hang on a lookup (FUSE, NFS, SMB, 9P, Ceph): a write root on one of them,
such as the olliefs mount itself (profile ``ollie``), is not scanned at all. Its .git
entries, if any, are not protected (toolsrv(8)).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from olliewire.checkpoints import PROTECTED_NAMES  # the names both sides keep away from tools

log = logging.getLogger(__name__)

MAX_DIRS = 200_000
"""A root with more directories than this is scanned that far only (and a warning logged)."""
# A directory modified this recently may change again within the same coarse timestamp
# tick, unseen by an mtime comparison: it is listed again on the next call.
_FRESH_NS = 100_000_000


_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_IN_MODIFY_DIR = 0x100 | 0x200 | 0x40 | 0x80  # CREATE, DELETE, MOVED_FROM, MOVED_TO
FILE_EVENTS = _IN_MODIFY_DIR | 0x02 | 0x04 | 0x08  # and MODIFY, ATTRIB, CLOSE_WRITE of entries
_IN_SELF = 0x400 | 0x800  # DELETE_SELF, MOVE_SELF
_IN_ONLYDIR = 0x01000000
_IN_DONT_FOLLOW = 0x02000000
_IN_IGNORED = 0x8000
_IN_Q_OVERFLOW = 0x4000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then the name
_libc = ctypes.CDLL(None, use_errno=True)
# statfs f_type of filesystems the scan does not enter.
UNSCANNED_FS = frozenset(
    {
        0x65735546,  # FUSE
        0x6969,  # NFS
        0xFF534D42,  # CIFS
        0xFE534D42,  # SMB2
        0x01021997,  # 9P (v9fs)
        0x00C36400,  # Ceph
    }
)


def fs_type(path: str) -> int | None:
    """statfs(2) f_type of the filesystem holding ``path`` (a long at offset 0 on Linux)."""
    buf = ctypes.create_string_buffer(256)
    if _libc.statfs(os.fsencode(path), buf) != 0:
        return None
    return int(struct.unpack_from("l", buf.raw)[0])


class Inotify:
    """Directory watches: the scan's (one fd per ProtectedScan), and the tests' waits."""

    def __init__(self) -> None:
        self.fd = _libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")

    def add(self, path: str, events: int = _IN_MODIFY_DIR) -> int | None:
        """Watch the directory ``path`` for ``events`` (default: entries made, removed
        or renamed; ``FILE_EVENTS``: their contents written too) and its own end."""
        mask = events | _IN_SELF | _IN_ONLYDIR | _IN_DONT_FOLLOW
        wd = int(_libc.inotify_add_watch(self.fd, os.fsencode(path), mask))
        return wd if wd >= 0 else None

    def remove(self, wd: int) -> None:
        _libc.inotify_rm_watch(self.fd, wd)

    def read(self) -> tuple[set[int], bool]:
        """Watches that had events since the last read, and whether events were lost."""
        wds: set[int] = set()
        lost = False
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return wds, lost
            at = 0
            while at < len(data):
                wd, mask, _cookie, size = _EVENT.unpack_from(data, at)
                at += _EVENT.size + size
                if mask & _IN_Q_OVERFLOW:
                    lost = True
                elif not mask & _IN_IGNORED:
                    wds.add(wd)

    def close(self) -> None:
        os.close(self.fd)


@dataclass(eq=False)
class _Dir:
    mtime: int  # st_mtime_ns when listed; -1: list again next time
    wd: int | None = None  # its inotify watch
    subdirs: list[str] = field(default_factory=list)
    protected: list[str] = field(default_factory=list)


@dataclass(eq=False)
class _Tree:
    nodes: dict[str, _Dir] = field(default_factory=dict)
    watched: bool = True  # every directory has a watch: events say what changed
    dirty: set[str] = field(default_factory=set)  # directories to list again
    found: list[str] | None = None  # the protected entries, until something changes


class ProtectedScan:
    """The protected entries beneath each root, kept up to date by inotify, else mtimes."""

    def __init__(self, max_dirs: int = MAX_DIRS, *, inotify: bool = True) -> None:
        self.max_dirs = max_dirs
        self._trees: dict[str, _Tree] = {}
        self._paths: dict[int, tuple[_Tree, str]] = {}  # watch -> its directory
        self._inotify: Inotify | None = None
        if inotify:
            try:
                self._inotify = Inotify()
            except OSError as err:
                log.debug("no inotify for the protected-name scan: %s", err)
        self.listed = 0  # directories listed so far (tests and benches read it)
        self.stats = 0  # directories stat'ed to validate a tree (the fallback's cost)

    def close(self) -> None:
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None

    def find(self, roots: Sequence[str], *, drained: bool = False) -> list[str]:
        """Absolute paths to make read-only for a call with these (real, absolute) roots.
        ``drained``: the inotify queue was read just now (by `quick`, on this thread)."""
        found: list[str] = []
        for root in roots:
            for path in self._refresh(root, drained):
                target = _target(path, roots)
                if target is not None and target not in found:
                    found.append(target)
        return found

    def quick(self, roots: Sequence[str]) -> list[str] | None:
        """`find`'s answer when it takes no filesystem work: every root scanned before and
        watched by inotify, and nothing changed since (one non-blocking read of the event
        queue says so). None otherwise: then `find` must run, in a worker thread.

        A call's scan is nearly always this case, and answering it on the server's own
        thread saves the hop to a worker and back (a few hundred µs on a busy VM).
        """
        if self._inotify is None:
            return None
        trees = [self._trees.get(root) for root in roots]
        if any(tree is None or not tree.watched for tree in trees):
            return None
        self._drain()
        if any(tree is None or tree.dirty or not tree.watched for tree in trees):
            return None
        return self.find(roots, drained=True)

    def _refresh(self, root: str, drained: bool = False) -> list[str]:
        if not drained:
            self._drain()
        tree = self._trees.get(root)
        if tree is None:
            tree = self._trees[root] = _Tree(watched=self._inotify is not None)
            kind = fs_type(root)
            if kind in UNSCANNED_FS:
                log.debug("protected-name scan skips %s (filesystem %#x)", root, kind)
                tree.found = []
                return tree.found
            self._walk(tree, root)
        elif tree.watched:
            for path in sorted(tree.dirty):  # parents first: a forgotten child is skipped
                if path in tree.nodes:
                    self._relist(tree, path)
            tree.dirty.clear()
        else:
            stale = []
            for path, node in tree.nodes.items():
                self.stats += 1
                try:
                    st = os.stat(path, follow_symlinks=False)
                    mtime = st.st_mtime_ns if stat.S_ISDIR(st.st_mode) else -2
                except OSError:
                    mtime = -2
                if mtime != node.mtime:
                    stale.append(path)
            for path in stale:
                if path in tree.nodes:
                    self._relist(tree, path)
        return [os.path.join(d, name) for d, node in tree.nodes.items() for name in node.protected]

    def _drain(self) -> None:
        """Turn pending inotify events into directories to list again."""
        if self._inotify is None:
            return
        wds, lost = self._inotify.read()
        if lost:
            log.info("inotify queue overflowed: protected-name scans check mtimes")
            for tree in self._trees.values():
                self._unwatch(tree)
            return
        for wd in wds:
            hit = self._paths.get(wd)
            if hit is not None:
                hit[0].dirty.add(hit[1])

    def _unwatch(self, tree: _Tree) -> None:
        """From now on this tree is checked by mtimes."""
        tree.watched = False
        for path, node in tree.nodes.items():
            if node.wd is not None:
                self._drop_watch(node.wd, path)
                node.wd = None
            node.mtime = -1  # whatever happened meanwhile: list once more

    def _drop_watch(self, wd: int, path: str) -> None:
        # A directory moved within the tree keeps its watch (watches follow inodes): only
        # drop it if it still stands for this path.
        hit = self._paths.get(wd)
        if hit is not None and hit[1] == path and self._inotify is not None:
            del self._paths[wd]
            self._inotify.remove(wd)

    def _relist(self, tree: _Tree, path: str) -> None:
        old = tree.nodes[path].subdirs
        node = self._list(tree, path)
        if node is None:  # gone, or no longer a directory
            self._forget(tree, path)
            return
        for name in set(old) - set(node.subdirs):
            self._forget(tree, os.path.join(path, name))
        for name in node.subdirs:
            sub = os.path.join(path, name)
            if sub not in tree.nodes:
                self._walk(tree, sub)

    def _walk(self, tree: _Tree, top: str) -> None:
        stack = [top]
        while stack:
            path = stack.pop()
            node = self._list(tree, path)
            if node is not None:
                stack.extend(os.path.join(path, name) for name in node.subdirs)

    def _enters(self, path: str, dev: int) -> bool:
        """Whether the walk may list ``path`` (on device ``dev``): not on a filesystem it
        does not enter. Checked where the device changes, so once per filesystem."""
        parent = os.path.dirname(path)
        try:
            if parent != path and os.stat(parent, follow_symlinks=False).st_dev == dev:
                return True
        except OSError:
            pass
        kind = fs_type(path)
        if kind in UNSCANNED_FS:
            log.debug("protected-name scan does not enter %s (filesystem %#x)", path, kind)
            return False
        return True

    def _list(self, tree: _Tree, path: str) -> _Dir | None:
        old = tree.nodes.get(path)
        if old is None and len(tree.nodes) >= self.max_dirs:
            log.warning("protected-name scan stopped at %d directories (%s)", self.max_dirs, path)
            return None
        try:
            dev = os.stat(path, follow_symlinks=False).st_dev
        except OSError:
            return None
        if old is None and not self._enters(path, dev):
            return None
        wd = old.wd if old is not None else None
        if tree.watched and wd is None and self._inotify is not None:
            # The watch comes before the listing: nothing can change unseen in between.
            wd = self._inotify.add(path)
            if wd is None:
                if ctypes.get_errno() == errno.ENOSPC:
                    log.warning("inotify watches exhausted: %s is checked by mtimes", path)
                    self._unwatch(tree)
                else:
                    return None  # gone, or not a directory
            else:
                self._paths[wd] = (tree, path)
        try:
            st = os.stat(path, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                return None
            node = _Dir(st.st_mtime_ns, wd if tree.watched else None)
            with os.scandir(path) as entries:
                for entry in entries:
                    if entry.name in PROTECTED_NAMES:
                        node.protected.append(entry.name)
                    elif entry.is_dir(follow_symlinks=False):
                        node.subdirs.append(entry.name)
        except OSError:
            return None
        if time.time_ns() - node.mtime < _FRESH_NS:
            node.mtime = -1
        self.listed += 1
        tree.nodes[path] = node
        tree.found = None
        return node

    def _forget(self, tree: _Tree, path: str) -> None:
        tree.found = None
        prefix = path + os.sep
        for p in [p for p in tree.nodes if p == path or p.startswith(prefix)]:
            node = tree.nodes.pop(p)
            if node.wd is not None:
                self._drop_watch(node.wd, p)


def _target(path: str, roots: Sequence[str]) -> str | None:
    """``path`` itself, or for a symlink its target if that lies beneath one of ``roots``."""
    try:
        if not os.path.islink(path):
            return path
        real = os.path.realpath(path)
    except OSError:
        return None
    if not os.path.exists(real):
        return None
    for root in roots:
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return real
    return None
