"""The session journal: one append-only file of JSON lines per session.

Everything a session is can be rebuilt by replaying its journal: ``Create`` first, then
prompts as they are acknowledged, turn boundaries, every event (which re-renders ``chat``
and ``events``), history messages, usage, configuration changes and renames.

Durability: records are written with ``write(2)`` as the turn goes (a killed daemon loses
none of them: they are in the kernel), and the file is fsync'd when a prompt is
acknowledged, when a turn ends and when the session is created, so a machine crash loses
at most the part of a turn that was still running. A torn last line (a crash inside
``write``) is ignored on replay.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from olliefs.agent.events import Event
from olliefs.backend.base import Message, Usage

log = logging.getLogger(__name__)


class Create(msgspec.Struct, tag="create"):
    uid: str
    id: str
    cwd: str
    backend: str
    model: str
    agent: str
    ts: float


class Prompt(msgspec.Struct, tag="prompt"):
    seq: int
    text: str
    ts: float


class Start(msgspec.Struct, tag="start"):
    seq: int


class End(msgspec.Struct, tag="end"):
    seq: int


class Ev(msgspec.Struct, tag="ev"):
    ev: Event


class Msg(msgspec.Struct, tag="msg", omit_defaults=True):
    """A history message. ``streamed``: its ``content`` and ``reasoning`` were left out
    because they are the text of the ``assistant`` / ``reasoning`` events journaled since
    the previous ``msg`` record (see ``StreamedText``); journals written before the field
    existed never set it, so they load as they always did."""

    msg: Message
    streamed: bool = False


class UsageRec(msgspec.Struct, tag="usage"):
    usage: Usage
    cost: float
    estimated: bool = False


class TurnCost(msgspec.Struct, tag="turncost"):
    cost: float


class Cfg(msgspec.Struct, tag="cfg"):
    values: dict[str, Any]


class Rename(msgspec.Struct, tag="rename"):
    id: str


class Clear(msgspec.Struct, tag="clear"):
    pass


class Tools(msgspec.Struct, tag="tools"):
    """The agent's loaded tools after a ``tool_load`` / ``tool_unload`` (the whole list)."""

    names: list[str]


class Dropped(msgspec.Struct, tag="dropped"):
    """Queued prompts dropped by ``ctl queue clear`` (never run, also not after a restart)."""

    seqs: list[int]


class MaxSteps(msgspec.Struct, tag="maxsteps"):
    n: int


class Rewind(msgspec.Struct, tag="rewind"):
    """The last ``n`` turns left the history; they are kept in ``branches/<branch>/``."""

    n: int
    branch: int


class Plan(msgspec.Struct, tag="plan"):
    """The agent's plan (the ``plan`` file), replaced whole."""

    text: str


class Replaced(msgspec.Struct, tag="replaced"):
    """A compaction replaced the history (the old one is in ``compactions/<n>/``)."""

    messages: list[Message]
    n: int


Record = (
    Create
    | Prompt
    | Start
    | End
    | Ev
    | Msg
    | UsageRec
    | TurnCost
    | Cfg
    | Rename
    | Clear
    | Tools
    | Dropped
    | MaxSteps
    | Rewind
    | Plan
    | Replaced
)


