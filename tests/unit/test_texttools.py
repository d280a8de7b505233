"""Tool calls and ``<think>`` read out of a reply's text (``backend/texttools.py``): each
case read whole, one character per delta, and cut anywhere (hypothesis) reads the same."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from olliefs.backend.base import StreamEvent
from olliefs.backend.texttools import TextTools

TOOLS = ("file_read", "file_write")
Outcome = tuple[str, str, list[tuple[str, Any]]]


def read(pieces: list[str], tools: tuple[str, ...] = TOOLS) -> Outcome:
    reader, out = TextTools(tools), list[StreamEvent]()
    for piece in pieces:
        reader.feed(piece, out)
    calls = reader.finish(out)
    assert {e.kind for e in out} <= {"content", "reasoning"}
    assert all(e.text for e in out)  # no empty delta goes out
    content = "".join(e.text for e in out if e.kind == "content")
    reasoning = "".join(e.text for e in out if e.kind == "reasoning")

    def args(text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError:
            return text

    return content, reasoning, [(c.name, args(c.arguments)) for c in calls]


CALL = '{"name": "file_read", "arguments": {"path": "a.txt"}}'
READ = ("file_read", {"path": "a.txt"})
CASES: list[tuple[str, str, Outcome]] = [
    ("plain text", "Hello <b>world</b> {x} a < b", ("Hello <b>world</b> {x} a < b", "", [])),
    ("think", "<think>hmm\nok</think>\n\nAnswer.", ("Answer.", "hmm\nok", [])),
    ("think after whitespace", " \n<think>a</think>b", ("b", "a", [])),
    ("think never closed", "<think>still thinking", ("", "still thinking", [])),
    ("think mid-text is text", "x <think>y</think>", ("x <think>y</think>", "", [])),
    ("leading whitespace kept", "\n\nHello", ("\n\nHello", "", [])),
    (
        "tagged call after text",
        f"Let me read.\n<tool_call>\n{CALL}\n</tool_call>",
        ("Let me read.\n", "", [READ]),
    ),
    (
        "two tagged calls",
        f"<tool_call>{CALL}</tool_call>\n<tool_call>{CALL}</tool_call>",
        ("", "", [READ, READ]),
    ),
    ("a list in one tag", f"<tool_call>[{CALL}, {CALL}]</tool_call>", ("", "", [READ, READ])),
    ("tag never closed", f"<tool_call>\n{CALL}\n", ("", "", [READ])),
    (
        "tagged call cut off",
        '<tool_call>{"name": "file_read", "arguments": {"path": "a',
        ("", "", [("file_read", '{"name": "file_read", "arguments": {"path": "a')]),
    ),
    (
        "a tag names any tool",
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
        ("", "", [("nope", {})]),
    ),
    (
        "not JSON in a tag",
        "<tool_call>oops</tool_call> ok",
        ("<tool_call>oops</tool_call> ok", "", []),
    ),
    ("bare JSON call", CALL, ("", "", [READ])),
    ("bare JSON calls", f"{CALL}\n{CALL}", ("", "", [READ, READ])),
    (
        "bare JSON with parameters",
        '{"name": "file_read", "parameters": {"path": "a.txt"}}',
        ("", "", [READ]),
    ),
    (
        "bare JSON naming no offered tool",
        '{"name": "rm", "arguments": {}}',
        ('{"name": "rm", "arguments": {}}', "", []),
    ),
    (
        "bare JSON with another key",
        '{"name": "file_read", "arguments": {}, "why": 1}',
        ('{"name": "file_read", "arguments": {}, "why": 1}', "", []),
    ),
    ("JSON of another kind", '{"type": "object"} done', ('{"type": "object"} done', "", [])),
    ("a brace of prose", "{not json at all", ("{not json at all", "", [])),
    ("empty object", "{}", ("{}", "", [])),
    (
        "braces and quotes in strings",
        '{"name": "file_write", "arguments": {"content": "a } \\" { \\\\"}}',
        ("", "", [("file_write", {"content": 'a } " { \\'})]),
    ),
    (
        "think then a bare call",
        f"<think>read it</think>\n{CALL}",
        ("", "read it", [READ]),
    ),
    (
        "text after a call",
        f"<tool_call>{CALL}</tool_call>\n\nDone.",
        ("Done.", "", [READ]),
    ),
    (
        "string arguments",
        '{"name": "file_read", "arguments": "{\\"path\\": 1}"}',
        ("", "", [("file_read", {"path": 1})]),
    ),
    ("a cut tag at the end", "so <tool_ca", ("so <tool_ca", "", [])),
    ("a cut think at the end", "<thi", ("<thi", "", [])),
]


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_read_whole_and_one_character_at_a_time(text: str, expected: Outcome) -> None:
    assert read([text]) == expected
    assert read(list(text)) == expected


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_any_cut_reads_the_same(data: st.DataObject) -> None:
    _, text, expected = data.draw(st.sampled_from(CASES))
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert read([p for p in pieces if p]) == expected


def test_without_tools_offered_only_think_is_read() -> None:
    text = f"<think>t</think><tool_call>{CALL}</tool_call> {CALL}"
    assert read([text], tools=()) == (f"<tool_call>{CALL}</tool_call> {CALL}", "t", [])


def test_plain_text_passes_through_as_it_came() -> None:
    """Once the text began, a delta without ``<`` is passed on as the same event."""
    reader, out = TextTools(TOOLS), list[StreamEvent]()
    for piece in ["Hello", " world", ", {x}", " and ", "more"]:
        reader.feed(piece, out)
    assert [e.text for e in out] == ["Hello", " world", ", {x}", " and ", "more"]
