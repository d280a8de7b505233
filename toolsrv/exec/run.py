"""`Executor`: runs tool calls to their end; all the exec state of one server."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import msgspec
import trio

from toolsrv import namespaces, sandbox
from toolsrv.checkpoint import Overlay
from toolsrv.exec import cgroup
from toolsrv.exec.capture import Watch, exit_fd, prefill
from toolsrv.exec.cgroup import Cgroup, CgroupBackend
from toolsrv.exec.reaper import CallRecord, Reaper
from toolsrv.exec.spawn import SetupError, Spare, Spawner, spawn_in_thread
from toolsrv.protect import ProtectedScan
from toolsrv.sandbox import Prepared, Profile

log = logging.getLogger(__name__)

KILL_GRACE = 5.0
"""Seconds to wait for SIGKILLed processes to be gone (only D-state ones take long)."""
DRAIN_GRACE = 0.5
"""Seconds to keep reading pipes once the tree is dead (an escapee may still hold them)."""


class ExecResult(msgspec.Struct):
    """What a call produced. ``error`` is set (and nothing else) when it could not start.

    ``*_dropped`` count the bytes read past ``Profile.max_output`` and discarded. `run`
    never returns ``cancelled=True``: a cancelled call raises trio.Cancelled, and the caller
    that cancelled it builds its own cancelled result. ``oom_killed``: processes of the call
    the kernel killed for going over ``memory_max`` (its cgroup's memory limit, in bytes).
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
    oom_killed: int = 0
    memory_max: int = 0


class Executor:
    """Runs tool calls; holds every piece of state that running them needs.

    One per server (``toolsrv.__main__`` makes it and hands it to the ToolServer); tests
    make their own. `start` makes this process the child subreaper of the tools (one
    executor at a time per process: the flag and the SIGCHLD handler are process-wide);
    `close` undoes it and removes the pooled cgroups.

    ``cgroups``: ``off``, ``v1``, ``v2`` or empty for the best available (see
    `cgroup.detect`); detected on first use. ``hide``: paths no tool may see (the daemon's
    config, state, data and run dirs, this server's socket), hidden in each call's mount
    namespace wherever the call's roots are; ``show``: paths inside them that tools may
    still read and execute (the user's tool scripts).
    The executor also owns the scan of protected entries (`ProtectedScan`) and the empty
    network namespace shared by calls without network.
    """

    def __init__(
        self, *, cgroups: str = "", hide: Sequence[str] = (), show: Sequence[str] = ()
    ) -> None:
        self._want_cgroups = cgroups
        self.hide = tuple(hide)
        self.show = tuple(show)
        self.scan = ProtectedScan()
        self.rulesets = sandbox.RulesetCache()
        self._scan_lock = trio.Lock()  # one scan at a time (ProtectedScan is not thread-safe)
        self._netns: int | None = None
        self._netns_known = False
        self._cgroups: CgroupBackend | None = None
        self._cgroups_known = False
        self.reaper = Reaper()
        self._spawner: Spawner | None = None
        self._core_off = False

    def start(self) -> None:
        """Become the subreaper of the tools. Where calls get cgroups, every process of
        a call is dead when it ends and the end reaps its zombies, so SIGCHLD needs no
        handler (a sweep on each tool's exit, and a wakeup of the loop through trio's
        signal socket, were several syscalls a call); without cgroups, escapees of a call
        may die later, and SIGCHLD sweeps them up."""
        self.reaper.start(sigchld=self.cgroups is None)

    def close(self) -> None:
        if self._spawner is not None:
            self._spawner.close()
        self.reaper.stop()
        if self._cgroups is not None:
            self._cgroups.close()
        self.scan.close()
        self.rulesets.close()
        if self._netns is not None:
            os.close(self._netns)
            self._netns, self._netns_known = None, False

    @property
    def netns(self) -> int | None:
        """The empty network namespace of calls without network (made on first use)."""
        if not self._netns_known:
            self._netns = namespaces.empty_netns()
            self._netns_known = True
        return self._netns

    @property
    def cgroups(self) -> CgroupBackend | None:
        if not self._cgroups_known:
            self._cgroups = cgroup.detect(self._want_cgroups)
            self._cgroups_known = True
            log.debug("cgroups: %s", self._cgroups.mode if self._cgroups else "none")
        return self._cgroups

    @property
    def cgroup_mode(self) -> str:
        """How calls are grouped, for logs: e.g. ``v1 pids (/sys/fs/cgroup/pids/toolsrv)``."""
        backend = self.cgroups
        return backend.mode if backend is not None else "none (process groups and RLIMIT_NPROC)"

    @property
    def spawner(self) -> Spawner:
        if self._spawner is None:
            self._spawner = Spawner(self.cgroups, mount_ns=namespaces.mount_namespaces())
        return self._spawner

    async def run(
        self,
        argv: list[str],
        *,
        stdin: bytes,
        cwd: str,
        env: dict[str, str],
        write_roots: list[str],
        tmp_dir: str,
        profile: Profile,
        timeout: float,
        capture: Overlay | None = None,
    ) -> ExecResult:
        """Run one tool call to its end and return what it did.

        The tool runs in its own session and process group with exactly ``env``, confined by
        ``profile`` (writable: ``write_roots``, ``tmp_dir`` and the profile's ``write``
        entries), for at most ``min(timeout, profile.timeout_cap)`` seconds. The call ends
        when the leader exits, at the timeout (``timed_out``), or when the awaiting task is
        cancelled (then trio.Cancelled propagates, after the cleanup).

        **Guarantee**: when this returns or raises, every process of the call has been sent
        SIGKILL and has exited (its cgroup is empty, or, without one, no live process is
        left in its process group) and the leader is reaped. Exceptions: a process stuck in
        uninterruptible sleep is waited for `KILL_GRACE` seconds, then logged; a process
        that left both the group and the cgroup (only possible without a cgroup) is killed
        by the reaper before this returns, unless a call that started earlier is still
        running (then by the sweep at that call's end).

        A tool that cannot start gives ``error``. Raises SandboxError when policy forbids
        running (Landlock missing and the profile is not ``unsandboxed``).
        """
        if not argv:
            return ExecResult(error="empty command")
        timeout = min(timeout, profile.timeout_cap)
        roots = [*write_roots, tmp_dir, *sandbox.expand_write(profile.write, env)]
        protect = None
        clean = None
        ids: namespaces.Ids = {}
        hidden = sandbox.Hidden()  # (an unsandboxed profile hides nothing)
        if not profile.unsandboxed:
            hidden = sandbox.resolve_hidden(self.hide, self.show, ids)
            for root in write_roots:
                real = namespaces.real_path(root, ids)
                inside = hidden.holding(real) if real is not None else None
                if inside is not None:
                    return ExecResult(
                        error=f"refused: the working directory {root} is inside {inside}, "
                        "which is hidden from tools"
                    )
        if not profile.unsandboxed and namespaces.mount_namespaces():
            lock = self._scan_lock
            try:
                lock.acquire_nowait()  # (async with would yield to the scheduler twice)
            except trio.WouldBlock:
                await lock.acquire()
            try:
                clean = sandbox.clean_roots(roots, ids, hidden)
                outer = sandbox.outer_roots(clean)
                protect = self.scan.quick(outer)
                if protect is None:
                    # In a worker thread: a root on a slow filesystem must not stall us.
                    protect = await trio.to_thread.run_sync(self.scan.find, outer)
            finally:
                lock.release()
        try:
            prepared = sandbox.prepare(
                profile,
                roots,
                protect=protect,
                hide=hidden,
                netns_fd=None if profile.network else self.netns,
                rulesets=self.rulesets if capture is None else None,
                clean=clean,
                ids=ids,
            )
        except (OSError, ValueError) as err:
            return ExecResult(error=f"sandbox setup failed: {err}")
        if prepared.mounts is not None:  # checkpoints: only a call in a namespace has one
            prepared.overlay = capture
        try:
            return await self._run(argv, stdin, cwd, env, prepared, profile, timeout)
        finally:
            prepared.close()

    async def _run(
        self,
        argv: list[str],
        stdin: bytes,
        cwd: str,
        env: dict[str, str],
        prepared: Prepared,
        profile: Profile,
        timeout: float,
    ) -> ExecResult:
        backend = self.cgroups
        spawner = self.spawner
        call = CallRecord()
        fds: list[int] = []  # ours until handed to the watch or closed
        watch: Watch | None = None
        cg: Cgroup | None = None
        run: _Run | None = None
        spare: Spare | None = None  # None once handed to in_fresh_thread
        oom_seen = False  # the cgroup's OOM kill count was read for this call
        try:
            ns_cache = spawner.mount_ns
            ns_key = pins = None
            if ns_cache is not None and prepared.mounts is not None:
                ns_key = ns_cache.key(prepared.mounts, prepared.ids)
                prepared.mount_ns_fd = ns_cache.get(ns_key)
                prepared.ns_serial = ns_cache.serial(ns_key)
                if prepared.mount_ns_fd is None:
                    pins = ns_cache.pin(ns_key)  # before the namespace is made
                    prepared.keep_ns = pins is not None
            spare = spawner.take_spare(prepared.key())
            for _ in range(3):
                fds.extend(os.pipe2(os.O_CLOEXEC))
            in_r, in_w, out_r, out_w, err_r, err_w = fds
            rest = prefill(in_w, stdin)
            if not rest:
                os.close(in_w)
                fds.remove(in_w)
            if backend is not None:
                try:
                    if spare is not None and spare.cg is not None:
                        cg = spare.cg  # joined ahead by the spare thread
                        backend.set_limit(cg, profile.max_procs, profile.memory_max)
                    else:
                        cg = backend.acquire(profile.max_procs, profile.memory_max)
                except OSError as err:
                    log.warning("cgroup for the call unavailable: %s", err.strerror)
            self.reaper.calls.add(call)
            thread, spare = spare, None
            capped = cg is not None and backend is not None and backend.limits
            mem_capped = cg is not None and cg.mem_path is not None
            try:
                proc = await spawner.in_fresh_thread(
                    partial(
                        spawn_in_thread,
                        argv=argv,
                        cwd=cwd,
                        env=env,
                        stdio=(in_r, out_w, err_w),
                        prepared=prepared,
                        cg=cg,
                        version=backend.version if backend else 0,
                        rlimits=self._rlimits(profile, capped, mem_capped),
                    ),
                    thread,
                )
            except SetupError as err:
                return ExecResult(error=f"sandbox setup failed: {err}")
            except (OSError, subprocess.SubprocessError, ValueError) as err:
                return ExecResult(error=_spawn_error(argv[0], err))
            except Exception as err:  # a failed spawn is a result, never the server's problem
                log.exception("spawning %s failed", argv[0])
                return ExecResult(error=_spawn_error(argv[0], err))
            finally:
                os.close(in_r)
                fds.remove(in_r)
                built = prepared.take_built_ns()
                if built is not None and ns_cache is not None:
                    ns_cache.put(ns_key, built, pins)
                    pins = None
                    # Kept now: the next call like this one joins it, and so can a spare.
                    prepared.mount_ns_fd = ns_cache.get(ns_key)
                    prepared.ns_serial = ns_cache.serial(ns_key)
                for pin in pins or ():
                    os.close(pin)
            call.pid = proc.pid
            run = _Run(self.reaper, proc, exit_fd(proc.pid), cg, backend)
            assert run.exit_fd is not None
            watch = Watch(
                out_r,
                err_r,
                in_w if rest else None,
                rest,
                run.exit_fd,
                profile.max_output,
                held=(out_w, err_w),
            )
            for fd in (out_r, err_r, out_w, err_w, *([in_w] if rest else [])):
                fds.remove(fd)
            spawner.prestart(profile.max_procs, prepared)
            with trio.move_on_after(timeout) as deadline:
                await watch.pump(until_exit=True)
            run.exited = watch.exited
            watch.forget_exit()
            await run.end()
            watch.release()
            watch.drain()
            if watch.readers:  # a process that left the call still holds a pipe
                with trio.move_on_after(DRAIN_GRACE):
                    await watch.pump(until_exit=False)
            rc = proc.returncode
            assert rc is not None
            oom = cg.new_oom_kills() if mem_capped and cg is not None else 0
            oom_seen = True
            if oom:
                log.info("call %s: %d process(es) killed at the memory limit", argv[0], oom)
            return ExecResult(
                exit_code=rc if rc >= 0 else None,
                signal=-rc if rc < 0 else None,
                stdout=bytes(watch.out.buf),
                stderr=bytes(watch.err.buf),
                stdout_dropped=watch.out.dropped,
                stderr_dropped=watch.err.dropped,
                timed_out=deadline.cancelled_caught,
                oom_killed=oom,
                memory_max=profile.memory_max,
            )
        finally:
            if spare is not None:  # taken but not handed a job: it keeps its cgroup
                if cg is spare.cg:
                    cg = None
                spawner.return_spare(spare)
            with trio.CancelScope(shield=True):
                if run is not None:
                    await run.end()
                if watch is not None:
                    watch.close()
                for fd in fds:
                    os.close(fd)
                empty = run is not None and run.empty
                if cg is not None and run is not None and not oom_seen:
                    cg.new_oom_kills()  # (not this call's: the next one counts from here)
                if cg is not None and backend is not None:
                    backend.release(cg, empty=empty)
                self.reaper.calls.discard(call)
                # A call whose cgroup was seen empty left no live process (a cgroup holds
                # setsid escapees too); the processes killed at its end (stragglers) may
                # still be on their way to being zombies of ours: the sweep waits for
                # them. Otherwise zombies only, and `orphans` sees them.
                stragglers = run is not None and run.stragglers
                if not empty or stragglers or self.reaper.orphans():
                    await self.reaper.sweep_until_clean(trio.current_time() + KILL_GRACE)

    def _rlimits(
        self, profile: Profile, capped: bool, mem_capped: bool = False
    ) -> list[tuple[int, int]]:
        """The limits a call's leader must start with (see `spawn_in_thread`).

        RLIMIT_CORE is set to 0 once on the server itself (soft limit), which every tool
        inherits at no cost per call. RLIMIT_AS is ``max_memory``. RLIMIT_DATA is
        ``memory_max`` where no memory cgroup caps the call: per process, and only what a
        process writes to (heap, anonymous writable mappings), not the address space it
        reserves, which the JVM, V8 and Go reserve by the gigabyte without using it (under
        RLIMIT_AS of a few GiB they do not start). RLIMIT_NPROC is only the
        fallback when no pids cgroup caps the call. It counts every process of the user, not
        of the call, so it is set to what runs now plus max_procs: the tool gets at most that
        many more. Root (uid 0) is exempt from RLIMIT_NPROC whatever its capabilities
        (kernel: ``real_cred->user != INIT_USER``), so for root it is not set, and without a
        pids cgroup a root tool has no process cap: the timeout and the group kill still end
        a fork bomb.
        """
        if not self._core_off:
            with contextlib.suppress(OSError, ValueError):
                resource.setrlimit(
                    resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1])
                )
            self._core_off = True
        wanted: list[tuple[int, int]] = []
        if profile.max_memory:
            wanted.append((resource.RLIMIT_AS, profile.max_memory))
        if profile.memory_max and not mem_capped:
            wanted.append((resource.RLIMIT_DATA, profile.memory_max))
        if not capped:
            if os.geteuid() == 0:
                sandbox.warn_once(
                    "nproc", "no pids cgroup: tools running as root have no process cap"
                )
            else:
                wanted.append((resource.RLIMIT_NPROC, _total_tasks() + profile.max_procs))
        limits: list[tuple[int, int]] = []
        for res, value in wanted:
            hard = resource.getrlimit(res)[1]  # the tool inherits ours: it cannot go above
            limits.append((res, value if hard == resource.RLIM_INFINITY else min(value, hard)))
        return limits


