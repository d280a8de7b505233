"""A replay LLM server: an OpenAI-compatible HTTP endpoint that answers from a script.

The test-suite uses it as its LLM, and the README demo uses it to show olliefs working
offline. It speaks OpenAI's chat-completions wire format byte for byte (chunked SSE,
``data: [DONE]``, error bodies, rate-limit headers), so the real OpenAI backend talks to it
exactly as it talks to a provider. It listens on loopback only: it has no authentication
worth the name and answers anyone.

Endpoints (each with or without the ``/v1`` prefix)::

    POST /v1/chat/completions   answer the request with the next script entry
    GET  /v1/models             {"object": "list", "data": [{"id", "object": "model",
                                 "created": 0, "owned_by": "replay", "context_length"}]}
    GET  /_requests             every chat-completion request body received so far, as a
                                JSON list (tests assert on what the client sent)

With a key configured, ``/v1/...`` requests without ``Authorization: Bearer <key>`` get 401.

Script format
-------------

A script is a text file of JSON lines, one entry per chat-completion request, consumed in
order. Blank lines and lines starting with ``#`` are ignored. Every field is optional::

    # a plain reply, streamed 4 characters per delta
    {"reply": "Hello there."}
    # thinking first, then a tool call; the next request gets the following line
    {"reasoning": "Let me look.", "tool_calls": [{"name": "ls", "arguments": {"path": "."}}]}
    {"status": 429, "retry_after": 2}
    {"reply": "slow and cut off", "chunk": 1, "delay": 0.05, "drop_after": 5}

Fields:

``reply``
    The assistant text.
``reasoning``
    Text streamed before the reply as ``delta.reasoning_content``.
``reasoning_field``
    ``"reasoning_content"`` (default) or ``"reasoning"``: the delta key carrying the
    reasoning (providers disagree on it).
``tool_calls``
    ``[{"id": str, "name": str, "arguments": object or str}]``; ``id`` defaults to
    ``call_<n>_<i>``, ``arguments`` to ``{}`` (an object is sent JSON-encoded, a string as
    is). Streamed after the reply, in OpenAI's shape: a first delta per call carries
    ``index``, ``id``, ``type`` and ``function.name`` with empty arguments, then the
    arguments follow in fragments of ``chunk`` characters.
``late_ids``
    ``true``: each call's argument fragments come first, without id or name; a later delta
    carries them (some OpenAI-compatible servers do this).
``chunk``
    Characters per delta, default 4 (at least 1).
``delay``
    Seconds between deltas, default 0.
``first_delay``
    Seconds before the response headers are sent.
``usage``
    ``{"prompt_tokens", "completion_tokens", "cached_tokens", "cost"}``, each optional.
    Defaults: prompt tokens = characters of the request's message contents / 4, completion
    tokens = characters of the reply / 4, both at least 1. ``cached_tokens`` is sent as
    ``prompt_tokens_details.cached_tokens`` and ``cost`` as ``usage.cost`` only when given.
    Streamed replies carry usage only when the request asked for
    ``stream_options.include_usage``.
``finish_reason``
    Overrides the finish reason (default ``"stop"``, or ``"tool_calls"`` with calls).
``status``
    An HTTP status other than 200 answers with an OpenAI error body
    ``{"error": {"message", "type", "param", "code"}}`` instead of a completion.
``error``, ``error_type``, ``error_code``
    The error body's message (default: the status phrase), type (default by status:
    ``requests`` for 429, ``server_error`` for 5xx, else ``invalid_request_error``) and code
    (default ``rate_limit_exceeded`` for 429, ``invalid_api_key`` for 401, else null), e.g.
    ``"error_code": "context_length_exceeded"``.
``body``
    A raw response body sent (as ``application/json``) instead of the error body or the
    completion, with ``status``.
``retry_after``, ``retry_after_ms``
    Values of the ``Retry-After`` and ``retry-after-ms`` response headers.
``drop_after``
    Send that many deltas, then close the TCP connection without the terminating chunk and
    without ``[DONE]`` (a dropped stream). A non-streamed request is dropped unanswered.
``hang``, ``hang_after``
    Send the headers and ``hang_after`` deltas (default 0), then nothing more until the
    client goes away or the server stops (a stalled provider). A non-streamed request gets
    no answer at all.
``garbage``
    A raw string sent as one ``data: <garbage>`` event in place of the whole reply,
    followed by ``data: [DONE]`` (the raw body of a non-streamed answer).

Counted "deltas" are the reasoning, content and tool-call chunks; the first one also
carries ``"role": "assistant"`` (a reply with none gets a role-only delta). After them come
a chunk with ``finish_reason``, the usage chunk (``"choices": []``) when requested, and
``data: [DONE]``. A request without ``"stream": true`` gets one ``chat.completion`` object.

When the script runs out the server is in echo mode: it replies
``echo: <content of the last user message>``, so it is useful with no script at all. With
``then="error"`` (``--then error``) it answers 500 ``replay script exhausted`` instead.

Run it as ``ollie replay-server [--script FILE] [--port N] [--port-file PATH] ...``; it
serves until SIGTERM or SIGINT. ``--port-file`` receives the bound port (written atomically
once listening, removed on exit), so a script can start it with ``--port 0`` and wait.
"""

