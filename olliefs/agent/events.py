"""The one event vocabulary every output of an agent goes through.

An agent emits ``Event``s; the session turns each into a line of ``events`` (JSON), into
``chat`` text (``olliefs.agent.chat.ChatRenderer``) and into the journal. Restoring a
session replays the journalled events through the same renderer, so ``chat`` after a
restart is byte-for-byte what it was before.
"""

from __future__ import annotations

from typing import Literal

import msgspec

EventRole = Literal[
    "user",
    "assistant",
    "reasoning",
    "call",
    "tool",
    "usage",
    "state",
    "limitretry",
    "retry",
    "maxsteps",
    "error",
    "info",
]


class Event(msgspec.Struct, frozen=True):
    ts: float
    session: str
    agent: str
    role: EventRole
    name: str = ""
    content: str = ""
    response_id: str = ""


_encoder = msgspec.json.Encoder()


def encode_line(ev: Event) -> bytes:
    """One JSON line, written whole so a reader never sees half an event."""
    return _encoder.encode(ev) + b"\n"
