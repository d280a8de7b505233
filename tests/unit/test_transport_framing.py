"""The lean transport's HTTP/1.1 framing through h11, as pure functions (no I/O).

The exchange over real sockets is tested in tests/e2e/test_transport.py.
"""

from __future__ import annotations

import itertools

import h11
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from olliefs.backend.transport import (
    INCOMPLETE_CHUNKED,
    MAX_HEAD,
    body_piece,
    next_head,
    received,
    request_head,
    reusable,
    sent,
)

CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def encode(parts: list[bytes], exts: list[bytes], trailers: list[bytes]) -> bytes:
    out = b""
    for i, part in enumerate(parts):
        ext = exts[i % len(exts)] if exts else b""
        out += b"%x%s\r\n%s\r\n" % (len(part), ext, part)
    return out + b"0\r\n" + b"".join(t + b"\r\n" for t in trailers) + b"\r\n"


def cuts(data: bytes, points: list[int]) -> list[bytes]:
    marks = sorted({p % (len(data) + 1) for p in points} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(marks)]


def replied(head: bytes = CHUNKED_HEAD, method: str = "GET") -> h11.Connection:
    h = sent(httpx.Request(method, "http://h/"))
    h.receive_data(head)
    assert next_head(h) is not None
    return h


def read_body(
    h: h11.Connection, pieces: list[bytes], fast: bool = False
) -> tuple[list[bytes], int]:
    """Each piece given as one network read: the body pieces that came out, and how
    many reads the body took (an IndexError: it never ended). ``fast``: each read
    through ``received`` (the transport's way), not ``receive_data`` + ``body_piece``."""
    out, fed = [], 0
    piece, done = body_piece(h)
    while True:
        if piece:
            out.append(piece)
        if done:
            return out, fed
        data = pieces[fed]
        fed += 1
        if fast and data:
            piece, done = received(h, data)
        else:
            h.receive_data(data)
            piece, done = body_piece(h)


def outcome(pieces: list[bytes], fast: bool) -> tuple[object, ...]:
    """What reading a chunked body of these reads gives: its pieces, the reads it took,
    what h11 holds after it and whether the connection is reusable; or the error."""
    h = replied()
    try:
        out, fed = read_body(h, pieces, fast)
    except (h11.ProtocolError, IndexError) as exc:
        return (type(exc), str(exc))
    return (out, fed, h.trailing_data, reusable(h))


ODD = (
    b"5;x=1\r\nhello\r\n"  # an extension
    b'6; name="v;w\\"x"\r\n world\r\n'  # a quoted value with ; and an escaped quote
    b"1;a;b=;;\r\n!\r\n"  # bare and empty ones
    b"00a  \r\n0123456789\r\n"  # leading zeros, white space before the CRLF
    b"A\r\nABCDEFGHIJ\r\n"  # upper-case hex
    b"0;last=1\r\nX-Trailer: t\r\nServer-Timing: total;dur=2\r\n\r\n"  # trailers
)
ODD_BODY = b"hello world!0123456789ABCDEFGHIJ"


@pytest.mark.parametrize("at", range(len(ODD) + 1))
def test_chunked_split_at_every_byte(at: int) -> None:
    """Odd extensions and trailers, the reply cut in two reads at every byte: the same
    body, ended, and nothing left over to spoil the next reply on the connection."""
    h = replied()
    out, _ = read_body(h, [ODD[:at], ODD[at:]] if at else [ODD])
    assert b"".join(out) == ODD_BODY and reusable(h)


def test_chunked_one_byte_a_read() -> None:
    h = replied()
    out, fed = read_body(h, [ODD[i : i + 1] for i in range(len(ODD))])
    assert b"".join(out) == ODD_BODY and fed == len(ODD)


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.binary(min_size=1, max_size=70), max_size=12),
    exts=st.lists(st.sampled_from([b"", b";x=1", b'; name="v"', b";a"]), max_size=3),
    trailers=st.lists(st.sampled_from([b"X-A: 1", b"Server-Timing: t;dur=2"]), max_size=2),
    points=st.lists(st.integers(0, 10_000), max_size=25),
    after=st.binary(max_size=10),
)
def test_chunked_any_split_gives_the_body(
    parts: list[bytes], exts: list[bytes], trailers: list[bytes], points: list[int], after: bytes
) -> None:
    wire = encode(parts, exts, trailers)
    pieces = cuts(wire + after, points)
    h = replied()
    out, fed = read_body(h, pieces)
    assert b"".join(out) == b"".join(parts)
    # what followed the body in the same read stays in h11: the connection is not reused
    assert h.trailing_data[0] + b"".join(pieces[fed:]) == after
    assert reusable(h) == (not h.trailing_data[0])


