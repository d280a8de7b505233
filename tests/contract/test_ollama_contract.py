"""Ollama wire: our parser against the official ``ollama`` SDK on the same bytes.

The SDK's reading is ``Client.chat(stream=True)``: one ``ChatResponse`` per NDJSON line,
accumulated here the obvious way. Ollama sends no tool call ids (we make our own), so ids
are left out of the comparison. Ollama has no context-overflow error to compare: it cuts
the prompt to the context it was given instead.
"""

from __future__ import annotations

import httpx
import ollama
import pytest

from olliefs.replay import Entry, EntryToolCall, EntryUsage, ReplayServer
from tests.contract.harness import (
    Outcome,
    kind_of_status,
    ours,
    recorded,
    with_malformed,
    without_final_newline,
)


def sdk(server: ReplayServer, entry: Entry) -> Outcome:
    server.add([entry])
    client = ollama.Client(host=server.base_url, timeout=20)
    out = Outcome()
    try:
        for part in client.chat(
            model="replay", messages=[{"role": "user", "content": "hi"}], stream=True
        ):
            message = part.message
            out.text += message.content or ""
            out.reasoning += message.thinking or ""
            for call in message.tool_calls or ():
                out.calls.append((None, call.function.name, dict(call.function.arguments)))
            if part.done:
                out.usage = (part.prompt_eval_count or 0, part.eval_count or 0, 0, 0)
                out.finish = "tool_calls" if out.calls else part.done_reason or ""
    except ollama.ResponseError as err:
        # -1: an error line inside the stream, which carries no status
        out.error = "stream_error" if err.status_code == -1 else kind_of_status(err.status_code)
    except httpx.HTTPError:
        out.error = "transient"
    except ValueError:
        out.error = "bad_payload"
    finally:
        client.close()  # type: ignore[no-untyped-call]
    return out


async def both(server: ReplayServer, entry: Entry) -> tuple[Outcome, Outcome]:
    theirs = sdk(server, entry)
    mine = await ours(server, "ollama", entry)
    return theirs, mine.without_ids()


@pytest.mark.parametrize("raw_chunk", [None, 1, 17])
async def test_recorded_stream_reads_alike(server: ReplayServer, raw_chunk: int | None) -> None:
    """Thinking, parallel tool calls, and content on the ``done`` line."""
    theirs, mine = await both(
        server, Entry(raw=recorded("ollama_tools.ndjson"), raw_chunk=raw_chunk)
    )
    assert not mine.error, mine.extra
    assert mine.essentials() == theirs.essentials()
    assert mine.text.endswith(" now.")  # from the done line


async def test_last_line_without_newline(server: ReplayServer) -> None:
    entry = Entry(raw=without_final_newline(recorded("ollama_tools.ndjson")), raw_chunk=5)
    theirs, mine = await both(server, entry)
    assert not mine.error and mine.essentials() == theirs.essentials()


async def test_malformed_json_fails_both(server: ReplayServer) -> None:
    entry = Entry(raw=with_malformed(recorded("ollama_tools.ndjson"), b"", nth=2))
    theirs, mine = await both(server, entry)
    assert theirs.error == mine.error == "bad_payload"


async def test_drop_mid_stream_is_transient_for_both(server: ReplayServer) -> None:
    raw = recorded("ollama_tools.ndjson")
    theirs, mine = await both(server, Entry(raw=raw, raw_chunk=40, drop_after=len(raw) // 2))
    assert theirs.error == mine.error == "transient"


async def test_end_without_done_is_a_drop_for_us_only(server: ReplayServer) -> None:
    raw = recorded("ollama_tools.ndjson")
    raw = raw[: raw.rindex(b'{"model"')]
    theirs, mine = await both(server, Entry(raw=raw))
    assert not theirs.error and theirs.calls
    assert mine.error == "transient"


async def test_error_line_mid_stream(server: ReplayServer) -> None:
    """Both fail the reply; the SDK's error has no status, ours is a retried transient
    error (Ollama reports runner crashes this way)."""
    theirs, mine = await both(server, Entry(reply="so far", status=500, in_stream=True))
    assert theirs.error == "stream_error"
    assert mine.error == "transient"


NO_TOOLS = '{"error": "registry.ollama.ai/library/gemma:2b does not support tools"}'


@pytest.mark.parametrize(
    ("entry", "kind"),
    [
        (Entry(status=429, retry_after="4"), "rate_limit"),
        (Entry(status=500), "transient"),
        (Entry(status=503, error="server busy, please try again"), "transient"),
        (Entry(status=400, body=NO_TOOLS), "invalid_request"),
        (Entry(status=404, error="model 'nope' not found"), "invalid_request"),
    ],
    ids=["429", "500", "503", "no tools", "404"],
)
async def test_errors_read_alike(server: ReplayServer, entry: Entry, kind: str) -> None:
    theirs, mine = await both(server, entry)
    assert theirs.error == mine.error == kind


SCRIPTED = Entry(
    reasoning="Compare two files.",
    reply="Reading both.",
    tool_calls=(
        EntryToolCall(name="file_read", arguments={"path": "a.txt"}),
        EntryToolCall(name="file_read", arguments={"path": "b.txt", "lines": [1, 5]}),
    ),
    usage=EntryUsage(prompt_tokens=321, completion_tokens=12),
    chunk=3,
)


async def test_the_replay_servers_own_rendering_reads_alike(server: ReplayServer) -> None:
    theirs, mine = await both(server, SCRIPTED)
    assert not mine.error, mine.extra
    assert mine.essentials() == theirs.essentials()
