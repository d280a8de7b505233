"""The toolsrv file tree (SPEC 5), served over 9P2000 by ``ninep.server``.

One attach per agent: ``uname`` is the agent id, ``aname`` the per-agent secret
(``protocol.agent_secret``). Everything an agent sees hangs off its own attach root, so
one agent cannot name, let alone read or kill, another agent's procs::

    tools/<name>/{meta,schema}   every tool of the registry
    agent/ctl                    "load <name>" / "unload <name>", one per line
    agent/loaded, agent/rev      the agent's loaded tools; a counter bumped on each change
    proc/new                     open + read: a fresh call id N (proc/N/ appears)
    proc/N/call                  write the CallRequest JSON: the call starts
    proc/N/result                blocking read: the CallResult JSON once the call ended
                                 (a read before the call was written waits for it)
    proc/N/ctl                   "kill": the call's whole process group dies
    proc/rpc                     a call on one fid: write the CallRequest, read the
                                 CallResult; again and again on the same fid

A blocked ``result`` read that is flushed (Tflush) kills the call, exactly like ``kill``:
that is how a ``stop`` in olliefs reaches a running tool. A proc disappears once its
result was read and the reading fid clunked, when ``proc/N`` is removed, or when the
agent's last connection goes away (its running calls are killed then: a dead client must
not leave tools running).

``proc/rpc`` is the same call without the bookkeeping, for a client that makes many
(factotum's ``rpc`` file is the model): on one fid open for reading and writing, a write
(or several, at offsets 0, then where the last ended) holds the call, and the next read
starts it and waits for its result; reads at further offsets return the rest of the
result, until the next write. Write and read go out together, so a call is one round
trip and two messages, where ``proc/new`` and ``proc/N`` take a dozen (and five round
trips, made ahead by the client). A refused call is the read's Rerror; a Tflush of the
read, or the end of the connection, kills the call. No ``proc/N`` is made.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgspec
import trio

from ninep import NinePError
from ninep.codec import DMDIR, OREAD, OTRUNC, QTDIR, QTFILE, TREAD, Qid, Stat
from ninep.server import BaseFileSystem
from olliewire import (
    AGENT_ID_RE,
    CALL_ENV_KEYS,
    CallRequest,
    CallResult,
    Content,
    check_secret,
)
from toolsrv import checkpoint, sandbox
from toolsrv.exec import ExecResult, Executor
from toolsrv.mcp import McpServers
from toolsrv.registry import AgentTools, ToolError, ToolInfo, ToolRegistry

log = logging.getLogger(__name__)

MAX_PROCS_PER_AGENT = 256
MAX_CALL = 64 << 20  # bytes of one call written to proc/rpc (the tool's args, mostly)
BASE_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
_json = msgspec.json.Encoder()
_call_decoder = msgspec.json.Decoder(CallRequest)
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def denied() -> NinePError:
    return NinePError("permission denied")


# Files whose content a read at offset 0 renders again (the Plan 9 manner of a synthetic
# file): a client that keeps one open reads the current value in one round trip, as
# olliefs reads agent/rev before each model request.
_LIVE = frozenset({"rev", "loaded"})


@dataclass(eq=False)
class Proc:
    n: int
    agent: Agent
    started: bool = False
    result: bytes | None = None
    done: trio.Event = field(default_factory=trio.Event)
    scope: trio.CancelScope | None = None

    def kill(self) -> None:
        if self.scope is not None:
            self.scope.cancel()
        elif not self.started:  # nothing runs: a reader waiting for the call is answered
            self.started = True
            self.result = _json.encode(
                CallResult([Content("cancelled: the call was killed before it started")], True)
            )
            self.done.set()


@dataclass(eq=False)
class Agent:
    id: str
    tools: AgentTools
    procs: dict[int, Proc] = field(default_factory=dict)
    next_n: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    connections: int = 0
    rpcs: int = 0  # calls running through proc/rpc (they have no Proc)


@dataclass(frozen=True, eq=False)
class Node:
    """A path in one agent's view. ``kind`` names its entry in `TREE`; ``arg`` the tool,
    ``proc`` the call, of the paths beneath ``tools/<name>`` and ``proc/N``."""

    agent: Agent
    kind: str
    name: str
    arg: str = ""
    proc: Proc | None = None

    @property
    def is_dir(self) -> bool:
        return TREE[self.kind].is_dir


@dataclass(eq=False)
class Handle:
    node: Node
    mode: int
    data: bytes | None = None  # snapshot for small read-only files
    proc: Proc | None = None  # proc/new: the proc this open created
    consumed: bool = False  # proc/N/result: read to its end (the proc goes at clunk)
    request: bytearray | None = None  # proc/rpc: the call written, not yet started
    result: bytes | None = None  # proc/rpc: the last call's result
    running: bool = False  # proc/rpc: a read is running the call


# ---- the tree, declared once ------------------------------------------------------------
#
# Each kind of node says what it is and does; `ToolServer` serves whatever is declared,
# so a new file (or a new kind of directory) is one entry here plus the method behind it,
# not a branch in each of walk, readdir, open, read and write.

Snapshot = Callable[["ToolServer", Node], bytes]
Reader = Callable[["ToolServer", Handle, int, int], Awaitable[bytes]]
Writer = Callable[["ToolServer", Handle, int, bytes], None]
Children = Callable[["ToolServer", Node], list[Node]]
Child = Callable[["ToolServer", Node, str], Node | None]


@dataclass(frozen=True)
class Kind:
    """One kind of node of an agent's tree.

    A directory has ``parent`` (the kind ``..`` leads to), fixed ``files`` (name, kind)
    and, beneath ``tools/`` and ``proc/``, ``children``/``child`` for the entries that
    come and go; ``alive`` says whether its fixed files may still be walked to. A file has
    its permission bits and what it does: ``snapshot`` renders it at open (again at
    offset 0 when ``live``), ``read``/``write`` answer instead, ``opened`` runs at
    open."""

    is_dir: bool = False
    perm: int = 0o400
    parent: str | None = None
    files: tuple[tuple[str, str], ...] = ()
    children: Children | None = None
    child: Child | None = None
    alive: Callable[[ToolServer, Node], bool] = lambda srv, node: True
    snapshot: Snapshot | None = None
    live: bool = False
    read: Reader | None = None
    write: Writer | None = None
    opened: Callable[[ToolServer, Handle], None] | None = None
    waits: Callable[[Handle], bool] = lambda handle: False


def _dir(
    parent: str,
    files: tuple[tuple[str, str], ...] = (),
    children: Children | None = None,
    child: Child | None = None,
    alive: Callable[[ToolServer, Node], bool] = lambda srv, node: True,
) -> Kind:
    return Kind(True, 0o500, parent, files, children, child, alive)


class ToolServer(BaseFileSystem[Node, Handle]):
    """The application side of the 9P server: a tree per agent over one tool registry."""

    def __init__(
        self,
        key: bytes,
        registry: ToolRegistry,
        *,
        sandbox_dirs: list[Path],
        tmp_root: Path,
        nursery: trio.Nursery,
        executor: Executor,
        initial_tools: tuple[str, ...] = (),
        capture_root: Path | None = None,
    ) -> None:
        self.key = key
        self.capture_root = capture_root  # checkpoints (toolsrv.checkpoint)
        self.executor = executor
        self.registry = registry
        self.sandbox_dirs = sandbox_dirs
        self.tmp_root = tmp_root
        self.nursery = nursery
        self.initial_tools = initial_tools
        self.agents: dict[str, Agent] = {}
        self._profiles: dict[str, tuple[tuple[tuple[int, int] | None, ...], sandbox.Profile]] = {}
        self._tmp_made: set[Path] = set()
        self.started = time.time()
        self.mcp: McpServers | None = None  # MCP servers' tools (toolsrv.mcp), if configured

    # ---- identity -------------------------------------------------------------------

    @staticmethod
    def _qid_path(key: tuple[object, ...]) -> int:
        """A stable 64-bit id for a path: derived, so no table grows with every proc."""
        return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest())

    def stat(self, node: Node) -> Stat:
        key: tuple[object, ...] = (node.agent.id, node.kind, node.arg)
        if node.proc is not None:
            key = (*key, node.proc.n)
        kind = TREE[node.kind]
        qtype = QTDIR if kind.is_dir else QTFILE
        mode = (DMDIR | kind.perm) if kind.is_dir else kind.perm
        now = int(self.started)
        return Stat(
            type=0,
            dev=0,
            qid=Qid(qtype, 0, self._qid_path(key)),
            mode=mode,
            atime=now,
            mtime=now,
            length=0,
            name=node.name,
            uid=node.agent.id,
            gid=node.agent.id,
            muid=node.agent.id,
        )

    def waits(self, op: int, node: Node | None, handle: Handle | None) -> bool:
        """Only reads wait: of a result not there yet, and of proc/rpc when they start a
        call. Everything else here is bookkeeping in memory (and a few stats of the
        tool dirs), answered by the 9P reader at once."""
        if op != TREAD or handle is None:
            return False
        return TREE[handle.node.kind].waits(handle)

    # ---- attach and walk ------------------------------------------------------------

    async def attach(self, uname: str, aname: str) -> Node:
        if not AGENT_ID_RE.fullmatch(uname) or not check_secret(self.key, uname, aname):
            log.info("attach refused for %r", uname)
            raise NinePError("authentication failed")
        agent = self.agents.get(uname)
        if agent is None:
            agent = Agent(uname, AgentTools(self.registry, self.initial_tools))
            self.agents[uname] = agent
        agent.connections += 1
        return Node(agent, "root", "/")

    def detach(self, root: Node) -> None:
        """Called when a connection that attached ``root`` goes away."""
        agent = root.agent
        agent.connections -= 1
        if agent.connections <= 0:
            for proc in list(agent.procs.values()):
                proc.kill()
            agent.procs.clear()
            # The client re-pushes its loaded tools when it attaches again.
            if self.agents.get(agent.id) is agent:
                del self.agents[agent.id]

    async def walk(self, node: Node, name: str) -> Node:
        kind = TREE[node.kind]
        if not kind.is_dir:
            raise NinePError("not a directory")
        if name == "..":
            assert kind.parent is not None
            return Node(node.agent, kind.parent, NAMES.get(kind.parent, kind.parent))
        for fname, fkind in kind.files:
            if fname == name:
                if not kind.alive(self, node):
                    break
                return Node(node.agent, fkind, fname, arg=node.arg, proc=node.proc)
        else:
            found = kind.child(self, node, name) if kind.child is not None else None
            if found is not None:
                return found
        raise NinePError("file not found")

    async def readdir(self, node: Node) -> list[Stat]:
        kind = TREE[node.kind]
        if not kind.is_dir:
            raise NinePError("not a directory")
        if node.kind == "tools" and self.mcp is not None:
            await self.mcp.settled()  # a server's new file lists its tools first (toolsrv.mcp)
        children = [
            Node(node.agent, fkind, fname, arg=node.arg, proc=node.proc)
            for fname, fkind in kind.files
        ]
        if kind.children is not None:
            children += kind.children(self, node)
        return [self.stat(c) for c in children]

    # ---- open, read, write ----------------------------------------------------------

    async def open(self, node: Node, mode: int) -> Handle:
        kind = TREE[node.kind]
        if kind.is_dir:
            if mode & 3 != OREAD:
                raise NinePError("is a directory")
            return Handle(node, mode)
        writing = mode & 3 != OREAD or bool(mode & OTRUNC)
        reading = mode & 3 != 1  # OWRITE
        if (writing and not kind.perm & 0o200) or (reading and not kind.perm & 0o400):
            raise denied()
        h = Handle(node, mode)
        if kind.opened is not None:
            kind.opened(self, h)
        elif kind.snapshot is not None and reading:
            h.data = kind.snapshot(self, node)
        return h

    async def read(self, handle: Handle, offset: int, count: int) -> bytes:
        kind = TREE[handle.node.kind]
        if kind.read is not None:
            return await kind.read(self, handle, offset, count)
        if handle.data is None:
            raise denied()
        if offset == 0 and kind.live and kind.snapshot is not None:
            handle.data = kind.snapshot(self, handle.node)  # what it says now, to a fid kept open
        return handle.data[offset : offset + count]

    async def write(self, handle: Handle, offset: int, data: bytes) -> int:
        kind = TREE[handle.node.kind]
        if kind.write is None:
            raise denied()
        kind.write(self, handle, offset, data)
        return len(data)

    # ---- what the files do ----------------------------------------------------------

    def _tools(self, node: Node) -> list[Node]:
        return [Node(node.agent, "tool", n, arg=n) for n in sorted(self.registry.tools())]

    def _tool_named(self, node: Node, name: str) -> Node | None:
        return Node(node.agent, "tool", name, arg=name) if name in self.registry else None

    def _procs(self, node: Node) -> list[Node]:
        procs = sorted(node.agent.procs.items())
        return [Node(node.agent, "proc", str(n), proc=p) for n, p in procs]

    def _proc_named(self, node: Node, name: str) -> Node | None:
        procs = node.agent.procs
        if name.isdigit() and int(name) in procs:
            return Node(node.agent, "proc", name, proc=procs[int(name)])
        return None

    def _meta(self, node: Node) -> bytes:
        return _json.encode(self._tool(node.arg).meta()) + b"\n"

    def _schema(self, node: Node) -> bytes:
        return _json.encode(self._tool(node.arg).args) + b"\n"

    def _loaded(self, node: Node) -> bytes:
        return "".join(f"{n}\n" for n in node.agent.tools.loaded()).encode()

    def _rev(self, node: Node) -> bytes:
        return f"{node.agent.tools.rev}\n".encode()

    def _mcp_status(self, node: Node) -> bytes:
        return b"" if self.mcp is None else self.mcp.status().encode()

    def _opened_new(self, handle: Handle) -> None:
        handle.proc = self._new_proc(handle.node.agent)
        handle.data = f"{handle.proc.n}\n".encode()

    @staticmethod
    def _text(data: bytes) -> str:
        try:
            return data.decode()
        except UnicodeDecodeError:
            raise NinePError("not valid UTF-8") from None

    def _write_ctl(self, handle: Handle, offset: int, data: bytes) -> None:
        self._agent_ctl(handle.node.agent, self._text(data))

    def _write_call(self, handle: Handle, offset: int, data: bytes) -> None:
        self._text(data)
        assert handle.node.proc is not None
        self._start(handle.node.proc, data)

    def _write_procctl(self, handle: Handle, offset: int, data: bytes) -> None:
        cmd = self._text(data).strip()
        if cmd != "kill":
            raise NinePError(f"unknown command: {cmd!r} (proc ctl takes: kill)")
        assert handle.node.proc is not None
        handle.node.proc.kill()

    async def _read_result(self, handle: Handle, offset: int, count: int) -> bytes:
        proc = handle.node.proc
        assert proc is not None
        # A read may come before the call is written (a client that pipelines the
        # two): it waits for the call to start and end, like a pipe for its writer.
        if proc.result is None:
            try:
                await proc.done.wait()
            except trio.Cancelled:
                # Tflush of a pending result read: the call dies (SPEC 5).
                log.debug("result read of %s/%d flushed: killing", proc.agent.id, proc.n)
                proc.kill()
                raise
        data = proc.result or b""
        handle.consumed = offset + count >= len(data)
        return data[offset : offset + count]

    def _tool(self, name: str) -> ToolInfo:
        try:
            return self.registry.get(name)
        except KeyError:
            raise NinePError("file not found") from None

    def _new_proc(self, agent: Agent) -> Proc:
        # At the bound, forget the oldest finished procs nobody read: a bound, not a leak.
        for n in [n for n, p in agent.procs.items() if p.done.is_set()]:
            if len(agent.procs) < MAX_PROCS_PER_AGENT:
                break
            del agent.procs[n]
        if len(agent.procs) >= MAX_PROCS_PER_AGENT:
            raise NinePError("too many procs")
        proc = Proc(next(agent.next_n), agent)
        agent.procs[proc.n] = proc
        return proc

    def _agent_ctl(self, agent: Agent, text: str) -> None:
        """Lines applied in order; all are checked before any is applied."""
        actions: list[Callable[[], None]] = []
        for line in text.splitlines():
            verb, _, name = line.strip().partition(" ")
            name = name.strip()
            if not verb:
                continue
            if verb not in ("load", "unload") or not name:
                raise NinePError(f"bad command: {line.strip()!r} (load NAME | unload NAME)")
            if verb == "load" and name not in self.registry:
                raise NinePError(f"unknown tool: {name}")
            if verb == "unload" and name not in agent.tools.loaded():
                raise NinePError(f"not loaded: {name}")
            fn = agent.tools.load if verb == "load" else agent.tools.unload
            actions.append(lambda fn=fn, name=name: fn(name))  # type: ignore[misc]
        try:
            for act in actions:
                act()
        except ToolError as err:
            raise NinePError(str(err)) from None

    # ---- proc/rpc ---------------------------------------------------------------------

    def _rpc_write(self, handle: Handle, offset: int, data: bytes) -> None:
        if handle.running:
            raise NinePError("a call is running on this fid (one at a time per fid)")
        if offset == 0:
            handle.request = bytearray(data)
        elif handle.request is not None and offset == len(handle.request):
            handle.request += data
        else:
            have = 0 if handle.request is None else len(handle.request)
            raise NinePError(f"call written at offset {offset}: 0 or {have} expected")
        if len(handle.request) > MAX_CALL:
            handle.request = None
            raise NinePError(f"call too large (more than {MAX_CALL} bytes)")
        handle.result = None

    async def _rpc_read(self, handle: Handle, offset: int, count: int) -> bytes:
        if handle.running:
            raise NinePError("the call is still running (one read at a time per fid)")
        if handle.request is not None:
            data, handle.request = bytes(handle.request), None
            agent = handle.node.agent
            req, info = self._parse_call(agent, data)
            if agent.rpcs + len(agent.procs) >= MAX_PROCS_PER_AGENT:
                raise NinePError("too many procs")
            n = next(agent.next_n)
            handle.running = True
            agent.rpcs += 1
            try:
                result = await self._execute(agent, info, req)
            except Exception as err:  # a bug must not take the server down
                log.exception("call %s/%d failed", agent.id, n)
                result = CallResult([Content(f"internal error: {type(err).__name__}: {err}")], True)
            finally:
                handle.running = False
                agent.rpcs -= 1
            handle.result = _json.encode(result)
        if handle.result is None:
            raise NinePError("no call written (write the call, then read its result)")
        return handle.result[offset : offset + count]

    # ---- calls ----------------------------------------------------------------------

    def _parse_call(self, agent: Agent, data: bytes) -> tuple[CallRequest, ToolInfo]:
        try:
            req = _call_decoder.decode(data)
        except msgspec.DecodeError as err:
            raise NinePError(f"bad call: {err}") from None
        if req.tool not in agent.tools.loaded():
            raise NinePError(f"tool not loaded: {req.tool}")
        info = self._tool(req.tool)
        if not os.path.isabs(req.cwd) or not os.path.isdir(req.cwd):
            raise NinePError(f"bad call: cwd must be an existing absolute directory: {req.cwd!r}")
        return req, info

    def _start(self, proc: Proc, data: bytes) -> None:
        if proc.started:
            raise NinePError("call already started (or killed)")
        req, info = self._parse_call(proc.agent, data)
        proc.started = True
        proc.scope = trio.CancelScope()
        self.nursery.start_soon(self._run, proc, info, req, name=f"call {proc.agent.id}/{proc.n}")

    async def _run(self, proc: Proc, info: ToolInfo, req: CallRequest) -> None:
        assert proc.scope is not None
        result = CallResult([Content("cancelled: the call was killed before it ended")], True)
        try:
            with proc.scope:
                result = await self._execute(proc.agent, info, req)
        except Exception as err:  # a bug must not take the server down
            log.exception("call %s/%d failed", proc.agent.id, proc.n)
            result = CallResult([Content(f"internal error: {type(err).__name__}: {err}")], True)
        finally:
            proc.result = _json.encode(result)
            proc.done.set()

    def _env(self, req: CallRequest, agent: Agent, tmp: Path) -> dict[str, str]:
        env = {k: v for k, v in req.env.items() if k in CALL_ENV_KEYS}
        env.update(
            PATH=os.environ.get("PATH", BASE_PATH),
            HOME=os.environ.get("HOME", "/"),
            TMPDIR=str(tmp),
            OLLIE_TMP=str(tmp),
            OLLIE_CWD=req.cwd,
        )
        env.setdefault("LANG", "C.UTF-8")
        env.setdefault("OLLIE_AGENT", agent.id)
        return env

    def tmp_dir(self, req: CallRequest, agent: Agent) -> Path:
        """The session's scratch dir: writable by its tools, private to it."""
        owner = req.env.get("OLLIE_SESSION_ID") or agent.id
        tmp = self.tmp_root / _SAFE.sub("_", owner)
        if tmp not in self._tmp_made or not tmp.is_dir():
            tmp.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._tmp_made.add(tmp)
        return tmp

    def profile(self, name: str) -> sandbox.Profile:
        """The sandbox profile, parsed again only when one of its candidate files changed."""
        stamp: list[tuple[int, int] | None] = []
        for d in self.sandbox_dirs:
            try:
                st = os.stat(d / f"{name}.toml")
                stamp.append((st.st_mtime_ns, st.st_size))
            except (OSError, ValueError):
                stamp.append(None)
        key = tuple(stamp)
        hit = self._profiles.get(name)
        if hit is not None and hit[0] == key:
            return hit[1]
        prof = sandbox.load_profile(self.sandbox_dirs, name)
        self._profiles[name] = (key, prof)
        return prof

    async def _execute(self, agent: Agent, info: ToolInfo, req: CallRequest) -> CallResult:
        if info.server and self.mcp is not None:  # a tool of an MCP server (toolsrv.mcp)
            return await self.mcp.call(info, req.args, self.tmp_dir(req, agent))
        try:
            profile = self.profile(info.sandbox)
        except sandbox.SandboxError as err:
            return CallResult([Content(f"sandbox profile {info.sandbox!r}: {err}")], True)
        tmp = self.tmp_dir(req, agent)
        timeout = min(info.timeout, profile.timeout_cap)
        overlay = await checkpoint.begin(self.capture_root, req, profile.unsandboxed)
        try:
            res = await self.executor.run(
                [info.path],
                stdin=_json.encode(req.args),
                cwd=req.cwd,
                env=self._env(req, agent, tmp),
                write_roots=[req.cwd],
                tmp_dir=str(tmp),
                profile=profile,
                timeout=timeout,
                capture=overlay,
            )
        except sandbox.SandboxError as err:
            return CallResult([Content(str(err))], True)
        finally:
            seq = await checkpoint.end(overlay)
        result = render_result(res, timeout, info.sandbox)
        return msgspec.structs.replace(result, checkpoint=seq) if seq else result

    async def clunk(self, handle: Handle) -> None:
        node = handle.node
        proc = node.proc
        if node.kind == "result" and proc is not None and handle.consumed:
            # The result was read to its end: the proc has served its purpose.
            proc.agent.procs.pop(proc.n, None)

    async def remove(self, node: Node) -> None:
        if node.kind != "proc" or node.proc is None:
            raise denied()
        node.proc.kill()
        node.agent.procs.pop(node.proc.n, None)


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def render_result(res: ExecResult, timeout: float, profile: str = "default") -> CallResult:
    """One text for the model: stdout, then what went wrong, said plainly (``profile``:
    the sandbox profile the call ran with, named where its limits are the reason)."""
    out = res.stdout.decode(errors="replace")
    err = res.stderr.decode(errors="replace")
    notes: list[str] = []
    is_error = False
    if res.error is not None:
        return CallResult([Content(res.error)], True)
    if res.oom_killed:
        notes.append(
            "killed: the call went over its memory limit of "
            f"{_size(res.memory_max)} (memory_max in sandbox/{profile}.toml)"
        )
        is_error = True
    if res.cancelled:
        notes.append("cancelled: the call was killed (process group ended)")
        is_error = True
    elif res.timed_out:
        notes.append(f"timed out after {timeout:g}s: process group killed")
        is_error = True
    elif res.signal is not None and not res.oom_killed:
        notes.append(f"killed by signal {res.signal}")
        is_error = True
    elif res.exit_code:
        is_error = True
    if res.stdout_dropped:
        notes.append(f"[stdout cut: {res.stdout_dropped} more bytes were dropped]")
    if res.stderr_dropped:
        notes.append(f"[stderr cut: {res.stderr_dropped} more bytes were dropped]")
    parts = [out.rstrip("\n")] if out.strip() else []
    if err.strip() and (is_error or not out.strip()):
        parts.append(err.rstrip("\n"))
    if res.exit_code and not res.timed_out and not res.cancelled:
        if not err.strip() and not out.strip():
            notes.append(f"exit status {res.exit_code}")
    parts.extend(notes)
    return CallResult([Content("\n".join(parts))], is_error)


