"""The ``ollie`` command as a user runs it: daemonized mount, status, umount, doctor, the
mount(8) helper, the systemd unit, the bash completion; clear errors."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyfuse3
import pytest
from landlock.plumbing import landlock_abi_version

from olliefs import memory
from olliefs.cli import parser
from olliefs.replay import ReplayServer
from olliefs.settings import shipped_dir
from olliefs.testing import HAVE_FUSE, wait_until

from .test_huge_pages import environ, heap_flags

pytestmark = pytest.mark.skipif(not HAVE_FUSE, reason="needs /dev/fuse (mounts for real)")


OLLIE = str(Path(sys.executable).parent / "ollie")


class Cli:
    """``ollie`` run as a user runs it, on a private home; ``name`` tells homes apart."""

    def __init__(self, base: Path, replay: ReplayServer, name: str = "") -> None:
        self.home = base / f"home{name}"
        self.mnt = base / f"mnt{name}"
        self.mnt.mkdir()
        self.env = {
            **os.environ,
            "OLLIE_HOME": str(self.home),
            # the default mount point: never a real ~/ollie of this machine
            "OLLIE": str(self.mnt),
            "OLLIE_OPENAI_URL": replay.url,
            "OLLIE_MODEL": "replay",
        }

    def run(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "olliefs", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
        )

    def daemon_pid(self) -> int:
        return int((self.home / "run" / "ollie.pid").read_text().split()[0])

    def cleanup(self) -> None:
        self.run("umount", str(self.mnt))
        subprocess.run(["fusermount3", "-uz", str(self.mnt)], capture_output=True, check=False)


@pytest.fixture
def cli(tmp_path: Path, replay: ReplayServer) -> Iterator[Cli]:
    c = Cli(tmp_path, replay)
    yield c
    c.cleanup()


def wait_exit(pid: int) -> None:
    """Until the process ``pid`` has ended (it need not be our child): a pidfd poll."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        p = select.poll()
        p.register(fd, select.POLLIN)
        assert p.poll(30_000), f"pid {pid} still runs"
    finally:
        os.close(fd)


def kill_daemon(c: Cli) -> int:
    """SIGKILL the daemon and return once it is gone: its mount is then dead (ENOTCONN),
    as the kernel aborts a FUSE connection when the daemon's /dev/fuse is closed."""
    pid = c.daemon_pid()
    os.kill(pid, signal.SIGKILL)
    wait_exit(pid)
    with pytest.raises(OSError) as err:
        os.listdir(c.mnt)
    assert err.value.errno == errno.ENOTCONN
    return pid


def olliefs_mounted(point: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(f" {point} " in line and " - fuse.olliefs " in line for line in f)


def test_mount_returns_when_usable_and_umount_stops(cli: Cli) -> None:
    r = cli.run("mount", str(cli.mnt))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"mounted at {cli.mnt}")
    # usable at once: no waiting after the command returned
    assert {"backends", "events", "help", "s", "t"} <= set(os.listdir(cli.mnt))
    with open(cli.mnt / "s" / "new", "r+") as f:
        f.write(f"name=x cwd={cli.mnt.parent}")
        f.flush()
        f.seek(0)
        assert f.read() == "x\n"
    st = cli.run("status")
    assert st.returncode == 0 and str(cli.mnt) in st.stdout and "1 sessions" in st.stdout
    again = cli.run("mount", str(cli.mnt))
    assert again.returncode == 1
    assert again.stderr.startswith("ollie: already mounted at")
    assert len(again.stderr.splitlines()) == 1
    pid = cli.daemon_pid()
    u = cli.run("umount")
    assert u.returncode == 0, u.stderr
    assert pid > 0
    assert os.listdir(cli.mnt) == []
    assert cli.run("status").returncode == 1


