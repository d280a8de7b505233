"""Streams coalesced per read, the reply's text journaled once, provider connections kept.

The figures (latency, MB/s) are in ``bench/perf_stream.py``; these tests check what the
figures rest on: every byte reaches a ``stream`` reader and equals ``chat``, the deltas of
a fast stream are merged (far fewer events than deltas), the journal grows by about the
reply's size (not twice it), a reply comes back whole after a SIGKILL and restart, a
retried reply (whose events hold more than the final message) is journaled whole, and ten
turns use one TCP connection to the provider.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import msgspec

from olliefs.replay import Entry
from olliefs.testing import Daemon, deadline
from tests.conftest import script

REPLY = int(os.environ.get("OLLIE_STREAM_REPLY_BYTES", str(10 * 1000 * 1000)))
DELTA = 200  # bytes of text per SSE event


def reply_text(size: int) -> str:
    line = "".join(chr(97 + i % 26) for i in range(79)) + "\n"
    return (line * (size // len(line) + 1))[:size]


def sse(text: str, delta: int) -> bytes:
    """An OpenAI chat-completions stream of ``text`` in ``delta``-character deltas."""
    enc = msgspec.json.encode
    out = []
    for i in range(0, len(text), delta):
        chunk = {"id": "c1", "choices": [{"index": 0, "delta": {"content": text[i : i + delta]}}]}
        out.append(b"data: " + enc(chunk) + b"\n\n")
    stop = {"id": "c1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    out.append(b"data: " + enc(stop) + b"\n\ndata: [DONE]\n\n")
    return b"".join(out)


def journal(d: Daemon) -> Path:
    (path,) = (d.home / "state" / "sessions").glob("*.jsonl")
    return path


def records(d: Daemon) -> list[dict[str, object]]:
    return [msgspec.json.decode(line) for line in journal(d).read_bytes().splitlines()]


def assistant_events(d: Daemon, sid: str) -> list[str]:
    lines = d.snapshot(f"s/{sid}/events").splitlines()
    evs = [msgspec.json.decode(line) for line in lines]
    return [e["content"] for e in evs if e["role"] == "assistant"]


def test_big_reply_reaches_the_reader_whole_and_is_journaled_once(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory(OLLIE_READ_TIMEOUT="60")
    d.start()
    sid = d.new(name="big")
    text = reply_text(REPLY)
    d.replay.add([Entry(raw=sse(text, DELTA), raw_chunk=65536, content_type="text/event-stream")])
    before = journal(d).stat().st_size
    want = d.p(f"s/{sid}/chat").read_bytes() + b"user: go\nassistant: " + text.encode()
    seen = bytearray()
    with deadline(120), open(d.p(f"s/{sid}/stream"), "rb") as f:
        d.prompt(sid, "go")
        while len(seen) < len(want):
            chunk = f.read1(1 << 20)
            assert chunk, "stream ended before the reply did"
            seen += chunk
    d.wait_idle(sid)
    chat = d.p(f"s/{sid}/chat").read_bytes()
    assert chat.startswith(want) and chat[len(want) :] in (b"", b"\n")
    assert bytes(seen) == chat[: len(seen)]
    # coalesced: the deltas read together became one event (a 64 KiB read holds ~250)
    parts = assistant_events(d, sid)
    assert "".join(parts) == text
    assert len(parts) < len(text) // DELTA // 10
    # the text once in the journal: as the events; the message record leaves it out
    growth = journal(d).stat().st_size - before
    assert growth < 1.3 * len(text), (growth, len(text))
    assert any(r.get("type") == "msg" and r.get("streamed") is True for r in records(d))
    context = d.p(f"s/{sid}/context").read_bytes()
    d.crash()
    d.start()
    assert d.p(f"s/{sid}/chat").read_bytes() == chat
    assert d.p(f"s/{sid}/context").read_bytes() == context
    history = [msgspec.json.decode(line) for line in context.splitlines()]
    assert history[-1] == {"role": "assistant", "content": text}


def test_retried_reply_is_journaled_whole_and_restored(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """A stream cut and retried streamed more than its final message holds: that message
    is written whole, and the history after a restart has only the retry's text."""
    d = daemon_factory()
    d.start()
    sid = d.new(name="retry")
    d.replay.add(
        script(
            '{"reasoning": "mull", "reply": "the first try is cut", "chunk": 3, "drop_after": 4}',
            '{"reasoning": "think", "reply": "the second try"}',
            '{"reasoning": "ok", "reply": "plain"}',
        )
    )
    d.prompt(sid, "one")
    d.wait_idle(sid)
    d.prompt(sid, "two")
    d.wait_idle(sid)
    msgs = [r["msg"] for r in records(d) if r.get("type") == "msg"]
    assistant = [m for m in msgs if isinstance(m, dict) and m["role"] == "assistant"]
    assert len(assistant) == 2
    assert assistant[0]["content"] == "the second try"  # written whole
    assert "content" not in assistant[1]  # left out: the events hold it
    chat = d.read(f"s/{sid}/chat")
    d.crash()
    d.start()
    assert d.read(f"s/{sid}/chat") == chat
    d.prompt(sid, "three")
    d.wait_idle(sid)
    sent = [(m["role"], m["content"]) for m in d.replay.requests[-1]["messages"][1:]]
    assert sent == [
        ("user", "one"),
        ("assistant", "the second try"),
        ("user", "two"),
        ("assistant", "plain"),
        ("user", "three"),
    ]


def test_ten_turns_use_one_connection(daemon: Daemon) -> None:
    sid = daemon.new(name="ka")
    for i in range(10):
        daemon.prompt(sid, f"turn {i}")
        daemon.wait_idle(sid)
    assert len(daemon.replay.requests) == 10
    assert daemon.replay.accepted == 1
