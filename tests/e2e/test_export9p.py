"""The 9P re-export (``ollie mount --9p``): the tree of the FUSE mount, served over 9P2000.

Two clients talk to a real daemon (FUSE mounted at the same time): ``py9p``, a
third-party client with plan9port's codec that nobody here wrote, in a thread; and the
project's own trio client (``ninep.client``). What one frontend writes the other reads.

A blocked read is known to be blocked in the daemon without sleeping: the read's frame
is out (the client task is blocked: ``wait_all_tasks_blocked``), then one more round trip
on the same connection comes back; the daemon started the read's task before that
request's, and a read runs to its wait with no checkpoint. Blocked 9P reads are counted
by the daemon (bounded by ``OLLIE_MAX_WAITERS``), so "too many blocked readers" tells
how many there are, and the daemon logs its connection counters as each client leaves.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import py9p
import pytest
import trio
import trio.testing
from msgspec.structs import replace

from ninep.client import Client, ConnectionLost, split_path
from ninep.codec import DMDIR, NOCHANGE, ORDWR, OREAD, OWRITE, NinePError
from olliefs.testing import Daemon, deadline, expect_log
from tests.conftest import script

LEFT_CLEAN = (
    "9P client left: 0 connections, 0 fids, 0 requests in flight, 0 handles open, 0 blocked reads"
)


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """A short directory for unix sockets (a pytest tmp_path can pass the 108-byte limit)."""
    d = Path(tempfile.mkdtemp(prefix="o9p-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def exported(make: Callable[..., Daemon], *args: str, **env: str) -> Daemon:
    if "--9p-key-file" not in args and any(a.startswith("tcp:") for a in args):
        # The daemon warns that every local user can use a TCP export without a key.
        expect_log(r"export9p: 9P export on tcp:\S+ has no key: every local user", count=None)
    d = make(**env)
    d.mount_args = list(args)
    d.start()
    return d


def tcp_port(d: Daemon) -> int:
    """The port the daemon logged (it was asked for port 0: no race for a free one)."""
    m = re.search(r"9P export listening on tcp:127\.0\.0\.1:(\d+)", d.stderr())
    assert m, d.stderr()
    return int(m.group(1))


def wait_left_clean(d: Daemon) -> None:
    """Until the daemon says its last 9P client left and nothing of it is held."""
    d.wait_for(lambda: LEFT_CLEAN in d.stderr())


# ---- py9p (a synchronous client, run in a thread) ------------------------------------------


def py9p_read_all(cl: py9p.Client, fid: int, iounit: int) -> bytes:
    out = b""
    while True:
        data = cl.read(fid, iounit, len(out))
        if not data:
            return out
        out += data


def py9p_listing(cl: py9p.Client, fid: int) -> list[str]:
    buf = py9p_read_all(cl, fid, 8000)
    names, pos = [], 0
    while pos < len(buf):
        (n,) = struct.unpack_from("<H", buf, pos)
        names.append(py9p.decode_dir(buf[pos : pos + 2 + n]).name)
        pos += 2 + n
    return names


def py9p_session(path: str, work: str) -> dict[str, Any]:
    """What a user does: create a session, prompt it, follow its stream, read chat."""
    got: dict[str, Any] = {}
    with py9p.Client.connect_unix(path) as cl:
        cl.negotiate()
        cl.attach(0, uname="someone", aname="")
        cl.walk(0, 1, "s/new")
        cl.open(1, py9p.ORDWR)
        cl.write(1, f"cwd={work} name=viapy9p".encode(), 0)
        got["id"] = cl.read(1, 100, 0).decode().strip()
        cl.clunk(1)
        sid = got["id"]
        cl.walk(0, 2, f"s/{sid}/prompt")
        cl.open(2, py9p.OWRITE)
        cl.write(2, b"hello over 9P", 0)
        cl.clunk(2)  # close(2): the prompt is submitted here
        cl.walk(0, 3, f"s/{sid}/stream")
        _, iounit = cl.open(3)
        seen = b""
        while b"assistant: echo: hello over 9P\n" not in seen:
            chunk = cl.read(3, iounit, len(seen))
            assert chunk, seen
            seen += chunk
        cl.clunk(3)
        cl.walk(0, 4, f"s/{sid}/chat")
        _, iounit = cl.open(4)
        got["chat"] = py9p_read_all(cl, 4, iounit)
        got["stat"] = cl.stat(4)
        cl.clunk(4)
        cl.walk(0, 5, "s")
        cl.open(5)
        got["s"] = py9p_listing(cl, 5)
        cl.clunk(5)
        # a refused write: the Rerror carries the reason
        cl.walk(0, 6, "s/new")
        cl.open(6, py9p.OWRITE)
        try:
            cl.write(6, b"cwd=/no/such/dir", 0)
        except py9p.RemoteError as err:
            got["refused"] = str(err)
        cl.clunk(6)
        cl.walk(0, 7, f"s/{sid}/ctl")
        try:
            cl.open(7, py9p.OREAD)  # write-only: refused as on FUSE for its owner
        except py9p.RemoteError as err:
            got["ctl_read"] = str(err)
        cl.clunk(7)
        cl.clunk(0)
    return got


async def test_py9p_creates_prompts_and_reads_what_fuse_shows(
    daemon_factory: Callable[..., Daemon], sockdir: Path
) -> None:
    sock = sockdir / "9p"
    d = exported(daemon_factory, "--9p", f"unix:{sock}")
    assert os.stat(sock).st_mode & 0o777 == 0o600
    with deadline(30):
        got = await trio.to_thread.run_sync(py9p_session, str(sock), str(d.work))
    sid = got["id"]
    assert sid == "viapy9p"
    # the same state through FUSE
    assert d.read(f"s/{sid}/chat").encode() == got["chat"]
    assert b"user: hello over 9P\n" in got["chat"]
    assert got["stat"].name == "chat" and got["stat"].length == len(got["chat"])
    assert got["s"] == sorted(os.listdir(d.p("s")))
    # the reason, as FUSE's writer finds it in err
    assert got["refused"] and got["refused"] in d.read("err")
    assert "cwd" in got["refused"]
    assert got["ctl_read"] == "permission denied"
    wait_left_clean(d)


def py9p_follow(path: str, sid: str, until: bytes) -> bytes:
    with py9p.Client.connect_unix(path) as cl:
        cl.negotiate()
        cl.attach(0, uname="someone", aname="")
        cl.walk(0, 1, f"s/{sid}/stream")
        _, iounit = cl.open(1)
        seen = b""
        while until not in seen:
            chunk = cl.read(1, iounit, len(seen))
            assert chunk, seen
            seen += chunk
        cl.clunk(1)
        cl.clunk(0)
    return seen


# ---- the project's own client ---------------------------------------------------------------


async def read_file(c: Client, root: int, path: str) -> bytes:
    return await c.read_all(root, path)


async def new_session(c: Client, root: int, text: str) -> str:
    fid = await c.walk(root, split_path("s/new"))
    try:
        await c.open(fid, ORDWR)
        await c.write(fid, 0, text.encode())
        return (await c.read(fid, 0, 100)).decode().strip()
    finally:
        await c.clunk(fid)


async def write_file(c: Client, root: int, path: str, data: bytes) -> None:
    fid = await c.walk(root, split_path(path))
    try:
        await c.open(fid, OWRITE)
        await c.write(fid, 0, data)
    finally:
        await c.clunk(fid)


async def follow(c: Client, root: int, path: str, until: bytes) -> bytes:
    """Read a blocking file from its start until ``until`` is in it."""
    fid = await c.walk(root, split_path(path))
    try:
        await c.open(fid, OREAD)
        seen = b""
        while until not in seen:
            chunk = await c.read(fid, len(seen), c.iounit)
            assert chunk, seen
            seen += chunk
        return seen
    finally:
        await c.clunk(fid)


async def test_three_followers_of_one_stream_get_every_byte(
    daemon_factory: Callable[..., Daemon], sockdir: Path
) -> None:
    sock = str(sockdir / "9p")
    d = exported(daemon_factory, "--9p", f"unix:{sock}")
    d.replay.add(script('{"reply": "a slow answer in small pieces", "chunk": 3, "delay": 0.01}'))
    end = b"assistant: a slow answer in small pieces\n"
    with trio.fail_after(30):
        async with Client.connect_unix(sock) as a, Client.connect_unix(sock) as b:
            ra, rb = await a.attach("me"), await b.attach("me")
            sid = await new_session(a, ra, f"cwd={d.work}")
            got: dict[str, bytes] = {}

            async def follower(name: str, c: Client, root: int) -> None:
                got[name] = await follow(c, root, f"s/{sid}/stream", end)

            async def py9p_follower() -> None:
                got["py9p"] = await trio.to_thread.run_sync(py9p_follow, sock, sid, end)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(follower, "a", a, ra)
                nursery.start_soon(follower, "b", b, rb)
                nursery.start_soon(py9p_follower)
                await write_file(b, rb, f"s/{sid}/prompt", b"go")
            # all saw the very bytes that chat holds, over 9P and through FUSE
            chat = await read_file(a, ra, f"s/{sid}/chat")
            assert got["a"] == got["b"] == got["py9p"] == chat
            assert d.read(f"s/{sid}/chat").encode() == chat
            # FUSE writes, 9P reads: a session made through the mount is listed
            other = d.new(name="fromfuse")
            names = [st.name for st in await a.listdir(ra, "s")]
            assert other in names
            # ...and removed through 9P, gone from the mount
            fid = await a.walk(ra, split_path(f"s/{other}"))
            await a.remove(fid)
            d.wait_for(lambda: not d.p(f"s/{other}").exists())
            # mv s/ID s/moved: a Twstat of the name
            fid = await a.walk(ra, split_path(f"s/{sid}"))
            await a.wstat(fid, replace(NOCHANGE, name="moved"))
            await a.clunk(fid)
            assert "moved" in os.listdir(d.p("s")) and sid not in os.listdir(d.p("s"))
            # The kernel's cached lookups of a name changed over 9P are dropped (at
            # once, asynchronously: waited for rather than assumed).
            # files on disk: create, truncate, rename, mkdir, remove
            fid = await a.walk(ra, ["tmp"])
            await a.create(fid, "note", 0o644, OWRITE)
            await a.write(fid, 0, b"hello\n")
            await a.clunk(fid)
            assert d.p("tmp/note").read_bytes() == b"hello\n"
            fid = await a.walk(ra, ["tmp", "note"])
            await a.wstat(fid, replace(NOCHANGE, length=2))
            await a.wstat(fid, replace(NOCHANGE, name="renamed"))
            assert (await a.stat(fid)).name == "renamed"
            await a.clunk(fid)
            assert d.p("tmp/renamed").read_bytes() == b"he"
            d.wait_for(lambda: not d.p("tmp/note").exists())
            fid = await a.walk(ra, ["tmp"])
            await a.create(fid, "sub", DMDIR | 0o755, OREAD)
            await a.clunk(fid)
            assert d.p("tmp/sub").is_dir()
            for name in ("sub", "renamed"):
                await a.remove(await a.walk(ra, ["tmp", name]))
            assert os.listdir(d.p("tmp")) == []
            # a refused one: the root's files cannot be renamed
            fid = await a.walk(ra, ["help"])
            with pytest.raises(NinePError, match="cannot rename help"):
                await a.wstat(fid, replace(NOCHANGE, name="h"))
            await a.clunk(fid)
    wait_left_clean(d)


async def test_flush_ends_a_blocked_read_and_frees_its_count(
    daemon_factory: Callable[..., Daemon], sockdir: Path
) -> None:
    sock = str(sockdir / "9p")
    d = exported(daemon_factory, "--9p", f"unix:{sock}", OLLIE_MAX_WAITERS="2")
    with trio.fail_after(30):
        async with Client.connect_unix(sock) as c:
            root = await c.attach("me")
            sid = await new_session(c, root, f"cwd={d.work}")

            async def blocked_reads(paths: list[str]) -> list[trio.CancelScope]:
                """Start a read of each path that blocks in the daemon."""
                scopes = []
                for path in paths:
                    fid = await c.walk(root, split_path(path))
                    await c.open(fid, OREAD)
                    # statewait answers once; the logs block at their end
                    at = 0 if path.endswith("statewait") else len(await c.read(fid, 0, 1 << 16))
                    scope = trio.CancelScope()
                    scopes.append(scope)

                    async def reader(
                        fid: int = fid, at: int = at, scope: trio.CancelScope = scope, p: str = path
                    ) -> None:
                        with scope:
                            await c.read(fid, at, 100)
                            raise AssertionError(f"a read of {p} returned")
                        c.clunk_nowait(fid)

                    nursery.start_soon(reader)
                await trio.testing.wait_all_tasks_blocked()  # every Tread is out
                await c.stat(root)  # ...and served up to its wait
                return scopes

            async def third_is_refused() -> None:
                fid = await c.walk(root, split_path(f"s/{sid}/statewait"))
                await c.open(fid, OREAD)
                with pytest.raises(NinePError, match="too many blocked readers"):
                    await c.read(fid, 0, 100)
                await c.clunk(fid)

            async with trio.open_nursery() as nursery:
                scopes = await blocked_reads(["events", f"s/{sid}/stream"])
                await third_is_refused()  # two are blocked in the daemon
                for scope in scopes:
                    scope.cancel()  # the client sends Tflush and waits for Rflush
            # Flushed: the connection goes on, and the daemon counts no blocked read.
            async with trio.open_nursery() as nursery:
                scopes = await blocked_reads([f"s/{sid}/statewait", f"s/{sid}/events"])
                await third_is_refused()
                for scope in scopes:
                    scope.cancel()
            # a flushed read left nothing behind: the stream still serves every byte
            async with trio.open_nursery() as nursery:
                end = b"assistant: echo: after the flushes\n"
                nursery.start_soon(write_file, c, root, f"s/{sid}/prompt", b"after the flushes")
                seen = await follow(c, root, f"s/{sid}/stream", end)
            assert seen == d.read(f"s/{sid}/chat").encode()
    wait_left_clean(d)
    d.stop()
    assert not os.path.exists(sock)  # the socket file goes with the daemon


# ---- TCP, remote, keys ---------------------------------------------------------------------


def ollie_mount(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "olliefs", "mount", "-f", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def mnt(tmp_path: Path) -> Iterator[Path]:
    """A mount point that is unmounted after the test, should a refusal fail to refuse."""
    m = tmp_path / "mnt"
    m.mkdir()
    yield m
    subprocess.run(["fusermount3", "-uz", str(m)], capture_output=True, check=False)


def test_tcp_off_loopback_needs_the_flag_and_a_key(tmp_path: Path, mnt: Path) -> None:
    env = {**os.environ, "OLLIE_HOME": str(tmp_path / "home")}
    key = tmp_path / "key"
    key.write_text(secrets.token_hex(16) + "\n")
    key.chmod(0o600)
    r = ollie_mount("--9p", "tcp:0.0.0.0:0", str(mnt), env=env)
    assert r.returncode == 1
    assert "not loopback" in r.stderr and "--9p-allow-remote" in r.stderr
    r = ollie_mount("--9p", "tcp:0.0.0.0:0", "--9p-allow-remote", str(mnt), env=env)
    assert r.returncode == 1 and "needs --9p-key-file" in r.stderr
    key.chmod(0o644)
    r = ollie_mount(
        "--9p", "tcp:0.0.0.0:0", "--9p-allow-remote", "--9p-key-file", str(key), str(mnt), env=env
    )
    assert r.returncode == 1 and "readable by others" in r.stderr
    r = ollie_mount("--9p", "udp:1.2.3.4:5", str(mnt), env=env)
    assert r.returncode == 1 and "unix:PATH or tcp:HOST:PORT" in r.stderr
    # found only by the daemon (binding): one line all the same, nothing left mounted
    r = ollie_mount("--9p", f"unix:{tmp_path}/no/such/dir/sock", str(mnt), env=env)
    assert r.returncode == 1 and "9P socket" in r.stderr and "Traceback" not in r.stderr
    assert not os.listdir(mnt)  # nothing was mounted


def py9p_tcp(port: int, key: str) -> dict[str, Any]:
    got: dict[str, Any] = {}
    with py9p.Client.connect_tcp("127.0.0.1", port) as cl:
        cl.negotiate()
        for n, aname in enumerate(("", "wrong" + key, key[:-1])):
            try:
                cl.attach(n, uname="someone", aname=aname)
            except py9p.RemoteError as err:
                got.setdefault("refused", []).append(str(err))
        cl.attach(9, uname="someone", aname=key)
        cl.walk(9, 10, "help")
        _, iounit = cl.open(10)
        got["help"] = py9p_read_all(cl, 10, iounit)
        cl.clunk(10)
        cl.clunk(9)
    return got


async def make_profile(c: Client, root: int, name: str) -> None:
    fid = await c.walk(root, ["a"])
    try:
        await c.create(fid, f"{name}.json", 0o644, OWRITE)
        await c.write(fid, 0, b'{"prompt": "be brief"}')
    finally:
        await c.clunk(fid)


async def test_tcp_export_checks_the_key(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    key = secrets.token_hex(16)
    kf = tmp_path / "key"
    kf.write_text(key + "\n")
    kf.chmod(0o600)
    # Off loopback (all addresses), allowed explicitly, with a key; reached on loopback.
    d = exported(
        daemon_factory,
        "--9p",
        "tcp:0.0.0.0:0",
        "--9p-allow-remote",
        "--9p-key-file",
        str(kf),
    )
    m = re.search(r"9P export listening on tcp:0\.0\.0\.0:(\d+)", d.stderr())
    assert m, d.stderr()
    with deadline(30):
        got = await trio.to_thread.run_sync(py9p_tcp, int(m.group(1)), key)
    assert got["refused"] == ["authentication failed"] * 3
    assert got["help"].decode() == d.read("help")
    # the project's client over TCP too, wrong key first
    stream = await trio.open_tcp_stream("127.0.0.1", int(m.group(1)))
    with trio.fail_after(30):
        async with Client.connect(stream) as c:
            with pytest.raises(NinePError, match="authentication failed"):
                await c.attach("me", "nope")
            root = await c.attach("me", key)
            assert {st.name for st in await c.listdir(root)} == set(os.listdir(d.path))
            # A keyed client is the user: it may write an agent profile.
            await make_profile(c, root, "bykey")
    assert (d.path / "a" / "bykey.json").exists()
    wait_left_clean(d)


async def test_loopback_tcp_needs_no_flag(daemon_factory: Callable[..., Daemon]) -> None:
    d = exported(daemon_factory, "--9p", "tcp:127.0.0.1:0")
    port = tcp_port(d)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    with trio.fail_after(30):
        async with Client.connect(stream) as c:
            root = await c.attach("me")
            # Without a key a TCP client may be a tool with network: no agent profiles.
            with pytest.raises(NinePError, match="without a key"):
                await make_profile(c, root, "bytcp")
            assert not (d.path / "a" / "bytcp.json").exists()
            assert "without a key" in d.read("err")
            # Nor a session's cwd: it could be a tool naming a directory it may not write.
            with pytest.raises(NinePError, match="without a key has no write roots"):
                await new_session(c, root, f"cwd={d.work} name=overtcp")
            assert "overtcp" not in os.listdir(d.path / "s")
            # The daemon stops while a 9P read is blocked: the read ends (EOF, or the
            # connection goes), and the daemon logs no error (checked at teardown).
            fid = await c.walk(root, ["events"])
            await c.open(fid, OREAD)
            at = len(await c.read(fid, 0, 1 << 16))
            got: list[bytes | None] = []

            async def blocked() -> None:
                try:
                    got.append(await c.read(fid, at, 100))
                except ConnectionLost:
                    got.append(None)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(blocked)
                await trio.testing.wait_all_tasks_blocked()
                await c.stat(root)
                await trio.to_thread.run_sync(d.stop)
            assert got in ([b""], [None])
