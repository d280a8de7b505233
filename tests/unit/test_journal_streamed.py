"""``persist.StreamedText``: a streamed reply's message record leaves out the text its
events hold, and replay puts it back; journals from before the field load unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from olliefs.agent.events import Event, encode_line
from olliefs.backend.base import Message
from olliefs.session import persist
from olliefs.session.persist import Ev, Msg, Prompt, Record, StreamedText


def ev(role: str, text: str) -> Ev:
    return Ev(Event(1.0, "s", "u", role, "", text, ""))  # type: ignore[arg-type]


def write_and_read(tmp_path: Path, recs: list[Record]) -> tuple[list[Record], list[Record]]:
    """What the journal holds, and what replay makes of it."""
    path = tmp_path / "j.jsonl"
    j = persist.Journal(path)
    packer = StreamedText()
    for r in recs:
        j.append(packer.pack(r))
    j.close()
    stored = persist.read_journal(path)
    unpacker = StreamedText()
    return stored, [unpacker.unpack(r) for r in stored]


def test_streamed_reply_is_stored_once_and_restored(tmp_path: Path) -> None:
    reply = Message("assistant", "Hello", "hmm", provider_data={"x": {"y": 1}})
    recs: list[Record] = [
        Msg(Message("user", "hi")),
        ev("reasoning", "h"),
        ev("reasoning", "mm"),
        ev("assistant", "Hel"),
        ev("info", "not text"),
        ev("assistant", "lo"),
        Msg(reply),
    ]
    stored, restored = write_and_read(tmp_path, recs)
    last = stored[-1]
    assert isinstance(last, Msg) and last.streamed
    assert last.msg.content == "" and last.msg.reasoning == ""
    assert last.msg.provider_data == {"x": {"y": 1}}
    assert restored == recs


def test_text_that_differs_from_the_events_is_written_whole(tmp_path: Path) -> None:
    recs: list[Record] = [
        ev("assistant", "cut short"),  # an attempt that failed and was retried
        ev("assistant", "second"),
        Msg(Message("assistant", "second")),
        Msg(Message("assistant", "never streamed")),  # e.g. a fork's copied history
        Prompt(1, "p", 0.0),
        ev("assistant", "x"),
        Msg(Message("user", "x")),  # not an assistant message: whole
    ]
    stored, restored = write_and_read(tmp_path, recs)
    assert [r for r in stored if isinstance(r, Msg) and r.streamed] == []
    assert stored == recs and restored == recs


def test_old_journal_lines_load_as_before(tmp_path: Path) -> None:
    """A journal written before ``streamed`` existed: every msg has its text."""
    path = tmp_path / "old.jsonl"
    path.write_bytes(
        b'{"type":"ev","ev":{"ts":1.0,"session":"s","agent":"u","role":"assistant",'
        b'"content":"Hi"}}\n'
        b'{"type":"msg","msg":{"role":"assistant","content":"Hi"}}\n'
    )
    recs = persist.read_journal(path)
    unpacker = StreamedText()
    out = [unpacker.unpack(r) for r in recs]
    assert out[-1] == Msg(Message("assistant", "Hi"))
    # a message record without the flag is written exactly as before the flag existed
    assert persist._encoder.encode(Msg(Message("user", "q"))) == (
        b'{"type":"msg","msg":{"role":"user","content":"q"}}'
    )


@settings(max_examples=200, deadline=None)
@given(
    content=st.text(max_size=200),
    name=st.text(max_size=10),
    role=st.sampled_from(["assistant", "reasoning", "user", "error"]),
)
def test_event_record_from_the_line_is_the_encoded_record(
    tmp_path_factory: pytest.TempPathFactory, content: str, name: str, role: str
) -> None:
    """``append_event`` wraps the event's log line instead of encoding it again: the
    journal gets the bytes ``append(Ev(ev))`` would have written."""
    d = tmp_path_factory.mktemp("j")
    ev = Event(1712.5, "s", "a", role, name, content, "r")  # type: ignore[arg-type]
    a, b = persist.Journal(d / "a"), persist.Journal(d / "b")
    a.append(persist.Ev(ev))
    b.append_event(encode_line(ev))
    a.close()
    b.close()
    assert (d / "a").read_bytes() == (d / "b").read_bytes()
    assert persist.read_journal(d / "b") == [persist.Ev(ev)]


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.text(max_size=8), max_size=6), text=st.text(max_size=30))
def test_concatenation_without_joining(parts: list[str], text: str) -> None:
    assert persist._concatenation(text, parts) == (text == "".join(parts))
    assert persist._concatenation("".join(parts), parts)
