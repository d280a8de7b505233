"""A small in-memory FileSystem, a live server on a unix socket, and a raw-frame peer.

``MemFS`` keeps books on itself: every handle ``open``/``create`` returned, every clunk
(a second clunk of the same handle is counted, not hidden), reads that were cancelled.
The tests use those books and ``ServerStats`` to prove nothing leaks.

Tree::

    hello        "hello world\\n"
    big          200 000 bytes of a pattern
    rw           writable, starts empty
    block        a read blocks until cancelled (records the cancellation)
    boom         a read raises RuntimeError (an application bug)
    badclunk     clunking a handle of it raises RuntimeError
    secret       open is refused (permission denied)
    sub/a, sub/b small files
    many/        60 entries with longish names (directory reads in pieces)
    empty/       an empty directory
"""

from __future__ import annotations

import functools
import itertools
import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
import trio

from ninep import codec as c
from ninep.codec import NinePError
from ninep.server import BaseFileSystem, ServerStats, serve_unix
from ninep.transport import Transport

TEST_MAX_MSIZE = (1 << 16) + c.IOHDRSZ
BIG = bytes(i * 7 % 251 for i in range(200_000))
MAX_FILE = 64 << 20  # room for test_large_frames; a fuzzed offset must not allocate more


@dataclass(eq=False)
class MNode:
    name: str
    path: int
    parent: MNode | None
    children: dict[str, MNode] | None = None  # None: a file
    data: bytearray = field(default_factory=bytearray)
    kind: str = "file"
    writable: bool = False
    version: int = 0

    @property
    def is_dir(self) -> bool:
        return self.children is not None


@dataclass(eq=False)
class MHandle:
    id: int
    node: MNode
    mode: int


