"""The OpenAI-compatible backend against canned wire data (httpx.MockTransport).

The two tests at the end use a real loopback socket: a hung server and an abandoned stream
cannot be faked faithfully by a mock transport.
"""

from __future__ import annotations

import gc
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from olliefs.backend.base import (
    Backend,
    BackendError,
    BadResponseError,
    ContextOverflowError,
    GenerationParams,
    Message,
    RateLimitError,
    StreamDropError,
    StreamEvent,
    Tool,
    ToolCall,
    ToolUnsupportedError,
    TransientError,
    Usage,
)
from olliefs.backend.copilot import CopilotBackend
from olliefs.backend.openai import OpenAIBackend, OpenAIParser, normalize_base_url
from olliefs.backend.pool import backend_names, make_backend
from olliefs.backend.stream import SSEDecoder, coalesce
from olliefs.backend.texttools import TextTools

KEY = "sk-test-0123456789abcdef"
USER = [Message("user", "hi")]
NO_PARAMS = GenerationParams()
Handler = Callable[[httpx.Request], httpx.Response]


def delta(**fields: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": fields, "finish_reason": None}]}


def finish(reason: str) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}


def sse(*items: dict[str, Any] | str, done: bool = True) -> bytes:
    lines = [f"data: {item if isinstance(item, str) else json.dumps(item)}\n\n" for item in items]
    return "".join([*lines, "data: [DONE]\n\n" if done else ""]).encode()


async def chunked(*parts: bytes, error: Exception | None = None) -> AsyncIterator[bytes]:
    for part in parts:
        yield part
    if error is not None:
        raise error


def reply(
    body: bytes | AsyncIterator[bytes], status: int = 200, headers: dict[str, str] | None = None
) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        fields = {"content-type": "text/event-stream", **(headers or {})}
        return httpx.Response(status, headers=fields, content=body)

    return handler


def make(handler: Handler, url: str = "https://api.example.com/v1", **kw: Any) -> OpenAIBackend:
    return OpenAIBackend("openai", url, KEY, transport=httpx.MockTransport(handler), **kw)


async def events_of(
    handler: Handler, tools: list[Tool] | None = None, messages: list[Message] = USER
) -> list[StreamEvent]:
    backend = make(handler)
    try:
        async with backend.stream("gpt-test", messages, tools or [], NO_PARAMS) as events:
            return [event async for event in events]
    finally:
        await backend.aclose()


async def request_of(
    messages: list[Message] = USER,
    tools: list[Tool] | None = None,
    params: GenerationParams = NO_PARAMS,
    *,
    base_url: str = "http://h",
    api_key: str | None = KEY,
    extra_headers: dict[str, str] | None = None,
) -> httpx.Request:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return reply(sse())(request)

    transport = httpx.MockTransport(handler)
    backend = OpenAIBackend(
        "openai", base_url, api_key, transport=transport, extra_headers=extra_headers
    )
    async with backend.stream("gpt-test", messages, tools or [], params) as events:
        assert [e.kind async for e in events] == ["done"]
    await backend.aclose()
    return seen[0]


def texts(events: list[StreamEvent], kind: str) -> str:
    return "".join(e.text for e in events if e.kind == kind)


# --- replies -------------------------------------------------------------------------------


async def test_content_reasoning_usage_and_done() -> None:
    usage = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}
    events = await events_of(
        reply(
            sse(
                delta(role="assistant", content=None, reasoning_content="think"),
                delta(reasoning="ing"),
                delta(content="Hel", reasoning_content=None, refusal=None),
                delta(content="lo", reasoning_content="", extra={"x": 1}),
                {**finish("stop"), "usage": None, "system_fingerprint": "fp"},
                {"id": "chatcmpl-1", "choices": [], "usage": usage},
            )
        )
    )
    assert events == [
        # deltas read together come merged (stream.coalesce)
        StreamEvent("reasoning", text="thinking"),
        StreamEvent("content", text="Hello"),
        StreamEvent("usage", usage=Usage(input_tokens=12, output_tokens=5)),
        StreamEvent("done", finish_reason="stop", response_id="chatcmpl-1"),
    ]


