"""MCP servers as tools (toolsrv.mcp): real servers, spoken to by a real toolsrv.

The stdio servers are the reference ``mcp-server-time`` from PyPI, and a tiny server
written here with the SDK's own ``MCPServer`` for what a reference server will not do on
demand (crash during a call, hang, try to write or connect where it may not).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from olliefs.testing import await_until
from tests.toolsrv.harness import ToolsrvProc, running_toolsrv
from toolsrv.mcp import MAX_NAME, tool_name
from toolsrv.sandbox import landlock_abi

BIN = Path(sys.executable).parent
TIME = BIN / "mcp-server-time"

pytestmark = pytest.mark.skipif(not TIME.exists(), reason="mcp-server-time is not installed")

TINY = textwrap.dedent(
    """\
    import os, socket, sys, time
    from mcp.server.mcpserver import Context, MCPServer

    app = MCPServer("tiny")

    @app.tool()
    def echo(text: str) -> str:
        \"\"\"Say it back.\"\"\"
        return f"echo: {text} (pid {os.getpid()})"

    @app.tool()
    def crash() -> str:
        \"\"\"Die in the middle of the call.\"\"\"
        os._exit(3)

    @app.tool()
    def hang() -> str:
        \"\"\"Never answer.\"\"\"
        time.sleep(3600)
        return "never"

    @app.tool()
    def write(path: str) -> str:
        \"\"\"Write a file.\"\"\"
        with open(path, "w") as f:
            f.write("x")
        return "written"

    @app.tool()
    async def grow(ctx: Context) -> str:
        \"\"\"Offer one tool more, and say so.\"\"\"

        def extra() -> str:
            \"\"\"A tool that was not there at first.\"\"\"
            return "extra"

        app.add_tool(extra)
        await ctx.request_context.session.send_tool_list_changed()
        return "grown"

    @app.tool()
    def read(path: str) -> str:
        \"\"\"Read a file.\"\"\"
        with open(path) as f:
            return f.read()

    @app.tool()
    def connect(port: int) -> str:
        \"\"\"Open a TCP connection to the loopback.\"\"\"
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return "connected"

    app.run()
    """
)


def server_file(mcp_dir: Path, name: str, **cfg: object) -> Path:
    mcp_dir.mkdir(parents=True, exist_ok=True)
    path = mcp_dir / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


def tiny(tmp_path: Path, mcp_dir: Path, **extra: object) -> Path:
    script = tmp_path / "tiny.py"
    script.write_text(TINY)
    return server_file(mcp_dir, "tiny", command=sys.executable, args=[str(script)], **extra)


def mcp_args(tmp_path: Path) -> tuple[str, ...]:
    return ("--mcp-dir", str(tmp_path / "mcp"), "--mcp-cache", str(tmp_path / "cache"))


def processes_running(needle: str) -> list[int]:
    """Live processes whose command line holds ``needle`` (from /proc)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle.encode() in cmd and state != "Z":
            found.append(int(pid))
    return found


@pytest.fixture
def work(tmp_path: Path) -> Path:
    w = tmp_path / "w"
    w.mkdir()
    return w


async def listed(srv: ToolsrvProc, config: Path) -> set[str]:
    """The tool names once the server of ``config`` was listed as the file says now."""
    digest = hashlib.sha256(config.read_bytes()).hexdigest()
    cache = Path(srv.base).parent / "cache" / config.name
    cache.parent.mkdir(exist_ok=True)

    def done() -> bool:
        try:
            return bool(json.loads(cache.read_text())["config"] == digest)
        except (OSError, ValueError):
            return False

    async with srv.agent("lister") as conn:
        await conn.names()  # the first look finds the file, and lists what is new
        await await_until(done, f"{config.name} listed", 60, files=[cache])
        return set(await conn.names())


async def no_process(needle: str) -> None:
    pids = processes_running(needle)
    await await_until(lambda: not processes_running(needle), f"{needle} gone", exits=pids)


