"""Google Gemini API: ``models/{model}:streamGenerateContent?alt=sse``.

Each server-sent event carries a whole ``GenerateContentResponse``: ``candidates[0]``
with ``content.parts`` (``text``, ``thought: true`` for thinking summaries,
``functionCall`` with its ``args`` as an object, each part possibly with a
``thoughtSignature``), ``finishReason`` on the last chunk, and ``usageMetadata``
(``promptTokenCount`` including ``cachedContentTokenCount``, ``candidatesTokenCount``,
``thoughtsTokenCount``). There is no end marker: the stream ends with the body, so a
stream that ends before any ``finishReason`` counts as dropped. An ``{"error": ...}``
event reports a failure mid-stream.

Requests: ``contents`` with roles ``user`` and ``model``, tool results as
``functionResponse`` parts (in a user turn, by function name and id), the system prompt as
``systemInstruction``, tools as ``functionDeclarations`` (``parametersJsonSchema``, which
takes JSON Schema as it is), parameters in ``generationConfig``, thinking as
``thinkingConfig.thinkingBudget``, structured output as ``responseMimeType`` +
``responseSchema``. Thought signatures are sent back on the parts they
came with (Gemini requires that for function calls of thinking models): they travel in
``Message.provider_data["gemini"]``.

Errors follow google.rpc.Status: ``{"error": {"code", "message", "status", "details"}}``;
a 429's ``RetryInfo.retryDelay`` (``"37s"``) is the wait when no Retry-After header came.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator, Mapping
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
from olliefs.backend.openai import parse_base_url
from olliefs.backend.stream import HTTPBackend, Secrets, SSEDecoder, decode_json, http_error

WIRE = "gemini"
STREAM_TYPES = ("text/event-stream",)
CONTEXT_LENGTH = 1048576
_DURATION = re.compile(r"(\d+(?:\.\d+)?)s")

FINISH = {
    "STOP": "stop",
    "MAX_TOKENS": "length",
    "SAFETY": "content_filter",
    "RECITATION": "content_filter",
    "PROHIBITED_CONTENT": "content_filter",
    "BLOCKLIST": "content_filter",
    "SPII": "content_filter",
}


# ---- the stream ----------------------------------------------------------------------------


class _FunctionCall(msgspec.Struct, gc=False):
    name: str = ""
    args: Any = None
    id: str | None = None


class _Part(msgspec.Struct, gc=False):
    text: str | None = None
    thought: bool = False
    functionCall: _FunctionCall | None = None
    thoughtSignature: str | None = None


class _Content(msgspec.Struct, gc=False):
    parts: list[_Part] | None = None


class _Candidate(msgspec.Struct, gc=False):
    content: _Content | None = None
    finishReason: str | None = None


class _UsageMetadata(msgspec.Struct, gc=False):
    promptTokenCount: int | None = None
    candidatesTokenCount: int | None = None
    thoughtsTokenCount: int | None = None
    cachedContentTokenCount: int | None = None


class _Status(msgspec.Struct, gc=False):
    code: int | None = None
    message: str = ""
    status: str = ""
    details: list[dict[str, Any]] | None = None


class _PromptFeedback(msgspec.Struct, gc=False):
    blockReason: str | None = None


class _Response(msgspec.Struct, gc=False):
    candidates: list[_Candidate] | None = None
    usageMetadata: _UsageMetadata | None = None
    responseId: str | None = None
    promptFeedback: _PromptFeedback | None = None
    error: _Status | None = None


_RESPONSE = msgspec.json.Decoder(_Response)
_ERROR_BODY = msgspec.json.Decoder(_Response)


def retry_delay(details: list[dict[str, Any]] | None) -> float | None:
    """Seconds from a google.rpc.RetryInfo detail (``"retryDelay": "37s"``), if any."""
    for detail in details or ():
        if isinstance(detail, dict) and str(detail.get("@type", "")).endswith("RetryInfo"):
            match = _DURATION.fullmatch(str(detail.get("retryDelay", "")))
            if match:
                return float(match[1])
    return None


def status_error(
    status: int,
    body: bytes,
    headers: Mapping[str, str] | None,
    provider: str,
    secrets: Secrets,
    label: str = "",
) -> BackendError:
    try:
        error = _ERROR_BODY.decode(body).error
    except msgspec.DecodeError:
        error = None
    hint = retry_delay(error.details) if error is not None else None
    return http_error(
        status, body, headers, secret=secrets, provider=provider, label=label, retry_hint=hint
    )


class GeminiParser:
    """One streamed reply, read incrementally (see ``stream.Parser``)."""

    def __init__(self, provider: str = "gemini", secrets: Secrets = None) -> None:
        self._provider = provider
        self._secrets = secrets
        self._sse = SSEDecoder(provider)
        self.done = False
        self._finished = False
        self._calls: list[ToolCall] = []
        self._signatures: list[dict[str, Any]] = []
        self._usage: Usage | None = None
        self._finish_reason = ""
        self._response_id = ""

    def feed(self, chunk: bytes, out: list[StreamEvent]) -> None:
        for message in self._sse.feed(chunk):
            self._message(message.data, out)

    def close(self, out: list[StreamEvent]) -> None:
        for message in self._sse.close():
            self._message(message.data, out)
        if self._finished:
            self._finish(out)

    def _message(self, data: bytes, out: list[StreamEvent]) -> None:
        if not data.strip():
            return
        response = decode_json(_RESPONSE, data, self._provider, self._secrets)
        if (error := response.error) is not None:
            status = error.code or 500
            raise status_error(
                status, data, None, self._provider, self._secrets, f"stream error {status}"
            )
        if response.responseId:
            self._response_id = response.responseId
        if (usage := response.usageMetadata) is not None:
            self._usage = Usage(
                input_tokens=usage.promptTokenCount or 0,
                output_tokens=(usage.candidatesTokenCount or 0) + (usage.thoughtsTokenCount or 0),
                cached_input_tokens=usage.cachedContentTokenCount or 0,
            )
        feedback = response.promptFeedback
        if feedback is not None and feedback.blockReason and not response.candidates:
            self._finish_reason = "content_filter"
            self._finished = True
        for candidate in (response.candidates or ())[:1]:
            for part in candidate.content.parts or () if candidate.content else ():
                self._part(part, out)
            if candidate.finishReason:
                reason = candidate.finishReason
                self._finish_reason = FINISH.get(reason, reason.lower())
                self._finished = True

    def _part(self, part: _Part, out: list[StreamEvent]) -> None:
        if (call := part.functionCall) is not None:
            args = call.args if call.args is not None else {}
            call_id = call.id or f"call_{uuid.uuid4().hex[:24]}"
            self._calls.append(ToolCall(call_id, call.name, msgspec.json.encode(args).decode()))
            if part.thoughtSignature:
                self._signatures.append({"call": call_id, "signature": part.thoughtSignature})
        elif part.text:
            out.append(StreamEvent("reasoning" if part.thought else "content", text=part.text))
            if part.thoughtSignature:
                self._signatures.append({"text": True, "signature": part.thoughtSignature})
        elif part.thoughtSignature:
            self._signatures.append({"text": True, "signature": part.thoughtSignature})

    def _finish(self, out: list[StreamEvent]) -> None:
        self.done = True
        if self._usage is not None:
            out.append(StreamEvent("usage", usage=self._usage))
        if self._calls:
            out.append(StreamEvent("tool_calls", tool_calls=tuple(self._calls)))
        reason = (
            "tool_calls" if self._calls and self._finish_reason == "stop" else self._finish_reason
        )
        data = {WIRE: {"signatures": self._signatures}} if self._signatures else {}
        out.append(
            StreamEvent(
                "done", finish_reason=reason, response_id=self._response_id, provider_data=data
            )
        )


# ---- the request ---------------------------------------------------------------------------


def _args(text: str) -> Any:
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _model_parts(message: Message) -> list[dict[str, Any]]:
    own = message.provider_data.get(WIRE)
    signatures = own.get("signatures", []) if isinstance(own, dict) else []
    by_call = {s.get("call"): s.get("signature") for s in signatures if isinstance(s, dict)}
    text_signature = next(
        (s.get("signature") for s in signatures if isinstance(s, dict) and s.get("text")), None
    )
    parts: list[dict[str, Any]] = []
    if message.content:
        part: dict[str, Any] = {"text": message.content}
        if text_signature and not message.tool_calls:
            part["thoughtSignature"] = text_signature
        parts.append(part)
    for call in message.tool_calls:
        part = {"functionCall": {"name": call.name, "args": _args(call.arguments), "id": call.id}}
        if signature := by_call.get(call.id):
            part["thoughtSignature"] = signature
        parts.append(part)
    return parts


def wire_contents(messages: list[Message]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(system parts, contents); same-role neighbours merged, empty turns dropped."""
    system = [{"text": m.content} for m in messages if m.role == "system" and m.content]
    contents: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "system":
            continue
        if m.role == "assistant":
            role, parts = "model", _model_parts(m)
        elif m.role == "tool":
            response = {"name": m.name, "response": {"output": m.content}, "id": m.tool_call_id}
            role, parts = "user", [{"functionResponse": response}]
            # The images go next to their response, as parts of the same content.
            parts += [{"inlineData": {"mimeType": i.mime, "data": i.data}} for i in m.images]
        else:
            role, parts = "user", [{"text": m.content}] if m.content else []
        if not parts:
            continue
        if contents and contents[-1]["role"] == role:
            contents[-1]["parts"] += parts
        else:
            contents.append({"role": role, "parts": parts})
    return system, contents


