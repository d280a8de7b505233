"""run_tool with real processes, real Landlock and real cgroups (no mocks).

Tools are small Python or shell programs; what they could or could not do is read from their
output and from /proc. Tests that need Landlock skip on kernels without it; the rest use a
profile that runs unsandboxed there, so process handling is tested everywhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
import trio

from olliefs.testing import await_until, expect_log
from toolsrv import namespaces, sandbox
from toolsrv.exec import ExecResult, Executor, cgroup, spawn
from toolsrv.exec.run import _MountNs
from toolsrv.exec.spawn import Spare, Spawner
from toolsrv.sandbox import Profile, SandboxError
from toolsrv.server import render_result

ABI = sandbox.landlock_abi()
needs_landlock = pytest.mark.skipif(
    ABI == 0, reason="needs Landlock (Linux >= 5.13 with landlock in the active LSMs)"
)
needs_net_rules = pytest.mark.skipif(ABI < 4, reason="Landlock TCP rules need ABI 4 (Linux 6.7)")
needs_scopes = pytest.mark.skipif(ABI < 6, reason="Landlock scopes need ABI 6 (Linux 6.12)")
BASH = shutil.which("bash")

DEFAULT = Profile(name="default")
NETWORK = Profile(name="network", network=True)
# For tests about process handling rather than confinement: runs on any kernel.
PLAIN = Profile(name="plain", unsandboxed=ABI == 0)
SHIPPED = Path(__file__).resolve().parents[2] / "agents" / "sandbox"


@pytest.fixture(autouse=True)
def warned_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """toolsrv warns once per process about a kernel feature it goes without; each test
    here gets its own first time, so the warnings it declares do not hang on the order."""
    monkeypatch.setattr(sandbox, "_warned", set())


NO_MOUNT_NS = r"toolsrv\.sandbox: no mount namespaces: only \.git at the top"
NO_NETNS = r"toolsrv\.sandbox: no network namespace: tools without network keep the host's"


def netns_of(b: Box) -> int | None:
    """The executor's empty network namespace, as a call gets it; where there is none,
    the sandbox says so."""
    if b.executor.netns is None:
        expect_log(NO_NETNS)
    return b.executor.netns


@pytest.fixture
def executor() -> Iterator[Executor]:
    """What the server does at start: an executor of its own, whose reaper gets the orphans
    of tools back."""
    ex = Executor()
    ex.start()
    yield ex
    ex.close()


@dataclass
class Box:
    root: Path
    cwd: Path  # a git checkout: src/ and .git/hooks/
    tmp: Path
    outside: Path
    executor: Executor

    def env(self, **extra: str) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.tmp), **extra}

    async def run(
        self,
        argv: list[str],
        *,
        profile: Profile = DEFAULT,
        timeout: float = 30,
        stdin: bytes = b"",
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        return await self.executor.run(
            argv,
            stdin=stdin,
            cwd=str(self.cwd),
            env=self.env() if env is None else env,
            write_roots=[str(self.cwd)],
            tmp_dir=str(self.tmp),
            profile=profile,
            timeout=timeout,
        )


@pytest.fixture
def exec_box(tmp_path: Path, executor: Executor) -> Box:
    cwd = tmp_path / "work"
    (cwd / "src").mkdir(parents=True)
    (cwd / ".git" / "hooks").mkdir(parents=True)
    (cwd / ".git" / "config").write_text("[core]\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    outside = tmp_path / "outside"
    (outside / "etc").mkdir(parents=True)
    (outside / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    return Box(tmp_path, cwd, tmp, outside, executor)


def py(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code), *args]


# Tries each path; prints "<path> ok" or "<path> <ERRNO NAME>".
WRITER = """
    import errno, sys
    for p in sys.argv[1:]:
        try:
            with open(p, "a") as f:
                f.write("x")
            print(p, "ok")
        except OSError as e:
            print(p, errno.errorcode[e.errno])
"""


def outcomes(res: ExecResult) -> dict[str, str]:
    assert res.error is None and res.exit_code == 0, res
    return dict(line.rsplit(" ", 1) for line in res.stdout.decode().splitlines())


def state(pid: int) -> str | None:
    """The process state letter (Z: zombie), or None once the pid is gone (reaped)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return data[data.rindex(b")") + 2 :].split()[0].decode()


async def gone(pids: list[int], within: float = 3.0) -> list[int]:
    """The pids still present (alive or zombie) after each was reaped, or ``within``
    seconds."""
    with contextlib.suppress(AssertionError):
        await await_until(lambda: all(state(p) is None for p in pids), "reaped", within, reaps=pids)
    return [p for p in pids if state(p) is not None]


async def read_pids(path: Path, count: int) -> list[int]:
    def pids() -> list[int]:
        return [int(x) for x in path.read_text().split()] if path.exists() else []

    await await_until(lambda: len(pids()) >= count, f"{count} pids in {path}", 20, files=[path])
    return pids()


# --- confinement ---------------------------------------------------------------------------


@needs_landlock
async def test_writes_inside_roots_only(exec_box: Box) -> None:
    b = exec_box
    inside = [b.cwd / "src" / "new.txt", b.tmp / "t.txt", Path("/dev/null")]
    if sandbox.mount_namespaces():  # else .git is kept by per-entry rules: no new top level
        inside.append(b.cwd / "top.txt")
    outside = [b.outside / "x", b.outside / "etc" / "passwd", b.root / "sibling.txt"]
    res = await b.run(py(WRITER, *map(str, inside + outside)))
    got = outcomes(res)
    for p in inside:
        assert got[str(p)] == "ok", p
    for p in outside:
        assert got[str(p)] in ("EACCES", "EPERM", "EROFS"), p
    assert (b.cwd / "src" / "new.txt").read_text() == "x"
    assert not (b.outside / "x").exists()
    assert (b.outside / "etc" / "passwd").read_text().startswith("root:x")


