"""Our client against our server over a real unix socket: the file operations."""

from __future__ import annotations

import logging
import os
import stat as pystat

import msgspec
import pytest
import trio

from ninep import Client, NinePError
from ninep import codec as c
from olliefs.testing import expect_log
from tests.ninep.conftest import BIG, TEST_MAX_MSIZE, Served, raw_connection, settle


async def test_read_stat_listdir_clunk(served: Served) -> None:
    async with Client.connect_unix(served.path) as cl:
        root = await cl.attach("me", "")
        assert await cl.read_all(root, "hello") == b"hello world\n"
        assert await cl.read_all(root, "big") == BIG
        assert await cl.read_all(root, "sub/a") == b"A"
        assert await cl.read_all(root, "sub/../sub/./b") == b"BB"
        names = sorted(s.name for s in await cl.listdir(root, ""))
        assert names == sorted(served.fs.root.children or {})
        assert sorted(s.name for s in await cl.listdir(root, "sub")) == ["a", "b"]
        assert await cl.listdir(root, "empty") == []

        fid = await cl.walk(root, ["big"])
        st = await cl.stat(fid)
        assert (st.name, st.length, st.qid.type) == ("big", len(BIG), c.QTFILE)
        qid, iounit = await cl.open(fid, c.OREAD)
        assert qid == st.qid
        assert iounit == cl.msize - c.IOHDRSZ
        assert await cl.read(fid, 10, 5) == BIG[10:15]
        assert await cl.read(fid, len(BIG), 100) == b""
        await cl.clunk(fid)
        with pytest.raises(NinePError, match=c.EUNKNOWNFID):
            await cl.stat(fid)
        rst = await cl.stat(root)
        assert rst.qid.type == c.QTDIR and rst.mode & c.DMDIR
        await cl.clunk(root)
    await settle()
    assert served.stats.fids == 0 and served.stats.in_flight == 0
    served.fs.assert_all_clunked()
    assert served.fs.attaches == served.fs.detaches == 1


async def test_write_create_remove_wstat(served: Served) -> None:
    fs = served.fs
    async with Client.connect_unix(served.path) as cl:
        root = await cl.attach("me", "")
        await cl.write_all(root, "rw", b"first version, long")
        await cl.write_all(root, "rw", b"second")  # OTRUNC
        assert await cl.read_all(root, "rw") == b"second"

        d = await cl.clone(root)
        qid, _ = await cl.create(d, "new", 0o644, c.ORDWR)
        assert qid.type == c.QTFILE
        assert await cl.write(d, 0, b"created") == 7
        assert await cl.read(d, 0, 100) == b"created"
        await cl.clunk(d)
        assert await cl.read_all(root, "new") == b"created"

        d = await cl.clone(root)
        with pytest.raises(NinePError, match=c.EEXIST):
            await cl.create(d, "new", 0o644, c.OWRITE)
        for bad in ("", ".", "..", "a/b"):
            with pytest.raises(NinePError, match="invalid file name"):
                await cl.create(d, bad, 0o644, c.OWRITE)
        await cl.create(d, "newdir", c.DMDIR | 0o755, c.OREAD)  # the fid is still usable
        assert await cl.read(d, 0, 1000) == b""  # an empty directory, opened
        await cl.clunk(d)
        f = await cl.walk(root, ["hello"])
        with pytest.raises(NinePError, match=c.ENOTDIR):
            await cl.create(f, "x", 0o644, c.OWRITE)
        await cl.clunk(f)

        f = await cl.walk(root, ["new"])
        await cl.wstat(f, msgspec.structs.replace(c.NOCHANGE, length=3, name="renamed"))
        assert (await cl.stat(f)).length == 3
        await cl.clunk(f)
        assert await cl.read_all(root, "renamed") == b"cre"

        f = await cl.walk(root, ["renamed"])
        await cl.remove(f)
        with pytest.raises(NinePError, match=c.ENOTFOUND):
            await cl.walk(root, ["renamed"])
        # remove(5): the fid is clunked even when the remove fails.
        before = served.stats.fids
        f = await cl.clone(root)
        with pytest.raises(NinePError, match=c.EPERM):
            await cl.remove(f)
        assert served.stats.fids == before
        with pytest.raises(NinePError, match=c.EUNKNOWNFID):
            await cl.stat(f)
    await settle()
    assert served.stats.fids == 0
    fs.assert_all_clunked()


