"""The sandbox attacked as a hostile tool would, through a real toolsrv over its socket.

Each attack is a shell or Python program run as a tool call (olliefs toolclient -> 9P ->
toolsrv -> a sandboxed process), and each test has a positive control: the same kind of
operation, aimed where it is allowed, succeeds, so a test cannot pass because the tool
never ran. What is checked is the state outside (the victim file, the host socket, the
process), not only what the tool printed.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import signal
import socket
import stat
import subprocess
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from olliefs import settings
from olliefs.settings import Paths
from olliefs.testing import await_until
from olliefs.toolclient.client import ToolsrvConn
from olliefs.toolclient.spawn import hidden_args
from tests.toolsrv.harness import ToolsrvProc, running_toolsrv, tool_env
from toolsrv import namespaces
from toolsrv.sandbox import landlock_abi

ABI = landlock_abi()
ROOT = os.geteuid() == 0
pytestmark = pytest.mark.skipif(ABI == 0, reason="the kernel has no Landlock")
needs_ns = pytest.mark.skipif(
    not namespaces.mount_namespaces(), reason="mount namespaces need root (CAP_SYS_ADMIN)"
)
needs_scopes = pytest.mark.skipif(ABI < 6, reason="Landlock scopes need ABI 6 (Linux 6.12)")

SH_TOOL = """#!/bin/bash
# ollie-tool
# description: test shell ({sandbox})
# args: {{"type": "object", "properties": {{"code": {{"type": "string"}}}}}}
# timeout: 30
# sandbox: {sandbox}
code=$(python3 -c 'import json, sys; print(json.load(sys.stdin)["code"])')
exec bash -c "$code"
"""


class Box:
    def __init__(self, srv: ToolsrvProc, conn: ToolsrvConn, work: Path, outside: Path) -> None:
        self.srv, self.conn, self.work, self.outside = srv, conn, work, outside

    async def sh(self, code: str, tool: str = "sh") -> str:
        res = await self.conn.call(tool, {"code": code}, str(self.work), tool_env(self.work))
        return ("ERROR " if res.isError else "") + res.text

    async def py(self, code: str, *args: str, tool: str = "sh") -> dict[str, str]:
        """Run Python in the tool; it prints ``<what> <result>`` lines; a dict of them."""
        argv = shlex.join(["python3", "-c", textwrap.dedent(code), *args])
        out = await self.sh(argv, tool)
        assert not out.startswith("ERROR"), out
        return dict(line.rsplit(" ", 1) for line in out.splitlines() if " " in line)


# Prints "<label> ok" or "<label> <ERRNO>" for each attempt.
TRY = """
import errno, os, socket, sys
def attempt(label, fn):
    try:
        fn()
        print(label, "ok")
    except OSError as e:
        print(label, errno.errorcode.get(e.errno, e.errno))
"""


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    work = tmp_path / "work"
    for d in ("sub/.git/hooks", ".git/hooks", "a/b", ".ollie", "d"):
        (work / d).mkdir(parents=True)
    (work / "sub" / ".git" / "config").write_text("[core]\n")
    (work / "a" / "b" / ".git").write_text("gitdir: ../../.git\n")  # a worktree's .git file
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    return work, outside


@pytest.fixture
async def box(tmp_path: Path, tree: tuple[Path, Path]) -> AsyncIterator[Box]:
    tools = tmp_path / "tools"
    tools.mkdir()
    for name, profile in (("sh", "default"), ("sh_net", "network")):
        (tools / name).write_text(SH_TOOL.format(sandbox=profile))
        (tools / name).chmod(0o755)
    run = tmp_path / "run"  # stands for the daemon's run dir, as olliefs passes it
    run.mkdir()
    extra = ("--hide", str(run))
    with running_toolsrv(tmp_path / "srv", tools_dirs=(tools,), extra_args=extra) as srv:
        async with srv.agent("attacker", "sh", "sh_net") as conn:
            yield Box(srv, conn, *tree)


def snapshot(p: Path) -> tuple[int, int, int, int, bytes, list[str]]:
    st = p.stat()
    return (st.st_mode, st.st_uid, st.st_mtime_ns, st.st_nlink, p.read_bytes(), os.listxattr(p))


METADATA = (
    TRY
    + """
