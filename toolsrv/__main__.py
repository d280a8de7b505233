"""``toolsrv``: the 9P tool server process (SPEC 5, toolsrv(8)).

toolsrv imports nothing of olliefs: whoever starts it names every directory it serves on the
command line (olliefs' spawner passes the user's config dirs, then the shipped defaults).
olliefs spawns it with the master key on stdin (one hex line) and waits for ``ready`` on
stdout; a remote toolsrv reads the key from ``--key-file``. It serves until SIGTERM/SIGINT
or until stdin reaches EOF when ``--exit-with-stdin`` is given (the spawning daemon died:
a tool server without its daemon has nobody to serve).

``--stdio`` is the remote form, run by the daemon as ``ssh HOST toolsrv --stdio``: ssh is
the transport and the authentication. The key line comes on stdin as above, ``ready`` goes
out on stdout, and from then on the one 9P2000 connection is stdin/stdout themselves (every
session of that daemon attaches on it). Without ``--tools-dir`` it serves what this host
has: the user's ``ollie`` config dir (``OLLIE_HOME/config`` or the XDG one) first, then the
shipped defaults of the olliefs installed beside it, with that host's ollie dirs hidden from
tools. EOF on stdin (the ssh connection gone) ends it, and with it every call it ran.

Right after reading the key the process forks (`toolsrv.keeper`): the parent, which the
spawner waits for, only keeps the server; the child serves. When the server dies, however,
the keeper kills every process it left, so no tool outlives its toolsrv.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import logging
import os
import signal
import sys
from pathlib import Path

import trio

from ninep.server import serve_connection, serve_unix
from toolsrv import keeper, namespaces
from toolsrv.exec import Executor
from toolsrv.mcp import McpServers
from toolsrv.registry import ToolRegistry
from toolsrv.server import ToolServer

log = logging.getLogger("toolsrv")

# A tool whose header changed on disk is seen within this long; a new tool at once.
REGISTRY_MAX_AGE = 1.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="toolsrv", description="olliefs tool server (9P2000)")
    p.add_argument("--socket", help="unix socket path to listen on (mode 0600)")
    p.add_argument(
        "--stdio",
        action="store_true",
        help="serve one 9P connection on stdin/stdout (run over ssh by a remote daemon)",
    )
    p.add_argument(
        "--tools-dir", action="append", default=[], help="tool scripts; earlier dirs win"
    )
    p.add_argument(
        "--sandbox-dir", action="append", default=[], help="sandbox/*.toml dirs; earlier win"
    )
    p.add_argument("--tmp-dir", help="root of the per-session tmp dirs")
    p.add_argument(
        "--capture-dir", default="", help="root of the sessions' checkpoint stores (none: off)"
    )
    p.add_argument(
        "--hide",
        action="append",
        default=[],
        help="a path no tool may see nor change, wherever the call's cwd is (the daemon's "
        "dirs, secrets, sockets); repeatable",
    )
    p.add_argument(
        "--show",
        action="append",
        default=[],
        help="a path inside a hidden dir that tools may still read and execute (the user's "
        "tool scripts); repeatable",
    )
    p.add_argument(
        "--mcp-dir",
        action="append",
        default=[],
        help="dirs of MCP server files <name>.json; earlier dirs win (toolsrv.mcp)",
    )
    p.add_argument("--mcp-cache", help="where the tool listings of MCP servers are kept")
    p.add_argument("--key-file", help="master key file (default: one hex line on stdin)")
    p.add_argument("--exit-with-stdin", action="store_true", help="exit when stdin closes")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    args = p.parse_args(argv)
    if args.version:
        return args
    if args.stdio:
        stdio_defaults(args)
    elif not args.socket or not args.tmp_dir:
        p.error("--socket and --tmp-dir are required (or --stdio)")
    return args


def ollie_dirs() -> tuple[Path, Path, Path]:
    """This host's ollie config, state and data dirs, as olliefs' settings find them
    (``OLLIE_HOME`` wins, then XDG): a ``--stdio`` toolsrv serves the user's tools there
    and hides them from tools, as the local daemon does with its own."""
    home = os.environ.get("OLLIE_HOME")
    if home:
        return Path(home) / "config", Path(home) / "state", Path(home) / "data"
    user = Path.home()

    def xdg(var: str, default: str) -> Path:
        return Path(os.environ.get(var) or user / default) / "ollie"

    return (
        xdg("XDG_CONFIG_HOME", ".config"),
        xdg("XDG_STATE_HOME", ".local/state"),
        xdg("XDG_DATA_HOME", ".local/share"),
    )


def shipped_dir() -> Path | None:
    """The shipped ``agents/`` folder of the olliefs installed beside this toolsrv (package
    data, located, not imported as code), or None where toolsrv is installed alone."""
    try:
        spec = importlib.util.find_spec("olliefs._agents")
    except ImportError:
        return None
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def stdio_defaults(args: argparse.Namespace) -> None:
    config, state, data = ollie_dirs()
    shipped = shipped_dir()
    if not args.tools_dir:
        args.tools_dir = [str(config / "tools")]
        args.sandbox_dir = [str(config / "sandbox")]
        args.mcp_dir = [str(config / "mcp")]
        if shipped is not None:
            args.tools_dir.append(str(shipped / "tools"))
            args.sandbox_dir.append(str(shipped / "sandbox"))
        args.mcp_cache = args.mcp_cache or str(state / "mcp")
        for path in (config, state, data):
            args.hide.append(str(path))
        args.show += [str(config / "tools")]
    if not args.tmp_dir:
        args.tmp_dir = str(data / "tmp")
    args.exit_with_stdin = True


def version() -> str:
    try:
        return importlib.metadata.version("olliefs")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def read_key(args: argparse.Namespace) -> bytes:
    text = Path(args.key_file).read_text() if args.key_file else sys.stdin.readline()
    key = bytes.fromhex(text.strip())
    if len(key) < 16:
        raise SystemExit("toolsrv: the master key must be at least 16 bytes of hex")
    return key


async def amain(args: argparse.Namespace, key: bytes) -> None:
    tools = [Path(d) for d in args.tools_dir]
    boxes = [Path(d) for d in args.sandbox_dir]
    tmp_root = Path(args.tmp_dir)
    tmp_root.mkdir(parents=True, exist_ok=True, mode=0o700)
    # This server's own socket is hidden from tools too: a tool must not reach it.
    hide = [*args.hide, args.socket] if args.socket else list(args.hide)
    executor = Executor(cgroups=os.environ.get("TOOLSRV_CGROUPS", ""), hide=hide, show=args.show)
    executor.start()
    try:
        await serve(args, key, tools, boxes, tmp_root, executor)
    finally:
        executor.close()


async def serve(
    args: argparse.Namespace,
    key: bytes,
    tools: list[Path],
    boxes: list[Path],
    tmp_root: Path,
    executor: Executor,
) -> None:
    async with trio.open_nursery() as nursery:
        fs = ToolServer(
            key,
            ToolRegistry(tools, max_age=REGISTRY_MAX_AGE, watch=True),
            sandbox_dirs=boxes,
            tmp_root=tmp_root,
            nursery=nursery,
            executor=executor,
            capture_root=Path(args.capture_dir) if args.capture_dir else None,
        )
        if args.mcp_dir:
            fs.mcp = McpServers(
                [Path(d) for d in args.mcp_dir],
                cache=Path(args.mcp_cache) if args.mcp_cache else None,
                tmp_root=tmp_root,
                executor=executor,
                nursery=nursery,
                profile=fs.profile,
            )
            fs.registry.extra = fs.mcp.tools
        if args.stdio:
            await serve_stdio(fs, nursery)
            return
        await nursery.start(serve_unix, args.socket, fs)
        log.info("serving %s (tools: %s)", args.socket, ", ".join(map(str, tools)))
        try:
            sys.stdout.write("ready\n")
            sys.stdout.flush()
        except BrokenPipeError:
            # Whoever started us is gone already (a daemon stopped while we started):
            # nobody will ever connect, so leave quietly.
            log.info("the spawner went away before toolsrv was ready; exiting")
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error
            nursery.cancel_scope.cancel()
            return

        async def on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
                async for _ in sigs:
                    nursery.cancel_scope.cancel()

        async def on_stdin_eof() -> None:
            await trio.lowlevel.wait_readable(0)
            while await trio.to_thread.run_sync(os.read, 0, 4096):
                pass
            log.info("stdin closed: the daemon is gone, exiting")
            nursery.cancel_scope.cancel()

        nursery.start_soon(on_signal)
        if args.exit_with_stdin:
            nursery.start_soon(on_stdin_eof)


async def serve_stdio(fs: ToolServer, nursery: trio.Nursery) -> None:
    """The one connection of ``--stdio``: stdin/stdout, moved to fds of their own first,
    so that nothing else in this process (a stray print, a child that inherits fd 1) can
    write into the 9P stream; fds 0 and 1 become /dev/null. The connection's end (EOF:
    ssh gone) ends the server."""
    rfd, wfd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    for fd in (rfd, wfd):
        os.set_inheritable(fd, False)
    os.write(wfd, b"ready\n")  # before FdStream makes the pipe non-blocking
    stream = trio.StapledStream(trio.lowlevel.FdStream(wfd), trio.lowlevel.FdStream(rfd))
    log.info("serving 9P on stdin/stdout")

    async def on_signal() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
            async for _ in sigs:
                nursery.cancel_scope.cancel()

    nursery.start_soon(on_signal)
    await serve_connection(stream, fs)
    log.info("stdin closed: the remote daemon is gone, exiting")
    nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.version:
        print(f"toolsrv {version()}")
        return
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s toolsrv %(levelname)s %(name)s: %(message)s",
    )
    key = read_key(args)
    keeper.split(args.socket or "")  # from here on, in the server; the keeper never comes back
    # Before any thread exists, so that every thread (each tool's spawning thread) starts
    # with an empty bounding set instead of emptying its own, ~40 syscalls a call.
    try:
        if not namespaces.drop_bounding_set():
            log.debug("no CAP_SETPCAP: the bounding set stays (no_new_privs covers it)")
    except OSError as err:
        log.warning("cannot empty the capability bounding set: %s", err.strerror)
    try:
        trio.run(amain, args, key)
    finally:
        if args.socket:
            try:
                os.unlink(args.socket)
            except FileNotFoundError:
                pass


if __name__ == "__main__":
    main()