async def test_reasoning_sent_under_both_names_is_not_doubled() -> None:
    events = await events_of(reply(sse(delta(reasoning_content="a", reasoning="a"))))
    assert texts(events, "reasoning") == "a"


async def test_usage_with_cached_tokens_and_cost() -> None:
    usage = {
        "prompt_tokens": 1000,
        "completion_tokens": 20,
        "prompt_tokens_details": {"cached_tokens": 800, "audio_tokens": None},
        "completion_tokens_details": {"reasoning_tokens": 10},
        "cost": 0.0042,
    }
    events = await events_of(reply(sse(delta(content="x"), {"choices": [], "usage": usage})))
    assert [e.usage for e in events if e.kind == "usage"] == [
        Usage(input_tokens=1000, output_tokens=20, cached_input_tokens=800, cost=0.0042)
    ]


async def test_only_the_last_usage_is_reported() -> None:
    first = {"prompt_tokens": 1, "completion_tokens": 1}
    last = {"prompt_tokens": 1, "completion_tokens": 2}
    events = await events_of(
        reply(sse({**delta(content="a"), "usage": first}, {**delta(content="b"), "usage": last}))
    )
    assert [e.usage for e in events if e.kind == "usage"] == [Usage(1, 2)]


async def test_tool_calls_accumulate_by_index_with_late_id_and_name() -> None:
    def call(index: int, **fields: Any) -> dict[str, Any]:
        return delta(tool_calls=[{"index": index, **fields}])

    events = await events_of(
        reply(
            sse(
                delta(content="Let me look."),
                call(0, function={"arguments": '{"pa'}),
                call(0, id="call_a", type="function", function={"name": "read", "arguments": ""}),
                call(1, id="call_b", function={"name": "ls", "arguments": None}),
                call(0, function={"arguments": 'th": "x"}'}),
                call(1, id=None, function={"name": None, "arguments": '{"dir": "."}'}),
                finish("tool_calls"),
            )
        )
    )
    assert events[-2:] == [
        StreamEvent(
            "tool_calls",
            tool_calls=(
                ToolCall("call_a", "read", '{"path": "x"}'),
                ToolCall("call_b", "ls", '{"dir": "."}'),
            ),
        ),
        StreamEvent("done", finish_reason="tool_calls", response_id="chatcmpl-1"),
    ]


async def test_tool_calls_by_position_come_out_in_index_order() -> None:
    events = await events_of(
        reply(
            sse(
                delta(tool_calls=[{"index": 1, "id": "b", "function": {"name": "f"}}]),
                delta(tool_calls=[{"index": 0, "id": "a", "function": {"name": "g"}}]),
            )
        )
    )
    (tool_calls,) = [e.tool_calls for e in events if e.kind == "tool_calls"]
    assert tool_calls == (ToolCall("a", "g", "{}"), ToolCall("b", "f", "{}"))


async def test_tool_calls_without_index_are_told_apart_by_id() -> None:
    events = await events_of(
        reply(
            sse(
                delta(tool_calls=[{"id": "a", "function": {"name": "f", "arguments": "{}"}}]),
                delta(tool_calls=[{"id": "b", "function": {"name": "g", "arguments": '{"k"'}}]),
                delta(tool_calls=[{"function": {"arguments": ": 1}"}}]),
            )
        )
    )
    (tool_calls,) = [e.tool_calls for e in events if e.kind == "tool_calls"]
    assert tool_calls == (ToolCall("a", "f", "{}"), ToolCall("b", "g", '{"k": 1}'))


async def test_missing_ids_are_generated() -> None:
    events = await events_of(
        reply(sse(delta(tool_calls=[{"index": 0, "function": {"name": "f", "arguments": "{}"}}])))
    )
    (tool_calls,) = [e.tool_calls for e in events if e.kind == "tool_calls"]
    assert tool_calls[0].id.startswith("call_")
    assert tool_calls[0].name == "f"


