"""Kernel plumbing for the sandbox: mount and network namespaces, capabilities.

Everything here runs in the thread that spawns a tool (see `toolsrv.sandbox.Prepared.enter`):
namespaces, capabilities and no_new_privs are per thread on Linux, and the tool inherits them
from the thread that forks it. Only `empty_netns` runs elsewhere, once per server.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import logging
import os
import select
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

CLONE_FS = 0x00000200
CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MOUNT_ATTR_RDONLY = 1
_AT_FDCWD = -100
_AT_SYMLINK_NOFOLLOW = 0x100
_AT_RECURSIVE = 0x8000
_OPEN_TREE_CLONE = 1
_MOVE_MOUNT_F_EMPTY_PATH = 4
# The syscalls added since 5.0 have one number on every architecture (alpha aside).
_NR_OPEN_TREE = 428
_NR_MOVE_MOUNT = 429
_NR_MOUNT_SETATTR = 442
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CAP_VERSION_3 = 0x20080522
_CAP_SETPCAP = 8

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _check(rc: int, what: str) -> int:
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return rc


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


def mount(
    src: str | None, target: str, flags: int, fstype: str | None = None, data: str = ""
) -> None:
    s = None if src is None else os.fsencode(src)
    t = None if fstype is None else fstype.encode()
    d = data.encode() if data else None
    _check(_libc.mount(s, os.fsencode(target), t, ctypes.c_ulong(flags), d), f"mount {target}")


def mount_setattr(path: str, set_: int, clear: int = 0, *, recursive: bool = False) -> None:
    attr = _MountAttr(set_, clear, 0, 0)
    flags = _AT_RECURSIVE if recursive else 0
    rc = _libc.syscall(
        ctypes.c_long(_NR_MOUNT_SETATTR),
        ctypes.c_int(_AT_FDCWD),
        os.fsencode(path),
        ctypes.c_uint(flags),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    _check(rc, f"mount_setattr {path}")


def open_tree_clone(path: str, *, follow: bool = True) -> int:
    """A detached copy of the mount tree at ``path`` (submounts and their flags included);
    of a symlink itself when not ``follow``."""
    flags = _OPEN_TREE_CLONE | _AT_RECURSIVE | os.O_CLOEXEC
    if not follow:
        flags |= _AT_SYMLINK_NOFOLLOW
    rc = _libc.syscall(
        ctypes.c_long(_NR_OPEN_TREE),
        ctypes.c_int(_AT_FDCWD),
        os.fsencode(path),
        ctypes.c_uint(flags),
    )
    return _check(rc, f"open_tree {path}")


def move_mount(fd: int, target: str) -> None:
    """Attach the detached tree ``fd`` at ``target`` (a symlink there is not followed)."""
    rc = _libc.syscall(
        ctypes.c_long(_NR_MOVE_MOUNT),
        ctypes.c_int(fd),
        b"",
        ctypes.c_int(_AT_FDCWD),
        os.fsencode(target),
        ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH),
    )
    _check(rc, f"move_mount {target}")


def prctl(option: int, arg: int) -> int:
    return int(
        _libc.prctl(
            ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), None
        )
    )


def no_new_privs() -> None:
    _check(prctl(_PR_SET_NO_NEW_PRIVS, 1), "prctl(PR_SET_NO_NEW_PRIVS)")


@functools.cache
def _last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 40


def _caps() -> tuple[_CapHeader, ctypes.Array[_CapData]]:
    hdr = _CapHeader(_CAP_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.capget(ctypes.byref(hdr), data), "capget")
    return hdr, data


def drop_bounding_set() -> bool:
    """Empty this thread's capability bounding set; False if it cannot (no CAP_SETPCAP).

    One credential commit per capability, ~4 µs each (160 µs of CPU in all, measured): the
    toolsrv process does it once, in its only thread, before it starts any other (threads
    inherit the set, and the server never needs it: it execs nothing but tools), so that
    spawning threads need not (`bounding_set_empty`); a spare thread of an executor in a
    process that keeps its set (tests) does it ahead of its job. As an unprivileged user
    it cannot be done, and need not be: with no_new_privs an exec never gains a capability,
    whatever the bounding set.
    """
    _hdr, data = _caps()
    if not data[0].effective & (1 << _CAP_SETPCAP):
        return False
    for cap in range(_last_cap() + 1):
        _check(prctl(_PR_CAPBSET_DROP, cap), f"PR_CAPBSET_DROP {cap}")
    return True


def bounding_set_empty() -> bool:
    """Whether the calling thread's bounding set is empty (CapBnd in /proc): then so is
    that of every thread it starts."""
    try:
        with open("/proc/thread-self/status", "rb") as f:
            for line in f:
                if line.startswith(b"CapBnd:"):
                    return int(line.split()[1], 16) == 0
    except (OSError, ValueError):
        pass
    return False


def drop_all_caps() -> None:
    """Effective, permitted, inheritable and ambient sets to zero, for good."""
    hdr, data = _caps()
    for i in (0, 1):
        data[i].effective = data[i].permitted = data[i].inheritable = 0
    _check(_libc.capset(ctypes.byref(hdr), data), "capset")
    prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)


@dataclass(frozen=True)
class MountPlan:
    """The tool's view of the filesystems, made in a private mount namespace.

    ``roots`` stay writable (each keeps its own mounts and their flags); everything else is
    read-only; ``protect`` entries (beneath roots) are read-only binds; ``hide_dirs`` get an
    empty read-only tmpfs on top, ``hide_files`` /dev/null (so a socket there refuses
    connections: it is not a socket any more). Roots and ``show`` paths that lie inside a
    hidden directory are put back at their own paths inside its tmpfs, roots writable,
    ``show`` read-only (the per-session tmp dir inside the daemon's data dir, the user's
    tool scripts inside its config dir). ``pins`` (directories or symlinks beneath a root,
    on the way to a hidden path) are mounted on themselves: a mount point cannot be moved
    or removed, so a tool cannot rename the way to a hidden directory and put a directory
    of its own where the daemon will look.
    """

    roots: tuple[str, ...]
    protect: tuple[str, ...] = ()
    hide_dirs: tuple[str, ...] = ()
    hide_files: tuple[str, ...] = ()
    show: tuple[str, ...] = ()
    pins: tuple[str, ...] = ()

    @property
    def paths(self) -> tuple[str, ...]:
        """Every path the plan mounts on or from."""
        return (
            *self.roots,
            *self.protect,
            *self.hide_dirs,
            *self.hide_files,
            *self.show,
            *self.pins,
        )

    def inside(self, hidden: str) -> list[str]:
        """The roots and shown paths to put back inside the hidden directory ``hidden``,
        parents first (a root inside a shown directory goes on top of it)."""
        return sorted(p for p in (*self.roots, *self.show) if strictly_beneath(p, hidden))

    def apply(self) -> None:
        """Make the calling thread's view, in a private mount namespace of its own."""
        private_mount_ns()
        # The roots are copied before "/" turns read-only, so the copies keep the flags the
        # host gives them (a read-only mount inside a root stays read-only); those inside
        # a hidden directory are put back once its tmpfs is there.
        inner = {p for d in self.hide_dirs for p in self.inside(d)}
        clones: dict[str, int] = {}
        try:
            for root in sorted(self.roots):
                clones[root] = open_tree_clone(root)
            mount_setattr("/", MOUNT_ATTR_RDONLY, recursive=True)
            for root, fd in clones.items():
                if root not in inner:
                    move_mount(fd, root)
            for path in sorted(self.pins):
                _mount_on_itself(path)
            for path in sorted(self.hide_dirs):
                self._hide_dir(path, clones)
        finally:
            for fd in clones.values():
                os.close(fd)
        # After the roots inside hidden directories are back: their .git too.
        for path in self.protect:
            try:
                mount(path, path, MS_BIND)
            except FileNotFoundError:  # removed since the scan, or hidden: nothing to do
                continue
            mount_setattr(path, MOUNT_ATTR_RDONLY)
        for path in self.hide_files:
            mount("/dev/null", path, MS_BIND)

    def _hide_dir(self, path: str, roots: dict[str, int]) -> None:
        """Cover ``path`` with a tmpfs; put back the roots inside it (``roots``: their
        copies, made before "/" turned read-only) and the shown paths (read-only)."""
        flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
        inner = self.inside(path)
        if not inner:
            mount("none", path, flags | MS_RDONLY, "tmpfs", "size=4k,mode=000")
            return
        # The shown paths are copied before the tmpfs covers them, put back inside it, and
        # only then is the tmpfs made read-only (its directories lead to them, no more).
        shown: dict[str, int] = {}
        try:
            for p in inner:
                if p not in roots:
                    shown[p] = open_tree_clone(p)
            mount("none", path, flags, "tmpfs", "size=16k,nr_inodes=256,mode=0111")
            for p in inner:
                fd = roots[p] if p in roots else shown[p]
                _mount_point(path, p, isdir=stat.S_ISDIR(os.fstat(fd).st_mode))
                move_mount(fd, p)
                if p in shown:
                    mount_setattr(p, MOUNT_ATTR_RDONLY, recursive=True)
        finally:
            for fd in shown.values():
                os.close(fd)
        mount_setattr(path, MOUNT_ATTR_RDONLY)


