"""``a/``: agent profiles, validated as they are written (SPEC 3.7 "Profiles").

The user's ``config/agents/<name>.json`` lies over the shipped profiles: a file of the
same name wins. A write is checked as it comes (``ProfileChecker``): one after which the
document is certainly invalid fails with EINVAL; a document still incomplete, or
invalid once complete, fails the close with EINVAL; one longer than MAX_PROFILE_BYTES
fails the write that passes it, and the close, with EFBIG. Either way the file on disk
is not touched and the previous version stays in force; the reason goes to the root ``err``
and ``events``. A valid document replaces the user's file atomically (write, fsync,
rename). Removing a user's profile shows the shipped one of that name again; a shipped
profile itself cannot be removed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

import trio

from olliefs.agent.profile import (
    MAX_PROFILE_BYTES,
    ProfileChecker,
    Status,
    check_complete,
    check_name,
)
from olliefs.errors import Denied, InvalidRequest, NotFound, disk_error
from olliefs.fs.nodes import Cap, Dir, File, Handle, Node, Open, editors_own


def refuse_sandboxed(how: Open, refused: Callable[[str], None]) -> None:
    """A profile holds hook and prompt commands, which run outside the tool sandbox: a
    process under ``no_new_privs`` (every tool toolsrv runs) may not write one, or an
    agent could give itself a hook and switch to it."""
    if how.pid < 0:  # a 9P client over TCP without a key (olliefs.fs.export9p.UNVERIFIED)
        reason = "a/: profiles cannot be written by a 9P client without a key"
        refused(reason)
        raise Denied(reason)
    try:
        with open(f"/proc/{how.pid}/status") as f:
            sandboxed = "\nNoNewPrivs:\t1" in f.read()
    except OSError:
        sandboxed = False
    if sandboxed:
        reason = "a/: profiles cannot be written from a sandboxed process (a tool)"
        refused(reason)
        raise Denied(reason)


class ProfileHandle(Handle):
    waits = False

    def __init__(self, node: ProfileFile, initial: bytes, refused: Callable[[str], None]) -> None:
        self.node = node
        self.buf = bytearray(initial)
        self.dirty = False
        self.refused = refused
        self.checker: ProfileChecker | None = ProfileChecker() if not initial else None
        self.cap = Cap(f"a/{node.name}.json", MAX_PROFILE_BYTES, refused, "not saved")
        # The reason a write of this handle was refused: a close that finds no valid
        # document then fails with it, without telling err again.
        self.failed: str | None = None

    async def read(self, off: int, size: int) -> bytes:
        return bytes(self.buf[off : off + size])

    async def write(self, off: int, data: bytes) -> int:
        # Past the limit (EFBIG) nothing of this document is saved, not even the part
        # that came before: the kernel splits a long write(2) and passes its pieces here.
        self.cap.check(off + len(data))
        sequential = off == len(self.buf) and self.checker is not None
        new = bytearray(self.buf)
        if off > len(new):
            new += b" " * (off - len(new))
        new[off : off + len(data)] = data
        if sequential and self.checker is not None:
            verdict = self.checker.feed(data)
        else:
            self.checker = None  # not a plain stream of appends: checked whole at close
            verdict = None
        if verdict is not None and verdict.invalid:
            self._refuse(f"a/{self.node.name}.json: {verdict.reason}")
        self.buf = new
        self.dirty = True
        return len(data)

    def truncate(self, size: int) -> None:
        self.failed = None  # starting the document over
        # Cut, or extend as a write past the end does: with spaces, which JSON allows
        # between tokens, where a disk would put NUL bytes no document can hold.
        if size == 0:
            self.cap.reset()
        self.cap.check(size)
        del self.buf[size:]
        self.buf += b" " * (size - len(self.buf))
        self.checker = ProfileChecker() if size == 0 else None
        self.dirty = True

    def _refuse(self, reason: str) -> None:
        self.failed = reason
        self.refused(reason)
        raise InvalidRequest(reason)

    async def flush(self) -> None:
        if self.cap.over:
            raise self.cap.error()
        if not self.dirty:
            return
        self.dirty = False
        verdict = check_complete(bytes(self.buf))
        if verdict.status is not Status.VALID:
            if self.failed is not None:
                # A write of this handle was refused, and said why: the close is refused
                # with that reason, which err keeps (not the "empty document" left).
                raise InvalidRequest(self.failed)
            self._refuse(f"a/{self.node.name}.json: {verdict.reason or 'incomplete'}")
        try:
            await trio.to_thread.run_sync(self.node.save, bytes(self.buf))
        except OSError as err:  # a full disk: the old profile stays in force
            refusal = disk_error(err, f"a/{self.node.name}.json: not saved")
            self.refused(str(refusal))
            raise refusal from None


class ProfileFile(File):
    perm = 0o644
    direct_io = True
    # Looked up afresh each time: a create refused at its first write or at close
    # leaves no profile, and the kernel must not go on showing the name it was told of.
    entry_ttl = 0.0

    def __init__(self, folder: ProfilesDir, name: str) -> None:
        self.key = ("a", name)
        self.folder = folder
        self.name = name

    def path(self) -> Path | None:
        return self.folder.find(self.name)

    def _st(self) -> os.stat_result | None:
        p = self.path()
        try:
            return os.stat(p) if p else None
        except OSError:
            return None

    def stat(self) -> tuple[int, int]:
        st = self._st()
        return (st.st_size, st.st_mtime_ns) if st else (0, 0)

    def valid(self) -> bool:
        return True  # a profile being created has no file until its first valid close

    def open(self, how: Open) -> Handle:
        if how.flags & os.O_ACCMODE != os.O_RDONLY:
            refuse_sandboxed(how, self.folder.refused)
        p = self.path()
        trunc = bool(how.flags & os.O_TRUNC) or p is None
        data = b"" if trunc or p is None else p.read_bytes()
        return ProfileHandle(self, data, self.folder.refused)

    def save(self, data: bytes) -> None:
        d = self.folder.user
        d.mkdir(parents=True, exist_ok=True)
        dest = d / f"{self.name}.json"
        tmp = d / f".{self.name}.json.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class ProfilesDir(Dir):
    perm = 0o755
    entry_ttl = 0.0

    def __init__(self, user: Path, shipped: Path, refused: Callable[[str], None]) -> None:
        self.key = ("a",)
        self.user = user
        self.shipped = shipped
        self.refused = refused

    def find(self, name: str) -> Path | None:
        for d in (self.user, self.shipped):
            p = d / f"{name}.json"
            if p.is_file():
                return p
        return None

    def _names(self) -> list[str]:
        names: set[str] = set()
        for d in (self.user, self.shipped):
            try:
                names.update(f[:-5] for f in os.listdir(d) if f.endswith(".json"))
            except OSError:
                pass
        return sorted(n for n in names if not n.startswith("."))

    def entries(self) -> Iterable[tuple[str, Node]]:
        return [(f"{n}.json", ProfileFile(self, n)) for n in self._names()]

    def lookup(self, name: str) -> Node | None:
        if not name.endswith(".json") or self.find(name[:-5]) is None:
            return None
        return ProfileFile(self, name[:-5])

    @staticmethod
    def _profile_name(name: str) -> str:
        if not name.endswith(".json"):
            raise InvalidRequest(f"a/{name}: a profile is <name>.json")
        check_name(name[:-5])
        return name[:-5]

    async def create(self, name: str, mode: int, how: Open) -> tuple[Node, Handle]:
        refuse_sandboxed(how, self.refused)
        if editors_own(name):
            raise Denied(f"a/{name}: not a profile (an editor's own file)")
        try:
            pname = self._profile_name(name)
        except InvalidRequest as err:
            self.refused(str(err))
            raise
        node = ProfileFile(self, pname)
        return node, ProfileHandle(node, b"", self.refused)

    async def unlink(self, name: str) -> None:
        p = self.user / name
        if name.endswith(".json") and not p.is_file() and (self.shipped / name).is_file():
            raise Denied(f"a/{name}: a shipped profile cannot be removed")
        if not p.is_file():
            if (self.shipped / name).is_file():
                raise Denied(f"a/{name}: a shipped profile cannot be removed")
            raise NotFound(f"a/{name}: no such profile")
        p.unlink()

    def mtime_ns(self) -> int:
        try:
            return os.stat(self.user).st_mtime_ns
        except OSError:  # no profile of the user's yet: the shipped ones' time
            return os.stat(self.shipped).st_mtime_ns
