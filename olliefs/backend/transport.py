"""A lean HTTP/1.1 transport for httpx, on trio: one body chunk per network read.

httpx stays the client every backend talks to (requests, headers, timeouts, status,
content decoding, errors); this module replaces only what sits under it, httpcore and h11,
for the one kind of exchange a model backend makes: an HTTP/1.1 request to a provider,
whose reply streams for as long as the model writes.

Why. httpcore hands the body up one HTTP chunk at a time, through a chain of async
generators, and a provider sends every SSE event as a chunk of its own. So 50 deltas
that arrived in one network read still went up the chain, through the parser, the
agent, the journal and every reader's wake-up fifty times, and ``coalesce`` (which merges
what the parser read from one chunk) never saw more than one. Worse, a session that had
fallen behind did all that for everything buffered in its socket within one trio step:
with 200 streaming sessions the steps grew to seconds, and the daemon, busy at 100% of a
core, delivered 1% of the tokens. Here each network read becomes exactly one body chunk
(every complete HTTP chunk in it, decoded, joined): the per-token work above the
transport is paid once per read, a session that falls behind catches up in bigger reads,
and a token that arrives alone still goes up at once. A request is one ``send_all`` of
its head and body.

Scope, and what falls back. HTTP/1.1 over TCP or TLS (ALPN ``http/1.1``), keep-alive
with a pool per origin; bodies framed by ``Content-Length``, chunked coding (extensions
and trailers read and dropped) or the connection's end; 1xx replies skipped. A backend
whose URL a proxy setting covers (``HTTP(S)_PROXY``/``ALL_PROXY``, ``NO_PROXY``) gets
httpx's own transport instead (``transport_for``): proxies are httpcore's business.

Errors are httpx's own classes (``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``,
``ReadError``, ``WriteError``, ``RemoteProtocolError``), so the backends' error mapping
(``stream.transport_error``) reads them as it reads httpcore's.

Connections. A connection goes back to the pool only when its reply was read to the
end and neither side said ``Connection: close``; it is dropped when idle longer than
``keepalive_expiry``, and, when taken from the pool, if the socket is readable (the
server closed it, or sent what nobody asked for), so a request is not written to a
connection known to be dead. One that the server closes while the request is on its way
fails the request (``RemoteProtocolError``); the agent retries such errors.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import time
import urllib.request
from collections.abc import AsyncGenerator, Iterator

import httpx
import trio

# One receive: large enough that a stream that fell behind catches up in few reads (each
# read costs the same above this module however much it holds), and a 10 MB reply is a
# few dozen of them.
RECEIVE_SIZE = 256 * 1024
MAX_HEAD = 64 * 1024  # status line and headers of one reply
MAX_LINE = 4096  # a chunk-size line or a trailer line
KEEPALIVE_SECONDS = 55.0
MAX_IDLE = 256


class ProtocolError(Exception):
    """The peer broke HTTP/1.1 framing (raised as httpx.RemoteProtocolError)."""


# ---- framing (pure: no I/O, unit-tested by itself) ------------------------------------------


def request_head(request: httpx.Request, body_length: int | None) -> bytes:
    """``METHOD target HTTP/1.1`` and the headers httpx prepared (Host included)."""
    lines = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), request.url.raw_path)]
    raw = request.headers.raw
    names = {name.lower() for name, _ in raw}
    lines += [b"%s: %s" % pair for pair in raw]
    if body_length is None and b"transfer-encoding" not in names:
        lines.append(b"Transfer-Encoding: chunked")
    elif body_length is not None and b"content-length" not in names and body_length:
        lines.append(b"Content-Length: %d" % body_length)
    lines.append(b"\r\n")
    return b"\r\n".join(lines)


class Head:
    """A parsed status line and header block."""

    __slots__ = ("headers", "http11", "reason", "status")

    def __init__(
        self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]], http11: bool
    ) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.http11 = http11

    def values(self, name: bytes) -> list[bytes]:
        return [v for k, v in self.headers if k.lower() == name]

    def tokens(self, name: bytes) -> list[bytes]:
        """The comma-separated tokens of every ``name`` header, lowercased."""
        return [t.strip().lower() for v in self.values(name) for t in v.split(b",") if t.strip()]


def parse_head(block: bytes) -> Head:
    """The head of a reply, ``block`` being everything before its blank line."""
    lines = block.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or len(parts[0]) != 8:
        raise ProtocolError(f"bad status line {lines[0][:80]!r}")
    if not (len(parts[1]) == 3 and parts[1].isdigit()):
        raise ProtocolError(f"bad status code {parts[1][:10]!r}")
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
            raise ProtocolError(f"bad header line {line[:80]!r}")
        headers.append((name, value.strip(b" \t")))
    return Head(
        int(parts[1]), parts[2] if len(parts) > 2 else b"", headers, parts[0] == b"HTTP/1.1"
    )


def body_length(head: Head, method: str) -> int | None:
    """Bytes of body after ``head``: a number, -1 for chunked, None for "until close"."""
    if method == "HEAD" or head.status in (204, 304) or 100 <= head.status < 200:
        return 0
    codings = head.tokens(b"transfer-encoding")
    if codings:
        if codings[-1] != b"chunked":
            return None  # RFC 9112 6.3: a final coding other than chunked reads to close
        return -1
    lengths = {v.strip() for v in head.values(b"content-length")}
    if not lengths:
        return None
    if len(lengths) != 1 or not (n := lengths.pop()).isdigit():
        raise ProtocolError("bad Content-Length")
    return int(n)


_HEX = b"0123456789abcdefABCDEF"


class ChunkedDecoder:
    """Chunked transfer coding, decoded incrementally: each ``feed`` returns every data
    byte it completed, as one ``bytes``; ``done`` once the last chunk and trailers are
    read. Bytes past the end of the body are kept in ``rest``.

    A provider sends each event as a chunk of its own, so a read that holds many is the
    common case of a stream that fell behind: whole chunks are cut out with one ``find``
    and two slices each, and only a chunk that a read cut in two takes the slow path.
    """

    __slots__ = ("_buf", "_left", "_trailer", "done", "rest")

    def __init__(self) -> None:
        self._buf = b""  # an unfinished size line, CRLF or trailer line
        self._left = 0  # data bytes of the current chunk still to come, then its CRLF
        self._trailer = False  # the last chunk was read: trailer lines until a blank one
        self.done = False
        self.rest = b""

    def feed(self, data: bytes) -> bytes:
        out: list[bytes] = []
        buf = self._buf + data if self._buf else data
        pos, end = 0, len(buf)
        if self._left:  # the rest of a chunk begun in an earlier read, then its CRLF
            take = min(self._left - 2, end) if self._left > 2 else 0
            if take > 0:
                out.append(buf[:take])
                pos = take
            self._left -= take
            if self._left <= 2:
                tail = buf[pos : pos + self._left]
                if tail != b"\r\n"[2 - self._left : 2 - self._left + len(tail)]:
                    raise ProtocolError("chunk not followed by CRLF")
                pos += len(tail)
                self._left -= len(tail)
        while not self._left and pos < end:
            nl = buf.find(b"\r\n", pos, pos + MAX_LINE + 2)
            if nl < 0:
                if end - pos > MAX_LINE:
                    raise ProtocolError("chunk size line too long")
                break
            line = buf[pos:nl]
            pos = nl + 2
            if self._trailer:
                if not line:
                    self.done = True
                    self.rest = buf[pos:]
                    pos = end
                    break
                continue
            if not line or len(line) > 16 or line.translate(None, _HEX):  # not just a size
                size = line.split(b";", 1)[0].strip(b" \t")
                if not size or len(size) > 16 or size.translate(None, _HEX):
                    raise ProtocolError(f"bad chunk size {line[:40]!r}")
                line = size
            n = int(line, 16)
            if n == 0:
                self._trailer = True
                continue
            stop = pos + n
            if stop + 2 <= end:  # the whole chunk is here
                if buf[stop : stop + 2] != b"\r\n":
                    raise ProtocolError("chunk not followed by CRLF")
                out.append(buf[pos:stop])
                pos = stop + 2
                continue
            take = min(n, end - pos)
            out.append(buf[pos : pos + take])
            pos += take
            self._left = n - take + 2
            if self._left <= 2:  # the data is here, part of its CRLF too
                tail = buf[pos:end]
                if tail != b"\r\n"[: len(tail)]:
                    raise ProtocolError("chunk not followed by CRLF")
                pos = end
                self._left -= len(tail)
        self._buf = buf[pos:] if pos < end and not self._left else b""
        if not out:
            return b""
        return out[0] if len(out) == 1 else b"".join(out)


# ---- connections --------------------------------------------------------------------------


Origin = tuple[str, str, int]


def _origin(url: httpx.URL) -> Origin:
    port = url.port or (443 if url.scheme == "https" else 80)
    return url.scheme, url.host, port


def _timeout(request: httpx.Request, key: str) -> float:
    value = request.extensions.get("timeout", {}).get(key)
    return float("inf") if value is None else float(value)


class _Connection:
    """One connection to an origin: a plain non-blocking socket, or TLS over one.

    Plain TCP reads the socket directly: ``recv`` first, and only when nothing is there
    a park in ``wait_readable`` under the read deadline. So a stream that has bytes
    waiting (one that fell behind) costs one system call and a scheduling point a read,
    and only a read that really waits pays for a cancel scope. (trio's SocketStream does
    the same work through more layers, and a ``fail_after`` per read was a fifth of what
    a streamed token cost.) TLS goes through trio's SSLStream.
    """

    __slots__ = ("buf", "expires", "received", "sock", "tls")

    def __init__(self, sock: socket.socket, tls: trio.SSLStream[trio.SocketStream] | None) -> None:
        self.sock = sock
        self.tls = tls
        self.buf = b""  # received, not consumed yet
        self.expires = 0.0
        self.received = 0  # bytes received in all

    def stale(self) -> bool:
        """Closed by the server while idle (or holding bytes nobody asked for)."""
        if self.buf:
            return True
        # poll, not select: a daemon with a thousand blocked readers has descriptors
        # past select's limit of 1024.
        poller = select.poll()
        try:
            poller.register(self.sock, select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True

    async def receive(self, timeout: float) -> bytes:
        """The next bytes (b"" at the end); ``trio.TooSlowError`` after ``timeout``
        seconds without any."""
        if self.tls is not None:
            with trio.fail_after(timeout):
                data = bytes(await self.tls.receive_some(RECEIVE_SIZE))
        else:
            sock, waited = self.sock, False
            while True:
                try:
                    data = sock.recv(RECEIVE_SIZE)
                    break
                except BlockingIOError:
                    pass
                with trio.CancelScope(deadline=trio.current_time() + timeout) as scope:
                    await trio.lowlevel.wait_readable(sock)
                if scope.cancelled_caught:
                    raise trio.TooSlowError
                waited = True
            if not waited:
                await trio.lowlevel.checkpoint()  # others run between two reads
        self.received += len(data)
        return data

    async def send_all(self, data: bytes, timeout: float) -> None:
        if self.tls is not None:
            with trio.fail_after(timeout):
                await self.tls.send_all(data)
            return
        sock, view = self.sock, memoryview(data)
        while view:
            try:
                view = view[sock.send(view) :]
                continue
            except BlockingIOError:
                pass
            with trio.fail_after(timeout):
                await trio.lowlevel.wait_writable(sock)

    async def close(self) -> None:
        if self.tls is not None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await trio.aclose_forcefully(self.tls)
        else:
            self.close_now()
            await trio.lowlevel.checkpoint()

    def close_now(self) -> None:
        """Close without awaiting (a TLS close_notify is not worth waiting for)."""
        with contextlib.suppress(OSError):
            self.sock.close()


_NETWORK = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)


def _network_error(
    exc: BaseException, error: type[httpx.TransportError], request: httpx.Request
) -> httpx.TransportError:
    return error(
        f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, request=request
    )


@contextlib.contextmanager
def _mapped(request: httpx.Request, error: type[httpx.TransportError]) -> Iterator[None]:
    """Network failures as the httpx error class for this phase of the exchange."""
    try:
        yield
    except ProtocolError as exc:
        raise httpx.RemoteProtocolError(str(exc), request=request) from exc
    except _NETWORK as exc:
        raise _network_error(exc, error, request) from exc


class LeanTransport(httpx.AsyncBaseTransport):
    """An ``httpx.AsyncBaseTransport`` for HTTP/1.1 (see the module's docstring)."""

    def __init__(
        self,
        *,
        verify: ssl.SSLContext | bool = True,
        keepalive_expiry: float = KEEPALIVE_SECONDS,
        max_idle: int = MAX_IDLE,
    ) -> None:
        self._verify = verify
        self._ssl: ssl.SSLContext | None = None
        self._idle: dict[Origin, list[_Connection]] = {}
        self._keepalive = keepalive_expiry
        self._max_idle = max_idle
        # For tests and the bench: connections opened; requests sent again after a kept
        # connection died under them.
        self.connections_made = 0
        self.resent = 0

    # -- the pool

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            verify = self._verify
            ctx = verify if isinstance(verify, ssl.SSLContext) else httpx.create_ssl_context(verify)
            ctx.set_alpn_protocols(["http/1.1"])
            self._ssl = ctx
        return self._ssl

    def _take(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.expires > now and not conn.stale():
                return conn
            conn.close_now()
        return None

    def _give_back(self, origin: Origin, conn: _Connection) -> None:
        if sum(len(v) for v in self._idle.values()) >= self._max_idle:
            conn.close_now()
            return
        conn.expires = time.monotonic() + self._keepalive
        self._idle.setdefault(origin, []).append(conn)

    async def _connect(self, request: httpx.Request, origin: Origin) -> _Connection:
        scheme, host, port = origin
        if scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(f"unsupported scheme {scheme!r}", request=request)
        timeout = _timeout(request, "connect")
        try:
            with trio.fail_after(timeout), _mapped(request, httpx.ConnectError):
                tcp = await trio.open_tcp_stream(host, port)  # happy eyeballs, as httpcore
                sock = socket.socket(fileno=tcp.socket.detach())
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if scheme == "http":
                    conn = _Connection(sock, None)
                else:
                    tls = trio.SSLStream(
                        trio.SocketStream(trio.socket.from_stdlib_socket(sock)),
                        self._ssl_context(),
                        server_hostname=host,
                        https_compatible=True,
                    )
                    conn = _Connection(sock, tls)
                    try:
                        await tls.do_handshake()
                    except BaseException:
                        await conn.close()
                        raise
        except trio.TooSlowError:
            raise httpx.ConnectTimeout(
                f"connecting to {host}:{port} timed out", request=request
            ) from None
        self.connections_made += 1
        return conn

    # -- one exchange

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        origin = _origin(request.url)
        body, length = await _request_body(request)
        data = request_head(request, length) + body
        conn = self._take(origin)
        while True:
            reused = conn is not None
            if conn is None:
                conn = await self._connect(request, origin)
            before = conn.received
            try:
                try:
                    await conn.send_all(data, _timeout(request, "write"))
                except trio.TooSlowError:
                    raise httpx.WriteTimeout("write timed out", request=request) from None
                except _NETWORK as exc:
                    raise _network_error(exc, httpx.WriteError, request) from exc
                head = await _read_head(conn, request)
                n = body_length(head, request.method)
                break
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                await conn.close()
                # A kept connection the server closed as the request went out (its idle
                # timeout): nothing was answered, so the request is sent again, once, on
                # a new connection. A new connection that fails is the server's answer.
                if not reused or conn.received != before:
                    raise
                conn = None
                self.resent += 1
            except BaseException:
                await conn.close()
                raise
        reusable = (
            n is not None
            and head.http11
            and b"close" not in head.tokens(b"connection")
            and "close"
            not in [
                t.strip().lower() for t in request.headers.get_list("connection", split_commas=True)
            ]
        )
        stream = _Body(self, origin, conn, request, n, reusable)
        return httpx.Response(
            head.status,
            headers=head.headers,
            stream=stream,
            extensions={
                "http_version": b"HTTP/1.1" if head.http11 else b"HTTP/1.0",
                "reason_phrase": head.reason,
            },
        )

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                await conn.close()


async def _receive(conn: _Connection, request: httpx.Request, timeout: float) -> bytes:
    try:
        return await conn.receive(timeout)
    except trio.TooSlowError:
        raise httpx.ReadTimeout(f"no byte for {timeout:g} s", request=request) from None
    except _NETWORK as exc:
        raise _network_error(exc, httpx.ReadError, request) from exc


async def _read_head(conn: _Connection, request: httpx.Request) -> Head:
    """The next final (non-1xx) reply head; what follows it stays in ``conn.buf``."""
    while True:
        buf = conn.buf
        while (end := buf.find(b"\r\n\r\n")) < 0:
            if len(buf) > MAX_HEAD:
                raise httpx.RemoteProtocolError("reply head too long", request=request)
            data = await _receive(conn, request, _timeout(request, "read"))
            if not data:
                raise httpx.RemoteProtocolError(
                    "server disconnected without sending a response", request=request
                )
            buf += data
        with _mapped(request, httpx.ReadError):
            head = parse_head(buf[:end])
        conn.buf = buf[end + 4 :]
        if not 100 <= head.status < 200:
            return head


async def _request_body(request: httpx.Request) -> tuple[bytes, int | None]:
    """The whole body, and its length (None: it streams, so it goes chunked)."""
    stream = request.stream
    if isinstance(stream, httpx.ByteStream):
        data = b"".join([part async for part in stream])
        return data, len(data)
    parts = [part async for part in stream]  # type: ignore[union-attr]
    if request.headers.get("content-length") is not None:
        data = b"".join(parts)
        return data, len(data)
    chunked = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in parts if p) + b"0\r\n\r\n"
    return chunked, None


class _Body(httpx.AsyncByteStream):
    """A reply's body: one decoded chunk per network read."""

    def __init__(
        self,
        transport: LeanTransport,
        origin: Origin,
        conn: _Connection,
        request: httpx.Request,
        length: int | None,
        reusable: bool,
    ) -> None:
        self._transport = transport
        self._origin = origin
        self._conn: _Connection | None = conn
        self._request = request
        self._length = length
        self._reusable = reusable
        self._done = length == 0
        self._timeout = _timeout(request, "read")

    async def __aiter__(self) -> AsyncGenerator[bytes, None]:
        conn, request = self._conn, self._request
        if conn is None or self._done:
            return
        length = self._length
        if length == -1:
            decoder = ChunkedDecoder()
            data, conn.buf = conn.buf, b""
            while True:
                if data:
                    try:
                        out = decoder.feed(data)
                    except ProtocolError as exc:
                        raise httpx.RemoteProtocolError(str(exc), request=request) from exc
                    if decoder.done:
                        conn.buf = decoder.rest
                        self._done = True
                        if out:
                            yield out
                        return
                    if out:
                        yield out
                data = await _receive(conn, request, self._timeout)
                if not data:
                    raise httpx.RemoteProtocolError(
                        "peer closed connection without sending complete message body "
                        "(incomplete chunked read)",
                        request=request,
                    )
        elif length is None:  # until the server closes
            data, conn.buf = conn.buf, b""
            while True:
                if data:
                    yield data
                data = await _receive(conn, request, self._timeout)
                if not data:
                    self._done = True
                    return
        else:
            left = length
            data, conn.buf = conn.buf, b""
            while True:
                if data:
                    take = data[:left] if len(data) > left else data
                    left -= len(take)
                    if left == 0:
                        conn.buf = data[len(take) :]
                        self._done = True
                        yield take
                        return
                    yield take
                data = await _receive(conn, request, self._timeout)
                if not data:
                    raise httpx.RemoteProtocolError(
                        f"peer closed connection without sending complete message body "
                        f"(received {length - left} of {length} bytes)",
                        request=request,
                    )

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and self._reusable and not conn.buf:
            self._transport._give_back(self._origin, conn)
        else:
            await conn.close()


def direct_body(response: httpx.Response) -> AsyncGenerator[bytes, None] | None:
    """The body of a reply this transport read, as it comes off the network, when
    there is no content coding for httpx to undo; None otherwise. (httpx's own reading
    passes each piece through three more generators and a chunker: a few microseconds
    of every token's way to a reader.)"""
    stream = response.stream
    coding = response.headers.get("content-encoding", "identity").strip().lower()
    if not isinstance(stream, _Body) or coding not in ("", "identity"):
        return None
    return stream.__aiter__()


def proxied(url: str) -> bool:
    """Whether the environment's proxy settings cover ``url`` (as httpx would read them)."""
    u = httpx.URL(url)
    proxies = urllib.request.getproxies_environment()
    if not (proxies.get(u.scheme) or proxies.get("all")):
        return False
    bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]
    return not bypass(u.host or "", proxies)


def transport_for(base_url: str) -> httpx.AsyncBaseTransport | None:
    """The transport for a backend at ``base_url``: ours, or None (httpx's own, which
    reads the proxy settings) when a proxy covers it."""
    return None if proxied(base_url) else LeanTransport()
