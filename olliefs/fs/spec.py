"""The file tree, declared once (SPEC 3).

Each entry maps a name to the node kind and the runtime call behind it. The frontends
(``fuse.py``, and ``export9p.py`` for ``--9p``) only translate this tree; adding a file is one
line here plus the runtime method it calls.
"""

from __future__ import annotations

import os
import re
import weakref
from collections.abc import Awaitable, Callable, Hashable, Iterable

from olliefs.caller import Caller, mcp_guard, tool_guard
from olliefs.errors import DiskError, NotFound, OllieError
from olliefs.fs.disk import Folder, Generated, Rules, Skills, not_partial
from olliefs.fs.nodes import (
    CACHED_TTL,
    STARTED,
    Collected,
    Control,
    Dir,
    DiskDir,
    DiskFile,
    FifoOut,
    LogFile,
    Node,
    PromptIn,
    Query,
    Script,
    Stamp,
    StateWait,
    StaticDir,
    Text,
    Watchable,
)
from olliefs.fs.profiles import ProfilesDir
from olliefs.session import checkpoints
from olliefs.session.catalogue import CATALOGUE_MAX_AGE
from olliefs.session.commands import help_text
from olliefs.session.registry import NEW_TEMPLATE, Dormant, Registry
from olliefs.session.session import MAX_PROMPT, Session
from olliefs.settings import shipped_dir

HELP = """\
olliefs: an LLM agent runtime whose interface is this file tree.

  echo cwd=$PWD name=demo > s/new     create a session (keys: name cwd backend model agent)
  echo 'fix the tests' > s/demo/prompt
  cat s/demo/stream                    follow it live (Ctrl-C to leave)
  cat s/demo/chat                      the conversation so far
  echo stop > s/demo/ctl               interrupt; also: kill rn backend model cwd clear
  echo tool_load file_read > s/demo/ctl  give the agent a tool (t/idx lists them all)
  cat s/demo/statewait                 wait for the state to change
  rm -r s/demo                         end it (its journal goes to the transcripts)

ctl commands:
"""
HELP_END = "\nSee ollie(1) and ollie(5).\n"