def request_body(
    messages: list[Message], tools: list[Tool], params: GenerationParams
) -> dict[str, Any]:
    system, contents = wire_contents(messages)
    body: dict[str, Any] = {"contents": contents}
    if system:
        body["systemInstruction"] = {"parts": system}
    if tools:
        declarations = [
            {"name": t.name, "description": t.description, "parametersJsonSchema": t.parameters}
            for t in tools
        ]
        body["tools"] = [{"functionDeclarations": declarations}]
    config: dict[str, Any] = {
        key: value
        for key, value in (
            ("maxOutputTokens", params.max_tokens),
            ("temperature", params.temperature),
            ("frequencyPenalty", params.frequency_penalty),
            ("presencePenalty", params.presence_penalty),
        )
        if value is not None
    }
    if params.thinking_budget is not None:
        budget = params.thinking_budget
        config["thinkingConfig"] = {"thinkingBudget": budget, "includeThoughts": budget != 0}
    if params.response_schema is not None:
        config["responseMimeType"] = "application/json"
        config["responseSchema"] = response_schema(params.response_schema.schema)
    if config:
        body["generationConfig"] = config
    return body


def response_schema(schema: Any) -> Any:
    """A JSON Schema as Gemini's ``Schema`` (an OpenAPI subset) takes it, the way the SDK
    sends one: types in capitals, properties in their order (``propertyOrdering``: Gemini
    otherwise orders them by name), ``additionalProperties`` left out (older API versions
    refuse it, and an extra key costs nothing to whoever reads the answer)."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "additionalProperties":
            continue
        if key == "type" and isinstance(value, str):
            out[key] = value.upper()
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: response_schema(sub) for name, sub in value.items()}
            out["propertyOrdering"] = list(value)
        elif key == "items":
            out[key] = response_schema(value)
        else:
            out[key] = value
    return out


# ---- the backend ---------------------------------------------------------------------------


class _ModelEntry(msgspec.Struct, gc=False):
    name: str
    inputTokenLimit: int | None = None
    supportedGenerationMethods: list[str] | None = None


class _ModelPage(msgspec.Struct, gc=False):
    models: list[_ModelEntry] | None = None
    nextPageToken: str | None = None


_MODELS = msgspec.json.Decoder(_ModelPage)


def base_url(url: str) -> str:
    """The API root with its version: ``https://host`` and ``https://host/v1beta`` alike."""
    parsed = parse_base_url(url)
    path = parsed.path.rstrip("/")
    if not re.search(r"/v\d+[a-z]*\d*$", path):
        path += "/v1beta"
    return str(parsed.copy_with(path=path + "/"))


