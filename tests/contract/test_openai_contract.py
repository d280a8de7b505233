"""OpenAI wire: our parser against the official ``openai`` SDK on the same bytes.

The SDK's reading is ``ChatCompletionStreamState``, the accumulator behind its
``chat.completions.stream()`` helper; errors are its exception classes and its own
Retry-After parser. Where we read differently on purpose, the test says so and checks
the difference.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import msgspec
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import (
    ChatCompletionAssistantMessageParam,
    ChatCompletionMessageFunctionToolCallParam,
    ChatCompletionMessageParam,
    ChatCompletionSystemMessageParam,
    ChatCompletionToolMessageParam,
    ChatCompletionToolParam,
    ChatCompletionUserMessageParam,
)
from pydantic import TypeAdapter

from olliefs.backend.base import GenerationParams, Message, Tool, ToolCall
from olliefs.backend.copilot import EDITOR_HEADERS
from olliefs.backend.openai import request_body
from olliefs.replay import Entry, EntryToolCall, EntryUsage, ReplayServer
from tests.contract.harness import (
    HTTP_DATE_AHEAD,
    KEY,
    Outcome,
    args_of,
    http_date,
    kind_of_status,
    ours,
    recorded,
    with_keepalives,
    with_malformed,
    without_final_newline,
)


def sdk(server: ReplayServer, entry: Entry, *, copilot: bool = False) -> Outcome:
    """Play ``entry`` to the openai SDK (through Copilot's token exchange if asked)."""
    server.add([entry])
    if copilot:
        token = httpx.get(
            f"{server.base_url}/copilot_internal/v2/token",
            headers={"Authorization": f"token {KEY}", **EDITOR_HEADERS},
        ).json()
        client = openai.OpenAI(
            base_url=token["endpoints"]["api"],
            api_key=token["token"],
            default_headers=EDITOR_HEADERS,
            max_retries=0,
            timeout=20,
        )
    else:
        client = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=20)
    out = Outcome()
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    try:
        with client:
            stream = client.chat.completions.create(
                model="replay",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                stream_options={"include_usage": True},
            )
            for chunk in stream:
                state.handle_chunk(chunk)
            final = state.get_final_completion()
    except openai.APIStatusError as err:
        out.error = kind_of_status(err.status_code)
        out.retry_after = client._parse_retry_after_header(err.response.headers)
        return out
    except (openai.APIConnectionError, httpx.HTTPError) as err:
        out.error = "transient"
        out.extra["message"] = str(err)
        return out
    except openai.APIError as err:  # an error object inside the stream
        body = err.body if isinstance(err.body, dict) else {}
        code = body.get("code")
        out.error = kind_of_status(int(str(code))) if str(code).isdigit() else "invalid_request"
        return out
    except ValueError:  # json.JSONDecodeError from a malformed payload
        out.error = "bad_payload"
        return out
    except Exception as err:  # httpx2's transport errors (the SDK's own HTTP stack)
        if type(err).__module__.startswith(("httpx2", "httpcore2")):
            out.error = "transient"
            return out
        raise
    message = final.choices[0].message
    extra = message.model_extra or {}
    out.text = message.content or ""
    out.reasoning = extra.get("reasoning") or extra.get("reasoning_content") or ""
    out.calls = [
        (c.id, c.function.name, args_of(c.function.arguments))
        for c in message.tool_calls or ()
        if c.type == "function"
    ]
    if message.function_call is not None:
        out.calls.append(
            (None, message.function_call.name, args_of(message.function_call.arguments))
        )
    if final.usage is not None:
        details = final.usage.prompt_tokens_details
        cached = (details.cached_tokens or 0) if details else 0
        out.usage = (final.usage.prompt_tokens, final.usage.completion_tokens, cached, 0)
        if (cost := (final.usage.model_extra or {}).get("cost")) is not None:
            out.extra["cost"] = cost
    out.finish = str(final.choices[0].finish_reason)
    if details_list := extra.get("reasoning_details"):
        out.extra["reasoning_details"] = details_list
    return out


RECORDED = [
    "openai_tools.sse",  # parallel tool calls, cached-token usage, UTF-8 in arguments
    "openai_openrouter.sse",  # keep-alive comments, reasoning, cost, U+2028 in content
    "openai_late_ids.sse",  # argument fragments before the call's id and name
    "openai_azure.sse",  # a first chunk with empty choices (prompt filter results)
]


@pytest.mark.parametrize("raw_chunk", [None, 1, 5])
@pytest.mark.parametrize("name", RECORDED)
async def test_recorded_streams_read_alike(
    server: ReplayServer, name: str, raw_chunk: int | None
) -> None:
    entry = Entry(raw=recorded(name), raw_chunk=raw_chunk)
    theirs, mine = sdk(server, entry), await ours(server, "openai", entry)
    assert not mine.error, mine.extra
    assert mine.essentials() == theirs.essentials()
    assert mine.extra.get("cost") == theirs.extra.get("cost")


