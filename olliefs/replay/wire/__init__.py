"""Wire formats of the replay server: one module per provider, each only translating.

A ``Wire`` turns a provider-neutral ``Answer`` (what the script entry says) into the
provider's bytes: a ``Plan`` of stream frames, error bodies, in-stream errors; and reads
the few things the server needs from a request (the model, whether it streams, the user's
text for echo mode). Everything about sockets, chunking, delays, drops and hangs is the
server's (``server.py``), the same for every wire.
"""

from __future__ import annotations

from http.client import responses
from typing import Any, NamedTuple

import msgspec

from olliefs.replay.script import Entry


class Frame(NamedTuple):
    """One write of a stream: an SSE event, an NDJSON line, an event stream message.

    ``counted`` frames are the deltas that ``drop_after``, ``hang_after`` and ``delay``
    count; ``text`` is the reply text a frame carries (for the server's ``on_send``).
    """

    data: bytes
    text: str = ""
    counted: bool = False


class Plan(NamedTuple):
    """A whole stream: ``frames`` in order, then ``tail`` once every delta went out
    (finish, usage and terminator frames)."""

    frames: list[Frame]
    tail: list[Frame]


class Call(NamedTuple):
    id: str | None
    name: str
    arguments: str


class Answer:
    """The provider-neutral content of one scripted answer."""

    def __init__(self, n: int, entry: Entry, model: str, prompt_chars: int) -> None:
        self.n, self.entry, self.model = n, entry, model
        self.calls = [Call(c.id, c.name, c.arguments_text()) for c in entry.tool_calls]
        # What each wire streams as the reply's text and as thinking.
        self.reply, self.reasoning = entry.reply, entry.reasoning
        if entry.in_text is not None:
            self._in_text(entry.in_text)
        usage = entry.usage
        given = usage.prompt_tokens if usage else None
        self.prompt_tokens = max(1, prompt_chars // 4) if given is None else given
        given = usage.completion_tokens if usage else None
        chars = len(entry.reply) + len(entry.reasoning)
        self.completion_tokens = max(1, chars // 4) if given is None else given
        self.cached_tokens = usage.cached_tokens if usage else None
        self.cache_creation_tokens = usage.cache_creation_tokens if usage else None
        self.cost = usage.cost if usage else None

    def _in_text(self, form: str) -> None:
        """Thinking and tool calls written into the reply's text, as open models do
        when their server does not parse them (``in_text``)."""
        head = f"<think>{self.reasoning}</think>\n\n" if self.reasoning else ""
        written = []
        for call in self.calls:
            # the arguments' own text, so that malformed ones stay malformed
            text = f'{{"name": {dumps(call.name).decode()}, "arguments": {call.arguments}}}'
            written.append(f"<tool_call>\n{text}\n</tool_call>" if form == "tags" else text)
        tail = "\n".join(written)
        self.reply = head + self.reply + ("\n" if self.reply and tail else "") + tail
        self.reasoning, self.calls = "", []

    def pieces(self, text: str) -> list[str]:
        size = self.entry.chunk
        return [text[i : i + size] for i in range(0, len(text), size)]

    def call_id(self, index: int, prefix: str) -> str:
        given = self.calls[index].id
        return given if given is not None else f"{prefix}_{self.n}_{index}"


def dumps(value: Any) -> bytes:
    return msgspec.json.encode(value)


def error_message(status: int, entry: Entry) -> str:
    return entry.error or f"{status} {responses.get(status, 'Error')}"


def text_of(content: Any) -> str:
    """The text of a message ``content``: a string, or a list of parts with ``text``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


class Wire:
    """The interface every wire format implements (see the module docstring)."""

    name = ""
    content_type = "text/event-stream"
    #: The default tool-call id prefix; None: the provider sends no ids of its own.
    id_prefix: str | None = "call"

    def model(self, body: dict[str, Any], path_model: str) -> str:
        return str(body.get("model") or path_model)

    def streaming(self, body: dict[str, Any]) -> bool:
        return body.get("stream") is True

    def user_text(self, body: dict[str, Any]) -> str:
        """The last user message's text (echo mode)."""
        raise NotImplementedError

    def prompt_chars(self, body: dict[str, Any]) -> int:
        """Characters of every message text (the default prompt token count)."""
        raise NotImplementedError

    def schema(self, body: dict[str, Any]) -> Any:
        """The structured output the request asks for, in the wire's own form (a JSON
        Schema object, ``{}`` for "any JSON"), or None: it asks for none."""
        return None

    def refusal(self, body: dict[str, Any]) -> str | None:
        """Why a strict server of this API refuses the request (answered 400, and no
        script entry taken), or None."""
        return None

    def stream(self, answer: Answer, body: dict[str, Any]) -> Plan:
        raise NotImplementedError

    def complete(self, answer: Answer, body: dict[str, Any]) -> bytes | None:
        """A non-streamed answer; None when the wire serves streams only."""
        return None

    def error_body(self, status: int, entry: Entry) -> tuple[bytes, list[tuple[str, str]]]:
        raise NotImplementedError

    def stream_error(self, status: int, entry: Entry) -> bytes:
        raise NotImplementedError

    def garbage(self, text: str) -> bytes:
        raise NotImplementedError

    def keepalive(self) -> bytes | None:
        return None

    def flood_head(self, size: int) -> bytes:
        """What starts a payload of ``size`` bytes that never ends (``flood``)."""
        return b"data: "

    def trim(self, frame: bytes) -> bytes:
        """The frame without its final line ending (``no_final_newline``)."""
        return frame.rstrip(b"\r\n")