def test_mount_errors_are_one_clear_line(cli: Cli, tmp_path: Path) -> None:
    missing = cli.run("mount", str(tmp_path / "nope"))
    assert missing.returncode == 1
    assert missing.stderr == f"ollie: mount point does not exist: {tmp_path / 'nope'}\n"
    full = tmp_path / "full"
    full.mkdir()
    (full / "file").write_text("x")
    busy = cli.run("mount", str(full))
    assert busy.returncode == 1
    assert busy.stderr == f"ollie: mount point is not empty: {full}\n"
    not_dir = tmp_path / "plain"
    not_dir.write_text("")
    r = cli.run("mount", str(not_dir))
    assert r.returncode == 1 and "not a directory" in r.stderr
    assert cli.run("umount").stderr == "ollie: not mounted\n"
    nokey = cli.run("mount", "--toolsrv", "unix:/x.sock", str(cli.mnt))
    assert nokey.returncode == 1 and "--toolsrv needs --toolsrv-key-file" in nokey.stderr
    tcp = cli.run("mount", "--toolsrv", "tcp:1.2.3.4:5", "--toolsrv-key-file", "k", str(cli.mnt))
    assert tcp.returncode == 1 and "unix:PATH, local or ssh:" in tcp.stderr


def dead(mnt: Path) -> bool:
    """The mount answers no more (ENOTCONN: its daemon is gone). statfs, not stat: the
    kernel answers a stat of the root from its attribute cache for a while after the
    daemon died, a statfs always asks."""
    try:
        os.statvfs(mnt)
    except OSError:
        return True
    return False


def test_stale_mount_of_a_killed_daemon_is_cleared(cli: Cli) -> None:
    assert cli.run("mount", str(cli.mnt)).returncode == 0
    pid = cli.daemon_pid()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: dead(cli.mnt), "a dead mount (ENOTCONN)", 20, exits=[pid])
    r = cli.run("mount", str(cli.mnt))
    assert r.returncode == 0, r.stderr
    assert f"ollie: cleared a stale mount left at {cli.mnt} by a dead daemon" in r.stderr
    assert "s" in os.listdir(cli.mnt)


def test_sigterm_unmounts_cleanly(cli: Cli) -> None:
    assert cli.run("mount", str(cli.mnt)).returncode == 0
    pid = cli.daemon_pid()
    pid_file = cli.home / "run" / "ollie.pid"
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not pid_file.exists(), "the pid file removed", 20, files=[pid_file])
    assert os.listdir(cli.mnt) == []


# ---- umount and status of a named mount point ---------------------------------------------


def test_umount_ends_the_mount_it_names(tmp_path: Path, replay: ReplayServer, cli: Cli) -> None:
    """Two daemons of two homes; ``umount`` of the second's mount point, run with the
    first's home, ends the second and leaves the first mounted."""
    other = Cli(tmp_path, replay, "2")
    try:
        assert cli.run("mount", str(cli.mnt)).returncode == 0
        assert other.run("mount", str(other.mnt)).returncode == 0
        mine, theirs = cli.daemon_pid(), other.daemon_pid()
        # named relative to the caller's cwd, with a trailing slash
        u = cli.run("umount", "mnt2/", cwd=tmp_path)
        assert u.returncode == 0, u.stderr
        assert u.stdout == f"unmounted {other.mnt}\n"
        wait_exit(theirs)
        assert not olliefs_mounted(other.mnt) and os.listdir(other.mnt) == []
        assert olliefs_mounted(cli.mnt) and "s" in os.listdir(cli.mnt)
        assert cli.daemon_pid() == mine
        again = cli.run("umount", str(other.mnt))
        assert (again.returncode, again.stderr) == (1, f"ollie: not mounted: {other.mnt}\n")
        proc = cli.run("umount", "/proc")
        assert (proc.returncode, proc.stderr) == (1, "ollie: not an olliefs mount: /proc (proc)\n")
        # without a mount point: this home's daemon, as before
        assert cli.run("umount").returncode == 0
        wait_exit(mine)
        assert not olliefs_mounted(cli.mnt)
    finally:
        other.cleanup()


def test_umount_without_a_name_leaves_another_homes_mount(
    tmp_path: Path, replay: ReplayServer, cli: Cli
) -> None:
    other = Cli(tmp_path, replay, "2")
    try:
        assert other.run("mount", str(other.mnt)).returncode == 0
        cli.env["OLLIE"] = str(other.mnt)  # the default mount point is the other's mount
        r = cli.run("umount")
        assert r.returncode == 1
        assert r.stderr.startswith("ollie: not mounted by this state dir")
        assert olliefs_mounted(other.mnt) and "s" in os.listdir(other.mnt)
    finally:
        other.cleanup()


