"""The checkpoint store both sides share: toolsrv writes it, the daemon reads it and
moves records away when it rewinds (see ``toolsrv.checkpoint`` for how a call's changes
are captured through an overlay, and ``olliefs.session.checkpoints`` for what the daemon
does with them).

The store of a session (``<capture root>/<name>/``): ``run/<token>/{u,w}`` the upper and
work dirs of calls in flight, ``blobs/<sha256>``, ``rec/<seq>.json``, ``staged/`` and
``staged.json`` in review mode. Everything here is plain file work (no mounts): the walk
of an upper dir, the durable writes, applying a record to the real tree and finishing one
a crash left half applied.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import secrets
import shutil
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

log = logging.getLogger(__name__)

# Entries no tool may write (read-only binds in every call), never captured nor restored.
PROTECTED_NAMES = frozenset({".git", ".ollie"})
OPAQUE_XATTR = "trusted.overlay.opaque"


class Obj(msgspec.Struct, frozen=True):
    """A file's state: ``kind`` ``file`` or ``link`` (a symlink, ``hash`` of its target)."""

    kind: str
    mode: int
    hash: str
    size: int


class Change(msgspec.Struct, frozen=True):
    """One path's change: ``pre`` None = created, ``post`` None = deleted. ``src``: a
    rename's old path (then that path's deletion is this entry's too)."""

    path: str
    pre: Obj | None = None
    post: Obj | None = None
    src: str = ""

    @property
    def op(self) -> str:
        if self.src:
            return "R"
        if self.pre is None:
            return "A"
        return "D" if self.post is None else "M"


class Record(msgspec.Struct):
    """``rec/<seq>.json``: one call's changes, in the order they are applied."""

    seq: int
    turn: int
    cwd: str
    changes: list[Change]
    mkdirs: list[tuple[str, int]] = []  # dirs the call made (path, mode), parents first
    rmdirs: list[str] = []  # dirs the call removed, children first
    upper: str = ""  # run/<token>: while it exists the record is not fully applied
    time: float = 0.0
    trimmed: bool = False  # its pre-images were dropped (the daemon's size cap)


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(Record)


def protected(rel: str) -> bool:
    return not PROTECTED_NAMES.isdisjoint(rel.split("/"))