async def test_legacy_function_call_is_one_tool_call() -> None:
    events = await events_of(
        reply(
            sse(
                delta(function_call={"name": "search", "arguments": '{"q":'}),
                delta(function_call={"arguments": ' "trio"}'}),
                finish("function_call"),
            )
        )
    )
    (tool_calls,) = [e.tool_calls for e in events if e.kind == "tool_calls"]
    assert [(c.name, c.arguments) for c in tool_calls] == [("search", '{"q": "trio"}')]
    assert tool_calls[0].id
    assert events[-1].finish_reason == "function_call"


@given(
    st.text(max_size=40),
    st.text(max_size=40),
    st.lists(st.integers(min_value=0, max_value=40), max_size=6),
    st.integers(min_value=0, max_value=6),
)
async def test_any_split_of_deltas_reassembles(
    content: str, arguments: str, cuts: list[int], id_at: int
) -> None:
    def pieces(text: str) -> list[str]:
        points = sorted({min(cut, len(text)) for cut in cuts})
        return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]

    fragments = pieces(arguments)
    id_at = min(id_at, len(fragments) - 1)
    calls = [
        {"index": 0, "function": {"arguments": part}}
        | ({"id": "c1", "function": {"name": "f", "arguments": part}} if i == id_at else {})
        for i, part in enumerate(fragments)
    ]
    chunks = [delta(content=part) for part in pieces(content)]
    chunks += [delta(tool_calls=[call]) for call in calls]
    events = await events_of(reply(chunked(*(sse(c, done=False) for c in chunks), sse())))
    assert texts(events, "content") == content
    (tool_calls,) = [e.tool_calls for e in events if e.kind == "tool_calls"]
    assert tool_calls == (ToolCall("c1", "f", arguments or "{}"),)


async def test_done_without_trailing_blank_line_and_split_chunks() -> None:
    body = sse(delta(content="héllo"))[:-2]  # '... data: [DONE]' with no final blank line
    parts = [body[i : i + 3] for i in range(0, len(body), 3)]
    events = await events_of(reply(chunked(*parts)))
    assert [e.kind for e in events] == ["content", "done"]
    assert texts(events, "content") == "héllo"


async def test_anything_after_done_is_ignored() -> None:
    events = await events_of(reply(sse(delta(content="a")) + b"data: {garbage\n\n"))
    assert [e.kind for e in events] == ["content", "done"]


async def test_keepalive_comments_and_empty_data_are_skipped() -> None:
    body = b": OPENROUTER PROCESSING\n\ndata:\n\n" + sse(delta(content="a"))
    assert [e.kind for e in await events_of(reply(body))] == ["content", "done"]


# --- broken streams ------------------------------------------------------------------------


async def test_stream_without_done_is_a_drop_after_its_content() -> None:
    backend = make(reply(sse(delta(content="partial"), finish("stop"), done=False)))
    seen: list[StreamEvent] = []
    with pytest.raises(StreamDropError):
        async with backend.stream("m", USER, [], NO_PARAMS) as events:
            async for event in events:
                seen.append(event)
    assert seen == [StreamEvent("content", text="partial")]
    await backend.aclose()


@pytest.mark.parametrize("line", ["data: {not json", "data: [1, 2]", 'data: {"choices": "x"}'])
async def test_garbage_is_a_bad_response(line: str) -> None:
    with pytest.raises(BadResponseError, match="openai: bad stream payload"):
        await events_of(reply(sse(delta(content="a")).replace(b"data: [DONE]", line.encode())))


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        ({"code": 429, "message": "Rate limit exceeded"}, RateLimitError),
        ({"code": 502, "message": "Provider returned error"}, TransientError),
        ({"code": "503", "message": "overloaded"}, TransientError),
        (
            {"code": 400, "message": "This model's maximum context length is 8k"},
            ContextOverflowError,
        ),
        ({"code": "context_length_exceeded", "message": "too long"}, ContextOverflowError),
        ({"code": 403, "message": "moderation"}, BadResponseError),
        ({"message": "something broke"}, BadResponseError),
    ],
)
async def test_error_object_in_stream(error: dict[str, Any], expected: type[BackendError]) -> None:
    body = sse(delta(content="a"), {"id": "x", "object": "chat.completion.chunk", "error": error})
    with pytest.raises(expected, match=r"^openai: stream error") as caught:
        await events_of(reply(body))
    assert type(caught.value) is expected
    assert error["message"] in str(caught.value)


