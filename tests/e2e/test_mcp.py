"""MCP servers' tools end to end: daemon + the toolsrv it spawns + the reference
``mcp-server-time`` from PyPI + the replay LLM server as the model."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.conftest import Daemon, script
from tests.e2e.test_tools import call, calls, reply, sent_tools

TIME = Path(sys.executable).parent / "mcp-server-time"


def configure_time(daemon: Daemon) -> None:
    mcp = daemon.home / "config" / "mcp"
    mcp.mkdir(parents=True, exist_ok=True)
    (mcp / "time.json").write_text(json.dumps({"command": str(TIME)}))


@pytest.mark.skipif(not TIME.exists(), reason="mcp-server-time is not installed")
def test_model_calls_an_mcp_tool_and_the_answer_reaches_chat(daemon: Daemon) -> None:
    configure_time(daemon)
    # The first look after the file was written waits for the server's listing.
    line = next(
        x.split("\t")
        for x in daemon.read("t/idx").splitlines()
        if x.startswith("mcp_time_get_current_time\t")
    )
    assert line[3:] == ["cold", "parallel"]  # readOnlyHint
    daemon.replay.add(
        script(
            calls(call("mcp_time_get_current_time", {"timezone": "Europe/Paris"}, "c1")),
            reply("it is late in Paris"),
        )
    )
    sid = daemon.new(name="t", cwd=str(daemon.work))
    daemon.write(f"s/{sid}/ctl", "tool_load mcp_time_get_current_time")
    daemon.prompt(sid, "what time is it in Paris?")
    daemon.wait_idle(sid)
    chat = daemon.read(f"s/{sid}/chat")
    assert '-> mcp_time_get_current_time({"timezone":"Europe/Paris"})' in chat
    assert '"timezone": "Europe/Paris"' in chat.split("-> mcp_time_get_current_time")[1]
    assert chat.endswith("assistant: it is late in Paris\n")
    assert "mcp_time_get_current_time" in sent_tools(daemon, 0)
    assert daemon.read(f"s/{sid}/tcct") == "1\n"


async def test_an_sdk_client_drives_sessions_through_ollie_mcp(daemon: Daemon) -> None:
    """The SDK's own client against ``ollie mcp`` (stdio): create, prompt with progress,
    read, and resume by id after the daemon restarted."""
    import mcp_types as types
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client
    from mcp.shared.exceptions import MCPDeprecationWarning

    daemon.replay.add(script(reply("the first answer"), reply("the answer after a restart")))
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "olliefs.cli", "mcp", str(daemon.path)],
        env={k: v for k, v in daemon.env.items() if isinstance(v, str)},
        cwd=str(daemon.work),  # where a client such as Claude Code starts it: its project
    )

    def data(res: types.CallToolResult) -> dict[str, Any]:
        assert not res.is_error, res.content
        assert res.structured_content is not None
        return dict(res.structured_content)

    updated = trio.Event()

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ResourceUpdatedNotification):
            if message.params.uri == "ollie://s/m/chat":
                updated.set()

    async with (
        stdio_client(params) as (r, w),
        ClientSession(r, w, message_handler=on_message) as client,
    ):
        await client.initialize()
        names = {t.name for t in (await client.list_tools()).tools}
        assert {"session_create", "session_prompt", "session_chat", "session_fork"} <= names
        made = data(await client.call_tool("session_create", {"name": "m"}))
        assert made["session"] == "m" and made["state"] == "idle"
        # Each session's resources are listed as they are, besides the templates.
        listed = {str(r.uri): r for r in (await client.list_resources()).resources}
        assert {"ollie://s/m/chat", "ollie://s/m/context"} <= set(listed)
        assert listed["ollie://s/m/chat"].mime_type == "text/plain"
        templates = (await client.list_resource_templates()).resource_templates
        assert "ollie://s/{session}/chat" in {t.uri_template for t in templates}
        assert f"cwd={daemon.work}\n" in daemon.read("s/m/cfg")
        streamed: list[str] = []

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            streamed.append(message or "")

        # The handshake's protocol (2025-11-25) subscribes the older way, which the SDK
        # calls deprecated (subscriptions/listen needs 2026-07-28; ollie mcp serves both).
        with pytest.warns(MCPDeprecationWarning):
            await client.subscribe_resource("ollie://s/m/chat")
        res = data(
            await client.call_tool(
                "session_prompt", {"session": "m", "text": "hello"}, progress_callback=on_progress
            )
        )
        with trio.fail_after(20):
            await updated.wait()  # the subscription saw the chat change
        assert res["session"] == "m" and res["state"] == "idle"
        assert "assistant: the first answer" in res["chat"]
        assert "the first answer" in "".join(streamed)
        # A refusal is a tool error with the daemon's reason.
        bad = await client.call_tool("session_prompt", {"session": "nope", "text": "x"})
        assert bad.is_error and "no such session: nope" in str(bad.content)
        daemon.stop()
        daemon.start()
        # Resumed by id: the same server process, the same session, its history kept.
        res = data(await client.call_tool("session_prompt", {"session": "m", "text": "again"}))
        assert "assistant: the answer after a restart" in res["chat"]
        whole = data(await client.call_tool("session_chat", {"session": "m", "offset": 0}))
        assert "the first answer" in whole["chat"] and "after a restart" in whole["chat"]
        chat = await client.read_resource("ollie://s/m/chat")
        assert any("after a restart" in getattr(c, "text", "") for c in chat.contents)
        fork = data(await client.call_tool("session_fork", {"session": "m", "name": "m2"}))
        assert fork["session"] == "m2" and "m2\t" in daemon.read("s/idx")
        data(await client.call_tool("session_rewind", {"session": "m", "turns": 1}))
        assert "after a restart" not in daemon.read("s/m/chat").split(":: rewound")[-1]
        assert "after a restart" in daemon.read("s/m2/context")
        assert data(await client.call_tool("session_stop", {"session": "m"}))["state"] == "idle"
        state = data(await client.call_tool("session_state", {"session": "m2"}))
        assert state["usage"] and state["cost"].startswith("costLast=")


@pytest.mark.skipif(not TIME.exists(), reason="mcp-server-time is not installed")
def test_mcp_files_are_written_through_the_tree_by_the_user_only(daemon: Daemon) -> None:
    from tests.e2e.test_sandbox_doors import _agent_calls, _write

    mine = daemon.p("mcp/time.json")
    mine.write_text(json.dumps({"command": str(TIME)}))
    assert oct(mine.stat().st_mode & 0o777) == "0o600"  # env may hold a token
    assert (daemon.home / "config" / "mcp" / "time.json").exists()
    names = [x.split("\t")[0] for x in daemon.read("t/idx").splitlines()]
    assert "mcp_time_get_current_time" in names
    # A sandboxed agent can neither add a server nor change (or empty) the user's.
    sid = daemon.new(name="w")
    evil = json.dumps({"command": "/bin/sh", "roots": ["/"], "network": True})
    results = _agent_calls(
        daemon, sid, [_write("/mcp/evil.json", evil), _write("/mcp/time.json", evil)]
    )
    assert all("Permission denied" in r for r in results), results
    assert not daemon.p("mcp/evil.json").exists()
    assert json.loads(mine.read_text()) == {"command": str(TIME)}
    assert "may not write an MCP server's file" in daemon.read("err")


def test_ollie_mcp_over_http_on_the_loopback_with_a_key(daemon: Daemon, tmp_path: Path) -> None:
    """Streamable HTTP, with the SDK's client on asyncio (most MCP clients' loop; under
    trio its HTTP client leaves its stream generators to the garbage collector)."""
    import socket
    import subprocess

    import anyio
    import httpx
    from mcp.client.session import ClientSession
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    cli = [sys.executable, "-m", "olliefs.cli", "mcp", str(daemon.path)]
    env = {k: v for k, v in daemon.env.items() if isinstance(v, str)}
    # Off the loopback without a key: refused before anything listens.
    off = subprocess.run(
        [*cli, "--http", "0", "--http-host", "0.0.0.0"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert off.returncode == 1 and "--http-key-file" in off.stderr
    key = tmp_path / "key"
    key.write_text("s3cret-s3cret-s3cret\n")
    key.chmod(0o600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [*cli, "--http", str(port), "--http-key-file", str(key)], env=env, stdin=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}/mcp"

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    async def client_side() -> dict[str, Any]:
        async with httpx.AsyncClient() as plain:
            got = await plain.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
            assert got.status_code == 401
        client = create_mcp_http_client(headers={"Authorization": "Bearer s3cret-s3cret-s3cret"})
        async with (
            client,
            streamable_http_client(url, http_client=client) as (r, w),
            ClientSession(r, w) as session,
        ):
            await session.initialize()
            res = await session.call_tool("session_create", {"name": "h", "cwd": str(daemon.work)})
            assert not res.is_error and res.structured_content is not None
            return dict(res.structured_content)

    try:
        daemon.wait_for(listening)
        made = anyio.run(client_side)
        assert made["session"] == "h" and "h\t" in daemon.read("s/idx")
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_stop_cuts_a_hanging_mcp_call_and_the_server_serves_the_next(daemon: Daemon) -> None:
    from tests.toolsrv.test_mcp import TINY

    server = daemon.base / "tiny.py"
    server.write_text(TINY)
    mcp = daemon.home / "config" / "mcp"
    mcp.mkdir(parents=True, exist_ok=True)
    (mcp / "tiny.json").write_text(json.dumps({"command": sys.executable, "args": [str(server)]}))
    assert "mcp_tiny_hang\t" in daemon.read("t/idx")
    daemon.replay.add(
        script(
            calls(call("mcp_tiny_hang", {}, "c1")),
            calls(call("mcp_tiny_echo", {"text": "still here"}, "c2")),
            reply("done"),
        )
    )
    sid = daemon.new(name="t", cwd=str(daemon.work))
    daemon.write(f"s/{sid}/ctl", "tool_load mcp_tiny_hang\ntool_load mcp_tiny_echo")
    daemon.prompt(sid, "hang")
    daemon.wait_chat(sid, "-> mcp_tiny_hang")
    daemon.write(f"s/{sid}/ctl", "stop")
    daemon.wait_idle(sid)
    daemon.prompt(sid, "again")
    daemon.wait_idle(sid)
    chat = daemon.read(f"s/{sid}/chat")
    assert "echo: still here" in chat.split("-> mcp_tiny_echo")[1], chat
    assert chat.endswith("assistant: done\n")


PICS = """\
import base64
import mcp_types as types
from mcp.server.mcpserver import MCPServer

