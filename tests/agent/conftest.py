"""Helpers for tests that run real shell commands: process liveness from /proc."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """A live process (a zombie is dead: it only waits for its reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :].split()[0] not in (b"Z", b"X")


def read_pid(path: Path) -> int:
    return int(path.read_text().split()[0])


def ignores_sigterm(pid: int) -> bool:
    """The process has SIGTERM (15) ignored, as /proc/<pid>/status says."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << 14))
    return False
