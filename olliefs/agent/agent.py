"""The agent: history, tool link, configuration and retry policy — the turn's host.

``loop.run_turn`` defines what a turn needs (``TurnHost``); ``Agent`` is that host. It
knows nothing of the tree, the journal or other sessions: what it produces goes to its
``AgentHost`` (the session), which shows it and records it. What it needs from the
daemon (backends by name, profile prompts, where tools keep their output) comes in as
``Services``, so an agent can be built and driven in a test without a mount.

Split of responsibilities with the session:

* the agent owns what the model sees and how it is asked: ``cfg`` (backend, model,
  profile, cwd, generation parameters), ``history``, ``link`` (loaded tools), ``retry``,
  ``max_steps``, the context length;
* the session owns how that is shown and kept: logs, state, queue, journal, the runner.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec
import trio

from olliefs.agent.compact import (
    CompactionFailed,
    next_snapshot_number,
    should_compact,
    write_snapshot,
)
from olliefs.agent.compact import compact as run_compaction
from olliefs.agent.compact import plan as plan_compaction
from olliefs.agent.config import Cfg
from olliefs.agent.dispatch import tool_env
from olliefs.agent.events import EventRole
from olliefs.agent.history import History
from olliefs.agent.hooks import (
    HOOK_TIMEOUT,
    HookEvent,
    HookFailure,
    HookResult,
    hook_payload,
    run_hook,
)
from olliefs.agent.loop import run_turn
from olliefs.agent.profile import permits
from olliefs.agent.retry import RetryPolicy
from olliefs.agent.runtime import ToolLink, preamble
from olliefs.agent.safety import Action, Safety
from olliefs.agent.shell import base_env
from olliefs.agent.taskstate import TaskState, infer, last_round, start_turn, to_json
from olliefs.backend.base import Backend, GenerationParams, Message, Usage
from olliefs.errors import DiskError, disk_error
from toolsrv.protocol import ToolMeta

_json = msgspec.json.Encoder()

CompactTrigger = Literal["auto", "overflow", "ctl"]


class AgentHost(Protocol):
    """What an agent needs from the session that hosts it."""

    @property
    def id(self) -> str: ...

    def emit(
        self, role: EventRole, content: str = "", name: str = "", response_id: str = ""
    ) -> None: ...

    def set_state(self, state: str) -> None: ...

    def message_added(self, msg: Message) -> None: ...

    def usage_added(self, usage: Usage, cost: float, estimated: bool) -> None: ...

    async def checkpoint(self) -> None: ...

    @property
    def plan(self) -> str: ...

    def compactions_dir(self) -> Path: ...

    def history_replaced(self, messages: list[Message], n: int) -> None: ...


@dataclass(frozen=True)
class Services:
    """What the daemon lends every agent."""

    backend: Callable[[str], Backend]
    profile_prompt: Callable[[str], str]
    tool_meta: Callable[[str], ToolMeta | None]  # from toolsrv's catalogue, when known
    mountpoint: str
    memory_dir: str
    results_root: Path


class Agent:
    def __init__(
        self,
        host: AgentHost,
        services: Services,
        *,
        uid: str,
        cfg: Cfg,
        link: ToolLink,
        retry: RetryPolicy,
        context_length: int,
    ) -> None:
        self.host = host
        self.services = services
        self.uid = uid
        self.cfg = cfg
        self.link = link
        self.retry = retry
        self.history = History()
        self._system = Message("system", "")
        self.max_steps = 50
        self.context_length = context_length
        self.turn_cost = 0.0
        self.injection: str | None = None  # ctl inject / irw, taken at the next step
        self.taskstate = TaskState()
        self.safety = Safety()
        self.tool_calls = 0  # tcct: the session's tool calls so far
        self.allow_tools: tuple[str, ...] | None = None  # the profile's allowTools
        self.prompt: str | None = None  # the profile's resolved prompt, once built
        self.hooks: dict[str, list[str]] = {}  # event -> shell commands (the profile's)
        self.hook_failure: HookFailure = "warn"
        self.hook_timeout = HOOK_TIMEOUT
        self.compaction_model: str | None = None  # the profile's compactionModel
        self.text_tool_calls: bool | None = None  # the profile's textToolCalls
        # ``ctl compact`` during a turn (the agent asking through its own ctl, or the
        # user): the focus, taken before the turn's next request.
        self.compact_requested: str | None = None
        self.max_session_cost: float | None = None  # OLLIE_MAX_SESSION_COST

    # ---- the turn host --------------------------------------------------------------

    @property
    def model(self) -> str:
        return self.cfg.model

    @property
    def cwd(self) -> str:
        return self.cfg.cwd

    def backend(self) -> Backend:
        return self.services.backend(self.cfg.backend)

    def params(self) -> GenerationParams:
        params = self.cfg.params()
        if self.text_tool_calls is None:
            return params
        return msgspec.structs.replace(params, text_tools=self.text_tool_calls)

    def set_state(self, state: str) -> None:
        self.host.set_state(state)

    def emit(
        self, role: EventRole, content: str = "", name: str = "", response_id: str = ""
    ) -> None:
        self.host.emit(role, content, name, response_id)

    def add_message(self, msg: Message) -> None:
        self.host.message_added(msg)
        self.history.append(msg)

    def add_usage(self, usage: Usage, cost: float, estimated: bool) -> None:
        self.host.usage_added(usage, cost, estimated)
        self.history.totals.add(usage, cost, estimated)
        self.turn_cost += cost

    def request_messages(self) -> list[Message]:
        text = self.systemprompt_text()
        if self._system.content != text:
            # Kept while its text is the same: a request's messages then begin with the
            # previous request's, as the same objects (``WireCache``).
            self._system = Message("system", text)
        return [self._system, *self.history.for_model()]

    async def checkpoint(self) -> None:
        """After each tool round: the journal reaches the disk (SPEC 4 persistence)."""
        await self.host.checkpoint()

    def take_injection(self) -> str | None:
        text, self.injection = self.injection, None
        return text

    def over_budget(self) -> str | None:
        cap = self.max_session_cost
        spent = self.history.totals.session_cost
        if cap is not None and spent >= cap:
            return (
                f"session cost ${spent:.4f} reached the cap of ${cap:.4f} "
                "(OLLIE_MAX_SESSION_COST); the turn ends here"
            )
        return None

    async def hook(self, event: HookEvent, **fields: Any) -> HookResult | None:
        """Run the profile's commands for ``event`` (None when it has none); warnings
        become chat lines, the caller acts on ``blocked`` and ``context``."""
        cmds = self.hooks.get(event)
        if not cmds:
            return None
        c = self.cfg
        payload = hook_payload(
            event,
            session_id=self.host.id,
            agent=c.agent,
            cwd=c.cwd,
            backend=c.backend,
            model=c.model,
            **fields,
        )
        result = await run_hook(
            event,
            cmds,
            payload,
            cwd=c.cwd,
            env=base_env() | dict(self.tool_env()),
            timeout=self.hook_timeout,
            failure=self.hook_failure,
        )
        for w in result.warnings:
            self.emit("info", f"hook {event}: {w}")
        if result.blocked:
            self.emit("error", f"blocked by the {event} hook: {result.reason or '(no reason)'}")
        return result

    def permits(self, tool: str) -> bool:
        return permits(self.allow_tools, tool)

    def turn_started(self, prompt: str) -> None:
        self.taskstate = start_turn(self.taskstate, prompt)
        self.safety.start_turn()

    def after_round(self) -> list[Action]:
        rnd = last_round(self.history.messages)
        if rnd is None:
            return []
        self.tool_calls += len(rnd.reply.tool_calls)
        self.taskstate = infer(self.taskstate, rnd, self.host.plan)
        return self.safety.after_round(self.taskstate, failed=rnd.failed, planned=rnd.planned)

    async def compact_if_needed(self, *, overflow: bool = False) -> bool:
        try:
            if self.compact_requested is not None and not overflow:
                focus, self.compact_requested = self.compact_requested, None
                return await self.compact(focus, "ctl")
            est = self.history.totals.last_context_tokens or self.history.estimate()
            if not overflow and not should_compact(est, self.context_length):
                return False
            return await self.compact("", "overflow" if overflow else "auto")
        except DiskError as err:  # the turn goes on with the history it had
            self.emit("error", str(err))
            return False

    async def compact(
        self, focus: str, trigger: CompactTrigger = "ctl", *, after: str | None = "thinking"
    ) -> bool:
        """Compaction that loses nothing: the whole history goes to
        ``compactions/<n>/`` (fsync'd) before the compacted one replaces it; a failed or
        malformed answer keeps the old history and says why in chat. ``trigger`` is what
        the hooks are told: ``auto`` (half the context), ``overflow`` (the provider
        refused the request), ``ctl`` (``ctl compact``, with or without a focus).
        ``after`` is the state once it is over (None: the caller says, as the session
        does for a compaction outside a turn, which must not show ``thinking`` on its
        way back to ``idle``). preCompact's output is further instructions for the
        compaction model (the chat line names only the user's focus); postCompact's
        joins the new context. A snapshot the disk refuses (full) raises ``DiskError``,
        the history kept: ``ctl compact`` is refused with it, a compaction in a turn
        says so and goes on."""
        tokens = self.history.totals.last_context_tokens or self.history.estimate()
        pre = await self.hook("preCompact", trigger=trigger, focus=focus, tokens=tokens)
        if pre is not None and pre.blocked:
            return False
        ask = focus
        if pre is not None and pre.context.strip():
            ask = "\n".join(x for x in (focus, pre.context.strip()) if x)
        self.set_state("compacting")
        self.emit("info", "compacting" + (f" (focus: {focus})" if focus else ""))
        try:
            p = plan_compaction(
                self.history.messages, self.taskstate, ask, max_chars=self.context_length * 2
            )
            model = self.compaction_model or self.cfg.model
            r = await run_compaction(self.backend(), model, p, self.params())
            where = self.host.compactions_dir()
            n = next_snapshot_number(where)
            await trio.to_thread.run_sync(write_snapshot, where, n, p.before, r.summary, r.dropped)
        except CompactionFailed as err:
            self.emit("error", f"compaction failed, history kept: {err}")
            return False
        except OSError as err:
            raise disk_error(err, "compaction failed, history kept: compactions/") from None
        finally:
            if after is not None:
                self.set_state(after)
        self.history.replace(r.messages)
        self.taskstate = r.state
        self.host.history_replaced(r.messages, n)
        self.emit(
            "info",
            f"compacted {len(p.before)} messages into {len(r.messages)} (compactions/{n})",
        )
        post = await self.hook(
            "postCompact",
            trigger=trigger,
            compaction=n,
            messages_before=len(p.before),
            messages_after=len(r.messages),
        )
        if post is not None and post.context.strip():
            self.add_message(Message("user", f"[postCompact hook]\n{post.context.strip()}"))
        return True

    def taskstate_text(self) -> str:
        return to_json(self.taskstate)

    def tool_env(self) -> Mapping[str, str]:
        return tool_env(
            mountpoint=self.services.mountpoint,
            session_id=self.host.id,
            agent=self.cfg.agent,
            cwd=self.cfg.cwd,
            memory_dir=self.services.memory_dir,
        )

    def results_dir(self) -> Path:
        return self.services.results_root / self.host.id / "results"

    async def run(self, prompt: str) -> None:
        self.turn_cost = 0.0
        await run_turn(self, prompt)

    # ---- what the tree shows of it --------------------------------------------------

    def systemprompt_text(self) -> str:
        return preamble(
            session_id=self.host.id,
            cwd=self.cfg.cwd,
            profile_prompt=(
                self.prompt
                if self.prompt is not None
                else self.services.profile_prompt(self.cfg.agent)
            ),
            link=self.link,
        )

    def ctxsz_text(self) -> str:
        est = self.history.totals.last_context_tokens or self.history.estimate()
        pct = 100.0 * est / self.context_length if self.context_length else 0.0
        return f"{est} / {self.context_length} ({pct:.0f}%)\n"

    def context_text(self) -> str:
        return "".join(_json.encode(m).decode() + "\n" for m in self.history.messages)

    def tools_text(self) -> str:
        """``tools``: the loaded tools, with tier and parallel flag (SPEC 3.3)."""
        lines = []
        for name in self.link.wanted:
            meta = self.link.metas.get(name) or self.services.tool_meta(name)
            if meta is None:
                lines.append(f"{name}\t?\t?\n")
            else:
                flag = "parallel" if meta.parallel else "serial"
                lines.append(f"{name}\t{meta.tier}\t{flag}\n")
        return "".join(lines)

    def answer_open_calls(self, why: str) -> None:
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