@needs_landlock
async def test_shell_redirections_and_tmp(exec_box: Box) -> None:
    script = (
        'echo a > /dev/null && echo b >/dev/stderr && echo c > "$HOME/f" && mkdir src/d && echo ok'
    )
    res = await exec_box.run(["sh", "-c", script])
    assert (res.exit_code, res.stdout, res.stderr) == (0, b"ok\n", b"b\n")
    assert (exec_box.tmp / "f").read_text() == "c\n"
    assert (exec_box.cwd / "src" / "d").is_dir()


@needs_landlock
async def test_git_dir_stays_read_only(exec_box: Box) -> None:
    b = exec_box
    res = await b.run(py(WRITER, str(b.cwd / ".git" / "hooks" / "x"), str(b.cwd / "src" / "x")))
    got = outcomes(res)
    assert got[str(b.cwd / "src" / "x")] == "ok"
    assert got[str(b.cwd / ".git" / "hooks" / "x")] in ("EROFS", "EACCES")
    assert not (b.cwd / ".git" / "hooks" / "x").exists()
    # Nor can it be moved, removed or replaced wholesale.
    res = await b.run(["sh", "-c", "mv .git git2; rm -rf .git; echo done"])
    assert res.stdout == b"done\n"
    assert (b.cwd / ".git" / "config").read_text() == "[core]\n"
    assert not (b.cwd / "git2").exists()


def run_entered(prepared: sandbox.Prepared, argv: list[str]) -> dict[str, str]:
    """What run_tool does, by hand: a fresh thread enters the sandbox, then spawns."""
    box: list[subprocess.CompletedProcess[bytes] | BaseException] = []

    def spawn() -> None:
        try:
            prepared.enter()
            box.append(subprocess.run(argv, capture_output=True, check=True))
        except BaseException as err:
            box.append(err)

    t = threading.Thread(target=spawn)
    t.start()
    t.join()
    prepared.close()
    done = box[0]
    assert isinstance(done, subprocess.CompletedProcess), done
    return dict(line.rsplit(" ", 1) for line in done.stdout.decode().splitlines())


@needs_landlock
def test_git_fallback_without_mount_namespace(exec_box: Box) -> None:
    """Where namespaces are refused, Landlock rules per top-level entry protect .git."""
    b = exec_box
    expect_log(NO_MOUNT_NS)
    roots = [str(b.cwd), str(b.tmp)]
    prepared = sandbox.prepare(DEFAULT, roots, mount_ns=False, netns_fd=netns_of(b))
    assert prepared.protect == () and prepared.mounts is None
    targets = [b.cwd / ".git" / "hooks" / "x", b.cwd / "src" / "x", b.cwd / "newtop", b.tmp / "x"]
    got = run_entered(prepared, py(WRITER, *map(str, targets)))
    assert got[str(b.cwd / ".git" / "hooks" / "x")] == "EACCES"
    assert got[str(b.cwd / "src" / "x")] == "ok"
    assert got[str(b.cwd / "newtop")] == "EACCES"  # the documented limitation
    assert got[str(b.tmp / "x")] == "ok"


@needs_landlock
def test_hidden_dirs_stay_read_only_without_mount_namespace(exec_box: Box) -> None:
    """Where namespaces are refused, a hidden directory beneath a root (the daemon's
    config dir beneath a cwd = $HOME) is kept read-only by Landlock rules per entry down
    the way to it; its neighbours stay writable, and so does a root inside it (the tmp
    dir inside the data dir)."""
    b = exec_box
    config = b.cwd / ".config" / "ollie"
    (config / "sandbox").mkdir(parents=True)
    (config / "sandbox" / "default.toml").write_text("# the user's\n")
    (b.cwd / ".config" / "other").mkdir()
    tmp = b.cwd / ".local" / "share" / "ollie" / "tmp" / "sess"
    tmp.mkdir(parents=True)
    hide = [str(config), str(b.cwd / ".local" / "share" / "ollie")]
    expect_log(NO_MOUNT_NS)
    roots = [str(b.cwd), str(tmp)]
    prepared = sandbox.prepare(DEFAULT, roots, mount_ns=False, hide=hide, netns_fd=netns_of(b))
    assert prepared.mounts is None
    targets = [
        config / "sandbox" / "default.toml",
        config / "new.toml",
        b.cwd / ".local" / "share" / "ollie" / "journal",
        b.cwd / ".config" / "other" / "x",
        b.cwd / "src" / "x",
        tmp / "x",
    ]
    got = run_entered(prepared, py(WRITER, *map(str, targets)))
    assert got == {
        str(config / "sandbox" / "default.toml"): "EACCES",
        str(config / "new.toml"): "EACCES",
        str(b.cwd / ".local" / "share" / "ollie" / "journal"): "EACCES",
        str(b.cwd / ".config" / "other" / "x"): "ok",
        str(b.cwd / "src" / "x"): "ok",
        str(tmp / "x"): "ok",
    }
    assert (config / "sandbox" / "default.toml").read_text() == "# the user's\n"


@needs_landlock
def test_network_namespace_alone_cuts_tcp_and_udp(exec_box: Box) -> None:
    """The empty network namespace as the only wall (Landlock ABI 3: no TCP rules; no
    seccomp filter): nothing reaches the host's loopback, TCP or UDP."""
    netns = exec_box.executor.netns
    if netns is None:
        pytest.skip(reason="no network namespaces here (toolsrv is not root)")
    with socket.socket() as listener, socket.socket(type=socket.SOCK_DGRAM) as udp:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        udp.bind(("127.0.0.1", 0))
        udp.setblocking(False)
        args = [str(listener.getsockname()[1]), str(udp.getsockname()[1])]
        cwd = [str(exec_box.cwd)]
        alone = sandbox.prepare(DEFAULT, cwd, abi=3, netns_fd=netns, use_seccomp=False)
        got = run_entered(alone, py(CONNECT, *args))
        assert got["connect"] in ("ENETUNREACH", "ECONNREFUSED")
        assert got["udp"] == "ENETUNREACH"
        with pytest.raises(BlockingIOError):
            udp.recv(16)
        # The same program with network connects (the test can fail).
        got = run_entered(
            sandbox.prepare(NETWORK, cwd, abi=3, use_seccomp=False), py(CONNECT, *args)
        )
        assert got == {"connect": "ok", "bind": "ok", "udp": "ok"}
        assert udp.recv(16) == b"x"


