"""The client against a hand-scripted server: the orderings a real server rarely shows."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from ninep import Client, ConnectionLost, NinePError
from ninep import codec as c
from ninep.client import FLUSH_TIMEOUT, split_path
from ninep.transport import Transport
from tests.ninep.conftest import settle


class Peer:
    """The server side of a memory stream, driven frame by frame by the test."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.transport = Transport(stream)

    async def recv(self) -> c.Message:
        frame = await self.transport.next_frame(1 << 20)
        assert frame is not None
        return c.decode(frame)

    async def send(self, *msgs: c.Message) -> None:
        await self.stream.send_all(b"".join(c.encode(m) for m in msgs))

    async def handshake(self, msize: int | None = None, version: str = c.VERSION) -> None:
        tv = await self.recv()
        assert isinstance(tv, c.Tversion) and tv.tag == c.NOTAG
        await self.send(c.Rversion(c.NOTAG, msize or tv.msize, version))


@asynccontextmanager
async def scripted(
    script: Callable[[Peer], Awaitable[None]],
) -> AsyncIterator[tuple[Client, Peer]]:
    a, b = trio.testing.memory_stream_pair()
    peer = Peer(b)
    async with trio.open_nursery() as n:
        n.start_soon(peer.handshake)
        async with Client.connect(a) as cl:
            n.start_soon(script, peer)
            yield cl, peer
        n.cancel_scope.cancel()


async def test_late_walk_reply_gets_its_fid_clunked() -> None:
    """Rwalk arrives before Rflush: the walk happened, so the client clunks newfid."""
    seen: list[c.Message] = []

    async def script(peer: Peer) -> None:
        tw = await peer.recv()
        assert isinstance(tw, c.Twalk)
        tf = await peer.recv()
        assert tf == c.Tflush(tf.tag, tw.tag)
        await peer.send(c.Rwalk(tw.tag, (c.Qid(0, 0, 1),)), c.Rflush(tf.tag))
        seen.append(await peer.recv())

    async with scripted(script) as (cl, _):
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as n:
                n.start_soon(cl.walk, 0, ["x"])
                await settle()
                scope.cancel()
        assert scope.cancelled_caught
        await settle()
    assert len(seen) == 1 and isinstance(seen[0], c.Tclunk)


async def test_rflush_first_means_no_fid_and_tags_are_reused() -> None:
    tags: list[int] = []
    newfids: list[int] = []

    async def script(peer: Peer) -> None:
        tw = await peer.recv()
        assert isinstance(tw, c.Twalk)
        tf = await peer.recv()
        assert isinstance(tf, c.Tflush)
        tags.extend([tw.tag, tf.tag])
        newfids.append(tw.newfid)
        await peer.send(c.Rflush(tf.tag))
        nxt = await peer.recv()
        assert isinstance(nxt, c.Twalk)
        assert nxt.newfid == tw.newfid  # the fid number came back
        assert nxt.tag in tags  # so did the tags
        await peer.send(c.Rwalk(nxt.tag, (c.Qid(0, 0, 1),)))

    async with scripted(script) as (cl, _):
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as n:
                n.start_soon(cl.walk, 0, ["x"])
                await settle()
                scope.cancel()
        assert await cl.walk(0, ["y"]) == newfids[0]


async def test_unanswered_flush_gives_up_and_keeps_the_tag(autojump_clock: object) -> None:
    """No Rflush within FLUSH_TIMEOUT: the call ends anyway; the tag is not reused until
    a reply for it finally shows up."""
    got: list[c.Message] = []

    async def script(peer: Peer) -> None:
        tr = await peer.recv()
        tf = await peer.recv()
        assert isinstance(tf, c.Tflush)
        got.extend([tr, tf])
        nxt = await peer.recv()  # sent after the client gave up on the flush
        got.append(nxt)
        await peer.send(c.Rread(nxt.tag, b"ok"))

    async with scripted(script) as (cl, _):
        start = trio.current_time()
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as n:
                n.start_soon(cl.read, 1, 0, 10)
                await settle()
                scope.cancel()
        assert trio.current_time() - start >= FLUSH_TIMEOUT
        assert await cl.read(1, 0, 10) == b"ok"
    assert got[2].tag not in (got[0].tag, got[1].tag)


