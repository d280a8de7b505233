"""``ollie mcp``: the sessions of a mounted tree, served to MCP clients (ollie(1)).

Another agent (Claude Code, Codex, an SDK client) drives olliefs sessions as MCP tools:
create one, prompt it and wait for the answer (the streamed text comes as progress
notifications), read its chat from an offset, read its state, usage and cost, stop,
fork and rewind it. Each result names the session, whose id is its directory in ``s/``
and survives a daemon restart, so a client resumes it later by that id.

Nothing here runs a session: every tool reads and writes the mounted tree, exactly as a
shell user would (``s/new``, ``prompt``, ``ctl``, ``stream``, ``statewait``), so it goes
through the same code and the same checks, and a client that cannot reach the mount
(its permissions, a sandbox) reaches no session through this either. The files that
block are opened with O_NONBLOCK and waited on with poll (ollie(5), BLOCKING READS): no
thread sits in a FUSE read, and a cancelled request leaves nothing behind.

The server is the SDK's ``MCPServer`` over stdio (on trio), or over streamable HTTP
(``--http PORT``) on the loopback; off the loopback only with ``--http-key-file``, whose
secret each request must carry as ``Authorization: Bearer``, the rule of the 9P export.
"""

from __future__ import annotations

import errno
import hmac
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.to_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.subscriptions import InMemorySubscriptionBus, ResourceUpdated

if TYPE_CHECKING:
    import mcp_types as types

__all__ = ["SessionTree", "build_server", "serve_http", "serve_stdio"]

MAX_READ = 1 << 20
"""Bytes of chat one ``session_chat`` returns at most (the next offset says where to go on)."""


class TreeError(Exception):
    """A refused request, with the daemon's reason (the session's ``err``)."""


class SessionTree:
    """The sessions of one mount, through its files."""

    def __init__(self, mount: Path) -> None:
        self.mount = mount

    def p(self, *parts: str) -> Path:
        for part in parts:
            if not part or "/" in part or part in (".", ".."):
                raise TreeError(f"bad name: {part!r}")
        return self.mount.joinpath(*parts)

    async def read(self, *parts: str) -> str:
        return await anyio.to_thread.run_sync(self._read, self.p(*parts))

    @staticmethod
    def _read(path: Path) -> str:
        try:
            return path.read_text(errors="replace")
        except FileNotFoundError:
            raise TreeError(f"no such session or file: {path.name}") from None
        except OSError as err:
            raise TreeError(f"{path}: {err.strerror}") from None

    async def write(self, sid: str, name: str, data: str) -> None:
        """One write(2), as ``echo`` does; a refusal says the daemon's reason."""
        path = self.p("s", sid, name)

        def go() -> None:
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
            try:
                os.write(fd, data.encode())
            finally:
                os.close(fd)

        try:
            await anyio.to_thread.run_sync(go)
        except FileNotFoundError:
            raise TreeError(f"no such session: {sid}") from None
        except OSError as err:
            why = ""
            try:
                why = (await self.read("s", sid, "err")).strip()
            except TreeError:
                pass
            code = errno.errorcode.get(err.errno or 0, "?")
            raise TreeError(f"{name}: {why or err.strerror} ({code})") from None

    async def create(self, **keys: str) -> str:
        tokens = " ".join(f"{k}={v}" for k, v in keys.items() if v)
        for v in keys.values():
            if any(c.isspace() for c in v):
                raise TreeError("s/new: values cannot hold blanks")
        path = self.p("s", "new")

        def go() -> str:
            fd = os.open(path, os.O_RDWR)
            try:
                os.write(fd, tokens.encode())
                return os.pread(fd, 4096, 0).decode().strip()
            finally:
                os.close(fd)

        try:
            return await anyio.to_thread.run_sync(go)
        except OSError as err:
            raise TreeError(f"s/new: {tokens!r} refused: {err.strerror}") from None

    async def chat_size(self, sid: str) -> int:
        path = self.p("s", sid, "chat")
        try:
            return (await anyio.to_thread.run_sync(os.stat, path)).st_size
        except FileNotFoundError:
            raise TreeError(f"no such session: {sid}") from None

    async def chat(self, sid: str, offset: int, limit: int = MAX_READ) -> tuple[str, int]:
        """Chat bytes from ``offset`` (at most ``limit``), and the offset after them."""
        path = self.p("s", sid, "chat")

        def go() -> bytes:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read(limit)

        try:
            data = await anyio.to_thread.run_sync(go)
        except FileNotFoundError:
            raise TreeError(f"no such session: {sid}") from None
        # Never end inside a UTF-8 sequence: the next read starts where this one ended.
        cut = len(data)
        while cut and cut > len(data) - 4 and (data[cut - 1] & 0xC0) == 0x80:
            cut -= 1
        if cut and data[cut - 1] >= 0xC0:
            cut -= 1
        if len(data) < limit:
            cut = len(data)
        return data[:cut].decode(errors="replace"), offset + cut

    async def state(self, sid: str) -> str:
        return (await self.read("s", sid, "state")).strip()

    async def wait_idle(
        self, sid: str, offset: int, follow: Callable[[str], Awaitable[None]]
    ) -> None:
        """Wait until the session is idle, handing ``follow`` each piece of ``stream``
        from ``offset`` on as it comes."""
        stream = os.open(self.p("s", sid, "stream"), os.O_RDONLY | os.O_NONBLOCK)
        try:
            os.lseek(stream, offset, os.SEEK_SET)
            while True:
                # Opened before the state is looked at: a change after this counts.
                sw = os.open(self.p("s", sid, "statewait"), os.O_RDONLY | os.O_NONBLOCK)
                try:
                    await self._drain(stream, follow)
                    if await self.state(sid) == "idle":
                        await self._drain(stream, follow)
                        return
                    removed = False
                    async with anyio.create_task_group() as tg:

                        async def changed(fd: int) -> None:
                            await anyio.wait_readable(fd)
                            tg.cancel_scope.cancel()

                        tg.start_soon(changed, sw)
                        while not removed:
                            await anyio.wait_readable(stream)
                            removed = await self._drain(stream, follow)
                        tg.cancel_scope.cancel()
                    if removed:
                        raise TreeError(f"the session {sid} was removed")
                finally:
                    os.close(sw)
        finally:
            os.close(stream)

    @staticmethod
    async def _drain(fd: int, follow: Callable[[str], Awaitable[None]]) -> bool:
        """Hand ``follow`` what can be read now; True at the end of the stream (the
        session was removed)."""
        pending, ended = read_now(fd)
        if pending:
            # Read is read: a cancel (the state changed meanwhile) must not lose it.
            with anyio.CancelScope(shield=True):
                await follow(pending.decode(errors="replace"))
        return ended


