"""Hostile peers: protocol violations and garbage close that connection and nothing else.

Whole hostile sessions, checked step by step against a model, are in test_fuzz_sessions.
"""

from __future__ import annotations

import functools
import os
import random
import struct

import pytest
import trio

from ninep import Client
from ninep import codec as c
from ninep.server import ServerStats, serve_unix
from tests.ninep.conftest import BIG, MemFS, Raw, Served, raw_connection, settle


async def _blocked_read(r: Raw, fs: MemFS, tag: int, fid: int) -> None:
    await r.send(c.Tread(tag, fid, 0, 10))
    await fs.block_started.wait()


VIOLATIONS: dict[str, bytes] = {
    "R-message": c.encode(c.Rclunk(5)),
    "Terror": struct.pack("<IBH", 7, c.TERROR, 5),
    "size below header": struct.pack("<I", 6) + b"\x00\x00",
    "size above msize": struct.pack("<IBH", 8193, c.TREAD, 5),  # body never sent
    "bad utf-8": c.encode(c.Twalk(5, 0, 1, ("ab",)))[:-2] + b"\xff\xff",
    "17 walk names": struct.pack("<IBHIIH", 17, c.TWALK, 5, 0, 1, 17),
    "count lies": c.encode(c.Twrite(5, 0, 0, b"abc"))[:19] + struct.pack("<I", 4) + b"abc",
    "unknown type": struct.pack("<IBH", 7, 200, 5),
}


@pytest.mark.parametrize("frame", VIOLATIONS.values(), ids=VIOLATIONS.keys())
async def test_violation_closes_only_that_connection(served: Served, frame: bytes) -> None:
    fs = served.fs
    async with Client.connect_unix(served.path) as good:
        root = await good.attach("me", "")
        async with raw_connection(served.path) as r:
            await r.version(8192)
            await r.attach(0)
            await r.walk_open(0, 1, ("block",), c.OREAD)
            await _blocked_read(r, fs, 9, 1)  # work in flight when the violation comes
            await r.send_bytes(frame)
            await r.closed_by_server()
        assert fs.block_cancelled.is_set()
        assert await good.read_all(root, "hello") == b"hello world\n"
        await good.clunk(root)
        await settle()
        assert served.stats.connections == 1
        assert served.stats.violations == 1
        assert served.stats.fids == 0 and served.stats.in_flight == 0
        fs.assert_all_clunked()


async def test_duplicate_tag_in_flight_closes(served: Served) -> None:
    fs = served.fs
    async with raw_connection(served.path) as r:
        await r.version()
        await r.attach(0)
        await r.walk_open(0, 1, ("block",), c.OREAD)
        await _blocked_read(r, fs, 9, 1)
        await r.send(c.Tstat(9, 1))
        await r.closed_by_server()
    await settle()
    assert served.stats.violations == 1 and served.stats.connections == 0
    fs.assert_all_clunked()


async def test_too_many_requests_in_flight_closes(nursery: trio.Nursery, sock_dir: str) -> None:
    fs = MemFS()
    stats = ServerStats()
    path = os.path.join(sock_dir, "p.sock")
    await nursery.start(functools.partial(serve_unix, path, fs, stats=stats, max_pending=4))
    async with raw_connection(path) as r:
        await r.version()
        await r.attach(0)
        await r.walk_open(0, 1, ("block",), c.OREAD)
        for tag in range(4):
            await r.send(c.Tread(tag, 1, 0, 1))
        await settle()
        assert stats.in_flight == 4
        await r.send(c.Tread(4, 1, 0, 1))
        await r.closed_by_server()
    await settle()
    assert stats.violations == 1
    assert stats.in_flight == 0 and stats.fids == 0 and stats.connections == 0
    assert fs.cancelled_reads == 4
    fs.assert_all_clunked()