def test_status_tells_live_dead_and_absent_apart(
    tmp_path: Path, replay: ReplayServer, cli: Cli
) -> None:
    stranger = Cli(tmp_path, replay, "2")  # another home: it sees the mount all the same
    r = cli.run("status", str(cli.mnt))
    assert (r.returncode, r.stdout) == (1, f"not mounted: {cli.mnt}\n")
    assert cli.run("mount", str(cli.mnt)).returncode == 0
    with open(cli.mnt / "s" / "new", "w") as f:
        f.write(f"name=a cwd={tmp_path}")
    pid = cli.daemon_pid()
    live = f"mounted at {cli.mnt} (daemon pid {pid}), 1 sessions, state in {cli.home / 'state'}\n"
    for who in (cli, stranger):
        r = who.run("status", str(cli.mnt))
        assert (r.returncode, r.stdout) == (0, live)
    r = cli.run("status")
    assert (r.returncode, r.stdout) == (0, live)

    kill_daemon(cli)
    dead = (
        f"dead mount at {cli.mnt}: its daemon is gone (ENOTCONN);"
        f" `ollie umount {cli.mnt}` clears it\n"
    )
    for args in (("status", str(cli.mnt)), ("status",)):
        r = cli.run(*args)
        assert (r.returncode, r.stdout) == (2, dead)
    r = stranger.run("status", str(cli.mnt))
    assert (r.returncode, r.stdout) == (2, dead)
    r = stranger.run("status")  # its own home has nothing to do with it
    # (then every live olliefs mount of this machine, the dead one not among them)
    assert (r.returncode, r.stdout.split("\n")[0]) == (1, "not mounted")
    assert str(cli.mnt) not in r.stdout

    doc = cli.run("doctor")
    stale = [line for line in doc.stdout.splitlines() if line.startswith("FAIL stale mounts:")]
    assert len(stale) == 1 and str(cli.mnt) in stale[0], doc.stdout
    assert "-> fix: " in stale[0] and f"ollie umount {cli.mnt}" in stale[0]
    assert doc.returncode == 1

    u = stranger.run("umount", str(cli.mnt))
    assert u.returncode == 0, u.stderr
    assert u.stderr == f"ollie: no daemon; cleared the dead mount at {cli.mnt}\n"
    assert not olliefs_mounted(cli.mnt)
    r = cli.run("status", str(cli.mnt))
    assert (r.returncode, r.stdout) == (1, f"not mounted: {cli.mnt}\n")
    r = cli.run("status", "/proc")
    assert (r.returncode, r.stdout) == (1, "not an olliefs mount: /proc (proc)\n")


def test_mount_and_status_say_the_9p_exports_and_other_homes_mounts(
    tmp_path: Path, replay: ReplayServer, cli: Cli
) -> None:
    """A 9P export's TCP port (0: the kernel picks) is printed by ``ollie mount`` and
    listed by ``ollie status``; ``ollie status`` of another home names this mount."""
    r = cli.run("mount", "--9p", "tcp:127.0.0.1:0", str(cli.mnt))
    assert r.returncode == 0, r.stderr
    exports = [line for line in r.stdout.splitlines() if line.startswith("9P export on ")]
    assert len(exports) == 1 and exports[0].startswith("9P export on tcp:127.0.0.1:")
    port = int(exports[0].rsplit(":", 1)[1])
    assert port > 0
    with socket.create_connection(("127.0.0.1", port), timeout=10):
        pass  # it listens there
    for args in (("status",), ("status", str(cli.mnt))):
        r = cli.run(*args)
        assert r.returncode == 0 and exports[0] in r.stdout.splitlines(), r.stdout
    other = Cli(tmp_path, replay, "2")
    r = other.run("status")
    assert r.returncode == 1
    assert f"other olliefs mount: {cli.mnt} (daemon pid {cli.daemon_pid()}" in r.stdout


