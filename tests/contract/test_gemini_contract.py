"""Gemini wire: our parser against the official ``google-genai`` SDK on the same bytes.

The SDK's reading is ``models.generate_content_stream``: one ``GenerateContentResponse``
per event, which this test accumulates the obvious way (texts joined, function calls
listed, the last usage and finish reason kept). Gemini sends no call ids, so we make our
own, and the comparison leaves ids out. Thought signatures are compared as the base64 text
on the wire (the SDK hands them over decoded to bytes).
"""

from __future__ import annotations

import base64
from typing import Any

import httpx
import pytest
from google import genai
from google.genai import errors, types

from olliefs.backend.gemini import FINISH
from olliefs.replay import Entry, EntryToolCall, EntryUsage, ReplayServer
from tests.contract.harness import (
    KEY,
    Outcome,
    kind_of_status,
    ours,
    recorded,
    with_keepalives,
    with_malformed,
    without_final_newline,
)


def sdk(server: ReplayServer, entry: Entry) -> Outcome:
    server.add([entry])
    options = types.HttpOptions(base_url=server.base_url, api_version="v1beta", timeout=20000)
    client = genai.Client(api_key=KEY, http_options=options)
    out = Outcome()
    signatures: list[dict[str, Any]] = []
    reason = ""
    try:
        for chunk in client.models.generate_content_stream(model="replay", contents="hi"):
            if chunk.usage_metadata is not None:
                u = chunk.usage_metadata
                out.usage = (
                    u.prompt_token_count or 0,
                    (u.candidates_token_count or 0) + (u.thoughts_token_count or 0),
                    u.cached_content_token_count or 0,
                    0,
                )
            for candidate in (chunk.candidates or [])[:1]:
                for part in candidate.content.parts or [] if candidate.content else []:
                    signature = (
                        base64.b64encode(part.thought_signature).decode()
                        if part.thought_signature
                        else None
                    )
                    if part.function_call is not None:
                        call = part.function_call
                        out.calls.append((call.id, call.name or "", call.args or {}))
                        if signature:
                            signatures.append({"call": len(out.calls) - 1, "signature": signature})
                    elif part.text:
                        if part.thought:
                            out.reasoning += part.text
                        else:
                            out.text += part.text
                if candidate.finish_reason is not None:
                    reason = candidate.finish_reason.value
    except errors.APIError as err:
        out.error = kind_of_status(err.code)
        return out
    except (httpx.HTTPError, ValueError) as err:
        out.error = "bad_payload" if isinstance(err, ValueError) else "transient"
        return out
    except Exception as err:  # httpx2, the SDK's own HTTP stack
        if type(err).__module__.startswith(("httpx2", "httpcore2")):
            out.error = "transient"
            return out
        raise
    finish = FINISH.get(reason, reason.lower())
    out.finish = "tool_calls" if out.calls and finish == "stop" else finish
    out.extra["signatures"] = signatures
    return out


async def both(server: ReplayServer, entry: Entry) -> tuple[Outcome, Outcome]:
    theirs = sdk(server, entry)
    mine = await ours(server, "gemini", entry)
    # our signatures name the call by id; the SDK's by position
    ids = [call[0] for call in mine.calls]
    mine.extra["signatures"] = [
        {"call": ids.index(s["call"]), "signature": s["signature"]}
        for s in mine.extra.get("gemini", {}).get("signatures", [])
        if "call" in s
    ]
    return theirs.without_ids(), mine.without_ids()


@pytest.mark.parametrize("raw_chunk", [None, 1, 13])
@pytest.mark.parametrize("name", ["gemini_tools.sse", "gemini_text.sse"])
async def test_recorded_streams_read_alike(
    server: ReplayServer, name: str, raw_chunk: int | None
) -> None:
    entry = Entry(raw=recorded(name), raw_chunk=raw_chunk)
    theirs = sdk(server, entry)
    mine = await ours(server, "gemini", entry)
    assert not mine.error, mine.extra
    assert mine.without_ids().essentials() == theirs.without_ids().essentials()
    if name == "gemini_tools.sse":
        [signature] = theirs.extra["signatures"]
        assert mine.extra["gemini"]["signatures"] == [
            {"call": mine.calls[signature["call"]][0], "signature": signature["signature"]}
        ]


async def test_last_event_without_blank_line(server: ReplayServer) -> None:
    entry = Entry(raw=without_final_newline(recorded("gemini_tools.sse")), raw_chunk=6)
    theirs, mine = await both(server, entry)
    assert not mine.error and mine.essentials() == theirs.essentials()


