"""The daemon's toolsrv: spawned on first use, respawned if it died, or a remote one.

Local (default): ``toolsrv`` runs as a child in its own session (a Ctrl-C meant for a
foreground ``ollie mount -f`` is not its business), listening on
``run/toolsrv-<daemon pid>-<n>.sock`` (0600). olliefs mints a fresh master key per spawn
and hands it over on the child's stdin, which it keeps open: toolsrv exits when that pipe
closes, so a daemon killed with SIGKILL does not leave a tool server behind.

Remote: ``OLLIE_TOOLSRV=unix:/path/to.sock`` with ``OLLIE_TOOLSRV_KEY_FILE`` (the hex key
that toolsrv was started with, ``--key-file``), or ``OLLIE_TOOLSRV=ssh:[user@]host[:dir]``:
a toolsrv on that host over ssh (`olliefs.toolclient.remote`).
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import trio

from olliefs.settings import Paths, private_file, shipped_dir
from olliefs.toolclient.client import ToolsrvConn, ToolsrvError, connect
from olliefs.toolclient.remote import STATUS_FILE, RemoteToolsrvs, SshTarget, parse_toolsrv

log = logging.getLogger(__name__)


def hidden_args(paths: Paths) -> list[str]:
    """What no tool may read or change, wherever its cwd is: the config dir (keys in
    ``env``, sandbox profiles), the state dir (journals, logs), the data dir and the run
    dir (sockets, toolsrv's among them); the env file again in case it is a symlink to
    elsewhere. What tools need of them is shown again: the user's tool scripts (toolsrv
    execs them) and the memory notes (read-only; the ``memory`` profile makes them
    writable); the per-session tmp dirs are write roots, each shown to its own calls."""
    args: list[str] = []
    for path in (paths.config, paths.state, paths.data, paths.run, paths.env_file):
        args += ["--hide", str(path)]
    for path in (paths.config / "tools", paths.memory):
        args += ["--show", str(path)]
    return args


class Toolsrv:
    def __init__(self, paths: Paths, settings: Mapping[str, str], nursery: trio.Nursery) -> None:
        self.paths = paths
        self.settings = settings
        self._nursery = nursery
        self._lock = trio.Lock()
        self._proc: trio.Process | None = None
        self._key: bytes | None = None
        self._socket = ""
        self.spawns = 0
        self.remotes = RemoteToolsrvs(settings, nursery, paths.run / STATUS_FILE)
        remote = settings.get("OLLIE_TOOLSRV", "")
        self.ssh: SshTarget | None = None
        if remote.startswith("ssh:") or remote == "local":
            try:
                self.ssh = parse_toolsrv(remote)
            except ValueError as err:
                raise ToolsrvError(f"OLLIE_TOOLSRV: {err}") from None
            remote = ""
        if remote:
            if not remote.startswith("unix:"):
                raise ToolsrvError(f"OLLIE_TOOLSRV: only unix:PATH is supported: {remote}")
            self._socket = remote[len("unix:") :]
            key_file = settings.get("OLLIE_TOOLSRV_KEY_FILE", "")
            try:
                self._key = bytes.fromhex(Path(key_file).read_text().strip())
            except (OSError, ValueError) as err:
                raise ToolsrvError(f"OLLIE_TOOLSRV_KEY_FILE: {err}") from None
        self.remote = bool(remote)

    @property
    def tmp_root(self) -> Path:
        return self.paths.data / "tmp"

    @property
    def alive(self) -> bool:
        return self.remote or (self._proc is not None and self._proc.returncode is None)

    async def _ensure(self) -> tuple[str, bytes]:
        async with self._lock:
            proc = self._proc
            if proc is not None and proc.returncode is None and not os.path.exists(self._socket):
                # The server died and its keeper is killing what it left (its socket is
                # gone first): that takes milliseconds; then a new one is spawned.
                with trio.move_on_after(5):
                    await proc.wait()
            if not self.alive:
                await self._spawn()
            assert self._key is not None
            return self._socket, self._key

    async def _spawn(self) -> None:
        # One name per spawn: a toolsrv of a crashed daemon may still be on its way out.
        sock = self.paths.run / f"toolsrv-{os.getpid()}-{self.spawns}.sock"
        key = secrets.token_bytes(32)
        # toolsrv knows nothing of olliefs: it is told every dir, the user's first (they win
        # by name), then the shipped defaults.
        shipped = shipped_dir()
        argv = [
            sys.executable,
            "-m",
            "toolsrv",
            "--socket",
            str(sock),
            "--tools-dir",
            str(self.paths.config / "tools"),
            "--tools-dir",
            str(shipped / "tools"),
            "--sandbox-dir",
            str(self.paths.config / "sandbox"),
            "--sandbox-dir",
            str(shipped / "sandbox"),
            "--tmp-dir",
            str(self.tmp_root),
            "--mcp-dir",
            str(self.paths.config / "mcp"),
            "--mcp-cache",
            str(self.paths.state / "mcp"),
            "--capture-dir",
            str(self.paths.state / "checkpoints"),
            *hidden_args(self.paths),
            "--exit-with-stdin",
            "--log-level",
            self.settings.get("OLLIE_TOOLSRV_LOG_LEVEL", "INFO"),
        ]
        private_file(self.paths.state / "toolsrv.log")
        log_file = open(self.paths.state / "toolsrv.log", "ab")
        try:
            proc = await trio.lowlevel.open_process(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                start_new_session=True,
            )
        finally:
            log_file.close()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            await proc.stdin.send_all(key.hex().encode() + b"\n")
            line = b""
            with trio.move_on_after(30):
                while not line.endswith(b"\n"):
                    chunk = await proc.stdout.receive_some(64)
                    if not chunk:
                        break
                    line += chunk
            if line.strip() != b"ready":
                raise ToolsrvError(
                    f"toolsrv did not start (see {self.paths.state / 'toolsrv.log'})"
                )
        except BaseException:
            # Also when cancelled (the daemon stopping): left alive, it would read no key,
            # log a bogus complaint about it and exit on its own, after the daemon.
            proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()
            raise
        self.spawns += 1
        self._proc, self._key, self._socket = proc, key, str(sock)
        log.info("toolsrv started, pid %d, socket %s", proc.pid, sock)
        self._nursery.start_soon(self._watch, proc)

    async def _watch(self, proc: trio.Process) -> None:
        code = await proc.wait()
        if proc is self._proc:
            log.warning("toolsrv (pid %d) exited with %s; respawned on next use", proc.pid, code)

    @asynccontextmanager
    async def connect(self, agent_id: str, where: str = "") -> AsyncIterator[ToolsrvConn]:
        """An attach for ``agent_id`` on the toolsrv ``where`` names: ``local``,
        ``ssh:[user@]host[:dir]``, or "" for the daemon's default (``OLLIE_TOOLSRV``)."""
        try:
            target = parse_toolsrv(where) if where else self.ssh
        except ValueError as err:
            raise ToolsrvError(str(err)) from None
        if target is not None:
            async with self.remotes.get(target).connect(agent_id) as conn:
                conn.remote_cwd = target.dir
                yield conn
            return
        async with AsyncExitStack() as stack:
            for attempt in (1, 2):
                sock, key = await self._ensure()
                try:
                    conn = await stack.enter_async_context(connect(sock, key, agent_id))
                    break
                except ToolsrvError:
                    # A toolsrv killed a moment ago may still look alive (it is exiting
                    # but not yet reaped): wait for it to go, then spawn a new one.
                    if attempt == 2 or not await self._gone_after_all():
                        raise
            yield conn

    async def _gone_after_all(self) -> bool:
        proc = self._proc
        if self.remote or proc is None:
            return False
        with trio.move_on_after(2):
            await proc.wait()
        return proc.returncode is not None

    async def aclose(self) -> None:
        await self.remotes.aclose()
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        with trio.CancelScope(shield=True):
            assert proc.stdin is not None
            await proc.stdin.aclose()  # toolsrv exits on stdin EOF ...
            with trio.move_on_after(5):
                await proc.wait()
            if proc.returncode is None:  # ... or is made to
                proc.kill()
                await proc.wait()
        try:
            os.unlink(self._socket)
        except FileNotFoundError:
            pass
