"""Anthropic Messages, streamed as api.anthropic.com does it.

``event: <type>`` plus ``data: {"type": <type>, ...}`` per event: ``message_start``
(usage with ``input_tokens`` not counting the cache, ``cache_read_input_tokens`` and
``cache_creation_input_tokens`` apart), then per content block ``content_block_start``,
its deltas (``thinking_delta`` then one ``signature_delta``; ``text_delta``;
``input_json_delta``) and ``content_block_stop``; ``message_delta`` with the stop reason
and the output tokens; ``message_stop``. Tools the provider ran itself (``server_tools``)
are a ``server_tool_use`` block, its input as ``input_json_delta``, then its result block
whole at its start, between text blocks, as the API sends web search results. Errors are
``{"type": "error", "error": {"type", "message"}}``, in a body or as an ``error`` event.
"""

from __future__ import annotations

from typing import Any

from olliefs.replay.script import Entry
from olliefs.replay.wire import Answer, Frame, Plan, Wire, dumps, error_message, text_of

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def event(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: %b\ndata: %b\n\n" % (kind.encode(), dumps({"type": kind, **payload}))


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    return [m for m in msgs if isinstance(m, dict)] if isinstance(msgs, list) else []


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(
            text_of(b.get("content")) if b.get("type") == "tool_result" else text_of([b])
            for b in content
            if isinstance(b, dict)
        )
    return text_of(content)


class AnthropicWire(Wire):
    name = "anthropic"
    id_prefix = "toolu"

    def user_text(self, body: dict[str, Any]) -> str:
        for message in reversed(_messages(body)):
            if message.get("role") != "user":
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = [b for b in content if isinstance(b, dict) and b.get("type") == "text"]
                if not content:
                    continue  # only tool results: look further back
            return text_of(content)
        return ""

    def schema(self, body: dict[str, Any]) -> Any:
        """A forced tool (``tool_choice`` of type ``tool``) is Anthropic's structured
        output: its ``input_schema``."""
        choice, tools = body.get("tool_choice"), body.get("tools")
        if not isinstance(choice, dict) or choice.get("type") != "tool":
            return None
        for tool in tools if isinstance(tools, list) else ():
            if isinstance(tool, dict) and tool.get("name") == choice.get("name"):
                return tool.get("input_schema", {})
        return {}

    def prompt_chars(self, body: dict[str, Any]) -> int:
        system = text_of(body.get("system"))
        return len(system) + sum(len(_text(m.get("content"))) for m in _messages(body))

    def stream(self, answer: Answer, body: dict[str, Any]) -> Plan:
        e = answer.entry
        cached = answer.cached_tokens or 0
        created = answer.cache_creation_tokens or 0
        usage = {
            "input_tokens": max(answer.prompt_tokens - cached - created, 0),
            "cache_creation_input_tokens": created,
            "cache_read_input_tokens": cached,
            "output_tokens": 1,
        }
        message: dict[str, Any] = {
            "id": f"msg_replay_{answer.n}",
            "type": "message",
            "role": "assistant",
            "model": answer.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        frames = [Frame(event("message_start", {"message": message}))]
        index = 0

        def block(start: dict[str, Any], deltas: list[tuple[dict[str, Any], str]]) -> None:
            nonlocal index
            frames.append(
                Frame(event("content_block_start", {"index": index, "content_block": start}))
            )
            for delta, text in deltas:
                payload = {"index": index, "delta": delta}
                counted = delta["type"] != "signature_delta"
                frames.append(Frame(event("content_block_delta", payload), text, counted))
            frames.append(Frame(event("content_block_stop", {"index": index})))
            index += 1

        if answer.reasoning:
            deltas: list[tuple[dict[str, Any], str]] = [
                ({"type": "thinking_delta", "thinking": p}, "")
                for p in answer.pieces(answer.reasoning)
            ]
            signature = e.signature if e.signature is not None else f"sig-{answer.n}"
            deltas.append(({"type": "signature_delta", "signature": signature}, ""))
            block({"type": "thinking", "thinking": "", "signature": ""}, deltas)

        def text(part: str) -> None:
            block(
                {"type": "text", "text": ""},
                [({"type": "text_delta", "text": p}, p) for p in answer.pieces(part)],
            )

        done = 0
        for i, tool in enumerate(e.server_tools):
            at = min(max(tool.after, done), len(answer.reply))
            if at > done:
                text(answer.reply[done:at])
                done = at
            use_id = tool.id if tool.id is not None else f"srvtoolu_{answer.n}_{i}"
            use = {"type": "server_tool_use", "id": use_id, "name": tool.name, "input": {}}
            pieces = answer.pieces(dumps(tool.arguments).decode()) or [""]
            block(use, [({"type": "input_json_delta", "partial_json": p}, "") for p in pieces])
            result = {
                "type": tool.result_type or f"{tool.name}_tool_result",
                "tool_use_id": use_id,
                "content": [] if tool.result is None else tool.result,
            }
            block(result, [])
        if answer.reply[done:] or not (answer.calls or e.server_tools):
            text(answer.reply[done:])
        for i, call in enumerate(answer.calls):
            start = {
                "type": "tool_use",
                "id": answer.call_id(i, "toolu"),
                "name": call.name,
                "input": {},
            }
            pieces = answer.pieces(call.arguments) or [""]
            block(start, [({"type": "input_json_delta", "partial_json": p}, "") for p in pieces])
        stop = e.finish_reason or ("tool_use" if answer.calls else "end_turn")
        delta = {"stop_reason": stop, "stop_sequence": None}
        tail = [
            Frame(
                event(
                    "message_delta",
                    {"delta": delta, "usage": {"output_tokens": answer.completion_tokens}},
                )
            ),
            Frame(event("message_stop", {})),
        ]
        return Plan(frames, tail)

    def _error(self, status: int, entry: Entry) -> dict[str, Any]:
        kind = entry.error_type or ERROR_TYPES.get(
            status, "api_error" if status >= 500 else "invalid_request_error"
        )
        return {"type": "error", "error": {"type": kind, "message": error_message(status, entry)}}

    def error_body(self, status: int, entry: Entry) -> tuple[bytes, list[tuple[str, str]]]:
        return dumps(self._error(status, entry)), [("request-id", "req_replay")]

    def stream_error(self, status: int, entry: Entry) -> bytes:
        error = self._error(status, entry)
        return b"event: error\ndata: %b\n\n" % dumps(error)

    def garbage(self, text: str) -> bytes:
        return b"event: content_block_delta\ndata: %b\n\n" % text.encode()

    def flood_head(self, size: int) -> bytes:
        return b"event: content_block_delta\ndata: "

    def keepalive(self) -> bytes | None:
        return event("ping", {})