class MemFS(BaseFileSystem[MNode, MHandle]):
    """A tree in memory. ``inline``: every request but a read of ``block`` is said not
    to wait (`waits`), so the server answers it in its reader, as toolsrv's are; by
    default each request gets a task of its own, as the FUSE tree's do."""

    def __init__(self, *, inline: bool = False) -> None:
        self.inline = inline
        self._paths = itertools.count(1)
        self._hids = itertools.count(1)
        self.root = MNode("/", next(self._paths), None, {})
        self.root.parent = self.root
        self.file("hello", b"hello world\n")
        self.file("big", BIG)
        self.file("rw", b"", writable=True)
        self.file("block", b"", kind="block")
        self.file("boom", b"", kind="boom")
        self.file("badclunk", b"", kind="badclunk")
        self.file("secret", b"", kind="secret")
        sub = self.mkdir(self.root, "sub")
        self.file("a", b"A", parent=sub)
        self.file("b", b"BB", parent=sub)
        many = self.mkdir(self.root, "many")
        for i in range(60):
            self.file(f"entry-{i:03d}-" + "x" * (i % 17), b"", parent=many)
        self.mkdir(self.root, "empty")
        self.open_handles: dict[int, MHandle] = {}
        self.opened = 0
        self.clunked = 0
        self.double_clunks = 0
        self.attaches = 0
        self.detaches = 0
        self.writes: list[tuple[int, int]] = []  # (offset, len) of each write call
        self.block_started = trio.Event()
        self.block_cancelled = trio.Event()
        self.cancelled_reads = 0

    def mkdir(self, parent: MNode, name: str) -> MNode:
        node = MNode(name, next(self._paths), parent, {}, writable=True)
        assert parent.children is not None
        parent.children[name] = node
        return node

    def file(
        self,
        name: str,
        data: bytes,
        *,
        parent: MNode | None = None,
        kind: str = "file",
        writable: bool = False,
    ) -> MNode:
        parent = parent or self.root
        node = MNode(name, next(self._paths), parent, None, bytearray(data), kind, writable)
        assert parent.children is not None
        parent.children[name] = node
        return node

    # ---- FileSystem ---------------------------------------------------------------

    def waits(self, op: int, node: MNode | None, handle: MHandle | None) -> bool:
        if not self.inline:
            return True
        return op == c.TREAD and handle is not None and handle.node.kind == "block"

    async def attach(self, uname: str, aname: str) -> MNode:
        if aname == "bad":
            raise NinePError("authentication failed")
        self.attaches += 1
        return self.root

    def detach(self, root: MNode) -> None:
        assert root is self.root
        self.detaches += 1

    async def walk(self, node: MNode, name: str) -> MNode:
        if node.children is None:
            raise NinePError(c.ENOTDIR)
        if name == "..":
            assert node.parent is not None
            return node.parent
        child = node.children.get(name)
        if child is None:
            raise NinePError(c.ENOTFOUND)
        return child

    def stat(self, node: MNode) -> c.Stat:
        qtype = c.QTDIR if node.is_dir else c.QTFILE
        perm = 0o755 if node.is_dir else (0o644 if node.writable else 0o444)
        return c.Stat(
            qid=c.Qid(qtype, node.version, node.path),
            mode=(c.DMDIR if node.is_dir else 0) | perm,
            atime=1_700_000_000,
            mtime=1_700_000_000,
            length=0 if node.is_dir else len(node.data),
            name=node.name,
            uid="ollie",
            gid="ollie",
            muid="ollie",
        )

    async def open(self, node: MNode, mode: int) -> MHandle:
        if node.kind == "secret":
            raise NinePError(c.EPERM)
        if (mode & 3 in (c.OWRITE, c.ORDWR) or mode & c.OTRUNC) and not node.writable:
            raise NinePError(c.EPERM)
        if mode & c.OTRUNC and not node.is_dir:
            node.data.clear()
        return self._handle(node, mode)

    def _handle(self, node: MNode, mode: int) -> MHandle:
        h = MHandle(next(self._hids), node, mode)
        self.open_handles[h.id] = h
        self.opened += 1
        return h

    async def read(self, handle: MHandle, offset: int, count: int) -> bytes:
        assert handle.id in self.open_handles, "read on a clunked handle"
        node = handle.node
        if node.kind == "block":
            self.block_started.set()
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                self.cancelled_reads += 1
                self.block_cancelled.set()
                raise
        if node.kind == "boom":
            raise RuntimeError("boom: a bug in the file system")
        return bytes(node.data[offset : offset + count])

    async def write(self, handle: MHandle, offset: int, data: bytes) -> int:
        assert handle.id in self.open_handles, "write on a clunked handle"
        node = handle.node
        if offset + len(data) > MAX_FILE:
            raise NinePError("file too large")
        self.writes.append((offset, len(data)))
        if len(node.data) < offset:
            node.data.extend(bytes(offset - len(node.data)))
        node.data[offset : offset + len(data)] = data
        node.version += 1
        return len(data)

    async def readdir(self, node: MNode) -> list[c.Stat]:
        assert node.children is not None
        return [self.stat(ch) for ch in node.children.values()]

    async def clunk(self, handle: MHandle) -> None:
        if self.open_handles.pop(handle.id, None) is None:
            self.double_clunks += 1
            return
        self.clunked += 1
        if handle.node.kind == "badclunk":
            raise RuntimeError("clunk bug")

    async def remove(self, node: MNode) -> None:
        if node is self.root:
            raise NinePError(c.EPERM)
        if node.children:
            raise NinePError("directory not empty")
        assert node.parent is not None and node.parent.children is not None
        if node.parent.children.get(node.name) is not node:
            raise NinePError(c.ENOTFOUND)
        del node.parent.children[node.name]

    async def create(self, node: MNode, name: str, perm: int, mode: int) -> tuple[MNode, MHandle]:
        assert node.children is not None
        if name in node.children:
            raise NinePError(c.EEXIST)
        if perm & c.DMDIR:
            new = self.mkdir(node, name)
        else:
            new = self.file(name, b"", parent=node, writable=True)
        return new, self._handle(new, mode)

    async def wstat(self, node: MNode, stat: c.Stat) -> None:
        if stat.length != c.NOCHANGE.length:
            if node.is_dir:
                raise NinePError(c.EISDIR)
            del node.data[stat.length :]
        if stat.name and stat.name != node.name:
            assert node.parent is not None and node.parent.children is not None
            if stat.name in node.parent.children:
                raise NinePError(c.EEXIST)
            del node.parent.children[node.name]
            node.name = stat.name
            node.parent.children[stat.name] = node

    # ---- books --------------------------------------------------------------------

    def assert_all_clunked(self) -> None:
        assert self.open_handles == {}
        assert self.double_clunks == 0
        assert self.clunked == self.opened