def session_files(reg: Registry, s: Session, stamps: dict[str, Stamp]) -> dict[str, Node]:
    u = s.uid
    a = s.agent
    live = lambda: not s.closed  # noqa: E731
    fresh = reg.fresh_catalogue  # what toolsrv serves, read again if older than a second

    def stamp(name: str) -> Stamp:
        got = stamps.get(name)
        if got is None:
            got = stamps[name] = Stamp(s.created)
        return got

    # What each text's size is kept by (``Node.attrs_version``): the session's changes,
    # and for some what other parts hold (toolsrv's catalogue, the subagents' costs).
    version = s.files_version
    tools = reg.tools

    def with_tools() -> Hashable:
        return (version(), tools.version)

    def prompt_version() -> Hashable | None:
        # Before the runtime is built the prompt is the profile's file, read as it is.
        return None if a.prompt is None else with_tools()

    def cost_version() -> Hashable:
        return (version(), reg.generation, reg.costs)

    def text(
        name: str,
        render: Callable[[], str],
        refresh: Callable[[], Awaitable[None]] | None = None,
        kept: Callable[[], Hashable | None] = version,
    ) -> Text:
        return Text(("s", u, name), render, live, refresh, stamp(name), version=kept)

    return {
        "prompt": PromptIn(("s", u, "prompt"), s.submit, s.refused, MAX_PROMPT, live=live),
        "fifo.in": PromptIn(("s", u, "fifo.in"), s.submit, s.refused, MAX_PROMPT, live=live),
        "fifo.out": FifoOut(
            ("s", u, "fifo.out"),
            s.pop_queued,
            s.queued.park,
            lambda: s.closed,
            lambda: bool(s.queue),
        ),
        "plan": Collected(
            ("s", u, "plan"),
            s.set_plan,
            lambda: s.plan,
            s.refused,
            live,
            stamp("plan"),
            version=version,
        ),
        # Texts of one value are kept by that value itself.
        "err": text(
            "err", lambda: s.last_error + ("\n" if s.last_error else ""), kept=lambda: s.last_error
        ),
        "prompt.prev": text(
            "prompt.prev",
            lambda: s.prompt_prev + ("\n" if s.prompt_prev else ""),
            kept=lambda: s.prompt_prev,
        ),
        "chat": LogFile(("s", u, "chat"), s.chat),
        "stream": LogFile(("s", u, "stream"), s.chat, blocking=True),
        "events": LogFile(("s", u, "events"), s.events, blocking=True),
        "state": Text(
            ("s", u, "state"), lambda: s.state.value + "\n", live, None, stamp("state"), s.state
        ),
        "statewait": StateWait(("s", u, "statewait"), s.state, lambda: s.closed),
        "cfg": Control(
            ("s", u, "cfg"),
            s.write_cfg,
            s.cfg_text,
            perm=0o666,
            live=live,
            stamp=stamp("cfg"),
            refused=s.refused,
            version=version,
        ),
        "ctl": Control(
            ("s", u, "ctl"),
            s.ctl,
            live=live,
            stamp=stamp("ctl"),
            refused=s.refused,
            version=_unchanging,
        ),
        "offset": text("offset", lambda: f"{s.renderer.offset}\n", kept=lambda: s.renderer.offset),
        "usage": text("usage", a.history.totals.usage_text),
        "cost": text("cost", lambda: reg.cost_text(s), kept=cost_version),
        # The estimate counts the system prompt (the profile's file until it is built).
        "ctxsz": text("ctxsz", a.ctxsz_text, lambda: reg.fresh_context(s), kept=prompt_version),
        "models": text("models", lambda: s.models_text, lambda: reg.fresh_models(s)),
        "context": text("context", a.context_text),
        "env": text("env", s.env_text),
        "tools": text("tools", a.tools_text, fresh, kept=with_tools),
        "systemprompt": text(
            "systemprompt", a.systemprompt_text, lambda: _ready(s, fresh), kept=prompt_version
        ),
        "tail": Script(
            ("s", u, "tail"), s.tail_script, live, stamp=stamp("tail"), version=_unchanging
        ),
        # Written by the daemon only, at a rewind (a record of the session's).
        "branches": DiskDir(
            ("s", u, "branches"), reg.branches_dir(s), "ignore", s.created, version
        ),
        "peer": PeerDir(reg, s),
        "compactions": DiskDir(
            ("s", u, "compactions"), s.compactions_dir(), "ignore", s.created, version
        ),
        "taskstate": text("taskstate", a.taskstate_text),
        "tcct": text("tcct", lambda: f"{a.tool_calls}\n", kept=lambda: a.tool_calls),
        "t": session_tools(reg, s, stamp("t/idx")),
        "checkpoints": CheckpointsDir(reg, s),
        "staged": ViewDir(
            ("s", u, "staged"),
            lambda: {
                "files": Text(("s", u, "staged", "files"), lambda: _staged(reg, s, "files")),
                "diff": Text(("s", u, "staged", "diff"), lambda: _staged(reg, s, "diff")),
            },
            live,
            s.created,
        ),
    }


def _unchanging() -> Hashable:
    return 0


def _staged(reg: Registry, s: Session, what: str) -> str:
    """``staged/files`` and ``staged/diff``: the edits waiting for review."""
    st = checkpoints.store(reg.checkpoints_root(), s.uid)
    rec = checkpoints.staged(st)
    if rec is None:
        return ""
    changes = checkpoints.staged_net(rec)
    if what == "files":
        return checkpoints.files_text(changes)
    return checkpoints.diff_text(st, changes)