def test_is_protected(exec_box: Box) -> None:
    root = str(exec_box.cwd)
    assert sandbox.is_protected(f"{root}/.git/config", [root])
    assert sandbox.is_protected(f"{root}/.git", [root])
    assert sandbox.is_protected(".git/hooks/pre-commit", [root])
    assert not sandbox.is_protected(f"{root}/src/x", [root])
    assert not sandbox.is_protected("src/.gitignore", [root])
    (exec_box.cwd / "src" / "link").symlink_to("../.git")
    assert sandbox.is_protected(f"{root}/src/link/config", [root])


@needs_landlock
async def test_extra_write_roots_from_profile(exec_box: Box) -> None:
    b = exec_box
    profile = Profile(
        name="extra", write=["${EXTRA}", "${UNSET_VAR}/x", "~/not-there", "relative/${EXTRA}"]
    )
    env = b.env(EXTRA=str(b.outside / "etc"))
    res = await b.run(
        py(WRITER, str(b.outside / "etc" / "y"), str(b.outside / "z")), env=env, profile=profile
    )
    got = outcomes(res)
    assert got[str(b.outside / "etc" / "y")] == "ok"
    assert got[str(b.outside / "z")] in ("EACCES", "EROFS")
    assert sandbox.expand_write(profile.write, env) == [str(b.outside / "etc")]
    assert sandbox.expand_write(["~"], {"HOME": str(b.tmp)}) == [str(b.tmp)]


# argv: a TCP port listening on 127.0.0.1 [, a UDP port to send "x" to].
CONNECT = """
    import errno, socket, sys
    def attempt(what, fn):
        try:
            fn()
            print(what, "ok")
        except OSError as e:
            print(what, errno.errorcode[e.errno])
    attempt("connect", lambda: socket.socket().connect(("127.0.0.1", int(sys.argv[1]))))
    attempt("bind", lambda: socket.socket().bind(("127.0.0.1", 0)))
    if len(sys.argv) > 2:
        to = ("127.0.0.1", int(sys.argv[2]))
        attempt("udp", lambda: socket.socket(type=socket.SOCK_DGRAM).sendto(b"x", to))
"""


@needs_net_rules
def test_landlock_tcp_rules_alone(exec_box: Box) -> None:
    """Landlock's TCP rules as the only wall (no namespace, no seccomp): EACCES."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = str(listener.getsockname()[1])
        # No namespace at all (both are warned about), no seccomp: the TCP rules alone.
        expect_log(NO_MOUNT_NS)
        expect_log(NO_NETNS)
        alone = sandbox.prepare(DEFAULT, [str(exec_box.cwd)], mount_ns=False, use_seccomp=False)
        assert run_entered(alone, py(CONNECT, port)) == {"connect": "EACCES", "bind": "EACCES"}


@needs_landlock
async def test_no_network_unless_the_profile_allows_it(exec_box: Box) -> None:
    """Every wall at once, as a call gets them: the socket is not even made (seccomp)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = str(listener.getsockname()[1])
        got = outcomes(await exec_box.run(py(CONNECT, port)))
        assert got == {"connect": "EAFNOSUPPORT", "bind": "EAFNOSUPPORT"}
        got = outcomes(await exec_box.run(py(CONNECT, port), profile=NETWORK))
        assert got == {"connect": "ok", "bind": "ok"}


@needs_scopes
async def test_cannot_signal_outside_or_reach_abstract_sockets(exec_box: Box) -> None:
    """Landlock's scopes, tested with the network profile (the host's network namespace,
    so an abstract name of the host is there to be refused)."""
    name = f"\0olliefs-test-{os.getpid()}"
    code = """
        import errno, os, socket, sys
        try:
            os.kill(int(sys.argv[1]), 0)
            print("signal ok")
        except OSError as e:
            print("signal", errno.errorcode[e.errno])
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(sys.argv[2].replace("@", "\\0"))
            print("abstract ok")
        except OSError as e:
            print("abstract", errno.errorcode[e.errno])
    """
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(name)
        listener.listen(1)
        args = (str(os.getpid()), name.replace("\0", "@"))
        res = await exec_box.run(py(code, *args), profile=NETWORK)
    assert outcomes(res) == {"signal": "EPERM", "abstract": "EPERM"}


@needs_landlock
@pytest.mark.parametrize("profile", [DEFAULT, NETWORK], ids=["default", "network"])
async def test_no_new_privs_and_no_capabilities(exec_box: Box, profile: Profile) -> None:
    keys = "NoNewPrivs|CapInh|CapPrm|CapEff|CapBnd|CapAmb|Seccomp"
    res = await exec_box.run(["grep", "-E", f"^({keys}):", "/proc/self/status"], profile=profile)
    fields = dict(line.split(":\t") for line in res.stdout.decode().splitlines())
    assert fields.pop("NoNewPrivs") == "1"
    assert fields.pop("Seccomp") == "2"  # a filter
    caps = {k: int(v, 16) for k, v in fields.items()}
    if os.geteuid() != 0:  # an unprivileged server cannot empty a bounding set
        caps.pop("CapBnd")
    assert caps and all(v == 0 for v in caps.values()), fields


async def test_refuses_without_landlock(exec_box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "landlock_abi", lambda: 0)
    with pytest.raises(SandboxError) as info:
        await exec_box.run(["true"])
    assert str(info.value) == (
        "landlock unavailable: refusing to run tools unsandboxed "
        "(set unsandboxed = true in sandbox/default.toml to allow)"
    )
    # Opted out: runs, without Landlock, still with NNP and its own session.
    loose = Profile(name="loose", unsandboxed=True)
    code = """
        import os
        status = open("/proc/self/status").read()
        print(os.getsid(0) == os.getpid(), status.count("NoNewPrivs:\\t1"))
    """
    target = exec_box.outside / "written"
    script = f"echo hi > {target} && exec {shlex.join(py(code))}"
    res = await exec_box.run(["sh", "-c", script], profile=loose)
    assert res.stdout == b"True 1\n"
    assert target.read_text() == "hi\n"