@pytest.mark.parametrize("usage_first", [False, True], ids=["with the error", "before it"])
def test_usage_of_a_failed_stream_comes_before_the_error(usage_first: bool) -> None:
    """OpenRouter bills a request that fails mid-stream and reports its usage with the
    error (or in a chunk before it): the usage event is out before the error is raised."""
    usage = {"prompt_tokens": 40, "completion_tokens": 3, "cost": 0.001}
    error = {
        "id": "x",
        "error": {"code": "server_error", "message": "Provider disconnected unexpectedly"},
        "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}],
    }
    chunks: list[dict[str, Any] | str] = [delta(content="par")]
    if usage_first:
        chunks.append({"id": "x", "choices": [], "usage": usage})
    else:
        error["usage"] = usage
    parser, out = OpenAIParser(), list[StreamEvent]()
    with pytest.raises(BadResponseError, match="Provider disconnected"):
        parser.feed(sse(*chunks, error, done=False), out)
    assert [e.kind for e in out] == ["content", "usage"]
    assert out[1].usage == Usage(input_tokens=40, output_tokens=3, cost=0.001)


async def test_error_string_in_stream() -> None:
    with pytest.raises(BadResponseError, match="stream error: went wrong"):
        await events_of(reply(sse({"error": "went wrong"})))


@pytest.mark.parametrize(
    "exc", [httpx.RemoteProtocolError("incomplete chunked read"), httpx.ReadTimeout("")]
)
async def test_transport_failure_mid_stream_is_transient(exc: Exception) -> None:
    body = chunked(sse(delta(content="a"), done=False), error=exc)
    with pytest.raises(TransientError) as caught:
        await events_of(reply(body))
    assert type(caught.value) is TransientError


async def test_connect_failure_is_transient() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused")

    with pytest.raises(TransientError, match="ConnectError"):
        await events_of(refuse)


async def test_json_error_with_status_200() -> None:
    body = b'{"error": {"message": "quota", "code": 429}}'
    with pytest.raises(RateLimitError, match="quota"):
        await events_of(reply(body, headers={"content-type": "application/json; charset=utf-8"}))


async def test_non_streamed_reply_is_a_bad_response() -> None:
    body = b'{"id": "x", "choices": [{"message": {"content": "hi"}}]}'
    with pytest.raises(BadResponseError, match="expected an event stream"):
        await events_of(reply(body, headers={"content-type": "application/json"}))


# --- HTTP errors ---------------------------------------------------------------------------


async def enter_fails(handler: Handler, expected: type[BackendError]) -> BackendError:
    backend = make(handler)
    with pytest.raises(expected) as caught:
        async with backend.stream("m", USER, [], NO_PARAMS):
            pytest.fail("a failed request must be raised by __aenter__")
    await backend.aclose()
    assert type(caught.value) is expected
    return caught.value


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({"retry-after": "7"}, 7.0),
        ({"retry-after-ms": "250", "retry-after": "7"}, 0.25),
        ({}, None),
    ],
)
async def test_429(headers: dict[str, str], seconds: float | None) -> None:
    body = b'{"error": {"message": "Rate limit reached", "type": "requests"}}'
    error = await enter_fails(reply(body, 429, headers), RateLimitError)
    assert isinstance(error, RateLimitError)
    assert error.retry_after == seconds
    assert str(error) == "openai: HTTP 429: Rate limit reached"


@pytest.mark.parametrize("status", [500, 503])
async def test_5xx_is_transient(status: int) -> None:
    await enter_fails(reply(b"<html>bad gateway</html>", status), TransientError)


async def test_400_context_overflow() -> None:
    body = b'{"error": {"message": "...", "code": "context_length_exceeded"}}'
    await enter_fails(reply(body, 400), ContextOverflowError)


async def test_400_tools_unsupported() -> None:
    body = b'{"error": {"message": "qwen:0.5b does not support tools"}}'
    await enter_fails(reply(body, 400), ToolUnsupportedError)


