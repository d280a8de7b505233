"""Per-turn cache of file reads (the seed's cache.go).

A model often reads the same file twice in one turn (to re-check a line before an edit).
The second read is answered from here when the file is provably unchanged: same inode,
size and mtime (nanoseconds) as when the first read ran. Any difference, or a file that
cannot be stat'ed, is a miss. The cache lives for one turn only, so a file changed by
someone else between turns is always read afresh.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import msgspec

# Tools whose result depends only on their arguments and the file named by ``path``.
CACHEABLE = frozenset({"file_read"})

Fingerprint = tuple[int, int, int, int]


def fingerprint(path: str) -> Fingerprint | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class ReadCache:
    entries: dict[bytes, tuple[Fingerprint, str]] = field(default_factory=dict)
    hits: int = 0

    @staticmethod
    def key(tool: str, args: dict[str, Any], cwd: str) -> tuple[bytes, str] | None:
        """The cache key and the file it depends on, or None when not cacheable."""
        path = args.get("path")
        if tool not in CACHEABLE or not isinstance(path, str) or not path:
            return None
        full = os.path.normpath(os.path.join(cwd, os.path.expanduser(path)))
        k = msgspec.json.encode([tool, cwd, sorted(args.items())])
        return k, full

    def get(self, key: bytes, path: str) -> str | None:
        hit = self.entries.get(key)
        if hit is None:
            return None
        if fingerprint(path) != hit[0]:
            del self.entries[key]
            return None
        self.hits += 1
        return hit[1]

    def put(self, key: bytes, before: Fingerprint | None, path: str, text: str) -> None:
        """Keep ``text`` only if the file did not change while the tool read it."""
        if before is not None and fingerprint(path) == before:
            self.entries[key] = (before, text)