# --- process handling ----------------------------------------------------------------------


async def test_exit_status_signal_and_output(exec_box: Box) -> None:
    res = await exec_box.run(["sh", "-c", "echo out; echo err >&2; exit 3"], profile=PLAIN)
    assert (res.exit_code, res.signal, res.stdout, res.stderr) == (3, None, b"out\n", b"err\n")
    assert not res.timed_out and res.error is None
    res = await exec_box.run(["sh", "-c", "kill -9 $$"], profile=PLAIN)
    assert (res.exit_code, res.signal) == (None, signal.SIGKILL)


async def test_env_is_exactly_what_was_given(exec_box: Box) -> None:
    env = {"PATH": "/usr/bin:/bin", "ONLY": "this"}
    res = await exec_box.run(["env"], env=env, profile=PLAIN)
    assert sorted(res.stdout.decode().splitlines()) == ["ONLY=this", "PATH=/usr/bin:/bin"]


async def test_stdin_big_and_unread(exec_box: Box) -> None:
    data = os.urandom(3 << 20)
    big = Profile(name="big", unsandboxed=ABI == 0, max_output=4 << 20)
    res = await exec_box.run(["cat"], stdin=data, profile=big)
    assert res.stdout == data and res.stdout_dropped == 0
    with trio.fail_after(10):  # a tool that never reads its stdin must not hang the call
        res = await exec_box.run(["true"], stdin=data, profile=PLAIN)
    assert res.exit_code == 0


async def test_spawn_failures_are_results(exec_box: Box) -> None:
    res = await exec_box.run(["/nonexistent/tool"], profile=PLAIN)
    assert res.error == "cannot run /nonexistent/tool: not found"
    assert res.exit_code is None
    res = await exec_box.run(["no-such-tool-anywhere"], profile=PLAIN)
    assert res.error is not None and "not found" in res.error
    script = exec_box.cwd / "noexec.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    res = await exec_box.run([str(script)], profile=PLAIN)
    assert res.error is not None and "Permission denied" in res.error
    res = await exec_box.executor.run(
        ["true"],
        stdin=b"",
        cwd=str(exec_box.root / "missing"),
        env=exec_box.env(),
        write_roots=[],
        tmp_dir=str(exec_box.tmp),
        profile=PLAIN,
        timeout=5,
    )
    assert res.error is not None and "missing" in res.error
    assert (await exec_box.run([], profile=PLAIN)).error == "empty command"


async def test_output_capped_and_runaway_ended_by_timeout(exec_box: Box) -> None:
    small = Profile(name="small", unsandboxed=ABI == 0, max_output=1000)
    res = await exec_box.run(["sh", "-c", "yes & exec yes err >&2"], profile=small, timeout=1)
    assert res.timed_out and res.signal == signal.SIGKILL
    assert res.stdout == b"y\n" * 500 and res.stderr == b"err\n" * 250
    assert res.stdout_dropped > 0 and res.stderr_dropped > 0


async def test_limits_and_timeout_cap(exec_box: Box) -> None:
    profile = Profile(name="lim", unsandboxed=ABI == 0, max_memory=1 << 30, timeout_cap=1)
    res = await exec_box.run(["cat", "/proc/self/limits"], profile=profile)
    limits = {line[:26].strip(): line[26:].split()[:2] for line in res.stdout.decode().splitlines()}
    assert limits["Max address space"] == [str(1 << 30)] * 2
    assert limits["Max core file size"][0] == "0"
    with trio.fail_after(10):
        res = await exec_box.run(["sleep", "30"], profile=profile, timeout=60)
    assert res.timed_out


async def test_background_children_die_with_the_call(exec_box: Box) -> None:
    with trio.fail_after(10):
        res = await exec_box.run(["sh", "-c", "sleep 100 & echo $!"], profile=PLAIN)
    assert res.exit_code == 0
    assert state(int(res.stdout)) in (None, "Z")
    assert await gone([int(res.stdout)]) == []


# Every process appends its pid to argv[1]: the leader, three children ignoring SIGTERM, one
# that leaves the session with setsid() and its own child.
SPREAD = """
    import os, signal, sys
    def note():
        with open(sys.argv[1], "a") as f:
            f.write(f"{os.getpid()}\\n")
    def linger():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        note()
        while True:
            signal.pause()
    note()
    for _ in range(3):
        if os.fork() == 0:
            linger()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            linger()
        linger()
    signal.pause()
"""


async def test_cancel_kills_everything(exec_box: Box) -> None:
    pidfile = exec_box.tmp / "pids"
    scope = trio.CancelScope()
    after: dict[int, str | None] = {}
    async with trio.open_nursery() as nursery:

        async def call() -> None:
            with scope:
                await exec_box.run(py(SPREAD, str(pidfile)), profile=PLAIN)
                pytest.fail("run_tool returned although cancelled")
            after.update((p, state(p)) for p in await read_pids(pidfile, 6))

        nursery.start_soon(call)
        pids = await read_pids(pidfile, 6)
        assert all(state(p) not in (None, "Z") for p in pids)
        scope.cancel()
    assert scope.cancelled_caught
    # When run_tool raised, nothing was alive and the leader was reaped ...
    assert after[pids[0]] is None
    assert all(s in (None, "Z") for s in after.values()), after
    # ... and the zombies of the others are reaped by the reaper right after.
    assert await gone(pids) == []


async def test_timeout_kills_everything(exec_box: Box) -> None:
    pidfile = exec_box.tmp / "pids"
    res = await exec_box.run(py(SPREAD, str(pidfile)), profile=PLAIN, timeout=2)
    pids = await read_pids(pidfile, 6)
    assert res.timed_out and res.signal == signal.SIGKILL
    assert state(pids[0]) is None
    assert all(state(p) in (None, "Z") for p in pids)
    assert await gone(pids) == []


