"""The replay server's HTTP side: loopback sockets, routing, and how bytes leave.

One server speaks every wire format at once, each at its provider's own paths, so one
port serves whichever backend a test or the demo points at it (``ReplayServer.settings``
gives the ``OLLIE_<NAME>_URL`` values)::

    POST /v1/chat/completions               OpenAI (also without /v1; Copilot's path)
    GET  /v1/models                         OpenAI's list, Anthropic's with anthropic-version
    POST /v1/messages                       Anthropic
    POST /api/chat, GET /api/tags,
    POST /api/show                          Ollama
    POST /api/generate                      Ollama's fill in the middle (``suffix``)
    POST /v1/completions                    OpenAI's text completions (``suffix``); 404
                                            with ``completions=False``, as a server
                                            without them
    POST /v1beta/models/<m>:streamGenerateContent?alt=sse, GET /v1beta/models   Gemini
    GET  /copilot_internal/v2/token         Copilot's token exchange
    POST /generateAssistantResponse, GET /ListAvailableModels,
    POST /refreshToken                      Kiro (CodeWhisperer)
    GET  /_requests                         every model request body so far (JSON list)

With a key configured, each wire checks it where its provider carries it
(``Authorization: Bearer``, ``x-api-key``, ``x-goog-api-key`` or ``?key=``; Copilot and
Kiro accept the short-lived tokens this server minted). Anthropic requests also need
``anthropic-version``, Copilot requests the editor headers, as the real services do.

Streams are written one frame per HTTP chunk, with Nagle off, so a delta leaves the
moment it is written; ``stop`` shuts every connection down, even mid-delay or mid-hang.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import re
import select
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs

import msgspec

from olliefs.replay.script import Entry, Recorded, Script, parse_script
from olliefs.replay.wire import Answer, Wire, dumps
from olliefs.replay.wire import copilot as copilot_wire
from olliefs.replay.wire.anthropic import AnthropicWire
from olliefs.replay.wire.fim import CompletionsWire, GenerateWire
from olliefs.replay.wire.gemini import GeminiWire
from olliefs.replay.wire.kiro import KiroWire
from olliefs.replay.wire.ollama import OllamaWire
from olliefs.replay.wire.openai import OpenAIWire

log = logging.getLogger(__name__)

WIRES: dict[str, Wire] = {
    w.name: w for w in (OpenAIWire(), AnthropicWire(), OllamaWire(), GeminiWire(), KiroWire())
}
# Fill in the middle: recorded under their provider's wire name (Recorded.path tells them).
FIM_WIRES: dict[str, Wire] = {"/api/generate": GenerateWire(), "/completions": CompletionsWire()}
_GEMINI_CALL = re.compile(r"/v1[a-z0-9]*/models/([^/:]+):(streamGenerateContent|generateContent)")


def bind_host(host: str) -> str:
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


class _HTTPServer(ThreadingHTTPServer):
    """Tracks every connection and its thread so ``stop`` can wake and join them all."""

    daemon_threads = True

    def __init__(self, replay: ReplayServer, address: tuple[str, int]) -> None:
        self.replay = replay
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.connections: dict[socket.socket, threading.Thread] = {}
        # Every connection thread not yet seen to end: one that took itself out of
        # ``connections`` is still finishing, and ``stop`` waits for it too.
        self.threads: list[threading.Thread] = []
        self.conn_lock = threading.Lock()
        self.conn_changed = threading.Condition(self.conn_lock)  # a connection came or went
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
            self.threads = [*(x for x in self.threads if x.is_alive()), t]
            self.replay.accepted += 1
            self.conn_changed.notify_all()
        t.start()

    def shutdown_request(self, request: Any) -> None:
        with self.conn_lock:
            self.connections.pop(request, None)
            self.conn_changed.notify_all()
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up mid-stream, or a socket shut down by stop(), is routine.
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class _Cut(Exception):
    """The answer was cut short on purpose (``cut_after``, or ``stop`` during
    ``byte_delay``); the connection is closed."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    _faults: Entry | None = None
    _budget: int | None = None
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

    def _query(self) -> dict[str, list[str]]:
        return parse_qs(self.path.partition("?")[2])

    # -- plain replies

    def _send(
        self,
        status: int,
        body: bytes,
        headers: Iterable[tuple[str, str]] = (),
        content_type: str = "application/json",
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self._body(body, framed=False)

    def _fail(self, wire: Wire, status: int, message: str) -> None:
        body, headers = wire.error_body(status, Entry(error=message))
        self._send(status, body, headers)

    # -- auth

    def _bearer(self) -> str | None:
        value = self.headers.get("Authorization") or ""
        return value[7:] if value.startswith("Bearer ") else None

    def _authorized(self, wire: Wire) -> bool:
        """The key check of ``wire``; answers the refusal itself."""
        key = self.replay.key
        if wire.name == "anthropic" and not self.headers.get("anthropic-version"):
            self._fail(wire, 400, "anthropic-version: header is required")
            return False
        bearer = self._bearer()
        if wire.name == "openai" and bearer in self.replay.minted("copilot"):
            if missing := copilot_wire.missing_headers(self.headers):
                self._fail(wire, 400, f"bad request: missing {missing[0]} header for IDE auth")
                return False
            return True
        if key is None or wire.name == "ollama":
            return True
        if wire.name == "anthropic":
            # x-api-key as documented; the official SDK (2.x) sends the key as a bearer
            # token, which the API takes too.
            ok = key in (self.headers.get("x-api-key"), bearer)
        elif wire.name == "gemini":
            ok = key in (self.headers.get("x-goog-api-key"), *self._query().get("key", []))
        elif wire.name == "kiro":
            ok = bearer == key or bearer in self.replay.minted("kiro")
        else:
            ok = bearer == key
        if not ok:
            status = 403 if wire.name == "kiro" else 401
            message = {
                "anthropic": "invalid x-api-key",
                "gemini": "API key not valid. Please pass a valid API key.",
                "kiro": "The bearer token included in the request is invalid.",
            }.get(wire.name, "Incorrect API key provided.")
            self._fail(wire, status, message)
        return ok

    # -- routing

    def do_GET(self) -> None:
        path, replay = self._path(), self.replay
        if path == "/_requests":
            return self._send(200, dumps([r.body for r in replay.recorded]))
        if path == copilot_wire.TOKEN_PATH:
            return self._copilot_token()
        if path == "/api/tags":
            tags = [
                {
                    "name": m,
                    "model": m,
                    "modified_at": "2025-01-01T00:00:00Z",
                    "size": 1,
                    "digest": f"{i:064x}",
                }
                for i, m in enumerate(replay.models)
            ]
            return self._send(200, dumps({"models": tags}))
        if re.fullmatch(r"/v1[a-z0-9]*/models", path):
            if not self._authorized(WIRES["gemini"]):
                return None
            entries = [
                {
                    "name": f"models/{m}",
                    "inputTokenLimit": replay.context_length,
                    "outputTokenLimit": 8192,
                    "supportedGenerationMethods": ["generateContent", "streamGenerateContent"],
                }
                for m in replay.models
            ]
            return self._send(200, dumps({"models": entries}))
        if path == "/ListAvailableModels":
            if not self._authorized(WIRES["kiro"]):
                return None
            entries = [
                {
                    "modelId": m,
                    "modelName": m,
                    "tokenLimits": {"maxInputTokens": replay.context_length},
                }
                for m in replay.models
            ]
            return self._send(200, dumps({"models": entries, "defaultModel": entries[0]}))
        if path == "/models":
            if self.headers.get("anthropic-version"):
                return self._anthropic_models()
            return self._openai_models()
        return self._fail(WIRES["openai"], 404, f"no such endpoint: {self.path}")

    def _openai_models(self) -> None:
        if not self._authorized(WIRES["openai"]):
            return
        copilot = self._bearer() in self.replay.minted("copilot")
        data = []
        for name in self.replay.models:
            entry: dict[str, Any] = {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "replay",
                "context_length": self.replay.context_length,
            }
            if copilot:
                del entry["context_length"]
                limits = {
                    "max_prompt_tokens": self.replay.context_length,
                    "max_output_tokens": 8192,
                }
                entry["capabilities"] = {"limits": limits, "supports": {"tool_calls": True}}
            data.append(entry)
        self._send(200, dumps({"object": "list", "data": data}))

    def _anthropic_models(self) -> None:
        if not self._authorized(WIRES["anthropic"]):
            return
        data = [
            {
                "type": "model",
                "id": m,
                "display_name": m,
                "created_at": "2025-01-01T00:00:00Z",
                "max_input_tokens": self.replay.context_length,
            }
            for m in self.replay.models
        ]
        page = {
            "data": data,
            "has_more": False,
            "first_id": data[0]["id"],
            "last_id": data[-1]["id"],
        }
        self._send(200, dumps(page))

    def _copilot_token(self) -> None:
        key = self.replay.key
        if key is not None and self.headers.get("Authorization") != f"token {key}":
            return self._send(401, dumps({"message": "Bad credentials"}))
        token = self.replay.mint("copilot")
        self._send(200, copilot_wire.token_reply(token, self.replay.base_url))

    def do_POST(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            return self._fail(WIRES["openai"], 400, "bad Content-Length")
        raw = self.rfile.read(length)  # always read, so the keep-alive stream stays in step
        path, path_model = self._path(), ""
        if path == "/refreshToken":
            return self._kiro_refresh(raw)
        if path in ("/chat/completions",):
            wire = WIRES["openai"]
        elif path == "/messages":
            wire = WIRES["anthropic"]
        elif path == "/api/chat":
            wire = WIRES["ollama"]
        elif path == "/api/show":
            return self._ollama_show(raw)
        elif path == "/generateAssistantResponse":
            wire = WIRES["kiro"]
        elif path in FIM_WIRES:
            wire = FIM_WIRES[path]
            if path == "/completions" and not self.replay.completions:
                self.replay.not_found.append(self.path)
                error = f"Invalid URL (POST {self.path})"  # what OpenAI answers
                return self._fail(wire, 404, error)
        elif match := _GEMINI_CALL.fullmatch(path):
            wire, path_model = WIRES["gemini"], match[1]
            if match[2] != "streamGenerateContent" or self._query().get("alt") != ["sse"]:
                return self._fail(wire, 400, "the replay server streams only, with alt=sse")
        else:
            return self._fail(WIRES["openai"], 404, f"no such endpoint: {self.path}")
        if not self._authorized(wire):
            return None
        try:
            request = msgspec.json.decode(raw)
        except msgspec.DecodeError as e:
            return self._fail(wire, 400, f"request body is not JSON: {e}")
        if not isinstance(request, dict):
            return self._fail(wire, 400, "request body must be a JSON object")
        if path in FIM_WIRES and (
            not isinstance(request.get("prompt", ""), str)
            or not isinstance(request.get("suffix", ""), str)
        ):
            return self._fail(wire, 400, "prompt and suffix must be strings")
        headers = {k.lower(): v for k, v in self.headers.items()}
        model = wire.model(request, path_model) or self.replay.models[0]
        recorded = Recorded(wire.name, self.path, headers, request, model, wire.schema(request))
        if (why := wire.refusal(request)) is not None:
            self.replay.script.record(recorded)
            return self._fail(wire, 400, why)
        n, entry = self.replay.script.take(recorded, wire.user_text(request), model)
        answer = Answer(n, entry, model, wire.prompt_chars(request))
        self._faults = entry
        self._budget = entry.cut_after
        try:
            self._answer(wire, answer, request)
        except _Cut:
            self.close_connection = True
        finally:
            self._faults = None

    def _ollama_show(self, raw: bytes) -> None:
        try:
            name = msgspec.json.decode(raw).get("model", "")
        except (msgspec.DecodeError, AttributeError):
            name = ""
        if name not in self.replay.models:
            return self._send(404, dumps({"error": f"model '{name}' not found"}))
        info = {
            "general.architecture": "replay",
            "replay.context_length": self.replay.context_length,
        }
        self._send(
            200, dumps({"modelfile": "", "parameters": "", "template": "", "model_info": info})
        )

    def _kiro_refresh(self, raw: bytes) -> None:
        try:
            token = msgspec.json.decode(raw).get("refreshToken")
        except (msgspec.DecodeError, AttributeError):
            token = None
        if not token or (self.replay.key is not None and token != self.replay.key):
            return self._send(401, dumps({"message": "Invalid refresh token"}))
        access = self.replay.mint("kiro")
        self._send(
            200, dumps({"accessToken": access, "expiresIn": 3600, "profileArn": "arn:aws:replay"})
        )

    # -- answers

    def _answer(self, wire: Wire, answer: Answer, request: dict[str, Any]) -> None:
        entry = answer.entry
        if entry.first_delay and self.replay._stopping.wait(entry.first_delay):
            self.close_connection = True
            return
        if entry.silent:
            return self._hang()
        if entry.revoke_token:
            self.replay.revoke(self._bearer() or "")
            return self._fail(wire, 401, "unauthorized: token expired")
        headers = [
            (name, str(value))
            for name, value in (
                ("Retry-After", entry.retry_after),
                ("retry-after-ms", entry.retry_after_ms),
            )
            if value is not None
        ]
        headers += entry.headers.items()
        if entry.flood is not None:
            return self._flood(wire, entry, headers)
        if entry.raw is not None:
            return self._raw(wire, entry, headers)
        if entry.body is not None:
            return self._send(entry.status, entry.body.encode(), headers)
        if entry.status != 200 and not entry.in_stream:
            body, extra = wire.error_body(entry.status, entry)
            return self._send(entry.status, body, headers + extra)
        if wire.streaming(request):
            return self._stream(wire, answer, request, headers)
        completion = wire.complete(answer, request)
        if entry.hang:
            self._hang()
        elif entry.drop_after is not None:
            self._drop()
        elif entry.garbage is not None:
            self._send(200, entry.garbage.encode(), headers)
        elif completion is None:
            self._fail(wire, 400, "the replay server answers this API only with streams")
        else:
            self._send(200, completion, headers)

    def _start_stream(
        self, content_type: str, headers: list[tuple[str, str]], status: int = 200
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()

    def _stream(
        self, wire: Wire, answer: Answer, request: dict[str, Any], headers: list[tuple[str, str]]
    ) -> None:
        entry = answer.entry
        self._start_stream(wire.content_type, headers)
        plan = wire.stream(answer, request)
        if entry.garbage is not None:
            self._chunk(wire.garbage(entry.garbage))
            return self._end(wire, entry, [f.data for f in plan.tail[-1:]])
        limit = entry.hang_after if entry.hang else entry.drop_after
        on_send = self.replay.on_send
        counted = 0
        keepalive = wire.keepalive() if entry.keepalive else None
        for frame in plan.frames:
            if frame.counted:
                if counted == limit:
                    break
                if counted and entry.delay and self.replay._stopping.wait(entry.delay):
                    self.close_connection = True
                    return
                if counted and keepalive:
                    self._chunk(keepalive)
                counted += 1
            self._chunk(frame.data)
            if frame.text and on_send is not None:
                on_send(frame.text, time.monotonic())
        if entry.hang:
            return self._hang()
        if entry.status != 200:  # in_stream: the error instead of the rest of the reply
            self._chunk(wire.stream_error(entry.status, entry))
            self.wfile.write(b"0\r\n\r\n")
            return None
        if entry.drop_after is not None:
            return self._drop()
        self._end(wire, entry, [f.data for f in plan.tail])

    def _flood(self, wire: Wire, entry: Entry, headers: list[tuple[str, str]]) -> None:
        """One payload that never ends (a stream's, or an error body's with ``status``):
        ``flood`` bytes of it, made as they go out, until the client hangs up (which is
        what it should do)."""
        size = entry.flood or 0
        piece = b"x" * min(size, 1 << 20)
        try:
            if entry.status == 200:
                self._start_stream(wire.content_type, headers)
                head = wire.flood_head(size)
            else:
                self._start_stream("application/json", headers, entry.status)
                head = b'{"error": {"message": "'
            self._chunk(head)
            for sent in range(0, size, len(piece)):
                self._chunk(piece[: size - sent])
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client hung up
            self.close_connection = True

    def _end(self, wire: Wire, entry: Entry, frames: list[bytes]) -> None:
        """The last frames and the end of the body (the zero-length HTTP chunk)."""
        if entry.no_final_newline and frames:
            frames[-1] = wire.trim(frames[-1])
        for data in frames:
            self._chunk(data)
        self.wfile.write(b"0\r\n\r\n")

    def _raw(self, wire: Wire, entry: Entry, headers: list[tuple[str, str]]) -> None:
        raw = entry.raw or b""
        self._start_stream(entry.content_type or wire.content_type, headers, entry.status)
        size = entry.raw_chunk or max(len(raw), 1)
        end = len(raw) if entry.drop_after is None else min(entry.drop_after, len(raw))
        for i in range(0, end, size):
            self._chunk(raw[i : min(i + size, end)])
        if entry.drop_after is not None:
            return self._drop()
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, data: bytes) -> None:
        """Write one HTTP chunk (the socket writer is unbuffered: it leaves at once)."""
        if data:
            self._body(data, framed=True)

    def _body(self, data: bytes, *, framed: bool) -> None:
        """Every byte of a body leaves here, so the byte-level faults (``cut_after``,
        ``byte_delay``) apply to any answer, whatever its shape; ``framed`` data goes out
        as HTTP chunks. Raises ``_Cut`` once the connection was dropped on purpose."""
        entry = self._faults
        if entry is None or (entry.cut_after is None and not entry.byte_delay):
            self.wfile.write(b"%x\r\n%b\r\n" % (len(data), data) if framed else data)
            return
        size = len(data)
        if self._budget is not None and self._budget < size:
            data, cut = data[: self._budget], True
        else:
            cut = False
        if self._budget is not None:
            self._budget -= len(data)
        if entry.byte_delay:
            for i in range(len(data)):
                byte = data[i : i + 1]
                self.wfile.write(b"1\r\n%b\r\n" % byte if framed else byte)
                if self.replay._stopping.wait(entry.byte_delay):
                    raise _Cut
        elif framed:
            # the chunk's full size is announced, then only part of it comes
            self.wfile.write(b"%x\r\n%b" % (size, data) + (b"" if cut else b"\r\n"))
        else:
            self.wfile.write(data)
        if cut:
            self._drop()
            raise _Cut

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


class ReplayServer:
    """The replay server, served from background threads (no event loop involved).

    ``script`` is a list of entries, script text (``str``) or a script file (``Path``).
    ``completions=False`` makes ``/v1/completions`` answer 404 (a server without it).
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
        completions: bool = True,
    ) -> None:
        if not models:
            raise ValueError("at least one model name is needed")
        if isinstance(script, Path):
            try:
                script = parse_script(script.read_text())
            except ValueError as e:
                raise ValueError(f"{script}: {e}") from None
        elif isinstance(script, str):
            script = parse_script(script)
        self.script = Script(script or (), then)
        self._address = (bind_host(host), port)
        self.models = tuple(models)
        self.context_length = context_length
        self.key = key
        self.on_send = on_send
        # False: /v1/completions answers 404, as a server that has only chat completions.
        self.completions = completions
        self.not_found: list[str] = []  # the paths of those 404s, in order
        self._tokens: dict[str, set[str]] = {"copilot": set(), "kiro": set()}
        self._token_counter = itertools.count(1)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.accepted = 0  # TCP connections accepted so far (keep-alive tests count them)

    @property
    def then(self) -> str:
        return self.script.then

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("the replay server is not running")
        return self._httpd.server_port

    @property
    def base_url(self) -> str:
        """``http://host:port``, the root every wire's paths hang from."""
        host = self._address[0]
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI-style base URL (``.../v1``)."""
        return f"{self.base_url}/v1"

    def settings(self) -> dict[str, str]:
        """The ``OLLIE_*`` settings that point every backend at this server (keys included
        when the server has one)."""
        base = self.base_url
        out = {
            "OLLIE_OPENAI_URL": f"{base}/v1",
            "OLLIE_ANTHROPIC_URL": base,
            "OLLIE_OLLAMA_URL": base,
            "OLLIE_GEMINI_URL": base,
            "OLLIE_COPILOT_URL": base,
            "OLLIE_COPILOT_TOKEN_URL": f"{base}{copilot_wire.TOKEN_PATH}",
            "OLLIE_KIRO_URL": base,
            "OLLIE_KIRO_AUTH_URL": f"{base}/refreshToken",
        }
        if self.key is not None:
            for name in ("OPENAI", "ANTHROPIC", "OLLAMA", "GEMINI", "COPILOT", "KIRO"):
                out[f"OLLIE_{name}_KEY"] = self.key
        return out

    @property
    def requests(self) -> list[dict[str, Any]]:
        """A snapshot of the model request bodies received so far (every wire)."""
        return [r.body for r in self.script.recorded]

    @property
    def recorded(self) -> list[Recorded]:
        """The model requests received so far, with their wire, path and headers."""
        return self.script.recorded

    def wait_connections(self, cond: Callable[[int], bool], timeout: float = 30) -> None:
        """Wait until ``cond`` holds of the number of TCP connections open (woken as each
        comes and goes: a client that gave up a request closes its connection)."""
        httpd = self._httpd
        if httpd is None:
            raise RuntimeError("the replay server is not running")
        with httpd.conn_changed:
            if not httpd.conn_changed.wait_for(lambda: cond(len(httpd.connections)), timeout):
                raise AssertionError(f"connections: still {len(httpd.connections)}")

    def wait_recorded(
        self, cond: Callable[[list[Recorded]], bool], timeout: float = 30
    ) -> list[Recorded]:
        """Wait until ``cond`` holds of the model requests received (woken by each)."""
        return self.script.wait_recorded(cond, timeout)

    def add(self, entries: Iterable[Entry]) -> None:
        """Append entries to the script while the server runs."""
        self.script.add(entries)

    def mint(self, kind: str) -> str:
        """A fresh short-lived token of ``kind`` (``copilot``, ``kiro``) this server accepts."""
        with self._lock:
            token = f"{kind}-replay-token-{next(self._token_counter)}"
            self._tokens[kind].add(token)
        return token

    def revoke(self, token: str) -> None:
        """Stop accepting a token this server minted (``revoke_token``)."""
        with self._lock:
            for tokens in self._tokens.values():
                tokens.discard(token)

    def minted(self, kind: str) -> set[str]:
        with self._lock:
            return set(self._tokens[kind])

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
            threads = list(httpd.threads)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by its handler
        for t in threads:
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
