"""A session: the stable host of one agent, its logs, its queue and its journal.

Everything a session shows in the tree is derived here: ``chat`` and ``events`` are
``GrowingLog``s fed by ``emit``, ``state`` is a ``StateCell``, the rest are small texts.
Every change goes to the journal first, so that replaying it (``restore``) rebuilds the
same session after a crash.

Control requests (``ctl``, ``cfg``) are validated whole before anything is applied: a
write holding several lines either applies all of them or none (SPEC 3.7).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from olliefs.agent.chat import ChatRenderer, GrowingLog
from olliefs.agent.dispatch import tool_env
from olliefs.agent.events import Event, EventRole, encode_line
from olliefs.agent.history import History
from olliefs.agent.loop import run_turn
from olliefs.agent.retry import RetryPolicy
from olliefs.agent.runtime import ToolLink, preamble
from olliefs.agent.state import StateCell
from olliefs.backend.base import Backend, BackendError, GenerationParams, Message, Usage
from olliefs.errors import Busy, InvalidRequest
from olliefs.session import persist
from olliefs.session.persist import Journal, Record

if TYPE_CHECKING:
    from olliefs.session.registry import Registry

log = logging.getLogger(__name__)

# cfg key -> (GenerationParams field, parser)
PARAMS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "maxTokens": ("max_tokens", int),
    "temperature": ("temperature", float),
    "frequencyPenalty": ("frequency_penalty", float),
    "presencePenalty": ("presence_penalty", float),
}
CFG_KEYS = ("state", "backend", "model", "agent", "cwd", *PARAMS)

Apply = Callable[[], None]
_json = msgspec.json.Encoder()


def resolve_cwd(value: str) -> str:
    """``~`` expanded; must be absolute and an existing directory."""
    path = os.path.expanduser(value)
    if not os.path.isabs(path):
        raise InvalidRequest(f"cwd must be an absolute path: {value}")
    if not os.path.isdir(path):
        raise InvalidRequest(f"cwd is not an existing directory: {value}")
    return os.path.normpath(path)


def parse_param(key: str, value: str) -> Any:
    if value == "":
        return None
    field, parse = PARAMS[key]
    try:
        v = parse(value)
    except ValueError:
        raise InvalidRequest(f"{key}: not a number: {value}") from None
    if isinstance(v, float) and not math.isfinite(v):
        raise InvalidRequest(f"{key}: not a finite number: {value}")
    if field == "max_tokens" and v <= 0:
        raise InvalidRequest(f"{key} must be positive: {value}")
    return v


class Session:
    def __init__(
        self,
        registry: Registry,
        journal: Journal,
        *,
        uid: str,
        id: str,
        cwd: str,
        backend: str,
        model: str,
        agent: str,
        created: float,
    ) -> None:
        self.registry = registry
        self.journal = journal
        self.uid = uid
        self.id = id
        self.cwd = cwd
        self.backend_name = backend
        self._model = model
        self.agent = agent
        self.created = created
        self.gen: dict[str, Any] = {}  # GenerationParams fields that are set
        self.chat = GrowingLog()
        self.renderer = ChatRenderer(self.chat)
        self.events = GrowingLog()
        self.state = StateCell()
        self.history = History()
        self.retry = RetryPolicy.from_settings(registry.settings)
        self.max_steps = 50
        self.prompt_prev = ""
        self.queue: deque[tuple[int, str]] = deque()
        self._queue_lot = trio.lowlevel.ParkingLot()
        self._seq = 0
        self._running_seq: int | None = None
        self._turn_scope: trio.CancelScope | None = None
        self._turn_cost = 0.0
        self._scope = trio.CancelScope()
        self.closed = False
        self.context_length = registry.default_context_length
        self._replaying = False
        self.link = ToolLink(registry.toolsrv, uid, registry.profile_tools(agent))
        self.link.on_dropped = self._tool_dropped

    # ---- identity and derived texts -------------------------------------------------

    @property
    def model(self) -> str:
        return self._model

    @property
    def running(self) -> bool:
        return self._running_seq is not None

    def backend(self) -> Backend:
        return self.registry.backend(self.backend_name)

    def params(self) -> GenerationParams:
        return GenerationParams(**self.gen)

    def cfg_text(self) -> str:
        lines = [
            f"state={self.state.value}",
            f"backend={self.backend_name}",
            f"model={self.model}",
            f"agent={self.agent}",
            f"cwd={self.cwd}",
        ]
        for key, (field, _) in PARAMS.items():
            v = self.gen.get(field)
            lines.append(f"{key}={'' if v is None else v}")
        return "\n".join(lines) + "\n"

    def ctxsz_text(self) -> str:
        est = self.history.totals.last_context_tokens or self.history.estimate()
        pct = 100.0 * est / self.context_length if self.context_length else 0.0
        return f"{est} / {self.context_length} ({pct:.0f}%)\n"

    def context_text(self) -> str:
        return "".join(_json.encode(m).decode() + "\n" for m in self.history.messages)

    def env_text(self) -> str:
        return (
            f"OLLIE_SESSION_ID={self.id}\n"
            f"OLLIE={self.registry.mountpoint}\n"
            f"OLLIE_AGENT={self.agent}\n"
            f"OLLIE_BACKEND={self.backend_name}\n"
            f"OLLIE_MODEL={self.model}\n"
            f"OLLIE_CWD={self.cwd}\n"
        )

    def tail_script(self) -> str:
        # Relative to the script itself, so it keeps working after a rename.
        return '#!/bin/sh\n# follow this session live\nexec cat "$(dirname "$0")/stream"\n'

    def tools_text(self) -> str:
        """``tools``: the loaded tools, with tier and parallel flag (SPEC 3.3)."""
        lines = []
        for name in self.link.wanted:
            meta = self.link.metas.get(name) or self.registry.tool_meta(name)
            if meta is None:
                lines.append(f"{name}\t?\t?\n")
            else:
                flag = "parallel" if meta.parallel else "serial"
                lines.append(f"{name}\t{meta.tier}\t{flag}\n")
        return "".join(lines)

    def systemprompt_text(self) -> str:
        return preamble(
            session_id=self.id,
            cwd=self.cwd,
            profile_prompt=self.registry.profile_prompt(self.agent),
            link=self.link,
        )

    def request_messages(self) -> list[Message]:
        return [Message("system", self.systemprompt_text()), *self.history.for_model()]

    def tool_env(self) -> dict[str, str]:
        return tool_env(
            mountpoint=self.registry.mountpoint,
            session_id=self.id,
            agent=self.agent,
            cwd=self.cwd,
            memory_dir=str(self.registry.paths.memory),
        )

    def results_dir(self) -> Path:
        return self.registry.toolsrv.tmp_root / self.id / "results"

    async def checkpoint(self) -> None:
        """After each tool round: the journal reaches the disk (SPEC 4 persistence)."""
        await self.sync()

    def idx_line(self) -> str:
        return f"{self.id}\t{self.state.value}\t{self.cwd}\t{self.backend_name}\t{self.model}\n"

    # ---- output ---------------------------------------------------------------------

    def record(self, rec: Record) -> None:
        if not self._replaying:
            self.journal.append(rec)

    def emit(
        self, role: EventRole, content: str = "", name: str = "", response_id: str = ""
    ) -> None:
        ev = Event(time.time(), self.id, self.uid, role, name, content, response_id)
        self.record(persist.Ev(ev))
        self._show(ev)

    def _show(self, ev: Event) -> None:
        self.renderer.render(ev)
        line = encode_line(ev)
        self.events.append(line)
        self.registry.events.append(line)

    def set_state(self, state: str) -> None:
        if self.state.set(state):
            self.emit("state", state)

    def add_message(self, msg: Message) -> None:
        self.record(persist.Msg(msg))
        self.history.append(msg)

    def add_usage(self, usage: Usage, cost: float, estimated: bool) -> None:
        self.record(persist.UsageRec(usage, cost, estimated))
        self.history.totals.add(usage, cost, estimated)
        self._turn_cost += cost

    def error(self, message: str) -> None:
        self.emit("error", message)

    # ---- prompts and the turn runner ------------------------------------------------

    async def submit(self, text: str) -> None:
        """Acknowledge a prompt: journal it, fsync, show its ``user:`` line, queue it."""
        text = text.strip()
        if not text or self.closed:
            return
        self._seq += 1
        seq = self._seq
        self.record(persist.Prompt(seq, text, time.time()))
        self.emit("user", text)
        self.prompt_prev = text
        await self.sync()
        self.queue.append((seq, text))
        self._queue_lot.unpark_all()
        self.set_state("thinking")  # running or queued, as soon as it is acknowledged

    async def sync(self) -> None:
        await trio.to_thread.run_sync(self.journal.sync)

    async def run(self) -> None:
        """The session's life: run queued prompts one at a time until it is killed."""
        with self._scope:
            async with trio.open_nursery() as nursery:
                self.link.bind(nursery)  # the toolsrv connection lives in here
                try:
                    while True:
                        while not self.queue:
                            await self._queue_lot.park()
                        seq, text = self.queue.popleft()
                        await self._run_one(seq, text)
                finally:
                    self.link.close()

    async def _run_one(self, seq: int, text: str) -> None:
        self._running_seq = seq
        self._turn_cost = 0.0
        self.record(persist.Start(seq))
        try:
            with trio.CancelScope() as scope:
                self._turn_scope = scope
                self.context_length = await self.registry.context_length(self)
                await run_turn(self, text)
            if scope.cancelled_caught:
                self.emit("info", "stopped")
        except BackendError as err:
            self.emit("error", str(err))
        except Exception as err:  # a bug must not take the daemon down
            log.exception("turn of session %s failed", self.id)
            self.emit("error", f"internal error: {type(err).__name__}: {err}")
        finally:
            self._turn_scope = None
            self._running_seq = None
            self.renderer.end_turn()
            self.history.totals.last_turn_cost = self._turn_cost
            self.record(persist.TurnCost(self._turn_cost))
            self.record(persist.End(seq))
            if not self.queue:
                self.set_state("idle")
        with trio.CancelScope(shield=True):
            await self.sync()

    def stop(self) -> None:
        if self._turn_scope is not None:
            self._turn_scope.cancel()

    def close(self) -> None:
        """Stop everything; wake every reader so blocked reads end with EOF."""
        self.closed = True
        self.stop()
        self._scope.cancel()
        self.link.close()
        self.chat.close()
        self.events.close()
        self.state.wake()
        self.journal.close()

    # ---- control --------------------------------------------------------------------

    def _busy(self, what: str) -> None:
        if self.running:
            raise Busy(f"{what}: refused while a turn is running (ctl stop first)")

    def _prepare_ctl(self, line: str, wanted: list[str]) -> Apply:
        """One ctl line checked; ``wanted`` is the tool list as the earlier lines of the
        same write leave it (``tool_load a`` then ``tool_unload a`` is valid)."""
        cmd, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        reg = self.registry

        def need_arg() -> str:
            if not arg:
                raise InvalidRequest(f"{cmd}: missing argument")
            return arg

        def no_arg() -> None:
            if arg:
                raise InvalidRequest(f"{cmd}: takes no argument")

        if cmd == "stop":
            no_arg()
            return self.stop
        if cmd == "kill":
            no_arg()
            return lambda: reg.kill(self)
        if cmd == "rn":
            new = need_arg()
            self._busy("rn")
            reg.check_new_name(new)
            return lambda: reg.rename(self, new)
        if cmd == "backend":
            name = need_arg()
            reg.check_backend(name)
            self._busy("backend")
            return lambda: self._set_cfg({"backend": name})
        if cmd == "model":
            name = need_arg()
            self._busy("model")
            return lambda: self._set_cfg({"model": name})
        if cmd == "cwd":
            path = resolve_cwd(need_arg())
            self._busy("cwd")
            return lambda: self._set_cfg({"cwd": path})
        if cmd in ("tool_load", "tool_unload"):
            name = need_arg()
            if cmd == "tool_load":
                if name not in self.registry.known_tools(self.link):
                    raise InvalidRequest(f"tool_load: unknown tool: {name}")
                if name in wanted:
                    return lambda: None
                wanted.append(name)
            else:
                if name not in wanted:
                    raise InvalidRequest(f"tool_unload: not loaded: {name}")
                wanted.remove(name)
            verb = "loaded" if cmd == "tool_load" else "unloaded"
            return lambda: self._set_tools(list(wanted), f"tool {name} {verb}")
        if cmd == "clear":
            no_arg()
            self._busy("clear")
            return self._clear
        if not cmd:
            raise InvalidRequest("empty command")
        raise InvalidRequest(f"unknown command: {cmd}")

    def ctl(self, text: str) -> None:
        wanted = list(self.link.wanted)
        self._apply_all(text, lambda line: self._prepare_ctl(line, wanted))

    def _set_tools(self, names: list[str], info: str) -> None:
        """The loaded tools changed; toolsrv learns it at the next refresh of the link."""
        self.record(persist.Tools(names))
        self.link.set_wanted(names)
        self.emit("info", info)

    def _tool_dropped(self, name: str, why: str) -> None:
        self.record(persist.Tools(list(self.link.wanted)))
        self.emit("error", f"tool {name} unloaded: {why}")

    def write_cfg(self, text: str) -> None:
        self._apply_all(text, self._prepare_cfg)

    def _apply_all(self, text: str, prepare: Callable[[str], Apply]) -> None:
        try:
            actions = [prepare(line) for line in text.splitlines() if line.strip()]
        except (InvalidRequest, Busy) as err:
            self.error(str(err))
            raise
        for act in actions:
            act()
        self.journal.sync()

    def _prepare_cfg(self, line: str) -> Apply:
        key, sep, value = line.strip().partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise InvalidRequest(f"cfg: expected key=value: {line.strip()}")
        if key not in CFG_KEYS:
            raise InvalidRequest(f"cfg: unknown key: {key}")
        current = self.cfg_values()
        if key == "state":
            if value != self.state.value:
                raise InvalidRequest("cfg: state is read-only (use ctl stop)")
            return lambda: None
        if key in PARAMS:
            new: Any = parse_param(key, value)
            field = PARAMS[key][0]
            if new == self.gen.get(field):
                return lambda: None
            self._busy(f"cfg {key}")
            return lambda: self._set_cfg({key: new})
        if not value or value == current[key]:
            return lambda: None
        if key == "backend":
            self.registry.check_backend(value)
        elif key == "agent":
            self.registry.check_agent(value)
        elif key == "cwd":
            value = resolve_cwd(value)
        self._busy(f"cfg {key}")
        return lambda: self._set_cfg({key: value})

    def cfg_values(self) -> dict[str, Any]:
        return {
            "backend": self.backend_name,
            "model": self.model,
            "agent": self.agent,
            "cwd": self.cwd,
        }

    def _set_cfg(self, values: Mapping[str, Any], *, announce: bool = True) -> None:
        self.record(persist.Cfg(dict(values)))
        for key, value in values.items():
            if key == "backend":
                self.backend_name = value
            elif key == "model":
                self._model = value
            elif key == "agent":
                self.agent = value
            elif key == "cwd":
                self.cwd = value
            elif key in PARAMS:
                field = PARAMS[key][0]
                if value is None:
                    self.gen.pop(field, None)
                else:
                    self.gen[field] = value
            if announce:
                self.emit("info", f"{key} set to {'(unset)' if value is None else value}")

    def _answer_open_calls(self, why: str) -> None:
        """Tool calls of the last assistant message left without an answer get one, so
        the history stays valid for the provider (every call answered)."""
        msgs = self.history.messages
        last = max((i for i, m in enumerate(msgs) if m.role == "assistant"), default=-1)
        if last < 0:
            return
        answered = {m.tool_call_id for m in msgs[last + 1 :] if m.role == "tool"}
        for call in msgs[last].tool_calls:
            if call.id not in answered:
                text = f"[tool error] {why}"
                self.emit("tool", text, name=call.name)
                self.add_message(Message("tool", text, tool_call_id=call.id, name=call.name))

    def _clear(self) -> None:
        self.record(persist.Clear())
        self.history.clear()
        self.emit("info", "history cleared")

    # ---- restore --------------------------------------------------------------------

    def replay(self, records: list[Record]) -> None:
        """Rebuild the session from its journal (without writing to it again)."""
        self._replaying = True
        started: set[int] = set()
        prompts: dict[int, str] = {}
        ended: set[int] = set()
        try:
            for rec in records:
                if isinstance(rec, persist.Prompt):
                    prompts[rec.seq] = rec.text
                    self._seq = max(self._seq, rec.seq)
                    self.prompt_prev = rec.text
                elif isinstance(rec, persist.Start):
                    started.add(rec.seq)
                elif isinstance(rec, persist.End):
                    ended.add(rec.seq)
                    self.renderer.end_turn()
                elif isinstance(rec, persist.Ev):
                    self._show(rec.ev)
                    if rec.ev.role == "state":
                        self.state.set(rec.ev.content)
                elif isinstance(rec, persist.Msg):
                    self.history.append(rec.msg)
                elif isinstance(rec, persist.UsageRec):
                    self.history.totals.add(rec.usage, rec.cost, rec.estimated)
                elif isinstance(rec, persist.TurnCost):
                    self.history.totals.last_turn_cost = rec.cost
                elif isinstance(rec, persist.Cfg):
                    self._set_cfg(rec.values, announce=False)
                elif isinstance(rec, persist.Rename):
                    self.id = rec.id
                elif isinstance(rec, persist.Clear):
                    self.history.clear()
                elif isinstance(rec, persist.Tools):
                    self.link.set_wanted(rec.names)
        finally:
            self._replaying = False
        for seq in sorted(started - ended):
            # A turn cut by a crash: closed, never re-run (SPEC 3.7).
            self._answer_open_calls("interrupted by restart before the tool ended")
            self.emit("info", "interrupted by restart")
            self.renderer.end_turn()
            self.record(persist.End(seq))
        self.queue.extend((seq, prompts[seq]) for seq in sorted(prompts) if seq not in started)
        self.set_state("thinking" if self.queue else "idle")
        self.journal.sync()


def journal_path(sessions_dir: Path, uid: str) -> Path:
    return sessions_dir / f"{uid}.jsonl"
