"""The lean HTTP/1.1 transport against a real loopback server that writes exact bytes.

Each test's server is a handler that reads requests off a real socket and writes what the
test says: framings, keep-alive, a server closing an idle connection, truncated bodies,
silence, TLS. The client is httpx's AsyncClient over ``LeanTransport``, as the backends
use it.
"""

from __future__ import annotations

import gzip
import os
import re
import resource
import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import trio

from olliefs.backend.base import TransientError
from olliefs.backend.stream import transport_error
from olliefs.backend.transport import LeanTransport, direct_body, transport_for
from olliefs.testing import recv_request

# handler(conn, request head, number of the request on this connection, connection number)
Handler = Callable[[socket.socket, bytes, int, int], None]


class RawServer:
    """Accepts connections; reads each request (head and Content-Length body) and hands
    it to ``handler``; a handler that closes the socket ends that connection."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.handler = handler
        self.tls = tls
        self.accepted = 0
        self.requests: list[bytes] = []
        self.threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            n = self.accepted
            self.accepted += 1
            t = threading.Thread(target=self._serve, args=(conn, n), daemon=True)
            self.threads.append(t)
            t.start()

    def _serve(self, raw: socket.socket, n: int) -> None:
        conn = raw
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(raw, server_side=True)
            buf = b""
            for i in range(1000):
                got = recv_request(conn, buf)
                if got is None:
                    return
                request, buf = got
                self.requests.append(request.head + b"\r\n\r\n" + request.body)
                self.handler(conn, request.head, i, n)
                if conn.fileno() < 0:
                    return
        except (OSError, ssl.SSLError):
            return
        finally:
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def serve() -> Iterator[Callable[..., RawServer]]:
    made: list[RawServer] = []

    def make(handler: Handler, tls: ssl.SSLContext | None = None) -> RawServer:
        srv = RawServer(handler, tls)
        made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.close()


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def client(transport: LeanTransport, read: float = 5.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(read, connect=5.0))


async def test_framings(serve: Callable[..., RawServer]) -> None:
    replies = [
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
        CHUNKED_HEAD + chunked(b"hel", b"lo"),
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n0\r\nX-Trailer: t\r\n\r\n",
    ]

    def handler(conn: socket.socket, head: bytes, i: int, n: int) -> None:
        conn.sendall(replies[i])

    srv = serve(handler)
    async with client(LeanTransport()) as c:
        bodies = [(await c.get(srv.url + "/x")).content for _ in replies]
    assert bodies == [b"hello", b"hello", b"hello", b"", b"hello"]
    assert srv.accepted == 1  # all on one kept-alive connection
    assert srv.requests[0].startswith(b"GET /x HTTP/1.1\r\n")


async def test_body_until_close_and_connection_close(serve: Callable[..., RawServer]) -> None:
    def handler(conn: socket.socket, head: bytes, i: int, n: int) -> None:
        if b"until-close" in head:
            conn.sendall(b"HTTP/1.1 200 OK\r\n\r\nall of it")
        else:
            conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
        conn.shutdown(socket.SHUT_RDWR)
        conn.close()

    srv = serve(handler)
    t = LeanTransport()
    async with client(t) as c:
        assert (await c.get(srv.url + "/until-close")).content == b"all of it"
        assert (await c.get(srv.url + "/closing")).content == b"ok"
        assert (await c.get(srv.url + "/closing")).content == b"ok"
    assert srv.accepted == 3 and t.connections_made == 3  # none was reused


async def test_one_network_read_is_one_chunk(serve: Callable[..., RawServer]) -> None:
    """The point of the transport: 300 HTTP chunks in one write reach the reader as one
    piece (a backend then parses and reports them as one delta); chunks sent apart in
    time arrive apart."""
    go = threading.Event()

    def handler(conn: socket.socket, head: bytes, i: int, n: int) -> None:
        conn.sendall(CHUNKED_HEAD + b"".join(b"4\r\ntok|\r\n" for _ in range(300)))
        go.wait(10)
        conn.sendall(b"3\r\nend\r\n0\r\n\r\n")

    srv = serve(handler)
    async with client(LeanTransport()) as c, c.stream("POST", srv.url, content=b"{}") as r:
        pieces = []
        async for piece in r.aiter_raw():
            pieces.append(piece)
            go.set()
    assert pieces == [b"tok|" * 300, b"end"]


async def test_idle_connection_closed_by_server_is_not_used(
    serve: Callable[..., RawServer],
) -> None:
    def handler(conn: socket.socket, head: bytes, i: int, n: int) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        conn.shutdown(socket.SHUT_RDWR)  # the server's idle timeout, at once
        conn.close()

    srv = serve(handler)
    t = LeanTransport()
    async with client(t) as c:
        assert (await c.get(srv.url)).content == b"ok"
        # the pooled connection is readable (EOF): seen as closed when taken
        await trio.to_thread.run_sync(srv.threads[0].join, 10)
        assert not srv.threads[0].is_alive()
        assert (await c.get(srv.url)).content == b"ok"
    assert t.connections_made == 2
    assert t.resent == 0  # not written to the dead one and sent again: never written there


async def test_reused_connection_dying_before_a_reply_is_retried_once(
    serve: Callable[..., RawServer],
) -> None:
    """A kept connection the server drops as the request arrives (its idle timeout
    racing our request): sent again on a new one. On a new connection the same is the
    server's answer, an error."""

    def handler(conn: socket.socket, head: bytes, i: int, n: int) -> None:
        if (n == 0 and i == 1) or b"/always" in head:
            conn.close()  # read the request, answer nothing
            return
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    srv = serve(handler)
    t = LeanTransport()
    async with client(t) as c:
        assert (await c.get(srv.url)).content == b"ok"
        assert (await c.get(srv.url)).content == b"ok"  # conn 0 died; sent on conn 1
        assert t.connections_made == 2 and t.resent == 1
        with pytest.raises(httpx.RemoteProtocolError):
            await c.get(srv.url + "/always")
    assert len(srv.requests) == 5  # 1, 2 (dropped), 2 again, /always twice (kept, new)