class CheckpointsDir(Dir):
    """``checkpoints/``: ``diff`` of the whole session, and one directory per turn that
    changed files (``files``, ``diff``, ``turn``), read from the store toolsrv fills."""

    entry_ttl = 0.0  # a call of the session adds one

    def __init__(self, reg: Registry, s: Session) -> None:
        self.key = ("s", s.uid, "checkpoints")
        self.reg = reg
        self.s = s
        self._st = checkpoints.store(reg.checkpoints_root(), s.uid)

    def _store(self) -> checkpoints.Store:
        return self._st

    def attrs_version(self) -> Hashable:
        # A turn's directory appears when toolsrv wrote its first record, before the
        # call's answer reached the session (whose message is a record of its own);
        # the records' folder's mtime for the rest (a seal, a review).
        try:
            mtime = os.stat(self._st.rec).st_mtime_ns
        except OSError:
            mtime = 0
        return (self.s.revision, mtime)

    def _turn_text(self, turn: int, sealed: bool = False) -> str:
        s = self.s
        if sealed:
            return f"{turn}\t(a conversation since cleared or compacted)\n"
        if turn == 0 or turn > len(s.turn_starts):
            return f"{turn}\t!\n"
        msgs = s.agent.history.messages
        i = s.turn_starts[turn - 1]
        first = msgs[i].content.splitlines()[0] if i < len(msgs) and msgs[i].content else ""
        return f"{turn}\t{first}\n"

    def _one(self, n: int, cp: checkpoints.Checkpoint) -> Node:
        u = self.s.uid
        st = self._store()

        def files() -> str:
            return checkpoints.files_text(checkpoints.net(cp.records))

        def diff() -> str:
            return checkpoints.diff_text(st, checkpoints.net(cp.records))

        key = ("s", u, "checkpoints", str(n))
        return ViewDir(
            key,
            lambda: {
                "files": Text((*key, "files"), files),
                "diff": Text((*key, "diff"), diff),
                "turn": Text((*key, "turn"), lambda: self._turn_text(cp.turn, cp.sealed)),
            },
            lambda: not self.s.closed,
        )

    def _whole(self) -> str:
        st = self._store()
        return checkpoints.diff_text(st, checkpoints.net(st.records()))

    def entries(self) -> Iterable[tuple[str, Node]]:
        cps = checkpoints.checkpoints(self._store())
        out: list[tuple[str, Node]] = [
            ("diff", Text(("s", self.s.uid, "checkpoints", "diff"), self._whole))
        ]
        out += [(str(i), self._one(i, cp)) for i, cp in enumerate(cps, 1)]
        return out

    def valid(self) -> bool:
        return not self.s.closed

    async def unlink(self, name: str) -> None:
        pass  # rm -r of the session goes through

    async def rmdir(self, name: str) -> None:
        pass


class ViewDir(StaticDir):
    """A read-only view inside a session directory: unlink and rmdir succeed and do
    nothing, so ``rm -r`` of the session goes through."""

    fixed_attrs = True  # files only (nlink 2), born with it

    async def unlink(self, name: str) -> None:
        pass

    async def rmdir(self, name: str) -> None:
        pass


async def _ready(s: Session, fresh: Callable[[], Awaitable[None]]) -> None:
    """What ``systemprompt`` shows: the profile's prompt as built (``Session.ready``)."""
    await s.ready()
    await fresh()


class PeerDir(Dir):
    """``peer/``: one file per other session of the family; writing one submits the text
    to that session, prefixed with the sender's id (fire-and-forget: the write returns
    once the peer acknowledged the prompt, not when it answered)."""

    perm = 0o755
    entry_ttl = 0.0  # families change as sessions come and go
    fixed_attrs = True  # files only (nlink 2), the daemon's start as mtime

    def __init__(self, reg: Registry, s: Session) -> None:
        self.key = ("s", s.uid, "peer")
        self.reg = reg
        self.s = s

    def _file(self, other: Session) -> Node:
        sender = self.s
        prefix = f"[from {sender.id}] "

        async def send(text: str, caller: Caller) -> None:
            if not text.strip():
                return
            if other.closed:
                raise NotFound(f"peer {other.id} is gone")
            try:
                await other.submit(prefix + text.strip(), caller)
            except DiskError as err:  # the writer is told too, where it looks
                sender.refused(f"peer {other.id}: {err}")
                raise

        # A refused write is the writer's: its reason goes to this session's err (and
        # chat), where the writer looks, not to the peer, which was never reached (the
        # limit leaves room for the prefix, so the peer never refuses it for its size).
        limit = MAX_PROMPT - len(prefix.encode())
        return PromptIn(("s", self.s.uid, "peer", other.uid), send, sender.refused, limit)

    def entries(self) -> Iterable[tuple[str, Node]]:
        return [(o.id, self._file(o)) for o in self.reg.family(self.s)]

    def lookup(self, name: str) -> Node | None:
        for o in self.reg.family(self.s):
            if o.id == name:
                return self._file(o)
        return None

    async def unlink(self, name: str) -> None:
        pass  # rm -r of the session goes through

    def valid(self) -> bool:
        return not self.s.closed