async def test_legacy_function_call(server: ReplayServer) -> None:
    entry = Entry(raw=recorded("openai_function_call.sse"))
    theirs, mine = sdk(server, entry), await ours(server, "openai", entry)
    # The SDK keeps the legacy form as message.function_call, without an id; we turn it
    # into a tool call (with an id of our own making, needed to send the result back).
    assert mine.without_ids().essentials() == theirs.essentials()
    assert mine.calls[0][0]


async def test_reasoning_details_merge(server: ReplayServer) -> None:
    entry = Entry(raw=recorded("openai_openrouter.sse"))
    theirs, mine = sdk(server, entry), await ours(server, "openai", entry)
    [their_detail] = theirs.extra["reasoning_details"]
    [my_detail] = mine.extra["openai"]["reasoning_details"]
    for key in ("type", "text", "signature", "index"):
        assert my_detail[key] == their_detail[key]
    # The SDK's generic accumulator (3.x) also concatenates string fields repeated in every
    # fragment ("format" becomes "anthropic-claude-v1anthropic-claude-v1"); we keep the
    # value, as OpenRouter wants it back.
    assert my_detail["format"] == "anthropic-claude-v1"
    assert their_detail["format"] in ("anthropic-claude-v1", "anthropic-claude-v1" * 2)


@pytest.mark.parametrize(
    "edit",
    [with_keepalives, without_final_newline],
    ids=["keep-alive comments", "last event without blank line"],
)
@pytest.mark.parametrize("name", ["openai_tools.sse", "openai_openrouter.sse"])
async def test_framing_edges_read_alike(server: ReplayServer, edit: Any, name: str) -> None:
    entry = Entry(raw=edit(recorded(name)), raw_chunk=3)
    theirs, mine = sdk(server, entry), await ours(server, "openai", entry)
    assert not mine.error, mine.extra
    assert mine.essentials() == theirs.essentials()


async def test_malformed_json_fails_both(server: ReplayServer) -> None:
    entry = Entry(raw=with_malformed(recorded("openai_tools.sse")))
    theirs, mine = sdk(server, entry), await ours(server, "openai", entry)
    assert theirs.error == mine.error == "bad_payload"


