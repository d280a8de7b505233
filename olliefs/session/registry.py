"""All sessions of one daemon: creation, naming, removal and restore after a restart."""

from __future__ import annotations

import gc
import logging
import os
import re
import secrets
import shutil
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from olliefs.agent.agent import Services
from olliefs.agent.compact import checkpoint as checkpoint_messages
from olliefs.agent.config import Cfg, resolve_cwd
from olliefs.agent.events import Event, encode_line
from olliefs.agent.runtime import ToolLink
from olliefs.caller import USER, Caller
from olliefs.errors import (
    Busy,
    DiskError,
    Exists,
    InvalidRequest,
    NotFound,
    disk_error,
    short_reason,
)
from olliefs.live import GrowingLog, StateCell
from olliefs.session import checkpoints, persist, views
from olliefs.session import index as session_index
from olliefs.session.catalogue import Backends, Profiles, Tools
from olliefs.session.commands import split_request
from olliefs.session.complete import Completer
from olliefs.session.edits import Edits
from olliefs.session.session import Session, journal_path
from olliefs.settings import Paths
from olliefs.toolclient.spawn import Toolsrv

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

NEW_KEYS = ("name", "cwd", "backend", "model", "agent")
NEW_TEMPLATE = "".join(f"{k}=\n" for k in NEW_KEYS)
RESERVED = {"new", "idx"}
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
# The daemon's own attach to toolsrv, for t/idx and tool metadata (never a session uid,
# which always holds a '-').
TREE_AGENT = "olliefs_tree"
PROFILE_PARAMS = (
    "edits",
    "maxTokens",
    "temperature",
    "frequencyPenalty",
    "presencePenalty",
    "thinkingBudget",
    "toolsrv",
)
"""Profile keys that are also cfg keys: a new session takes them from its profile."""
SUB = views.SUB
RESTORE_STARTS = 32  # restored sessions whose tasks start in one pass of the event loop


def new_uid() -> str:
    return f"{time.time_ns()}-{secrets.token_hex(3)}"


