"""Ollama's ``/api/chat``, streamed as newline-delimited JSON as a local server does.

One JSON object a line: ``message`` deltas with ``thinking`` or ``content``, each tool
call whole in a line of its own (``arguments`` as an object, no id unless the script
gives one), and a last line with ``done: true``, ``done_reason`` and the counts
(``prompt_eval_count``, ``eval_count``, durations in nanoseconds). Errors are
``{"error": "<message>"}``, as the body of an error status or as a line of the stream.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec

from olliefs.replay.script import Entry
from olliefs.replay.wire import Answer, Frame, Plan, Wire, dumps, error_message, text_of


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    return [m for m in msgs if isinstance(m, dict)] if isinstance(msgs, list) else []


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _arguments(text: str) -> Any:
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text  # not JSON: sent as the string it is


class OllamaWire(Wire):
    name = "ollama"
    content_type = "application/x-ndjson"
    id_prefix = None

    def streaming(self, body: dict[str, Any]) -> bool:
        return body.get("stream") is not False  # Ollama streams unless told not to

    def user_text(self, body: dict[str, Any]) -> str:
        users = [m for m in _messages(body) if m.get("role") == "user"]
        return text_of(users[-1].get("content")) if users else ""

    def prompt_chars(self, body: dict[str, Any]) -> int:
        return sum(len(text_of(m.get("content"))) for m in _messages(body))

    def schema(self, body: dict[str, Any]) -> Any:
        form = body.get("format")
        return form if isinstance(form, dict) else {} if form == "json" else None

    def _line(self, answer: Answer, message: dict[str, Any], **extra: Any) -> bytes:
        doc = {
            "model": answer.model,
            "created_at": _now(),
            "message": {"role": "assistant", "content": "", **message},
            **extra,
        }
        return dumps(doc) + b"\n"

    def stream(self, answer: Answer, body: dict[str, Any]) -> Plan:
        e = answer.entry
        frames = [
            Frame(self._line(answer, {"thinking": p}, done=False), "", True)
            for p in answer.pieces(answer.reasoning)
        ]
        frames += [
            Frame(self._line(answer, {"content": p}, done=False), p, True)
            for p in answer.pieces(answer.reply)
        ]
        for i, call in enumerate(answer.calls):
            function: dict[str, Any] = {
                "index": i,
                "name": call.name,
                "arguments": _arguments(call.arguments),
            }
            wire_call: dict[str, Any] = {"function": function}
            if call.id is not None:
                wire_call["id"] = call.id
            frames.append(
                Frame(self._line(answer, {"tool_calls": [wire_call]}, done=False), "", True)
            )
        done = self._line(
            answer,
            {},
            done=True,
            done_reason=e.finish_reason or "stop",
            total_duration=1000000,
            load_duration=1000,
            prompt_eval_count=answer.prompt_tokens,
            prompt_eval_duration=1000,
            eval_count=answer.completion_tokens,
            eval_duration=1000,
        )
        return Plan(frames, [Frame(done)])

    def error_body(self, status: int, entry: Entry) -> tuple[bytes, list[tuple[str, str]]]:
        return dumps({"error": error_message(status, entry)}), []

    def stream_error(self, status: int, entry: Entry) -> bytes:
        return dumps({"error": error_message(status, entry)}) + b"\n"

    def garbage(self, text: str) -> bytes:
        return text.encode() + b"\n"

    def flood_head(self, size: int) -> bytes:
        return b'{"message": {"role": "assistant", "content": "'