def _mount_on_itself(path: str) -> None:
    """Make ``path`` (a directory or a symlink, not followed) a mount point of its own,
    with what is mounted beneath it: then it cannot be renamed or removed (EBUSY)."""
    try:
        fd = open_tree_clone(path, follow=False)
    except FileNotFoundError:  # removed meanwhile: nothing to pin, nothing to lead astray
        return
    try:
        move_mount(fd, path)
    finally:
        os.close(fd)


def _mount_point(hidden: str, path: str, *, isdir: bool) -> None:
    """Make ``path`` (beneath the fresh tmpfs at ``hidden``) exist, with the directories
    leading to it, for a mount to go on it (those already there, a mount beneath another
    put back before it, are left)."""
    rel = os.path.relpath(path, hidden).split(os.sep)
    cur = hidden
    for name in rel[:-1]:
        cur = os.path.join(cur, name)
        with contextlib.suppress(FileExistsError):
            os.mkdir(cur, 0o111)
    if isdir:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    else:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))


def private_mount_ns() -> None:
    """Give the calling thread its own copy of the mount tree, propagating nothing back.

    ~85 µs (the copy of every mount), and the copy's teardown when its last user is gone
    waits for an RCU grace period (milliseconds on a busy VM): `MountNsCache` keeps the
    namespaces it builds, so a call rarely pays either.
    """
    unshare(CLONE_NEWNS)
    mount(None, "/", MS_REC | MS_PRIVATE)