class StreamedText:
    """Keeps a streamed reply's text out of its ``msg`` record: the journal holds it once.

    A reply reaches the journal twice by nature: as the ``assistant`` (and ``reasoning``)
    events that stream it, coalesced per scheduler tick, and as the history message made
    of it when the reply ends. The message record is where the copy can go: when its
    ``content`` and ``reasoning`` are exactly the concatenation of the ``assistant`` and
    ``reasoning`` event texts journaled since the previous ``msg`` record, they are left
    out and the record says ``streamed``; replay puts them back from the same events.

    The rule looks only at the sequence of records, so the writer (``pack``, on every
    record appended) and the reader (``unpack``, on every record replayed) follow the same
    state, and anything that breaks the equality (a retried reply whose cut first attempt
    streamed too, a message that was never streamed) is simply written whole. A SIGKILL
    between the events and the message loses nothing either way: the events are written
    as they come, and a message that never reached the journal was never acknowledged.
    """

    __slots__ = ("_content", "_reasoning")

    def __init__(self) -> None:
        self._content: list[str] = []
        self._reasoning: list[str] = []

    def saw(self, ev: Event) -> None:
        """``ev`` was journaled (by ``Journal.append_event``, which bypasses ``pack``)."""
        self._event(ev)

    def _event(self, ev: Event) -> None:
        if ev.role == "assistant":
            self._content.append(ev.content)
        elif ev.role == "reasoning":
            self._reasoning.append(ev.content)

    def _reset(self) -> None:
        self._content = []
        self._reasoning = []

    def pack(self, rec: Record) -> Record:
        """The record to write for ``rec`` (``rec`` itself, or its message elided)."""
        if isinstance(rec, Ev):
            self._event(rec.ev)
        elif isinstance(rec, Msg):
            m = rec.msg
            if (
                not rec.streamed
                and m.role == "assistant"
                and (self._content or self._reasoning)
                and _concatenation(m.content, self._content)
                and _concatenation(m.reasoning, self._reasoning)
            ):
                rec = Msg(msgspec.structs.replace(m, content="", reasoning=""), streamed=True)
            self._reset()
        return rec

    def unpack(self, rec: Record) -> Record:
        """``rec`` as it was before ``pack`` (a ``streamed`` message gets its text back)."""
        if isinstance(rec, Ev):
            self._event(rec.ev)
        elif isinstance(rec, Msg):
            if rec.streamed:
                text, reasoning = "".join(self._content), "".join(self._reasoning)
                rec = Msg(msgspec.structs.replace(rec.msg, content=text, reasoning=reasoning))
            self._reset()
        return rec


def _concatenation(text: str, parts: list[str]) -> bool:
    """``text == "".join(parts)``, without making the join (a reply can be 10 MB)."""
    if len(text) != sum(map(len, parts)):
        return False
    pos = 0
    for part in parts:
        if not text.startswith(part, pos):
            return False
        pos += len(part)
    return True


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Record)
# An ``ev`` record is its event's JSON line in an envelope: ``event_record`` builds it from
# the line the logs get anyway, instead of encoding (and escaping) the text a second time.
_EV_HEAD = b'{"type":"ev","ev":'


