"""Anthropic Messages API: ``POST /v1/messages`` streamed as server-sent events.

The stream is a sequence of typed events (the ``type`` inside each JSON payload names it;
the SSE ``event:`` line repeats it): ``message_start`` (id, input usage),
``content_block_start`` / ``content_block_delta`` / ``content_block_stop`` per content
block (text, thinking, redacted_thinking, tool_use), ``message_delta`` (stop reason,
cumulative usage), ``message_stop`` (the terminator), ``ping`` and ``error`` at any time.
Deltas are ``text_delta``, ``thinking_delta``, ``signature_delta`` (the signature of the
thinking block, which replaces rather than appends, as in the SDK's accumulator) and
``input_json_delta`` (fragments of a tool call's JSON input).

What the request side has to get right:

* the system prompt goes in ``system``, not in ``messages``;
* tool results are ``tool_result`` blocks in a *user* message, and consecutive ones are
  batched into one such message (the API insists that roles alternate);
* thinking blocks, with their signatures, are sent back in front of the tool calls of the
  same assistant message: they travel in ``Message.provider_data["anthropic"]``;
* prompt caching: ``cache_control`` breakpoints on the system prompt, the last tool and
  the two latest large tool results (four is the API's maximum per request);
* extended thinking takes ``thinking.budget_tokens`` (at least 1024, below
  ``max_tokens``) and refuses a changed temperature; frequency and presence penalties do
  not exist here and are left out;
* structured output (``response_schema``) is a forced tool: ``tool_choice`` names the one
  tool whose ``input_schema`` is the answer's schema, and the answer comes back as that
  tool's call; thinking is left out then (the API refuses it with a forced tool).

Usage: Anthropic's ``input_tokens`` excludes cache reads and cache writes; ours includes
them (see ``Usage``), so the three are added up.

Server tools: a reply may hold blocks of tools the *provider* ran itself (web search,
web fetch, code execution; MCP connector calls): ``server_tool_use`` (its input streamed
as ``input_json_delta`` like a ``tool_use``) and a result block (``web_search_tool_result``,
``code_execution_tool_result`` ..., whole at its start), already answered in the stream.
They are never tool calls of ours: each is reported as a ``server_call`` /
``server_result`` event (shown in chat) and kept verbatim, with where it stood in the
reply's text, in ``provider_data["anthropic"]["server"]``, so the message goes back in
the next request as the API requires, each block in its place. Any block type this
module does not know is treated the same way (kept, never run).
"""

from __future__ import annotations

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
from olliefs.backend.openai import normalize_base_url
from olliefs.backend.stream import (
    HTTPBackend,
    Secrets,
    SSEDecoder,
    SSEMessage,
    bad_payload,
    http_error,
)

WIRE = "anthropic"
API_VERSION = "2023-06-01"
STREAM_TYPES = ("text/event-stream",)
CONTEXT_LENGTH = 200000
MIN_THINKING_BUDGET = 1024
LARGE_TOOL_RESULT = 4096  # characters; smaller results are not worth a cache breakpoint
SERVER_RESULT_CHARS = 500  # of a server tool result chat shows as JSON
_EPHEMERAL = {"type": "ephemeral"}
ANSWER_TOOL = "Give your answer: call this tool once, with the whole answer as its input."

STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
# In-stream ``error`` events carry a type, not a status: the status that type comes with.
ERROR_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}


# ---- the stream ----------------------------------------------------------------------------


class _Usage(msgspec.Struct, gc=False):
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None


class _Message(msgspec.Struct, gc=False):
    id: str = ""
    usage: _Usage | None = None


class _Block(msgspec.Struct, gc=False):
    type: str = ""
    id: str = ""
    name: str = ""
    text: str = ""
    thinking: str = ""
    signature: str = ""
    data: str = ""  # redacted_thinking
    input: Any = None


class _Delta(msgspec.Struct, gc=False):
    type: str = ""
    text: str = ""
    thinking: str = ""
    signature: str = ""
    partial_json: str = ""
    stop_reason: str | None = None


class _Error(msgspec.Struct, gc=False):
    type: str = ""
    message: str = ""


class _Event(msgspec.Struct, gc=False):
    type: str = ""
    index: int = 0
    message: _Message | None = None
    # Untyped: a provider's own block is kept verbatim (``content_block_start`` comes
    # once per block, so reading it as a dict costs nothing that matters).
    content_block: dict[str, Any] | None = None
    delta: _Delta | None = None
    usage: _Usage | None = None
    error: _Error | None = None


