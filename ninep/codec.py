"""The 9P2000 wire format: constants, one frozen msgspec Struct per message, encode/decode.

9P2000 is binary and little-endian (intro(5)): a frame is ``size[4] type[1] tag[2]``
followed by the message's fields; strings are ``n[2]`` plus UTF-8 bytes (no NUL), data is
``count[4]`` plus bytes, a qid is 13 bytes, a stat is ``size[2]`` plus its fields.

The decoder is the first line of defence of every server and client built on this
package: whatever arrives from a peer either becomes one well-formed message or raises
``ProtocolError``. Nothing is guessed or repaired: a size that does not match the frame,
a count that runs past the end, trailing bytes, invalid UTF-8, a NUL in a string, more
than ``MAXWELEM`` walk elements, or the never-valid ``Terror`` all fail. A frame that
decodes re-encodes to the very same bytes, so there is exactly one encoding per message.

The encoder checks value ranges (``ValueError``) instead of silently truncating: an
application that puts a negative mtime or a 70 KB name into a ``Stat`` hears about it
at its own call site, not as garbage at the peer.

Speed matters (a tool call is about a dozen round trips and is benchmarked against a
fork+exec), so every layout is a precompiled ``struct.Struct`` and each message class
carries its own ``_encode``; decoding is a table lookup on the type byte.

Nothing here does I/O or imports trio (a test checks it in a fresh interpreter):
``FrameBuffer`` splits bytes the caller already has into frames, and ``ninep.transport``
is what reads and writes them on a stream.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import ClassVar, TypeAlias

import msgspec

# ---- constants ------------------------------------------------------------------------

VERSION = "9P2000"
NOTAG = 0xFFFF
NOFID = 0xFFFFFFFF
IOHDRSZ = 24  # Twrite's header (23 bytes) rounded up: payload room is msize - IOHDRSZ
MAXWELEM = 16

# qid.type bits
QTDIR = 0x80
QTAPPEND = 0x40
QTEXCL = 0x20
QTAUTH = 0x08
QTTMP = 0x04
QTFILE = 0x00

# stat.mode / Tcreate perm bits
DMDIR = 0x80000000
DMAPPEND = 0x40000000
DMEXCL = 0x20000000
DMAUTH = 0x08000000
DMTMP = 0x04000000
DMREAD = 0x4
DMWRITE = 0x2
DMEXEC = 0x1

# Topen / Tcreate modes
OREAD = 0
OWRITE = 1
ORDWR = 2
OEXEC = 3
OTRUNC = 0x10
ORCLOSE = 0x40

# message types
TVERSION = 100
RVERSION = 101
TAUTH = 102
RAUTH = 103
TATTACH = 104
RATTACH = 105
TERROR = 106  # never valid on the wire
RERROR = 107
TFLUSH = 108
RFLUSH = 109
TWALK = 110
RWALK = 111
TOPEN = 112
ROPEN = 113
TCREATE = 114
RCREATE = 115
TREAD = 116
RREAD = 117
TWRITE = 118
RWRITE = 119
TCLUNK = 120
RCLUNK = 121
TREMOVE = 122
RREMOVE = 123
TSTAT = 124
RSTAT = 125
TWSTAT = 126
RWSTAT = 127

# Error strings shared by the server and the client, so both ends say the same thing.
ENOTFOUND = "file not found"
EPERM = "permission denied"
EEXIST = "file already exists"
ENOTDIR = "not a directory"
EISDIR = "is a directory"
EUNKNOWNFID = "unknown fid"
EFIDINUSE = "fid already in use"
EINTERNAL = "internal error"


class ProtocolError(ValueError):
    """A frame or field that is not valid 9P2000: the peer is broken or hostile."""


class NinePError(Exception):
    """A 9P error: ``ename`` is the text of the Rerror that carries it.

    Applications raise it to refuse an operation (the server answers Rerror(ename)); the
    client raises it when the server answered Rerror.
    """

    def __init__(self, ename: str) -> None:
        super().__init__(ename)
        self.ename = ename


# ---- layouts --------------------------------------------------------------------------

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_HDR = struct.Struct("<IBH")  # size type tag
_HDR_U16 = struct.Struct("<IBHH")
_HDR_U32 = struct.Struct("<IBHI")
_HDR_U32_U8 = struct.Struct("<IBHIB")
_HDR_U32_U32 = struct.Struct("<IBHII")
_HDR_U32_U32_U16 = struct.Struct("<IBHIIH")
_HDR_U32_U16 = struct.Struct("<IBHIH")
_HDR_QID = struct.Struct("<IBHBIQ")
_HDR_QID_U32 = struct.Struct("<IBHBIQI")
_HDR_U32_U64_U32 = struct.Struct("<IBHIQI")  # Tread; Twrite's header
_QID = struct.Struct("<BIQ")
_U32_U8 = struct.Struct("<IB")
# size type dev qid.type qid.version qid.path mode atime mtime length
_STAT_FIXED = struct.Struct("<HHIBIQIIIQ")
_STAT_FIXED_SIZE = _STAT_FIXED.size  # 41

_HDRSZ = 7


def _s(value: str) -> bytes:
    """``n[2]`` + UTF-8: the 9P string, refusing what a peer would have to reject."""
    b = value.encode("utf-8")
    if len(b) > 0xFFFF:
        raise ValueError(f"9P string longer than 65535 bytes ({len(b)})")
    if b"\x00" in b:
        raise ValueError("9P strings cannot contain NUL")
    return _U16.pack(len(b)) + b


# ---- structs --------------------------------------------------------------------------


class Qid(msgspec.Struct, frozen=True, gc=False):
    """The server's identity of a file: ``path`` is unique per file, ``version`` changes
    when it is modified, ``type`` holds the QT* bits (QTDIR for directories)."""

    type: int
    version: int
    path: int


_ZERO_QID = Qid(0, 0, 0)


class Stat(msgspec.Struct, frozen=True, gc=False):
    """A 9P2000 directory entry (stat(5)); ``length`` is u64, times are u32 seconds."""

    type: int = 0
    dev: int = 0
    qid: Qid = _ZERO_QID
    mode: int = 0
    atime: int = 0
    mtime: int = 0
    length: int = 0
    name: str = ""
    uid: str = ""
    gid: str = ""
    muid: str = ""


# In a Twstat, all-ones numbers and empty strings mean "don't touch" (stat(5)). Build a
# request with ``msgspec.structs.replace(NOCHANGE, length=0)`` (truncate), etc.
NOCHANGE = Stat(
    type=0xFFFF,
    dev=0xFFFFFFFF,
    qid=Qid(0xFF, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF),
    mode=0xFFFFFFFF,
    atime=0xFFFFFFFF,
    mtime=0xFFFFFFFF,
    length=0xFFFFFFFFFFFFFFFF,
)


def _stat_bytes(st: Stat) -> bytes:
    q = st.qid
    strings = _s(st.name) + _s(st.uid) + _s(st.gid) + _s(st.muid)
    size = _STAT_FIXED_SIZE - 2 + len(strings)
    return (
        _STAT_FIXED.pack(
            size,
            st.type,
            st.dev,
            q.type,
            q.version,
            q.path,
            st.mode,
            st.atime,
            st.mtime,
            st.length,
        )
        + strings
    )


def encode_stat(st: Stat) -> bytes:
    """One stat as it appears in a directory read: ``size[2]`` followed by the entry."""
    try:
        return _stat_bytes(st)
    except struct.error as err:
        raise ValueError(f"Stat out of range: {err}") from None


class _Msg(msgspec.Struct, frozen=True, gc=False):
    """Common base: every message has a tag; subclasses know their type and layout."""

    tag: int
    TYPE: ClassVar[int] = 0

    def _encode(self) -> bytes:  # pragma: no cover - every concrete class overrides
        raise NotImplementedError


class Tversion(_Msg, frozen=True, gc=False):
    msize: int
    version: str
    TYPE: ClassVar[int] = TVERSION

    def _encode(self) -> bytes:
        v = _s(self.version)
        return _HDR_U32.pack(11 + len(v), TVERSION, self.tag, self.msize) + v


class Rversion(_Msg, frozen=True, gc=False):
    msize: int
    version: str
    TYPE: ClassVar[int] = RVERSION

    def _encode(self) -> bytes:
        v = _s(self.version)
        return _HDR_U32.pack(11 + len(v), RVERSION, self.tag, self.msize) + v


class Tauth(_Msg, frozen=True, gc=False):
    afid: int
    uname: str
    aname: str
    TYPE: ClassVar[int] = TAUTH

    def _encode(self) -> bytes:
        tail = _s(self.uname) + _s(self.aname)
        return _HDR_U32.pack(11 + len(tail), TAUTH, self.tag, self.afid) + tail


class Rauth(_Msg, frozen=True, gc=False):
    aqid: Qid
    TYPE: ClassVar[int] = RAUTH

    def _encode(self) -> bytes:
        q = self.aqid
        return _HDR_QID.pack(20, RAUTH, self.tag, q.type, q.version, q.path)


class Tattach(_Msg, frozen=True, gc=False):
    fid: int
    afid: int
    uname: str
    aname: str
    TYPE: ClassVar[int] = TATTACH

    def _encode(self) -> bytes:
        tail = _s(self.uname) + _s(self.aname)
        return _HDR_U32_U32.pack(15 + len(tail), TATTACH, self.tag, self.fid, self.afid) + tail


class Rattach(_Msg, frozen=True, gc=False):
    qid: Qid
    TYPE: ClassVar[int] = RATTACH

    def _encode(self) -> bytes:
        q = self.qid
        return _HDR_QID.pack(20, RATTACH, self.tag, q.type, q.version, q.path)


class Rerror(_Msg, frozen=True, gc=False):
    ename: str
    TYPE: ClassVar[int] = RERROR

    def _encode(self) -> bytes:
        e = _s(self.ename)
        return _HDR.pack(7 + len(e), RERROR, self.tag) + e


class Tflush(_Msg, frozen=True, gc=False):
    oldtag: int
    TYPE: ClassVar[int] = TFLUSH

    def _encode(self) -> bytes:
        return _HDR_U16.pack(9, TFLUSH, self.tag, self.oldtag)


class Rflush(_Msg, frozen=True, gc=False):
    TYPE: ClassVar[int] = RFLUSH

    def _encode(self) -> bytes:
        return _HDR.pack(7, RFLUSH, self.tag)


class Twalk(_Msg, frozen=True, gc=False):
    fid: int
    newfid: int
    wnames: tuple[str, ...]
    TYPE: ClassVar[int] = TWALK

    def _encode(self) -> bytes:
        names = self.wnames
        if len(names) > MAXWELEM:
            raise ValueError(f"Twalk takes at most {MAXWELEM} names, got {len(names)}")
        tail = b"".join([_s(n) for n in names])
        return (
            _HDR_U32_U32_U16.pack(
                17 + len(tail), TWALK, self.tag, self.fid, self.newfid, len(names)
            )
            + tail
        )


class Rwalk(_Msg, frozen=True, gc=False):
    qids: tuple[Qid, ...]
    TYPE: ClassVar[int] = RWALK

    def _encode(self) -> bytes:
        qids = self.qids
        if len(qids) > MAXWELEM:
            raise ValueError(f"Rwalk carries at most {MAXWELEM} qids, got {len(qids)}")
        tail = b"".join([_QID.pack(q.type, q.version, q.path) for q in qids])
        return _HDR_U16.pack(9 + len(tail), RWALK, self.tag, len(qids)) + tail


class Topen(_Msg, frozen=True, gc=False):
    fid: int
    mode: int
    TYPE: ClassVar[int] = TOPEN

    def _encode(self) -> bytes:
        return _HDR_U32_U8.pack(12, TOPEN, self.tag, self.fid, self.mode)


class Ropen(_Msg, frozen=True, gc=False):
    qid: Qid
    iounit: int
    TYPE: ClassVar[int] = ROPEN

    def _encode(self) -> bytes:
        q = self.qid
        return _HDR_QID_U32.pack(24, ROPEN, self.tag, q.type, q.version, q.path, self.iounit)


class Tcreate(_Msg, frozen=True, gc=False):
    fid: int
    name: str
    perm: int
    mode: int
    TYPE: ClassVar[int] = TCREATE

    def _encode(self) -> bytes:
        n = _s(self.name)
        return (
            _HDR_U32.pack(16 + len(n), TCREATE, self.tag, self.fid)
            + n
            + _U32_U8.pack(self.perm, self.mode)
        )


class Rcreate(_Msg, frozen=True, gc=False):
    qid: Qid
    iounit: int
    TYPE: ClassVar[int] = RCREATE

    def _encode(self) -> bytes:
        q = self.qid
        return _HDR_QID_U32.pack(24, RCREATE, self.tag, q.type, q.version, q.path, self.iounit)


class Tread(_Msg, frozen=True, gc=False):
    fid: int
    offset: int
    count: int
    TYPE: ClassVar[int] = TREAD

    def _encode(self) -> bytes:
        return _HDR_U32_U64_U32.pack(23, TREAD, self.tag, self.fid, self.offset, self.count)


class Rread(_Msg, frozen=True, gc=False):
    data: bytes
    TYPE: ClassVar[int] = RREAD

    def _encode(self) -> bytes:
        n = len(self.data)
        return _HDR_U32.pack(11 + n, RREAD, self.tag, n) + self.data


class Twrite(_Msg, frozen=True, gc=False):
    fid: int
    offset: int
    data: bytes
    TYPE: ClassVar[int] = TWRITE

    def _encode(self) -> bytes:
        n = len(self.data)
        return _HDR_U32_U64_U32.pack(23 + n, TWRITE, self.tag, self.fid, self.offset, n) + self.data


class Rwrite(_Msg, frozen=True, gc=False):
    count: int
    TYPE: ClassVar[int] = RWRITE

    def _encode(self) -> bytes:
        return _HDR_U32.pack(11, RWRITE, self.tag, self.count)


class Tclunk(_Msg, frozen=True, gc=False):
    fid: int
    TYPE: ClassVar[int] = TCLUNK

    def _encode(self) -> bytes:
        return _HDR_U32.pack(11, TCLUNK, self.tag, self.fid)


class Rclunk(_Msg, frozen=True, gc=False):
    TYPE: ClassVar[int] = RCLUNK

    def _encode(self) -> bytes:
        return _HDR.pack(7, RCLUNK, self.tag)


class Tremove(_Msg, frozen=True, gc=False):
    fid: int
    TYPE: ClassVar[int] = TREMOVE

    def _encode(self) -> bytes:
        return _HDR_U32.pack(11, TREMOVE, self.tag, self.fid)


class Rremove(_Msg, frozen=True, gc=False):
    TYPE: ClassVar[int] = RREMOVE

    def _encode(self) -> bytes:
        return _HDR.pack(7, RREMOVE, self.tag)


class Tstat(_Msg, frozen=True, gc=False):
    fid: int
    TYPE: ClassVar[int] = TSTAT

    def _encode(self) -> bytes:
        return _HDR_U32.pack(11, TSTAT, self.tag, self.fid)


class Rstat(_Msg, frozen=True, gc=False):
    stat: Stat
    TYPE: ClassVar[int] = RSTAT

    def _encode(self) -> bytes:
        st = _stat_bytes(self.stat)
        return _HDR_U16.pack(9 + len(st), RSTAT, self.tag, len(st)) + st


class Twstat(_Msg, frozen=True, gc=False):
    fid: int
    stat: Stat
    TYPE: ClassVar[int] = TWSTAT

    def _encode(self) -> bytes:
        st = _stat_bytes(self.stat)
        return _HDR_U32_U16.pack(13 + len(st), TWSTAT, self.tag, self.fid, len(st)) + st


class Rwstat(_Msg, frozen=True, gc=False):
    TYPE: ClassVar[int] = RWSTAT

    def _encode(self) -> bytes:
        return _HDR.pack(7, RWSTAT, self.tag)


TMessage: TypeAlias = (
    Tversion
    | Tauth
    | Tattach
    | Tflush
    | Twalk
    | Topen
    | Tcreate
    | Tread
    | Twrite
    | Tclunk
    | Tremove
    | Tstat
    | Twstat
)
RMessage: TypeAlias = (
    Rversion
    | Rauth
    | Rattach
    | Rerror
    | Rflush
    | Rwalk
    | Ropen
    | Rcreate
    | Rread
    | Rwrite
    | Rclunk
    | Rremove
    | Rstat
    | Rwstat
)
Message: TypeAlias = TMessage | RMessage

T_TYPES: tuple[type[TMessage], ...] = (
    Tversion,
    Tauth,
    Tattach,
    Tflush,
    Twalk,
    Topen,
    Tcreate,
    Tread,
    Twrite,
    Tclunk,
    Tremove,
    Tstat,
    Twstat,
)
R_TYPES: tuple[type[RMessage], ...] = (
    Rversion,
    Rauth,
    Rattach,
    Rerror,
    Rflush,
    Rwalk,
    Ropen,
    Rcreate,
    Rread,
    Rwrite,
    Rclunk,
    Rremove,
    Rstat,
    Rwstat,
)


def encode(msg: Message) -> bytes:
    """The whole frame, ``size[4] type[1] tag[2]`` included; ValueError if out of range."""
    try:
        return msg._encode()
    except struct.error as err:
        raise ValueError(f"{type(msg).__name__}: field out of range: {err}") from None


# ---- decoding -------------------------------------------------------------------------

Buffer: TypeAlias = bytes | bytearray | memoryview


def _str_at(buf: Buffer, off: int, end: int) -> tuple[str, int]:
    if off + 2 > end:
        raise ProtocolError("string length runs past the end")
    n = buf[off] | (buf[off + 1] << 8)
    stop = off + 2 + n
    if stop > end:
        raise ProtocolError("string runs past the end")
    s = str(buf[off + 2 : stop], "utf-8")  # UnicodeDecodeError -> ProtocolError in decode
    if "\x00" in s:
        raise ProtocolError("NUL in a 9P string")
    return s, stop


def _stat_at(buf: Buffer, off: int, end: int) -> tuple[Stat, int]:
    """The stat at ``off``; its own size field must say exactly where it ends."""
    if off + _STAT_FIXED_SIZE > end:
        raise ProtocolError("truncated stat")
    size, typ, dev, qt, qv, qp, mode, atime, mtime, length = _STAT_FIXED.unpack_from(buf, off)
    stop = off + 2 + size
    if stop > end:
        raise ProtocolError("stat size runs past the end")
    name, p = _str_at(buf, off + _STAT_FIXED_SIZE, stop)
    uid, p = _str_at(buf, p, stop)
    gid, p = _str_at(buf, p, stop)
    muid, p = _str_at(buf, p, stop)
    if p != stop:
        raise ProtocolError("stat size does not match its fields")
    return Stat(typ, dev, Qid(qt, qv, qp), mode, atime, mtime, length, name, uid, gid, muid), stop


def decode_stats(buf: Buffer) -> list[Stat]:
    """The entries of a directory read payload: whole stats, back to back."""
    out: list[Stat] = []
    off = 0
    end = len(buf)
    try:
        while off < end:
            st, off = _stat_at(buf, off, end)
            out.append(st)
    except UnicodeDecodeError as err:
        raise ProtocolError(f"invalid UTF-8 in a stat: {err.reason}") from None
    return out


def _fixed(n: int, frame: Buffer, name: str) -> None:
    if len(frame) != n:
        raise ProtocolError(f"{name} must be {n} bytes, got {len(frame)}")


def _end(off: int, frame: Buffer) -> None:
    if off != len(frame):
        raise ProtocolError(f"{len(frame) - off} bytes of trailing garbage")


def _d_version(cls: type[Tversion] | type[Rversion]) -> Callable[[Buffer, int], Message]:
    def dec(frame: Buffer, tag: int) -> Message:
        if len(frame) < 13:
            raise ProtocolError("truncated version message")
        (msize,) = _U32.unpack_from(frame, 7)
        version, off = _str_at(frame, 11, len(frame))
        _end(off, frame)
        return cls(tag, msize, version)

    return dec


def _d_tauth(frame: Buffer, tag: int) -> Message:
    end = len(frame)
    if end < 11:
        raise ProtocolError("truncated Tauth")
    (afid,) = _U32.unpack_from(frame, 7)
    uname, off = _str_at(frame, 11, end)
    aname, off = _str_at(frame, off, end)
    _end(off, frame)
    return Tauth(tag, afid, uname, aname)


def _d_qid_only(cls: type[Rauth] | type[Rattach]) -> Callable[[Buffer, int], Message]:
    def dec(frame: Buffer, tag: int) -> Message:
        _fixed(20, frame, cls.__name__)
        qt, qv, qp = _QID.unpack_from(frame, 7)
        return cls(tag, Qid(qt, qv, qp))

    return dec


def _d_tattach(frame: Buffer, tag: int) -> Message:
    end = len(frame)
    if end < 15:
        raise ProtocolError("truncated Tattach")
    fid, afid = struct.unpack_from("<II", frame, 7)
    uname, off = _str_at(frame, 15, end)
    aname, off = _str_at(frame, off, end)
    _end(off, frame)
    return Tattach(tag, fid, afid, uname, aname)


def _d_rerror(frame: Buffer, tag: int) -> Message:
    ename, off = _str_at(frame, 7, len(frame))
    _end(off, frame)
    return Rerror(tag, ename)


def _d_tflush(frame: Buffer, tag: int) -> Message:
    _fixed(9, frame, "Tflush")
    (oldtag,) = _U16.unpack_from(frame, 7)
    return Tflush(tag, oldtag)


def _d_empty(cls: type[Rflush | Rclunk | Rremove | Rwstat]) -> Callable[[Buffer, int], Message]:
    def dec(frame: Buffer, tag: int) -> Message:
        _fixed(7, frame, cls.__name__)
        return cls(tag)

    return dec


def _d_twalk(frame: Buffer, tag: int) -> Message:
    end = len(frame)
    if end < 17:
        raise ProtocolError("truncated Twalk")
    fid, newfid, nwname = struct.unpack_from("<IIH", frame, 7)
    if nwname > MAXWELEM:
        raise ProtocolError(f"Twalk with {nwname} names (max {MAXWELEM})")
    off = 17
    names = []
    for _ in range(nwname):
        name, off = _str_at(frame, off, end)
        names.append(name)
    _end(off, frame)
    return Twalk(tag, fid, newfid, tuple(names))


def _d_rwalk(frame: Buffer, tag: int) -> Message:
    if len(frame) < 9:
        raise ProtocolError("truncated Rwalk")
    (nwqid,) = _U16.unpack_from(frame, 7)
    if nwqid > MAXWELEM:
        raise ProtocolError(f"Rwalk with {nwqid} qids (max {MAXWELEM})")
    _fixed(9 + 13 * nwqid, frame, "Rwalk")
    unpack = _QID.unpack_from
    return Rwalk(tag, tuple([Qid(*unpack(frame, 9 + 13 * i)) for i in range(nwqid)]))


def _d_topen(frame: Buffer, tag: int) -> Message:
    _fixed(12, frame, "Topen")
    fid, mode = _U32_U8.unpack_from(frame, 7)
    return Topen(tag, fid, mode)


def _d_qid_iounit(cls: type[Ropen] | type[Rcreate]) -> Callable[[Buffer, int], Message]:
    def dec(frame: Buffer, tag: int) -> Message:
        _fixed(24, frame, cls.__name__)
        _, _, _, qt, qv, qp, iounit = _HDR_QID_U32.unpack_from(frame)
        return cls(tag, Qid(qt, qv, qp), iounit)

    return dec


def _d_tcreate(frame: Buffer, tag: int) -> Message:
    end = len(frame)
    if end < 11:
        raise ProtocolError("truncated Tcreate")
    (fid,) = _U32.unpack_from(frame, 7)
    name, off = _str_at(frame, 11, end)
    if off + 5 != end:
        raise ProtocolError("Tcreate perm/mode missing or followed by garbage")
    perm, mode = _U32_U8.unpack_from(frame, off)
    return Tcreate(tag, fid, name, perm, mode)


def _d_tread(frame: Buffer, tag: int) -> Message:
    _fixed(23, frame, "Tread")
    _, _, _, fid, offset, count = _HDR_U32_U64_U32.unpack_from(frame)
    return Tread(tag, fid, offset, count)


def _d_rread(frame: Buffer, tag: int) -> Message:
    if len(frame) < 11:
        raise ProtocolError("truncated Rread")
    (count,) = _U32.unpack_from(frame, 7)
    if 11 + count != len(frame):
        raise ProtocolError("Rread count does not match the frame")
    return Rread(tag, bytes(frame[11:]))


def _d_twrite(frame: Buffer, tag: int) -> Message:
    if len(frame) < 23:
        raise ProtocolError("truncated Twrite")
    _, _, _, fid, offset, count = _HDR_U32_U64_U32.unpack_from(frame)
    if 23 + count != len(frame):
        raise ProtocolError("Twrite count does not match the frame")
    return Twrite(tag, fid, offset, bytes(frame[23:]))


def _d_rwrite(frame: Buffer, tag: int) -> Message:
    _fixed(11, frame, "Rwrite")
    (count,) = _U32.unpack_from(frame, 7)
    return Rwrite(tag, count)


def _d_fid_only(cls: type[Tclunk | Tremove | Tstat]) -> Callable[[Buffer, int], Message]:
    def dec(frame: Buffer, tag: int) -> Message:
        _fixed(11, frame, cls.__name__)
        (fid,) = _U32.unpack_from(frame, 7)
        return cls(tag, fid)

    return dec


def _d_rstat(frame: Buffer, tag: int) -> Message:
    if len(frame) < 9:
        raise ProtocolError("truncated Rstat")
    (n,) = _U16.unpack_from(frame, 7)
    if 9 + n != len(frame):
        raise ProtocolError("Rstat stat length does not match the frame")
    st, off = _stat_at(frame, 9, len(frame))
    _end(off, frame)
    return Rstat(tag, st)


def _d_twstat(frame: Buffer, tag: int) -> Message:
    if len(frame) < 13:
        raise ProtocolError("truncated Twstat")
    fid, n = struct.unpack_from("<IH", frame, 7)
    if 13 + n != len(frame):
        raise ProtocolError("Twstat stat length does not match the frame")
    st, off = _stat_at(frame, 13, len(frame))
    _end(off, frame)
    return Twstat(tag, fid, st)


_DECODERS: dict[int, Callable[[Buffer, int], Message]] = {
    TVERSION: _d_version(Tversion),
    RVERSION: _d_version(Rversion),
    TAUTH: _d_tauth,
    RAUTH: _d_qid_only(Rauth),
    TATTACH: _d_tattach,
    RATTACH: _d_qid_only(Rattach),
    RERROR: _d_rerror,
    TFLUSH: _d_tflush,
    RFLUSH: _d_empty(Rflush),
    TWALK: _d_twalk,
    RWALK: _d_rwalk,
    TOPEN: _d_topen,
    ROPEN: _d_qid_iounit(Ropen),
    TCREATE: _d_tcreate,
    RCREATE: _d_qid_iounit(Rcreate),
    TREAD: _d_tread,
    RREAD: _d_rread,
    TWRITE: _d_twrite,
    RWRITE: _d_rwrite,
    TCLUNK: _d_fid_only(Tclunk),
    RCLUNK: _d_empty(Rclunk),
    TREMOVE: _d_fid_only(Tremove),
    RREMOVE: _d_empty(Rremove),
    TSTAT: _d_fid_only(Tstat),
    RSTAT: _d_rstat,
    TWSTAT: _d_twstat,
    RWSTAT: _d_empty(Rwstat),
}


def decode(frame: Buffer) -> Message:
    """One whole frame (size field included) to a message, or ProtocolError."""
    n = len(frame)
    if n < _HDRSZ:
        raise ProtocolError(f"frame of {n} bytes is shorter than a 9P header")
    size, mtype, tag = _HDR.unpack_from(frame)
    if size != n:
        raise ProtocolError(f"size field says {size} but the frame has {n} bytes")
    dec = _DECODERS.get(mtype)
    if dec is None:
        if mtype == TERROR:
            raise ProtocolError("Terror is not a valid message")
        raise ProtocolError(f"unknown message type {mtype}")
    try:
        return dec(frame, tag)
    except struct.error as err:  # defensive: every decoder checks lengths first
        raise ProtocolError(f"truncated message: {err}") from None
    except UnicodeDecodeError as err:
        raise ProtocolError(f"invalid UTF-8 in a string: {err.reason}") from None


class FrameBuffer:
    """Splits a byte stream into frames (sans I/O), so server and client share the rules.

    ``feed`` what the socket gave; ``next_frame(limit)`` returns one whole frame or None
    if more bytes are needed, and raises ProtocolError as soon as a size field is below
    the header size or above ``limit`` (the negotiated msize): such a peer is not waited for.
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def __len__(self) -> int:
        return len(self._buf)

    def feed(self, data: Buffer) -> None:
        self._buf += data

    def next_frame(self, limit: int) -> bytes | None:
        buf = self._buf
        have = len(buf)
        if have < 4:
            return None
        size = buf[0] | (buf[1] << 8) | (buf[2] << 16) | (buf[3] << 24)
        if size < _HDRSZ:
            raise ProtocolError(f"frame size {size} is below the header size")
        if size > limit:
            raise ProtocolError(f"frame size {size} exceeds msize {limit}")
        if have < size:
            return None
        if have == size:
            frame = bytes(buf)
            buf.clear()
        else:
            frame = bytes(buf[:size])
            del buf[:size]
        return frame


