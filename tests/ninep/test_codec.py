"""The 9P2000 codec on its own: round trips, strict decoding, encode-side range checks."""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ninep import codec as c
from tests.ninep.strategies import ALL_TYPES, PROPERTY, messages, messages_of, stats


def with_size(body: bytes) -> bytes:
    """``body`` (type onwards) behind a size field that matches it: a frame whose only
    possible fault is in its fields."""
    return struct.pack("<I", len(body) + 4) + body


def test_every_message_type_has_a_strategy() -> None:
    assert set(ALL_TYPES) == set(c.T_TYPES) | set(c.R_TYPES)
    assert len(ALL_TYPES) == 27  # 13 T + 14 R (Rerror has no T) in base 9P2000


@pytest.mark.parametrize("cls", ALL_TYPES, ids=lambda t: t.__name__)
@PROPERTY
@given(data=st.data())
def test_roundtrip(cls: type[c.Message], data: st.DataObject) -> None:
    msg = data.draw(messages_of(cls))
    frame = c.encode(msg)
    size, mtype, tag = struct.unpack_from("<IBH", frame)
    assert (size, mtype, tag) == (len(frame), cls.TYPE, msg.tag)
    assert c.decode(frame) == msg
    assert c.decode(memoryview(frame)) == msg
    assert c.decode(bytearray(frame)) == msg


@PROPERTY
@given(st.lists(stats(), max_size=8))
def test_stat_list_roundtrip(entries: list[c.Stat]) -> None:
    buf = b"".join(c.encode_stat(s) for s in entries)
    assert c.decode_stats(buf) == entries
    assert c.decode_stats(memoryview(buf)) == entries


@PROPERTY
@given(stats())
def test_stat_size_field_counts_the_rest(st_: c.Stat) -> None:
    b = c.encode_stat(st_)
    assert struct.unpack_from("<H", b)[0] == len(b) - 2


@PROPERTY
@given(st.lists(stats(), min_size=1, max_size=4), st.data())
def test_cut_stat_list_is_rejected(entries: list[c.Stat], data: st.DataObject) -> None:
    buf = b"".join(c.encode_stat(s) for s in entries)
    cut = data.draw(st.integers(1, len(buf) - 1))
    bounds = set()
    pos = 0
    for s in entries:
        pos += len(c.encode_stat(s))
        bounds.add(pos)
    if cut in bounds:
        assert len(c.decode_stats(buf[:cut])) < len(entries)
    else:
        with pytest.raises(c.ProtocolError):
            c.decode_stats(buf[:cut])


@PROPERTY
@given(messages)
def test_every_truncation_is_rejected(msg: c.Message) -> None:
    frame = c.encode(msg)
    for cut in range(len(frame)):
        with pytest.raises(c.ProtocolError):
            c.decode(frame[:cut])
        if cut >= 7:
            # Same cut, but with a size field that agrees: the fields must catch it.
            with pytest.raises(c.ProtocolError):
                c.decode(with_size(frame[4:cut]))


@PROPERTY
@given(messages, st.binary(min_size=1, max_size=8))
def test_trailing_garbage_is_rejected(msg: c.Message, extra: bytes) -> None:
    frame = c.encode(msg)
    with pytest.raises(c.ProtocolError):
        c.decode(frame + extra)  # size field now lies
    with pytest.raises(c.ProtocolError):
        c.decode(with_size(frame[4:] + extra))


@PROPERTY
@given(st.binary(max_size=64))
def test_random_bytes_only_raise_protocol_error(raw: bytes) -> None:
    try:
        msg = c.decode(raw)
    except c.ProtocolError:
        return
    assert c.encode(msg) == raw


@PROPERTY
@given(st.sampled_from(range(256)), st.binary(max_size=80))
def test_random_bodies_decode_canonically_or_fail(mtype: int, body: bytes) -> None:
    """Any frame that decodes has exactly one encoding: re-encoding gives it back."""
    frame = with_size(bytes([mtype]) + body)
    try:
        msg = c.decode(frame)
    except c.ProtocolError:
        return
    assert c.encode(msg) == frame


@PROPERTY
@given(messages, st.data())
def test_mutated_frames_decode_canonically_or_fail(msg: c.Message, data: st.DataObject) -> None:
    frame = bytearray(c.encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(4, len(frame) - 1))  # keep the size field right
        frame[i] = data.draw(st.integers(0, 255))
    try:
        out = c.decode(bytes(frame))
    except c.ProtocolError:
        return
    assert c.encode(out) == bytes(frame)


