"""Which olliefs mounts exist, which daemon serves each, and which are dead.

``ollie umount MOUNTPOINT`` and ``ollie status MOUNTPOINT`` must act on the mount they
name, whichever ``OLLIE_HOME`` started it, and ``ollie doctor`` must find every mount
left dead by a killed daemon. Three sources are combined, each for what only it knows:

* ``/proc/self/mountinfo`` says what is mounted where, with which type: the daemon
  mounts with ``subtype=olliefs``, so the kernel lists its mounts as ``fuse.olliefs``;
* a live daemon holds its state lock (``state/daemon.lock``, ``flock``) open for as long
  as it runs, so the processes holding an open file of that name are the live daemons,
  and the path of that file is their state directory. Nothing else keeps the file open
  (``ollie status`` opens it for an instant), and a pid file alone can lie: a SIGKILLed
  daemon leaves it behind and its pid may be reused;
* the daemon's pid file (``run/ollie.pid``: pid, mount point, ``9p ADDR`` for each 9P
  export as bound) says where it
  mounted. Its run directory is found from the daemon's own environment
  (``/proc/PID/environ``), the way ``settings.paths`` found it when the daemon started.

A mount with no daemon behind it is probed with one ``listdir``: a dead one answers
ENOTCONN at once (the kernel aborted the connection when the daemon's ``/dev/fuse`` was
closed). A mount whose daemon is found is never probed, so a stopped (SIGSTOP) or wedged
daemon cannot hang ``ollie status``.

Only this user's daemons can be seen (``/proc/PID/fd`` of another user's process is
unreadable); root sees every one.
"""

from __future__ import annotations

import enum
import errno
import os
import re
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

FSTYPE = "fuse.olliefs"
LOCK_NAME = "daemon.lock"


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str
    source: str
    options: str = ""  # the mount's own options (``rw,nosuid,relatime``), not the sb's


_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (``\\040``)."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def mounts(mountinfo: str = "/proc/self/mountinfo") -> list[Mount]:
    """Every mount of this mount namespace, in mount order (a later one covers an earlier
    one on the same point)."""
    out: list[Mount] = []
    with open(mountinfo) as f:
        for line in f:
            left, sep, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if sep and len(fields) > 4 and len(tail) >= 2:
                point = _unescape(fields[4])
                out.append(Mount(point, tail[0], _unescape(tail[1]), fields[5]))
    return out


def mount_at(point: str) -> Mount | None:
    """The mount visible at ``point`` (the last one mounted there), if any."""
    found = None
    for m in mounts():
        if m.point == point:
            found = m
    return found


def covering(path: str, table: list[Mount]) -> Mount | None:
    """The mount of ``table`` that ``path`` (a real path) lies on: the last one mounted on
    the longest mount point that is ``path`` or one of its parents."""
    best: Mount | None = None
    for m in table:
        if _beneath(path, m.point) and (best is None or len(m.point) >= len(best.point)):
            best = m
    return best


def _beneath(path: str, top: str) -> bool:
    return top == "/" or path == top or path.startswith(top.rstrip("/") + "/")


class InsideTree(OSError):
    """A path that leads into an olliefs tree (errno EINVAL)."""


_MAX_LINKS = 40  # as the kernel's path walk


def real_dir(path: str, table: list[Mount] | None = None) -> str:
    """The real path of the existing directory ``path`` (absolute), found without ever
    looking inside an olliefs mount.

    A daemon that ``stat``s a path inside its own mount waits for an answer that only
    it can give: it hangs, and with it every access to the tree. ``os.path.realpath``
    or ``isdir`` would do exactly that for ``~/ollie/m``, and for a symlink that points
    there. So the walk goes one component at a time, follows symlinks itself, and
    refuses (`InsideTree`) before it touches a component that is, or lies beneath, the
    mount point of any olliefs mount in ``table`` (this namespace's, by default): its
    own, a bind mount of it elsewhere, or another daemon's. Other errors are the
    ``OSError`` of the component that failed (ENOENT, ENOTDIR, ELOOP, EACCES).
    """
    if not os.path.isabs(path):
        raise OSError(errno.EINVAL, "not an absolute path", path)
    table = mounts() if table is None else table
    trees = [m.point for m in table if m.fstype == FSTYPE]
    todo = [c for c in path.split("/") if c][::-1]  # a stack: the next component last
    real = "/"
    links = 0
    while todo:
        comp = todo.pop()
        if comp == ".":
            continue
        if comp == "..":
            real = os.path.dirname(real)
            continue
        cand = os.path.join(real, comp)
        if any(_beneath(cand, t) for t in trees):
            raise InsideTree(errno.EINVAL, "inside an olliefs tree", cand)
        st = os.lstat(cand)
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
            target = os.readlink(cand)
            if target.startswith("/"):
                real = "/"
            todo.extend(c for c in target.split("/")[::-1] if c)
            continue
        if todo and not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), cand)
        real = cand
    if any(_beneath(real, t) for t in trees):  # "/" itself, or a path of only ".."
        raise InsideTree(errno.EINVAL, "inside an olliefs tree", real)
    if not stat.S_ISDIR(os.stat(real).st_mode):
        raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), real)
    return real


