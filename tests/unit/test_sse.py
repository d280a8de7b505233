"""The shared streaming helpers: line splitting, SSE parsing, status and transport errors.

The framing is synchronous and works on bytes (``LineSplitter``, ``SSEDecoder``); the
helpers below feed it chunk by chunk, as the HTTP layer does, and decode what comes out.
"""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from olliefs.backend.base import (
    BadResponseError,
    ContextOverflowError,
    RateLimitError,
    ToolUnsupportedError,
    TransientError,
)
from olliefs.backend.stream import (
    MAX_MESSAGE_CHARS,
    LineSplitter,
    NDJSONSplitter,
    SSEDecoder,
    data_payloads,
    http_error,
    httpx_errors,
    one_line,
    retry_after,
    transport_error,
)

Message = tuple[str, str, str]


def M(data: str, event: str = "", id: str = "") -> Message:
    return (data, event, id)


async def lines_of(*chunks: bytes) -> list[str]:
    splitter = LineSplitter()
    lines = [line for chunk in chunks for line in splitter.feed(chunk)] + splitter.close()
    return [line.decode("utf-8", "replace") for line in lines]


async def sse_of(*chunks: bytes) -> list[Message]:
    decoder = SSEDecoder()
    messages = [m for chunk in chunks for m in decoder.feed(chunk)] + decoder.close()
    return [(m.data.decode(), m.event, m.id) for m in messages]


# --- lines ---------------------------------------------------------------------------------


async def test_lines_end_in_lf_crlf_or_cr() -> None:
    assert await lines_of(b"a\nb\r\nc\rd") == ["a", "b", "c", "d"]


async def test_crlf_split_across_chunks_is_one_terminator() -> None:
    assert await lines_of(b"a\r", b"\nb\r", b"", b"\n", b"\n") == ["a", "b", ""]


async def test_cr_then_cr_is_an_empty_line() -> None:
    assert await lines_of(b"a\r", b"\rb") == ["a", "", "b"]


async def test_line_split_across_many_chunks() -> None:
    assert await lines_of(b"da", b"ta: x", b"yz\n") == ["data: xyz"]


async def test_unicode_line_separators_do_not_split() -> None:
    text = 'data: {"a": "x\u2028y\u0085z\x0c"}\n'
    assert await lines_of(text.encode()) == [text[:-1]]


async def test_multibyte_character_split_across_chunks() -> None:
    encoded = "é€😀\n".encode()
    assert await lines_of(*(encoded[i : i + 1] for i in range(len(encoded)))) == ["é€😀"]


async def test_leading_bom_is_dropped_and_bad_bytes_replaced() -> None:
    assert await lines_of(b"\xef\xbb\xbfa\n\xff\n") == ["a", "\ufffd"]


async def test_empty_stream_has_no_lines() -> None:
    assert await lines_of() == []
    assert await lines_of(b"") == []


# --- SSE -----------------------------------------------------------------------------------


async def test_data_with_and_without_space() -> None:
    assert await sse_of(b"data: a\n\ndata:b\n\ndata:  c\n\n") == [
        M("a"),
        M("b"),
        M(" c"),
    ]


async def test_multi_line_data_is_joined_with_newlines() -> None:
    assert await sse_of(b"data: one\ndata:\ndata: three\n\n") == [M("one\n\nthree")]


async def test_event_and_id_fields() -> None:
    body = b"event: delta\nid: 7\ndata: x\n\ndata: y\n\nid: 8\nevent: end\ndata: z\n\n"
    assert await sse_of(body) == [
        M("x", "delta", "7"),
        M("y", "", "7"),  # the event type resets, the last id persists
        M("z", "end", "8"),
    ]


async def test_comments_unknown_fields_and_empty_events_are_ignored() -> None:
    body = b": OPENROUTER PROCESSING\n\nretry: 10\nfoo: bar\n\nevent: ping\n\ndata: x\n: c\n\n"
    assert await sse_of(body) == [M("x")]