def test_tool_names_fit_every_provider() -> None:
    assert tool_name("time", "get_current_time") == "mcp_time_get_current_time"
    assert tool_name("my-srv", "Get.Thing") == "mcp_my_srv_get_thing"
    long = tool_name("s", "x" * 100)
    assert len(long) == MAX_NAME and long == tool_name("s", "x" * 100)
    assert tool_name("s", "get_time", {"mcp_s_get_time"}) != "mcp_s_get_time"


async def test_time_server_lists_from_its_cache_and_starts_only_at_a_call(
    tmp_path: Path, work: Path
) -> None:
    # A wrapper that counts its starts: the proof that nothing starts before a call.
    count = tmp_path / "count"
    count.mkdir()
    wrapper = tmp_path / "time.sh"
    wrapper.write_text(f'#!/bin/sh\necho start >> "{count}/starts"\nexec "{TIME}" "$@"\n')
    wrapper.chmod(0o755)
    config = server_file(tmp_path / "mcp", "time", command=str(wrapper), roots=[str(count)])
    starts = count / "starts"
    with running_toolsrv(tmp_path / "one", extra_args=mcp_args(tmp_path)) as srv:
        # Never listed: started once to list its tools, then stopped.
        names = await listed(srv, config)
        assert {"mcp_time_get_current_time", "mcp_time_convert_time"} <= names
        await no_process(str(TIME))
    assert starts.read_text().count("start") == 1
    with running_toolsrv(tmp_path / "two", extra_args=mcp_args(tmp_path)) as srv:
        async with srv.agent("a1", "mcp_time_get_current_time") as conn:
            assert "mcp_time_get_current_time" in await conn.names()
            meta, schema = await conn.meta("mcp_time_get_current_time")
            # readOnlyHint: parallel and cold.
            assert (meta.tier, meta.parallel) == ("cold", True)
            assert "timezone" in schema["properties"]
            # Listed from the cache: no process, no start.
            assert not processes_running(str(wrapper))
            assert starts.read_text().count("start") == 1
            res = await conn.call("mcp_time_get_current_time", {"timezone": "UTC"}, str(work), {})
            assert not res.isError, res.text
            assert json.loads(res.text)["timezone"] == "UTC"
            assert starts.read_text().count("start") == 2
            assert len(processes_running(str(TIME))) == 1  # one, kept for the next call
            res = await conn.call(
                "mcp_time_get_current_time", {"timezone": "Nowhere/Atlantis"}, str(work), {}
            )
            assert res.isError and "Atlantis" in res.text
            assert starts.read_text().count("start") == 2
    await no_process(str(TIME))


async def test_a_changed_file_is_listed_again_and_allow_tools_filters(
    tmp_path: Path,
) -> None:
    path = server_file(tmp_path / "mcp", "time", command=str(TIME))
    with running_toolsrv(tmp_path / "s", extra_args=mcp_args(tmp_path)) as srv:
        assert "mcp_time_convert_time" in await listed(srv, path)
        path.write_text(json.dumps({"command": str(TIME), "allowTools": ["get_current_time"]}))
        names = await listed(srv, path)
        assert "mcp_time_convert_time" not in names and "mcp_time_get_current_time" in names


async def test_a_server_that_dies_mid_call_gives_an_error_and_is_started_again(
    tmp_path: Path, work: Path
) -> None:
    config = tiny(tmp_path, tmp_path / "mcp")
    with running_toolsrv(tmp_path / "s", extra_args=mcp_args(tmp_path)) as srv:
        await listed(srv, config)
        async with srv.agent("a1", "mcp_tiny_crash", "mcp_tiny_echo") as conn:
            res = await conn.call("mcp_tiny_echo", {"text": "one"}, str(work), {})
            assert not res.isError and res.text.startswith("echo: one"), res.text
            first_pid = res.text.rsplit("pid ", 1)[1]
            res = await conn.call("mcp_tiny_crash", {}, str(work), {})
            assert res.isError
            assert "exited (exit status 3)" in res.text and "call was cut" in res.text
            res = await conn.call("mcp_tiny_echo", {"text": "two"}, str(work), {})
            assert not res.isError and res.text.startswith("echo: two"), res.text
            second_pid = res.text.rsplit("pid ", 1)[1]
            assert second_pid != first_pid
            # One process per server, shared by the agents.
            async with srv.agent("a2", "mcp_tiny_echo") as other:
                res = await other.call("mcp_tiny_echo", {"text": "three"}, str(work), {})
                assert res.text.rsplit("pid ", 1)[1] == second_pid, res.text
            # Arguments the server refuses are an error the model reads, too.
            res = await conn.call("mcp_tiny_echo", {"nope": 1}, str(work), {})
            assert res.isError and "text" in res.text


