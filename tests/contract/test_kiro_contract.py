"""Kiro (CodeWhisperer) wire: the AWS event stream framing against botocore's own parser.

No official Python SDK reads CodeWhisperer's chat stream. What is public is the framing
(the AWS "event stream encoding"), and botocore implements it: every frame here is decoded
by ``botocore.eventstream.EventStreamBuffer`` and by our decoder, and the two must agree.
The events inside are then read the way the CodeWhisperer service model describes them
(``assistantResponseEvent.content`` appended, ``toolUseEvent.input`` concatenated per
``toolUseId`` until ``stop``) and compared with our backend's reading over HTTP. What rests
on no public document at all is listed in ollie-replay(1).
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import httpx
import pytest
from botocore.eventstream import ChecksumMismatch, EventStreamBuffer

from olliefs.backend.kiro import EventStreamDecoder, KiroParser
from olliefs.backend.stream import parse_all
from olliefs.replay import Entry, EntryToolCall, ReplayServer
from olliefs.replay.wire.kiro import event
from tests.contract.harness import Outcome, ours


def recorded_stream() -> bytes:
    """A reply as Kiro streams it: metadata, text, two tool uses, metering."""
    frames = [
        event("messageMetadataEvent", {"conversationId": "c-1", "utteranceId": "u-1"}),
        event("assistantResponseEvent", {"content": "Reading "}),
        event("assistantResponseEvent", {"content": "both files — "}),
        event("assistantResponseEvent", {"content": "ünïcode ok"}),
        event("toolUseEvent", {"toolUseId": "tooluse_A1", "name": "file_read", "input": '{"pa'}),
        event(
            "toolUseEvent", {"toolUseId": "tooluse_A1", "name": "file_read", "input": 'th": "a"}'}
        ),
        event("toolUseEvent", {"toolUseId": "tooluse_A1", "name": "file_read", "stop": True}),
        event("toolUseEvent", {"toolUseId": "tooluse_B2", "name": "file_read", "input": ""}),
        event("toolUseEvent", {"toolUseId": "tooluse_B2", "name": "file_read", "stop": True}),
        event("meteringEvent", {"unit": "credit", "unitPlural": "credits", "usage": 0.02}),
    ]
    return b"".join(frames)


def botocore_frames(raw: bytes) -> list[tuple[dict[str, Any], bytes]]:
    buffer = EventStreamBuffer()
    buffer.add_data(raw)
    return [(dict(m.headers), m.payload) for m in buffer]


def reference(raw: bytes) -> Outcome:
    """The service model's reading of the frames botocore decoded."""
    out = Outcome()
    inputs: dict[str, list[str]] = {}
    names: dict[str, str] = {}
    for headers, payload in botocore_frames(raw):
        body = json.loads(payload) if payload else {}
        kind = headers.get(":event-type")
        if kind == "assistantResponseEvent":
            out.text += body.get("content", "")
        elif kind == "toolUseEvent":
            names[body["toolUseId"]] = body["name"]
            inputs.setdefault(body["toolUseId"], []).append(body.get("input", ""))
    out.calls = [
        (use, names[use], json.loads("".join(parts) or "{}")) for use, parts in inputs.items()
    ]
    out.finish = "tool_calls" if out.calls else "stop"
    return out


@pytest.mark.parametrize("step", [1, 3, 64, 10000])
def test_frames_decode_as_botocore_decodes_them(step: int) -> None:
    raw = recorded_stream()
    decoder = EventStreamDecoder()
    frames = [f for i in range(0, len(raw), step) for f in decoder.feed(raw[i : i + step])]
    assert [(f.headers, f.payload) for f in frames] == botocore_frames(raw)
    assert decoder.pending == 0


