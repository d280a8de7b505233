"""Who makes a request of the tree, and what a sandboxed caller may not do through it.

Every tool runs under ``no_new_privs`` in toolsrv's sandbox, and the agent's own tool,
``client_9p``, may write the tree. The tree must not be a door out of that sandbox: a
tool that writes ``s/new`` with ``cwd=/``, or a ``!cmd`` prompt, or ``ctl cwd /home``,
would have another process (the daemon, or toolsrv for another session) act for it with
rights it does not have. So each control write, prompt and tool script written through
the tree carries its `Caller`, and a caller that is *confined* is held to its own rights
(ollie(5), SANDBOXED CALLERS; toolsrv(8)):

* a caller is confined when its process runs under ``no_new_privs`` (what toolsrv sets
  for every tool and what nothing unprivileged can clear), or when it is a 9P client over
  TCP that gave no key (`UNVERIFIED`: it may be a tool with network);
* a directory it names as a session's cwd (``s/new``, ``ctl cwd``, ``cfg cwd=``, the
  source of a ``fork``) must be writable in its own view of the filesystem: toolsrv gives
  each call a private mount namespace in which everything but its write roots is
  mounted read-only (and the daemon's own dirs are hidden), and a tool cannot change its
  mounts (seccomp), so the mount that holds the path in ``/proc/PID/mountinfo`` says
  exactly whether the path is beneath one of its write roots. A caller that shares the
  daemon's mount namespace (no private view to read) is refused: its roots cannot be told;
* it may not run ``!cmd`` prompts (they run with the session's rights, not its own);
* it may not choose a profile: profiles hold hook and prompt commands, which run outside
  the sandbox (``a/`` refuses their writes already); ``agent=`` in ``s/new`` is allowed
  only when it names the profile of the session the new one is a child of
  (``<parent>__<name>``, what ``subagent_spawn`` makes);
* a tool script it writes into ``t/`` may ask for no sandbox profile other than
  ``default`` or ``ollie`` (the profile it must itself have to write the tree at all).

Looking at ``/proc/PID/status`` costs a read, so it is done only for the requests that
need the answer, once per request.
"""

from __future__ import annotations

import os
import re

from olliefs.errors import Denied
from olliefs.mounts import covering, mounts

UNVERIFIED = -1
"""The pid of a 9P client over TCP without a key: confined, with no view to read."""

TOOL_PROFILES = frozenset({"default", "ollie"})
"""The sandbox profiles a confined caller may give a tool script it writes into ``t/``."""


class Caller:
    """The process behind one request: its pid as the frontend saw it (0: the daemon
    itself or a caller that cannot be told, and so is the user's)."""

    __slots__ = ("_confined", "pid")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._confined: bool | None = None

    def __repr__(self) -> str:
        return f"Caller({self.pid})"

    @property
    def confined(self) -> bool:
        if self._confined is None:
            self._confined = _confined(self.pid)
        return self._confined

    def check_dir(self, real: str, what: str) -> None:
        """Refuse (`Denied`) unless a confined caller may write the directory ``real``
        (a real path, `olliefs.mounts.real_dir`); an unconfined caller may name any."""
        if not self.confined:
            return
        reason = _unwritable(self.pid, real)
        if reason is not None:
            raise Denied(f"{what}: {real}: {reason}")

    def check(self, allowed: bool, what: str) -> None:
        """Refuse ``what`` (`Denied`) to a confined caller unless ``allowed``."""
        if self.confined and not allowed:
            raise Denied(f"{what}: not allowed from a sandboxed process (a tool)")


USER = Caller(0)
"""Requests the daemon makes for itself (restore, a profile's own start)."""


def _confined(pid: int) -> bool:
    if pid == UNVERIFIED:
        return True
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nNoNewPrivs:\t1" in f.read()
    except OSError:
        # Gone before we looked: it cannot see the answer either way; refuse to be safe.
        return True


def _unwritable(pid: int, real: str) -> str | None:
    """Why the confined process ``pid`` cannot write beneath ``real``, or None."""
    if pid <= 0:
        return "a 9P client without a key has no write roots here"
    try:
        theirs = os.stat(f"/proc/{pid}/ns/mnt").st_ino
        if theirs == os.stat("/proc/self/ns/mnt").st_ino:
            return "the caller has no private view of the files: its write roots are unknown"
        table = mounts(f"/proc/{pid}/mountinfo")
    except OSError as err:
        return f"the caller's view cannot be read ({err.strerror})"
    m = covering(real, table)
    if m is None or "rw" not in m.options.split(","):
        return "outside the caller's write roots (read-only to it)"
    return None


_SANDBOX_LINE = re.compile(rb"^(?:#|//|--) ?sandbox:(.*)$", re.MULTILINE)


def tool_profiles(head: bytes) -> list[str]:
    """Every sandbox profile the start of a tool script could be read as asking for.

    Deliberately wider than toolsrv's header parser: any line of the first bytes shaped
    like a ``sandbox:`` entry counts, wherever it stands, so that no edit can slip one past
    this check that the parser would then honour."""
    return [m.group(1).strip().decode(errors="replace") for m in _SANDBOX_LINE.finditer(head)]


def tool_guard(head: bytes) -> str | None:
    """Why a sandboxed writer may not leave a tool script starting with ``head``, or None
    (`olliefs.fs.disk.Rules.guard` of ``t/``)."""
    wider = [p for p in tool_profiles(head) if p not in TOOL_PROFILES]
    if not wider:
        return None
    allowed = " or ".join(sorted(TOOL_PROFILES))
    return (
        f"a sandboxed process may not write a tool with the sandbox profile {wider[0]!r} "
        f"(only {allowed})"
    )


def mcp_guard(head: bytes) -> str:
    """A sandboxed writer may leave no MCP server file at all (``mcp/``): a server's file
    names the command toolsrv runs and the rights it gets (roots, network), more than
    any tool of the writer's own profile."""
    return "a sandboxed process may not write an MCP server's file (they are the user's)"
