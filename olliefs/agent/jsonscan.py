"""An incremental JSON syntax scanner: is this data a prefix of some valid JSON document?

A profile written through the tree (``a/<name>.json``) is checked after every write (SPEC
3.7): a write after which the document is *certainly* invalid fails at once, while a
document that is merely unfinished is let through until close. A parser cannot tell the
two apart — to it, ``{"tools": [`` and ``{"tools": ]`` are both "not JSON" — so this module
runs the JSON grammar (RFC 8259) as a push-down automaton over the bytes seen so far and
answers three questions at any point:

* ``ok``: the data so far is a prefix of at least one valid document (the automaton has
  not rejected a character; a UTF-8 sequence cut at the very end is fine);
* ``complete``: the data so far *is* a valid document (the top-level value has ended and
  only whitespace followed it);
* ``error``: when not ok, why, with the line and column of the first offending character.

Both ``ok`` and ``complete`` may hold at once (``12`` may still become ``123``; ``{}`` may
still get trailing whitespace). The scanner is fed chunk by chunk and keeps its state
between chunks, so checking a document written in many small writes costs one pass over
it, not one pass per write.

``completion()`` returns bytes that, appended to the data, make a valid document. The
profile code uses the state to explain an unfinished document ("inside a string", "2
brackets open"); the tests use it to prove that every "prefix" verdict is honest: the data
plus its completion must parse with an independent parser.

Two deliberate departures from the bare grammar, both things the decoder behind it
(msgspec) refuses anyway, so refusing them early only makes the error come sooner and read
better: nesting deeper than ``MAX_DEPTH`` (no profile needs it, and it bounds the stack),
and a lone surrogate in ``\\u`` escapes (a high one not followed at once by a low one, or a
low one alone), which is not text.
"""

from __future__ import annotations

import codecs
import re

MAX_DEPTH = 512

_WS = " \t\n\r"
_WS_RUN = re.compile(r"[ \t\n\r]*")
_STR_RUN = re.compile(r'[^"\\\x00-\x1f]*')
_DIGITS = re.compile(r"[0-9]*")
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = frozenset('"\\/bfnrt')
_LONE_HIGH = "a high surrogate \\uD800-\\uDBFF must be followed by a low one (\\uDC00-\\uDFFF)"
# One whole token after optional whitespace: a string without escapes, a number followed by
# what ends it (so it cannot go on), a literal, or punctuation. Anything else (escapes, a
# token cut at the end of a chunk, an invalid character) takes the character path.
_TOKEN = re.compile(
    r'[ \t\n\r]*(?:(?P<s>"[^"\\\x00-\x1f]*")'
    r"|(?P<n>-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)(?=[ \t\n\r,\]}])"
    r"|(?P<l>true|false|null)"
    r"|(?P<p>[{}\[\],:]))"
)
_LITERALS = {"t": "true", "f": "false", "n": "null"}


class _S:
    """Where the automaton is. Structural states say what may come next. Plain ints, not
    an IntEnum: an enum member lookup costs ten times a class attribute, per character."""

    VALUE = 0  # a value (top level start, after ':' or after ',' in an array)
    VALUE_OR_CLOSE = 1  # after '['
    KEY_OR_CLOSE = 2  # after '{'
    KEY = 3  # after ',' in an object
    COLON = 4  # after a key
    AFTER_VALUE = 5  # after a value inside a container: ',' or the closing bracket
    END = 6  # the top-level value is done: only whitespace may follow
    STRING = 7
    ESCAPE = 8  # after a backslash in a string
    UHEX = 9  # inside \uXXXX
    LITERAL = 10  # inside true / false / null
    # numbers: -? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?
    N_MINUS = 11  # after '-': a digit must follow
    N_ZERO = 12  # a leading 0: '.', 'e' or the end
    N_INT = 13  # integer digits
    N_DOT = 14  # after '.': a digit must follow
    N_FRAC = 15  # fraction digits
    N_E = 16  # after 'e': sign or digit
    N_ESIGN = 17  # after the exponent's sign: a digit must follow
    N_EXP = 18  # exponent digits


_NUMBER_END_OK = frozenset({_S.N_ZERO, _S.N_INT, _S.N_FRAC, _S.N_EXP})
_IS_NUMBER = frozenset(range(_S.N_MINUS, _S.N_EXP + 1))


