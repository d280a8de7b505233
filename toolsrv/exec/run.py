"""`Executor`: runs tool calls to their end; all the exec state of one server."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import signal
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
        clean: list[str] | None = None
        protect: list[str] | None = None
        if not profile.unsandboxed and namespaces.mount_namespaces():
            clean = sandbox.clean_roots(roots, ids, hidden)
            protect = await self._protected(sandbox.outer_roots(clean))
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
        with contextlib.closing(prepared):
            return await self._run(argv, stdin, cwd, env, prepared, profile, timeout)

    async def _protected(self, outer: list[str]) -> list[str]:
        """The protected entries beneath ``outer`` (`ProtectedScan`), one scan at a time."""
        lock = self._scan_lock
        try:
            lock.acquire_nowait()  # (async with would yield to the scheduler twice)
        except trio.WouldBlock:
            await lock.acquire()
        try:
            protect = self.scan.quick(outer)
            if protect is None:
                # In a worker thread: a root on a slow filesystem must not stall us.
                protect = await trio.to_thread.run_sync(self.scan.find, outer)
            return protect
        finally:
            lock.release()

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
        """Spawn the call into ``prepared`` and watch it to its end.

        Each resource goes on ``stack`` the moment it is ours, so that whatever ends the
        call (a failed spawn, the timeout, a cancellation, a bug) gives everything back in
        the reverse order: the watch with its pipes, the processes (killed, reaped), the
        call's entry in the reaper, its cgroup, the pipes not handed on, the namespace
        pins, and last the sweep that `run`'s guarantee rests on. Only a spare thread
        taken but never handed a job goes back first (`_give_back`).
        """
        spawner = self.spawner
        run = _Run(self.reaper, self.cgroups)
        # [None]: it does not swallow exceptions (typeshed has to assume it could).
        async with contextlib.AsyncExitStack[None]() as stack:
            stack.push_async_callback(run.sweep)
            ns = _MountNs(spawner.mount_ns, prepared)
            stack.callback(ns.close)
            in_r, in_w = _pipe(stack)
            out_r, out_w = _pipe(stack)
            err_r, err_w = _pipe(stack)
            rest = prefill(in_w.fd, stdin)
            if not rest:
                in_w.close()
            with contextlib.ExitStack() as unused:
                spare = spawner.take_spare(prepared.key())
                if spare is not None:
                    unused.callback(self._give_back, spare, run)
                run.cg = self._cgroup(spare, profile)
                stack.callback(run.release_cgroup)
                job = self._spawn_job(
                    argv, cwd, env, (in_r.fd, out_w.fd, err_w.fd), run, prepared, profile
                )
                self.reaper.calls.add(run.record)
                stack.callback(self.reaper.calls.discard, run.record)
                unused.pop_all()  # from here the spare is the spawn's
            try:
                proc = await spawner.in_fresh_thread(job, spare)
            except SetupError as err:
                return ExecResult(error=f"sandbox setup failed: {err}")
            except (OSError, subprocess.SubprocessError, ValueError) as err:
                return ExecResult(error=_spawn_error(argv[0], err))
            except Exception as err:  # a failed spawn is a result, never the server's problem
                log.exception("spawning %s failed", argv[0])
                return ExecResult(error=_spawn_error(argv[0], err))
            finally:
                in_r.close()  # the tool's now (and stdin's EOF comes with in_w's close)
                ns.keep()
            run.started(proc)
            stack.push_async_callback(run.end)
            run.exit_fd = exit_fd(proc.pid)
            watch = Watch(
                out_r.fd,
                err_r.fd,
                in_w.fd if rest else None,
                rest,
                run.exit_fd,
                profile.max_output,
                held=(out_w.fd, err_w.fd),
            )
            stack.callback(watch.close)
            for fd in (out_r, err_r, out_w, err_w, in_w):
                fd.take()  # the watch's now
            spawner.prestart(profile.max_procs, prepared, profile.memory_max)
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
            oom = run.oom_kills()
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

    def _cgroup(self, spare: Spare | None, profile: Profile) -> Cgroup | None:
        """The call's cgroup: the one its spare thread joined ahead, else one of the pool.
        Without one the call still runs (process groups and RLIMIT_NPROC instead)."""
        backend = self.cgroups
        if backend is None:
            return None
        cg = spare.cg if spare is not None else None
        try:
            if cg is not None:
                backend.set_limit(cg, profile.max_procs, profile.memory_max)
            else:
                cg = backend.acquire(profile.max_procs, profile.memory_max)
        except OSError as err:
            log.warning("cgroup for the call unavailable: %s", err.strerror)
        return cg

    def _give_back(self, spare: Spare, run: _Run) -> None:
        """A spare taken but not handed a job keeps its cgroup, for the next call."""
        if run.cg is spare.cg:
            run.cg = None
        self.spawner.return_spare(spare)

    def _spawn_job(
        self,
        argv: list[str],
        cwd: str,
        env: dict[str, str],
        stdio: tuple[int, int, int],
        run: _Run,
        prepared: Prepared,
        profile: Profile,
    ) -> Callable[[Spare], subprocess.Popen[bytes]]:
        """What the spawning thread runs (`spawn_in_thread`) for this call."""
        backend, cg = run.backend, run.cg
        capped = cg is not None and backend is not None and backend.limits
        mem_capped = cg is not None and cg.mem_path is not None
        return partial(
            spawn_in_thread,
            argv=argv,
            cwd=cwd,
            env=env,
            stdio=stdio,
            prepared=prepared,
            cg=cg,
            version=backend.version if backend else 0,
            rlimits=self._rlimits(profile, capped, mem_capped),
        )

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
    """One call's processes and cgroup, so that its end runs the same from the normal path,
    a failure or a cancellation (`Executor._run` registers each step when it is due)."""

    reaper: Reaper
    backend: CgroupBackend | None
    record: CallRecord = field(default_factory=CallRecord)
    cg: Cgroup | None = None
    proc: subprocess.Popen[bytes] | None = None
    exit_fd: int | None = None
    exited: bool = False  # the leader has exited (not yet reaped)
    ended: bool = False
    empty: bool = False  # the call's cgroup was seen empty at the end
    stragglers: bool = False  # processes other than the leader were killed at the end
    oom_seen: bool = False  # the cgroup's OOM kill count was read for this call

    def started(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.record.pid = proc.pid

    async def end(self) -> None:
        """Kill everything of the call, reap the leader, wait until the rest is gone."""
        if self.ended or self.proc is None:
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

    def oom_kills(self) -> int:
        """Processes of the call the kernel killed at its memory limit."""
        self.oom_seen = True
        if self.cg is None or self.cg.mem_path is None:
            return 0
        return self.cg.new_oom_kills()

    def release_cgroup(self) -> None:
        """Give the cgroup back to the pool (or remove it), once the call is over."""
        if self.cg is None or self.backend is None:
            return
        if self.proc is not None and not self.oom_seen:
            self.cg.new_oom_kills()  # (not this call's: the next one counts from here)
        self.backend.release(self.cg, empty=self.empty)

    async def sweep(self) -> None:
        """The last step of every call. A call whose cgroup was seen empty left no live
        process (a cgroup holds setsid escapees too); the processes killed at its end
        (stragglers) may still be on their way to being zombies of ours: the sweep waits
        for them. Otherwise zombies only, and `Reaper.orphans` sees them."""
        with trio.CancelScope(shield=True):
            if not self.empty or self.stragglers or self.reaper.orphans():
                await self.reaper.sweep_until_clean(trio.current_time() + KILL_GRACE)


class _MountNs:
    """The kept mount namespace a call joins; or, where none is kept yet, the pins that let
    the one its spawn makes be kept (`MountNsCache`), closed at the end unless kept."""

    def __init__(self, cache: namespaces.MountNsCache | None, prepared: Prepared) -> None:
        self.cache = cache
        self.prepared = prepared
        self.key: namespaces.NsKey | None = None
        self.pins: list[int] | None = None
        if cache is not None and prepared.mounts is not None:
            self.key = cache.key(prepared.mounts, prepared.ids)
            self._join()
            if prepared.mount_ns_fd is None:
                self.pins = cache.pin(self.key)  # before the namespace is made
                prepared.keep_ns = self.pins is not None

    def _join(self) -> None:
        assert self.cache is not None
        self.prepared.join_kept_ns(self.cache.get(self.key), self.cache.serial(self.key))

    def keep(self) -> None:
        """After the spawn: keep the namespace it made (with the pins). The next call like
        this one joins it, and so can a spare started for it."""
        built = self.prepared.take_built_ns()
        if built is not None and self.cache is not None:
            pins, self.pins = self.pins, None
            self.cache.put(self.key, built, pins)
            self._join()

    def close(self) -> None:
        pins, self.pins = self.pins or [], None
        for pin in pins:
            os.close(pin)


class _Fd:
    """A descriptor of the call's: closed at its end unless closed early or handed on."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def take(self) -> int:
        """Hand the descriptor on: whoever takes it closes it."""
        fd, self.fd = self.fd, -1
        return fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.take())


def _pipe(stack: contextlib.AsyncExitStack[None]) -> tuple[_Fd, _Fd]:
    """A pipe (read end, write end) whose ends ``stack`` closes unless they are taken."""
    r, w = (_Fd(fd) for fd in os.pipe2(os.O_CLOEXEC))
    stack.callback(r.close)
    stack.callback(w.close)
    return r, w


def _spawn_error(prog: str, err: BaseException) -> str:
    if isinstance(err, OSError) and err.errno is not None:
        where = f" ({err.filename})" if err.filename not in (None, prog) else ""
        what = "not found" if err.errno == errno.ENOENT else err.strerror
        return f"cannot run {prog}: {what}{where}"
    return f"cannot run {prog}: {err}"