async def test_401_message_never_shows_the_key() -> None:
    body = f'{{"error": {{"message": "Incorrect API key provided: {KEY}."}}}}'.encode()
    error = await enter_fails(reply(body, 401), BadResponseError)
    assert KEY not in str(error)
    assert str(error).startswith("openai: HTTP 401: Incorrect API key provided")


# --- requests ------------------------------------------------------------------------------


async def test_request_body_shape() -> None:
    history = [
        Message("system", "be brief"),
        Message("user", "list files"),
        Message("assistant", "", reasoning="hmm", tool_calls=(ToolCall("c1", "ls", "{}"),)),
        Message("tool", "a.txt", tool_call_id="c1", name="ls"),
        Message("assistant", "done", reasoning="easy"),
    ]
    tool = Tool("ls", "list a directory", {"type": "object", "properties": {}})
    request = await request_of(history, [tool], GenerationParams(max_tokens=100, temperature=0.0))
    assert request.method == "POST"
    assert str(request.url) == "http://h/v1/chat/completions"
    assert request.headers["content-type"] == "application/json"
    assert json.loads(request.content) == {
        "model": "gpt-test",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 100,
        "temperature": 0.0,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "list files"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "content": "a.txt", "tool_call_id": "c1"},
            {"role": "assistant", "content": "done"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "ls",
                    "description": "list a directory",
                    "parameters": {"type": "object", "properties": {}},
                },
            }
        ],
    }


async def test_malformed_arguments_go_back_as_an_empty_object() -> None:
    """A call whose arguments came cut off or not as JSON is answered with a tool error;
    the call itself goes back with ``{}``, since servers that parse the history's
    arguments (vLLM, llama.cpp, Ollama) refuse the whole request otherwise."""
    calls = (
        ToolCall("c1", "ls", '{"path": "sr'),
        ToolCall("c2", "ls", "not json"),
        ToolCall("c3", "ls", "[1, 2]"),
        ToolCall("c4", "ls", '{"path": "."}'),
    )
    history = [Message("user", "go"), Message("assistant", "", tool_calls=calls)]
    request = await request_of(history)
    [assistant] = [m for m in json.loads(request.content)["messages"] if m["role"] == "assistant"]
    sent = [c["function"]["arguments"] for c in assistant["tool_calls"]]
    assert sent == ["{}", "{}", "{}", '{"path": "."}']


async def test_no_tools_and_no_params_are_not_sent() -> None:
    request = await request_of(api_key=None)
    body = json.loads(request.content)
    assert set(body) == {"model", "messages", "stream", "stream_options"}
    assert "authorization" not in request.headers


async def test_headers() -> None:
    request = await request_of(extra_headers={"X-Title": "ollie"})
    assert request.headers["authorization"] == f"Bearer {KEY}"
    assert request.headers["x-title"] == "ollie"


@pytest.mark.parametrize(
    ("given", "base"),
    [
        ("https://api.openai.com/v1", "https://api.openai.com/v1"),
        ("https://api.openai.com/v1/", "https://api.openai.com/v1"),
        ("https://api.openai.com", "https://api.openai.com/v1"),
        (" http://localhost:8000/ ", "http://localhost:8000/v1"),
        ("https://openrouter.ai/api", "https://openrouter.ai/api/v1"),
        ("https://openrouter.ai/api/v1", "https://openrouter.ai/api/v1"),
        ("https://open.bigmodel.cn/api/paas/v4", "https://open.bigmodel.cn/api/paas/v4"),
        (
            "https://generativelanguage.googleapis.com/v1beta/openai/",
            "https://generativelanguage.googleapis.com/v1beta/openai",
        ),
    ],
)
def test_base_url_with_or_without_version(given: str, base: str) -> None:
    assert normalize_base_url(given) == base


@pytest.mark.parametrize("url", ["localhost:8000", "ftp://h", "http://", "not a url"])
def test_bad_base_url(url: str) -> None:
    with pytest.raises(ValueError, match="URL"):
        normalize_base_url(url)


@pytest.mark.parametrize("url", ["http://h:1234", "http://h:1234/v1/"])
async def test_requests_reach_v1(url: str) -> None:
    assert str((await request_of(base_url=url)).url) == "http://h:1234/v1/chat/completions"