class JsonScanner:
    """Feed bytes with `feed`; read `ok`, `complete`, `error` and `completion()`."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self.state = _S.VALUE
        self.stack: list[str] = []  # '{' or '['
        self.key = False  # the string being scanned is an object key
        self.hex_left = 0
        self.hex_value = 0  # the \u digits so far
        self.want_low = False  # after a high surrogate escape: a low one must follow
        self.literal = ""
        self.literal_pos = 0
        self.error: str | None = None
        self.line = 1
        self.col = 1  # column (in characters) of the next character
        self._first = True  # nothing but whitespace seen yet

    # ---- verdicts --------------------------------------------------------------------

    @property
    def ok(self) -> bool:
        """The data so far can still become a valid document."""
        return self.error is None

    @property
    def complete(self) -> bool:
        """The data so far is a valid document (a cut UTF-8 sequence at the end is not)."""
        if self.error is not None or self._decoder.getstate()[0]:
            return False
        return self.state == _S.END or (not self.stack and self.state in _NUMBER_END_OK)

    @property
    def started(self) -> bool:
        """Something other than whitespace has been seen."""
        return not self._first

    def describe(self) -> str:
        """Where an unfinished document stands, for an error message."""
        if self.error is not None:
            return self.error
        if self._first:
            return "empty document"
        where = {
            _S.ESCAPE: "inside a string escape",
            _S.UHEX: "inside a \\u escape",
            _S.STRING: "inside a string" if not self.want_low else "after a high surrogate",
            _S.LITERAL: f"inside the literal {self.literal!r}",
            _S.COLON: "expecting ':' after a key",
            _S.KEY: "expecting a key",
            _S.KEY_OR_CLOSE: "expecting a key or '}'",
            _S.VALUE: "expecting a value",
            _S.VALUE_OR_CLOSE: "expecting a value or ']'",
            _S.AFTER_VALUE: "expecting ',' or a closing bracket",
            _S.END: "after a complete document",
        }.get(self.state, "inside a number" if self.state in _IS_NUMBER else "")
        if self._decoder.getstate()[0]:
            where = "inside a UTF-8 sequence"
        opened = len(self.stack)
        brackets = f"; {opened} bracket{'s' if opened != 1 else ''} open" if opened else ""
        return f"document ends {where}{brackets} (line {self.line}, column {self.col})"

    # ---- feeding ---------------------------------------------------------------------

    def feed(self, data: bytes) -> bool:
        """Scan more bytes; return `ok`. Once not ok, further data is ignored."""
        if self.error is not None:
            return False
        try:
            text = self._decoder.decode(data)
        except UnicodeDecodeError as err:
            # Scan the valid part first: a syntax error before the bad byte is the first
            # error in the document and the better report.
            pending = self._decoder.getstate()[0]
            self._decoder.reset()
            good = (pending + data)[: err.start]  # start counts from the pending bytes
            self._scan(good.decode("utf-8", "strict"))
            if self.error is None:
                self.error = self._at(f"invalid UTF-8 ({err.reason})")
            return False
        self._scan(text)
        if self.error is None and self._decoder.getstate()[0]:
            # A cut UTF-8 sequence: only a string may go on with a non-ASCII character.
            if self.state != _S.STRING or self.want_low:
                self._fail("a non-ASCII character outside a string")
        return self.error is None

    def _at(self, what: str) -> str:
        return f"line {self.line} column {self.col}: {what}"

    def _fail(self, what: str) -> None:
        self.error = self._at(what)

    def _advance(self, text: str, start: int, end: int) -> None:
        """Move the line/column position over text[start:end]."""
        nl = text.count("\n", start, end)
        if nl:
            self.line += nl
            self.col = end - text.rindex("\n", start, end)
        else:
            self.col += end - start

    def _scan(self, s: str) -> None:
        i, n = 0, len(s)
        while i < n:
            st = self.state
            if st == _S.STRING:
                if self.want_low and s[i] != "\\":
                    return self._fail(_LONE_HIGH)
                j = _STR_RUN.match(s, i).end()  # type: ignore[union-attr]
                self.col += j - i
                i = j
                if i == n:
                    return
                c = s[i]
                if c == '"':
                    self.col += 1
                    i += 1
                    if self.key:
                        self.key = False
                        self.state = _S.COLON
                    else:
                        self._value_done()
                elif c == "\\":
                    self.col += 1
                    i += 1
                    self.state = _S.ESCAPE
                else:
                    return self._fail(f"control character U+{ord(c):04X} in a string")
                continue
            c = s[i]
            if st == _S.ESCAPE:
                if c == "u":
                    self.state, self.hex_left, self.hex_value = _S.UHEX, 4, 0
                elif self.want_low:
                    return self._fail(_LONE_HIGH)
                elif c in _ESCAPES:
                    self.state = _S.STRING
                else:
                    return self._fail(f"invalid escape \\{c}")
                self.col += 1
                i += 1
            elif st == _S.UHEX:
                if c not in _HEX:
                    return self._fail(f"invalid \\u escape: {c!r} is not a hex digit")
                self.hex_left -= 1
                self.hex_value = self.hex_value * 16 + int(c, 16)
                if not self._surrogate_ok():
                    return
                if self.hex_left == 0:
                    self.state = _S.STRING
                    # A high surrogate must be followed by a low one, at once.
                    self.want_low = not self.want_low and 0xD800 <= self.hex_value < 0xDC00
                self.col += 1
                i += 1
            elif st == _S.LITERAL:
                if c != self.literal[self.literal_pos]:
                    return self._fail(f"invalid literal (expected {self.literal!r})")
                self.literal_pos += 1
                self.col += 1
                i += 1
                if self.literal_pos == len(self.literal):
                    self._value_done()
            elif st in _IS_NUMBER:
                i = self._number(s, i)
                if self.error is not None:
                    return
            else:
                m = _TOKEN.match(s, i)
                if m is not None:
                    j = self._token(s, i, m)
                    if self.error is not None:
                        return
                    if j > i:
                        i = j
                        continue
                j = _WS_RUN.match(s, i).end()  # type: ignore[union-attr]
                if j > i:
                    self._advance(s, i, j)
                    i = j
                    continue
                self._first = False
                self._structural(c)
                if self.error is not None:
                    return
                self.col += 1
                i += 1

    def _token(self, s: str, i: int, m: re.Match[str]) -> int:
        """The fast path of structural states: one whole token (with the whitespace before
        it) matched by `_TOKEN` and applied at once. Returns where scanning goes on; ``i``
        (nothing consumed) when the token is not one the state takes whole, so that the
        character path reports the error or takes the token apart."""
        kind = m.lastgroup
        start = m.start(kind)  # type: ignore[arg-type]
        st = self.state
        if kind == "p":
            if start > i:
                self._advance(s, i, start)
            self._first = False
            self._structural(s[start])
            self.col += 1
            return start + 1
        if st == _S.VALUE or st == _S.VALUE_OR_CLOSE:
            self.state = _S.AFTER_VALUE if self.stack else _S.END
        elif kind == "s" and (st == _S.KEY or st == _S.KEY_OR_CLOSE):
            self.state = _S.COLON
        else:
            return i
        if start > i:
            self._advance(s, i, start)
        self._first = False
        self.col += m.end() - start  # a whole token holds no newline
        return m.end()

    def _surrogate_ok(self) -> bool:
        """Lone surrogates are refused as soon as the digits so far decide it (the
        profile decoder refuses them too). After 2 digits the top byte is known: DC-DF
        is a low surrogate, which only a pending high one may be followed by."""
        digits = 4 - self.hex_left
        if self.want_low:
            lo, hi = 0xDC00 >> (4 * self.hex_left), 0xDFFF >> (4 * self.hex_left)
            if not lo <= self.hex_value <= hi:
                self._fail(_LONE_HIGH)
                return False
        elif digits >= 2 and 0xDC <= self.hex_value >> (4 * (digits - 2)) <= 0xDF:
            self._fail("a low surrogate \\uDC00-\\uDFFF without a high one before it")
            return False
        return True

    def _structural(self, c: str) -> None:
        st = self.state
        if st == _S.END:
            return self._fail(f"unexpected {c!r} after the end of the document")
        if st == _S.COLON:
            if c != ":":
                return self._fail(f"expected ':' after a key, found {c!r}")
            self.state = _S.VALUE
            return
        if st == _S.AFTER_VALUE:
            top = self.stack[-1]
            if c == ",":
                self.state = _S.KEY if top == "{" else _S.VALUE
            elif c == ("}" if top == "{" else "]"):
                self.stack.pop()
                self._value_done()
            else:
                close = "}" if top == "{" else "]"
                return self._fail(f"expected ',' or {close!r}, found {c!r}")
            return
        if st in (_S.KEY, _S.KEY_OR_CLOSE):
            if c == '"':
                self.state, self.key = _S.STRING, True
            elif c == "}" and st == _S.KEY_OR_CLOSE:
                self.stack.pop()
                self._value_done()
            else:
                what = "a key" if st == _S.KEY else "a key or '}'"
                return self._fail(f"expected {what} (a string in double quotes), found {c!r}")
            return
        # VALUE or VALUE_OR_CLOSE
        if c == "]" and st == _S.VALUE_OR_CLOSE:
            self.stack.pop()
            self._value_done()
        elif c == '"':
            self.state = _S.STRING
        elif c in "{[":
            if len(self.stack) >= MAX_DEPTH:
                return self._fail(f"nested deeper than {MAX_DEPTH}")
            self.stack.append(c)
            self.state = _S.KEY_OR_CLOSE if c == "{" else _S.VALUE_OR_CLOSE
        elif c == "-":
            self.state = _S.N_MINUS
        elif c == "0":
            self.state = _S.N_ZERO
        elif "1" <= c <= "9":
            self.state = _S.N_INT
        elif c in _LITERALS:
            self.state, self.literal, self.literal_pos = _S.LITERAL, _LITERALS[c], 1
        else:
            return self._fail(f"expected a value, found {c!r}")

    def _number(self, s: str, i: int) -> int:
        """Scan number characters from s[i]; return where the scan stopped."""
        st = self.state
        c = s[i]
        digit = "0" <= c <= "9"
        if st in (_S.N_INT, _S.N_FRAC, _S.N_EXP) and digit:
            j = _DIGITS.match(s, i).end()  # type: ignore[union-attr]
            self.col += j - i
            return j
        nxt: int | None = None
        if st == _S.N_MINUS:
            nxt = _S.N_ZERO if c == "0" else _S.N_INT if digit else None
            if nxt is None:
                self._fail("expected a digit after '-'")
                return i
        elif st in (_S.N_DOT, _S.N_E, _S.N_ESIGN):
            if digit:
                nxt = _S.N_FRAC if st == _S.N_DOT else _S.N_EXP
            elif st == _S.N_E and c in "+-":
                nxt = _S.N_ESIGN
            else:
                self._fail(f"expected a digit in a number, found {c!r}")
                return i
        elif c == "." and st in (_S.N_ZERO, _S.N_INT):
            nxt = _S.N_DOT
        elif c in "eE" and st in (_S.N_ZERO, _S.N_INT, _S.N_FRAC):
            nxt = _S.N_E
        elif st == _S.N_ZERO and digit:
            self._fail("a number must not have a leading zero")
            return i
        if nxt is not None:
            self.state = nxt
            self.col += 1
            return i + 1
        # The number ended before c (in a terminal state: the others returned above);
        # c is scanned again as what follows a value.
        self._value_done()
        return i

    def _value_done(self) -> None:
        self.state = _S.AFTER_VALUE if self.stack else _S.END

    # ---- completing ------------------------------------------------------------------

    def completion(self) -> bytes:
        """Bytes that, appended to the data fed so far, make a valid document.

        Raises ValueError when the data is not a prefix of any (``ok`` is false).
        """
        if self.error is not None:
            raise ValueError(self.error)
        out = bytearray(_finish_utf8(self._decoder.getstate()[0]))
        st = self.state
        tail = ""
        if st == _S.UHEX:
            digits = 4 - self.hex_left
            if self.want_low:
                tail = "dc00"[digits:]
            else:
                tail = "0" * self.hex_left
                if 0xD800 <= self.hex_value << (4 * self.hex_left) < 0xDC00:
                    tail += "\\udc00"
            tail += '"'
        elif st == _S.ESCAPE:
            tail = 'udc00"' if self.want_low else 'n"'
        elif st == _S.STRING:
            tail = '\\udc00"' if self.want_low else '"'
        elif st == _S.LITERAL:
            tail = self.literal[self.literal_pos :]
        elif st in (_S.N_MINUS, _S.N_DOT, _S.N_E, _S.N_ESIGN):
            tail = "0"
        if st in (_S.STRING, _S.ESCAPE, _S.UHEX) and self.key:
            tail += ":null"
        elif st == _S.VALUE:
            tail = "null"
        elif st == _S.KEY:
            tail = '"":null'
        elif st == _S.COLON:
            tail = ":null"
        tail += "".join("}" if b == "{" else "]" for b in reversed(self.stack))
        out += tail.encode()
        return bytes(out)


def _finish_utf8(pending: bytes) -> bytes:
    """Continuation bytes completing a UTF-8 sequence cut after ``pending``.

    The decoder only keeps a pending sequence that some continuation makes valid; one of
    these candidates always does (E0 needs A0-BF, ED 80-9F, F0 90-BF, F4 80-8F).
    """
    if not pending:
        return b""
    need = (2 if pending[0] >= 0xE0 else 1) + (1 if pending[0] >= 0xF0 else 0) + 1
    need -= len(pending)
    candidates = (0x80, 0x9F, 0xA0, 0xBF)

    def tries(k: int) -> list[bytes]:
        if k == 0:
            return [b""]
        return [bytes([c]) + rest for c in candidates for rest in tries(k - 1)]

    for extra in tries(need):
        try:
            (pending + extra).decode("utf-8")
        except UnicodeDecodeError:
            continue
        return extra
    raise AssertionError(f"no completion for the UTF-8 prefix {pending!r}")


def scan(data: bytes) -> JsonScanner:
    """A scanner that has been fed ``data``."""
    scanner = JsonScanner()
    scanner.feed(data)
    return scanner
