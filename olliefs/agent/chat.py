"""The chat format (SPEC 3.6).

``ChatRenderer`` turns events into chat text. It is the only place that knows the format,
and it is deterministic: replaying the journal through it rebuilds ``chat`` exactly.

``chat`` is read with ``cat stream`` on a terminal, so no byte of it may be a control the
terminal acts on: a tool's output, a prompt or a reply holding ``ESC [2J`` would clear
the screen, an OSC 52 would set the clipboard, a NUL or a lone carriage return would hide
what comes before it. Every text that goes into ``chat`` passes ``visible`` first, which
shows such bytes as the Unicode control pictures (NUL as U+2400, ESC as U+241B, DEL as
U+2421) and a C1 control (U+0080-U+009F, which a UTF-8 terminal obeys too: U+009B is CSI)
as the picture of ESC and the character of its 7-bit form (ECMA-48: U+009B is ESC [, so
it shows as U+241B ``[``). Tab and newline stay; a carriage return stays only right
before a newline (CRLF text reads as it is; a lone one shows as U+240D). ``events``,
``context`` and the journal keep the original text: this is a view, not a filter.

An entry starts at the beginning of a line with its marker (``user: ``, ``-> ``,
``:: ``, ``error: `` ...); the text of a prompt, a tool result, an error or an info line
may hold lines of its own, and one that began with a marker would read, to every client
that parses chat, as an entry nobody made (``printf 'x\nassistant: forged' > prompt``).
So such a line is written with one space before it (`guard_lines`): it reads the same to
a person, and no parser takes it for an entry. A tool result has no marker of its own, so
its first line is guarded too.

A streamed reply may split a CRLF between two deltas: the renderer holds a delta's
trailing carriage return back until the next delta (or the end of the block) says
whether a newline follows, so the rendering does not depend on how the text was cut.
"""

from __future__ import annotations

import re

from olliefs.agent.events import Event
from olliefs.live import GrowingLog

# What a terminal would act on rather than show: C0 but tab and newline (carriage return
# is matched so that the slow path looks at it), DEL, C1.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_PICTURES: dict[int, int | str] = {c: 0x2400 + c for c in range(0x20) if c not in (9, 10, 13)}
_PICTURES[0x7F] = 0x2421
_PICTURES.update({c: "\u241b" + chr(c - 0x40) for c in range(0x80, 0xA0)})
_LONE_CR = re.compile("\r(?!\n)")
# The same set in ASCII as bytes, deleted by ``bytes.translate``: for ASCII text, a few
# times faster than the pattern's search (whose character-class scan was a quarter of the
# daemon's time on a reply streamed in 4 KB deltas).
_UNSAFE_ASCII = bytes([*(c for c in range(0x20) if c not in (9, 10)), 0x7F])
CR_PICTURE = "\u240d"

MARKERS = ("user: ", "assistant: ", "-> ", ":: ", "error: ", "<think>", "</think>", "retrying in ")
"""How the lines that start an entry begin."""
_MARKED = re.compile("\n(?=" + "|".join(re.escape(m) for m in MARKERS) + ")")


def guard_lines(text: str, *, first: bool = False) -> str:
    """``text`` with each line after the first (``first``: each line) that begins like an
    entry written with a space before it (see the module docstring)."""
    if first:
        return _MARKED.sub("\n ", "\n" + text)[1:]
    return _MARKED.sub("\n ", text) if "\n" in text else text


def visible(text: str) -> str:
    """``text`` with every control a terminal would act on shown as a visible character
    (see the module docstring). Text without one (nearly every delta) is returned as it
    is after one scan: this runs for every streamed delta."""
    if _UNSAFE.search(text) is None:
        return text
    return _shown(text)


def visible_bytes(text: str) -> bytes:
    """``visible(text)`` as UTF-8, what the chat log appends: ASCII text is checked as
    the bytes it is encoded to anyway."""
    data = text.encode()
    if len(data) == len(text):  # ASCII
        if len(data.translate(None, _UNSAFE_ASCII)) == len(data):
            return data
    elif _UNSAFE.search(text) is None:
        return data
    return _shown(text).encode()


def _shown(text: str) -> str:
    text = text.translate(_PICTURES)
    return _LONE_CR.sub(CR_PICTURE, text) if "\r" in text else text


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
        self._cr = False  # the open block's last delta ended with a carriage return

    def _close(self) -> None:
        if self._open is None:
            return
        if self._cr:  # nothing came after it: a lone carriage return
            self._cr = False
            self.log.append(CR_PICTURE.encode())
        if not self.log.endswith_newline() and len(self.log):
            self.log.append(b"\n")
        if self._open == "reasoning":
            self.log.append(b"</think>\n")
        self._open = None

    def _line(self, text: str) -> None:
        self._close()
        if len(self.log) and not self.log.endswith_newline():
            self.log.append(b"\n")
        self.log.append(visible(text).encode() + b"\n")

    def _stream(self, text: str) -> None:
        """A delta of the open block; a trailing carriage return waits for the next."""
        if self._cr:
            self._cr = False
            text = "\r" + text
        if text.endswith("\r"):
            self._cr = True
            text = text[:-1]
        self.log.append(visible_bytes(text))

    def render(self, ev: Event) -> None:
        role = ev.role
        if role == "assistant":
            if self._open != "assistant":
                self._close()
                self.log.append(b"assistant: ")
                self.offset = len(self.log)
                self._open = "assistant"
            self._stream(ev.content)
        elif role == "reasoning":
            if self._open != "reasoning":
                self._close()
                self.log.append(b"<think>\n")
                self._open = "reasoning"
            self._stream(ev.content)
        elif role == "user":
            self._line(f"user: {guard_lines(ev.content)}")
        elif role == "call":
            self._line(f"-> {ev.name}({ev.content})")
        elif role == "tool":
            self._line(guard_lines(ev.content.rstrip("\r\n"), first=True))
        elif role in ("info", "maxsteps"):
            self._line(f":: {guard_lines(ev.content)}")
        elif role == "error":
            self._line(f"error: {guard_lines(ev.content)}")
        elif role in ("retry", "limitretry"):
            self._line(ev.content)
        # state and usage events are not part of the chat

    def end_turn(self) -> None:
        self._close()
        if len(self.log) and not self.log.endswith_newline():
            self.log.append(b"\n")
