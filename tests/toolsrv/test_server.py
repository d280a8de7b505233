"""The toolsrv tree over 9P: listing, metadata, the proc life cycle and bad requests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from ninep import NinePError
from ninep.codec import ORDWR, OREAD, OWRITE
from olliefs.testing import await_until
from olliefs.toolclient.client import ToolsrvConn
from tests.toolsrv.harness import ToolsrvProc, pid_exists, running_toolsrv, tool_env
from toolsrv.sandbox import landlock_abi


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[ToolsrvProc]:
    with running_toolsrv(tmp_path) as t:
        yield t


async def new_proc(conn: ToolsrvConn) -> str:
    c = conn.client
    fid = await c.walk(conn.root, ["proc", "new"])
    try:
        await c.open(fid, OREAD)
        return (await c.read(fid, 0, 64)).decode().strip()
    finally:
        await c.clunk(fid)


async def test_tree_and_metadata(srv: ToolsrvProc) -> None:
    async with srv.agent("a1") as conn:
        c = conn.client
        assert sorted(st.name for st in await c.listdir(conn.root, "")) == [
            "agent",
            "mcp",
            "proc",
            "tools",
        ]
        assert await conn.mcp_status() == ""  # no MCP server configured
        names = await conn.names()
        for n in ("client_9p", "execute_code", "file_read", "memory_recall", "subagent_spawn"):
            assert n in names
        meta, schema = await conn.meta("file_read")
        assert (meta.name, meta.tier, meta.parallel) == ("file_read", "cold", True)
        assert schema["type"] == "object" and "path" in schema["properties"]
        assert await conn.loaded() == []
        with pytest.raises(NinePError):
            await c.walk(conn.root, ["tools", "nope"])
        # Read-only and write-only files refuse the other direction.
        fid = await c.walk(conn.root, ["agent", "rev"])
        with pytest.raises(NinePError):
            await c.open(fid, OWRITE)
        await c.clunk(fid)
        fid = await c.walk(conn.root, ["agent", "ctl"])
        with pytest.raises(NinePError):
            await c.open(fid, OREAD)
        await c.clunk(fid)


async def test_proc_life_cycle(srv: ToolsrvProc, tmp_path: Path) -> None:
    work = tmp_path / "w"
    work.mkdir()
    async with srv.agent("a1", "reasoning_think") as conn:
        c, root = conn.client, conn.root
        n1, n2 = await new_proc(conn), await new_proc(conn)
        assert int(n2) == int(n1) + 1
        procs = {st.name for st in await c.listdir(root, "proc")}
        assert {"new", n1, n2} <= procs
        for bad in (
            b"{not json",
            b'{"tool": "reasoning_think", "bogus": 1}',
            b'{"tool": "execute_code", "cwd": "/"}',
            b'{"tool": "reasoning_think", "cwd": "relative"}',
            b'{"tool": "reasoning_think", "cwd": "/nonexistent-dir"}',
        ):
            with pytest.raises(NinePError):
                await c.write_all(root, f"proc/{n1}/call", bad)
        call = {"tool": "reasoning_think", "args": {"thought": "hm"}, "cwd": str(work)}
        await c.write_all(root, f"proc/{n1}/call", json.dumps(call).encode())
        with pytest.raises(NinePError, match="already started"):
            await c.write_all(root, f"proc/{n1}/call", json.dumps(call).encode())
        with pytest.raises(NinePError, match="unknown command"):
            await c.write_all(root, f"proc/{n1}/ctl", b"explode")
        result = json.loads(await c.read_all(root, f"proc/{n1}/result"))
        if landlock_abi():
            assert result == {"content": [{"type": "text", "text": "ok"}], "isError": False}
        # Read to the end and clunked: proc/N is gone. Removing proc/N2 removes it.
        assert n1 not in {st.name for st in await c.listdir(root, "proc")}
        fid = await c.walk(root, ["proc", n2])
        await c.remove(fid)
        assert {st.name for st in await c.listdir(root, "proc")} == {"new", "rpc"}


async def test_call_errors_come_back_as_results(srv: ToolsrvProc, tmp_path: Path) -> None:
    work = tmp_path / "w"
    work.mkdir()
    async with srv.agent("a1", "subagent_spawn", "file_read") as conn:
        res = await conn.call("subagent_spawn", {"name": "x", "prompt": "y"}, str(work), {})
        assert res.isError and "the ollie tree is not mounted here" in res.text
        res = await conn.call("file_read", {"path": "missing.txt"}, str(work), tool_env(work))
        assert res.isError and "missing.txt" in res.text


async def test_result_read_before_the_call_waits_for_it(srv: ToolsrvProc, tmp_path: Path) -> None:
    work = tmp_path / "w"
    work.mkdir()
    async with srv.agent("a1", "reasoning_think") as conn:
        c, root = conn.client, conn.root
        n = await new_proc(conn)
        got: list[bytes] = []
        async with trio.open_nursery() as nursery:

            async def reader() -> None:
                got.append(await c.read_all(root, f"proc/{n}/result"))

            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []  # waiting, not an error
            call = {"tool": "reasoning_think", "args": {"thought": "hm"}, "cwd": str(work)}
            await c.write_all(root, f"proc/{n}/call", json.dumps(call).encode())
        if landlock_abi():
            ok = {"content": [{"type": "text", "text": "ok"}], "isError": False}
            assert json.loads(got[0]) == ok
        # Killing a proc nobody started answers a waiting reader too.
        n2 = await new_proc(conn)
        async with trio.open_nursery() as nursery:
            got.clear()

            async def reader2() -> None:
                got.append(await c.read_all(root, f"proc/{n2}/result"))

            nursery.start_soon(reader2)
            await trio.testing.wait_all_tasks_blocked()
            await c.write_all(root, f"proc/{n2}/ctl", b"kill")
        result = json.loads(got[0])
        assert result["isError"] and "before it started" in result["content"][0]["text"]


async def test_warm_fids_serve_the_next_calls(srv: ToolsrvProc, tmp_path: Path) -> None:
    work = tmp_path / "w"
    work.mkdir()
    async with srv.agent("a1", "reasoning_think") as conn:
        await conn.warm(3)
        assert conn.idle == 3
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(
                    conn.call, "reasoning_think", {"thought": "x"}, str(work), tool_env(work)
                )
        # The three calls ran side by side on the three fids opened ahead, and left
        # them for the next calls; no proc/N was made for them.
        assert conn.idle == 3
        names = {st.name for st in await conn.client.listdir(conn.root, "proc")}
        assert names == {"new", "rpc"}


async def rpc_fid(conn: ToolsrvConn) -> int:
    fid = await conn.client.walk(conn.root, ["proc", "rpc"])
    await conn.client.open(fid, ORDWR)
    return fid


async def test_rpc_calls_one_after_another_on_one_fid(srv: ToolsrvProc, tmp_path: Path) -> None:
    work = tmp_path / "w"
    work.mkdir()
    async with srv.agent("a1", "reasoning_think", "file_read") as conn:
        c = conn.client
        fid = await rpc_fid(conn)
        with pytest.raises(NinePError, match="no call written"):
            await c.read(fid, 0, 100)
        (work / "f").write_text("line one\n")
        for thought in ("a", "b"):
            call = {"tool": "reasoning_think", "args": {"thought": thought}, "cwd": str(work)}
            got = json.loads(await c.transact(fid, json.dumps(call).encode()))
            assert got["isError"] is False
            # The result stays readable, at any offset, until the next call is written.
            again = await c.read(fid, 2, 100)
            assert again == json.dumps(got, separators=(",", ":")).encode()[2:]
        call = {"tool": "file_read", "args": {"path": "f"}, "cwd": str(work)}
        got = json.loads(await c.transact(fid, json.dumps(call).encode()))
        if landlock_abi():
            assert "line one" in got["content"][0]["text"]
        # A refused call is the read's error; the fid serves the next call all the same.
        for bad, why in (
            (b"{not json", "bad call"),
            (b'{"tool": "execute_code", "cwd": "/"}', "not loaded"),
            (b'{"tool": "file_read", "cwd": "relative"}', "absolute directory"),
        ):
            with pytest.raises(NinePError, match=why):
                await c.transact(fid, bad)
        with pytest.raises(NinePError, match="offset 7"):
            await c.write(fid, 7, b"{}")
        got = json.loads(await c.transact(fid, json.dumps(call).encode()))
        assert got["isError"] is not True or not landlock_abi()
        names = {st.name for st in await c.listdir(conn.root, "proc")}
        assert names == {"new", "rpc"}  # no proc/N for these


async def test_rpc_call_larger_than_a_message(srv: ToolsrvProc, tmp_path: Path) -> None:
    """A call (its args) and a result longer than one 9P message each go in pieces."""
    work = tmp_path / "w"
    work.mkdir()
    text = "".join(f"{i:07d} the quick brown fox\n" for i in range(20_000))  # ~600 KB
    async with srv.agent("a1", "file_write", "file_read") as conn:
        assert len(text) > 4 * conn.client.iounit
        env = tool_env(work)
        res = await conn.call("file_write", {"path": "big.txt", "content": text}, str(work), env)
        if not landlock_abi():
            return
        assert not res.isError, res.text
        assert (work / "big.txt").read_text() == text
        res = await conn.call("file_read", {"path": "big.txt", "limit": 20_000}, str(work), env)
        assert not res.isError and "0019999 the quick brown fox" in res.text
        assert len(res.text) > 4 * conn.client.iounit


async def test_a_background_child_neither_holds_the_call_nor_outlives_it(
    srv: ToolsrvProc, tmp_path: Path
) -> None:
    """execute_code of ``sleep 1000 &``: the call ends when the program exits, with what it
    printed, and the background child, which kept its output pipe open, dies with it."""
    work = tmp_path / "w"
    work.mkdir()
    async with srv.agent("a1", "execute_code") as conn:
        with trio.fail_after(30):  # (the tool's own timeout is 120 s)
            res = await conn.call(
                "execute_code", {"code": "sleep 1000 & echo $!; echo hi"}, str(work), tool_env(work)
            )
    assert not res.isError, res.text
    pid, hi, note = res.text.splitlines()
    assert hi == "hi" and note.startswith("[background processes were still running"), res.text
    await await_until(lambda: not pid_exists(int(pid)), f"{pid} gone", 10, reaps=[int(pid)])


ECHO_TOOL = """#!/usr/bin/env python3
# ollie-tool
# description: answers with its args, cwd and session, exits with args' code (test)
# args: {"type": "object", "properties": {"n": {"type": "integer"}}}
# parallel: true
import json, os, sys
args = json.load(sys.stdin)
print(json.dumps([args, os.getcwd(), os.environ.get("OLLIE_SESSION_ID")]))
sys.exit(args["n"] % 3)
"""


@pytest.fixture
def echo_srv(tmp_path: Path) -> Iterator[ToolsrvProc]:
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "echo").write_text(ECHO_TOOL)
    (tools / "echo").chmod(0o755)
    with running_toolsrv(tmp_path, tools_dirs=(tools,)) as t:
        yield t


async def test_call_is_two_messages_in_one_send(echo_srv: ToolsrvProc, tmp_path: Path) -> None:
    """The daemon's call, on a fid kept from the call before: its write and its read,
    sent together (one round trip), and nothing else: no walk, open nor clunk."""
    work = tmp_path / "w"
    work.mkdir()
    async with echo_srv.agent("a1", "echo") as conn:
        c = conn.client
        await conn.warm(1)
        requests, sends = c.requests, c.sends
        for n in range(5):
            res = await conn.call("echo", {"n": 3 * n}, str(work), tool_env(work))
            assert not res.isError, res
        assert (c.requests - requests, c.sends - sends) == (10, 5)
        assert conn.idle == 1


async def test_concurrent_calls_each_get_their_own_answer(
    echo_srv: ToolsrvProc, tmp_path: Path
) -> None:
    """Twenty calls at once, each with its own args, cwd, session and exit status: each
    answer is its own call's, though the fids are kept and reused between them."""
    dirs = [tmp_path / f"w{i}" for i in range(4)]
    for d in dirs:
        d.mkdir()
    got: dict[int, tuple[bool, list[object]]] = {}
    async with echo_srv.agent("a1", "echo") as conn:

        async def one(n: int) -> None:
            d = dirs[n % 4]
            res = await conn.call("echo", {"n": n}, str(d), tool_env(d, f"s{n}"))
            text = res.content[0].text
            got[n] = (bool(res.isError), json.loads(text.splitlines()[0]))

        for _ in range(2):  # the second round on the fids the first one left
            got.clear()
            async with trio.open_nursery() as nursery:
                for n in range(20):
                    nursery.start_soon(one, n)
            for n in range(20):
                assert got[n] == (n % 3 != 0, [{"n": n}, str(dirs[n % 4]), f"s{n}"])
