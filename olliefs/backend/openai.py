"""OpenAI-compatible chat completions (OpenAI, OpenRouter, vLLM, llama.cpp, LM Studio, ...).

Compatible servers agree on the happy path and drift at the edges, so the chunk structs
accept nulls and unknown fields everywhere, while anything that is not the agreed shape
becomes a typed error rather than a silently shorter reply. The drift this reads:

* reasoning as ``delta.reasoning_content`` (vLLM, DeepSeek, LM Studio) or
  ``delta.reasoning`` (OpenRouter, Ollama, newer vLLM; sometimes both, never doubled);
  OpenRouter's ``reasoning_details`` are kept whole in ``provider_data`` and sent back
  with the message, as OpenRouter asks for tool use with reasoning models;
* tool calls by ``index`` with ids and names that may come late, calls without an index
  (Gemini's compatibility endpoint sends each whole), the legacy ``function_call``;
* usage in the last chunk (``choices: []``), OpenRouter's ``usage.cost`` in USD;
* errors as an ``error`` object inside a 200 stream (OpenRouter) or as a 200 JSON body;
  usage that came with such an error (or before it) is reported before the error is
  raised, since the failed request was billed.

Open models whose server does not parse their chat template write tool calls
(``<tool_call>``, a bare JSON object) and thinking (``<think>``) into the content: those
are read out of it (``texttools.py``) unless ``GenerationParams.text_tools`` is False.

Requests to reasoning models (o1, o3, o4, gpt-5) use ``max_completion_tokens`` and leave
out the sampling parameters those models refuse; ``thinking_budget`` becomes a
``reasoning_effort`` there, and ``reasoning.max_tokens`` on OpenRouter. A
``response_schema`` becomes ``response_format`` of type ``json_schema``, strict (Copilot
and OpenRouter take the same).
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import httpx
import msgspec

from olliefs.backend.base import (
    BackendError,
    BadResponseError,
    GenerationParams,
    Message,
    StreamEvent,
    Tool,
    ToolCall,
    Usage,
    WireCache,
)
from olliefs.backend.stream import (
    HTTPBackend,
    Secrets,
    SSEDecoder,
    bad_payload,
    data_payloads,
    http_error,
    one_line,
)
from olliefs.backend.texttools import TextTools

WIRE = "openai"  # the provider_data key of this wire format
STREAM_TYPES = ("text/event-stream",)
_VERSION_SEGMENT = re.compile(r"v\d+[a-z]*\d*")
_REASONING_MODEL = re.compile(r"(o\d+(-.*)?|gpt-5(?!-chat).*)")
_JSON_HEADERS = {"Content-Type": "application/json"}


def normalize_base_url(url: str) -> str:
    """Users paste ``https://host`` as often as ``https://host/v1``; both must reach /v1.

    A path that already ends in a version (``/v1``, ``/v1beta``, ``/api/v4``) or in
    ``/openai`` (Gemini's compatibility root) is kept as given.
    """
    parsed = parse_base_url(url)
    path = parsed.path.rstrip("/")
    if not (_VERSION_SEGMENT.fullmatch(path.rsplit("/", 1)[-1]) or path.endswith("/openai")):
        path += "/v1"
    return str(parsed.copy_with(path=path))


def parse_base_url(url: str) -> httpx.URL:
    """An http(s) URL with a host, or ValueError naming what is wrong."""
    try:
        parsed = httpx.URL(url.strip())
    except httpx.InvalidURL as exc:
        raise ValueError(f"invalid base URL {url!r}: {exc}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"base URL must be http(s)://host[/path], got {url!r}")
    return parsed


def is_reasoning_model(model: str) -> bool:
    return bool(_REASONING_MODEL.fullmatch(model.lower().rsplit("/", 1)[-1]))


# ---- the stream ----------------------------------------------------------------------------


class _FunctionDelta(msgspec.Struct, gc=False):
    name: str | None = None
    arguments: str | None = None


class _ToolCallDelta(msgspec.Struct, gc=False):
    index: int | None = None
    id: str | None = None
    function: _FunctionDelta | None = None


class _Delta(msgspec.Struct, gc=False):
    content: str | None = None
    reasoning_content: str | None = None  # vLLM, DeepSeek, LM Studio
    reasoning: str | None = None  # OpenRouter, Ollama, newer vLLM (sometimes both are sent)
    reasoning_details: list[Any] | None = None  # OpenRouter
    tool_calls: list[_ToolCallDelta] | None = None
    function_call: _FunctionDelta | None = None  # legacy single-function form


class _Choice(msgspec.Struct, gc=False):
    delta: _Delta | None = None
    finish_reason: str | None = None


class _PromptTokensDetails(msgspec.Struct, gc=False):
    cached_tokens: int | None = None
    cache_write_tokens: int | None = None  # OpenRouter, for providers that charge writes


class _Usage(msgspec.Struct, gc=False):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _PromptTokensDetails | None = None
    cost: float | None = None  # OpenRouter, USD


class _Error(msgspec.Struct, gc=False):
    code: int | str | None = None


class _Chunk(msgspec.Struct, gc=False):
    id: str | None = None
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: _Error | str | None = None  # OpenRouter reports failures inside a 200 stream


_CHUNK = msgspec.json.Decoder(_Chunk)
_CHUNKS = msgspec.json.Decoder(list[_Chunk])


# The same payloads when each is nothing but a piece of the reply's text: the fields the
# parser reads are typed so that anything else (a tool call, reasoning, a finish reason,
# usage, an error, no content, two choices) fails to decode, and the read takes the
# general path. Unknown fields are skipped, as ``_Chunk`` skips them.
class _TextDelta(msgspec.Struct, gc=False):
    content: str
    reasoning_content: None = None
    reasoning: None = None
    reasoning_details: None = None
    tool_calls: None = None
    function_call: None = None


class _TextChoice(msgspec.Struct, gc=False):
    delta: _TextDelta
    finish_reason: None = None


class _TextChunk(msgspec.Struct, gc=False):
    choices: tuple[_TextChoice]
    id: str | None = None
    usage: None = None
    error: None = None


_TEXT_CHUNKS = msgspec.json.Decoder(list[_TextChunk])


class _PartialCall:
    __slots__ = ("arguments", "id", "name")

    def __init__(self) -> None:
        self.id = ""
        self.name = ""
        self.arguments: list[str] = []

    def complete(self) -> ToolCall:
        # An argument-less call streams no fragments, but the history we send back must
        # hold JSON; likewise some local servers never send an id.
        return ToolCall(
            id=self.id or f"call_{uuid.uuid4().hex[:24]}",
            name=self.name,
            arguments="".join(self.arguments) or "{}",
        )


def content_event(text: str, out: list[StreamEvent]) -> None:
    """A piece of the reply's text, passed on as it came."""
    out.append(StreamEvent("content", text=text))


class OpenAIParser:
    """One streamed chat completion, read incrementally (see ``stream.Parser``).

    Content and reasoning pass straight through; tool calls and usage are only known
    complete at ``[DONE]``, so they are kept here and emitted once, just before ``done``.
    """

    def __init__(
        self, provider: str = "openai", secrets: Secrets = None, text: TextTools | None = None
    ) -> None:
        self._provider = provider
        self._secrets = secrets
        self._text = text  # reads tool calls and <think> out of the content, if set
        self._content = text.feed if text is not None else content_event
        self._sse = SSEDecoder(provider)
        self.done = False
        self._calls: dict[int, _PartialCall] = {}
        self._last_index = -1
        self._usage: Usage | None = None
        self._finish_reason = ""
        self._response_id = ""
        self._details: dict[int, dict[str, Any]] = {}

    def feed(self, chunk: bytes, out: list[StreamEvent]) -> None:
        """A read whose events are all plain ``data:`` lines (nearly every read) has its
        payloads decoded in one msgspec call, as one JSON array: one call per delta was
        half of what a 50-byte delta cost. When every payload is a piece of text (the
        array decodes as ``_TextChunk``s) the read is one ``content`` delta, made
        without a Python step per payload; otherwise the payloads go through ``_one``.
        Anything else in the read (``[DONE]``, an error object, a payload that does not
        decode) sends that read one payload at a time through the general path, which
        says exactly what was wrong."""
        got = self._sse.feed_array(chunk)
        if got is None:
            self._read([m.data for m in self._sse.feed(chunk)], out)
            return
        array, head, n = got
        if not n:
            return
        try:
            texts = _TEXT_CHUNKS.decode(array)
        except msgspec.DecodeError:
            texts = []
        if len(texts) == n:  # the common case: pieces of text, one delta for the read
            # (a different count: a payload held more than one value)
            for piece in reversed(texts):
                if piece.id:
                    self._response_id = piece.id
                    break
            text = "".join([piece.choices[0].delta.content for piece in texts])
            if text:
                self._content(text, out)
            return
        payloads = data_payloads(head)
        if len(payloads) > 1:
            try:
                chunks = _CHUNKS.decode(array)
            except msgspec.DecodeError:
                pass
            else:
                if len(chunks) == n:
                    for data, parsed in zip(payloads, chunks, strict=True):
                        self._one(parsed, data, out)
                    return
        self._read(payloads, out)

    def close(self, out: list[StreamEvent]) -> None:
        self._read([m.data for m in self._sse.close()], out)

    def _read(self, payloads: list[bytes], out: list[StreamEvent]) -> None:
        decode = _CHUNK.decode
        for data in payloads:
            if data[:1] != b"{":  # [DONE], an empty event, or not JSON at all
                data = data.strip()
                if data == b"[DONE]":
                    self._finish(out)
                    break
                if not data:
                    continue
            try:
                chunk = decode(data)
            except msgspec.DecodeError as exc:
                raise bad_payload(self._provider, data, exc, self._secrets) from exc
            self._one(chunk, data, out)

    def _one(self, chunk: _Chunk, data: bytes, out: list[StreamEvent]) -> None:
        """One decoded payload; the common case first, inline: one choice whose delta is
        only content."""
        choices = chunk.choices
        if choices and len(choices) == 1 and chunk.usage is None and chunk.error is None:
            choice = choices[0]
            delta = choice.delta
            if (
                delta is not None
                and delta.content
                and choice.finish_reason is None
                and delta.tool_calls is None
                and delta.function_call is None
                and not (delta.reasoning or delta.reasoning_content or delta.reasoning_details)
            ):
                if chunk.id:
                    self._response_id = chunk.id
                self._content(delta.content, out)
                return
        self._chunk(chunk, data, out)

    def _chunk(self, chunk: _Chunk, data: bytes, out: list[StreamEvent]) -> None:
        if chunk.error is not None:
            # OpenRouter bills a request that failed mid-stream and says so: the usage
            # comes with the error (or before it), and is counted like any other.
            if chunk.usage is not None:
                self._usage = _usage(chunk.usage)
            if self._usage is not None:
                out.append(StreamEvent("usage", usage=self._usage))
            raise in_stream_error(chunk.error, data, self._provider, self._secrets)
        if chunk.id:
            self._response_id = chunk.id
        if chunk.usage is not None:
            self._usage = _usage(chunk.usage)
        for choice in chunk.choices or ():
            if choice.finish_reason:
                self._finish_reason = choice.finish_reason
            if (delta := choice.delta) is None:
                continue
            if reasoning := delta.reasoning_content or delta.reasoning:
                out.append(StreamEvent("reasoning", text=reasoning))
            if delta.content:
                self._content(delta.content, out)
            if delta.tool_calls:
                for call in delta.tool_calls:
                    self._add(call.index, call.id, call.function)
            if delta.function_call is not None:
                self._add(0, None, delta.function_call)
            if delta.reasoning_details:
                self._add_details(delta.reasoning_details)

    def _add(self, index: int | None, call_id: str | None, function: _FunctionDelta | None) -> None:
        if index is None:  # Gemini omits it and sends each call whole, with its own id
            last = self._calls.get(self._last_index)
            same = last is not None and (not call_id or call_id == last.id)
            index = self._last_index if same else self._last_index + 1
        self._last_index = index
        call = self._calls.get(index)
        if call is None:
            call = self._calls[index] = _PartialCall()
        if call_id:
            call.id = call_id
        if function is not None:
            if function.name:
                call.name = function.name
            if function.arguments:
                call.arguments.append(function.arguments)

    def _add_details(self, details: list[Any]) -> None:
        """Merge streamed ``reasoning_details`` fragments by index: text is appended,
        the other fields (signature, data, format, id) are taken as they arrive."""
        for fragment in details:
            if not isinstance(fragment, dict):
                continue
            index = fragment.get("index")
            key = index if isinstance(index, int) else len(self._details)
            merged = self._details.setdefault(key, {})
            for name, value in fragment.items():
                if name in ("text", "summary") and isinstance(value, str):
                    merged[name] = merged.get(name, "") + value
                elif value is not None:
                    merged[name] = value

    def _finish(self, out: list[StreamEvent]) -> None:
        self.done = True
        written = self._text.finish(out) if self._text is not None else []
        if self._usage is not None:
            out.append(StreamEvent("usage", usage=self._usage))
        if self._calls or written:
            calls = tuple(self._calls[i].complete() for i in sorted(self._calls))
            out.append(StreamEvent("tool_calls", tool_calls=(*calls, *written)))
            if written and self._finish_reason in ("", "stop"):
                self._finish_reason = "tool_calls"
        data: dict[str, Any] = {}
        if self._details:
            details = [self._details[i] for i in sorted(self._details)]
            data[WIRE] = {"reasoning_details": details}
        out.append(
            StreamEvent(
                "done",
                finish_reason=self._finish_reason,
                response_id=self._response_id,
                provider_data=data,
            )
        )


def _usage(usage: _Usage) -> Usage:
    details = usage.prompt_tokens_details
    return Usage(
        input_tokens=usage.prompt_tokens or 0,
        output_tokens=usage.completion_tokens or 0,
        cached_input_tokens=(details.cached_tokens or 0) if details else 0,
        cache_creation_tokens=(details.cache_write_tokens or 0) if details else 0,
        cost=usage.cost,
    )


def in_stream_error(
    error: _Error | str, data: bytes | str, provider: str, secrets: Secrets
) -> BackendError:
    """Classify an error object sent inside the stream as if it were the HTTP status.

    A code that is not a number is treated as a 400, so its text can still reveal an
    overflow or missing tool support.
    """
    code = error.code if isinstance(error, _Error) else None
    if isinstance(code, int):
        status = code
    elif isinstance(code, str) and code.isdigit():
        status = int(code)
    else:
        status = 400
    label = f"stream error {code or ''}".strip()
    return http_error(status, data, secret=secrets, label=label, provider=provider)


# ---- the request ---------------------------------------------------------------------------


def wire_message(message: Message) -> dict[str, Any]:
    """One message in the API's shape, and only with the fields the API defines for its
    role: strict OpenAI-compatible gateways refuse anything else with a 400."""
    wire: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.images and message.role == "user":  # (made by ``with_tool_images``)
        wire["content"] = [
            {"type": "text", "text": message.content},
            *(
                {"type": "image_url", "image_url": {"url": f"data:{i.mime};base64,{i.data}"}}
                for i in message.images
            ),
        ]
    if message.tool_calls:
        wire["content"] = message.content or None
        wire["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": json_arguments(c.arguments)},
            }
            for c in message.tool_calls
        ]
    if message.tool_call_id:
        wire["tool_call_id"] = message.tool_call_id
    # A tool message is role, content and tool_call_id: the API has no ``name`` there
    # (the history keeps it for the wires that do, Ollama's and Gemini's).
    if message.name and message.role != "tool":
        wire["name"] = message.name
    own = message.provider_data.get(WIRE)
    if isinstance(own, dict) and isinstance(details := own.get("reasoning_details"), list):
        wire["reasoning_details"] = details
    return wire


