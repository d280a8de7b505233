"""A tree shared with other machines over 9P: read-only exports (``--9p ADDR,ro``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
from msgspec.structs import replace

from ninep import NinePError
from ninep.client import Client
from ninep.codec import NOCHANGE, ORDWR, OREAD, OTRUNC, OWRITE
from olliefs.fs.export9p import EROFS, AddressError, parse_address
from tests.conftest import Daemon, script
from tests.e2e.test_export9p import exported, follow
from tests.e2e.test_tools import reply


def test_ro_is_an_option_of_every_address() -> None:
    assert str(parse_address("tcp:127.0.0.1:0,ro")) == "tcp:127.0.0.1:0,ro"
    assert parse_address("unix:/tmp/x,ro").ro and not parse_address("unix:/tmp/x").ro
    with pytest.raises(AddressError, match="tcp:HOST:PORT"):
        parse_address("tcp:127.0.0.1:x,ro")


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
