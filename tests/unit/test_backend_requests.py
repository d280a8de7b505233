"""What each provider module sends, and the parts of its reading the SDKs do not cover.

Requests are captured with ``httpx.MockTransport`` (pure translation, no network); the
streams read here are small canned ones aimed at one rule each. The SDK comparisons of
whole streams live in tests/contract/.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import pytest

from olliefs.backend.anthropic import AnthropicBackend, AnthropicParser, server_result_text
from olliefs.backend.anthropic import request_body as anthropic_body
from olliefs.backend.base import (
    Backend,
    BadResponseError,
    ContextOverflowError,
    GenerationParams,
    Message,
    ProviderBackend,
    RateLimitError,
    ResponseSchema,
    StreamEvent,
    Tool,
    ToolCall,
    TransientError,
    Usage,
)
from olliefs.backend.copilot import CopilotBackend
from olliefs.backend.gemini import GeminiBackend, GeminiParser, retry_delay
from olliefs.backend.gemini import request_body as gemini_body
from olliefs.backend.kiro import KiroBackend, conversation
from olliefs.backend.ollama import OllamaBackend, OllamaParser, context_of
from olliefs.backend.ollama import _Show as OllamaShow
from olliefs.backend.ollama import request_body as ollama_body
from olliefs.backend.openai import OpenAIBackend, OpenAIParser, is_reasoning_model
from olliefs.backend.openai import request_body as openai_body
from olliefs.backend.stream import parse_all

KEY = "sk-unit-0123456789abcdef"
TOOL = Tool(
    "ls", "list a directory", {"type": "object", "properties": {"path": {"type": "string"}}}
)
Handler = Callable[[httpx.Request], httpx.Response]

THINKING = {
    "anthropic": {
        "thinking": [
            {"type": "thinking", "thinking": "hmm", "signature": "sig=="},
            {"type": "redacted_thinking", "data": "opaque"},
        ]
    }
}
HISTORY = [
    Message("system", "be brief"),
    Message("user", "list both"),
    Message(
        "assistant",
        "sure",
        reasoning="hmm",
        tool_calls=(ToolCall("c1", "ls", '{"path": "a"}'), ToolCall("c2", "ls", "{}")),
        provider_data=THINKING,
    ),
    Message("tool", "a.txt", tool_call_id="c1", name="ls"),
    Message("tool", "b.txt", tool_call_id="c2", name="ls"),
    Message("user", "and now?"),
]


def capture(reply: httpx.Response) -> tuple[list[httpx.Request], httpx.MockTransport]:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return reply

    return seen, httpx.MockTransport(handler)


async def drain(backend: Backend, messages: list[Message] = HISTORY) -> list[StreamEvent]:
    async with backend.stream("m", messages, [TOOL], GenerationParams()) as events:
        return [e async for e in events]


# ---- Anthropic --------------------------------------------------------------------------------


def test_anthropic_body_shape() -> None:
    body = anthropic_body("claude-sonnet-4-5", HISTORY, [TOOL], GenerationParams(max_tokens=100))
    assert body["system"] == [
        {"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}
    ]
    assert body["tools"] == [
        {
            "name": "ls",
            "description": "list a directory",
            "input_schema": TOOL.parameters,
            "cache_control": {"type": "ephemeral"},
        }
    ]
    assert body["max_tokens"] == 100 and body["stream"] is True
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "list both"}]},
        {
            "role": "assistant",
            "content": [
                *THINKING["anthropic"]["thinking"],  # verbatim, before the tool calls
                {"type": "text", "text": "sure"},
                {"type": "tool_use", "id": "c1", "name": "ls", "input": {"path": "a"}},
                {"type": "tool_use", "id": "c2", "name": "ls", "input": {}},
            ],
        },
        {  # consecutive tool results and the next prompt: one user message, results first
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "c1", "content": "a.txt"},
                {"type": "tool_result", "tool_use_id": "c2", "content": "b.txt"},
                {"type": "text", "text": "and now?"},
            ],
        },
    ]


def test_anthropic_caches_the_two_latest_large_tool_results() -> None:
    big = "x" * 5000
    history = [Message("user", "go")]
    for i in range(4):
        call = ToolCall(f"c{i}", "ls", "{}")
        history += [
            Message("assistant", tool_calls=(call,)),
            Message("tool", big, tool_call_id=f"c{i}"),
        ]
    history.append(Message("tool", "small", tool_call_id="c3"))
    body = anthropic_body("m", history, [TOOL], GenerationParams())
    marked = [
        block["tool_use_id"]
        for message in body["messages"]
        for block in message["content"]
        if "cache_control" in block
    ]
    assert marked == ["c2", "c3"]
    # with no system prompt and no tools, still at most two: four breakpoints in all
    body = anthropic_body("m", history, [], GenerationParams())
    assert sum("cache_control" in b for m in body["messages"] for b in m["content"]) == 2


def test_anthropic_thinking_budget() -> None:
    params = GenerationParams(max_tokens=2000, temperature=0.2, thinking_budget=500)
    body = anthropic_body("claude-sonnet-4-5", [Message("user", "hi")], [], params)
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 1024}  # the API minimum
    assert body["max_tokens"] == 2000
    assert "temperature" not in body  # refused together with thinking
    body = anthropic_body("m", [Message("user", "hi")], [], GenerationParams(thinking_budget=9000))
    assert body["max_tokens"] > 9000  # max_tokens must exceed the budget
    body = anthropic_body(
        "claude-3-haiku-20240307", [Message("user", "hi")], [], GenerationParams()
    )
    assert body["max_tokens"] == 4096 and "thinking" not in body


def test_anthropic_leaves_out_empty_blocks_and_foreign_provider_data() -> None:
    history = [
        Message("user", "hi"),
        Message("assistant", "", reasoning="cut short"),  # stopped before saying anything
        Message("user", ""),
        Message("user", "again", provider_data={"gemini": {"signatures": []}}),
        Message("assistant", "ok", provider_data={"openai": {"reasoning_details": [1]}}),
    ]
    body = anthropic_body("m", history, [], GenerationParams())
    assert body["messages"] == [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "again"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
    ]


async def test_anthropic_request_headers_and_url() -> None:
    seen, transport = capture(httpx.Response(200, headers={"content-type": "text/event-stream"}))
    for url in ("https://api.anthropic.com", "https://api.anthropic.com/v1/"):
        backend = AnthropicBackend("anthropic", url, KEY, transport=transport)
        with pytest.raises(TransientError):  # an empty body: dropped
            await drain(backend)
        await backend.aclose()
    for request in seen:
        assert str(request.url) == "https://api.anthropic.com/v1/messages"
        assert request.headers["x-api-key"] == KEY
        assert request.headers["anthropic-version"] == "2023-06-01"


def anthropic_events(*events: dict[str, Any]) -> list[bytes]:
    return [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events]


def test_anthropic_usage_counts_cache_in_input_and_later_totals_win() -> None:
    start = {
        "type": "message_start",
        "message": {
            "id": "msg_1",
            "usage": {
                "input_tokens": 10,
                "cache_read_input_tokens": 100,
                "cache_creation_input_tokens": 1000,
                "output_tokens": 1,
            },
        },
    }
    delta = {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens"},
        "usage": {"output_tokens": 7, "cache_read_input_tokens": 200},
    }
    events = parse_all(AnthropicParser(), anthropic_events(start, delta, {"type": "message_stop"}))
    assert events == [
        StreamEvent(
            "usage",
            usage=Usage(
                input_tokens=1210,
                output_tokens=7,
                cached_input_tokens=200,
                cache_creation_tokens=1000,
            ),
        ),
        StreamEvent("done", finish_reason="length", response_id="msg_1"),
    ]


def server_tool_stream() -> list[bytes]:
    """Text, a web search the provider ran (its input in two deltas, its result whole at
    its start), more text, then a tool call of ours."""
    search = {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}
    found = [
        {
            "type": "web_search_result",
            "title": "Paris",
            "url": "https://example.org/paris",
            "encrypted_content": "EqgfCioIARgBIiQ3",
            "page_age": None,
        }
    ]
    result = {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": found}
    call = {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {}}

    def delta(index: int, **fields: Any) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": index, "delta": fields}

    def block(index: int, start: dict[str, Any], *deltas: dict[str, Any]) -> list[dict[str, Any]]:
        begin = {"type": "content_block_start", "index": index, "content_block": start}
        return [begin, *deltas, {"type": "content_block_stop", "index": index}]

    return anthropic_events(
        {"type": "message_start", "message": {"id": "m"}},
        *block(0, {"type": "text", "text": ""}, delta(0, type="text_delta", text="Looking.")),
        *block(
            1,
            search,
            delta(1, type="input_json_delta", partial_json='{"query": '),
            delta(1, type="input_json_delta", partial_json='"capital of France"}'),
        ),
        *block(2, result),
        *block(3, {"type": "text", "text": ""}, delta(3, type="text_delta", text="Paris.")),
        *block(4, call, delta(4, type="input_json_delta", partial_json='{"path": "."}')),
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}},
        {"type": "message_stop"},
    )


def test_anthropic_server_tools_are_shown_and_kept_never_called() -> None:
    """A tool the provider ran itself is no tool call of ours: it is reported (for chat)
    and kept verbatim, where it stood in the text, for the next request."""
    events = parse_all(AnthropicParser(), server_tool_stream())
    assert [e.kind for e in events] == [
        "content",
        "server_call",
        "server_result",
        "content",
        "usage",
        "tool_calls",
        "done",
    ]
    [call] = events[1].tool_calls
    assert (call.id, call.name, json.loads(call.arguments)) == (
        "srvtoolu_1",
        "web_search",
        {"query": "capital of France"},
    )
    assert events[2].tool_calls == (ToolCall("srvtoolu_1", "web_search", ""),)
    assert events[2].text == ("[run by anthropic] 1 found:\nParis <https://example.org/paris>")
    assert events[5].tool_calls == (ToolCall("toolu_1", "ls", '{"path": "."}'),)
    done = events[-1]
    reply = Message(
        "assistant",
        "Looking.Paris.",
        tool_calls=events[5].tool_calls,
        provider_data=done.provider_data,
    )
    body = anthropic_body("claude-x", [Message("user", "go"), reply], [TOOL], GenerationParams())
    blocks = body["messages"][1]["content"]
    assert [b["type"] for b in blocks] == [
        "text",
        "server_tool_use",
        "web_search_tool_result",
        "text",
        "tool_use",
    ]
    assert blocks[0]["text"] == "Looking." and blocks[3]["text"] == "Paris."
    assert blocks[1] == {
        "type": "server_tool_use",
        "id": "srvtoolu_1",
        "name": "web_search",
        "input": {"query": "capital of France"},
    }
    assert blocks[2]["content"][0]["encrypted_content"] == "EqgfCioIARgBIiQ3"  # verbatim


@pytest.mark.parametrize(
    ("content", "shown"),
    [
        (
            {"type": "web_search_tool_result_error", "error_code": "max_uses_exceeded"},
            "error: max_uses_exceeded",
        ),
        (
            {"type": "code_execution_result", "stdout": "4\n", "stderr": "", "return_code": 0},
            "4\n(exit status 0)",
        ),
        (
            {"type": "web_fetch_result", "url": "https://example.org/"},
            "fetched <https://example.org/>",
        ),
        ([{"type": "text", "text": "from the MCP server"}], "from the MCP server"),
        ({"type": "future_result", "n": 1}, '{"type":"future_result","n":1}'),
    ],
)
def test_anthropic_server_tool_results_in_a_few_words(content: Any, shown: str) -> None:
    assert server_result_text({"type": "x_tool_result", "content": content}) == shown


def test_anthropic_signature_delta_replaces() -> None:
    events = anthropic_events(
        {"type": "message_start", "message": {"id": "m"}},
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "thinking", "thinking": ""},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "signature_delta", "signature": "a"},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "signature_delta", "signature": "b"},
        },
        {"type": "message_stop"},
    )
    done = parse_all(AnthropicParser(), events)[-1]
    assert done.provider_data == {
        "anthropic": {"thinking": [{"type": "thinking", "thinking": "", "signature": "b"}]}
    }


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("overloaded_error", TransientError),
        ("api_error", TransientError),
        ("rate_limit_error", RateLimitError),
        ("invalid_request_error", BadResponseError),
    ],
)
def test_anthropic_error_event(kind: str, expected: type[Exception]) -> None:
    events = anthropic_events(
        {"type": "message_start", "message": {"id": "m"}},
        {"type": "error", "error": {"type": kind, "message": "Overloaded"}},
    )
    with pytest.raises(expected, match=f"^anthropic: stream error {kind}: Overloaded"):
        parse_all(AnthropicParser(), events)


def test_anthropic_overflow_error_event() -> None:
    events = anthropic_events(
        {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": "prompt is too long"},
        }
    )
    with pytest.raises(ContextOverflowError):
        parse_all(AnthropicParser(), events)


# ---- Ollama -----------------------------------------------------------------------------------


def test_ollama_body_shape() -> None:
    params = GenerationParams(
        max_tokens=50, temperature=0.5, presence_penalty=0.1, thinking_budget=0
    )
    body = ollama_body("qwen3", HISTORY, [TOOL], params, num_ctx=8192)
    assert body["options"] == {
        "num_predict": 50,
        "temperature": 0.5,
        "presence_penalty": 0.1,
        "num_ctx": 8192,
    }
    assert body["think"] is False and body["stream"] is True
    assistant = body["messages"][2]
    assert assistant == {
        "role": "assistant",
        "content": "sure",
        "thinking": "hmm",
        "tool_calls": [
            {"function": {"name": "ls", "arguments": {"path": "a"}}},  # an object, not text
            {"function": {"name": "ls", "arguments": {}}},
        ],
    }
    assert body["messages"][3] == {"role": "tool", "content": "a.txt", "tool_name": "ls"}
    assert "options" not in ollama_body("m", HISTORY, [], GenerationParams())


@pytest.mark.parametrize(
    "url",
    [
        "http://localhost:11434",
        "http://localhost:11434/",
        "http://localhost:11434/v1",
        "http://localhost:11434/api",
    ],
)
async def test_ollama_url_forms_reach_api_chat(url: str) -> None:
    seen, transport = capture(httpx.Response(200, headers={"content-type": "application/x-ndjson"}))
    backend = OllamaBackend("ollama", url, transport=transport)
    with pytest.raises(TransientError):
        await drain(backend)
    await backend.aclose()
    assert str(seen[0].url) == "http://localhost:11434/api/chat"
    assert "authorization" not in seen[0].headers


def test_ollama_done_line_content_is_kept_and_string_arguments_pass() -> None:
    call = {"function": {"name": "f", "arguments": '{"x": 1}'}}
    last = {"message": {"content": "b"}, "done": True, "done_reason": "length", "eval_count": 4}
    lines = [
        b'{"message": {"content": "a"}, "done": false}\n',
        json.dumps({"message": {"content": "", "tool_calls": [call]}, "done": False}).encode(),
        b"\n" + json.dumps(last).encode(),  # no newline after the last line
    ]
    events = parse_all(OllamaParser(), lines)
    assert "".join(e.text for e in events if e.kind == "content") == "ab"
    [calls] = [e.tool_calls for e in events if e.kind == "tool_calls"]
    assert (calls[0].name, calls[0].arguments) == ("f", '{"x": 1}')
    assert events[-1].finish_reason == "tool_calls"


async def test_ollama_reads_a_call_and_thinking_written_in_the_text() -> None:
    """A model whose template Ollama does not parse writes both into the content (a
    bare JSON call here, Llama 3's "parameters"); the backend reads them unless the
    request's parameters say not to."""
    pieces = ["<think>", "the dir</think>\n", '{"name": "ls", ', '"parameters": {"path": "."}}']
    lines = [
        json.dumps({"message": {"content": p}, "done": False}).encode() + b"\n" for p in pieces
    ]
    lines.append(b'{"message": {"content": ""}, "done": true, "done_reason": "stop"}\n')

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200, headers={"content-type": "application/x-ndjson"}, content=b"".join(lines)
        )

    for params, read in ((GenerationParams(), True), (GenerationParams(text_tools=False), False)):
        backend = OllamaBackend("ollama", "http://h", transport=httpx.MockTransport(handler))
        async with backend.stream("m", HISTORY, [TOOL], params) as stream:
            events = [e async for e in stream]
        await backend.aclose()
        calls = [c for e in events if e.kind == "tool_calls" for c in e.tool_calls]
        content = "".join(e.text for e in events if e.kind == "content")
        if read:
            assert [(c.name, json.loads(c.arguments)) for c in calls] == [("ls", {"path": "."})]
            assert content == "" and events[-1].finish_reason == "tool_calls"
            assert "".join(e.text for e in events if e.kind == "reasoning") == "the dir"
        else:
            assert not calls and content == "".join(pieces)


