"""One turn of an agent: stream the model, handle its tool calls, repeat until it stops.

The turn runs inside the session's cancel scope, so ``stop`` cancels it wherever it is:
in the HTTP stream, in a retry back-off, in a tool. A reply cut by ``stop`` is kept, both
in ``chat`` (already streamed there) and in the history, so the model sees what it said.

Tool calls go through ``dispatch.run_tools`` to toolsrv. Before the first request and
after every tool round the agent's ``ToolLink`` is refreshed: pending ``tool_load`` /
``tool_unload`` are pushed and, when toolsrv's ``agent/rev`` moved, the schemas and the
preamble are rebuilt, so a tool loaded by the model in one round is callable in the next.
If toolsrv cannot be reached the turn goes on (the refresh says so with an error line).

Tools the provider ran itself (Anthropic's server tools) come as ``server_call`` /
``server_result`` events of the reply: they are shown in ``chat`` like calls and
results, and never run here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import trio

from olliefs.agent.cache import ReadCache
from olliefs.agent.chat import format_seconds
from olliefs.agent.cost import request_cost
from olliefs.agent.dispatch import ToolHost, one_line_args, run_tools
from olliefs.agent.events import EventRole
from olliefs.agent.history import History, estimate_tokens
from olliefs.agent.hooks import HookEvent, HookResult
from olliefs.agent.retry import RetryPolicy
from olliefs.agent.safety import Abort, Action, Nudge, Reinject
from olliefs.backend.base import (
    Backend,
    BackendError,
    BadResponseError,
    ContextOverflowError,
    GenerationParams,
    Message,
    ProviderData,
    RateLimitError,
    StreamDropError,
    ToolCall,
    ToolUnsupportedError,
    TransientError,
    Usage,
)
from olliefs.toolclient.client import ToolsrvError

log = logging.getLogger(__name__)


class TurnHost(ToolHost, Protocol):
    """What a turn needs from the session that runs it."""

    history: History
    retry: RetryPolicy
    max_steps: int

    @property
    def model(self) -> str: ...

    def backend(self) -> Backend: ...

    def params(self) -> GenerationParams: ...

    def set_state(self, state: str) -> None: ...

    def emit(
        self, role: EventRole, content: str = "", name: str = "", response_id: str = ""
    ) -> None: ...

    def add_message(self, msg: Message) -> None: ...

    def add_usage(self, usage: Usage, cost: float, estimated: bool) -> None: ...

    def request_messages(self) -> list[Message]: ...

    def request_estimate(self) -> int:
        """Estimated tokens of a whole request (history, system prompt, tool schemas)."""
        ...

    async def checkpoint(self) -> None: ...

    def take_injection(self) -> str | None:
        """Text injected into the running turn (``ctl inject``), taken once."""
        ...

    def over_budget(self) -> str | None:
        """Why the turn must end now (a cost cap reached), or None."""
        ...

    def turn_started(self, prompt: str) -> None:
        """A new turn: TaskState's goal, the safety counters reset."""
        ...

    def after_round(self) -> list[Action]:
        """After a tool round: TaskState inferred, what the safety table says to do."""
        ...

    async def hook(self, event: HookEvent, **fields: Any) -> HookResult | None:
        """Run the profile's hook commands for ``event`` (None: it has none)."""
        ...

    async def compact_if_needed(self, *, overflow: bool = False) -> bool:
        """Compact when the context is half full (or the provider said it overflowed);
        True if the history was compacted."""
        ...

    async def switch_backend(self, values: Mapping[str, str]) -> str | None:
        """Apply a turnError hook's ``backend=`` / ``model=`` to the session (journaled,
        as a ``cfg`` write); None when done, else why not (nothing changed then)."""
        ...


class TurnEnded(Exception):
    """The turn ends early for a reason the user is told (``error:`` line)."""


SUMMARY_PROMPT = (
    "You have reached the step limit for this turn. Do not call any tool. Summarize what "
    "you did, what is left, and what the user should decide next."
)


async def run_turn(host: TurnHost, prompt: str) -> None:
    host.set_state("thinking")
    pre = await host.hook("preTurn", prompt=prompt)
    if pre is not None and pre.blocked:
        return  # the prompt never reaches the model (the reason is in chat)
    host.turn_started(prompt)
    host.add_message(Message("user", prompt))
    if pre is not None and pre.context.strip():
        host.add_message(Message("user", f"[preTurn hook]\n{pre.context.strip()}"))
    outcome = _Outcome()
    try:
        await _steps(host, outcome)
    except trio.Cancelled:
        outcome.end = "stopped"
        raise
    finally:
        with trio.CancelScope(shield=True):
            last = next((m for m in reversed(host.history.messages) if m.role == "assistant"), None)
            post = await host.hook(
                "postTurn",
                prompt=prompt,
                reply=last.content if last else "",
                end=outcome.end,
                rounds=outcome.rounds,
            )
            if post is not None and post.context.strip():
                # The model reads it with the next prompt.
                host.add_message(Message("user", f"[postTurn hook]\n{post.context.strip()}"))