def _fsync_dir(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` or what it held before, whatever crashes when."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


# One lock per store, for the process: two calls of a session end in two threads.
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()
# The upper dirs of this process's calls in flight: no recovery touches them.
_live: set[Path] = set()


def in_flight(upper: Path) -> None:
    """``upper`` belongs to a call of this process still running: no recovery takes it."""
    with _locks_guard:
        _live.add(upper)


def landed(upper: Path) -> None:
    """The call of ``upper`` has ended (its record is written, or it is dropped)."""
    with _locks_guard:
        _live.discard(upper)


class Store:
    """One session's checkpoint store (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs = root / "blobs"
        self.rec = root / "rec"
        self.run = root / "run"
        self.staged = root / "staged"
        self.staged_rec = root / "staged.json"
        self.merging = root / "merging.json"  # a review call's merge under way
        with _locks_guard:
            self.lock = _locks.setdefault(str(root), threading.Lock())

    def ensure(self) -> None:
        for d in (self.blobs, self.rec, self.run):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)

    def blob(self, digest: str) -> Path:
        return self.blobs / digest

    def records(self) -> list[Record]:
        """The records in the order they were made."""
        out = []
        try:
            names = sorted(n for n in os.listdir(self.rec) if n.endswith(".json"))
        except FileNotFoundError:
            return []
        for name in names:
            try:
                out.append(_dec.decode((self.rec / name).read_bytes()))
            except (OSError, msgspec.DecodeError):
                continue
        return out

    def next_seq(self) -> int:
        """The next record's number: one more than the highest ever given (``seq``, kept
        beside the records, as records moved away by a rewind keep theirs), past any
        record a crash left before ``seq`` said so. One read, not a listing."""
        try:
            seq = int((self.root / "seq").read_text()) + 1
        except (OSError, ValueError):
            names = os.listdir(self.rec) if self.rec.is_dir() else []
            seqs = [int(n.split(".")[0]) for n in names if n.split(".")[0].isdigit()]
            seq = max(seqs, default=0) + 1
        while (self.rec / f"{seq:08d}.json").exists():
            seq += 1
        return seq

    def keep_blob(self, src_fd: int, size: int) -> str:
        """Copy the open file ``src_fd`` into ``blobs/`` (once per content); its hash."""
        h = hashlib.sha256()
        tmp = self.blobs / f".in.{secrets.token_hex(6)}"
        with open(tmp, "wb") as out:
            os.lseek(src_fd, 0, os.SEEK_SET)
            while chunk := os.read(src_fd, 1 << 20):
                h.update(chunk)
                out.write(chunk)
            out.flush()
            digest = h.hexdigest()
            if not self.blob(digest).exists():
                os.fsync(out.fileno())
        if self.blob(digest).exists():
            tmp.unlink()
        else:
            os.replace(tmp, self.blob(digest))
        return digest

    def keep_bytes(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        if not self.blob(digest).exists():
            write_durably(self.blob(digest), data)
        return digest

    def write_record(self, rec: Record) -> Path:
        path = self.rec / f"{rec.seq:08d}.json"
        write_durably(path, _enc.encode(rec))
        (self.root / "seq").write_text(str(rec.seq))
        return path


def snapshot(store: Store, path: str) -> Obj | None:
    """Keep the file or symlink at ``path`` in the store; None when absent or a dir."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        target = os.fsencode(os.readlink(path))
        return Obj("link", mode, store.keep_bytes(target), len(target))
    if not stat.S_ISREG(st.st_mode):
        return None
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return Obj("file", mode, store.keep_blob(fd, st.st_size), st.st_size)
    finally:
        os.close(fd)


def _lower(lower: str, rel: str, files: list[str], dirs: list[str]) -> None:
    """What the lower dir ``rel`` holds (what a deleted or replaced dir held): every file
    and symlink (protected paths left out) into ``files``, every dir into ``dirs``,
    children first."""
    try:
        it = os.scandir(os.path.join(lower, rel))
    except OSError:
        return
    with it:
        for e in it:
            p = f"{rel}/{e.name}" if rel else e.name
            if e.is_dir(follow_symlinks=False):
                _lower(lower, p, files, dirs)
                dirs.append(p)
            elif not protected(p):
                files.append(p)


@dataclass
class _Walk:
    """What the upper dir says was done to the lower tree."""

    deleted: list[str] = field(default_factory=list)  # files and symlinks gone
    written: list[str] = field(default_factory=list)  # files and symlinks in upper
    mkdirs: list[tuple[str, int]] = field(default_factory=list)
    rmdirs: list[str] = field(default_factory=list)


def _walk(upper: str, lower: str, rel: str, w: _Walk) -> None:
    with os.scandir(os.path.join(upper, rel)) as it:
        entries = list(it)
    for e in entries:
        p = f"{rel}/{e.name}" if rel else e.name
        if protected(p):
            continue
        st = e.stat(follow_symlinks=False)
        low = os.path.join(lower, p)
        try:
            lst: os.stat_result | None = os.lstat(low)
        except (FileNotFoundError, NotADirectoryError):
            lst = None
        low_dir = lst is not None and stat.S_ISDIR(lst.st_mode)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # a whiteout
            if low_dir:
                _lower(lower, p, w.deleted, w.rmdirs)
                w.rmdirs.append(p)
            elif lst is not None:
                w.deleted.append(p)
        elif stat.S_ISDIR(st.st_mode):
            if lst is not None and not low_dir:
                w.deleted.append(p)
            opaque = False
            with contextlib.suppress(OSError):
                opaque = os.getxattr(e.path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
            if low_dir and opaque:  # removed and made again: what it held is gone
                gone: list[str] = []
                inner: list[str] = []
                _lower(lower, p, gone, inner)
                w.deleted.extend(g for g in gone if not os.path.lexists(os.path.join(upper, g)))
                w.rmdirs.extend(d for d in inner if not os.path.lexists(os.path.join(upper, d)))
            if not low_dir:
                w.mkdirs.append((p, stat.S_IMODE(st.st_mode)))
            _walk(upper, lower, p, w)
        elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
            if low_dir:
                _lower(lower, p, w.deleted, w.rmdirs)
                w.rmdirs.append(p)
            w.written.append(p)


def collect(store: Store, upper: str, lower: str) -> tuple[list[Change], _Walk]:
    """The changes the upper dir holds over ``lower``, their contents kept in the store."""
    w = _Walk()
    _walk(upper, lower, "", w)
    changes: dict[str, Change] = {}
    for p in w.deleted:
        pre = snapshot(store, os.path.join(lower, p))
        if pre is not None:
            changes[p] = Change(p, pre, None)
    for p in w.written:
        post = snapshot(store, os.path.join(upper, p))
        pre = changes.pop(p).pre if p in changes else snapshot(store, os.path.join(lower, p))
        if pre == post:  # opened for writing, or chmod back: nothing changed
            continue
        changes[p] = Change(p, pre, post)
    # A deletion and a creation of the same content: a rename.
    gone = {c.pre: c.path for c in changes.values() if c.post is None and c.pre is not None}
    for p, c in list(changes.items()):
        if c.pre is None and c.post is not None:
            old = gone.pop(c.post, None)
            if old is not None and old in changes:
                changes[p] = Change(p, changes.pop(old).pre, c.post, src=old)
    return sorted(changes.values(), key=lambda c: c.path), w


def _deleted_paths(rec: Record) -> list[str]:
    out = [c.path for c in rec.changes if c.post is None]
    out += [c.src for c in rec.changes if c.src]
    return out


def _put(upper: str, real: str, rel: str) -> None:
    """Make ``real/rel`` what ``upper/rel`` is: a rename where both are on one
    filesystem, else a copy beside it and a rename (never a half file in place)."""
    src = os.path.join(upper, rel)
    dst = os.path.join(real, rel)
    try:
        st = os.lstat(src)
    except FileNotFoundError:
        return  # moved by the first attempt
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        if stat.S_ISDIR(os.lstat(dst).st_mode):
            shutil.rmtree(dst)
    # (its directory may have been removed on disk while the call ran)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        os.rename(src, dst)
        return
    except OSError as err:
        if err.errno != errno.EXDEV:
            raise
    tmp = os.path.join(os.path.dirname(dst), f".ollie-put.{secrets.token_hex(4)}")
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), tmp)
    else:
        shutil.copy2(src, tmp, follow_symlinks=False)
    os.replace(tmp, dst)
    os.unlink(src)


def apply(store: Store, rec: Record, real: str) -> None:
    """Make the real tree what the record's upper dir says; can be redone at any point."""
    upper = str(store.root / rec.upper / "u") if rec.upper else ""
    for p in _deleted_paths(rec):
        with contextlib.suppress(FileNotFoundError, NotADirectoryError, IsADirectoryError):
            os.unlink(os.path.join(real, p))
    for d in rec.rmdirs:
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(real, d))
    for d, mode in rec.mkdirs:
        with contextlib.suppress(FileExistsError):
            os.mkdir(os.path.join(real, d), mode)
    if upper:
        for c in rec.changes:
            if c.post is not None:
                _put(upper, real, c.path)
        shutil.rmtree(store.root / rec.upper, ignore_errors=True)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _merge(src: str, dst: str, real: str) -> None:
    """Overlay ``src`` (a call's upper dir) onto ``dst`` (the staged one) as overlayfs
    would stack them, over the real tree ``real``. Each step can be done again: what is
    merged leaves ``src`` by a rename, and ``src`` goes only once all of it has."""
    for name in os.listdir(src):
        s, d, r = os.path.join(src, name), os.path.join(dst, name), os.path.join(real, name)
        st = os.lstat(s)
        if _whiteout(st):
            _remove(d)
            if os.path.lexists(r):  # deleted from the real tree once accepted
                os.mknod(d, stat.S_IFCHR, 0)
            os.unlink(s)
        elif stat.S_ISDIR(st.st_mode):
            try:
                opaque = os.getxattr(s, OPAQUE_XATTR, follow_symlinks=False) == b"y"
            except OSError:
                opaque = False
            if opaque or not (os.path.isdir(d) and not os.path.islink(d)):
                _remove(d)
                os.rename(s, d)
            else:
                _merge(s, d, r)
                os.chmod(d, stat.S_IMODE(st.st_mode))
                os.rmdir(s)
        else:
            _remove(d)
            os.rename(s, d)


def merge_staged(store: Store, token: str, cwd: str) -> None:
    """A review call's changes (``run/<token>/u``) join the staged edits, all or none:
    ``merging`` says durably which call is being merged before the first step, so a
    crash in the middle is finished by ``recover``; then ``staged.json`` is made anew."""
    upper = store.run / token / "u"
    if upper.is_dir() and os.listdir(upper):
        write_durably(store.merging, _enc.encode({"token": token, "cwd": cwd}))
        (store.staged / "u").mkdir(parents=True, mode=0o755, exist_ok=True)
        _merge(str(upper), str(store.staged / "u"), cwd)
    stage(store, cwd)
    store.merging.unlink(missing_ok=True)
    shutil.rmtree(store.run / token, ignore_errors=True)


def recover(store: Store) -> None:
    """Finish what a crash left: records not yet applied are applied, a review call's
    merge into the staged edits is finished, upper dirs without either (calls that never
    finished) are dropped."""
    with store.lock:
        try:
            runs = os.listdir(store.run)
        except FileNotFoundError:
            return
        with _locks_guard:
            runs = [t for t in runs if store.run / t not in _live]
        if not runs:
            return
        try:
            merging = msgspec.json.decode(store.merging.read_bytes())
        except FileNotFoundError:
            merging = None
        if merging is not None and merging["token"] in runs:
            runs.remove(merging["token"])
            merge_staged(store, merging["token"], merging["cwd"])
        pending = {r.upper: r for r in store.records() if r.upper}
        for token in runs:
            rec = pending.get(f"run/{token}")
            if rec is None or not os.path.isdir(rec.cwd):
                shutil.rmtree(store.run / token, ignore_errors=True)
                continue
            try:
                apply(store, rec, rec.cwd)
            except OSError as err:
                # Kept aside, not retried at every call: the disk refuses it for good.
                log.warning("checkpoint %d of %s not applied: %s", rec.seq, store.root, err)
                aside = store.root / "unapplied"
                aside.mkdir(exist_ok=True)
                os.replace(store.run / token, aside / token)


def staged(store: Store) -> Record | None:
    """What waits in review mode (None: nothing)."""
    try:
        return _dec.decode(store.staged_rec.read_bytes())
    except FileNotFoundError:
        return None


def stage(store: Store, cwd: str) -> None:
    """``staged.json`` made again from the staged upper dir. A path staged before keeps
    the content it had on disk then: accepting it checks the disk still has that."""
    before = staged(store)
    first = {c.path: c.pre for c in before.changes} if before is not None else {}
    first |= {c.src: c.pre for c in before.changes if c.src} if before is not None else {}
    changes, w = collect(store, str(store.staged / "u"), cwd)
    kept = []
    for c in changes:
        key = c.src or c.path
        pre = first[key] if key in first else c.pre
        kept.append(msgspec.structs.replace(c, pre=pre))
    rec = Record(0, 0, cwd, kept, w.mkdirs, w.rmdirs, "staged", time.time())
    write_durably(store.staged_rec, _enc.encode(rec))