class GeminiBackend(HTTPBackend):
    default_model = "gemini-2.5-flash"
    default_context_length = CONTEXT_LENGTH

    def __init__(
        self,
        name: str,
        url: str,
        api_key: str | None,
        *,
        read_timeout: float = 300.0,
        transport: httpx.AsyncBaseTransport | None = None,
        default_model: str | None = None,
    ) -> None:
        headers = {"x-goog-api-key": api_key} if api_key else {}
        super().__init__(
            name,
            base_url(url),
            api_key,
            read_timeout=read_timeout,
            transport=transport,
            headers=headers,
        )
        if default_model:
            self.default_model = default_model
        self._models: dict[str, _ModelEntry] | None = None

    def _error(
        self, status: int, body: bytes, headers: Mapping[str, str] | None = None
    ) -> BackendError:
        return status_error(status, body, headers, self.name, self._secrets)

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
        body = msgspec.json.encode(request_body(messages, tools, params))
        name = model.removeprefix("models/")
        request = self._client.build_request(
            "POST",
            f"models/{name}:streamGenerateContent",
            params={"alt": "sse"},
            content=body,
            headers={"content-type": "application/json"},
        )
        parser = GeminiParser(self.name, self._secrets)
        async with self._stream(request, parser, stream_types=STREAM_TYPES) as events:
            yield events

    async def _entries(self) -> dict[str, _ModelEntry]:
        if self._models is None:
            found: dict[str, _ModelEntry] = {}
            params: dict[str, str | int] = {"pageSize": 1000}
            for _ in range(50):
                page = await self._get("models", _MODELS, "model list", params=params)
                for entry in page.models or ():
                    methods = entry.supportedGenerationMethods
                    if methods is None or "generateContent" in methods:
                        found[entry.name.removeprefix("models/")] = entry
                if not page.nextPageToken:
                    break
                params["pageToken"] = page.nextPageToken
            self._models = found
        return self._models

    async def models(self) -> list[str]:
        return list(await self._entries())

    async def context_length(self, model: str) -> int:
        try:
            entry = (await self._entries()).get(model.removeprefix("models/"))
        except BackendError:
            return CONTEXT_LENGTH
        return (entry.inputTokenLimit if entry else None) or CONTEXT_LENGTH

    def forget(self) -> None:
        self._models = None
