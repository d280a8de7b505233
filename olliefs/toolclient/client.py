"""One agent's authenticated connection to toolsrv (SPEC 5), over ``ninep.client``.

``ToolsrvConn`` turns the file protocol into calls: ``metas()`` reads ``tools/``,
``load``/``unload`` write ``agent/ctl``, ``rev()`` reads ``agent/rev`` and ``call()`` runs
one tool through ``proc/new`` → ``proc/N/call`` → ``proc/N/result``.

A ``call`` is cancellable: when the awaiting task is cancelled (a session ``stop``), the
9P client flushes the pending ``result`` read and toolsrv kills the call's process group.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from ninep import NinePError
from ninep.client import Client, ConnectionLost
from ninep.codec import OREAD, OWRITE
from toolsrv.protocol import CallRequest, CallResult, ToolMeta, agent_secret

log = logging.getLogger(__name__)

MAX_WARM = 16  # procs made ahead, per connection (toolsrv keeps at most 256 per agent)
_json = msgspec.json.Encoder()
_result = msgspec.json.Decoder(CallResult)
_meta = msgspec.json.Decoder(ToolMeta)
_schema = msgspec.json.Decoder(dict[str, Any])


class ToolsrvError(Exception):
    """toolsrv refused or could not be reached; ``str()`` is fit for ``chat``."""


CUT = "toolsrv died; the call was cut"
"""The answer to a call whose toolsrv connection was lost while it ran."""


def _first(group: BaseExceptionGroup[NinePError]) -> NinePError:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    assert isinstance(exc, NinePError)
    return exc


@dataclass
class Slot:
    """A proc made ready ahead of its call: ``call`` open for writing, ``result`` for reading."""

    n: str
    call: int
    result: int


class ToolsrvConn:
    """One agent's attach. ``call`` keeps one proc slot warm (see ``call``)."""

    def __init__(
        self, client: Client, root: int, agent_id: str, nursery: trio.Nursery | None = None
    ) -> None:
        self.client = client
        self.root = root
        self.agent_id = agent_id
        self._nursery = nursery
        self._slots: list[Slot] = []
        self._filling: trio.Event | None = None

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

    async def meta(self, name: str) -> tuple[ToolMeta, dict[str, Any]]:
        async with trio.open_nursery() as n:
            got: dict[str, bytes] = {}

            async def get(file: str) -> None:
                got[file] = await self._read(f"tools/{name}/{file}")

            n.start_soon(get, "meta")
            n.start_soon(get, "schema")
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
        return int(await self._read("agent/rev"))

    async def loaded(self) -> list[str]:
        return (await self._read("agent/loaded")).decode().split()

    async def ctl(self, text: str) -> None:
        try:
            await self.client.write_all(self.root, "agent/ctl", text.encode())
        except NinePError as err:
            raise ToolsrvError(f"toolsrv: {err.ename}") from None

    async def call(
        self, tool: str, args: Mapping[str, Any], cwd: str, env: Mapping[str, str]
    ) -> CallResult:
        """Run one tool; the result JSON of ``proc/N/result``.

        Making a proc costs five round trips (walk/open/read ``proc/new``, then walk and
        open ``call`` and ``result`` side by side); the call itself one (write ``call`` and
        read ``result``, sent together). So that a tool call waits only for that, the
        connection keeps one proc made ahead: it is taken here, and the next one is made in
        the background once this call has its result. Clunks are not waited for.
        """
        c = self.client
        req = _json.encode(CallRequest(tool, dict(args), cwd, dict(env)))
        try:
            slot = await self._take_slot()
            try:
                return _result.decode(await self._write_and_read(slot, req))
            finally:
                c.clunk_nowait(slot.call)
                c.clunk_nowait(slot.result)
                self._refill()
        except NinePError as err:
            if self.client.lost is not None:
                raise ToolsrvError(CUT) from None
            raise ToolsrvError(f"toolsrv: {tool}: {err.ename}") from None

    async def _take_slot(self) -> Slot:
        """A warm slot; or the one being made (it is already on its way); or a new one."""
        if not self._slots and self._filling is not None:
            await self._filling.wait()
        return self._slots.pop() if self._slots else await self._make_slot()

    async def warm(self, n: int) -> None:
        """Have ``n`` slots ready, made side by side (a round of ``n`` calls then waits for
        five round trips once instead of five per call)."""
        missing = min(n, MAX_WARM) - len(self._slots)
        if missing <= 0:
            return

        async def one() -> None:
            with contextlib.suppress(NinePError):  # the calls will say what is wrong
                self._slots.append(await self._make_slot())

        async with trio.open_nursery() as nursery:
            for _ in range(missing):
                nursery.start_soon(one)

    async def _write_and_read(self, slot: Slot, req: bytes) -> bytes:
        """Write the call and read its result without waiting for the Rwrite in between
        (toolsrv's result read waits for the call): one round trip less per call. A
        refused write ends the pending read (flushed) and is what the caller sees."""
        refused: list[NinePError] = []
        result = b""
        try:
            async with trio.open_nursery() as nursery:

                async def write() -> None:
                    try:
                        await self.client.write(slot.call, 0, req)
                    except NinePError as err:
                        refused.append(err)
                        nursery.cancel_scope.cancel()

                nursery.start_soon(write)
                result = await self._read_result(slot.result)
        except BaseExceptionGroup as group:
            # The read failed too (the connection went away): one NinePError, not a group.
            nine, rest = group.split(NinePError)
            if nine is None or rest is not None:
                raise
            raise _first(nine) from None
        if refused:
            raise refused[0]
        return result

    async def _make_slot(self) -> Slot:
        c = self.client
        fid = await c.walk(self.root, ["proc", "new"])
        try:
            await c.open(fid, OREAD)
            n = (await c.read(fid, 0, 32)).decode().strip()
        finally:
            c.clunk_nowait(fid)
        fids: dict[str, int] = {}

        async def prep(name: str, mode: int) -> None:
            f = await c.walk(self.root, ["proc", n, name])
            fids[name] = f
            await c.open(f, mode)

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(prep, "call", OWRITE)
                nursery.start_soon(prep, "result", OREAD)
        except BaseException:
            for f in fids.values():
                c.clunk_nowait(f)
            raise
        return Slot(n, fids["call"], fids["result"])

    def _refill(self) -> None:
        """Make the next slot in the background, after a call: by the time the model asks
        for the next tool it is ready (made while the model was thinking)."""
        if self._nursery is None or self._filling is not None or self._slots:
            return
        filling = trio.Event()
        try:
            self._nursery.start_soon(self._fill, filling)
        except RuntimeError:
            # The connection's nursery is closed: the daemon is shutting down (or the
            # link went away) while this call ran, and no next call will want a slot.
            # Raised from the call's ``finally``, it would hide the call's own outcome.
            return
        self._filling = filling

    async def _fill(self, done: trio.Event) -> None:
        try:
            slot = await self._make_slot()
        except NinePError as err:  # the connection is going away; the next call says so
            log.debug("no warm proc slot: %s", err.ename)
            return
        finally:
            self._filling = None
            done.set()
        self._slots.append(slot)

    async def _read_result(self, fid: int) -> bytes:
        # toolsrv answers the whole result in one read when it fits; a full read means
        # there may be more.
        chunk = self.client.iounit
        buf = bytearray()
        while True:
            data = await self.client.read(fid, len(buf), chunk)
            buf += data
            if len(data) < chunk:
                return bytes(buf)


@asynccontextmanager
async def connect(socket_path: str, key: bytes, agent_id: str) -> AsyncIterator[ToolsrvConn]:
    """An attached connection for ``agent_id``; closed when the block ends."""
    try:
        async with Client.connect_unix(socket_path) as client:
            try:
                root = await client.attach(agent_id, agent_secret(key, agent_id))
            except NinePError as err:
                raise ToolsrvError(f"toolsrv: attach refused: {err.ename}") from None
            async with trio.open_nursery() as nursery:
                yield ToolsrvConn(client, root, agent_id, nursery)
                nursery.cancel_scope.cancel()
    except OSError as err:
        raise ToolsrvError(f"toolsrv unreachable at {socket_path}: {err.strerror or err}") from None
    except ConnectionLost as err:  # it went away while we said hello
        raise ToolsrvError(f"toolsrv at {socket_path}: {err}") from None
