"""The index of saved sessions: what ``s/`` and ``s/idx`` show of each, without its journal.

A start with hundreds of saved sessions read every journal before the mount answered:
the listing of ``s/`` waited for histories nobody had asked for. So a clean stop writes,
next to the journals (``sessions/index.json``), one entry per session idle at rest (no
turn running, nothing queued, its journal whole): its ids, birth, cfg, cost, and the
size, mtime and inode of its journal at that moment. The next start reads the index and
removes it at once; a session whose journal still matches its entry is listed from the
entry and restored from its journal at its first use (``Registry.wake``); every other
journal is restored at the start, as without an index.

The journal stays the record: the index only saves reading it. A crash leaves no index
(the start removed it, and only a clean stop writes one), so the start after a crash
reads every journal; a journal changed behind the index (another size, mtime or inode)
is read whatever its entry says. An index that cannot be read is ignored. It is written
without an fsync: losing it costs a slower start, nothing else.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec

log = logging.getLogger(__name__)

NAME = "index.json"


class Entry(msgspec.Struct, frozen=True):
    uid: str
    id: str
    created: float
    agent: str
    backend: str
    model: str
    cwd: str
    cost: float  # the session's own cost so far (its parent's cost file shows it)
    size: int  # the journal's, when the entry was written
    mtime_ns: int
    ino: int

    def matches(self, st: os.stat_result) -> bool:
        """Whether the journal is as it was when the entry was written."""
        return (st.st_size, st.st_mtime_ns, st.st_ino) == (self.size, self.mtime_ns, self.ino)

    def idx_line(self) -> str:
        """The session's line of ``s/idx`` (idle: only sessions idle at rest have one)."""
        return f"{self.id}\tidle\t{self.cwd}\t{self.backend}\t{self.model}\n"


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(list[Entry])


def take(sessions_dir: Path) -> dict[str, Entry]:
    """The index's entries by uid, and the index removed (see the module docstring)."""
    path = sessions_dir / NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as err:
        log.info("%s: not read (%s): every journal is read", path, err)
        return {}
    try:
        path.unlink()
    except OSError as err:
        # An index that stays would be trusted again after a crash of this run.
        log.info("%s: not removed (%s): every journal is read", path, err)
        return {}
    try:
        return {e.uid: e for e in _decoder.decode(data)}
    except msgspec.DecodeError as err:
        log.info("%s: unreadable (%s): every journal is read", path, err)
        return {}


def write(sessions_dir: Path, entries: list[Entry]) -> None:
    path = sessions_dir / NAME
    tmp = sessions_dir / f".{NAME}.tmp"
    try:
        tmp.write_bytes(_encoder.encode(entries))
        os.replace(tmp, path)
    except OSError as err:
        log.info("%s: not written (%s): the next start reads every journal", path, err)
        tmp.unlink(missing_ok=True)
