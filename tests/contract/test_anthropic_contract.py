"""Anthropic wire: our parser against the official ``anthropic`` SDK on the same bytes.

The SDK's reading is ``messages.stream(...).get_final_message()`` (its accumulator of the
raw events); errors are its exception classes and its own Retry-After parser. Our usage
convention (input tokens include cache reads and writes) is applied to the SDK's numbers
before comparing: that is the check that our backend adds them up.
"""

from __future__ import annotations

from typing import Any, get_args, get_type_hints

import anthropic
import httpx
import msgspec
import pytest
from anthropic.types import ContentBlock, ContentBlockParam
from pydantic import TypeAdapter

from olliefs.backend.anthropic import ERROR_STATUS, STOP_REASONS, request_body
from olliefs.backend.base import GenerationParams, Message, ToolCall
from olliefs.replay import Entry, EntryServerTool, EntryToolCall, EntryUsage, ReplayServer
from tests.contract.harness import (
    HTTP_DATE_AHEAD,
    KEY,
    Outcome,
    http_date,
    kind_of_status,
    ours,
    recorded,
    with_keepalives,
    with_malformed,
    without_final_newline,
)


def sdk(server: ReplayServer, entry: Entry) -> Outcome:
    server.add([entry])
    client = anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=20)
    out = Outcome()
    try:
        with (
            client,
            client.messages.stream(
                model="replay", max_tokens=1024, messages=[{"role": "user", "content": "hi"}]
            ) as stream,
        ):
            message = stream.get_final_message()
    except anthropic.APIStatusError as err:
        if err.status_code == 200:  # an ``error`` event inside the stream
            body = err.body if isinstance(err.body, dict) else {}
            kind = body.get("error", {}).get("type", "")
            out.error = kind_of_status(ERROR_STATUS.get(kind, 500))
        else:
            out.error = kind_of_status(err.status_code)
            out.retry_after = client._parse_retry_after_header(err.response.headers)
        return out
    except (anthropic.APIConnectionError, httpx.HTTPError):
        out.error = "transient"
        return out
    except ValueError:  # json.JSONDecodeError from a malformed payload
        out.error = "bad_payload"
        return out
    except Exception as err:  # the SDK's own HTTP stack (httpx2) failing mid-body
        if type(err).__module__.startswith(("httpx2", "httpcore2")):
            out.error = "transient"
            return out
        raise
    thinking: list[dict[str, Any]] = []
    for block in message.content:
        if block.type == "text":
            out.text += block.text
        elif block.type == "thinking":
            out.reasoning += block.thinking
            thinking.append(
                {"type": "thinking", "thinking": block.thinking, "signature": block.signature}
            )
        elif block.type == "redacted_thinking":
            thinking.append({"type": "redacted_thinking", "data": block.data})
        elif block.type == "tool_use":
            out.calls.append((block.id, block.name, block.input))
        else:  # the provider's own blocks (server tools), as the SDK keeps them
            out.extra.setdefault("server", []).append(block.to_dict())
    u = message.usage
    cached, created = u.cache_read_input_tokens or 0, u.cache_creation_input_tokens or 0
    out.usage = (u.input_tokens + cached + created, u.output_tokens, cached, created)
    out.finish = STOP_REASONS.get(message.stop_reason or "", message.stop_reason or "")
    if thinking:
        out.extra["anthropic"] = {"thinking": thinking}
    return out


RECORDED = ["anthropic_thinking_tools.sse", "anthropic_text_cache.sse"]


@pytest.mark.parametrize("raw_chunk", [None, 1, 9])
@pytest.mark.parametrize("name", RECORDED)
async def test_recorded_streams_read_alike(
    server: ReplayServer, name: str, raw_chunk: int | None
) -> None:
    entry = Entry(raw=recorded(name), raw_chunk=raw_chunk)
    theirs, mine = sdk(server, entry), await ours(server, "anthropic", entry)
    assert not mine.error, mine.extra
    assert mine.essentials() == theirs.essentials()
    # thinking blocks with their signatures, as they must be sent back
    assert mine.extra.get("anthropic") == theirs.extra.get("anthropic")


