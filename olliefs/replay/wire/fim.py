"""Fill in the middle: Ollama's ``/api/generate`` and OpenAI's ``/v1/completions``.

The two completion APIs that take the text after the cursor as ``suffix`` beside the
``prompt`` (what ``u/complete`` asks through ``olliefs/backend/fim.py``). The script's
``reply`` is the inserted text; the other fields act as on the chat wires (faults,
``status``, ``finish_reason``, ``usage``, ``chunk``). Both answer whole when the request
says ``"stream": false`` and stream otherwise:

* ``/api/generate``: NDJSON lines ``{"model", "created_at", "response", "done"}``, the
  last with ``done: true``, ``done_reason``, ``context`` and the counts (Ollama streams
  unless told not to); the whole answer is that last line with the full ``response``;
* ``/v1/completions``: ``text_completion`` objects, ``choices[0].text`` (SSE ``data:``
  events ending with ``[DONE]`` when streamed, which happens only when asked).

Each records under its provider's wire name (``ollama``, ``openai``) and checks the key
the same way; ``Recorded.path`` tells them from the chat requests.
"""

from __future__ import annotations

import time
from typing import Any

from olliefs.replay.wire import Answer, Frame, Plan, dumps
from olliefs.replay.wire.ollama import OllamaWire, _now
from olliefs.replay.wire.openai import OpenAIWire, event


def _prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def _suffix(body: dict[str, Any]) -> str:
    suffix = body.get("suffix")
    return suffix if isinstance(suffix, str) else ""


class GenerateWire(OllamaWire):
    """Ollama's ``POST /api/generate``."""

    def user_text(self, body: dict[str, Any]) -> str:
        return _prompt(body)

    def prompt_chars(self, body: dict[str, Any]) -> int:
        return len(_prompt(body)) + len(_suffix(body))

    def _generated(self, answer: Answer, text: str, **extra: Any) -> bytes:
        doc = {"model": answer.model, "created_at": _now(), "response": text, **extra}
        return dumps(doc) + b"\n"

    def _done(self, answer: Answer, text: str) -> bytes:
        return self._generated(
            answer,
            text,
            done=True,
            done_reason=answer.entry.finish_reason or "stop",
            context=[1, 2, 3],
            total_duration=1000000,
            load_duration=1000,
            prompt_eval_count=answer.prompt_tokens,
            prompt_eval_duration=1000,
            eval_count=answer.completion_tokens,
            eval_duration=1000,
        )

    def stream(self, answer: Answer, body: dict[str, Any]) -> Plan:
        frames = [
            Frame(self._generated(answer, p, done=False), p, True)
            for p in answer.pieces(answer.entry.reply)
        ]
        return Plan(frames, [Frame(self._done(answer, ""))])

    def complete(self, answer: Answer, body: dict[str, Any]) -> bytes | None:
        return self._done(answer, answer.entry.reply)


class CompletionsWire(OpenAIWire):
    """OpenAI's ``POST /v1/completions`` (the legacy text completions)."""

    def streaming(self, body: dict[str, Any]) -> bool:
        return body.get("stream") is True

    def user_text(self, body: dict[str, Any]) -> str:
        return _prompt(body)

    def prompt_chars(self, body: dict[str, Any]) -> int:
        return len(_prompt(body)) + len(_suffix(body))

    def _object(self, answer: Answer, text: str, finish: str | None, **extra: Any) -> bytes:
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
        return dumps(
            {
                "id": f"cmpl-{answer.n}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": answer.model,
                "choices": [choice],
                **extra,
            }
        )

    def _finish(self, answer: Answer) -> str:
        return answer.entry.finish_reason or "stop"

    def stream(self, answer: Answer, body: dict[str, Any]) -> Plan:
        frames = [
            Frame(event(self._object(answer, p, None)), p, True)
            for p in answer.pieces(answer.entry.reply)
        ]
        tail = [
            Frame(event(self._object(answer, "", self._finish(answer)))),
            Frame(event(b"[DONE]")),
        ]
        return Plan(frames, tail)

    def complete(self, answer: Answer, body: dict[str, Any]) -> bytes | None:
        usage = self._usage(answer)
        return self._object(answer, answer.entry.reply, self._finish(answer), usage=usage)
