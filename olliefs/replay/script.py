"""The script: what the replay server answers, one entry per model request, in order.

A script is a text file of JSON lines, consumed in order by every chat request whatever
its wire format (OpenAI, Anthropic, Ollama, Gemini, Copilot and Kiro requests all take
the next entry). Blank lines and lines starting with ``#`` are ignored. Every field is
optional::

    # a plain reply, streamed 4 characters per delta
    {"reply": "Hello there."}
    # thinking first, then a tool call; the next request gets the following line
    {"reasoning": "Let me look.", "tool_calls": [{"name": "ls", "arguments": {"path": "."}}]}
    {"status": 429, "retry_after": 2}
    {"reply": "slow and cut off", "chunk": 1, "delay": 0.05, "drop_after": 5}

Fields (each wire format renders them in its own shape, see ``wire/``):

``reply``
    The assistant text.
``reasoning``
    Thinking text, streamed before the reply (OpenAI: ``delta.reasoning_content``;
    Anthropic: a thinking block with a signature; Gemini: ``thought`` parts; Ollama:
    ``message.thinking``; Kiro has none and leaves it out).
``reasoning_field``
    OpenAI wire only: ``"reasoning_content"`` (default) or ``"reasoning"``.
``signature``
    Anthropic: the thinking block's signature (default ``sig-<n>``); Gemini: the
    ``thoughtSignature`` put on the first function call (default: none).
``tool_calls``
    ``[{"id": str, "name": str, "arguments": object or str}]``; ``id`` defaults to a
    wire-specific ``<prefix>_<n>_<i>`` (Gemini and Ollama send none unless given),
    ``arguments`` to ``{}``. Streamed after the reply; where the wire streams arguments in
    fragments (OpenAI, Anthropic, Kiro) they come ``chunk`` characters at a time.
``server_tools``
    Anthropic wire only: ``[{"name", "arguments", "id", "result", "result_type",
    "after"}]``, tools the provider ran itself: each a ``server_tool_use`` block (its
    input streamed as ``input_json_delta``, id default ``srvtoolu_<n>_<i>``) and its
    result block, ``result_type`` (default ``<name>_tool_result``) with ``result`` as its
    ``content`` (default ``[]``), placed after ``after`` characters of the reply (the text
    around them comes as separate text blocks, as the API sends it).
``in_text``
    ``"tags"`` or ``"json"``: the reasoning and the tool calls are written into the
    reply's text, as open models do when their server does not parse their template
    (every wire streams them as text): ``<think>REASONING</think>`` and a blank line
    first, then the reply, then each call on a line of its own, as ``<tool_call>{"name":
    ..., "arguments": ...}</tool_call>`` (``"tags"``) or as that bare JSON object
    (``"json"``); arguments given as a string are written as they are (malformed ones
    stay malformed).
``late_ids``
    OpenAI wire: each call's argument fragments come first, without id or name; a later
    delta carries them.
``chunk``
    Characters per delta, default 4 (at least 1).
``delay``
    Seconds between deltas, default 0.
``first_delay``
    Seconds before the response headers are sent.
``usage``
    ``{"prompt_tokens", "completion_tokens", "cached_tokens", "cache_creation_tokens",
    "cost"}``, each optional. Defaults: prompt tokens = characters of the request's
    message texts / 4, completion tokens = characters of reply and reasoning / 4, both at
    least 1. The prompt count includes the cached and cache-creation ones (ollie's
    convention); the Anthropic wire reports them apart, as Anthropic does. ``cost`` is
    sent (as OpenRouter does) only on the OpenAI wire. The OpenAI wire sends usage only
    when the request asked for ``stream_options.include_usage``; Kiro never does.
``finish_reason``
    Overrides the finish/stop reason, in the wire's own vocabulary (``"length"``,
    ``"max_tokens"``, ``"MAX_TOKENS"`` ...).
``status``
    An HTTP status other than 200 answers with the wire's error body instead.
``error``, ``error_type``, ``error_code``
    The error's message (default: the status phrase) and, where the wire has them, its
    type and code (OpenAI ``type``/``code``; Anthropic ``error.type``; Gemini
    ``error.status``; Kiro the exception name), e.g. ``"error_code":
    "context_length_exceeded"``. Defaults follow each provider's own choice for the status.
``in_stream``
    With ``status``: answer 200, stream the deltas (up to ``drop_after``), then report the
    error inside the stream the way the wire does (OpenAI/OpenRouter an ``error`` chunk
    beside a choice finished with ``"error"``, with the entry's ``usage`` when it has one,
    Anthropic an ``error`` event, Gemini an ``error`` object, Ollama an ``error`` line, Kiro
    an exception frame), and end the body without the wire's terminator.
``body``
    A raw response body sent (as ``application/json``) instead of the error body or the
    completion, with ``status``.
``raw``
    Recorded response bytes (base64 in a script file), sent verbatim as the body with
    ``status`` and the wire's stream content type (or ``content_type``), in HTTP chunks of
    ``raw_chunk`` bytes (default: one chunk). With ``drop_after`` the connection is closed
    after that many bytes of it, without the terminating HTTP chunk.
``content_type``
    The content type of a ``raw`` body.
``retry_after``, ``retry_after_ms``
    Values of the ``Retry-After`` and ``retry-after-ms`` response headers (an HTTP date is
    fine too).
``retry_delay``
    Gemini: a ``RetryInfo`` detail with this ``retryDelay`` (``"7s"``) in the error body.
``drop_after``
    Send that many deltas, then close the TCP connection without the wire's terminator
    and without the terminating HTTP chunk (a dropped stream). A non-streamed request is
    dropped unanswered.
``hang``, ``hang_after``
    Send the headers and ``hang_after`` deltas (default 0), then nothing more until the
    client goes away or the server stops (a stalled provider).
``garbage``
    A raw string sent as one payload (an SSE ``data:`` event, an NDJSON line, an event
    stream frame) in place of the whole reply, followed by the wire's terminator.
``keepalive``
    Send a keep-alive between deltas where the wire has one (an SSE comment; Anthropic's
    ``ping`` event).
``no_final_newline``
    End the last event without its trailing blank line (or newline).
``refuse_schema``
    A request that asks for structured output (OpenAI ``response_format``, Ollama
    ``format``, Gemini ``responseSchema``, Anthropic a forced ``tool_choice``: the
    ``schema`` of ``Recorded``) gets the wire's 400 instead ("structured output is not
    supported for this model"), and the entry stays for the next request: a provider
    that refuses the schema and answers the same request without it.
``flood``
    Start one payload (an SSE ``data:`` line, an NDJSON line, an event stream frame that
    announces this size; with ``status``, a JSON error body) and send this many bytes of
    it, never ending it, then end the body; the bytes are made as they go out, and the
    sending stops when the client hangs up (a server that never ends its line).

Faults that act on the bytes of any answer, whatever its shape (fault tests and
``bench/bench_faults.py`` use them):

``for_model``
    Answer only a request for this model; requests for other models skip the entry (and
    take the next one that fits, or the fallback). Sessions that each use a model name of
    their own can so run scripts side by side on one server, and ``ReplayServer.recorded``
    counts each one's requests (its retries) apart.
``headers``
    Extra response headers, ``{"name": "value"}``.
``cut_after``
    Close the connection after that many bytes of the response body (HTTP chunk framing
    not counted), wherever they fall: inside an event, inside a UTF-8 sequence, inside an
    HTTP chunk (whose announced size then never arrives).
``byte_delay``
    Send the body one byte at a time, each in its own HTTP chunk, this many seconds apart
    (a slow-loris server: a byte a second keeps any per-read timeout from ever firing).
``silent``
    Read the request and answer nothing at all, not even a status line, until the client
    goes away or the server stops (a server that accepted and hung).
``revoke_token``
    The short-lived token the request carries (one this server minted for Copilot or
    Kiro) is revoked, and the request answered 401 in the wire's error shape: a token
    that expired or was revoked before its time. Later requests with it are refused as
    any unknown token is; a new exchange (or refresh) gets one that works.

When the script runs out the server is in echo mode: it replies ``echo: <text of the last
user message>``, so it is useful with no script at all. With ``then="error"`` it answers
500 ``replay script exhausted`` instead.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Any, Literal

import msgspec

NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]


class EntryToolCall(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One scripted tool call; an object ``arguments`` is sent JSON-encoded."""

    name: str
    arguments: dict[str, Any] | str = {}
    id: str | None = None

    def arguments_text(self) -> str:
        args = self.arguments
        return args if isinstance(args, str) else msgspec.json.encode(args).decode()


