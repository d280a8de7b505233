"""Every backend end to end: a real mount, a real daemon, the replay server in each wire.

One replay server speaks all six wire formats; the daemon gets the ``OLLIE_<NAME>_URL``
settings that point each backend at it. For each backend a session created with
``backend=<name>`` runs a turn with thinking and a tool call (``file_read``, run for real
by toolsrv), then a reply: the chat, the usage counters, and the second request, which must
carry the tool result (and the provider's opaque state) back in that provider's own shape.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest

from olliefs.replay import Entry, EntryServerTool, EntryToolCall, EntryUsage, Recorded, ReplayServer
from olliefs.testing import HAVE_FUSE, Daemon

pytestmark = pytest.mark.skipif(not HAVE_FUSE, reason="needs /dev/fuse (mounts for real)")

KEY = "sk-e2e-backends-0123456789"
NAMES = ["openai", "anthropic", "ollama", "gemini", "copilot", "kiro"]
# Kiro's stream has no thinking and no token counts (ollie-replay(1))
THINKS = {"openai", "anthropic", "ollama", "gemini", "copilot"}
CACHED = {"openai": 40, "copilot": 40, "anthropic": 40, "gemini": 40, "ollama": 0}


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[tuple[ReplayServer, Daemon]]:
    with ReplayServer(key=KEY) as server:
        daemon = Daemon(tmp_path, server, {**server.settings(), "OLLIE_RETRY_BASE": "0.01"})
        with daemon.running():
            yield server, daemon


def turn_script(call_id: str) -> list[Entry]:
    return [
        Entry(
            reasoning="Read the notes first.",
            signature="c2lnbmVkLXRoaW5raW5n",
            reply="Reading.",
            tool_calls=(
                EntryToolCall(name="file_read", arguments={"path": "notes.txt"}, id=call_id),
            ),
            usage=EntryUsage(prompt_tokens=100, completion_tokens=10, cached_tokens=40),
        ),
        Entry(
            reply="The notes say alpha.",
            usage=EntryUsage(prompt_tokens=130, completion_tokens=5),
        ),
    ]


def tool_result_of(name: str, request: Recorded) -> tuple[str, str]:
    """(call id, result text) of the tool result in the second request, as ``name``'s
    wire format carries it back."""
    body: dict[str, Any] = request.body
    if name in ("openai", "copilot"):
        [msg] = [m for m in body["messages"] if m["role"] == "tool"]
        assert set(msg) == {"role", "content", "tool_call_id"}  # what the API defines
        return msg["tool_call_id"], msg["content"]
    if name == "anthropic":
        blocks = [b for m in body["messages"] for b in m["content"] if isinstance(b, dict)]
        [result] = [b for b in blocks if b["type"] == "tool_result"]
        return result["tool_use_id"], result["content"]
    if name == "ollama":
        [msg] = [m for m in body["messages"] if m["role"] == "tool"]
        assert msg["tool_name"] == "file_read"
        return "", msg["content"]
    if name == "gemini":
        parts = [p for c in body["contents"] for p in c["parts"]]
        [response] = [p["functionResponse"] for p in parts if "functionResponse" in p]
        assert response["name"] == "file_read"
        return response["id"], response["response"]["output"]
    assert name == "kiro"
    user = body["conversationState"]["currentMessage"]["userInputMessage"]
    [result] = user["userInputMessageContext"]["toolResults"]
    return result["toolUseId"], result["content"][0]["text"]


def assert_opaque_state_went_back(name: str, request: Recorded) -> None:
    """The provider's state of the first reply came back with it in the next request."""
    body: dict[str, Any] = request.body
    if name == "anthropic":
        assistant = next(m for m in body["messages"] if m["role"] == "assistant")
        thinking = assistant["content"][0]
        assert thinking == {
            "type": "thinking",
            "thinking": "Read the notes first.",
            "signature": "c2lnbmVkLXRoaW5raW5n",
        }
        assert [b["type"] for b in assistant["content"]] == ["thinking", "text", "tool_use"]
    elif name == "gemini":
        model = next(c for c in body["contents"] if c["role"] == "model")
        [call] = [p for p in model["parts"] if "functionCall" in p]
        assert call["thoughtSignature"] == "c2lnbmVkLXRoaW5raW5n"