def canonical(path: str) -> str:
    """An absolute path with the symlinks of its parent resolved, as mountinfo spells it.

    The last component is left alone: resolving it would ``lstat`` the mount's root,
    which for a wedged daemon never returns.
    """
    path = os.path.abspath(os.path.expanduser(path))
    parent, name = os.path.split(path)
    return os.path.join(os.path.realpath(parent), name) if name else path


@dataclass(frozen=True)
class Daemon:
    """A live olliefs daemon: its pid, where it mounted, its state and run directories."""

    pid: int
    mountpoint: str
    state: Path
    run: Path

    @property
    def sessions(self) -> int:
        return len(list((self.state / "sessions").glob("*.jsonl")))

    @property
    def exports(self) -> list[str]:
        """The 9P addresses it serves, as bound (`exports_in`)."""
        return exports_in(self.run / "ollie.pid")


def exports_in(pid_file: Path) -> list[str]:
    """The 9P exports a daemon's pid file lists after its pid and mount point
    (``9p tcp:127.0.0.1:40123``): the addresses as bound, a port 0 made real."""
    try:
        lines = pid_file.read_text().splitlines()[2:]
    except OSError:
        return []
    return [line[3:] for line in lines if line.startswith("9p ")]


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        raw = f.read()
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def run_dir_of(state: Path, environ: Mapping[str, str], uid: int) -> Path:
    """The run directory a daemon with this environment uses (``settings.paths``)."""
    if environ.get("OLLIE_HOME"):
        return state.parent / "run"  # OLLIE_HOME/{state,run}: no relative path to resolve
    runtime = environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "ollie" if runtime else Path(f"/tmp/ollie-{uid}")


def _lock_of(pid: int) -> Path | None:
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.endswith("/" + LOCK_NAME):
            return Path(target)
    return None


def daemon_of(pid: int) -> Daemon | None:
    """The daemon with this pid, if it is a live olliefs daemon this user can see."""
    try:
        lock = _lock_of(pid)
        if lock is None:
            return None
        environ = _environ(pid)
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:  # gone, or another user's
        return None
    run = run_dir_of(lock.parent, environ, uid)
    try:
        pid_s, mnt = (run / "ollie.pid").read_text().splitlines()[:2]
        if int(pid_s) != pid:
            return None  # an `ollie status` looking at the lock, or a stale file
    except (OSError, ValueError):
        return None  # not mounted yet (the pid file is written right after the mount)
    return Daemon(pid, canonical(mnt), lock.parent, run)


def daemons() -> Iterator[Daemon]:
    """Every live olliefs daemon this user can see."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            d = daemon_of(int(name))
            if d is not None:
                yield d


class State(enum.Enum):
    LIVE = "live"  # served by a daemon that answers (found, or seen to answer)
    DEAD = "dead"  # an olliefs mount whose daemon is gone: everything answers ENOTCONN
    ABSENT = "absent"  # nothing mounted there
    FOREIGN = "foreign"  # something else is mounted there


@dataclass(frozen=True)
class Status:
    point: str
    state: State
    daemon: Daemon | None = None  # LIVE, when the daemon is one this user can see
    fstype: str = ""  # FOREIGN: what is mounted instead


def status(point: str, known: list[Daemon] | None = None) -> Status:
    """What is at ``point`` (canonical): a live or dead olliefs mount, another, or none."""
    m = mount_at(point)
    if m is None:
        return Status(point, State.ABSENT)
    if m.fstype != FSTYPE:
        return Status(point, State.FOREIGN, fstype=m.fstype)
    for d in daemons() if known is None else known:
        if d.mountpoint == point:
            return Status(point, State.LIVE, d)
    try:
        os.listdir(point)
    except OSError as err:
        if err.errno == errno.ENOTCONN:
            return Status(point, State.DEAD)
    # It answers (or refuses us: another user's private mount): a daemon we cannot see.
    return Status(point, State.LIVE)