async def test_field_without_colon() -> None:
    assert await sse_of(b"data\n\n") == [M("")]


async def test_crlf_and_cr_line_endings() -> None:
    assert await sse_of(b"data: a\r\n\r\ndata: b\r\rdata: c\r\n") == [
        M("a"),
        M("b"),
        M("c"),
    ]


async def test_final_message_without_blank_line_is_dispatched() -> None:
    assert await sse_of(b"data: a\n\ndata: [DONE]") == [M("a"), M("[DONE]")]
    assert await sse_of(b"data: [DONE]\n") == [M("[DONE]")]


async def test_message_split_anywhere() -> None:
    body = b"data: hello\r\n\r\ndata: world\n\n"
    for cut in range(len(body) + 1):
        assert await sse_of(body[:cut], body[cut:]) == [M("hello"), M("world")]


# (an id holding NUL is ignored by the spec; that rule has its own test)
_value = st.text(
    st.characters(exclude_characters="\r\n\x00", exclude_categories=["Cs"]), max_size=12
)
_message = st.tuples(
    st.sampled_from(["", "delta", "error"]),
    st.none() | _value,
    st.lists(_value, min_size=1, max_size=3),
    st.booleans(),
)


@st.composite
def _streams(draw: st.DrawFn) -> tuple[bytes, list[Message]]:
    messages = draw(st.lists(_message, max_size=5))
    eol = st.sampled_from(["\n", "\r\n", "\r"])
    text, last_id = "", ""
    expected: list[Message] = []
    for event, event_id, data, comment in messages:
        fields = [": keep-alive"] if comment else []
        fields += [f"event: {event}"] if event else []
        fields += [f"id: {event_id}"] if event_id is not None else []
        fields += [f"data: {line}" for line in data]
        text += "".join(field + draw(eol) for field in fields)
        text += draw(st.sampled_from(["\r", "\r\n"]) if text.endswith("\r") else eol)  # not CR+LF
        last_id = last_id if event_id is None else event_id
        expected.append(M("\n".join(data), event, last_id))
    for _ in range(draw(st.integers(0, 2))):  # drop the last blank line, maybe the last EOL
        text = text.removesuffix("\n").removesuffix("\r")
    return text.encode(), expected


@given(_streams(), st.lists(st.integers(min_value=0), max_size=8))
async def test_same_messages_however_the_bytes_are_split(
    stream: tuple[bytes, list[Message]], cuts: list[int]
) -> None:
    body, expected = stream
    assert await sse_of(*cut(body, cuts)) == expected


def cut(body: bytes, cuts: list[int]) -> list[bytes]:
    """``body`` in reads, cut at ``cuts`` (each taken modulo its length + 1)."""
    points = sorted({c % (len(body) + 1) for c in cuts})
    return [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]


async def sse_arrays_of(*chunks: bytes) -> list[Message]:
    """As ``sse_of``, the way the OpenAI parser reads: ``feed_array`` first, ``feed``
    for a read it declines; the array checked against the payloads it holds."""
    decoder = SSEDecoder()
    messages: list[Message] = []
    for chunk in chunks:
        got = decoder.feed_array(chunk)
        if got is None:
            messages += [(m.data.decode(), m.event, m.id) for m in decoder.feed(chunk)]
            continue
        array, head, n = got
        payloads = data_payloads(head)
        assert array == b"[" + b",".join(payloads) + b"]" and n == len(payloads)
        messages += [(data.decode(), "", decoder.last_id) for data in payloads]
    return messages + [(m.data.decode(), m.event, m.id) for m in decoder.close()]


_short = st.text(st.characters(exclude_characters="\r\n", exclude_categories=["Cs"]), max_size=8)
_long = st.builds(lambda t: t * 100, _short)  # past _SHORT_EVENT: found one by one


