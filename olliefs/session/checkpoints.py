"""Checkpoints, the daemon's side: the store toolsrv fills (`toolsrv.checkpoint`) read as
turns, rendered as ``files`` and ``diff``, and undone by ``ctl rewind``.

A checkpoint is every live record of one turn (the tool calls of the turn and the
``!cmd`` prompts after it), numbered from 1 in the order of the turns. A rewind restores
the files of the records it undoes, newest first, and moves the records to
``branches/<k>/`` of the store, where ``diff`` keeps what they did.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import os
import shutil
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from olliewire.checkpoints import Change, Obj, Record, Store, stage, staged, write_durably

__all__ = ["Store", "staged"]

_dec = msgspec.json.Decoder(Record)


@dataclass
class Net:
    """One path's change over several records: its first state before and last after."""

    path: str
    pre: Obj | None
    post: Obj | None
    src: str = ""


@dataclass
class Checkpoint:
    turn: int
    records: list[Record] = field(default_factory=list)
    sealed: bool = False  # of a conversation since cleared or compacted (see `seal`)


def floors(st: Store) -> list[int]:
    """The record numbers at which the conversation's turns were counted afresh."""
    try:
        return [int(x) for x in (st.root / "floors").read_text().split()]
    except (OSError, ValueError):
        return []


def seal(st: Store) -> None:
    """The conversation's turns start again from 1 (ctl clear, a compaction, ctl agent):
    the records so far belong to turns that no rewind can count any more."""
    last = max((r.seq for r in st.records()), default=0)
    if last and last not in floors(st):
        st.root.mkdir(parents=True, exist_ok=True)
        with open(st.root / "floors", "a") as f:
            f.write(f"{last}\n")


def store(root: Path, uid: str) -> Store:
    return Store(root / uid)


def checkpoints(st: Store) -> list[Checkpoint]:
    """The live records of the store, by turn (oldest first; the turns of a conversation
    since cleared or compacted before those of the current one)."""
    fl = floors(st)
    out: dict[tuple[int, int], Checkpoint] = {}
    for rec in st.records():
        if rec.changes or rec.mkdirs or rec.rmdirs:
            epoch = sum(1 for f in fl if rec.seq > f)
            cp = out.setdefault((epoch, rec.turn), Checkpoint(rec.turn, sealed=epoch < len(fl)))
            cp.records.append(rec)
    return [out[k] for k in sorted(out)]


def net(records: Sequence[Record]) -> list[Net]:
    """What ``records`` (in order) did in all, path by path."""
    out: dict[str, Net] = {}
    for rec in records:
        for c in rec.changes:
            if c.src:
                gone = out.get(c.src)
                if gone is None:
                    out[c.src] = Net(c.src, c.pre, None)
                else:
                    gone.post = None
            now = out.get(c.path)
            if now is None:
                out[c.path] = Net(c.path, None if c.src else c.pre, c.post)
            else:
                now.post = c.post
    # A path gone and one made with the same content: a rename.
    result = {p: n for p, n in out.items() if n.pre != n.post}
    gone_by = {n.pre: p for p, n in result.items() if n.post is None and n.pre is not None}
    for n in list(result.values()):
        if n.pre is None and n.post is not None and n.post in gone_by:
            old = gone_by.pop(n.post)
            n.pre, n.src = result.pop(old).pre, old
    return sorted(result.values(), key=lambda n: n.path)


def files_text(changes: Sequence[Net]) -> str:
    lines = []
    for n in changes:
        if n.src:
            lines.append(f"R\t{n.src} -> {n.path}")
        else:
            op = "A" if n.pre is None else "D" if n.post is None else "M"
            lines.append(f"{op}\t{n.path}")
    return "".join(line + "\n" for line in lines)


def _blob(st: Store, obj: Obj | None) -> bytes:
    if obj is None:
        return b""
    try:
        return st.blob(obj.hash).read_bytes()
    except OSError:
        return b""


