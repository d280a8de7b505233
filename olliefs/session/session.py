"""A session: the tree-facing host of one agent — its logs, state, queue and journal.

Everything a session shows in the tree is derived here: ``chat`` and ``events`` are
``GrowingLog``s fed by ``emit``, ``state`` is a ``StateCell``, the rest are small texts.
The agent itself (history, tools, backend, model, parameters, the turn) is an ``Agent``
(``olliefs.agent.agent``) that reports back through this session. Every change goes to
the journal first, so that replaying it (``replay``) rebuilds the same session after a
crash.

Control requests (``ctl``, ``cfg``) are validated whole before anything is applied: a
write holding several lines either applies all of them or none (SPEC 3.7). The ctl
commands are entries of the table in ``commands.py``; ``cfg`` is one typed record
(``olliefs.agent.config.Cfg``). Durability waits (fsync) run in a worker thread, never on
the thread that serves the mount.

A full disk (or a quota, or an I/O error) refuses what a user asks for and stops what
the session was doing, never more: a prompt, a ``ctl`` or ``cfg`` line, a plan, a take
from ``fifo.out`` whose record cannot be written is refused with the disk's errno and
the reason (``refused``), and nothing of it happens; a record that tells what already
happened (a turn's events and messages) is kept in the journal's backlog
(``persist.Journal``) and written as soon as the disk takes it. A turn that meets the
full disk is stopped, as by ``ctl stop``, with an ``error:`` line that says why; prompts
queued behind it wait until the journal is written again (``_mend`` tries now and then,
and every write tries first), then run in order.

The session reaches the rest of the daemon only through ``SessionHost``, a protocol the
registry implements, so this module does not import the registry.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import trio

from olliefs.agent.agent import Agent, Services
from olliefs.agent.build import Runtime
from olliefs.agent.chat import ChatRenderer
from olliefs.agent.config import KEYS, PARAM_KEYS, Cfg, check_toolsrv, parse_param, resolve_cwd
from olliefs.agent.events import Event, EventRole, encode_line
from olliefs.agent.loop import TurnEnded
from olliefs.agent.retry import RetryPolicy
from olliefs.agent.runtime import ToolLink
from olliefs.agent.taskstate import TaskState
from olliefs.backend.base import BackendError, Message, Usage
from olliefs.caller import USER, Caller
from olliefs.errors import (
    Busy,
    Denied,
    DiskError,
    InvalidRequest,
    TooLarge,
    short_reason,
    size_text,
)
from olliefs.live import GrowingLog, StateCell
from olliefs.memory import give_back
from olliefs.session import commands, persist
from olliefs.session.commands import Apply
from olliefs.session.persist import Journal, Record
from olliefs.toolclient.client import ToolsrvError
from olliefs.toolclient.spawn import Toolsrv
from olliewire.checkpoints import Change

log = logging.getLogger(__name__)

MEND_FIRST = 1.0  # seconds before a session tries again to write what its journal owes
MEND_MAX = 30.0  # ... doubling up to this
WAIT = "wait until the journal is written again"
MAX_PROMPT = 4 * 1024 * 1024
"""The longest prompt taken, in bytes of UTF-8. A pasted file fits, and so does anything
a model can read (the largest contexts, a million tokens, are about 4 MB of text); a
longer one is refused whole (EFBIG) instead of being journaled, shown and sent to the
provider as is."""


class SessionHost(Protocol):
    """What a session needs from the daemon (the registry implements it)."""

    @property
    def settings(self) -> Mapping[str, str]: ...

    @property
    def mountpoint(self) -> str: ...

    @property
    def events(self) -> GrowingLog: ...

    @property
    def services(self) -> Services: ...

    @property
    def toolsrv(self) -> Toolsrv: ...

    def check_new_name(self, name: str) -> None: ...

    def check_backend(self, name: str) -> None: ...

    def check_agent(self, name: str) -> None: ...

    def rename(self, s: Session, new: str) -> None: ...

    async def fork(self, src: Session, name: str, n: int, *, checkpoint: bool = False) -> None: ...

    async def save(self, s: Session) -> None: ...

    async def rewind(self, s: Session, n: int, what: str = "both") -> None: ...

    def check_rewind(self, s: Session, n: int) -> None: ...

    def staged(self, s: Session) -> bool: ...

    def trim_checkpoints(self, s: Session) -> None: ...

    def seal_checkpoints(self, s: Session) -> None: ...

    def check_review(self, s: Session, verb: str, paths: list[str]) -> list[Change]: ...

    async def review(self, s: Session, verb: str, chosen: list[Change]) -> None: ...

    def compactions_root(self) -> Path: ...

    def branches_dir(self, s: Session) -> Path: ...

    async def models_command(self, s: Session) -> None: ...

    async def build_runtime(self, name: str, cwd: str, env: Mapping[str, str]) -> Runtime: ...

    def kill(self, s: Session) -> Awaitable[None] | None: ...

    def known_tools(self, s: Session) -> set[str]: ...

    async def refresh_tools(self) -> None: ...

    async def run_shell(
        self,
        cmd: str,
        cwd: str,
        env: Mapping[str, str],
        capture: tuple[str, int, bool] = ("", 0, False),
        where: str = "",
    ) -> tuple[str, bool]: ...

    async def context_length(self, backend: str, model: str) -> int: ...

    def profile_tools(self, agent: str) -> list[str]: ...

    def log_path(self, uid: str, kind: str) -> str | None: ...

    def costs_changed(self) -> None:
        """A session's cost changed (its own ``cost`` and its ancestors' show it)."""


class Session:
    def __init__(
        self,
        host: SessionHost,
        journal: Journal,
        *,
        uid: str,
        id: str,
        cfg: Cfg,
        created: float,
    ) -> None:
        self.host = host
        self.journal = journal
        self.uid = uid
        self.id = id
        self.created = created
        self.spawned = False  # made by s/new: its start runs agentSpawn and userPrompts
        self.chat = GrowingLog(host.log_path(uid, "chat"))
        self.renderer = ChatRenderer(self.chat)
        self.events = GrowingLog(host.log_path(uid, "events"))
        self.state = StateCell()
        # Woken when the session's name in s/ changes or goes (a rename, close): the
        # tree's cue to check what the kernel caches of that name. (The events log said
        # as much, but it changes at every streamed delta, and each change cost a lookup.)
        self.presence = StateCell()
        # Counts the changes of what the session's files show (each journal record, each
        # event, the runtime built, the models read): the tree keeps their sizes while
        # it holds (``files_version``), so that a stat or a listing renders nothing.
        self.revision = 0
        self.prompt_prev = ""
        self.queue: deque[tuple[int, str]] = deque()
        self._queue_lot = trio.lowlevel.ParkingLot()
        self._seq = 0
        self._running_seq: int | None = None
        # The focus of a ``ctl compact`` given outside a turn, from the write that asked
        # for it until the runner has done it: the session's work, like a turn.
        self._compaction: str | None = None
        # The scope of the work running or about to run (a turn, a compaction): ``stop``
        # cancels it, even before the runner has entered it.
        self._work_scope: trio.CancelScope | None = None
        self._scope = trio.CancelScope()
        self._nursery: trio.Nursery | None = None
        self.closed = False
        self._replaying = False
        self._announce = True  # events go to the root events too (see ``replay``)
        # History index where each turn began (its prompt), for ``rewind``.
        self.turn_starts: list[int] = []
        self.branches = 0  # how many rewinds kept a branch
        self.last_error = ""  # the reason of the last refused write (the ``err`` file)
        self.plan = ""
        self._models_text = ""  # the ``models`` file (filled from the backend pool)
        self.queued = trio.lowlevel.ParkingLot()  # fifo.out readers wait here
        # The profile's runtime (prompt, hooks, allowTools) is built at the first need
        # (``ready``), not at start: see ``run``.
        self._runtime_due = True
        self._runtime_building: trio.Event | None = None
        self._runtime: Runtime | None = None  # as built by ``ready``, until ``run`` starts
        self._streamed = persist.StreamedText()
        # A full disk: why the running turn was stopped (it says so as it ends); set when
        # the journal mended (``_mend`` waits on it); prompts are acknowledged one at a
        # time (a failed fsync takes its prompt's records back out, see ``submit``).
        self._cut_turn: DiskError | None = None
        self._mended = trio.Event()
        self._mending = False
        self._told = False  # the error line of this full disk was shown
        self._submitting = trio.Lock()
        journal.on_broken = self._journal_broken
        journal.on_mended = self._journal_mended
        link = ToolLink(host.toolsrv, uid, host.profile_tools(cfg.agent), cfg.toolsrv)
        link.on_dropped = self._tool_dropped
        link.capture = self.capture_key
        self.agent = Agent(
            self,
            host.services,
            uid=uid,
            cfg=cfg,
            link=link,
            retry=RetryPolicy.from_settings(host.settings),
            context_length=int(host.settings.get("OLLIE_CONTEXT_LENGTH") or 128000),
        )
        self.agent.max_session_cost = _cost_cap(host.settings.get("OLLIE_MAX_SESSION_COST"))

    # ---- identity and derived texts -------------------------------------------------

    @property
    def models_text(self) -> str:
        return self._models_text

    @models_text.setter
    def models_text(self, text: str) -> None:
        self._models_text = text
        self.revision += 1

    def files_version(self) -> tuple[int, int, int]:
        """Changes whenever a text of the session's directory may have (but ``cost``,
        which its subagents' costs change too, and ``systemprompt`` before the runtime
        is built, which the profile's file on disk gives): the journal's records and the
        events bump ``revision``; the context length and the loaded tools' metadata are
        set after awaits of their own, without either, and are read as they are."""
        a = self.agent
        return (self.revision, a.context_length, a.link.version)

    @property
    def cfg(self) -> Cfg:
        return self.agent.cfg

    @property
    def cwd(self) -> str:
        return self.agent.cfg.cwd

    @property
    def running(self) -> bool:
        """A turn or a compaction is the session's work now: what a running turn
        refuses (``rn``, ``cfg`` changes, ``clear``, ...) is refused then too."""
        return self._running_seq is not None or self._compaction is not None

    @property
    def work(self) -> str:
        """What runs, for the reasons of refused requests: ``turn`` or ``compaction``."""
        return "turn" if self._running_seq is not None or self._compaction is None else "compaction"

    def cfg_text(self) -> str:
        return self.cfg.text(self.state.value)

    def env_text(self) -> str:
        c = self.cfg
        return (
            f"OLLIE_SESSION_ID={self.id}\n"
            f"OLLIE={self.host.mountpoint}\n"
            f"OLLIE_AGENT={c.agent}\n"
            f"OLLIE_BACKEND={c.backend}\n"
            f"OLLIE_MODEL={c.model}\n"
            f"OLLIE_CWD={c.cwd}\n"
        )

    def tail_script(self) -> str:
        # Relative to the script itself, so it keeps working after a rename.
        return '#!/bin/sh\n# follow this session live\nexec cat "$(dirname "$0")/stream"\n'

    def idx_line(self) -> str:
        c = self.cfg
        return f"{self.id}\t{self.state.value}\t{c.cwd}\t{c.backend}\t{c.model}\n"

    # ---- output (also the AgentHost side) -------------------------------------------

    def record(self, rec: Record, *, strict: bool = False) -> None:
        """``rec`` to the journal. ``strict``: the first record of a request, made before
        the request changes anything, so that a ``DiskError`` refuses it whole; otherwise
        a record the disk refuses waits in the journal's backlog."""
        self.revision += 1
        if not self._replaying:
            self.journal.append(self._streamed.pack(rec), strict=strict)

    def emit(
        self, role: EventRole, content: str = "", name: str = "", response_id: str = ""
    ) -> None:
        """One event: journaled, then shown in ``chat``, ``events`` and the root ``events``.

        A streamed reply arrives here already coalesced: the backend makes one delta of
        everything it parsed from one network read (``olliefs.backend.stream``), so a
        10 MB reply in 50-byte deltas is a few hundred events, journal writes and reader
        wake-ups, not 200,000; and ``message_added`` leaves the reply's text out of its
        ``msg`` record when these events already hold it (``persist.StreamedText``).
        """
        ev = Event(time.time(), self.id, self.uid, role, name, content, response_id)
        line = encode_line(ev)
        if not self._replaying:
            self._streamed.saw(ev)
            self.journal.append_event(line)
        self._show(ev, line)

    def _show(self, ev: Event, line: bytes) -> None:
        self.revision += 1
        self.renderer.render(ev)
        self.events.append(line)
        if self._announce:
            self.host.events.append(line)

    def set_state(self, state: str) -> None:
        if self.state.set(state):
            self.emit("state", state)

    def message_added(self, msg: Message) -> None:
        self.record(persist.Msg(msg))

    def usage_added(self, usage: Usage, cost: float, estimated: bool) -> None:
        self.record(persist.UsageRec(usage, cost, estimated))
        self.host.costs_changed()

    async def checkpoint(self) -> None:
        await self.sync()

    def error(self, message: str) -> None:
        self.emit("error", message)

    def refused(self, reason: str) -> None:
        """A write to this session was refused: the reason in ``err``, in chat as an
        ``error:`` line, in the events (root ``events`` too) and in the daemon log."""
        reason = short_reason(reason)
        self.last_error = reason
        log.info("session %s: refused: %s", self.id, reason)
        self.error(reason)

    def compactions_dir(self) -> Path:
        return self.host.compactions_root() / self.uid

    def history_replaced(self, messages: list[Message], n: int) -> None:
        self.record(persist.Replaced(messages, n))
        self.turn_starts = [0]  # the compacted history is one turn's start
        self.host.seal_checkpoints(self)

    def taskstate_changed(self, state: TaskState) -> None:
        self.record(persist.TaskStateRec(state))

    async def switch_backend(self, values: Mapping[str, str]) -> None:
        """A turnError hook's recovery (``loop._turn_error``): ``backend`` and ``model``
        set as a ``cfg`` write sets them, in the turn that failed (where ``cfg`` and
        ``ctl`` refuse them), before its request is sent again."""
        if "backend" in values:
            self.host.check_backend(values["backend"])
        current = self.cfg.values()
        changed = {k: v for k, v in values.items() if current[k] != v}
        if changed:
            self.set_cfg(changed, announce=False)
        cfg = self.cfg
        self.agent.context_length = await self.host.context_length(cfg.backend, cfg.model)

    def compact(self, focus: str) -> None:
        """``ctl compact [focus]``. During a turn (the agent compacting itself through its
        ctl, or the user): before the turn's next request, or right after the turn if it
        makes none. Otherwise it becomes the session's work, like a turn: the write
        returns at once, ``state`` says ``compacting``, prompts written meanwhile queue
        behind it, ``stop`` ends it with the history kept, ``kill`` ends it with the
        session. A provider that hangs then holds nothing but this session's runner."""
        if self._running_seq is not None:
            self.agent.compact_requested = focus
            self.emit("info", "compaction requested: before the next request of this turn")
            return
        err = self.journal.error
        if err is not None:  # nothing would run before the journal is written again
            raise type(err)(str(err))
        self._compaction = focus
        self._work_scope = trio.CancelScope()
        self.set_state("compacting")
        self._queue_lot.unpark_all()

    def check_compact(self) -> None:
        """A second ``ctl compact`` while one is asked for or runs outside a turn."""
        if self._running_seq is None and self._compaction is not None:
            raise Busy("compact: a compaction is already running (ctl stop ends it)")

    def set_plan(self, text: str) -> None:
        try:
            self.record(persist.Plan(text), strict=True)
        except DiskError as err:
            self.refused(f"plan not saved: {err}")
            raise
        self.plan = text
        self.emit("info", "plan updated" if text.strip() else "plan cleared")

    def pop_queued(self) -> str | None:
        """``fifo.out``: take the next queued prompt away (it will not run)."""
        if not self.queue:
            return None
        seq, text = self.queue[0]
        try:
            self.record(persist.Dropped([seq]), strict=True)
        except DiskError as err:
            self.refused(f"fifo.out: {err}")
            raise
        self.queue.popleft()
        self.emit("info", "a queued prompt was taken through fifo.out")
        if not self.queue and not self.running:
            self.set_state("idle")
        return text

    # ---- prompts and the turn runner ------------------------------------------------

    async def submit(self, text: str, caller: Caller = USER) -> None:
        """Acknowledge a prompt: journal it, show its ``user:`` line, fsync, queue it.

        ``/cmd`` is a ctl command, run at once (``/stop`` stops the running turn);
        ``!cmd`` is a shell command, queued like a prompt and run in the session's cwd
        under toolsrv's sandbox when its turn comes, its output added to the context;
        refused to a sandboxed ``caller``, whose rights it would exceed (`Caller`).

        A prompt whose records the disk refuses is refused (``DiskError``, with the
        disk's errno) and nothing of it is kept or shown, but the reason. One whose fsync
        fails after they were written is taken back out of the journal (its ``user:``
        line, shown already, is followed by the error that says so). Prompts are
        acknowledged one at a time, so that a take-back moves no other prompt's records.
        """
        text = text.strip()
        if not text or self.closed:
            return
        # UTF-8 takes at most 4 bytes a character: only a long text needs encoding here.
        if len(text) > MAX_PROMPT // 4 and len(text.encode()) > MAX_PROMPT:
            reason = f"prompt: longer than {size_text(MAX_PROMPT)} (not submitted)"
            self.refused(reason)
            raise TooLarge(reason)
        if text.startswith("/"):
            await self.ctl(text[1:], caller)
            return
        if text.startswith("!"):
            try:
                caller.check(False, "prompt: !cmd (it runs with the session's rights)")
            except Denied as err:
                self.refused(str(err))
                raise
        async with self._submitting:
            seq = self._seq + 1
            ev = Event(time.time(), self.id, self.uid, "user", "", text, "")
            line = encode_line(ev)
            try:
                start = self.journal.append_records([persist.Prompt(seq, text, ev.ts), line])
            except DiskError as err:
                self.refused(f"prompt not accepted: {err}")
                err.told = True
                raise
            end = self.journal.size
            self._seq = seq
            self._streamed.saw(ev)
            # Shown where its records are in the journal (a running turn's events may
            # follow them during the fsync), so that a restore renders the same chat.
            self._show(ev, line)
            try:
                await trio.to_thread.run_sync(self.journal.sync)
            except DiskError as err:
                self._take_back(seq, start, end)
                self.refused(f"prompt not accepted (the user: line above is not kept): {err}")
                err.told = True
                raise
            self.prompt_prev = text
        busy = self.running
        self.queue.append((seq, text))
        self._queue_lot.unpark_all()
        self.queued.unpark_all()
        if not busy:
            # Running or queued, as soon as it is acknowledged; behind a running turn or
            # compaction the state stays what that work says (``calling: x``, ...).
            self.set_state("thinking")

    def _take_back(self, seq: int, start: int, end: int) -> None:
        """A prompt's records out of the journal again (its fsync failed)."""
        try:
            self.journal.retract(start, end)
        except DiskError as err:
            # Still in the file: a restore must not run it.
            log.warning("session %s: prompt %d stays in the journal (%s)", self.id, seq, err)
            self.record(persist.Dropped([seq]))

    async def sync(self) -> None:
        """The journal to the disk, in a worker thread (an fsync stalls nobody else).
        What the disk refuses is said in chat; nothing here is refused (a request's own
        records were written strictly before it changed anything)."""
        self.journal.catch_up()
        if not self.journal.dirty:
            return
        try:
            await trio.to_thread.run_sync(self.journal.sync)
        except DiskError as err:
            log.warning("session %s: %s", self.id, err)
            self.error(f"{err} (what this session did last may not survive a machine crash)")

    def _journal_broken(self, err: DiskError) -> None:
        """The journal owes records from now on: a running turn stops (and says why);
        queued prompts wait until it is written again (``run``)."""
        self._mended = trio.Event()
        if self.running:
            self._cut_turn = err
            if self._work_scope is not None:
                self._work_scope.cancel()
        if self._nursery is not None and not self._mending:
            self._nursery.start_soon(self._mend)

    def _journal_mended(self) -> None:
        self._mended.set()
        self._queue_lot.unpark_all()

    async def _mend(self) -> None:
        """While the journal owes records: try again now and then (space is freed from
        outside, and the session may have nothing else to write meanwhile); then say so."""
        self._mending = True
        try:
            await trio.lowlevel.checkpoint()  # after the write that broke, and its turn's end
            if self.queue and not self.running and not self._told:
                self._told = True
                self.error(f"{self.journal.error}: queued prompts {WAIT}")
            delay = MEND_FIRST
            while self.journal.error is not None:
                with trio.move_on_after(delay):
                    await self._mended.wait()
                delay = min(delay * 2, MEND_MAX)
                self.journal.catch_up()
        finally:
            self._mending = False
        self._told = False
        n = len(self.queue)
        more = (
            f"; {n} queued prompt{'' if n == 1 else 's'} run{'s' if n == 1 else ''} now"
            if n
            else ""
        )
        self.emit("info", f"the journal is written again{more}")

    async def run(self) -> None:
        """The session's life: run queued prompts one at a time until it is killed."""
        with self._scope:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.agent.link.bind(nursery)  # the toolsrv connection lives in here
                if self.spawned:
                    await self.ready()
                rt, self._runtime = self._runtime, None
                if self.spawned and rt is not None:
                    self.spawned = False
                    await self._agent_started(rt)
                if self.journal.error is not None:  # a restore on a full disk
                    nursery.start_soon(self._mend)
                try:
                    while True:
                        # Nothing starts while the journal owes records: a turn would
                        # stop at its first one.
                        while (
                            not self.queue and self._compaction is None
                        ) or self.journal.error is not None:
                            await self._queue_lot.park()
                        await self.ready()
                        if self._compaction is not None:
                            await self._run_compaction(self._compaction)
                        elif self.queue:  # fifo.out may have taken it meanwhile
                            seq, text = self.queue.popleft()
                            await self._run_one(seq, text)
                finally:
                    self.agent.link.close()

    async def _run_one(self, seq: int, text: str) -> None:
        self._running_seq = seq
        self.record(persist.Start(seq))
        agent = self.agent
        try:
            with trio.CancelScope() as scope:
                self._work_scope = scope
                if self.journal.error is not None:  # broken since it was taken
                    self._cut_turn = self.journal.error
                    scope.cancel()
                if text.startswith("!"):
                    await self._run_shell(text[1:].strip())
                else:
                    self.turn_starts.append(len(agent.history.messages))
                    agent.context_length = await self.host.context_length(
                        agent.cfg.backend, agent.cfg.model
                    )
                    await agent.run(text)
            if scope.cancelled_caught and self._cut_turn is not None:
                self._told = True
                more = f"; queued prompts {WAIT}" if self.queue else ""
                self.emit("error", f"{self._cut_turn}: turn stopped{more}")
            elif scope.cancelled_caught:
                self.emit("info", "stopped")
                if agent.compact_requested is not None:
                    # ``stop`` means the user wants nothing more done now.
                    agent.compact_requested = None
                    self.emit("info", "the compaction requested for this turn is dropped")
        except (BackendError, TurnEnded) as err:
            self.emit("error", str(err))
        except Exception as err:  # a bug must not take the daemon down
            if self.closed:
                # The daemon is stopping: what the turn had (its backend's client) was
                # closed under it. Not a failure of the turn; it is cut like any other.
                log.info("turn of session %s cut by the shutdown: %s", self.id, err)
            else:
                log.exception("turn of session %s failed", self.id)
                self.emit("error", f"internal error: {type(err).__name__}: {err}")
        finally:
            self._work_scope = None
            self._cut_turn = None
            self._running_seq = None
            self.host.trim_checkpoints(self)  # (checkpoints: the size cap)
            self.renderer.end_turn()
            agent.history.totals.last_turn_cost = agent.turn_cost
            self.record(persist.TurnCost(agent.turn_cost))
            self.record(persist.End(seq))
            if agent.compact_requested is not None and not self.closed:
                # Asked for during the turn, which made no request after it: done now,
                # before the prompts queued behind the turn.
                self.compact(agent.compact_requested)
                agent.compact_requested = None
            elif not self.queue:
                self.set_state("idle")
        with trio.CancelScope(shield=True):
            await self.sync()
        give_back()  # what the turn's pieces occupied goes back to the system

    async def _run_compaction(self, focus: str) -> None:
        """A ``ctl compact`` outside a turn, run by the runner as the session's work."""
        agent = self.agent
        before = agent.history.messages
        scope = self._work_scope
        assert scope is not None  # set with the request, in ``compact``
        try:
            with scope:
                await agent.compact(focus, after=None)
            if scope.cancelled_caught:
                # ``History.replace`` installs a new list: the same list means the old
                # history is still in force (stopped before its snapshot was written).
                kept = agent.history.messages is before
                self.emit("info", "compaction stopped; history kept" if kept else "stopped")
        except BackendError as err:  # e.g. a backend that cannot be built
            self.emit("error", f"compaction failed, history kept: {err}")
        except DiskError as err:  # its snapshot refused: the write has returned, so err
            self.refused(str(err))
        except Exception as err:  # a bug must not take the daemon down
            log.exception("compaction of session %s failed", self.id)
            self.emit("error", f"internal error: {type(err).__name__}: {err}")
        finally:
            self._work_scope = None
            self._compaction = None
            self.set_state("thinking" if self.queue else "idle")
        with trio.CancelScope(shield=True):
            await self.sync()
        give_back()

    async def _run_shell(self, cmd: str) -> None:
        if not cmd:
            self.error("!: no command")
            return
        self.set_state("calling: !")
        try:
            text, failed = await self.host.run_shell(
                cmd, self.cwd, self.agent.tool_env(), self.capture_key(), self.cfg.toolsrv
            )
        except ToolsrvError as err:
            self.error(f"!{cmd}: {err}")
            return
        finally:
            self.set_state("thinking")
        self.emit("tool", text or "(no output)", name="!")
        how = "failed" if failed else "printed"
        self.agent.add_message(
            Message("user", f"I ran `{cmd}` in {self.cwd}; it {how}:\n{text}".rstrip())
        )

    def stop(self) -> None:
        if self._work_scope is not None:
            self._work_scope.cancel()

    def inject(self, text: str, *, replace: bool, caller: Caller = USER) -> Awaitable[None] | None:
        """``inject``/``irw``: text for the running turn's next step; otherwise (idle, or
        compacting outside a turn) a prompt."""
        if self._running_seq is None:
            return self.submit(text, caller)
        agent = self.agent
        if replace or agent.injection is None:
            verb = "replaced" if replace and agent.injection is not None else "queued"
            agent.injection = text
        else:
            verb = "added"
            agent.injection += "\n" + text
        self.emit("info", f"injection {verb} for the running turn")
        return None

    def clear_queue(self) -> None:
        seqs = [seq for seq, _ in self.queue]
        self.record(persist.Dropped(seqs), strict=True)
        self.queue.clear()
        self.emit("info", f"queue cleared ({len(seqs)} prompt{'' if len(seqs) == 1 else 's'})")
        if not self.running:
            self.set_state("idle")

    def set_max_steps(self, n: int | None) -> None:
        if n is not None:
            self.record(persist.MaxSteps(n), strict=True)
            self.agent.max_steps = n
        self.emit("info", f"maxsteps {self.agent.max_steps}")

    def turns(self) -> int:
        return len(self.turn_starts)

    def capture_key(self) -> tuple[str, int, bool]:
        """Checkpoints: the store and the turn a tool call or ``!cmd`` is captured under,
        and whether its edits wait for review (``cfg edits=review``)."""
        return (self.uid, len(self.turn_starts), self.cfg.edits == "review")

    def rewind_to(self, n: int, branch: int) -> None:
        """Drop the last ``n`` turns from the history, as branch number ``branch``."""
        self.record(persist.Rewind(n, branch), strict=True)
        self.branches = branch
        cut = self.turn_starts[len(self.turn_starts) - n]
        self.agent.history.truncate(cut)
        del self.turn_starts[len(self.turn_starts) - n :]
        self.emit("info", f"rewound {n} turn{'' if n == 1 else 's'} (kept in branches/{branch})")

    def close(self) -> None:
        """Stop everything; wake every reader so blocked reads end with EOF."""
        self.closed = True
        self.stop()
        self._scope.cancel()
        self.agent.link.close()
        self.chat.close()
        self.events.close()
        self.state.wake()
        self.presence.wake()
        self.queued.unpark_all()  # fifo.out readers: EOF
        # The journal is closed by the caller: in a worker thread on kill, at once on
        # shutdown (its close is an fsync).

    def discard(self) -> None:
        """After ``close``: give back the memory and the log files (a killed session)."""
        self.chat.discard()
        self.events.discard()
        self.agent.history.clear()
        give_back()

    # ---- control --------------------------------------------------------------------

    async def ctl(self, text: str, caller: Caller = USER) -> None:
        await self.ready()
        names = commands.tool_names(text)
        if any(n not in self.host.known_tools(self) for n in names):
            await self.host.refresh_tools()  # a tool added since the last look
        pending = commands.Pending(
            list(self.agent.link.wanted), self.host.known_tools(self), caller
        )
        await self._apply_all(text, lambda line: commands.prepare(self, line, pending))

    async def write_cfg(self, text: str, caller: Caller = USER) -> None:
        await self.ready()
        draft = [self.cfg]  # the record as the earlier lines of this write leave it
        await self._apply_all(text, lambda line: self._prepare_cfg(line, draft, caller))

    async def _apply_all(self, text: str, prepare: Callable[[str], Apply]) -> None:
        try:
            commands.check_text(text, "request")
            actions = [prepare(line) for line in text.splitlines() if line.strip()]
        except (InvalidRequest, Busy, Denied) as err:
            self.refused(str(err))
            raise
        try:
            # An action writes its first record strictly, before it changes anything: on
            # a full disk it is refused whole (the lines before it stay applied).
            later = []
            for act in actions:
                rest = act()
                if rest is not None:
                    later.append(rest)
            await self.sync()
            for rest in later:
                await rest
        except DiskError as err:
            if not err.told:
                self.refused(str(err))
            raise

    def _prepare_cfg(self, line: str, draft: list[Cfg], caller: Caller) -> Apply:
        key, sep, value = line.strip().partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise InvalidRequest(f"cfg: expected key=value: {line.strip()}")
        if key not in KEYS:
            raise InvalidRequest(f"cfg: unknown key: {key} (keys: {' '.join(KEYS)})")
        if key == "state":
            if value != self.state.value:
                raise InvalidRequest("cfg: state is read-only (use ctl stop)")
            return lambda: None
        current = draft[0].values()
        new: Any
        if key in PARAM_KEYS:
            new = parse_param(key, value)
        elif key == "toolsrv":
            new = check_toolsrv(value)
        elif not value:
            return lambda: None  # an empty value leaves the key as it is
        elif key == "backend":
            self.host.check_backend(value)
            new = value
        elif key == "agent":
            self.host.check_agent(value)
            caller.check(value == current[key], f"cfg agent={value}")
            new = value
        elif key == "cwd":
            new = resolve_cwd(value)
            caller.check_dir(new, "cfg cwd")
            if new != current[key] and self.host.staged(self):  # (staged against the cwd)
                raise Busy("cfg cwd: edits are staged (ctl accept or ctl reject them)")
        elif key == "edits":
            if value not in ("direct", "review"):
                raise InvalidRequest(f"cfg edits: direct or review, not {value}")
            if value == "direct" and self.host.staged(self):
                raise Busy("cfg edits=direct: edits are staged (ctl accept or ctl reject them)")
            new = value
        else:
            new = value
        if new == current[key]:
            return lambda: None
        if self.running:
            raise Busy(f"cfg {key}: refused while a {self.work} is running (ctl stop first)")
        draft[0] = draft[0].with_values({key: new})
        if key == "agent":
            return lambda: self.switch_agent(new)
        if key == "toolsrv":
            return lambda: self.switch_toolsrv(new)
        return lambda: self.set_cfg({key: new})

    async def switch_agent(self, name: str) -> None:
        """``ctl agent``/``cfg agent=``: the seed's switch — the profile loaded and built
        (prompt commands run), a fresh toolsrv attach with its tools, backend and model
        from it where it sets them, the history cleared; same session and directory.
        Nothing changes if the profile cannot be built."""
        try:
            rt = await self.host.build_runtime(name, self.cwd, self.agent.tool_env())
        except InvalidRequest as err:
            self.refused(f"agent {name}: {err}")
            raise
        values: dict[str, Any] = {"agent": name}
        if rt.backend:
            values["backend"] = rt.backend
        if rt.edits and not self.host.staged(self):  # (staged edits wait for review)
            values["edits"] = rt.edits
        if rt.model:
            values["model"] = rt.model
        for key, v in (
            ("maxTokens", rt.params.max_tokens),
            ("temperature", rt.params.temperature),
            ("frequencyPenalty", rt.params.frequency_penalty),
            ("presencePenalty", rt.params.presence_penalty),
            ("thinkingBudget", rt.thinking_budget),
        ):
            values[key] = v
        self.set_cfg(values, announce=False)
        tools = rt.initial_tools
        self._relink(tools)
        self.record(persist.Tools(tools))
        self._adopt(rt)
        if rt.max_steps:
            self.record(persist.MaxSteps(rt.max_steps))
            self.agent.max_steps = rt.max_steps
        self.record(persist.Clear())
        self.agent.clear()
        self.turn_starts.clear()
        self.host.seal_checkpoints(self)
        self.emit("info", f"agent {name}: tools {', '.join(tools) or 'none'}; history cleared")
        for note in rt.notes:
            self.emit("info", note)
        await self.sync()
        await self._agent_started(rt)

    def _adopt(self, rt: Runtime) -> None:
        """What of a built profile lives only in memory: rebuilt at every start."""
        self.revision += 1
        self.agent.allow_tools = rt.allow_tools
        self.agent.prompt = rt.prompt
        self.agent.hooks = dict(rt.hooks)
        self.agent.hook_failure = rt.hook_failure
        self.agent.hook_timeout = rt.hook_timeout
        self.agent.compaction_model = rt.compaction_model
        self.agent.text_tool_calls = rt.text_tool_calls

    async def ready(self) -> None:
        """Build the profile's runtime now if it was not yet (once, whoever asks first).

        A session that was restored (or forked) with nothing queued does not build it
        at start: a thousand sessions building theirs at once held the mount back. A
        turn, a ctl or cfg request and a read of ``systemprompt`` wait for it here.
        """
        while self._runtime_building is not None:
            await self._runtime_building.wait()
        if not self._runtime_due:
            return
        self._runtime_building = building = trio.Event()
        try:
            rt = await self._build_current()
            if self.spawned:
                self._runtime = rt  # for the agent's start (``run``)
            self._runtime_due = False
        finally:
            self._runtime_building = None
            building.set()

    async def _build_current(self) -> Runtime | None:
        """At the session's start (new or restored): its profile's prompt, hooks and
        allowTools. The tools and the history come from the journal, not from here."""
        name = self.cfg.agent
        try:
            rt = await self.host.build_runtime(name, self.cwd, self.agent.tool_env())
        except InvalidRequest as err:
            self.error(f"agent {name}: {err} (running without its prompt and hooks)")
            return None
        self._adopt(rt)
        return rt

    async def _agent_started(self, rt: Runtime) -> None:
        """A new session (s/new) or a switched one (ctl agent): the agentSpawn hook, whose
        output joins the context, then the profile's userPrompts, queued in order."""
        spawn = await self.agent.hook(
            "agentSpawn", parent=self.id.rpartition("__")[0], depth=self.id.count("__")
        )
        if spawn is not None and spawn.context.strip():
            self.agent.add_message(Message("user", f"[agentSpawn hook]\n{spawn.context.strip()}"))
        for prompt in rt.user_prompts:
            try:
                await self.submit(prompt)
            except DiskError:
                break  # refused, and chat says so; the ones after it would be too

    def _relink(self, tools: list[str]) -> None:
        """A fresh toolsrv link (agent switched, or its toolsrv moved), ``tools`` wanted."""
        old = self.agent.link
        link = ToolLink(self.host.toolsrv, self.uid, tools, self.cfg.toolsrv)
        link.on_dropped = self._tool_dropped
        link.capture = self.capture_key
        if self._nursery is not None:
            link.bind(self._nursery)
        old.close()
        self.agent.link = link

    def switch_toolsrv(self, where: str) -> None:
        """``cfg toolsrv=``: the same tools, loaded again on the toolsrv ``where`` names
        (the next model request attaches there; a host not reachable says so then)."""
        self.set_cfg({"toolsrv": where})
        self._relink(list(self.agent.link.wanted))

    def set_cfg(self, values: Mapping[str, Any], *, announce: bool = True) -> None:
        self.record(persist.Cfg(dict(values)), strict=True)
        self.agent.cfg = self.agent.cfg.with_values(dict(values))
        if "toolsrv" in values:  # a restore: the link is not connected yet
            self.agent.link.where = self.cfg.toolsrv
        if announce:
            for key, value in values.items():
                self.emit("info", f"{key} set to {'(unset)' if value is None else value}")

    def set_tools(self, names: list[str], info: str) -> None:
        """The loaded tools changed; toolsrv learns it at the next refresh of the link."""
        self.record(persist.Tools(names), strict=True)
        self.agent.link.set_wanted(names)
        self.emit("info", info)

    def _tool_dropped(self, name: str, why: str) -> None:
        self.record(persist.Tools(list(self.agent.link.wanted)))
        self.emit("error", f"tool {name} unloaded: {why}")

    def clear(self) -> None:
        self.record(persist.Clear(), strict=True)
        self.agent.clear()
        self.turn_starts.clear()
        self.host.seal_checkpoints(self)
        self.emit("info", "history cleared")

    # ---- restore --------------------------------------------------------------------

    def replay(self, records: list[Record], *, announce: bool = True) -> None:
        """Rebuild the session from its journal (without writing to it again): each
        record goes to its entry of ``REPLAY``, the one table of record kinds.
        ``announce``: its events go to the root ``events`` too (at the start; not for a
        session restored at its first use, whose past is not news by then)."""
        self._replaying = True
        self._announce = announce
        r = _Replayed()
        streamed, lost = r.streamed, r.lost
        started, ended, prompts, dropped = r.started, r.ended, r.prompts, r.dropped
        try:
            for rec in records:
                rec = streamed.unpack(rec)
                step = REPLAY.get(type(rec))
                if step is not None:
                    step(self, rec, r)
        finally:
            self._replaying = False
            self._announce = True
            self.revision += 1
            self.host.costs_changed()
        # Writing on from here, the journal's next message is packed against the events
        # the replay ended with (a restored journal ends where a turn ended or was cut, so
        # this is normally empty; it matters only for a journal cut between the two).
        self._streamed = streamed
        for k, messages, size in lost:
            log.warning("session %s: branches/%d rebuilt from the journal", self.id, k)
            persist.write_branch(self.host.branches_dir(self), k, messages, self.chat.read(0, size))
        cut_turns = sorted(started - ended)
        for seq in cut_turns:
            # A turn cut by a crash: closed, never re-run (SPEC 3.7).
            self.agent.answer_open_calls("interrupted by restart before the tool ended")
            self.emit("info", "interrupted by restart")
            self.renderer.end_turn()
            self.record(persist.End(seq))
        if not cut_turns and self.state.value == "compacting":
            # A ``ctl compact`` cut by a crash (outside a turn, so no turn mark says it):
            # its Replaced record was never written, so the history is the old one.
            self.emit("info", "compaction interrupted by restart; history kept")
        self.queue.extend(
            (seq, prompts[seq])
            for seq in sorted(prompts)
            if seq not in started and seq not in dropped
        )
        self.set_state("thinking" if self.queue else "idle")
        try:
            self.journal.sync()
        except DiskError as err:  # the restore goes on; the next sync tries again
            log.warning("session %s: %s", self.id, err)