def join_mount_ns(fd: int) -> None:
    """Move the calling thread into the mount namespace ``fd`` (cwd and root become that
    namespace's root). A thread shares its fs_struct with the process, and setns refuses a
    mount namespace to a thread that does: unsharing it first is one cheap copy."""
    unshare(CLONE_FS)
    setns(fd, CLONE_NEWNS)


def this_mount_ns() -> int:
    """An fd that keeps the calling thread's mount namespace alive (for `join_mount_ns`)."""
    return os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)


@dataclass(frozen=True)
class NsKey:
    """What a kept namespace was made from: the plan, and the identity (st_dev, st_ino) of
    each path it mounts on or from, in `MountPlan.paths` order."""

    plan: MountPlan
    ids: tuple[tuple[int, int], ...]


@dataclass(eq=False)
class _Kept:
    key: NsKey
    fd: int  # the namespace
    pins: list[int]  # O_PATH fds of the plan's paths: their inode numbers stay unique
    serial: int  # which namespace this is, for those that joined it (fd numbers recur)


class MountNsCache:
    """Mount namespaces already made to a `MountPlan`, kept for the next calls like it.

    Making a call's namespace (`MountPlan.apply`) costs a copy of the mount tree plus a
    mount per root and per protected entry, and its teardown once the tool exits waits
    for an RCU grace period inside the kernel; both were most of a tool call's cost on a
    busy VM (tens of milliseconds for back-to-back calls). Joining a kept namespace is two
    syscalls. Calls of one session share a plan (same roots, same protected entries), so
    nearly every call joins.

    A kept namespace is a snapshot, so its key holds all it depends on: the plan (paths),
    the identity of every path it mounts on or from, and the host's mount table (any
    change there, `MountWatch`, drops every kept namespace). A path replaced in the host
    (a .git removed and cloned again, a root made anew) has a new identity: the kernel
    detaches the kept namespace's mounts from the old one, so joining would show the new
    .git unprotected. Identities are only unique while the inode lives, so each kept
    namespace pins its paths with O_PATH fds: a removed directory's inode number is not
    given to its replacement while it is pinned. Nothing inside a kept namespace changes:
    tools have no capabilities and seccomp refuses the mount family, so calls joining one
    see exactly what a fresh namespace would show. At most ``size`` are kept (least
    recently used go first).
    """

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self._watch = MountWatch()
        self._kept: OrderedDict[NsKey, _Kept] = OrderedDict()
        self._serials = itertools.count(1)
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(plan: MountPlan, seen: Ids | None = None) -> NsKey | None:
        """The key of ``plan`` now; None if one of its paths is gone. ``seen``: identities
        of some of its paths, taken while the call was prepared (the rest are stat'ed)."""
        ids = identities(plan.paths, seen)
        return None if ids is None else NsKey(plan, ids)

    def get(self, key: NsKey | None) -> int | None:
        """A kept namespace for ``key`` (still owned by the cache), or None."""
        if self._watch.changed():
            self.clear()
        kept = self._kept.get(key) if key is not None else None
        if kept is None:
            self.misses += 1
            return None
        self._kept.move_to_end(kept.key)
        self.hits += 1
        return kept.fd

    def serial(self, key: NsKey | None) -> int | None:
        """Which kept namespace `get` gives for ``key`` now: another one (made again after
        the first was dropped) has another serial, though maybe the same fd number."""
        kept = self._kept.get(key) if key is not None else None
        return kept.serial if kept is not None else None

    @staticmethod
    def pin(key: NsKey | None) -> list[int] | None:
        """Pins of ``key``'s paths, taken before its namespace is made: None if a path
        changed since the key was taken (a namespace made now must not be kept)."""
        if key is None:
            return None
        pins: list[int] = []
        try:
            for path, ident in zip(key.plan.paths, key.ids, strict=True):
                fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
                pins.append(fd)
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) != ident:
                    raise FileNotFoundError(path)
        except OSError:
            for fd in pins:
                os.close(fd)
            return None
        return pins

    def put(self, key: NsKey | None, fd: int, pins: list[int] | None) -> None:
        """Keep namespace ``fd`` made to ``key`` with ``pins`` (`pin`); all three are now
        the cache's, and closed at once if the namespace cannot be kept."""
        if self._watch.changed():  # it may be a copy of the table before the change
            self.clear()
            key = None
        if key is None or pins is None or key in self._kept:
            os.close(fd)
            for pin in pins or ():
                os.close(pin)
            return
        self._kept[key] = _Kept(key, fd, pins, next(self._serials))
        while len(self._kept) > self.size:
            _key, old = self._kept.popitem(last=False)
            _close(old)

    def clear(self) -> None:
        while self._kept:
            _key, kept = self._kept.popitem()
            _close(kept)

    def close(self) -> None:
        self.clear()
        self._watch.close()


