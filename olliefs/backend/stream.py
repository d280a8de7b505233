"""HTTP streaming helpers shared by the provider modules.

Providers differ in wire format but fail in the same ways. Keeping the byte → line → SSE
parsing and the status → error mapping here means every backend splits payloads, retries
and reports errors on the same grounds.
"""

from __future__ import annotations

import codecs
import contextlib
import math
import re
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Iterator, Mapping
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
import msgspec

from olliefs.backend.base import (
    BackendError,
    BadResponseError,
    ContextOverflowError,
    RateLimitError,
    ToolUnsupportedError,
    TransientError,
)

MAX_MESSAGE_CHARS = 300

_EOL = re.compile(r"\r\n|\r|\n")
_OVERFLOW_MARKERS = (
    "context_length_exceeded",
    "maximum context length",
    "context length",
    "too many tokens",
    "prompt is too long",
    "reduce the length",
    "exceeds the available context size",  # llama.cpp
)
_NO_TOOLS_MARKERS = (
    "does not support tools",
    "tool use is not supported",
    "tools are not supported",
    "does not support function calling",
    "tool choice requires",  # vLLM started without a tool-call parser
)


class SSEMessage(msgspec.Struct, frozen=True):
    """One dispatched server-sent event; ``id`` is the last id seen, as the SSE spec keeps it."""

    data: str
    event: str = ""
    id: str = ""


async def iter_lines(chunks: AsyncIterable[bytes]) -> AsyncGenerator[str, None]:
    """Split a UTF-8 byte stream into lines ended by CRLF, LF or CR.

    httpx's ``aiter_lines`` uses ``str.splitlines``, which also breaks on U+2028, U+0085 and
    other characters a JSON string may carry unescaped, cutting a payload in two. A last
    line without terminator is still yielded.
    """
    decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="replace")
    pending = ""  # the current line, not terminated yet
    after_cr = False  # the last text ended in CR, so a leading LF only completes a CRLF
    async for chunk in chunks:
        text = decoder.decode(chunk)
        if not text:
            continue
        if after_cr and text.startswith("\n"):
            text = text[1:]
        after_cr = text.endswith("\r")
        if "\n" in text or "\r" in text:
            *lines, pending = _EOL.split(pending + text)
            for line in lines:
                yield line
        else:
            pending += text
    if rest := pending + decoder.decode(b"", final=True):
        yield rest


async def iter_sse(chunks: AsyncIterable[bytes]) -> AsyncGenerator[SSEMessage, None]:
    """Parse a ``text/event-stream`` body into messages.

    A message still open when the stream ends is dispatched too (the spec drops it), so a
    server that omits the last blank line does not lose its terminator.
    """
    data: list[str] = []
    event = last_id = ""
    async with contextlib.aclosing(iter_lines(chunks)) as lines:
        async for line in lines:
            if line:
                name, _, value = line.partition(":")  # ":comment" has an empty name
                value = value.removeprefix(" ")
                if name == "data":
                    data.append(value)
                elif name == "event":
                    event = value
                elif name == "id":
                    last_id = value
                continue
            if data:
                yield SSEMessage("\n".join(data), event, last_id)
            data, event = [], ""
    if data:
        yield SSEMessage("\n".join(data), event, last_id)


@contextlib.asynccontextmanager
async def open_body(response: httpx.Response) -> AsyncIterator[AsyncIterator[bytes]]:
    """Yield the body chunks of a streamed response and close it properly on exit.

    httpx reads bodies through a chain of nested async generators; closing the response
    alone leaves them suspended, and trio reports each one as a ResourceWarning when it is
    garbage collected (encode/httpx#3686). After the close, pulling once more makes the read
    fail at the bottom of the chain, which ends every generator in it.
    """
    chunks = response.aiter_bytes()
    try:
        yield chunks
    finally:
        await response.aclose()
        with contextlib.suppress(httpx.HTTPError, httpx.StreamError):
            async for _ in chunks:
                pass


def one_line(text: str, secret: str | None = None) -> str:
    """Make provider text fit one ``chat`` line, and never echo the API key back."""
    if secret:
        text = text.replace(secret, "***")
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 1] + "…"


def retry_after(headers: Mapping[str, str], now: datetime | None = None) -> float | None:
    """Seconds the provider asks us to wait: ``retry-after-ms`` first, it is the finer one."""
    fields = httpx.Headers(headers)
    if (ms := _seconds(fields.get("retry-after-ms"))) is not None:
        return ms / 1000
    value = fields.get("retry-after", "")
    if (seconds := _seconds(value)) is not None:
        return seconds
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
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
    """The human part of an error body: OpenAI-style ``error.message`` when there is one.

    OpenRouter wraps upstream failures as "Provider returned error" with the upstream text
    in ``error.metadata.raw``, which is the part worth showing.
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
    message = next((v for k in ("message", "detail") if isinstance(v := error.get(k), str)), body)
    metadata = error.get("metadata")
    if isinstance(metadata, dict) and isinstance(raw := metadata.get("raw"), str):
        return f"{message}: {raw}"
    return message


def http_error(
    status: int,
    body: bytes | str,
    headers: Mapping[str, str] | None = None,
    *,
    secret: str | None = None,
    label: str = "",
) -> BackendError:
    """Map an error status and its body to the typed error the agent's retry logic expects.

    ``label`` replaces the default ``HTTP <status>`` prefix, for errors reported in-stream.
    """
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    detail = provider_message(text).strip() or httpx.codes.get_reason_phrase(status)
    message = one_line(f"{label or f'HTTP {status}'}: {detail}", secret)
    lowered = text.lower()
    if status == 429:
        return RateLimitError(message, retry_after(headers or {}))
    if status == 408 or 500 <= status <= 599:
        return TransientError(message)
    if status == 400 and any(marker in lowered for marker in _OVERFLOW_MARKERS):
        return ContextOverflowError(message)
    if status in (400, 422) and any(marker in lowered for marker in _NO_TOOLS_MARKERS):
        return ToolUnsupportedError(message)
    return BadResponseError(message)


def transport_error(exc: httpx.HTTPError) -> BackendError:
    """Network trouble is worth a retry; a malformed request or URL is not."""
    detail = one_line(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    transient = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
    if isinstance(exc, (*transient, httpx.ProxyError)):
        return TransientError(f"network error: {detail}")
    return BadResponseError(f"request failed: {detail}")


@contextlib.contextmanager
def httpx_errors() -> Iterator[None]:
    """Let no raw httpx exception escape a backend: the agent retries by error type."""
    try:
        yield
    except httpx.HTTPError as exc:
        raise transport_error(exc) from exc