# --- models --------------------------------------------------------------------------------


MODEL_LIST = {
    "object": "list",
    "data": [
        {"id": "openai/gpt-4o", "object": "model", "context_length": 128000, "pricing": {}},
        {"id": "local", "object": "model", "max_model_len": 32768, "owned_by": "vllm"},
        {"id": "bare", "object": "model", "context_length": None},
    ],
}


def model_server(counter: list[str], status: int = 200) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        counter.append(str(request.url))
        return httpx.Response(status, json=MODEL_LIST if status == 200 else {"error": "down"})

    return handler


async def test_models_and_context_length() -> None:
    urls: list[str] = []
    backend = make(model_server(urls), default_context_length=4096)
    assert await backend.models() == ["openai/gpt-4o", "local", "bare"]
    assert await backend.context_length("openai/gpt-4o") == 128000
    assert await backend.context_length("local") == 32768
    assert await backend.context_length("bare") == 4096
    assert await backend.context_length("unknown") == 4096
    assert await backend.context_length("unknown") == 4096
    assert urls == ["https://api.example.com/v1/models"] * 4  # models(), then once per miss
    await backend.aclose()


async def test_context_length_falls_back_when_listing_fails() -> None:
    urls: list[str] = []
    backend = make(model_server(urls, status=503), default_context_length=4096)
    assert await backend.context_length("m") == 4096
    assert await backend.context_length("m") == 4096
    assert len(urls) == 2  # a failure is not cached
    with pytest.raises(TransientError):
        await backend.models()
    await backend.aclose()


async def test_bad_model_list() -> None:
    backend = make(lambda request: httpx.Response(200, json={"data": "nope"}))
    with pytest.raises(BadResponseError, match="bad model list"):
        await backend.models()
    await backend.aclose()


# --- pool ----------------------------------------------------------------------------------


async def test_pool_builds_openai_from_settings() -> None:
    assert backend_names() == ["openai", "anthropic", "ollama", "gemini", "copilot", "kiro"]
    backend = make_backend(
        "openai",
        {
            "OLLIE_OPENAI_URL": "http://localhost:8000",
            "OPENAI_API_KEY": KEY,
            "OLLIE_READ_TIMEOUT": "12.5",
            "OLLIE_CONTEXT_LENGTH": "8192",
        },
    )
    assert isinstance(backend, OpenAIBackend)
    assert (backend.name, backend.base_url) == ("openai", "http://localhost:8000/v1")
    assert backend._client.headers["authorization"] == f"Bearer {KEY}"
    assert backend._client.timeout == httpx.Timeout(12.5, connect=10.0)
    assert backend._default_context_length == 8192
    await backend.aclose()