def _tool_alive(srv: ToolServer, node: Node) -> bool:
    return node.arg in srv.registry


def _proc_alive(srv: ToolServer, node: Node) -> bool:
    return node.proc is not None and node.proc.n in node.agent.procs


def _result_waits(handle: Handle) -> bool:
    proc = handle.node.proc
    return proc is None or proc.result is None


TREE: dict[str, Kind] = {
    "root": _dir(
        "root", (("tools", "tools"), ("agent", "agent"), ("proc", "procdir"), ("mcp", "mcp"))
    ),
    # The MCP servers: listed, being listed or failed, and why (`McpServers.status`).
    "mcp": Kind(snapshot=ToolServer._mcp_status, live=True),
    # A task per listing: it may wait for an MCP server's tools to be listed.
    "tools": replace(
        _dir("root", children=ToolServer._tools, child=ToolServer._tool_named),
        waits=lambda handle: True,
    ),
    "tool": _dir("tools", (("meta", "meta"), ("schema", "schema")), alive=_tool_alive),
    "meta": Kind(snapshot=ToolServer._meta),
    "schema": Kind(snapshot=ToolServer._schema),
    "agent": _dir("root", (("ctl", "ctl"), ("loaded", "loaded"), ("rev", "rev"))),
    "ctl": Kind(perm=0o200, write=ToolServer._write_ctl),
    # Rendered again by a read at offset 0 (the Plan 9 manner of a synthetic file): a
    # client that keeps one open reads the current value in one round trip, as olliefs
    # reads agent/rev before each model request.
    "loaded": Kind(snapshot=ToolServer._loaded, live=True),
    "rev": Kind(snapshot=ToolServer._rev, live=True),
    "procdir": _dir(
        "root",
        (("new", "new"), ("rpc", "rpc")),
        children=ToolServer._procs,
        child=ToolServer._proc_named,
    ),
    "new": Kind(opened=ToolServer._opened_new),
    "rpc": Kind(
        perm=0o600,
        read=ToolServer._rpc_read,
        write=ToolServer._rpc_write,
        waits=lambda handle: handle.request is not None,
    ),
    "proc": _dir(
        "procdir", (("call", "call"), ("result", "result"), ("ctl", "procctl")), alive=_proc_alive
    ),
    "call": Kind(perm=0o200, write=ToolServer._write_call),
    "result": Kind(read=ToolServer._read_result, waits=_result_waits),
    "procctl": Kind(perm=0o200, write=ToolServer._write_procctl),
}
"""Every kind of node of an agent's tree (the module docstring draws it)."""

NAMES = {"root": "/", "tools": "tools", "procdir": "proc"}
"""The name a directory reached by ``..`` has."""