def _git_mode(obj: Obj) -> str:
    if obj.kind == "link":
        return "120000"
    return "100755" if obj.mode & 0o111 else "100644"


def _binary(data: bytes) -> bool:
    if b"\0" in data[:8000]:
        return True
    try:
        data.decode()
    except UnicodeDecodeError:
        return True
    return False


def diff_text(st: Store, changes: Sequence[Net]) -> str:
    """The changes as git writes a diff (``a/`` and ``b/``), for ``patch -p1``."""
    out: list[str] = []
    for n in changes:
        old_path = n.src or n.path
        out.append(f"diff --git a/{old_path} b/{n.path}\n")
        if n.pre is None and n.post is not None:
            out.append(f"new file mode {_git_mode(n.post)}\n")
        elif n.post is None and n.pre is not None:
            out.append(f"deleted file mode {_git_mode(n.pre)}\n")
        elif n.pre is not None and n.post is not None:
            if _git_mode(n.pre) != _git_mode(n.post):
                out.append(f"old mode {_git_mode(n.pre)}\nnew mode {_git_mode(n.post)}\n")
            if n.src:
                same = "100" if n.pre.hash == n.post.hash else "50"
                out.append(f"similarity index {same}%\nrename from {n.src}\nrename to {n.path}\n")
        a, b = _blob(st, n.pre), _blob(st, n.post)
        if (n.pre is not None and n.post is not None and n.pre.hash == n.post.hash) or a == b:
            continue
        fa = f"a/{old_path}" if n.pre is not None else "/dev/null"
        fb = f"b/{n.path}" if n.post is not None else "/dev/null"
        if _binary(a) or _binary(b):
            out.append(f"Binary files {fa} and {fb} differ\n")
            continue
        al = a.decode().splitlines(keepends=True)
        bl = b.decode().splitlines(keepends=True)
        for line in difflib.unified_diff(al, bl, fa, fb):
            if line.endswith("\n"):
                out.append(line)
            else:
                out.append(line + "\n\\ No newline at end of file\n")
    return "".join(out)


def share(src: Store, dst: Store, turns: int) -> None:
    """A fork's checkpoints: the parent's up to the fork point (its first ``turns``
    turns, and those of earlier conversations, sealed in the fork too), the records
    copied and their blobs linked (one copy of each content on disk)."""
    fl = floors(src)
    floor = max(fl, default=0)
    recs = [r for r in src.records() if r.seq <= floor or r.turn <= turns]
    if not recs:
        return
    dst.ensure()
    for r in recs:
        for c in r.changes:
            for o in (c.pre, c.post):
                if o is not None and not dst.blob(o.hash).exists():
                    with contextlib.suppress(FileNotFoundError):  # (dropped by the cap)
                        os.link(src.blob(o.hash), dst.blob(o.hash))
        dst.write_record(r)
    if fl:
        write_durably(dst.root / "floors", "".join(f"{f}\n" for f in fl).encode())


# ---- rewind ---------------------------------------------------------------------------


