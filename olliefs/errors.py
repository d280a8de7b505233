"""Typed errors raised by the runtime and mapped to errnos by the frontends.

The runtime knows nothing about errnos, inodes or 9P fids; it raises one of these and
``olliefs.fs.fuse`` (or later the 9P export) translates:

    OllieError
    ├── InvalidRequest   bad token, unknown key or command, malformed value   -> EINVAL
    ├── Busy             refused while a turn runs                            -> EBUSY
    ├── Exists           a name that is already taken                         -> EEXIST
    ├── NotFound         no such session / file                               -> ENOENT
    ├── Denied           the file's mode does not allow it                    -> EACCES
    ├── WouldBlock       O_NONBLOCK read at the end of a blocking file        -> EAGAIN
    ├── Interrupted      the reader got a signal while blocked                -> EINTR
    └── TooMany          too many blocked readers                             -> EMFILE

Every refused request leaves the runtime's state untouched; the message is what the user
sees in ``chat`` as ``error: ...``.
"""

from __future__ import annotations


class OllieError(Exception):
    """Base of every error a client request can provoke."""


class InvalidRequest(OllieError):
    pass


class Busy(OllieError):
    pass


class Exists(OllieError):
    pass


class NotFound(OllieError):
    pass


class Denied(OllieError):
    pass


class WouldBlock(OllieError):
    pass


class Interrupted(OllieError):
    pass


class TooMany(OllieError):
    pass