target, other = sys.argv[1], sys.argv[2]
attempt("chmod", lambda: os.chmod(target, 0o777))
attempt("chown", lambda: os.chown(target, 65534, 65534))
attempt("utime", lambda: os.utime(target, (978307200, 978307200)))
attempt("setxattr", lambda: os.setxattr(target, "user.x", b"1"))
attempt("mknod", lambda: os.mknod(other, 0o600 | 0o010000))
attempt("truncate", lambda: os.truncate(target, 0))
attempt("rename", lambda: os.rename(target, other + ".moved"))
"""
)


@needs_ns
async def test_metadata_outside_the_roots(box: Box) -> None:
    victim = box.outside / "victim"
    before = snapshot(victim)
    got = await box.py(METADATA, str(victim), str(box.outside / "node"))
    assert set(got) == {"chmod", "chown", "utime", "setxattr", "mknod", "truncate", "rename"}
    for what, errno_name in got.items():
        assert errno_name in ("EROFS", "EACCES", "EPERM"), (what, got)
    assert snapshot(victim) == before
    assert sorted(os.listdir(box.outside)) == ["victim"]
    # Positive control: the same program on a file of the cwd changes it.
    mine = box.work / "mine"
    mine.write_text("mine\n")
    got = await box.py(METADATA, str(mine), str(box.work / "node"))
    assert got["chmod"] == got["utime"] == got["mknod"] == got["truncate"] == "ok", got
    assert got["rename"] == "ok" and (box.work / "node.moved").exists()


@needs_ns
async def test_protected_names_at_any_depth(box: Box) -> None:
    w = box.work
    targets = [
        w / "sub/.git/hooks/pre-commit",
        w / "sub/.git/config",
        w / ".git/hooks/post-checkout",
        w / "a/b/.git",  # a .git file (gitdir: ...): rewritten, it would point git elsewhere
        w / ".ollie/x",
    ]
    code = TRY + "for p in sys.argv[1:]: attempt(p, lambda p=p: open(p, 'a').write('evil'))\n"
    got = await box.py(code, *map(str, targets), str(w / "sub/file"))
    assert got.pop(str(w / "sub/file")) == "ok"  # positive control, next to a .git
    assert set(got.values()) <= {"EROFS", "EACCES"}, got
    assert (w / "sub/.git/config").read_text() == "[core]\n"
    assert (w / "a/b/.git").read_text() == "gitdir: ../../.git\n"
    assert not (w / "sub/.git/hooks/pre-commit").exists() and not (w / ".ollie/x").exists()
    # Nor can they be moved away, removed or replaced by a symlink.
    out = await box.sh(
        "mv sub/.git sub/git2; rm -rf sub/.git; ln -sfn /tmp sub/.git; mv a/b/.git a/b/g2;"
        " echo done"
    )
    assert out.endswith("done")
    assert (w / "sub/.git/config").read_text() == "[core]\n" and not (w / "sub/git2").exists()
    assert not (w / "sub/.git").is_symlink() and (w / "a/b/.git").is_file()
    # Moving the directory that holds a .git moves the read-only mount along with it.
    got = await box.py(
        TRY + "os.makedirs('q'); os.rename('sub', 'q/sub')\n"
        "attempt('moved', lambda: open('q/sub/.git/hooks/x', 'w').write('evil'))\n"
    )
    assert got == {"moved": got["moved"]} and got["moved"] in ("EROFS", "EACCES")
    assert not (w / "q/sub/.git/hooks/x").exists()


@needs_ns
async def test_a_symlinked_git_protects_its_target(box: Box) -> None:
    w = box.work
    (w / "evil" / "hooks").mkdir(parents=True)
    (w / "linked").mkdir()
    (w / "linked" / ".git").symlink_to("../evil")
    code = TRY + "for p in sys.argv[1:]: attempt(p, lambda p=p: open(p, 'w').write('x'))\n"
    got = await box.py(code, str(w / "linked/.git/hooks/x"), str(w / "evil/hooks/y"))
    assert set(got.values()) <= {"EROFS", "EACCES"}, got
    assert list((w / "evil" / "hooks").iterdir()) == []
    got = await box.py(code, str(w / "linked/ok"))  # positive control
    assert got == {str(w / "linked/ok"): "ok"}


async def test_symlink_races_out_of_the_cwd(box: Box) -> None:
    """A directory swapped with a symlink to the outside, over and over, while another
    thread writes through its name: a write lands inside or is refused, never outside."""
    code = (
        TRY
        + """
import threading
os.makedirs("race"); os.makedirs("real")
stop = False
def swap():
    while not stop:
        os.rename("race", "real/race"); os.symlink(sys.argv[1], "race"); os.unlink("race")
        os.rename("real/race", "race")
t = threading.Thread(target=swap); t.start()
landed = 0
for i in range(3000):
    try:
        with open(f"race/f{i}", "w") as f:
            f.write("x")
        landed += 1
    except OSError:
        pass
stop = True; t.join()
print("landed", landed)
"""
    )
    got = await box.py(code, str(box.outside))
    assert sorted(os.listdir(box.outside)) == ["victim"], got
    assert int(got["landed"]) > 0  # positive control: writes did land, inside
    assert len(os.listdir(box.work / "race")) == int(got["landed"])


async def test_writes_through_proc_magic_links(box: Box) -> None:
    victim = box.outside / "victim"
    before = snapshot(victim)
    code = (
        TRY
        + """
