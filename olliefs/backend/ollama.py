"""Ollama's native API: ``POST /api/chat`` streamed as newline-delimited JSON.

Each line is a whole JSON object: ``message`` holds a delta (``content``, ``thinking``,
and ``tool_calls`` that always arrive complete, with their ``arguments`` as a JSON object
rather than a string), and the last line has ``done: true`` with ``done_reason`` and the
token counts (``prompt_eval_count``, ``eval_count``). That last line may still carry
content, which is kept. An ``{"error": ...}`` line reports a failure mid-stream.

A model whose template Ollama cannot parse for tool calls (or thinking) writes them into
the content: ``<tool_call>`` tags, a bare JSON object naming a tool, ``<think>``. Those
are read out of it (``texttools.py``) unless ``GenerationParams.text_tools`` is False.

Requests put the generation parameters under ``options`` (``num_predict``,
``temperature``, ``frequency_penalty``, ``presence_penalty``, ``num_ctx``); thinking is
the ``think`` flag (a budget has no equivalent: any budget turns it on, 0 off); a
``response_schema`` is ``format`` (Ollama's structured output takes the JSON Schema).

The context length comes from ``POST /api/show``: the ``num_ctx`` the model was created
with, else the architecture's ``<arch>.context_length``, capped by the ``num_ctx`` this
backend sends when ``OLLIE_OLLAMA_NUM_CTX`` is set. Ollama runs a model with its server's
default context unless a request asks for more, so that setting is what makes a long
context real. Lengths are cached per model and dropped when ``/api/tags`` shows that the
model changed (a new digest after ``ollama pull``), or on ``forget``.

No API key: a local server needs none. A key, when given, is sent as a bearer token (for
a hosted Ollama behind a proxy).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec

from olliefs.backend.base import (
    BackendError,
    GenerationParams,
    Message,
    StreamEvent,
    Tool,
    ToolCall,
    Usage,
    WireCache,
)
from olliefs.backend.openai import content_event, function_tools, parse_base_url
from olliefs.backend.stream import (
    HTTPBackend,
    NDJSONSplitter,
    Secrets,
    decode_json,
    http_error,
)
from olliefs.backend.texttools import TextTools

STREAM_TYPES = ("application/x-ndjson", "application/jsonl", "application/json-seq")
DEFAULT_CONTEXT = 4096  # what an Ollama server gives a model unless told otherwise


# ---- the stream ----------------------------------------------------------------------------


class _Function(msgspec.Struct, gc=False):
    name: str = ""
    arguments: Any = None
    index: int | None = None


class _ToolCall(msgspec.Struct, gc=False):
    function: _Function
    id: str | None = None


class _Message(msgspec.Struct, gc=False):
    content: str = ""
    thinking: str = ""
    tool_calls: list[_ToolCall] | None = None


class _Line(msgspec.Struct, gc=False):
    message: _Message | None = None
    done: bool = False
    done_reason: str = ""
    prompt_eval_count: int | None = None
    eval_count: int | None = None
    created_at: str = ""
    error: str | dict[str, Any] | None = None


_LINE = msgspec.json.Decoder(_Line)
FINISH = {"stop": "stop", "length": "length"}


class OllamaParser:
    """One streamed chat reply, read incrementally (see ``stream.Parser``)."""

    def __init__(
        self, provider: str = "ollama", secrets: Secrets = None, text: TextTools | None = None
    ) -> None:
        self._provider = provider
        self._secrets = secrets
        self._text = text  # reads tool calls and <think> out of the content, if set
        self._content = text.feed if text is not None else content_event
        self._lines = NDJSONSplitter(provider)
        self.done = False
        self._calls: list[ToolCall] = []
        self._response_id = ""

    def feed(self, chunk: bytes, out: list[StreamEvent]) -> None:
        for line in self._lines.feed(chunk):
            self._line(line, out)
            if self.done:
                break

    def close(self, out: list[StreamEvent]) -> None:
        for line in self._lines.close():
            self._line(line, out)
            if self.done:
                break

    def _line(self, data: bytes, out: list[StreamEvent]) -> None:
        line = decode_json(_LINE, data, self._provider, self._secrets)
        if line.error is not None:
            label = "stream error"
            raise http_error(500, data, secret=self._secrets, label=label, provider=self._provider)
        if not self._response_id and line.created_at:
            self._response_id = line.created_at
        if (message := line.message) is not None:
            if message.thinking:
                out.append(StreamEvent("reasoning", text=message.thinking))
            if message.content:
                self._content(message.content, out)
            for call in message.tool_calls or ():
                self._calls.append(self._call(call))
        if line.done:
            self.done = True
            if self._text is not None:
                self._calls += self._text.finish(out)
            if line.prompt_eval_count is not None or line.eval_count is not None:
                usage = Usage(
                    input_tokens=line.prompt_eval_count or 0,
                    output_tokens=line.eval_count or 0,
                )
                out.append(StreamEvent("usage", usage=usage))
            if self._calls:
                out.append(StreamEvent("tool_calls", tool_calls=tuple(self._calls)))
            reason = "tool_calls" if self._calls else FINISH.get(line.done_reason, line.done_reason)
            out.append(StreamEvent("done", finish_reason=reason))

    @staticmethod
    def _call(call: _ToolCall) -> ToolCall:
        arguments = call.function.arguments
        if isinstance(arguments, str):  # some models' templates hand back a string
            text = arguments or "{}"
        else:
            text = msgspec.json.encode(arguments if arguments is not None else {}).decode()
        return ToolCall(call.id or f"call_{uuid.uuid4().hex[:24]}", call.function.name, text)


# ---- the request ---------------------------------------------------------------------------


def _arguments(text: str) -> Any:
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return {}


def wire_message(message: Message) -> dict[str, Any]:
    wire: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.role == "assistant" and message.reasoning:
        wire["thinking"] = message.reasoning
    if message.tool_calls:
        wire["tool_calls"] = [
            {"function": {"name": c.name, "arguments": _arguments(c.arguments)}}
            for c in message.tool_calls
        ]
    if message.role == "tool" and message.name:
        wire["tool_name"] = message.name
    if message.images:  # base64, as Ollama takes a message's images
        wire["images"] = [i.data for i in message.images]
    return wire


def request_body(
    model: str,
    messages: list[Message],
    tools: list[Tool],
    params: GenerationParams,
    num_ctx: int | None = None,
    wire: WireCache | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": (
            wire.encode(messages, wire_message) if wire else [wire_message(m) for m in messages]
        ),
        "stream": True,
    }
    if tools:
        body["tools"] = function_tools(tools)
    options = {
        "num_predict": params.max_tokens,
        "temperature": params.temperature,
        "frequency_penalty": params.frequency_penalty,
        "presence_penalty": params.presence_penalty,
        "num_ctx": num_ctx,
    }
    if options := {k: v for k, v in options.items() if v is not None}:
        body["options"] = options
    if params.thinking_budget is not None:
        body["think"] = params.thinking_budget > 0
    if params.response_schema is not None:
        body["format"] = params.response_schema.schema  # structured output: the schema
    return body


# ---- the backend ---------------------------------------------------------------------------


class _Tag(msgspec.Struct, gc=False):
    name: str
    model: str = ""
    digest: str = ""


class _Tags(msgspec.Struct, gc=False):
    models: list[_Tag]


class _Show(msgspec.Struct, gc=False):
    model_info: dict[str, Any] | None = None
    parameters: str = ""


_TAGS = msgspec.json.Decoder(_Tags)
_SHOW = msgspec.json.Decoder(_Show)


def context_of(show: _Show) -> int | None:
    """The model's context length from an ``/api/show`` reply (None if it says nothing)."""
    for line in show.parameters.splitlines():
        name, _, value = line.strip().partition(" ")
        if name == "num_ctx" and value.strip().isdigit():
            return int(value.strip())
    info = show.model_info or {}
    lengths = [v for k, v in info.items() if k.endswith(".context_length") and isinstance(v, int)]
    return lengths[0] if lengths else None


