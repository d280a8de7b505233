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

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec
import trio

from olliefs.agent.compact import (
    CompactionFailed,
    NothingToCompact,
    budget_for,
    next_snapshot_number,
    should_compact,
    write_snapshot,
)
from olliefs.agent.compact import compact as run_compaction
from olliefs.agent.compact import plan as plan_compaction
from olliefs.agent.config import Cfg
from olliefs.agent.dispatch import tool_env
from olliefs.agent.events import EventRole
from olliefs.agent.history import History, estimate_tokens
from olliefs.agent.hooks import (
    HOOK_TIMEOUT,
    HookEvent,
    HookFailure,
    HookResult,
    hook_payload,
    run_hook,
)
from olliefs.agent.loop import back_off, run_turn
from olliefs.agent.profile import permits
from olliefs.agent.retry import RetryPolicy
from olliefs.agent.runtime import ToolLink, preamble
from olliefs.agent.safety import Action, Safety
from olliefs.agent.shell import base_env
from olliefs.agent.taskstate import TaskState, infer, last_round, start_turn, to_json
from olliefs.backend.base import Backend, BackendError, GenerationParams, Message, Tool, Usage
from olliefs.errors import DiskError, OllieError, disk_error
from olliewire import ToolMeta

log = logging.getLogger(__name__)
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

    def taskstate_changed(self, state: TaskState) -> None: ...

    async def switch_backend(self, values: Mapping[str, str]) -> None:
        """Set ``backend`` / ``model`` during a turn (a turnError hook's recovery);
        raises an ``OllieError`` (nothing changed) when it cannot."""
        ...


