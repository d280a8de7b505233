"""A lean HTTP/1.1 transport for httpx, on trio: one body chunk per network read.

httpx stays the client every backend talks to (requests, headers, timeouts, status,
content decoding, errors), and h11 reads the HTTP/1.1 (the reply's status line, headers,
framing, chunked coding, keep-alive); this module replaces only httpcore, which sits
between them, for the one kind of exchange a model backend makes: an HTTP/1.1 request to
a provider, whose reply streams for as long as the model writes. The request head is
written here (``request_head``, from the headers httpx prepared and checked): h11's
writer checks them all again, and measured, that put a tenth on a prompt's way to the
provider; h11 is then told of the request only what its reading of the reply needs
(``sent``), after the request is out.

Why. httpcore hands the body up one HTTP chunk at a time, through a chain of async
generators, and a provider sends every SSE event as a chunk of its own. So 50 deltas
that arrived in one network read still went up the chain, through the parser, the
agent, the journal and every reader's wake-up fifty times, and ``coalesce`` (which merges
what the parser read from one chunk) never saw more than one. Worse, a session that had
fallen behind did all that for everything buffered in its socket within one trio step:
with 200 streaming sessions the steps grew to seconds, and the daemon, busy at 100% of a
core, delivered 1% of the tokens. Here each network read becomes exactly one body chunk
(everything h11 decodes from it, joined): the per-token work above the transport is paid
once per read, a session that falls behind catches up in bigger reads, and a token that
arrives alone still goes up at once. A request is one ``send_all`` of its head and body.

Scope, and what falls back. HTTP/1.1 over TCP or TLS (ALPN ``http/1.1``), keep-alive
with a pool per origin; bodies framed as h11 reads them (``Content-Length``, chunked
coding with its extensions and trailers read and dropped, or the connection's end); 1xx
replies skipped; a reply head (or a chunk-size or trailer line) longer than
``MAX_HEAD`` is refused. A backend whose URL a proxy setting covers
(``HTTP(S)_PROXY``/``ALL_PROXY``, ``NO_PROXY``) gets httpx's own transport instead
(``transport_for``): proxies are httpcore's business.

Errors are httpx's own classes (``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``,
``ReadError``, ``WriteError``, ``WriteTimeout``, ``RemoteProtocolError`` for what h11
refuses in a reply or a reply cut short), so the backends' error mapping
(``stream.transport_error``) reads them as it reads httpcore's.

Connections. A connection goes back to the pool only when h11 says both sides are done
with the exchange and may go on (neither said ``Connection: close``, the reply was not
HTTP/1.0 nor framed by the connection's end) and nothing follows the reply; it is
dropped when idle longer than ``keepalive_expiry``, and, when taken from the pool, if
the socket is readable (the server closed it, or sent what nobody asked for), so a
request is not written to a connection known to be dead. One that the server closes
while the request is on its way fails the request (``RemoteProtocolError``); the agent
retries such errors.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import time
import urllib.request
from collections.abc import AsyncGenerator, Iterator

import h11
import httpx
import trio
from h11._readers import ChunkedReader as _ChunkedReader

# One receive: large enough that a stream that fell behind catches up in few reads (each
# read costs the same above this module however much it holds), and a 10 MB reply is a
# few dozen of them.
RECEIVE_SIZE = 256 * 1024
# The most h11 holds while it waits for the rest of one piece of framing: the status line
# and headers of a reply, a chunk-size line, the trailers (h11's own default is 16 KiB).
MAX_HEAD = 64 * 1024
KEEPALIVE_SECONDS = 55.0
MAX_IDLE = 256

# What h11 says of a body cut inside a chunk-size or trailer line, said as it says it of
# one cut inside a chunk's data (and as httpcore said it).
INCOMPLETE_CHUNKED = (
    "peer closed connection without sending complete message body (incomplete chunked read)"
)


# ---- HTTP/1.1 through h11 (pure: no I/O, unit-tested by itself) ----------------------------


def exchange() -> h11.Connection:
    """The h11 state of one request and its reply."""
    return h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)


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


def sent(request: httpx.Request) -> h11.Connection:
    """The h11 state of an exchange whose request went out (written by ``request_head``:
    h11's own writer checks every header again, a tenth of a prompt's way to the
    provider). h11 is told only what its reading of the reply depends on: the method
    (a reply to HEAD has no body) and whether the request said ``Connection: close``."""
    h = exchange()
    headers = [(b"host", request.url.netloc or b"_")]
    if "close" in [
        t.strip().lower() for t in request.headers.get_list("connection", split_commas=True)
    ]:
        headers.append((b"connection", b"close"))
    h.send(h11.Request(method=request.method, target=b"/", headers=headers))
    h.send(h11.EndOfMessage())
    return h


def next_head(h: h11.Connection) -> h11.Response | None:
    """The reply's final head once h11 has all of it (1xx replies skipped); None while
    it needs more bytes. What follows the head stays in ``h`` for ``body_piece``."""
    while True:
        event = h.next_event()
        if type(event) is h11.Response:
            return event
        if event is h11.NEED_DATA:
            return None
        if type(event) is not h11.InformationalResponse:
            raise h11.RemoteProtocolError(f"unexpected {type(event).__name__} before a reply")


def body_piece(h: h11.Connection) -> tuple[bytes, bool]:
    """Every body byte h11 can decode from what it was given so far, as one ``bytes``,
    and whether the body ended (trailers are read and dropped).

    h11 gives one ``Data`` per HTTP chunk (per ``receive_data`` for other framings); a
    read that holds many chunks, the common case of a stream that fell behind, becomes
    one piece here. Raises ``h11.RemoteProtocolError`` for broken framing or a body cut
    short (``receive_data(b"")`` says the connection ended).
    """
    first: bytes | None = None
    more: list[bytes] | None = None
    while True:
        try:
            event = h.next_event()
        except h11.RemoteProtocolError as exc:
            if h.trailing_data[1] and str(exc) == "peer unexpectedly closed connection":
                raise h11.RemoteProtocolError(INCOMPLETE_CHUNKED) from exc
            raise
        kind = type(event)
        if kind is h11.Data:
            data = event.data  # type: ignore[union-attr]
            if first is None:
                first = data
            elif more is None:
                more = [first, data]
            else:
                more.append(data)
            continue
        if kind is h11.EndOfMessage:
            done = True
        elif event is h11.NEED_DATA:
            done = False
        else:
            raise h11.RemoteProtocolError(f"unexpected {kind.__name__} in a reply's body")
        if more is not None:
            return b"".join(more), done
        return (b"" if first is None else bytes(first)), done


_HEX = b"0123456789abcdefABCDEF"


def received(h: h11.Connection, data: bytes) -> tuple[bytes, bool]:
    """``h.receive_data(data)`` then ``body_piece(h)``, the same result, faster for the
    common chunked body: complete chunks of the plainest form (a size of 1 to 16 hex
    digits, CRLF, the data, CRLF) are cut out here in one loop; the first thing of any
    other form (an extension, the last chunk and its trailers, a chunk the read holds
    only part of, anything malformed) and all that follows it in the read go to h11,
    which then stands exactly at that chunk's start, as if it had read the chunks before.

    Why: a stream that fell behind gets many chunks in one read, and h11 decodes each
    through a dozen calls of its own (with 1,000 streaming sessions, its chunk reading
    was half of the daemon's time). h11 keeps every decision but this one: the head,
    the framing, the end, trailers, errors, whether the connection can be reused. Its
    chunk reader's state is only looked at (``_reader``): with any other h11 the whole
    read is h11's, as before."""
    reader = getattr(h, "_reader", None)
    if (
        type(reader) is not _ChunkedReader
        or getattr(reader, "_reading_trailer", True)
        or h.their_state is not h11.SEND_BODY
        or h.trailing_data[0]  # a size line h11 has begun
    ):
        h.receive_data(data)
        return body_piece(h)
    out: list[bytes] = []
    left = reader._bytes_in_chunk  # (its CRLF is owed once they have come)
    need = left + 2 if left else len(reader._bytes_to_discard)
    if need:  # the rest of a chunk h11 has begun: h11's
        if need >= len(data):
            h.receive_data(data)
            return body_piece(h)
        h.receive_data(data[:need])
        piece, done = body_piece(h)
        out.append(piece)
        data = data[need:]
    pos, end = 0, len(data)
    find = data.find
    while True:
        eol = find(b"\r\n", pos, pos + 18)
        if eol <= pos:
            break
        size_hex = data[pos:eol]
        if size_hex.translate(None, _HEX):
            break  # an extension, white space, no hex: h11's to read or refuse
        size = int(size_hex, 16)
        stop = eol + 2 + size
        if size == 0 or stop + 2 > end or data[stop : stop + 2] != b"\r\n":
            break  # the last chunk, one not all here, a broken footer: h11's
        out.append(data[eol + 2 : stop])
        pos = stop + 2
    done = False
    if pos < end:
        h.receive_data(data[pos:] if pos else data)
        piece, done = body_piece(h)
        out.append(piece)
    return (out[0] if len(out) == 1 else b"".join(out)), done


def reusable(h: h11.Connection) -> bool:
    """Whether the connection may carry another exchange after this one: both sides are
    done, neither said ``Connection: close`` (nor is HTTP/1.0), the server has not
    closed it (a body read to the connection's end leaves h11 DONE too), and nothing
    came after the reply."""
    return h.our_state is h11.DONE and h.their_state is h11.DONE and h.trailing_data == (b"", False)


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

    __slots__ = ("drained", "expires", "received", "sock", "tls")

    def __init__(self, sock: socket.socket, tls: trio.SSLStream[trio.SocketStream] | None) -> None:
        self.sock = sock
        self.tls = tls
        self.expires = 0.0
        self.received = 0  # bytes received in all
        self.drained = False

    def stale(self) -> bool:
        """Closed by the server while idle (or holding bytes nobody asked for)."""
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
            sock, waited = self.sock, self.drained
            if waited:  # the last read took all there was: wait before asking again
                await self._readable(timeout)
            while True:
                try:
                    data = sock.recv(RECEIVE_SIZE)
                    break
                except BlockingIOError:
                    pass
                await self._readable(timeout)
                waited = True
            if not waited:
                await trio.lowlevel.checkpoint()  # others run between two reads
            # A read that did not fill the buffer most likely emptied the socket: the
            # next one waits for readiness first rather than failing with EAGAIN (a
            # system call of each token's way); if bytes came meanwhile, the wait
            # returns at once.
            self.drained = 0 < len(data) < RECEIVE_SIZE
        self.received += len(data)
        return data

    async def _readable(self, timeout: float) -> None:
        with trio.CancelScope(deadline=trio.current_time() + timeout) as scope:
            await trio.lowlevel.wait_readable(self.sock)
        if scope.cancelled_caught:
            raise trio.TooSlowError

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
    except _NETWORK as exc:
        raise _network_error(exc, error, request) from exc


def _protocol_error(exc: h11.ProtocolError, request: httpx.Request) -> httpx.TransportError:
    """What h11 refused, as httpx says it: the reply's fault, or the request's."""
    if isinstance(exc, h11.RemoteProtocolError):
        return httpx.RemoteProtocolError(str(exc), request=request)
    return httpx.LocalProtocolError(str(exc), request=request)


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
                h = sent(request)  # (after the send: nothing of it on the way out)
                head = await _read_head(conn, h, request)
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
        return httpx.Response(
            head.status_code,
            headers=head.headers.raw_items(),
            stream=_Body(self, origin, conn, h, request),
            extensions={
                "http_version": b"HTTP/" + head.http_version,
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


async def _read_head(conn: _Connection, h: h11.Connection, request: httpx.Request) -> h11.Response:
    """The next final (non-1xx) reply head; what follows it stays in ``h``."""
    timeout = _timeout(request, "read")
    while True:
        try:
            head = next_head(h)
        except h11.ProtocolError as exc:
            raise _protocol_error(exc, request) from exc
        if head is not None:
            return head
        data = await _receive(conn, request, timeout)
        if not data:
            raise httpx.RemoteProtocolError(
                "server disconnected without sending a response", request=request
            )
        h.receive_data(data)


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
        h: h11.Connection,
        request: httpx.Request,
    ) -> None:
        self._transport = transport
        self._origin = origin
        self._conn: _Connection | None = conn
        self._h = h
        self._request = request
        self._done = False
        self._timeout = _timeout(request, "read")

    async def __aiter__(self) -> AsyncGenerator[bytes, None]:
        conn, h, request = self._conn, self._h, self._request
        if conn is None or self._done:
            return
        timeout = self._timeout
        data: bytes | None = None  # None: only what h11 holds (what came with the head)
        while True:
            try:
                piece, done = body_piece(h) if data is None else received(h, data)
            except h11.ProtocolError as exc:
                raise _protocol_error(exc, request) from exc
            if done:
                self._done = True
                if piece:
                    yield piece
                return
            if piece:
                yield piece
            data = await _receive(conn, request, timeout)
            if not data:  # the connection's end: h11 says what that means for the body
                h.receive_data(data)
                data = None

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        h = self._h
        if not self._done:
            # A body nobody read may be all here already (a 204, a reply to HEAD).
            with contextlib.suppress(h11.ProtocolError):
                self._done = body_piece(h)[1]
        if self._done and reusable(h):
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
