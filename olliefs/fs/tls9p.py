"""TLS for the 9P export over TCP (``--9p tcp:HOST:PORT,tls``), pinned like ssh.

The daemon's certificate is self-signed and made on first use, by ``openssl`` (Python's
ssl module can use a certificate but not make one), under the config dir:
``9p-tls/cert.pem`` and ``9p-tls/key.pem`` (mode 0600). No CA is involved: a client
trusts the certificate it met first for that ``host:port`` and refuses a different one
later, as ssh does with ``known_hosts``. `connect` is that client for the project's own
9P client; the fingerprint (``SHA256:`` base64 of the certificate's DER, as ssh prints
host keys) is in the daemon's log and in ``ollie status``, to compare out of band.

A TLS export still wants the attach key (``--9p-key-file``) when it is off loopback:
TLS hides the key and the traffic from the wire, the key says who may attach.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import ssl
import subprocess
from pathlib import Path

import trio

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 30.0  # a client that connects and says nothing holds no task longer


class TlsError(Exception):
    """No certificate could be made, or a peer's differs from the pinned one."""


def cert_dir(config: Path) -> Path:
    return config / "9p-tls"


def ensure_cert(config: Path) -> tuple[Path, Path]:
    """The export's certificate and key, made the first time (never replaced: clients
    pinned it)."""
    d = cert_dir(config)
    cert, key = d / "cert.pem", d / "key.pem"
    if cert.exists() and key.exists():
        return cert, key
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp_cert, tmp_key = d / "cert.pem.tmp", d / "key.pem.tmp"
    argv = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
            "ec_paramgen_curve:prime256v1", "-nodes", "-days", "36500", "-subj",
            "/CN=ollie-9p", "-keyout", str(tmp_key), "-out", str(tmp_cert)]  # fmt: skip
    old = os.umask(0o077)
    try:
        got = subprocess.run(argv, capture_output=True, check=False, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise TlsError("cannot make the 9P TLS certificate: no openssl command") from None
    finally:
        os.umask(old)
    if got.returncode != 0:
        why = got.stderr.decode(errors="replace").strip().splitlines()[-1:]
        raise TlsError(f"openssl could not make the 9P TLS certificate: {' '.join(why)}")
    os.replace(tmp_key, key)
    os.replace(tmp_cert, cert)
    log.info("made the 9P TLS certificate %s (%s)", cert, fingerprint_of(cert))
    return cert, key


def server_context(config: Path) -> ssl.SSLContext:
    cert, key = ensure_cert(config)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    return ctx


def fingerprint(der: bytes) -> str:
    digest = base64.b64encode(hashlib.sha256(der).digest()).decode().rstrip("=")
    return f"SHA256:{digest}"


def fingerprint_of(cert: Path) -> str:
    return fingerprint(ssl.PEM_cert_to_DER_cert(cert.read_text()))


async def serve_side(
    stream: trio.abc.Stream, ctx: ssl.SSLContext
) -> trio.SSLStream[trio.abc.Stream]:
    """The server's end of a TLS connection, handshake done (or TlsError)."""
    tls = trio.SSLStream(stream, ctx, server_side=True)
    with trio.move_on_after(HANDSHAKE_TIMEOUT) as scope:
        try:
            await tls.do_handshake()
        except trio.BrokenResourceError as err:
            await stream.aclose()
            raise TlsError(f"TLS handshake failed: {err.__cause__ or err}") from None
    if scope.cancelled_caught:
        await stream.aclose()
        raise TlsError("TLS handshake timed out")
    return tls


async def connect(host: str, port: int, known_hosts: Path) -> trio.SSLStream[trio.abc.Stream]:
    """A TLS stream to a ``,tls`` export, its certificate checked against
    ``known_hosts`` (``host:port fingerprint`` lines): the first one met is recorded,
    a different one later is refused (TlsError naming the file and line)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # no CA: the pin below is the check
    raw = await trio.open_tcp_stream(host, port)
    tls: trio.SSLStream[trio.abc.Stream] = trio.SSLStream(raw, ctx, server_hostname=host)
    try:
        await tls.do_handshake()
        der = tls.getpeercert(binary_form=True)
        if der is None:
            raise TlsError(f"{host}:{port} sent no certificate")
        check_pin(known_hosts, f"{host}:{port}", fingerprint(der))
    except BaseException:
        await raw.aclose()
        raise
    return tls


def check_pin(known_hosts: Path, name: str, seen: str) -> None:
    try:
        lines = known_hosts.read_text().splitlines()
    except FileNotFoundError:
        lines = []
    for i, line in enumerate(lines, 1):
        who, _, pinned = line.partition(" ")
        if who == name:
            if pinned.strip() != seen:
                raise TlsError(
                    f"the certificate of {name} changed: it is {seen}, {known_hosts} line "
                    f"{i} pins {pinned.strip()}; if that is expected, remove that line"
                )
            return
    known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(known_hosts, "a", opener=lambda p, f: os.open(p, f, 0o600)) as out:
        out.write(f"{name} {seen}\n")
    log.info("pinned the certificate of %s: %s (in %s)", name, seen, known_hosts)