@dataclass(frozen=True)
class Services:
    """What the daemon lends every agent."""

    backend: Callable[[str], Backend]
    profile_prompt: Callable[[str], str]
    tool_meta: Callable[[str], ToolMeta | None]  # from toolsrv's catalogue, when known
    mountpoint: str
    memory_dir: str
    results_root: Path
    # (backend, model) pairs that refused structured output: their compactions ask for
    # the answer in the prompt only (for the daemon's lifetime).
    plain_compaction: set[tuple[str, str]] = field(default_factory=set)


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
        self._tools_tokens: tuple[list[Tool] | None, int] = (None, 0)

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

    def overhead_estimate(self) -> int:
        """Tokens of what every request sends besides the history: the system prompt and
        the tool schemas (a provider that reports no usage is measured by this)."""
        tools, known = self._tools_tokens
        if tools is not self.link.tools:  # rebuilt as a new list when the tools change
            tools = self.link.tools
            schemas = [(t.name, t.description, t.parameters) for t in tools]
            known = estimate_tokens(_json.encode(schemas).decode()) if tools else 0
            self._tools_tokens = (tools, known)
        return estimate_tokens(self.systemprompt_text()) + known

    def request_estimate(self) -> int:
        """The estimate of a whole request: everything sent, not only the history."""
        return self.history.estimate() + self.overhead_estimate()

    def context_estimate(self) -> int:
        """The context's size: what the provider reported for the latest request, else
        (none reported, or a compaction since) the estimate of everything sent."""
        return self.history.totals.last_context_tokens or self.request_estimate()

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
            self.emit("info", w)  # it names the hook already
        if result.blocked:
            self.emit("error", f"blocked by the {event} hook: {result.reason or '(no reason)'}")
        return result

    def permits(self, tool: str) -> bool:
        return permits(self.allow_tools, tool)

    async def switch_backend(self, values: Mapping[str, str]) -> str | None:
        try:
            await self.host.switch_backend(values)
        except OllieError as err:
            return str(err)
        return None

    def set_taskstate(self, state: TaskState) -> None:
        """The TaskState changed: the host journals it (it survives a restart, so the
        next compaction starts from it and not from nothing)."""
        if state != self.taskstate:
            self.taskstate = state
            self.host.taskstate_changed(state)

    def turn_started(self, prompt: str) -> None:
        self.set_taskstate(start_turn(self.taskstate, prompt))
        self.safety.start_turn()

    def after_round(self) -> list[Action]:
        rnd = last_round(self.history.messages)
        if rnd is None:
            return []
        self.tool_calls += len(rnd.reply.tool_calls)
        self.set_taskstate(infer(self.taskstate, rnd, self.host.plan))
        return self.safety.after_round(self.taskstate, failed=rnd.failed, planned=rnd.planned)

    async def compact_if_needed(self, *, overflow: bool = False) -> bool:
        try:
            if self.compact_requested is not None and not overflow:
                focus, self.compact_requested = self.compact_requested, None
                return await self.compact(focus, "ctl")
            est = self.context_estimate()
            if not overflow and not should_compact(est, self.context_length):
                return False
            return await self.compact("", "overflow" if overflow else "auto")
        except DiskError as err:  # the turn goes on with the history it had
            self.emit("error", str(err))
            return False

    async def compact(
        self, focus: str, trigger: CompactTrigger = "ctl", *, after: str | None = "thinking"
    ) -> bool:
        """Compaction that loses nothing and always shrinks: the whole history goes to
        ``compactions/<n>/`` (fsync'd) before the compacted one replaces it. An answer
        the model gets wrong, or a request that fails after the usual retries, gives a
        mechanical compaction (``compact.py``), said so in chat. ``trigger`` is what
        the hooks are told: ``auto`` (half the context), ``overflow`` (the provider
        refused the request), ``ctl`` (``ctl compact``, with or without a focus).
        ``after`` is the state once it is over (None: the caller says, as the session
        does for a compaction outside a turn, which must not show ``thinking`` on its
        way back to ``idle``). preCompact's output is further instructions for the
        compaction model (the chat line names only the user's focus); postCompact's
        joins the new context. Nothing to compact is said in chat when asked for, and
        only logged for the automatic trigger (which would say it after every round of
        a context that stays above it). A snapshot the disk refuses (full) raises
        ``DiskError``, the history kept: ``ctl compact`` is refused with it, a
        compaction in a turn says so and goes on."""
        tokens = self.context_estimate()
        try:
            p = plan_compaction(
                self.history.messages,
                self.taskstate,
                focus,
                max_chars=self.context_length * 2,
                budget=budget_for(self.context_length, self.overhead_estimate()),
            )
        except NothingToCompact as err:
            if trigger == "auto":
                log.debug("session %s: %s", self.host.id, err.reason)
            else:
                self.emit("info", err.reason)
            return False
        except CompactionFailed as err:
            self.emit("error", f"compaction failed, history kept: {err}")
            return False
        pre = await self.hook("preCompact", trigger=trigger, focus=focus, tokens=tokens)
        if pre is not None and pre.blocked:
            return False
        if pre is not None and pre.context.strip():
            p = replace(p, focus="\n".join(x for x in (p.focus, pre.context.strip()) if x))
        self.set_state("compacting")
        self.emit("info", "compacting" + (f" (focus: {focus})" if focus else ""))
        try:
            model = self.compaction_model or self.cfg.model
            key = (self.cfg.backend, model)
            r = await run_compaction(
                self.backend(),
                model,
                p,
                self.params(),
                structured=key not in self.services.plain_compaction,
                retry=self.retry,
                wait=self._compaction_wait,
            )
            if r.schema_refused:
                self.services.plain_compaction.add(key)
                self.emit(
                    "info",
                    f"{self.cfg.backend} refused structured output for {model}: "
                    "compactions there ask for the answer in the prompt only",
                )
            where = self.host.compactions_dir()
            n = next_snapshot_number(where)
            await trio.to_thread.run_sync(write_snapshot, where, n, p.before, r.summary, r.dropped)
        except OSError as err:
            raise disk_error(err, "compaction failed, history kept: compactions/") from None
        finally:
            if after is not None:
                self.set_state(after)
        self.history.replace(r.messages)
        self.host.history_replaced(r.messages, n)
        self.set_taskstate(r.state)
        how = f" mechanically (compactions/{n}): {r.mechanical}" if r.mechanical else ""
        self.emit(
            "info",
            f"compacted {len(p.before)} messages into {len(r.messages)}"
            + (how or f" (compactions/{n})"),
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

    def clear(self) -> None:
        """``ctl clear`` or an agent switch (a ``Clear`` record, which also says this):
        the conversation and what was inferred from it go. The count of tool rounds
        stays, as ``tcct`` does: it counts the session's, not the conversation's."""
        self.history.clear()
        self.taskstate = TaskState(rounds=self.taskstate.rounds)

    async def _compaction_wait(self, err: BackendError, delay: float) -> None:
        """A compaction request's retry waits, shown as a turn's are (``limitretry``)."""
        await back_off(self, err, delay, resume="compacting")

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
            permits=self.permits,
        )

    def ctxsz_text(self) -> str:
        est = self.context_estimate()
        pct = 100.0 * est / self.context_length if self.context_length else 0.0
        return f"{est} / {self.context_length} ({pct:.0f}%)\n"

    def context_text(self) -> str:
        """The history as JSON lines; an image shows its type and size, not its data."""
        return "".join(
            _json.encode(_shown(m) if m.images else m).decode() + "\n"
            for m in self.history.messages
        )

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


def _shown(m: Message) -> Message:
    return msgspec.structs.replace(
        m, images=tuple(msgspec.structs.replace(i, data="") for i in m.images)
    )