fd = os.open(sys.argv[1], os.O_RDONLY)
attempt("fd", lambda: open(f"/proc/self/fd/{fd}", "w").write("x"))
attempt("selfroot", lambda: open("/proc/self/root" + sys.argv[1], "w").write("x"))
attempt("srvroot", lambda: open(f"/proc/{sys.argv[2]}/root" + sys.argv[1], "w").write("x"))
attempt("initroot", lambda: open("/proc/1/root" + sys.argv[1], "w").write("x"))
attempt("control", lambda: open("/proc/self/root" + sys.argv[3], "w").write("x"))
"""
    )
    srv_pid = box.srv.proc.pid if box.srv.proc else 1
    got = await box.py(code, str(victim), str(srv_pid), str(box.work / "via-proc"))
    assert got.pop("control") == "ok" and (box.work / "via-proc").read_text() == "x"
    assert set(got.values()) <= {"EROFS", "EACCES", "EPERM", "ENOENT"}, got
    assert snapshot(victim) == before


async def test_hard_links_to_outside_files(box: Box) -> None:
    victim = box.outside / "victim"
    before = snapshot(victim)
    (box.work / "inside").write_text("in\n")
    code = (
        TRY
        + """
attempt("outside", lambda: os.link(sys.argv[1], "hl"))
attempt("control", lambda: os.link("inside", "hl2"))
"""
    )
    got = await box.py(code, str(victim))
    assert got == {"outside": got["outside"], "control": "ok"}
    assert got["outside"] in ("EXDEV", "EACCES", "EPERM", "EROFS")
    assert not (box.work / "hl").exists() and snapshot(victim) == before


UDP = (
    TRY
    + """
to = ("127.0.0.1", int(sys.argv[1]))
attempt("send", lambda: socket.socket(type=socket.SOCK_DGRAM).sendto(b"x", to))
attempt("bind", lambda: socket.socket(type=socket.SOCK_DGRAM).bind(("127.0.0.1", 0)))
"""
)


async def test_udp_send_and_bind(box: Box) -> None:
    with socket.socket(type=socket.SOCK_DGRAM) as host:
        host.bind(("127.0.0.1", 0))
        host.setblocking(False)
        port = str(host.getsockname()[1])
        got = await box.py(UDP, port)
        assert got["send"] != "ok" and got["bind"] != "ok", got
        with pytest.raises(BlockingIOError):
            host.recv(16)
        # Positive control: the network profile reaches the host's loopback.
        assert await box.py(UDP, port, tool="sh_net") == {"send": "ok", "bind": "ok"}
        assert host.recv(16) == b"x"


@needs_ns
async def test_abstract_unix_sockets(box: Box, tmp_path: Path) -> None:
    """The tool binds an abstract name and holds it while the host looks for it; it also
    tries the host's own abstract name. Neither crosses (the tool's network namespace; the
    Landlock scope for connecting out)."""
    name = f"olliefs-attack-{os.getpid()}"
    ready, go = box.work / "ready", tmp_path / "go"
    os.mkfifo(go)
    code = (
        TRY
        + """
s = socket.socket(socket.AF_UNIX)
attempt("bind", lambda: s.bind("\\0" + sys.argv[1] + "-tool"))
s.listen(1)
attempt("connect", lambda: socket.socket(socket.AF_UNIX).connect("\\0" + sys.argv[1]))
open(sys.argv[2], "w").close()
open(sys.argv[3]).read()  # held until the host has looked
"""
    )
    got: dict[str, str] = {}
    with socket.socket(socket.AF_UNIX) as host:
        host.bind("\0" + name)
        host.listen(1)
        async with trio.open_nursery() as nursery:

            async def call(tool: str, done: trio.Event) -> None:
                got.update(await box.py(code, name, str(ready), str(go), tool=tool))
                done.set()

            for tool, reachable in (("sh", False), ("sh_net", True)):
                got.clear()
                done = trio.Event()
                nursery.start_soon(call, tool, done)
                await await_until(ready.exists, "the tool's bind", 20, files=[ready])
                probe = socket.socket(socket.AF_UNIX)
                try:
                    probe.connect("\0" + name + "-tool")
                    seen = True
                except ConnectionRefusedError:
                    seen = False
                probe.close()
                # Positive control: with the host's network (sh_net) the same bind is seen.
                assert seen == reachable, tool
                await trio.to_thread.run_sync(lambda: go.write_text("\n"))
                with trio.fail_after(20):
                    await done.wait()
                ready.unlink()
                assert got["bind"] == "ok" and got["connect"] in ("ECONNREFUSED", "EPERM"), got


async def test_daemon_and_toolsrv_sockets_are_out_of_reach(box: Box, tmp_path: Path) -> None:
    daemon_sock = tmp_path / "run" / "daemon.sock"
    control_sock = box.outside / "other.sock"
    listeners = []
    for path in (daemon_sock, control_sock):
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.listen(4)
        listeners.append(s)
    try:
        code = (
            TRY
            + """