async def test_orphans_of_calls_in_flight_are_left_alone(exec_box: Box) -> None:
    """The end of one call must not kill what a call still running has re-parented to us.

    The slow call leaves an orphan (setsid, its parent gone) that waits on a FIFO; the quick
    call, started once that orphan is ours, leaves one too. After the quick call, the slow
    call's orphan must still be alive; released, it answers the slow call's leader.
    """
    t = exec_box.tmp
    go, back, pidf = t / "go", t / "back", t / "orphan.pid"
    os.mkfifo(go)
    os.mkfifo(back)
    orphan = f"echo $$ > {pidf}; read x < {go}; echo late > {back}"
    slow = f"(setsid sh -c {shlex.quote(orphan)} &); cat {back}"
    results: list[ExecResult] = []
    async with trio.open_nursery() as nursery:

        async def slow_call() -> None:
            results.append(await exec_box.run(["sh", "-c", slow], profile=PLAIN))

        nursery.start_soon(slow_call)
        (pid,) = await read_pids(pidf, 1)
        parent = ppid(pid)  # its subshell, which ends at once: then it is ours
        assert parent is not None
        await await_until(lambda: ppid(pid) == os.getpid(), "the orphan is ours", exits=[parent])
        quick = await exec_box.run(["sh", "-c", "(setsid sleep 100 &); echo quick"], profile=PLAIN)
        assert quick.stdout == b"quick\n"
        assert state(pid) not in (None, "Z"), "the in-flight call's orphan was killed"

        def release() -> None:
            with open(go, "w") as f:
                f.write("\n")

        await trio.to_thread.run_sync(release)
    assert results[0].stdout == b"late\n"


def ppid(pid: int) -> int | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return int(data[data.rindex(b")") + 2 :].split()[1])


@pytest.fixture
def exec_capped(executor: Executor) -> bool:
    """Whether a pids cgroup caps calls (else RLIMIT_NPROC does, except for root)."""
    capped = "pids" in executor.cgroup_mode
    if not capped and os.geteuid() == 0:
        pytest.skip(reason="no writable pids cgroup, and root is exempt from RLIMIT_NPROC: no cap")
    return capped


@pytest.mark.skipif(BASH is None, reason="the fork bomb is written for bash")
async def test_fork_bomb_is_contained(exec_box: Box, exec_capped: bool) -> None:
    assert BASH is not None
    capped = exec_capped
    pidfile = exec_box.tmp / "leader"
    # Guarded: it stops forking after 2 s by itself, even if it were not contained.
    bomb = f"echo $$ > {pidfile}; f() {{ [ $SECONDS -lt 2 ] && {{ f | f & }}; }}; f; sleep 30"
    limit = 40
    profile = Profile(name="bomb", unsandboxed=ABI == 0, max_procs=limit)
    baseline = int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])
    peak = 0
    result: list[ExecResult] = []
    async with trio.open_nursery() as nursery:

        async def call() -> None:
            result.append(await exec_box.run([BASH, "-c", bomb], profile=profile, timeout=3))

        nursery.start_soon(call)
        (leader,) = await read_pids(pidfile, 1)
        while not result:
            peak = max(peak, len(session(leader)))
            await trio.sleep(0.02)
    res = result[0]
    assert res.timed_out
    assert peak > 5  # it did try
    # pids.max caps the call; RLIMIT_NPROC (the fallback) caps all processes of the user.
    assert peak <= (limit if capped else baseline + limit), (peak, exec_box.executor.cgroup_mode)
    assert all(state(p) in (None, "Z") for p in session(leader))
    assert await gone(session(leader)) == []
    assert (await exec_box.run(["true"], profile=PLAIN)).exit_code == 0  # the machine is fine