def _total_tasks() -> int:
    """All tasks on the machine (/proc/loadavg): the RLIMIT_NPROC fallback's baseline."""
    try:
        return int(cgroup.read_file("/proc/loadavg").split()[3].split("/")[1])
    except (OSError, ValueError, IndexError):
        return 4096


@dataclass(eq=False)
class _Run:
    """One call's live state, so the end can run from the normal path or a cancellation."""

    reaper: Reaper
    proc: subprocess.Popen[bytes]
    exit_fd: int | None
    cg: Cgroup | None
    backend: CgroupBackend | None
    exited: bool = False  # the leader has exited (not yet reaped)
    ended: bool = False
    empty: bool = False  # the call's cgroup was seen empty at the end
    stragglers: bool = False  # processes other than the leader were killed at the end

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
                    trio.lowlevel.notify_closing(self.exit_fd)  # (trio knows it only then)
                os.close(self.exit_fd)
                self.exit_fd = None
            self.proc.wait()
            deadline = trio.current_time() + KILL_GRACE
            if self.cg is not None and self.backend is not None:
                gone, self.stragglers = await self.backend.wait_empty(self.cg, deadline)
                self.empty = gone
            else:
                gone = await self.reaper.wait_group_gone(pid, deadline)
            if not gone:
                log.warning("tool %d: processes still alive %gs after SIGKILL", pid, KILL_GRACE)


def _spawn_error(prog: str, err: BaseException) -> str:
    if isinstance(err, OSError) and err.errno is not None:
        where = f" ({err.filename})" if err.filename not in (None, prog) else ""
        what = "not found" if err.errno == errno.ENOENT else err.strerror
        return f"cannot run {prog}: {what}{where}"
    return f"cannot run {prog}: {err}"