for p in sys.argv[1:]:
    attempt(p, lambda p=p: socket.socket(socket.AF_UNIX).connect(p))
"""
        )
        got = await box.py(code, str(daemon_sock), box.srv.socket, str(control_sock))
    finally:
        for s in listeners:
            s.close()
    assert got.pop(str(control_sock)) == "ok"  # positive control: pathname sockets work
    if namespaces.mount_namespaces():
        assert set(got.values()) <= {"ENOENT", "ECONNREFUSED", "EACCES"}, got
    else:
        pytest.skip(reason="without mount namespaces nothing hides the sockets")


@needs_scopes
async def test_signals_to_processes_outside(box: Box) -> None:
    victim = subprocess.Popen(["sleep", "1000"])
    try:
        code = f"kill -9 {victim.pid} 2>&1; echo rc=$?; sleep 1000 & kill -9 $! && echo own-ok"
        out = await box.sh(code)
        assert victim.poll() is None, "the tool killed a process outside its call"
        assert "rc=1" in out and "own-ok" in out, out  # own child: positive control
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()


@pytest.mark.skipif(not ROOT, reason="reading another user's file is a question for root only")
async def test_another_users_private_file(box: Box) -> None:
    """Decision (toolsrv(8)): the tool keeps toolsrv's uid, without capabilities: DAC
    applies with no override, so another user's 0600 file is unreadable even to uid 0."""
    secret, public = box.outside / "secret", box.outside / "public"
    for p, mode in ((secret, 0o600), (public, 0o644)):
        p.write_text(f"{p.name}\n")
        os.chown(p, 12345, 12345)
        p.chmod(mode)
    out = await box.sh(f"cat {secret} 2>&1; cat {public}")
    assert "secret\n" not in out and "Permission denied" in out
    assert out.endswith("public")  # positive control: readable files are read


async def test_no_capabilities_at_all(box: Box) -> None:
    keys = "NoNewPrivs|CapInh|CapPrm|CapEff|CapBnd|CapAmb|Seccomp"
    for tool in ("sh", "sh_net"):
        out = await box.sh(f"grep -E '^({keys}):' /proc/self/status", tool)
        fields = dict(line.split(":\t") for line in out.splitlines())
        assert fields.pop("NoNewPrivs") == "1" and fields.pop("Seccomp") == "2", out
        if not ROOT:
            fields.pop("CapBnd")  # an unprivileged server cannot empty it (toolsrv(8))
        assert fields and set(fields.values()) == {"0000000000000000"}, (tool, out)
    if ROOT:  # positive control: the same probe outside a tool sees capabilities
        assert "CapEff:\t0000000000000000" not in Path("/proc/self/status").read_text()


SYSCALLS = {  # x86_64, aarch64
    "keyctl": (250, 219),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "getpid": (39, 172),
}


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "aarch64"), reason="syscall numbers known for two arches"
)
async def test_seccomp_refusals(box: Box) -> None:
    arch = 0 if platform.machine() == "x86_64" else 1
    nums = {k: str(v[arch]) for k, v in SYSCALLS.items()}
    code = """
import ctypes, errno, sys
libc = ctypes.CDLL(None, use_errno=True)
def report(label, rc):
    print(label, "ok" if rc >= 0 else errno.errorcode[ctypes.get_errno()])
nums = dict(a.split("=") for a in sys.argv[1:])
for name in ("keyctl", "bpf", "perf_event_open", "getpid"):
    report(name, libc.syscall(int(nums[name]), 0, 0, 0, 0, 0))
report("ptrace", libc.ptrace(0, 0, 0, 0))
report("unshare_user", libc.unshare(0x10000000))
report("mount", libc.mount(b"none", b"/tmp", b"tmpfs", 0, None))
"""
    got = await box.py(code, *(f"{k}={v}" for k, v in nums.items()))
    assert got.pop("getpid") == "ok"  # positive control: the same path, an allowed syscall
    assert got == dict.fromkeys(
        ("keyctl", "bpf", "perf_event_open", "ptrace", "unshare_user", "mount"), "EPERM"
    ), got
    out = await box.sh("unshare -U true 2>&1; echo rc=$?")
    assert "rc=1" in out and "Operation not permitted" in out


