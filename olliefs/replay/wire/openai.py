"""OpenAI chat completions, byte for byte as api.openai.com streams them.

``data: {chat.completion.chunk}`` events separated by blank lines: the first delta also
carries ``"role": "assistant"``; tool calls open with ``index``, ``id``, ``type`` and
``function.name`` and empty arguments, then the arguments follow in fragments; a chunk
with ``finish_reason``; the usage chunk (``"choices": []``) only when the request asked
for ``stream_options.include_usage``; ``data: [DONE]``. Errors are
``{"error": {"message", "type", "param", "code"}}``; an error inside a stream is sent the
way OpenRouter does, as a chunk holding ``error`` with a numeric ``code``.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from olliefs.replay.script import Entry
from olliefs.replay.wire import Answer, Frame, Plan, Wire, dumps, error_message, text_of


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    return [m for m in msgs if isinstance(m, dict)] if isinstance(msgs, list) else []


def event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


# The fields of a tool message in the API; strict gateways refuse any other.
TOOL_MESSAGE_FIELDS = ("role", "content", "tool_call_id")


class OpenAIWire(Wire):
    name = "openai"
    id_prefix = "call"

    def user_text(self, body: dict[str, Any]) -> str:
        users = [m for m in _messages(body) if m.get("role") == "user"]
        return text_of(users[-1].get("content")) if users else ""

    def prompt_chars(self, body: dict[str, Any]) -> int:
        return sum(len(text_of(m.get("content"))) for m in _messages(body))

    def schema(self, body: dict[str, Any]) -> Any:
        form = body.get("response_format")
        if not isinstance(form, dict) or form.get("type") not in ("json_schema", "json_object"):
            return None
        spec = form.get("json_schema")
        return spec.get("schema", {}) if isinstance(spec, dict) else {}

    def refusal(self, body: dict[str, Any]) -> str | None:
        """What strict OpenAI-compatible servers refuse: a field a tool message does not
        have (gateways that validate against the API's schema), and the arguments of a
        call in the history that are not the JSON text of an object (vLLM, llama.cpp and
        Ollama parse them for the chat template)."""
        for i, message in enumerate(_messages(body)):
            if message.get("role") == "tool":
                extra = [k for k in message if k not in TOOL_MESSAGE_FIELDS]
                if extra:
                    return (
                        f"messages[{i}].{extra[0]}: Extra inputs are not permitted (a tool "
                        f"message has {', '.join(TOOL_MESSAGE_FIELDS)})"
                    )
            calls = message.get("tool_calls")
            for j, call in enumerate(calls if isinstance(calls, list) else ()):
                function = call.get("function") if isinstance(call, dict) else None
                args = function.get("arguments") if isinstance(function, dict) else None
                where = f"messages[{i}].tool_calls[{j}].function.arguments"
                if not isinstance(args, str):
                    return f"{where}: must be a string"
                try:
                    value = msgspec.json.decode(args)
                except msgspec.DecodeError as err:
                    return f"{where}: not valid JSON ({err})"
                if not isinstance(value, dict):
                    return f"{where}: must be a JSON object"
        return None

    def _calls(self, answer: Answer) -> list[tuple[str, str, str]]:
        return [
            (answer.call_id(i, "call"), call.name, call.arguments)
            for i, call in enumerate(answer.calls)
        ]

    def _finish_reason(self, answer: Answer) -> str:
        return answer.entry.finish_reason or ("tool_calls" if answer.calls else "stop")

    def _usage(self, answer: Answer) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": answer.prompt_tokens,
            "completion_tokens": answer.completion_tokens,
            "total_tokens": answer.prompt_tokens + answer.completion_tokens,
        }
        if answer.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": answer.cached_tokens}
        if answer.cost is not None:
            usage["cost"] = answer.cost
        return usage

    def _chunk(self, answer: Answer, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return event(
            dumps(
                {
                    "id": f"chatcmpl-{answer.n}",
                    "object": "chat.completion.chunk",
                    "created": int(time.time()),
                    "model": answer.model,
                    "choices": choices,
                    **extra,
                }
            )
        )

    def deltas(self, answer: Answer) -> list[tuple[dict[str, Any], str]]:
        """Every counted delta, paired with its content text."""
        e = answer.entry
        out: list[tuple[dict[str, Any], str]] = [
            ({e.reasoning_field: p}, "") for p in answer.pieces(answer.reasoning)
        ]
        out += [({"content": p}, p) for p in answer.pieces(answer.reply)]
        for index, (call_id, name, arguments) in enumerate(self._calls(answer)):
            function = {"name": name, "arguments": ""}
            head = {"index": index, "id": call_id, "type": "function", "function": function}
            frags = [
                {"index": index, "function": {"arguments": p}} for p in answer.pieces(arguments)
            ]
            for call in [*frags, head] if e.late_ids else [head, *frags]:
                out.append(({"tool_calls": [call]}, ""))
        delta, content = out[0] if out else ({"content": ""}, "")
        out[:1] = [({"role": "assistant", **delta}, content)]
        return out

    def stream(self, answer: Answer, body: dict[str, Any]) -> Plan:
        frames = [
            Frame(
                self._chunk(answer, [{"index": 0, "delta": delta, "finish_reason": None}]),
                text,
                counted=True,
            )
            for delta, text in self.deltas(answer)
        ]
        finish = {"index": 0, "delta": {}, "finish_reason": self._finish_reason(answer)}
        tail = [Frame(self._chunk(answer, [finish]))]
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage") is True:
            tail.append(Frame(self._chunk(answer, [], usage=self._usage(answer))))
        tail.append(Frame(event(b"[DONE]")))
        return Plan(frames, tail)

    def complete(self, answer: Answer, body: dict[str, Any]) -> bytes | None:
        e = answer.entry
        message: dict[str, Any] = {"role": "assistant", "content": answer.reply or None}
        if answer.reasoning:
            message[e.reasoning_field] = answer.reasoning
        if answer.calls:
            message["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": name, "arguments": args}}
                for i, name, args in self._calls(answer)
            ]
        choice = {"index": 0, "message": message, "finish_reason": self._finish_reason(answer)}
        return dumps(
            {
                "id": f"chatcmpl-{answer.n}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": answer.model,
                "choices": [choice],
                "usage": self._usage(answer),
            }
        )

    def error_body(self, status: int, entry: Entry) -> tuple[bytes, list[tuple[str, str]]]:
        type_ = entry.error_type
        if type_ is None:
            type_ = (
                "requests"
                if status == 429
                else "server_error"
                if status >= 500
                else "invalid_request_error"
            )
        code = entry.error_code
        if code is None:
            code = {429: "rate_limit_exceeded", 401: "invalid_api_key"}.get(status)
        error = {
            "message": error_message(status, entry),
            "type": type_,
            "param": None,
            "code": code,
        }
        return dumps({"error": error}), []

    def stream_error(self, status: int, entry: Entry) -> bytes:
        """OpenRouter's error inside a 200 stream: ``error`` beside a choice finished
        with ``"error"``, and the usage of the failed request when the entry gives one
        (OpenRouter bills it)."""
        error = {"code": status, "message": error_message(status, entry)}
        choice = {"index": 0, "delta": {"content": ""}, "finish_reason": "error"}
        doc: dict[str, Any] = {"error": error, "choices": [choice]}
        if (usage := entry.usage) is not None:
            prompt, completion = usage.prompt_tokens or 0, usage.completion_tokens or 0
            doc["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
            if usage.cost is not None:
                doc["usage"]["cost"] = usage.cost
        return event(dumps(doc))

    def garbage(self, text: str) -> bytes:
        return event(text.encode())

    def keepalive(self) -> bytes | None:
        return b": keep-alive\n\n"