class Journal:
    """Append-only records; ``sync`` may run in a worker thread while appends go on.

    Appends are counted, and a sync marks as durable only what was appended before it
    began, so an append that races with a sync in another thread is never taken as
    synced.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._appended = 0
        self._synced = 0
        self._lock = threading.Lock()  # sync and close may run in different threads

    def append(self, rec: Record) -> None:
        self._write(_encoder.encode(rec) + b"\n")

    def append_event(self, line: bytes) -> None:
        """An ``Ev`` record of the event whose ``encode_line`` is ``line``."""
        if self._fd < 0:
            return
        with memoryview(line) as view, view[:-1] as event:
            self._writev([_EV_HEAD, event, b"}\n"], len(line) + len(_EV_HEAD) + 1)

    def _write(self, data: bytes) -> None:
        if self._fd < 0:
            return  # closed: the session is gone, and what it still says goes nowhere
        os.write(self._fd, data)
        self._appended += 1

    def _writev(self, parts: list[bytes | memoryview], size: int) -> None:
        """``parts`` as one record, without joining them first (a delta can be large).
        O_APPEND: a writev lands whole at the end, as one write would."""
        done = os.writev(self._fd, parts)
        if done < size:  # short (a full disk, or a signal): the rest, once joined
            os.write(self._fd, b"".join(parts)[done:])
        self._appended += 1

    @property
    def dirty(self) -> bool:
        """Appended since the last sync (so a sync has something to do)."""
        return self._appended != self._synced

    def sync(self) -> None:
        """Make everything appended so far durable (fsync). Cheap when nothing changed."""
        with self._lock:
            upto = self._appended
            if upto != self._synced and self._fd >= 0:
                os.fsync(self._fd)
                self._synced = max(self._synced, upto)

    def close(self) -> None:
        self.sync()
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_libc = ctypes.CDLL(None, use_errno=True)


def rename_noreplace(src: Path, dst: Path) -> None:
    """``rename(src, dst)`` that fails with FileExistsError instead of replacing
    ``dst`` (renameat2 RENAME_NOREPLACE: atomic, one name or the other). Where the
    filesystem cannot do that, a hard link and an unlink (a crash between them leaves
    both names, never neither); across filesystems, a copy that is synced first."""
    rc = _libc.renameat2(
        _AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE
    )
    if rc == 0:
        return
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        raise FileExistsError(err, os.strerror(err), str(dst))
    if err not in (errno.EINVAL, errno.ENOSYS, errno.EXDEV):
        raise OSError(err, os.strerror(err), str(src))
    if err == errno.EXDEV:
        tmp = dst.with_name(f".{dst.name}.tmp")
        shutil.copyfile(src, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        try:
            os.link(tmp, dst)
        finally:
            os.unlink(tmp)
    else:
        os.link(src, dst)
    os.unlink(src)


def keep_as(src: Path, directory: Path, stamp: str, sid: str, ext: str) -> Path:
    """Move ``src`` to ``directory/STAMP-ID.EXT``, or ``STAMP.N-ID.EXT`` (N = 2, 3, ...)
    when that name is taken (two sessions of one name removed, or one saved twice,
    within a second): a transcript never replaces another. The directory is synced."""
    n = 1
    while True:
        dest = directory / (f"{stamp}-{sid}{ext}" if n == 1 else f"{stamp}.{n}-{sid}{ext}")
        try:
            rename_noreplace(src, dest)
            break
        except FileExistsError:
            n += 1
    sync_dir(directory)
    return dest


def write_branch(root: Path, k: int, messages: Sequence[Message], chat: bytes) -> None:
    """``root/<k>/{context,chat}``: the history and chat a rewind took away, durably.

    Written in ``.<k>.tmp`` and renamed: a crash in here leaves ``<k>`` whole or absent,
    never a context cut half-way (the tree hides the temp dir, and the next write of this
    number clears it). ``<k>`` exists already only if a machine crash lost the Rewind
    record that named it after the branch was synced; it is replaced, as it always was.
    Blocking: run it in a worker thread from trio.
    """
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    final, tmp = root / str(k), root / f".{k}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    ctx = b"".join(_encoder.encode(m) + b"\n" for m in messages)
    for name, data in (("context", ctx), ("chat", chat)):
        with open(tmp / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    sync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    sync_dir(root)


def _repaired(path: Path, data: bytes) -> bytes:
    """``data`` without a torn last line, cut from the file too, so that the next
    append starts on a line of its own."""
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        log.warning("%s: torn last record (%d bytes) cut", path, len(data) - keep)
        os.truncate(path, keep)
        return data[:keep]
    return data


def read_journal(path: Path) -> list[Record]:
    """All complete records; a torn or undecodable line ends the replay there."""
    return _records(path, path.read_bytes())


def restore_journal(path: Path) -> list[Record]:
    """``read_journal`` of a journal whose torn last line, if any, is cut from the
    file first; one read of the file (a restore read each journal twice)."""
    return _records(path, _repaired(path, path.read_bytes()))


def _records(path: Path, data: bytes) -> list[Record]:
    records: list[Record] = []
    for n, line in enumerate(data.split(b"\n")[:-1], 1):
        if not line.strip():
            continue
        try:
            records.append(_decoder.decode(line))
        except msgspec.DecodeError as e:
            log.warning("%s:%d: unreadable journal record ignored from here: %s", path, n, e)
            break
    return records
