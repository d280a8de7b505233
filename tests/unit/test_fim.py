"""Fill in the middle, the pure parts: reading a chat model's answer (``fim.insertion``)
and the request format of the root ``complete`` file (``session.complete``).

The wire requests themselves are tested over real HTTP against the replay server
(tests/clients/test_complete.py, tests/clients/test_ellie.py).
"""

from __future__ import annotations

import pytest

from olliefs.backend.fim import CURSOR, insertion, strip_think
from olliefs.errors import InvalidRequest
from olliefs.session.complete import HEAD_MAX, Head, parse_head, split

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"


@pytest.mark.parametrize(
    "answer",
    [
        "<insert>return a + b</insert>",
        "return a + b",
        "Here is the completion:\n<insert>return a + b</insert>\nHope it helps.",
        "Sure!\n```python\nreturn a + b\n```\nThis adds the numbers.",
        "```\n    return a + b\n```",  # the indentation typed already, repeated
        "<think>the sum</think>\n<insert>return a + b</insert>",
        "<insert>\nreturn a + b\n</insert>",  # the tag on a line of its own
        f"<insert>return a + b{CURSOR}</insert>",
        "```python\n    return a + b\n\nprint(add(1, 2))\n```",  # the suffix repeated
        "<insert>return a + b\n\nprint(add(1, 2))</insert>",
    ],
)
def test_only_the_inserted_text_is_kept(answer: str) -> None:
    assert insertion(answer, PREFIX, SUFFIX) == "return a + b"


def test_the_part_of_the_line_typed_already_is_not_inserted_twice() -> None:
    assert insertion("<insert>    return a</insert>", "x = 1\n    ret", "") == "urn a"
    assert insertion("<insert>return a</insert>", "x = 1\n    ret", "") == "urn a"
    # A line that only looks alike is kept.
    assert insertion("<insert>(a, b)</insert>", "print", "") == "(a, b)"


def test_a_newline_at_the_start_is_kept_where_the_cursor_ends_a_line() -> None:
    assert insertion("<insert>\n    return 1</insert>", "def f():", "") == "\n    return 1"


def test_an_unclosed_tag_or_fence_runs_to_the_end() -> None:
    assert insertion("<insert>return a + b", PREFIX, SUFFIX) == "return a + b"
    assert insertion("```python\nreturn a + b\n", PREFIX, SUFFIX) == "return a + b"


def test_nothing_to_insert() -> None:
    assert insertion("<insert></insert>", PREFIX, SUFFIX) == ""
    assert insertion("", PREFIX, SUFFIX) == ""


def test_think_is_dropped_only_at_the_start() -> None:
    assert strip_think("<think>\nhmm\n</think>\nx = <think>") == "x = <think>"
    assert strip_think("x <think>y</think>") == "x <think>y</think>"


# ---- the request format -----------------------------------------------------------------

BACKENDS = ["openai", "ollama"]


def test_header_and_body() -> None:
    assert split(b"model=m\nsuffix=2\n\nabcd") == (b"model=m\nsuffix=2", b"abcd")
    assert split(b"\nabc\n\ndef") == (b"", b"abc\n\ndef")  # no header lines at all
    assert split(b"model=m\n") is None  # the empty line has not come yet
    assert split(b"x" * (HEAD_MAX + 10) + b"\n\n") is None  # not a header any more
    head = parse_head("backend=ollama\nmodel=qwen\nfile=a b.py\ntimeout=2.5\nsuffix=2", BACKENDS)
    assert head == Head("ollama", "qwen", "a b.py", 2.5, 256, 2)


def test_empty_values_are_the_defaults() -> None:
    text = "backend=\nmodel=\nfile=\ntimeout=\nmax_tokens=\nsuffix="
    assert parse_head(text, BACKENDS) == Head()


@pytest.mark.parametrize(
    "text",
    [
        "nokey",
        "colour=red",
        "model=a\nmodel=b",
        "backend=nope",
        "timeout=0",
        "timeout=601",
        "timeout=nan",
        "max_tokens=0",
        "max_tokens=99999",
        "suffix=-1",
        "suffix=ten",
        "file=a\x1bb",
    ],
)
def test_bad_headers_are_refused_with_a_reason(text: str) -> None:
    with pytest.raises(InvalidRequest, match=r"^complete: "):
        parse_head(text, BACKENDS)