def _state(path: str) -> tuple[str, int, bytes] | None:
    """(kind, mode, content or link target) of what is at ``path``; None: nothing."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISLNK(st.st_mode):
        return ("link", stat.S_IMODE(st.st_mode), os.fsencode(os.readlink(path)))
    if stat.S_ISREG(st.st_mode):
        with open(path, "rb") as f:
            return ("file", stat.S_IMODE(st.st_mode), f.read())
    return ("other", 0, b"")


def _matches(path: str, obj: Obj | None) -> bool:
    now = _state(path)
    if obj is None:
        return now is None
    if now is None or now[0] != obj.kind:
        return False
    return hashlib.sha256(now[2]).hexdigest() == obj.hash and (
        obj.kind == "link" or now[1] == obj.mode
    )


def by_cwd(records: Sequence[Record]) -> list[tuple[str, list[Record]]]:
    """The records by the cwd they were made in (a session's cwd can change)."""
    out: dict[str, list[Record]] = {}
    for r in records:
        out.setdefault(r.cwd, []).append(r)
    return list(out.items())


def conflicts(st: Store, records: Sequence[Record]) -> list[str]:
    """The paths ``records`` left that something else has changed since."""
    bad = []
    for cwd, group in by_cwd(records):
        bad += _conflicts(st, cwd, group)
    return bad


def _conflicts(st: Store, cwd: str, records: Sequence[Record]) -> list[str]:
    bad = []
    for n in net(records):
        if n.src and not _matches(os.path.join(cwd, n.src), None):
            bad.append(n.src)
        if not _matches(os.path.join(cwd, n.path), n.post):
            bad.append(n.path)
    return bad


def _restore(st: Store, cwd: str, rel: str, obj: Obj | None) -> None:
    path = os.path.join(cwd, rel)
    if obj is None:
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = os.path.join(os.path.dirname(path), f".ollie-rewind.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    if obj.kind == "link":
        os.symlink(os.fsdecode(_blob(st, obj)), tmp)
    else:
        shutil.copyfile(st.blob(obj.hash), tmp)
        os.chmod(tmp, obj.mode)
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    os.replace(tmp, path)


def restore(st: Store, records: Sequence[Record]) -> None:
    """Put back every path ``records`` changed as it was before them; the dirs they made
    go once empty, those they removed come back."""
    for cwd, group in reversed(by_cwd(records)):
        _restore_in(st, cwd, group)


def _restore_in(st: Store, cwd: str, records: Sequence[Record]) -> None:
    for rec in reversed(records):
        for d in reversed(rec.rmdirs):
            os.makedirs(os.path.join(cwd, d), exist_ok=True)
    for n in net(records):
        if n.src:
            _restore(st, cwd, n.path, None)
            _restore(st, cwd, n.src, n.pre)
        else:
            _restore(st, cwd, n.path, n.pre)
    for rec in reversed(records):
        for d, _mode in reversed(rec.mkdirs):
            try:
                os.rmdir(os.path.join(cwd, d))
            except OSError:
                continue


def move_to_branch(st: Store, records: Sequence[Record], name: str, diff: str) -> None:
    """The undone records leave the live ones (newest first: a crash leaves the older
    live) for the store's ``branches/<name>/``, with the ``diff`` of what they did."""
    kept = st.root / "branches" / name
    kept.mkdir(parents=True, exist_ok=True)
    write_durably(kept / "diff", diff.encode())
    for rec in sorted(records, key=lambda r: r.seq, reverse=True):
        name = f"{rec.seq:08d}.json"
        try:
            os.replace(st.rec / name, kept / name)
        except FileNotFoundError:
            continue


def undone_by(st: Store, last_turn: int) -> list[Record]:
    """The live records of turn ``last_turn`` and after (a rewind's), of the current
    conversation only."""
    floor = max(floors(st), default=0)
    return [r for r in st.records() if r.turn >= last_turn and r.seq > floor]


def changes_of(records: Sequence[Record]) -> list[Change]:
    return [c for r in records for c in r.changes]


# ---- the size cap -------------------------------------------------------------------

LIMIT = 1 << 30
"""Bytes of pre-images a session keeps unless its profile says (``checkpointLimit``)."""


def trim(st: Store, limit: int) -> list[int]:
    """Drop the oldest turns' pre-images while those kept weigh more than ``limit``; the
    turns dropped. Their records stay (``files``, and a refusal to rewind past them)."""
    recs = [r for r in st.records()]
    size: dict[str, int] = {}
    for r in recs:
        if not r.trimmed:
            for c in r.changes:
                if c.pre is not None:
                    size[c.pre.hash] = c.pre.size
    total = sum(size.values())
    dropped: list[int] = []
    for cp in checkpoints(st):
        if total <= limit:
            break
        live = [r for r in cp.records if not r.trimmed]
        if not live:
            continue
        for r in live:
            r.trimmed = True
            st.write_record(r)
        dropped.append(cp.turn)
        keep = {
            o.hash
            for r in st.records()
            for c in r.changes
            for o in (c.post, None if r.trimmed else c.pre)
            if o is not None
        }
        rec = staged(st)
        if rec is not None:
            keep |= {o.hash for c in rec.changes for o in (c.pre, c.post) if o is not None}
        for r in live:
            for c in r.changes:
                if c.pre is not None and c.pre.hash not in keep:
                    with contextlib.suppress(FileNotFoundError):
                        st.blob(c.pre.hash).unlink()
                        total -= c.pre.size
    return dropped


# ---- review mode ----------------------------------------------------------------------


def chosen(rec: Record, paths: Sequence[str]) -> list[Change]:
    """The staged changes named by ``paths`` (all when none); ValueError for a path that
    has no staged change."""
    if not paths:
        return list(rec.changes)
    by = {c.path: c for c in rec.changes} | {c.src: c for c in rec.changes if c.src}
    unknown = [p for p in paths if p.rstrip("/") not in by]
    if unknown:
        raise ValueError(f"nothing staged for {', '.join(unknown)}")
    out: list[Change] = []
    for p in paths:
        c = by[p.rstrip("/")]
        if c not in out:
            out.append(c)
    return out


def _as_net(changes: Sequence[Change]) -> list[Net]:
    return [Net(c.path, None if c.src else c.pre, c.post, c.src) for c in changes]


def accept_conflicts(rec: Record, changes: Sequence[Change]) -> list[str]:
    """The paths whose disk content is no longer what it was when staged."""
    bad = []
    for c in changes:
        if c.src and not _matches(os.path.join(rec.cwd, c.src), c.pre):
            bad.append(c.src)
        if not _matches(os.path.join(rec.cwd, c.path), None if c.src else c.pre):
            bad.append(c.path)
    return bad


def _unstage(upper: Path, rel: str) -> None:
    path = upper / rel
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _put_from(upper: Path, cwd: str, rel: str) -> None:
    """``cwd/rel`` made a copy of the staged ``upper/rel`` (mode, symlink as symlink)."""
    src = upper / rel
    dst = os.path.join(cwd, rel)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = os.path.join(os.path.dirname(dst), f".ollie-accept.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    if src.is_symlink():
        os.symlink(os.readlink(src), tmp)
    else:
        shutil.copy2(src, tmp)
    if os.path.isdir(dst) and not os.path.islink(dst):
        shutil.rmtree(dst)
    os.replace(tmp, dst)


def accept(st: Store, rec: Record, changes: Sequence[Change], turn: int) -> None:
    """Apply the ``changes`` staged in ``rec`` to the disk, as a checkpoint of ``turn``
    (so a rewind can take them back), and unstage them."""
    upper = st.staged / "u"
    everything = len(changes) == len(rec.changes)
    done = Record(
        st.next_seq(),
        turn,
        rec.cwd,
        list(changes),
        [d for d in rec.mkdirs if any(c.path.startswith(d[0] + "/") for c in changes)],
        rec.rmdirs if everything else [],
        "",
        rec.time,
    )
    st.write_record(done)
    for c in changes:
        for gone in (c.src, c.path if c.post is None else ""):
            if gone:
                with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                    os.unlink(os.path.join(rec.cwd, gone))
    for d in done.rmdirs:
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(rec.cwd, d))
    for c in changes:
        if c.post is not None:
            _put_from(upper, rec.cwd, c.path)
    unstage(st, changes, everything)


def unstage(st: Store, changes: Sequence[Change], everything: bool) -> None:
    """Drop ``changes`` from the staged dir (``ctl reject``, or once accepted)."""
    if everything:
        shutil.rmtree(st.staged, ignore_errors=True)
        st.staged_rec.unlink(missing_ok=True)
        return
    upper = st.staged / "u"
    for c in changes:
        _unstage(upper, c.path)
        if c.src:
            _unstage(upper, c.src)
    rec = staged(st)
    if rec is not None:
        stage(st, rec.cwd)


def staged_net(rec: Record) -> list[Net]:
    return _as_net(rec.changes)
