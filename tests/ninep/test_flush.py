"""Cancellation end to end: Tflush really cancels server work; connection loss."""

from __future__ import annotations

import functools

import pytest
import trio
import trio.testing

from ninep import Client, ConnectionLost, NinePError
from ninep import codec as c
from ninep.server import ServerStats, serve_connection
from tests.ninep.conftest import MemFS, MNode, Served, raw_connection, settle


async def test_cancelled_read_is_flushed_and_server_work_cancelled(served: Served) -> None:
    fs = served.fs
    async with Client.connect_unix(served.path) as cl:
        root = await cl.attach("me", "")
        fid = await cl.walk(root, ["block"])
        await cl.open(fid, c.OREAD)
        outcome: list[str] = []

        async def reader(scope: trio.CancelScope) -> None:
            with scope:
                await cl.read(fid, 0, 10)
                outcome.append("returned")  # pragma: no cover - must not happen
            outcome.append("cancelled")

        scope = trio.CancelScope()
        async with trio.open_nursery() as n:
            n.start_soon(reader, scope)
            await fs.block_started.wait()
            assert served.stats.in_flight == 1
            scope.cancel()
        # By the time the cancelled call returned, the server task had been cancelled
        # and the Tflush answered.
        assert outcome == ["cancelled"]
        assert fs.block_cancelled.is_set() and fs.cancelled_reads == 1
        assert served.stats.in_flight == 0
        # The connection (and the tags the flush used) keep working.
        for _ in range(3):
            assert await cl.read_all(root, "hello") == b"hello world\n"
        # The fid is still open and can be read (and flushed) again.
        fs.block_started = trio.Event()
        with trio.move_on_after(0) as again:
            again.deadline = trio.current_time() + 1e9
            async with trio.open_nursery() as n:
                n.start_soon(cl.read, fid, 0, 10)
                await fs.block_started.wait()
                again.cancel()
        assert fs.cancelled_reads == 2
        await cl.clunk(fid)
    await settle()
    assert served.stats.fids == 0 and served.stats.in_flight == 0
    fs.assert_all_clunked()


async def test_no_reply_for_a_flushed_tag_after_rflush(served: Served) -> None:
    fs = served.fs
    async with raw_connection(served.path) as r:
        await r.version()
        await r.attach(0)
        await r.walk_open(0, 1, ("block",), c.OREAD)
        await r.send(c.Tread(10, 1, 0, 10))
        await fs.block_started.wait()
        await r.send(c.Tflush(11, 10))
        assert await r.recv() == c.Rflush(11)
        assert fs.block_cancelled.is_set()
        # Had the server answered tag 10 after all, that reply would come first here.
        reply = await r.rpc(c.Tstat(12, 1))
        assert isinstance(reply, c.Rstat)
        # Tag 10 is free again.
        assert isinstance(await r.rpc(c.Tstat(10, 1)), c.Rstat)
        # Tflush of a tag nobody uses is simply answered.
        assert await r.rpc(c.Tflush(13, 777)) == c.Rflush(13)


async def test_flush_after_the_reply_went_out(served: Served) -> None:
    async with raw_connection(served.path) as r:
        await r.version()
        await r.attach(0)
        await r.walk_open(0, 1, ("hello",), c.OREAD)
        await r.send(c.Tread(10, 1, 0, 5), c.Tflush(11, 10))
        # Either the read was answered before the flush (then Rread comes first), or
        # it was flushed (then only Rflush comes). Never Rflush then Rread.
        first = await r.recv()
        if isinstance(first, c.Rread):
            assert first == c.Rread(10, b"hello")
            assert await r.recv() == c.Rflush(11)
        else:
            assert first == c.Rflush(11)
        assert isinstance(await r.rpc(c.Tstat(12, 1)), c.Rstat)
        await settle()
        assert served.stats.in_flight == 0


