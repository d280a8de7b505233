"""Run one tool call: a sandboxed process tree that cannot outlive the call.

`run_tool` spawns the tool in its own session and process group, confined by the call's
sandbox (`toolsrv.sandbox`), and, where the server may write cgroups, in a per-call cgroup
that caps its process count (``pids.max``) and lets us kill every process it started,
including those that called setsid() to leave the process group. Output is captured with a
cap per stream.

**Guarantee**: when `run_tool` returns or raises, every process of the call has been sent
SIGKILL and has exited (its cgroup is empty, or, without one, no live process is left in its
process group) and the leader is reaped. Exceptions: a process stuck in uninterruptible
sleep is waited for `KILL_GRACE` seconds, then logged; a process that left both the group and
the cgroup (only possible without a cgroup) is killed by the reaper (`init_reaper`) before
`run_tool` returns, unless a call that started earlier is still running (then by the sweep
at that call's end). The zombies of killed descendants are reaped by the reaper as they
appear (SIGCHLD).

How the spawn stays cheap: the restrictions are applied to a fresh thread that then spawns
the tool with vfork (see `sandbox.Prepared.enter`). A ``preexec_fn`` would force a full fork
of the server and run Python between fork and exec: 2 ms more per call on a VM, which alone
would triple the cost of running ``true``; it is only used to set rlimits, when a profile
asks for ``max_memory`` (see `_spawn`). The thread joins a cgroup v1 before spawning (v1
places threads one by one); cgroup v2 places whole processes only, so there the child is
moved right after exec: a native tool that forks within those microseconds, before its
dynamic loader has run, leaves children outside the cgroup, which the process-group kill and
the reaper still catch. For the same microseconds the spawning thread, a thread of the
server, shares the tool's Landlock domain: the server is non-dumpable meanwhile so the tool
cannot ptrace it, but such a tool could signal that thread and so kill the server.
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import ctypes
import errno
import logging
import os
import re
import resource
import select
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import FrameType
from typing import Any, TypeVar

import msgspec
import trio

from toolsrv import sandbox
from toolsrv.sandbox import Prepared, Profile, SandboxError

log = logging.getLogger(__name__)

KILL_GRACE = 5.0
"""Seconds to wait for SIGKILLed processes to be gone (only D-state ones take long)."""
DRAIN_GRACE = 0.5
"""Seconds to keep reading pipes once the tree is dead (an escapee may still hold them)."""
_CHUNK = 65536
_SPAWN_BLOCK = 0.002
# Waits for killed processes to be gone back off up to this step: the state they wait for
# (a dying process gone from its cgroup) comes within microseconds to a few milliseconds,
# and a longer step was seen to add ~15 ms to one call in ten.
_MAX_STEP = 0.002
_POOL_MAX = 16
_PR_GET_DUMPABLE = 3
_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36

__all__ = [
    "KILL_GRACE",
    "ExecResult",
    "SandboxError",
    "cgroup_mode",
    "init_reaper",
    "run_tool",
    "stop_reaper",
]


class ExecResult(msgspec.Struct):
    """What a call produced. ``error`` is set (and nothing else) when it could not start.

    ``*_dropped`` count the bytes read past ``Profile.max_output`` and discarded. `run_tool`
    never returns ``cancelled=True``: a cancelled call raises trio.Cancelled, and the caller
    that cancelled it builds its own cancelled result.
    """

    exit_code: int | None = None
    signal: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_dropped: int = 0
    stderr_dropped: int = 0
    timed_out: bool = False
    cancelled: bool = False
    error: str | None = None


# --- cgroups ---------------------------------------------------------------------------------


@dataclass(eq=False)
class _Cgroup:
    path: str
    join_fd: int  # v1: tasks (a thread id joins), v2: cgroup.procs (a pid joins)
    pids_max: int = 0


class _CgroupBackend:
    """Per-call cgroups under ``<base>`` (``.../toolsrv``), named ``<server pid>-<n>``.

    Empty call cgroups are pooled and reused: mkdir+rmdir cost ~80 µs a call, a reuse one
    ``pids.max`` write at most. The pool is removed at exit; cgroups left by a server that
    died are removed (their processes killed) by the next server that starts.
    """

    def __init__(self, version: int, base: str, limits: bool) -> None:
        self.version = version
        self.base = base
        self.limits = limits
        self.kill_file = False
        self._pool: list[_Cgroup] = []
        self._n = 0
        self._me = os.getpid()

    @property
    def mode(self) -> str:
        what = "pids" if self.limits else "kill only"
        return f"v{self.version} {what} ({self.base})"

    def acquire(self, max_procs: int) -> _Cgroup:
        if self._pool:
            cg = self._pool.pop()
        else:
            self._n += 1
            path = os.path.join(self.base, f"{self._me}-{self._n}")
            os.mkdir(path)
            name = "tasks" if self.version == 1 else "cgroup.procs"
            try:
                fd = os.open(os.path.join(path, name), os.O_WRONLY | os.O_CLOEXEC)
            except OSError:
                os.rmdir(path)
                raise
            cg = _Cgroup(path, fd)
            if self.version == 2:
                self.kill_file = os.path.exists(os.path.join(path, "cgroup.kill"))
        try:
            self.set_limit(cg, max_procs)
        except OSError:
            self.release(cg)
            raise
        return cg

    def set_limit(self, cg: _Cgroup, max_procs: int) -> None:
        if self.limits and cg.pids_max != max_procs:
            _write(os.path.join(cg.path, "pids.max"), str(max_procs))
            cg.pids_max = max_procs

    def pids(self, cg: _Cgroup) -> list[int]:
        """Processes in the cgroup. Our own pid shows in v1 while the spawning thread is
        still in there: it is excluded, so it is never killed nor waited for."""
        try:
            with open(os.path.join(cg.path, "cgroup.procs"), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return []
        return [p for p in map(int, data.split()) if p != self._me]

    def populated(self, cg: _Cgroup) -> bool:
        if self.version == 2:
            try:
                with open(os.path.join(cg.path, "cgroup.events"), "rb") as f:
                    return b"populated 1" in f.read()
            except FileNotFoundError:
                return False
        return bool(self.pids(cg))

    def kill(self, cg: _Cgroup) -> None:
        """SIGKILL everything in the cgroup (v2: atomically, forks included)."""
        if self.version == 2 and self.kill_file:
            _write(os.path.join(cg.path, "cgroup.kill"), "1")
            return
        for pid in self.pids(cg):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    async def wait_empty(self, cg: _Cgroup, deadline: float) -> bool:
        """Kill until empty. A process forked between listing and killing shows up on the
        next pass; SIGKILLed processes cannot fork, and pids.max bounds the passes."""
        delay = 0.0002
        while self.populated(cg):
            self.kill(cg)
            if trio.current_time() > deadline:
                return False
            await trio.sleep(delay)
            delay = min(delay * 2, _MAX_STEP)
        return True

    def release(self, cg: _Cgroup, *, empty: bool = False) -> None:
        """Pool the cgroup if it is empty (``empty``: just seen so), else remove it."""
        if len(self._pool) < _POOL_MAX and (empty or not self.populated(cg)):
            self._pool.append(cg)
            return
        os.close(cg.join_fd)
        try:
            os.rmdir(cg.path)
        except OSError as err:
            log.warning("cannot remove cgroup %s: %s", cg.path, err.strerror)

    def close(self) -> None:
        while self._pool:
            cg = self._pool.pop()
            os.close(cg.join_fd)
            with contextlib.suppress(OSError):
                os.rmdir(cg.path)

    def remove_stale(self) -> None:
        """Remove call cgroups of servers that are gone, killing what is left in them."""
        try:
            names = os.listdir(self.base)
        except OSError:
            return
        for name in names:
            m = re.fullmatch(r"(\d+)-\d+", name)
            if m is None or int(m.group(1)) == self._me or _alive(int(m.group(1))):
                continue
            stale = _Cgroup(os.path.join(self.base, name), -1)
            for _ in range(100):
                if not self.pids(stale):
                    break
                with contextlib.suppress(OSError):
                    self.kill(stale)
            with contextlib.suppress(OSError):
                os.rmdir(stale.path)


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


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


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _enable_pids(parent: str, base: str) -> bool:
    """Enable the pids controller for children of ``base`` (and so in ``parent``)."""
    try:
        for d in (parent, base):
            if "pids" not in _read(os.path.join(d, "cgroup.subtree_control")).split():
                _write(os.path.join(d, "cgroup.subtree_control"), "+pids")
    except OSError as err:
        log.debug("cgroup: cannot enable pids under %s: %s", parent, err.strerror)
        return False
    return True


def _v2_base(parent: str, want_pids: bool) -> _CgroupBackend | None:
    base = os.path.join(parent, "toolsrv")
    if want_pids:
        try:
            if "pids" not in _read(os.path.join(parent, "cgroup.controllers")).split():
                return None
        except OSError:
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
    if want_pids and not _enable_pids(parent, base):
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(base)
        return None
    return _CgroupBackend(2, base, limits=want_pids)


def _detect_cgroups() -> _CgroupBackend | None:
    """Find a writable place for per-call cgroups, best first.

    1. cgroup v1 ``pids`` hierarchy, under our own cgroup: limits, and a race-free join.
    2. cgroup v2 with the pids controller: under our own cgroup when it is the root of the
       (visible) hierarchy, else at that root (this needs root, and takes the calls out of the
       server's cgroup: a process cap is worth more than accounting them with the service).
       A non-root cgroup holding processes cannot enable controllers for its children.
    3. cgroup v2 without controllers under our own cgroup: no cap, but still a kill switch.

    ``TOOLSRV_CGROUPS`` in the environment: ``off`` disables cgroups (then the process group,
    the reaper and RLIMIT_NPROC do the job), ``v1`` or ``v2`` allows only that version.
    """
    want = os.environ.get("TOOLSRV_CGROUPS", "").lower()
    if want in ("0", "off", "no", "false", "none"):
        return None
    try:
        own: dict[str, str] = {}
        for line in _read("/proc/self/cgroup").splitlines():
            _hid, ctrls, path = line.split(":", 2)
            for c in ctrls.split(",") if ctrls else [""]:
                own[c] = path
        mounts: list[tuple[str, str, str, list[str]]] = []
        for line in _read("/proc/self/mountinfo").splitlines():
            left, _, right = line.partition(" - ")
            a, b = left.split(), right.split()
            if len(a) >= 5 and len(b) >= 3:
                mounts.append((_unescape(a[3]), _unescape(a[4]), b[0], b[2].split(",")))
    except (OSError, ValueError):
        return None
    backend: _CgroupBackend | None = None
    for root, mountpoint, fstype, opts in mounts if want != "v2" else []:
        if fstype == "cgroup" and "pids" in opts and "pids" in own:
            d = _cgroup_dir(mountpoint, root, own["pids"])
            if d is None:
                continue
            base = os.path.join(d, "toolsrv")
            with contextlib.suppress(OSError):
                os.makedirs(base, exist_ok=True)
            if os.access(os.path.join(base, "tasks"), os.W_OK):
                backend = _CgroupBackend(1, base, limits=True)
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
    if backend is not None:
        backend.remove_stale()
        atexit.register(backend.close)
    return backend


_backend: _CgroupBackend | None = None
_backend_known = False


def _cgroups() -> _CgroupBackend | None:
    global _backend, _backend_known
    if not _backend_known:
        _backend = _detect_cgroups()
        _backend_known = True
        log.debug("cgroups: %s", _backend.mode if _backend else "none")
    return _backend


def cgroup_mode() -> str:
    """How calls are grouped, for logs: e.g. ``v1 pids (/sys/fs/cgroup/pids/toolsrv)``."""
    backend = _cgroups()
    return backend.mode if backend is not None else "none (process groups and RLIMIT_NPROC)"


# --- the reaper ------------------------------------------------------------------------------


@dataclass(eq=False)
class _Call:
    pid: int | None = None  # the leader, once spawned
    start: int | None = None  # the leader's start time in clock ticks (read when needed)


_calls: set[_Call] = set()
_reaper_on = False
_prev_sigchld: Any = None
_own_sid = 0
_own_nnp = False
_sweeping = False
_sweep_again = False
_libc = ctypes.CDLL(None, use_errno=True)


def _nnp(pid: int | str) -> bool:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            return b"\nNoNewPrivs:\t1" in f.read()
    except OSError:
        return False


def init_reaper() -> None:
    """Make this process the reaper of orphaned tool processes (call once at server start).

    As a child subreaper, processes whose parent died while they ran (a tool's background
    job, or one that called setsid() to leave the call's process group) are re-parented to
    us rather than to init. The sweep then reaps their zombies and SIGKILLs the live ones of
    finished calls: at the end of each call, and on SIGCHLD when called from the main thread.

    A child is taken for a tool process only if it runs in another session than ours and has
    NoNewPrivs set (every tool process has, for good) while we do not: children that other
    code of this process spawns are left alone.
    """
    global _reaper_on, _prev_sigchld, _own_sid, _own_nnp
    if _reaper_on:
        return
    if _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("cannot become a child subreaper: %s", os.strerror(ctypes.get_errno()))
    _own_sid = os.getsid(0)
    _own_nnp = _nnp("self")
    if threading.current_thread() is threading.main_thread():
        _prev_sigchld = signal.signal(signal.SIGCHLD, _on_sigchld)
    _reaper_on = True


def stop_reaper() -> None:
    """Undo `init_reaper` (for tests and embedders), after a last sweep."""
    global _reaper_on, _prev_sigchld
    if not _reaper_on:
        return
    _sweep()
    _reaper_on = False
    if threading.current_thread() is threading.main_thread() and _prev_sigchld is not None:
        signal.signal(signal.SIGCHLD, _prev_sigchld)
        _prev_sigchld = None
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def _on_sigchld(signum: int, frame: FrameType | None) -> None:
    _sweep()
    if callable(_prev_sigchld):
        _prev_sigchld(signum, frame)


def _children() -> set[int]:
    """Our children: /proc/<pid>/task/*/children (a few µs), else a scan of all of /proc."""
    me = os.getpid()
    kids: set[int] = set()
    try:
        tids = os.listdir(f"/proc/{me}/task")
    except OSError:
        return kids
    found = False
    for tid in tids:
        try:
            fd = os.open(f"/proc/{me}/task/{tid}/children", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        found = True
        try:
            data = b""
            while chunk := os.read(fd, 65536):  # a seq_file: a read may stop at a page
                data += chunk
        finally:
            os.close(fd)
        kids.update(map(int, data.split()))
    if not found:  # kernel without CONFIG_PROC_CHILDREN
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (st := _stat(int(entry))) is not None and st[1] == me:
                kids.add(int(entry))
    return kids


def _stat(pid: int) -> tuple[str, int, int, int, int] | None:
    """(state, ppid, pgrp, session, starttime) from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])


def _sweep() -> int:
    """Reap and kill orphaned tool processes (see `init_reaper`); how many it SIGKILLed.

    Never raises: it runs from the SIGCHLD handler, in the middle of whatever code.
    """
    global _sweeping, _sweep_again
    if not _reaper_on:
        return 0
    if _sweeping:  # a SIGCHLD arrived during a sweep: go round once more
        _sweep_again = True
        return 0
    _sweeping = True
    killed = 0
    try:
        while True:
            _sweep_again = False
            killed += _sweep_once()
            if not _sweep_again:
                break
    except Exception:
        log.debug("reaper sweep failed", exc_info=True)
    finally:
        _sweeping = False
    return killed


async def _sweep_until_clean(deadline: float) -> None:
    """Sweep until no orphan of a finished call is alive: a killed escapee's children are
    re-parented to us only once it is dead, so killing a chain takes a few rounds."""
    delay = 0.0002
    while _sweep() and trio.current_time() < deadline:
        await trio.sleep(delay)
        delay = min(delay * 2, _MAX_STEP)


def _sweep_once() -> int:
    calls = list(_calls)
    if any(c.pid is None for c in calls):
        # A leader being spawned may already be a zombie we do not know yet: touch nothing.
        # That call's end sweeps again.
        return 0
    kids = _children() - {c.pid for c in calls}
    floor: int | None = None
    floor_known = False
    killed = 0
    for pid in kids:
        st = _stat(pid)
        if st is None or st[3] == _own_sid or (not _own_nnp and not _nnp(pid)):
            continue
        if st[0] in ("Z", "X"):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            continue
        if not floor_known:
            floor, floor_known = _calls_floor(calls), True
        # Processes of calls in flight all started after their leader: anything older
        # belongs to a call that is over. Without a known floor, kill nothing.
        if calls and (floor is None or st[4] >= floor):
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # its zombie comes back through SIGCHLD
            killed += 1
    return killed


def _calls_floor(calls: list[_Call]) -> int | None:
    starts: list[int] = []
    for call in calls:
        if call.start is None and call.pid is not None:
            st = _stat(call.pid)
            if st is not None:
                call.start = st[4]
        if call.start is None:
            return None
        starts.append(call.start)
    return min(starts, default=None)


# --- spawning --------------------------------------------------------------------------------

_T = TypeVar("_T")


class _SetupError(Exception):
    pass


_local = threading.local()  # .joined: the cgroup a spare thread joined ahead of its job


class _Spare:
    """A thread started ahead of time, waiting for the one job it will run before ending.

    Each spawn needs a brand-new thread (its restrictions are for good), and starting one
    costs ~50 µs; the next one is started while the current tool runs (`_prestart`), off
    the critical path. Only the trio thread starts them, so they begin unrestricted.

    With a v1 cgroup backend the spare also takes the next call's cgroup and joins it at
    once: joining (a write to ``tasks``) waits for an RCU grace period inside the kernel,
    which was measured at 15-20 ms on an idle VM. Done ahead, nobody waits for it.
    """

    def __init__(self, cg: _Cgroup | None = None) -> None:
        self.cg = cg
        self._go = _thread.allocate_lock()
        self._go.acquire()
        self._job: Callable[[], None] | None = None
        _thread.start_new_thread(self._main, ())

    def _main(self) -> None:
        if self.cg is not None:
            try:
                os.write(self.cg.join_fd, str(threading.get_native_id()).encode())
                _local.joined = self.cg
            except OSError as err:  # the job joins (or fails) the usual way
                log.debug("spare thread could not join %s: %s", self.cg.path, err.strerror)
        self._go.acquire()
        if self._job is not None:
            self._job()

    def run(self, job: Callable[[], None]) -> None:
        self._job = job
        self._go.release()


_spare: _Spare | None = None


def _prestart(max_procs: int) -> None:
    """Start the next spawning thread now, while a tool runs and the server waits."""
    global _spare
    if _spare is None:
        backend = _cgroups()
        cg = None
        if backend is not None and backend.version == 1:
            try:
                cg = backend.acquire(max_procs)
            except OSError as err:
                log.debug("no cgroup for the spare thread: %s", err.strerror)
        _spare = _Spare(cg)


def _take_spare() -> _Spare | None:
    global _spare
    spare, _spare = _spare, None
    return spare


def _return_spare(spare: _Spare) -> None:
    """A spare taken but not used: keep it for the next call, or end it."""
    global _spare
    if _spare is None:
        _spare = spare
        return
    spare.run(lambda: None)
    backend = _cgroups()
    if spare.cg is not None and backend is not None:
        backend.release(spare.cg)


_spawning = 0
_was_dumpable: bool | None = None


def _guard_spawn(start: bool) -> None:
    """Keep the server non-dumpable while a spawning thread lives.

    That thread shares the tool's Landlock domain, which does not stop the tool from
    ptrace-attaching it during the microseconds it lives on after exec; being non-dumpable
    does (attaching then takes CAP_SYS_PTRACE, which tools lack), and costs two prctls.
    """
    global _spawning, _was_dumpable
    if _was_dumpable is None:
        _was_dumpable = _libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) == 1
    if not _was_dumpable:
        return
    _spawning += 1 if start else -1
    if _spawning == (1 if start else 0):
        _libc.prctl(_PR_SET_DUMPABLE, 0 if start else 1, 0, 0, 0)


async def _in_fresh_thread(fn: Callable[[], _T], spare: _Spare | None = None) -> _T:
    """Run ``fn`` in a new OS thread that ends with it: never trio's thread cache, which
    would hand the restricted thread to unrelated work afterwards. The wait is shielded:
    a spawn takes about a millisecond and its result must not be lost."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    result: list[_T] = []
    error: list[BaseException] = []

    ready = _thread.allocate_lock()
    ready.acquire()

    def body() -> None:
        try:
            result.append(fn())
        except BaseException as err:
            error.append(err)
        finally:
            ready.release()
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

    thread = spare or _Spare()
    _guard_spawn(True)
    thread.run(body)
    # A spawn takes ~0.3 ms. Waiting for it on a lock, with the event loop blocked, is
    # ~0.1 ms faster than a trio wakeup from another thread; a slow spawn (a mount
    # namespace, a binary on a slow filesystem) blocks the loop _SPAWN_BLOCK at most and
    # is then awaited the trio way.
    if not ready.acquire(timeout=_SPAWN_BLOCK):
        with trio.CancelScope(shield=True):
            await done.wait()
    _guard_spawn(False)
    if error:
        raise error[0]
    return result[0]


def _spawn(
    argv: list[str],
    cwd: str,
    env: dict[str, str],
    stdio: tuple[int, int, int],
    prepared: Prepared,
    cg: _Cgroup | None,
    version: int,
    rlimits: list[tuple[int, int]],
) -> subprocess.Popen[bytes]:
    """The spawning thread: join the cgroup (v1), restrict itself, vfork+exec the tool.

    ``rlimits`` are per process, so the thread cannot pass them on: when there are any, the
    spawn forks and sets them in the child before exec (a Python ``preexec_fn``: a full
    fork of the server, ~2 ms, paid only by profiles with ``max_memory`` and by non-root
    servers without a pids cgroup).
    """
    try:
        if cg is not None and version == 1 and getattr(_local, "joined", None) is not cg:
            os.write(cg.join_fd, str(threading.get_native_id()).encode())
        prepared.enter()
    except OSError as err:
        raise _SetupError(str(err)) from err
    proc = subprocess.Popen(
        argv,
        stdin=stdio[0],
        stdout=stdio[1],
        stderr=stdio[2],
        cwd=cwd,
        env=env,
        close_fds=True,
        start_new_session=True,
        preexec_fn=partial(_set_rlimits, rlimits) if rlimits else None,
    )
    if cg is not None and version == 2:
        with contextlib.suppress(OSError):  # already gone
            os.write(cg.join_fd, str(proc.pid).encode())
    return proc


def _set_rlimits(rlimits: list[tuple[int, int]]) -> None:
    for res, value in rlimits:
        resource.setrlimit(res, (value, value))


def _total_tasks() -> int:
    """All tasks on the machine (/proc/loadavg): the RLIMIT_NPROC fallback's baseline."""
    try:
        return int(_read("/proc/loadavg").split()[3].split("/")[1])
    except (OSError, ValueError, IndexError):
        return 4096


_core_off = False


def _rlimits(profile: Profile, capped: bool) -> list[tuple[int, int]]:
    """The limits a call's leader must start with (see `_spawn`).

    RLIMIT_CORE is set to 0 once on the server itself (soft limit), which every tool
    inherits at no cost per call. RLIMIT_AS is ``max_memory``. RLIMIT_NPROC is only the
    fallback when no pids cgroup caps the call. It counts every process of the user, not of
    the call, so it is set to what runs now plus max_procs: the tool gets at most that many
    more. Root (uid 0) is exempt from RLIMIT_NPROC whatever its capabilities (kernel:
    ``real_cred->user != INIT_USER``), so for root it is not set, and without a pids cgroup
    a root tool has no process cap: the timeout and the group kill still end a fork bomb.
    """
    global _core_off
    if not _core_off:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(
                resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1])
            )
        _core_off = True
    wanted: list[tuple[int, int]] = []
    if profile.max_memory:
        wanted.append((resource.RLIMIT_AS, profile.max_memory))
    if not capped:
        if os.geteuid() == 0:
            sandbox.warn_once("nproc", "no pids cgroup: tools running as root have no process cap")
        else:
            wanted.append((resource.RLIMIT_NPROC, _total_tasks() + profile.max_procs))
    limits: list[tuple[int, int]] = []
    for res, value in wanted:
        hard = resource.getrlimit(res)[1]  # the tool inherits ours: it cannot go above
        limits.append((res, value if hard == resource.RLIM_INFINITY else min(value, hard)))
    return limits


def _exit_fd(pid: int) -> int:
    """An fd that becomes readable when the leader exits: its pidfd, or on kernels before
    5.3 a pipe closed by a thread blocked in waitid() (WNOWAIT: reaping stays ours)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        pass
    r, w = os.pipe2(os.O_CLOEXEC)

    def wait() -> None:
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        finally:
            os.close(w)

    threading.Thread(target=wait, name=f"toolsrv-wait-{pid}", daemon=True).start()
    return r


def _group_alive(pgid: int) -> bool:
    """Whether a live (non-zombie) process is in the group: a /proc scan, slow path only."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            if st[2] == pgid and st[0] not in ("Z", "X"):
                return True
    return False


async def _wait_group_gone(pgid: int, deadline: float) -> bool:
    delay = 0.0002
    waited = 0.0
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # a member switched to another uid: still there
            pass
        # Members left: dying, or zombies waiting for their reaper (us or init).
        _sweep()
        if waited > 0.005 and not _group_alive(pgid):
            return True
        if trio.current_time() > deadline:
            return False
        await trio.sleep(delay)
        waited += delay
        delay = min(delay * 2, _MAX_STEP)


class _Capture:
    """One output stream: ``cap`` bytes kept, the rest read and counted, never stored, so a
    chatty tool never blocks on a full pipe and the server's memory stays bounded."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.buf = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.buf)
        if room > 0:
            self.buf += chunk[:room]
        self.dropped += max(0, len(chunk) - max(room, 0))


class _Watch:
    """The call's pipes and its exit fd in one epoll set, serviced by the calling task.

    One trio wait per wakeup instead of a task and a stream per pipe: on the fast path a
    call's cost is mostly such scheduling rounds. Reads are bounded per wakeup, so a tool
    writing as fast as we read cannot keep the loop from its checkpoint (and its timeout).
    """

    def __init__(
        self, out_r: int, err_r: int, in_w: int | None, rest: memoryview, exit_fd: int, cap: int
    ) -> None:
        self.ep = select.epoll()
        self.out, self.err = _Capture(cap), _Capture(cap)
        self.readers = {out_r: self.out, err_r: self.err}
        self.writer, self.rest = in_w, rest
        self.exit_fd: int | None = exit_fd
        self.exited = False
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
            self.ep.register(fd, select.EPOLLIN)
        self.ep.register(exit_fd, select.EPOLLIN)
        if in_w is not None:
            self.ep.register(in_w, select.EPOLLOUT)

    async def pump(self, *, until_exit: bool) -> None:
        """Move data until the leader has exited, or (``until_exit`` false) until EOF on
        both pipes, which comes once every process holding them is dead."""
        while not self.exited if until_exit else self.readers:
            await trio.lowlevel.wait_readable(self.ep.fileno())
            for fd, _events in self.ep.poll(0):
                if fd == self.exit_fd:
                    self.exited = True
                    self.forget_exit()
                elif fd == self.writer:
                    self._write()
                elif fd in self.readers:
                    self._read(fd)

    def forget_exit(self) -> None:
        """Stop watching the exit fd (its owner closes it)."""
        if self.exit_fd is not None:
            self.ep.unregister(self.exit_fd)
            self.exit_fd = None

    def _read(self, fd: int) -> None:
        capture = self.readers[fd]
        for _ in range(16):
            try:
                chunk = os.read(fd, _CHUNK)
            except BlockingIOError:
                return
            if not chunk:
                self.ep.unregister(fd)
                os.close(fd)
                del self.readers[fd]
                return
            capture.add(chunk)

    def _write(self) -> None:
        """Stdin that did not fit in the pipe up front. A tool that exits without reading
        it gives EPIPE: the rest is dropped."""
        assert self.writer is not None
        try:
            self.rest = self.rest[os.write(self.writer, self.rest) :]
        except BlockingIOError:
            return
        except OSError:
            self.rest = self.rest[:0]
        if not self.rest:
            self.ep.unregister(self.writer)
            os.close(self.writer)
            self.writer = None

    def close(self) -> None:
        trio.lowlevel.notify_closing(self.ep.fileno())
        self.ep.close()
        for fd in [*self.readers, *([self.writer] if self.writer is not None else [])]:
            os.close(fd)
        self.readers.clear()
        self.writer = None


def _prefill(fd: int, data: bytes) -> memoryview:
    """Put as much stdin as fits in the pipe before the spawn (usually all of it, so no
    writer task is needed); return the rest."""
    view = memoryview(data)
    if not view:
        return view
    os.set_blocking(fd, False)
    try:
        n = os.write(fd, view)
    except BlockingIOError:
        n = 0
    return view[n:]


@dataclass(eq=False)
class _Run:
    """One call's live state, so the end can run from the normal path or a cancellation."""

    call: _Call
    proc: subprocess.Popen[bytes]
    exit_fd: int | None
    cg: _Cgroup | None
    backend: _CgroupBackend | None
    exited: bool = False  # the leader has exited (not yet reaped)
    ended: bool = False
    empty: bool = False  # the call's cgroup was seen empty at the end

    async def end(self) -> None:
        """Kill everything of the call, reap the leader, wait until the rest is gone."""
        if self.ended:
            return
        self.ended = True
        with trio.CancelScope(shield=True):
            pid = self.proc.pid
            # The group first, while the unreaped leader still holds the pgid (no reuse).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            if self.exit_fd is not None:
                if not self.exited:
                    await trio.lowlevel.wait_readable(self.exit_fd)
                trio.lowlevel.notify_closing(self.exit_fd)
                os.close(self.exit_fd)
                self.exit_fd = None
            self.proc.wait()
            deadline = trio.current_time() + KILL_GRACE
            if self.cg is not None and self.backend is not None:
                gone = self.empty = await self.backend.wait_empty(self.cg, deadline)
            else:
                gone = await _wait_group_gone(pid, deadline)
            if not gone:
                log.warning("tool %d: processes still alive %gs after SIGKILL", pid, KILL_GRACE)


async def run_tool(
    argv: list[str],
    *,
    stdin: bytes,
    cwd: str,
    env: dict[str, str],
    write_roots: list[str],
    tmp_dir: str,
    profile: Profile,
    timeout: float,
) -> ExecResult:
    """Run one tool call to its end and return what it did.

    The tool runs in its own session and process group with exactly ``env``, confined by
    ``profile`` (writable: ``write_roots``, ``tmp_dir`` and the profile's ``write`` entries),
    for at most ``min(timeout, profile.timeout_cap)`` seconds. The call ends when the leader
    exits, at the timeout (``timed_out``), or when the awaiting task is cancelled (then
    trio.Cancelled propagates, after the cleanup). In every case all processes of the call
    are SIGKILLed and gone, and the leader is reaped, before this returns or raises.

    A tool that cannot start gives ``error``. Raises SandboxError when policy forbids running
    (Landlock missing and the profile is not ``unsandboxed``).
    """
    if not argv:
        return ExecResult(error="empty command")
    timeout = min(timeout, profile.timeout_cap)
    roots = [*write_roots, tmp_dir, *sandbox.expand_write(profile.write, env)]
    try:
        prepared = sandbox.prepare(profile, roots)
    except (OSError, ValueError) as err:
        return ExecResult(error=f"sandbox setup failed: {err}")
    try:
        return await _run(argv, stdin, cwd, env, prepared, profile, timeout)
    finally:
        prepared.close()


async def _run(
    argv: list[str],
    stdin: bytes,
    cwd: str,
    env: dict[str, str],
    prepared: Prepared,
    profile: Profile,
    timeout: float,
) -> ExecResult:
    backend = _cgroups()
    call = _Call()
    fds: list[int] = []  # ours until handed to the watch or closed
    watch: _Watch | None = None
    cg: _Cgroup | None = None
    run: _Run | None = None
    spare = _take_spare()  # None once handed to _in_fresh_thread
    try:
        for _ in range(3):
            fds.extend(os.pipe2(os.O_CLOEXEC))
        in_r, in_w, out_r, out_w, err_r, err_w = fds
        rest = _prefill(in_w, stdin)
        if not rest:
            os.close(in_w)
            fds.remove(in_w)
        if backend is not None:
            try:
                if spare is not None and spare.cg is not None:
                    cg = spare.cg  # joined ahead by the spare thread
                    backend.set_limit(cg, profile.max_procs)
                else:
                    cg = backend.acquire(profile.max_procs)
            except OSError as err:
                log.warning("cgroup for the call unavailable: %s", err.strerror)
        _calls.add(call)
        thread, spare = spare, None
        try:
            proc = await _in_fresh_thread(
                partial(
                    _spawn,
                    argv,
                    cwd,
                    env,
                    (in_r, out_w, err_w),
                    prepared,
                    cg,
                    backend.version if backend else 0,
                    _rlimits(profile, cg is not None and backend is not None and backend.limits),
                ),
                thread,
            )
        except _SetupError as err:
            return ExecResult(error=f"sandbox setup failed: {err}")
        except (OSError, subprocess.SubprocessError, ValueError) as err:
            return ExecResult(error=_spawn_error(argv[0], err))
        except Exception as err:  # a failed spawn is a result, never the server's problem
            log.exception("spawning %s failed", argv[0])
            return ExecResult(error=_spawn_error(argv[0], err))
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
                fds.remove(fd)
        call.pid = proc.pid
        run = _Run(call, proc, _exit_fd(proc.pid), cg, backend)
        assert run.exit_fd is not None
        watch = _Watch(out_r, err_r, in_w if rest else None, rest, run.exit_fd, profile.max_output)
        for fd in (out_r, err_r, *([in_w] if rest else [])):
            fds.remove(fd)
        _prestart(profile.max_procs)
        with trio.move_on_after(timeout) as deadline:
            await watch.pump(until_exit=True)
        run.exited = watch.exited
        watch.forget_exit()
        await run.end()
        with trio.move_on_after(DRAIN_GRACE):
            await watch.pump(until_exit=False)
        rc = proc.returncode
        assert rc is not None
        return ExecResult(
            exit_code=rc if rc >= 0 else None,
            signal=-rc if rc < 0 else None,
            stdout=bytes(watch.out.buf),
            stderr=bytes(watch.err.buf),
            stdout_dropped=watch.out.dropped,
            stderr_dropped=watch.err.dropped,
            timed_out=deadline.cancelled_caught,
        )
    finally:
        if spare is not None:  # taken but not handed a job: it keeps its cgroup
            if cg is spare.cg:
                cg = None
            _return_spare(spare)
        with trio.CancelScope(shield=True):
            if run is not None:
                await run.end()
            if watch is not None:
                watch.close()
            for fd in fds:
                os.close(fd)
            if cg is not None and backend is not None:
                backend.release(cg, empty=run is not None and run.empty)
            _calls.discard(call)
            await _sweep_until_clean(trio.current_time() + KILL_GRACE)


def _spawn_error(prog: str, err: BaseException) -> str:
    if isinstance(err, OSError) and err.errno is not None:
        where = f" ({err.filename})" if err.filename not in (None, prog) else ""
        what = "not found" if err.errno == errno.ENOENT else err.strerror
        return f"cannot run {prog}: {what}{where}"
    return f"cannot run {prog}: {err}"