async def test_a_hanging_call_is_cut_by_its_timeout_and_by_kill(tmp_path: Path, work: Path) -> None:
    config = tiny(tmp_path, tmp_path / "mcp", timeout=2)
    with running_toolsrv(tmp_path / "s", extra_args=mcp_args(tmp_path)) as srv:
        await listed(srv, config)
        async with srv.agent("a1", "mcp_tiny_hang", "mcp_tiny_echo") as conn:
            res = await conn.call("mcp_tiny_hang", {}, str(work), {})
            assert res.isError and "timed out after 2s" in res.text
            # A stop: the pending result read is flushed, which kills the call.
            with trio.move_on_after(1) as cut:
                await conn.call("mcp_tiny_hang", {}, str(work), {})
            assert cut.cancelled_caught
            res = await conn.call("mcp_tiny_echo", {"text": "still here"}, str(work), {})
            assert not res.isError and "still here" in res.text, res.text


async def test_a_server_that_cannot_start_is_a_tool_error(tmp_path: Path, work: Path) -> None:
    script = tmp_path / "tiny.py"
    script.write_text(TINY)
    # Listed from a good file, then broken: the call reads why it cannot run.
    config = server_file(tmp_path / "mcp", "tiny", command=sys.executable, args=[str(script)])
    with running_toolsrv(tmp_path / "s", extra_args=mcp_args(tmp_path)) as srv:
        await listed(srv, config)
        async with srv.agent("a1", "mcp_tiny_echo") as conn:
            script.write_text("import sys\nprint('no config for you', file=sys.stderr)\n")
            res = await conn.call("mcp_tiny_echo", {"text": "x"}, str(work), {})
            assert res.isError and "no config for you" in res.text, res.text