async def test_the_shipped_tools_still_work_in_the_sandbox(box: Box) -> None:
    """What tools need is left: /dev/null, the tmp dir, pipes, socketpairs, subprocesses."""
    code = """
        echo a > /dev/null && echo b > "$TMPDIR/t" && cat "$TMPDIR/t" &&
        eval "$PAIR" &&
        ( echo d | cat ) && mkdir -p deep/er && echo e > deep/er/f && cat deep/er/f
    """
    pair = "import socket; a, b = socket.socketpair(); a.send(b'c'); print(b.recv(1).decode())"
    out = await box.sh(
        f"PAIR={shlex.quote(shlex.join(['python3', '-c', pair]))}\n" + textwrap.dedent(code)
    )
    assert out.split() == ["b", "c", "d", "e"], out
    assert stat.S_ISREG((box.work / "deep" / "er" / "f").stat().st_mode)


async def in_dir(box: Box, cwd: Path, code: str, *args: str, tool: str = "sh") -> dict[str, str]:
    """``Box.py`` for a call whose cwd (and so write root) is ``cwd``."""
    argv = shlex.join(["python3", "-c", textwrap.dedent(code), *args])
    res = await box.conn.call(tool, {"code": argv}, str(cwd), tool_env(cwd))
    assert not res.isError, res.text
    return dict(line.rsplit(" ", 1) for line in res.text.splitlines() if " " in line)


# Every wall at once, aimed at ``target`` (a directory): writes, metadata, a nested .git,
# UDP. Prints "<what> ok" or "<what> <ERRNO>".
EVERY_WALL = (
    TRY
    + """
target, port = sys.argv[1], int(sys.argv[2])
f = os.path.join(target, "victim")
attempt("write", lambda: open(os.path.join(target, "new"), "w").write("x"))
attempt("chmod", lambda: os.chmod(f, 0o777))
attempt("chown", lambda: os.chown(f, 65534, 65534))
attempt("utime", lambda: os.utime(f, (978307200, 978307200)))
attempt("hook", lambda: open(os.path.join(target, "repo/.git/hooks/x"), "w").write("x"))
attempt("udp", lambda: socket.socket(type=socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", port)))
"""
)


@needs_ns
async def test_a_call_never_runs_in_the_sandbox_entered_for_another(
    box: Box, tmp_path: Path
) -> None:
    """toolsrv enters the sandbox of each call ahead, for the next call like it
    (`Spawner.prestart`). A call whose sandbox differs (another cwd, another profile, a
    .git made since) must get its own: from each such call, every wall is tried against
    what the sandbox entered ahead would have allowed."""
    one, two = tmp_path / "one", tmp_path / "two"
    for d in (one, two):
        (d / "repo").mkdir(parents=True)
        (d / "victim").write_text("precious\n")
        (d / "victim").chmod(0o644)
    with socket.socket(type=socket.SOCK_DGRAM) as host:
        host.bind(("127.0.0.1", 0))
        host.setblocking(False)
        port = str(host.getsockname()[1])
        # Calls in ``one`` with the network profile: one's sandbox is entered ahead.
        for _ in range(3):
            got = await in_dir(box, one, EVERY_WALL, str(one), port, tool="sh_net")
            assert got["write"] == got["chmod"] == got["utime"] == got["udp"] == "ok", got
        assert host.recv(16) == b"x"
        while True:  # (drain the three)
            try:
                host.recv(16)
            except BlockingIOError:
                break
        before = snapshot(one / "victim")
        (one / "new").unlink()
        # Another cwd, the default profile: nothing of ``one``, no network.
        got = await in_dir(box, two, EVERY_WALL, str(one), port)
        assert got["hook"] in ("ENOENT", "EROFS", "EACCES"), got
        del got["hook"]  # (one/repo has no .git yet)
        assert set(got.values()) <= {"EROFS", "EACCES", "EPERM", "EAFNOSUPPORT"}, got
        assert snapshot(one / "victim") == before and not (one / "new").exists()
        with pytest.raises(BlockingIOError):
            host.recv(16)
        # Positive control: the same call reaches its own cwd.
        got = await in_dir(box, two, EVERY_WALL, str(two), port)
        assert got["write"] == got["chmod"] == got["utime"] == "ok", got
        assert got["udp"] != "ok"
        # The default profile in ``one`` itself, right after network calls there: no UDP.
        got = await in_dir(box, one, EVERY_WALL, str(one), port)
        assert got["write"] == "ok" and got["udp"] != "ok", got
        with pytest.raises(BlockingIOError):
            host.recv(16)
    # A .git made in ``one`` between two calls: protected from the next call on, though
    # the sandbox entered ahead for ``one`` was made before it existed.
    got = await in_dir(box, one, TRY + "attempt('touch', lambda: open('repo/f', 'w'))\n")
    assert got == {"touch": "ok"}
    (one / "repo" / ".git" / "hooks").mkdir(parents=True)
    got = await in_dir(box, one, EVERY_WALL, str(one), "9")
    assert got["hook"] in ("EROFS", "EACCES") and got["write"] == "ok", got
    assert list((one / "repo" / ".git" / "hooks").iterdir()) == []
    # Moved away and back (the same directory: the namespace made for it is still kept),
    # right after calls without it: the sandbox entered ahead then is not the one to use.
    for _ in range(2):
        got = await in_dir(box, one, EVERY_WALL, str(one), "9")
        assert got["hook"] in ("EROFS", "EACCES"), got
    (one / "repo" / ".git").rename(one / "repo" / "git")
    for _ in range(3):
        got = await in_dir(box, one, EVERY_WALL, str(one), "9")
        assert got["hook"] == "ENOENT", got
    (one / "repo" / "git").rename(one / "repo" / ".git")
    got = await in_dir(box, one, EVERY_WALL, str(one), "9")
    assert got["hook"] in ("EROFS", "EACCES") and got["write"] == "ok", got
    assert list((one / "repo" / ".git" / "hooks").iterdir()) == []