class Registry:
    def __init__(
        self,
        paths: Paths,
        settings: Mapping[str, str],
        mountpoint: str,
        nursery: trio.Nursery,
    ) -> None:
        self.paths = paths
        self.settings = dict(settings)
        self.mountpoint = mountpoint
        self._nursery = nursery
        self.sessions: dict[str, Session] = {}
        # Saved sessions listed from the index and restored at their first use (``wake``).
        self.dormant: dict[str, Dormant] = {}
        self._indexed = False  # the index was written (at the stop)
        self._reserved: set[str] = set()  # names of sessions being created
        self.max_depth = _int(settings.get("OLLIE_SUBAGENT_DEPTH"), 3)
        self.last_error = ""  # the root ``err`` file: last refused write outside a session
        self.changed = time.time()  # when s/ last gained or lost a session
        # Counts every change of which sessions s/ lists under which names (made,
        # renamed, killed, closed): the tree reuses a listing of s/ while it holds.
        self.generation = 0
        # Counts the changes of any session's cost: a ``cost`` file shows its subagents'.
        self.costs = 0
        self.on_kill: list[Callable[[Session], None]] = []  # called as each one goes
        self.on_start: list[Callable[[Session], None]] = []  # each new one (not restored)
        # Every session object not yet freed, killed ones included (for the leak tests).
        self.alive: weakref.WeakSet[Session] = weakref.WeakSet()
        self.logs_dir = paths.state / "logs"
        self._old_logs = _set_aside(self.logs_dir)
        self.logs_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._logs = str(self.logs_dir)
        self.events = GrowingLog(self.logs_dir / "events")
        self.backends = Backends(self.settings, _int(settings.get("OLLIE_CONTEXT_LENGTH"), 128000))
        self.default_backend = settings.get("OLLIE_BACKEND") or "openai"
        # The root ``complete`` file: code completion on the same backends.
        self.completer = Completer(lambda: self.backends.pool, self.settings, nursery, self.refused)
        self.toolsrv = Toolsrv(paths, self.settings, nursery)
        self._tree_link = ToolLink(self.toolsrv, TREE_AGENT, [])
        self._shell_links: dict[str, ToolLink] = {}
        self._tree_link.bind(nursery)
        self.profiles = Profiles(paths)
        self.tools = Tools(paths, self._tree_link)
        # What sessions (``SessionHost``), the tree and the commands ask of the three.
        self.backend = self.backends.backend
        self.context_length = self.backends.context_length
        self.check_backend = self.backends.check_backend
        self.fresh_models = self.backends.fresh_models
        self.models_command = self.backends.models_command
        self.build_runtime = self.profiles.build_runtime
        self.check_agent = self.profiles.check_agent
        self.profile = self.profiles.profile
        self.profile_tools = self.profiles.profile_tools
        self.profile_prompt = self.profiles.profile_prompt
        self.refresh_tools = self.tools.refresh_tools
        self.fresh_catalogue = self.tools.fresh_catalogue
        self.tool_meta = self.tools.tool_meta
        self.known_tools = self.tools.known_tools
        self.tools_idx_text = self.tools.tools_idx_text
        self.mcp_idx_text = self.tools.mcp_idx_text
        self.refresh_mcp = self.tools.refresh_mcp
        self.tool_script = self.tools.tool_script
        self.edits = Edits(self.checkpoints_root(), self.profile, self._conflict)
        self.check_rewind = self.edits.check_rewind
        self.trim_checkpoints = self.edits.trim_checkpoints
        self.seal_checkpoints = self.edits.seal_checkpoints
        self.staged = self.edits.staged
        self.check_review = self.edits.check_review
        self.review = self.edits.review
        # Sessions restored, whose tasks are not started yet (during a restore only).
        self._restored: list[Session] | None = None
        self.services = Services(
            backend=self.backend,
            profile_prompt=self.profile_prompt,
            tool_meta=self.tool_meta,
            mountpoint=mountpoint,
            memory_dir=str(paths.memory),
            results_root=self.toolsrv.tmp_root,
        )

    # ---- backends and profiles ------------------------------------------------------

    async def fresh_context(self, s: Session) -> None:
        """``ctxsz`` shows the real context length from its first read on."""
        s.agent.context_length = await self.context_length(s.cfg.backend, s.cfg.model)

    def costs_changed(self) -> None:
        self.costs += 1

    def log_path(self, uid: str, kind: str) -> str | None:
        # A string: pathlib's ``/`` was a tenth of what restoring a session cost.
        return f"{self._logs}/{uid}.{kind}"

    # ---- the tree's texts over the sessions (``olliefs.session.views``) --------------

    def family(self, s: Session) -> list[Session]:
        self._wake_all([sid for sid in self.dormant if views.related(s.id, sid)])
        return views.family(self.sessions, s)

    def children(self, s: Session) -> list[Session]:
        self._wake_all([sid for sid in self.dormant if views.descends(s.id, sid)])
        return views.children(self.sessions, s)

    def cost_text(self, s: Session) -> str:
        # A subagent not restored yet counts with the cost its index entry has.
        costs = [
            (o.id, o.agent.history.totals.session_cost)
            for o in self.sessions.values()
            if views.descends(s.id, o.id)
        ]
        costs += [
            (sid, d.entry.cost) for sid, d in self.dormant.items() if views.descends(s.id, sid)
        ]
        return views.cost_text(s, costs)

    def _conflict(self, reason: str) -> None:
        self.last_error = short_reason(reason)

    def refused(self, reason: str) -> None:
        """A write outside any session was refused: the reason in the root ``err``, as
        an ``error`` event on the root ``events``, and in the log."""
        reason = short_reason(reason)
        self.last_error = reason
        log.info("refused: %s", reason)
        ev = Event(time.time(), "", "", "error", "", reason)
        self.events.append(encode_line(ev))

    def check_new_name(self, name: str) -> None:
        if not NAME_RE.fullmatch(name) or name in RESERVED:
            raise InvalidRequest(
                f"bad session name: {name!r} (letters, digits, '.', '_', '-'; not new/idx)"
            )
        if name in self.sessions or name in self.dormant or name in self._reserved:
            raise Exists(f"session name taken: {name}")
        depth = name.count(SUB)
        if depth > self.max_depth:
            raise InvalidRequest(
                f"{name}: subagent depth {depth} is over the limit of {self.max_depth} "
                "(OLLIE_SUBAGENT_DEPTH)"
            )

    # ---- texts ----------------------------------------------------------------------

    def idx_text(self) -> str:
        listed: dict[str, views.Listed] = {sid: d.entry for sid, d in self.dormant.items()}
        listed.update(self.sessions)
        return views.idx_text(listed)

    def backends_text(self) -> str:
        return self.backends.pool.backends_text()

    def get(self, sid: str) -> Session:
        s = self.find(sid)
        if s is None:
            raise NotFound(f"no such session: {sid}")
        return s

    def find(self, sid: str) -> Session | None:
        """The session named ``sid``, restored now if it was not yet (``wake``)."""
        s = self.sessions.get(sid)
        if s is None and sid in self.dormant:
            s = self.wake(self.dormant[sid])
        return s

    # ---- lifecycle ------------------------------------------------------------------

    def parse_new(self, text: str, caller: Caller = USER) -> dict[str, str]:
        values: dict[str, str] = {}
        seen: set[str] = set()
        for tok in split_request(text, "s/new"):
            key, sep, value = tok.partition("=")
            if not sep:
                raise InvalidRequest(f"s/new: expected key=value, got {tok!r}")
            if key not in NEW_KEYS:
                raise InvalidRequest(f"s/new: unknown key {key!r} (keys: {' '.join(NEW_KEYS)})")
            if key in seen:
                raise InvalidRequest(f"s/new: duplicate key {key!r}")
            seen.add(key)
            if value:
                values[key] = value
        if "cwd" not in values:
            raise InvalidRequest("s/new: cwd= is required")
        values["cwd"] = resolve_cwd(values["cwd"])
        caller.check_dir(values["cwd"], "s/new: cwd")
        name = values.get("name", "")
        parent = self.find(name.rpartition(SUB)[0]) if SUB in name else None
        if "agent" in values:
            caller.check(
                parent is not None and parent.cfg.agent == values["agent"],
                f"s/new: agent={values['agent']} (only the parent's profile, for a child "
                "<parent>__<name>)",
            )
        # A child (a subagent, ``<parent>__<name>``) is by default what its parent is
        # now: its profile, backend and model (which a turnError hook or the user may
        # have switched since the parent started).
        values.setdefault("agent", parent.cfg.agent if parent is not None else "default")
        self.check_agent(values["agent"])
        if parent is None or parent.cfg.agent != values["agent"]:
            # The profile's backend and model, where s/new does not name them (as ctl
            # agent does); a child of another profile than its parent's gets them too.
            prof = self.profile(values["agent"])
            for key in ("backend", "model"):
                if key not in values and isinstance(prof.get(key), str) and prof[key]:
                    values[key] = prof[key]
        if parent is not None:
            values.setdefault("backend", parent.cfg.backend)
            if values["backend"] == parent.cfg.backend:
                values.setdefault("model", parent.cfg.model)
        values.setdefault("backend", self.default_backend)
        self.check_backend(values["backend"])
        if "model" not in values:
            values["model"] = self.settings.get("OLLIE_MODEL") or self.backends.default_model(
                values["backend"]
            )
        if "name" in values:
            self.check_new_name(values["name"])
        return values

    async def create(self, text: str, caller: Caller = USER) -> Session:
        """Create a session from an ``s/new`` write; durable before it returns."""
        v = self.parse_new(text, caller)
        cfg = Cfg(backend=v["backend"], model=v["model"], agent=v["agent"], cwd=v["cwd"])
        # The profile's step limit, as its tools (Session takes those itself): a limit
        # known only to ``ctl agent`` let a session made with agent= run 50 rounds.
        prof = self.profile(cfg.agent)
        steps = prof.get("maxSteps")
        extra: list[persist.Record] = []
        if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1:
            extra.append(persist.MaxSteps(steps))
        # The profile's generation parameters (validated when the profile was written).
        params = {k: prof[k] for k in PROFILE_PARAMS if prof.get(k) is not None}
        if params:
            extra.append(persist.Cfg(params))
        created = f"created (cwd {cfg.cwd}, {cfg.backend}/{cfg.model})"
        s = await self._make(v.get("name"), cfg, extra, lambda sid: f"session {sid} {created}")
        s.spawned = True  # its start runs agentSpawn and the profile's userPrompts
        return s

    async def fork(self, src: Session, name: str, n: int, *, checkpoint: bool = False) -> None:
        """``ctl fork``: a new session with ``src``'s configuration, tools and first ``n``
        history messages, or (``checkpoint``) with only ``src``'s checkpoint as history:
        its TaskState (the cold zone) and decision index (the warm zone), the seed's
        ``History.Checkpoint``, for a subagent that needs the state of the work and not
        the conversation that led there. All or nothing: until the new journal is
        durable, nothing of the fork is visible, and a failure leaves no trace of it."""
        msgs = (
            checkpoint_messages(src.agent.taskstate)
            if checkpoint
            else src.agent.history.messages[:n]
        )
        extra: list[persist.Record] = [
            persist.Cfg({k: v for k, v in src.cfg.values().items() if k != "agent"}),
            persist.Tools(list(src.agent.link.wanted)),
            persist.MaxSteps(src.agent.max_steps),
            *(persist.Msg(m) for m in msgs),
        ]
        if checkpoint:
            mine = f"forked from {src.id}, starting from its checkpoint"
            theirs = "which starts from this checkpoint"
        else:
            mine = f"forked from {src.id} with its first {n} messages"
            theirs = f"with the first {n} messages"
        s = await self._make(name, src.cfg, extra, lambda _: mine)
        src.emit("info", f"forked into {s.id}{',' if checkpoint else ''} {theirs}")
        # Checkpoints: the fork shares those of the turns it has.
        turns = 0 if checkpoint else sum(1 for start in src.turn_starts if start < n)
        root = self.checkpoints_root()
        try:
            await trio.to_thread.run_sync(
                checkpoints.share,
                checkpoints.store(root, src.uid),
                checkpoints.store(root, s.uid),
                turns,
            )
        except OSError as err:
            log.warning("fork %s: checkpoints not shared: %s", s.id, err)
            s.error(f"the checkpoints of {src.id} are not shared ({err.strerror or err})")

    async def _make(
        self, name: str | None, cfg: Cfg, extra: list[persist.Record], info: Callable[[str], str]
    ) -> Session:
        """A new session from a create record plus ``extra`` records, made durable (in a
        worker thread) before it appears; its name is reserved meanwhile, so a second
        request for the same name fails with EEXIST instead of racing this one.

        ``info(sid)`` is the session's first chat line (``:: session <id> created ...``),
        journaled with the rest before the sync: a crash right after the session became
        durable brings it back with that line, not as a session without a beginning."""
        uid = new_uid()
        sid = name or uid
        extra = [*extra, persist.Ev(Event(time.time(), sid, uid, "info", "", info(sid)))]
        self._reserved.add(sid)
        path = journal_path(self.paths.sessions, uid)
        # Written whole under a name a restore does not read, then renamed: a crash while
        # the records are written (a fork copies a whole history) leaves no session at
        # all, never one with part of its beginning.
        tmp = path.with_name(f".{path.name}.tmp")
        journal: persist.Journal | None = None
        try:
            rec = persist.Create(uid, sid, cfg.cwd, cfg.backend, cfg.model, cfg.agent, time.time())
            try:
                journal = persist.Journal(tmp)
                journal.append_records([rec, *extra])
            except OSError as err:
                raise disk_error(err, "journal") from None

            def durable() -> None:
                assert journal is not None
                journal.sync()
                try:
                    os.rename(tmp, path)
                    journal.path = path
                    persist.sync_dir(self.paths.sessions)
                except OSError as err:
                    raise disk_error(err, "journal") from None

            await trio.to_thread.run_sync(durable)
            s = self._from_create(rec, journal)
            s.replay(list(extra))
        except BaseException:
            # Nothing of it stays: no journal under either name, no descriptor open.
            if journal is not None:
                journal.abandon()
            for left in (tmp, path):
                left.unlink(missing_ok=True)
            raise
        finally:
            self._reserved.discard(sid)
        self._start(s)
        return s

    async def save(self, s: Session) -> None:
        """``ctl save``: the chat so far as ``tr/<stamp>-<id>.md``."""
        size = len(s.chat)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime())
        tr = self.paths.transcripts

        def write() -> Path:
            data = s.chat.read(0, size)
            tmp = tr / f".{stamp}-{s.id}.md.tmp"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                return persist.keep_as(tmp, tr, stamp, s.id, ".md")
            except OSError as err:
                tmp.unlink(missing_ok=True)  # no half transcript left on a full disk
                raise disk_error(err, "save: the transcript") from None

        dest = await trio.to_thread.run_sync(write)
        s.emit("info", f"saved to tr/{dest.name}")

    def compactions_root(self) -> Path:
        return self.paths.state / "compactions"

    def checkpoints_root(self) -> Path:
        """Where toolsrv keeps the sessions' checkpoint stores (``--capture-dir``)."""
        return self.paths.state / "checkpoints"

    def branches_dir(self, s: Session) -> Path:
        return self.paths.state / "branches" / s.uid

    async def rewind(self, s: Session, n: int, what: str = "both") -> None:
        """``ctl rewind``: the last ``n`` turns leave the history at once; what the
        history and chat were before is written to ``branches/<k>/`` before the write
        returns. The Rewind record comes first (so no record of a turn can slip in
        between the cut and its record); a crash before the branch is on disk leaves the
        record without its branch, and the restore rebuilds the branch from the journal
        (``Session.replay``)."""
        st = checkpoints.store(self.checkpoints_root(), s.uid)
        undone = checkpoints.undone_by(st, s.turns() - n + 1)
        root = self.branches_dir(s)
        k = s.branches + 1
        diff: bytes | None = None
        if undone:  # (checkpoints: the files first, then the records leave)
            text = checkpoints.diff_text(st, checkpoints.net(undone))
            diff = text.encode()
            if what != "chat":
                await trio.to_thread.run_sync(checkpoints.restore, st, undone)
            name = str(k) if what != "files" else f"files-{undone[-1].seq}"
            await trio.to_thread.run_sync(checkpoints.move_to_branch, st, undone, name, text)
            if what != "chat":
                s.emit("info", f"restored {len(checkpoints.net(undone))} file(s)")
        if what == "files":
            return
        before = list(s.agent.history.messages)
        chat_size = len(s.chat)
        s.rewind_to(n, k)

        def write() -> None:
            persist.write_branch(root, k, before, s.chat.read(0, chat_size), diff)

        try:
            await trio.to_thread.run_sync(write)
        except OSError as err:
            # The rewind is done and journaled; the journal also holds what the branch
            # is, and a restore writes a branch it does not find (``Session.replay``).
            log.warning("session %s: branches/%d not written: %s", s.id, k, err)
            why = err.strerror or err
            s.error(f"branches/{k} not written ({why}); it is written at the next start")

    async def run_shell(
        self,
        cmd: str,
        cwd: str,
        env: Mapping[str, str],
        capture: tuple[str, int, bool] = ("", 0, False),
        where: str = "",
    ) -> tuple[str, bool]:
        """A ``!cmd`` prompt: bash through toolsrv's ``execute_code``, sandboxed like any
        tool (the user typed it, but a prompt can also come from an agent or a peer), on
        the session's toolsrv (``where``), one link per toolsrv named."""
        link = self._shell_links.get(where) if where else self._tree_link
        if link is None:
            link = self._shell_links[where] = ToolLink(self.toolsrv, TREE_AGENT, [], where)
            link.bind(self._nursery)
        if "execute_code" not in link.wanted:
            link.set_wanted([*link.wanted, "execute_code"])
        args = {"code": cmd, "language": "bash"}
        result = await link.call("execute_code", args, cwd, env, capture)
        return result.text.rstrip("\n"), result.isError

    def _from_create(self, rec: persist.Create, journal: persist.Journal) -> Session:
        cfg = Cfg(backend=rec.backend, model=rec.model, agent=rec.agent, cwd=rec.cwd)
        s = Session(self, journal, uid=rec.uid, id=rec.id, cfg=cfg, created=rec.ts)
        self.alive.add(s)
        return s

    def _start(self, s: Session) -> None:
        self.sessions[s.id] = s
        self._membership_changed()
        if self._restored is not None:
            self._restored.append(s)  # its task starts after the restore (see there)
        else:
            self._nursery.start_soon(s.run, name=f"session {s.uid}")
            for hook in self.on_start:
                hook(s)

    async def _start_restored(self, sessions: list[Session]) -> None:
        """Start the tasks of restored sessions, those with prompts queued first, a few
        at a time: all at once, a thousand first steps ran in one pass of the event loop,
        and the mount's first requests waited behind them."""
        sessions.sort(key=lambda s: not s.queue)
        for i, s in enumerate(sessions):
            if not s.closed:
                self._nursery.start_soon(s.run, name=f"session {s.uid}")
            if i % RESTORE_STARTS == RESTORE_STARTS - 1:
                await trio.lowlevel.checkpoint()

    def _membership_changed(self) -> None:
        self.changed = time.time()
        self.generation += 1

    def rename(self, s: Session, new: str) -> None:
        if s.running:
            raise Busy(f"rename {s.id}: refused while a {s.work} is running")
        self.check_new_name(new)
        old = s.id
        s.record(persist.Rename(new), strict=True)
        del self.sessions[old]
        s.id = new
        self.sessions[new] = s
        self._membership_changed()
        s.presence.wake()
        s.emit("info", f"renamed from {old} to {new}")

    def kill(self, s: Session) -> Awaitable[None] | None:
        """Stop the session and move its journal to the transcripts (nothing is lost).

        The session leaves the tree at once; closing its journal (an fsync), moving it
        and syncing the directories happen in a worker thread, in what the returned
        awaitable runs (``rm -r`` and ``ctl kill`` await it before they return).
        """
        if self.sessions.get(s.id) is not s:
            return None
        del self.sessions[s.id]
        self._membership_changed()
        s.emit("info", "session killed")
        s.close()
        s.discard()
        for hook in self.on_kill:
            hook(s)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime())
        return self._keep(s, stamp)

    async def _keep(self, s: Session, stamp: str) -> None:
        # The fsync in a worker thread; the close itself here, on the thread that appends,
        # so no append can meet a descriptor closed (or reused) under it.
        s.journal.catch_up()
        try:
            await trio.to_thread.run_sync(s.journal.sync)
        except DiskError as err:
            log.warning("session %s: %s", s.id, err)
        s.journal.close()

        def move() -> None:
            try:
                persist.keep_as(s.journal.path, self.paths.transcripts, stamp, s.id, ".jsonl")
                persist.sync_dir(self.paths.sessions)
                self._keep_checkpoints(s, stamp)
            except OSError as err:
                # Not moved: the session comes back at the next start, nothing is lost.
                log.warning("session %s: journal not moved to the transcripts: %s", s.id, err)
                raise disk_error(err, "the journal of the killed session") from None

        await trio.to_thread.run_sync(move)

    def _keep_checkpoints(self, s: Session, stamp: str) -> None:
        """Beside the transcript of a removed session: ``STAMP-ID.diff``, what all its
        checkpoints changed (the store itself stays in the state dir)."""
        st = checkpoints.store(self.checkpoints_root(), s.uid)
        try:
            diff = checkpoints.diff_text(st, checkpoints.net(st.records()))
            if not diff:
                return
            tmp = self.paths.transcripts / f".{stamp}-{s.id}.diff.tmp"
            tmp.write_bytes(diff.encode())
            persist.keep_as(tmp, self.paths.transcripts, stamp, s.id, ".diff")
        except OSError as err:
            log.warning("session %s: its checkpoints' diff not kept in tr/: %s", s.id, err)

    def restore(self) -> None:
        """Bring back every journalled session (at daemon start).

        Made for speed, since the mount waits for it: the logs of the last run were set
        aside (and are removed in a worker thread), each profile is read once, and the
        cyclic garbage collector does not run meanwhile (with a thousand sessions it
        walked everything restored so far many times over).
        """
        self._nursery.start_soon(self._remove_old_logs)
        self.profiles.caching(True)
        self._restored = []
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._restore_all()
        finally:
            self.profiles.caching(False)
            self._nursery.start_soon(self._start_restored, self._restored)
            self._restored = None
            if collecting:
                gc.enable()

    async def _remove_old_logs(self) -> None:
        for old in self._old_logs:
            await trio.to_thread.run_sync(shutil.rmtree, old, True)
        self._old_logs = []

    def _restore_all(self) -> None:
        for cut in self.paths.sessions.glob(".*.jsonl.tmp"):  # a create cut by a crash
            log.warning("%s: session creation cut by a crash; removed", cut)
            cut.unlink(missing_ok=True)
        indexed = session_index.take(self.paths.sessions)
        for path in sorted(self.paths.sessions.glob("*.jsonl")):
            entry = indexed.get(path.stem)
            if entry is not None and self._asleep(entry, path):
                continue
            try:
                records = persist.restore_journal(path)
                if not records and path.stat().st_size == 0:
                    # s/new (or a fork) killed before its create record was whole: the
                    # create never returned, since it returns only once the record is
                    # durable. Nothing of it was acknowledged, so nothing is kept.
                    log.warning("%s: create cut by a crash; removed", path)
                    path.unlink()
                    continue
                if not records or not isinstance(records[0], persist.Create):
                    log.warning("%s: no create record; left alone", path)
                    continue
                s = self._from_create(records[0], persist.Journal(path))
                s.replay(records[1:])
            except (OSError, ValueError) as err:
                log.error("%s: cannot restore: %s", path, err)
                continue
            if s.id in self.sessions or s.id in self.dormant:
                log.error("%s: duplicate session id %s; left alone", path, s.id)
                s.journal.close()
                continue
            self._start(s)
        log.info(
            "restored %d sessions, %d more at their first use",
            len(self.sessions),
            len(self.dormant),
        )

    def _asleep(self, entry: session_index.Entry, path: Path) -> bool:
        """Whether the session of ``path`` is listed from its index ``entry`` (its journal
        is as the entry says), to be restored at its first use."""
        try:
            st = path.stat()
        except OSError:
            return False
        if not entry.matches(st) or entry.id in self.dormant or entry.id in self.sessions:
            return False
        self.dormant[entry.id] = Dormant(entry, path)
        return True

    def wake(self, d: Dormant) -> Session | None:
        """Restore the session of ``d`` from its journal (its first use since the start);
        None if it cannot be (the reason is logged, and it leaves the tree)."""
        if self.dormant.get(d.entry.id) is not d:
            return d.session
        del self.dormant[d.entry.id]
        self._membership_changed()  # s/ lists the restored session's own node from here
        try:
            records = persist.restore_journal(d.path)
            if not records or not isinstance(records[0], persist.Create):
                raise ValueError("no create record")
            s = self._from_create(records[0], persist.Journal(d.path))
            # Its past is not news: the root events has what happened since the start.
            s.replay(records[1:], announce=False)
        except (OSError, ValueError) as err:
            log.error("%s: cannot restore: %s", d.path, err)
            return None
        if s.id in self.sessions:
            log.error("%s: duplicate session id %s; left alone", d.path, s.id)
            s.journal.close()
            return None
        s.presence = d.presence  # the tree watches the name of s/<id> through it
        d.session = s
        self._start(s)
        return s

    def _wake_all(self, ids: list[str]) -> None:
        for sid in ids:
            d = self.dormant.get(sid)
            if d is not None:
                self.wake(d)

    def _write_index(self, idle: list[Session]) -> None:
        """At the stop: the index of the sessions idle at rest (``olliefs.session.index``)."""
        entries = [d.entry for d in self.dormant.values()]  # their journals were not opened
        for s in idle:
            try:
                st = s.journal.path.stat()
            except OSError:
                continue
            c = s.cfg
            cost = s.agent.history.totals.session_cost
            entries.append(
                session_index.Entry(
                    s.uid,
                    s.id,
                    s.created,
                    c.agent,
                    c.backend,
                    c.model,
                    c.cwd,
                    cost,
                    st.st_size,
                    st.st_mtime_ns,
                    st.st_ino,
                )
            )
        session_index.write(self.paths.sessions, entries)

    async def aclose(self) -> None:
        """Close every session and backend; safe to call again (signal, then shutdown)."""
        idle = [
            s
            for s in self.sessions.values()
            if not s.closed and not s.running and not s.queue and s.state.value == "idle"
        ]
        for s in list(self.sessions.values()):
            s.close()
            s.journal.close()
        if not self._indexed:
            self._indexed = True
            self._write_index([s for s in idle if s.journal.error is None])
        self.generation += 1  # closed sessions are no longer valid in the tree
        self._tree_link.close()
        for link in self._shell_links.values():
            link.close()
        self.events.close()
        await self.toolsrv.aclose()
        if self.backends.made is not None:
            with trio.CancelScope(shield=True):
                await self.backends.made.aclose()