# The sub-directories of a session directory (its nlink, without building its files).
SESSION_SUBDIRS = ("branches", "peer", "compactions", "t", "checkpoints", "staged")


class SessionDir(StaticDir):
    """``s/<id>/``: unlink inside succeeds and does nothing, so ``rm -r`` reaches rmdir.

    Its name may be cached by the kernel (``entry_ttl``) although ``ctl rn`` and
    ``ctl kill`` change it behind the kernel's back: both wake the session's
    ``presence`` cell, its ``entry_watch()``, at which the frontend checks the name and
    invalidates it if it no longer leads here.
    """

    entry_ttl = CACHED_TTL
    fixed_attrs = True  # empty, born with the session, SESSION_SUBDIRS: a listing of
    # s/ with 1,000 sessions answers 1,000 of them
    presence: Watchable | None = None

    def entry_watch(self) -> Watchable | None:
        return self.presence

    def nlink(self) -> int:
        return 2 + len(SESSION_SUBDIRS)

    def listing_version(self) -> Hashable:
        # The names are declared, the nodes bound to the session for its life: they
        # change only when it ends (and then none is valid any more).
        return self.live()

    async def unlink(self, name: str) -> None:
        pass

    async def rmdir(self, name: str) -> None:
        pass


class SessionsDir(Dir):
    """``s/``: ``new``, ``idx`` and one directory per session."""

    perm = 0o755

    def __init__(self, reg: Registry, stamps: dict[str, Stamp]) -> None:
        self.key = ("s",)
        self.reg = reg
        self.stamps = stamps
        # The stamps of each session's files live as long as the session object.
        self._session_stamps: weakref.WeakKeyDictionary[Session, dict[str, Stamp]] = (
            weakref.WeakKeyDictionary()
        )
        # The node of each live session's directory, made once: a listing of s/ with
        # 1,000 sessions would otherwise make 1,000 of them (and as many weak references).
        self._dirs: dict[str, tuple[Session, SessionDir]] = {}
        # The nodes of sessions listed from the index, not restored yet (by uid).
        self._asleep: dict[str, SessionDir] = {}
        reg.on_kill.append(self._killed)

    def _fixed(self) -> dict[str, Node]:
        reg = self.reg

        async def new(text: str, caller: Caller) -> str:
            try:
                return (await reg.create(text, caller)).id + "\n"
            except OllieError as err:
                reason = str(err)  # the parser's reasons already name s/new
                reg.refused(reason if reason.startswith("s/new: ") else f"s/new: {reason}")
                raise

        return {
            "new": Control(
                ("s", "new"), new, lambda: NEW_TEMPLATE, perm=0o666, refused=reg.refused
            ),
            # Every change of a line of idx (a session's state, cwd, backend or model,
            # a session made, renamed or killed) is an event in the root events log.
            "idx": Text(
                ("s", "idx"),
                reg.idx_text,
                stamp=root_stamp(self.stamps, "s/idx"),
                source=reg.events,
            ),
        }

    def _session_dir(self, s: Session) -> SessionDir:
        got = self._dirs.get(s.uid)
        if got is not None and got[0] is s:
            return got[1]
        d = self._new_session_dir(s)
        self._forget_gone()
        self._dirs[s.uid] = (s, d)
        return d

    def _killed(self, s: Session) -> None:
        got = self._dirs.get(s.uid)
        if got is not None and got[0] is s:
            del self._dirs[s.uid]

    def _forget_gone(self) -> None:
        """Drop the nodes of sessions that went away (each holds its session)."""
        sessions = self.reg.sessions
        if len(self._dirs) >= len(sessions):
            live = {s.uid for s in sessions.values()}
            self._dirs = {uid: got for uid, got in self._dirs.items() if uid in live}

    def _new_session_dir(self, s: Session) -> SessionDir:
        stamps = self._session_stamps.setdefault(s, {})
        d = SessionDir(
            ("s", s.uid),
            lambda: session_files(self.reg, s, stamps),
            lambda: not s.closed,
            born=s.created,
        )
        d.presence = s.presence
        return d

    def _dormant_dir(self, d: Dormant) -> SessionDir:
        """``s/<id>`` of a session not restored yet: listed, looked up and stat'ed from
        its index entry (the same attributes as once restored); looking into it restores
        the session (``Registry.wake``), and it then shows that session's files."""
        uid = d.entry.uid
        node = self._asleep.get(uid)
        if node is not None:
            return node
        reg = self.reg

        def children() -> dict[str, Node]:
            s = reg.wake(d)
            return self._session_dir(s).children() if s is not None else {}

        def live() -> bool:
            if d.session is not None:
                return not d.session.closed
            return reg.dormant.get(d.entry.id) is d

        node = SessionDir(("s", uid), children, live, born=d.entry.created)
        node.presence = d.presence  # the restored session's, for the name's cache
        if len(self._asleep) > len(reg.dormant):
            self._asleep = {u: n for u, n in self._asleep.items() if n.live()}
        self._asleep[uid] = node
        return node

    def nlink(self) -> int:
        return 2 + len(self.reg.sessions) + len(self.reg.dormant)

    def attrs_version(self) -> Hashable:
        return self.reg.generation  # nlink and mtime: the sessions made and gone

    def listing_version(self) -> Hashable:
        # Sessions come, go and are renamed only through the registry, which counts it;
        # a session directory is valid exactly while its session is registered.
        return self.reg.generation

    def mtime(self) -> float:
        return self.reg.changed

    def entries(self) -> Iterable[tuple[str, Node]]:
        yield from self._fixed().items()
        sessions, dormant = self.reg.sessions, self.reg.dormant
        if len(self._dirs) > len(sessions):
            self._forget_gone()
        for sid in sorted([*sessions, *dormant]):
            s = sessions.get(sid)
            yield sid, self._session_dir(s) if s is not None else self._dormant_dir(dormant[sid])

    def lookup(self, name: str) -> Node | None:
        fixed = self._fixed()
        if name in fixed:
            return fixed[name]
        s = self.reg.sessions.get(name)
        if s is not None:
            return self._session_dir(s)
        d = self.reg.dormant.get(name)
        return self._dormant_dir(d) if d is not None else None

    async def rmdir(self, name: str) -> None:
        rest = self.reg.kill(self.reg.get(name))
        if rest is not None:
            await rest

    async def rename(self, old: str, new: str) -> None:
        s = self.reg.get(old)
        try:
            self.reg.rename(s, new)
        except DiskError as err:
            s.refused(f"mv: not renamed: {err}")
            raise
        await s.sync()


