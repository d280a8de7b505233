"""A toolsrv on another host, reached over ssh: ``toolsrv=ssh:[user@]host[:dir]``.

ssh is the transport and the authentication: the daemon runs ``ssh HOST toolsrv --stdio``
(the remote command is the setting ``OLLIE_SSH_TOOLSRV``, the local ssh command line
``OLLIE_SSH``, split like a shell would, so ``ssh -F FILE`` or ``ssh -p 2222`` work), hands
it a fresh master key on the pipe, waits for ``ready`` and speaks 9P2000 over the ssh
process's stdin/stdout. There is one such connection per destination, shared by every
session that names it: each session's agent attaches on it with its own uname and secret,
as over the local socket.

When the connection drops (the host rebooted, the network went, ssh was killed) the calls
in flight are answered as tool errors (`client.CUT`), and the next use starts a new ssh.
What cannot start is said plainly, naming what is missing: no ssh on this machine, the host
unreachable or refusing the key (ssh's own last line), or no ``toolsrv`` on the remote
PATH.

``:dir`` is the directory the session's tools work in on that host (their cwd and write
root); without it, the session's own cwd is used as the same path there.
"""

from __future__ import annotations

import logging
import os
import secrets
import shlex
import subprocess
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

from ninep import NinePError
from ninep.client import Client, ConnectionLost
from olliefs.toolclient.client import ToolsrvConn, ToolsrvError
from olliewire import agent_secret

log = logging.getLogger(__name__)

START_TIMEOUT = 60.0  # ssh's own ConnectTimeout applies within it; this bounds a hung login
_STDERR_KEPT = 4096
STATUS_FILE = "remotes"  # in the run dir: one line per remote toolsrv (``ollie status``)


@dataclass(frozen=True)
class SshTarget:
    """``ssh:[user@]host[:dir]`` parsed: ``dest`` as ssh takes it, ``dir`` or ""."""

    dest: str
    dir: str = ""

    def __str__(self) -> str:
        return f"ssh:{self.dest}:{self.dir}" if self.dir else f"ssh:{self.dest}"


def parse_toolsrv(value: str) -> SshTarget | None:
    """None for ``local`` (or empty); an ``SshTarget`` for ``ssh:...``; ValueError else."""
    if value in ("", "local"):
        return None
    if not value.startswith("ssh:"):
        raise ValueError(f"toolsrv: expected local or ssh:[user@]host[:dir], got {value!r}")
    rest = value[len("ssh:") :]
    dest, _, path = rest.partition(":")
    user, _, host = dest.rpartition("@")
    if not host or any(c.isspace() or c in "/'\"\\;&|$`" for c in dest) or dest.startswith("-"):
        raise ValueError(f"toolsrv: not a [user@]host: {dest!r}")
    if "@" in user:
        raise ValueError(f"toolsrv: not a [user@]host: {dest!r}")
    if path and not path.startswith("/"):
        raise ValueError(f"toolsrv: the remote dir must be absolute: {path!r}")
    if any(ord(c) < 32 for c in path):
        raise ValueError("toolsrv: control bytes in the remote dir")
    return SshTarget(dest, path.rstrip("/") or ("/" if path else ""))


def ssh_argv(dest: str, settings: Mapping[str, str], *args: str) -> list[str]:
    """``ssh ... DEST -- <remote toolsrv> ARGS``: the command line of every use of a host
    (``OLLIE_SSH`` is split as a shell would; ``OLLIE_SSH_TOOLSRV`` names the remote
    command)."""
    ssh = shlex.split(settings.get("OLLIE_SSH") or "ssh")
    remote = settings.get("OLLIE_SSH_TOOLSRV") or "toolsrv"
    # BatchMode: a daemon has nobody to type a password or accept a host key for.
    return [*ssh, "-T", "-o", "BatchMode=yes", dest, "--", " ".join([remote, *args])]