def test_umount_without_a_name_clears_this_homes_dead_mount(cli: Cli) -> None:
    assert cli.run("mount", str(cli.mnt)).returncode == 0
    kill_daemon(cli)
    u = cli.run("umount")
    assert u.returncode == 0, u.stderr
    assert "cleared the dead mount" in u.stderr
    assert not olliefs_mounted(cli.mnt)


# ---- doctor ----------------------------------------------------------------------------

CHECKS = [
    "/dev/fuse",
    "fusermount3",
    "landlock",
    "pyfuse3",
    "runtime dir",
    "state dir",
    "config dir",
    "data dir",
    "stale mounts",
    "overrides",
    "backend",
]
LINE = re.compile(r"^(?:ok   (?P<ok>[^:]+): .+|FAIL (?P<fail>[^:]+): .+ -> fix: .+)$")


def doctor(c: Cli) -> tuple[int, dict[str, str]]:
    """(exit status, check -> its whole line), every line checked for its form."""
    r = c.run("doctor")
    assert r.stderr == ""
    lines: dict[str, str] = {}
    for line in r.stdout.splitlines():
        m = LINE.match(line)
        assert m, f"not a doctor line: {line!r}"
        lines[m.group("ok") or m.group("fail")] = line
    assert list(lines) == CHECKS
    failed = any(line.startswith("FAIL") for line in lines.values())
    assert r.returncode == (1 if failed else 0)
    return r.returncode, lines


def test_doctor_on_this_machine(cli: Cli, tmp_path: Path) -> None:
    assert cli.run("mount", str(cli.mnt)).returncode == 0
    _, lines = doctor(cli)
    assert lines["/dev/fuse"].startswith("ok   /dev/fuse: character device 10,229")
    fusermount = shutil.which("fusermount3")
    assert lines["fusermount3"].startswith(f"ok   fusermount3: {fusermount}")
    # The landlock package's own syscall wrapper; it takes a non-zero ctypes errno left by
    # any earlier ctypes call of this thread for its own failure (toolsrv.sandbox._ll).
    ctypes.set_errno(0)
    abi = landlock_abi_version()
    assert lines["landlock"].startswith(f"ok   landlock: ABI {abi} (filesystem rules")
    patched = hasattr(pyfuse3, "current_request")
    assert lines["pyfuse3"].startswith("ok   pyfuse3:" if patched else "FAIL pyfuse3:")
    for check, sub in (("runtime dir", "run"), ("state dir", "state"), ("data dir", "data")):
        assert lines[check] == f"ok   {check}: {cli.home / sub} is 0700, yours"
    # our own mount is live; other tests on this machine may leave theirs
    assert f"{cli.mnt} (daemon pid {cli.daemon_pid()})" in lines["stale mounts"]
    assert re.match(
        r"ok   backend: openai: http://127\.0\.0\.1:\d+/v1/models answers "
        r"\(HTTP 200, 1 models\)$",
        lines["backend"],
    ), lines["backend"]

    # nothing shipped is copied into the config dir: no override
    assert lines["overrides"].startswith("ok   overrides: none")
    config = cli.home / "config"
    (config / "agents").mkdir(exist_ok=True)
    shutil.copy(shipped_dir() / "profiles" / "default.json", config / "agents")
    (config / "sandbox").mkdir(exist_ok=True)
    (config / "sandbox" / "default.toml").write_text("# mine\n")
    (config / "agents" / "mine.json").write_text("{}")  # not a shipped name
    _, lines = doctor(cli)
    assert lines["overrides"] == (
        f"ok   overrides: 2 in {config}: agents/default.json (identical to the shipped file:"
        " remove it to follow upgrades), sandbox/default.toml"
    )