def read_now(fd: int) -> tuple[bytes, bool]:
    """What a non-blocking ``fd`` holds now, and whether it reached its end."""
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return data, False
        if not chunk:
            return data, True
        data += chunk


class Watchers:
    """``ollie://s/ID/chat`` and ``.../context`` change with every event of the session:
    one task follows the root ``events`` (poll, no thread) and tells both kinds of
    subscriber, those of ``subscriptions/listen`` (through the SDK's bus) and those of
    the older ``resources/subscribe``. The events read in one go are told once per
    session, not once per streamed piece. A daemon restart ends the task (its mount
    answered EOF or an error); the next subscription or tool call starts it again."""

    def __init__(self, tree: SessionTree, bus: InMemorySubscriptionBus) -> None:
        self.tree = tree
        self.bus = bus
        self.tasks: anyio.abc.TaskGroup | None = None
        self.following = False
        self.legacy: dict[str, set[Any]] = {}  # uri -> the sessions of the clients

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            self.tasks = tg
            self.ensure()
            try:
                yield None
            finally:
                tg.cancel_scope.cancel()
                self.tasks = None

    def ensure(self) -> None:
        if not self.following and self.tasks is not None:
            self.following = True
            self.tasks.start_soon(self._follow)

    @staticmethod
    def uris(sid: str) -> tuple[str, str]:
        return f"ollie://s/{sid}/chat", f"ollie://s/{sid}/context"

    async def subscribe(self, client: Any, uri: str) -> None:
        sid = uri.removeprefix("ollie://s/").partition("/")[0]
        if uri not in self.uris(sid) or not sid:
            raise TreeError(f"no such resource: {uri} (ollie://s/ID/chat or .../context)")
        await self.tree.chat_size(sid)  # the session exists
        self.legacy.setdefault(uri, set()).add(client)
        self.ensure()

    def unsubscribe(self, client: Any, uri: str) -> None:
        self.legacy.get(uri, set()).discard(client)

    async def _follow(self) -> None:
        try:
            fd = os.open(self.tree.p("events"), os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            self.following = False
            return
        try:
            os.lseek(fd, os.fstat(fd).st_size, os.SEEK_SET)  # what happens from now on
            rest = b""
            while True:
                await anyio.wait_readable(fd)
                data, ended = read_now(fd)
                *lines, rest = (rest + data).split(b"\n")
                sids = set()
                for line in lines:
                    try:
                        sid = json.loads(line).get("session")
                    except (ValueError, AttributeError):
                        continue
                    if isinstance(sid, str):
                        sids.add(sid)
                for sid in sorted(sids):
                    for uri in self.uris(sid):
                        await self.bus.publish(ResourceUpdated(uri=uri))
                        for client in list(self.legacy.get(uri, ())):
                            try:
                                await client.send_resource_updated(uri)
                            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                                self.legacy[uri].discard(client)
                if ended:
                    return
        except OSError:
            pass  # the daemon went away
        finally:
            os.close(fd)
            self.following = False


# What each of a session's resources (``Watchers.uris``) is, and its type.
_KINDS = (
    ("its conversation as text", "text/plain"),
    ("the messages its next request sends", "application/x-ndjson"),
)


class _Server(MCPServer):
    """``resources/list`` names each session's two resources besides the templates (a
    client that lists resources, as most do, finds the sessions without knowing ids)."""

    tree: SessionTree

    async def list_resources(self) -> list[types.Resource]:
        import mcp_types as types

        out = await super().list_resources()
        try:
            index = await self.tree.read("s", "idx")
        except TreeError:
            return out  # (no daemon at the mount: the templates only)
        for line in index.splitlines():
            sid = line.partition("\t")[0]
            if not sid:
                continue
            for uri, (what, mime) in zip(Watchers.uris(sid), _KINDS, strict=True):
                out.append(
                    types.Resource(
                        uri=uri,
                        name=f"{sid}/{uri.rpartition('/')[2]}",
                        description=f"session {sid}: {what}",
                        mime_type=mime,
                    )
                )
        return out


def build_server(tree: SessionTree) -> MCPServer:
    """The MCP server: a tool per thing a user does to a session, resources per session."""
    watchers = Watchers(tree, InMemorySubscriptionBus())
    app = _Server(
        "olliefs",
        lifespan=lambda _app: watchers.running(),
        subscriptions=watchers.bus,
        instructions=(
            "Sessions of an olliefs tree: each is an agent with its own history, tools and "
            "working directory. Create one, prompt it, read its chat; keep its id to come "
            "back to it later (ids survive restarts)."
        ),
    )
    app.tree = tree

    async def summary(sid: str) -> dict[str, Any]:
        watchers.ensure()  # (again after a daemon restart)
        return {
            "session": sid,
            "state": await tree.state(sid),
            "usage": (await tree.read("s", sid, "usage")).strip(),
            "cost": (await tree.read("s", sid, "cost")).strip(),
            "chatSize": await tree.chat_size(sid),
        }

    def fail(err: TreeError) -> Exception:
        # The SDK's expected tool error: a result with isError and this text, no traceback.
        return ToolError(str(err))

    @app.tool()
    async def session_create(
        name: str = "", cwd: str = "", agent: str = "", backend: str = "", model: str = ""
    ) -> dict[str, Any]:
        """Create a session (an agent at work in cwd, an absolute directory; default: where
        this server was started); returns its id, which later calls take as `session`."""
        try:
            sid = await tree.create(
                name=name, cwd=cwd or os.getcwd(), agent=agent, backend=backend, model=model
            )
            return await summary(sid)
        except TreeError as err:
            raise fail(err) from None

    @app.tool()
    async def session_prompt(session: str, text: str, ctx: Context) -> dict[str, Any]:
        """Send a prompt and wait until the session is idle (this turn, and any queued
        before it, done); the text streamed meanwhile comes as progress notifications.
        Returns the chat written since the prompt. Cancelling the request stops the
        waiting, not the turn (session_stop does that)."""
        try:
            start = await tree.chat_size(session)
            await tree.write(session, "prompt", text)
            sent = 0

            async def follow(piece: str) -> None:
                nonlocal sent
                sent += len(piece)
                await ctx.report_progress(sent, None, piece)

            await tree.wait_idle(session, start, follow)
            chat, end = await tree.chat(session, start)
            out = await summary(session)
            return {**out, "chat": chat, "offset": start, "nextOffset": end}
        except TreeError as err:
            raise fail(err) from None

    @app.tool()
    async def session_chat(session: str, offset: int = 0) -> dict[str, Any]:
        """The session's chat from a byte offset (at most 1 MiB); nextOffset goes on."""
        try:
            text, end = await tree.chat(session, max(0, offset))
            return {"session": session, "chat": text, "offset": offset, "nextOffset": end}
        except TreeError as err:
            raise fail(err) from None

    @app.tool()
    async def session_state(session: str) -> dict[str, Any]:
        """State (idle, thinking, ...), token usage and cost of a session."""
        try:
            return await summary(session)
        except TreeError as err:
            raise fail(err) from None

    @app.tool()
    async def session_list() -> list[dict[str, str]]:
        """Every session: id, state, cwd, backend, model."""
        rows = []
        for line in (await tree.read("s", "idx")).splitlines():
            f = line.split("\t")
            if len(f) >= 5:
                rows.append(
                    dict(zip(("session", "state", "cwd", "backend", "model"), f[:5], strict=True))
                )
        return rows

    async def ctl(session: str, line: str) -> dict[str, Any]:
        try:
            await tree.write(session, "ctl", line)
            return await summary(session)
        except TreeError as err:
            raise fail(err) from None

    @app.tool()
    async def session_stop(session: str) -> dict[str, Any]:
        """Stop the running turn (the history keeps what was done)."""
        return await ctl(session, "stop")

    @app.tool()
    async def session_fork(session: str, name: str, messages: int = 0) -> dict[str, Any]:
        """Copy a session (its first `messages` messages, all if 0) as a new one named
        `name`; returns the new session."""
        await ctl(session, f"fork {name} {messages}" if messages else f"fork {name}")
        try:
            return await summary(name)
        except TreeError as err:
            raise fail(err) from None

    @app.tool()
    async def session_rewind(session: str, turns: int = 1) -> dict[str, Any]:
        """Drop the last `turns` turns of a session (kept under its branches/)."""
        return await ctl(session, f"rewind {turns}")

    @app.resource("ollie://s/{session}/chat", mime_type="text/plain")
    async def chat_resource(session: str) -> str:
        """A session's conversation as text."""
        return (await tree.chat(session, 0, 64 << 20))[0]

    @app.resource("ollie://s/{session}/context", mime_type="application/x-ndjson")
    async def context_resource(session: str) -> str:
        """The messages the session's next request sends, one JSON object a line."""
        return await tree.read("s", session, "context")

    import mcp_types as types

    async def on_subscribe(ctx: Any, params: types.SubscribeRequestParams) -> types.EmptyResult:
        try:
            await watchers.subscribe(ctx.session, str(params.uri))
        except TreeError as err:
            raise fail(err) from None
        return types.EmptyResult()

    async def on_unsubscribe(ctx: Any, params: types.UnsubscribeRequestParams) -> types.EmptyResult:
        watchers.unsubscribe(ctx.session, str(params.uri))
        return types.EmptyResult()

    low = app._lowlevel_server  # (MCPServer has no decorator for the legacy subscribe)
    low.add_request_handler("resources/subscribe", types.SubscribeRequestParams, on_subscribe)
    low.add_request_handler("resources/unsubscribe", types.UnsubscribeRequestParams, on_unsubscribe)
    _ = (session_create, session_prompt, session_chat, session_state, session_list)
    _ = (session_stop, session_fork, session_rewind, chat_resource, context_resource)
    return app


def serve_stdio(mount: Path) -> None:
    import trio

    app = build_server(SessionTree(mount))
    trio.run(app.run_stdio_async)


def serve_http(mount: Path, host: str, port: int, key: str | None) -> None:
    """Streamable HTTP on ``host:port`` (uvicorn, asyncio). ``key``: the secret every
    request must bring as ``Authorization: Bearer KEY`` (required off the loopback)."""
    import uvicorn

    app = build_server(SessionTree(mount))
    inner = app.streamable_http_app()

    async def guarded(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and key is not None:
            got = dict(scope.get("headers", [])).get(b"authorization", b"").decode()
            if not hmac.compare_digest(got, f"Bearer {key}"):
                body = json.dumps({"error": "authentication failed"}).encode()
                await send({"type": "http.response.start", "status": 401, "headers": []})
                await send({"type": "http.response.body", "body": body})
                return
        await inner(scope, receive, send)

    uvicorn.run(guarded, host=host, port=port, log_level="warning", lifespan="on")