def _close(kept: _Kept) -> None:
    os.close(kept.fd)
    for pin in kept.pins:
        os.close(pin)


class MountWatch:
    """Tells whether the host's mount table changed since the last look (one poll(2) of
    /proc/self/mountinfo, which reports POLLPRI once per change). A thread that copied the
    mount tree before a change must not be used: its copy lacks a new mount (which would
    appear writable to no one, but missing) or pins one the host unmounted."""

    def __init__(self) -> None:
        self._fd = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLPRI | select.POLLERR)
        self.changed()

    def changed(self) -> bool:
        return bool(self._poll.poll(0))

    def close(self) -> None:
        if self._fd >= 0:
            self._poll.unregister(self._fd)
            os.close(self._fd)
            self._fd = -1


def run_in_thread(fn: Callable[[], None]) -> BaseException | None:
    """Run ``fn`` in a throw-away thread (for work that changes thread state for good)."""
    box: list[BaseException | None] = [None]

    def body() -> None:
        try:
            fn()
        except BaseException as err:
            box[0] = err

    t = threading.Thread(target=body, name="toolsrv-ns")
    t.start()
    t.join()
    return box[0]


@functools.cache
def mount_namespaces() -> bool:
    """Whether a thread can get a private mount namespace and make mounts read-only there
    (root, or CAP_SYS_ADMIN, and mount_setattr: Linux 5.12).

    Probed once for real in a throw-away thread: ``unshare`` can be refused by seccomp or a
    container runtime even to root.
    """

    def probe() -> None:
        private_mount_ns()
        mount_setattr("/", MOUNT_ATTR_RDONLY, recursive=True)

    err = run_in_thread(probe)
    if err is not None:
        log.debug("sandbox: no private mount namespaces (%s)", err)
    return err is None