def session(sid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                data = Path(f"/proc/{entry}/stat").read_bytes()
            except OSError:
                continue
            if int(data[data.rindex(b")") + 2 :].split()[3]) == sid:
                out.append(int(entry))
    return out


REAPER_SCRIPT = """
import json, os, sys, trio
from pathlib import Path
from olliefs.testing import await_until
from toolsrv.exec import Executor
from toolsrv.sandbox import Profile

def state(pid):
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return data[data.rindex(b")") + 2 :].split()[0].decode()

async def main():
    executor = Executor(cgroups=sys.argv[5])
    executor.start()
    cwd, tmp, code = sys.argv[1:4]
    profile = Profile(name="t", unsandboxed=sys.argv[4] == "1")
    res = await executor.run(
        [sys.executable, "-c", code, tmp + "/pids"], stdin=b"", cwd=cwd,
        env={"PATH": "/usr/bin:/bin"}, write_roots=[cwd], tmp_dir=tmp, profile=profile, timeout=2,
    )
    pids = [int(x) for x in Path(tmp, "pids").read_text().split()]
    at_return = {p: state(p) for p in pids}
    try:  # each reaped (its pidfd hangs up), or 3 s
        await await_until(lambda: all(state(p) is None for p in pids), "reaped", 3, reaps=pids)
    except AssertionError:
        pass
    print(json.dumps({"mode": executor.cgroup_mode, "timed_out": res.timed_out,
                      "at_return": at_return, "later": {p: state(p) for p in pids}}))

trio.run(main)
"""


@pytest.mark.parametrize("mode", ["off", "v1", "v2"])
def test_kill_in_each_cgroup_mode(exec_box: Box, mode: str) -> None:
    """The setsid() escapee and its child die with the call whatever the cgroup setup:
    killed through the cgroup, or without one by the subreaper's sweep. In a fresh process,
    as a process has one subreaper and one SIGCHLD handler."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            REAPER_SCRIPT,
            str(exec_box.cwd),
            str(exec_box.tmp),
            textwrap.dedent(SPREAD),
            "1" if ABI == 0 else "0",
            mode,
        ],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    out = json.loads(proc.stdout)
    if not out["mode"].startswith("none" if mode == "off" else mode):
        pytest.skip(reason=f"no writable cgroup {mode} here ({out['mode']})")
    assert out["timed_out"]
    assert len(out["at_return"]) == 6
    assert all(s in (None, "Z") for s in out["at_return"].values()), out
    assert all(s is None for s in out["later"].values()), out


# Allocates and writes argv[1] MiB (every page touched), then says so.
HOG = """
    import sys
    data = b"x" * (int(sys.argv[1]) << 20)
    print("survived", len(data) >> 20)
"""


@pytest.mark.parametrize("mode", ["", "off"])
async def test_memory_limit_per_call(tmp_path: Path, mode: str) -> None:
    """A call over its profile's memory_max is killed (its cgroup's memory limit) and
    answered with a tool error naming the limit; one under it runs. Without a memory
    cgroup (``off``) each process gets the cap as RLIMIT_DATA: the allocation fails."""
    cwd = tmp_path / "work"
    cwd.mkdir()
    boxes = write(tmp_path / "sandbox", "small", "memory_max = 67108864\n")
    profile = sandbox.load_profile([boxes], "small")
    if ABI == 0:
        profile = Profile(name="small", unsandboxed=True, memory_max=profile.memory_max)
    executor = Executor(cgroups=mode)
    executor.start()
    if mode == "off" and os.geteuid() == 0:
        expect_log(r"toolsrv\.sandbox: no pids cgroup: tools running as root have no process cap")
    try:
        if mode == "" and "memory" not in executor.cgroup_mode:
            pytest.skip(reason=f"no writable memory cgroup here ({executor.cgroup_mode})")

        async def hog(mib: int) -> ExecResult:
            return await executor.run(
                py(HOG, str(mib)),
                stdin=b"",
                cwd=str(cwd),
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                write_roots=[str(cwd)],
                tmp_dir=str(tmp_path),
                profile=profile,
                timeout=60,
            )

        for _ in range(2):  # (the second time in a pooled cgroup that saw an OOM kill)
            res = await hog(256)
            assert res.stdout == b"", res
            if mode == "off":
                assert res.oom_killed == 0 and res.exit_code == 1 and b"MemoryError" in res.stderr
            else:
                assert res.oom_killed >= 1 and res.signal == signal.SIGKILL, res
                text = render_result(res, 60, "small").content[0].text
                assert "killed: the call went over its memory limit of 64 MiB" in text, text
                assert "memory_max in sandbox/small.toml" in text, text
            res = await hog(8)
            assert res.stdout == b"survived 8\n" and res.oom_killed == 0, res
            assert not render_result(res, 60, "small").isError
    finally:
        executor.close()


async def test_calls_of_one_profile_leave_cgroup_limits_alone(
    exec_box: Box, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calls of the same profile find their cgroup's limits already set, the spare
    threads' cgroups included: no limit file is written again after the first call. A
    call of another profile still gets its own limit (the OOM test above enforces it)."""
    ex = exec_box.executor
    if ex.cgroups is None or not ex.cgroups.joins_threads:
        pytest.skip(reason=f"no cgroup joined ahead by spare threads here ({ex.cgroup_mode})")
    written: list[str] = []
    real = cgroup.write_file

    def counted(path: str, text: str) -> None:
        written.append(os.path.basename(path))
        real(path, text)

    monkeypatch.setattr(cgroup, "write_file", counted)
    for _ in range(2):  # the first call's spares are made with its limits
        assert (await exec_box.run(["/bin/true"])).exit_code == 0
    written.clear()
    for _ in range(4):
        assert (await exec_box.run(["/bin/true"])).exit_code == 0
    assert [w for w in written if "limit" in w or w.endswith(".max")] == []
    other = Profile(name="other", memory_max=DEFAULT.memory_max // 2)
    if ABI == 0:
        other = Profile(name="other", unsandboxed=True, memory_max=other.memory_max)
    assert (await exec_box.run(["/bin/true"], profile=other)).exit_code == 0
    if "memory" in ex.cgroup_mode:
        assert any("memory" in w for w in written), written


# --- profiles ------------------------------------------------------------------------------


def write(d: Path, name: str, text: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.toml").write_text(text)
    return d


def test_shipped_profiles_load() -> None:
    profiles = {p.stem: sandbox.load_profile([SHIPPED], p.stem) for p in SHIPPED.glob("*.toml")}
    assert set(profiles) >= {"default", "network", "ollie", "memory"}
    assert profiles["default"] == Profile(name="default")
    assert profiles["network"].network and not profiles["default"].network
    assert profiles["ollie"].write == ["${OLLIE}"]
    assert profiles["memory"].write == ["${OLLIE_MEMORY_DIR}"]
    # Every shipped profile caps a call's memory (2 GiB unless it says otherwise).
    assert {p.memory_max for p in profiles.values()} == {2 << 30}


def test_profile_first_dir_wins(tmp_path: Path) -> None:
    user = write(tmp_path / "user", "default", "network = true\nmax_procs = 12\ntimeout_cap = 5\n")
    got = sandbox.load_profile([user, SHIPPED], "default")
    assert got == Profile(name="default", network=True, max_procs=12, timeout_cap=5.0)
    assert sandbox.load_profile([user, SHIPPED], "ollie").write == ["${OLLIE}"]


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("netwrok = true\n", "unknown field `netwrok`"),
        ('network = "yes"\n', "Expected `bool`, got `str` - at `$.network`"),
        ("max_procs = 0\n", "Expected `int` >= 1 - at `$.max_procs`"),
        ('write = "/tmp"\n', "Expected `array`, got `str` - at `$.write`"),
        ('name = "other"\n', "unknown key 'name'"),
        ("network = \n", "invalid TOML"),
    ],
)
def test_profile_errors(tmp_path: Path, text: str, expect: str) -> None:
    d = write(tmp_path, "broken", text)
    with pytest.raises(SandboxError) as info:
        sandbox.load_profile([d], "broken")
    msg = str(info.value)
    assert expect in msg and str(d / "broken.toml") in msg and "\n" not in msg