class EntryServerTool(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A tool the provider ran itself, already answered (Anthropic's server tools)."""

    name: str = "web_search"
    arguments: dict[str, Any] = {}
    id: str | None = None
    result: Any = None  # the result block's ``content``; None: no results (``[]``)
    result_type: str | None = None  # default ``<name>_tool_result``
    after: Annotated[int, msgspec.Meta(ge=0)] = 0  # characters of ``reply`` before it


class EntryUsage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Token counts to report; ``None`` fields get the character-based defaults."""

    prompt_tokens: Count | None = None
    completion_tokens: Count | None = None
    cached_tokens: Count | None = None
    cache_creation_tokens: Count | None = None
    cost: float | None = None


class Entry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One scripted answer; the module docstring documents every field."""

    reply: str = ""
    reasoning: str = ""
    reasoning_field: Literal["reasoning_content", "reasoning"] = "reasoning_content"
    signature: str | None = None
    tool_calls: tuple[EntryToolCall, ...] = ()
    server_tools: tuple[EntryServerTool, ...] = ()
    in_text: Literal["tags", "json"] | None = None
    late_ids: bool = False
    chunk: Annotated[int, msgspec.Meta(ge=1)] = 4
    delay: NonNegative = 0.0
    first_delay: NonNegative = 0.0
    usage: EntryUsage | None = None
    finish_reason: str | None = None
    status: Annotated[int, msgspec.Meta(ge=200, le=599)] = 200
    error: str | None = None
    error_type: str | None = None
    error_code: str | None = None
    in_stream: bool = False
    body: str | None = None
    raw: bytes | None = None
    raw_chunk: Annotated[int, msgspec.Meta(ge=1)] | None = None
    content_type: str | None = None
    retry_after: str | float | None = None
    retry_after_ms: str | float | None = None
    retry_delay: str | None = None
    drop_after: Count | None = None
    hang: bool = False
    hang_after: Count = 0
    garbage: str | None = None
    keepalive: bool = False
    no_final_newline: bool = False
    flood: Annotated[int, msgspec.Meta(ge=1, lt=1 << 32)] | None = None
    for_model: str | None = None
    headers: dict[str, str] = {}
    cut_after: Count | None = None
    byte_delay: NonNegative = 0.0
    silent: bool = False
    refuse_schema: bool = False
    revoke_token: bool = False


SCHEMA_REFUSED = "structured output is not supported for this model"


def parse_script(text: str) -> list[Entry]:
    """Parse a JSON-lines script; errors name the 1-based line so users can fix the file."""
    entries = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            entries.append(msgspec.json.decode(line, type=Entry))
        except msgspec.MsgspecError as e:
            raise ValueError(f"line {lineno}: {e}") from None
    return entries


class Recorded(msgspec.Struct, frozen=True):
    """One model request as the server received it (header names in lower case), the
    model it asked for, and the structured output it asked for (the JSON Schema in the
    wire's own form, ``{}`` for any JSON; None: none)."""

    wire: str
    path: str
    headers: dict[str, str]
    body: Any
    model: str = ""
    schema: Any = None


class Script:
    """The entries still to play, the requests seen so far, and the fallback answer.

    Shared by the server's connection threads, hence the lock; each request recorded
    wakes those waiting for requests (``wait_recorded``).
    """

    def __init__(self, entries: Sequence[Entry] = (), then: str = "echo") -> None:
        if then not in ("echo", "error"):
            raise ValueError(f"then must be 'echo' or 'error', not {then!r}")
        self.then = then
        self._entries: deque[Entry] = deque(entries)
        self._recorded: list[Recorded] = []
        self._counter = itertools.count(1)
        self._lock = threading.Lock()
        self._recorded_more = threading.Condition(self._lock)

    def add(self, entries: Iterable[Entry]) -> None:
        with self._lock:
            self._entries.extend(entries)

    @property
    def recorded(self) -> list[Recorded]:
        with self._lock:
            return list(self._recorded)

    def wait_recorded(
        self, cond: Callable[[list[Recorded]], bool], timeout: float
    ) -> list[Recorded]:
        """Block until ``cond`` holds of the requests recorded so far, looking again at
        each new one; AssertionError after ``timeout`` seconds."""
        with self._recorded_more:
            if not self._recorded_more.wait_for(lambda: cond(self._recorded), timeout):
                raise AssertionError(f"the requests never came: {len(self._recorded)} so far")
            return list(self._recorded)

    def record(self, recorded: Recorded) -> None:
        """Record a request that takes no entry (one the server refused as it came)."""
        with self._lock:
            self._recorded.append(recorded)
            self._recorded_more.notify_all()

    def take(self, recorded: Recorded, user_text: str, model: str = "") -> tuple[int, Entry]:
        """Record a request and pick its answer: the next entry for ``model`` (one without
        ``for_model`` fits any), or the fallback. An entry that refuses the request's
        schema answers 400 and stays."""
        with self._lock:
            self._recorded.append(recorded)
            self._recorded_more.notify_all()
            n = next(self._counter)
            for i, entry in enumerate(self._entries):
                if entry.for_model is None or entry.for_model == model:
                    if entry.refuse_schema and recorded.schema is not None:
                        return n, Entry(status=400, error=SCHEMA_REFUSED)
                    del self._entries[i]
                    return n, entry
        if self.then == "error":
            return n, Entry(status=500, error="replay script exhausted")
        return n, Entry(reply=f"echo: {user_text}")