async def test_remove_on_close(served: Served) -> None:
    async with Client.connect_unix(served.path) as cl:
        root = await cl.attach("me", "")
        d = await cl.clone(root)
        await cl.create(d, "tmp", 0o600, c.OWRITE | c.ORCLOSE)
        await cl.write(d, 0, b"x")
        assert "tmp" in (served.fs.root.children or {})
        await cl.clunk(d)
        assert "tmp" not in (served.fs.root.children or {})


async def test_walk_semantics(served: Served) -> None:
    async with Client.connect_unix(served.path) as cl:
        root = await cl.attach("me", "")
        base = served.stats.fids
        with pytest.raises(NinePError, match=c.ENOTFOUND):
            await cl.walk(root, ["nope"])
        # A partial walk (sub exists, nope does not) creates no fid on either side.
        with pytest.raises(NinePError, match=c.ENOTFOUND):
            await cl.walk(root, ["sub", "nope", "deeper"])
        with pytest.raises(NinePError, match=c.ENOTFOUND):
            await cl.walk(root, ["hello", "x"])  # walking out of a file
        assert served.stats.fids == base
        # More than MAXWELEM names: the client walks in pieces.
        long = ["sub", ".."] * 12 + ["sub", "a"]
        f = await cl.walk(root, long)
        assert (await cl.stat(f)).name == "a"
        await cl.clunk(f)
        # ... and a failure in a later piece leaves nothing behind.
        with pytest.raises(NinePError, match=c.ENOTFOUND):
            await cl.walk(root, [*(["sub", ".."] * 12), "sub", "zz"])
        await settle()
        assert served.stats.fids == base
        # An open fid cannot be walked, not even cloned.
        f = await cl.walk(root, ["sub"])
        await cl.open(f, c.OREAD)
        with pytest.raises(NinePError, match="open fid"):
            await cl.clone(f)
        with pytest.raises(NinePError, match="already open"):
            await cl.open(f, c.OREAD)
        await cl.clunk(f)


async def test_walk_replacing_the_fid_and_newfid_in_use(served: Served) -> None:
    async with raw_connection(served.path) as r:
        await r.version()
        await r.attach(0)
        assert served.fs.root.children is not None
        sub = served.fs.root.children["sub"]
        assert await r.rpc(c.Twalk(5, 0, 1, ("sub",))) == c.Rwalk(5, (served.fs.stat(sub).qid,))
        # newfid == fid: the walk moves the fid itself, only if it succeeds entirely.
        assert isinstance(await r.rpc(c.Twalk(5, 1, 1, ("a",))), c.Rwalk)
        st = await r.rpc(c.Tstat(6, 1))
        assert isinstance(st, c.Rstat) and st.stat.name == "a"
        reply = await r.rpc(c.Twalk(5, 0, 1, ("hello",)))
        assert reply == c.Rerror(5, c.EFIDINUSE)
        reply = await r.rpc(c.Twalk(5, 0, 2, ("sub", "nope")))
        assert isinstance(reply, c.Rwalk) and len(reply.qids) == 1
        assert await r.rpc(c.Tstat(6, 2)) == c.Rerror(6, c.EUNKNOWNFID)
        assert await r.rpc(c.Twalk(5, 0, 2, ("",))) == c.Rerror(5, "invalid file name")
        assert await r.rpc(c.Twalk(5, 0, c.NOFID, ())) == c.Rerror(5, "NOFID is not a valid fid")
        assert await r.rpc(c.Twalk(5, 9, 3, ())) == c.Rerror(5, c.EUNKNOWNFID)


async def test_open_mode_rules(served: Served) -> None:
    async with Client.connect_unix(served.path) as cl:
        root = await cl.attach("me", "")
        for mode in (c.OWRITE, c.ORDWR, c.OREAD | c.OTRUNC, c.OREAD | c.ORCLOSE):
            d = await cl.walk(root, ["sub"])
            with pytest.raises(NinePError, match=c.EISDIR):
                await cl.open(d, mode)
            await cl.clunk(d)
        f = await cl.walk(root, ["hello"])
        with pytest.raises(NinePError, match=c.EPERM):  # the file system refuses
            await cl.open(f, c.OWRITE)
        with pytest.raises(NinePError, match="not open"):
            await cl.read(f, 0, 10)
        await cl.open(f, c.OREAD)
        with pytest.raises(NinePError, match="not open for writing"):
            await cl.write(f, 0, b"x")
        await cl.clunk(f)
        f = await cl.walk(root, ["rw"])
        await cl.open(f, c.OWRITE)
        with pytest.raises(NinePError, match="not open for reading"):
            await cl.read(f, 0, 10)
        await cl.clunk(f)
        f = await cl.walk(root, ["secret"])
        with pytest.raises(NinePError, match=c.EPERM):
            await cl.open(f, c.OREAD)
        await cl.open(await cl.clone(root), c.OEXEC)  # exec on a directory reads it
    await settle()
    served.fs.assert_all_clunked()