def test_ollama_context_from_show() -> None:
    show = OllamaShow(model_info={"general.architecture": "qwen3", "qwen3.context_length": 40960})
    assert context_of(show) == 40960
    assert context_of(msgspec.structs.replace(show, parameters="stop <x>\nnum_ctx 8192")) == 8192
    assert context_of(OllamaShow()) is None


async def test_ollama_context_length_cached_until_the_model_changes() -> None:
    asked: list[str] = []
    digest = ["aaa"]

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        if request.url.path == "/api/tags":
            return httpx.Response(
                200, json={"models": [{"name": "m", "model": "m", "digest": digest[0]}]}
            )
        return httpx.Response(200, json={"model_info": {"x.context_length": 1000 * len(asked)}})

    backend = OllamaBackend(
        "ollama", "http://h", transport=httpx.MockTransport(handler), num_ctx=2500
    )
    assert await backend.context_length("m") == 1000
    assert await backend.context_length("m") == 1000  # cached
    assert await backend.models() == ["m"]
    assert await backend.context_length("m") == 1000  # same digest: still cached
    digest[0] = "bbb"
    backend.forget()
    assert await backend.models() == ["m"]  # the digest moved: the length is asked again
    assert await backend.context_length("m") == 2500  # 5000 reported, capped by num_ctx
    assert asked == ["/api/show", "/api/tags", "/api/tags", "/api/show"]
    await backend.aclose()