from __future__ import annotations

import argparse
import ipaddress
import itertools
import logging
import os
import select
import signal
import socket
import socketserver
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from http.client import responses
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType, TracebackType
from typing import Annotated, Any, Literal

import msgspec

log = logging.getLogger(__name__)

NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]


class EntryToolCall(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One scripted tool call; an object ``arguments`` is sent JSON-encoded."""

    name: str
    arguments: dict[str, Any] | str = {}
    id: str | None = None


class EntryUsage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Token counts to report; ``None`` fields get the character-based defaults."""

    prompt_tokens: Count | None = None
    completion_tokens: Count | None = None
    cached_tokens: Count | None = None
    cost: float | None = None


class Entry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One scripted answer; the module docstring documents every field."""

    reply: str = ""
    reasoning: str = ""
    reasoning_field: Literal["reasoning_content", "reasoning"] = "reasoning_content"
    tool_calls: tuple[EntryToolCall, ...] = ()
    late_ids: bool = False
    chunk: Annotated[int, msgspec.Meta(ge=1)] = 4
    delay: NonNegative = 0.0
    first_delay: NonNegative = 0.0
    usage: EntryUsage | None = None
    finish_reason: str | None = None
    status: Annotated[int, msgspec.Meta(ge=200, le=599)] = 200
    error: str | None = None
    error_type: str | None = None
    error_code: str | None = None
    body: str | None = None
    retry_after: str | float | None = None
    retry_after_ms: str | float | None = None
    drop_after: Count | None = None
    hang: bool = False
    hang_after: Count = 0
    garbage: str | None = None


def parse_script(text: str) -> list[Entry]:
    """Parse a JSON-lines script; errors name the 1-based line so users can fix the file."""
    entries = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            entries.append(msgspec.json.decode(line, type=Entry))
        except msgspec.MsgspecError as e:
            raise ValueError(f"line {lineno}: {e}") from None
    return entries


def _bind_host(host: str) -> str:
    """The address to bind for ``host``; anything but loopback is refused.

    The server answers anyone who can reach it, so it must never be reachable from
    another machine. ``localhost`` maps to 127.0.0.1 rather than trusting the resolver.
    """
    if host == "localhost":
        return "127.0.0.1"
    try:
        if ipaddress.ip_address(host).is_loopback:
            return host
    except ValueError:
        pass
    raise ValueError(f"refusing to listen on {host!r}: the replay server is loopback only")


def _text(content: Any) -> str:
    """The text of a message ``content``: a string, or a list of ``{"type": "text"}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def _messages(request: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = request.get("messages")
    return [m for m in msgs if isinstance(m, dict)] if isinstance(msgs, list) else []


def _error_body(status: int, message: str | None, type_: str | None, code: str | None) -> bytes:
    if type_ is None:
        type_ = (
            "requests"
            if status == 429
            else "server_error"
            if status >= 500
            else "invalid_request_error"
        )
    if code is None:
        code = {429: "rate_limit_exceeded", 401: "invalid_api_key"}.get(status)
    message = message or f"{status} {responses.get(status, 'Error')}"
    error = {"message": message, "type": type_, "param": None, "code": code}
    return msgspec.json.encode({"error": error})


class _HTTPServer(ThreadingHTTPServer):
    """Tracks every connection and its thread so ``stop`` can wake and join them all."""

    daemon_threads = True

    def __init__(self, replay: ReplayServer, address: tuple[str, int]) -> None:
        self.replay = replay
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.connections: dict[socket.socket, threading.Thread] = {}
        self.conn_lock = threading.Lock()
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind does a reverse DNS lookup (getfqdn) that can stall for
        # seconds on machines without a resolver; the server name is not needed.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def process_request(self, request: Any, client_address: Any) -> None:
        # Registered here, in the serving thread, so that once ``shutdown()`` has returned
        # every accepted connection is known to ``stop``.
        t = threading.Thread(
            target=self.process_request_thread,
            args=(request, client_address),
            name=f"replay-conn-{client_address[1]}",
            daemon=True,
        )
        with self.conn_lock:
            self.connections[request] = t
        t.start()

    def shutdown_request(self, request: Any) -> None:
        with self.conn_lock:
            self.connections.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up mid-stream, or a socket shut down by stop(), is routine.
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Deltas are small writes that must leave at once: with Nagle's algorithm each would
    # wait for the client's delayed ACK (~40 ms), skewing token latency.
    disable_nagle_algorithm = True
    server: _HTTPServer

    def version_string(self) -> str:
        return "ollie-replay"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    @property
    def replay(self) -> ReplayServer:
        return self.server.replay

    def _path(self) -> str:
        path = self.path.split("?", 1)[0]
        return path[3:] if path.startswith("/v1/") else path

    def _send(self, status: int, body: bytes, headers: Iterable[tuple[str, str]] = ()) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _fail(self, status: int, message: str) -> None:
        self._send(status, _error_body(status, message, None, None))

    def _authorized(self) -> bool:
        key = self.replay.key
        if key is None or self.headers.get("Authorization") == f"Bearer {key}":
            return True
        self._fail(401, "Incorrect API key provided.")
        return False

    def do_GET(self) -> None:
        path = self._path()
        if path == "/_requests":
            self._send(200, msgspec.json.encode(self.replay.requests))
        elif not self._authorized():
            return
        elif path == "/models":
            data = [
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "replay",
                    "context_length": self.replay.context_length,
                }
                for name in self.replay.models
            ]
            self._send(200, msgspec.json.encode({"object": "list", "data": data}))
        else:
            self._fail(404, f"no such endpoint: {self.path}")

    def do_POST(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            return self._fail(400, "bad Content-Length")
        raw = self.rfile.read(length)  # always read, so the keep-alive stream stays in step
        if self._path() != "/chat/completions":
            return self._fail(404, f"no such endpoint: {self.path}")
        if not self._authorized():
            return
        try:
            request = msgspec.json.decode(raw)
        except msgspec.DecodeError as e:
            return self._fail(400, f"request body is not JSON: {e}")
        if not isinstance(request, dict):
            return self._fail(400, "request body must be a JSON object")
        n, entry = self.replay._take(request)
        self._answer(n, entry, request)

    def _answer(self, n: int, entry: Entry, request: dict[str, Any]) -> None:
        if entry.first_delay and self.replay._stopping.wait(entry.first_delay):
            self.close_connection = True
            return
        headers = [
            (name, str(value))
            for name, value in (
                ("Retry-After", entry.retry_after),
                ("retry-after-ms", entry.retry_after_ms),
            )
            if value is not None
        ]
        if entry.body is not None:
            return self._send(entry.status, entry.body.encode(), headers)
        if entry.status != 200:
            err = _error_body(entry.status, entry.error, entry.error_type, entry.error_code)
            return self._send(entry.status, err, headers)
        model = str(request.get("model") or self.replay.models[0])
        reply = _Reply(n, entry, request, model)
        if request.get("stream") is True:
            self._stream(reply, headers)
        elif entry.hang:
            self._hang()
        elif entry.drop_after is not None:
            self._drop()
        elif entry.garbage is not None:
            self._send(200, entry.garbage.encode(), headers)
        else:
            self._send(200, msgspec.json.encode(reply.completion()), headers)

    def _stream(self, reply: _Reply, headers: list[tuple[str, str]]) -> None:
        entry = reply.entry
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        if entry.garbage is not None:
            self._event(entry.garbage.encode())
            return self._end()
        limit = entry.hang_after if entry.hang else entry.drop_after
        on_send = self.replay.on_send
        for i, (delta, content) in enumerate(reply.deltas()):
            if i == limit:
                break
            if i and entry.delay and self.replay._stopping.wait(entry.delay):
                self.close_connection = True
                return
            choice = {"index": 0, "delta": delta, "finish_reason": None}
            self._event(msgspec.json.encode(reply.chunk([choice])))
            if content and on_send is not None:
                on_send(content, time.monotonic())
        if entry.hang:
            return self._hang()
        if entry.drop_after is not None:
            return self._drop()
        finish = {"index": 0, "delta": {}, "finish_reason": reply.finish_reason}
        self._event(msgspec.json.encode(reply.chunk([finish])))
        options = reply.request.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage") is True:
            self._event(msgspec.json.encode(reply.chunk([], usage=reply.usage())))
        self._end()

    def _event(self, data: bytes) -> None:
        """Write one SSE event as one HTTP chunk (the socket writer is unbuffered)."""
        payload = b"data: " + data + b"\n\n"
        self.wfile.write(b"%x\r\n%b\r\n" % (len(payload), payload))

    def _end(self) -> None:
        self._event(b"[DONE]")
        self.wfile.write(b"0\r\n\r\n")

    def _drop(self) -> None:
        """Close the connection mid-response: FIN, not RST, so the client reads what was
        sent before it sees the body end early."""
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)

    def _hang(self) -> None:
        """Wait for the client to hang up; ``stop`` wakes this by shutting the socket down."""
        self.close_connection = True
        poller = select.poll()
        poller.register(self.connection, select.POLLIN)
        poller.poll()


class _Reply:
    """The wire objects of one answer: streamed chunks or a whole ``chat.completion``."""

    def __init__(self, n: int, entry: Entry, request: dict[str, Any], model: str) -> None:
        self.entry, self.request, self.model = entry, request, model
        self.id = f"chatcmpl-{n}"
        self.created = int(time.time())
        self.calls = [
            (
                call.id or f"call_{n}_{i}",
                call.name,
                call.arguments
                if isinstance(call.arguments, str)
                else msgspec.json.encode(call.arguments).decode(),
            )
            for i, call in enumerate(entry.tool_calls)
        ]
        self.finish_reason = entry.finish_reason or ("tool_calls" if self.calls else "stop")

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def deltas(self) -> list[tuple[dict[str, Any], str]]:
        """Every counted delta, paired with its content text (for ``on_send``)."""
        e, size = self.entry, self.entry.chunk

        def pieces(text: str) -> list[str]:
            return [text[i : i + size] for i in range(0, len(text), size)]

        out: list[tuple[dict[str, Any], str]] = [
            ({e.reasoning_field: p}, "") for p in pieces(e.reasoning)
        ]
        out += [({"content": p}, p) for p in pieces(e.reply)]
        for index, (call_id, name, arguments) in enumerate(self.calls):
            function = {"name": name, "arguments": ""}
            head = {"index": index, "id": call_id, "type": "function", "function": function}
            frags = [{"index": index, "function": {"arguments": p}} for p in pieces(arguments)]
            for call in [*frags, head] if e.late_ids else [head, *frags]:
                out.append(({"tool_calls": [call]}, ""))
        delta, content = out[0] if out else ({"content": ""}, "")
        out[:1] = [({"role": "assistant", **delta}, content)]
        return out

    def usage(self) -> dict[str, Any]:
        given = self.entry.usage or EntryUsage()
        chars = sum(len(_text(m.get("content"))) for m in _messages(self.request))
        prompt = given.prompt_tokens
        prompt = max(1, chars // 4) if prompt is None else prompt
        completion = given.completion_tokens
        completion = max(1, len(self.entry.reply) // 4) if completion is None else completion
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if given.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": given.cached_tokens}
        if given.cost is not None:
            usage["cost"] = given.cost
        return usage

    def completion(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.entry.reply or None}
        if self.entry.reasoning:
            message[self.entry.reasoning_field] = self.entry.reasoning
        if self.calls:
            message["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": name, "arguments": args}}
                for i, name, args in self.calls
            ]
        choice = {"index": 0, "message": message, "finish_reason": self.finish_reason}
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(),
        }