@dataclass
class Served:
    path: str
    fs: MemFS
    stats: ServerStats


@pytest.fixture
def sock_dir(tmp_path: os.PathLike[str]) -> Iterator[str]:
    """A directory for sockets whose paths fit in sun_path (108 bytes)."""
    base = str(tmp_path)
    if len(base) < 80:
        yield base
        return
    with tempfile.TemporaryDirectory(prefix="9p", dir="/tmp") as d:  # pragma: no cover
        yield d


@pytest.fixture(params=[False, True], ids=["tasks", "inline"])
async def served(nursery: trio.Nursery, sock_dir: str, request: pytest.FixtureRequest) -> Served:
    fs = MemFS(inline=request.param)
    stats = ServerStats()
    path = os.path.join(sock_dir, "9p.sock")
    await nursery.start(
        functools.partial(serve_unix, path, fs, stats=stats, max_msize=TEST_MAX_MSIZE)
    )
    return Served(path, fs, stats)


async def settle() -> None:
    """Let every task in this process (server included) run until it blocks."""
    await trio.testing.wait_all_tasks_blocked()


class Raw:
    """A hand-driven 9P peer: sends any frame, reads replies one by one."""

    def __init__(self, stream: trio.abc.HalfCloseableStream) -> None:
        self.stream = stream
        self.transport = Transport(stream)

    async def send(self, *msgs: c.Message) -> None:
        await self.stream.send_all(b"".join(c.encode(m) for m in msgs))

    async def send_bytes(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def recv(self) -> c.Message:
        with trio.fail_after(10):
            frame = await self.transport.next_frame(1 << 24)
        assert frame is not None, "server closed the connection"
        return c.decode(frame)

    async def rpc(self, msg: c.Message) -> c.Message:
        await self.send(msg)
        reply = await self.recv()
        assert reply.tag == msg.tag
        return reply

    async def version(self, msize: int = 8192) -> c.Rversion:
        reply = await self.rpc(c.Tversion(c.NOTAG, msize, c.VERSION))
        assert isinstance(reply, c.Rversion), reply
        return reply

    async def attach(self, fid: int = 0) -> None:
        reply = await self.rpc(c.Tattach(1, fid, c.NOFID, "me", ""))
        assert isinstance(reply, c.Rattach), reply

    async def walk_open(self, fid: int, newfid: int, names: tuple[str, ...], mode: int) -> None:
        reply = await self.rpc(c.Twalk(2, fid, newfid, names))
        assert isinstance(reply, c.Rwalk) and len(reply.qids) == len(names), reply
        reply = await self.rpc(c.Topen(3, newfid, mode))
        assert isinstance(reply, c.Ropen), reply

    async def closed_by_server(self) -> bytes:
        """Everything the server still sent, once it closed the connection."""
        got = bytearray()
        with trio.fail_after(10):
            while True:
                try:
                    data = await self.stream.receive_some(1 << 16)
                except trio.BrokenResourceError:
                    return bytes(got)
                if not data:
                    return bytes(got)
                got += data


@asynccontextmanager
async def raw_connection(path: str) -> AsyncIterator[Raw]:
    stream = await trio.open_unix_socket(path)
    async with stream:
        yield Raw(stream)
