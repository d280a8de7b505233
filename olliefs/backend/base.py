"""The backend contract: message types, the streaming interface and its typed errors.

Every provider module (``openai.py`` now; ``anthropic.py``, ``ollama.py`` ... later)
turns a provider's wire format into the same small vocabulary:

* ``Message`` / ``ToolCall`` / ``Tool`` — what the agent sends;
* ``StreamEvent`` — what comes back, one delta at a time;
* ``Usage`` — token counts (and a provider-reported cost when there is one).

Errors form one hierarchy, so the agent loop decides on retries by type alone::

    BackendError
    ├── RateLimitError        HTTP 429; .retry_after seconds from Retry-After / retry-after-ms
    ├── TransientError        5xx, network failure, timeout            (retried)
    │   └── StreamDropError   the stream ended without its terminator   (retried)
    ├── ContextOverflowError  400 that says the prompt is too long      (compact, retry once)
    ├── ToolUnsupportedError  400/422 that says the model has no tools
    └── BadResponseError      anything else: 4xx, garbage bodies       (ends the turn)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any, Literal, Protocol

import msgspec

Role = Literal["system", "user", "assistant", "tool"]


class ToolCall(msgspec.Struct, frozen=True):
    """One function call requested by the model; ``arguments`` is the raw JSON text."""

    id: str
    name: str
    arguments: str


class Message(msgspec.Struct, frozen=True, omit_defaults=True):
    role: Role
    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""
    # Tool results only: how the result ages in the context (SPEC 4 result tiers). Never
    # sent to a provider; the wire formats pick their fields explicitly.
    tier: str = ""


class Tool(msgspec.Struct, frozen=True):
    """A function the model may call; ``parameters`` is a JSON-schema object."""

    name: str
    description: str
    parameters: dict[str, Any]


class Usage(msgspec.Struct, frozen=True, omit_defaults=True):
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    cache_creation_tokens: int = 0
    cost: float | None = None  # USD, when the provider reports it (OpenRouter)


class GenerationParams(msgspec.Struct, frozen=True, omit_defaults=True):
    max_tokens: int | None = None
    temperature: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None


StreamKind = Literal["content", "reasoning", "tool_calls", "usage", "done"]


class StreamEvent(msgspec.Struct, frozen=True, omit_defaults=True):
    """One item of a streamed reply.

    * ``content`` / ``reasoning``: ``text`` holds the delta;
    * ``tool_calls``: ``tool_calls`` holds every call of the reply, complete, emitted once
      just before ``done`` (deltas are accumulated by the backend, since ids and names may
      arrive after the first argument fragments);
    * ``usage``: ``usage`` is set;
    * ``done``: the provider terminated the stream properly; ``finish_reason`` if known.
    """

    kind: StreamKind
    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    usage: Usage | None = None
    finish_reason: str = ""
    response_id: str = ""


class Backend(Protocol):
    """A provider. ``stream`` raises the typed errors below, never raw httpx errors."""

    name: str

    def stream(
        self,
        model: str,
        messages: list[Message],
        tools: list[Tool],
        params: GenerationParams,
    ) -> AbstractAsyncContextManager[AsyncIterator[StreamEvent]]:
        """Open a streamed completion.

        Used as ``async with backend.stream(...) as events: async for ev in events``.
        Errors before the first byte (HTTP status) are raised by ``__aenter__``; errors
        while streaming (drop, garbage, timeout) are raised by the iterator. A stream that
        ends without the provider's terminator raises ``StreamDropError``.
        """
        ...

    async def models(self) -> list[str]:
        """Model ids offered by the provider."""
        ...

    async def context_length(self, model: str) -> int:
        """Context window of ``model`` in tokens (cached; a default when unknown)."""
        ...

    async def aclose(self) -> None: ...


class BackendError(Exception):
    """Base of every backend failure; ``str()`` is a one-line message fit for ``chat``."""


class RateLimitError(BackendError):
    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TransientError(BackendError):
    pass


class StreamDropError(TransientError):
    pass


class ContextOverflowError(BackendError):
    pass


class ToolUnsupportedError(BackendError):
    pass


class BadResponseError(BackendError):
    pass
