"""The chat format (SPEC 3.6).

``ChatRenderer`` turns events into chat text. It is the only place that knows the format,
and it is deterministic: replaying the journal through it rebuilds ``chat`` exactly.
"""

from __future__ import annotations

from olliefs.agent.events import Event
from olliefs.live import GrowingLog


def format_seconds(seconds: float) -> str:
    return f"{seconds:g}" if seconds >= 1 or seconds == 0 else f"{seconds:.3g}"


class ChatRenderer:
    """Appends the chat rendering of each event to a ``GrowingLog``.

    An open ``assistant:`` line or ``<think>`` block is closed before any other kind of
    line; ``end_turn`` leaves the log ending with a newline.
    """

    def __init__(self, log: GrowingLog) -> None:
        self.log = log
        self._open: str | None = None  # "assistant" | "reasoning" | None
        self.offset = 0  # first byte after the latest "assistant: "

    def _close(self) -> None:
        if self._open is None:
            return
        if not self.log.endswith_newline() and len(self.log):
            self.log.append(b"\n")
        if self._open == "reasoning":
            self.log.append(b"</think>\n")
        self._open = None

    def _line(self, text: str) -> None:
        self._close()
        if len(self.log) and not self.log.endswith_newline():
            self.log.append(b"\n")
        self.log.append(text.encode() + b"\n")

    def render(self, ev: Event) -> None:
        role = ev.role
        if role == "assistant":
            if self._open != "assistant":
                self._close()
                self.log.append(b"assistant: ")
                self.offset = len(self.log)
                self._open = "assistant"
            self.log.append(ev.content.encode())
        elif role == "reasoning":
            if self._open != "reasoning":
                self._close()
                self.log.append(b"<think>\n")
                self._open = "reasoning"
            self.log.append(ev.content.encode())
        elif role == "user":
            self._line(f"user: {ev.content}")
        elif role == "call":
            self._line(f"-> {ev.name}({ev.content})")
        elif role == "tool":
            self._line(ev.content.rstrip("\n"))
        elif role in ("info", "maxsteps"):
            self._line(f":: {ev.content}")
        elif role == "error":
            self._line(f"error: {ev.content}")
        elif role in ("retry", "limitretry"):
            self._line(ev.content)
        # state and usage events are not part of the chat

    def end_turn(self) -> None:
        self._close()
        if len(self.log) and not self.log.endswith_newline():
            self.log.append(b"\n")
