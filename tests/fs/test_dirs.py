"""The folders on disk of SPEC 3.1 on a real mount: m/ tmp/ t/ p/ sk/ tr/ u/ x/.

Everything here goes through the kernel: plain file calls, and the tools people use on
a disk (sed -i, vim -es, cp -a, tar). The backing folders are checked directly, so a
test also sees what reached the disk, not only what the mount says.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from olliefs.settings import shipped_dir
from olliefs.testing import Daemon, expect_log
from tests.conftest import oserror, script

SHIPPED = shipped_dir()


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def backing(daemon: Daemon, top: str) -> Path:
    return {
        "m": daemon.home / "data" / "memory",
        "tmp": daemon.home / "data" / "scratch",
        "t": daemon.home / "config" / "tools",
        "sk": daemon.home / "config" / "skills",
        "tr": daemon.home / "state" / "transcripts",
        "p": daemon.home / "config" / "prompts",
    }[top]


def run(*argv: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    argl = [str(a) for a in argv]
    return subprocess.run(argl, capture_output=True, text=True, timeout=60, check=False, env=env)


def close_errno(path: Path, data: bytes, flags: int = os.O_WRONLY | os.O_TRUNC) -> int:
    """Write ``data`` in one handle; the errno of the close (0 if it succeeded)."""
    fd = os.open(path, flags | os.O_CREAT, 0o644)
    os.write(fd, data)
    return oserror(os.close, fd)


# ---- the listing ---------------------------------------------------------------------


def test_each_folder_lists_sorted_with_its_mode(daemon: Daemon) -> None:
    dirs = {"m": 0o755, "tmp": 0o755, "t": 0o755, "sk": 0o755, "tr": 0o755}
    dirs |= {"p": 0o555, "u": 0o555, "x": 0o555}
    for name, want in dirs.items():
        assert stat.S_ISDIR(os.stat(daemon.p(name)).st_mode)
        assert mode(daemon.p(name)) == want, name
    assert os.listdir(daemon.p("m")) == []
    assert os.listdir(daemon.p("tmp")) == []
    assert os.listdir(daemon.p("tr")) == []
    assert os.listdir(daemon.p("sk")) == ["idx"]
    assert os.listdir(daemon.p("p")) == ["coding.md", "concise.md", "review.md"]
    assert os.listdir(daemon.p("u")) == ["complete"]
    tools = sorted(f.name for f in (SHIPPED / "tools").iterdir())
    assert os.listdir(daemon.p("t")) == sorted([*tools, "idx"])
    # Shipped files are read-only; u/ and x/ are r-x; generated files r--.
    assert mode(daemon.p("t/file_read")) == 0o555
    assert mode(daemon.p("p/coding.md")) == 0o444
    assert mode(daemon.p("u/complete")) == 0o555
    assert mode(daemon.p("t/idx")) == 0o444
    assert daemon.read("p/review.md") == (SHIPPED / "prompts" / "review.md").read_text()


def test_nothing_is_copied_into_the_config_dir(daemon: Daemon) -> None:
    assert "file_read\t" in daemon.read("t/idx")  # toolsrv runs and serves the shipped tools
    sid = daemon.new(name="c")
    assert daemon.read(f"s/{sid}/tools") == "client_9p\thot\tserial\n"
    assert list((daemon.home / "config").rglob("*")) == []


# ---- m/ and tmp/: files as on a disk ---------------------------------------------------


@pytest.mark.parametrize("top", ["m", "tmp"])
def test_files_behave_as_on_a_disk(daemon: Daemon, top: str) -> None:
    disk = backing(daemon, top)
    f = daemon.p(f"{top}/notes")
    fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    assert os.write(fd, b"hello\n") == 6
    os.close(fd)
    assert (disk / "notes").read_bytes() == b"hello\n"
    assert mode(f) == mode(disk / "notes") == 0o640 & ~current_umask()
    with open(f, "a") as a:  # O_APPEND
        a.write("world\n")
    fd = os.open(f, os.O_RDWR)
    try:
        os.pwrite(fd, b"HELLO", 0)
        assert os.pread(fd, 100, 0) == b"HELLO\nworld\n"
        os.ftruncate(fd, 3)
        assert os.fstat(fd).st_size == 3
    finally:
        os.close(fd)
    os.truncate(f, 2)
    assert f.read_bytes() == b"HE" == (disk / "notes").read_bytes()
    # Size, mtime and inode are the disk's and do not move between stats.
    st, real = os.stat(f), os.stat(disk / "notes")
    assert (st.st_size, st.st_mtime_ns) == (real.st_size, real.st_mtime_ns)
    assert os.stat(f).st_mtime_ns == st.st_mtime_ns and os.stat(f).st_ino == st.st_ino
    # A change made on the disk (a memory tool appending) is seen at once.
    with open(disk / "notes", "ab") as out:
        out.write(b"!")
    assert f.read_bytes() == b"HE!" and os.stat(f).st_size == 3
    # rename keeps the inode; over an existing name it replaces it.
    daemon.p(f"{top}/other").write_text("old")
    os.rename(f, daemon.p(f"{top}/other"))
    assert os.stat(daemon.p(f"{top}/other")).st_ino == st.st_ino
    assert daemon.p(f"{top}/other").read_bytes() == b"HE!"
    assert sorted(os.listdir(disk)) == ["other"]
    # O_TRUNC empties it; listings are sorted; dotfiles (editor swap files) work.
    with open(daemon.p(f"{top}/other"), "w"):
        pass
    assert (disk / "other").read_bytes() == b""
    for name in ("c", ".b.swp", "a"):
        daemon.p(f"{top}/{name}").write_text(name)
    assert os.listdir(daemon.p(top)) == [".b.swp", "a", "c", "other"]
    # An unlinked file stays readable through the handle that holds it.
    h = open(daemon.p(f"{top}/a"), "rb")
    os.unlink(daemon.p(f"{top}/a"))
    assert not (disk / "a").exists() and "a" not in os.listdir(daemon.p(top))
    assert h.read() == b"a" and os.fstat(h.fileno()).st_size == 1
    h.close()
    assert oserror(os.stat, daemon.p(f"{top}/a")) == errno.ENOENT


def current_umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_rename_noreplace_and_exchange(daemon: Daemon) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd = -100

    def renameat2(a: Path, b: Path, flags: int) -> int:
        if libc.renameat2(at_fdcwd, bytes(a), at_fdcwd, bytes(b), flags) == 0:
            return 0
        return ctypes.get_errno()

    a, b = daemon.p("m/a"), daemon.p("m/b")
    a.write_text("a")
    b.write_text("b")
    assert renameat2(a, b, 1) == errno.EEXIST  # RENAME_NOREPLACE
    assert renameat2(a, b, 2) == errno.EINVAL  # RENAME_EXCHANGE: not offered
    assert (a.read_text(), b.read_text()) == ("a", "b")
    assert renameat2(a, daemon.p("m/c"), 1) == 0
    assert daemon.p("m/c").read_text() == "a"


def test_tmp_has_sub_folders_m_does_not(daemon: Daemon) -> None:
    disk = backing(daemon, "tmp")
    os.makedirs(daemon.p("tmp/a/b"))
    daemon.p("tmp/a/b/f").write_text("deep")
    assert (disk / "a" / "b" / "f").read_text() == "deep"
    os.rename(daemon.p("tmp/a"), daemon.p("tmp/z"))
    assert daemon.p("tmp/z/b/f").read_text() == "deep"
    assert oserror(os.rmdir, daemon.p("tmp/z")) == errno.ENOTEMPTY
    # cp -a sets modes and times of folders; tar and rm -r walk them.
    r = run("cp", "-a", daemon.p("tmp/z"), daemon.p("tmp/copy"))
    assert r.returncode == 0, r.stderr
    assert os.stat(daemon.p("tmp/copy/b/f")).st_mtime_ns == os.stat(disk / "z/b/f").st_mtime_ns
    r = run("tar", "cf", daemon.base / "t.tar", "-C", daemon.path, "tmp", "m", "p", "t", "sk")
    assert r.returncode == 0, r.stderr
    shutil.rmtree(daemon.p("tmp/z"))
    assert sorted(os.listdir(disk)) == ["copy"]
    assert oserror(os.mkdir, daemon.p("m/sub")) == errno.EACCES
    assert oserror(os.mkdir, daemon.p("t/sub")) == errno.EACCES


def test_a_symlink_in_m_is_never_followed(daemon: Daemon) -> None:
    outside = daemon.base / "outside"
    outside.write_text("secret\n")
    os.symlink(outside, backing(daemon, "m") / "link")
    assert os.listdir(daemon.p("m")) == []
    assert oserror(os.stat, daemon.p("m/link")) == errno.ENOENT
    assert oserror(close_errno, daemon.p("m/link"), b"x") == errno.ELOOP
    assert outside.read_text() == "secret\n"


def test_sed_i_and_vim_edit_a_note(daemon: Daemon) -> None:
    note = daemon.p("m/notes.md")
    note.write_text("alpha\nbeta\n")
    r = run("sed", "-i", "s/beta/gamma/", note)
    assert r.returncode == 0, r.stderr
    assert note.read_text() == "alpha\ngamma\n"
    assert os.listdir(daemon.p("m")) == ["notes.md"]  # sed's temp file renamed into place
    vim = shutil.which("vim")
    if vim is None:
        pytest.skip(reason="vim is not installed (.ci/setup installs it)")
    env = {**os.environ, "HOME": str(daemon.base)}
    # Default settings write a swap file next to the note and save in place; the second
    # run renames the note to a backup and writes a new file (backupcopy=no).
    for cmd, want in (
        ("%s/gamma/delta/", "alpha\ndelta\n"),
        ("set backup writebackup backupcopy=no | %s/alpha/omega/", "omega\ndelta\n"),
    ):
        r = run(vim, "-es", "-u", "NONE", "-i", "NONE", "-c", cmd, "-c", "wq", note, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert note.read_text() == want
    assert "notes.md" in os.listdir(daemon.p("m"))
    assert (backing(daemon, "m") / "notes.md").read_text() == "omega\ndelta\n"


# ---- read-only folders -------------------------------------------------------------------


def test_read_only_folders_refuse_writes_with_eacces(daemon: Daemon) -> None:
    for top in ("p", "u", "x", "tr"):
        assert oserror(close_errno, daemon.p(f"{top}/new"), b"x") == errno.EACCES, top
    assert oserror(close_errno, daemon.p("p/coding.md"), b"x") == errno.EACCES
    assert oserror(os.unlink, daemon.p("p/coding.md")) == errno.EACCES
    assert oserror(os.unlink, daemon.p("u/complete")) == errno.EACCES
    assert oserror(os.rename, daemon.p("p/coding.md"), daemon.p("p/c.md")) == errno.EACCES
    # The user's fragments sit over the shipped ones, by name.
    mine = backing(daemon, "p")
    mine.mkdir()
    (mine / "coding.md").write_text("my way\n")
    (mine / "mine.md").write_text("mine\n")
    assert os.listdir(daemon.p("p")) == ["coding.md", "concise.md", "mine.md", "review.md"]
    assert daemon.read("p/coding.md") == "my way\n"


def test_transcripts_appear_and_may_be_removed(daemon: Daemon) -> None:
    daemon.replay.add(script('{"reply": "hi"}'))
    sid = daemon.new(name="gone")
    daemon.prompt(sid, "hello")
    daemon.wait_idle(sid)
    daemon.write(f"s/{sid}/ctl", "save")
    shutil.rmtree(daemon.p(f"s/{sid}"))
    names = os.listdir(daemon.p("tr"))
    assert sorted(n.split("-", 1)[1] for n in names) == ["gone.jsonl", "gone.md"]
    assert names == sorted(names)
    md = next(n for n in names if n.endswith(".md"))
    assert "user: hello" in daemon.read(f"tr/{md}")
    assert mode(daemon.p(f"tr/{md}")) == 0o444
    assert oserror(close_errno, daemon.p(f"tr/{md}"), b"x") == errno.EACCES
    os.unlink(daemon.p(f"tr/{md}"))
    assert not (backing(daemon, "tr") / md).exists()
    assert len(os.listdir(daemon.p("tr"))) == 1


def test_no_transcript_replaces_another(daemon: Daemon) -> None:
    """Three sessions of one name removed, and one saved three times, in quick
    succession (mostly within one second): every journal and every save is kept."""
    for i in range(3):
        sid = daemon.new(name="twin")
        daemon.prompt(sid, f"I am twin {i}")
        daemon.wait_idle(sid)
        for _ in range(3 if i == 0 else 0):
            daemon.write(f"s/{sid}/ctl", "save")
        shutil.rmtree(daemon.p(f"s/{sid}"))
    names = sorted(os.listdir(daemon.p("tr")))
    journals = [n for n in names if n.endswith("-twin.jsonl")]
    assert len(journals) == 3 and len([n for n in names if n.endswith("-twin.md")]) == 3
    said = sorted(
        i for n in journals for i in range(3) if f"I am twin {i}" in daemon.read(f"tr/{n}")
    )
    assert said == [0, 1, 2]


# ---- t/: tool scripts --------------------------------------------------------------------

TOOL = """#!/bin/sh
# ollie-tool
# description: greet from a script written through the mount (test)
# args: {"type": "object", "properties": {}}
echo hello from t
"""


def test_a_tool_written_to_t_is_offered_at_once_and_runs(daemon: Daemon) -> None:
    assert "greet_dirs\t" not in daemon.read("t/idx")
    with open(daemon.p("t/greet_dirs"), "w") as f:  # a plain cat > t/x: made 0755
        f.write(TOOL)
    disk = backing(daemon, "t") / "greet_dirs"
    assert disk.read_text() == TOOL and mode(disk) == 0o755
    assert mode(daemon.p("t/greet_dirs")) == 0o755
    line = next(x for x in daemon.read("t/idx").splitlines() if x.startswith("greet_dirs\t"))
    assert line.split("\t")[1] == "greet from a script written through the mount (test)"
    call = {"name": "greet_dirs", "arguments": {}, "id": "c1"}
    daemon.replay.add(script(json.dumps({"tool_calls": [call]}), '{"reply": "done"}'))
    sid = daemon.new(name="tool")
    daemon.write(f"s/{sid}/ctl", "tool_load greet_dirs")
    assert "greet_dirs\thot\tserial" in daemon.read(f"s/{sid}/tools")
    daemon.prompt(sid, "greet")
    daemon.wait_idle(sid)
    msgs = [m for m in daemon.replay.requests[1]["messages"] if m["role"] == "tool"]
    assert msgs[0]["content"] == "hello from t"
    # chmod where it makes sense: the exec bit of the user's own script.
    os.chmod(daemon.p("t/greet_dirs"), 0o644)
    assert mode(disk) == 0o644
    # ... which takes it out of the catalogue, as toolsrv says.
    expect_log(r"toolsrv\.registry: tool .*/greet_dirs left out: not executable \(chmod \+x\)")
    daemon.wait_for(lambda: "greet_dirs\t" not in daemon.read("t/idx"))
    assert oserror(os.chmod, daemon.p("t/file_read"), 0o777) == errno.EPERM


def test_shipped_tools_are_read_only_and_the_users_win_by_name(daemon: Daemon) -> None:
    shipped = (SHIPPED / "tools" / "reasoning_think").read_text()
    assert oserror(close_errno, daemon.p("t/reasoning_think"), b"x") == errno.EACCES
    assert oserror(os.unlink, daemon.p("t/reasoning_think")) == errno.EACCES
    for op in (
        lambda: close_errno(daemon.p("t/idx"), b"x"),
        lambda: os.unlink(daemon.p("t/idx")),
        lambda: os.rename(daemon.p("t/idx"), daemon.p("t/idx2")),
    ):
        assert oserror(op) == errno.EACCES
    # sed -i writes a temp file in t/ and renames it over the shipped name: the user's
    # copy now wins (with the mode sed copied), the shipped file is untouched.
    r = run("sed", "-i", "s/^# description: .*/# description: mine/", daemon.p("t/reasoning_think"))
    assert r.returncode == 0, r.stderr
    mine = backing(daemon, "t") / "reasoning_think"
    assert "# description: mine" in mine.read_text()
    assert daemon.p("t/reasoning_think").read_text() == mine.read_text()
    assert (SHIPPED / "tools" / "reasoning_think").read_text() == shipped
    assert sorted(os.listdir(backing(daemon, "t"))) == ["reasoning_think"]
    # Removing the user's script shows the shipped one again.
    os.unlink(daemon.p("t/reasoning_think"))
    assert daemon.p("t/reasoning_think").read_text() == shipped
    assert mode(daemon.p("t/reasoning_think")) == 0o555


# ---- sk/: skills -------------------------------------------------------------------------

SKILL = b"""---
name: demo
description: >
  Shows how skills
  are written.
