"""Checkpoints: what one tool call changed under its cwd, captured through an overlay.

A call that asks for capture (``CallRequest.capture``, the session's store name) runs with
an overlayfs mounted over its cwd inside its own mount namespace: the tool writes to a
fresh upper dir of the session's store, the real tree is the lower layer and stays
untouched while the tool runs. When the call has ended (every process of it dead), only
the upper dir is walked, so the cost grows with what changed, not with the tree:

1. the changes are classified (A, M, D; a D and an A of equal content are a rename;
   whiteouts and opaque dirs give the deletions), and the content before (the real
   file) and after (the upper file) of each is kept in ``blobs/``, by hash;
2. the record ``rec/<seq>.json`` is written durably (tmp, fsync, rename, fsync of the
   dir), naming the upper dir it came from;
3. the upper dir is applied to the real tree (deletions, then moves or copies), and
   removed: its absence says the record is applied.

A crash (toolsrv or the daemon SIGKILLed) before 2 leaves an upper dir without a record:
it is dropped, the real tree never saw the call (none of it). A crash after 2 leaves a
record whose upper dir is still there: `recover` applies it again (each step can be
redone), so the real tree gets all of it. `recover` runs before each captured call of the
session and when the daemon restores the session.

``.git`` (and the other protected entries) keep their read-only bind over the overlay; a
path with a ``.git`` component is never captured nor applied.

The store of a session (``<capture root>/<name>/``): ``run/<token>/{u,w}`` the upper and
work dirs of calls in flight, ``blobs/<sha256>``, ``rec/<seq>.json``. The daemon reads it
(`olliefs.session.checkpoints`) and moves records away when it rewinds.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import secrets
import shutil
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import trio

from toolsrv import namespaces
from toolsrv.protect import PROTECTED_NAMES
from toolsrv.protocol import CallRequest

log = logging.getLogger(__name__)

OPAQUE_XATTR = "trusted.overlay.opaque"
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


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


class Store:
    """One session's checkpoint store (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs = root / "blobs"
        self.rec = root / "rec"
        self.run = root / "run"
        self.staged = root / "staged"
        self.staged_rec = root / "staged.json"
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


def _lower_files(lower: str, rel: str, out: list[str]) -> None:
    """Every file and symlink beneath the lower dir ``rel`` (what a deleted dir held)."""
    try:
        it = os.scandir(os.path.join(lower, rel))
    except OSError:
        return
    with it:
        for e in it:
            p = f"{rel}/{e.name}" if rel else e.name
            if protected(p):
                continue
            if e.is_dir(follow_symlinks=False):
                _lower_files(lower, p, out)
            else:
                out.append(p)


def _lower_dirs(lower: str, rel: str, out: list[str]) -> None:
    """The dirs beneath ``rel`` in the lower tree, children first."""
    try:
        it = os.scandir(os.path.join(lower, rel))
    except OSError:
        return
    with it:
        for e in it:
            if e.is_dir(follow_symlinks=False):
                p = f"{rel}/{e.name}"
                _lower_dirs(lower, p, out)
                out.append(p)


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
                _lower_files(lower, p, w.deleted)
                _lower_dirs(lower, p, w.rmdirs)
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
                _lower_files(lower, p, gone)
                w.deleted.extend(g for g in gone if not os.path.lexists(os.path.join(upper, g)))
                inner: list[str] = []
                _lower_dirs(lower, p, inner)
                w.rmdirs.extend(d for d in inner if not os.path.lexists(os.path.join(upper, d)))
            if not low_dir:
                w.mkdirs.append((p, stat.S_IMODE(st.st_mode)))
            _walk(upper, lower, p, w)
        elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
            if low_dir:
                _lower_files(lower, p, w.deleted)
                _lower_dirs(lower, p, w.rmdirs)
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


def recover(store: Store) -> None:
    """Finish what a crash left: records not yet applied are applied, upper dirs without
    a record (calls that never finished) are dropped."""
    with store.lock:
        try:
            runs = os.listdir(store.run)
        except FileNotFoundError:
            return
        with _locks_guard:
            runs = [t for t in runs if store.run / t not in _live]
        if not runs:
            return
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


