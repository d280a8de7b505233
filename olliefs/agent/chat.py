"""Growing logs and the chat format (SPEC 3.6).

``GrowingLog`` is an append-only byte buffer whose readers wait on a
``trio.lowlevel.ParkingLot``: an append unparks every waiter at once, so a blocked
``cat stream`` is woken in the same scheduler tick as the token arrives, with no polling.

``ChatRenderer`` turns events into chat text. It is the only place that knows the format,
and it is deterministic: replaying the journal through it rebuilds ``chat`` exactly.
"""

from __future__ import annotations

import time

import trio

from olliefs.agent.events import Event


class GrowingLog:
    """Append-only bytes with a broadcast wake-up for readers waiting at the end."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._lot = trio.lowlevel.ParkingLot()
        self.closed = False
        self.mtime = time.time()

    def __len__(self) -> int:
        return len(self._buf)

    def append(self, data: bytes) -> None:
        if not data:
            return
        self._buf += data
        self.mtime = time.time()
        self._lot.unpark_all()

    def read(self, off: int, size: int) -> bytes:
        return bytes(self._buf[off : off + size])

    def endswith(self, suffix: bytes) -> bool:
        return self._buf.endswith(suffix)

    def close(self) -> None:
        """Readers at the end get EOF from now on (the session is gone)."""
        self.closed = True
        self._lot.unpark_all()

    async def wait(self) -> None:
        """Park until the next append or close. Callers re-check their condition."""
        await self._lot.park()


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
        if not self.log.endswith(b"\n") and len(self.log):
            self.log.append(b"\n")
        if self._open == "reasoning":
            self.log.append(b"</think>\n")
        self._open = None

    def _line(self, text: str) -> None:
        self._close()
        if len(self.log) and not self.log.endswith(b"\n"):
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
        if len(self.log) and not self.log.endswith(b"\n"):
            self.log.append(b"\n")