license: MIT
---
Body of the skill.
"""


def test_skills(daemon: Daemon) -> None:
    root = backing(daemon, "sk")
    assert daemon.read("sk/idx") == ""
    assert close_errno(daemon.p("sk/demo.md"), SKILL) == 0
    assert (root / "demo" / "SKILL.md").read_bytes() == SKILL
    assert os.listdir(daemon.p("sk")) == ["demo.md", "idx"]
    assert daemon.read("sk/idx") == "demo\tShows how skills are written.\n"
    assert daemon.p("sk/demo.md").read_bytes() == SKILL
    # A SKILL.md without name/description is refused at close; the old one stays.
    bad = b"---\nname: demo\n---\nno description\n"
    assert close_errno(daemon.p("sk/demo.md"), bad) == errno.EINVAL
    assert close_errno(daemon.p("sk/demo.md"), b"no front matter\n") == errno.EINVAL
    assert (root / "demo" / "SKILL.md").read_bytes() == SKILL
    assert daemon.p("sk/demo.md").read_bytes() == SKILL
    # A new skill refused at close leaves nothing behind.
    assert close_errno(daemon.p("sk/other.md"), bad) == errno.EINVAL
    assert not (root / "other").exists() and os.listdir(daemon.p("sk")) == ["demo.md", "idx"]
    assert oserror(close_errno, daemon.p("sk/notes.txt"), SKILL) == errno.EINVAL
    # Edited in place (pwrite), renamed, removed.
    fd = os.open(daemon.p("sk/demo.md"), os.O_RDWR)
    os.pwrite(fd, b"B", SKILL.index(b"Body"))
    os.close(fd)
    assert (root / "demo" / "SKILL.md").read_bytes() == SKILL
    os.rename(daemon.p("sk/demo.md"), daemon.p("sk/demo2.md"))
    assert sorted(os.listdir(root)) == ["demo2"]
    assert daemon.read("sk/idx").startswith("demo2\t")
    # vim saves in place here (its swap and test files are refused: not <name>.md).
    vim = shutil.which("vim")
    if vim is not None:
        env = {**os.environ, "HOME": str(daemon.base)}
        cmd = "%s/^name: demo$/name: demo2/"
        r = run(
            vim,
            "-es",
            "-u",
            "NONE",
            "-i",
            "NONE",
            "-c",
            cmd,
            "-c",
            "wq",
            daemon.p("sk/demo2.md"),
            env=env,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert b"name: demo2\n" in (root / "demo2" / "SKILL.md").read_bytes()
    os.unlink(daemon.p("sk/demo2.md"))
    assert os.listdir(root) == [] and daemon.read("sk/idx") == ""


# ---- u/complete --------------------------------------------------------------------------


def test_u_complete_runs_through_the_mount(daemon: Daemon) -> None:
    sid = daemon.new(name="demo")

    def complete(*words: str) -> list[str]:
        r = run(daemon.p("u/complete"), *words)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()

    fi = ["file_edit", "file_glob", "file_grep", "file_read", "file_write"]
    assert complete("tool_load fi") == fi
    assert complete("tool_load", "fi") == fi
    assert complete("/tool_load fi") == fi
    assert complete("tool_l") == ["tool_load"]
    assert complete("/to") == ["/tool_load", "/tool_unload"]
    assert "stop" in complete("") and "rn" in complete("")
    assert complete("s/") == ["s/demo/", "s/idx", "s/new"]
    assert complete("s/d") == ["s/demo/"]
    assert complete(f"s/{sid}/st") == [
        f"s/{sid}/staged/",
        f"s/{sid}/state",
        f"s/{sid}/statewait",
        f"s/{sid}/stream",
    ]
    assert complete("-s", sid, "tool_unload ") == ["client_9p"]
    assert complete("backend op") == ["openai"]
    assert complete("rn x") == []
    assert complete("cwd", str(daemon.work.parent) + "/wo") == [str(daemon.work) + "/"]


# ---- shipped defaults: reading, not copying ----------------------------------------------


def test_old_copies_identical_to_the_shipped_file_are_removed_once(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory()
    config = d.home / "config"
    for sub in ("tools", "agents", "sandbox"):
        (config / sub).mkdir(parents=True)
    shutil.copy2(SHIPPED / "tools" / "file_read", config / "tools" / "file_read")
    shutil.copy2(SHIPPED / "tools" / "file_grep", config / "tools" / "file_grep")
    with open(config / "tools" / "file_grep", "a") as f:
        f.write("# changed by the user\n")
    shutil.copy2(SHIPPED / "profiles" / "default.json", config / "agents" / "default.json")
    shutil.copy2(SHIPPED / "sandbox" / "default.toml", config / "sandbox" / "default.toml")
    (config / "sandbox" / "network.toml").write_text("network = true\n# mine\n")
    with d.running():
        assert sorted(str(p.relative_to(config)) for p in config.rglob("*")) == [
            "sandbox",
            "sandbox/network.toml",
            "tools",
            "tools/file_grep",
        ]
        assert mode(d.p("t/file_read")) == 0o555  # the shipped one now
        assert "# changed by the user" in d.p("t/file_grep").read_text()
        assert "file_read\t" in d.read("t/idx")
    # Once done, a copy made on purpose (to pin a default) is the user's file.
    shutil.copy2(SHIPPED / "tools" / "file_read", config / "tools" / "file_read")
    with d.running():
        assert (config / "tools" / "file_read").exists()
        assert mode(d.p("t/file_read")) == 0o755