async def test_flushed_walk_does_not_leave_its_fid() -> None:
    """A walk the client saw flushed must not have created newfid, even if the file
    system finished it (it ignored the cancellation) after the Tflush arrived."""

    class StubbornWalk(MemFS):
        def __init__(self) -> None:
            super().__init__()
            self.walking = trio.Event()
            self.release = trio.Event()

        async def walk(self, node: MNode, name: str) -> MNode:
            if name == "slow":
                self.walking.set()
                with trio.CancelScope(shield=True):
                    await self.release.wait()
                return self.root
            return await super().walk(node, name)

    fs = StubbornWalk()
    stats = ServerStats()
    a, b = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as n:
        n.start_soon(functools.partial(serve_connection, b, fs, stats=stats))
        async with Client.connect(a) as cl:
            root = await cl.attach("me", "")
            outcome: list[str] = []

            async def walker(scope: trio.CancelScope) -> None:
                with scope:
                    await cl.walk(root, ["slow"])
                    outcome.append("walked")  # pragma: no cover
                outcome.append("cancelled")

            async with trio.open_nursery() as inner:
                scope = trio.CancelScope()
                inner.start_soon(walker, scope)
                await fs.walking.wait()
                scope.cancel()
                await settle()  # the Tflush is in and waits for the walk to finish
                assert stats.in_flight == 2
                fs.release.set()
            assert outcome == ["cancelled"]
            assert stats.fids == 1  # only the root: the finished walk was not committed
            f = await cl.walk(root, ["hello"])  # the fid number is free again
            assert await cl.read_all(root, "hello") == b"hello world\n"
            await cl.clunk(f)
            await cl.clunk(root)
        n.cancel_scope.cancel()
    assert stats.fids == 0


async def test_connection_lost_fails_pending_and_later_calls() -> None:
    fs = MemFS()
    stats = ServerStats()
    a, b = trio.testing.memory_stream_pair()
    errors: list[BaseException] = []
    async with trio.open_nursery() as n:
        server_scope = trio.CancelScope()

        async def server() -> None:
            with server_scope:
                await serve_connection(b, fs, stats=stats)

        n.start_soon(server)
        async with Client.connect(a) as cl:
            root = await cl.attach("me", "")
            fid = await cl.walk(root, ["block"])
            await cl.open(fid, c.OREAD)

            async def pending() -> None:
                try:
                    await cl.read(fid, 0, 1)
                except ConnectionLost as err:
                    errors.append(err)

            async with trio.open_nursery() as inner:
                inner.start_soon(pending)
                await fs.block_started.wait()
                server_scope.cancel()  # the server goes away
            assert len(errors) == 1 and isinstance(errors[0], NinePError)
            with pytest.raises(ConnectionLost):
                await cl.stat(root)
            cl.clunk_nowait(root)  # harmless on a dead connection
    assert stats.connections == 0 and stats.fids == 0 and stats.in_flight == 0
    fs.assert_all_clunked()
    assert fs.block_cancelled.is_set()


async def test_disconnect_clunks_every_handle_exactly_once(served: Served) -> None:
    fs = served.fs
    async with Client.connect_unix(served.path) as cl:
        root = await cl.attach("me", "")
        for name in ("hello", "big", "sub", "rw", "block"):
            f = await cl.walk(root, [name])
            await cl.open(f, c.OWRITE if name == "rw" else c.OREAD)
        blocked = await cl.walk(root, ["block"])
        await cl.open(blocked, c.OREAD)
        async with trio.open_nursery() as n:
            n.start_soon(cl.read, blocked, 0, 1)
            await fs.block_started.wait()
            n.cancel_scope.cancel()
        assert len(fs.open_handles) == 6
    # The client went away with fids open; the server clunks them all.
    await settle()
    assert served.stats.connections == 0
    assert served.stats.fids == 0 and served.stats.in_flight == 0
    assert served.stats.handles == 0
    fs.assert_all_clunked()
    assert fs.attaches == fs.detaches == 1


async def test_clunk_nowait_frees_the_fid_after_the_reply(served: Served) -> None:
    async with Client.connect_unix(served.path) as cl:
        root = await cl.attach("me", "")
        f = await cl.walk(root, ["hello"])
        cl.clunk_nowait(f)
        g = await cl.walk(root, ["sub"])
        assert g != f  # f is not free until Rclunk arrived
        await settle()
        assert served.stats.fids == 2
        h = await cl.walk(root, ["sub"])
        assert h == f  # now it is reused
        await cl.clunk(g)
        await cl.clunk(h)
        await cl.clunk(root)
    await settle()
    assert served.stats.fids == 0