chunk_forms = st.one_of(
    st.binary(min_size=1, max_size=40).map(lambda b: b"%x\r\n%s\r\n" % (len(b), b)),
    st.binary(min_size=1, max_size=40).map(lambda b: b"%X;e=1\r\n%s\r\n" % (len(b), b)),
    st.binary(min_size=1, max_size=20).map(lambda b: b"%04x \r\n%s\r\n" % (len(b), b)),
    st.sampled_from(
        [
            b"0\r\n\r\n",
            b"0\r\nX-A: 1\r\n\r\n",
            b"2\r\nabXY",  # a broken footer
            b"zz\r\nab\r\n",
            b"+2\r\nab\r\n",
            b"0x2\r\nab\r\n",
            b"\r\n",  # an empty size line
            b"1" * 17 + b"\r\n",  # more hex digits than the fast loop takes
            b"1" * 21 + b"\r\n",
            b"3\r\nabc\n",
            b"",
        ]
    ),
)


@settings(max_examples=500, deadline=None)
@given(
    chunks=st.lists(chunk_forms, max_size=14),
    points=st.lists(st.integers(0, 10_000), max_size=20),
)
def test_the_fast_reading_is_h11s(chunks: list[bytes], points: list[int]) -> None:
    """``received`` cuts plain chunks out by itself: for any body (well formed or not)
    cut into any reads, the same pieces, the same end, the same leftover and reuse, or
    the same error, as h11 reading every byte."""
    pieces = cuts(b"".join(chunks), points)
    assert outcome(pieces, fast=True) == outcome(pieces, fast=False)


def test_plain_chunks_are_cut_out_without_h11() -> None:
    """The fast loop is taken (h11 never sees the chunks it cut out), a chunk left
    incomplete at the end of a read is h11's, and the next read is fast again once h11
    has finished that chunk."""
    h = replied()
    fed: list[bytes] = []
    give = h.receive_data

    def spy(data: bytes) -> None:
        fed.append(data)
        give(data)

    h.receive_data = spy  # type: ignore[method-assign]
    assert received(h, b"4\r\ntok|\r\n4\r\ntok|\r\n4\r\nto") == (b"tok|tok|to", False)
    assert fed == [b"4\r\nto"] and h.trailing_data[0] == b""  # h11 waits for "k|\r\n"
    assert received(h, b"k|\r\n3\r\nabc\r\n") == (b"k|abc", False)
    assert fed[1:] == [b"k|\r\n"]  # the rest of its chunk; "3\r\nabc\r\n" was cut here
    assert received(h, b"0\r\n\r\n") == (b"", True)
    assert fed[2:] == [b"0\r\n\r\n"] and reusable(h)


def test_one_read_of_many_chunks_is_one_piece() -> None:
    h = replied()
    h.receive_data(encode([b"tok|"] * 500, [], []))
    assert body_piece(h) == (b"tok|" * 500, True)


def test_what_came_with_the_head_is_the_first_piece() -> None:
    h = sent(httpx.Request("GET", "http://h/"))
    h.receive_data(CHUNKED_HEAD + b"3\r\nabc\r\n2\r\nde")
    head = next_head(h)
    assert head is not None and head.status_code == 200
    assert body_piece(h) == (b"abcde", False)
    assert body_piece(h) == (b"", False)  # nothing new: nothing out


@pytest.mark.parametrize(
    "wire",
    [
        b"5\r\nhel",  # inside a chunk's data
        b"5\r\nhello",  # before the CRLF after it
        b"5\r\nhello\r",
        b"5\r\nhello\r\n",  # before the next size line
        b"5\r\nhello\r\n1",  # inside the size line
        b"5\r\nhello\r\n1;ext=",  # inside an extension
        b"5\r\nhello\r\n0\r\n",  # after the last chunk, before the end of the trailers
        b"5\r\nhello\r\n0\r\nX-Trailer: t",  # inside a trailer
    ],
)
def test_chunked_cut_short_is_a_clear_error(wire: bytes) -> None:
    """The connection ends (``b""``) anywhere before the end of a chunked body: the
    same clear error, wherever the cut fell, after the data that did come."""
    h = replied()
    h.receive_data(wire)
    piece, done = body_piece(h)
    assert not done and (piece == b"hello" or b"hello".startswith(piece))
    h.receive_data(b"")
    with pytest.raises(h11.RemoteProtocolError, match=r"^peer closed connection without sending"):
        body_piece(h)


def test_incomplete_chunked_is_httpcores_text() -> None:
    assert INCOMPLETE_CHUNKED.endswith("(incomplete chunked read)")