_EVENT = msgspec.json.Decoder(_Event)


# Blocks this module reads; any other is the provider's own (server tools), kept as is.
_OWN_BLOCKS = frozenset({"text", "thinking", "redacted_thinking", "tool_use"})


class _Open:
    """A content block being streamed."""

    __slots__ = (
        "at",
        "data",
        "id",
        "json",
        "name",
        "raw",
        "shown",
        "signature",
        "thinking",
        "type",
    )

    def __init__(self, block: _Block, raw: dict[str, Any] | None = None, at: int = 0) -> None:
        # A provider's own block: as it came, and the characters of reply text before it.
        self.raw = raw
        self.at = at
        self.shown = False
        self.type = block.type
        self.id = block.id
        self.name = block.name
        self.thinking = [block.thinking] if block.thinking else []
        self.signature = block.signature
        self.data = block.data
        # A tool_use starts with ``input: {}`` and gets its JSON as deltas; an input that
        # is already complete at the start (no deltas follow) is kept as it is.
        self.json: list[str] = []
        if block.input:
            self.json.append(msgspec.json.encode(block.input).decode())


class AnthropicParser:
    """One streamed message, read incrementally (see ``stream.Parser``)."""

    def __init__(self, provider: str = "anthropic", secrets: Secrets = None) -> None:
        self._provider = provider
        self._secrets = secrets
        self._sse = SSEDecoder(provider)
        self.done = False
        self._blocks: dict[int, _Open] = {}
        self._usage = _Usage()
        self._stop_reason = ""
        self._id = ""
        self._seen_start = False
        self._chars = 0  # characters of reply text so far (where a server block stands)
        self._server: list[_Open] = []  # the provider's own blocks, in order
        self._server_names: dict[str, str] = {}  # server call id -> tool name

    def feed(self, chunk: bytes, out: list[StreamEvent]) -> None:
        self._read(self._sse.feed(chunk), out)

    def close(self, out: list[StreamEvent]) -> None:
        self._read(self._sse.close(), out)

    def _read(self, messages: list[SSEMessage], out: list[StreamEvent]) -> None:
        decode = _EVENT.decode
        for message in messages:
            if message.event == "ping":
                continue  # keep-alive; its payload is not read (as the SDK does not)
            try:
                event = decode(message.data)
            except msgspec.DecodeError as exc:
                raise bad_payload(self._provider, message.data, exc, self._secrets) from exc
            # the common case first, inline: a text delta
            if event.type == "content_block_delta" and (delta := event.delta) is not None:
                if delta.type == "text_delta":
                    if delta.text and event.index in self._blocks:
                        self._chars += len(delta.text)
                        out.append(StreamEvent("content", text=delta.text))
                    continue
            self._message(event, message.data, message.event, out)
            if self.done:
                break

    def _message(self, event: _Event, data: bytes, name: str, out: list[StreamEvent]) -> None:
        kind = event.type or name
        if kind == "content_block_delta":
            delta, block = event.delta, self._blocks.get(event.index)
            if delta is None or block is None:
                return
            if delta.type == "text_delta":
                if delta.text:
                    self._chars += len(delta.text)
                    out.append(StreamEvent("content", text=delta.text))
            elif delta.type == "thinking_delta":
                if delta.thinking:
                    block.thinking.append(delta.thinking)
                    out.append(StreamEvent("reasoning", text=delta.thinking))
            elif delta.type == "input_json_delta":
                if delta.partial_json:
                    block.json.append(delta.partial_json)
            elif delta.type == "signature_delta":
                block.signature = delta.signature
        elif kind == "content_block_start":
            if (raw := event.content_block) is None or not isinstance(raw.get("type"), str):
                return  # no block a request could carry back
            if raw["type"] not in _OWN_BLOCKS:
                self._server_block(event.index, raw)
                return
            try:
                start = msgspec.convert(raw, _Block)
            except msgspec.ValidationError as exc:
                raise bad_payload(self._provider, data, exc, self._secrets) from exc
            self._blocks[event.index] = _Open(start)
            if start.type == "text" and start.text:
                self._chars += len(start.text)
                out.append(StreamEvent("content", text=start.text))
            elif start.type == "thinking" and start.thinking:
                out.append(StreamEvent("reasoning", text=start.thinking))
        elif kind == "content_block_stop":
            block = self._blocks.get(event.index)
            if block is not None and block.raw is not None:
                self._show(block, out)
        elif kind == "message_start":
            self._seen_start = True
            if event.message is not None:
                self._id = event.message.id
                if event.message.usage is not None:
                    self._usage = event.message.usage
        elif kind == "message_delta":
            if event.delta is not None and event.delta.stop_reason:
                self._stop_reason = event.delta.stop_reason
            if (usage := event.usage) is not None:
                # Cumulative totals: each one present replaces the earlier value.
                for field in usage.__struct_fields__:
                    if (value := getattr(usage, field)) is not None:
                        setattr(self._usage, field, value)
        elif kind == "message_stop":
            self._finish(out)
        elif kind == "error":
            raise self._error(event.error, data)
        # ping and event types added later need nothing

    def _server_block(self, index: int, raw: dict[str, Any]) -> None:
        """A block of the provider's own (see the module docstring): kept as it came,
        with where it stands in the reply's text; a call's input streams in as deltas."""

        def text(key: str) -> str:
            value = raw.get(key)
            return value if isinstance(value, str) else ""

        start = _Block(text("type"), text("id"), text("name"), input=raw.get("input"))
        block = self._blocks[index] = _Open(start, raw, self._chars)
        self._server.append(block)

    def _show(self, block: _Open, out: list[StreamEvent]) -> None:
        """Report a provider's own block once (at its end, when its input is whole)."""
        if block.shown or block.raw is None:
            return
        block.shown = True
        if block.type.endswith("_tool_use"):  # server_tool_use, mcp_tool_use
            self._server_names[block.id] = block.name
            call = ToolCall(block.id, block.name, "".join(block.json) or "{}")
            out.append(StreamEvent("server_call", tool_calls=(call,)))
            return
        use_id = block.raw.get("tool_use_id")
        use_id = use_id if isinstance(use_id, str) else ""
        name = self._server_names.get(use_id) or block.type.removesuffix("_tool_result")
        text = f"[run by {self._provider}] {server_result_text(block.raw)}"
        out.append(
            StreamEvent("server_result", text=text, tool_calls=(ToolCall(use_id, name, ""),))
        )

    def _error(self, error: _Error | None, data: bytes) -> BackendError:
        kind = error.type if error is not None else ""
        status = ERROR_STATUS.get(kind, 500 if not kind else 400)
        label = f"stream error {kind}".strip()
        return http_error(status, data, secret=self._secrets, label=label, provider=self._provider)

    def _finish(self, out: list[StreamEvent]) -> None:
        self.done = True
        u = self._usage
        cached, created = u.cache_read_input_tokens or 0, u.cache_creation_input_tokens or 0
        if self._seen_start:
            usage = Usage(
                input_tokens=(u.input_tokens or 0) + cached + created,
                output_tokens=u.output_tokens or 0,
                cached_input_tokens=cached,
                cache_creation_tokens=created,
            )
            out.append(StreamEvent("usage", usage=usage))
        for block in self._server:
            self._show(block, out)  # one whose stop event never came
        calls, thinking = [], []
        for index in sorted(self._blocks):
            block = self._blocks[index]
            if block.type == "tool_use":
                calls.append(ToolCall(block.id, block.name, "".join(block.json) or "{}"))
            elif block.type == "thinking":
                text = "".join(block.thinking)
                thinking.append(
                    {"type": "thinking", "thinking": text, "signature": block.signature}
                )
            elif block.type == "redacted_thinking":
                thinking.append({"type": "redacted_thinking", "data": block.data})
        if calls:
            out.append(StreamEvent("tool_calls", tool_calls=tuple(calls)))
        reason = STOP_REASONS.get(self._stop_reason, self._stop_reason)
        own: dict[str, Any] = {}
        if thinking:
            own["thinking"] = thinking
        if self._server:
            own["server"] = [{"at": b.at, "block": _kept(b)} for b in self._server]
        data = {WIRE: own} if own else {}
        out.append(
            StreamEvent("done", finish_reason=reason, response_id=self._id, provider_data=data)
        )


