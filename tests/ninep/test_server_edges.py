"""Server corners: what the application gets wrong, clunks racing reads, limits."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import trio.testing

from ninep import codec as c
from ninep.codec import NinePError
from ninep.server import BaseFileSystem, ServerStats, serve_connection
from olliefs.testing import expect_log
from tests.ninep.conftest import MemFS, MHandle, MNode, Raw, Served, raw_connection, settle


class WeirdFS(MemFS):
    """A file system with bugs and odd answers, one per file name."""

    def stat(self, node: MNode) -> c.Stat:
        st = super().stat(node)
        if node.name == "badstat":
            return c.Stat(qid=st.qid, mtime=-1, name="badstat")
        if node.name == "hugestat":
            return c.Stat(qid=st.qid, name="h" * 5000)
        return st

    async def read(self, handle: MHandle, offset: int, count: int) -> bytes:
        if handle.node.name == "longerr":
            raise NinePError("é" * 40000 + "\x00 tail")
        if handle.node.name == "toomuch":
            return b"x" * (count + 10)
        return await super().read(handle, offset, count)

    async def write(self, handle: MHandle, offset: int, data: bytes) -> int:
        if handle.node.name == "liar":
            return len(data) + 1
        return await super().write(handle, offset, data)


@asynccontextmanager
async def weird_server(**kw: int) -> AsyncIterator[tuple[Raw, WeirdFS, ServerStats]]:
    fs = WeirdFS()
    for name in ("badstat", "hugestat", "longerr", "toomuch", "liar"):
        fs.file(name, b"content", writable=True)
    stats = ServerStats()
    a, b = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as n:
        n.start_soon(functools.partial(serve_connection, b, fs, stats=stats, **kw))
        yield Raw(a), fs, stats
        n.cancel_scope.cancel()


async def test_application_mistakes_become_rerrors() -> None:
    expect_log(r"ninep\.server: 9P Rstat from the file system cannot be encoded", logging.ERROR)
    expect_log(r"ninep\.server: 9P read returned 15 bytes for a count of 5")
    expect_log(r"ninep\.server: 9P write returned 4 for 3 bytes", logging.ERROR)
    async with weird_server() as (r, fs, _):
        assert (await r.version(1000)).msize == 1000
        await r.attach(0)
        # A Stat that cannot be encoded: a bug, logged, "internal error".
        assert isinstance(await r.rpc(c.Twalk(1, 0, 1, ("badstat",))), c.Rwalk)
        assert await r.rpc(c.Tstat(1, 1)) == c.Rerror(1, c.EINTERNAL)
        # A reply that cannot fit in the msize is refused, not sent oversize.
        await r.rpc(c.Twalk(1, 0, 2, ("hugestat",)))
        reply = await r.rpc(c.Tstat(2, 2))
        assert reply == c.Rerror(2, "reply does not fit in msize")
        # An ename longer than the msize is cut (on a character boundary), NUL-free.
        await r.walk_open(0, 3, ("longerr",), c.OREAD)
        reply = await r.rpc(c.Tread(3, 3, 0, 10))
        assert isinstance(reply, c.Rerror)
        assert len(c.encode(reply)) <= 1000 and reply.ename.startswith("éé")
        # More data than asked for is cut to the count.
        await r.walk_open(0, 4, ("toomuch",), c.OREAD)
        assert await r.rpc(c.Tread(4, 4, 0, 5)) == c.Rread(4, b"xxxxx")
        # A write that claims more than it was given is a bug.
        await r.walk_open(0, 5, ("liar",), c.OWRITE)
        assert await r.rpc(c.Twrite(5, 5, 0, b"abc")) == c.Rerror(5, c.EINTERNAL)
        # The connection is still fine.
        assert isinstance(await r.rpc(c.Tstat(6, 0)), c.Rstat)
    fs.assert_all_clunked()


async def test_clunk_during_a_read_waits_for_the_read(served: Served) -> None:
    """The file system never sees a read on a handle it was told to clunk."""
    fs = served.fs
    async with raw_connection(served.path) as r:
        await r.version()
        await r.attach(0)
        await r.walk_open(0, 1, ("block",), c.OREAD)
        await r.send(c.Tread(10, 1, 0, 5))
        await fs.block_started.wait()
        assert await r.rpc(c.Tclunk(11, 1)) == c.Rclunk(11)
        assert len(fs.open_handles) == 1  # still reading: not clunked yet
        assert await r.rpc(c.Tstat(12, 1)) == c.Rerror(12, c.EUNKNOWNFID)
        assert await r.rpc(c.Tflush(13, 10)) == c.Rflush(13)
        await settle()
        assert fs.open_handles == {}
        fs.assert_all_clunked()


async def test_fid_limit() -> None:
    async with weird_server(max_fids=3) as (r, _, stats):
        await r.version()
        await r.attach(0)
        assert isinstance(await r.rpc(c.Twalk(1, 0, 1, ())), c.Rwalk)
        assert isinstance(await r.rpc(c.Twalk(1, 0, 2, ())), c.Rwalk)
        assert await r.rpc(c.Twalk(1, 0, 3, ())) == c.Rerror(1, "too many fids")
        assert stats.fids == 3
        assert await r.rpc(c.Tclunk(1, 2)) == c.Rclunk(1)
        assert isinstance(await r.rpc(c.Twalk(1, 0, 3, ())), c.Rwalk)


async def test_create_rules() -> None:
    async with weird_server() as (r, _, _):
        await r.version()
        await r.attach(0)
        await r.rpc(c.Twalk(1, 0, 1, ()))
        reply = await r.rpc(c.Tcreate(2, 1, "d", c.DMDIR | 0o755, c.OWRITE))
        assert reply == c.Rerror(2, c.EISDIR)
        reply = await r.rpc(c.Tcreate(2, 1, "d", c.DMDIR | 0o755, c.OREAD))
        assert isinstance(reply, c.Rcreate) and reply.qid.type == c.QTDIR
        assert reply.iounit == 8192 - c.IOHDRSZ
        # Now fid 1 is the new (open) directory: no second create, no walk.
        reply = await r.rpc(c.Tcreate(2, 1, "e", 0o644, c.OREAD))
        assert reply == c.Rerror(2, "fid already open")
        assert await r.rpc(c.Twstat(3, 99, c.NOCHANGE)) == c.Rerror(3, c.EUNKNOWNFID)
        assert await r.rpc(c.Tremove(3, 99)) == c.Rerror(3, c.EUNKNOWNFID)
        assert await r.rpc(c.Tclunk(3, 99)) == c.Rerror(3, c.EUNKNOWNFID)


class NoneHandles(BaseFileSystem[str, None]):
    """Nodes are path strings and every handle is ``None``: the server must not take a
    handle for "no handle". ``/`` is a directory whose listing fails after it was opened,
    ``f`` a file."""

    def __init__(self) -> None:
        self.opens = 0
        self.clunks = 0

    async def attach(self, uname: str, aname: str) -> str:
        return "/"

    async def walk(self, node: str, name: str) -> str:
        if node != "/" or name != "f":
            raise NinePError(c.ENOTFOUND)
        return "f"

    def stat(self, node: str) -> c.Stat:
        qtype = c.QTDIR if node == "/" else c.QTFILE
        return c.Stat(qid=c.Qid(qtype, 0, len(node)), name=node)

    async def open(self, node: str, mode: int) -> None:
        self.opens += 1

    async def read(self, handle: None, offset: int, count: int) -> bytes:
        return b"data"[offset : offset + count]

    async def readdir(self, node: str) -> list[c.Stat]:
        raise NinePError("listing failed")

    async def clunk(self, handle: None) -> None:
        self.clunks += 1


async def test_a_handle_may_be_none() -> None:
    fs = NoneHandles()
    stats = ServerStats()
    a, b = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as n:
        n.start_soon(functools.partial(serve_connection, b, fs, stats=stats))
        r = Raw(a)
        await r.version()
        await r.attach(0)
        # A file: opened, read through its None handle, clunked once.
        await r.walk_open(0, 1, ("f",), c.OREAD)
        assert await r.rpc(c.Tread(4, 1, 0, 10)) == c.Rread(4, b"data")
        assert await r.rpc(c.Tclunk(5, 1)) == c.Rclunk(5)
        assert (fs.opens, fs.clunks, stats.handles) == (1, 1, 0)
        # The directory's open fails after the app gave its (None) handle: that handle
        # is clunked all the same, and the fid is fresh again.
        assert await r.rpc(c.Topen(6, 0, c.OREAD)) == c.Rerror(6, "listing failed")
        assert (fs.opens, fs.clunks, stats.handles) == (2, 2, 0)
        assert isinstance(await r.rpc(c.Twalk(7, 0, 2, ("f",))), c.Rwalk)
        n.cancel_scope.cancel()
    assert stats.handles == 0 and fs.clunks == fs.opens


class _CountingStream(trio.abc.Stream):
    """The server's end of a memory stream, counting the writes the server makes."""

    def __init__(self, inner: trio.abc.Stream, fs: MemFS) -> None:
        self.inner = inner
        self.fs = fs
        self.writes = 0
        self.block_started_at_write: list[bool] = []

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.writes += 1
        self.block_started_at_write.append(self.fs.block_started.is_set())
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_requests_that_cannot_wait_are_answered_in_order_in_one_write() -> None:
    """A pipelined walk, open, read and clunk of one fid (and a Tflush of the read, which
    is already answered) work as if sent one by one, and their replies leave together;
    a blocked read in flight is not held up by them, nor they by it."""
    fs = MemFS(inline=True)
    a, b = trio.testing.memory_stream_pair()
    counted = _CountingStream(b, fs)
    async with trio.open_nursery() as n:
        n.start_soon(serve_connection, counted, fs)
        r = Raw(a)
        await r.version()
        await r.attach(0)
        await r.walk_open(0, 1, ("block",), c.OREAD)
        await r.send(c.Tread(9, 1, 0, 5))
        await fs.block_started.wait()
        before = counted.writes
        await r.send(
            c.Twalk(1, 0, 5, ("hello",)),
            c.Topen(2, 5, c.OREAD),
            c.Tread(3, 5, 0, 100),
            c.Tclunk(4, 5),
            c.Tflush(5, 3),
        )
        replies = [await r.recv() for _ in range(5)]
        assert [type(m) for m in replies] == [c.Rwalk, c.Ropen, c.Rread, c.Rclunk, c.Rflush]
        assert replies[2] == c.Rread(3, b"hello world\n")
        assert counted.writes == before + 1
        assert await r.rpc(c.Tflush(6, 9)) == c.Rflush(6)  # the blocked read, flushed
        assert fs.cancelled_reads == 1
        # A reply made at once waits for a task started after it in the same batch, but
        # only until that task first waits, not until it ends.
        fs.block_started = trio.Event()
        await r.send(c.Twalk(7, 0, 8, ("hello",)), c.Tread(10, 1, 0, 5))
        assert isinstance(await r.recv(), c.Rwalk)
        assert counted.block_started_at_write[-1]  # the read had started, and waits
        assert await r.rpc(c.Tflush(11, 10)) == c.Rflush(11)
        n.cancel_scope.cancel()
    fs.assert_all_clunked()
