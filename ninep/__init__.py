"""9P2000 for trio: a typed codec, a file-server framework and a multiplexing client.

Shared by ``toolsrv`` (the tool server), the olliefs tool client and the 9P re-export of
the FUSE tree. ``ninep.codec`` is the wire format, ``ninep.server`` serves an
application's ``FileSystem``, ``ninep.client`` talks to any 9P2000 server.
"""

from ninep.client import Client, ConnectionLost
from ninep.codec import NinePError, ProtocolError, Qid, Stat
from ninep.server import BaseFileSystem, FileSystem, ServerStats, serve_connection, serve_unix

__all__ = [
    "BaseFileSystem",
    "Client",
    "ConnectionLost",
    "FileSystem",
    "NinePError",
    "ProtocolError",
    "Qid",
    "ServerStats",
    "Stat",
    "serve_connection",
    "serve_unix",
]