# ---- Gemini -----------------------------------------------------------------------------------


def test_gemini_body_shape() -> None:
    history = [
        *HISTORY[:2],
        Message(
            "assistant",
            "sure",
            tool_calls=(ToolCall("c1", "ls", '{"path": "a"}'), ToolCall("c2", "ls", "{}")),
            provider_data={"gemini": {"signatures": [{"call": "c1", "signature": "U0lH"}]}},
        ),
        *HISTORY[3:],
    ]
    params = GenerationParams(max_tokens=64, temperature=0.1, thinking_budget=2048)
    body = gemini_body(history, [TOOL], params)
    assert body["systemInstruction"] == {"parts": [{"text": "be brief"}]}
    assert body["tools"] == [
        {
            "functionDeclarations": [
                {
                    "name": "ls",
                    "description": "list a directory",
                    "parametersJsonSchema": TOOL.parameters,
                }
            ]
        }
    ]
    assert body["generationConfig"] == {
        "maxOutputTokens": 64,
        "temperature": 0.1,
        "thinkingConfig": {"thinkingBudget": 2048, "includeThoughts": True},
    }
    assert body["contents"] == [
        {"role": "user", "parts": [{"text": "list both"}]},
        {
            "role": "model",
            "parts": [
                {"text": "sure"},
                {
                    "functionCall": {"name": "ls", "args": {"path": "a"}, "id": "c1"},
                    "thoughtSignature": "U0lH",
                },
                {"functionCall": {"name": "ls", "args": {}, "id": "c2"}},
            ],
        },
        {
            "role": "user",
            "parts": [
                {"functionResponse": {"name": "ls", "response": {"output": "a.txt"}, "id": "c1"}},
                {"functionResponse": {"name": "ls", "response": {"output": "b.txt"}, "id": "c2"}},
                {"text": "and now?"},
            ],
        },
    ]


