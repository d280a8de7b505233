"""Kiro / CodeWhisperer ``generateAssistantResponse``: an AWS event stream.

The body is ``application/vnd.amazon.eventstream``: binary frames, each a 12-byte prelude
(total length, headers length, CRC32 of the two), string headers (``:message-type``,
``:event-type``, ``:content-type``), a JSON payload and a CRC32 of the whole frame. A
reply is a ``messageMetadataEvent``, ``assistantResponseEvent {content}`` deltas,
``toolUseEvent {toolUseId, name, input}`` fragments closed by one with ``stop: true``, and
a ``meteringEvent`` (Kiro's, shape unverified); the body simply ends, there is no end
event. Errors: an ``x-amzn-errortype`` header and ``{"message", "__type"}`` body, or an
``exception`` frame inside the stream. There is no thinking here; ``reasoning`` is left
out. Which parts of this rest on public documentation is listed in ollie-replay(1).
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

from olliefs.replay.script import Entry
from olliefs.replay.wire import Answer, Frame, Plan, Wire, dumps, error_message

EXCEPTIONS = {
    400: "ValidationException",
    403: "AccessDeniedException",
    404: "ResourceNotFoundException",
    409: "ConflictException",
    429: "ThrottlingException",
}


def encode_frame(headers: list[tuple[str, str]], payload: bytes) -> bytes:
    """One event stream message, every header a string (type 7)."""
    head = b"".join(
        bytes([len(name)])
        + name.encode()
        + b"\x07"
        + struct.pack(">H", len(value.encode()))
        + value.encode()
        for name, value in headers
    )
    total = 12 + len(head) + len(payload) + 4
    prelude = struct.pack(">II", total, len(head))
    message = prelude + struct.pack(">I", zlib.crc32(prelude)) + head + payload
    return message + struct.pack(">I", zlib.crc32(message))


def event(kind: str, payload: dict[str, Any] | bytes) -> bytes:
    data = payload if isinstance(payload, bytes) else dumps(payload)
    headers = [
        (":event-type", kind),
        (":content-type", "application/json"),
        (":message-type", "event"),
    ]
    return encode_frame(headers, data)


def exception_name(status: int, entry: Entry) -> str:
    if entry.error_type:
        return entry.error_type
    return EXCEPTIONS.get(
        status, "InternalServerException" if status >= 500 else "ValidationException"
    )


class KiroWire(Wire):
    name = "kiro"
    content_type = "application/vnd.amazon.eventstream"
    id_prefix = "tooluse"

    def _current(self, body: dict[str, Any]) -> dict[str, Any]:
        state = body.get("conversationState")
        current = state.get("currentMessage") if isinstance(state, dict) else None
        user = current.get("userInputMessage") if isinstance(current, dict) else None
        return user if isinstance(user, dict) else {}

    def model(self, body: dict[str, Any], path_model: str) -> str:
        return str(self._current(body).get("modelId") or path_model)

    def streaming(self, body: dict[str, Any]) -> bool:
        return True

    def user_text(self, body: dict[str, Any]) -> str:
        content = self._current(body).get("content")
        return content if isinstance(content, str) else ""

    def prompt_chars(self, body: dict[str, Any]) -> int:
        state = body.get("conversationState")
        history = state.get("history") if isinstance(state, dict) else None
        chars = len(self.user_text(body))
        for turn in history if isinstance(history, list) else ():
            for message in turn.values() if isinstance(turn, dict) else ():
                if isinstance(message, dict) and isinstance(message.get("content"), str):
                    chars += len(message["content"])
        return chars

    def stream(self, answer: Answer, body: dict[str, Any]) -> Plan:
        meta = {
            "conversationId": f"conv-replay-{answer.n}",
            "utteranceId": f"utt-replay-{answer.n}",
        }
        frames = [Frame(event("messageMetadataEvent", meta))]
        frames += [
            Frame(event("assistantResponseEvent", {"content": p}), p, True)
            for p in answer.pieces(answer.reply)
        ]
        for i, call in enumerate(answer.calls):
            use_id = answer.call_id(i, "tooluse")
            for piece in answer.pieces(call.arguments) or [""]:
                payload = {"toolUseId": use_id, "name": call.name, "input": piece}
                frames.append(Frame(event("toolUseEvent", payload), "", True))
            stop = {"toolUseId": use_id, "name": call.name, "stop": True}
            frames.append(Frame(event("toolUseEvent", stop)))
        tail = [
            Frame(
                event("meteringEvent", {"unit": "credit", "unitPlural": "credits", "usage": 0.01})
            )
        ]
        return Plan(frames, tail)

    def error_body(self, status: int, entry: Entry) -> tuple[bytes, list[tuple[str, str]]]:
        name = exception_name(status, entry)
        doc: dict[str, Any] = {
            "message": error_message(status, entry),
            "__type": f"com.amazon.aws.codewhisperer#{name}",
        }
        if entry.error_code:
            doc["reason"] = entry.error_code
        return dumps(doc), [
            (
                "x-amzn-errortype",
                f"{name}:http://internal.amazon.com/coral/com.amazon.aws.codewhisperer/",
            )
        ]

    def stream_error(self, status: int, entry: Entry) -> bytes:
        name = exception_name(status, entry)
        headers = [
            (":exception-type", name),
            (":content-type", "application/json"),
            (":message-type", "exception"),
        ]
        return encode_frame(headers, dumps({"message": error_message(status, entry)}))

    def garbage(self, text: str) -> bytes:
        return event("assistantResponseEvent", text.encode())

    def trim(self, frame: bytes) -> bytes:
        return frame  # binary frames have no line ending to leave out

    def flood_head(self, size: int) -> bytes:
        """A frame's prelude (checksum right) announcing a payload of ``size`` bytes."""
        prelude = struct.pack(">II", 16 + size, 0)
        return prelude + struct.pack(">I", zlib.crc32(prelude))
