"""Bad input gets a clear errno at write(2), an ``error:`` line, and changes nothing.

Shells ignore errors from close(), so a refusal that only close() reports is lost on them:
these tests write the way a shell does (one write, then close) and look at both the
errno and what the session shows.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import subprocess

import pytest

from olliefs.fs.nodes import MAX_CONTROL_WRITE, MAX_TEXT
from olliefs.session.session import MAX_PROMPT
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


# ---- sizes ---------------------------------------------------------------------------


def write_at(path: os.PathLike[str], data: bytes, shift: int) -> int:
    """One write(2) of ``data`` from a buffer ``shift`` bytes into a page (the kernel
    cuts a long write where the buffer's pages run out: the offset decides where);
    the byte count it returned, or minus the errno."""
    with mmap.mmap(-1, len(data) + 2 * mmap.PAGESIZE) as m:
        m[shift : shift + len(data)] = data
        view = memoryview(m)[shift : shift + len(data)]
        fd = os.open(path, os.O_WRONLY)
        try:
            return os.write(fd, view)
        except OSError as err:
            return -(err.errno or 1)
        finally:
            view.release()
            os.close(fd)


SHIFTS = [0, 1, 32, mmap.PAGESIZE - 1]


def test_a_control_write_longer_than_one_fuse_request_is_refused_whole(daemon: Daemon) -> None:
    """The kernel passes a write(2) longer than one FUSE request (1 MiB, less where the
    writer's buffer starts in its page) in pieces: each was applied as a write of its
    own, 95,322 of 100,000 ``maxsteps 8`` lines before the ``bogus`` one. Now the first
    piece is refused with EFBIG, which fails the whole write(2): nothing applied."""
    sid = daemon.new(name="big")
    daemon.write(f"s/{sid}/ctl", "maxsteps 5")
    data = b"maxsteps 8\n" * 100_000 + b"bogus\n"
    for shift in SHIFTS:
        assert write_at(daemon.p(f"s/{sid}/ctl"), data, shift) == -errno.EFBIG, shift
        assert write_at(daemon.p(f"s/{sid}/cfg"), b"model=x\n" * 140_000, shift) == -errno.EFBIG
    daemon.write(f"s/{sid}/ctl", "maxsteps")
    chat = daemon.read(f"s/{sid}/chat")
    assert chat.endswith(":: maxsteps 5\n"), chat[-300:]
    assert "model=replay\n" in daemon.read(f"s/{sid}/cfg")
    reason = f"ctl: a write longer than {MAX_CONTROL_WRITE} bytes"
    assert reason in chat and "error: cfg: a write longer than" in chat
    assert daemon.read(f"s/{sid}/err").startswith("cfg: a write longer than")
    # s/new with a model name of a MiB: no session (it was made, with the name cut)
    before = sorted(os.listdir(daemon.p("s")))
    new = f"cwd={daemon.work} name=cut model=".encode() + b"m" * (1 << 20)
    for shift in SHIFTS:
        assert write_at(daemon.p("s/new"), new, shift) == -errno.EFBIG
    assert sorted(os.listdir(daemon.p("s"))) == before
    assert daemon.read("err").startswith(f"s/new: a write longer than {MAX_CONTROL_WRITE}")


def test_a_control_write_up_to_the_limit_is_taken_whole(daemon: Daemon) -> None:
    """The limit is exact: a write of MAX_CONTROL_WRITE bytes is one request, wherever
    its buffer starts; one byte more is refused."""
    for shift in SHIFTS:
        head = f"cwd={daemon.work} name=edge{shift}".encode()
        pad = b" " * (MAX_CONTROL_WRITE - len(head))
        assert write_at(daemon.p("s/new"), head + pad, shift) == MAX_CONTROL_WRITE
        assert (daemon.p(f"s/edge{shift}")).is_dir()
        head = f"cwd={daemon.work} name=over{shift}".encode()
        data = head + b" " * (MAX_CONTROL_WRITE + 1 - len(head))
        assert write_at(daemon.p("s/new"), data, shift) == -errno.EFBIG
        assert not (daemon.p(f"s/over{shift}")).exists()


def test_a_prompt_over_the_limit_is_refused_and_nothing_of_it_submitted(daemon: Daemon) -> None:
    """A prompt is collected over many writes: the one that passes MAX_PROMPT fails with
    EFBIG, so does every later one and the close, and nothing of it reaches chat, the
    history or the provider (it used to be sent whole: 100 MB)."""
    sid = daemon.new(name="long")
    fd = os.open(daemon.p(f"s/{sid}/prompt"), os.O_WRONLY)
    piece = b"a" * (1 << 20)
    try:
        for _ in range(MAX_PROMPT // len(piece)):
            assert os.write(fd, piece) == len(piece)
        with pytest.raises(OSError) as err:
            os.write(fd, b"!")
        assert err.value.errno == errno.EFBIG
        with pytest.raises(OSError) as err:
            os.write(fd, b"more")
        assert err.value.errno == errno.EFBIG
    finally:
        with pytest.raises(OSError) as err:
            os.close(fd)
        assert err.value.errno == errno.EFBIG
    # the shell sees it at the write, and cat stops there
    sh = subprocess.run(
        ["bash", "-c", f"head -c 5000000 /dev/zero | tr '\\0' b > {daemon.p(f's/{sid}/prompt')}"],
        capture_output=True,
    )
    assert sh.returncode != 0 and b"File too large" in sh.stderr
    chat = daemon.read(f"s/{sid}/chat")
    assert "user:" not in chat and "aaaa" not in chat and "bbbb" not in chat
    assert chat.count("error: prompt: longer than 4 MiB (not submitted)") == 2
    assert daemon.read(f"s/{sid}/err") == "prompt: longer than 4 MiB (not submitted)\n"
    assert daemon.replay.recorded == []
    daemon.prompt(sid, "a short one")
    assert "assistant: echo: a short one" in daemon.wait_chat(sid, "echo: a short one")


def test_a_plan_over_the_limit_is_refused_and_the_old_one_kept(daemon: Daemon) -> None:
    sid = daemon.new(name="plan")
    daemon.write(f"s/{sid}/plan", "1. keep me\n")
    with pytest.raises(OSError) as err, open(daemon.p(f"s/{sid}/plan"), "w") as f:
        f.write("x" * (MAX_TEXT + 1))
    assert err.value.errno == errno.EFBIG
    assert daemon.read(f"s/{sid}/plan") == "1. keep me\n"
    assert daemon.read(f"s/{sid}/err").startswith("plan: longer than 1 MiB")
