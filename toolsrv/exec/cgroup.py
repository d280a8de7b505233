"""Per-call cgroups: a process cap (``pids.max``), a memory cap, and a kill switch for a
whole call.

`detect` finds a writable place for them once per executor; `CgroupBackend` hands out one
cgroup per call, pooled. Every process a call starts lands in its cgroup, including those
that called setsid() to leave the call's process group, so killing the cgroup ends the call.

Memory: cgroup v2 ``memory.max`` with ``memory.swap.max`` 0 and ``memory.oom.group`` (the
kernel kills the whole call when it must kill), in the call's own cgroup; or, where the
memory controller is a v1 hierarchy of its own (hybrid setups), a cgroup of the same name
there with ``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes`` equal (no swap),
which the spawning thread joins by its thread id, as v1 ``pids``. The kernel's count of
OOM kills in the cgroup (``oom_kill`` in memory.events, v2, or memory.oom_control, v1) is
read once at the end of a call: a rise means the limit killed a process of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from dataclasses import dataclass

import trio

log = logging.getLogger(__name__)

POOL_MAX = 16
# Waits for killed processes to be gone back off up to this step: the state they wait for
# (a dying process gone from its cgroup) comes within microseconds to a few milliseconds,
# and a longer step was seen to add ~15 ms to one call in ten.
MAX_STEP = 0.002


@dataclass(eq=False)
class Cgroup:
    path: str
    join_fd: int  # v1: tasks (a thread id joins), v2: cgroup.procs (a pid joins)
    pids_max: int = 0
    current_fd: int = -1  # v1: pids.current, read again with pread (kept across calls)
    mem_path: str | None = None  # where its memory files are (None: no memory cgroup)
    mem_join_fd: int = -1  # v1 memory hierarchy: its tasks (a thread id joins)
    mem_max: int = -1  # the memory limit written (0: none; -1: never written)
    oom_fd: int = -1  # memory.events (v2) or memory.oom_control (v1), read with pread
    oom_kills: int = 0  # the kernel's oom_kill count there after the last call

    def join_thread(self, version: int) -> None:
        """Move the calling thread into the cgroups that a thread joins by its id (v1):
        what it spawns starts there."""
        tid = str(threading.get_native_id()).encode()
        if version == 1:
            os.write(self.join_fd, tid)
        if self.mem_join_fd >= 0:
            os.write(self.mem_join_fd, tid)

    def new_oom_kills(self) -> int:
        """Processes the memory limit killed since the last look (one pread)."""
        if self.oom_fd < 0:
            return 0
        try:
            data = os.pread(self.oom_fd, 4096, 0)
        except OSError:
            return 0
        m = re.search(rb"^oom_kill (\d+)$", data, re.M)
        if m is None:
            return 0
        count = int(m.group(1))
        new, self.oom_kills = count - self.oom_kills, count
        return max(new, 0)

    def close(self) -> None:
        for fd in (self.join_fd, self.current_fd, self.mem_join_fd, self.oom_fd):
            if fd >= 0:
                os.close(fd)
        self.join_fd = self.current_fd = self.mem_join_fd = self.oom_fd = -1


class CgroupBackend:
    """Per-call cgroups under ``<base>`` (``.../toolsrv``), named ``<server pid>-<n>``.

    Empty call cgroups are pooled and reused: mkdir+rmdir cost ~80 µs a call, a reuse one
    ``pids.max`` write at most. The pool is removed by `close`; cgroups left by a server
    that died are removed (their processes killed) by the next server that starts.
    """

    def __init__(
        self, version: int, base: str, limits: bool, *, memory: int = 0, mem_base: str = ""
    ) -> None:
        """``memory``: 2 when the calls' cgroups (v2) have the memory controller, 1 when
        it is a v1 hierarchy with the calls' memory cgroups under ``mem_base``, 0 none."""
        self.version = version
        self.base = base
        self.limits = limits
        self.memory = memory
        self.mem_base = mem_base
        self.memsw = memory == 1 and os.path.exists(
            os.path.join(mem_base, "memory.memsw.limit_in_bytes")
        )
        self.kill_file = False
        self._pool: list[Cgroup] = []
        self._n = 0
        self._me = os.getpid()

    @property
    def mode(self) -> str:
        what = "pids" if self.limits else "kill only"
        if self.memory == 2:
            what += ", memory"
        elif self.memory == 1:
            what += f", v1 memory ({self.mem_base})"
        return f"v{self.version} {what} ({self.base})"

    @property
    def joins_threads(self) -> bool:
        """Whether a spawning thread joins the call's cgroups (v1 pids or memory), which
        costs an RCU grace period: a spare thread does it ahead."""
        return self.version == 1 or self.memory == 1

    def acquire(self, max_procs: int, memory_max: int = 0) -> Cgroup:
        if self._pool:
            cg = self._pool.pop()
        else:
            while True:  # a name left by another backend of this process is skipped
                self._n += 1
                path = os.path.join(self.base, f"{self._me}-{self._n}")
                try:
                    os.mkdir(path)
                    break
                except FileExistsError:
                    continue
            name = "tasks" if self.version == 1 else "cgroup.procs"
            try:
                fd = os.open(os.path.join(path, name), os.O_WRONLY | os.O_CLOEXEC)
            except OSError:
                os.rmdir(path)
                raise
            cg = Cgroup(path, fd)
            if self.version == 2:
                self.kill_file = os.path.exists(os.path.join(path, "cgroup.kill"))
            try:
                self._add_memory(cg)
            except OSError as err:
                log.warning("no memory cgroup for %s: %s", path, err.strerror)
        try:
            self.set_limit(cg, max_procs, memory_max)
        except OSError:
            self.release(cg)
            raise
        return cg

    def _add_memory(self, cg: Cgroup) -> None:
        if self.memory == 2:
            cg.mem_path = cg.path
            # No swap: a call over its limit is stopped, not paged out at the host's cost.
            # One OOM kill takes the whole call: its processes are one job.
            for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                with contextlib.suppress(FileNotFoundError):
                    write_file(os.path.join(cg.path, name), value)
            cg.oom_fd = os.open(os.path.join(cg.path, "memory.events"), os.O_RDONLY | os.O_CLOEXEC)
        elif self.memory == 1:
            path = os.path.join(self.mem_base, os.path.basename(cg.path))
            with contextlib.suppress(FileExistsError):
                os.mkdir(path)
            cg.mem_path = path
            flags = os.O_CLOEXEC
            cg.mem_join_fd = os.open(os.path.join(path, "tasks"), os.O_WRONLY | flags)
            cg.oom_fd = os.open(os.path.join(path, "memory.oom_control"), os.O_RDONLY | flags)
        if cg.oom_fd >= 0:
            cg.new_oom_kills()  # the count so far (a cgroup left by an earlier backend)

    def set_limit(self, cg: Cgroup, max_procs: int, memory_max: int = 0) -> None:
        if self.limits and cg.pids_max != max_procs:
            write_file(os.path.join(cg.path, "pids.max"), str(max_procs))
            cg.pids_max = max_procs
        if cg.mem_path is not None and cg.mem_max != memory_max:
            self._set_memory(cg.mem_path, memory_max, cg.mem_max)
            cg.mem_max = memory_max

    def _set_memory(self, path: str, value: int, old: int) -> None:
        if self.memory == 2:
            write_file(os.path.join(path, "memory.max"), str(value) if value else "max")
            return
        files = ["memory.limit_in_bytes"]
        if self.memsw:
            # memory+swap may never be below memory: lowered after it, raised before it.
            files.append("memory.memsw.limit_in_bytes")
            raising = value == 0 or (old > 0 and value > old)
            if raising:
                files.reverse()
        for name in files:
            write_file(os.path.join(path, name), str(value) if value else "-1")

    def pids(self, cg: Cgroup) -> list[int]:
        """Processes in the cgroup. Our own pid shows in v1 while the spawning thread is
        still in there: it is excluded, so it is never killed nor waited for."""
        try:
            data = read_seq(os.path.join(cg.path, "cgroup.procs"))
        except FileNotFoundError:
            return []
        return [p for p in map(int, data.split()) if p != self._me]

    def populated(self, cg: Cgroup) -> bool:
        if self.version == 2:
            try:
                with open(os.path.join(cg.path, "cgroup.events"), "rb") as f:
                    return b"populated 1" in f.read()
            except FileNotFoundError:
                return False
        # v1: pids.current, one pread of a kept fd, says 0 at the end of nearly every
        # call; otherwise the list decides (it leaves out our spawning thread, which
        # pids.current counts while it lives). cgroup.procs cannot be read again through
        # a kept fd: it answers what it listed the first time.
        if cg.current_fd < 0:
            try:
                path = os.path.join(cg.path, "pids.current")
                cg.current_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return bool(self.pids(cg))
        try:
            if os.pread(cg.current_fd, 32, 0).strip() == b"0":
                return False
        except OSError:
            pass
        return bool(self.pids(cg))

    def kill(self, cg: Cgroup) -> None:
        """SIGKILL everything in the cgroup (v2: atomically, forks included)."""
        if self.version == 2 and self.kill_file:
            write_file(os.path.join(cg.path, "cgroup.kill"), "1")
            return
        for pid in self.pids(cg):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)

    async def wait_empty(self, cg: Cgroup, deadline: float) -> tuple[bool, bool]:
        """Kill until empty: (empty by ``deadline``, whether anything had to be killed).
        A process forked between listing and killing shows up on the next pass;
        SIGKILLed processes cannot fork, and pids.max bounds the passes."""
        delay = 0.0002
        killed = False
        while self.populated(cg):
            self.kill(cg)
            killed = True
            if trio.current_time() > deadline:
                return False, killed
            await trio.sleep(delay)
            delay = min(delay * 2, MAX_STEP)
        return True, killed

    def release(self, cg: Cgroup, *, empty: bool = False) -> None:
        """Pool the cgroup if it is empty (``empty``: just seen so), else remove it.

        A full pool gives up its longest idle cgroup for this one, not this one: the
        thread that spawned into it (v1) may be a moment from its end, still a task of
        it, and a cgroup with a task cannot be removed (EBUSY)."""
        if empty or not self.populated(cg):
            if len(self._pool) >= POOL_MAX:
                self._remove(self._pool.pop(0), quiet=False)
            self._pool.append(cg)
            return
        self._remove(cg, quiet=False)

    def _remove(self, cg: Cgroup, *, quiet: bool) -> None:
        cg.close()
        for path in (cg.path, cg.mem_path if self.memory == 1 else None):
            if path is None:
                continue
            try:
                os.rmdir(path)
            except OSError as err:
                if not quiet:
                    log.warning("cannot remove cgroup %s: %s", path, err.strerror)

    def close(self) -> None:
        while self._pool:
            self._remove(self._pool.pop(), quiet=True)

    def remove_stale(self) -> None:
        """Remove call cgroups of servers that are gone, killing what is left in them."""
        for base in (self.base, self.mem_base if self.memory == 1 else ""):
            if base:
                self._remove_stale(base)

    def _remove_stale(self, base: str) -> None:
        try:
            names = os.listdir(base)
        except OSError:
            return
        for name in names:
            m = re.fullmatch(r"(\d+)-\d+", name)
            if m is None or int(m.group(1)) == self._me or _alive(int(m.group(1))):
                continue
            stale = Cgroup(os.path.join(base, name), -1)
            for _ in range(100):
                left = self.pids(stale)
                if not left:
                    break
                if base == self.base:
                    with contextlib.suppress(OSError):
                        self.kill(stale)
                for pid in left if base != self.base else ():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, 9)
            with contextlib.suppress(OSError):
                os.rmdir(stale.path)