app = MCPServer("pics")
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)

@app.tool()
def shot() -> list[types.TextContent | types.ImageContent]:
    \"\"\"A picture of the plot.\"\"\"
    return [
        types.TextContent(type="text", text="the plot:"),
        types.ImageContent(
            type="image", data=base64.b64encode(PNG).decode(), mime_type="image/png"
        ),
    ]

app.run()
"""


def pics_daemon(tmp_path: Path, server: Any) -> Daemon:
    """A daemon (not started) whose config has the server of PICS as ``pics``."""
    d = Daemon(tmp_path, server, server.settings())
    (tmp_path / "pics.py").write_text(PICS)
    mcp = d.home / "config" / "mcp"
    mcp.mkdir(parents=True)
    (mcp / "pics.json").write_text(
        json.dumps({"command": sys.executable, "args": [str(tmp_path / "pics.py")]})
    )
    return d


def image_sent(name: str, body: dict[str, Any]) -> str:
    """The base64 image the request carries back with the tool's result, found where
    ``name``'s wire puts it."""
    if name == "anthropic":
        for m in body["messages"]:
            for b in m["content"]:
                if isinstance(b, dict) and b.get("type") == "tool_result":
                    [img] = [c for c in b["content"] if c["type"] == "image"]
                    assert img["source"]["media_type"] == "image/png"
                    return str(img["source"]["data"])
    elif name in ("openai", "copilot"):
        for m in body["messages"]:
            if m["role"] == "user" and isinstance(m["content"], list):
                [part] = [c for c in m["content"] if c["type"] == "image_url"]
                url = str(part["image_url"]["url"])
                assert url.startswith("data:image/png;base64,")
                return url.removeprefix("data:image/png;base64,")
    elif name == "gemini":
        for c in body["contents"]:
            for p in c["parts"]:
                if "inlineData" in p:
                    assert p["inlineData"]["mimeType"] == "image/png"
                    return str(p["inlineData"]["data"])
    elif name == "ollama":
        for m in body["messages"]:
            if m["role"] == "tool" and m.get("images"):
                return str(m["images"][0])
    raise AssertionError(f"no image in the {name} request")