# ---- specific malformations --------------------------------------------------------


def test_size_field_must_match() -> None:
    frame = c.encode(c.Tclunk(1, 2))
    for bad in (0, 6, len(frame) - 1, len(frame) + 1, 0xFFFFFFFF):
        with pytest.raises(c.ProtocolError, match="size"):
            c.decode(struct.pack("<I", bad) + frame[4:])


@pytest.mark.parametrize("mtype", [0, 99, 128, 255])
def test_unknown_types(mtype: int) -> None:
    with pytest.raises(c.ProtocolError, match="unknown message type"):
        c.decode(with_size(bytes([mtype, 0, 0])))


def test_terror_is_never_valid() -> None:
    frame = with_size(bytes([c.TERROR, 1, 0]) + struct.pack("<H", 2) + b"no")
    with pytest.raises(c.ProtocolError, match="Terror"):
        c.decode(frame)


def test_more_than_maxwelem_names() -> None:
    names = tuple(f"n{i}" for i in range(c.MAXWELEM))
    ok = c.encode(c.Twalk(1, 2, 3, names))
    assert c.decode(ok) == c.Twalk(1, 2, 3, names)
    body = bytearray(ok[4:])
    struct.pack_into("<H", body, 11, 17)
    body += struct.pack("<H", 1) + b"x"
    with pytest.raises(c.ProtocolError, match="17 names"):
        c.decode(with_size(bytes(body)))
    with pytest.raises(ValueError, match="at most 16"):
        c.encode(c.Twalk(1, 2, 3, (*names, "x")))
    with pytest.raises(ValueError, match="at most 16"):
        c.encode(c.Rwalk(1, tuple(c.Qid(0, 0, i) for i in range(17))))
    rwalk = with_size(bytes([c.RWALK, 1, 0]) + struct.pack("<H", 17) + bytes(13 * 17))
    with pytest.raises(c.ProtocolError, match="17 qids"):
        c.decode(rwalk)


def test_invalid_utf8_and_nul_in_strings() -> None:
    good = c.encode(c.Twalk(1, 2, 3, ("ab",)))
    for bad in (b"\xff\xfe", b"\xc0\xaf", b"\xed\xa0", b"a\x00"):
        frame = good[:-2] + bad
        with pytest.raises(c.ProtocolError):
            c.decode(frame)
    with pytest.raises(ValueError, match="NUL"):
        c.encode(c.Rerror(1, "a\x00b"))
    with pytest.raises(ValueError):
        c.encode(c.Rerror(1, "\udc80"))  # lone surrogate: not encodable as UTF-8


def test_counts_that_lie() -> None:
    rread = c.encode(c.Rread(1, b"abcdef"))
    for n in (0, 5, 7, 0xFFFFFFFF):
        body = bytearray(rread[4:])
        struct.pack_into("<I", body, 3, n)
        with pytest.raises(c.ProtocolError, match="count"):
            c.decode(with_size(bytes(body)))
    twrite = c.encode(c.Twrite(1, 2, 3, b"xyz"))
    body = bytearray(twrite[4:])
    struct.pack_into("<I", body, 15, 4)
    with pytest.raises(c.ProtocolError, match="count"):
        c.decode(with_size(bytes(body)))
    # Rstat: the outer n[2] and the stat's own size[2] must both be exact.
    rstat = c.encode(c.Rstat(1, c.Stat(name="x")))
    for off, delta in ((7, 1), (7, -1), (9, 1), (9, -1)):
        body = bytearray(rstat[4:])
        (v,) = struct.unpack_from("<H", body, off - 4)
        struct.pack_into("<H", body, off - 4, v + delta)
        with pytest.raises(c.ProtocolError):
            c.decode(with_size(bytes(body)))
    # A string length that runs past its stat.
    st = bytearray(c.encode_stat(c.Stat(name="abc")))
    struct.pack_into("<H", st, 41, 200)
    with pytest.raises(c.ProtocolError):
        c.decode_stats(bytes(st))


def test_tcreate_needs_perm_and_mode() -> None:
    frame = c.encode(c.Tcreate(1, 2, "f", 0o644, c.OWRITE))
    with pytest.raises(c.ProtocolError):
        c.decode(with_size(frame[4:-1]))


# ---- encode-side checks ------------------------------------------------------------


