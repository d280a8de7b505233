"""The backend contract: message types, the streaming interface and its typed errors.

Every provider module (``openai.py``, ``anthropic.py``, ``ollama.py``, ``gemini.py``,
``copilot.py``, ``kiro.py``) only translates: it turns a provider's wire format into the
same small vocabulary, and the HTTP, retry and error plumbing is shared (``stream.py``):

* ``Message`` / ``ToolCall`` / ``Tool`` — what the agent sends;
* ``StreamEvent`` — what comes back, one delta at a time;
* ``Usage`` — token counts (and a provider-reported cost when there is one).

Some providers hand out state that must come back verbatim in the next request and that
the other fields cannot carry: Anthropic's thinking blocks with their signatures (refused
if missing while tools are in use), Gemini's thought signatures on function calls,
OpenRouter's ``reasoning_details``. That state travels in ``Message.provider_data``, keyed
by the wire format that produced it (``"anthropic"``, ``"gemini"``, ``"openai"``); the
history and the journal keep it as an opaque JSON value, each wire module reads only its
own key, so a session that switches provider sends nothing the new one cannot read.

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

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Literal, Protocol

import msgspec

Role = Literal["system", "user", "assistant", "tool"]


class ToolCall(msgspec.Struct, frozen=True, gc=False):
    """One function call requested by the model; ``arguments`` is the raw JSON text."""

    id: str
    name: str
    arguments: str


#: Opaque per-provider state of a message: wire-format name -> a JSON value only that
#: wire module reads. Kept verbatim by the history, the journal and ``context``.
ProviderData = dict[str, Any]


class Image(msgspec.Struct, frozen=True, gc=False):
    """An image a tool result carries to the model: ``data`` in base64, ``size`` its
    bytes. ``data`` empty: shown elsewhere without it (``context``), never sent."""

    mime: str
    size: int
    data: str = ""


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
    # Tool results only: images the tool answered with, sent in the form each wire takes
    # them (``content`` keeps a line per image for the wires without them).
    images: tuple[Image, ...] = ()
    # See the module docstring. Set from the ``done`` event of the reply that made it.
    provider_data: ProviderData = msgspec.field(default_factory=dict)


class Tool(msgspec.Struct, frozen=True):
    """A function the model may call; ``parameters`` is a JSON-schema object."""

    name: str
    description: str
    parameters: dict[str, Any]


class Usage(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """Token counts of one request, the same convention for every provider.

    ``input_tokens`` counts *every* prompt token: the ones read from the provider's cache
    (``cached_input_tokens``) and the ones written to it (``cache_creation_tokens``) are
    parts of it, never additions. OpenAI (``prompt_tokens``), Gemini
    (``promptTokenCount``) and Ollama already count that way; Anthropic reports the three
    apart (``input_tokens`` is only the uncached rest), so its backend adds them up. The
    tokens billed at the full input price are therefore ``input_tokens -
    cached_input_tokens - cache_creation_tokens`` (``agent/cost.py``).

    ``output_tokens`` includes reasoning (thinking) tokens, which providers bill as output.
    """

    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    cache_creation_tokens: int = 0
    cost: float | None = None  # USD, when the provider reports it (OpenRouter)


class ResponseSchema(msgspec.Struct, frozen=True):
    """Ask for a reply that is one JSON object of ``schema`` (structured output).

    ``schema`` is a JSON Schema in the strict form OpenAI asks for (every property
    required, ``additionalProperties: false``), which the others accept as it is or
    nearly. Each backend maps it to its own wire: OpenAI (Copilot, OpenRouter)
    ``response_format`` of type ``json_schema``, strict; Ollama ``format``; Gemini
    ``responseMimeType`` + ``responseSchema``; Anthropic a forced tool named ``name``
    whose ``input_schema`` is the schema, so the answer comes back as that tool's call
    (its ``arguments``), not as text. Kiro has no such field and sends none: the caller
    reads the text leniently whatever the wire.
    """

    name: str  # [A-Za-z0-9_-]{1,64}: both an OpenAI schema name and a tool name
    schema: dict[str, Any]


class GenerationParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """Sampling parameters; ``None`` leaves the provider's default.

    ``thinking_budget`` is the token budget for extended thinking / reasoning: Anthropic's
    ``thinking.budget_tokens``, Gemini's ``thinkingBudget``, Ollama's ``think``, a
    ``reasoning_effort`` for OpenAI reasoning models (ollie-replay(1) lists the mapping).
    0 turns thinking off where the provider allows it.

    ``response_schema`` asks for structured output (``ResponseSchema``); compaction is
    its only user.
    ``text_tools``: whether tool calls and ``<think>`` reasoning that a model writes into
    its reply's text are read as such (``texttools.py``); None is the backend's default
    (on for the OpenAI-compatible and Ollama backends, off for Copilot's; the other wires
    have no use for it). Not a sampling parameter, but a request's reading of its reply.
    """

    max_tokens: int | None = None
    temperature: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    thinking_budget: int | None = None
    response_schema: ResponseSchema | None = None
    text_tools: bool | None = None


StreamKind = Literal[
    "content", "reasoning", "tool_calls", "usage", "done", "server_call", "server_result"
]


class StreamEvent(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """One item of a streamed reply.

    (``gc=False`` here and on the structs the parsers decode: they are made by the
    hundred thousand per stream and can hold no reference cycle, only strings, numbers
    and JSON values; keeping them out of the cyclic collector makes parsing a third
    faster.)

    * ``content`` / ``reasoning``: ``text`` holds the delta;
    * ``tool_calls``: ``tool_calls`` holds every call of the reply, complete, emitted once
      just before ``done`` (deltas are accumulated by the backend, since ids and names may
      arrive after the first argument fragments);
    * ``server_call`` / ``server_result``: a tool the *provider* ran itself (Anthropic's
      server tools: web search, code execution ...), already answered in the stream and
      never to be run here: ``tool_calls`` holds the one call (its id, name and
      arguments; for a result, its id and name), a result's ``text`` says what it gave.
      Shown in chat; the reply's ``provider_data`` keeps the blocks for the history;
    * ``usage``: ``usage`` is set;
    * ``done``: the provider terminated the stream properly; ``finish_reason`` if known
      (``stop``, ``length``, ``tool_calls``, ``content_filter``, or the provider's own word
      when it has no equivalent), and ``provider_data`` to store in the reply's ``Message``.
    """

    kind: StreamKind
    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    usage: Usage | None = None
    finish_reason: str = ""
    response_id: str = ""
    provider_data: ProviderData = msgspec.field(default_factory=dict)


class WireCache:
    """The encoded wire form of the messages of one conversation's last request.

    A session sends its whole history with every request, and building each message's
    wire dict again at every turn was the part of a request that grew with the session
    (0.3 ms at 1,000 messages, for the 500th turn). A request's messages nearly always
    begin with the previous request's, as the same objects (the history only appends
    between two requests; its system message is kept while its text is the same): one
    list comparison in C, identity first, finds that part, and only the messages after
    it are encoded. A rewind or a compaction shares a shorter prefix or none, and the
    rest is encoded again. Messages are frozen, so equal messages have equal wire forms.

    One per conversation (the agent owns it and passes it with each request); its
    wire function is the backend's, and a backend of another wire format starts it over.
    A message whose encoded form is larger than ``max_bytes`` is encoded at each request
    instead of kept: its cost is the encoding itself, at memory speed, and keeping it
    would double the memory its text takes.
    """

    def __init__(self, max_bytes: int = 64 * 1024) -> None:
        self._max = max_bytes
        self._wire: Callable[[Message], Any] | None = None
        self._messages: list[Message] = []
        self._raws: list[msgspec.Raw | None] = []

    def encode(self, messages: list[Message], wire: Callable[[Message], Any]) -> list[msgspec.Raw]:
        """``[msgspec.Raw(json(wire(m))) for m in messages]``, from what is kept."""
        if wire is not self._wire:
            self._wire, self._messages, self._raws = wire, [], []
        old, n = self._messages, len(self._messages)
        if len(messages) >= n and messages[:n] == old:
            same = n
        else:
            same, limit = 0, min(n, len(messages))
            while same < limit and messages[same] == old[same]:
                same += 1
        encode, big = _ENCODER.encode, self._max
        raws = self._raws[:same]
        for m in messages[same:]:
            raw = msgspec.Raw(encode(wire(m)))
            raws.append(raw if len(raw) <= big else None)
        self._messages, self._raws = list(messages), raws
        return [
            raw if raw is not None else msgspec.Raw(encode(wire(m)))
            for raw, m in zip(raws, messages, strict=True)
        ]


_ENCODER = msgspec.json.Encoder()


class Backend(Protocol):
    """A provider. ``stream`` raises the typed errors below, never raw httpx errors."""

    name: str

    def stream(
        self,
        model: str,
        messages: list[Message],
        tools: list[Tool],
        params: GenerationParams,
        *,
        wire: WireCache | None = None,
    ) -> AbstractAsyncContextManager[AsyncIterator[StreamEvent]]:
        """Open a streamed completion.

        ``wire`` is the conversation's cache of encoded messages: a backend whose wire
        format maps messages one to one may use it instead of encoding every message.

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


class ProviderBackend(Backend, Protocol):
    """A provider's backend as the pool holds it: what the agent loop needs (``Backend``)
    plus its own default model and caches that ``ctl models`` can drop."""

    #: The model a session gets when none is named (each provider has its own).
    default_model: str

    def forget(self) -> None:
        """Drop cached model lists and context lengths: the next call asks again."""
        ...


class BackendError(Exception):
    """Base of every backend failure; ``str()`` is a one-line message fit for ``chat``.

    The message starts with the backend's name and, for HTTP failures, the status
    (``anthropic: HTTP 529: Overloaded``), and never holds the API key.
    """


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