@pytest.mark.parametrize("name", NAMES)
def test_a_turn_with_a_tool_call(keyed: tuple[ReplayServer, Daemon], name: str) -> None:
    server, daemon = keyed
    (daemon.work / "notes.txt").write_text("alpha\n")
    call_id = f"call-{name}-1"
    server.add(turn_script(call_id))
    sid = daemon.new(name=name, backend=name, model="replay")
    assert f"backend={name}\n" in daemon.read(f"s/{sid}/cfg")
    daemon.write(f"s/{sid}/ctl", "tool_load file_read")
    daemon.prompt(sid, "what do the notes say?")
    daemon.wait_idle(sid)

    chat = daemon.read(f"s/{sid}/chat")
    assert "assistant: Reading." in chat
    assert '-> file_read({"path":"notes.txt"})\n' in chat
    assert chat.endswith("assistant: The notes say alpha.\n")
    assert ("<think>\nRead the notes first." in chat) == (name in THINKS)

    first, second = server.recorded
    assert first.wire == second.wire == ("openai" if name == "copilot" else name)
    result_id, text = tool_result_of(name, second)
    assert "alpha" in text
    if name != "ollama":  # Ollama has no call ids; the result goes by tool name
        assert result_id == call_id
    assert_opaque_state_went_back(name, second)

    usage = daemon.read(f"s/{sid}/usage")
    if name == "kiro":
        assert usage.endswith(" [estimated]\n") and ", 2 requests, 0 cached" in usage
    else:
        assert usage == f"230 in, 15 out, 2 requests, {CACHED[name]} cached\n"


@pytest.mark.parametrize("name", NAMES)
def test_an_error_line_names_the_provider_and_status_never_the_key(
    keyed: tuple[ReplayServer, Daemon], name: str
) -> None:
    server, daemon = keyed
    server.add([Entry(status=400, error=f"no such thing (key {KEY})")])
    sid = daemon.new(name=f"err-{name}", backend=name, model="replay")
    daemon.prompt(sid, "go")
    daemon.wait_idle(sid)
    last = daemon.read(f"s/{sid}/chat").splitlines()[-1]
    assert last == f"error: {name}: HTTP 400: no such thing (key ***)"
    for f in ("chat", "context", "cfg", "env", "usage", "systemprompt"):
        assert KEY not in daemon.read(f"s/{sid}/{f}"), f
    assert KEY not in daemon.snapshot(f"s/{sid}/events")
    assert KEY not in daemon.stderr()


def test_thinking_blocks_survive_a_restart(tmp_path: Path) -> None:
    """Anthropic's signed thinking goes back with its tool call even after the daemon
    restarted: the journal keeps the provider's opaque state verbatim."""
    with ReplayServer(key=KEY) as server:
        daemon = Daemon(tmp_path, server, server.settings())
        (daemon.work / "notes.txt").write_text("alpha\n")
        server.add(turn_script("toolu_keep"))
        with daemon.running():
            sid = daemon.new(name="keep", backend="anthropic", model="replay")
            daemon.write(f"s/{sid}/ctl", "tool_load file_read")
            daemon.prompt(sid, "read")
            daemon.wait_idle(sid)
            context = [json.loads(x) for x in daemon.read(f"s/{sid}/context").splitlines()]
            assert any("anthropic" in m.get("provider_data", {}) for m in context)
        server.add([Entry(reply="still here")])
        with daemon.running():
            daemon.prompt("keep", "again")
            daemon.wait_idle("keep")
        assert_opaque_state_went_back("anthropic", server.recorded[-1])


def test_no_key_reaches_a_tool(keyed: tuple[ReplayServer, Daemon]) -> None:
    """Every backend's key is set; a tool that prints its whole environment shows none."""
    server, daemon = keyed
    code = {"code": "env; cat /proc/self/environ | tr '\\\\0' '\\\\n'", "language": "bash"}
    server.add(
        [
            Entry(tool_calls=(EntryToolCall(name="execute_code", arguments=code, id="e1"),)),
            Entry(reply="done"),
        ]
    )
    sid = daemon.new(name="env", backend="anthropic", model="replay")
    daemon.write(f"s/{sid}/ctl", "tool_load execute_code")
    daemon.prompt(sid, "show env")
    daemon.wait_idle(sid)
    _, output = tool_result_of("anthropic", server.recorded[-1])
    assert "OLLIE_SESSION_ID=" in output  # the tool did print its environment
    assert KEY not in output and "_KEY=" not in output


