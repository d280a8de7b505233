"""``ollie replay-server``: serve a script on loopback until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from olliefs.replay.server import ReplayServer


def _write_port_file(path: Path, port: int) -> None:
    """Atomically, so a script polling for the file never reads it half written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(f"{port}\n")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def run_cli(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; 0 then, 2 on a startup error.

    The first line on stdout is ``replay server listening on <OpenAI base URL>``; with
    ``--env`` the ``OLLIE_*`` settings that point every backend here follow, one per line.
    """
    parser = argparse.ArgumentParser(
        prog="ollie replay-server",
        description=(
            "Serve a scripted conversation in every provider's wire format "
            "(OpenAI, Anthropic, Ollama, Gemini, Copilot, Kiro) on loopback only."
        ),
    )
    parser.add_argument("--script", type=Path, help="JSON-lines script (default: echo mode)")
    parser.add_argument("--host", default="127.0.0.1", help="loopback address to bind")
    parser.add_argument("--port", type=int, default=0, help="port (default: any free one)")
    parser.add_argument("--model", action="append", help="model name to offer (repeatable)")
    parser.add_argument("--key", help="require this key (each wire checks it its own way)")
    parser.add_argument("--then", choices=("echo", "error"), default="echo")
    parser.add_argument("--port-file", type=Path, help="write the bound port here")
    parser.add_argument(
        "--env", action="store_true", help="print the OLLIE_* settings for every backend"
    )
    parser.add_argument(
        "--no-completions",
        action="store_true",
        help="answer /v1/completions with 404, as a server that has only chat completions",
    )
    args = parser.parse_args(argv)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    try:
        server = ReplayServer(
            args.script,
            host=args.host,
            port=args.port,
            models=args.model or ("replay",),
            key=args.key,
            then=args.then,
            completions=not args.no_completions,
        ).start()
    except (OSError, ValueError) as e:
        print(f"ollie replay-server: {e}", file=sys.stderr)
        return 2
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if args.port_file is not None:
            try:
                _write_port_file(args.port_file, server.port)
            except OSError as e:
                print(f"ollie replay-server: {e}", file=sys.stderr)
                return 2
        try:
            lines = [f"replay server listening on {server.url}"]
            if args.env:
                lines += [f"{k}={v}" for k, v in server.settings().items()]
            print("\n".join(lines), flush=True)
            stop.wait()
        finally:
            if args.port_file is not None:  # a stale port would mislead the next waiter
                args.port_file.unlink(missing_ok=True)
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