@st.composite
def _data_streams(draw: st.DrawFn) -> tuple[bytes, list[Message]]:
    """Mostly single-line ``data:`` events (what feed_array takes), now and then
    anything else a stream may hold."""
    text, last_id, expected = "", "", []
    for kind in draw(st.lists(st.sampled_from("sssssslxcei3"), max_size=12)):
        if kind in "sl":
            value = draw(_short if kind == "s" else _long)
            text += f"data: {value}\n\n"
            expected.append(M(value, "", last_id))
        elif kind == "x":  # an event of two data lines
            text += "data: a\ndata: b\n\n"
            expected.append(M("a\nb", "", last_id))
        elif kind == "c":
            text += ": keep-alive\n\n"
        elif kind == "e":
            text += "event: delta\ndata: e\n\n"
            expected.append(M("e", "delta", last_id))
        elif kind == "i":
            last_id = draw(_short.filter(lambda v: "\x00" not in v))
            text += f"id: {last_id}\ndata: i\n\n"
            expected.append(M("i", "", last_id))
        else:  # a third line end between two events
            text += "\n"
    return text.encode(), expected


@given(_data_streams(), st.lists(st.integers(min_value=0), max_size=8))
async def test_arrays_of_data_lines_hold_the_same_messages(
    stream: tuple[bytes, list[Message]], cuts: list[int]
) -> None:
    body, expected = stream
    assert await sse_arrays_of(*cut(body, cuts)) == expected


# --- HTTP status -> error ------------------------------------------------------------------


def test_429_uses_retry_after_seconds() -> None:
    error = http_error(429, b'{"error": {"message": "slow down"}}', {"Retry-After": "7"})
    assert isinstance(error, RateLimitError)
    assert error.retry_after == 7.0
    assert str(error) == "HTTP 429: slow down"
    assert str(http_error(429, b"", provider="gemini")) == "gemini: HTTP 429: Too Many Requests"


def test_429_prefers_retry_after_ms() -> None:
    error = http_error(429, b"", {"retry-after-ms": "1500", "retry-after": "7"})
    assert isinstance(error, RateLimitError)
    assert error.retry_after == 1.5


def test_429_without_hint() -> None:
    error = http_error(429, b"")
    assert isinstance(error, RateLimitError)
    assert error.retry_after is None
    assert str(error) == "HTTP 429: Too Many Requests"


def test_retry_after_http_date() -> None:
    now = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
    headers = {"Retry-After": "Wed, 01 Jan 2025 12:00:30 GMT"}
    assert retry_after(headers, now) == 30.0
    assert retry_after({"Retry-After": "Wed, 01 Jan 2025 11:00:00 GMT"}, now) == 0.0


@pytest.mark.parametrize("value", ["soon", "-3", "nan", "inf", ""])
def test_unusable_retry_after_is_none(value: str) -> None:
    assert retry_after({"Retry-After": value}) is None
    assert retry_after({"retry-after-ms": value}) is None


@pytest.mark.parametrize("status", [408, 500, 502, 503, 529])
def test_server_errors_and_408_are_transient(status: int) -> None:
    assert type(http_error(status, b"<html>oops</html>")) is TransientError


@pytest.mark.parametrize(
    "body",
    [
        '{"error": {"message": "too long", "code": "context_length_exceeded"}}',
        "This model's maximum context length is 8192 tokens.",
        "Please reduce the length of the messages.",
        '{"error": {"type": "invalid_request_error", "message": "prompt is too long: 210000"}}',
        "Input has too many tokens",
        "the request exceeds the available context size, try increasing it",
        '{"error": {"code": 400, "message": "The input token count (1200000) exceeds the '
        'maximum number of tokens allowed (1048576).", "status": "INVALID_ARGUMENT"}}',
        '{"message": "Input is too long.", "reason": "CONTENT_LENGTH_EXCEEDS_THRESHOLD"}',
        "prompt token count of 130001 exceeds the limit of 128000",
    ],
)
def test_400_context_overflow(body: str) -> None:
    assert isinstance(http_error(400, body), ContextOverflowError)