def test_usage_reported_with_an_error_in_the_stream_is_counted(
    keyed: tuple[ReplayServer, Daemon],
) -> None:
    """OpenRouter reports the usage (and cost) of a request that failed inside its 200
    stream: those tokens were billed, so ``usage`` and ``cost`` count them, beside the
    retried request's."""
    server, daemon = keyed
    server.add(
        [
            Entry(
                reply="partial",
                chunk=4,
                drop_after=1,
                status=502,
                in_stream=True,
                usage=EntryUsage(prompt_tokens=40, completion_tokens=3, cost=0.001),
            ),
            Entry(
                reply="whole", usage=EntryUsage(prompt_tokens=50, completion_tokens=2, cost=0.002)
            ),
        ]
    )
    sid = daemon.new(name="billed", backend="openai", model="replay")
    daemon.prompt(sid, "go")
    daemon.wait_idle(sid)
    chat = daemon.read(f"s/{sid}/chat")
    assert "retrying in " in chat and chat.endswith("assistant: whole\n"), chat
    assert daemon.read(f"s/{sid}/usage") == "90 in, 5 out, 2 requests, 0 cached\n"
    assert daemon.read(f"s/{sid}/cost") == "costLast=$0.0030\ncostSession=$0.0030\n"


def test_a_copilot_token_refused_mid_session_is_renewed_and_the_request_sent_again(
    keyed: tuple[ReplayServer, Daemon],
) -> None:
    """Copilot's API refuses a token before its time (401): the backend exchanges the
    GitHub token for a new one and sends the same request again, so the turn goes on."""
    server, daemon = keyed
    server.add([Entry(revoke_token=True), Entry(reply="after the renewal")])
    sid = daemon.new(name="renew", backend="copilot", model="replay")
    daemon.prompt(sid, "go")
    daemon.wait_idle(sid)
    chat = daemon.read(f"s/{sid}/chat")
    assert chat.endswith("user: go\nassistant: after the renewal\n"), chat
    first, second = server.recorded
    assert first.body == second.body
    tokens = [r.headers["authorization"].removeprefix("Bearer ") for r in (first, second)]
    assert tokens[0] != tokens[1]
    assert server.minted("copilot") == {tokens[1]}  # the first one is refused from now on


def test_tools_the_provider_ran_are_shown_kept_and_never_run(
    keyed: tuple[ReplayServer, Daemon],
) -> None:
    """Anthropic server tools (a web search here) come answered in the stream: chat
    shows the call and what it found, nothing runs them here (no "unknown tool", no
    second request), and the next request carries the blocks back where they stood."""
    server, daemon = keyed
    found = {
        "type": "web_search_result",
        "title": "Paris",
        "url": "https://example.org/paris",
        "encrypted_content": "Eqgf",
        "page_age": None,
    }
    search = EntryServerTool(
        name="web_search",
        arguments={"query": "capital of France"},
        id="srvtoolu_e2e",
        result=[found],
        after=len("Searching."),
    )
    server.add([Entry(reply="Searching. It is Paris.", server_tools=(search,))])
    sid = daemon.new(name="search", backend="anthropic", model="replay")
    daemon.prompt(sid, "capital?")
    daemon.wait_idle(sid)
    chat = daemon.read(f"s/{sid}/chat")
    assert chat.endswith(
        "user: capital?\n"
        "assistant: Searching.\n"
        '-> web_search({"query":"capital of France"})\n'
        "[run by anthropic] 1 found:\n"
        "Paris <https://example.org/paris>\n"
        "assistant:  It is Paris.\n"
    ), chat
    assert len(server.recorded) == 1  # nothing was answered here: the turn is over
    assert daemon.read(f"s/{sid}/tcct") == "0\n"
    daemon.prompt(sid, "thanks")
    daemon.wait_idle(sid)
    assistant = server.recorded[-1].body["messages"][1]
    assert [b["type"] for b in assistant["content"]] == [
        "text",
        "server_tool_use",
        "web_search_tool_result",
        "text",
    ]
    assert assistant["content"][2]["content"] == [found]