async def test_directory_reads_whole_entries(served: Served) -> None:
    fs = served.fs
    async with raw_connection(served.path) as r:
        await r.version()
        await r.attach(0)
        await r.walk_open(0, 1, ("many",), c.OREAD)
        assert fs.root.children is not None
        expected = await fs.readdir(fs.root.children["many"])
        sizes = [len(c.encode_stat(s)) for s in expected]
        for count in (max(sizes), 100, 150, 301, 1000):
            got: list[c.Stat] = []
            offset = 0
            reads = 0
            while True:
                reply = await r.rpc(c.Tread(7, 1, offset, count))
                assert isinstance(reply, c.Rread), reply
                if not reply.data:
                    break
                assert len(reply.data) <= count
                entries = c.decode_stats(reply.data)  # whole entries only
                # Greedy: the next entry would not have fit.
                if len(got) + len(entries) < len(expected):
                    assert len(reply.data) + sizes[len(got) + len(entries)] > count
                got += entries
                offset += len(reply.data)
                reads += 1
            assert got == expected
            assert reads > 1
            # The next round starts at offset 0 again: a rewind, the directory is re-read.
        assert await r.rpc(c.Tread(7, 1, 1, 1000)) == c.Rerror(7, "bad offset in directory read")
        reply = await r.rpc(c.Tread(7, 1, 0, min(sizes) - 1))
        assert reply == c.Rerror(7, "read count too small for a directory entry")
        first = await r.rpc(c.Tread(7, 1, 0, 200))
        assert isinstance(first, c.Rread)
        # A read that is neither a rewind nor where the last one ended is refused.
        assert isinstance(await r.rpc(c.Tread(7, 1, len(first.data) + 1, 200)), c.Rerror)
        nxt = await r.rpc(c.Tread(7, 1, len(first.data), 200))
        assert (
            isinstance(nxt, c.Rread)
            and c.decode_stats(nxt.data)[0] == expected[len(c.decode_stats(first.data))]
        )


