"""Run one shell command for the daemon (prompt commands, hooks): bounded, and leaving nothing.

Prompt commands (``"prompt": ["git log -5"]``, ``!cmd`` lines) and hooks are the user's own
commands, run by the daemon itself, not by toolsrv: they are configuration, not model
output, so they run unsandboxed like a shell's rc file would. What they must not do is
hang a session or leave processes behind (SPEC 7: nothing may leak a process). So each
command runs as ``/bin/sh -c COMMAND``:

* in its own session and process group (``start_new_session``), so the whole tree it
  starts can be signalled at once;
* with exactly the environment it is given (`base_env` builds a clean one: never the
  daemon's keys or tokens);
* with its output captured up to ``cap`` bytes per stream; the rest is read and counted,
  never stored, so a chatty command neither blocks on a full pipe nor grows the daemon;
* for at most ``timeout`` seconds. Then its group gets SIGTERM, and whatever is still alive
  ``kill_grace`` seconds later gets SIGKILL — a grandchild that ignores SIGTERM included.

**The command ends when its shell exits.** Whatever it left running in its process group
(``sleep 100 &``) is SIGKILLed at that moment: a hook or prompt command is a function call,
not a way to start daemons. A command that really wants to leave something running must
detach it from the group (``setsid``) and from the pipes (redirect its output); such an
escapee is no longer tracked.

**Guarantee**: when `run_shell` returns (or is cancelled), the shell has been reaped and no
live process is left in its process group (a process stuck in uninterruptible sleep is
waited for `REAP_WAIT` seconds, then logged). The group is signalled while the shell is
still an unreaped zombie, so its pgid cannot have been reused by then.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

import trio

from olliefs.mounts import real_dir

log = logging.getLogger(__name__)

OUTPUT_CAP = 256 * 1024
"""Bytes of each stream kept by default; the rest is counted in ``*_cut``."""
KILL_GRACE = 1.0
"""Seconds between SIGTERM and SIGKILL when a command is stopped (timeout, cancel)."""
REAP_WAIT = 5.0
"""Seconds to wait for SIGKILLed processes to be gone (only D-state ones take long)."""
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"

# What a command inherits from the daemon's environment: what a login shell would have.
# Never OLLIE_*_KEY, *_API_KEY, *_TOKEN or URLs: commands get those only if the caller
# passes them on purpose.
_INHERITED = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM",
              "TMPDIR")  # fmt: skip


@dataclass(frozen=True)
class ShellResult:
    """How a command ended and what it printed.

    ``status`` is the shell's exit status, ``-N`` when a signal N ended it, None when it
    could not start (``error`` says why). ``timed_out``: the timeout stopped it (its
    ``status`` is then the signal that did). ``*_cut``: bytes beyond the cap, dropped.
    """

    status: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_cut: int = 0
    stderr_cut: int = 0
    timed_out: bool = False
    error: str = ""
    pid: int | None = None  # the shell's pid, which was also its process group's id

    def stderr_text(self) -> str:
        """Stderr as one stripped text for a message, saying how much of it was cut."""
        text = self.stderr.decode(errors="replace").strip()
        if self.stderr_cut:
            text += f" [{self.stderr_cut} more bytes of stderr cut]"
        return text


def base_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The clean environment commands start from: PATH, HOME, USER, LOGNAME, SHELL, LANG,
    LANGUAGE, LC_*, TZ, TERM and TMPDIR from ``environ`` (default: the daemon's), with a
    default PATH when it has none. Add the session's variables on top."""
    env = os.environ if environ is None else environ
    out = {k: v for k, v in env.items() if k in _INHERITED or k.startswith("LC_")}
    out.setdefault("PATH", DEFAULT_PATH)
    return out


class _Capture:
    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.buf = bytearray()
        self.cut = 0

    def add(self, chunk: bytes | bytearray) -> None:
        room = max(self.cap - len(self.buf), 0)
        self.buf += chunk[:room]
        self.cut += max(len(chunk) - room, 0)