def test_doctor_says_what_fails_and_how_to_fix_it(
    cli: Cli, tmp_path: Path, replay: ReplayServer
) -> None:
    run = cli.home / "run"
    run.mkdir(parents=True, mode=0o700)
    (cli.home / "state").mkdir(mode=0o700)
    os.chmod(run, 0o755)
    # a port that is bound but not listening: connections are refused at once
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        cli.env["OLLIE_OPENAI_URL"] = f"http://127.0.0.1:{port}"
        code, lines = doctor(cli)
    assert code == 1
    assert lines["runtime dir"] == (
        f"FAIL runtime dir: {run} is 0755: others can look in -> fix: chmod 0700 {run}"
    )
    assert lines["backend"].startswith(
        f"FAIL backend: openai: http://127.0.0.1:{port}/v1/models cannot be reached ("
    )
    assert lines["backend"].endswith(
        "-> fix: check OLLIE_OPENAI_URL and that the server runs and is reachable from here"
    )
    os.chmod(run, 0o700)
    os.chown(cli.home / "state", 65534, 65534)
    with ReplayServer(key="sk-right") as locked:
        cli.env["OLLIE_OPENAI_URL"] = locked.url
        _, lines = doctor(cli)
        assert lines["runtime dir"].startswith("ok   runtime dir:")
        assert lines["state dir"].startswith(
            f"FAIL state dir: {cli.home / 'state'} belongs to uid 65534, not to you"
        )
        assert lines["backend"] == (
            f"FAIL backend: openai: {locked.url}/models answers HTTP 401: the key is missing"
            " -> fix: set OLLIE_OPENAI_KEY or OPENAI_API_KEY (environment or the config env file)"
        )
        cli.env["OLLIE_OPENAI_KEY"] = "sk-wrong"
        _, lines = doctor(cli)
        assert "answers HTTP 401: the key is refused" in lines["backend"]
        cli.env["OLLIE_OPENAI_KEY"] = "sk-right"
        _, lines = doctor(cli)
        assert lines["backend"].startswith("ok   backend: openai:")
        assert "sk-right" not in "".join(lines.values())
    cli.env["OLLIE_BACKEND"] = "nope"
    _, lines = doctor(cli)
    assert lines["backend"].startswith("FAIL backend: OLLIE_BACKEND=nope is not a backend")


def test_doctor_backend_urls() -> None:
    """Which URL is probed for each backend (pure: settings in, URL out)."""
    from olliefs.doctor import probe_for, shown

    def url(backend: str, **settings: str) -> str | None:
        probe = probe_for(backend, settings)
        return probe.url if probe else None

    assert url("openai") == "https://api.openai.com/v1/models"
    assert url("openai", OLLIE_OPENAI_URL="http://h:1") == "http://h:1/v1/models"
    assert url("openai", OLLIE_OPENAI_URL="http://h:1/v1/") == "http://h:1/v1/models"
    assert url("openai", OLLIE_OPENAI_URL="https://openrouter.ai/api/v1") == (
        "https://openrouter.ai/api/v1/models"
    )
    assert url("anthropic") == "https://api.anthropic.com/v1/models"
    assert url("ollama") == "http://localhost:11434/api/tags"
    assert url("ollama", OLLIE_OLLAMA_URL="http://box:11434/") == "http://box:11434/api/tags"
    assert url("gemini") == "https://generativelanguage.googleapis.com/v1beta/models"
    assert url("mystery") is None
    assert url("mystery", OLLIE_MYSTERY_URL="http://m/x") == "http://m/x/models"
    probe = probe_for("anthropic", {"ANTHROPIC_API_KEY": "k"})
    assert probe is not None and probe.headers["x-api-key"] == "k"
    probe = probe_for("openai", {"OLLIE_OPENAI_KEY": "a", "OPENAI_API_KEY": "b"})
    assert probe is not None and probe.headers == {"Authorization": "Bearer a"}
    assert shown("http://user:secret@h:8/v1") == "http://h:8/v1"


# ---- install-helpers, the mount(8) helper, the systemd unit, the completion -------------