# Opens the environ and mem of each thread of a process, and of the tool itself.
PROC_MEM = (
    TRY
    + """
pid = sys.argv[1]
for tid in os.listdir(f"/proc/{pid}/task"):
    for what in ("environ", "mem"):
        attempt(f"{tid}/{what}", lambda p=f"/proc/{pid}/task/{tid}/{what}": open(p, "rb").close())
attempt("self/environ", lambda: open("/proc/self/environ", "rb").close())
attempt("self/mem", lambda: open("/proc/self/mem", "rb").close())
"""
)


async def test_toolsrv_memory_out_of_reach(box: Box) -> None:
    """toolsrv holds the master key; its spawning thread lives on for moments in the
    tool's Landlock domain, and a tool may open /proc/<pid>/mem of its domain (seccomp
    refuses ptrace, not open): toolsrv stays non-dumpable, so that takes CAP_SYS_PTRACE.
    The tool tries every thread of its parent, toolsrv, as it starts."""
    for _ in range(3):
        got = await box.py(PROC_MEM.replace("sys.argv[1]", "str(os.getppid())"))
        mine = {k: got.pop(k) for k in ("self/environ", "self/mem")}
        assert mine == {"self/environ": "ok", "self/mem": "ok"}  # positive control
        assert got and set(got.values()) <= {"EACCES", "EPERM"}, got


# --- the daemon's own dirs -------------------------------------------------------------------

EVIL_PROFILE = 'unsandboxed = true\nnetwork = true\nwrite = ["/"]\n'


def daemon_layout(base: Path, layout: str) -> tuple[Path, Paths]:
    """A home (the sessions' cwd) holding a daemon's dirs as it leaves them: OLLIE_HOME's
    config/ state/ data/ run/, or the XDG defaults beneath $HOME (the run dir elsewhere),
    with ~/.config a symlink into the home in ``xdg_symlinked``."""
    home = base / "home"
    home.mkdir()
    if layout == "ollie_home":
        p = settings.paths({"OLLIE_HOME": str(home)})
    else:
        if layout == "xdg_symlinked":
            (home / "dotfiles" / "config").mkdir(parents=True)
            (home / ".config").symlink_to("dotfiles/config")
        p = Paths(
            home / ".config" / "ollie",
            home / ".local" / "state" / "ollie",
            home / ".local" / "share" / "ollie",
            base / "xdg-run" / "ollie",
        )
    p.ensure()
    (p.sessions / "s1.jsonl").write_text('{"journal": "of another session"}\n')
    p.log_file.write_text("daemon log\n")
    (p.state / "toolsrv.log").write_text("toolsrv log\n")
    p.env_file.write_text("OLLIE_OPENAI_KEY=sk-secret\n")
    (p.config / "sandbox").mkdir()
    (p.config / "sandbox" / "default.toml").write_text("# the user's own\n")
    (p.config / "tools").mkdir()
    (p.memory / "notes.md").write_text("## note\nremember the blue door\n")
    (p.data / "tmp" / "sess").mkdir(parents=True)  # (toolsrv makes it at the first call)
    return home, p


class DaemonBox:
    def __init__(self, srv: ToolsrvProc, conn: ToolsrvConn, home: Path, p: Paths) -> None:
        self.srv, self.conn, self.home, self.paths = srv, conn, home, p

    async def call(self, tool: str, args: dict[str, str], cwd: Path | None = None) -> str:
        cwd = cwd or self.home
        env = {**tool_env(cwd), "OLLIE_MEMORY_DIR": str(self.paths.memory)}
        res = await self.conn.call(tool, args, str(cwd), env)
        return ("ERROR " if res.isError else "") + res.text

    async def py(
        self, code: str, *args: str, tool: str = "sh", cwd: Path | None = None
    ) -> dict[str, str]:
        argv = shlex.join(["python3", "-c", textwrap.dedent(code), *args])
        out = await self.call(tool, {"code": argv}, cwd)
        assert not out.startswith("ERROR"), out
        return dict(line.rsplit(" ", 1) for line in out.splitlines() if " " in line)


