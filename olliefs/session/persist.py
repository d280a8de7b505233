"""The session journal: one append-only file of JSON lines per session.

Everything a session is can be rebuilt by replaying its journal: ``Create`` first, then
prompts as they are acknowledged, turn boundaries, every event (which re-renders ``chat``
and ``events``), history messages, usage, the TaskState, configuration changes and
renames.

Durability: records are written with ``write(2)`` as the turn goes (a killed daemon loses
none of them: they are in the kernel), and the file is fsync'd when a prompt is
acknowledged, when a turn ends and when the session is created, so a machine crash loses
at most the part of a turn that was still running. A record is in the file whole or not
at all: an append the disk refuses (a full disk, a quota, an I/O error) is cut back
before anything else is appended (``Journal``). A torn last line (a crash inside
``write``) is ignored on replay and cut; a line that an older version tore at a full
disk and glued the next record to is split again, and the record after the tear kept.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from olliefs.agent.events import Event
from olliefs.agent.taskstate import TaskState
from olliefs.backend.base import Message, Usage
from olliefs.errors import DiskError, disk_error

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


class TaskStateRec(msgspec.Struct, tag="taskstate"):
    """The agent's TaskState (the ``taskstate`` file), whole, each time it changed: a
    turn's goal, each tool round, a compaction, a clear. Restored as the last one read,
    so the next compaction goes on from it instead of from nothing."""

    state: TaskState


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
    | TaskStateRec
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
    """Append-only records, each one whole in the file or not there at all.

    Every append remembers where the file ended before it (``size``); an append the disk
    refuses (ENOSPC, EDQUOT, EIO ...) is cut back to there with ``ftruncate``, so a
    half-written record never stays in the file, and the next record starts on a line of
    its own. If even the cut fails, the length is kept and the cut is made before the next
    append, which is refused if it still cannot be made: a torn record can be at most the
    last line of the file (which a restore cuts), never one in the middle.

    A *strict* append (a prompt, a ``ctl`` or ``cfg`` request, a session's creation)
    raises ``DiskError`` when it cannot be written: the caller refuses its request, and
    nothing of it is in the file. Any other append (the events of a turn, a history
    message, a state change) cannot be refused, since what it records has happened: it
    joins the *backlog*, the records owed to the file, in order. While anything is owed,
    every append writes the backlog first (or joins it), so the file is always a prefix
    of the session's records, in their order, as after a crash: a restore brings back
    exactly that prefix. ``error`` says why records are owed; ``on_broken`` is called
    when the first one is, ``on_mended`` when the backlog is written out.

    Appends run on one thread (the trio thread); ``sync`` (an fsync) may run in a worker
    thread meanwhile. Appends are counted, and a sync marks as durable only what was
    appended before it began, so an append that races with a sync in another thread is
    never taken as synced.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        # Read and write: ``retract`` reads back the records it moves.
        self._fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._size = os.fstat(self._fd).st_size  # where the last whole record ends
        self._cut_due = False  # a failed append left bytes past _size that are not cut yet
        self._backlog: deque[bytes] = deque()
        self.error: DiskError | None = None  # why the backlog is not written
        self.on_broken: Callable[[DiskError], None] | None = None
        self.on_mended: Callable[[], None] | None = None
        self._appended = 0
        self._synced = 0
        self._lock = threading.Lock()  # sync and close may run in different threads

    @property
    def size(self) -> int:
        """Where the file's last whole record ends (the next one starts there)."""
        return self._size

    @property
    def owed(self) -> int:
        """Records in the backlog (appended, not yet in the file)."""
        return len(self._backlog)

    def append(self, rec: Record, *, strict: bool = False) -> None:
        data = _encoder.encode(rec) + b"\n"
        self._append([data], len(data), strict)

    def append_event(self, line: bytes) -> None:
        """An ``Ev`` record of the event whose ``encode_line`` is ``line``."""
        if self._fd < 0:
            return
        with memoryview(line) as view, view[:-1] as event:
            self._append([_EV_HEAD, event, b"}\n"], len(line) + len(_EV_HEAD) + 1, False)

    def append_records(self, records: Sequence[Record | bytes]) -> int:
        """Several records as one strict write, all of them in the file or none (after
        the backlog); ``bytes`` is an event's ``encode_line`` (as ``append_event``).
        Returns where they start in the file."""
        parts: list[bytes | memoryview] = [
            _EV_HEAD + r[:-1] + b"}\n" if isinstance(r, bytes) else _encoder.encode(r) + b"\n"
            for r in records
        ]
        size = sum(map(len, parts))
        self._append(parts, size, True)
        return self._size - size

    def _append(self, parts: list[bytes | memoryview], size: int, strict: bool) -> None:
        if self._fd < 0:
            return  # closed: the session is gone, and what it still says goes nowhere
        try:
            if self._backlog and not self.catch_up():
                assert self.error is not None
                raise type(self.error)(str(self.error))  # one of its own for each refusal
            self._write(parts, size)
        except DiskError as err:
            if strict:
                raise
            self._backlog.append(b"".join(parts))
            self._broke(err)

    def _broke(self, err: DiskError) -> None:
        """Records are owed (``err`` is why); the first time since the file took them
        all, ``on_broken`` is told."""
        if self.error is None:
            self.error = err
            log.warning("%s: %s; records are kept in memory until it can be", self.path, err)
            if self.on_broken is not None:
                self.on_broken(err)

    def _write(self, parts: Sequence[bytes | memoryview], size: int) -> None:
        """``parts`` at the end of the file, whole (O_APPEND: a writev lands whole at the
        end, as one write would), or nothing of them: a failure is cut back."""
        if self._cut_due:
            self._cut("cutting back a partial record")
        try:
            done = os.writev(self._fd, parts)
            if done < size:  # short (a full disk, or a signal): the rest, once joined
                rest = memoryview(b"".join(parts))[done:]
                while rest:
                    rest = rest[os.write(self._fd, rest) :]
        except OSError as err:
            failed = disk_error(err, "journal")
            self._cut_due = True
            try:
                self._cut("cutting back a partial record")
            except DiskError as cut:
                log.warning("%s: %s; cut before the next append", self.path, cut)
            raise failed from None
        self._size += size
        self._appended += 1

    def _cut(self, what: str) -> None:
        """The file back to ``size`` (a no-op when nothing is past it)."""
        try:
            os.ftruncate(self._fd, self._size)
        except OSError as err:
            raise disk_error(err, f"journal ({what})") from None
        self._cut_due = False
        self._appended += 1  # the cut, too, reaches the disk at the next sync

    def catch_up(self) -> bool:
        """Write the backlog, oldest first, as far as the disk allows; True when nothing
        is owed any more. On the appending thread only."""
        while self._backlog:
            data = self._backlog[0]
            try:
                self._write([data], len(data))
            except DiskError as err:
                self.error = err
                return False
            self._backlog.popleft()
        if self.error is not None:
            log.info("%s: written again", self.path)
            self.error = None
            if self.on_mended is not None:
                self.on_mended()
        return True

    def retract(self, start: int, end: int) -> None:
        """Take the records in ``[start, end)`` out of the file (a prompt whose fsync
        failed, so that it is not acknowledged after all): the records appended after
        them move up. Raises ``DiskError`` if the file cannot be read or cut; records
        that cannot be written back join the front of the backlog."""
        try:
            tail = b""
            while end + len(tail) < self._size:
                more = os.pread(self._fd, self._size - end - len(tail), end + len(tail))
                if not more:
                    break
                tail += more
        except OSError as err:
            raise disk_error(err, "journal (reading back)") from None
        size, self._size = self._size, start
        try:
            self._cut("retracting records")
        except DiskError:
            self._size = size  # nothing was cut: the file is as it was
            raise
        if not tail:
            return
        try:
            self._write([tail], len(tail))
        except DiskError as err:
            self._backlog.extendleft(reversed(tail.splitlines(keepends=True)))
            self._broke(err)

    @property
    def dirty(self) -> bool:
        """Appended since the last sync (so a sync has something to do)."""
        return self._appended != self._synced

    def sync(self) -> None:
        """Make everything in the file durable (fsync); not the backlog, which only the
        appending thread writes (``catch_up``). Cheap when nothing changed."""
        with self._lock:
            upto = self._appended
            if upto != self._synced and self._fd >= 0:
                try:
                    os.fsync(self._fd)
                except OSError as err:
                    raise disk_error(err, "journal (fsync)") from None
                self._synced = max(self._synced, upto)

    def close(self) -> None:
        """Write what is owed if the disk allows it now, sync, close. What still cannot
        be written is lost, and logged (the file holds the records before it)."""
        if self._fd < 0:
            return
        if not self.catch_up():
            log.warning(
                "%s: %d records not written (%s): the journal ends before them",
                self.path,
                len(self._backlog),
                self.error,
            )
        try:
            self.sync()
        except DiskError as err:
            log.warning("%s: %s", self.path, err)
        self.abandon()

    def abandon(self) -> None:
        """Close without writing or syncing anything more (a creation that failed)."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        self._backlog.clear()


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
        try:
            shutil.copyfile(src, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.link(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)  # a copy cut by a full disk is not left behind
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


def write_branch(
    root: Path, k: int, messages: Sequence[Message], chat: bytes, diff: bytes | None = None
) -> None:
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
    try:
        ctx = b"".join(_encoder.encode(m) + b"\n" for m in messages)
        files = [("context", ctx), ("chat", chat)]
        if diff is not None:  # what the rewound turns did to the files (checkpoints)
            files.append(("diff", diff))
        for name, data in files:
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        sync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk leaves nothing half-written
        raise
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
            glued = _unglued(line)
            if glued is None:
                log.warning("%s:%d: unreadable journal record ignored from here: %s", path, n, e)
                break
            log.warning("%s:%d: a torn record (%d bytes) dropped", path, n, glued[0])
            records.append(glued[1])
    return records


_RECORD_HEAD = b'{"type":"'


def _unglued(line: bytes) -> tuple[int, Record] | None:
    """The record glued to a torn one in ``line``, and where it starts; None if there is
    none. Versions before the cut-back left a record torn by a full disk in the file, and
    appended the next one right after it, on the same line. The glued record starts at a
    ``{"type":"`` (in a JSON string the quotes would be escaped); of those, the last one
    that decodes to the end of the line is it (an object nested in a record never does:
    the line ends with its record's closing braces)."""
    at = len(line)
    while (at := line.rfind(_RECORD_HEAD, 1, at)) > 0:
        try:
            return at, _decoder.decode(line[at:])
        except msgspec.DecodeError:
            continue
    return None