@pytest.mark.parametrize(
    "edit",
    [with_keepalives, without_final_newline],
    ids=["keep-alive comments", "last event without blank line"],
)
@pytest.mark.parametrize("name", RECORDED)
async def test_framing_edges_read_alike(server: ReplayServer, edit: Any, name: str) -> None:
    entry = Entry(raw=edit(recorded(name)), raw_chunk=4)
    theirs, mine = sdk(server, entry), await ours(server, "anthropic", entry)
    assert not mine.error, mine.extra
    assert mine.essentials() == theirs.essentials()


@pytest.mark.parametrize("nth", [1, 4, 9])
async def test_malformed_json_fails_both(server: ReplayServer, nth: int) -> None:
    entry = Entry(raw=with_malformed(recorded("anthropic_thinking_tools.sse"), nth=nth))
    theirs, mine = sdk(server, entry), await ours(server, "anthropic", entry)
    assert theirs.error == mine.error == "bad_payload"


async def test_a_ping_is_not_read(server: ReplayServer) -> None:
    """Both skip ``ping`` events by name, whatever their payload."""
    entry = Entry(raw=with_malformed(recorded("anthropic_thinking_tools.sse"), nth=2))
    theirs, mine = sdk(server, entry), await ours(server, "anthropic", entry)
    assert not mine.error and mine.essentials() == theirs.essentials()