@pytest.mark.parametrize(
    "url",
    [
        "https://generativelanguage.googleapis.com",
        "https://generativelanguage.googleapis.com/v1beta/",
    ],
)
async def test_gemini_request_url_and_key(url: str) -> None:
    seen, transport = capture(httpx.Response(200, headers={"content-type": "text/event-stream"}))
    backend = GeminiBackend("gemini", url, KEY, transport=transport)
    with pytest.raises(TransientError, match="gemini: the stream ended"):
        await drain(backend)
    await backend.aclose()
    assert str(seen[0].url) == (
        "https://generativelanguage.googleapis.com/v1beta/models/m:streamGenerateContent?alt=sse"
    )
    assert seen[0].headers["x-goog-api-key"] == KEY
    assert KEY not in str(seen[0].url)


def test_gemini_retry_info() -> None:
    detail = {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "37s"}
    assert retry_delay([{"@type": "x"}, detail]) == 37.0
    assert retry_delay([{"@type": "RetryInfo", "retryDelay": "soon"}]) is None
    assert retry_delay(None) is None


def test_gemini_prompt_blocked_ends_the_reply() -> None:
    blocked = {
        "promptFeedback": {"blockReason": "SAFETY"},
        "usageMetadata": {"promptTokenCount": 5},
    }
    data = b"data: " + json.dumps(blocked).encode() + b"\r\n\r\n"
    events = parse_all(GeminiParser(), [data])
    assert [e.kind for e in events] == ["usage", "done"]
    assert events[-1].finish_reason == "content_filter"


