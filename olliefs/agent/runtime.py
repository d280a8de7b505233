"""An agent's link to toolsrv: its loaded tools, their schemas and the preamble.

The session owns the list of loaded tools (``wanted``: journaled, so it survives a
restart); toolsrv owns the agent-scoped registry that calls are checked against. The link
keeps the two in step:

* on (re)connect, and whenever ``ctl tool_load`` / ``tool_unload`` changed ``wanted``, the
  difference is written to ``agent/ctl``;
* after every tool round the agent reads ``agent/rev``; when it moved since the last build
  the loaded tools' metadata is read again and the backend schemas and the rendered
  preamble are rebuilt before the next model request (the seed's ToolRevision check).

The connection is held by a task in the session's nursery, so it lives exactly as long as
the session and is re-established on next use if toolsrv went away.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import trio

from olliefs.backend.base import Tool
from olliefs.toolclient.client import ToolsrvConn, ToolsrvError
from olliefs.toolclient.spawn import Toolsrv
from olliewire import CallResult, ToolMeta

log = logging.getLogger(__name__)


class ToolLink:
    def __init__(self, toolsrv: Toolsrv, agent_id: str, wanted: list[str], where: str = "") -> None:
        self.toolsrv = toolsrv
        self.where = where  # cfg toolsrv: "" the daemon's default, local, ssh:...
        self.agent_id = agent_id
        self.wanted = list(wanted)
        # Checkpoints: the (store, turn) each call is captured under (None: not captured).
        self.capture: Callable[[], tuple[str, int, bool]] | None = None
        self.metas: dict[str, ToolMeta] = {}
        self.tools: list[Tool] = []
        self.catalogue: dict[str, ToolMeta] = {}
        self.rev = -1
        # Counts the changes of ``wanted`` and ``metas`` (what ``tools`` shows).
        self.version = 0
        self._pushed: list[str] | None = None
        self._conn: ToolsrvConn | None = None
        self._closed = trio.Event()
        self._shut = False
        self._lock = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self.on_dropped: Callable[[str, str], None] = lambda name, why: None

    def bind(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    def set_wanted(self, names: list[str]) -> None:
        self.wanted = list(names)
        self.version += 1

    async def conn(self) -> ToolsrvConn:
        """The live connection; a new one (toolsrv respawned if need be) when it was lost."""
        async with self._lock:
            if self._conn is not None and self._conn.client.lost is not None:
                log.warning(
                    "toolsrv connection of %s lost: %s", self.agent_id, self._conn.client.lost
                )
                self._drop()
            if self._conn is None:
                if self._nursery is None or self._shut:
                    raise ToolsrvError("toolsrv: the session is not running")
                self._closed = trio.Event()
                self._conn = await self._nursery.start(self._hold, self._closed)
                self._pushed = None
                self.rev = -1
            return self._conn

    async def _hold(self, closed: trio.Event, task_status: trio.TaskStatus[ToolsrvConn]) -> None:
        started = False
        try:
            async with self.toolsrv.connect(self.agent_id, self.where) as conn:
                task_status.started(conn)
                started = True
                await closed.wait()
        except Exception as err:  # toolsrv gone: the next use reconnects
            if not started:
                raise
            log.warning("toolsrv connection of %s ended: %s", self.agent_id, err)

    def _drop(self) -> None:
        self._closed.set()
        self._conn = None

    def close(self) -> None:
        self._shut = True
        self._drop()

    async def ready(self) -> ToolsrvConn:
        """The connection, with toolsrv's loaded set equal to ``wanted``."""
        conn = await self.conn()
        if self._pushed != self.wanted:
            await self._push(conn)
        return conn

    async def refresh(self) -> None:
        """Push ``wanted`` if it changed; rebuild schemas if ``agent/rev`` moved.

        A connection found dead on the way (toolsrv died since the last use, and the
        reader had not noticed yet) is replaced once.
        """
        for attempt in (1, 2):
            try:
                conn = await self.ready()
                rev = await conn.rev()
                if rev != self.rev:
                    await self._rebuild(conn, rev)
                return
            except ToolsrvError:
                if attempt == 2 or self._conn is None or self._conn.client.lost is None:
                    raise

    async def call(
        self,
        name: str,
        args: dict[str, Any],
        cwd: str,
        env: Mapping[str, str],
        capture: tuple[str, int, bool] | None = None,
    ) -> CallResult:
        """``capture``: (store, turn) of the checkpoints (default: ``self.capture``)."""
        conn = await self.ready()
        if capture is None:
            capture = self.capture() if self.capture is not None else ("", 0, False)
        return await conn.call(name, args, cwd, env, capture)

    async def warm(self, n: int) -> None:
        """Procs made ahead for a round of ``n`` calls (best effort: errors show later)."""
        try:
            conn = await self.ready()
            await conn.warm(n)
        except ToolsrvError:
            pass

    async def _push(self, conn: ToolsrvConn) -> None:
        loaded = await conn.loaded()
        cmds = [f"unload {n}" for n in loaded if n not in self.wanted]
        cmds += [f"load {n}" for n in self.wanted if n not in loaded]
        if cmds:
            try:
                await conn.ctl("\n".join(cmds) + "\n")
            except ToolsrvError:
                # One at a time, to find which one toolsrv refuses (a tool deleted since).
                for cmd in cmds:
                    try:
                        await conn.ctl(cmd + "\n")
                    except ToolsrvError as err:
                        name = cmd.split(" ", 1)[1]
                        if cmd.startswith("load ") and name in self.wanted:
                            self.wanted.remove(name)
                            self.version += 1
                            self.on_dropped(name, str(err))
        self._pushed = list(self.wanted)

    async def _rebuild(self, conn: ToolsrvConn, rev: int) -> None:
        names = await conn.names()
        infos = await conn.metas(names)
        loaded = await conn.loaded()
        self.catalogue = {n: m for n, (m, _) in infos.items()}
        self.metas = {n: infos[n][0] for n in loaded if n in infos}
        self.tools = [
            Tool(n, infos[n][0].description, _object_schema(infos[n][1]))
            for n in loaded
            if n in infos
        ]
        self.rev = rev
        self.version += 1
        log.debug("tools of %s rebuilt at rev %d: %s", self.agent_id, rev, loaded)


