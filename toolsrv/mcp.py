"""MCP servers as tools: ``mcp/<name>.json`` in the config dir (toolsrv(8), MCP SERVERS).

A user moving from Claude Code or Codex brings servers described as ``command``, ``args``,
``env`` (a process spoken to over stdio) or ``url`` (streamable HTTP). Each file names one
server; its tools join the registry as ``mcp_<server>_<tool>`` and are loaded, listed and
called like tool scripts, through the same ``proc/`` files, so olliefs needs to know
nothing of MCP.

Lazy
    Nothing runs until a tool of a server is called. What the tools are comes from a
    listing kept on disk (``--mcp-cache``), keyed by the hash of the server's file: only a
    server never listed (or whose file changed) is started once to list its tools, then
    stopped again. A running server that announces ``notifications/tools/list_changed`` is
    listed again, and the cache rewritten.

Sandboxed like every tool
    A stdio server is a long call of the `Executor`: its own process group, Landlock,
    mount namespace (read-only outside its roots: its private dir, and the file's
    ``roots``), no capabilities, seccomp, a cgroup, and no network unless the file says
    ``"network": true``. The executor runs a tool with pipes it owns and reads them to the
    end; a server needs a conversation instead. So the sandboxed process starts as a tiny
    relay that connects to a unix socket in the server's private dir (a write root, so
    visible in its namespace, and no network is needed for a pathname socket), puts the
    connection on its stdin and stdout, and execs the server's command. toolsrv speaks MCP
    on the other end with the SDK's `ClientSession`.

One process per server
    shared by every agent that loaded its tools. A server that dies is started again by
    the next call; the calls it cut are answered with an error saying so (and what it
    wrote on stderr). A call obeys the tool's timeout and ``proc/N/ctl kill`` (the request
    is cancelled; the server lives on).

Every failure is a result with ``isError`` the model can read: the server did not start
(its stderr), did not answer in time, refused the arguments, or died during the call.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import math
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from olliewire import IMAGE_TYPES, MAX_IMAGE, MAX_IMAGES, CallResult, Content
from toolsrv import sandbox
from toolsrv.exec import ExecResult, Executor
from toolsrv.protect import FILE_EVENTS, Inotify
from toolsrv.registry import ToolInfo

if TYPE_CHECKING:
    # The SDK costs most of a second to import: toolsrv imports it at the first server
    # it starts or lists, not at every start (the functions that need it import it).
    import mcp_types as types
    from mcp.client.session import ClientSession, IncomingMessage, MessageHandlerFnT
    from mcp.shared.message import SessionMessage

__all__ = ["MAX_NAME", "McpServers", "ServerConfig", "parse_config", "tool_name"]

log = logging.getLogger(__name__)

MAX_DESCRIPTION = 1024
"""Characters of a tool's description kept (the providers' smallest limit)."""
MAX_NAME = 64
"""What providers accept as a function name (OpenAI, Anthropic, Gemini alike)."""
SERVER_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}")
"""A server's name: its file name without ``.json``."""
STARTUP_TIMEOUT = 30.0
"""Seconds a server has to start and answer ``initialize``, unless its file says otherwise."""
STOP_GRACE = 10.0
"""Seconds a server whose connection closed has to exit on its own (it is killed then)."""
MAX_LINE = 64 << 20
"""The longest JSON-RPC line a stdio server may send (a larger one ends the connection)."""
MAX_TEXT = 1 << 20
"""What toolsrv keeps of one result, as it keeps 1 MiB of a script's output; the 32 KiB
the model sees is cut by olliefs, like any result."""
LIST_WAIT = 15.0
"""Seconds a listing of ``tools/`` waits for the MCP servers being listed."""
SCAN_AGE = 1.0
"""A scan of the config dirs is trusted until a watched dir changes, and this long at most
(a dir made later, a symlinked file's target edited elsewhere)."""

# The relay: connect to the socket in the cwd, make it stdin and stdout, exec the server.
_RELAY = (
    "import os,socket,sys\n"
    "s=socket.socket(socket.AF_UNIX)\n"
    "s.connect('mcp.sock')\n"
    "os.dup2(s.fileno(),0);os.dup2(s.fileno(),1);s.close()\n"
    "if sys.argv[1]:os.chdir(sys.argv[1])\n"
    "os.execvp(sys.argv[2],sys.argv[2:])\n"
)


