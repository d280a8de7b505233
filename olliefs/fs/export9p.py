"""The 9P frontend: the tree of ``spec.py`` served over 9P2000, beside the FUSE mount.

``ollie mount --9p unix:PATH`` (or ``tcp:HOST:PORT``) serves the very nodes the FUSE
frontend serves, made by the same declaration, through the generic ``ninep`` server: this
module only translates, as ``fuse.py`` does. Twalk is a lookup, Topen opens a ``Handle``,
Tread/Twrite go to it, Tclunk is close(2) (``flush`` then ``release``: a prompt is
submitted at clunk as at close), Tremove is unlink/rmdir in the parent, a Twstat that
changes the name is a rename in the same directory, one that sets the length truncates.

Errors: every ``OllieError`` is answered with an Rerror whose text is its ``reason``, the
same text the FUSE path logs and puts in ``err`` (9P has error strings, so the reason
reaches the client itself, not only the log). Anything else is a bug: logged with its
traceback and answered "internal error", and the daemon goes on.

Blocking reads (``stream``, ``events``, ``statewait``, ``fifo.out``) block as they do on
FUSE, each in its own task of the 9P server, and Tflush of the read's tag cancels that
task: the server answers Rflush only once the read has ended and sends nothing for the
flushed read. There is no signal to look at (9P carries no pid), so ``interrupt`` is not
involved: the flush is the interrupt. Blocked 9P reads are bounded like FUSE ones
(``OLLIE_MAX_WAITERS``, counted apart from the FUSE readers): one more is answered
"too many blocked readers".

Who the caller is. 9P has no uid or pid in its requests. The node operations see the
caller as the owner of the tree, never as root (a write-only ``ctl`` read over 9P is
refused, as it is on FUSE for anyone but root). On a unix socket the kernel tells who
connected (SO_PEERCRED): the socket is mode 0600, so only the owner (and root) get in,
and the peer's pid is what the node operations see as the opener's pid, so a sandboxed
tool that reached the socket cannot write an agent profile (``a/``) through it either.
Over TCP there is no pid: with a key the caller is the user who holds it (pid 0);
without one it may be a tool with network, so ``a/`` refuses its writes (`UNVERIFIED`).

Authentication (TCP off loopback needs it; ollie(1) and ollie(5) say how to use it): a
key file given with ``--9p-key-file``; a client attaches with the key's text as the
attach name (Tattach ``aname``). 9P2000 has Tauth, but few clients implement an auth
protocol an ``afid`` could carry, while every client can set ``aname`` (plan9port's
``9p -A``, Linux v9fs ``aname=``, py9p). The key is compared in constant time; a wrong
one is answered "authentication failed" and the attach creates nothing. 9P is not
encrypted: off loopback the key and the traffic are readable on the wire, so remote use
belongs on a network that is private already (a VPN, an ssh tunnel).

Read-only exports (``ADDR,ro``): the listener of that address serves an ``Export`` copy
with ``readonly`` set (the tree, counters and bounds shared with the others), and every
change is refused before it reaches a node: an open for writing or with OTRUNC, create,
remove and a Twstat that changes anything. The Rerror text is the one Linux v9fs maps
to EROFS.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import hmac
import ipaddress
import logging
import os
import pwd
import socket
import ssl
import stat as _stat
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import trio

from ninep.codec import (
    DMDIR,
    ENOTFOUND,
    OEXEC,
    ORDWR,
    OTRUNC,
    OWRITE,
    QTDIR,
    QTFILE,
    NinePError,
    Qid,
    Stat,
)
from ninep.server import (
    BaseFileSystem,
    ServerStats,
    accept_loop,
    clear_stale_socket,
    serve_connection,
)
from olliefs import errors
from olliefs.fs import tls9p
from olliefs.fs.nodes import Dir, File, Handle, Node, Open, Waiters

log = logging.getLogger(__name__)

R = TypeVar("R")

EAUTH = "authentication failed"
EDENIED = "permission denied"
# Linux v9fs maps this very text to EROFS (its 9P2000 error table); others show it.
EROFS = "Read-only file system"
U32 = 0xFFFFFFFF
U64 = 0xFFFFFFFFFFFFFFFF


# ---- where to listen ---------------------------------------------------------------------


@dataclass(frozen=True)
class Address:
    """One ``--9p`` address: ``unix:PATH`` or ``tcp:HOST:PORT``."""

    kind: str  # "unix" or "tcp"
    path: str = ""
    host: str = ""
    port: int = 0
    ro: bool = False  # ``,ro``: every change refused (EROFS)
    tls: bool = False  # ``,tls``: TLS with the daemon's pinned certificate (tls9p)

    def __str__(self) -> str:
        opts = (",ro" if self.ro else "") + (",tls" if self.tls else "")
        if self.kind == "unix":
            return f"unix:{self.path}{opts}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp:{host}:{self.port}{opts}"


class AddressError(ValueError):
    """A ``--9p`` address that cannot be served as asked (the message says why)."""


OPTIONS = ("ro", "tls")


def parse_address(text: str) -> Address:
    """``unix:PATH`` or ``tcp:HOST:PORT``, then options after commas (``,ro``)."""
    base, *opts = text.split(",")
    if opts and all(o in OPTIONS for o in opts):
        a = dataclasses.replace(_parse_base(base), ro="ro" in opts, tls="tls" in opts)
        if a.tls and a.kind != "tcp":
            raise AddressError(f"bad 9P address {text!r}: tls goes with tcp:HOST:PORT")
        return a
    return _parse_base(text)


def _parse_base(text: str) -> Address:
    kind, sep, rest = text.partition(":")
    if kind == "unix" and sep and rest:
        return Address("unix", path=os.path.abspath(os.path.expanduser(rest)))
    if kind == "tcp" and sep:
        host, sep, port_s = rest.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not sep or not host or not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
            raise AddressError(f"bad 9P address {text!r}: tcp:HOST:PORT (e.g. tcp:127.0.0.1:5640)")
        return Address("tcp", host=host, port=int(port_s))
    raise AddressError(f"bad 9P address {text!r}: unix:PATH or tcp:HOST:PORT[,ro][,tls]")


def is_loopback(host: str) -> bool:
    """Does every address ``host`` names belong to this machine's loopback?"""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def read_key(path: str) -> str:
    """The key a client must give as ``aname``: the file's text without surrounding
    whitespace. Refused when empty or readable by others than its owner (as ssh does)."""
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise AddressError(f"9P key file {path}: {err}") from None
    if st.st_mode & 0o077:
        raise AddressError(f"9P key file {path} is readable by others: chmod 600 it")
    if len(key) < 16:
        raise AddressError(f"9P key file {path}: the key must be at least 16 characters")
    return key