async def test_msize_negotiation_and_read_caps(served: Served) -> None:
    async with Client.connect_unix(served.path, msize=1 << 30) as cl:
        assert cl.msize == TEST_MAX_MSIZE
    async with Client.connect_unix(served.path, msize=4096) as cl:
        assert cl.msize == 4096 and cl.iounit == 4096 - c.IOHDRSZ
        root = await cl.attach("me", "")
        f = await cl.walk(root, ["big"])
        await cl.open(f, c.OREAD)
        assert await cl.read(f, 0, 100_000) == BIG[: 4096 - c.IOHDRSZ]
        assert await cl.read_all(root, "big") == BIG
        # Writes are split at msize.
        w = await cl.walk(root, ["rw"])
        await cl.open(w, c.OWRITE | c.OTRUNC)
        served.fs.writes.clear()
        data = bytes(range(256)) * 40
        assert await cl.write(w, 0, data) == len(data)
        assert all(n <= cl.iounit for _, n in served.fs.writes)
        assert len(served.fs.writes) == -(-len(data) // cl.iounit)
        await cl.clunk(w)
        assert await cl.read_all(root, "rw") == data
    # The server itself caps a read at msize - IOHDRSZ, whatever count says.
    async with raw_connection(served.path) as r:
        assert (await r.version(1000)).msize == 1000
        await r.attach(0)
        await r.walk_open(0, 1, ("big",), c.OREAD)
        reply = await r.rpc(c.Tread(9, 1, 0, 0xFFFFFFFF))
        assert reply == c.Rread(9, BIG[: 1000 - c.IOHDRSZ])
        # A frame over the negotiated msize (even a well-formed one) ends the session.
        await r.send(c.Twrite(9, 1, 0, bytes(1000)))
        await r.closed_by_server()


async def test_version_rules(served: Served) -> None:
    async with raw_connection(served.path) as r:
        # Nothing but Tversion is served before a successful Tversion.
        assert await r.rpc(c.Tattach(1, 0, c.NOFID, "me", "")) == c.Rerror(
            1, "Tversion must come first"
        )
        reply = await r.rpc(c.Tversion(c.NOTAG, 8192, "9P1999"))
        assert reply == c.Rversion(c.NOTAG, 8192, "unknown")
        reply = await r.rpc(c.Tversion(c.NOTAG, 100, "9P2000"))
        assert isinstance(reply, c.Rerror) and "too small" in reply.ename
        # 9P2000.L and friends are answered with plain 9P2000.
        assert await r.rpc(c.Tversion(c.NOTAG, 8192, "9P2000.L")) == c.Rversion(
            c.NOTAG, 8192, "9P2000"
        )


async def test_tversion_resets_the_session(served: Served) -> None:
    fs = served.fs
    async with raw_connection(served.path) as r:
        await r.version()
        await r.attach(0)
        await r.walk_open(0, 1, ("hello",), c.OREAD)
        await r.walk_open(0, 2, ("sub",), c.OREAD)
        # A blocked read is outstanding when the new Tversion arrives.
        await r.walk_open(0, 3, ("block",), c.OREAD)
        await r.send(c.Tread(40, 3, 0, 10))
        await fs.block_started.wait()
        assert served.stats.fids == 4 and fs.open_handles
        await r.send(c.Tversion(c.NOTAG, 4096, c.VERSION))
        # The aborted read gets no reply: the next frame is Rversion.
        assert await r.recv() == c.Rversion(c.NOTAG, 4096, c.VERSION)
        assert fs.block_cancelled.is_set()
        assert served.stats.fids == 0 and served.stats.in_flight == 0
        fs.assert_all_clunked()
        assert fs.detaches == fs.attaches == 1
        for fid in (0, 1, 2, 3):
            assert await r.rpc(c.Tstat(8, fid)) == c.Rerror(8, c.EUNKNOWNFID)
        await r.attach(0)  # fid 0 is free again
        assert fs.attaches == 2


async def test_auth_and_attach_refusals(served: Served) -> None:
    async with raw_connection(served.path) as r:
        await r.version()
        assert await r.rpc(c.Tauth(1, 5, "me", "")) == c.Rerror(1, "authentication not required")
        assert await r.rpc(c.Tattach(1, 0, 5, "me", "")) == c.Rerror(
            1, "authentication not required"
        )
        assert await r.rpc(c.Tattach(1, 0, c.NOFID, "me", "bad")) == c.Rerror(
            1, "authentication failed"
        )
        await r.attach(0)
        assert await r.rpc(c.Tattach(1, 0, c.NOFID, "me", "")) == c.Rerror(1, c.EFIDINUSE)
    async with Client.connect_unix(served.path) as cl:
        with pytest.raises(NinePError, match="authentication failed"):
            await cl.attach("me", "bad")


async def test_application_bugs_do_not_kill_the_connection(served: Served) -> None:
    # Each bug of the file system is logged, with its traceback, and answered.
    expect_log(r"ninep\.server: 9P Tread failed in the file system", logging.ERROR)
    expect_log(r"ninep\.server: 9P clunk failed in the file system", logging.ERROR)
    async with Client.connect_unix(served.path) as cl:
        root = await cl.attach("me", "")
        with pytest.raises(NinePError, match=c.EINTERNAL):
            await cl.read_all(root, "boom")
        # A clunk that raises still frees the fid (and reports the failure).
        f = await cl.walk(root, ["badclunk"])
        await cl.open(f, c.OREAD)
        with pytest.raises(NinePError, match=c.EINTERNAL):
            await cl.clunk(f)
        with pytest.raises(NinePError, match=c.EUNKNOWNFID):
            await cl.stat(f)
        assert await cl.read_all(root, "hello") == b"hello world\n"
    await settle()
    assert served.stats.fids == 0
    served.fs.assert_all_clunked()


async def test_many_tags_in_flight_and_a_blocked_read_does_not_stall(served: Served) -> None:
    fs = served.fs
    async with Client.connect_unix(served.path, msize=8192) as cl:
        root = await cl.attach("me", "")
        blocked = await cl.walk(root, ["block"])
        await cl.open(blocked, c.OREAD)
        results: list[bytes] = []
        async with trio.open_nursery() as n:
            n.start_soon(cl.read, blocked, 0, 10)
            await fs.block_started.wait()

            async def one(i: int) -> None:
                results.append(await cl.read_all(root, "big" if i % 2 else "sub/a"))

            async with trio.open_nursery() as inner:
                for i in range(100):
                    inner.start_soon(one, i)
            assert sorted(results) == sorted([BIG] * 50 + [b"A"] * 50)
            n.cancel_scope.cancel()
        assert fs.block_cancelled.is_set()


async def test_socket_file_mode_and_stale_socket(nursery: trio.Nursery, sock_dir: str) -> None:
    from ninep.server import serve_unix
    from tests.ninep.conftest import MemFS

    path = os.path.join(sock_dir, "m.sock")
    old = os.umask(0)  # even a wide-open umask must not matter
    try:
        await nursery.start(serve_unix, path, MemFS())
        st = os.lstat(path)
        assert pystat.S_ISSOCK(st.st_mode) and pystat.S_IMODE(st.st_mode) == 0o600
        # A live socket is not taken over.
        with pytest.raises(OSError, match="already listening"):
            await serve_unix(path, MemFS())
        other = os.path.join(sock_dir, "g.sock")
        await nursery.start(
            lambda task_status: serve_unix(other, MemFS(), mode=0o660, task_status=task_status)
        )
        assert pystat.S_IMODE(os.lstat(other).st_mode) == 0o660
    finally:
        os.umask(old)
    # A stale socket file (its server died without cleaning up) is replaced.
    import socket

    stale = os.path.join(sock_dir, "stale.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(stale)
    s.close()
    await nursery.start(serve_unix, stale, MemFS())
    async with Client.connect_unix(stale) as cl:
        root = await cl.attach("me", "")
        assert await cl.read_all(root, "hello") == b"hello world\n"
    # Anything else at the path is left alone.
    plain = os.path.join(sock_dir, "plain")
    with open(plain, "w") as fh:
        fh.write("keep me")
    with pytest.raises(FileExistsError):
        await serve_unix(plain, MemFS())
    with open(plain) as fh:
        assert fh.read() == "keep me"


async def test_socket_file_removed_when_serving_stops(sock_dir: str) -> None:
    from ninep.server import serve_unix
    from tests.ninep.conftest import MemFS

    path = os.path.join(sock_dir, "x.sock")
    async with trio.open_nursery() as n:
        await n.start(serve_unix, path, MemFS())
        assert os.path.exists(path)
        n.cancel_scope.cancel()
    assert not os.path.exists(path)


async def test_large_frames(nursery: trio.Nursery, sock_dir: str) -> None:
    """Frames larger than the socket buffers: partial sends and multi-read frames."""
    import functools

    from ninep.server import ServerStats, serve_unix
    from tests.ninep.conftest import MemFS

    fs = MemFS()
    stats = ServerStats()
    path = os.path.join(sock_dir, "big.sock")
    msize = (4 << 20) + c.IOHDRSZ
    await nursery.start(functools.partial(serve_unix, path, fs, stats=stats, max_msize=msize))
    data = bytes(i % 253 for i in range(9 << 20))
    async with Client.connect_unix(path, msize=msize) as cl:
        assert cl.msize == msize
        root = await cl.attach("me", "")
        async with trio.open_nursery() as n:  # several big frames in flight at once
            for _ in range(3):
                n.start_soon(cl.write_all, root, "rw", data)
        assert await cl.read_all(root, "rw") == data
        assert max(n for _, n in fs.writes) == 4 << 20


async def test_many_clients_connecting_at_once(served: Served) -> None:
    """A daemon whose 200 sessions start their turns together connects 200 times to its
    toolsrv in one go: with a listen backlog of 128, the connects past it were refused
    and those sessions went on without tools ("connection lost during version
    negotiation"). Every one of 300 simultaneous clients gets through."""
    done: list[int] = []

    async def one(i: int) -> None:
        async with Client.connect_unix(served.path) as cl:
            root = await cl.attach(f"u{i}", "")
            done.append(root)

    async with trio.open_nursery() as n:
        for i in range(300):
            n.start_soon(one, i)
    assert len(done) == 300
