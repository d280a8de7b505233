"""The ``ollie`` command as a user runs it: daemonized mount, status, umount, clear errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from olliefs.replay import ReplayServer
from olliefs.testing import HAVE_FUSE

pytestmark = pytest.mark.skipif(not HAVE_FUSE, reason="needs /dev/fuse (mounts for real)")


class Cli:
    def __init__(self, base: Path, replay: ReplayServer) -> None:
        self.home = base / "home"
        self.mnt = base / "mnt"
        self.mnt.mkdir()
        self.env = {
            **os.environ,
            "OLLIE_HOME": str(self.home),
            "OLLIE_OPENAI_URL": replay.url,
            "OLLIE_MODEL": "replay",
        }

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "olliefs", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )

    def daemon_pid(self) -> int:
        return int((self.home / "run" / "ollie.pid").read_text().split()[0])


@pytest.fixture
def cli(tmp_path: Path, replay: ReplayServer) -> Iterator[Cli]:
    c = Cli(tmp_path, replay)
    yield c
    c.run("umount")
    subprocess.run(["fusermount3", "-uz", str(c.mnt)], capture_output=True, check=False)


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
    assert tcp.returncode == 1 and "only unix:PATH" in tcp.stderr


def test_stale_mount_of_a_killed_daemon_is_cleared(cli: Cli) -> None:
    assert cli.run("mount", str(cli.mnt)).returncode == 0
    os.kill(cli.daemon_pid(), signal.SIGKILL)
    deadline = time.monotonic() + 20
    while True:
        try:
            os.stat(cli.mnt)
        except OSError:
            break  # ENOTCONN: the mount is dead
        assert time.monotonic() < deadline
        time.sleep(0.02)
    r = cli.run("mount", str(cli.mnt))
    assert r.returncode == 0, r.stderr
    assert f"ollie: cleared a stale mount left at {cli.mnt} by a dead daemon" in r.stderr
    assert "s" in os.listdir(cli.mnt)


def test_sigterm_unmounts_cleanly(cli: Cli) -> None:
    assert cli.run("mount", str(cli.mnt)).returncode == 0
    pid = cli.daemon_pid()
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while os.path.exists(cli.home / "run" / "ollie.pid"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert os.listdir(cli.mnt) == []