def test_install_helpers(tmp_path: Path) -> None:
    prefix, sbin = tmp_path / "usr", tmp_path / "sbin"
    r = subprocess.run(
        [OLLIE, "install-helpers", "--prefix", str(prefix), "--sbindir", str(sbin)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    helper = sbin / "mount.fuse.ollie"
    assert stat.S_IMODE(helper.stat().st_mode) == 0o755
    assert f': "${{OLLIE_BIN:={OLLIE}}}"' in helper.read_text().splitlines()
    unit = prefix / "lib/systemd/user/ollie.service"
    assert f"ExecStart={OLLIE} mount -f" in unit.read_text().splitlines()
    assert (prefix / "share/bash-completion/completions/ollie").is_file()
    for page in ("man1/ollie.1", "man5/ollie.5", "man8/toolsrv.8", "man1/ollie-replay.1"):
        assert (prefix / "share/man" / page).is_file(), page
    assert f"installed {helper}\n" in r.stdout

    home = tmp_path / "me"
    env = {**os.environ, "HOME": str(home)}
    env.pop("XDG_DATA_HOME", None)
    env.pop("XDG_CONFIG_HOME", None)
    r = subprocess.run(
        [OLLIE, "install-helpers", "--user"], capture_output=True, text=True, env=env, check=False
    )
    assert r.returncode == 0, r.stderr
    assert (home / ".config/systemd/user/ollie.service").is_file()
    assert (home / ".local/share/bash-completion/completions/ollie").is_file()
    assert (home / ".local/share/man/man5/ollie.5").is_file()
    assert "mount.fuse.ollie" not in r.stdout  # /sbin is root's
    # ~/.local/bin is not on this PATH, so man(1) does not look in ~/.local/share/man:
    # the unit names the pages by path, and the user is told the one line that makes
    # `man ollie` work, which then does.
    man = home / ".local/share/man"
    text = (home / ".config/systemd/user/ollie.service").read_text()
    assert f"Documentation=file://{man}/man1/ollie.1 file://{man}/man5/ollie.5" in text
    assert f'export MANPATH="{man}:"' in r.stdout
    r = subprocess.run(
        ["man", "-w", "ollie"], env={**env, "MANPATH": f"{man}:"}, capture_output=True, text=True
    )
    assert r.stdout.strip() == str(man / "man1/ollie.1"), r
    runtime = tmp_path / "xdg-runtime"
    runtime.mkdir(mode=0o700)
    r = subprocess.run(
        ["systemd-analyze", "--user", "verify", str(home / ".config/systemd/user/ollie.service")],
        capture_output=True,
        text=True,
        env={**env, "XDG_RUNTIME_DIR": str(runtime)},
        check=False,
    )
    assert (r.returncode, r.stderr) == (0, ""), r


def test_systemd_unit_syntax(tmp_path: Path) -> None:
    """Where systemd-analyze is missing this is the check: sections and keys of the unit
    as installed, and a command that exists (systemd needs an absolute path to run)."""
    prefix = tmp_path / "usr"
    subprocess.run(
        [OLLIE, "install-helpers", "--prefix", str(prefix), "--sbindir", str(tmp_path)],
        capture_output=True,
        check=True,
    )
    known = {
        "Unit": {"Description", "Documentation"},
        "Service": {
            "Type",
            "NotifyAccess",
            "Environment",
            "ExecStart",
            "KillMode",
            "TimeoutStopSec",
            "Restart",
            "RestartSec",
        },
        "Install": {"WantedBy"},
    }
    section = ""
    seen: dict[str, str] = {}
    for line in (prefix / "lib/systemd/user/ollie.service").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        if m := re.fullmatch(r"\[(\w+)\]", line):
            section = m.group(1)
            assert section in known, line
            continue
        key, sep, value = line.partition("=")
        assert sep and key in known[section], line
        seen[key] = value
    assert seen["Type"] == "notify" and seen["WantedBy"] == "default.target"
    command = seen["ExecStart"].split()
    assert command[1:] == ["mount", "-f"] and os.path.isabs(command[0])
    assert os.access(command[0], os.X_OK)


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)
def test_systemd_unit_verifies(tmp_path: Path) -> None:
    """``systemd-analyze verify`` of the installed unit: directives, the ExecStart binary,
    and the Documentation= man pages (found through the installed man tree). systemd
    itself does not run here, so the unit's start and stop are tested through what it
    runs: ``ollie mount -f`` and its READY=1 (test_foreground_mount_notifies_systemd)."""
    prefix = tmp_path / "usr"
    subprocess.run(
        [OLLIE, "install-helpers", "--prefix", str(prefix), "--sbindir", str(tmp_path)],
        capture_output=True,
        check=True,
    )
    runtime = tmp_path / "xdg-runtime"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "MANPATH": str(prefix / "share/man")}
    unit = prefix / "lib/systemd/user/ollie.service"
    r = subprocess.run(
        ["systemd-analyze", "--user", "verify", str(unit)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    # and it does catch a broken unit
    broken = tmp_path / "broken" / "ollie.service"
    broken.parent.mkdir()
    broken.write_text(unit.read_text().replace("Type=notify", "Type=notfy"))
    r = subprocess.run(
        ["systemd-analyze", "--user", "verify", str(broken)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert "Failed to parse service type" in r.stderr


def test_foreground_mount_notifies_systemd(cli: Cli, tmp_path: Path) -> None:
    """What ollie.service (Type=notify) relies on: READY=1 on $NOTIFY_SOCKET once the tree
    answers, and SIGTERM (systemctl stop) unmounting."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(tmp_path / "notify"))
        sock.settimeout(60)
        env = {**cli.env, "NOTIFY_SOCKET": str(tmp_path / "notify")}
        proc = subprocess.Popen(
            [OLLIE, "mount", "-f", str(cli.mnt)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            message = sock.recv(4096).decode()
            assert message == f"READY=1\nSTATUS=mounted at {cli.mnt}\n"
            assert "s" in os.listdir(cli.mnt)  # usable when READY=1 arrives
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
    assert not olliefs_mounted(cli.mnt)


@pytest.fixture
def mount_helper(tmp_path: Path) -> Iterator[str]:
    """The helper installed in /sbin, where mount(8) looks for it, under a type name of
    this test's own (fuse.ollie-<random>): a real /sbin/mount.fuse.ollie is left alone,
    and tests running side by side do not meet."""
    if os.geteuid() != 0 or not os.access("/sbin", os.W_OK):
        pytest.skip(reason="installing a mount(8) helper needs root and a writable /sbin")
    fstype = f"ollie-t{uuid.uuid4().hex[:8]}"
    subprocess.run(
        [OLLIE, "install-helpers", "--prefix", str(tmp_path / "usr"), "--sbindir", str(tmp_path)],
        capture_output=True,
        check=True,
    )
    dest = Path(f"/sbin/mount.fuse.{fstype}")
    shutil.copy2(tmp_path / "mount.fuse.ollie", dest)
    try:
        yield f"fuse.{fstype}"
    finally:
        dest.unlink()


def test_mount_helper_with_mount8(cli: Cli, tmp_path: Path, mount_helper: str) -> None:
    def mount(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["mount", *args], env=cli.env, capture_output=True, text=True, timeout=60, check=False
        )

    def umount() -> None:
        pid = cli.daemon_pid()
        r = subprocess.run(["umount", str(cli.mnt)], capture_output=True, text=True, check=False)
        assert r.returncode == 0, r.stderr
        wait_exit(pid)  # the daemon ends when its mount goes
        assert not olliefs_mounted(cli.mnt)

    home = tmp_path / "helper-home"
    r = mount("-t", mount_helper, "none", str(cli.mnt), "-o", f"home={home}")
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    assert "s" in os.listdir(cli.mnt)  # usable when mount(8) returns
    st = cli.run("status", str(cli.mnt))
    assert st.returncode == 0 and f"state in {home / 'state'}" in st.stdout
    cli.home = home
    umount()

    # the documented fstab line, through an fstab of this test's own (mount -T)
    fstab = tmp_path / "fstab"
    fstab.write_text(f"none {cli.mnt} {mount_helper} noauto,user,home={home},nofail 0 0\n")
    r = mount("-T", str(fstab), str(cli.mnt))
    assert r.returncode == 0, r.stderr
    assert "s" in os.listdir(cli.mnt)
    umount()

    for opts, why in (
        ("allow_other", "allow_other refused"),
        ("ro", "ro refused"),
        ("bogus=1", "unknown option: bogus=1"),
    ):
        r = mount("-t", mount_helper, "none", str(cli.mnt), "-o", f"home={home},{opts}")
        assert r.returncode != 0 and why in r.stderr, r.stderr
        assert not olliefs_mounted(cli.mnt)
    r = mount("-f", "-t", mount_helper, "none", str(cli.mnt), "-o", f"home={home}")
    assert r.returncode == 0 and not olliefs_mounted(cli.mnt)  # -f: fake


COMPLETION = Path(__file__).parents[2] / "mount_helpers" / "ollie.bash"


def complete(*words: str) -> list[str]:
    """What bash offers for the command line ``words`` (the last one being completed)."""
    script = f"""
        source {COMPLETION}
        compopt() {{ :; }}   # only valid while bash itself completes
        COMP_WORDS=({" ".join(_quote(w) for w in words)})
        COMP_CWORD={len(words) - 1}
        _ollie
        printf '%s\\n' "${{COMPREPLY[@]}}"
    """
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert r.stderr == ""
    return [line for line in r.stdout.splitlines() if line]


def _quote(word: str) -> str:
    return "'" + word.replace("'", "'\\''") + "'"


def test_bash_completion_registers() -> None:
    r = subprocess.run(
        ["bash", "-c", f"source {COMPLETION}; complete -p ollie"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert r.stdout == "complete -F _ollie ollie\n"


def test_bash_completion_offers_what_the_parser_takes() -> None:
    """Subcommands and every flag of each, compared with the argparse parser itself."""
    ap = parser()
    sub = next(a for a in ap._actions if a.choices and isinstance(a.choices, dict))
    assert isinstance(sub.choices, dict)
    assert set(complete(OLLIE, "")) == set(sub.choices) | {"-h", "--help"}
    assert complete(OLLIE, "st") == ["status"]
    for name, subparser in sub.choices.items():
        if name == "replay-server":
            continue
        flags = {
            flag
            for action in subparser._actions
            if action.help != "==SUPPRESS=="
            for flag in action.option_strings
        }
        assert set(complete(OLLIE, name, "-")) == flags, name
    assert complete(OLLIE, "mount", "--toolsrv", "") == ["unix:"]
    assert "ollie.5" in complete(OLLIE, "man", "")


def test_bash_completion_of_replay_server_flags() -> None:
    offered = complete(OLLIE, "replay-server", "--")
    assert {"--script", "--port-file", "--help"} <= set(offered)


def test_bash_completion_of_mount_points(cli: Cli, tmp_path: Path) -> None:
    (tmp_path / "with space").mkdir()
    assert complete(OLLIE, "mount", str(tmp_path / "with")) == [str(tmp_path / "with space")]
    assert cli.run("mount", str(cli.mnt)).returncode == 0
    for cmd in ("umount", "status"):
        assert complete(OLLIE, cmd, str(cli.mnt)[:-1]) == [str(cli.mnt)]
    # not an olliefs mount: directories then
    assert complete(OLLIE, "umount", str(tmp_path / "with")) == [str(tmp_path / "with space")]


def test_man_command_finds_the_installed_pages() -> None:
    r = subprocess.run([OLLIE, "man", "--path", "5"], capture_output=True, text=True, check=True)
    page = Path(r.stdout.strip())
    assert page.name == "ollie.5" and page.is_file()
    for name, file in (("ollie", "ollie.1"), ("1", "ollie.1"), ("toolsrv", "toolsrv.8")):
        r = subprocess.run([OLLIE, "man", "--path", name], capture_output=True, text=True)
        assert Path(r.stdout.strip()).name == file
    r = subprocess.run([OLLIE, "man", "nope"], capture_output=True, text=True, check=False)
    assert r.returncode == 1 and r.stderr.startswith("ollie: no man page 'nope'")


def test_background_daemon_heap_has_huge_pages(cli: Cli) -> None:
    """The daemon child gets glibc's huge page tunable from ``ollie mount`` (see
    tests/e2e/test_huge_pages.py for the foreground daemon and the environment)."""
    r = cli.run("mount", str(cli.mnt))
    assert r.returncode == 0, r.stderr
    pid = cli.daemon_pid()
    assert ("hg" in heap_flags(pid)) == memory._thp_usable()
    assert "OLLIE_GLIBC_TUNABLES_WAS" in environ(pid)  # started with it, by its parent