@pytest.mark.parametrize(
    "wire",
    [
        b"zz\r\nab\r\n",  # not hex
        b"0x2\r\nab\r\n",  # int() would take it
        b"+2\r\nab\r\n",
        b"2\r\nabXY",  # data not followed by CRLF
        b"1" * 21 + b"\r\n",  # a size of more than 20 hex digits
        b"2" + b";" * (MAX_HEAD + 10),  # a size line that never ends
        b"0\r\nbroken trailer\r\n\r\n",
    ],
)
def test_chunked_refuses_bad_framing(wire: bytes) -> None:
    h = replied()
    with pytest.raises(h11.RemoteProtocolError):
        for i in range(0, len(wire), 3):  # split too: the checks hold across reads
            h.receive_data(wire[i : i + 3])
            body_piece(h)


def test_content_length_and_until_close() -> None:
    h = replied(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\nhello")
    assert body_piece(h) == (b"hello", False)
    h.receive_data(b" world!")
    assert body_piece(h) == (b" world!", True)
    assert reusable(h)
    h = replied(b"HTTP/1.1 200 OK\r\n\r\nuntil")
    assert body_piece(h) == (b"until", False)
    h.receive_data(b" close")
    assert body_piece(h) == (b" close", False)
    h.receive_data(b"")
    assert body_piece(h) == (b"", True)
    assert not reusable(h)  # h11 says DONE: the connection's end is what tells
    h = replied(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello")
    body_piece(h)
    h.receive_data(b"")
    with pytest.raises(h11.RemoteProtocolError, match="received 5 bytes, expected 10"):
        body_piece(h)


@pytest.mark.parametrize(
    ("head", "method"),
    [
        (b"HTTP/1.1 204 No Content\r\nContent-Length: 9\r\n\r\n", "POST"),
        (b"HTTP/1.1 304 Not Modified\r\n\r\n", "GET"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n", "HEAD"),
    ],
)
def test_replies_without_a_body(head: bytes, method: str) -> None:
    h = replied(head, method)
    assert body_piece(h) == (b"", True)


def test_head_parsed_and_1xx_skipped() -> None:
    h = sent(httpx.Request("GET", "http://h/"))
    h.receive_data(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 429 Too Many Requests\r\nRetry-After: 3\r\n"
        b"X-A:b\r\nConnection: keep-alive, Close\r\n\r\n"
    )
    head = next_head(h)
    assert head is not None
    assert (head.status_code, head.reason, head.http_version) == (429, b"Too Many Requests", b"1.1")
    assert head.headers.raw_items() == [
        (b"Retry-After", b"3"),
        (b"X-A", b"b"),
        (b"Connection", b"keep-alive, Close"),
    ]


def test_head_waits_for_its_end_and_has_a_limit() -> None:
    h = sent(httpx.Request("GET", "http://h/"))
    h.receive_data(b"HTTP/1.1 200 OK\r\nX: y\r\n")
    assert next_head(h) is None
    h.receive_data(b"X-Long: " + b"a" * MAX_HEAD)
    with pytest.raises(h11.RemoteProtocolError):
        next_head(h)


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/2 200 OK",
        b"ICY 200 OK",
        b"HTTP/1.1 20 OK",
        b"HTTP/1.1 2000 OK",
        b"HTTP/1.1 200 OK\r\nno colon here",
        b"HTTP/1.1 200 OK\r\nName : space before colon",
        b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nContent-Length: 5",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1",
        b"HTTP/1.1 200 OK\r\nContent-Length: 0x10",
    ],
)
def test_head_refused(head: bytes) -> None:
    h = sent(httpx.Request("GET", "http://h/"))
    h.receive_data(head + b"\r\n\r\n")
    with pytest.raises(h11.RemoteProtocolError):
        next_head(h)


def test_request_head() -> None:
    r = httpx.Request("POST", "http://h:8/v1/chat?a=1", content=b"abc", headers={"X": "y"})
    head = request_head(r, 3)
    assert head.startswith(b"POST /v1/chat?a=1 HTTP/1.1\r\n")
    assert b"\r\nHost: h:8\r\n" in head and b"\r\nX: y\r\n" in head
    assert head.endswith(b"\r\n\r\n") and head.count(b"Content-Length") == 1
    # a body of unknown length goes chunked
    assert b"Transfer-Encoding: chunked" in request_head(httpx.Request("POST", "http://h/"), None)


@pytest.mark.parametrize(
    ("reply", "request_headers", "kept"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", {}, True),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n", {}, False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", {}, False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", {"Connection": "close"}, False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\nHTTP/1.1 200", {}, False),  # unasked
    ],
)
def test_reuse_rules(reply: bytes, request_headers: dict[str, str], kept: bool) -> None:
    h = sent(httpx.Request("GET", "http://h/", headers=request_headers))
    h.receive_data(reply)
    assert next_head(h) is not None and body_piece(h) == (b"", True)
    assert reusable(h) is kept