def with_tool_images(messages: list[Message]) -> list[Message]:
    """``messages`` with the images of tool results moved to a user message after them:
    the API's tool messages carry text only (their text keeps a line per image)."""
    if not any(m.images for m in messages):
        return messages
    out: list[Message] = []
    held: list[Message] = []  # tool results with images since the last other message

    def release() -> None:
        if held:
            names = ", ".join(f"{m.name} ({m.tool_call_id})" for m in held)
            text = f"[the images of the tool results above: {names}]"
            out.append(Message("user", text, images=tuple(i for m in held for i in m.images)))
            held.clear()

    for m in messages:
        if m.role != "tool":
            release()
        if m.role == "tool" and m.images:
            out.append(msgspec.structs.replace(m, images=()))
            held.append(m)
        else:
            out.append(m)
    release()
    return out


_ARGUMENTS = msgspec.json.Decoder(dict[str, Any])


def json_arguments(arguments: str) -> str:
    """A call's arguments as the request must carry them: the JSON text of an object.

    A model may stream arguments that are cut off or not JSON at all; the call is then
    answered with a tool error saying so (``agent/dispatch.py``), but the call itself
    goes back with ``{}``: vLLM, llama.cpp and Ollama parse the arguments of the calls
    in the history, and refuse the whole request (400 or 500) when one does not parse.
    """
    try:
        _ARGUMENTS.decode(arguments)
    except msgspec.DecodeError:
        return "{}"
    return arguments