def written_turn(form: Literal["tags", "json"]) -> list[Entry]:
    """A turn whose thinking and tool call the model wrote into its text (``in_text``),
    as open models do when their server does not parse them; then the answer."""
    call = EntryToolCall(name="file_read", arguments={"path": "notes.txt"})
    return [
        Entry(
            reasoning="Read the notes first.",
            reply="Reading." if form == "tags" else "",  # a bare JSON call opens the reply
            tool_calls=(call,),
            in_text=form,
            chunk=3,  # every tag and the JSON cut between deltas
        ),
        Entry(reply="The notes say alpha."),
    ]


@pytest.mark.parametrize("form", ["tags", "json"])
@pytest.mark.parametrize("name", ["openai", "ollama"])
def test_tool_calls_and_thinking_written_in_the_text_are_read(
    keyed: tuple[ReplayServer, Daemon], name: str, form: Literal["tags", "json"]
) -> None:
    server, daemon = keyed
    (daemon.work / "notes.txt").write_text("alpha\n")
    server.add(written_turn(form))
    sid = daemon.new(name=f"w-{name}-{form}", backend=name, model="replay")
    daemon.write(f"s/{sid}/ctl", "tool_load file_read")
    daemon.prompt(sid, "what do the notes say?")
    daemon.wait_idle(sid)
    chat = daemon.read(f"s/{sid}/chat")
    said = "assistant: Reading.\n" if form == "tags" else ""
    assert (
        "user: what do the notes say?\n<think>\nRead the notes first.\n</think>\n"
        f'{said}-> file_read({{"path":"notes.txt"}})\n1\talpha\n'
        "assistant: The notes say alpha.\n"
    ) in chat, chat
    assert "<tool_call>" not in chat and '"name"' not in chat
    # The call went back as a call of the wire, answered by its result.
    _, text = tool_result_of(name, server.recorded[1])
    assert "alpha" in text
    if name == "openai":
        [assistant] = [m for m in server.recorded[1].body["messages"] if m.get("tool_calls")]
        [call] = assistant["tool_calls"]
        assert call["function"] == {"name": "file_read", "arguments": '{"path":"notes.txt"}'}


def test_a_profile_can_leave_the_text_as_written(keyed: tuple[ReplayServer, Daemon]) -> None:
    """textToolCalls false: the markup stays the reply's text and no call is run."""
    server, daemon = keyed
    profile = {"tools": ["client_9p", "file_read"], "textToolCalls": False}
    fd = os.open(daemon.p("a/plain.json"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, json.dumps(profile).encode())
    finally:
        os.close(fd)
    server.add(written_turn("tags")[:1])
    sid = daemon.new(name="plain", backend="openai", model="replay", agent="plain")
    daemon.prompt(sid, "go")
    daemon.wait_idle(sid)
    chat = daemon.read(f"s/{sid}/chat")
    assert chat.endswith(
        "user: go\nassistant: <think>Read the notes first.</think>\n\nReading.\n"
        '<tool_call>\n{"name": "file_read", "arguments": {"path":"notes.txt"}}\n</tool_call>\n'
    ), chat
    assert len(server.recorded) == 1


def test_a_written_call_cut_off_goes_back_as_a_tool_error(
    keyed: tuple[ReplayServer, Daemon],
) -> None:
    """A call written in the text whose JSON was cut off: not run, answered with a tool
    error that says so; the next request holds the call with arguments that parse."""
    server, daemon = keyed
    cut = EntryToolCall(name="file_read", arguments='{"path": "notes', id="ignored")
    server.add([Entry(tool_calls=(cut,), in_text="tags"), Entry(reply="I will ask again.")])
    sid = daemon.new(name="cut", backend="openai", model="replay")
    daemon.write(f"s/{sid}/ctl", "tool_load file_read")
    daemon.prompt(sid, "go")
    daemon.wait_idle(sid)
    chat = daemon.read(f"s/{sid}/chat")
    assert "\n[tool error] the arguments were cut off before their end (truncated JSON); " in chat
    assert chat.endswith("assistant: I will ask again.\n"), chat
    messages = server.recorded[1].body["messages"]
    [call] = [c for m in messages for c in m.get("tool_calls", ())]
    assert (call["function"]["name"], call["function"]["arguments"]) == ("file_read", "{}")
    [result] = [m for m in messages if m["role"] == "tool"]
    assert result["tool_call_id"] == call["id"]
    assert result["content"].startswith("[tool error] the arguments were cut off")