async def test_gemini_models_follow_pages_and_give_context_lengths() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.params.get("pageToken") == "p2":
            return httpx.Response(
                200, json={"models": [{"name": "models/b", "inputTokenLimit": 32768}]}
            )
        embed = {"name": "models/e", "supportedGenerationMethods": ["embedContent"]}
        page = {
            "models": [{"name": "models/a", "inputTokenLimit": 1000}, embed],
            "nextPageToken": "p2",
        }
        return httpx.Response(200, json=page)

    backend = GeminiBackend("gemini", "http://h", KEY, transport=httpx.MockTransport(handler))
    assert await backend.models() == ["a", "b"]
    assert await backend.context_length("models/b") == 32768
    assert await backend.context_length("unknown") == 1048576
    await backend.aclose()


# ---- OpenAI details ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "reasoning"),
    [
        ("o3-mini", True),
        ("openai/o1", True),
        ("gpt-5", True),
        ("gpt-5-mini", True),
        ("gpt-5-chat-latest", False),
        ("gpt-4o", False),
        ("o", False),
        ("ollama3", False),
    ],
)
def test_reasoning_models(model: str, reasoning: bool) -> None:
    assert is_reasoning_model(model) is reasoning


def test_openai_reasoning_model_request() -> None:
    params = GenerationParams(
        max_tokens=500, temperature=0.3, presence_penalty=1.0, thinking_budget=20000
    )
    body = openai_body("o4-mini", [Message("user", "hi")], [], params)
    assert body["max_completion_tokens"] == 500 and "max_tokens" not in body
    assert "temperature" not in body and "presence_penalty" not in body
    assert body["reasoning_effort"] == "high"
    plain = openai_body("gpt-4o", [Message("user", "hi")], [], params)
    assert (plain["max_tokens"], plain["temperature"]) == (500, 0.3)
    assert "reasoning_effort" not in plain and "reasoning" not in plain
    routed = openai_body(
        "anthropic/claude-sonnet-4", [Message("user", "hi")], [], params, openrouter=True
    )
    assert routed["reasoning"] == {"max_tokens": 20000}
    assert (
        openai_body("gpt-5", [], [], GenerationParams(thinking_budget=0))["reasoning_effort"]
        == "minimal"
    )