def empty_netns() -> int | None:
    """An fd of a new, empty network namespace (only a loopback, left down), or None.

    Made once per server and shared by every call without network: creating one costs
    ~0.6 ms (and more to tear down, in the kernel's own time), joining it ~30 µs.
    """
    fds: list[int] = []

    def make() -> None:
        unshare(CLONE_NEWNET)
        fds.append(os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC))

    err = run_in_thread(make)
    if err is not None:
        log.debug("sandbox: no network namespace (%s)", err)
        return None
    return fds[0]


Ids = dict[str, tuple[int, int]]
"""(st_dev, st_ino) of real paths, as seen when they were resolved (`resolve`)."""


def resolve(path: str, ids: Ids | None = None) -> tuple[str, os.stat_result] | None:
    """``os.path.realpath`` of a path that exists, and its stat (None if it does not), in
    four syscalls: the kernel resolves it (open O_PATH), says where it ended
    (/proc/self/fd) and what it is. The Python realpath costs an lstat and a few string
    operations per component, and a call resolves its roots and hidden paths every time
    (a root may have been swapped for a symlink since the last call). ``ids`` gets the
    identity of the real path, so that no one stats it again for the same call."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # no /proc
            real = ""
    finally:
        os.close(fd)
    if not real.startswith("/") or real.endswith(" (deleted)"):
        # Removed meanwhile, or not a path of our root: let the library say.
        real = os.path.realpath(path)
        try:
            st = os.stat(real)
        except OSError:
            return None
    if ids is not None:
        ids[real] = (st.st_dev, st.st_ino)
    return real, st


def identities(paths: Sequence[str], seen: Ids | None = None) -> tuple[tuple[int, int], ...] | None:
    """(st_dev, st_ino) of each path, from ``seen`` where it has them, else lstat'ed now;
    None if one of them is gone."""
    ids: list[tuple[int, int]] = []
    for path in paths:
        ident = seen.get(path) if seen is not None else None
        if ident is None:
            try:
                st = os.lstat(path)  # a pinned symlink is itself (the rest are real paths)
            except OSError:
                return None
            ident = (st.st_dev, st.st_ino)
        ids.append(ident)
    return tuple(ids)


def real_path(path: str, ids: Ids | None = None) -> str | None:
    """The real path of an existing ``path`` (`resolve`), or None."""
    got = resolve(path, ids)
    return None if got is None else got[0]


def split_hidden(
    paths: Sequence[str], ids: Ids | None = None
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Existing paths to hide, as (directories, other files): real paths."""
    dirs: list[str] = []
    files: list[str] = []
    for path in paths:
        got = resolve(path, ids)
        if got is None:
            continue
        if stat.S_ISDIR(got[1].st_mode):
            dirs.append(got[0])
        else:
            files.append(got[0])
    # What lies beneath a hidden directory is hidden with it (and no longer there to mount on).
    dirs = [d for d in dirs if not any(o != d and d.startswith(o + os.sep) for o in dirs)]
    files = [f for f in files if not any(f.startswith(d + os.sep) for d in dirs)]
    return tuple(dirs), tuple(files)