CUT_CHUNKED = "without sending complete message body (incomplete chunked read)"


@pytest.mark.parametrize(
    ("reply", "says"),
    [
        (CHUNKED_HEAD + b"5\r\nhel", CUT_CHUNKED),  # inside a chunk's data
        (CHUNKED_HEAD + b"5\r\nhello\r", CUT_CHUNKED),  # inside the CRLF after it
        (CHUNKED_HEAD + b"5\r\nhello\r\n1", CUT_CHUNKED),  # inside a size line
        (CHUNKED_HEAD + b"5\r\nhello\r\n1;a=", CUT_CHUNKED),  # inside an extension
        (CHUNKED_HEAD + b"5\r\nhello\r\n0\r\nX-T: 1", CUT_CHUNKED),  # inside the trailers
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello",
            "peer closed connection without sending complete message body",
        ),
        (b"HTTP/1.1 200 OK\r\nContent-Le", "server disconnected without sending a response"),
    ],
)
async def test_truncated_replies(serve: Callable[..., RawServer], reply: bytes, says: str) -> None:
    """A reply the server cuts short, wherever: httpx's RemoteProtocolError saying so,
    which the backends take for a network error worth a retry."""

    def handler(conn: socket.socket, head: bytes, i: int, n: int) -> None:
        conn.sendall(reply)
        conn.close()

    srv = serve(handler)
    async with client(LeanTransport()) as c:
        with pytest.raises(httpx.RemoteProtocolError, match=re.escape(says)) as caught:
            await c.get(srv.url)
    error = transport_error(caught.value, "openai")
    assert isinstance(error, TransientError) and says in str(error)


async def test_odd_chunk_framing_a_byte_a_write(serve: Callable[..., RawServer]) -> None:
    """Chunk extensions of every odd kind and trailers, sent a byte a write (reads then
    split the framing anywhere): the body whole, and the trailers read to their end, so
    the connection carries the next request."""
    wire = (
        b"5;x=1\r\nhello\r\n"
        b'6; name="v;w\\"x"\r\n world\r\n'
        b"1;a;b=;;\r\n!\r\n"
        b"00a  \r\n0123456789\r\n"
        b"0;last=1\r\nX-Trailer: t\r\nServer-Timing: total;dur=2\r\n\r\n"
    )

    def handler(conn: socket.socket, head: bytes, i: int, n: int) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(CHUNKED_HEAD)
        for k in range(len(wire)):
            conn.sendall(wire[k : k + 1])

    srv = serve(handler)
    t = LeanTransport()
    async with client(t) as c:
        for _ in range(2):
            assert (await c.get(srv.url)).content == b"hello world!0123456789"
    assert srv.accepted == 1 and t.connections_made == 1


@pytest.mark.parametrize(
    "reply", [b"HTTP/1.1 200 OK\r\nbroken header\r\n\r\n", CHUNKED_HEAD + b"xyz\r\n"]
)
async def test_garbage_is_a_protocol_error(serve: Callable[..., RawServer], reply: bytes) -> None:
    def handler(conn: socket.socket, head: bytes, i: int, n: int) -> None:
        conn.sendall(reply)

    srv = serve(handler)
    async with client(LeanTransport()) as c:
        with pytest.raises(httpx.RemoteProtocolError):
            await c.get(srv.url)