@pytest.mark.parametrize("name", ["Default", "../default", "a b", "", "x.toml"])
def test_profile_bad_names(name: str) -> None:
    with pytest.raises(SandboxError, match="invalid sandbox profile name"):
        sandbox.load_profile([SHIPPED], name)


def test_profile_missing(tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match="no sandbox profile 'nope'"):
        sandbox.load_profile([tmp_path, SHIPPED], "nope")


@needs_landlock
def test_landlock_package_survives_a_stale_errno(exec_box: Box) -> None:
    """The `landlock` package takes a non-zero ctypes errno for failure: after any failed
    ctypes call in the same thread, its successful calls would raise. sandbox clears it."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.close(-1) == -1 and ctypes.get_errno() != 0
    prepared = sandbox.prepare(DEFAULT, [str(exec_box.cwd)], netns_fd=netns_of(exec_box))
    assert prepared.ruleset_fd is not None
    prepared.close()


# ---- kept mount namespaces and rulesets (calls of one session reuse them) ----------------


needs_mount_ns = pytest.mark.skipif(
    not sandbox.mount_namespaces(), reason="no private mount namespaces on this kernel"
)


MAX_TRIES = 50


async def joined(b: Box) -> None:
    """Run calls until one joins a kept namespace (a host mount change in between drops
    them all, so on a busy host the first tries may not)."""
    cache = b.executor.spawner.mount_ns
    assert cache is not None
    for _ in range(MAX_TRIES):
        before = cache.hits
        await b.run(["true"])
        if cache.hits > before:
            return
    raise AssertionError(f"no call joined a kept namespace in {MAX_TRIES} tries")


def _fd_target(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@needs_mount_ns
def test_a_call_keeps_its_namespace_when_the_cache_drops_it(exec_box: Box) -> None:
    """A call joins a kept namespace through a descriptor of its own: the cache closes
    its descriptors when the host's mount table changes (or when it drops the least
    recently used), maybe while the call waits for its spawn, and the number is given
    to the next descriptor opened (here /dev/null; in toolsrv, maybe another call's
    namespace). Before, the call held the cache's number (CI: a spare's copy of the
    call's sandbox failed with EBADF under concurrent calls)."""
    b = exec_box
    cache = namespaces.MountNsCache()
    made = sandbox.prepare(DEFAULT, [str(b.cwd)], netns_fd=netns_of(b))
    prepared = sandbox.prepare(DEFAULT, [str(b.cwd)], netns_fd=netns_of(b))
    try:
        assert made.mounts is not None
        key = cache.key(made.mounts, made.ids)
        cache.put(key, os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC), cache.pin(key))
        ns = _MountNs(cache, prepared)
        assert cache.hits == 1 and prepared.mount_ns_fd is not None
        cache.clear()  # what a mount anywhere on the host makes it do
        with open(os.devnull, "rb") as reuse:
            assert _fd_target(prepared.mount_ns_fd).startswith("mnt:"), reuse.fileno()
            copy = prepared.copy()  # (the spare for the next call)
            assert copy.mount_ns_fd is not None
            assert _fd_target(copy.mount_ns_fd).startswith("mnt:")
            copy.close()
        ns.close()
    finally:
        prepared.close()
        made.close()
        cache.close()


@needs_landlock
@needs_mount_ns
def test_a_call_keeps_its_ruleset_when_the_cache_drops_it(exec_box: Box) -> None:
    """The same for a kept Landlock ruleset: a cache of one drops the first ruleset for
    the second, and the call that got the first still holds a ruleset (not a closed
    number, nor /dev/null opened after it)."""
    b = exec_box
    other = b.cwd / "other"
    other.mkdir()
    rulesets = sandbox.RulesetCache(size=1)
    netns = netns_of(b)
    first = sandbox.prepare(DEFAULT, [str(b.cwd)], netns_fd=netns, rulesets=rulesets)
    second = sandbox.prepare(DEFAULT, [str(other)], netns_fd=netns, rulesets=rulesets)
    try:
        assert first.ruleset_fd is not None and first.ruleset_key is not None  # was kept
        with open(os.devnull, "rb"):
            assert "landlock" in _fd_target(first.ruleset_fd)
    finally:
        first.close()
        second.close()
        rulesets.close()


def test_a_spare_that_cannot_be_made_fails_no_call() -> None:
    """Spares only save the next call time: one that cannot be made (here the sandbox
    to enter ahead has a closed descriptor) is logged and left out, and the one it was
    to replace is ended once (before, it stayed the spawner's, and the next call's
    `prestart` ended it again: "release unlocked lock", a call failed)."""
    spawner = Spawner(None)
    closed = os.open(os.devnull, os.O_RDONLY)
    os.close(closed)
    good = sandbox.Prepared(None)
    bad = sandbox.Prepared(None, netns_fd=closed)

    def ahead() -> Spare | None:
        return spawner._ahead

    try:
        spawner.prestart(8, good)
        kept = ahead()
        assert kept is not None and kept.key == good.key()
        spawner.prestart(8, bad)  # raised EBADF
        assert ahead() is None and kept.join(30)
        spawner.prestart(8, bad)  # raised "release unlocked lock"
        spawner.prestart(8, good)
        now = ahead()
        assert now is not None and now.key == good.key()
    finally:
        spawner.close()


@needs_mount_ns
async def test_calls_alike_join_one_kept_namespace(exec_box: Box) -> None:
    """The second call with the same roots joins the namespace the first one made, and is
    confined exactly as the first (the kept namespace is no weaker than a fresh one)."""
    b = exec_box
    targets = [b.cwd / ".git" / "hooks" / "x", b.cwd / "src" / "x", b.outside / "etc" / "x"]
    cache = b.executor.spawner.mount_ns
    assert cache is not None
    # Any mount or unmount on the host (another test's FUSE mount going away) drops the
    # kept namespaces: run until two calls in a row joined one, as they do on a quiet host.
    for _ in range(MAX_TRIES):
        before = cache.hits
        got = outcomes(await b.run(py(WRITER, *map(str, targets))))
        assert got[str(targets[0])] in ("EROFS", "EACCES")
        assert got[str(targets[1])] == "ok"
        assert got[str(targets[2])] in ("EROFS", "EACCES")
        if cache.hits > before:
            break
    assert cache.hits >= 1


