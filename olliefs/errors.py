"""Typed errors raised by the runtime; each class carries the errno a frontend answers.

The runtime knows nothing about inodes or 9P fids; it raises one of these, and every
frontend maps it the same way: FUSE answers ``err.errno``, 9P answers ``str(err)`` (the
reason) in its Rerror. One table, here, on the classes themselves:

    OllieError
    ├── InvalidRequest   bad token, unknown key or command, malformed value   EINVAL
    ├── Busy             refused while a turn runs                            EBUSY
    ├── Exists           a name that is already taken                         EEXIST
    ├── NotFound         no such session / file                               ENOENT
    ├── Denied           the file's mode does not allow it                    EACCES
    ├── NotPermitted     a mode, owner or times that cannot be changed        EPERM
    ├── WouldBlock       O_NONBLOCK read at the end of a blocking file        EAGAIN
    ├── Interrupted      the reader got a signal while blocked                EINTR
    ├── TooMany          too many blocked readers                             EMFILE
    ├── DiskError        what the disk refused (ENOSPC, EDQUOT, EIO ...)      its own
    └── TooLarge         a write or prompt over its stated limit              EFBIG

Every refused request leaves the runtime's state untouched; the message is what the user
sees in ``chat`` as ``error: ...``. A ``DiskError`` is answered with the errno the disk
gave (``disk_error`` makes one subclass per errno), so a full disk reaches the writer as
ENOSPC, never as a bare EIO.
"""

from __future__ import annotations

import errno as _errno
import os
from typing import ClassVar, cast


class OllieError(Exception):
    """Base of every error a client request can provoke."""

    errno: ClassVar[int] = _errno.EIO

    @property
    def reason(self) -> str:
        """The text a frontend with error strings (9P) sends back."""
        return str(self) or type(self).__name__


class InvalidRequest(OllieError):
    errno = _errno.EINVAL


class Busy(OllieError):
    errno = _errno.EBUSY


class Exists(OllieError):
    errno = _errno.EEXIST


class NotFound(OllieError):
    errno = _errno.ENOENT


class Denied(OllieError):
    errno = _errno.EACCES


class NotPermitted(OllieError):
    errno = _errno.EPERM


class WouldBlock(OllieError):
    errno = _errno.EAGAIN


class Interrupted(OllieError):
    errno = _errno.EINTR


class TooMany(OllieError):
    errno = _errno.EMFILE


class DiskError(OllieError):
    """A write (or read) the disk refused, answered with the errno the disk gave.

    One subclass per errno (made on first use, by ``disk_error``), because each error
    class carries its errno: ENOSPC, EDQUOT, EIO, EISDIR ... reach the client unchanged.
    ``told``: its reason is in ``err`` already (a prompt refused inside a ``ctl``
    request, ``inject`` while idle, is not reported twice).
    """

    told = False


_DISK_KINDS: dict[int, type[DiskError]] = {}


def disk_error(err: OSError, what: str) -> DiskError:
    """``err`` as the ``DiskError`` of its errno; the reason is ``what: strerror``."""
    code = err.errno or _errno.EIO
    kind = _DISK_KINDS.get(code)
    if kind is None:
        name = f"DiskError_{_errno.errorcode.get(code, str(code))}"
        kind = _DISK_KINDS[code] = cast(type[DiskError], type(name, (DiskError,), {"errno": code}))
    return kind(f"{what}: {err.strerror or os.strerror(code)}")


class TooLarge(OllieError):
    errno = _errno.EFBIG


REASON_MAX = 400
"""Characters of a refusal reason kept in ``err``, ``events``, chat and the log: a reason
quotes what was written, and a 5 MB bad write must not become a 5 MB error line."""


def short_reason(reason: str) -> str:
    """``reason`` cut to `REASON_MAX` characters, saying how much was left out."""
    if len(reason) <= REASON_MAX:
        return reason
    return f"{reason[:REASON_MAX]}... ({len(reason) - REASON_MAX} more characters)"


def size_text(n: int) -> str:
    """A limit as a reason states it: ``16 MiB`` for whole mebibytes, else ``N bytes``."""
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n} bytes"
