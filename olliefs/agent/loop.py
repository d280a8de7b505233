"""One turn of an agent: stream the model, handle its tool calls, repeat until it stops.

The turn runs inside the session's cancel scope, so ``stop`` cancels it wherever it is:
in the HTTP stream, in a retry back-off, in a tool. A reply cut by ``stop`` is kept, both
in ``chat`` (already streamed there) and in the history, so the model sees what it said.

Tools arrive with toolsrv; until then every call the model makes is answered with an
"unknown tool" error result, exactly as a call to a tool that is not loaded would be.
"""

from __future__ import annotations

import logging
from typing import Protocol

import msgspec
import trio

from olliefs.agent.chat import format_seconds
from olliefs.agent.cost import request_cost
from olliefs.agent.events import EventRole
from olliefs.agent.history import History, estimate_tokens
from olliefs.agent.retry import RetryPolicy
from olliefs.backend.base import (
    Backend,
    BackendError,
    GenerationParams,
    Message,
    RateLimitError,
    ToolCall,
    Usage,
)

log = logging.getLogger(__name__)


class TurnHost(Protocol):
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


async def run_turn(host: TurnHost, prompt: str) -> None:
    host.set_state("thinking")
    host.add_message(Message("user", prompt))
    for _ in range(host.max_steps):
        reply = await stream_reply(host)
        host.add_message(reply)
        if not reply.tool_calls:
            return
        for call in reply.tool_calls:
            run_unknown_tool(host, call)
    host.emit("maxsteps", f"stopped after {host.max_steps} steps without a final answer")


def run_unknown_tool(host: TurnHost, call: ToolCall) -> None:
    host.emit("call", call.arguments, name=call.name)
    result = f"error: unknown tool {call.name!r}: no tools are loaded in this session"
    host.emit("tool", result, name=call.name)
    host.add_message(Message("tool", result, tool_call_id=call.id, name=call.name))


async def stream_reply(host: TurnHost) -> Message:
    """One model reply, retried on rate limits, transient errors and dropped streams."""
    attempt = 0
    while True:
        text: list[str] = []
        reasoning: list[str] = []
        calls: tuple[ToolCall, ...] = ()
        usage: Usage | None = None
        try:
            async with host.backend().stream(
                host.model, host.history.messages, [], host.params()
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
        except trio.Cancelled:
            if text or reasoning:
                host.add_message(Message("assistant", "".join(text), "".join(reasoning)))
            raise
        except BackendError as err:
            delay = host.retry.delay(err, attempt)
            if delay is None:
                raise
            await _back_off(host, err, delay)
            attempt += 1
            continue
        reply = Message("assistant", "".join(text), "".join(reasoning), calls)
        _account(host, reply, usage)
        return reply


async def _back_off(host: TurnHost, err: BackendError, delay: float) -> None:
    limited = isinstance(err, RateLimitError)
    role: EventRole = "limitretry" if limited else "retry"
    log.info("retrying in %ss after %s: %s", delay, type(err).__name__, err)
    host.emit(role, f"retrying in {format_seconds(delay)}s... ({err})")
    if limited:
        host.set_state("limitretry")
    await trio.sleep(delay)
    host.set_state("thinking")


def _account(host: TurnHost, reply: Message, usage: Usage | None) -> None:
    estimated = usage is None or (usage.input_tokens == 0 and usage.output_tokens == 0)
    if usage is None or estimated:
        usage = Usage(
            input_tokens=host.history.estimate(),
            output_tokens=estimate_tokens(reply.content + reply.reasoning),
        )
    cost = request_cost(host.model, usage)
    host.add_usage(usage, cost, estimated)
    host.emit("usage", msgspec.json.encode(usage).decode())