def beneath(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or lies inside it (both real paths)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def strictly_beneath(path: str, root: str) -> bool:
    """Whether ``path`` lies inside ``root``, not being it."""
    return path != root and beneath(path, root)


_MAX_LINKS = 40  # as the kernel's lookup


def lookup_chain(path: str, lstat: dict[str, os.stat_result | None]) -> list[str]:
    """Every entry the lookup of ``path`` passes through, each named by the real path of
    its directory: the components, a symlink met on the way as itself and then the
    components of its target, up to the end. ``lstat`` remembers what was looked at, for
    the other paths of the same call (the daemon's dirs share most of their way).

    Whoever can rename or replace one of these entries can make the path lead elsewhere:
    these are what `MountPlan.pins` keeps in place.
    """
    out: list[str] = []
    todo = [p for p in os.path.abspath(path).split(os.sep) if p]
    cur = os.sep
    links = 0
    while todo:
        name = todo.pop(0)
        if name == ".":
            continue
        if name == "..":
            cur = os.path.dirname(cur)
            continue
        entry = os.path.join(cur, name)
        if entry not in lstat:
            try:
                lstat[entry] = os.lstat(entry)
            except OSError:
                lstat[entry] = None
        st = lstat[entry]
        if st is None:
            break  # the rest does not exist: nothing there to lead astray
        out.append(entry)
        if stat.S_ISLNK(st.st_mode):
            links += 1
            try:
                target = os.readlink(entry)
            except OSError:
                break
            if links > _MAX_LINKS:
                break
            if target.startswith(os.sep):
                cur = os.sep
            todo[:0] = [p for p in target.split(os.sep) if p]
            continue
        cur = entry
    return out


_NR_FSOPEN = 430
_NR_FSCONFIG = 431
_NR_FSMOUNT = 432
_FSCONFIG_SET_STRING = 1
_FSCONFIG_CMD_CREATE = 6


def make_mount(fstype: str, options: Sequence[tuple[str, str]]) -> int:
    """A new detached mount of ``fstype`` (fsopen, fsconfig, fsmount): its paths are
    looked up where the calling thread is, and the fd can be attached in another mount
    namespace (`move_mount`)."""
    fs = _check(
        _libc.syscall(ctypes.c_long(_NR_FSOPEN), fstype.encode(), ctypes.c_uint(1)), "fsopen"
    )
    try:
        for key, value in options:
            rc = _libc.syscall(
                ctypes.c_long(_NR_FSCONFIG),
                ctypes.c_int(fs),
                ctypes.c_uint(_FSCONFIG_SET_STRING),
                key.encode(),
                os.fsencode(value),
                ctypes.c_int(0),
            )
            _check(rc, f"fsconfig {fstype} {key}")
        rc = _libc.syscall(
            ctypes.c_long(_NR_FSCONFIG),
            ctypes.c_int(fs),
            ctypes.c_uint(_FSCONFIG_CMD_CREATE),
            None,
            None,
            ctypes.c_int(0),
        )
        _check(rc, f"fsconfig {fstype} create")
        return _check(
            _libc.syscall(
                ctypes.c_long(_NR_FSMOUNT), ctypes.c_int(fs), ctypes.c_uint(1), ctypes.c_uint(0)
            ),
            f"fsmount {fstype}",
        )
    finally:
        os.close(fs)


def clone_mount(fd: int) -> int:
    """A detached copy of the mount ``fd`` (a `make_mount` one, kept for several calls)."""
    flags = _OPEN_TREE_CLONE | _AT_RECURSIVE | _AT_EMPTY_PATH | os.O_CLOEXEC
    rc = _libc.syscall(ctypes.c_long(_NR_OPEN_TREE), ctypes.c_int(fd), b"", ctypes.c_uint(flags))
    return _check(rc, "open_tree (clone of a mount)")


_AT_EMPTY_PATH = 0x1000