@pytest.fixture(params=["ollie_home", "xdg", "xdg_symlinked"])
async def daemon_box(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[DaemonBox]:
    """A toolsrv started as olliefs starts it (`hidden_args`), with the user's tools and
    profiles in the config dir and the tmp dirs in the data dir."""
    home, p = daemon_layout(tmp_path, request.param)
    for name, profile in (("sh", "default"), ("sh_mem", "memory")):
        (p.config / "tools" / name).write_text(SH_TOOL.format(sandbox=profile))
        (p.config / "tools" / name).chmod(0o755)
    extra = ("--tmp-dir", str(p.data / "tmp"), *hidden_args(p))
    with running_toolsrv(
        tmp_path / "srv",
        tools_dirs=(p.config / "tools",),
        sandbox_dirs=(p.config / "sandbox",),
        extra_args=extra,
    ) as srv:
        tools = ("sh", "sh_mem", "memory_recall", "memory_remember")
        async with srv.agent("attacker", *tools) as conn:
            yield DaemonBox(srv, conn, home, p)


def tree_state(top: Path) -> dict[str, tuple[int, bytes]]:
    """Every entry beneath ``top``: its mode and, for a file, its bytes."""
    out: dict[str, tuple[int, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            data = path.read_bytes() if stat.S_ISREG(st.st_mode) else b""
            out[str(path.relative_to(top))] = (st.st_mode, data)
    return out


# Every way at the daemon's dirs: read, list, write, create, chmod, rename, remove, and a
# rename or replacement of each entry on the way to them. argv[1]: JSON of the targets.
AT_THE_DIRS = (
    TRY
    + """
import json
t = json.loads(sys.argv[1])
evil = t["evil"]
for label, p in t["read"].items():
    attempt("read " + label, lambda p=p: open(p, "rb").read())
for label, p in t["dirs"].items():
    attempt("list " + label, lambda p=p: os.listdir(p))
    attempt("create in " + label, lambda p=p: open(os.path.join(p, "new"), "w").write(evil))
    attempt("mkdir in " + label, lambda p=p: os.mkdir(os.path.join(p, "newdir")))
    attempt("chmod " + label, lambda p=p: os.chmod(p, 0o777))
    attempt("rename " + label, lambda p=p: os.rename(p, p + ".moved"))
    attempt("rmdir " + label, lambda p=p: os.rmdir(p))
attempt("rewrite profile", lambda: open(t["profile"], "w").write(evil))
attempt("new profile", lambda: open(t["profile"] + ".new", "w").write(evil))
attempt("chmod profile", lambda: os.chmod(t["profile"], 0o666))
attempt("remove journal", lambda: os.unlink(t["journal"]))
attempt("rename journal", lambda: os.rename(t["journal"], t["journal"] + ".x"))
for p in t["way"]:
    attempt("rename way " + p, lambda p=p: os.rename(p, p + ".moved"))
    remove = os.unlink if os.path.islink(p) else os.rmdir
    attempt("remove way " + p, lambda p=p, remove=remove: remove(p))
"""
)


@needs_ns
async def test_the_daemon_dirs_are_out_of_reach_wherever_the_cwd_is(daemon_box: DaemonBox) -> None:
    """A call whose cwd holds the daemon's config, state, data and run dirs (OLLIE_HOME in
    the cwd, or cwd = $HOME with the XDG defaults) can neither read nor change anything of
    them: no journal, log, key or profile; and a profile it tried to rewrite does nothing."""
    b = daemon_box
    p, home = b.paths, b.home
    before = {d: tree_state(d) for d in (p.config, p.state, p.data, p.run)}
    ways = (".config", ".local", ".local/state", ".local/share", "dotfiles", "dotfiles/config")
    way = [str(home / w) for w in ways if os.path.lexists(home / w)]
    targets = {
        "evil": EVIL_PROFILE,
        "read": {
            "journal": str(p.sessions / "s1.jsonl"),
            "daemon.log": str(p.log_file),
            "toolsrv.log": str(p.state / "toolsrv.log"),
            "env": str(p.env_file),
            "profile": str(p.config / "sandbox" / "default.toml"),
        },
        "dirs": {"config": str(p.config), "state": str(p.state), "data": str(p.data)},
        "profile": str(p.config / "sandbox" / "default.toml"),
        "journal": str(p.sessions / "s1.jsonl"),
        "way": way,
    }
    got = await b.py(AT_THE_DIRS, json.dumps(targets))
    assert len(got) == 5 + 6 * 3 + 5 + 2 * len(way), got
    refused = {"ENOENT", "EACCES", "EROFS", "EBUSY", "EPERM", "EXDEV", "ENOTDIR"}
    assert {k: v for k, v in got.items() if v not in refused} == {}
    for d, was in before.items():
        assert tree_state(d) == was, d
    for w in way:
        assert os.path.lexists(w) and not os.path.lexists(w + ".moved")
    # The next call runs with the user's profile, not the one the tool tried to write.
    outside = home.parent / "outside"
    outside.mkdir()
    got = await b.py(TRY + "attempt('outside', lambda: open(sys.argv[1], 'w'))", str(outside / "x"))
    assert got["outside"] in ("EACCES", "EROFS"), got
    assert not (outside / "x").exists()


@needs_ns
async def test_what_tools_need_of_the_daemon_dirs_still_works(daemon_box: DaemonBox) -> None:
    """The cwd, the call's own tmp dir (inside the data dir), the memory notes (read by
    every tool, written by the memory profile) and the tool scripts (the user's, in the
    config dir, and the shipped ones) work as before, from a cwd holding the daemon's
    dirs and from one elsewhere; another session's tmp dir stays out of reach."""
    b = daemon_box
    p = b.paths
    code = (
        TRY
        + """
cwd, tmp, memory, other = sys.argv[1:5]
attempt("cwd", lambda: open(os.path.join(cwd, "made-here"), "w").write("x"))
attempt("tmp", lambda: open(os.path.join(tmp, "scratch"), "w").write("x"))
attempt("read memory", lambda: open(os.path.join(memory, "notes.md")).read())
attempt("write memory", lambda: open(os.path.join(memory, "notes.md"), "a").write("x"))
attempt("list tmp dirs", lambda: os.listdir(os.path.dirname(tmp)))
attempt("other tmp", lambda: open(other).read())
attempt("hook in tmp", lambda: open(os.path.join(tmp, "repo/.git/hooks/x"), "w").write("x"))
"""
    )
    tmp = p.data / "tmp" / "sess"
    (tmp / "repo" / ".git" / "hooks").mkdir(parents=True)
    other = p.data / "tmp" / "other-session" / "secret"
    other.parent.mkdir()
    other.write_text("not yours\n")
    elsewhere = b.home.parent / "elsewhere"
    elsewhere.mkdir()
    for cwd in (b.home, elsewhere):
        argv = (str(cwd), str(tmp), str(p.memory), str(other))
        got = await b.py(code, *argv, cwd=cwd)  # sh: the user's tool, in the config dir
        assert got == {
            "cwd": "ok",
            "tmp": "ok",
            "read memory": "ok",
            "write memory": got["write memory"],
            "list tmp dirs": "EACCES",
            "other tmp": "ENOENT",
            "hook in tmp": got["hook in tmp"],
        }, got
        assert got["hook in tmp"] in ("EROFS", "EACCES"), got
        assert got["write memory"] in ("EROFS", "EACCES"), got
        assert (cwd / "made-here").read_text() == "x" and (tmp / "scratch").read_text() == "x"
        # The memory profile writes the notes; a shipped tool reads them.
        got = await b.py(code, *argv, tool="sh_mem", cwd=cwd)
        assert got["write memory"] == "ok" and got["read memory"] == "ok", got
        assert got["tmp"] == got["cwd"] == "ok" and got["other tmp"] == "ENOENT", got
        out = await b.call("memory_remember", {"text": f"the key is under mat {cwd.name}"}, cwd)
        assert not out.startswith("ERROR"), out
        out = await b.call("memory_recall", {"query": cwd.name}, cwd)
        assert f"under mat {cwd.name}" in out and not out.startswith("ERROR"), out
        assert f"under mat {cwd.name}" in (p.memory / "notes.md").read_text()


@needs_ns
async def test_a_cwd_inside_the_daemon_dirs_is_refused(daemon_box: DaemonBox) -> None:
    b = daemon_box
    for cwd in (b.paths.config, b.paths.state / "sessions", b.paths.data / "tmp"):
        out = await b.call("sh", {"code": "echo ran"}, cwd=cwd)
        assert out.startswith("ERROR refused: the working directory"), out
        assert "hidden from tools" in out


@needs_ns
async def test_a_shown_dir_made_anew_on_the_host_is_shown_in_the_next_call(
    daemon_box: DaemonBox,
) -> None:
    """A call's mount namespace is kept for the next calls like it; a shown directory
    (the memory notes) replaced on the host gets a fresh one, not the kept view of the
    old directory."""
    b = daemon_box
    memory = b.paths.memory
    for _ in range(2):  # (the second call joins the namespace kept by the first)
        out = await b.call("memory_recall", {"query": "door"})
        assert "blue door" in out and not out.startswith("ERROR"), out
    memory.rename(memory.with_name("memory.old"))
    memory.mkdir()
    (memory / "notes.md").write_text("## note\nthe red door\n")
    out = await b.call("memory_recall", {"query": "door"})
    assert "red door" in out and "blue" not in out, out
