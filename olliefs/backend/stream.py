"""HTTP streaming shared by the provider modules: framing, errors, the request cycle.

Providers differ in wire format but fail in the same ways. Keeping the byte → line → SSE
(or NDJSON) framing, the status → error mapping and the request/response cycle here means
every backend splits payloads, retries and reports errors on the same grounds, and a
provider module is left with what is really its own: building a request body and reading
the provider's events (a ``Parser``).

Parsers are synchronous and incremental (``feed(chunk) -> events``): the whole stream can
be parsed without an event loop (the benchmarks and the SDK comparisons do that), the
async side only moves bytes, and parsing stays far from being the bottleneck. Framing
works on bytes, never on decoded text: a line break is a byte that cannot occur inside a
UTF-8 sequence, and msgspec decodes the JSON payloads straight from bytes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Iterator,
    Mapping,
    Sequence,
)
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, Protocol, TypeVar

import httpx
import msgspec

from olliefs.backend.base import (
    BackendError,
    BadResponseError,
    ContextOverflowError,
    RateLimitError,
    StreamDropError,
    StreamEvent,
    ToolUnsupportedError,
    TransientError,
)
from olliefs.backend.transport import LeanTransport, direct_body, transport_for
from olliefs.errors import size_text

MAX_MESSAGE_CHARS = 300

MAX_EVENT = 16 * 1024 * 1024
"""The most bytes of one line, SSE event or event stream frame a stream may send before
its end: past it the turn ends with an error instead of buffering on. A reply streams as
many small events, each a few hundred bytes; a server that sends one line and never ends
it (a broken proxy, a hostile endpoint) took the daemon to 1.6 GB with 300 MB of it."""

MAX_ERROR_BODY = 1024 * 1024
"""The most bytes of a reply that is not a stream (an error) read: it becomes a message
of one line (``MAX_MESSAGE_CHARS``), and each step to it (decode, search, join) copies
what was read."""

_OVERFLOW_MARKERS = (
    "context_length_exceeded",
    "maximum context length",
    "context length",
    "too many tokens",
    "prompt is too long",  # Anthropic
    "reduce the length",
    "exceeds the available context size",  # llama.cpp
    "exceeds the maximum number of tokens",  # Gemini
    "exceeds the limit of",  # Copilot: "prompt token count of N exceeds the limit of M"
    "input is too long",  # CodeWhisperer / Kiro
    "content_length_exceeds_threshold",  # CodeWhisperer ValidationException reason
)
_NO_TOOLS_MARKERS = (
    "does not support tools",  # Ollama
    "tool use is not supported",
    "tools are not supported",
    "does not support function calling",
    "function calling is not enabled",  # Gemini
    "tool choice requires",  # vLLM started without a tool-call parser
)

# httpx logs every request at INFO ("HTTP Request: POST ... 200 OK"): a formatted line
# and a write to the daemon's log for each model request, about 6% of what sending one
# costs, and nothing the daemon does not say better itself when a request fails.
logging.getLogger("httpx").setLevel(logging.WARNING)

Secrets = str | Sequence[str] | None
_T = TypeVar("_T")


# ---- framing -------------------------------------------------------------------------------


def too_long(provider: str, limit: int) -> BadResponseError:
    """The error for a line, event or frame that went past ``limit`` bytes unended."""
    prefix = f"{provider}: " if provider else ""
    return BadResponseError(
        f"{prefix}a stream line or event longer than {size_text(limit)} (not read further)"
    )


class SSEMessage(msgspec.Struct, frozen=True, gc=False):
    """One dispatched server-sent event; ``id`` is the last id seen, as the SSE spec keeps it.

    (A Struct, not a NamedTuple: its constructor is C code, and one is made per event.)
    """

    data: bytes
    event: str = ""
    id: str = ""


class LineSplitter:
    """Split a byte stream into lines ended by LF, CRLF or CR (the SSE spec allows all three).

    A CR at the end of a chunk is held back until the next chunk says whether an LF
    follows, so a CRLF cut in two is one line end, not two. Bytes are split before any
    decoding: ``str.splitlines`` would also break on U+2028 and friends, which JSON may
    carry unescaped. A leading UTF-8 BOM is dropped. A line longer than ``limit`` bytes
    (`MAX_EVENT`) fails the stream (`too_long`) as soon as that much of it is held.
    """

    __slots__ = ("_after_cr", "_held", "_limit", "_parts", "_provider", "_started")

    def __init__(self, provider: str = "", limit: int = MAX_EVENT) -> None:
        self._parts: list[bytes] = []  # the current line, not terminated yet
        self._held = 0  # bytes in _parts
        self._limit = limit
        self._provider = provider
        self._started = False
        self._after_cr = False  # the last chunk ended in CR: a leading LF completes a CRLF

    def feed(self, chunk: bytes) -> list[bytes]:
        if self._held > self._limit:
            raise too_long(self._provider, self._limit)
        if not self._started:
            head = b"".join([*self._parts, chunk])
            if len(head) < 3 and b"\xef\xbb\xbf".startswith(head):
                self._parts = [head] if head else []
                return []  # could still be the start of a BOM
            self._started, self._parts = True, []
            chunk = head.removeprefix(b"\xef\xbb\xbf")
        if self._after_cr and chunk:
            self._after_cr = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
        if b"\n" not in chunk and b"\r" not in chunk:
            if chunk:
                self._parts.append(chunk)
                self._held += len(chunk)
                if self._held > self._limit:
                    raise too_long(self._provider, self._limit)
            return []
        buf = b"".join(self._parts) + chunk if self._parts else chunk
        if b"\r" in buf:
            self._after_cr = buf.endswith(b"\r")
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = buf.split(b"\n")
        rest = lines.pop()
        self._parts = [rest] if rest else []
        self._held = len(rest)  # past the limit: fails at the next feed or close
        return lines

    def close(self) -> list[bytes]:
        """The last line, if the stream ended without a line break after it."""
        if self._held > self._limit:
            raise too_long(self._provider, self._limit)
        rest = b"".join(self._parts)
        self._parts = []
        self._held = 0
        if not self._started:
            rest = rest.removeprefix(b"\xef\xbb\xbf")
        return [rest] if rest else []


_NO_EVENTS = (b"[]", b"", 0)
# Events longer than this (up to their first line end) are found one by one; shorter
# ones, many to a read, all at once (``SSEDecoder.feed_array``).
_SHORT_EVENT = 512


def data_payloads(head: bytes) -> list[bytes]:
    """The payloads of ``head`` from ``SSEDecoder.feed_array``, one by one."""
    return [event[6:] for event in head[:-2].split(b"\n\n")] if head else []


class SSEDecoder:
    """Server-sent events from bytes, incrementally (the WHATWG parsing rules).

    Comments (``:keep-alive``) and unknown fields are skipped; ``event`` lasts for one
    message, ``id`` until changed. A message still open when the stream ends is
    dispatched too (the spec drops it), so a server that omits the last blank line does
    not lose its terminator.

    The bytes are cut at blank lines first, so a whole event is one slice, and the two
    shapes providers actually send (``data: ...`` alone, or ``event: ...`` then ``data:
    ...``) are read without looking at lines one by one; anything else takes the general
    path. Line ends are normalized to LF first (CRLF and lone CR are line ends too); a CR
    at the end of a read is held back until the next read says whether an LF follows.
    What follows the last blank line waits, unread, for more bytes; once more than
    ``limit`` bytes (`MAX_EVENT`) of one event wait so, the stream fails (`too_long`).
    """

    __slots__ = ("_held", "_id", "_limit", "_names", "_parts", "_provider", "_started")

    def __init__(self, provider: str = "", limit: int = MAX_EVENT) -> None:
        self._parts: list[bytes] = []  # bytes after the last blank line, not read yet
        self._held = 0  # bytes in _parts
        self._limit = limit
        self._provider = provider
        self._id = ""
        self._started = False
        self._names: dict[bytes, str] = {}  # event names seen, decoded once

    def _no_end(self, chunk: bytes) -> bool:
        """No event can end in ``chunk``, read after what is held: no blank line in it,
        nor one that a line end held from the last read starts."""
        parts = self._parts
        return not (
            b"\n\n" in chunk
            or b"\r" in chunk
            or (parts and (parts[-1][-1:] == b"\r" or (parts[-1][-1:] == b"\n" == chunk[:1])))
        )

    def _keep(self, rest: bytes) -> None:
        """Hold ``rest`` (the bytes after the last event that ended) and nothing else.
        Past the limit, the stream fails at the next feed or close: the events this read
        ended go out first (``rest`` is at most the limit and one read)."""
        self._parts = [rest] if rest else []
        self._held = len(rest)

    def feed(self, chunk: bytes) -> list[SSEMessage]:
        if self._held > self._limit:
            raise too_long(self._provider, self._limit)
        if not self._started:
            head = b"".join([*self._parts, chunk])
            if len(head) < 3 and b"\xef\xbb\xbf".startswith(head):
                self._parts = [head] if head else []
                return []  # could still be the start of a BOM
            self._started, self._parts = True, []
            chunk = head.removeprefix(b"\xef\xbb\xbf")
        if not chunk:
            return []
        parts = self._parts
        if (b"\n" not in chunk and b"\r" not in chunk) or self._no_end(chunk):
            parts.append(chunk)  # no event ends in here: kept for later (inline: most
            self._held += len(chunk)  # reads of a slow stream end no event)
            if self._held > self._limit:
                raise too_long(self._provider, self._limit)
            return []
        buf = b"".join([*parts, chunk]) if parts else chunk
        held = False
        if b"\r" in buf:
            held = buf.endswith(b"\r")  # maybe half of a CRLF: decided by the next read
            if held:
                buf = buf[:-1]
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        elif buf[:6] == b"data: ":
            fast = self._data_lines(buf)
            if fast is not None:
                event_id = self._id
                return [SSEMessage(data, "", event_id) for data in fast]
        blocks = buf.split(b"\n\n")
        rest = blocks.pop()
        if held:
            rest += b"\r"
        self._keep(rest)
        out: list[SSEMessage] = []
        append, last_id, names = out.append, self._id, self._names
        for block in blocks:
            # the two common shapes, inline: one data line, or an event line and a data line
            if block[:6] == b"data: ":
                if b"\n" not in block:
                    append(SSEMessage(block[6:], "", last_id))
                    continue
            elif block[:7] == b"event: ":
                nl = block.find(b"\n")
                if block[nl + 1 : nl + 7] == b"data: " and block.find(b"\n", nl + 1) < 0:
                    name = block[7:nl]
                    event = names.get(name)
                    if event is None:
                        event = name.decode("utf-8", "replace")
                        if len(names) < 64:
                            names[name] = event
                    append(SSEMessage(block[nl + 7 :], event, last_id))
                    continue
            self._block(block, out)
            last_id = self._id
        return out

    def feed_array(self, chunk: bytes) -> tuple[bytes, bytes, int] | None:
        """The payloads of the events ``chunk`` completes, when every one of them is a
        single ``data:`` line (the shape of nearly every provider's stream), as one JSON
        array a parser can decode in one call: ``(b"[P1,P2,...]", the events' bytes,
        how many)``, ``(b"[]", b"", 0)`` when no event ends in here; None, with nothing
        consumed, when the read holds anything else: then ``feed(chunk)`` reads it.
        Each payload's event has no ``event:`` name and the id ``last_id``. (The count
        tells a payload of two JSON values with a comma between them from two.)

        Long events are found one by one (``_data_lines``: a memchr per event). Short
        ones (a 50-byte delta is a ~150-byte event, a thousand to a read) are cut and
        joined without a Python step per event: the events end at the last blank line;
        cut at each blank line followed by ``data: `` and joined with commas, they are
        the array, unless a line end is left in it (a line that is not ``data:``, an
        event of two lines, a third line end in a row): then the read is the general
        path's.
        """
        if not self._started:
            return None
        if self._held > self._limit:
            raise too_long(self._provider, self._limit)
        parts = self._parts
        if (b"\n" not in chunk and b"\r" not in chunk) or self._no_end(chunk):
            if chunk:  # kept, not joined: a long event (or line) comes in many reads
                parts.append(chunk)
                self._held += len(chunk)
                if self._held > self._limit:
                    raise too_long(self._provider, self._limit)
            return _NO_EVENTS
        buf = b"".join([*parts, chunk]) if parts else chunk
        if b"\r" in buf or buf[:6] != b"data: ":
            return None
        if buf.find(b"\n") > _SHORT_EVENT:
            payloads = self._data_lines(buf)
            if payloads is None:
                return None
            if not payloads:
                return _NO_EVENTS
            head = buf[: len(buf) - self._held]
            return b"[%b]" % b",".join(payloads), head, len(payloads)
        end = buf.rfind(b"\n\n") + 2
        if end == 1:  # no blank line yet
            self._keep(buf)
            return _NO_EVENTS
        head = buf[:end] if end < len(buf) else buf
        payloads = head[6:-2].split(b"\n\ndata: ")
        array = b"[%b]" % b",".join(payloads)
        if b"\n" in array:
            return None  # a line that is not data:, a longer event, or a third line end
        self._keep(buf[end:])
        return array, head, len(payloads)

    @property
    def last_id(self) -> str:
        return self._id

    def _data_lines(self, buf: bytes) -> list[bytes] | None:
        """The payloads of ``buf``'s events, read at memchr speed, when each is one
        ``data: X`` line and its blank line; None: the read holds something else, for
        the general path. (A JSON payload holds no raw line end, so each ``\n`` found
        is a line end; a line end not followed by another one, or a line that is not
        ``data:``, is the general path's business.) What follows the last event waits
        for the next read."""
        out: list[bytes] = []
        find, pos, end = buf.find, 0, len(buf)
        while (nl := find(b"\n", pos)) >= 0:
            if nl + 1 == end:
                break  # the blank line may be in the next read
            if buf[nl + 1] != 0x0A or buf[pos : pos + 6] != b"data: ":
                return None
            out.append(buf[pos + 6 : nl])
            pos = nl + 2
        self._keep(buf[pos:])
        return out

    def close(self) -> list[SSEMessage]:
        if self._held > self._limit:
            raise too_long(self._provider, self._limit)
        rest = b"".join(self._parts)
        self._parts = []
        self._held = 0
        if not self._started:
            rest = rest.removeprefix(b"\xef\xbb\xbf")
        out: list[SSEMessage] = []
        for block in rest.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n\n"):
            self._block(block, out)
        return out

    def _block(self, block: bytes, out: list[SSEMessage]) -> None:
        """Read one event (the text between two blank lines), field by field."""
        data: list[bytes] = []
        event = ""
        for line in block.split(b"\n"):
            if not line:  # a blank line at the start (three line ends in a row)
                if data:
                    out.append(SSEMessage(b"\n".join(data), event, self._id))
                data, event = [], ""
            elif line.startswith(b"data:"):
                value = line[5:]
                data.append(value[1:] if value.startswith(b" ") else value)
            elif not line.startswith(b":"):
                name, _, value = line.partition(b":")
                if value.startswith(b" "):
                    value = value[1:]
                if name == b"data":  # "data" alone: a field with an empty value
                    data.append(value)
                elif name == b"event":
                    event = value.decode("utf-8", "replace")
                elif name == b"id" and b"\0" not in value:
                    self._id = value.decode("utf-8", "replace")
        if data:
            out.append(SSEMessage(b"\n".join(data), event, self._id))


class NDJSONSplitter:
    """Newline-delimited JSON: one document a line; blank lines are skipped, CRLF allowed."""

    __slots__ = ("_lines",)

    def __init__(self, provider: str = "", limit: int = MAX_EVENT) -> None:
        self._lines = LineSplitter(provider, limit)

    def feed(self, chunk: bytes) -> list[bytes]:
        return [line for line in self._lines.feed(chunk) if line.strip()]

    def close(self) -> list[bytes]:
        return [line for line in self._lines.close() if line.strip()]


class Parser(Protocol):
    """A provider's incremental stream reader.

    ``feed`` takes body bytes as they come and appends the events they complete to
    ``out``. Once the provider's terminator has been read ``done`` is true and the caller
    stops feeding. ``close`` is called at the end of the body when ``done`` never became
    true: it appends what is still pending and raises ``StreamDropError`` if the stream
    was cut short. Malformed payloads raise ``BadResponseError``; errors the provider
    reports inside the stream raise the typed error they stand for.

    Events go to a list the caller owns, not a returned one, because one read may hold
    both deltas and the error that follows them: when ``feed`` raises, ``out`` still holds
    every event read before the error, and the text the model wrote before it failed
    reaches ``chat`` (and stays there, before the retry line) as it did when each event
    came in a read of its own.
    """

    done: bool

    def feed(self, chunk: bytes, out: list[StreamEvent]) -> None: ...

    def close(self, out: list[StreamEvent]) -> None: ...


def parse_all(parser: Parser, chunks: Iterator[bytes] | Sequence[bytes]) -> list[StreamEvent]:
    """Run a parser over a whole recorded body (tests, benchmarks, SDK comparisons)."""
    out: list[StreamEvent] = []
    for chunk in chunks:
        parser.feed(chunk, out)
        if parser.done:
            return out
    parser.close(out)
    return out


def decode_json(
    decoder: msgspec.json.Decoder[_T], data: bytes, provider: str, secrets: Secrets
) -> _T:
    """Decode one payload, or fail with a one-line BadResponseError that shows it."""
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise bad_payload(provider, data, exc, secrets) from exc


def bad_payload(provider: str, data: bytes, exc: Exception, secrets: Secrets) -> BadResponseError:
    text = data.decode("utf-8", "replace")
    return BadResponseError(one_line(f"{provider}: bad stream payload ({exc}): {text}", secrets))


# ---- errors --------------------------------------------------------------------------------


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def one_line(text: str, secrets: Secrets = None) -> str:
    """Make provider text fit one ``chat`` line, and never echo a key or token back."""
    for secret in [secrets] if isinstance(secrets, str) else secrets or ():
        if secret:
            text = text.replace(secret, "***")
    text = " ".join(text.split())
    # A garbage body quoted in an error must not put NULs or terminal escapes in chat.
    text = _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", text)
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 1] + "…"


def retry_after(headers: Mapping[str, str], now: datetime | None = None) -> float | None:
    """Seconds the provider asks us to wait: ``retry-after-ms`` first, it is the finer one.

    ``Retry-After`` may hold seconds or an HTTP date (RFC 9110 10.2.3); a date in the
    past means "now".
    """
    fields = httpx.Headers(headers)
    if (ms := _seconds(fields.get("retry-after-ms"))) is not None:
        return ms / 1000
    value = fields.get("retry-after", "")
    if (seconds := _seconds(value)) is not None:
        return seconds
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


def _seconds(value: str | None) -> float | None:
    try:
        number = float(value or "nan")
    except ValueError:
        return None
    return number if math.isfinite(number) and number >= 0 else None


def provider_message(body: str) -> str:
    """The human part of an error body, whichever provider's shape it has.

    OpenAI, Anthropic and Gemini nest it as ``error.message``; Ollama sends ``error`` as a
    string; AWS services (CodeWhisperer) a top-level ``message`` or ``Message``. OpenRouter
    wraps upstream failures as "Provider returned error" with the upstream text in
    ``error.metadata.raw``, which is the part worth showing.
    """
    try:
        doc: Any = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body
    error = doc.get("error", doc) if isinstance(doc, dict) else doc
    if isinstance(error, str):
        return error
    if not isinstance(error, dict):
        return body
    keys = ("message", "Message", "detail")
    message = next((v for k in keys if isinstance(v := error.get(k), str)), body)
    metadata = error.get("metadata")
    if isinstance(metadata, dict) and isinstance(raw := metadata.get("raw"), str):
        return f"{message}: {raw}"
    return message


def http_error(
    status: int,
    body: bytes | str,
    headers: Mapping[str, str] | None = None,
    *,
    secret: Secrets = None,
    label: str = "",
    provider: str = "",
    retry_hint: float | None = None,
) -> BackendError:
    """Map an error status and its body to the typed error the agent's retry logic expects.

    The message reads ``<provider>: HTTP <status>: <provider's words>``; ``label``
    replaces the ``HTTP <status>`` part for errors reported inside a stream.
    ``retry_hint`` is a wait the body asked for (Gemini's RetryInfo), used for a 429
    without a Retry-After header.
    """
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    detail = provider_message(text).strip() or httpx.codes.get_reason_phrase(status)
    prefix = f"{provider}: " if provider else ""
    message = one_line(f"{prefix}{label or f'HTTP {status}'}: {detail}", secret)
    lowered = text.lower()
    if status == 429:
        wait = retry_after(headers or {})
        return RateLimitError(message, retry_hint if wait is None else wait)
    if status == 408 or 500 <= status <= 599:
        return TransientError(message)  # includes Anthropic's 529 "overloaded"
    if status in (400, 413) and any(marker in lowered for marker in _OVERFLOW_MARKERS):
        return ContextOverflowError(message)
    if status in (400, 422) and any(marker in lowered for marker in _NO_TOOLS_MARKERS):
        return ToolUnsupportedError(message)
    return BadResponseError(message)


def transport_error(
    exc: httpx.HTTPError, provider: str = "", secrets: Secrets = None
) -> BackendError:
    """Network trouble is worth a retry; a malformed request or URL is not."""
    prefix = f"{provider}: " if provider else ""
    detail = one_line(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, secrets)
    transient = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
    if isinstance(exc, (*transient, httpx.ProxyError)):
        return TransientError(f"{prefix}network error: {detail}")
    return BadResponseError(f"{prefix}request failed: {detail}")


@contextlib.contextmanager
def httpx_errors(provider: str = "", secrets: Secrets = None) -> Iterator[None]:
    """Let no raw httpx exception escape a backend: the agent retries by error type."""
    try:
        yield
    except httpx.HTTPError as exc:
        raise transport_error(exc, provider, secrets) from exc


# ---- coalescing ----------------------------------------------------------------------------


def coalesce(events: list[StreamEvent]) -> list[StreamEvent]:
    """Merge runs of ``content`` (and of ``reasoning``) deltas into one event each.

    Called on what the parser read from one network read: those deltas arrived together,
    so nobody can tell them apart by time, and the agent, the session journal and every
    reader of ``stream`` then handle one delta per read instead of one per token. At 50
    bytes a delta a 10 MB reply is 200,000 deltas but only a few hundred reads; a token
    that arrives alone (a model generating slower than the network) still travels alone,
    at once. Only deltas that differ in nothing but their text are merged, and the order
    of everything else is kept.
    """
    if len(events) < 2:
        return events
    out: list[StreamEvent] = []
    run: list[str] = []
    first: StreamEvent | None = None
    for ev in events:
        if (
            first is not None
            and ev.kind == first.kind
            and ev.response_id == first.response_id
            and not ev.provider_data
        ):
            run.append(ev.text)
            continue
        if first is not None:
            out.append(_joined(first, run))
            first, run = None, []
        if ev.kind in ("content", "reasoning") and not ev.provider_data:
            first, run = ev, [ev.text]
        else:
            out.append(ev)
    if first is not None:
        out.append(_joined(first, run))
    return out


def _joined(first: StreamEvent, texts: list[str]) -> StreamEvent:
    if len(texts) == 1:
        return first
    return StreamEvent(first.kind, text="".join(texts), response_id=first.response_id)


# ---- the request cycle ---------------------------------------------------------------------


@contextlib.asynccontextmanager
async def open_body(response: httpx.Response) -> AsyncIterator[AsyncIterator[bytes]]:
    """Yield the body chunks of a streamed response and close it properly on exit.

    httpx reads bodies through a chain of nested async generators; closing the response
    alone leaves them suspended, and trio reports each one as a ResourceWarning when it is
    garbage collected (encode/httpx#3686). After the close, pulling once more makes the read
    fail at the bottom of the chain, which ends every generator in it.
    """
    direct = direct_body(response)
    chunks = direct if direct is not None else response.aiter_bytes()
    try:
        yield chunks
    finally:
        await response.aclose()
        if direct is not None:
            await direct.aclose()
        else:
            with contextlib.suppress(httpx.HTTPError, httpx.StreamError):
                async for _ in chunks:
                    pass


async def read_capped(chunks: AsyncIterator[bytes], limit: int) -> bytes:
    """A body that is not a stream (an error), read whole up to ``limit`` bytes: what
    follows is not read (the connection is then dropped, not pooled). It only ever
    becomes a one-line message."""
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        parts.append(chunk)
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(parts)[:limit]


def content_type(response: httpx.Response) -> str:
    value: str = response.headers.get("content-type", "")
    return value.split(";")[0].strip().lower()


# Connections to a provider: as many at once as sessions stream (httpx allows 100 by
# default, so the 101st of 200 streaming sessions waited for a free one), and kept for the
# next request. httpx drops an idle one after 5 s by default, shorter than the pause
# between two prompts of a person, so nearly every turn paid a new TCP (and TLS)
# handshake; a minute covers a conversation's rhythm and stays under the idle timeout of
# the usual servers and proxies (60-120 s), and a connection the server closed anyway is
# seen as closed when it is taken from the pool. Up to 256 idle ones are kept.
KEEPALIVE_SECONDS = 55.0
_LIMITS = httpx.Limits(
    max_connections=None, max_keepalive_connections=256, keepalive_expiry=KEEPALIVE_SECONDS
)


class HTTPBackend:
    """What every provider shares: one pooled HTTP client, the stream cycle, errors.

    A subclass sets ``default_model`` and ``default_context_length``, builds its requests,
    and gives ``_stream`` a fresh ``Parser`` per request. ``_secrets`` lists every string
    that must never appear in a message (the key, and any token derived from it).
    """

    default_model = ""
    default_context_length = 128000

    def __init__(
        self,
        name: str,
        base_url: str,
        key: str | None,
        *,
        read_timeout: float = 300.0,
        transport: httpx.AsyncBaseTransport | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.base_url = base_url
        self._key = key or None
        self._secrets: list[str] = [key] if key else []
        if transport is None:
            transport = transport_for(base_url)
        self._client = httpx.AsyncClient(
            base_url=base_url,
            headers=dict(headers or {}),
            timeout=httpx.Timeout(read_timeout, connect=10.0),
            limits=_LIMITS,
            transport=transport,
        )
        # Model requests go straight to our transport when it is the one in use (see
        # ``_post``); anything else (httpx's, for a proxy; a test's) through the client.
        self._lean = transport if isinstance(transport, LeanTransport) else None
        self._templates: dict[tuple[Any, ...], tuple[httpx.URL, list[Any], dict[str, Any]]] = {}

    # -- errors

    def _error(
        self, status: int, body: bytes, headers: Mapping[str, str] | None = None
    ) -> BackendError:
        return http_error(status, body, headers, secret=self._secrets, provider=self.name)

    def _errors(self) -> contextlib.AbstractContextManager[None]:
        return httpx_errors(self.name, self._secrets)

    def _stream_error(self, response: httpx.Response, body: bytes) -> BackendError | None:
        """A provider's reading of a 2xx reply that is not a stream (None: not an error)."""
        return None

    def _secret(self, value: str) -> None:
        """Redact ``value`` from every message from now on. Short-lived tokens replace one
        another, so only the latest few are kept beside the long-lived ones."""
        if value and value not in self._secrets:
            self._secrets.append(value)
            if len(self._secrets) > 12:
                del self._secrets[4]

    def _bad(self, what: str) -> BadResponseError:
        return BadResponseError(one_line(f"{self.name}: {what}", self._secrets))

    # -- requests

    def _post(
        self,
        path: str,
        content: bytes,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
    ) -> httpx.Request:
        """What ``client.build_request("POST", ...)`` makes, at a fifth of its cost.

        httpx merges the URL with the base URL, the headers with the client's and the
        timeouts into the extensions at every call: 90 us of each model request's few
        hundred. The merged URL, headers and extensions are kept per path, parameters and
        request headers (a rotating token starts a new entry; a few dozen are kept).
        """
        key = (path, *sorted((params or {}).items()), None, *sorted((headers or {}).items()))
        template = self._templates.get(key)
        if template is None:
            if len(self._templates) >= 32:
                self._templates.clear()
            built = self._client.build_request("POST", path, params=params, headers=headers)
            raw = [(k, v) for k, v in built.headers.raw if k.lower() != b"content-length"]
            template = self._templates[key] = (built.url, raw, dict(built.extensions))
        url, raw, extensions = template
        return httpx.Request("POST", url, headers=raw, content=content, extensions=extensions)

    async def _send(self, request: httpx.Request) -> httpx.Response:
        """Send a model request, its reply streamed.

        Straight to the lean transport when it is ours: the client's send wraps the
        reply's stream, extracts cookies into its jar and walks its auth and redirect
        loops (none of which a model request uses: keys are headers, a POST is not
        redirected), 60 us a request. Cookies a provider sets on a streamed reply are
        therefore not kept; requests made through the client (model lists, tokens) keep
        them as before.
        """
        if self._lean is None:
            return await self._client.send(request, stream=True)
        response = await self._lean.handle_async_request(request)
        response.request = request
        return response

    @contextlib.asynccontextmanager
    async def _stream(
        self, request: httpx.Request, parser: Parser, *, stream_types: tuple[str, ...]
    ) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        """Send ``request``; yield the events ``parser`` reads from the reply.

        A reply whose content type is not one of ``stream_types`` is read whole and turned
        into an error: an HTTP error status, an error object sent with 200 (proxies do
        that), or a server that ignored the streaming flag.
        """
        with self._errors():
            response = await self._send(request)
        async with open_body(response) as chunks:
            if not response.is_success or content_type(response) not in stream_types:
                with self._errors():
                    body = await read_capped(chunks, MAX_ERROR_BODY)
                if not response.is_success:
                    raise self._error(response.status_code, body, response.headers)
                raise self._stream_error(response, body) or self._bad(
                    f"expected a stream ({', '.join(stream_types)}), got "
                    f"{content_type(response) or 'no content type'}: "
                    f"{body.decode('utf-8', 'replace')}"
                )
            async with contextlib.aclosing(self._events(chunks, parser)) as events:
                yield events

    async def _events(
        self, chunks: AsyncIterable[bytes], parser: Parser
    ) -> AsyncGenerator[StreamEvent, None]:
        with self._errors():
            async for chunk in chunks:
                out: list[StreamEvent] = []
                try:
                    parser.feed(chunk, out)
                except BackendError:
                    for event in coalesce(out):  # what came before the error, first
                        yield event
                    raise
                for event in coalesce(out):
                    yield event
                if parser.done:
                    break
            else:
                out = []
                try:
                    parser.close(out)
                except BackendError:
                    for event in coalesce(out):
                        yield event
                    raise
                for event in coalesce(out):
                    yield event
                if not parser.done:
                    raise StreamDropError(f"{self.name}: the stream ended before its end marker")
        # Read on to the end of the body: only then does the connection go back to the
        # pool. The reply is complete, so a failure here no longer matters.
        with contextlib.suppress(httpx.HTTPError):
            async for _ in chunks:
                pass

    async def _get(self, url: str, decoder: msgspec.json.Decoder[_T], what: str, **kw: Any) -> _T:
        """GET (or POST with ``json=``) a JSON document, typed errors on failure."""
        method = "POST" if "json" in kw or "content" in kw else "GET"
        with self._errors():
            response = await self._client.request(method, url, **kw)
        if not response.is_success:
            raise self._error(response.status_code, response.content, response.headers)
        try:
            return decoder.decode(response.content)
        except msgspec.DecodeError as exc:
            raise self._bad(f"bad {what} ({exc})") from exc

    def forget(self) -> None:
        """Drop cached model data; subclasses that cache more extend this."""

    async def aclose(self) -> None:
        await self._client.aclose()