__all__ = [
    "DMAPPEND",
    "DMAUTH",
    "DMDIR",
    "DMEXCL",
    "DMEXEC",
    "DMREAD",
    "DMTMP",
    "DMWRITE",
    "EEXIST",
    "EFIDINUSE",
    "EINTERNAL",
    "EISDIR",
    "ENOTDIR",
    "ENOTFOUND",
    "EPERM",
    "EUNKNOWNFID",
    "IOHDRSZ",
    "MAXWELEM",
    "NOCHANGE",
    "NOFID",
    "NOTAG",
    "OEXEC",
    "ORCLOSE",
    "ORDWR",
    "OREAD",
    "OTRUNC",
    "OWRITE",
    "QTAPPEND",
    "QTAUTH",
    "QTDIR",
    "QTEXCL",
    "QTFILE",
    "QTTMP",
    "RATTACH",
    "RAUTH",
    "RCLUNK",
    "RCREATE",
    "RERROR",
    "RFLUSH",
    "ROPEN",
    "RREAD",
    "RREMOVE",
    "RSTAT",
    "RVERSION",
    "RWALK",
    "RWRITE",
    "RWSTAT",
    "R_TYPES",
    "TATTACH",
    "TAUTH",
    "TCLUNK",
    "TCREATE",
    "TERROR",
    "TFLUSH",
    "TOPEN",
    "TREAD",
    "TREMOVE",
    "TSTAT",
    "TVERSION",
    "TWALK",
    "TWRITE",
    "TWSTAT",
    "T_TYPES",
    "VERSION",
    "FrameBuffer",
    "Message",
    "NinePError",
    "ProtocolError",
    "Qid",
    "RMessage",
    "Rattach",
    "Rauth",
    "Rclunk",
    "Rcreate",
    "Rerror",
    "Rflush",
    "Ropen",
    "Rread",
    "Rremove",
    "Rstat",
    "Rversion",
    "Rwalk",
    "Rwrite",
    "Rwstat",
    "Stat",
    "TMessage",
    "Tattach",
    "Tauth",
    "Tclunk",
    "Tcreate",
    "Tflush",
    "Topen",
    "Tread",
    "Tremove",
    "Tstat",
    "Tversion",
    "Twalk",
    "Twrite",
    "Twstat",
    "decode",
    "decode_stats",
    "encode",
    "encode_stat",
]
