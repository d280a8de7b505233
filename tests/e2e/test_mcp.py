"""MCP servers' tools end to end: daemon + the toolsrv it spawns + the reference
``mcp-server-time`` from PyPI + the replay LLM server as the model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

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
