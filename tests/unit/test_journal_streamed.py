"""``persist.StreamedText``: a streamed reply's message record leaves out the text its
events hold, and replay puts it back; journals from before the field load unchanged."""

from __future__ import annotations

from pathlib import Path

from olliefs.agent.events import Event
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