def test_openai_reasoning_details_go_back_with_the_message() -> None:
    details = [{"type": "reasoning.encrypted", "data": "xyz", "index": 0}]
    message = Message("assistant", "hi", provider_data={"openai": {"reasoning_details": details}})
    body = openai_body("m", [message, Message("assistant", "no details")], [], GenerationParams())
    assert body["messages"][0]["reasoning_details"] == details
    assert "reasoning_details" not in body["messages"][1]


def test_openai_cache_write_tokens() -> None:
    chunk = {
        "choices": [],
        "usage": {
            "prompt_tokens": 100,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 10, "cache_write_tokens": 50},
        },
    }
    events = parse_all(OpenAIParser(), [f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()])
    assert events[0].usage == Usage(
        input_tokens=100, output_tokens=2, cached_input_tokens=10, cache_creation_tokens=50
    )


async def test_openai_context_length_from_every_listing_shape() -> None:
    data = [
        {"id": "router", "top_provider": {"context_length": 64000}},
        {
            "id": "copilot",
            "capabilities": {
                "limits": {"max_context_window_tokens": 90000, "max_prompt_tokens": 80000}
            },
        },
        {"id": "vllm", "max_model_len": 32768},
        {"id": "bare"},
    ]
    backend = OpenAIBackend(
        "openai",
        "http://h",
        None,
        transport=httpx.MockTransport(lambda r: httpx.Response(200, json={"data": data})),
        default_context_length=4096,
    )
    assert [await backend.context_length(m) for m in ("router", "copilot", "vllm", "bare")] == [
        64000,
        80000,
        32768,
        4096,
    ]
    await backend.aclose()


# ---- Copilot ----------------------------------------------------------------------------------


class FakeGitHub:
    """The token exchange and Copilot's API, as far as this backend relies on them."""

    def __init__(self) -> None:
        self.exchanges = 0
        self.requests: list[httpx.Request] = []
        self.chat_status = 200
        self.revoked: set[str] = set()  # Copilot tokens the API refuses (401)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.url.host == "api.github.com":
            self.exchanges += 1
            token = f"tid=copilot-{self.exchanges}"
            reply = {
                "token": token,
                "refresh_in": 1500,
                "expires_at": 10**10,
                "endpoints": {"api": "https://api.business.githubcopilot.com"},
            }
            return httpx.Response(200, json=reply)
        status = self.chat_status
        if request.headers["authorization"].removeprefix("Bearer ") in self.revoked:
            status = 401
        if status != 200:
            return httpx.Response(
                status,
                json={"error": {"message": f"token {request.headers['authorization']} expired"}},
            )
        body = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\ndata: [DONE]\n\n'
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)