def _kept(block: _Open) -> dict[str, Any]:
    """A provider's own block as the next request must carry it: as it came, with a
    call's input made whole from its deltas."""
    assert block.raw is not None
    kept = dict(block.raw)
    if block.json:
        kept["input"] = _json_object("".join(block.json))
    return kept


def server_result_text(block: dict[str, Any]) -> str:
    """What a server tool's result block says, in a few lines for chat: the pages a web
    search found, a program's output and exit status, the page fetched, an error code;
    anything else as one line of JSON."""
    content = block.get("content")
    if isinstance(content, list):
        items = [item for item in content if isinstance(item, dict)]
        found = [
            f"{item.get('title') or '(untitled)'} <{item['url']}>"
            for item in items
            if isinstance(item.get("url"), str)
        ]
        if found:
            return f"{len(found)} found:\n" + "\n".join(found)
        texts = [item["text"] for item in items if isinstance(item.get("text"), str)]
        if texts:
            return "\n".join(texts)
    if isinstance(content, dict):
        if isinstance(code := content.get("error_code"), str):
            return f"error: {code}"
        if "return_code" in content:
            output = [content.get(k) for k in ("stdout", "stderr")]
            lines = [o.rstrip("\n") for o in output if isinstance(o, str) and o.strip()]
            return "\n".join([*lines, f"(exit status {content.get('return_code')})"])
        if isinstance(url := content.get("url"), str):
            return f"fetched <{url}>"
    text = msgspec.json.encode(content).decode()
    return text if len(text) <= SERVER_RESULT_CHARS else text[:SERVER_RESULT_CHARS] + "..."