@dataclass
class _Replayed:
    """What a replay gathers beyond the session itself, for what it does at the end."""

    started: set[int] = field(default_factory=set)
    ended: set[int] = field(default_factory=set)
    prompts: dict[int, str] = field(default_factory=dict)
    dropped: set[int] = field(default_factory=set)
    streamed: persist.StreamedText = field(default_factory=persist.StreamedText)
    # Branches a crash left unwritten: (k, the history before the rewind, chat size).
    lost: list[tuple[int, list[Message], int]] = field(default_factory=list)


_Step = Callable[[Session, Any, _Replayed], None]
# The journal's record kinds, each with what replaying it does (as the ctl commands are
# a table, not an if-chain). ``Create`` has none: it is read by the registry, which makes
# the session. A kind missing here is skipped (tests/unit/test_replay_table.py).
REPLAY: dict[type, _Step] = {}


def _replays(kind: type) -> Callable[[_Step], _Step]:
    def register(step: _Step) -> _Step:
        REPLAY[kind] = step
        return step

    return register


@_replays(persist.Prompt)
def _(s: Session, rec: persist.Prompt, r: _Replayed) -> None:
    r.prompts[rec.seq] = rec.text
    s._seq = max(s._seq, rec.seq)
    s.prompt_prev = rec.text