async def test_copilot_token_exchange_refresh_and_headers() -> None:
    github, now = FakeGitHub(), [1000.0]
    backend = CopilotBackend(
        "copilot", "gho_secret", transport=httpx.MockTransport(github), clock=lambda: now[0]
    )
    for _ in range(2):
        assert [e.text for e in await drain(backend) if e.kind == "content"] == ["hi"]
    assert github.exchanges == 1
    exchange, chat = github.requests[0], github.requests[1]
    assert exchange.headers["authorization"] == "token gho_secret"
    assert str(chat.url) == "https://api.business.githubcopilot.com/chat/completions"
    assert chat.headers["authorization"] == "Bearer tid=copilot-1"
    for name in ("editor-version", "editor-plugin-version", "copilot-integration-id", "user-agent"):
        assert chat.headers[name]
    now[0] += 1500  # refresh_in less a minute has passed
    await drain(backend)
    assert github.exchanges == 2
    # A token revoked before its time: the 401 renews it and the request goes again,
    # so the turn goes on.
    github.revoked.add("tid=copilot-2")
    assert [e.text for e in await drain(backend) if e.kind == "content"] == ["hi"]
    assert github.exchanges == 3
    chats = [r.headers["authorization"] for r in github.requests if r.url.host != "api.github.com"]
    assert chats[-2:] == ["Bearer tid=copilot-2", "Bearer tid=copilot-3"]
    # Refused again with the new token: one renewal only, then the error.
    github.chat_status = 401
    with pytest.raises(BadResponseError) as caught:
        await drain(backend)
    assert github.exchanges == 4
    assert "tid=copilot" not in str(caught.value) and "***" in str(caught.value)
    assert str(caught.value).startswith("copilot: HTTP 401")
    github.chat_status = 200
    await drain(backend)  # the 401 dropped the token: exchanged again
    assert github.exchanges == 5
    await backend.aclose()


async def test_copilot_without_a_token_says_what_to_set() -> None:
    backend = CopilotBackend("copilot", None, transport=httpx.MockTransport(FakeGitHub()))
    with pytest.raises(BadResponseError, match="OLLIE_COPILOT_KEY"):
        await drain(backend)
    await backend.aclose()


# ---- Kiro -------------------------------------------------------------------------------------


def test_kiro_conversation_state() -> None:
    state = conversation("claude-sonnet-4", HISTORY, [TOOL], "conv-1")
    user = {"modelId": "claude-sonnet-4", "origin": "AI_EDITOR"}
    assert state["chatTriggerType"] == "MANUAL" and state["conversationId"] == "conv-1"
    assert state["history"] == [
        {"userInputMessage": {"content": "be brief\n\nlist both", **user}},
        {
            "assistantResponseMessage": {
                "content": "sure",
                "toolUses": [
                    {"toolUseId": "c1", "name": "ls", "input": {"path": "a"}},
                    {"toolUseId": "c2", "name": "ls", "input": {}},
                ],
            }
        },
    ]
    assert state["currentMessage"] == {
        "userInputMessage": {
            "content": "and now?",
            **user,
            "userInputMessageContext": {
                "toolResults": [
                    {"toolUseId": "c1", "content": [{"text": "a.txt"}], "status": "success"},
                    {"toolUseId": "c2", "content": [{"text": "b.txt"}], "status": "success"},
                ],
                "tools": [
                    {
                        "toolSpecification": {
                            "name": "ls",
                            "description": "list a directory",
                            "inputSchema": {"json": TOOL.parameters},
                        }
                    }
                ],
            },
        }
    }


async def test_kiro_refresh_token_flow_and_model_fallback() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/refreshToken":
            return httpx.Response(
                200, json={"accessToken": "kiro-access-1", "expiresIn": 3600, "profileArn": "arn:p"}
            )
        return httpx.Response(404, json={"message": "not here"})

    backend = KiroBackend(
        "kiro",
        "https://q.example",
        None,
        refresh_token="rt-secret",
        auth_url="https://auth.example/refreshToken",
        transport=httpx.MockTransport(handler),
    )
    assert await backend.models() == [
        "claude-sonnet-4",
        "claude-sonnet-4.5",
        "claude-haiku-4.5",
        "claude-3.7-sonnet",
    ]
    assert json.loads(seen[0].content) == {"refreshToken": "rt-secret"}
    assert seen[1].headers["authorization"] == "Bearer kiro-access-1"
    assert seen[1].url.params["profileArn"] == "arn:p"
    with pytest.raises(BadResponseError) as caught:
        await drain(backend)
    assert str(caught.value).startswith("kiro: HTTP 404")
    assert json.loads(seen[-1].content)["profileArn"] == "arn:p"
    await backend.aclose()