class McpFailure(Exception):
    """A call that cannot be made; the message is the tool error the model reads."""


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One ``mcp/<name>.json``: the shape of Claude Code's and Codex's server entries, plus
    toolsrv's own keys (``network``, ``allowTools``, ``roots``, ``timeout``,
    ``startupTimeout``, ``sandbox``). Unknown keys are refused: a typo must not silently
    widen or narrow what a server may do."""

    type: str = ""
    command: str = ""
    args: list[str] = []
    env: dict[str, str] = {}
    cwd: str = ""
    url: str = ""
    headers: dict[str, str] = {}
    network: bool = False
    allowTools: list[str] | None = None
    roots: list[str] = []
    timeout: float = 60.0
    startupTimeout: float = STARTUP_TIMEOUT
    sandbox: str = "default"
    description: str = ""


def parse_config(data: bytes, path: str) -> ServerConfig:
    """Decode and check one server file; `McpFailure` says what is wrong, naming it."""
    try:
        cfg = msgspec.json.decode(data, type=ServerConfig)
    except msgspec.DecodeError as err:
        raise McpFailure(f"{path}: {err}") from None
    if bool(cfg.command) == bool(cfg.url):
        raise McpFailure(f"{path}: give either command (a stdio server) or url (HTTP)")
    if cfg.type not in ("", "stdio", "http", "streamable-http", "streamableHttp"):
        raise McpFailure(f"{path}: type must be stdio or http, not {cfg.type!r}")
    if cfg.url and not cfg.url.startswith(("http://", "https://")):
        raise McpFailure(f"{path}: url must be http:// or https://")
    if not 0 < cfg.timeout < math.inf or not 0 < cfg.startupTimeout < math.inf:
        raise McpFailure(f"{path}: timeout and startupTimeout must be seconds > 0")
    return cfg


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9_]", "_", text.lower())


def tool_name(server: str, tool: str, taken: set[str] | frozenset[str] = frozenset()) -> str:
    """``mcp_<server>_<tool>`` as a tool name (``[a-z][a-z0-9_]*``, at most 64 chars).

    Characters no provider takes become ``_``; a name too long, or one another tool of
    the server already maps to (``getTime`` and ``get_time``), ends in 8 hex digits of a
    hash of the real name instead, so it is stable from one listing to the next."""
    name = f"mcp_{_slug(server)}_{_slug(tool)}"
    if len(name) <= MAX_NAME and name not in taken:
        return name
    tag = hashlib.sha256(f"{server}\0{tool}".encode()).hexdigest()[:8]
    return f"{name[: MAX_NAME - 9]}_{tag}"


class Listed(msgspec.Struct, frozen=True):
    """One tool of a server's listing, as cached on disk."""

    name: str
    description: str
    schema: dict[str, Any]
    read_only: bool = False


class Listing(msgspec.Struct):
    config: str  # sha256 of the server file it was made with
    tools: list[Listed]


def _listed(tool: types.Tool) -> Listed:
    schema = dict(tool.input_schema) if isinstance(tool.input_schema, dict) else {}
    if schema.get("type") != "object":
        schema = {"type": "object", "properties": {}}
    schema.setdefault("properties", {})
    ro = bool(tool.annotations is not None and tool.annotations.read_only_hint)
    return Listed(tool.name, one_line(tool.description or tool.title or tool.name), schema, ro)


def one_line(text: str) -> str:
    """A description as tools declare theirs: one line (``t/idx`` is tab-separated lines),
    at most `MAX_DESCRIPTION` characters (what OpenAI takes)."""
    text = " ".join(text.split())
    if len(text) > MAX_DESCRIPTION:
        text = text[: MAX_DESCRIPTION - 1].rstrip() + "\u2026"
    return text


@dataclass(eq=False)
class _Conn:
    """A running, initialized server connection."""

    session: ClientSession
    scope: trio.CancelScope
    dead: trio.Event = field(default_factory=trio.Event)
    exit: ExecResult | None = None  # what the process did, once it ended
    gone: str = ""  # why the connection ended, for the calls it cut
    called: bool = False  # a call used it: a listing that started it leaves it running


