"""One agent's authenticated connection to toolsrv (SPEC 5), over ``ninep.client``.

``ToolsrvConn`` turns the file protocol into calls: ``metas()`` reads ``tools/``,
``load``/``unload`` write ``agent/ctl``, ``rev()`` reads ``agent/rev`` and ``call()`` runs
one tool through ``proc/rpc`` (write the call, read the result, on one fid).

A ``call`` is cancellable: when the awaiting task is cancelled (a session ``stop``), the
9P client flushes the pending ``result`` read and toolsrv kills the call's process group.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import trio

from ninep import NinePError
from ninep.client import Client, ConnectionLost
from ninep.codec import ORDWR, OREAD
from olliewire import CallRequest, CallResult, ToolMeta, agent_secret

log = logging.getLogger(__name__)

MAX_WARM = 16  # call fids opened ahead, per connection (toolsrv runs at most 256 per agent)
_json = msgspec.json.Encoder()
_result = msgspec.json.Decoder(CallResult)
_meta = msgspec.json.Decoder(ToolMeta)
_schema = msgspec.json.Decoder(dict[str, Any])


class ToolsrvError(Exception):
    """toolsrv refused or could not be reached; ``str()`` is fit for ``chat``."""


CUT = "toolsrv died; the call was cut"
"""The answer to a call whose toolsrv connection was lost while it ran."""


class ToolsrvConn:
    """One agent's attach. ``call`` keeps the fids of finished calls (see ``call``)."""

    def __init__(self, client: Client, root: int, agent_id: str) -> None:
        self.client = client
        self.root = root
        self.agent_id = agent_id
        self._idle: list[int] = []  # proc/rpc fids open for reading and writing, free
        self._rev: int | None = None  # agent/rev, kept open: read at 0, it is current
        # A remote toolsrv named with a dir (``ssh:host:/dir``): the cwd of every call
        # there, in place of the session's local one.
        self.remote_cwd = ""

    @property
    def idle(self) -> int:
        """Fids kept open for the next calls."""
        return len(self._idle)

    async def _read(self, path: str) -> bytes:
        try:
            return await self.client.read_all(self.root, path)
        except NinePError as err:
            raise ToolsrvError(f"toolsrv: {path}: {err.ename}") from None

    async def names(self) -> list[str]:
        try:
            return sorted(st.name for st in await self.client.listdir(self.root, "tools"))
        except NinePError as err:
            raise ToolsrvError(f"toolsrv: tools/: {err.ename}") from None

    async def mcp_status(self) -> str:
        """toolsrv's ``mcp`` file: a line per MCP server, its state and why it failed
        (empty from a toolsrv without the file, an older one)."""
        try:
            return (await self.client.read_all(self.root, "mcp")).decode(errors="replace")
        except NinePError:
            return ""

    async def meta(self, name: str) -> tuple[ToolMeta, dict[str, Any]]:
        got: dict[str, bytes] = {}

        async def get(file: str) -> None:
            got[file] = await self._read(f"tools/{name}/{file}")

        try:
            async with trio.open_nursery() as n:
                n.start_soon(get, "meta")
                n.start_soon(get, "schema")
        except* ToolsrvError as group:
            # The nursery wraps the failure in a group, which callers that catch
            # ToolsrvError (a tool toolsrv does not serve: a script written through t/
            # without a valid header) would let through as a daemon failure (EIO).
            raise group.exceptions[0] from None
        return _meta.decode(got["meta"]), _schema.decode(got["schema"])

    async def metas(self, names: list[str]) -> dict[str, tuple[ToolMeta, dict[str, Any]]]:
        """Meta and schema of each name that exists (read concurrently)."""
        out: dict[str, tuple[ToolMeta, dict[str, Any]]] = {}

        async def one(name: str) -> None:
            try:
                out[name] = await self.meta(name)
            except ToolsrvError as err:
                log.info("%s", err)

        async with trio.open_nursery() as n:
            for name in names:
                n.start_soon(one, name)
        return {k: out[k] for k in names if k in out}

    async def rev(self) -> int:
        """agent/rev, read on a fid kept open: one round trip, asked before every model
        request (toolsrv renders the file again at each read at offset 0)."""
        try:
            if self._rev is None:
                fid = await self.client.walk(self.root, ["agent", "rev"])
                try:
                    await self.client.open(fid, OREAD)
                except BaseException:
                    self.client.clunk_nowait(fid)
                    raise
                self._rev = fid
            return int(await self.client.read(self._rev, 0, 64))
        except NinePError as err:
            raise ToolsrvError(f"toolsrv: agent/rev: {err.ename}") from None

    async def loaded(self) -> list[str]:
        return (await self._read("agent/loaded")).decode().split()

    async def ctl(self, text: str) -> None:
        try:
            await self.client.write_all(self.root, "agent/ctl", text.encode())
        except NinePError as err:
            raise ToolsrvError(f"toolsrv: {err.ename}") from None

    async def call(
        self,
        tool: str,
        args: Mapping[str, Any],
        cwd: str,
        env: Mapping[str, str],
        capture: tuple[str, int, bool] = ("", 0, False),
    ) -> CallResult:
        """Run one tool; the result JSON it answers.

        A call is one round trip on ``proc/rpc``: the call written and its result read
        on a fid already open for both (`Client.transact`), two 9P messages in all. The
        connection keeps the fids of finished calls for the next ones, so only a call
        that finds none free (the first, or one of several at once) waits for a walk
        and an open first; ``warm`` opens them ahead for a round of calls.
        """
        c = self.client
        where = self.remote_cwd or cwd
        req = _json.encode(CallRequest(tool, dict(args), where, dict(env), *capture))
        fid: int | None = None
        try:
            fid = self._idle.pop() if self._idle else await self._open_rpc()
            result = _result.decode(await c.transact(fid, req))
        except NinePError as err:
            if self.client.lost is not None:
                raise ToolsrvError(CUT) from None
            raise ToolsrvError(f"toolsrv: {tool}: {err.ename}") from None
        except BaseException:
            # Cancelled (the read was flushed and the call killed): the fid goes, so
            # that the next call cannot meet a call still being killed on it.
            if fid is not None:
                c.clunk_nowait(fid)
            raise
        self._idle.append(fid)
        return result

    async def _open_rpc(self) -> int:
        c = self.client
        fid = await c.walk(self.root, ["proc", "rpc"])
        try:
            await c.open(fid, ORDWR)
        except BaseException:
            c.clunk_nowait(fid)
            raise
        return fid

    async def warm(self, n: int) -> None:
        """Have ``n`` fids ready for calls, opened side by side (a round of ``n`` calls
        at once then waits for two round trips once instead of once per call)."""
        missing = min(n, MAX_WARM) - len(self._idle)
        if missing <= 0:
            return

        async def one() -> None:
            with contextlib.suppress(NinePError):  # the calls will say what is wrong
                self._idle.append(await self._open_rpc())

        async with trio.open_nursery() as nursery:
            for _ in range(missing):
                nursery.start_soon(one)


@asynccontextmanager
async def connect(socket_path: str, key: bytes, agent_id: str) -> AsyncIterator[ToolsrvConn]:
    """An attached connection for ``agent_id``; closed when the block ends."""
    try:
        async with Client.connect_unix(socket_path) as client:
            try:
                root = await client.attach(agent_id, agent_secret(key, agent_id))
            except NinePError as err:
                raise ToolsrvError(f"toolsrv: attach refused: {err.ename}") from None
            yield ToolsrvConn(client, root, agent_id)
    except OSError as err:
        raise ToolsrvError(f"toolsrv unreachable at {socket_path}: {err.strerror or err}") from None
    except ConnectionLost as err:  # it went away while we said hello
        raise ToolsrvError(f"toolsrv at {socket_path}: {err}") from None