async def test_drop_mid_stream_is_transient_for_both(server: ReplayServer) -> None:
    raw = recorded("anthropic_thinking_tools.sse")
    entry = Entry(raw=raw, raw_chunk=100, drop_after=len(raw) // 2)
    theirs, mine = sdk(server, entry), await ours(server, "anthropic", entry)
    assert theirs.error == mine.error == "transient"


async def test_end_without_message_stop_is_a_drop_for_us_only(server: ReplayServer) -> None:
    """The SDK's accumulator makes a message of whatever came; we retry instead, so a
    reply cut at a block boundary never enters the history."""
    raw = recorded("anthropic_text_cache.sse")
    raw = raw[: raw.index(b"event: message_delta")]
    theirs, mine = sdk(server, Entry(raw=raw)), await ours(server, "anthropic", Entry(raw=raw))
    assert not theirs.error and theirs.text
    assert mine.error == "transient"


OVERFLOW = (
    '{"type": "error", "error": {"type": "invalid_request_error", '
    '"message": "prompt is too long: 208310 tokens > 200000 maximum"}}'
)


@pytest.mark.parametrize(
    ("entry", "kind", "wait"),
    [
        (Entry(status=429, retry_after="13"), "rate_limit", 13.0),
        (Entry(status=429, retry_after="DATE"), "rate_limit", HTTP_DATE_AHEAD),
        (Entry(status=529, error="Overloaded"), "transient", None),
        (Entry(status=500), "transient", None),
        (Entry(status=400, body=OVERFLOW), "invalid_request", None),
        (Entry(status=401), "auth", None),
        (Entry(reply="half", status=529, in_stream=True, drop_after=1), "transient", None),
        (Entry(status=429, in_stream=True), "rate_limit", None),
        (Entry(status=400, in_stream=True, error="bad"), "invalid_request", None),
    ],
    ids=[
        "429 seconds",
        "429 http-date",
        "529",
        "500",
        "overflow",
        "401",
        "in-stream overloaded",
        "in-stream rate limit",
        "in-stream invalid",
    ],
)
async def test_errors_read_alike(
    server: ReplayServer, entry: Entry, kind: str, wait: float | None
) -> None:
    if entry.retry_after == "DATE":
        entry = msgspec.structs.replace(entry, retry_after=http_date(HTTP_DATE_AHEAD))
    theirs, mine = sdk(server, entry), await ours(server, "anthropic", entry)
    assert theirs.error == mine.error == kind, mine.extra
    if wait is not None:
        assert mine.retry_after is not None and theirs.retry_after is not None
        assert abs(mine.retry_after - theirs.retry_after) < 5
        assert abs(mine.retry_after - wait) < 5


SCRIPTED = Entry(
    reasoning="Two lookups, in parallel.",
    signature="c2lnbmF0dXJl",
    reply="Checking.",
    tool_calls=(
        EntryToolCall(name="get_weather", arguments={"city": "Lima"}, id="toolu_a"),
        EntryToolCall(name="get_time", id="toolu_b"),
    ),
    usage=EntryUsage(
        prompt_tokens=3000, completion_tokens=40, cached_tokens=2048, cache_creation_tokens=512
    ),
    chunk=5,
    keepalive=True,
)


@pytest.mark.parametrize(
    "entry",
    [SCRIPTED, Entry(reply="plain", usage=EntryUsage(prompt_tokens=3, completion_tokens=1))],
    ids=["thinking and calls", "plain"],
)
async def test_the_replay_servers_own_rendering_reads_alike(
    server: ReplayServer, entry: Entry
) -> None:
    theirs, mine = sdk(server, entry), await ours(server, "anthropic", entry)
    assert not mine.error, mine.extra
    assert mine.essentials() == theirs.essentials()
    assert mine.extra.get("anthropic") == theirs.extra.get("anthropic")


BLOCK_PARAMS = {
    get_args(get_type_hints(cls)["type"])[0]: cls for cls in get_args(ContentBlockParam)
}
FOUND = {
    "type": "web_search_result",
    "title": "Paris - Wikipedia",
    "url": "https://en.wikipedia.org/wiki/Paris",
    "encrypted_content": "EqgfCioIARgBIiQ3YTAwMjY1Mi1mZjM5LTQ1NGUtODgxNC1kNjNjNTk1ZWI3Y",
    "page_age": "2 days ago",
}
SERVER_TOOLS = Entry(
    reply="Let me look that up. It is Paris.",
    server_tools=(
        EntryServerTool(
            name="web_search",
            arguments={"query": "capital of France"},
            id="srvtoolu_01WYG3ziw53XMcoyKL4XcZmE",
            result=[FOUND],
            after=len("Let me look that up."),
        ),
        EntryServerTool(
            name="code_execution",
            arguments={"code": "print(2 + 2)"},
            id="srvtoolu_02",
            result={
                "type": "code_execution_result",
                "stdout": "4\n",
                "stderr": "",
                "return_code": 0,
                "content": [],
            },
            after=len("Let me look that up."),
        ),
    ),
    tool_calls=(EntryToolCall(name="get_weather", arguments={"city": "Paris"}, id="toolu_a"),),
    usage=EntryUsage(prompt_tokens=50, completion_tokens=20),
    chunk=6,
)


async def test_server_tools_read_alike_and_go_back_as_the_api_takes_them(
    server: ReplayServer,
) -> None:
    """Blocks of tools the provider ran (web search, code execution): the SDK reads
    them as ServerToolUseBlock and result blocks, we read no tool call of ours from
    them; the blocks we keep are the SDK's, and the message we send back with them
    validates as the SDK's MessageParam, each block where it stood."""
    theirs, mine = sdk(server, SERVER_TOOLS), await ours(server, "anthropic", SERVER_TOOLS)
    assert not mine.error, mine.extra
    assert mine.essentials() == theirs.essentials()
    assert [c[1] for c in mine.calls] == ["get_weather"]
    kept = [item["block"] for item in mine.extra["anthropic"]["server"]]
    assert [b["type"] for b in kept] == [
        "server_tool_use",
        "web_search_tool_result",
        "server_tool_use",
        "code_execution_tool_result",
    ]
    assert kept == [
        {k: v for k, v in block.items() if v is not None} for block in theirs.extra["server"]
    ]
    reply = Message(
        "assistant",
        mine.text,
        tool_calls=(ToolCall("toolu_a", "get_weather", '{"city": "Paris"}'),),
        provider_data={"anthropic": mine.extra["anthropic"]},
    )
    history = [Message("user", "capital?"), reply, Message("tool", "sunny", tool_call_id="toolu_a")]
    body = request_body("claude-sonnet-4-5", history, [], GenerationParams())
    blocks = body["messages"][1]["content"]
    for block in blocks:
        # the fields of the SDK's request type for the block, and (their nested values
        # too) valid as the SDK's block model
        assert set(block) <= set(get_type_hints(BLOCK_PARAMS[block["type"]])), block
        TypeAdapter(ContentBlock).validate_python(block)
    assert [b["type"] for b in blocks] == [
        "text",
        "server_tool_use",
        "web_search_tool_result",
        "server_tool_use",
        "code_execution_tool_result",
        "text",
        "tool_use",
    ]
    assert blocks[0]["text"] + blocks[5]["text"] == mine.text