class Overlay:
    """One call's overlay over its cwd (made in the server, mounted in the spawn thread)."""

    def __init__(self, store: Store, cwd: str, turn: int, review: bool = False) -> None:
        self.store = store
        self.cwd = cwd
        self.turn = turn
        self.review = review
        store.ensure()
        self.token = f"{int(time.time() * 1000):x}-{secrets.token_hex(4)}"
        # Review mode: one upper dir for the session, kept from call to call until the
        # edits in it are accepted or rejected (``staged.json`` says what it holds).
        self.dir = store.staged if review else store.run / self.token
        with _locks_guard:
            _live.add(self.dir)
        (self.dir / "u").mkdir(parents=True, mode=0o755, exist_ok=review)
        (self.dir / "w").mkdir(mode=0o700, exist_ok=review)
        self.users = 1  # the calls in flight that share it
        # Made here, where the store (hidden from tools) is seen; each call attaches a
        # copy in its own namespace, so calls running side by side see each other's files.
        self.mount_fd = namespaces.make_mount(
            "overlay",
            [
                ("lowerdir+", cwd),
                ("upperdir", str(self.dir / "u")),
                ("workdir", str(self.dir / "w")),
                ("redirect_dir", "off"),
                ("index", "off"),
                ("metacopy", "off"),
                ("xino", "off"),
            ],
        )

    def close(self) -> None:
        if self.mount_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.mount_fd)
            self.mount_fd = -1

    def enter(self, ruleset_fd: int | None) -> None:
        """In the spawning thread, after the mount plan: a namespace of its own (the plan's
        may be kept for other calls) with the overlay over the cwd, the mounts beneath the
        cwd (``.git`` read-only, hidden dirs) put back on top of it, and the overlay's root
        writable in the call's Landlock ruleset (``ruleset_fd``, this call's own: a rule on
        the real cwd does not reach the files of a mount over it)."""
        from toolsrv import sandbox

        namespaces.unshare(namespaces.CLONE_NEWNS)
        cwd = self.cwd
        subs = _submounts(cwd)
        clones = {p: namespaces.open_tree_clone(p, follow=False) for p in subs}
        try:
            fd = namespaces.clone_mount(self.mount_fd)
            try:
                namespaces.move_mount(fd, cwd)
            finally:
                os.close(fd)
            for p, c in clones.items():
                namespaces.move_mount(c, p)
        finally:
            for c in clones.values():
                os.close(c)
        if ruleset_fd is not None:
            sandbox.add_rule(ruleset_fd, cwd, sandbox.fs_rights(sandbox.landlock_abi()))

    def finish(self) -> Record | None:
        """After the call: record and apply what it changed (None: nothing)."""
        if self.review:
            with self.store.lock:
                stage(self.store, self.cwd)
            with _locks_guard:
                _live.discard(self.dir)
            return None
        with self.store.lock:
            upper = str(self.dir / "u")
            changes, w = collect(self.store, upper, self.cwd)
            if not changes and not w.mkdirs and not w.rmdirs:
                self.drop()
                return None
            rec = Record(
                self.store.next_seq(),
                self.turn,
                self.cwd,
                changes,
                w.mkdirs,
                w.rmdirs,
                f"run/{self.token}",
                time.time(),
            )
            self.store.write_record(rec)
            apply(self.store, rec, self.cwd)  # (its upper dir gone: applied)
            self.drop()
            return rec

    def drop(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        with _locks_guard:
            _live.discard(self.dir)


def _submounts(path: str) -> list[str]:
    """The mount points strictly beneath ``path`` not beneath another one (each is
    cloned with what it holds)."""
    found: list[str] = []
    with open("/proc/thread-self/mountinfo", "rb") as f:
        for line in f:
            point = _unescape(line.split(b" ")[4].decode(errors="surrogateescape"))
            if namespaces.strictly_beneath(point, path):
                found.append(point)
    found = sorted(set(found))
    return [p for p in found if not any(namespaces.strictly_beneath(p, o) for o in found)]


def _unescape(s: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def store_for(root: Path, name: str) -> Store | None:
    """The store of session ``name`` under ``root`` (None for an unsafe name)."""
    if not SAFE_NAME.fullmatch(name):
        return None
    return Store(root / name)


# The overlays of calls in flight, by (store, cwd): a call made while another of the
# session runs in the same cwd shares its overlay (a round of parallel calls).
_shared: dict[tuple[Path, str], Overlay] = {}


async def begin(root: Path | None, req: CallRequest, unsandboxed: bool) -> Overlay | None:
    """The overlay of a call that asks for capture (None: no capture for it)."""
    if root is None or not req.capture or unsandboxed or not namespaces.mount_namespaces():
        return None
    store = store_for(root, req.capture)
    if store is None or not os.path.isabs(req.cwd) or not os.path.isdir(req.cwd):
        return None
    cwd = os.path.realpath(req.cwd)
    key = (store.root, cwd)
    async with _begin_lock:
        ov = _shared.get(key)
        if ov is not None:
            ov.users += 1
            return ov

        def make() -> Overlay:
            store.ensure()
            recover(store)  # what a crash of an earlier server left
            return Overlay(store, cwd, req.turn, req.review)

        try:
            ov = _shared[key] = await trio.to_thread.run_sync(make)
        except OSError as err:
            # A cwd overlayfs cannot take as a layer, a store's filesystem without the
            # xattrs it needs: the call runs as without capture, and the log says why.
            log.warning("no checkpoint for a call in %s: %s", cwd, err)
            return None
        return ov


_begin_lock = trio.Lock()


async def end(overlay: Overlay | None) -> int:
    """After the call, even a cancelled one: when it is the last of those sharing the
    overlay, record and apply their changes; the record's number (0: none). Shielded:
    once the tools have run, their changes are never half kept."""
    if overlay is None:
        return 0
    overlay.users -= 1
    if overlay.users > 0:
        return 0
    _shared.pop((overlay.store.root, overlay.cwd), None)
    with trio.CancelScope(shield=True):
        overlay.close()
        try:
            rec = await trio.to_thread.run_sync(overlay.finish)
        except OSError:
            # Left for `recover`: applied at the next call if its record is durable.
            log.exception("checkpoint of the call in %s failed", overlay.cwd)
            with _locks_guard:
                _live.discard(overlay.dir)
            return 0
    return rec.seq if rec is not None else 0
