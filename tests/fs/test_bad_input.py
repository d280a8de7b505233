"""Bad input gets a clear errno at write(2), an ``error:`` line, and changes nothing.

Shells ignore errors from close(), so a refusal that only close() reports is lost on them:
these tests write the way a shell does (one write, then close) and look at both the
errno and what the session shows.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess

import pytest

from olliefs.testing import Daemon


def write_errno(path: os.PathLike[str], *chunks: bytes) -> int:
    """Write each chunk with its own write(2); the errno of the first refused, else 0."""
    fd = os.open(path, os.O_WRONLY)
    try:
        for chunk in chunks:
            try:
                os.write(fd, chunk)
            except OSError as err:
                return err.errno or -1
    finally:
        try:
            os.close(fd)
        except OSError as err:
            return -(err.errno or 1)  # refused only at close: what a shell never sees
    return 0


def test_invalid_utf8_prompt_is_refused_at_write(daemon: Daemon) -> None:
    sid = daemon.new(name="u")
    before = daemon.read(f"s/{sid}/chat")
    assert write_errno(daemon.p(f"s/{sid}/prompt"), b"caf\xff\n") == errno.EINVAL
    chat = daemon.read(f"s/{sid}/chat")
    assert chat.startswith(before) and "error: prompt: not valid UTF-8" in chat
    assert "user:" not in chat
    # The shell sees it too.
    sh = subprocess.run(
        ["bash", "-c", f"printf 'x\\377' > {daemon.p(f's/{sid}/prompt')}"], capture_output=True
    )
    assert sh.returncode != 0 and b"Invalid argument" in sh.stderr


def test_utf8_cut_between_writes_is_put_together(daemon: Daemon) -> None:
    sid = daemon.new(name="v")
    assert write_errno(daemon.p(f"s/{sid}/prompt"), b"caf\xc3", b"\xa9 ok") == 0
    assert "user: café ok" in daemon.wait_chat(sid, "user: caf")


def test_a_prompt_ending_inside_a_character_is_refused_at_close(daemon: Daemon) -> None:
    sid = daemon.new(name="w")
    assert write_errno(daemon.p(f"s/{sid}/prompt"), b"abc\xe2\x82") == -errno.EINVAL
    chat = daemon.read(f"s/{sid}/chat")
    assert "user:" not in chat and "ends inside a UTF-8 sequence" in chat


def test_ftruncate_cuts_the_unsubmitted_prompt(daemon: Daemon) -> None:
    sid = daemon.new(name="t")
    fd = os.open(daemon.p(f"s/{sid}/prompt"), os.O_WRONLY)
    os.write(fd, b"discard me")
    os.ftruncate(fd, 0)
    os.close(fd)
    fd = os.open(daemon.p(f"s/{sid}/prompt"), os.O_WRONLY)
    os.write(fd, b"keep this, not that")
    os.ftruncate(fd, 9)
    os.close(fd)
    chat = daemon.wait_chat(sid, "user: keep this")
    assert "discard me" not in chat and "not that" not in chat
    assert chat.count("user:") == 1


@pytest.mark.parametrize("bad", [b"model=\x00", b"model=a\x01b", b"name=x\x1b[31m", b"cwd=\x7f"])
def test_control_bytes_in_s_new_are_refused(daemon: Daemon, bad: bytes) -> None:
    before = sorted(os.listdir(daemon.p("s")))
    data = f"cwd={daemon.work} ".encode() + bad + b"\n"
    assert write_errno(daemon.p("s/new"), data) == errno.EINVAL
    assert sorted(os.listdir(daemon.p("s"))) == before


def test_control_bytes_in_cfg_and_ctl_are_refused(daemon: Daemon) -> None:
    sid = daemon.new(name="c")
    cfg = daemon.read(f"s/{sid}/cfg")
    assert write_errno(daemon.p(f"s/{sid}/cfg"), b"model=m\x00x\n") == errno.EINVAL
    assert write_errno(daemon.p(f"s/{sid}/ctl"), b"model m\x07\n") == errno.EINVAL
    assert daemon.read(f"s/{sid}/cfg") == cfg
    assert "control character" in daemon.read(f"s/{sid}/chat")


def test_a_quoted_cwd_may_hold_spaces(daemon: Daemon) -> None:
    spaced = daemon.work / "my proj"
    spaced.mkdir()
    daemon.write("s/new", f'cwd="{spaced}" name=sp\n')
    assert f"cwd={spaced}\n" in daemon.read("s/sp/cfg")
    assert write_errno(daemon.p("s/new"), f'cwd="{spaced} name=x\n'.encode()) == errno.EINVAL


def test_state_and_logs_are_private(daemon: Daemon) -> None:
    sid = daemon.new(name="p")
    daemon.prompt(sid, "hello")
    daemon.wait_idle(sid)
    home = daemon.home
    for d in ("config", "state", "data", "run", "state/sessions", "state/logs"):
        assert stat.S_IMODE(os.stat(home / d).st_mode) == 0o700, d
    files = [home / "state" / "daemon.log", *(home / "state" / "sessions").iterdir()]
    files += (home / "state" / "logs").iterdir()
    for f in files:
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f


def test_a_huge_bad_write_gives_a_short_reason(daemon: Daemon) -> None:
    """A reason quotes what was written: 600 KB of garbage to s/new or to a session's cfg
    must not become a 600 KB line in err, events, chat and the log."""
    sid = daemon.new(name="huge")
    for path in ("s/new", f"s/{sid}/cfg"):
        fd = os.open(daemon.p(path), os.O_WRONLY)
        try:
            with pytest.raises(OSError) as err:
                os.write(fd, b"x" * 600_000)
            assert err.value.errno == errno.EINVAL
        finally:
            os.close(fd)
    for err_file in ("err", f"s/{sid}/err"):
        text = daemon.read(err_file)
        assert "more characters)" in text and len(text) < 1000, err_file
    assert max(map(len, daemon.read(f"s/{sid}/chat").splitlines())) < 1000
    assert len(daemon.stderr()) < 100_000