@pytest.mark.parametrize(
    "msg",
    [
        c.Tclunk(-1, 1),
        c.Tclunk(0x10000, 1),
        c.Tclunk(1, 0x100000000),
        c.Tclunk(1, -1),
        c.Tread(1, 1, 1 << 64, 1),
        c.Tread(1, 1, 0, 1 << 32),
        c.Topen(1, 1, 256),
        c.Tflush(1, 0x10000),
        c.Rattach(1, c.Qid(256, 0, 0)),
        c.Rattach(1, c.Qid(0, 1 << 32, 0)),
        c.Rattach(1, c.Qid(0, 0, 1 << 64)),
        c.Rstat(1, c.Stat(mtime=-1)),
        c.Rstat(1, c.Stat(length=1 << 64)),
        c.Rstat(1, c.Stat(type=0x10000)),
        c.Rerror(1, "x" * 0x10000),
        c.Rstat(1, c.Stat(name="n" * 30000, uid="u" * 30000, gid="g" * 6000)),
        c.Tversion(1, 1 << 32, "9P2000"),
    ],
    ids=repr,
)
def test_encode_refuses_out_of_range(msg: c.Message) -> None:
    with pytest.raises(ValueError):
        c.encode(msg)


def test_encode_stat_refuses_out_of_range() -> None:
    with pytest.raises(ValueError):
        c.encode_stat(c.Stat(atime=1 << 32))
    with pytest.raises(ValueError):
        c.encode_stat(c.Stat(name="é" * 40000))


def test_limits_are_exactly_the_field_widths() -> None:
    assert c.decode(c.encode(c.Tclunk(0xFFFF, 0xFFFFFFFF))) == c.Tclunk(0xFFFF, 0xFFFFFFFF)
    big = c.Tread(0, 0, (1 << 64) - 1, 0xFFFFFFFF)
    assert c.decode(c.encode(big)) == big
    longest = "x" * 0xFFFF
    assert c.decode(c.encode(c.Rerror(1, longest))) == c.Rerror(1, longest)


def test_nochange_stat_is_all_ones() -> None:
    b = c.encode_stat(c.NOCHANGE)
    assert b[2:41] == b"\xff" * 39
    assert c.decode_stats(b) == [c.NOCHANGE]


def test_iohdrsz_covers_the_largest_io_header() -> None:
    assert len(c.encode(c.Twrite(0, 0, 0, b""))) <= c.IOHDRSZ
    assert len(c.encode(c.Rread(0, b""))) <= c.IOHDRSZ


# ---- framing -----------------------------------------------------------------------


@PROPERTY
@given(st.lists(messages, min_size=1, max_size=6), st.data())
def test_frame_buffer_splits_any_chunking(msgs: list[c.Message], data: st.DataObject) -> None:
    stream = b"".join(c.encode(m) for m in msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    fb = c.FrameBuffer()
    out: list[c.Message] = []
    prev = 0
    for cut in [*cuts, len(stream)]:
        fb.feed(stream[prev:cut])
        prev = cut
        while (frame := fb.next_frame(1 << 20)) is not None:
            out.append(c.decode(frame))
    assert out == msgs
    assert len(fb) == 0


def test_frame_buffer_rejects_bad_sizes_before_the_body() -> None:
    for size in (0, 6):
        fb = c.FrameBuffer()
        fb.feed(struct.pack("<I", size))
        with pytest.raises(c.ProtocolError, match="below"):
            fb.next_frame(8192)
    fb = c.FrameBuffer()
    fb.feed(struct.pack("<I", 8193))  # no body sent: judged on the size field alone
    with pytest.raises(c.ProtocolError, match="exceeds msize"):
        fb.next_frame(8192)
    fb = c.FrameBuffer()
    fb.feed(struct.pack("<I", 8192) + b"\x00" * 10)
    assert fb.next_frame(8192) is None  # fine, just incomplete


def test_message_structs_are_frozen_and_hashable() -> None:
    m = c.Twalk(1, 2, 3, ("a",))
    with pytest.raises(AttributeError):
        m.fid = 5  # type: ignore[misc]
    assert hash(m) == hash(c.Twalk(1, 2, 3, ("a",)))


def test_the_codec_does_not_load_trio() -> None:
    """The wire format is pure: a program that only parses 9P never loads an event loop
    (the I/O lives in ninep.transport). A fresh interpreter, so nothing is preloaded."""
    probe = (
        "import sys, ninep.codec, ninep.codec as c; "
        "c.decode(c.encode(c.Tclunk(1, 2))); "
        "print(sorted(m for m in sys.modules if m == 'trio' or m.startswith(('trio.', 'ninep'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "['ninep', 'ninep.codec']"
