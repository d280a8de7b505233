"""Where the protected names (``.git``, ``.ollie``) are under a write root, without walking
the whole tree on every call.

A tool may write anywhere beneath its write roots, except into a ``.git`` (hooks and config
run unsandboxed the next time the user runs git there) or an ``.ollie``, at any depth. The
sandbox makes each of them read-only with a bind mount, so it must know where they are when
the call starts. Walking a big checkout for that on every call costs tens of milliseconds;
`ProtectedScan` walks a root once and then only re-lists the directories whose mtime moved
(an entry created, removed or renamed in a directory changes that directory's mtime): a call
pays one ``stat`` per directory of the tree, no listing. Figures in toolsrv(8).

The walk does not follow symlinks nor descend into the protected entries themselves. A
protected entry that is a symlink is reported as its target, when that target lies beneath
a write root (elsewhere everything is read-only anyway).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

PROTECTED_NAMES = frozenset({".git", ".ollie"})
MAX_DIRS = 200_000
"""A root with more directories than this is scanned that far only (and a warning logged)."""
# A directory modified this recently may change again within the same coarse timestamp
# tick, unseen by an mtime comparison: it is listed again on the next call.
_FRESH_NS = 100_000_000


@dataclass(eq=False)
class _Dir:
    mtime: int  # st_mtime_ns when listed; -1: list again next time
    subdirs: list[str] = field(default_factory=list)
    protected: list[str] = field(default_factory=list)


class ProtectedScan:
    """The protected entries beneath each root, kept up to date by directory mtimes."""

    def __init__(self, max_dirs: int = MAX_DIRS) -> None:
        self.max_dirs = max_dirs
        self._trees: dict[str, dict[str, _Dir]] = {}
        self.listed = 0  # directories listed so far (tests and benches read it)

    def find(self, roots: Sequence[str]) -> list[str]:
        """Absolute paths to make read-only for a call with these (real, absolute) roots."""
        found: list[str] = []
        for root in roots:
            for path in self._refresh(root):
                target = _target(path, roots)
                if target is not None and target not in found:
                    found.append(target)
        return found

    def _refresh(self, root: str) -> list[str]:
        tree = self._trees.get(root)
        if tree is None:
            tree = self._trees[root] = {}
            self._walk(tree, root)
        else:
            stale = []
            for path, node in tree.items():
                try:
                    st = os.stat(path, follow_symlinks=False)
                    mtime = st.st_mtime_ns if stat.S_ISDIR(st.st_mode) else -2
                except OSError:
                    mtime = -2
                if mtime != node.mtime:
                    stale.append(path)
            for path in stale:
                if path in tree:
                    self._relist(tree, path)
        return [os.path.join(d, name) for d, node in tree.items() for name in node.protected]

    def _relist(self, tree: dict[str, _Dir], path: str) -> None:
        old = tree[path].subdirs
        node = self._list(tree, path)
        if node is None:  # gone, or no longer a directory
            _forget(tree, path)
            return
        for name in set(old) - set(node.subdirs):
            _forget(tree, os.path.join(path, name))
        for name in node.subdirs:
            sub = os.path.join(path, name)
            if sub not in tree:
                self._walk(tree, sub)

    def _walk(self, tree: dict[str, _Dir], top: str) -> None:
        stack = [top]
        while stack:
            path = stack.pop()
            node = self._list(tree, path)
            if node is not None:
                stack.extend(os.path.join(path, name) for name in node.subdirs)

    def _list(self, tree: dict[str, _Dir], path: str) -> _Dir | None:
        if path not in tree and len(tree) >= self.max_dirs:
            log.warning("protected-name scan stopped at %d directories (%s)", self.max_dirs, path)
            return None
        try:
            st = os.stat(path, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                return None
            node = _Dir(st.st_mtime_ns)
            with os.scandir(path) as entries:
                for entry in entries:
                    if entry.name in PROTECTED_NAMES:
                        node.protected.append(entry.name)
                    elif entry.is_dir(follow_symlinks=False):
                        node.subdirs.append(entry.name)
        except OSError:
            return None
        if time.time_ns() - node.mtime < _FRESH_NS:
            node.mtime = -1
        self.listed += 1
        tree[path] = node
        return node


def _forget(tree: dict[str, _Dir], path: str) -> None:
    tree.pop(path, None)
    prefix = path + os.sep
    for p in [p for p in tree if p.startswith(prefix)]:
        del tree[p]


def _target(path: str, roots: Sequence[str]) -> str | None:
    """``path`` itself, or for a symlink its target if that lies beneath one of ``roots``."""
    try:
        if not os.path.islink(path):
            return path
        real = os.path.realpath(path)
    except OSError:
        return None
    if not os.path.exists(real):
        return None
    for root in roots:
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return real
    return None