class OllamaBackend(HTTPBackend):
    default_model = "llama3.2"
    default_context_length = DEFAULT_CONTEXT
    text_tools = True  # see the module docstring

    def __init__(
        self,
        name: str,
        base_url: str,
        api_key: str | None = None,
        *,
        read_timeout: float = 300.0,
        transport: httpx.AsyncBaseTransport | None = None,
        num_ctx: int | None = None,
        default_model: str | None = None,
    ) -> None:
        # The native API lives under /api; an OpenAI-style base ending in /v1 is accepted
        # too (users copy it from the compatibility docs) and means the same server.
        url = parse_base_url(base_url)
        path = url.path.rstrip("/").removesuffix("/v1").removesuffix("/api")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        super().__init__(
            name,
            str(url.copy_with(path=path + "/api/")),
            api_key,
            read_timeout=read_timeout,
            transport=transport,
            headers=headers,
        )
        if default_model:
            self.default_model = default_model
        self._num_ctx = num_ctx
        self._context: dict[str, int] = {}
        self._digests: dict[str, str] = {}
        self._names: list[str] | None = None

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
        body = request_body(model, messages, tools, params, self._num_ctx, wire)
        request = self._post(
            "chat",
            msgspec.json.encode(body),
            headers={"content-type": "application/json"},
        )
        reads = self.text_tools if params.text_tools is None else params.text_tools
        text = TextTools([t.name for t in tools]) if reads else None
        parser = OllamaParser(self.name, self._secrets, text)
        async with self._stream(request, parser, stream_types=STREAM_TYPES) as events:
            yield events

    async def models(self) -> list[str]:
        if self._names is None:
            tags = (await self._get("tags", _TAGS, "model list")).models
            for tag in tags:
                for name in {tag.name, tag.model} - {""}:
                    if self._digests.get(name, tag.digest) != tag.digest:
                        self._context.pop(name, None)  # the model changed: ask again
                    self._digests[name] = tag.digest
            self._names = [tag.name for tag in tags]
        return list(self._names)

    async def context_length(self, model: str) -> int:
        if model not in self._context:
            try:
                show = await self._get("show", _SHOW, "model description", json={"model": model})
            except BackendError:
                return self._num_ctx or DEFAULT_CONTEXT  # not cached: asked again next time
            length = context_of(show) or DEFAULT_CONTEXT
            self._context[model] = min(length, self._num_ctx) if self._num_ctx else length
        return self._context[model]

    def forget(self) -> None:
        self._context.clear()
        self._names = None