async def run_shell(
    command: str,
    *,
    cwd: str,
    env: Mapping[str, str],
    stdin: bytes | None = None,
    timeout: float,
    cap: int = OUTPUT_CAP,
    kill_grace: float = KILL_GRACE,
) -> ShellResult:
    """Run ``/bin/sh -c command`` in ``cwd`` with exactly ``env``; see the module doc.

    ``stdin`` is written to the command's standard input, then closed (a command that
    does not read it is fine); None gives it /dev/null. Never raises for anything the
    command does; trio.Cancelled propagates after the cleanup.
    """
    try:
        # The child's chdir happens while this thread waits for its exec: a cwd inside
        # the daemon's own tree (a symlink changed since the cwd was checked, a journal
        # from before that check) would hang both. The real path is the one used.
        cwd = real_dir(cwd)
        proc = await trio.lowlevel.open_process(
            ["/bin/sh", "-c", command],
            stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=dict(env),
            start_new_session=True,
        )
    except OSError as err:
        return ShellResult(error=f"cannot run /bin/sh in {cwd}: {err.strerror or err}")
    pgid = proc.pid
    out, err_ = _Capture(cap), _Capture(cap)
    exited = False
    timed_out = False
    pidfd = _pidfd(pgid)
    try:
        with trio.move_on_after(timeout) as scope:
            async with trio.open_nursery() as nursery:
                if proc.stdin is not None:
                    nursery.start_soon(_feed, proc.stdin, stdin or b"")
                assert proc.stdout is not None and proc.stderr is not None
                nursery.start_soon(_drain, proc.stdout, out)
                nursery.start_soon(_drain, proc.stderr, err_)
                if pidfd is not None:
                    # Exited but not reaped: the zombie keeps the pgid ours while we kill.
                    await trio.lowlevel.wait_readable(pidfd)
                else:
                    await proc.wait()
                exited = True
                _killpg(pgid, signal.SIGKILL)  # what it left running in its group
        # Cancelled after the shell exited: an escapee held the pipes; not a timeout.
        timed_out = scope.cancelled_caught and not exited
    finally:
        with trio.CancelScope(shield=True):
            if not exited:
                await _stop(pgid, kill_grace)
            if pidfd is not None:
                trio.lowlevel.notify_closing(pidfd)
                os.close(pidfd)
            _killpg(pgid, signal.SIGKILL)
            await proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    await stream.aclose()
            if not await _wait_gone(pgid, trio.current_time() + REAP_WAIT):
                log.warning("command %r: processes still alive after SIGKILL", command)
    return ShellResult(
        status=proc.returncode,
        stdout=bytes(out.buf),
        stderr=bytes(err_.buf),
        stdout_cut=out.cut,
        stderr_cut=err_.cut,
        timed_out=timed_out,
        pid=pgid,
    )


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # kernels before 5.3: reap first, kill after
        return None


async def _feed(stream: trio.abc.SendStream, data: bytes) -> None:
    try:
        if data:
            await stream.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # it exited (or closed stdin) without reading everything: fine
    finally:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.aclose()


async def _drain(stream: trio.abc.ReceiveStream, capture: _Capture) -> None:
    while chunk := await stream.receive_some(65536):
        capture.add(chunk)


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def _stop(pgid: int, grace: float) -> None:
    """SIGTERM to the group; SIGKILL to whatever outlives ``grace`` seconds."""
    _killpg(pgid, signal.SIGTERM)
    await _wait_gone(pgid, trio.current_time() + grace)
    _killpg(pgid, signal.SIGKILL)


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group ``pgid``, by a /proc scan."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            found.append(int(entry))
    return found


async def _wait_gone(pgid: int, deadline: float) -> bool:
    """Wait until no live process is left in the group (zombies do not count: an unreaped
    shell is ours to reap, and orphans' zombies are init's); False at the deadline."""
    delay = 0.0005
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # a member changed uid: still there
            pass
        if not group_members(pgid):
            return True
        if trio.current_time() >= deadline:
            return False
        await trio.sleep(delay)
        delay = min(delay * 2, 0.05)
