"""The daemon: one trio program that serves the FUSE mount and runs every session.

Start-up order matters: sessions are restored before the mount appears (so the first
``ls`` already sees them), the 9P export (``--9p``, ``olliefs.fs.export9p``) listens before
it too, and readiness is reported only once a ``stat`` through the mount has been
answered, so ``ollie mount`` returns when the tree is usable.

Shutdown (SIGTERM, SIGINT, or an external ``fusermount3 -u``) closes every log first so that
blocked readers return EOF, then ends the FUSE loop and unmounts; journals are fsync'd as
sessions close.
"""

from __future__ import annotations

import fcntl
import functools
import gc
import logging
import os
import resource
import signal
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import pyfuse3
import trio

from olliefs.fs import patched, spec
from olliefs.fs.fuse import Operations, mount_options
from olliefs.fs.nodes import Node, Waiters
from olliefs.session.registry import Registry
from olliefs.session.session import Session
from olliefs.settings import Paths

if TYPE_CHECKING:
    from olliefs.cli import Exports

log = logging.getLogger(__name__)


class DaemonError(Exception):
    pass


def task_counts() -> tuple[int, int]:
    """(every trio task of this run, the pyfuse3 workers among them).

    Reported on SIGUSR1 so that load tests can check nothing leaked: after a storm of
    interrupted readers the count must come back to where it was. pyfuse3 grows its worker
    pool while requests block and lets idle workers go after the storm, so the workers are
    counted apart (their number settles, it does not return to an exact figure).
    """
    total = workers = 0
    root = trio.lowlevel.current_root_task()
    todo = [root] if root is not None else []
    while todo:
        task = todo.pop()
        total += 1
        workers += task.name.startswith("pyfuse-")
        todo += [t for n in task.child_nurseries for t in n.child_tasks]
    return total, workers


class Collector:
    """The cyclic garbage collector, kept away from what the daemon restored.

    A thousand restored sessions are some 160,000 objects that every full collection
    walks: 70 ms on a quiet machine, 300 to 600 ms on a busy one, in the middle of
    someone's ``cat`` (and, right after a restore, of the mount's first listing). So
    the restore runs without the collector, and what it restored is then frozen
    (``gc.freeze()``: the permanent generation, which no collection walks; no
    collection first, which would hold the mount back as long).

    Sessions made while the daemon runs are frozen too, as each starts: a thousand
    sessions made through ``s/new`` left every full collection walking them all, a
    fifth of the daemon's time while they streamed.

    Frozen objects are freed by reference counting only, and a killed session sits in
    reference cycles. So the first kill of a frozen session unfreezes everything (the
    collector manages it all again, as if nothing had been frozen), and a collection
    is run a moment later (``SETTLE``, doubling up to ``SETTLE_MAX`` while a killed
    session is still held somewhere, as by a file kept open); once every killed
    session is freed, what lives is frozen again. A killed session is never frozen.
    """

    SETTLE = 1.0
    SETTLE_MAX = 60.0

    def __init__(self, reg: Registry, ops: Operations, nursery: trio.Nursery) -> None:
        self._reg = reg
        self._ops = ops
        self._nursery = nursery
        self._frozen: weakref.WeakSet[Session] = weakref.WeakSet()
        self._killed: weakref.WeakSet[Session] = weakref.WeakSet()  # not freed yet
        self._settling = False
        self.refreezes = 0  # for tests and the bench (the SIGUSR1 line)
        reg.on_kill.append(self._kill)
        reg.on_start.append(self._made_one)

    def freeze(self) -> None:
        gc.freeze()
        self._frozen = weakref.WeakSet(self._reg.sessions.values())

    @property
    def frozen(self) -> int:
        return gc.get_freeze_count()

    def _kill(self, s: Session) -> None:
        self._killed.add(s)
        if s in self._frozen:
            gc.unfreeze()
            self._frozen = weakref.WeakSet()
            if not self._settling:
                self._settling = True
                self._nursery.start_soon(self._settle)

    def _made_one(self, s: Session) -> None:
        # gc.freeze() itself is cheap (the generations are moved, not walked). A killed
        # session still held must not be frozen (it would never be freed): while one
        # is, the settling's freeze takes the new session along.
        if not self._settling and not self._killed:
            gc.freeze()
            self._frozen.add(s)

    async def _settle(self) -> None:
        delay = self.SETTLE
        try:
            while True:
                await trio.sleep(delay)
                self._ops.drop_stale_listings()
                gc.collect()
                if not self._killed:
                    break
                delay = min(delay * 2, self.SETTLE_MAX)
            self.refreezes += 1
            self.freeze()
        finally:
            self._settling = False