@pytest.mark.parametrize("status", [400, 422])
@pytest.mark.parametrize(
    "body",
    [
        '{"error": {"message": "registry.ollama.ai/library/gemma:2b does not support tools"}}',
        "Tool use is not supported for this model",
        "tools are not supported",
        "This model does not support function calling",
        '{"error": {"code": 400, "message": "Function calling is not enabled for '
        'models/gemma-3-27b-it", "status": "INVALID_ARGUMENT"}}',
    ],
)
def test_tools_unsupported(status: int, body: str) -> None:
    assert isinstance(http_error(status, body), ToolUnsupportedError)


def test_overflow_text_on_other_4xx_is_a_bad_response() -> None:
    assert type(http_error(404, "maximum context length")) is BadResponseError


def test_other_4xx_carry_the_provider_message_without_the_key() -> None:
    key = "sk-secret-0123456789"
    body = f'{{"error": {{"message": "Incorrect API key provided:\\n {key}", "code": 401}}}}'
    error = http_error(401, body.encode(), secret=key)
    assert type(error) is BadResponseError
    assert str(error) == "HTTP 401: Incorrect API key provided: ***"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"error": "model not found"}', "model not found"),
        ('{"detail": "Not Found"}', "Not Found"),
        ('{"message": "nope"}', "nope"),
        ('{"error": {"code": 404}}', '{"error": {"code": 404}}'),
        ("plain text", "plain text"),
        ("", "Not Found"),
        (
            '{"error": {"message": "Provider returned error", "metadata": {"raw": "quota"}}}',
            "Provider returned error: quota",
        ),
    ],
)
def test_provider_message_shapes(body: str, message: str) -> None:
    assert str(http_error(404, body)) == f"HTTP 404: {message}"


def test_long_bodies_become_one_short_line() -> None:
    message = str(http_error(418, "word\n\t" * 500))
    assert "\n" not in message
    assert len(message) == MAX_MESSAGE_CHARS
    assert message.endswith("…")
    assert one_line("a  b\r\nc") == "a b c"


def test_label_replaces_the_status_prefix() -> None:
    assert (
        str(http_error(502, "upstream", label="stream error 502")) == "stream error 502: upstream"
    )


# --- transport errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "exc",
    [
        httpx.ConnectError("[Errno 111] Connection refused"),
        httpx.ReadTimeout(""),
        httpx.ConnectTimeout("timed out"),
        httpx.RemoteProtocolError("peer closed connection without sending complete message body"),
        httpx.ReadError("reset"),
    ],
)
def test_network_failures_are_transient(exc: httpx.HTTPError) -> None:
    error = transport_error(exc)
    assert type(error) is TransientError
    assert type(exc).__name__ in str(error)


def test_request_mistakes_are_not_retried() -> None:
    assert type(transport_error(httpx.UnsupportedProtocol("no scheme"))) is BadResponseError


def test_httpx_errors_context_translates() -> None:
    with pytest.raises(TransientError) as caught, httpx_errors():
        raise httpx.ReadTimeout("")
    assert isinstance(caught.value.__cause__, httpx.ReadTimeout)


async def test_an_id_holding_nul_is_ignored() -> None:
    assert await sse_of(b"id: 1\ndata: a\n\nid: x\x00y\ndata: b\n\n") == [
        M("a", "", "1"),
        M("b", "", "1"),
    ]


async def test_a_bom_split_across_chunks_is_still_dropped() -> None:
    assert await lines_of(b"\xef", b"\xbb", b"\xbfdata\n") == ["data"]
    assert await lines_of(b"\xef", b"x\n") == ["\ufffdx"]


def test_ndjson_skips_blank_lines_and_keeps_a_last_line_without_newline() -> None:
    splitter = NDJSONSplitter()
    lines = splitter.feed(b'{"a":1}\r\n\n  \n{"b"') + splitter.feed(b":2}") + splitter.close()
    assert lines == [b'{"a":1}', b'{"b":2}']


# --- the cap on a line or event that never ends ----------------------------------------------

