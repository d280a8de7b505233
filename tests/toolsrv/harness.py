"""Helpers for toolsrv tests (the toolsrv harness itself is in ``olliefs.testing``)."""

from __future__ import annotations

import os
from pathlib import Path

from olliefs.testing import ToolsrvProc, running_toolsrv

__all__ = [
    "ToolsrvProc",
    "pid_alive",
    "pid_exists",
    "running_toolsrv",
    "server_pid",
    "tool_env",
]


def tool_env(cwd: Path, session: str = "sess") -> dict[str, str]:
    return {"OLLIE_SESSION_ID": session, "OLLIE_CWD": str(cwd), "OLLIE": str(cwd)}


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def pid_exists(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def server_pid(t: ToolsrvProc) -> int:
    """The server itself: the one child of the keeper, the process ``t`` started."""
    assert t.proc is not None
    with open(f"/proc/{t.proc.pid}/task/{t.proc.pid}/children") as f:
        (pid,) = f.read().split()
    return int(pid)