class ReplayServer:
    """The replay server, served from background threads (no event loop involved).

    ``script`` is a list of entries, script text (``str``) or a script file (``Path``).
    Use as ``with ReplayServer(script) as srv: ... srv.url ...`` or ``start()``/``stop()``.
    ``on_send(text, time.monotonic())`` is called right after each content delta has been
    written to the socket, so benchmarks can measure token latency end to end.
    """

    def __init__(
        self,
        script: Sequence[Entry] | str | Path | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        models: Sequence[str] = ("replay",),
        context_length: int = 128000,
        key: str | None = None,
        then: str = "echo",
        on_send: Callable[[str, float], None] | None = None,
    ) -> None:
        if then not in ("echo", "error"):
            raise ValueError(f"then must be 'echo' or 'error', not {then!r}")
        if not models:
            raise ValueError("at least one model name is needed")
        if isinstance(script, Path):
            try:
                script = parse_script(script.read_text())
            except ValueError as e:
                raise ValueError(f"{script}: {e}") from None
        elif isinstance(script, str):
            script = parse_script(script)
        self._address = (_bind_host(host), port)
        self.models = tuple(models)
        self.context_length = context_length
        self.key = key
        self.then = then
        self.on_send = on_send
        self._script: deque[Entry] = deque(script or ())
        self._requests: list[dict[str, Any]] = []
        self._counter = itertools.count(1)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("the replay server is not running")
        return self._httpd.server_port

    @property
    def url(self) -> str:
        host = self._address[0]
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/v1"

    @property
    def requests(self) -> list[dict[str, Any]]:
        """A snapshot of the chat-completion request bodies received so far."""
        with self._lock:
            return list(self._requests)

    def add(self, entries: Iterable[Entry]) -> None:
        """Append entries to the script while the server runs."""
        with self._lock:
            self._script.extend(entries)

    def _take(self, request: dict[str, Any]) -> tuple[int, Entry]:
        """Record ``request`` and pick its answer: the next entry, or the fallback."""
        with self._lock:
            self._requests.append(request)
            n = next(self._counter)
            if self._script:
                return n, self._script.popleft()
        if self.then == "error":
            return n, Entry(status=500, error="replay script exhausted")
        users = [m for m in _messages(request) if m.get("role") == "user"]
        return n, Entry(reply=f"echo: {_text(users[-1].get('content')) if users else ''}")

    def start(self) -> ReplayServer:
        """Bind and serve in a daemon thread; raises ``OSError`` when the port is taken."""
        if self._httpd is not None:
            raise RuntimeError("the replay server is already running")
        self._stopping.clear()
        self._httpd = _HTTPServer(self, self._address)
        # A short poll interval keeps stop() prompt: serve_forever checks for shutdown
        # only between polls.
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.05,), name="replay-serve", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and end every connection, even mid-delay or mid-hang; then join all
        threads, so nothing keeps running after this returns."""
        httpd, thread = self._httpd, self._thread
        if httpd is None or thread is None:
            return
        self._stopping.set()
        httpd.shutdown()
        thread.join()
        with httpd.conn_lock:
            connections = dict(httpd.connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by its handler
        for t in connections.values():
            t.join()
        httpd.server_close()
        self._httpd = self._thread = None

    def __enter__(self) -> ReplayServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


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
    """``ollie replay-server``: serve until SIGTERM/SIGINT; 0 then, 2 on a startup error."""
    parser = argparse.ArgumentParser(
        prog="ollie replay-server",
        description="Serve a scripted conversation as an OpenAI-compatible API (loopback only).",
    )
    parser.add_argument("--script", type=Path, help="JSON-lines script (default: echo mode)")
    parser.add_argument("--host", default="127.0.0.1", help="loopback address to bind")
    parser.add_argument("--port", type=int, default=0, help="port (default: any free one)")
    parser.add_argument("--model", action="append", help="model name to offer (repeatable)")
    parser.add_argument("--key", help="require Authorization: Bearer KEY")
    parser.add_argument("--then", choices=("echo", "error"), default="echo")
    parser.add_argument("--port-file", type=Path, help="write the bound port here")
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
            print(f"replay server listening on {server.url}", flush=True)
            stop.wait()
        finally:
            if args.port_file is not None:  # a stale port would mislead the next waiter
                args.port_file.unlink(missing_ok=True)
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
