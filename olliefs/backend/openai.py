"""OpenAI-compatible chat completions (OpenAI, OpenRouter, vLLM, llama.cpp, LM Studio, ...).

Compatible servers agree on the happy path and drift at the edges, so the chunk structs
accept nulls and unknown fields everywhere, while anything that is not the agreed shape
becomes a typed error rather than a silently shorter reply.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Iterator, Mapping
from contextlib import aclosing, asynccontextmanager, suppress
from typing import Any

import httpx
import msgspec

from olliefs.backend.base import (
    BackendError,
    BadResponseError,
    GenerationParams,
    Message,
    StreamDropError,
    StreamEvent,
    Tool,
    ToolCall,
    Usage,
)
from olliefs.backend.stream import http_error, httpx_errors, iter_sse, one_line, open_body

_VERSION_SEGMENT = re.compile(r"v\d+[a-z]*\d*")
_JSON_HEADERS = {"Content-Type": "application/json"}


def normalize_base_url(url: str) -> str:
    """Users paste ``https://host`` as often as ``https://host/v1``; both must reach /v1.

    A path that already ends in a version (``/v1``, ``/v1beta``, ``/api/v4``) or in
    ``/openai`` (Gemini's compatibility root) is kept as given.
    """
    try:
        parsed = httpx.URL(url.strip())
    except httpx.InvalidURL as exc:
        raise ValueError(f"invalid base URL {url!r}: {exc}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"base URL must be http(s)://host[/path], got {url!r}")
    path = parsed.path.rstrip("/")
    if not (_VERSION_SEGMENT.fullmatch(path.rsplit("/", 1)[-1]) or path.endswith("/openai")):
        path += "/v1"
    return str(parsed.copy_with(path=path))


class _FunctionDelta(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class _ToolCallDelta(msgspec.Struct):
    index: int | None = None
    id: str | None = None
    function: _FunctionDelta | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None  # vLLM, DeepSeek, LM Studio
    reasoning: str | None = None  # OpenRouter, Ollama, newer vLLM (sometimes both are sent)
    tool_calls: list[_ToolCallDelta] | None = None
    function_call: _FunctionDelta | None = None  # legacy single-function form


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    finish_reason: str | None = None


class _PromptTokensDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _PromptTokensDetails | None = None
    cost: float | None = None  # OpenRouter, USD


class _Error(msgspec.Struct):
    code: int | str | None = None


class _Chunk(msgspec.Struct):
    id: str | None = None
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: _Error | str | None = None  # OpenRouter reports failures inside a 200 stream


class _ModelEntry(msgspec.Struct):
    id: str
    context_length: int | None = None  # OpenRouter
    max_model_len: int | None = None  # vLLM


class _ModelList(msgspec.Struct):
    data: list[_ModelEntry]


_CHUNK = msgspec.json.Decoder(_Chunk)
_MODELS = msgspec.json.Decoder(_ModelList)


class _PartialCall:
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


class _Reply:
    """What one streamed reply has said so far.

    Content and reasoning pass straight through; tool calls and usage are only known
    complete at ``[DONE]``, so they are kept here and emitted once, just before ``done``.
    """

    def __init__(self, secret: str | None) -> None:
        self._secret = secret
        self._calls: dict[int, _PartialCall] = {}
        self._last_index = -1
        self._usage: Usage | None = None
        self._finish_reason = ""
        self._response_id = ""

    def feed(self, data: str) -> Iterator[StreamEvent]:
        try:
            chunk = _CHUNK.decode(data)
        except msgspec.DecodeError as exc:
            message = one_line(f"bad stream chunk ({exc}): {data}", self._secret)
            raise BadResponseError(message) from exc
        if chunk.error is not None:
            raise _in_stream_error(chunk.error, data, self._secret)
        self._response_id = chunk.id or self._response_id
        if chunk.usage is not None:
            self._usage = _usage(chunk.usage)
        for choice in chunk.choices or ():
            self._finish_reason = choice.finish_reason or self._finish_reason
            if (delta := choice.delta) is None:
                continue
            if reasoning := delta.reasoning_content or delta.reasoning:
                yield StreamEvent("reasoning", text=reasoning)
            if delta.content:
                yield StreamEvent("content", text=delta.content)
            for call in delta.tool_calls or ():
                self._add(call.index, call.id, call.function)
            if delta.function_call is not None:
                self._add(0, None, delta.function_call)

    def _add(self, index: int | None, call_id: str | None, function: _FunctionDelta | None) -> None:
        if index is None:  # Gemini omits it and sends each call whole, with its own id
            last = self._calls.get(self._last_index)
            same = last is not None and (not call_id or call_id == last.id)
            index = self._last_index if same else self._last_index + 1
        self._last_index = index
        call = self._calls.setdefault(index, _PartialCall())
        call.id = call_id or call.id
        if function is not None:
            call.name = function.name or call.name
            call.arguments.append(function.arguments or "")

    def finish(self) -> Iterator[StreamEvent]:
        if self._usage is not None:
            yield StreamEvent("usage", usage=self._usage)
        if self._calls:
            calls = tuple(self._calls[i].complete() for i in sorted(self._calls))
            yield StreamEvent("tool_calls", tool_calls=calls)
        yield StreamEvent("done", finish_reason=self._finish_reason, response_id=self._response_id)


def _usage(usage: _Usage) -> Usage:
    details = usage.prompt_tokens_details
    return Usage(
        input_tokens=usage.prompt_tokens or 0,
        output_tokens=usage.completion_tokens or 0,
        cached_input_tokens=(details.cached_tokens or 0) if details else 0,
        cost=usage.cost,
    )


def _in_stream_error(error: _Error | str, data: str, secret: str | None) -> BackendError:
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
    return http_error(status, data, secret=secret, label=f"stream error {code or ''}".strip())


def _wire_message(message: Message) -> dict[str, Any]:
    wire: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        wire["content"] = message.content or None
        wire["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
    if message.tool_call_id:
        wire["tool_call_id"] = message.tool_call_id
    if message.name:
        wire["name"] = message.name
    return wire


def _request_body(
    model: str, messages: list[Message], tools: list[Tool], params: GenerationParams
) -> bytes:
    body: dict[str, Any] = {
        "model": model,
        "messages": [_wire_message(m) for m in messages],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                },
            }
            for t in tools
        ]
    body.update(msgspec.to_builtins(params))  # only the parameters that are set
    return msgspec.json.encode(body)


class OpenAIBackend:
    """One OpenAI-compatible endpoint; ``name`` is the backend's name in the pool."""

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
    ) -> None:
        self.name = name
        self.base_url = normalize_base_url(base_url)
        self._key = api_key or None
        self._default_context_length = default_context_length
        self._context_lengths: dict[str, int] = {}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        headers.update(extra_headers or {})
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(read_timeout, connect=10.0),
            transport=transport,
        )

    @asynccontextmanager
    async def stream(
        self,
        model: str,
        messages: list[Message],
        tools: list[Tool],
        params: GenerationParams,
    ) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        body = _request_body(model, messages, tools, params)
        request = self._client.build_request(
            "POST", "chat/completions", content=body, headers=_JSON_HEADERS
        )
        with httpx_errors():
            response = await self._client.send(request, stream=True)
        async with open_body(response) as chunks:
            if not response.is_success or _is_json(response):
                with httpx_errors():
                    error_body = b"".join([chunk async for chunk in chunks])
                raise self._reply_error(response, error_body)
            async with aclosing(self._events(chunks)) as events:
                yield events

    def _reply_error(self, response: httpx.Response, body: bytes) -> BackendError:
        if not response.is_success:
            return http_error(response.status_code, body, response.headers, secret=self._key)
        # A 200 JSON reply: a proxy's error object, or a server that ignored stream=true.
        text = body.decode("utf-8", "replace")
        try:
            error = _CHUNK.decode(body).error
        except msgspec.DecodeError:
            error = None
        if error is not None:
            return _in_stream_error(error, text, self._key)
        return BadResponseError(one_line(f"expected an event stream, got JSON: {text}", self._key))

    async def _events(self, chunks: AsyncIterable[bytes]) -> AsyncGenerator[StreamEvent, None]:
        reply = _Reply(self._key)
        async with aclosing(iter_sse(chunks)) as messages:
            with httpx_errors():
                async for message in messages:
                    data = message.data.strip()
                    if data == "[DONE]":
                        break
                    if data:
                        for event in reply.feed(data):
                            yield event
                else:
                    raise StreamDropError("the stream ended before [DONE]")
            for event in reply.finish():
                yield event
            # Read on to the end of the body: only then does the connection go back to the
            # pool. The reply is complete, so a failure here no longer matters.
            with suppress(httpx.HTTPError):
                async for _ in messages:
                    pass

    async def models(self) -> list[str]:
        return [entry.id for entry in await self._model_list()]

    async def context_length(self, model: str) -> int:
        if model not in self._context_lengths:
            try:
                entries = await self._model_list()
            except BackendError:
                return self._default_context_length  # not cached: the next call asks again
            for entry in entries:
                if length := entry.context_length or entry.max_model_len:
                    self._context_lengths[entry.id] = length
            self._context_lengths.setdefault(model, self._default_context_length)
        return self._context_lengths[model]

    async def _model_list(self) -> list[_ModelEntry]:
        with httpx_errors():
            response = await self._client.get("models")
        if not response.is_success:
            raise http_error(
                response.status_code, response.content, response.headers, secret=self._key
            )
        try:
            return _MODELS.decode(response.content).data
        except msgspec.DecodeError as exc:
            raise BadResponseError(one_line(f"bad model list ({exc})", self._key)) from exc

    async def aclose(self) -> None:
        await self._client.aclose()


def _is_json(response: httpx.Response) -> bool:
    content_type: str = response.headers.get("content-type", "")
    return content_type.split(";")[0].strip().lower() == "application/json"