PREAMBLE_MCP_TOOLS = 20
"""MCP servers' tools the system prompt lists one by one; past that it counts them."""


def _object_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return schema if schema.get("type") == "object" else {"type": "object", "properties": {}}


def preamble(
    *,
    session_id: str,
    cwd: str,
    profile_prompt: str,
    link: ToolLink,
    permits: Callable[[str], bool] = lambda name: True,
) -> str:
    """The system prompt: who the agent is, where it works, and how to get more tools
    (only those ``permits`` lets it load: the profile's allowTools)."""
    lines = [
        f"You are an agent of olliefs, session {session_id}, working in {cwd}.",
    ]
    if profile_prompt:
        lines += ["", profile_prompt.strip()]
    loaded = [n for n in link.wanted if n in link.metas] or list(link.wanted)
    lines += ["", "Loaded tools: " + (", ".join(loaded) if loaded else "none") + "."]
    more = {n: m for n, m in sorted(link.catalogue.items()) if n not in link.wanted and permits(n)}
    if more:
        if "client_9p" in link.wanted:
            how = (
                'load one with client_9p {"op": "write", "path": "ctl", '
                '"data": "tool_load NAME"}; it can be called from your next step on'
            )
        else:
            how = "ask the user to load one (echo tool_load NAME > ctl)"
        lines += ["", f"More tools exist ({how}):"]
        # Hundreds of MCP servers' tools would drown the prompt: past a few, they are
        # counted and left to tool_search, which ranks them all by name and description.
        mcp = [n for n in more if n.startswith("mcp_")]
        folded = len(mcp) > PREAMBLE_MCP_TOOLS
        lines += [f"- {n}: {m.description}" for n, m in more.items() if not folded or n not in mcp]
        if folded:
            search = "tool_search" in link.wanted or "tool_search" in more
            lines.append(
                f"- and {len(mcp)} tools of MCP servers (mcp_SERVER_TOOL)"
                + (": find one with tool_search (load it first if it is not)" if search else "")
            )
    return "\n".join(lines) + "\n"
