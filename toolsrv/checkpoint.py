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
import logging
import os
import re
import secrets
import shutil
import time
from pathlib import Path

import trio

from olliewire import CallRequest
from olliewire.checkpoints import (
    Record,
    Store,
    apply,
    collect,
    in_flight,
    landed,
    merge_staged,
    recover,
)
from toolsrv import namespaces

log = logging.getLogger(__name__)

SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


class Overlay:
    """One call's overlay over its cwd (made in the server, mounted in the spawn thread)."""

    def __init__(self, store: Store, cwd: str, turn: int, review: bool = False) -> None:
        self.store = store
        self.cwd = cwd
        self.turn = turn
        self.review = review
        store.ensure()
        self.token = f"{int(time.time() * 1000):x}-{secrets.token_hex(4)}"
        self.dir = store.run / self.token
        in_flight(self.dir)
        (self.dir / "u").mkdir(parents=True, mode=0o755)
        (self.dir / "w").mkdir(mode=0o700)
        self.users = 1  # the calls in flight that share it
        # Review mode: the session's staged edits (``staged/u``, kept from call to call
        # until accepted or rejected) are a layer between the call and the real tree, so
        # the call sees them; what the call changes goes to its own upper dir, merged
        # into the staged one only once the call has ended (all of it or none).
        layers = [("lowerdir+", cwd)]
        if review:
            (store.staged / "u").mkdir(parents=True, mode=0o755, exist_ok=True)
            layers.insert(0, ("lowerdir+", str(store.staged / "u")))
        # Made here, where the store (hidden from tools) is seen; each call attaches a
        # copy in its own namespace, so calls running side by side see each other's files.
        self.mount_fd = namespaces.make_mount(
            "overlay",
            [
                *layers,
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
                merge_staged(self.store, self.token, self.cwd)
            landed(self.dir)
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
        landed(self.dir)


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
            landed(overlay.dir)
            return 0
    return rec.seq if rec is not None else 0