async def test_read_timeout_and_cancel(serve: Callable[..., RawServer]) -> None:
    hold = threading.Event()

    def handler(conn: socket.socket, head: bytes, i: int, n: int) -> None:
        conn.sendall(CHUNKED_HEAD + b"2\r\nhi\r\n")
        hold.wait(20)  # then silence: the model hung mid-reply

    srv = serve(handler)
    t = LeanTransport()
    try:
        async with client(t, read=0.2) as c:
            async with c.stream("GET", srv.url) as r:
                with pytest.raises(httpx.ReadTimeout):
                    async for _ in r.aiter_raw():
                        pass
            # cancelled while waiting (ctl stop): the connection is dropped, not pooled
            with trio.move_on_after(0.2):
                async with c.stream("GET", srv.url) as r:
                    async for _ in r.aiter_raw():
                        pass
        assert t.connections_made == 2 and not any(t._idle.values())
    finally:
        hold.set()


async def test_connect_refused() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    async with client(LeanTransport()) as c:
        with pytest.raises(httpx.ConnectError):
            await c.get(f"http://127.0.0.1:{port}/")


async def test_gzip_body_decoded_by_httpx(serve: Callable[..., RawServer]) -> None:
    body = gzip.compress(b"zipped " * 100)

    def handler(conn: socket.socket, head: bytes, i: int, n: int) -> None:
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body)
        )

    srv = serve(handler)
    async with client(LeanTransport()) as c:
        assert (await c.get(srv.url)).content == b"zipped " * 100


@pytest.fixture
def certs(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip(reason="needs the openssl command to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"),
            *("-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
    )
    return key, cert


async def test_tls(serve: Callable[..., RawServer], certs: tuple[Path, Path]) -> None:
    key, cert = certs
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    def handler(conn: socket.socket, head: bytes, i: int, n: int) -> None:
        conn.sendall(CHUNKED_HEAD + chunked(b"secret ", b"stream"))

    srv = serve(handler, tls=server_ctx)
    trusted = ssl.create_default_context(cafile=str(cert))
    t = LeanTransport(verify=trusted)
    async with client(t) as c:
        assert (await c.get(srv.url)).content == b"secret stream"
        assert (await c.get(srv.url)).content == b"secret stream"
    assert t.connections_made == 1
    # the system's trust store does not know this certificate: refused at the handshake
    async with client(LeanTransport()) as c:
        with pytest.raises(httpx.ConnectError):
            await c.get(srv.url)


def test_proxy_settings_choose_httpx_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    assert isinstance(transport_for("https://api.openai.com/v1"), LeanTransport)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert transport_for("https://api.openai.com/v1") is None
    assert isinstance(transport_for("http://127.0.0.1:11434"), LeanTransport)  # not https
    monkeypatch.setenv("NO_PROXY", "api.openai.com")
    assert isinstance(transport_for("https://api.openai.com/v1"), LeanTransport)


async def test_kept_connection_reused_above_descriptor_1024(
    serve: Callable[..., RawServer],
) -> None:
    """A daemon with a thousand blocked readers holds descriptors past 1024, where
    select() cannot look: a kept connection there is still checked and reused."""

    def handler(conn: socket.socket, head: bytes, i: int, n: int) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    srv = serve(handler)

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1200:
        pytest.skip(reason=f"the descriptor limit ({hard}) is below 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    filler = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    try:
        t = LeanTransport()
        async with client(t) as c:
            for _ in range(3):
                assert (await c.get(srv.url)).content == b"ok"
        assert t.connections_made == 1
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_direct_body_only_without_content_coding(serve: Callable[..., RawServer]) -> None:
    """A backend reads our transport's body straight off the network, but a coded body
    goes through httpx, which undoes the coding."""
    zipped = gzip.compress(b"z" * 50)

    def handler(conn: socket.socket, head: bytes, i: int, n: int) -> None:
        if b"/gz" in head:
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s"
                % (len(zipped), zipped)
            )
        else:
            conn.sendall(CHUNKED_HEAD + chunked(b"plain ", b"body"))

    srv = serve(handler)
    t = LeanTransport()
    plain = await t.handle_async_request(httpx.Request("GET", srv.url + "/plain"))
    body = direct_body(plain)
    assert body is not None and b"".join([p async for p in body]) == b"plain body"
    await plain.aclose()
    coded = await t.handle_async_request(httpx.Request("GET", srv.url + "/gz"))
    assert direct_body(coded) is None
    assert await coded.aread() == b"z" * 50
    await t.aclose()