@needs_mount_ns
async def test_a_git_replaced_on_the_host_is_protected_in_the_next_call(exec_box: Box) -> None:
    """The host (the user, git itself) replaces .git between two calls: the kept namespace's
    read-only bind was on the old directory (the kernel detaches it), so the next call
    must not join it: the key holds each protected path's identity."""
    b = exec_box
    hook = b.cwd / ".git" / "hooks" / "x"
    assert outcomes(await b.run(py(WRITER, str(hook))))[str(hook)] in ("EROFS", "EACCES")
    shutil.rmtree(b.cwd / ".git")
    (b.cwd / ".git" / "hooks").mkdir(parents=True)
    assert outcomes(await b.run(py(WRITER, str(hook))))[str(hook)] in ("EROFS", "EACCES")
    assert not hook.exists()
    # And a repository that appears deeper down between two calls is protected too.
    sub = b.cwd / "src" / "vendored" / ".git"
    (sub / "hooks").mkdir(parents=True)
    subhook = sub / "hooks" / "x"
    assert outcomes(await b.run(py(WRITER, str(subhook))))[str(subhook)] in ("EROFS", "EACCES")
    assert not subhook.exists()


@needs_mount_ns
async def test_a_root_replaced_on_the_host_gets_a_fresh_sandbox(exec_box: Box) -> None:
    """A write root removed and made again between calls: the kept namespace and ruleset
    hold the old directory, and a call joining them could not write the new one."""
    b = exec_box
    first = b.cwd / "src" / "a"
    assert outcomes(await b.run(py(WRITER, str(first))))[str(first)] == "ok"
    shutil.rmtree(b.cwd)
    (b.cwd / "src").mkdir(parents=True)
    (b.cwd / ".git").mkdir()
    again = b.cwd / "src" / "b"
    assert outcomes(await b.run(py(WRITER, str(again))))[str(again)] == "ok"
    assert again.read_text() == "x"


@needs_mount_ns
async def test_a_host_mount_change_drops_the_kept_namespaces(exec_box: Box) -> None:
    """A mount made on the host after a namespace was kept is seen by the next call (a kept
    copy of the old mount table would not show it)."""
    b = exec_box
    cache = b.executor.spawner.mount_ns
    assert cache is not None
    await joined(b)
    mnt = b.outside / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "none", str(mnt)], check=True)
    try:
        (mnt / "seen").write_text("yes")
        res = await b.run(["cat", str(mnt / "seen")])
        assert res.stdout == b"yes"
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


async def test_the_pipes_give_no_eof_before_the_exit() -> None:
    """The server keeps its copies of the output pipes' write ends (`Watch` ``held``), so
    a tool closing stdout and stderr before it exits (as every program does at exit)
    wakes the pump once, for the exit; the output is complete after `release`."""
    from toolsrv.exec.capture import Watch, exit_fd

    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    code = "import os; os.write(1, b'out'); os.write(2, b'err'); os.close(1); os.close(2)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=out_w, stderr=err_w)
    pidfd = exit_fd(proc.pid)
    watch = Watch(out_r, err_r, None, memoryview(b""), pidfd, 100, held=(out_w, err_w))
    try:
        with trio.fail_after(20):
            await watch.pump(until_exit=True)
        assert watch.exited and set(watch.readers) == {out_r, err_r}  # no EOF seen
        proc.wait()
        watch.release()
        watch.drain()
        assert not watch.readers  # EOF on both, without waiting
        assert (bytes(watch.out.buf), bytes(watch.err.buf)) == (b"out", b"err")
    finally:
        watch.close()
        os.close(pidfd)
        if proc.returncode is None:
            proc.kill()
            proc.wait()


def test_the_executor_keeps_the_process_non_dumpable(executor: Executor) -> None:
    """While an executor can spawn, its process is non-dumpable (see spawn.Spawner), and
    it is dumpable again once the executor is closed (a test process must stay usable)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_get_dumpable = 3
    assert libc.prctl(pr_get_dumpable, 0, 0, 0, 0) == 1
    assert executor.spawner is not None
    assert libc.prctl(pr_get_dumpable, 0, 0, 0, 0) == 0
    executor.close()
    assert libc.prctl(pr_get_dumpable, 0, 0, 0, 0) == 1


class _SlowJoin:
    """A cgroup whose join (by a spare thread, ahead) waits until ``done`` is set: a v1
    join after a pause, which waits for an RCU grace period, made as long as needed."""

    path = "slow"

    def __init__(self) -> None:
        self.done = threading.Event()

    def join_thread(self, version: int) -> None:
        self.done.wait(30)


def test_a_call_takes_a_ready_spare_over_one_still_joining() -> None:
    """A spare made for the next call may still be joining its cgroup when that call
    comes (v1: a join after a pause waits for an RCU grace period, ~8 ms): the call
    takes a plain spare that is ready instead, and the one made for it only once it is
    ready, or when nothing else is."""
    spawner = Spawner(None)
    slow = _SlowJoin()
    joining = Spare(cast(cgroup.Cgroup, slow), version=1)
    try:
        spawner.prestart(8)
        plain = list(spawner._plain)
        assert len(plain) == spawn.PLAIN_SPARES
        assert all(s.wait_ready(30) for s in plain)
        joining.key = ("k",)  # as if it had entered the sandbox ``k`` ahead
        spawner._ahead = joining
        assert not joining.ready
        first = spawner.take_spare(("k",))
        assert first in plain and spawner._ahead is joining
        slow.done.set()
        assert joining.wait_ready(30)
        assert spawner.take_spare(("k",)) is joining
        spawner.return_spare(joining)
        assert spawner._ahead is joining
        spawner.return_spare(first)
        assert first in spawner._plain
    finally:
        slow.done.set()
        if spawner._ahead is not joining:  # (the spawner ends what it keeps)
            joining.run(lambda: None)
        spawner.close()