# ---- the request ---------------------------------------------------------------------------


def _json_object(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as the object ``tool_use.input`` must be ({} if not one)."""
    try:
        value = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _assistant_blocks(message: Message) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    own = message.provider_data.get(WIRE)
    if not isinstance(own, dict):
        own = {}
    if isinstance(thinking := own.get("thinking"), list):
        blocks += [b for b in thinking if isinstance(b, dict)]
    # The provider's own blocks go back where they stood in the text, verbatim.
    text, done = message.content, 0
    server = own.get("server")
    for item in server if isinstance(server, list) else ():
        if not isinstance(item, dict) or not isinstance(block := item.get("block"), dict):
            continue
        at = item.get("at")
        at = min(max(at, done), len(text)) if isinstance(at, int) else len(text)
        if at > done:
            blocks.append({"type": "text", "text": text[done:at]})
            done = at
        blocks.append(block)
    if text[done:]:
        blocks.append({"type": "text", "text": text[done:]})
    blocks += [
        {"type": "tool_use", "id": c.id, "name": c.name, "input": _json_object(c.arguments)}
        for c in message.tool_calls
    ]
    return blocks


def wire_messages(messages: list[Message]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(system blocks, messages) in Anthropic's shape; same-role neighbours are merged.

    Empty text blocks are refused by the API, so they are left out, and a message left
    with no block at all (a reply stopped before it said anything) is dropped.
    """
    system = [{"type": "text", "text": m.content} for m in messages if m.role == "system"]
    system = [block for block in system if block["text"]]
    wire: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "system":
            continue
        role = "assistant" if m.role == "assistant" else "user"
        if m.role == "assistant":
            blocks = _assistant_blocks(m)
        elif m.role == "tool":
            result: dict[str, Any] = {"type": "tool_result", "tool_use_id": m.tool_call_id}
            if m.images:  # a tool result's content may be text and image blocks
                result["content"] = [
                    *([{"type": "text", "text": m.content}] if m.content else []),
                    *(
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": i.mime, "data": i.data},
                        }
                        for i in m.images
                    ),
                ]
            elif m.content:
                result["content"] = m.content
            blocks = [result]
        else:
            blocks = [{"type": "text", "text": m.content}] if m.content else []
        if not blocks:
            continue
        if wire and wire[-1]["role"] == role:
            wire[-1]["content"] += blocks
        else:
            wire.append({"role": role, "content": blocks})
    for message in wire:  # tool results must open their user message
        if message["role"] == "user":
            message["content"].sort(key=lambda b: b.get("type") != "tool_result")
    return system, wire


def _large(content: str | list[dict[str, Any]]) -> bool:
    """A tool result worth a cache breakpoint: long text, or any image."""
    if isinstance(content, str):
        return len(content) >= LARGE_TOOL_RESULT
    return any(b["type"] == "image" for b in content) or (
        sum(len(b.get("text", "")) for b in content) >= LARGE_TOOL_RESULT
    )