@dataclass(eq=False)
class _Exit:
    """How a server's process ended, once it did."""

    result: ExecResult | None = None
    event: trio.Event = field(default_factory=trio.Event)


def _failure(err: BaseException) -> McpFailure | None:
    """The `McpFailure` inside nested groups (trio wraps what a nursery raises)."""
    if isinstance(err, McpFailure):
        return err
    if isinstance(err, BaseExceptionGroup):
        for e in err.exceptions:
            found = _failure(e)
            if found is not None:
                return found
    return None


def _leaf(err: BaseException) -> str:
    """The message of the first exception inside nested groups."""
    from mcp.shared.exceptions import MCPError

    found = _failure(err)
    if found is not None:
        return str(found)
    while isinstance(err, BaseExceptionGroup):
        err = err.exceptions[0]
    if isinstance(err, MCPError):
        return err.message
    return str(err) or type(err).__name__


@dataclass(eq=False)
class _Server:
    name: str
    path: str
    sig: tuple[int, int, int]
    config: ServerConfig | None
    digest: str
    error: str = ""
    listing: list[Listed] | None = None
    tools: dict[str, ToolInfo] = field(default_factory=dict)
    listed: trio.Event | None = None  # set when the listing under way ends
    conn: _Conn | None = None
    starting: trio.Event | None = None
    start_error: str = ""


