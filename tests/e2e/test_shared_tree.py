"""A tree shared with other machines over 9P: read-only exports (``--9p ADDR,ro``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from msgspec.structs import replace

from ninep import NinePError
from ninep.client import Client, ConnectionLost
from ninep.codec import NOCHANGE, ORDWR, OREAD, OTRUNC, OWRITE
from olliefs.fs import tls9p
from olliefs.fs.export9p import EROFS, AddressError, parse_address
from tests.conftest import Daemon, script
from tests.e2e.test_export9p import exported, follow
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
    with trio.fail_after(30):
        for _ in range(2):  # the first meeting pins it, the second checks the pin
            async with Client.connect(await tls9p.connect("127.0.0.1", port, known)) as c:
                root = await c.attach("me")
                assert b"openai" in await c.read_all(root, "backends")
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
