"""The chat shows control bytes, it never sends them to a terminal (pure rendering).

``visible`` and ``ChatRenderer`` on their own: no control a terminal acts on survives,
text without one is untouched, and a streamed reply renders the same bytes however its
deltas were cut. Through the mount (events and context keep the bytes) see
``tests/e2e/test_chat_controls.py``.
"""

from __future__ import annotations

import itertools
import re

from hypothesis import example, given
from hypothesis import strategies as st

from olliefs.agent.chat import ChatRenderer, visible, visible_bytes
from olliefs.agent.events import Event, EventRole
from olliefs.live import GrowingLog

# C0 but tab and newline, DEL, C1; a carriage return only before a newline.
RAW = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]|\r(?!\n)")

# Text rich in what matters here: controls, CR/LF, and plain characters around them.
texts = st.text(
    alphabet=st.sampled_from(
        ["a", " ", "é", "\t", "\n", "\r", "\x00", "\x1b", "\x07", "\x7f", "\x85", "\x9b", "["]
    ),
    min_size=1,
)


def ev(role: EventRole, content: str) -> Event:
    return Event(0.0, "s", "u", role, "", content)


def rendered(*events: Event) -> str:
    log = GrowingLog()
    r = ChatRenderer(log)
    for e in events:
        r.render(e)
    r.end_turn()
    return log.read(0, len(log)).decode()


def test_what_a_terminal_would_obey_is_shown() -> None:
    assert visible("a\x00b") == "a\u2400b"
    assert visible("\x1b[2J") == "\u241b[2J"
    assert visible("\x1b]52;c;aGk=\x07") == "\u241b]52;c;aGk=\u2407"
    assert visible("\x9b31m") == "\u241b[31m"  # C1 CSI: its 7-bit form, ESC [
    assert visible("\x7f\x85") == "\u2421\u241bE"
    assert visible("tab\there\nline\r\nnext\rover\r") == "tab\there\nline\r\nnext\u240dover\u240d"


@given(texts)
def test_no_control_survives(text: str) -> None:
    assert RAW.search(visible(text)) is None


@given(st.text(alphabet=st.characters(exclude_categories=["Cc"]) | st.sampled_from("\t\n")))
def test_text_without_controls_is_untouched(text: str) -> None:
    assert visible(text) == text


@given(texts | st.text(alphabet=st.characters(max_codepoint=0x7F)) | st.text())
@example("plain ascii, one CR\r")
def test_the_bytes_the_chat_appends_are_the_visible_text(text: str) -> None:
    # visible_bytes checks ASCII text as bytes (a faster scan): the same result
    assert visible_bytes(text) == visible(text).encode()


@given(texts, st.lists(st.integers(0, 60), max_size=8))
@example("one\r\ntwo\r", [4, 9])  # a CRLF cut between two deltas; a lone CR at the end
def test_a_reply_renders_the_same_however_it_was_cut(text: str, cuts: list[int]) -> None:
    at = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    deltas = [text[a:b] for a, b in itertools.pairwise(at)]
    whole = rendered(ev("assistant", text))
    assert rendered(*(ev("assistant", d) for d in deltas)) == whole
    assert RAW.search(whole) is None


def test_every_kind_of_line_is_shown_safely() -> None:
    bad = "x\x00\x1b[2J\x1b]52;c;aGk=\x07\x9by"
    shown = visible(bad)
    chat = rendered(
        ev("user", bad),
        ev("reasoning", bad),
        ev("assistant", bad + "\r"),
        Event(0.0, "s", "u", "call", "t\x1b", '{"a":1}'),
        ev("tool", bad + "\r\n\r\n"),
        ev("info", bad),
        ev("error", bad),
        ev("retry", bad),
    )
    assert chat == (
        f"user: {shown}\n<think>\n{shown}\n</think>\nassistant: {shown}\u240d\n"
        f'-> t\u241b({{"a":1}})\n{shown}\n:: {shown}\nerror: {shown}\n{shown}\n'
    )