def session_tools(reg: Registry, s: Session, stamp: Stamp) -> Dir:
    """``s/<id>/t/``: the tools this agent may load, as the root ``t/`` shows them (``idx``
    and each tool's script, read-only here, where this machine has it), less those the
    profile's allowTools does not permit. Looked at, the profile's runtime is built first
    (a restored session builds it at its first need), so allowTools is the profile's."""
    key = ("s", s.uid, "t")
    live = lambda: not s.closed  # noqa: E731
    permits = s.agent.permits

    def entries() -> dict[str, Node]:
        idx = Text((*key, "idx"), lambda: reg.tools_idx_text(permits), live, stamp=stamp)
        out: dict[str, Node] = {"idx": idx}
        for name in sorted(reg.tools.catalogue):
            path = reg.tool_script(name) if permits(name) else None
            if path is not None:
                out[name] = DiskFile((*key, name), path)
        return out

    return SessionToolsDir(
        key, entries, live, born=s.created, refresh=lambda: _ready(s, reg.fresh_catalogue)
    )


class SessionToolsDir(StaticDir):
    """Removal inside succeeds and does nothing, so that ``rm -r s/<id>`` reaches the
    session's rmdir (SPEC 3.7), as in the other directories of a session."""

    fixed_attrs = True  # files only (nlink 2), born with the session

    async def unlink(self, name: str) -> None:
        pass

    async def rmdir(self, name: str) -> None:
        pass


