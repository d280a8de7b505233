"""What the model reads of an MCP tool result (toolsrv.mcp.render): pure mapping."""

from __future__ import annotations

import base64
from pathlib import Path

import mcp_types as types

from toolsrv.mcp import render


def test_text_resources_images_and_structured_content(tmp_path: Path) -> None:
    png = b"\x89PNG\r\n\x1a\n" + b"\0" * 20
    result = types.CallToolResult(
        content=[
            types.TextContent(text="first"),
            types.ImageContent(data=base64.b64encode(png).decode(), mime_type="image/png"),
            types.EmbeddedResource(
                resource=types.TextResourceContents(uri="file:///a.txt", text="inside")
            ),
            types.ResourceLink(uri="file:///b.bin", name="b.bin"),
        ]
    )
    out = render(result, tmp_path, "srv")
    assert not out.isError
    lines = out.text.splitlines()
    assert lines[0] == "first"
    saved = next(p for p in tmp_path.iterdir() if p.suffix == ".png")
    assert saved.read_bytes() == png
    assert f"[image image/png, {len(png)} bytes, saved as {saved}]" in lines
    assert "[resource file:///a.txt]" in lines and "inside" in lines
    assert "[resource link file:///b.bin: b.bin]" in lines
    only = types.CallToolResult(content=[], structured_content={"t": 1})
    assert render(only, tmp_path, "srv").text == '{"t":1}'
    empty = types.CallToolResult(content=[], is_error=True)
    err = render(empty, tmp_path, "srv")
    assert err.isError and "srv reported an error" in err.text
    bad = types.CallToolResult(content=[types.ImageContent(data="%%%", mime_type="image/png")])
    assert "not valid base64" in render(bad, tmp_path, "srv").text


def test_a_listed_tool_has_a_one_line_description_and_an_object_schema() -> None:
    from toolsrv.mcp import MAX_DESCRIPTION, _listed

    tool = types.Tool(
        name="t",
        description="Line one.\n\n\tLine\ttwo " + "x" * 2000,
        input_schema={"type": "object"},
        annotations=types.ToolAnnotations(read_only_hint=True),
    )
    listed = _listed(tool)
    assert listed.description.startswith("Line one. Line two x")
    assert "\n" not in listed.description and "\t" not in listed.description
    assert len(listed.description) == MAX_DESCRIPTION
    assert listed.schema == {"type": "object", "properties": {}} and listed.read_only
