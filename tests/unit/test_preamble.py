"""The system prompt's list of tools to load: short, whatever the catalogue holds."""

from __future__ import annotations

from typing import Any, cast

from olliefs.agent.runtime import PREAMBLE_MCP_TOOLS, ToolLink, preamble
from olliewire import ToolMeta


def link(names: list[str]) -> ToolLink:
    out = ToolLink(cast(Any, None), "a", ["client_9p"])
    out.catalogue = {n: ToolMeta(n, f"does {n}.") for n in ["client_9p", *names]}
    return out


def test_a_few_mcp_tools_are_listed_one_by_one() -> None:
    text = preamble(session_id="s", cwd="/w", profile_prompt="", link=link(["mcp_t_a"]))
    assert "- mcp_t_a: does mcp_t_a." in text


def test_hundreds_of_mcp_tools_are_counted_and_left_to_tool_search() -> None:
    mcp = [f"mcp_big_op{i}" for i in range(300)]
    text = preamble(
        session_id="s", cwd="/w", profile_prompt="", link=link(["file_read", "tool_search", *mcp])
    )
    assert "- file_read: does file_read." in text and "- tool_search:" in text
    assert "mcp_big_op1" not in text
    assert "- and 300 tools of MCP servers (mcp_SERVER_TOOL): find one with tool_search" in text
    assert len(text.splitlines()) < 10 + PREAMBLE_MCP_TOOLS