class McpServers:
    """Every configured MCP server: their tools for the registry, and calls to them.

    ``dirs`` hold ``<name>.json`` files (the first of a name wins, as for tools);
    ``cache`` the listings; ``tmp_root`` the servers' private dirs; ``profile`` loads
    a sandbox profile by name (the server's, narrowed as its file says).
    """

    def __init__(
        self,
        dirs: Sequence[Path],
        *,
        cache: Path | None,
        tmp_root: Path,
        executor: Executor,
        nursery: trio.Nursery,
        profile: Callable[[str], sandbox.Profile],
    ) -> None:
        self.dirs = [Path(d) for d in dirs]
        self.cache = cache
        self.tmp_root = tmp_root
        self.executor = executor
        self.nursery = nursery
        self.profile = profile
        self.servers: dict[str, _Server] = {}
        self._scanned = -math.inf
        self._tools: dict[str, ToolInfo] = {}
        self._watch = Inotify()
        self._watched: set[Path] = set()

    # ---- the registry's view ------------------------------------------------------------

    def tools(self) -> dict[str, ToolInfo]:
        """Name → info of every tool of every listed server (no server is started for
        this; one never listed is listed in the background)."""
        now = time.monotonic()
        wds, lost = self._watch.read()
        if now - self._scanned >= SCAN_AGE or wds or lost:
            self._scanned = now
            self._scan()
        return self._tools

    def status(self) -> str:
        """toolsrv's ``mcp`` file: a line per configured server, tab-separated: its name,
        ``listed`` (its tools offered), ``listing`` (not yet) or ``failed``, how many tools
        it offers, and why it failed (its file, its start, its listing), else empty."""
        self.tools()
        lines = []
        for name, srv in sorted(self.servers.items()):
            state = "failed" if srv.error else "listing" if srv.listing is None else "listed"
            lines.append(f"{name}\t{state}\t{len(srv.tools)}\t{one_line(srv.error)}\n")
        return "".join(lines)

    async def settled(self) -> None:
        """Wait (`LIST_WAIT` at most) for the listings under way, a new file's among them:
        a listing of ``tools/`` right after a server file was written shows its tools."""
        self.tools()
        with trio.move_on_after(LIST_WAIT):
            for srv in list(self.servers.values()):
                if srv.listed is not None:
                    await srv.listed.wait()

    def _rebuild(self) -> None:
        """The tools offered: every server's, after a listing or a file changed."""
        self._tools = {n: i for s in self.servers.values() for n, i in s.tools.items()}

    def _scan(self) -> None:
        found: dict[str, tuple[str, tuple[int, int, int]]] = {}
        for d in self.dirs:
            if d not in self._watched and self._watch.add(str(d), FILE_EVENTS) is not None:
                self._watched.add(d)  # first: a change during the scan is seen next time
            try:
                names = sorted(os.listdir(d))
            except OSError:
                continue
            for fname in names:
                stem, ext = os.path.splitext(fname)
                if ext != ".json" or stem in found or fname.startswith("."):
                    continue
                path = os.path.join(d, fname)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                found[stem] = (path, (st.st_mtime_ns, st.st_size, st.st_ino))
        dirty = False
        for name in list(self.servers):
            if name not in found:
                self._drop(self.servers.pop(name))
                dirty = True
        for name, (path, sig) in found.items():
            old = self.servers.get(name)
            if old is not None and old.sig == sig and old.path == path:
                continue
            srv = self._load(name, path, sig)
            if old is not None:
                if old.digest == srv.digest and old.error == srv.error:
                    old.sig = sig  # touched, not changed
                    continue
                self._drop(old)
            self.servers[name] = srv
            dirty = True
            if srv.config is not None and srv.listing is None:
                self._list_later(srv)
        if dirty:
            self._rebuild()

    def _load(self, name: str, path: str, sig: tuple[int, int, int]) -> _Server:
        try:
            data = Path(path).read_bytes()
        except OSError as err:
            return _Server(name, path, sig, None, "", error=f"{path}: cannot read: {err}")
        digest = hashlib.sha256(data).hexdigest()
        srv = _Server(name, path, sig, None, digest)
        if not SERVER_RE.fullmatch(name):
            srv.error = f"{path}: bad server name {name!r}: must match [a-z0-9][a-z0-9_-]*"
        else:
            try:
                srv.config = parse_config(data, path)
            except McpFailure as err:
                srv.error = str(err)
        if srv.error:
            log.warning("MCP server left out: %s", srv.error)
            return srv
        cached = self._read_cache(name)
        if cached is not None and cached.config == digest:
            self._set_listing(srv, cached.tools)
        return srv

    def _drop(self, srv: _Server) -> None:
        if srv.conn is not None:
            srv.conn.gone = f"the MCP server {srv.name} was stopped: its file changed"
            srv.conn.scope.cancel()

    def _set_listing(self, srv: _Server, tools: list[Listed]) -> None:
        cfg = srv.config
        assert cfg is not None
        allow = None if cfg.allowTools is None else set(cfg.allowTools)
        infos: dict[str, ToolInfo] = {}
        for t in sorted(tools, key=lambda t: t.name):
            name = tool_name(srv.name, t.name, set(infos))
            if allow is not None and t.name not in allow and name not in allow:
                continue
            infos[name] = ToolInfo(
                name=name,
                description=one_line(t.description),  # (a cache may be older)
                args=t.schema,
                tier="cold" if t.read_only else "hot",
                parallel=t.read_only,
                timeout=cfg.timeout,
                sandbox=cfg.sandbox,
                path=srv.path,
                server=srv.name,
                remote=t.name,
            )
        srv.listing = tools
        srv.tools = infos

    # ---- the cache ----------------------------------------------------------------------

    def _cache_path(self, name: str) -> Path | None:
        return None if self.cache is None else self.cache / f"{name}.json"

    def _read_cache(self, name: str) -> Listing | None:
        path = self._cache_path(name)
        if path is None:
            return None
        try:
            return msgspec.json.decode(path.read_bytes(), type=Listing)
        except (OSError, msgspec.DecodeError):
            return None

    def _write_cache(self, srv: _Server) -> None:
        path = self._cache_path(srv.name)
        if path is None or srv.listing is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(msgspec.json.encode(Listing(srv.digest, srv.listing)))
            os.replace(tmp, path)
        except OSError as err:
            log.warning("cannot cache the tools of MCP server %s: %s", srv.name, err)

    # ---- listing ------------------------------------------------------------------------

    def _list_later(self, srv: _Server) -> None:
        if srv.listed is None:
            srv.listed = trio.Event()
            self.nursery.start_soon(self._list, srv, name=f"mcp list {srv.name}")

    async def _list(self, srv: _Server) -> None:
        """List a server's tools: on the running connection, or by starting it once."""
        try:
            if srv.conn is not None or srv.starting is not None:
                # Running, or being started by a call: list on that connection.
                try:
                    await self._relist(srv, await self._connection(srv))
                except McpFailure as err:
                    srv.error = str(err)
                    self._rebuild()
                return
            try:
                conn = await self._start(srv)
            except McpFailure as err:
                srv.error = str(err)
                log.warning("MCP server %s: %s", srv.name, err)
                self._rebuild()
                return
            try:
                await self._relist(srv, conn)
            finally:
                # Started only to list: stop it again, nothing may run before a call
                # (unless a call came meanwhile and uses it).
                if not conn.called:
                    conn.gone = conn.gone or "stopped after listing"
                    conn.scope.cancel()
                    await conn.dead.wait()
        except Exception as err:  # a server's odd answer must not take toolsrv down
            srv.error = f"{srv.path}: listing its tools failed: {type(err).__name__}: {err}"
            log.warning("MCP server %s: %s", srv.name, srv.error)
            self._rebuild()
        finally:
            assert srv.listed is not None
            srv.listed.set()
            srv.listed = None

    async def _relist(self, srv: _Server, conn: _Conn) -> None:
        import anyio
        import mcp_types as types
        from mcp.shared.exceptions import MCPError

        tools: list[types.Tool] = []
        cursor: str | None = None
        try:
            with trio.fail_after(srv.config.startupTimeout if srv.config else STARTUP_TIMEOUT):
                while True:
                    params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
                    page = await conn.session.list_tools(params=params)
                    tools.extend(page.tools)
                    cursor = page.next_cursor
                    if not cursor:
                        break
        except (MCPError, trio.TooSlowError, anyio.ClosedResourceError) as err:
            srv.error = f"{srv.path}: listing its tools failed: {err or 'timed out'}"
            log.warning("MCP server %s: %s", srv.name, srv.error)
            self._rebuild()
            return
        if self.servers.get(srv.name) is not srv:
            return  # its file changed meanwhile
        srv.error = ""
        self._set_listing(srv, [_listed(t) for t in tools])
        self._write_cache(srv)
        log.info("MCP server %s: %d tools", srv.name, len(srv.tools))
        self._rebuild()

    # ---- starting -----------------------------------------------------------------------

    async def _connection(self, srv: _Server) -> _Conn:
        """The server's running connection, started (once, for all callers) if needed."""
        while srv.conn is None:
            if srv.starting is not None:
                await srv.starting.wait()
                if srv.conn is None and srv.start_error:
                    raise McpFailure(srv.start_error)
                continue
            await self._start(srv)
        return srv.conn

    async def _start(self, srv: _Server) -> _Conn:
        assert srv.config is not None and srv.conn is None
        srv.starting = trio.Event()
        srv.start_error = ""
        try:
            conn: _Conn = await self.nursery.start(self._serve, srv, name=f"mcp {srv.name}")
        except McpFailure as err:
            srv.start_error = str(err)
            raise
        finally:
            srv.starting.set()
            srv.starting = None
        return conn

    async def _serve(
        self, srv: _Server, task_status: trio.TaskStatus[_Conn] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run one connection to its end; ``task_status`` gets it once initialized, or
        `McpFailure` (raised from ``nursery.start``) if it never got that far."""
        import mcp_types as types
        from mcp.client.session import ClientSession

        cfg = srv.config
        assert cfg is not None
        scope = trio.CancelScope()
        conn: _Conn | None = None
        ended = _Exit()
        try:
            with scope:
                async with trio.open_nursery() as inner:
                    if cfg.url:
                        read, write = await self._http(cfg, inner)
                    else:
                        read, write = await self._stdio(srv, cfg, inner, scope, ended)
                    session = ClientSession(
                        read,
                        write,
                        message_handler=self._handler(srv),
                        client_info=types.Implementation(name="olliefs-toolsrv", version="1"),
                    )
                    try:
                        async with session:
                            with trio.move_on_after(cfg.startupTimeout) as init:
                                await session.initialize()
                            if init.cancelled_caught:
                                raise McpFailure(
                                    f"the MCP server {srv.name} did not answer initialize "
                                    f"within {cfg.startupTimeout:g}s"
                                )
                            conn = _Conn(session, scope)
                            srv.conn = conn
                            task_status.started(conn)
                            await trio.sleep_forever()
                    except Exception as err:
                        if conn is not None:
                            raise
                        # Failed while starting: most often the process died; let it
                        # end, so that the error says what it wrote on stderr.
                        with trio.move_on_after(STOP_GRACE):
                            await ended.event.wait()
                        found = _failure(err)
                        if found is not None and ended.result is None:
                            raise found from None
                        raise McpFailure(self._why(srv, ended, _leaf(err))) from None
        except Exception as err:
            if conn is None:
                raise _failure(err) or McpFailure(self._why(srv, ended, _leaf(err))) from None
            log.warning("MCP server %s: connection failed: %s", srv.name, _leaf(err))
        finally:
            if conn is not None:
                conn.exit = ended.result
                if not conn.gone:
                    conn.gone = self._why(srv, ended, "the connection was lost")
                conn.dead.set()
                if srv.conn is conn:
                    srv.conn = None
        if conn is None:
            raise McpFailure(self._why(srv, ended, "it ended before it was ready"))

    def _why(self, srv: _Server, ended: _Exit, fallback: str) -> str:
        """Why a server ended or failed, as the model should read it."""
        res = ended.result
        if res is None:
            return f"the MCP server {srv.name} failed: {fallback}"
        if res.error is not None:
            return f"the MCP server {srv.name} could not start: {res.error}"
        how = (
            f"exit status {res.exit_code}"
            if res.signal is None
            else f"killed by signal {res.signal}"
        )
        err = res.stderr.decode(errors="replace").strip()
        tail = f"; its stderr ends:\n{err[-2000:]}" if err else ""
        return f"the MCP server {srv.name} exited ({how}){tail}"

    async def _stdio(
        self,
        srv: _Server,
        cfg: ServerConfig,
        nursery: trio.Nursery,
        scope: trio.CancelScope,
        ended: _Exit,
    ) -> tuple[Any, Any]:
        """Start the sandboxed process and accept its relay's connection."""
        home = self.tmp_root / f".mcp-{srv.name}"
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            prof = self.profile(cfg.sandbox)
        except sandbox.SandboxError as err:
            raise McpFailure(f"the MCP server {srv.name}: sandbox profile: {err}") from None
        prof = msgspec.structs.replace(
            prof,
            network=prof.network or cfg.network,
            timeout_cap=math.inf,
            max_output=min(prof.max_output, 64 * 1024),
        )
        sock_path = home / "mcp.sock"
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        dirfd = os.open(home, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            # Through the dir's descriptor: a tmp root deep in a test dir makes a path
            # longer than sun_path's 108 bytes.
            via = f"/proc/self/fd/{dirfd}/mcp.sock"
            try:
                os.unlink(via)
            except FileNotFoundError:
                pass
            await listener.bind(via)
        finally:
            os.close(dirfd)
        listener.listen(1)
        roots = [os.path.expanduser(r) for r in cfg.roots]
        for r in roots:
            if not os.path.isabs(r) or not os.path.isdir(r):
                raise McpFailure(f"{srv.path}: root {r!r} is not an existing absolute directory")
        cwd = os.path.expanduser(cfg.cwd) if cfg.cwd else (roots[0] if roots else "")
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/"),
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "TMPDIR": str(home),
            **cfg.env,
        }
        argv = [sys.executable, "-I", "-S", "-c", _RELAY, cwd, cfg.command, *cfg.args]

        async def run() -> None:
            try:
                res = await self.executor.run(
                    argv,
                    stdin=b"",
                    cwd=str(home),
                    env=env,
                    write_roots=roots,
                    tmp_dir=str(home),
                    profile=prof,
                    timeout=math.inf,
                )
            except sandbox.SandboxError as err:
                res = ExecResult(error=str(err))
            ended.result = res
            ended.event.set()
            log.info("MCP server %s ended: %s", srv.name, self._why(srv, ended, "?"))
            scope.cancel()  # the connection ends with its process

        nursery.start_soon(run, name=f"mcp process {srv.name}")
        try:
            with trio.move_on_after(cfg.startupTimeout) as waited:
                async with trio.open_nursery() as race:

                    async def exits() -> None:
                        await ended.event.wait()
                        race.cancel_scope.cancel()

                    race.start_soon(exits)
                    conn_sock, _ = await listener.accept()
                    race.cancel_scope.cancel()
        finally:
            listener.close()
            try:
                sock_path.unlink()
            except OSError:
                pass
        if ended.result is not None:
            raise McpFailure(self._why(srv, ended, "it ended before it connected"))
        if waited.cancelled_caught:
            raise McpFailure(
                f"the MCP server {srv.name} did not start within {cfg.startupTimeout:g}s"
            )
        return _socket_transport(trio.SocketStream(conn_sock), nursery)

    async def _http(self, cfg: ServerConfig, nursery: trio.Nursery) -> tuple[Any, Any]:
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client

        ready: trio.Event = trio.Event()
        box: list[tuple[Any, Any]] = []

        async def hold() -> None:
            client = create_mcp_http_client(headers=cfg.headers or None)
            async with client, streamable_http_client(cfg.url, http_client=client) as streams:
                box.append((streams[0], streams[1]))
                ready.set()
                await trio.sleep_forever()

        nursery.start_soon(hold)
        await ready.wait()
        return box[0]

    def _handler(self, srv: _Server) -> MessageHandlerFnT:
        import mcp_types as types

        async def handle(message: IncomingMessage) -> None:
            if isinstance(message, types.ToolListChangedNotification):
                log.info("MCP server %s: its tools changed; listing them again", srv.name)
                self._list_later(srv)
            await trio.lowlevel.checkpoint()

        return handle

    # ---- calls --------------------------------------------------------------------------

    async def call(self, info: ToolInfo, args: dict[str, Any], tmp: Path) -> CallResult:
        """Call one MCP tool; every failure is an error result, never an exception
        (but trio.Cancelled, for a killed call: the caller answers it)."""
        import anyio
        import mcp_types as types
        from mcp.shared.exceptions import MCPError
        from mcp_types import CONNECTION_CLOSED

        srv = self.servers.get(info.server)
        if srv is None or srv.config is None:
            return _error(f"the MCP server {info.server} is no longer configured")
        try:
            conn = await self._connection(srv)
            conn.called = True
        except McpFailure as err:
            return _error(f"{err}\n(the call did not run; the next call starts it again)")
        timeout = info.timeout
        result: types.CallToolResult | None = None
        failure = ""
        with trio.move_on_after(timeout) as deadline:
            async with trio.open_nursery() as race:

                async def watch() -> None:
                    await conn.dead.wait()
                    race.cancel_scope.cancel()

                race.start_soon(watch)
                try:
                    got: Any = await conn.session.call_tool(info.remote, args)
                    if isinstance(got, types.CallToolResult):
                        result = got
                    else:
                        failure = f"the MCP server {srv.name} answered {type(got).__name__}"
                except MCPError as err:
                    if err.code != CONNECTION_CLOSED:
                        failure = f"the MCP server {srv.name} refused the call: {err.message}"
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    pass  # the connection died: `dead` says how
                except (RuntimeError, ValueError) as err:  # the SDK's own checks of a result
                    failure = f"the MCP server {srv.name} gave a bad answer: {err}"
                race.cancel_scope.cancel()
        if (
            result is None
            and not failure
            and not deadline.cancelled_caught
            and not conn.dead.is_set()
        ):
            # The connection closed under the call: the process is on its way out (its
            # exit says why), or it closed its stdout and lives on, useless: stop it.
            with trio.move_on_after(STOP_GRACE):
                await conn.dead.wait()
            if not conn.dead.is_set():
                conn.gone = f"the MCP server {srv.name} closed its connection"
                conn.scope.cancel()
                await conn.dead.wait()
        if deadline.cancelled_caught:
            return _error(
                f"timed out after {timeout:g}s: the MCP server {srv.name} did not answer "
                f"(the request was cancelled; the server keeps running)"
            )
        if conn.dead.is_set() and result is None and not failure:
            return _error(f"{conn.gone}\nThe call was cut; the next call starts the server again.")
        if result is None:
            return _error(failure or f"the MCP server {srv.name} did not answer")
        return render(result, tmp, srv.name)


def _error(text: str) -> CallResult:
    return CallResult([Content(text)], True)


def render(result: types.CallToolResult, tmp: Path, server: str) -> CallResult:
    """What the model reads of an MCP result: text as is; a resource's text under its
    URI; an image, audio or binary resource saved to the session's tmp dir and named
    there in a line; an image of a type every backend takes (``IMAGE_TYPES``, up to
    ``MAX_IMAGE`` bytes, ``MAX_IMAGES`` of them) also carried as an image, which each
    backend sends in the form its wire takes; structured content as JSON when there is
    no content."""
    import mcp_types as types

    texts: list[str] = []
    images: list[Content] = []  # their lines are in the texts too
    for block in result.content:
        if isinstance(block, types.TextContent):
            texts.append(block.text)
            continue
        what: str
        if isinstance(block, types.ImageContent | types.AudioContent):
            data, mime, what = block.data, block.mime_type, block.type
        elif isinstance(block, types.EmbeddedResource):
            res = block.resource
            if isinstance(res, types.TextResourceContents):
                texts.append(f"[resource {res.uri}]\n{res.text}")
                continue
            data, mime, what = res.blob, res.mime_type or "", f"resource {res.uri}"
        else:  # a resource link (the content union's last kind)
            texts.append(f"[resource link {block.uri}: {block.description or block.name}]")
            continue
        line, raw = _saved(tmp, data, mime, what)
        texts.append(line)
        if raw is not None and mime in IMAGE_TYPES and raw <= MAX_IMAGE:
            images.append(Content("", "image", data, mime))
    if not texts and result.structured_content is not None:
        texts.append(msgspec.json.encode(result.structured_content).decode())
    text = "\n".join(texts)
    if len(text) > MAX_TEXT:
        text = f"{text[:MAX_TEXT]}\n[cut: {len(text) - MAX_TEXT} more characters were dropped]"
    if not text and result.is_error:
        text = f"the MCP server {server} reported an error without a message"
    return CallResult([Content(text), *images[:MAX_IMAGES]], bool(result.is_error))


def _saved(tmp: Path, data: str, mime: str, what: str) -> tuple[str, int | None]:
    """The line that names the saved file, and its size (None: not valid base64)."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return f"[{what} {mime}: not valid base64]", None
    ext = (mime.split("/")[-1] if "/" in mime else "bin").split("+")[0][:8] or "bin"
    digest = hashlib.sha256(raw).hexdigest()[:12]
    path = tmp / f"mcp-{digest}.{ext}"
    try:
        path.write_bytes(raw)
    except OSError as err:
        return f"[{what} {mime}, {len(raw)} bytes: could not be saved: {err.strerror}]", len(raw)
    return f"[{what} {mime}, {len(raw)} bytes, saved as {path}]", len(raw)


def _parse(line: bytes) -> SessionMessage | Exception:
    import mcp_types as types
    from mcp.shared.message import SessionMessage

    try:
        return SessionMessage(types.jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as err:
        return err


def _socket_transport(stream: trio.SocketStream, nursery: trio.Nursery) -> tuple[Any, Any]:
    """The SDK's stream pair over a connection carrying newline-delimited JSON-RPC, as
    the stdio transport does over pipes."""
    import anyio
    from mcp.shared.message import SessionMessage

    read_send, read_recv = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_send, write_recv = anyio.create_memory_object_stream[SessionMessage](0)

    async def reader() -> None:
        buf = b""
        async with read_send:
            try:
                while data := await stream.receive_some(65536):
                    buf += data
                    if b"\n" not in data:
                        if len(buf) > MAX_LINE:
                            log.warning("MCP server sent a line over %d bytes", MAX_LINE)
                            return
                        continue
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        if line.strip():
                            await read_send.send(_parse(line))
            except (trio.BrokenResourceError, trio.ClosedResourceError, anyio.ClosedResourceError):
                pass

    async def writer() -> None:
        async with write_recv:
            try:
                async for msg in write_recv:
                    line = msg.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await stream.send_all(line.encode() + b"\n")
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await read_send.aclose()

    nursery.start_soon(reader)
    nursery.start_soon(writer)
    return read_recv, write_send