def _valid_frames() -> list[bytes]:
    """Frames a client might send, for mutating."""
    return [
        c.encode(m)
        for m in (
            c.Tversion(c.NOTAG, 8192, c.VERSION),
            c.Tattach(1, 0, c.NOFID, "me", ""),
            c.Twalk(2, 0, 1, ("sub", "a")),
            c.Topen(3, 1, c.OREAD),
            c.Tread(4, 1, 0, 100),
            c.Twrite(5, 1, 0, b"data"),
            c.Tstat(6, 0),
            c.Twstat(7, 0, c.NOCHANGE),
            c.Tcreate(8, 0, "f", 0o644, c.OWRITE),
            c.Tflush(9, 4),
            c.Tclunk(10, 1),
            c.Tremove(11, 1),
        )
    ]


def _garbage(rng: random.Random) -> tuple[bytes, bool]:
    """Bytes to throw at the server, and whether they are certainly a violation (the
    server must hang up by itself) or may merely be incomplete (we send EOF)."""
    frames = _valid_frames()
    kind = rng.randrange(5)
    if kind == 0:  # random bytes
        return rng.randbytes(rng.randrange(1, 200)), False
    if kind == 1:  # a valid prefix of a frame, cut short
        f = rng.choice(frames)
        return f[: rng.randrange(1, len(f))], False
    if kind == 2:  # a frame with bytes flipped after its size field
        while True:
            mutated = bytearray(rng.choice(frames))
            for _ in range(rng.randrange(1, 4)):
                mutated[rng.randrange(4, len(mutated))] = rng.randrange(256)
            try:
                c.decode(bytes(mutated))
            except c.ProtocolError:
                return bytes(mutated), True
    if kind == 3:  # a sound frame header with a body that does not decode
        while True:
            body = bytes([rng.choice([*range(100, 128), 0, 255])]) + rng.randbytes(
                rng.randrange(2, 60)
            )
            f = struct.pack("<I", len(body) + 4) + body
            try:
                c.decode(f)
            except c.ProtocolError:
                return f, True
    # kind 4: an R-message
    replies: list[c.Message] = [c.Rclunk(1), c.Rerror(2, "x"), c.Rread(3, b"y")]
    return c.encode(rng.choice(replies)), True


async def _hostile(path: str, seed: int, after_version: bool) -> None:
    rng = random.Random(seed)
    data, certain = _garbage(rng)
    stream = await trio.open_unix_socket(path)
    async with stream:
        if after_version:
            await stream.send_all(c.encode(c.Tversion(c.NOTAG, 8192, c.VERSION)))
        try:
            await stream.send_all(data)
            if not certain:
                await stream.send_eof()
        except trio.BrokenResourceError:
            return  # already hung up on us
        with trio.fail_after(10):
            while True:
                try:
                    if not await stream.receive_some(1 << 16):
                        return  # the server closed the connection
                except trio.BrokenResourceError:
                    return


async def test_fuzzed_connections_do_not_disturb_a_good_client(served: Served) -> None:
    fs = served.fs
    async with Client.connect_unix(served.path, msize=8192) as good:
        root = await good.attach("me", "")
        done = trio.Event()
        rounds = 0

        async def keep_working() -> None:
            nonlocal rounds
            while not done.is_set():
                assert await good.read_all(root, "big") == BIG
                assert len(await good.listdir(root, "many")) == 60
                await good.write_all(root, "rw", b"round %d" % rounds)
                assert await good.read_all(root, "rw") == b"round %d" % rounds
                rounds += 1

        async with trio.open_nursery() as n:
            n.start_soon(keep_working)
            for batch in range(10):
                async with trio.open_nursery() as hostile:
                    for i in range(20):
                        hostile.start_soon(_hostile, served.path, batch * 100 + i, i % 2 == 0)
            done.set()
        assert rounds > 0
        # Still fine afterwards, including a flushed blocking read.
        f = await good.walk(root, ["block"])
        await good.open(f, c.OREAD)
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as n:
                n.start_soon(good.read, f, 0, 1)
                await fs.block_started.wait()
                scope.cancel()
        await good.clunk(f)
        await good.clunk(root)
        await settle()
        assert served.stats.connections == 1  # only the good one
        assert served.stats.fids == 0
        assert served.stats.in_flight == 0
        assert served.stats.violations > 0
        assert served.stats.connections_total == 201
        fs.assert_all_clunked()
    await settle()
    assert served.stats.connections == 0
    assert served.stats.handles == 0