@pytest.mark.skipif(not landlock_abi(), reason="the kernel has no Landlock")
async def test_a_stdio_server_is_sandboxed_like_every_tool(tmp_path: Path, work: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    mcp_dir = tmp_path / "mcp"
    path = tiny(tmp_path, mcp_dir, roots=[str(root)])
    secret = root / "secret"  # a hidden path (as olliefs hides its config, keys included)
    secret.mkdir()
    (secret / "key").write_text("k")
    hide = ("--hide", str(secret))
    try:
        with running_toolsrv(tmp_path / "s", extra_args=(*mcp_args(tmp_path), *hide)) as srv:
            await listed(srv, path)
            tools = ("mcp_tiny_write", "mcp_tiny_connect", "mcp_tiny_echo", "mcp_tiny_read")
            async with srv.agent("a1", *tools) as conn:
                res = await conn.call("mcp_tiny_read", {"path": str(secret / "key")}, str(work), {})
                assert res.isError, res.text
                res = await conn.call("mcp_tiny_write", {"path": str(root / "f")}, str(work), {})
                assert not res.isError and (root / "f").exists(), res.text
                for target in (outside / "f", work / "f"):
                    res = await conn.call("mcp_tiny_write", {"path": str(target)}, str(work), {})
                    assert res.isError and not target.exists(), res.text
                res = await conn.call("mcp_tiny_connect", {"port": port}, str(work), {})
                assert res.isError, res.text
                # network: true, and the file's change restarts the server with it.
                cfg = json.loads(path.read_text())
                path.write_text(json.dumps({**cfg, "network": True}))
                await listed(srv, path)
                res = await conn.call("mcp_tiny_connect", {"port": port}, str(work), {})
                assert not res.isError, res.text
    finally:
        listener.close()


GIT = BIN / "mcp-server-git"


@pytest.mark.skipif(not GIT.exists(), reason="mcp-server-git is not installed")
async def test_the_git_reference_server_reads_a_repository_and_cannot_touch_its_git_dir(
    tmp_path: Path, work: Path
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    for cmd in (["init", "-q"], ["config", "user.email", "t@t"], ["config", "user.name", "t"]):
        subprocess.run(["git", *cmd], cwd=repo, check=True)
    (repo / "a.txt").write_text("hello\n")
    config = server_file(
        tmp_path / "mcp",
        "git",
        command=str(GIT),
        args=["--repository", str(repo)],
        roots=[str(repo)],
        allowTools=["git_status", "git_add"],
    )
    with running_toolsrv(tmp_path / "s", extra_args=mcp_args(tmp_path)) as srv:
        names = await listed(srv, config)
        assert {n for n in names if n.startswith("mcp_git_")} == {
            "mcp_git_git_status",
            "mcp_git_git_add",
        }
        async with srv.agent("a1", "mcp_git_git_status", "mcp_git_git_add") as conn:
            res = await conn.call("mcp_git_git_status", {"repo_path": str(repo)}, str(work), {})
            assert not res.isError and "a.txt" in res.text, res.text
            # Its root is writable, but every .git beneath a root is read-only to tools.
            args = {"repo_path": str(repo), "files": ["a.txt"]}
            res = await conn.call("mcp_git_git_add", args, str(work), {})
            assert res.isError and "Read-only file system" in res.text, res.text
            assert not (repo / ".git" / "index").exists()


HTTP_SERVER = textwrap.dedent(
    """\
    import sys
    from mcp.server.mcpserver import MCPServer

    app = MCPServer("web")

    @app.tool()
    def shout(text: str) -> str:
        \"\"\"Say it louder.\"\"\"
        return text.upper()

    app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
    """
)


async def test_a_streamable_http_server_by_url(tmp_path: Path, work: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "web.py"
    script.write_text(HTTP_SERVER)
    logs = tmp_path / "web.log"
    with open(logs, "wb") as out:
        web = subprocess.Popen([sys.executable, str(script), str(port)], stdout=out, stderr=out)
    try:
        await await_until(
            lambda: b"running on" in logs.read_bytes().lower(),
            "the HTTP server listening",
            files=[logs],
            exits=[web.pid],
        )
        config = server_file(tmp_path / "mcp", "web", url=f"http://127.0.0.1:{port}/mcp")
        with running_toolsrv(tmp_path / "s", extra_args=mcp_args(tmp_path)) as srv:
            assert "mcp_web_shout" in await listed(srv, config)
            async with srv.agent("a1", "mcp_web_shout") as conn:
                res = await conn.call("mcp_web_shout", {"text": "hey"}, str(work), {})
                assert not res.isError and res.text == "HEY", res.text
    finally:
        web.terminate()
        web.wait(timeout=20)


async def test_a_server_that_announces_new_tools_is_listed_again(
    tmp_path: Path, work: Path
) -> None:
    config = tiny(tmp_path, tmp_path / "mcp")
    cache = tmp_path / "cache" / "tiny.json"
    with running_toolsrv(tmp_path / "s", extra_args=mcp_args(tmp_path)) as srv:
        assert "mcp_tiny_extra" not in await listed(srv, config)
        async with srv.agent("a1", "mcp_tiny_grow") as conn:
            res = await conn.call("mcp_tiny_grow", {}, str(work), {})
            assert not res.isError and res.text == "grown", res.text
            await await_until(
                lambda: "extra" in cache.read_text(), "the new listing cached", files=[cache]
            )
            assert "mcp_tiny_extra" in await conn.names()
