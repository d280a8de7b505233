"""A third-party client (py9p's synchronous Client, in a thread) against our server."""

from __future__ import annotations

import struct
from typing import Any

import py9p
import trio

from tests.ninep.conftest import BIG, Served, settle


def _dir_entries(buf: bytes) -> list[Any]:
    out = []
    pos = 0
    while pos < len(buf):
        (n,) = struct.unpack_from("<H", buf, pos)
        out.append(py9p.decode_dir(buf[pos : pos + 2 + n]))
        pos += 2 + n
    return out


def py9p_session(path: str) -> dict[str, Any]:
    got: dict[str, Any] = {}
    with py9p.Client.connect_unix(path, msize=8192) as cl:
        rv = cl.negotiate()
        got["version"] = (rv.version, rv.msize)
        got["root"] = cl.attach(0, uname="someone", aname="")
        # walk + open + read
        got["wqids"] = cl.walk(0, 1, "sub/a")
        cl.open(1)
        got["a"] = cl.read(1, 100, 0)
        cl.clunk(1)
        # a big file in msize-limited reads
        cl.walk(0, 2, "big")
        _, iounit = cl.open(2)
        got["iounit"] = iounit
        chunks = []
        off = 0
        while True:
            data = cl.read(2, iounit, off)
            if not data:
                break
            chunks.append(data)
            off += len(data)
        got["big"] = b"".join(chunks)
        got["stat"] = cl.stat(2)
        cl.clunk(2)
        # directory read, in whole entries
        cl.walk(0, 3, "")
        cl.open(3)
        listing = b""
        while True:
            data = cl.read(3, 8192 - 24, len(listing))
            if not data:
                break
            listing += data
        got["listing"] = sorted(d.name for d in _dir_entries(listing))
        cl.clunk(3)
        # write, then read back
        cl.walk(0, 4, "rw")
        cl.open(4, py9p.OWRITE | py9p.OTRUNC)
        got["wrote"] = cl.write(4, b"from py9p", 0)
        cl.clunk(4)
        cl.walk(0, 5, ["rw"])
        cl.open(5)
        got["rw"] = cl.read(5, 100, 0)
        cl.clunk(5)
        # create, remove; an error comes back as RemoteError
        cl.walk(0, 6, "")
        cl.create(6, "made-by-py9p", 0o644, py9p.OWRITE)
        cl.write(6, b"x", 0)
        cl.remove(6)
        try:
            cl.walk(0, 7, "nope")
        except py9p.RemoteError as err:
            got["error"] = str(err)
        cl.clunk(0)
    return got


async def test_py9p_client_against_our_server(served: Served) -> None:
    got = await trio.to_thread.run_sync(py9p_session, served.path)
    fs = served.fs
    assert got["version"] == ("9P2000", 8192)
    assert got["root"].type == 0x80
    assert [q.path for q in got["wqids"]] == [
        fs.stat((fs.root.children or {})["sub"]).qid.path,
        fs.stat(((fs.root.children or {})["sub"].children or {})["a"]).qid.path,
    ]
    assert got["a"] == b"A"
    assert got["iounit"] == 8192 - 24
    assert got["big"] == BIG
    assert (got["stat"].name, got["stat"].length) == ("big", len(BIG))
    assert got["listing"] == sorted(fs.root.children or {})
    assert got["wrote"] == 9
    assert got["rw"] == b"from py9p"
    assert "made-by-py9p" not in (fs.root.children or {})
    assert got["error"] == "file not found"
    await settle()
    assert served.stats.fids == 0 and served.stats.in_flight == 0
    fs.assert_all_clunked()