LIMIT = 1000


def test_an_sse_event_that_never_ends_fails_once_past_the_limit() -> None:
    """Fed in reads of every size, an event without its blank line is held until more
    than the limit of it waited, then the stream fails; nothing past it is kept."""
    for step in (1, 7, 100, 999, 1001, 4096):
        for head in (b"data: ", b'event: delta\ndata: {"x": "', b"data: a\ndata: "):
            decoder = SSEDecoder("openai", limit=LIMIT)
            body = head + b"x" * 5000
            with pytest.raises(BadResponseError, match=r"^openai: .* longer than 1000 bytes"):
                for i in range(0, len(body), step):
                    assert decoder.feed(body[i : i + step]) == []
            assert i + step > LIMIT and i <= LIMIT + step  # it failed as it went past


def test_the_array_path_fails_the_same_way() -> None:
    """``feed_array`` (OpenAI's reads of plain ``data:`` events) holds the same bytes."""
    for step in (1, 64, 999, 4096):
        decoder = SSEDecoder("openai", limit=LIMIT)
        body = b'data: {"a": 1}\n\ndata: {"b": "' + b"y" * 5000
        got: list[bytes] = []
        with pytest.raises(BadResponseError, match="longer than 1000 bytes"):
            for i in range(0, len(body), step):
                out = decoder.feed_array(body[i : i + step])
                if out is None:
                    got += [m.data for m in decoder.feed(body[i : i + step])]
                elif out[2]:
                    got += data_payloads(out[1])
        assert got == [b'{"a": 1}']  # the event that ended came out before the failure


def test_events_up_to_the_limit_pass_and_each_one_starts_the_count_again() -> None:
    decoder = SSEDecoder(limit=LIMIT)
    event = b"data: " + b"z" * (LIMIT - 10) + b"\n\n"
    out = [m.data for m in decoder.feed(event * 3)]
    out += [m.data for chunk in (event[:500], event[500:]) * 3 for m in decoder.feed(chunk)]
    assert out == [b"z" * (LIMIT - 10)] * 6


def test_a_line_that_never_ends_fails_the_splitters() -> None:
    for splitter in (LineSplitter("ollama", LIMIT), NDJSONSplitter("ollama", LIMIT)):
        assert splitter.feed(b'{"a":1}\n{"b":"') == [b'{"a":1}']
        with pytest.raises(BadResponseError, match=r"^ollama: .* longer than 1000 bytes"):
            for _ in range(100):
                splitter.feed(b"q" * 64)
    lines = LineSplitter(limit=LIMIT)
    assert lines.feed(b"w" * LIMIT) == []
    assert lines.feed(b"\n" + b"w" * LIMIT) == [b"w" * LIMIT]  # at the limit: fine


def test_the_default_limit_is_sixteen_mib() -> None:
    decoder = SSEDecoder("anthropic")
    piece = b"data: " + b"x" * ((1 << 20) - 6)
    for _ in range(16):
        assert decoder.feed(piece) == []
    with pytest.raises(BadResponseError, match=r"^anthropic: .* longer than 16 MiB"):
        decoder.feed(b"x")


def test_the_events_a_read_ended_come_out_before_the_failure() -> None:
    """One read ends an event and runs past the limit in the next: the event comes out,
    the stream fails at the next read or at its end."""
    body = b"data: first\n\ndata: " + b"x" * 5000
    for then in ("feed", "close"):
        decoder = SSEDecoder("gemini", limit=LIMIT)
        assert [m.data for m in decoder.feed(body)] == [b"first"]
        with pytest.raises(BadResponseError, match="longer than 1000 bytes"):
            decoder.feed(b"\n\n") if then == "feed" else decoder.close()
        lines = LineSplitter("ollama", LIMIT)
        assert lines.feed(b"one\n" + b"x" * 5000) == [b"one"]
        with pytest.raises(BadResponseError, match="longer than 1000 bytes"):
            lines.feed(b"\n") if then == "feed" else lines.close()