def function_tools(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """Tools in the OpenAI chat ``function`` shape (Ollama takes the same)."""
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
        }
        for t in tools
    ]


def request_body(
    model: str,
    messages: list[Message],
    tools: list[Tool],
    params: GenerationParams,
    *,
    openrouter: bool = False,
    wire: WireCache | None = None,
) -> dict[str, Any]:
    messages = with_tool_images(messages)
    body: dict[str, Any] = {
        "model": model,
        "messages": (
            wire.encode(messages, wire_message) if wire else [wire_message(m) for m in messages]
        ),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if tools:
        body["tools"] = function_tools(tools)
    if (answer := params.response_schema) is not None:
        schema = {"name": answer.name, "schema": answer.schema, "strict": True}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    sampling = {
        "temperature": params.temperature,
        "frequency_penalty": params.frequency_penalty,
        "presence_penalty": params.presence_penalty,
    }
    budget = params.thinking_budget
    if is_reasoning_model(model):
        # Reasoning models refuse max_tokens and any sampling parameter but the default.
        if params.max_tokens is not None:
            body["max_completion_tokens"] = params.max_tokens
        if budget is not None and not openrouter:
            body["reasoning_effort"] = reasoning_effort(model, budget)
    else:
        if params.max_tokens is not None:
            body["max_tokens"] = params.max_tokens
        body.update({k: v for k, v in sampling.items() if v is not None})
    if budget is not None and openrouter:
        body["reasoning"] = {"max_tokens": budget} if budget > 0 else {"enabled": False}
    return body


def reasoning_effort(model: str, budget: int) -> str:
    """A token budget in OpenAI's words: minimal (gpt-5 only) / low / medium / high."""
    if budget <= 0:
        return "minimal" if "gpt-5" in model.lower() else "low"
    if budget <= 4096:
        return "low"
    if budget <= 16384:
        return "medium"
    return "high"


# ---- models --------------------------------------------------------------------------------


class _Limits(msgspec.Struct, gc=False):
    max_context_window_tokens: int | None = None
    max_prompt_tokens: int | None = None


class _Capabilities(msgspec.Struct, gc=False):
    limits: _Limits | None = None


class _TopProvider(msgspec.Struct, gc=False):
    context_length: int | None = None


class _ModelEntry(msgspec.Struct, gc=False):
    id: str
    context_length: int | None = None  # OpenRouter
    max_model_len: int | None = None  # vLLM
    top_provider: _TopProvider | None = None  # OpenRouter, per routed provider
    capabilities: _Capabilities | None = None  # GitHub Copilot

    def window(self) -> int | None:
        limits = self.capabilities.limits if self.capabilities else None
        top = self.top_provider.context_length if self.top_provider else None
        return (
            self.context_length
            or self.max_model_len
            or top
            or (limits and (limits.max_prompt_tokens or limits.max_context_window_tokens))
            or None
        )


class _ModelList(msgspec.Struct, gc=False):
    data: list[_ModelEntry]


_MODELS = msgspec.json.Decoder(_ModelList)


class OpenAIBackend(HTTPBackend):
    """One OpenAI-compatible endpoint; ``name`` is the backend's name in the pool."""

    default_model = "gpt-4o-mini"
    chat_path = "chat/completions"
    models_path = "models"
    # Open models behind compatible servers often write their tool calls and thinking
    # into the text (texttools.py); a profile's textToolCalls turns this off.
    text_tools = True
    # Headers of a request that carries images (tool results'): none for OpenAI.
    image_headers: Mapping[str, str] = {}

    def __init__(
        self,
        name: str,
        base_url: str,
        api_key: str | None,
        *,
        read_timeout: float = 300.0,
        default_context_length: int = 128000,
        transport: httpx.AsyncBaseTransport | None = None,
        extra_headers: Mapping[str, str] | None = None,
        default_model: str | None = None,
        normalize: bool = True,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        headers.update(extra_headers or {})
        url = normalize_base_url(base_url) if normalize else str(parse_base_url(base_url))
        super().__init__(
            name, url, api_key, read_timeout=read_timeout, transport=transport, headers=headers
        )
        self.default_context_length = self._default_context_length = default_context_length
        if default_model:
            self.default_model = default_model
        self._context_lengths: dict[str, int] = {}
        self._model_ids: list[str] | None = None
        self._openrouter = (httpx.URL(url).host or "").endswith("openrouter.ai")

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
        body = request_body(model, messages, tools, params, openrouter=self._openrouter, wire=wire)
        content = msgspec.json.encode(body)
        names = [t.name for t in tools] if self._reads_text(params) else None
        images = any(m.images for m in messages)
        async with contextlib.AsyncExitStack() as stack:
            request = await self._chat_request(content, images)
            try:
                events = await stack.enter_async_context(self._chat(request, names))
            except BackendError as err:
                # Only a refusal of the request itself is renewed; an error the caller
                # raises while reading the events does not pass here.
                if not self._renewed(err):
                    raise
                request = await self._chat_request(content, images)
                events = await stack.enter_async_context(self._chat(request, names))
            yield events

    def _reads_text(self, params: GenerationParams) -> bool:
        """Whether tool calls and <think> in the reply's text are read (``texttools``)."""
        return self.text_tools if params.text_tools is None else params.text_tools

    async def _chat_request(self, content: bytes, images: bool = False) -> httpx.Request:
        headers = {**_JSON_HEADERS, **(await self._request_headers())}
        if images:
            headers.update(self.image_headers)
        return self._post(self._url(self.chat_path), content, headers)

    def _chat(
        self, request: httpx.Request, tools: list[str] | None
    ) -> AbstractAsyncContextManager[AsyncIterator[StreamEvent]]:
        """``tools``: the names of the request's tools, to read calls written in the
        reply's text; None: the text is not read."""
        text = TextTools(tools) if tools is not None else None
        parser = OpenAIParser(self.name, self._secrets, text)
        return self._stream(request, parser, stream_types=STREAM_TYPES)

    def _renewed(self, err: BackendError) -> bool:
        """Whether the request refused with ``err`` is worth sending once more, at once,
        because what made it fail was renewed (Copilot: its short-lived token)."""
        return False

    async def _request_headers(self) -> dict[str, str]:
        """Per-request headers (Copilot adds its short-lived token here)."""
        return {}

    def _url(self, path: str) -> str:
        return path

    def _stream_error(self, response: httpx.Response, body: bytes) -> BackendError | None:
        # A 200 JSON reply: a proxy's error object, or a server that ignored stream=true.
        text = body.decode("utf-8", "replace")
        try:
            error = _CHUNK.decode(body).error
        except msgspec.DecodeError:
            error = None
        if error is not None:
            return in_stream_error(error, text, self.name, self._secrets)
        return BadResponseError(
            one_line(f"{self.name}: expected an event stream, got JSON: {text}", self._secrets)
        )

    async def models(self) -> list[str]:
        if self._model_ids is None:
            entries = await self._model_list()
            self._model_ids = [entry.id for entry in entries]
        return list(self._model_ids)

    async def context_length(self, model: str) -> int:
        if model not in self._context_lengths:
            try:
                entries = await self._model_list()
            except BackendError:
                return self._default_context_length  # not cached: the next call asks again
            for entry in entries:
                if length := entry.window():
                    self._context_lengths[entry.id] = length
            self._context_lengths.setdefault(model, self._default_context_length)
        return self._context_lengths[model]

    async def _model_list(self) -> list[_ModelEntry]:
        headers = await self._request_headers()
        url = self._url(self.models_path)
        return (await self._get(url, _MODELS, "model list", headers=headers)).data

    def forget(self) -> None:
        self._context_lengths.clear()
        self._model_ids = None
