"""A tree shared with other machines over 9P: read-only exports (``--9p ADDR,ro``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import py9p
import pytest
import trio
from msgspec.structs import replace

from ninep import NinePError
from ninep.client import Client, ConnectionLost
from ninep.codec import NOCHANGE, ORDWR, OREAD, OTRUNC, OWRITE
from olliefs.fs import tls9p
from olliefs.fs.export9p import EROFS, AddressError, parse_address
from olliefs.testing import wait_until
from tests.conftest import Daemon, script
from tests.e2e.test_export9p import exported, follow, write_file
from tests.e2e.test_tools import reply


def test_ro_is_an_option_of_every_address() -> None:
    assert str(parse_address("tcp:127.0.0.1:0,ro")) == "tcp:127.0.0.1:0,ro"
    assert parse_address("unix:/tmp/x,ro").ro and not parse_address("unix:/tmp/x").ro
    assert str(parse_address("tcp:[::1]:5,tls,ro")) == "tcp:[::1]:5,ro,tls"
    with pytest.raises(AddressError, match="tcp:HOST:PORT"):
        parse_address("tcp:127.0.0.1:x,ro")
    with pytest.raises(AddressError, match="tls goes with tcp"):
        parse_address("unix:/tmp/x,tls")


async def test_a_read_only_export_reads_and_follows_and_refuses_every_change(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = exported(daemon_factory, "--9p", "tcp:127.0.0.1:0,ro")
    port = int(d.stderr().split("9P export listening on tcp:127.0.0.1:")[1].split(",")[0])
    d.replay.add(script(reply("hello from the agent")))
    # The daemon is another process: waiting on it here blocks nothing it needs.
    sid = d.new(name="t")
    d.prompt(sid, "hi")
    d.wait_idle(sid)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    with trio.fail_after(30):
        async with Client.connect(stream) as c:
            root = await c.attach("me")
            assert b"hello from the agent" in await c.read_all(root, f"s/{sid}/chat")
            assert b"hello from the agent" in await follow(
                c, root, f"s/{sid}/stream", b"hello from the agent"
            )
            for path, mode in (
                (f"s/{sid}/prompt", OWRITE),
                (f"s/{sid}/cfg", ORDWR),
                (f"s/{sid}/plan", OREAD | OTRUNC),
            ):
                fid = await c.walk(root, path.split("/"))
                with pytest.raises(NinePError, match=EROFS):
                    await c.open(fid, mode)
                await c.clunk(fid)
            with pytest.raises(NinePError, match=EROFS):
                await c.create(await c.walk(root, ["tmp"]), "new", 0o644, OWRITE)
            with pytest.raises(NinePError, match=EROFS):
                await c.remove(await c.walk(root, ["s", sid]))
            fid = await c.walk(root, ["s", sid])
            with pytest.raises(NinePError, match=EROFS):
                await c.wstat(fid, replace(NOCHANGE, name="renamed"))
            await c.wstat(fid, NOCHANGE)  # Plan 9's fsync: nothing changes, so allowed
    assert d.read(f"s/{sid}/chat").count("user:") == 1
    assert (d.path / "s" / sid).exists()
    d.stop()


async def test_a_tls_export_is_pinned_by_its_client_like_ssh_known_hosts(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    d = exported(daemon_factory, "--9p", "tcp:127.0.0.1:0,tls")
    port = int(d.stderr().split("9P export listening on tcp:127.0.0.1:")[1].split(",")[0])
    cert = d.home / "config" / "9p-tls" / "cert.pem"
    assert cert.exists() and (cert.parent / "key.pem").stat().st_mode & 0o077 == 0
    assert f"TLS certificate {tls9p.fingerprint_of(cert)}" in d.stderr()
    known = tmp_path / "known_9p"
    d.replay.add(script(reply("over TLS")))
    sid = d.new(name="t")
    with trio.fail_after(30):
        for _ in range(2):  # the first meeting pins it, the second checks the pin
            async with Client.connect(await tls9p.connect("127.0.0.1", port, known)) as c:
                root = await c.attach("me")
                assert b"openai" in await c.read_all(root, "backends")
        # A prompt written and the stream followed over TLS, as a shell there would.
        async with Client.connect(await tls9p.connect("127.0.0.1", port, known)) as c:
            root = await c.attach("me")
            await write_file(c, root, f"s/{sid}/prompt", b"hi")
            assert b"assistant: over TLS" in await follow(
                c, root, f"s/{sid}/stream", b"assistant: over TLS"
            )
        assert known.read_text() == f"127.0.0.1:{port} {tls9p.fingerprint_of(cert)}\n"
        # A plain 9P client gets nothing out of it: the daemon wants TLS first.
        plain = await trio.open_tcp_stream("127.0.0.1", port)
        with pytest.raises((ConnectionLost, trio.BrokenResourceError, NinePError)):
            async with Client.connect(plain) as c:
                await c.attach("me")
        known.write_text(f"127.0.0.1:{port} SHA256:somebodyelse\n")
        with pytest.raises(tls9p.TlsError, match="changed: it is SHA256:"):
            await tls9p.connect("127.0.0.1", port, known)
    d.stop()
    d.start()  # the certificate is kept: the pin holds across restarts
    assert f"TLS certificate {tls9p.fingerprint_of(cert)}" in d.stderr()
    d.stop()


# ---- existing clients -----------------------------------------------------------------


def py9p_reader(port: int, sid: str) -> dict[str, Any]:
    """python-9p on a read-only TCP export: what a shell on the other machine does."""
    got: dict[str, Any] = {}
    with py9p.Client.connect_tcp("127.0.0.1", port) as cl:
        cl.negotiate()
        cl.attach(0, uname="someone", aname="")
        cl.walk(0, 1, f"s/{sid}/stream")
        _, iounit = cl.open(1)
        seen = b""
        while b"hello from the agent" not in seen:
            chunk = cl.read(1, iounit, len(seen))
            assert chunk, seen
            seen += chunk
        got["stream"] = seen
        cl.clunk(1)
        cl.walk(0, 2, f"s/{sid}/prompt")
        try:
            cl.open(2, py9p.OWRITE)
        except py9p.RemoteError as err:
            got["refused"] = str(err)
        cl.clunk(2)
        cl.clunk(0)
    return got


async def test_python_9p_follows_a_read_only_export_and_is_refused_writes(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = exported(daemon_factory, "--9p", "tcp:127.0.0.1:0,ro")
    port = int(d.stderr().split("9P export listening on tcp:127.0.0.1:")[1].split(",")[0])
    d.replay.add(script(reply("hello from the agent")))
    sid = d.new(name="t")
    d.prompt(sid, "hi")
    d.wait_idle(sid)
    with trio.fail_after(30):
        got = await trio.to_thread.run_sync(py9p_reader, port, sid)
    assert got["stream"] == d.read(f"s/{sid}/chat").encode()
    assert got["refused"] == EROFS
    d.stop()


NO_V9FS = (
    "the kernel has no 9p filesystem: 9p is absent from /proc/filesystems "
    "and modprobe 9p failed (or there is no modprobe)"
)


def test_linux_v9fs_mounts_the_export(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """``mount -t 9p``: where the kernel has no 9p filesystem, skipped saying so."""
    if not _kernel_has_9p():
        pytest.skip(reason=NO_V9FS)
    if os.geteuid() != 0:
        pytest.skip(reason="mount -t 9p needs root")
    d = exported(daemon_factory, "--9p", "tcp:127.0.0.1:0")
    port = int(d.stderr().split("9P export listening on tcp:127.0.0.1:")[1].split(",")[0])
    mnt = tmp_path / "v9fs"
    mnt.mkdir()
    opts = f"trans=tcp,port={port},version=9p2000"
    subprocess.run(["mount", "-t", "9p", "-o", opts, "127.0.0.1", str(mnt)], check=True)
    try:
        assert (mnt / "backends").read_text() == d.read("backends")
        sid = d.new(name="t")
        d.replay.add(script(reply("over v9fs")))
        subprocess.run(["sh", "-c", f"echo hi > {mnt}/s/{sid}/prompt"], check=True)
        d.wait_idle(sid)
        assert "over v9fs" in (mnt / "s" / sid / "chat").read_text()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    d.stop()


def _kernel_has_9p() -> bool:
    def listed() -> bool:
        with open("/proc/filesystems") as f:
            return any(line.split()[-1:] == ["9p"] for line in f)

    if listed():
        return True
    modprobe = shutil.which("modprobe") or shutil.which("modprobe", path="/sbin:/usr/sbin")
    if modprobe is None:
        return False
    subprocess.run([modprobe, "9p"], capture_output=True, check=False)
    return listed()


def test_plan9port_9pfuse_mounts_the_export(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    """plan9port's 9pfuse, where it is installed (Debian has no package of it)."""
    nine = shutil.which("9pfuse")
    if nine is None:
        pytest.skip(reason="plan9port's 9pfuse is not installed")
    d = exported(daemon_factory, "--9p", "tcp:127.0.0.1:0")
    port = int(d.stderr().split("9P export listening on tcp:127.0.0.1:")[1].split(",")[0])
    mnt = tmp_path / "9pfuse"
    mnt.mkdir()
    subprocess.run([nine, f"tcp!127.0.0.1!{port}", str(mnt)], check=True)
    try:
        wait_until(lambda: os.path.ismount(mnt), "9pfuse mounted", timeout=30)
        assert (mnt / "backends").read_text() == d.read("backends")
    finally:
        subprocess.run(["fusermount3", "-uz", str(mnt)], check=False)
    d.stop()


async def test_ollie_status_lists_the_clients_of_each_export(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = exported(daemon_factory, "--9p", "tcp:127.0.0.1:0,ro")
    port = int(d.stderr().split("9P export listening on tcp:127.0.0.1:")[1].split(",")[0])

    def status() -> str:
        return subprocess.run(
            [sys.executable, "-m", "olliefs", "status"],
            env=d.env,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        ).stdout

    stream = await trio.open_tcp_stream("127.0.0.1", port)
    mine = stream.socket.getsockname()[1]
    with trio.fail_after(30):
        async with Client.connect(stream) as c:
            await c.attach("me")
            got = await trio.to_thread.run_sync(status)
            assert f"9P export on tcp:127.0.0.1:{port},ro\n" in got
            assert f"9P client 127.0.0.1:{mine} on tcp:127.0.0.1:{port},ro\n" in got
    peers = d.home / "run" / "9p-peers"
    await trio.to_thread.run_sync(
        lambda: wait_until(lambda: peers.read_text() == "", "client gone", files=[peers])
    )
    assert "9P client" not in await trio.to_thread.run_sync(status)
    d.stop()