@dataclass
class _Outcome:
    """How a turn ended, for postTurn: ``done``, ``stopped``, ``maxsteps`` or ``error``
    (anything raised: an abort, a backend error), and the tool rounds it took."""

    end: str = "error"
    rounds: int = 0


async def _steps(host: TurnHost, outcome: _Outcome) -> None:
    cache = ReadCache()
    await refresh_tools(host)
    for _ in range(host.max_steps):
        await host.compact_if_needed()
        try:
            reply = await stream_reply(host)
        except ContextOverflowError:
            # The provider says it does not fit: compact, then try once more.
            if not await host.compact_if_needed(overflow=True):
                raise
            reply = await stream_reply(host)
        host.add_message(reply)
        if not reply.tool_calls and not _inject(host):
            outcome.end = "done"
            return
        if reply.tool_calls:
            outcome.rounds += 1
            await run_tools(host, reply.tool_calls, cache)
            await refresh_tools(host)
            _apply_safety(host, host.after_round())
            await host.checkpoint()
            _inject(host)
    host.emit("maxsteps", f"step limit of {host.max_steps} reached: asking for a summary")
    host.add_message(Message("user", SUMMARY_PROMPT))
    final = await stream_reply(host, tools=False)
    # No tool is run now: calls the model made anyway are dropped from its message, so
    # the history stays valid (every call answered).
    host.add_message(msgspec.structs.replace(final, tool_calls=()))
    outcome.end = "maxsteps"


def _apply_safety(host: TurnHost, actions: list[Action]) -> None:
    """Nudges and re-injected plans become user messages of this turn; an abort ends it.
    (The step limit is counted by the loop itself, so FinalSummary is not used here.)"""
    for act in actions:
        if isinstance(act, Abort):
            raise TurnEnded(act.reason)
        if isinstance(act, Nudge | Reinject):
            what = act.kind if isinstance(act, Nudge) else "plan"
            host.emit("info", f"safety: {what} nudge")
            host.add_message(Message("user", act.text))


def _inject(host: TurnHost) -> bool:
    """Deliver a pending injection as a user message of this turn; True if there was one."""
    text = host.take_injection()
    if text is None:
        return False
    host.emit("user", text, name="inject")
    host.add_message(Message("user", text))
    return True


async def refresh_tools(host: TurnHost) -> None:
    try:
        await host.link.refresh()
    except ToolsrvError as err:
        log.warning("%s", err)
        host.emit("error", f"{err} (going on without tools)")


async def stream_reply(host: TurnHost, *, tools: bool = True) -> Message:
    """One model reply, retried on rate limits, transient errors and dropped streams."""
    attempt = 0
    hooked = False  # the turnError hook ran for this request
    while True:
        why = host.over_budget()
        if why is not None:
            raise TurnEnded(why)
        text: list[str] = []
        reasoning: list[str] = []
        calls: tuple[ToolCall, ...] = ()
        usage: Usage | None = None
        provider_data: ProviderData = {}
        try:
            async with host.backend().stream(
                host.model,
                host.request_messages(),
                host.link.tools if tools else [],
                host.params(),
                wire=host.history.wire,
            ) as events:
                async for ev in events:
                    if ev.kind == "content":
                        text.append(ev.text)
                        host.emit("assistant", ev.text, response_id=ev.response_id)
                    elif ev.kind == "reasoning":
                        reasoning.append(ev.text)
                        host.emit("reasoning", ev.text, response_id=ev.response_id)
                    elif ev.kind == "tool_calls":
                        calls = ev.tool_calls
                    elif ev.kind == "usage":
                        usage = ev.usage
                    elif ev.kind == "done":
                        provider_data = ev.provider_data  # opaque, kept with the reply
                    elif ev.kind == "server_call":
                        # The provider runs it itself: shown, never run here.
                        for c in ev.tool_calls:
                            host.emit("call", one_line_args(c.arguments), name=c.name)
                    elif ev.kind == "server_result":
                        name = ev.tool_calls[0].name if ev.tool_calls else ""
                        host.emit("tool", ev.text, name=name)
        except trio.Cancelled:
            if text or reasoning:
                host.add_message(Message("assistant", "".join(text), "".join(reasoning)))
            raise
        except BackendError as err:
            if usage is not None:
                # The provider reported usage before it failed (OpenRouter sends it with
                # an error inside a 200 stream): those tokens were billed, so they count.
                _account_usage(host, usage)
            if isinstance(err, BadResponseError) and _drop_images(host):
                host.emit(
                    "info",
                    f"{err}: sending the request again without the tool results' images, "
                    "and none for the rest of this session's run",
                )
                continue
            if not hooked:
                # Once per request: a request sent again after a switch that fails too
                # takes the usual way, so two hooks cannot switch back and forth forever.
                hooked = True
                if await _turn_error(host, err, attempt):
                    continue
            delay = host.retry.delay(err, attempt)
            if delay is None:
                raise
            await back_off(host, err, delay)
            attempt += 1
            continue
        reply = Message(
            "assistant", "".join(text), "".join(reasoning), calls, provider_data=provider_data
        )
        _account(host, reply, usage)
        return reply