def lock_state(paths: Paths) -> int:
    """One daemon per state dir: two would interleave the same journals."""
    fd = os.open(paths.lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DaemonError(f"another ollie daemon is using {paths.state}") from None
    return fd


def check_pyfuse3() -> None:
    """Say once what the installed pyfuse3 lacks of olliefs's patches (.ci/pyfuse3/) and
    what the daemon does without it (``olliefs.fs.patched``; ``ollie doctor`` says the
    same). A stock pyfuse3 mounts and serves: blocked reads of readers that did not
    open the file cannot be interrupted, and the rest is slower."""
    found = patched.gaps()
    if found:
        log.warning(
            "pyfuse3 %s lacks olliefs's patches (%s builds them): %s",
            patched.build() or "(version unknown)",
            patched.FIX,
            patched.summary(found),
        )


def raise_descriptor_limit() -> None:
    """Take the hard limit of open descriptors as the soft one.

    The daemon holds a descriptor per session (its journal), per open handle of the
    tree and per blocked read's log, per provider connection: a thousand sessions
    passed the soft limit most systems start a process with (1,024), and the next
    s/new failed with EMFILE. The hard limit is what the system allows this process;
    select() is never used here, so no descriptor is too high to use.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as err:  # an infinite hard limit some kernels refuse
            log.warning("open descriptors stay limited to %d: %s", soft, err)


async def serve(
    mountpoint: str,
    paths: Paths,
    settings: Mapping[str, str],
    ready: Callable[[], None] | None = None,
    exports: Exports | None = None,
) -> None:
    """Serve until stopped. A ``DaemonError`` raised inside the daemon's nursery comes
    out of it wrapped in an ExceptionGroup (trio's strict groups); it is unwrapped here,
    so the caller reports its one line instead of a traceback."""
    try:
        await _serve(mountpoint, paths, settings, ready, exports)
    except BaseExceptionGroup as group:
        found, rest = group.split(DaemonError)
        if found is None or rest is not None:
            raise
        raise _first(found) from None


def _first(group: BaseExceptionGroup[DaemonError]) -> DaemonError:
    first = group.exceptions[0]
    return first if isinstance(first, DaemonError) else _first(first)


async def _serve(
    mountpoint: str,
    paths: Paths,
    settings: Mapping[str, str],
    ready: Callable[[], None] | None,
    exports: Exports | None,
) -> None:
    check_pyfuse3()
    raise_descriptor_limit()
    max_waiters = int(settings.get("OLLIE_MAX_WAITERS") or 4096)
    async with trio.open_nursery() as nursery:
        reg = Registry(paths, settings, mountpoint, nursery)
        reg.restore()
        ops = Operations(spec.root(reg), max_waiters)
        collector = Collector(reg, ops, nursery)
        collector.freeze()

        def forget(d: Node, name: str) -> None:
            # A name removed or renamed over 9P: without this the kernel would show it
            # on the mount until its entry timeout. Asynchronous (a request may be in
            # flight on it); ENOENT means the kernel never looked it up.
            ino = ops._ino.get(d.key)  # the inode FUSE gave this directory, if any
            if ino is not None:
                pyfuse3.invalidate_entry_async(ino, name.encode(), ignore_enoent=True)

        bound: list[str] = []
        if exports is not None:
            from olliefs.fs import export9p  # only with --9p: a mount without it waits less

            # The same root node serves both frontends. Listening before the mount
            # appears: once ``ollie mount`` says ready, 9P clients can connect too.
            export = export9p.Export(
                ops.root,
                Waiters(max_waiters),
                exports.key,
                forget=forget,
                peers_file=paths.run / "9p-peers",
            )
            try:
                bound = await nursery.start(
                    functools.partial(export9p.serve, tls_config=paths.config),
                    export,
                    exports.addresses,
                )
            except export9p.AddressError as err:
                with trio.CancelScope(shield=True):
                    await reg.aclose()
                raise DaemonError(str(err)) from None
        try:
            # Before the mount: a pid file the disk refuses (full) is a clean refusal to
            # start, not a mount that dies as soon as it appeared.
            # Then the 9P exports as bound (a TCP port 0 is the port the kernel chose), for
            # ``ollie mount`` and ``ollie status`` to show.
            extra = "".join(f"9p {b}\n" for b in bound)
            paths.pid_file.write_text(f"{os.getpid()}\n{mountpoint}\n{extra}")
        except OSError as err:
            paths.pid_file.unlink(missing_ok=True)
            with trio.CancelScope(shield=True):
                await reg.aclose()
            raise DaemonError(f"cannot write {paths.pid_file}: {err.strerror}") from None
        try:
            pyfuse3.init(ops, mountpoint, mount_options())
        except RuntimeError as err:
            paths.pid_file.unlink(missing_ok=True)
            raise DaemonError(f"cannot mount {mountpoint}: {err}") from None

        async def stop_on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
                async for sig in sigs:
                    log.info("signal %d: unmounting", sig)
                    await reg.aclose()
                    pyfuse3.terminate()
                    return

        async def report_ready() -> None:
            try:
                await trio.to_thread.run_sync(os.stat, os.path.join(mountpoint, "s"))
            except OSError as err:  # stopped before it was ever ready
                log.info("not ready: %s", err)
                return
            log.info("mounted at %s", mountpoint)
            if ready:
                ready()

        async def report_on_usr1() -> None:
            with trio.open_signal_receiver(signal.SIGUSR1) as sigs:
                async for _ in sigs:
                    total, workers = task_counts()
                    fds = len(os.listdir("/proc/self/fd"))
                    log.info(
                        "debug: %d trio tasks, %d pyfuse3 workers, %d parked reads,"
                        " %d fds, %d inodes,"
                        " %d sessions alive, %d refreezes, %d frozen, %d collections",
                        total,
                        workers,
                        ops.parked_reads,
                        fds,
                        ops.known_inodes,
                        len(reg.alive),
                        collector.refreezes,
                        collector.frozen,
                        sum(g["collections"] for g in gc.get_stats()),
                    )

        nursery.start_soon(stop_on_signal)
        nursery.start_soon(report_on_usr1)
        nursery.start_soon(report_ready)
        try:
            await pyfuse3.main(min_tasks=4, max_tasks=max_waiters + 256)
        finally:
            with trio.CancelScope(shield=True):
                await reg.aclose()
            ops.close()
            pyfuse3.close(unmount=True)
            try:
                paths.pid_file.unlink()
            except FileNotFoundError:
                pass
            nursery.cancel_scope.cancel()
