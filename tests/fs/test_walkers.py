"""Programs that copy or search a whole tree, run over a session the way users run them:
``cp -r``, ``cp -a``, ``tar``, ``rsync -a``, ``grep -r``. They finish with what the files
hold now, and take nothing away, while followers (``cat stream``, ``statewait``) wait."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import Daemon, script


def _run(daemon: Daemon, *argv: str) -> subprocess.CompletedProcess[str]:
    # A time limit of the child's own: a walker that blocks fails the test, not hangs it.
    return subprocess.run(
        ["timeout", "-s", "KILL", "30", *argv],
        cwd=daemon.path,
        capture_output=True,
        text=True,
        check=False,
    )


def test_walkers_copy_and_search_a_busy_session_and_take_nothing(
    daemon: Daemon, tmp_path: Path
) -> None:
    sid = daemon.new(name="walk")
    daemon.prompt(sid, "first")
    daemon.wait_idle(sid)
    # A turn that hangs, and a prompt queued behind it: fifo.out would give it away.
    daemon.replay.add(script('{"hang": true}'))
    daemon.prompt(sid, "hangs")
    daemon.wait_for(lambda: len(daemon.replay.requests) == 2)
    daemon.prompt(sid, "queued one")
    chat = daemon.read(f"s/{sid}/chat")

    for argv in (
        ("cp", "-r", f"s/{sid}", str(tmp_path / "r")),
        ("cp", "-a", f"s/{sid}", str(tmp_path / "a")),
        ("tar", "cf", str(tmp_path / "s.tar"), f"s/{sid}"),
        ("rsync", "-a", f"s/{sid}/", str(tmp_path / "y")),
    ):
        done = _run(daemon, *argv)
        assert done.returncode == 0, (argv, done.stderr)
    for copy in (tmp_path / "r", tmp_path / "a", tmp_path / "y"):
        assert (copy / "chat").read_text() == chat
        assert (copy / "stream").read_text() == chat
        assert (copy / "statewait").read_text() == ""
        assert (copy / "fifo.out").read_text() == ""
    subprocess.run(["tar", "xf", str(tmp_path / "s.tar"), "-C", str(tmp_path)], check=True)
    assert (tmp_path / "s" / sid / "stream").read_text() == chat

    done = _run(daemon, "grep", "-r", "queued one", f"s/{sid}")
    assert done.returncode == 0, done.stderr
    assert f"s/{sid}/chat:user: queued one" in done.stdout
    assert f"s/{sid}/stream:user: queued one" in done.stdout
    done = _run(daemon, "grep", "-r", "no such text anywhere", ".")
    assert done.returncode == 1, done.stderr

    # Nothing was taken off the queue, and a follower still waits: the queued prompt is
    # there for fifo.out, and statewait answers only when the state changes.
    assert daemon.read(f"s/{sid}/fifo.out") == "queued one\n"
    statewait = str(daemon.p(f"s/{sid}/statewait"))
    with subprocess.Popen(["cat", statewait], stdout=subprocess.PIPE, text=True) as wait:
        try:
            # Opened (its reference state taken) before the state changes.
            fds = Path(f"/proc/{wait.pid}/fd")
            daemon.wait_for(lambda: any(_target(f) == statewait for f in fds.iterdir()))
            daemon.write(f"s/{sid}/ctl", "stop")
            out, _ = wait.communicate(timeout=30)
        finally:
            wait.kill()
    assert out == "idle\n", out


def _target(fd: Path) -> str:
    try:
        return str(fd.readlink())
    except OSError:
        return ""