def _mark_large_results(wire: list[dict[str, Any]], limit: int) -> None:
    """Put cache breakpoints on the ``limit`` latest large tool results."""
    for message in reversed(wire):
        for block in reversed(message["content"]):
            if limit <= 0:
                return
            if block.get("type") == "tool_result" and _large(block.get("content", "")):
                block["cache_control"] = _EPHEMERAL
                limit -= 1


def default_max_tokens(model: str) -> int:
    # The Claude 3 models (not 3.5 / 3.7) refuse more than 4096 output tokens.
    name = model.lower().rsplit("/", 1)[-1]
    old = name.startswith("claude-3-") and not name.startswith(("claude-3-5", "claude-3-7"))
    return 4096 if old else 8192


def request_body(
    model: str, messages: list[Message], tools: list[Tool], params: GenerationParams
) -> dict[str, Any]:
    system, wire = wire_messages(messages)
    max_tokens = params.max_tokens or default_max_tokens(model)
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": True}
    breakpoints = 4
    if system:
        system[-1]["cache_control"] = _EPHEMERAL
        body["system"] = system
        breakpoints -= 1
    if tools:
        body["tools"] = [
            {"name": t.name, "description": t.description, "input_schema": t.parameters}
            for t in tools
        ]
        body["tools"][-1]["cache_control"] = _EPHEMERAL
        breakpoints -= 1
    _mark_large_results(wire, min(2, breakpoints))
    body["messages"] = wire
    budget = params.thinking_budget
    if (answer := params.response_schema) is not None:
        # Structured output is a tool the model must call, whose input is the answer.
        # The API refuses a forced tool together with thinking: thinking is left out.
        tool = {"name": answer.name, "description": ANSWER_TOOL, "input_schema": answer.schema}
        body["tools"] = [*body.get("tools", ()), tool]
        body["tool_choice"] = {"type": "tool", "name": answer.name}
        budget = None
    if budget:
        budget = max(budget, MIN_THINKING_BUDGET)
        if max_tokens <= budget:
            body["max_tokens"] = budget + default_max_tokens(model)
        body["thinking"] = {"type": "enabled", "budget_tokens": budget}
    elif params.temperature is not None:
        body["temperature"] = params.temperature  # refused together with thinking
    return body


# ---- the backend ---------------------------------------------------------------------------


class _ModelInfo(msgspec.Struct, gc=False):
    id: str
    max_input_tokens: int | None = None


class _ModelPage(msgspec.Struct, gc=False):
    data: list[_ModelInfo]
    has_more: bool = False
    last_id: str | None = None


_MODELS = msgspec.json.Decoder(_ModelPage)


class AnthropicBackend(HTTPBackend):
    default_model = "claude-sonnet-4-5"
    default_context_length = CONTEXT_LENGTH

    def __init__(
        self,
        name: str,
        base_url: str,
        api_key: str | None,
        *,
        read_timeout: float = 300.0,
        transport: httpx.AsyncBaseTransport | None = None,
        default_model: str | None = None,
    ) -> None:
        headers = {"anthropic-version": API_VERSION}
        if api_key:
            headers["x-api-key"] = api_key
        super().__init__(
            name,
            normalize_base_url(base_url),
            api_key,
            read_timeout=read_timeout,
            transport=transport,
            headers=headers,
        )
        if default_model:
            self.default_model = default_model
        self._models: dict[str, _ModelInfo] | None = None

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
        body = msgspec.json.encode(request_body(model, messages, tools, params))
        request = self._client.build_request(
            "POST", "messages", content=body, headers={"content-type": "application/json"}
        )
        parser = AnthropicParser(self.name, self._secrets)
        async with self._stream(request, parser, stream_types=STREAM_TYPES) as events:
            yield events

    async def _model_infos(self) -> dict[str, _ModelInfo]:
        if self._models is None:
            found: dict[str, _ModelInfo] = {}
            params: dict[str, str | int] = {"limit": 1000}
            while True:
                page = await self._get("models", _MODELS, "model list", params=params)
                found.update((m.id, m) for m in page.data)
                if not (page.has_more and page.last_id) or len(found) > 10000:
                    break
                params["after_id"] = page.last_id
            self._models = found
        return self._models

    async def models(self) -> list[str]:
        return list(await self._model_infos())

    async def context_length(self, model: str) -> int:
        try:
            info = (await self._model_infos()).get(model)
        except BackendError:
            return CONTEXT_LENGTH  # not cached: the next call asks again
        return (info.max_input_tokens if info else None) or CONTEXT_LENGTH

    def forget(self) -> None:
        self._models = None