@_replays(persist.Start)
def _(s: Session, rec: persist.Start, r: _Replayed) -> None:
    r.started.add(rec.seq)
    if not r.prompts.get(rec.seq, "").startswith("!"):
        s.turn_starts.append(len(s.agent.history.messages))


@_replays(persist.End)
def _(s: Session, rec: persist.End, r: _Replayed) -> None:
    r.ended.add(rec.seq)
    s.renderer.end_turn()


@_replays(persist.Ev)
def _(s: Session, rec: persist.Ev, r: _Replayed) -> None:
    s._show(rec.ev, encode_line(rec.ev))
    if rec.ev.role == "state":
        s.state.set(rec.ev.content)


@_replays(persist.Msg)
def _(s: Session, rec: persist.Msg, r: _Replayed) -> None:
    s.agent.history.append(rec.msg)
    s.agent.tool_calls += len(rec.msg.tool_calls)


@_replays(persist.UsageRec)
def _(s: Session, rec: persist.UsageRec, r: _Replayed) -> None:
    s.agent.history.totals.add(rec.usage, rec.cost, rec.estimated)


@_replays(persist.TurnCost)
def _(s: Session, rec: persist.TurnCost, r: _Replayed) -> None:
    s.agent.history.totals.last_turn_cost = rec.cost