def why_failed(
    dest: str, settings: Mapping[str, str], code: int | None, err: bytes, line: bytes
) -> str:
    """What is missing, from how ``ssh DEST toolsrv ...`` ended: ssh's exit 255 is ssh's
    own failure (host, network, key), 127 the remote shell's "not found"."""
    text = err.decode(errors="replace").strip()
    last = text.splitlines()[-1] if text else ""
    remote = settings.get("OLLIE_SSH_TOOLSRV") or "toolsrv"
    if code == 255:
        return f"ssh cannot reach {dest}: {last or 'ssh exited with 255'}"
    if code == 127 or "command not found" in text or "No such file" in last:
        return f"no {remote} on the PATH of {dest} (install olliefs there): {last}"
    if line:
        return f"{remote} on {dest} said {line[:200]!r} instead of ready"
    return f"{remote} on {dest} did not start (exit {code}): {last}"


class SshToolsrv:
    """The daemon's connection to the toolsrv of one ssh destination."""

    def __init__(
        self,
        target: SshTarget,
        settings: Mapping[str, str],
        nursery: trio.Nursery,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.on_change = on_change
        self.target = target
        self.dest = target.dest
        self.settings = settings
        self._nursery = nursery
        self._lock = trio.Lock()
        self._client: Client | None = None
        self._proc: trio.Process | None = None
        self._key = b""
        self._stop: trio.Event | None = None
        self.connects = 0
        self._closing = False
        self.last_error = ""
        self.remote = True

    @property
    def alive(self) -> bool:
        return self._client is not None and self._client.lost is None

    def argv(self) -> list[str]:
        return ssh_argv(self.dest, self.settings, "--stdio")

    async def _ensure(self) -> tuple[Client, bytes]:
        async with self._lock:
            if self._client is None or self._client.lost is not None:
                await self._start()
            assert self._client is not None
            return self._client, self._key

    async def _start(self) -> None:
        argv = self.argv()
        key = secrets.token_bytes(32)
        try:
            proc = await trio.lowlevel.open_process(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except FileNotFoundError:
            self.last_error = (
                f"no ssh on this machine ({argv[0]} not found): install openssh-client"
            )
            raise ToolsrvError(f"toolsrv {self.target}: {self.last_error}") from None
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        err = bytearray()
        stop = trio.Event()
        self._nursery.start_soon(self._stderr, proc.stderr, err)
        try:
            await proc.stdin.send_all(key.hex().encode() + b"\n")
        except trio.BrokenResourceError:
            pass  # ssh already gone: the read below says why
        line = b""
        with trio.move_on_after(START_TIMEOUT):
            while not line.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(1)  # not a byte of 9P beyond it
                if not chunk:
                    break
                line += chunk
        if line != b"ready\n":
            if proc.returncode is None and not line:
                with trio.move_on_after(5):
                    await proc.wait()
            if proc.returncode is None:
                proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()
            self.last_error = self._why(proc.returncode, bytes(err), line)
            log.warning("toolsrv %s: %s", self.target, self.last_error)
            self.on_change()
            raise ToolsrvError(f"toolsrv {self.target}: {self.last_error}")
        stream = trio.StapledStream(proc.stdin, proc.stdout)
        self._proc, self._key, self._stop = proc, key, stop
        self._client = await self._nursery.start(self._hold, proc, stream, stop)
        self.connects += 1
        self.last_error = ""
        log.info("toolsrv %s: connected (ssh pid %d)", self.target, proc.pid)
        self.on_change()

    def _why(self, code: int | None, err: bytes, line: bytes) -> str:
        return why_failed(self.dest, self.settings, code, err, line)

    async def _stderr(self, pipe: trio.abc.ReceiveStream, kept: bytearray) -> None:
        """ssh's and the remote toolsrv's stderr: logged line by line, the end kept for
        the error that names why a start failed."""
        pending = b""
        async for chunk in pipe:
            kept += chunk
            del kept[:-_STDERR_KEPT]
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for one in lines:
                log.info("toolsrv %s: %s", self.target, one.decode(errors="replace"))

    async def _hold(
        self,
        proc: trio.Process,
        stream: trio.StapledStream[trio.abc.SendStream, trio.abc.ReceiveStream],
        stop: trio.Event,
        task_status: trio.TaskStatus[Client],
    ) -> None:
        try:
            async with Client.connect(stream) as client:
                task_status.started(client)
                async with trio.open_nursery() as n:

                    async def gone() -> None:
                        await proc.wait()
                        n.cancel_scope.cancel()

                    n.start_soon(gone)
                    await stop.wait()
                    n.cancel_scope.cancel()
        except (ConnectionLost, OSError, trio.BrokenResourceError) as err:
            log.warning("toolsrv %s: connection ended: %s", self.target, err)
        finally:
            with trio.CancelScope(shield=True):
                if proc.returncode is None:
                    proc.kill()
                await proc.wait()
            if proc is self._proc and not self._closing:
                self.on_change()
                log.warning(
                    "toolsrv %s: ssh ended (%s); reconnects on next use",
                    self.target,
                    proc.returncode,
                )

    @asynccontextmanager
    async def connect(self, agent_id: str) -> AsyncIterator[ToolsrvConn]:
        client, key = await self._ensure()
        try:
            root = await client.attach(agent_id, agent_secret(key, agent_id))
        except ConnectionLost as err:
            raise ToolsrvError(f"toolsrv {self.target}: {err}") from None
        except NinePError as err:
            raise ToolsrvError(f"toolsrv {self.target}: attach refused: {err.ename}") from None
        try:
            yield ToolsrvConn(client, root, agent_id)
        finally:
            if client.lost is None:
                client.clunk_nowait(root)

    def describe(self) -> str:
        """One line for ``ollie status``."""
        proc = self._proc
        if self.alive and proc is not None:
            return f"{self.target} connected (ssh pid {proc.pid}, peer {self.dest})"
        if self.last_error:
            return f"{self.target} down: {self.last_error}"
        return f"{self.target} disconnected (reconnects on next use)"

    async def aclose(self) -> None:
        self._closing = True  # the daemon stops: the ssh ending is no news
        if self._stop is not None:
            self._stop.set()
        proc = self._proc
        if proc is not None and proc.returncode is None:
            with trio.CancelScope(shield=True):
                proc.kill()
                await proc.wait()
        self._client = None


class RemoteToolsrvs:
    """One ``SshToolsrv`` per destination, made on first use, closed with the daemon."""

    def __init__(
        self, settings: Mapping[str, str], nursery: trio.Nursery, status_file: Path | None
    ) -> None:
        self.settings = settings
        self._nursery = nursery
        self.status_file = status_file
        self.hosts: dict[str, SshToolsrv] = {}

    def get(self, target: SshTarget) -> SshToolsrv:
        got = self.hosts.get(target.dest)
        if got is None:
            got = self.hosts[target.dest] = SshToolsrv(
                SshTarget(target.dest), self.settings, self._nursery, self._changed
            )
        return got

    def status_lines(self) -> list[str]:
        return [srv.describe() for srv in self.hosts.values()]

    def _changed(self) -> None:
        """``ollie status`` reads the connections from a file in the run dir (replaced
        whole, so a reader never sees half of it)."""
        if self.status_file is None:
            return
        tmp = self.status_file.with_suffix(".tmp")
        try:
            tmp.write_text("".join(f"{line}\n" for line in self.status_lines()))
            os.replace(tmp, self.status_file)
        except OSError as err:
            log.info("%s not written: %s", self.status_file, err.strerror)

    async def aclose(self) -> None:
        for srv in self.hosts.values():
            await srv.aclose()
        if self.status_file is not None:
            self.status_file.unlink(missing_ok=True)


def status_in(run: Path) -> list[str]:
    """The remote toolsrv connections a daemon with this run dir keeps, one line each."""
    try:
        return (run / STATUS_FILE).read_text().splitlines()
    except OSError:
        return []
