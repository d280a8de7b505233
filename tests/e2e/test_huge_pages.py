"""The daemon's heap uses transparent huge pages, and nothing else sees the tunable.

glibc reads ``GLIBC_TUNABLES`` only when a program starts, so ``ollie mount`` starts the
daemon with ``glibc.malloc.hugetlb=1`` (a foreground mount starts itself again, same pid)
and takes the tunable out of the environment once it runs: toolsrv and the tools get
the user's environment (olliefs.memory). What shows the heap is marked: the ``hg`` flag
(MADV_HUGEPAGE) of the ``[heap]`` mapping in /proc/PID/smaps.
"""

from __future__ import annotations

from collections.abc import Callable

from olliefs import memory
from olliefs.testing import Daemon

from .test_tools import toolsrv_pids


def heap_flags(pid: int) -> set[str]:
    with open(f"/proc/{pid}/smaps") as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith("[heap]"))
    flags = next(line for line in lines[start:] if line.startswith("VmFlags:"))
    return set(flags.split()[1:])


def environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = f.read().decode().split("\0")
    return dict(item.split("=", 1) for item in items if "=" in item)


def test_foreground_daemon_heap_has_huge_pages_and_toolsrv_the_users_environment(
    daemon_factory: Callable[..., Daemon],
) -> None:
    # a tunable of the user's own: harmless, and it must come through unchanged
    d = daemon_factory(GLIBC_TUNABLES="glibc.malloc.perturb=0")
    d.start()
    assert d.proc is not None
    pid = d.proc.pid
    want = memory._thp_usable()  # a kernel with THP "never" leaves the heap as it is
    assert ("hg" in heap_flags(pid)) == want
    sid = d.new(name="h")
    d.prompt(sid, "!echo tunables=$GLIBC_TUNABLES was=${OLLIE_GLIBC_TUNABLES_WAS-unset}")
    d.wait_idle(sid)
    assert "tunables= was=unset" in d.read(f"s/{sid}/chat")  # tools: their own env
    procs = toolsrv_pids(d)  # the servers, each below the keeper the daemon spawned
    assert procs
    for p in procs:
        env = environ(p)
        assert env["GLIBC_TUNABLES"] == "glibc.malloc.perturb=0"
        assert "OLLIE_GLIBC_TUNABLES_WAS" not in env


def test_ollie_hugepages_0_leaves_the_heap_alone(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory(OLLIE_HUGEPAGES="0")
    d.start()
    assert d.proc is not None
    assert "hg" not in heap_flags(d.proc.pid)
    assert "hugetlb" not in environ(d.proc.pid).get("GLIBC_TUNABLES", "")