# ---- every backend ----------------------------------------------------------------------------


def all_backends(transport: httpx.AsyncBaseTransport) -> list[ProviderBackend]:
    return [
        OpenAIBackend("openai", "http://h", KEY, transport=transport),
        AnthropicBackend("anthropic", "http://h", KEY, transport=transport),
        OllamaBackend("ollama", "http://h", KEY, transport=transport),
        GeminiBackend("gemini", "http://h", KEY, transport=transport),
        KiroBackend("kiro", "http://h", KEY, transport=transport),
    ]


@pytest.mark.parametrize("status", [401, 403, 429, 500, 529])
async def test_error_messages_name_provider_and_status_never_the_key(status: int) -> None:
    body = json.dumps({"error": {"message": f"bad key {KEY}"}, "message": f"bad key {KEY}"})
    transport = httpx.MockTransport(lambda r: httpx.Response(status, text=body))
    for backend in all_backends(transport):
        with pytest.raises(Exception) as caught:
            await drain(backend)
        message = str(caught.value)
        assert message.startswith(f"{backend.name}: HTTP {status}: bad key ***"), message
        assert KEY not in message
        await backend.aclose()


async def test_every_backend_has_a_default_model() -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(500))
    defaults = {b.name: b.default_model for b in all_backends(transport)}
    assert all(defaults.values()) and len(set(defaults.values())) == len(defaults)
    for backend in all_backends(transport):
        await backend.aclose()


# ---- structured output ------------------------------------------------------------------------

ANSWER = ResponseSchema(
    "answer",
    {
        "type": "object",
        "properties": {"goal": {"type": "string"}, "steps": {"type": "array", "items": {}}},
        "required": ["goal", "steps"],
        "additionalProperties": False,
    },
)
ASKED = GenerationParams(max_tokens=100, temperature=0.2, response_schema=ANSWER)


@pytest.mark.parametrize("openrouter", [False, True])
def test_structured_output_on_the_openai_wire(openrouter: bool) -> None:
    """Copilot and OpenRouter send the same body."""
    body = openai_body("gpt-4o", HISTORY, [], ASKED, openrouter=openrouter)
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": ANSWER.schema, "strict": True},
    }
    assert "response_format" not in openai_body("gpt-4o", HISTORY, [], GenerationParams())


def test_structured_output_on_anthropic_is_a_forced_tool_without_thinking() -> None:
    params = msgspec.structs.replace(ASKED, thinking_budget=4096)
    body = anthropic_body("claude-sonnet-4-5", HISTORY, [TOOL], params)
    assert [t["name"] for t in body["tools"]] == ["ls", "answer"]
    assert body["tools"][-1]["input_schema"] == ANSWER.schema
    assert body["tool_choice"] == {"type": "tool", "name": "answer"}
    assert "thinking" not in body and body["temperature"] == 0.2
    plain = anthropic_body("claude-sonnet-4-5", HISTORY, [TOOL], GenerationParams())
    assert "tool_choice" not in plain


def test_structured_output_on_ollama_and_gemini() -> None:
    assert ollama_body("m", HISTORY, [], ASKED)["format"] == ANSWER.schema
    assert "format" not in ollama_body("m", HISTORY, [], GenerationParams())
    config = gemini_body(HISTORY, [], ASKED)["generationConfig"]
    assert config["responseMimeType"] == "application/json"
    # Gemini's Schema: types in capitals, properties in order, no additionalProperties
    assert config["responseSchema"] == {
        "type": "OBJECT",
        "properties": {"goal": {"type": "STRING"}, "steps": {"type": "ARRAY", "items": {}}},
        "propertyOrdering": ["goal", "steps"],
        "required": ["goal", "steps"],
    }
    assert "responseSchema" not in gemini_body(HISTORY, [], GenerationParams()).get(
        "generationConfig", {}
    )


async def test_kiro_has_no_structured_output_and_sends_none() -> None:
    seen, transport = capture(httpx.Response(200, content=b""))
    backend = KiroBackend("kiro", "https://kiro.test", "token", transport=transport)
    try:
        async with backend.stream("m", HISTORY, [], ASKED) as events:
            async for _ in events:
                pass
    except BadResponseError:
        pass  # an empty body is no stream; only the request matters here
    body = json.loads(seen[0].content)
    assert "answer" not in json.dumps(body) and set(body) == {"conversationState"}