@pytest.mark.parametrize("name", ["anthropic", "openai", "copilot", "gemini", "ollama"])
def test_an_image_result_reaches_the_model_as_an_image(name: str, tmp_path: Path) -> None:
    """An MCP tool answers with text and a PNG: the model gets the picture in its wire's
    form (and the text with a line naming the saved file), in the request after the call
    and, after a daemon restart, in the next one (the journal keeps it)."""
    import base64

    from olliefs.replay import ReplayServer
    from olliefs.replay.script import Entry, EntryToolCall

    with ReplayServer(key="sk-images-0123456789abcdef") as server:  # (Copilot needs one)
        d = pics_daemon(tmp_path, server)
        server.add(
            [
                Entry(tool_calls=(EntryToolCall(name="mcp_pics_shot", arguments={}, id="c1"),)),
                Entry(reply="a dot"),
            ]
        )
        with d.running():
            assert "mcp_pics_shot\t" in d.read("t/idx")  # (waits for the server's listing)
            sid = d.new(name="p", backend=name, model="replay", cwd=str(d.work))
            d.write(f"s/{sid}/ctl", "tool_load mcp_pics_shot")
            d.prompt(sid, "look")
            d.wait_idle(sid)
            assert d.read(f"s/{sid}/chat").endswith("assistant: a dot\n")
            sent = image_sent(name, server.recorded[-1].body)
            # Copilot takes images only in a request that says it carries some.
            vision = server.recorded[-1].headers.get("copilot-vision-request")
            assert vision == ("true" if name == "copilot" else None)
            assert "copilot-vision-request" not in server.recorded[0].headers
            png = base64.b64decode(sent, validate=True)
            assert png.startswith(b"\x89PNG")
            context = d.read(f"s/{sid}/context")
            assert sent not in context and f'"mime":"image/png","size":{len(png)}' in context
        server.add([Entry(reply="still a dot")])
        with d.running():
            d.prompt("p", "again")
            d.wait_idle("p")
        assert image_sent(name, server.recorded[-1].body) == sent


