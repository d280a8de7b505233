"""The lean transport's HTTP/1.1 framing, as pure functions (no I/O).

The exchange over real sockets is tested in tests/e2e/test_transport.py.
"""

from __future__ import annotations

import itertools

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from olliefs.backend.transport import (
    ChunkedDecoder,
    ProtocolError,
    body_length,
    parse_head,
    request_head,
)


def encode(parts: list[bytes], exts: list[bytes], trailers: list[bytes]) -> bytes:
    out = b""
    for i, part in enumerate(parts):
        ext = exts[i % len(exts)] if exts else b""
        out += b"%x%s\r\n%s\r\n" % (len(part), ext, part)
    return out + b"0\r\n" + b"".join(t + b"\r\n" for t in trailers) + b"\r\n"


def cuts(data: bytes, points: list[int]) -> list[bytes]:
    marks = sorted({p % (len(data) + 1) for p in points} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(marks)]


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
    d = ChunkedDecoder()
    got, fed = b"", 0
    while not d.done:  # an IndexError here: the body never ended
        got += d.feed(pieces[fed])
        fed += 1
    assert got == b"".join(parts)
    # what followed the body in the same read is kept for the next reply
    assert d.rest + b"".join(pieces[fed:]) == after


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
    """Odd extensions and trailers, the body cut in two reads at every byte (and then
    fed a byte a read): the same body, ended, nothing left over for the next reply."""
    for pieces in ([ODD[:at], ODD[at:]], [ODD[i : i + 1] for i in range(len(ODD))]):
        d = ChunkedDecoder()
        got = b"".join(d.feed(p) for p in pieces if p)
        assert got == ODD_BODY and d.done and d.rest == b""


def test_chunked_one_read_of_many_chunks_is_one_piece() -> None:
    wire = encode([b"tok|"] * 500, [], [])
    d = ChunkedDecoder()
    assert d.feed(wire) == b"tok|" * 500 and d.done


@pytest.mark.parametrize(
    "wire",
    [
        b"zz\r\nab\r\n",  # not hex
        b"0x2\r\nab\r\n",  # int() would take it
        b"+2\r\nab\r\n",
        b"2\r\nabXY",  # data not followed by CRLF
        b"1" * 17 + b"\r\n",  # more than 64 bits of size
        b"2" + b";" * 5000,  # a size line that never ends
    ],
)
def test_chunked_refuses_bad_framing(wire: bytes) -> None:
    d = ChunkedDecoder()
    with pytest.raises(ProtocolError):
        for i in range(0, len(wire), 3):  # split too: the checks hold across reads
            d.feed(wire[i : i + 3])


def test_head_parsed() -> None:
    h = parse_head(
        b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 3\r\nX-A:b"
        b"\r\nConnection: keep-alive, Close"
    )
    assert (h.status, h.reason, h.http11) == (429, b"Too Many Requests", True)
    assert h.values(b"retry-after") == [b"3"] and h.values(b"x-a") == [b"b"]
    assert h.tokens(b"connection") == [b"keep-alive", b"close"]
    assert parse_head(b"HTTP/1.0 200").http11 is False


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/2 200 OK",
        b"ICY 200 OK",
        b"HTTP/1.1 20 OK",
        b"HTTP/1.1 2000 OK",
        b"HTTP/1.1 200 OK\r\n folded: continuation",
        b"HTTP/1.1 200 OK\r\nno colon here",
        b"HTTP/1.1 200 OK\r\nName : space before colon",
    ],
)
def test_head_refused(head: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_head(head)


@pytest.mark.parametrize(
    ("head", "method", "want"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 12", "POST", 12),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked", "POST", -1),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\nContent-Length: 5", "POST", -1),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip", "POST", None),
        (b"HTTP/1.1 200 OK", "GET", None),
        (b"HTTP/1.1 204 No Content\r\nContent-Length: 9", "POST", 0),
        (b"HTTP/1.1 304 Not Modified", "GET", 0),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 7", "HEAD", 0),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nContent-Length: 4", "GET", 4),
    ],
)
def test_body_length(head: bytes, method: str, want: int | None) -> None:
    assert body_length(parse_head(head), method) == want


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nContent-Length: 5",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1",
        b"HTTP/1.1 200 OK\r\nContent-Length: 0x10",
    ],
)
def test_bad_content_length(head: bytes) -> None:
    with pytest.raises(ProtocolError):
        body_length(parse_head(head), "GET")


def test_request_head() -> None:
    r = httpx.Request("POST", "http://h:8/v1/chat?a=1", content=b"abc", headers={"X": "y"})
    head = request_head(r, 3)
    assert head.startswith(b"POST /v1/chat?a=1 HTTP/1.1\r\n")
    assert b"\r\nHost: h:8\r\n" in head and b"\r\nX: y\r\n" in head
    assert head.endswith(b"\r\n\r\n") and head.count(b"Content-Length") == 1
    # a body of unknown length goes chunked
    assert b"Transfer-Encoding: chunked" in request_head(httpx.Request("POST", "http://h/"), None)