def _drop_images(host: TurnHost) -> bool:
    """A request with images was refused (a model without vision says 400): True if it
    had any, and from now on it has none (the results' text names their files)."""
    history = host.history
    if history.text_only or not any(m.images for m in history.for_model()):
        return False
    history.text_only = True
    return True


ERROR_TYPES: tuple[tuple[type[BackendError], str], ...] = (
    (RateLimitError, "rate_limit"),
    (StreamDropError, "stream_drop"),
    (TransientError, "transient"),
    (ContextOverflowError, "context_overflow"),
    (ToolUnsupportedError, "tool_unsupported"),
    (BadResponseError, "bad_response"),
)


def error_type(err: BackendError) -> str:
    """The ``error_type`` of a turnError payload (ollie-agent(5)); most specific first."""
    return next((name for cls, name in ERROR_TYPES if isinstance(err, cls)), "error")


async def _turn_error(host: TurnHost, err: BackendError, attempt: int) -> bool:
    """The turnError hook, at a request's first failure, before any retry.

    Exit 0 with ``backend=NAME`` / ``model=NAME`` lines in its output is the seed's
    recovery: they are applied to the session (a running turn refuses ``ctl backend``
    and ``cfg``, so the hook cannot do it through the tree) and True is returned: the
    request is sent again at once, on the new backend and model. Its other lines join
    the context first. Lines that cannot be applied (an unknown backend) make a warning
    and the usual handling. Exit 0 without them is "handled": its output joins the
    context and the turn ends without a retry. A block (exit 2) ends the turn too, with
    the hook's reason already in chat. Anything else: the usual retries, then the error.
    """
    r = await host.hook("turnError", error=str(err), error_type=error_type(err), attempt=attempt)
    if r is None:
        return False
    if r.blocked:
        raise TurnEnded(f"{err} (retries blocked by the turnError hook)") from None
    if not r.ok:
        return False
    switch, text = switch_directives(r.context)
    if switch:
        why = await host.switch_backend(switch)
        if why is not None:
            host.emit("info", f"hook turnError: not switched: {why}")
            return False
    if text:
        host.add_message(Message("user", f"[turnError hook]\n{text}"))
    if not switch:
        raise TurnEnded(f"{err} (handled by the turnError hook)") from None
    to = " ".join(f"{k}={v}" for k, v in switch.items())
    host.emit("info", f"turnError hook: switched to {to}; sending the request again")
    return True


SWITCH_KEYS = ("backend", "model")


def switch_directives(output: str) -> tuple[dict[str, str], str]:
    """A turnError hook's output: its ``backend=NAME`` and ``model=NAME`` lines (the
    last of each wins), and the rest of its text."""
    switch: dict[str, str] = {}
    rest: list[str] = []
    for line in output.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key in SWITCH_KEYS and value.strip() and not any(c.isspace() for c in value):
            switch[key] = value
        else:
            rest.append(line)
    return switch, "\n".join(rest).strip()


async def back_off(
    host: TurnHost, err: BackendError, delay: float, *, resume: str = "thinking"
) -> None:
    """Wait ``delay`` before a retry, shown as a ``retry`` event (``limitretry`` and that
    state for a 429); then the state is ``resume`` again."""
    limited = isinstance(err, RateLimitError)
    role: EventRole = "limitretry" if limited else "retry"
    log.info("retrying in %ss after %s: %s", delay, type(err).__name__, err)
    host.emit(role, f"retrying in {format_seconds(delay)}s... ({err})")
    if limited:
        host.set_state("limitretry")
    await trio.sleep(delay)
    host.set_state(resume)


def _account(host: TurnHost, reply: Message, usage: Usage | None) -> None:
    estimated = usage is None or (usage.input_tokens == 0 and usage.output_tokens == 0)
    if usage is None or estimated:
        usage = Usage(
            input_tokens=host.request_estimate(),
            output_tokens=estimate_tokens(reply.content + reply.reasoning),
        )
    _account_usage(host, usage, estimated)


def _account_usage(host: TurnHost, usage: Usage, estimated: bool = False) -> None:
    cost = request_cost(host.model, usage, host.backend().name)
    host.add_usage(usage, cost, estimated)
    host.emit("usage", msgspec.json.encode(usage).decode())