async def test_reply_for_an_unknown_tag_is_connection_lost() -> None:
    async def script(peer: Peer) -> None:
        await peer.recv()
        await peer.send(c.Rclunk(4242))

    async with scripted(script) as (cl, _):
        with pytest.raises(ConnectionLost, match="nobody asked"):
            await cl.stat(0)
        with pytest.raises(ConnectionLost):
            await cl.stat(0)


async def test_server_eof_fails_pending_calls() -> None:
    async def script(peer: Peer) -> None:
        await peer.recv()
        await peer.stream.aclose()

    async with scripted(script) as (cl, _):
        with pytest.raises(ConnectionLost):
            await cl.read(0, 0, 1)


async def test_rerror_frees_the_tag_and_fid() -> None:
    seen: list[c.Message] = []

    async def script(peer: Peer) -> None:
        for _ in range(3):
            m = await peer.recv()
            seen.append(m)
            await peer.send(c.Rerror(m.tag, c.ENOTFOUND))

    async with scripted(script) as (cl, _):
        for _ in range(3):
            with pytest.raises(NinePError, match=c.ENOTFOUND) as info:
                await cl.walk(0, ["nope"])
            assert info.value.ename == c.ENOTFOUND
    assert len({m.tag for m in seen}) == 1
    assert len({m.newfid for m in seen if isinstance(m, c.Twalk)}) == 1


async def test_wrong_reply_type_drops_the_connection() -> None:
    async def script(peer: Peer) -> None:
        m = await peer.recv()
        await peer.send(c.Rclunk(m.tag))

    async with scripted(script) as (cl, _):
        with pytest.raises(ConnectionLost, match="expected Rread, got Rclunk"):
            await cl.read(0, 0, 1)
        with pytest.raises(ConnectionLost):
            await cl.read(0, 0, 1)


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (c.Rerror(c.NOTAG, "go away"), NinePError),
        (c.Rversion(c.NOTAG, 8192, "unknown"), NinePError),
        (c.Rversion(c.NOTAG, 1 << 30, c.VERSION), ConnectionLost),
        (c.Rclunk(c.NOTAG), ConnectionLost),
        (c.Rversion(c.NOTAG, c.IOHDRSZ, c.VERSION), ConnectionLost),
    ],
)
async def test_handshake_failures(reply: c.Message, error: type[Exception]) -> None:
    a, b = trio.testing.memory_stream_pair()
    peer = Peer(b)

    async def serve() -> None:
        await peer.recv()
        await peer.send(reply)

    async with trio.open_nursery() as n:
        n.start_soon(serve)
        with pytest.raises(error):
            async with Client.connect(a, msize=8192):
                pass  # pragma: no cover


async def test_body_exceptions_come_out_unwrapped() -> None:
    """``connect`` runs a nursery inside; the caller's own exception must not come out
    wrapped in an ExceptionGroup."""
    a, b = trio.testing.memory_stream_pair()
    peer = Peer(b)
    async with trio.open_nursery() as n:
        n.start_soon(peer.handshake)
        with pytest.raises(KeyError):
            async with Client.connect(a):
                raise KeyError("mine")
        with pytest.raises(FileNotFoundError):  # an OSError, as callers expect
            async with Client.connect_unix("/nonexistent/socket"):
                pass  # pragma: no cover
        n.cancel_scope.cancel()


def test_split_path() -> None:
    assert split_path("") == []
    assert split_path("/a//b/./c/") == ["a", "b", "c"]
    assert split_path("../x") == ["..", "x"]


async def test_unencodable_requests_leak_no_tag_or_fid() -> None:
    seen: list[c.Message] = []

    async def script(peer: Peer) -> None:
        m = await peer.recv()
        seen.append(m)
        await peer.send(c.Rwalk(m.tag, (c.Qid(0, 0, 1),)))

    async with scripted(script) as (cl, _):
        for _ in range(3):
            with pytest.raises(ValueError, match="NUL"):
                await cl.walk(0, ["bad\x00name"])
            with pytest.raises(ValueError):
                await cl.read(0, -1, 10)
        assert await cl.walk(0, ["fine"]) == 0
    assert len(seen) == 1 and seen[0].tag == 0
