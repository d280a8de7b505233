"""Images in tool results, in the form each wire takes them (pure encoding).

An MCP tool may answer with images (toolsrv carries them as ``image`` content, the agent
as ``Message.images``); each backend sends them where its API accepts images. Through a
real toolsrv, MCP server and replay server: tests/e2e/test_mcp.py.
"""

from __future__ import annotations

from typing import Any

import msgspec

from olliefs.agent.history import IMAGE_TOKENS, History, estimate_tokens
from olliefs.backend.anthropic import request_body as anthropic_body
from olliefs.backend.base import GenerationParams, Image, Message, ToolCall, WireCache
from olliefs.backend.gemini import request_body as gemini_body
from olliefs.backend.kiro import conversation
from olliefs.backend.ollama import request_body as ollama_body
from olliefs.backend.openai import request_body as openai_body

PNG = Image("image/png", 4, "iVBORw==")
JPEG = Image("image/jpeg", 3, "/9j/")
LINE = "[image image/png, 4 bytes, saved as /tmp/x.png]"
HISTORY = [
    Message("system", "be brief"),
    Message("user", "show me"),
    Message(
        "assistant",
        "",
        tool_calls=(ToolCall("c1", "mcp_pics_shot", "{}"), ToolCall("c2", "ls", "{}")),
    ),
    Message("tool", LINE, tool_call_id="c1", name="mcp_pics_shot", images=(PNG, JPEG)),
    Message("tool", "a b", tool_call_id="c2", name="ls"),
    Message("assistant", "I see a plot."),
    Message("user", "thanks"),
]
PARAMS = GenerationParams()


def test_anthropic_tool_result_holds_text_and_image_blocks() -> None:
    body = anthropic_body("claude-x", HISTORY, [], PARAMS)
    result = dict(body["messages"][2]["content"][0])
    result.pop("cache_control", None)
    assert result["type"] == "tool_result" and result["tool_use_id"] == "c1"
    assert result["content"] == [
        {"type": "text", "text": LINE},
        {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": PNG.data},
        },
        {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/jpeg", "data": JPEG.data},
        },
    ]
    assert body["messages"][2]["content"][1]["content"] == "a b"  # without images: text
    # Its text is short, its images are not: a cache breakpoint, as on a large result.
    assert body["messages"][2]["content"][0].get("cache_control") == {"type": "ephemeral"}
    assert "cache_control" not in body["messages"][2]["content"][1]


def test_openai_images_follow_the_tool_results_in_a_user_message() -> None:
    for wire in (None, WireCache()):
        msgs = openai_body("gpt-x", HISTORY, [], PARAMS, wire=wire)["messages"]
        msgs = [msgspec.json.decode(msgspec.json.encode(m)) for m in msgs]
        roles = [m["role"] for m in msgs]
        assert roles == ["system", "user", "assistant", "tool", "tool", "user", "assistant", "user"]
        assert msgs[3] == {"role": "tool", "content": LINE, "tool_call_id": "c1"}
        images = msgs[5]["content"]
        assert images[0]["type"] == "text" and "mcp_pics_shot (c1)" in images[0]["text"]
        assert images[1:] == [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG.data}"}},
            {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{JPEG.data}"}},
        ]


def test_openai_without_images_is_unchanged() -> None:
    plain = [msgspec.structs.replace(m, images=()) for m in HISTORY]
    msgs = openai_body("gpt-x", plain, [], PARAMS)["messages"]
    assert [m["role"] for m in msgs] == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "user",
    ]


def test_gemini_inline_data_next_to_the_function_response() -> None:
    contents = gemini_body(HISTORY, [], PARAMS)["contents"]
    parts: list[dict[str, Any]] = contents[2]["parts"]
    assert parts[0]["functionResponse"]["id"] == "c1"
    assert parts[1:3] == [
        {"inlineData": {"mimeType": "image/png", "data": PNG.data}},
        {"inlineData": {"mimeType": "image/jpeg", "data": JPEG.data}},
    ]
    assert parts[3]["functionResponse"]["id"] == "c2"


def test_ollama_images_on_the_tool_message() -> None:
    msgs = ollama_body("llava", HISTORY, [], PARAMS)["messages"]
    assert msgs[3]["role"] == "tool" and msgs[3]["images"] == [PNG.data, JPEG.data]
    assert "images" not in msgs[4]


def test_kiro_images_with_the_user_message_of_the_results() -> None:
    state = conversation("claude-sonnet-4", HISTORY, [], "conv-1")
    users = [t["userInputMessage"] for t in state["history"] if "userInputMessage" in t]
    with_results = next(u for u in users if u.get("userInputMessageContext", {}).get("toolResults"))
    assert with_results["images"] == [
        {"format": "png", "source": {"bytes": PNG.data}},
        {"format": "jpeg", "source": {"bytes": JPEG.data}},
    ]


def test_an_image_counts_and_a_collapsed_result_drops_it() -> None:
    msgs = [msgspec.structs.replace(m, tier="cold") if m.images else m for m in HISTORY]
    h = History(msgs)
    plain = History([msgspec.structs.replace(m, images=()) for m in msgs])
    # Both results were answered after: the cold one is collapsed, images and all.
    assert h.estimate() == plain.estimate()
    shown = h.for_model()[3]
    assert shown.images == () and "collapsed" in shown.content
    hot = History(HISTORY)
    assert (
        hot.estimate()
        == History([msgspec.structs.replace(m, images=()) for m in HISTORY]).estimate()
        + 2 * IMAGE_TOKENS
    )
    assert estimate_tokens(LINE) > 0