def write_file(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def read_seq(path: str) -> bytes:
    """All of a kernel seq_file (a read may stop at a page), without a file object."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = b""
        while chunk := os.read(fd, 65536):
            data += chunk
    finally:
        os.close(fd)
    return data


def read_file(path: str) -> str:
    with open(path) as f:
        return f.read()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _cgroup_dir(mountpoint: str, mount_root: str, path: str) -> str | None:
    """Where the cgroup ``path`` (from /proc/self/cgroup) is under this mount, if it is."""
    if mount_root != "/":
        if path != mount_root and not path.startswith(mount_root + "/"):
            return None
        path = path[len(mount_root) :]
    return os.path.normpath(os.path.join(mountpoint, path.lstrip("/")))


def _enable(parent: str, base: str, controller: str) -> bool:
    """Enable ``controller`` for children of ``base`` (and so in ``parent``)."""
    try:
        for d in (parent, base):
            if controller not in read_file(os.path.join(d, "cgroup.subtree_control")).split():
                write_file(os.path.join(d, "cgroup.subtree_control"), "+" + controller)
    except OSError as err:
        log.debug("cgroup: cannot enable %s under %s: %s", controller, parent, err.strerror)
        return False
    return True


def _v2_base(parent: str, want_pids: bool) -> CgroupBackend | None:
    base = os.path.join(parent, "toolsrv")
    try:
        controllers = read_file(os.path.join(parent, "cgroup.controllers")).split()
    except OSError:
        controllers = []
    if want_pids and "pids" not in controllers:
        return None
    created = False
    try:
        os.mkdir(base)
        created = True
    except FileExistsError:
        pass
    except OSError:
        return None
    if not os.access(os.path.join(base, "cgroup.procs"), os.W_OK):
        return None
    if want_pids and not _enable(parent, base, "pids"):
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(base)
        return None
    memory = 2 if "memory" in controllers and _enable(parent, base, "memory") else 0
    return CgroupBackend(2, base, limits=want_pids, memory=memory)


def _v1_memory(mounts: list[tuple[str, str, str, list[str]]], own: dict[str, str]) -> str | None:
    """A writable place for calls' memory cgroups in a v1 memory hierarchy, if any."""
    for root, mountpoint, fstype, opts in mounts:
        if fstype != "cgroup" or "memory" not in opts or "memory" not in own:
            continue
        d = _cgroup_dir(mountpoint, root, own["memory"])
        if d is None:
            continue
        base = os.path.join(d, "toolsrv")
        with contextlib.suppress(OSError):
            os.makedirs(base, exist_ok=True)
        if os.access(os.path.join(base, "tasks"), os.W_OK) and os.path.exists(
            os.path.join(base, "memory.limit_in_bytes")
        ):
            return base
    return None


def detect(want: str = "") -> CgroupBackend | None:
    """Find a writable place for per-call cgroups, best first.

    1. cgroup v1 ``pids`` hierarchy, under our own cgroup: limits, and a race-free join.
    2. cgroup v2 with the pids controller: under our own cgroup when it is the root of the
       (visible) hierarchy, else at that root (this needs root, and takes the calls out of the
       server's cgroup: a process cap is worth more than accounting them with the service).
       A non-root cgroup holding processes cannot enable controllers for its children.
    3. cgroup v2 without controllers under our own cgroup: no cap, but still a kill switch.

    Memory: the v2 memory controller where the calls' v2 cgroups can have it, else a v1
    memory hierarchy (under our own cgroup there) if one is mounted and writable.

    ``want``: ``off`` disables cgroups (then the process group, the reaper and RLIMIT_NPROC
    do the job, and RLIMIT_DATA caps memory per process), ``v1`` or ``v2`` allows only that
    version, empty: any. Cgroups that servers now gone left behind are removed on the way
    (their processes killed).
    """
    want = want.lower()
    if want in ("0", "off", "no", "false", "none"):
        return None
    try:
        own: dict[str, str] = {}
        for line in read_file("/proc/self/cgroup").splitlines():
            _hid, ctrls, path = line.split(":", 2)
            for c in ctrls.split(",") if ctrls else [""]:
                own[c] = path
        mounts: list[tuple[str, str, str, list[str]]] = []
        for line in read_file("/proc/self/mountinfo").splitlines():
            left, _, right = line.partition(" - ")
            a, b = left.split(), right.split()
            if len(a) >= 5 and len(b) >= 3:
                mounts.append((_unescape(a[3]), _unescape(a[4]), b[0], b[2].split(",")))
    except (OSError, ValueError):
        return None
    backend: CgroupBackend | None = None
    for root, mountpoint, fstype, opts in mounts if want != "v2" else []:
        if fstype == "cgroup" and "pids" in opts and "pids" in own:
            d = _cgroup_dir(mountpoint, root, own["pids"])
            if d is None:
                continue
            base = os.path.join(d, "toolsrv")
            with contextlib.suppress(OSError):
                os.makedirs(base, exist_ok=True)
            if os.access(os.path.join(base, "tasks"), os.W_OK):
                backend = CgroupBackend(1, base, limits=True)
                break
    if backend is None and want != "v1":
        for root, mountpoint, fstype, _opts in mounts:
            if fstype != "cgroup2" or "" not in own:
                continue
            d = _cgroup_dir(mountpoint, root, own[""])
            if d is None:
                continue
            top = os.path.normpath(mountpoint)
            backend = _v2_base(d if d == top else top, want_pids=True) or _v2_base(
                d, want_pids=False
            )
            if backend is not None:
                break
    if backend is not None and backend.memory == 0 and want != "v2":
        mem_base = _v1_memory(mounts, own)
        if mem_base is not None:
            backend = CgroupBackend(
                backend.version, backend.base, backend.limits, memory=1, mem_base=mem_base
            )
    if backend is not None:
        backend.remove_stale()
    return backend
