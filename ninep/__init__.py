"""9P2000 for trio: a typed codec, a file-server framework and a multiplexing client.

Shared by ``toolsrv`` (the tool server), the olliefs tool client and the 9P re-export of
the FUSE tree. ``ninep.codec`` is the wire format, ``ninep.transport`` carries its frames
over a trio stream, ``ninep.server`` serves an application's ``FileSystem``,
``ninep.client`` talks to any 9P2000 server.

The codec is pure: ``import ninep.codec`` must not pull in trio (a parser, a test, or a
tool that only needs the wire format should not load an event loop). Importing a
submodule runs this file first, so the trio-bound names below are only loaded when one
of them is first asked for (PEP 562); ``from ninep import Client`` works as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ninep.codec import NinePError, ProtocolError, Qid, Stat

if TYPE_CHECKING:
    from ninep.client import Client, ConnectionLost
    from ninep.server import (
        BaseFileSystem,
        FileSystem,
        ServerStats,
        serve_connection,
        serve_unix,
    )

_LAZY = {
    "Client": "ninep.client",
    "ConnectionLost": "ninep.client",
    "BaseFileSystem": "ninep.server",
    "FileSystem": "ninep.server",
    "ServerStats": "ninep.server",
    "serve_connection": "ninep.server",
    "serve_unix": "ninep.server",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ninep' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


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