def test_why_an_mcp_server_failed_is_in_the_tree(daemon: Daemon) -> None:
    """A server that cannot start, and one whose file does not parse, are not only in
    toolsrv's log: ``mcp/idx`` says each server's state and why it failed."""
    from olliefs.testing import expect_log
    from tests.toolsrv.test_mcp import TINY

    expect_log(r"toolsrv\.mcp: MCP server left out: \S*/bad\.json: Expected `str`")
    expect_log(r"toolsrv\.mcp: MCP server gone ended: the MCP server gone exited", logging.ERROR)
    expect_log(r"toolsrv\.mcp: MCP server gone: the MCP server gone exited", logging.ERROR, None)
    server = daemon.base / "tiny.py"
    server.write_text(TINY)
    mcp = daemon.home / "config" / "mcp"
    mcp.mkdir(parents=True, exist_ok=True)
    (mcp / "tiny.json").write_text(json.dumps({"command": sys.executable, "args": [str(server)]}))
    (mcp / "gone.json").write_text(json.dumps({"command": "/nonexistent/mcp-server"}))
    (mcp / "bad.json").write_text('{"command": 3}')
    rows = {
        line.split("\t")[0]: line.split("\t")[1:] for line in daemon.read("mcp/idx").splitlines()
    }
    assert rows["tiny"][:2] == ["listed", str(sum(1 for _ in TINY.split("@app.tool()")) - 1)]
    assert rows["tiny"][2] == ""
    assert rows["gone"][:2] == ["failed", "0"]
    assert "exited (exit status 1)" in rows["gone"][2]
    assert "No such file or directory" in rows["gone"][2]
    assert rows["bad"][:2] == ["failed", "0"] and "bad.json" in rows["bad"][2]
    assert "idx" not in {n.removesuffix(".json") for n in os.listdir(mcp)}  # not on disk
    os.unlink(daemon.p("mcp/gone.json"))  # through the tree: idx reads toolsrv again
    names = [line.split("\t")[0] for line in daemon.read("mcp/idx").splitlines()]
    assert names == ["bad", "tiny"]


def test_a_model_that_refuses_images_gets_the_text_lines_instead(tmp_path: Path) -> None:
    """A model without vision refuses the request that carries the tool's image (a
    400): it is sent again at once without images, and so is every later request of
    the session; the history keeps them."""
    from olliefs.replay import ReplayServer
    from olliefs.replay.script import Entry, EntryToolCall

    with ReplayServer(key="sk-images-0123456789abcdef") as server:
        d = pics_daemon(tmp_path, server)
        shot = EntryToolCall(name="mcp_pics_shot", arguments={}, id="c1")
        refused = Entry(status=400, error="this model does not support image input")
        server.add([Entry(tool_calls=(shot,)), refused, Entry(reply="no pixels seen")])
        with d.running():
            assert "mcp_pics_shot\t" in d.read("t/idx")
            sid = d.new(name="blind", backend="openai", model="replay", cwd=str(d.work))
            d.write(f"s/{sid}/ctl", "tool_load mcp_pics_shot")
            d.prompt(sid, "look")
            d.wait_idle(sid)
            chat = d.read(f"s/{sid}/chat")
            assert "sending the request again without the tool results' images" in chat
            assert chat.endswith("assistant: no pixels seen\n")
            with_images, without = (r.body["messages"] for r in server.recorded[-2:])
            assert len(with_images) == len(without) + 1  # the images' user message
            [result] = [m for m in without if m["role"] == "tool"]
            assert "saved as" in result["content"]  # the text line names the file
            server.add([Entry(reply="still none")])
            d.prompt(sid, "again")
            d.wait_idle(sid)
            assert "image_url" not in json.dumps(server.recorded[-1].body)
            assert '"mime":"image/png"' in d.read(f"s/{sid}/context")  # kept
