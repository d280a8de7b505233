"""The tree behaves as a disk does for the tools people use every day.

mtime moves when a file's content changes, not at every stat (vim, nano and Emacs compare
it before saving; tar and rsync check that files stand still); every directory lists
``.`` and ``..``; listings are sorted; st_nlink counts sub-directories; the reason of
every refused write can be read back (``err``) and is an ``error`` event.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import tarfile
import time

from olliefs.testing import Daemon
from tests.conftest import oserror, script


def test_mtime_changes_with_the_content_only(daemon: Daemon) -> None:
    sid = daemon.new(name="mt")
    made = time.time_ns()  # cfg was written before this: "now at every stat" is later
    cfg = daemon.p(f"s/{sid}/cfg")
    first = os.stat(cfg).st_mtime_ns
    assert first <= made
    assert os.stat(cfg).st_mtime_ns == first
    daemon.write(f"s/{sid}/cfg", "model=other")
    changed = os.stat(cfg).st_mtime_ns
    assert changed > first
    assert os.stat(cfg).st_mtime_ns == changed
    state = os.stat(daemon.p(f"s/{sid}/state")).st_mtime_ns
    assert os.stat(daemon.p(f"s/{sid}/state")).st_mtime_ns == state
    assert os.stat(daemon.p("help")).st_mtime_ns == os.stat(daemon.p("help")).st_mtime_ns


def test_dot_entries_sorted_listings_and_nlink(daemon: Daemon) -> None:
    sid = daemon.new(name="ls")
    out = subprocess.run(["ls", "-af", str(daemon.p(f"s/{sid}"))], capture_output=True, text=True)
    names = out.stdout.split()
    assert names[:2] == [".", ".."]
    assert names[2:] == sorted(names[2:])
    root = subprocess.run(["ls", "-af", str(daemon.path)], capture_output=True, text=True)
    assert root.stdout.split()[:2] == [".", ".."]
    # s/ holds one sub-directory per session; a session dir holds branches/, peer/,
    # compactions/ and t/.
    assert os.stat(daemon.p("s")).st_nlink == 3
    assert os.stat(daemon.p(f"s/{sid}")).st_nlink == 8
    assert os.stat(daemon.p(f"s/{sid}/chat")).st_nlink == 1


def test_tar_and_find_and_du_finish(daemon: Daemon, tmp_path: os.PathLike[str]) -> None:
    sid = daemon.new(name="tr")
    daemon.prompt(sid, "hello")
    daemon.wait_idle(sid)
    dest = os.path.join(tmp_path, "s.tar")
    # tar reads each file up to its size, so the blocking files end too.
    tar = subprocess.run(
        ["tar", "-cf", dest, "-C", str(daemon.p("s")), sid], capture_output=True, timeout=60
    )
    assert tar.returncode == 0, tar.stderr
    with tarfile.open(dest) as t:
        chat = t.extractfile(f"{sid}/chat")
        assert chat is not None and b"user: hello" in chat.read()
    for cmd in (["find", str(daemon.path)], ["du", "-s", str(daemon.path)]):
        assert subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    ls = subprocess.run(["ls", "-laR", str(daemon.path)], capture_output=True, timeout=60)
    assert ls.returncode == 0


def test_vim_saves_cfg_without_a_warning(daemon: Daemon) -> None:
    sid = daemon.new(name="vi")
    cfg = daemon.p(f"s/{sid}/cfg")
    run = subprocess.run(
        ["vim", "-es", "-n", "-c", "%s/^model=.*/model=from-vim/", "-c", "wq", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "model=from-vim\n" in daemon.read(f"s/{sid}/cfg")
    assert "changed" not in run.stdout + run.stderr


def test_refused_writes_say_why(daemon: Daemon) -> None:
    assert oserror(lambda: daemon.write("s/new", "cwd=/no/such/dir")) == errno.EINVAL
    assert "cwd is not an existing directory: /no/such/dir" in daemon.read("err")
    sid = daemon.new(name="why")
    assert oserror(lambda: daemon.write(f"s/{sid}/ctl", "frobnicate")) == errno.EINVAL
    assert "unknown command: frobnicate" in daemon.read(f"s/{sid}/err")
    # O_NONBLOCK at open (FUSE learns the flags then): EAGAIN at the end, not a wait.
    fd = os.open(daemon.p("events"), os.O_RDONLY | os.O_NONBLOCK)
    lines = []
    try:
        while chunk := os.read(fd, 65536):
            lines.append(chunk)
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
    events = [json.loads(x) for x in b"".join(lines).splitlines()]
    reasons = [e["content"] for e in events if e["role"] == "error"]
    assert any("cwd is not an existing directory" in r for r in reasons)
    assert any("unknown command: frobnicate" in r for r in reasons)


def test_plan_is_a_file_that_persists(daemon: Daemon) -> None:
    sid = daemon.new(name="pl")
    daemon.write(f"s/{sid}/plan", "- [ ] one\n- [ ] two\n")
    with open(daemon.p(f"s/{sid}/plan"), "r+b") as f:
        f.seek(3)
        f.write(b"x")
    assert daemon.read(f"s/{sid}/plan") == "- [x] one\n- [ ] two\n"
    daemon.write(f"s/{sid}/plan", "short\n")
    assert daemon.read(f"s/{sid}/plan") == "short\n"
    daemon.stop()
    daemon.start()
    assert daemon.read(f"s/{sid}/plan") == "short\n"


def test_fifo_out_takes_a_queued_prompt(daemon: Daemon) -> None:
    daemon.replay.add(script('{"reply": "x", "hang": true}'))
    sid = daemon.new(name="ff")
    daemon.prompt(sid, "running")
    daemon.wait_for(lambda: len(daemon.replay.requests) == 1)
    daemon.write(f"s/{sid}/fifo.in", "queued one")
    assert daemon.read(f"s/{sid}/fifo.out") == "queued one\n"
    daemon.write(f"s/{sid}/ctl", "stop")
    daemon.wait_idle(sid)
    assert len(daemon.replay.requests) == 1  # the taken prompt never ran


def test_utimes_of_a_read_only_file_is_refused(daemon: Daemon) -> None:
    """As ollie(5) says: chmod and utimes of a read-only or generated file fail with
    EPERM (``utime`` on chat used to succeed and change nothing). Every read-only file
    of the root, of a session that ran a turn and of t/ is tried; the writable synthetic
    files have no times of their own and take a touch as a no-op."""
    sid = daemon.new(name="ut")
    daemon.prompt(sid, "hello")
    daemon.wait_idle(sid)
    files = [f"s/{sid}/{name}" for name in os.listdir(daemon.p(f"s/{sid}"))]
    files += [*os.listdir(daemon.p(".")), "s/idx", "t/idx"]
    tried = []
    for rel in files:
        path = daemon.p(rel)
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            continue
        if st.st_mode & 0o222:
            assert oserror(os.utime, path) == 0, rel
            continue
        tried.append(rel)
        assert oserror(os.utime, path) == errno.EPERM, rel
        assert oserror(os.utime, path, (1, 1)) == errno.EPERM, rel
        assert os.stat(path).st_mtime_ns == st.st_mtime_ns, rel
    assert {f"s/{sid}/chat", f"s/{sid}/stream", f"s/{sid}/events", "events", "t/idx"} <= set(tried)
    assert len(tried) > 20