async def test_drop_mid_stream_is_transient_for_both(server: ReplayServer) -> None:
    raw = recorded("openai_tools.sse")
    entry = Entry(raw=raw, raw_chunk=64, drop_after=len(raw) // 2)
    theirs, mine = sdk(server, entry), await ours(server, "openai", entry)
    assert theirs.error == mine.error == "transient"


async def test_end_without_done_is_a_drop_for_us_only(server: ReplayServer) -> None:
    """A body that ends cleanly but before ``[DONE]``: the SDK takes what came as the
    reply; we call it a drop (retried), so a truncated reply never enters the history."""
    raw = recorded("openai_tools.sse").replace(b"data: [DONE]\n\n", b"")
    theirs, mine = sdk(server, Entry(raw=raw)), await ours(server, "openai", Entry(raw=raw))
    assert not theirs.error and theirs.calls
    assert mine.error == "transient"


OVERFLOW = (
    '{"error": {"message": "This model\'s maximum context length is 128000 tokens. However, '
    'your messages resulted in 130412 tokens. Please reduce the length of the messages.", '
    '"type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}'
)
NO_TOOLS = (
    '{"object": "error", "message": "\\"auto\\" tool choice requires --enable-auto-tool-choice '
    'and --tool-call-parser to be set", "type": "BadRequestError", "param": null, "code": 400}'
)


@pytest.mark.parametrize(
    ("entry", "kind", "wait"),
    [
        (Entry(status=429, retry_after="7"), "rate_limit", 7.0),
        (Entry(status=429, retry_after_ms="1500", retry_after="9"), "rate_limit", 1.5),
        (Entry(status=429, retry_after="DATE"), "rate_limit", HTTP_DATE_AHEAD),
        (Entry(status=429), "rate_limit", None),
        (Entry(status=500), "transient", None),
        (Entry(status=503, error="The server is overloaded"), "transient", None),
        (Entry(status=400, body=OVERFLOW), "invalid_request", None),
        (Entry(status=400, body=NO_TOOLS), "invalid_request", None),
        (Entry(status=401), "auth", None),
        (Entry(reply="partial", status=502, in_stream=True, drop_after=1), "transient", None),
        (Entry(status=429, in_stream=True), "rate_limit", None),
    ],
    ids=[
        "429 seconds",
        "429 ms",
        "429 http-date",
        "429 bare",
        "500",
        "503",
        "overflow",
        "no tools",
        "401",
        "in-stream 502",
        "in-stream 429",
    ],
)
async def test_errors_read_alike(
    server: ReplayServer, entry: Entry, kind: str, wait: float | None
) -> None:
    if entry.retry_after == "DATE":  # made now: the wait is read against the clock
        entry = msgspec.structs.replace(entry, retry_after=http_date(HTTP_DATE_AHEAD))
    theirs, mine = sdk(server, entry), await ours(server, "openai", entry)
    assert theirs.error == mine.error == kind, mine.extra
    if entry.in_stream:
        return  # in-stream errors carry no headers
    if wait is None:
        assert mine.retry_after is None and (theirs.retry_after is None or kind != "rate_limit")
    else:
        assert mine.retry_after is not None and theirs.retry_after is not None
        assert abs(mine.retry_after - theirs.retry_after) < 5  # a date is read against the clock
        assert abs(mine.retry_after - wait) < 5


# Scripted entries name their ids and usage: the defaults depend on the request counter
# and on the request's size, which differ between the two clients.
SCRIPTED = Entry(
    reasoning="Two lookups.",
    reply="On it: ",
    tool_calls=(
        EntryToolCall(name="get_weather", arguments={"city": "Paris"}, id="call_a"),
        EntryToolCall(name="get_weather", arguments={"city": "Kyiv", "days": [1, 2]}, id="c_b"),
    ),
    usage=EntryUsage(prompt_tokens=90, completion_tokens=12, cached_tokens=64, cost=0.0012),
    chunk=3,
)
FIXED = EntryUsage(prompt_tokens=5, completion_tokens=1)


@pytest.mark.parametrize(
    "entry",
    [
        SCRIPTED,
        Entry(reply="plain", usage=FIXED),
        Entry(tool_calls=(EntryToolCall(name="ls", id="call_x"),), late_ids=True, usage=FIXED),
    ],
    ids=["calls", "plain", "late ids"],
)
async def test_the_replay_servers_own_rendering_reads_alike(
    server: ReplayServer, entry: Entry
) -> None:
    theirs, mine = sdk(server, entry), await ours(server, "openai", entry)
    assert not mine.error, mine.extra
    assert mine.essentials() == theirs.essentials()


async def test_copilot_wire_reads_alike(server: ReplayServer) -> None:
    """Copilot is the OpenAI wire behind a token exchange (checked only against this
    server: GitHub does not document it)."""
    for entry in (SCRIPTED, Entry(raw=recorded("openai_tools.sse"), raw_chunk=11)):
        theirs = sdk(server, entry, copilot=True)
        mine = await ours(server, "copilot", entry)
        assert not mine.error, mine.extra
        assert mine.essentials() == theirs.essentials()
    copilot_requests = [r for r in server.recorded if r.headers.get("copilot-integration-id")]
    assert len(copilot_requests) == 4


# ---- what we send ----------------------------------------------------------------------


def test_every_message_we_send_has_only_the_fields_the_sdk_defines() -> None:
    """Each message of a request (every role, a call with arguments that came cut off)
    uses only the fields of the SDK's type for its role, and validates as one: strict
    OpenAI-compatible gateways refuse anything else with a 400 (a ``name`` on a tool
    message, most often)."""
    history = [
        Message("system", "be brief"),
        Message("user", "list files"),
        Message(
            "assistant",
            "",
            tool_calls=(ToolCall("c1", "ls", '{"path": "."}'), ToolCall("c2", "ls", '{"pa')),
        ),
        Message("tool", "a.txt", tool_call_id="c1", name="ls"),
        Message("tool", "[tool error] cut off", tool_call_id="c2", name="ls"),
        Message("assistant", "done"),
    ]
    tool = Tool("ls", "list a directory", {"type": "object", "properties": {}})
    body = request_body("gpt-4o", history, [tool], GenerationParams())
    types: dict[str, Any] = {
        "system": ChatCompletionSystemMessageParam,
        "user": ChatCompletionUserMessageParam,
        "assistant": ChatCompletionAssistantMessageParam,
        "tool": ChatCompletionToolMessageParam,
    }
    for message in body["messages"]:
        defined = types[message["role"]]
        assert set(message) <= defined.__required_keys__ | defined.__optional_keys__, message
        for call in message.get("tool_calls", ()):
            fields = ChatCompletionMessageFunctionToolCallParam
            assert set(call) <= fields.__required_keys__ | fields.__optional_keys__
            assert isinstance(json.loads(call["function"]["arguments"]), dict)
    TypeAdapter(list[ChatCompletionMessageParam]).validate_python(body["messages"])
    TypeAdapter(list[ChatCompletionToolParam]).validate_python(body["tools"])


async def test_the_sdk_reads_the_in_stream_error_with_usage(server: ReplayServer) -> None:
    """OpenRouter's shape of an error inside a 200 stream, usage included: the SDK sees
    the error as we do."""
    entry = Entry(
        reply="partial",
        status=502,
        in_stream=True,
        usage=EntryUsage(prompt_tokens=40, completion_tokens=3, cost=0.001),
    )
    theirs, mine = sdk(server, entry), await ours(server, "openai", entry)
    assert theirs.error == mine.error == "transient"
    assert mine.usage == (40, 3, 0, 0) and mine.extra["cost"] == 0.001