async def test_pool_defaults_and_key_precedence() -> None:
    backend = make_backend("openai", {"OLLIE_OPENAI_KEY": "mine", "OPENAI_API_KEY": "theirs"})
    assert isinstance(backend, OpenAIBackend)
    assert backend.base_url == "https://api.openai.com/v1"
    assert backend._client.headers["authorization"] == "Bearer mine"
    assert backend._client.timeout.read == 300.0
    await backend.aclose()
    keyless = make_backend("openai", {})
    assert isinstance(keyless, OpenAIBackend)
    assert "authorization" not in keyless._client.headers
    await keyless.aclose()


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"OLLIE_READ_TIMEOUT": "soon"}, "OLLIE_READ_TIMEOUT"),
        ({"OLLIE_READ_TIMEOUT": "-1"}, "OLLIE_READ_TIMEOUT"),
        ({"OLLIE_CONTEXT_LENGTH": "8k"}, "OLLIE_CONTEXT_LENGTH"),
    ],
)
def test_pool_rejects_bad_numbers(settings: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_backend("openai", settings)


def test_pool_rejects_unknown_backend() -> None:
    with pytest.raises(ValueError, match=r"unknown backend 'nope'.*openai"):
        make_backend("nope", {})


def test_openai_backend_is_a_backend() -> None:
    backend: Backend = make(reply(sse()))  # checked by mypy against the protocol
    assert backend.name == "openai"


# --- real sockets --------------------------------------------------------------------------


class Loopback:
    """A bare HTTP/1.1 server on 127.0.0.1 that reads each request whole, then ``respond``s."""

    def __init__(self, respond: Callable[[trio.SocketStream], Awaitable[None]]) -> None:
        self.respond = respond
        self.connections = 0

    async def serve(self, nursery: trio.Nursery, read_timeout: float = 5.0) -> OpenAIBackend:
        listeners = await nursery.start(partial(trio.serve_tcp, self._handle, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        return OpenAIBackend("openai", f"http://127.0.0.1:{port}", None, read_timeout=read_timeout)

    async def _handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        buffer = b""
        while True:
            while b"\r\n\r\n" not in buffer:
                if not (data := await stream.receive_some()):
                    return
                buffer += data
            head, _, buffer = buffer.partition(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: *(\d+)", head)
            while len(buffer) < (size := int(length[1]) if length else 0):
                buffer += await stream.receive_some()
            buffer = buffer[size:]
            await self.respond(stream)


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


async def test_connection_is_reused_after_done() -> None:
    async def respond(stream: trio.SocketStream) -> None:
        await stream.send_all(STREAM_HEAD)
        for part in [sse(delta(content="a"), done=False), b"data: [DO", b"NE]\n\n", b""]:
            await stream.send_all(http_chunk(part))

    server = Loopback(respond)
    async with trio.open_nursery() as nursery:
        backend = await server.serve(nursery)
        for _ in range(2):
            async with backend.stream("m", USER, [], NO_PARAMS) as events:
                assert [e.kind async for e in events] == ["content", "done"]
        await backend.aclose()
        nursery.cancel_scope.cancel()
    assert server.connections == 1


async def test_hung_server_times_out_as_transient() -> None:
    async with trio.open_nursery() as nursery:
        backend = await Loopback(lambda stream: trio.sleep_forever()).serve(nursery, 0.2)
        with pytest.raises(TransientError, match="ReadTimeout"):
            async with backend.stream("m", USER, [], NO_PARAMS):
                pass
        await backend.aclose()
        nursery.cancel_scope.cancel()


async def test_abandoned_stream_leaves_nothing_behind() -> None:
    async def respond(stream: trio.SocketStream) -> None:
        await stream.send_all(STREAM_HEAD)
        for _ in range(3):
            await stream.send_all(http_chunk(sse(delta(content="a"), done=False)))
        await trio.sleep_forever()  # never finishes: the client must hang up

    async with trio.open_nursery() as nursery:
        backend = await Loopback(respond).serve(nursery)
        async with backend.stream("m", USER, [], NO_PARAMS) as events:
            async for event in events:
                assert set(event.text) == {"a"}  # one or more deltas, merged if read together
                break
        await backend.aclose()
        gc.collect()  # an unclosed async generator would warn here (an error under -W error)
        nursery.cancel_scope.cancel()


# --- a read's payloads decoded as one array -------------------------------------------------

_items = st.one_of(
    st.builds(lambda t: delta(content=t), st.text(min_size=1, max_size=8)),
    st.builds(lambda t: delta(reasoning_content=t), st.text(min_size=1, max_size=5)),
    st.builds(
        lambda i, a: delta(tool_calls=[{"index": i, "id": f"c{i}", "function": {"arguments": a}}]),
        st.integers(0, 1),
        st.text(max_size=4),
    ),
    st.just(finish("stop")),
    st.just({"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}),
    st.just({"error": {"message": "overloaded", "code": 529}}),
    st.builds(lambda t: delta(content=t * 100), st.text(min_size=6, max_size=8)),  # long
    st.sampled_from(
        ["not json", "[DONE]", "", "{}", '{"choices": 3}', '{"choices":[]},{"choices":[]}']
    ),
    st.just(json.dumps(delta(content="p")) + "," + json.dumps(delta(content="q"))),
)


class _OneByOne(SSEDecoder):
    """Never offers a read's payloads as a batch: the parser reads each one by itself."""

    def feed_array(self, chunk: bytes) -> None:
        return None


def _outcome(body: bytes, cuts: list[int], one_by_one: bool) -> tuple[list[StreamEvent], str]:
    parser = OpenAIParser()
    if one_by_one:
        parser._sse = _OneByOne()
    points = sorted({c % (len(body) + 1) for c in cuts})
    out: list[StreamEvent] = []
    read: list[StreamEvent] = []  # as the backend does: each read's deltas coalesced
    try:
        for a, b in zip([0, *points], [*points, len(body)], strict=True):
            read = []
            parser.feed(body[a:b], read)
            out += coalesce(read)
            if parser.done:
                break
        else:
            read = []
            parser.close(read)
            out += coalesce(read)
    except BackendError as err:
        return out + coalesce(read), f"{type(err).__name__}: {err}"
    return out, ""


@given(
    items=st.lists(_items, max_size=12),
    cuts=st.lists(st.integers(min_value=0), max_size=6),
    done=st.booleans(),
)
def test_batched_payloads_read_as_one_at_a_time(
    items: list[dict[str, Any] | str], cuts: list[int], done: bool
) -> None:
    """The array path gives the same events, the same error and the events before it as
    the payload-by-payload path, however the bytes are split into reads."""
    body = sse(*items, done=done)
    assert _outcome(body, cuts, False) == _outcome(body, cuts, True)


# --- tool calls and thinking written in the text ---------------------------------------------

LS = Tool("ls", "list a directory", {"type": "object", "properties": {}})
WRITTEN = sse(
    delta(content="<thi"),
    delta(content="nk>look first</think>\n\nOn it.\n<tool_"),
    delta(content='call>{"name": "ls", "arguments": {"path": "."}}</tool_call>'),
    finish("stop"),
)


async def stream_of(backend: OpenAIBackend, params: GenerationParams) -> list[StreamEvent]:
    try:
        async with backend.stream("m", USER, [LS], params) as events:
            return [event async for event in events]
    finally:
        await backend.aclose()


async def test_tool_calls_and_think_written_in_the_text_are_read() -> None:
    """Open models behind compatible servers write both into the content; the tags may
    be cut anywhere between deltas."""
    events = await stream_of(make(reply(WRITTEN)), NO_PARAMS)
    assert texts(events, "reasoning") == "look first"
    assert texts(events, "content") == "On it.\n"
    [calls] = [e.tool_calls for e in events if e.kind == "tool_calls"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("ls", {"path": "."})]
    assert calls[0].id.startswith("call_")
    assert events[-1].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    ("backend", "params"),
    [
        (lambda h: make(h), GenerationParams(text_tools=False)),  # a profile turned it off
        (  # Copilot serves hosted models with tool calls of their own: off by default
            lambda h: CopilotBackend(
                "copilot", "gho_x", api_url="http://h", transport=httpx.MockTransport(h)
            ),
            NO_PARAMS,
        ),
    ],
    ids=["textToolCalls false", "copilot"],
)
async def test_text_stays_text_when_not_read(
    backend: Callable[[Handler], OpenAIBackend], params: GenerationParams
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/token"):
            return httpx.Response(200, json={"token": "t", "refresh_in": 1500})
        return reply(WRITTEN)(request)

    events = await stream_of(backend(handler), params)
    assert texts(events, "content") == (
        '<think>look first</think>\n\nOn it.\n<tool_call>{"name": "ls", "arguments": '
        '{"path": "."}}</tool_call>'
    )
    assert not [e for e in events if e.kind in ("tool_calls", "reasoning")]


def test_plain_text_keeps_one_event_per_read() -> None:
    """Reading the text costs the fast path nothing: a read of many text payloads is
    still one content event, the same as with nothing read out of the text."""
    plain = [sse(*(delta(content=f"word {i}, {{x}} ") for i in range(50)), done=False)] * 3
    for text in (None, TextTools(["ls"])):
        parser = OpenAIParser(text=text)
        parser.feed(plain[0], [])  # (the first read of a stream takes the general path)
        for read in plain[1:]:
            out = list[StreamEvent]()
            parser.feed(read, out)
            assert out == [
                StreamEvent("content", text="".join(f"word {i}, {{x}} " for i in range(50)))
            ]
