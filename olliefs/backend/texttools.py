"""Tool calls and reasoning that open models write into the text of their reply.

A model served by Ollama or an OpenAI-compatible server (vLLM, llama.cpp, LM Studio)
whose chat template the server does not parse sends its tool calls and its thinking as
plain ``content``, in its own markup. Read as text, the calls are never run (the turn
ends on a reply that only *describes* a call) and the thinking fills ``chat`` as if it
were the answer. ``TextTools`` reads the content deltas of one reply and takes out what
it recognises:

* ``<think>...</think>`` where the reply's text begins (after whitespace; and again
  after a call or a think block): its text is reasoning (DeepSeek R1, Qwen3, QwQ);
* ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` anywhere in the text
  (Hermes, Qwen 2.5 and 3; a payload that is a JSON array holds several calls; the
  closing tag may be missing at the end of the reply). The name need not be a tool of
  the request: the markup says it is a call, and an unknown tool is answered as such.
  A payload that is not JSON but names a tool is a call whose arguments are that text,
  so the model is told what was wrong with them (``agent/dispatch.py``);
* a bare JSON object ``{"name": <a tool of the request>, "arguments": {...}}``
  (``"parameters"`` in Llama 3's words), with no other key, where the reply's text
  begins; several may follow one another.

Tool calls are only read when the request offered tools. What is not recognised is the
reply's text, unchanged: a ``{`` that does not begin such an object, a ``<`` that does
not begin a tag. Text that may still turn out to be a tag or a call is held back until
it is decided (a tag cut between two deltas; a JSON object until it closes, or its first
key shows it is no call), so the chat never shows markup that was then taken out.

Cost: once the reply's first characters are read, a delta without ``<`` (or any delta,
when no tools were offered) is passed on as it is, after one scan for ``<`` in C; the
per-character work is only for text inside a tag or a candidate JSON object.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from typing import Any

import msgspec

from olliefs.backend.base import StreamEvent, ToolCall

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_KEYS = frozenset({"name", "arguments", "parameters"})

# States: where the text begins (whitespace so far), plain text, inside a think block,
# inside a <tool_call>, inside a candidate bare JSON call.
_START, _TEXT, _THINK, _CALL, _JSON = range(5)
_JSON_TOKENS = re.compile(r'[{}"\\]')
_FIRST_KEY = re.compile(r'\s*\{\s*"([^"\\]*)"\s*:')
_KEY_COMING = re.compile(r'\s*\{\s*(?:"[^"\\]*(?:"\s*)?)?')  # the first key may still come
_NAME = re.compile(r'"name"\s*:\s*"([^"\\]{1,200})"')


def _cut(text: str, tag: str) -> tuple[str, bool, str]:
    """``(before, found, after)``: the text before ``tag`` and after it; when ``tag`` is
    not in ``text``, ``after`` is a trailing piece that may be its beginning (held back
    until the next delta says)."""
    i = text.find(tag)
    if i >= 0:
        return text[:i], True, text[i + len(tag) :]
    j = text.rfind("<", max(0, len(text) - len(tag) + 1))
    if j >= 0 and tag.startswith(text[j:]):
        return text[:j], False, text[j:]
    return text, False, ""


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class TextTools:
    """The content deltas of one reply in, content / reasoning events and tool calls out
    (see the module docstring). ``tools``: the names of the tools the request offered."""

    __slots__ = (
        "_depth",
        "_escape",
        "_held",
        "_in_string",
        "_lead",
        "_names",
        "_parts",
        "_plausible",
        "_state",
        "_tail",
        "calls",
    )

    def __init__(self, tools: Iterable[str]) -> None:
        self._names = frozenset(tools)
        self._state = _START
        self._held = ""  # text held back: whitespace where the text begins, a cut tag
        self._lead = True  # nothing read yet: leading whitespace is the model's own text
        self._parts: list[str] = []  # the text of a call being read (_CALL, _JSON)
        self._tail = ""  # _CALL: its last characters, where a cut end tag may begin
        self._depth = 0  # _JSON: braces open
        self._in_string = False
        self._escape = False  # _JSON: the last piece ended with a backslash in a string
        self._plausible = False  # _JSON: its first key is one a call has
        self.calls: list[ToolCall] = []

    def feed(self, text: str, out: list[StreamEvent]) -> None:
        """One content delta; what it completes is appended to ``out``."""
        if self._state == _TEXT and not self._held and (not self._names or "<" not in text):
            out.append(StreamEvent("content", text=text))
            return
        held, self._held = self._held, ""
        self._run(held + text if held else text, out)

    def finish(self, out: list[StreamEvent]) -> list[ToolCall]:
        """The reply ended: what was held back goes out as what it turned out to be;
        returns the tool calls read from the text."""
        state, held = self._state, self._held
        self._held, self._state = "", _TEXT
        if state == _START:
            # what may have begun a think block, or a reply of whitespace only
            text = held if self._lead else held.lstrip()
            if text:
                out.append(StreamEvent("content", text=text))
        elif state == _TEXT and held:
            out.append(StreamEvent("content", text=held))
        elif state == _THINK and held:
            out.append(StreamEvent("reasoning", text=held))  # a think block never closed
        elif state == _CALL:
            self._tagged("".join(self._parts), out, closed=False)
        elif state == _JSON:
            out.append(StreamEvent("content", text="".join(self._parts)))
        self._parts = []
        return self.calls

    # ---- the states ----------------------------------------------------------------------

    def _run(self, buf: str, out: list[StreamEvent]) -> None:
        while buf:
            state = self._state
            if state == _TEXT:
                if not self._names:
                    out.append(StreamEvent("content", text=buf))
                    return
                before, found, buf = _cut(buf, CALL_OPEN)
                if before:
                    out.append(StreamEvent("content", text=before))
                if not found:
                    self._held = buf
                    return
                self._state, self._parts, self._tail = _CALL, [], ""
            elif state == _START:
                buf = self._start(buf)
            elif state == _THINK:
                before, found, buf = _cut(buf, THINK_CLOSE)
                if before:
                    out.append(StreamEvent("reasoning", text=before))
                if not found:
                    self._held = buf
                    return
                self._state = _START
            elif state == _CALL:
                buf = self._in_call(buf, out)
            else:
                buf = self._in_json(buf, out)

    def _start(self, buf: str) -> str:
        """Where the text begins: a think block, a bare JSON call, or the text itself."""
        stripped = buf.lstrip()
        if not stripped or (len(stripped) < len(THINK_OPEN) and THINK_OPEN.startswith(stripped)):
            self._held = buf  # only whitespace, or what may be the start of <think>
            return ""
        if stripped.startswith(THINK_OPEN):
            self._state, self._lead = _THINK, False
            return stripped[len(THINK_OPEN) :]
        if stripped[0] == "{" and self._names:
            self._state, self._parts = _JSON, []
            self._depth, self._in_string, self._escape, self._plausible = 0, False, False, False
            return buf  # whitespace and all: given back as text if it is no call
        self._state = _TEXT
        # Whitespace after a think block or a call only separated them from the text.
        text = buf if self._lead else stripped
        self._lead = False
        return text

    def _in_call(self, buf: str, out: list[StreamEvent]) -> str:
        """Inside ``<tool_call>``: held until its end tag (found even when cut between
        deltas: only the new piece and the few characters before it are searched)."""
        window = self._tail + buf
        i = window.find(CALL_CLOSE)
        if i < 0:
            self._parts.append(buf)
            self._tail = window[-(len(CALL_CLOSE) - 1) :]
            return ""
        k = i - len(self._tail)  # where the end tag starts in ``buf`` (< 0: before it)
        text = "".join(self._parts)
        text = text + buf[:k] if k >= 0 else text[: len(text) + k]
        self._parts, self._tail = [], ""
        called = self._tagged(text, out, closed=True)
        self._state, self._lead = (_START if called else _TEXT), False
        return buf[k + len(CALL_CLOSE) :]

    def _in_json(self, buf: str, out: list[StreamEvent]) -> str:
        """Inside what may be a bare JSON call: held until the object closes, or until
        its first key shows it is not one (then it is the reply's text after all)."""
        end = self._close(buf)
        self._parts.append(buf if end < 0 else buf[:end])
        if not self._plausible:
            held = "".join(self._parts)
            first = _FIRST_KEY.match(held)
            if first is not None and first[1] in _CALL_KEYS:
                self._plausible = True
            elif first is not None or not _KEY_COMING.fullmatch(held):
                self._state, self._lead, self._parts = _TEXT, False, []
                return held + (buf[end:] if end >= 0 else "")
            self._parts = [held]
        if end < 0:
            return ""
        text = "".join(self._parts)
        self._parts = []
        calls = self._parse(text, tagged=False)
        if calls:
            self.calls += calls
            self._state, self._lead = _START, False
        else:
            out.append(StreamEvent("content", text=text))
            self._state, self._lead = _TEXT, False
        return buf[end:]

    def _close(self, buf: str) -> int:
        """Follow the braces of a JSON object through ``buf``: the index just after the
        one that closes it, or -1 (the state carries over to the next piece)."""
        skip = 0 if self._escape else -1
        self._escape = False
        for m in _JSON_TOKENS.finditer(buf):
            i = m.start()
            if i == skip:
                continue
            c = buf[i]
            if self._in_string:
                if c == "\\":
                    skip = i + 1
                    self._escape = skip == len(buf)
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c == "{":
                self._depth += 1
            elif c == "}":
                self._depth -= 1
                if self._depth <= 0:
                    return i + 1
        return -1

    # ---- calls -----------------------------------------------------------------------------

    def _tagged(self, payload: str, out: list[StreamEvent], *, closed: bool) -> bool:
        calls = self._parse(payload, tagged=True)
        if calls:
            self.calls += calls
            return True
        # Not a call after all: the text as it came.
        out.append(
            StreamEvent("content", text=CALL_OPEN + payload + (CALL_CLOSE if closed else ""))
        )
        return False

    def _parse(self, text: str, *, tagged: bool) -> list[ToolCall]:
        """The calls ``text`` holds; [] if it is not a call (then it is text)."""
        try:
            value: Any = msgspec.json.decode(text.strip())
        except msgspec.DecodeError:
            # Inside <tool_call> the model meant a call: one with arguments that do not
            # parse is answered with a tool error that says so.
            name = _NAME.search(text) if tagged else None
            return [ToolCall(_call_id(), name[1], text.strip())] if name else []
        items = value if isinstance(value, list) and tagged else [value]
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(name := item.get("name"), str):
                return []
            if not tagged and (name not in self._names or not set(item) <= _CALL_KEYS):
                return []
            args = item.get("arguments", item.get("parameters", {}))
            # Some templates hand the arguments back as a JSON string.
            text_args = args if isinstance(args, str) else msgspec.json.encode(args).decode()
            calls.append(ToolCall(_call_id(), name, text_args))
        return calls