class Dormant:
    """A saved session listed from the index, its journal not read yet."""

    __slots__ = ("_session", "entry", "path", "presence")

    def __init__(self, entry: session_index.Entry, path: Path) -> None:
        self.entry = entry
        self.path = path
        self.presence = StateCell()  # handed to the session when it is restored
        # Once restored (weak: the tree's node of s/<id> holds this past the session).
        self._session: weakref.ref[Session] | None = None

    @property
    def session(self) -> Session | None:
        return None if self._session is None else self._session()

    @session.setter
    def session(self, s: Session) -> None:
        self._session = weakref.ref(s)


def _set_aside(logs: Path) -> list[Path]:
    """Move the logs of the last run out of the way; return what is to be removed.

    The logs are caches rendered again from the journals at every start (``GrowingLog``);
    truncating a thousand sessions' old ones, one file at a time, took longer than the
    rest of a restore. A new, empty folder takes their place at once, and the old one
    is removed in the background (with any left by a run that stopped before it could).
    """
    leftovers = sorted(logs.parent.glob(f"{logs.name}.old-*"))
    try:
        aside = logs.with_name(f"{logs.name}.old-{time.time_ns()}")
        os.rename(logs, aside)
    except FileNotFoundError:
        return leftovers
    return [*leftovers, aside]


def _int(value: str | None, default: int) -> int:
    try:
        return int(value) if value else default
    except ValueError:
        return default
