"""What the contract tests share: an outcome both parsers are reduced to, and our side.

Each contract test plays one response (recorded bytes, or a scripted entry the replay
server renders) twice from a real loopback replay server: once to the provider's official
SDK, once to our backend. Both readings are reduced to an ``Outcome``, the part of a reply
the agent cares about, and compared. Error outcomes compare by kind (what the retry logic
does with them) and, for 429s, by the wait each side read from the headers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from olliefs.backend import pool
from olliefs.backend.base import (
    Backend,
    BackendError,
    GenerationParams,
    Message,
    RateLimitError,
    StreamDropError,
    Tool,
    TransientError,
)
from olliefs.replay import Entry, ReplayServer

STREAMS = Path(__file__).parent / "streams"
KEY = "sk-contract-0123456789abcdef"
USER = [Message("system", "be brief"), Message("user", "hi")]
TOOLS = [Tool("get_weather", "weather of a city", {"type": "object", "properties": {}})]


def recorded(name: str) -> bytes:
    return (STREAMS / name).read_bytes()


@dataclass
class Outcome:
    """The part of a reply the agent uses; ``error`` is the kind of failure, if any."""

    text: str = ""
    reasoning: str = ""
    calls: list[tuple[str | None, str, Any]] = field(default_factory=list)
    usage: tuple[int, int, int, int] | None = None  # input (all), output, cached, created
    finish: str = ""
    error: str = ""  # rate_limit | transient | invalid_request | auth | bad_payload
    retry_after: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def without_ids(self) -> Outcome:
        """For providers whose SDK shows no call id (we make one up)."""
        calls: list[tuple[str | None, str, Any]] = [(None, n, args) for _, n, args in self.calls]
        return Outcome(
            self.text,
            self.reasoning,
            calls,
            self.usage,
            self.finish,
            self.error,
            self.retry_after,
            self.extra,
        )

    def essentials(self) -> Outcome:
        """Errors compare by kind only: the partial reply before a failure is not kept by
        every SDK."""
        if self.error:
            return Outcome(error=self.error)
        return Outcome(self.text, self.reasoning, self.calls, self.usage, self.finish)


def args_of(text: str) -> Any:
    return msgspec.json.decode(text) if text else {}


def kind_of_status(status: int) -> str:
    if status == 429:
        return "rate_limit"
    if status >= 500 or status == 408:
        return "transient"
    if status in (401, 403):
        return "auth"
    return "invalid_request"


def kind_of(err: BackendError) -> str:
    message = str(err)
    if isinstance(err, RateLimitError):
        return "rate_limit"
    if isinstance(err, (TransientError, StreamDropError)):
        return "transient"
    if "bad stream payload" in message or "bad event stream" in message:
        return "bad_payload"
    match = re.search(r"(?:HTTP|stream error) (\d{3})", message)
    return kind_of_status(int(match[1])) if match else "invalid_request"


def settings(server: ReplayServer) -> dict[str, str]:
    return {**server.settings(), "OLLIE_READ_TIMEOUT": "20"}


def backend(server: ReplayServer, name: str) -> Backend:
    return pool.make_backend(name, settings(server))


async def ours(
    server: ReplayServer,
    name: str,
    entry: Entry,
    *,
    messages: list[Message] = USER,
    params: GenerationParams | None = None,
) -> Outcome:
    """Play ``entry`` to our backend ``name`` and reduce what it read."""
    server.add([entry])
    b = backend(server, name)
    out = Outcome()
    text: list[str] = []
    reasoning: list[str] = []
    try:
        async with b.stream("replay", messages, TOOLS, params or GenerationParams()) as events:
            async for ev in events:
                if ev.kind == "content":
                    text.append(ev.text)
                elif ev.kind == "reasoning":
                    reasoning.append(ev.text)
                elif ev.kind == "tool_calls":
                    out.calls = [(c.id, c.name, args_of(c.arguments)) for c in ev.tool_calls]
                elif ev.kind == "usage" and ev.usage is not None:
                    u = ev.usage
                    out.usage = (
                        u.input_tokens,
                        u.output_tokens,
                        u.cached_input_tokens,
                        u.cache_creation_tokens,
                    )
                    if u.cost is not None:
                        out.extra["cost"] = u.cost
                elif ev.kind == "done":
                    out.finish = ev.finish_reason
                    out.extra.update(ev.provider_data)
    except BackendError as err:
        out.error = kind_of(err)
        out.extra["message"] = str(err)
        if isinstance(err, RateLimitError):
            out.retry_after = err.retry_after
    finally:
        await b.aclose()
    out.text, out.reasoning = "".join(text), "".join(reasoning)
    return out


# ---- edge cases made from a recorded stream ---------------------------------------------------


def sse_events(body: bytes) -> list[bytes]:
    """The events of an SSE body, each with its own trailing blank line."""
    sep = b"\r\n\r\n" if b"\r\n\r\n" in body else b"\n\n"
    return [event + sep for event in body.split(sep) if event.strip()]


def with_keepalives(body: bytes) -> bytes:
    sep = b"\r\n\r\n" if b"\r\n\r\n" in body else b"\n\n"
    comment = b": keep-alive" + sep
    return comment + comment.join(sse_events(body)) + comment


def without_final_newline(body: bytes) -> bytes:
    return body.rstrip(b"\r\n")


def with_malformed(body: bytes, line_prefix: bytes = b"data: ", nth: int = 2) -> bytes:
    """The ``nth`` payload cut in half: invalid JSON in the middle of a stream."""
    lines = body.split(b"\n")
    seen = 0
    for i, line in enumerate(lines):
        if line.startswith(line_prefix) or (not line_prefix and line.strip()):
            seen += 1
            if seen == nth:
                lines[i] = line[: len(line) // 2]
                break
    return b"\n".join(lines)


HTTP_DATE_AHEAD = 120  # seconds: a Retry-After date this far ahead


def http_date(seconds_ahead: float) -> str:
    from email.utils import formatdate
    from time import time

    return formatdate(time() + seconds_ahead, usegmt=True)