def test_every_header_type() -> None:
    """Headers of each type the encoding defines, built by hand from the spec."""

    def header(name: str, kind: int, value: bytes) -> bytes:
        return bytes([len(name)]) + name.encode() + bytes([kind]) + value

    head = b"".join(
        [
            header("t", 0, b""),
            header("f", 1, b""),
            header("b", 2, b"\x7f"),
            header("s", 3, struct.pack(">h", -2)),
            header("i", 4, struct.pack(">i", 70000)),
            header("l", 5, struct.pack(">q", -(2**40))),
            header("y", 6, struct.pack(">H", 3) + b"\x00\x01\x02"),
            header("str", 7, struct.pack(">H", 5) + b"h\xc3\xa9llo"[:5]),
            header("ts", 8, struct.pack(">q", 1700000000000)),
            header("u", 9, bytes(range(16))),
        ]
    )
    total = 12 + len(head) + 2 + 4
    prelude = struct.pack(">II", total, len(head))
    frame = prelude + struct.pack(">I", zlib.crc32(prelude)) + head + b"{}"
    frame += struct.pack(">I", zlib.crc32(frame))
    [ours_frame] = EventStreamDecoder().feed(frame)
    [(theirs_headers, payload)] = botocore_frames(frame)
    assert payload == ours_frame.payload == b"{}"
    assert ours_frame.headers == theirs_headers


def test_a_corrupt_frame_is_refused_by_both() -> None:
    raw = bytearray(recorded_stream())
    raw[30] ^= 0xFF
    with pytest.raises(ChecksumMismatch):
        botocore_frames(bytes(raw))
    with pytest.raises(Exception, match="bad event stream frame"):
        parse_all(KiroParser(), [bytes(raw)])


@pytest.mark.parametrize("raw_chunk", [None, 1, 29])
async def test_recorded_stream_reads_as_the_service_model_says(
    server: ReplayServer, raw_chunk: int | None
) -> None:
    raw = recorded_stream()
    mine = await ours(server, "kiro", Entry(raw=raw, raw_chunk=raw_chunk))
    assert not mine.error, mine.extra
    assert mine.essentials() == reference(raw).essentials()


async def test_the_replay_servers_own_rendering(server: ReplayServer) -> None:
    entry = Entry(
        reply="Two reads.",
        tool_calls=(
            EntryToolCall(name="file_read", arguments={"path": "x"}, id="tooluse_1"),
            EntryToolCall(name="ls", id="tooluse_2"),
        ),
        chunk=3,
    )
    server.add([entry])
    body = {"conversationState": {"currentMessage": {"userInputMessage": {"content": "hi"}}}}
    raw = httpx.post(
        f"{server.base_url}/generateAssistantResponse",
        json=body,
        headers={"Authorization": f"Bearer {server.key}"},
    ).content
    mine = await ours(server, "kiro", entry)
    assert mine.essentials() == reference(raw).essentials()


async def test_a_stream_cut_inside_a_frame_is_a_drop(server: ReplayServer) -> None:
    raw = recorded_stream()
    mine = await ours(server, "kiro", Entry(raw=raw[: len(raw) - 7]))
    assert mine.error == "transient"
    assert "inside a frame" in mine.extra["message"]
    dropped = await ours(server, "kiro", Entry(raw=raw, raw_chunk=40, drop_after=len(raw) // 2))
    assert dropped.error == "transient"


@pytest.mark.parametrize(
    ("entry", "kind", "words"),
    [
        (Entry(status=429, retry_after="3"), "rate_limit", "HTTP 429"),
        (Entry(status=500), "transient", "HTTP 500"),
        (
            Entry(
                status=400,
                error="Input is too long.",
                error_code="CONTENT_LENGTH_EXCEEDS_THRESHOLD",
            ),
            "invalid_request",
            "Input is too long",
        ),
        (Entry(status=403, error="The bearer token has expired"), "auth", "HTTP 403"),
        (
            Entry(reply="half", status=429, in_stream=True, drop_after=1),
            "rate_limit",
            "ThrottlingException",
        ),
        (Entry(status=500, in_stream=True), "transient", "InternalServerException"),
    ],
    ids=["429", "500", "overflow", "403", "in-stream throttling", "in-stream internal"],
)
async def test_errors(server: ReplayServer, entry: Entry, kind: str, words: str) -> None:
    mine = await ours(server, "kiro", entry)
    assert mine.error == kind
    assert mine.extra["message"].startswith("kiro: ") and words in mine.extra["message"]