def check_exports(addresses: Sequence[Address], allow_remote: bool, key: str | None) -> None:
    """Refuse a TCP address off loopback unless asked for explicitly and with a key."""
    for a in addresses:
        if a.kind != "tcp" or is_loopback(a.host):
            continue
        if not allow_remote:
            raise AddressError(
                f"9P address {a} is not loopback: serving the tree to other machines needs"
                " --9p-allow-remote and --9p-key-file"
            )
        if key is None:
            raise AddressError(f"9P address {a} is not loopback: it needs --9p-key-file")


# ---- the file system -------------------------------------------------------------------


@dataclass(eq=False)
class Ref:
    """A node as one fid knows it: the node, its name, and the directory it was found in
    (for ``..``, remove and rename, which act on the parent)."""

    node: Node
    name: str
    parent: Ref | None = None


Opened = Handle | None  # None: an open directory (the server reads it through readdir)


def qid_path(node: Node) -> int:
    """A stable 64-bit identity for the node's key: the same file has the same qid for
    every client and across renames, with no table that grows with every name seen."""
    digest = hashlib.blake2b(repr(node.key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


async def _translated(call: Awaitable[R]) -> R:
    try:
        return await call
    except errors.OllieError as err:
        log.debug("9P: %s: %s", type(err).__name__, err.reason)
        raise NinePError(err.reason) from None


@dataclass
class Export:
    """What every 9P connection shares: the tree, the bound on blocked reads, the key,
    the server's counters."""

    root: Dir
    waiters: Waiters
    key: str | None = None
    stats: ServerStats = field(default_factory=ServerStats)
    user: str = field(default_factory=_user)
    readonly: bool = False  # this address's clients may read and follow, never change
    tls: ssl.SSLContext | None = None  # this address's clients speak TLS first
    address: str = ""  # the address this copy serves (shown with its peers)
    # Who is connected, to what: shared by the copies of every address, and written to
    # ``peers_file`` (run dir) for ``ollie status`` at each change, replaced whole.
    peers: dict[int, str] = field(default_factory=dict)
    peers_file: Path | None = None

    def peer_changed(self) -> None:
        if self.peers_file is None:
            return
        tmp = self.peers_file.with_suffix(".tmp")
        try:
            tmp.write_text("".join(f"{p}\n" for p in self.peers.values()))
            os.replace(tmp, self.peers_file)
        except OSError as err:
            log.info("%s not written: %s", self.peers_file, err.strerror)

    # Called with (directory, name) after a name there went away or changed over 9P:
    # the FUSE frontend drops the kernel's cached lookup of it (``daemon.py``).
    forget: Callable[[Node, str], None] = lambda d, name: None


class TreeFS(BaseFileSystem[Ref, Opened]):
    """The spec tree for one 9P connection (``pid``: who connected, 0 when unknown)."""

    def __init__(self, export: Export, pid: int) -> None:
        self.export = export
        self.pid = pid

    # ---- attach, walk, stat ------------------------------------------------------

    async def attach(self, uname: str, aname: str) -> Ref:
        key = self.export.key
        if key is not None and not hmac.compare_digest(aname.encode(), key.encode()):
            log.info("9P attach refused for %r: wrong key", uname)
            raise NinePError(EAUTH)
        return Ref(self.export.root, "/")

    async def walk(self, node: Ref, name: str) -> Ref:
        if name == "..":
            return node.parent or node
        d = node.node
        if not isinstance(d, Dir) or not d.valid():
            raise NinePError(ENOTFOUND)
        await _translated(d.prepare())
        child = d.lookup(name)
        if child is None or not child.valid():
            raise NinePError(ENOTFOUND)
        if child.stat_prepares:  # its first stat has the size its first read gets
            await _translated(child.prepare())
        return Ref(child, name, node)

    def stat(self, node: Ref) -> Stat:
        n = node.node
        if not n.valid():
            raise NinePError(ENOTFOUND)
        is_dir = isinstance(n, Dir)
        try:
            size, ns = n.stat()
        except errors.OllieError as err:
            raise NinePError(err.reason) from None
        user = self.export.user
        return Stat(
            # version: changes when the file does (its mtime in microseconds, mod 2^32)
            qid=Qid(QTDIR if is_dir else QTFILE, ns // 1000 & U32, qid_path(n)),
            mode=(DMDIR if is_dir else 0) | _stat.S_IMODE(n.mode),
            atime=ns // 1_000_000_000 & U32,
            mtime=ns // 1_000_000_000 & U32,
            length=0 if is_dir else size,
            name=node.name,
            uid=user,
            gid=user,
            muid=user,
        )

    # ---- open, read, write, clunk ------------------------------------------------

    def _writable(self) -> None:
        if self.export.readonly:
            raise NinePError(EROFS)

    async def open(self, node: Ref, mode: int) -> Opened:
        n = node.node
        if not n.valid():
            raise NinePError(ENOTFOUND)
        if mode & 3 in (OWRITE, ORDWR) or mode & OTRUNC:
            self._writable()
        if isinstance(n, Dir):
            await _translated(n.prepare())
            return None
        if not isinstance(n, File):
            raise NinePError(EDENIED)
        flags = self._flags(mode)
        acc = flags & os.O_ACCMODE
        # As on FUSE for anyone but root: the mode bits decide.
        if acc in (os.O_WRONLY, os.O_RDWR) and not n.writable:
            raise NinePError(EDENIED)
        if acc in (os.O_RDONLY, os.O_RDWR) and not n.readable:
            raise NinePError(EDENIED)
        await _translated(n.prepare())
        try:
            return n.open(self._how(flags))
        except errors.OllieError as err:
            raise NinePError(err.reason) from None

    def _flags(self, mode: int) -> int:
        acc = {OWRITE: os.O_WRONLY, ORDWR: os.O_RDWR}.get(mode & 3, os.O_RDONLY)
        if mode & 3 == OEXEC:
            acc = os.O_RDONLY
        return acc | (os.O_TRUNC if mode & OTRUNC else 0)

    def _how(self, flags: int) -> Open:
        return Open(pid=self.pid, nonblock=False, waiters=self.export.waiters, flags=flags)

    async def read(self, handle: Opened, offset: int, count: int) -> bytes:
        assert handle is not None  # directories are read by the server (readdir)
        return await _translated(handle.read(offset, count))

    async def write(self, handle: Opened, offset: int, data: bytes) -> int:
        assert handle is not None  # the server refuses to open a directory for writing
        return await _translated(handle.write(offset, data))

    async def clunk(self, handle: Opened) -> None:
        if handle is None:
            return
        try:
            await _translated(handle.flush())  # close(2): a prompt is submitted here
        finally:
            handle.release()

    async def readdir(self, node: Ref) -> list[Stat]:
        d = node.node
        assert isinstance(d, Dir)
        out = []
        for name, child in sorted(d.entries(), key=_by_name):
            if child.valid():
                out.append(self.stat(Ref(child, name, node)))
        return out

    # ---- namespace changes -------------------------------------------------------

    async def create(self, node: Ref, name: str, perm: int, mode: int) -> tuple[Ref, Opened]:
        self._writable()
        d = node.node
        if not isinstance(d, Dir) or not d.valid():
            raise NinePError(ENOTFOUND)
        if perm & DMDIR:
            child = await _translated(d.mkdir(name, perm & 0o777))
            return Ref(child, name, node), None
        # create(5): an existing file is truncated, as open(O_CREAT|O_TRUNC) does.
        how = self._how(self._flags(mode) | os.O_CREAT | os.O_TRUNC)
        made, handle = await _translated(d.create(name, perm & 0o777, how))
        return Ref(made, name, node), handle

    async def remove(self, node: Ref) -> None:
        self._writable()
        parent = node.parent
        if parent is None or not isinstance(parent.node, Dir):
            raise NinePError(EDENIED)
        if isinstance(node.node, Dir):
            await _translated(parent.node.rmdir(node.name))
        else:
            await _translated(parent.node.unlink(node.name))
        self.export.forget(parent.node, node.name)

    async def wstat(self, node: Ref, stat: Stat) -> None:
        """stat(5)'s "don't touch" fields are skipped; the others are applied: a new
        name is a rename in the same directory, a length truncates, a mode is chmod, an
        mtime is ``touch``. Owners cannot change (as on FUSE). A Twstat touching
        nothing is Plan 9's fsync: a no-op here."""
        n = node.node
        if not n.valid():
            raise NinePError(ENOTFOUND)
        if not _changes_nothing(stat):  # a Twstat touching nothing is fsync: allowed
            self._writable()
        user = self.export.user
        for owner in (stat.uid, stat.gid, stat.muid):
            if owner and owner != user:
                raise NinePError("the owner of this file is fixed")
        if stat.name and stat.name != node.name:
            parent = node.parent
            if parent is None or not isinstance(parent.node, Dir):
                raise NinePError(EDENIED)
            if "/" in stat.name or stat.name in (".", ".."):
                raise NinePError("invalid file name")
            if parent.node.lookup(stat.name) is not None:
                raise NinePError("file already exists")  # stat(5): no rename over a file
            await _translated(parent.node.rename(node.name, stat.name))
            self.export.forget(parent.node, node.name)
            node.name = stat.name
        if stat.length != U64:
            if not (isinstance(n, File) and n.writable):
                raise NinePError(EDENIED)
            await _translated(n.truncate(stat.length, self.pid))
        if stat.mode != U32:
            if bool(stat.mode & DMDIR) != isinstance(n, Dir):
                raise NinePError("cannot change a file into a directory or back")
            if stat.mode & 0o777 != _stat.S_IMODE(n.mode):
                await _translated(n.chmod(stat.mode & 0o777))
        atime = None if stat.atime == U32 else stat.atime * 1_000_000_000
        mtime = None if stat.mtime == U32 else stat.mtime * 1_000_000_000
        if atime is not None or mtime is not None:
            await _translated(n.set_times(atime, mtime))


def _changes_nothing(stat: Stat) -> bool:
    return (
        not (stat.name or stat.uid or stat.gid or stat.muid)
        and stat.length == U64
        and U32 == stat.mode == stat.atime == stat.mtime
    )


def _by_name(entry: tuple[str, Node]) -> str:
    return entry[0]


# ---- listeners -----------------------------------------------------------------------


UNVERIFIED = -1
"""The opener's pid of an unauthenticated TCP client: refused what a tool is refused."""


def _peer_pid(stream: trio.SocketStream) -> int:
    """The pid of the process at the other end of a unix socket (0 if unknown)."""
    try:
        creds = stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    except OSError:
        return 0
    pid, _uid, _gid = struct.unpack("3i", creds)
    return int(pid)


async def _serve_client(export: Export, stream: trio.SocketStream, unix: bool) -> None:
    # Over TCP without a key nobody can tell a tool (a profile with network) from its
    # user: UNVERIFIED makes the writes a tool may not make (a/ profiles) refused.
    pid = _peer_pid(stream) if unix else (0 if export.key is not None else UNVERIFIED)
    key = id(stream)
    export.peers[key] = f"{_peer_name(stream, pid, unix)} on {export.address}"
    export.peer_changed()
    try:
        await _serve_peer(export, stream, pid, unix)
    finally:
        del export.peers[key]
        export.peer_changed()


def _peer_name(stream: trio.SocketStream, pid: int, unix: bool) -> str:
    if unix:
        return f"pid {pid}"
    try:
        host, port = stream.socket.getpeername()[:2]
    except OSError:
        return "?"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _serve_peer(export: Export, stream: trio.SocketStream, pid: int, unix: bool) -> None:
    stats = export.stats
    served: trio.abc.Stream = stream
    if export.tls is not None:
        try:
            served = await tls9p.serve_side(stream, export.tls)
        except tls9p.TlsError as err:
            log.info("9P client refused: %s", err)
            return
    try:
        await serve_connection(served, TreeFS(export, pid), stats=stats)
    except Exception:
        log.exception("9P connection failed")
    # What the server still holds after a client leaves: operators (and the tests) can
    # see that a flushed read or a dropped client leaves nothing behind.
    log.info(
        "9P client left: %d connections, %d fids, %d requests in flight, %d handles open,"
        " %d blocked reads",
        stats.connections,
        stats.fids,
        stats.in_flight,
        stats.handles,
        export.waiters.count,
    )


async def _unix_listener(path: str) -> tuple[trio.SocketListener, Callable[[], None]]:
    """A listening unix socket of mode 0600 (set before listen: no moment when it is
    wider), and how to remove it again."""
    try:
        clear_stale_socket(path)
    except OSError as err:
        why = (
            "a server is already listening there" if err.errno == errno.EADDRINUSE else err.strerror
        )
        raise AddressError(f"9P socket {path}: {why}") from None
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await sock.bind(path)
        os.chmod(path, 0o600)
        ino = os.lstat(path).st_ino
        sock.listen(socket.SOMAXCONN)  # clients connecting together (ninep.server)
    except OSError as err:
        sock.close()
        raise AddressError(f"9P socket {path}: {err.strerror or err}") from None

    def remove() -> None:
        try:
            if os.lstat(path).st_ino == ino:
                os.unlink(path)
        except OSError:
            pass

    return trio.SocketListener(sock), remove


async def _accept_loop(
    export: Export, listener: trio.SocketListener, unix: bool, name: str, nursery: trio.Nursery
) -> None:
    def start(stream: trio.SocketStream) -> None:
        nursery.start_soon(_serve_client, export, stream, unix)

    await accept_loop(listener, start, name)


async def serve(
    export: Export,
    addresses: Sequence[Address],
    *,
    tls_config: Path | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen on every address and serve until cancelled; ``task_status.started`` gets
    the addresses actually bound (a TCP port 0 becomes the port the kernel chose) once
    clients can connect. Unix socket files are removed when serving stops."""
    cleanups: list[Callable[[], None]] = []
    export.peer_changed()  # none yet (a file left by a daemon before is replaced)
    listeners: list[tuple[trio.SocketListener, bool, Export]] = []
    bound: list[str] = []
    try:
        for a in addresses:
            # A read-only address shares the tree, counters and bounds of the others.
            served = dataclasses.replace(export, readonly=a.ro, address=str(a))
            if a.tls:
                if tls_config is None:
                    raise AddressError(f"9P address {a}: no config dir for its certificate")
                try:
                    ctx = tls9p.server_context(tls_config)
                except (tls9p.TlsError, OSError, ssl.SSLError) as err:
                    raise AddressError(f"9P address {a}: {err}") from None
                served = dataclasses.replace(served, tls=ctx)
                log.info(
                    "9P export %s: TLS certificate %s",
                    a,
                    tls9p.fingerprint_of(tls9p.cert_dir(tls_config) / "cert.pem"),
                )
            if a.kind == "unix":
                listener, remove = await _unix_listener(a.path)
                cleanups.append(remove)
                listeners.append((listener, True, served))
                bound.append(str(a))
                continue
            try:
                tcp = await trio.open_tcp_listeners(a.port, host=a.host)
            except OSError as err:
                raise AddressError(f"9P address {a}: {err.strerror or err}") from None
            if export.key is None:
                log.warning("9P export on %s has no key: every local user can use it", a)
            for t in tcp:
                sockname = t.socket.getsockname()
                real = str(dataclasses.replace(a, host=sockname[0], port=sockname[1]))
                listeners.append((t, False, dataclasses.replace(served, address=real)))
                bound.append(real)
        async with trio.open_nursery() as nursery:
            for listener, unix, served in listeners:
                name = served.address
                nursery.start_soon(_accept_loop, served, listener, unix, name, nursery)
            for b in bound:
                log.info("9P export listening on %s", b)
            task_status.started(bound)
    finally:
        for listener, _, _ in listeners:
            with trio.CancelScope(shield=True):
                await listener.aclose()
        for cleanup in cleanups:
            cleanup()


__all__ = [
    "EAUTH",
    "Address",
    "AddressError",
    "Export",
    "Ref",
    "TreeFS",
    "check_exports",
    "is_loopback",
    "parse_address",
    "qid_path",
    "read_key",
    "serve",
]