async def test_keep_alive_comments_are_skipped_by_us_only(server: ReplayServer) -> None:
    """SSE comments are part of the format, and proxies insert them; the SDK takes a
    comment line for a broken JSON document. We follow the SSE spec."""
    entry = Entry(raw=with_keepalives(recorded("gemini_text.sse")))
    theirs, mine = await both(server, entry)
    assert theirs.error == "bad_payload"
    plain = Entry(raw=recorded("gemini_text.sse"))
    assert mine.essentials() == (await both(server, plain))[0].essentials()


async def test_malformed_json_fails_both(server: ReplayServer) -> None:
    theirs, mine = await both(server, Entry(raw=with_malformed(recorded("gemini_tools.sse"))))
    assert theirs.error == mine.error == "bad_payload"


async def test_drop_mid_stream_is_transient_for_both(server: ReplayServer) -> None:
    raw = recorded("gemini_tools.sse")
    theirs, mine = await both(server, Entry(raw=raw, raw_chunk=50, drop_after=len(raw) // 2))
    assert theirs.error == mine.error == "transient"


async def test_end_before_finish_reason_is_a_drop_for_us_only(server: ReplayServer) -> None:
    """Gemini has no end marker; a body that ends before any ``finishReason`` is cut
    short. The SDK yields what came; we retry."""
    raw = recorded("gemini_tools.sse")
    raw = raw[: raw.rindex(b"data: ")]
    theirs, mine = await both(server, Entry(raw=raw))
    assert not theirs.error and theirs.text
    assert mine.error == "transient"


OVERFLOW = (
    '{"error": {"code": 400, "message": "The input token count (1250000) exceeds the maximum '
    'number of tokens allowed (1048576).", "status": "INVALID_ARGUMENT"}}'
)
NO_TOOLS = (
    '{"error": {"code": 400, "message": "Function calling is not enabled for '
    'models/gemma-3-27b-it", "status": "INVALID_ARGUMENT"}}'
)


@pytest.mark.parametrize(
    ("entry", "kind"),
    [
        (Entry(status=429, retry_after="5"), "rate_limit"),
        (Entry(status=429, retry_delay="37s"), "rate_limit"),
        (Entry(status=500), "transient"),
        (Entry(status=503), "transient"),
        (Entry(status=400, body=OVERFLOW), "invalid_request"),
        (Entry(status=400, body=NO_TOOLS), "invalid_request"),
        (Entry(status=403), "auth"),
        (Entry(reply="half", status=503, in_stream=True, drop_after=1), "transient"),
        (Entry(status=429, in_stream=True, retry_delay="2s"), "rate_limit"),
    ],
    ids=[
        "429 header",
        "429 RetryInfo",
        "500",
        "503",
        "overflow",
        "no tools",
        "403",
        "in-stream 503",
        "in-stream 429",
    ],
)
async def test_errors_read_alike(server: ReplayServer, entry: Entry, kind: str) -> None:
    theirs, mine = await both(server, entry)
    assert theirs.error == mine.error == kind


async def test_retry_waits(server: ReplayServer) -> None:
    """The SDK keeps no wait of its own; ours come from Retry-After, else RetryInfo."""
    for entry, wait in (
        (Entry(status=429, retry_after="5", retry_delay="37s"), 5.0),
        (Entry(status=429, retry_delay="37s"), 37.0),
        (Entry(status=429, retry_delay="1.5s", in_stream=True), 1.5),
    ):
        mine = await ours(server, "gemini", entry)
        assert (mine.error, mine.retry_after) == ("rate_limit", wait)


SCRIPTED = Entry(
    reasoning="Plan: two calls.",
    reply="Looking up.",
    signature="c2lnLWdlbWluaQ==",
    tool_calls=(
        EntryToolCall(name="get_weather", arguments={"city": "Accra"}),
        EntryToolCall(name="get_weather", arguments={"city": "Quito"}),
    ),
    usage=EntryUsage(prompt_tokens=700, completion_tokens=30, cached_tokens=512),
    chunk=4,
)


@pytest.mark.parametrize(
    "entry",
    [SCRIPTED, Entry(reply="plain", usage=EntryUsage(prompt_tokens=2, completion_tokens=1))],
    ids=["thinking and calls", "plain"],
)
async def test_the_replay_servers_own_rendering_reads_alike(
    server: ReplayServer, entry: Entry
) -> None:
    theirs, mine = await both(server, entry)
    assert not mine.error, mine.extra
    assert mine.essentials() == theirs.essentials()
    assert mine.extra["signatures"] == theirs.extra["signatures"]