@_replays(persist.Cfg)
def _(s: Session, rec: persist.Cfg, r: _Replayed) -> None:
    try:
        s.set_cfg(rec.values, announce=False)
    except InvalidRequest as err:  # a value an older version accepted
        log.warning("session %s: journaled cfg ignored: %s", s.id, err)


@_replays(persist.Rename)
def _(s: Session, rec: persist.Rename, r: _Replayed) -> None:
    s.id = rec.id


@_replays(persist.Clear)
def _(s: Session, rec: persist.Clear, r: _Replayed) -> None:
    s.agent.clear()
    s.turn_starts.clear()


@_replays(persist.Dropped)
def _(s: Session, rec: persist.Dropped, r: _Replayed) -> None:
    r.dropped.update(rec.seqs)


@_replays(persist.Replaced)
def _(s: Session, rec: persist.Replaced, r: _Replayed) -> None:
    s.agent.history.replace(rec.messages)
    s.turn_starts = [0]


@_replays(persist.TaskStateRec)
def _(s: Session, rec: persist.TaskStateRec, r: _Replayed) -> None:
    s.agent.taskstate = rec.state


@_replays(persist.Plan)
def _(s: Session, rec: persist.Plan, r: _Replayed) -> None:
    s.plan = rec.text


@_replays(persist.MaxSteps)
def _(s: Session, rec: persist.MaxSteps, r: _Replayed) -> None:
    s.agent.max_steps = rec.n


@_replays(persist.Rewind)
def _(s: Session, rec: persist.Rewind, r: _Replayed) -> None:
    history = s.agent.history
    s.branches = max(s.branches, rec.branch)
    if not (s.host.branches_dir(s) / str(rec.branch)).exists():
        # A crash between the record and its branch on disk: the branch is rebuilt
        # from what the journal says it was.
        r.lost.append((rec.branch, list(history.messages), len(s.chat)))
    cut = s.turn_starts[len(s.turn_starts) - rec.n]
    history.truncate(cut)
    del s.turn_starts[len(s.turn_starts) - rec.n :]


@_replays(persist.Tools)
def _(s: Session, rec: persist.Tools, r: _Replayed) -> None:
    s.agent.link.set_wanted(rec.names)


def _cost_cap(value: str | None) -> float | None:
    try:
        cap = float(value) if value else None
    except ValueError:
        log.warning("OLLIE_MAX_SESSION_COST is not a number: %r; no cap", value)
        return None
    return cap if cap is not None and cap >= 0 else None


def journal_path(sessions_dir: Path, uid: str) -> Path:
    return sessions_dir / f"{uid}.jsonl"