def root_stamp(stamps: dict[str, Stamp], name: str) -> Stamp:
    got = stamps.get(name)
    if got is None:
        got = stamps[name] = Stamp(STARTED)
    return got


# ---- folders on disk (SPEC 3.1; their node kinds are in disk.py) ----------------------

TOOL_NAME = re.compile(r"[a-z][a-z0-9_]*")


def disk_dirs(reg: Registry) -> dict[str, Node]:
    """m/ tmp/ t/ p/ sk/ tr/ u/ x/: the user's files over the shipped ones, by name."""
    p, shipped = reg.paths, shipped_dir()
    data = Rules(writable=True, follow=False)  # tools write m/: never follow a symlink

    async def tools_changed(names: set[str]) -> None:
        # Written through t/: ask toolsrv now (a tool is named by its file minus suffix).
        probe = sorted(
            {n for n in (os.path.splitext(f)[0] for f in names) if TOOL_NAME.fullmatch(n)}
        )
        await reg.refresh_tools(0.0 if names else CATALOGUE_MAX_AGE, probe)

    def scripts(kind: str) -> Folder:
        return Folder(
            (kind,),
            p.config / "scripts" / kind,
            [shipped / "scripts" / kind],
            Rules(executable=True),
        )

    tools = Folder(
        ("t",),
        p.config / "tools",
        [shipped / "tools"],
        Rules(writable=True, new_mode=0o755, guard=tool_guard),
        extra=lambda: {"idx": tools_idx},
        refresh=tools_changed,
        refused=reg.refused,
    )
    # Opening idx brings the catalogue up to date as a lookup in t/ does.
    tools_idx = Generated(("t", "idx"), reg.tools_idx_text, refresh=tools.prepare)
    # MCP servers' files (toolsrv.mcp): config mcp/<name>.json, private (env may hold a
    # token); toolsrv sees a change at its next look and lists the server again. Its idx:
    # each server's state and why it failed, read with the catalogue (toolsrv's mcp).
    mcp_files = Folder(
        ("mcp",),
        p.config / "mcp",
        rules=Rules(writable=True, new_mode=0o600, guard=mcp_guard),
        extra=lambda: {"idx": mcp_idx},
        refused=reg.refused,
    )
    mcp_idx = Generated(("mcp", "idx"), reg.mcp_idx_text, refresh=reg.refresh_mcp)
    return {
        "m": Folder(("m",), p.memory, rules=data),
        "tmp": Folder(("tmp",), p.scratch, rules=Rules(writable=True, follow=False, tree=True)),
        "t": tools,
        "mcp": mcp_files,
        "p": Folder(("p",), p.config / "prompts", [shipped / "prompts"]),
        "sk": Skills(("sk",), p.config / "skills", reg.refused),
        "tr": Folder(
            ("tr",), p.transcripts, rules=Rules(removable=True, follow=False, shown=not_partial)
        ),
        "u": scripts("u"),
        "x": scripts("x"),
    }


def root(reg: Registry) -> Dir:
    stamps: dict[str, Stamp] = {}
    sessions = SessionsDir(reg, stamps)
    disk = disk_dirs(reg)  # made once: each folder keeps the nodes the kernel holds
    profiles = ProfilesDir(reg.paths.config / "agents", shipped_dir() / "profiles", reg.refused)

    def text(name: str, render: Callable[[], str]) -> Text:
        return Text((name,), render, stamp=root_stamp(stamps, name))

    return StaticDir(
        ("/",),
        lambda: {
            "backends": text("backends", reg.backends_text),
            "help": text("help", lambda: HELP + help_text() + HELP_END),
            "complete": Query(("complete",), reg.completer.check, reg.completer.ask, reg.refused),
            "err": text("err", lambda: reg.last_error + ("\n" if reg.last_error else "")),
            "events": LogFile(("events",), reg.events, blocking=True),
            "s": sessions,
            "a": profiles,
            **disk,
        },
        born=STARTED,
    )
