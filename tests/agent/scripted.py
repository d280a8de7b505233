"""A scripted backend: the Backend protocol of ``olliefs.backend.base``, answering from a
list, so the agent's modules can be driven in-process through their backend seam.

Each scripted reply is a ``Reply``: events to stream, and optionally an error raised
before the first event (as an HTTP status would be, from ``__aenter__``) or after the
events (as a dropped stream would be, from the iterator). Every request is recorded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from olliefs.backend.base import (
    BackendError,
    GenerationParams,
    Message,
    StreamEvent,
    Tool,
    Usage,
    WireCache,
)


@dataclass
class Reply:
    events: list[StreamEvent] = field(default_factory=list)
    error_before: BackendError | None = None
    error_after: BackendError | None = None

    @classmethod
    def text(cls, text: str, usage: Usage | None = None) -> Reply:
        evs = [StreamEvent("content", text=chunk) for chunk in _chunks(text)]
        if usage is not None:
            evs.append(StreamEvent("usage", usage=usage))
        evs.append(StreamEvent("done", finish_reason="stop"))
        return cls(evs)


def _chunks(text: str, size: int = 7) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


@dataclass
class Request:
    model: str
    messages: list[Message]
    tools: list[Tool]
    params: GenerationParams


class ScriptedBackend:
    name = "scripted"
    default_model = "scripted"

    def forget(self) -> None:
        pass

    def __init__(self, replies: list[Reply]) -> None:
        self.replies = list(replies)
        self.requests: list[Request] = []

    @asynccontextmanager
    async def stream(
        self,
        model: str,
        messages: list[Message],
        tools: list[Tool],
        params: GenerationParams,
        *,
        wire: WireCache | None = None,
    ) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        self.requests.append(Request(model, list(messages), list(tools), params))
        if not self.replies:
            raise AssertionError("the script has no reply left")
        reply = self.replies.pop(0)
        if reply.error_before is not None:
            raise reply.error_before

        async def events() -> AsyncIterator[StreamEvent]:
            for ev in reply.events:
                yield ev
            if reply.error_after is not None:
                raise reply.error_after

        yield events()

    async def models(self) -> list[str]:
        return ["scripted-model"]

    async def context_length(self, model: str) -> int:
        return 8192

    async def aclose(self) -> None:
        pass
