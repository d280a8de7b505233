"""Gemini's ``streamGenerateContent?alt=sse``, as generativelanguage.googleapis.com sends it.

``data: {GenerateContentResponse}`` events ended by CRLF CRLF, no event names and no end
marker: thought parts (``"thought": true``), text parts, each function call whole (``args``
as an object, no id unless the script gives one, the script's ``signature`` as the first
call's ``thoughtSignature``), ``usageMetadata`` on every chunk, and a last chunk with
``finishReason``. Errors follow google.rpc.Status: ``{"error": {"code", "message",
"status", "details"}}``, in a body or as an event.
"""

from __future__ import annotations

from typing import Any

import msgspec

from olliefs.replay.script import Entry
from olliefs.replay.wire import Answer, Frame, Plan, Wire, dumps, error_message, text_of

STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def event(data: bytes) -> bytes:
    return b"data: " + data + b"\r\n\r\n"


def _contents(body: dict[str, Any]) -> list[dict[str, Any]]:
    contents = body.get("contents")
    return [c for c in contents if isinstance(c, dict)] if isinstance(contents, list) else []


def _args(text: str) -> Any:
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return {"value": text}
    return value if isinstance(value, dict) else {"value": value}


class GeminiWire(Wire):
    name = "gemini"
    id_prefix = None

    def streaming(self, body: dict[str, Any]) -> bool:
        return True  # the server checked the path and alt=sse

    def user_text(self, body: dict[str, Any]) -> str:
        for content in reversed(_contents(body)):
            if content.get("role", "user") == "user":
                text = text_of(content.get("parts"))
                if text:
                    return text
        return ""

    def schema(self, body: dict[str, Any]) -> Any:
        config = body.get("generationConfig")
        if not isinstance(config, dict):
            return None
        for key in ("responseSchema", "responseJsonSchema"):
            if isinstance(config.get(key), dict):
                return config[key]
        return {} if config.get("responseMimeType") == "application/json" else None

    def prompt_chars(self, body: dict[str, Any]) -> int:
        system = body.get("systemInstruction")
        chars = len(text_of(system.get("parts"))) if isinstance(system, dict) else 0
        return chars + sum(len(text_of(c.get("parts"))) for c in _contents(body))

    def _usage(self, answer: Answer, final: bool) -> dict[str, Any]:
        usage: dict[str, Any] = {"promptTokenCount": answer.prompt_tokens}
        if answer.cached_tokens is not None:
            usage["cachedContentTokenCount"] = answer.cached_tokens
        if final:
            usage["candidatesTokenCount"] = answer.completion_tokens
            usage["totalTokenCount"] = answer.prompt_tokens + answer.completion_tokens
        else:
            usage["totalTokenCount"] = answer.prompt_tokens
        return usage

    def _chunk(self, answer: Answer, parts: list[dict[str, Any]], final: bool = False) -> bytes:
        candidate: dict[str, Any] = {"content": {"parts": parts, "role": "model"}, "index": 0}
        if final:
            candidate["finishReason"] = answer.entry.finish_reason or "STOP"
        doc = {
            "candidates": [candidate],
            "usageMetadata": self._usage(answer, final),
            "modelVersion": answer.model,
            "responseId": f"replay-{answer.n}",
        }
        return event(dumps(doc))

    def stream(self, answer: Answer, body: dict[str, Any]) -> Plan:
        e = answer.entry
        frames = [
            Frame(self._chunk(answer, [{"text": p, "thought": True}]), "", True)
            for p in answer.pieces(answer.reasoning)
        ]
        frames += [
            Frame(self._chunk(answer, [{"text": p}]), p, True) for p in answer.pieces(answer.reply)
        ]
        for i, call in enumerate(answer.calls):
            function: dict[str, Any] = {"name": call.name, "args": _args(call.arguments)}
            if call.id is not None:
                function["id"] = call.id
            part: dict[str, Any] = {"functionCall": function}
            if i == 0 and e.signature is not None:
                part["thoughtSignature"] = e.signature
            frames.append(Frame(self._chunk(answer, [part]), "", True))
        return Plan(frames, [Frame(self._chunk(answer, [{"text": ""}], final=True))])

    def _status(self, status: int, entry: Entry) -> dict[str, Any]:
        error: dict[str, Any] = {
            "code": status,
            "message": error_message(status, entry),
            "status": entry.error_type or STATUS.get(status, "UNKNOWN"),
        }
        if entry.retry_delay is not None:
            error["details"] = [
                {
                    "@type": "type.googleapis.com/google.rpc.RetryInfo",
                    "retryDelay": entry.retry_delay,
                }
            ]
        return {"error": error}

    def error_body(self, status: int, entry: Entry) -> tuple[bytes, list[tuple[str, str]]]:
        return dumps(self._status(status, entry)), []

    def stream_error(self, status: int, entry: Entry) -> bytes:
        return event(dumps(self._status(status, entry)))

    def garbage(self, text: str) -> bytes:
        return event(text.encode())

    def keepalive(self) -> bytes | None:
        return b": keep-alive\r\n\r\n"
