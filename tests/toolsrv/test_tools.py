"""The shipped tool scripts, run as real processes the way toolsrv runs them.

Each test executes the script file directly (the kernel reads its ``#!``), with the
arguments as JSON on stdin, ``tmp_path`` as cwd and the env toolsrv gives a tool. The
sandbox is not applied here: that path is toolsrv's and is tested with it. The base PATH
is the system one, so ``/usr/bin/env python3`` finds the interpreter a user's toolsrv
would, not this venv's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "agents" / "tools"
SESSION = "1700000000000000000-abcdef"


@dataclass
class Result:
    rc: int
    out: str
    err: str


Run = Callable[..., Result]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    home, tmp, ollie, memory, cwd = (
        tmp_path / n for n in ("home", "tmp", "ollie", "memory", "cwd")
    )
    for d in (home, tmp, ollie / "s" / SESSION, cwd):
        d.mkdir(parents=True)
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TMPDIR": str(tmp),
        "OLLIE": str(ollie),
        "OLLIE_SESSION_ID": SESSION,
        "OLLIE_AGENT": "default",
        "OLLIE_CWD": str(cwd),
        "OLLIE_MEMORY_DIR": str(memory),
        "OLLIE_TMP": str(tmp),
    }


@pytest.fixture
def cwd(env: dict[str, str]) -> Path:
    return Path(env["OLLIE_CWD"])


@pytest.fixture
def run(env: dict[str, str], cwd: Path) -> Run:
    def call(tool: str, args: object = None, *, stdin: bytes | None = None) -> Result:
        data = stdin if stdin is not None else json.dumps(args or {}).encode()
        p = subprocess.run(
            [str(TOOLS / tool)],
            input=data,
            capture_output=True,
            cwd=cwd,
            env=env,
            timeout=60,
            check=False,
        )
        return Result(p.returncode, p.stdout.decode(), p.stderr.decode())

    return call


def ok(r: Result) -> str:
    assert (r.rc, r.err) == (0, ""), r
    return r.out


def fails(r: Result, tool: str) -> str:
    assert r.rc != 0, r
    assert r.err.startswith(f"{tool}: "), r
    assert "Traceback" not in r.err, r
    return r.err


ALL = sorted(p.name for p in TOOLS.iterdir())


# ---- every tool --------------------------------------------------------------------------


@pytest.mark.parametrize("tool", ALL)
@pytest.mark.parametrize("stdin", [b"[1]", b"{not json", b'"x"'])
def test_bad_arguments_fail_cleanly(run: Run, tool: str, stdin: bytes) -> None:
    fails(run(tool, stdin=stdin), tool)


@pytest.mark.parametrize("tool", ALL)
def test_isolated_mode_is_enough(tool: str, env: dict[str, str], cwd: Path) -> None:
    """-I (no user site, no PYTHON* env, no cwd on sys.path) changes nothing."""
    p = subprocess.run(
        [sys.executable, "-I", str(TOOLS / tool)],
        input=b"[]",
        capture_output=True,
        cwd=cwd,
        env=env,
        timeout=60,
        check=False,
    )
    assert p.returncode == 1
    assert p.stderr.decode().startswith(f"{tool}: ")


# ---- file_read ---------------------------------------------------------------------------


def lines(n: int) -> str:
    return "".join(f"line {i}\n" for i in range(1, n + 1))


def test_file_read_numbers_lines(run: Run, cwd: Path) -> None:
    (cwd / "f.txt").write_text(lines(12))
    out = ok(run("file_read", {"path": "f.txt"}))
    assert out.splitlines()[0] == " 1\tline 1"
    assert out.splitlines()[11] == "12\tline 12"
    assert len(out.splitlines()) == 12


def test_file_read_pages(run: Run, cwd: Path) -> None:
    (cwd / "f.txt").write_text(lines(10))
    out = ok(run("file_read", {"path": "f.txt", "offset": 3, "limit": 4}))
    assert (
        out == "3\tline 3\n4\tline 4\n5\tline 5\n6\tline 6\n... 4 more lines; read with offset=7\n"
    )
    out = ok(run("file_read", {"path": "f.txt", "offset": "9", "limit": 1.0}))
    assert out == "9\tline 9\n... 1 more line; read with offset=10\n"
    out = ok(run("file_read", {"path": "f.txt", "offset": 10}))
    assert out == "10\tline 10\n"


def test_file_read_counts_an_unterminated_last_line(run: Run, cwd: Path) -> None:
    (cwd / "f.txt").write_text("a\nb\nc")
    assert ok(run("file_read", {"path": "f.txt", "limit": 1})).endswith(
        "... 2 more lines; read with offset=2\n"
    )
    assert ok(run("file_read", {"path": "f.txt", "offset": 3})) == "3\tc\n"


def test_file_read_default_limit_is_2000(run: Run, cwd: Path) -> None:
    (cwd / "f.txt").write_text(lines(2500))
    out = ok(run("file_read", {"path": str(cwd / "f.txt")})).splitlines()
    assert len(out) == 2001
    assert out[-2] == "2000\tline 2000"
    assert out[-1] == "... 500 more lines; read with offset=2001"


def test_file_read_edge_cases(run: Run, cwd: Path) -> None:
    (cwd / "empty").write_text("")
    assert ok(run("file_read", {"path": "empty"})) == "(empty file)\n"
    (cwd / "short").write_text("x\r\ny\n")
    assert ok(run("file_read", {"path": "short"})) == "1\tx\n2\ty\n"
    assert "past the end" in ok(run("file_read", {"path": "short", "offset": 5}))
    (cwd / "long").write_text("é" * 2500 + "\n")
    out = ok(run("file_read", {"path": "long"}))
    assert out == "1\t" + "é" * 2000 + "... [500 more characters]\n"
    (cwd / "latin1").write_bytes(b"caf\xe9\n")
    assert ok(run("file_read", {"path": "latin1"})) == "1\tcaf\ufffd\n"


def test_file_read_errors(run: Run, cwd: Path) -> None:
    (cwd / "bin").write_bytes(b"\x7fELF\0\0\0" + b"x" * 100)
    assert "binary file (107 bytes)" in fails(run("file_read", {"path": "bin"}), "file_read")
    (cwd / "d").mkdir()
    assert "use file_glob" in fails(run("file_read", {"path": "d"}), "file_read")
    os.mkfifo(cwd / "fifo")
    assert "not a regular file" in fails(run("file_read", {"path": "fifo"}), "file_read")
    assert "not a regular file" in fails(run("file_read", {"path": "/dev/zero"}), "file_read")
    err = fails(run("file_read", {"path": "nope"}), "file_read")
    assert err == "file_read: nope: No such file or directory\n"
    (cwd / "f").write_text("x\n")
    for bad in (
        {"path": "f", "offset": 0},
        {"path": "f", "limit": -1},
        {"path": "f", "limit": 1.5},
        {"path": "f", "limit": True},
    ):
        assert "integer >= 1" in fails(run("file_read", bad), "file_read")
    assert "path must be" in fails(run("file_read", {}), "file_read")


# ---- file_write --------------------------------------------------------------------------


def test_file_write_creates_parents(run: Run, cwd: Path) -> None:
    out = ok(run("file_write", {"path": "a/b/c.txt", "content": "héllo\n"}))
    assert out == "wrote 7 bytes to a/b/c.txt\n"
    assert (cwd / "a/b/c.txt").read_text() == "héllo\n"
    assert sorted(os.listdir(cwd / "a/b")) == ["c.txt"]  # no temp file left


def test_file_write_overwrites_keeping_the_mode(run: Run, cwd: Path) -> None:
    f = cwd / "script.sh"
    f.write_text("old\n")
    f.chmod(0o750)
    ok(run("file_write", {"path": "script.sh", "content": ""}))
    assert f.read_text() == ""
    assert f.stat().st_mode & 0o777 == 0o750


def test_file_write_writes_through_a_symlink(run: Run, cwd: Path) -> None:
    (cwd / "real.txt").write_text("old")
    (cwd / "link.txt").symlink_to("real.txt")
    ok(run("file_write", {"path": "link.txt", "content": "new"}))
    assert (cwd / "link.txt").is_symlink()
    assert (cwd / "real.txt").read_text() == "new"


def test_file_write_refuses_git(run: Run, cwd: Path) -> None:
    (cwd / ".git").mkdir()
    err = fails(run("file_write", {"path": ".git/config", "content": "x"}), "file_write")
    assert "refusing to write inside .git" in err
    (cwd / "sneaky").symlink_to(".git")
    err = fails(run("file_write", {"path": "sneaky/hooks/x", "content": "x"}), "file_write")
    assert "inside .git" in err
    assert os.listdir(cwd / ".git") == []


def test_file_write_errors(run: Run, cwd: Path) -> None:
    (cwd / "d").mkdir()
    assert "is a directory" in fails(run("file_write", {"path": "d", "content": ""}), "file_write")
    (cwd / "file").write_text("")
    err = fails(run("file_write", {"path": "file/x", "content": ""}), "file_write")
    assert err == "file_write: file/x: Not a directory\n"
    assert "content must be" in fails(run("file_write", {"path": "x"}), "file_write")


# ---- file_edit ---------------------------------------------------------------------------


def test_file_edit_replaces_a_unique_match(run: Run, cwd: Path) -> None:
    f = cwd / "m.py"
    f.write_text("a = 1\nb = 2\nc = 3\n")
    f.chmod(0o700)
    out = ok(run("file_edit", {"path": "m.py", "old": "b = 2", "new": "b = 20\nbb = 4"}))
    assert out == "edited m.py: 1 replacement at line 2\n"
    assert f.read_text() == "a = 1\nb = 20\nbb = 4\nc = 3\n"
    assert f.stat().st_mode & 0o777 == 0o700
    assert os.listdir(cwd) == ["m.py"]


def test_file_edit_ambiguous_and_replace_all(run: Run, cwd: Path) -> None:
    f = cwd / "m.txt"
    f.write_text("x\ny\nx\nx\n")
    err = fails(run("file_edit", {"path": "m.txt", "old": "x", "new": "z"}), "file_edit")
    assert "occurs 3 times in m.txt" in err
    assert f.read_text() == "x\ny\nx\nx\n"
    out = ok(run("file_edit", {"path": "m.txt", "old": "x", "new": "1\n2", "replace_all": True}))
    assert out == "edited m.txt: 3 replacements at lines 1, 4, 6\n"
    assert f.read_text() == "1\n2\ny\n1\n2\n1\n2\n"


def test_file_edit_keeps_bytes_that_are_not_utf8(run: Run, cwd: Path) -> None:
    f = cwd / "l1.txt"
    f.write_bytes(b"caf\xe9 = 1\n")
    ok(run("file_edit", {"path": "l1.txt", "old": "1", "new": "2"}))
    assert f.read_bytes() == b"caf\xe9 = 2\n"


def test_file_edit_errors(run: Run, cwd: Path) -> None:
    (cwd / "m.txt").write_text("abc\n")
    err = fails(run("file_edit", {"path": "m.txt", "old": "zzz", "new": "y"}), "file_edit")
    assert "old text not found in m.txt" in err
    err = fails(run("file_edit", {"path": "m.txt", "old": "abc", "new": "abc"}), "file_edit")
    assert "the same" in err
    err = fails(run("file_edit", {"path": "m.txt", "old": "", "new": "x"}), "file_edit")
    assert "old must be a non-empty string" in err
    err = fails(run("file_edit", {"path": "gone", "old": "a", "new": "b"}), "file_edit")
    assert err == "file_edit: gone: No such file or directory\n"
    (cwd / ".git").mkdir()
    (cwd / ".git/HEAD").write_text("ref\n")
    err = fails(run("file_edit", {"path": ".git/HEAD", "old": "ref", "new": "x"}), "file_edit")
    assert "refusing to edit inside .git" in err
    assert (cwd / ".git/HEAD").read_text() == "ref\n"


# ---- file_glob ---------------------------------------------------------------------------


def tree(root: Path, *paths: str) -> None:
    for p in paths:
        (root / p).parent.mkdir(parents=True, exist_ok=True)
        (root / p).write_text(p)


def test_file_glob(run: Run, cwd: Path) -> None:
    tree(cwd, "b.py", "a.py", "src/c.py", "src/deep/d.py", "src/e.txt", ".git/x.py", ".hid/h.py")
    out = ok(run("file_glob", {"pattern": "**/*.py"}))
    assert out == "a.py\nb.py\nsrc/c.py\nsrc/deep/d.py\n"
    assert ok(run("file_glob", {"pattern": "*"})) == "a.py\nb.py\nsrc/\n"
    assert ok(run("file_glob", {"pattern": "*.py", "path": "src"})) == "src/c.py\n"
    assert ok(run("file_glob", {"pattern": ".git/*"})) == "no files match .git/*\n"
    assert ok(run("file_glob", {"pattern": ".hid/*"})) == ".hid/h.py\n"
    out = ok(run("file_glob", {"pattern": str(cwd / "src" / "*.txt")}))
    assert out == f"{cwd}/src/e.txt\n"
    assert ok(run("file_glob", {"pattern": "*.rs", "path": "src"})) == (
        "no files match *.rs in src\n"
    )
    err = fails(run("file_glob", {"pattern": "*", "path": "a.py"}), "file_glob")
    assert err == "file_glob: a.py: not a directory\n"


def test_file_glob_caps_at_1000(run: Run, cwd: Path) -> None:
    for i in range(1005):
        (cwd / f"f{i:04}").write_text("")
    out = ok(run("file_glob", {"pattern": "f*"})).splitlines()
    assert len(out) == 1001
    assert out[999] == "f0999"
    assert out[1000] == "... 5 more matches not shown; narrow the pattern or path"


# ---- file_grep ---------------------------------------------------------------------------


def test_file_grep(run: Run, cwd: Path) -> None:
    tree(cwd, "src/a.py", "src/b.c", "src/c.h", ".git/config")
    (cwd / "src/a.py").write_text("def main():\n    return MAIN\n# main\n")
    (cwd / "src/b.c").write_text("int main(void) {}\n")
    (cwd / "src/c.h").write_text("int main(void);\n")
    (cwd / ".git/config").write_text("main\n")
    (cwd / "bin").write_bytes(b"main\0")
    out = ok(run("file_grep", {"pattern": r"main\("}))
    assert out == "src/a.py:1:def main():\nsrc/b.c:1:int main(void) {}\nsrc/c.h:1:int main(void);\n"
    out = ok(run("file_grep", {"pattern": "^#", "path": "src"}))
    assert out == "src/a.py:3:# main\n"
    out = ok(run("file_grep", {"pattern": "main", "glob": "*.py", "ignore_case": True}))
    assert out == "src/a.py:1:def main():\nsrc/a.py:2:    return MAIN\nsrc/a.py:3:# main\n"
    out = ok(run("file_grep", {"pattern": "main", "glob": "*.{c,h}"}))
    assert out == "src/b.c:1:int main(void) {}\nsrc/c.h:1:int main(void);\n"
    out = ok(run("file_grep", {"pattern": "void", "glob": "src/*.h"}))
    assert out == "src/c.h:1:int main(void);\n"
    out = ok(run("file_grep", {"pattern": "MAIN", "path": "src/a.py"}))
    assert out == "src/a.py:2:    return MAIN\n"
    out = ok(run("file_grep", {"pattern": "return", "path": str(cwd / "src")}))
    assert out == f"{cwd}/src/a.py:2:    return MAIN\n"
    assert ok(run("file_grep", {"pattern": "nothing"})) == "no matches for 'nothing'\n"


def test_file_grep_literal_prefilter_is_exact(run: Run, cwd: Path) -> None:
    (cwd / "f").write_text("alpha beta\ngamma\n")
    assert ok(run("file_grep", {"pattern": "a beta"})) == "f:1:alpha beta\n"
    assert ok(run("file_grep", {"pattern": "ALPHA", "ignore_case": True})) == "f:1:alpha beta\n"
    assert ok(run("file_grep", {"pattern": "beta$"})) == "f:1:alpha beta\n"
    assert ok(run("file_grep", {"pattern": "beta gamma"})) == "no matches for 'beta gamma'\n"


def test_file_grep_caps_and_cuts(run: Run, cwd: Path) -> None:
    (cwd / "many").write_text("hit\n" * 300)
    out = ok(run("file_grep", {"pattern": "hit"})).splitlines()
    assert len(out) == 251
    assert out[-1] == "... stopped after 250 matches; narrow the pattern, path or glob"
    (cwd / "many").write_text("hit" + "x" * 1000 + "\n")
    assert ok(run("file_grep", {"pattern": "hit"})) == "many:1:hit" + "x" * 297 + "...\n"


def test_file_grep_skips_fifos_and_huge_files(run: Run, cwd: Path) -> None:
    os.mkfifo(cwd / "pipe")  # opening it would block the search forever
    (cwd / "small").write_text("needle\n")
    with open(cwd / "huge", "wb") as f:
        f.truncate(33 << 20)  # sparse: 33 MiB of size, no disk
    out = ok(run("file_grep", {"pattern": "needle"}))
    assert out == "small:1:needle\n(1 files over 32 MiB not searched)\n"


def test_file_grep_errors(run: Run) -> None:
    err = fails(run("file_grep", {"pattern": "("}), "file_grep")
    assert err.startswith("file_grep: bad regex '(': missing ), unterminated subpattern")
    err = fails(run("file_grep", {"pattern": "x", "path": "nope"}), "file_grep")
    assert err == "file_grep: nope: No such file or directory\n"
    assert "pattern must be" in fails(run("file_grep", {}), "file_grep")


# ---- execute_code ------------------------------------------------------------------------


def test_execute_code_bash(run: Run, cwd: Path) -> None:
    r = run("execute_code", {"code": "pwd; echo out; echo err >&2; echo out2"})
    assert ok(r) == f"{cwd}\nout\nerr\nout2\n"


def test_execute_code_failure(run: Run) -> None:
    r = run("execute_code", {"code": "echo partial; exit 3"})
    assert (r.rc, r.out, r.err) == (1, "partial\nexit status 3\n", "")
    r = run("execute_code", {"code": "printf no-newline; kill -9 $$"})
    assert (r.rc, r.out) == (1, "no-newline\nkilled by signal 9\n")


def test_execute_code_python_and_sh(run: Run, env: dict[str, str]) -> None:
    code = "import os, sys\nprint(os.environ['OLLIE_SESSION_ID'])\nprint(1/0)\n"
    r = run("execute_code", {"code": code, "language": "python"})
    assert r.rc == 1
    assert r.out.startswith(f"{SESSION}\nTraceback")
    assert "    print(1/0)\n" in r.out  # the source line: the code ran from a file
    assert r.out.endswith("ZeroDivisionError: division by zero\nexit status 1\n")
    assert ok(run("execute_code", {"code": "echo $0 | grep -c code-", "language": "sh"})) == "1\n"
    assert os.listdir(env["TMPDIR"]) == []


def test_execute_code_output_keeps_head_and_tail(run: Run) -> None:
    r = run("execute_code", {"code": "seq 1 100000"})
    out = ok(r)
    assert out.startswith("1\n2\n3\n")
    assert out.endswith("99999\n100000\n")
    assert re.search(r"\n\[\.\.\. \d+ bytes of output omitted \.\.\.\]\n", out)
    assert len(out) < 33 * 1024


def test_execute_code_quiet_and_errors(run: Run) -> None:
    assert ok(run("execute_code", {"code": "true"})) == "(no output)\n"
    assert ok(run("execute_code", {"code": "read x; echo ${x:-eof}"})) == "eof\n"
    err = fails(run("execute_code", {"code": "x", "language": "ruby"}), "execute_code")
    assert "language must be bash, sh or python" in err
    assert "code must be a string" in fails(run("execute_code", {}), "execute_code")


# ---- reasoning_think, subagent_spawn -----------------------------------------------------


def test_reasoning_think(run: Run) -> None:
    assert ok(run("reasoning_think", {"thought": "first read the tests"})) == "ok\n"
    assert "thought must be a string" in fails(run("reasoning_think", {}), "reasoning_think")


def test_subagent_spawn_needs_the_tree(run: Run, env: dict[str, str]) -> None:
    """Where $OLLIE is no olliefs tree it says what failed, one line (the e2e tests drive
    the real thing)."""
    r = run("subagent_spawn", {"name": "child", "prompt": "do it"})
    assert (r.rc, r.out) == (1, "")
    new = os.path.join(env["OLLIE"], "s", "new")
    assert r.err == f"subagent_spawn: {new}: No such file or directory\n"


# ---- memory ------------------------------------------------------------------------------


def test_memory_remember_appends_notes(run: Run, env: dict[str, str]) -> None:
    memory = Path(env["OLLIE_MEMORY_DIR"])
    out = ok(run("memory_remember", {"text": "  the build uses meson \n"}))
    assert re.fullmatch(r"remembered in notes\.md \(\d+ bytes\)\n", out)
    ok(run("memory_remember", {"text": "second"}))
    out = ok(run("memory_remember", {"text": "x", "name": "../Project ideas!.md"}))
    assert out.startswith("remembered in Project-ideas.md ")
    assert sorted(os.listdir(memory)) == ["Project-ideas.md", "notes.md"]
    text = (memory / "notes.md").read_text()
    header = rf"## \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{{4}} \(session {SESSION}\)"
    assert re.fullmatch(f"{header}\n\nthe build uses meson\n\n{header}\n\nsecond\n\n", text), text


def test_memory_remember_errors(run: Run, env: dict[str, str]) -> None:
    assert "text must be" in fails(run("memory_remember", {"text": "  "}), "memory_remember")
    err = fails(run("memory_remember", {"text": "x", "name": 3}), "memory_remember")
    assert "name must be a string" in err
    Path(env["OLLIE_MEMORY_DIR"]).write_text("a file, not a dir")
    err = fails(run("memory_remember", {"text": "x"}), "memory_remember")
    assert "File exists" in err or "Not a directory" in err


def test_memory_recall(run: Run, env: dict[str, str]) -> None:
    assert ok(run("memory_recall", {})) == "no memory notes yet\n"
    ok(run("memory_remember", {"text": "The build uses Meson"}))
    ok(run("memory_remember", {"text": "tests run with pytest -W error"}))
    ok(run("memory_remember", {"text": "deploy with meson install", "name": "ops"}))
    memory = Path(env["OLLIE_MEMORY_DIR"])
    (memory / "hand.txt").write_text("Written by hand.\nMeson version 1.2\n")
    (memory / ".hidden").write_text("meson")

    listing = ok(run("memory_recall", {})).splitlines()
    assert [row.split("\t")[0] for row in listing] == ["hand.txt", "notes.md", "ops.md"]
    assert listing[1].endswith("2 notes")
    assert listing[0] == "hand.txt\t35 bytes, 1 note"

    out = ok(run("memory_recall", {"query": "MESON build"}))
    assert out.startswith("[notes.md]\n## ")
    assert out.endswith("\n\nThe build uses Meson\n")
    out = ok(run("memory_recall", {"query": "meson"}))
    assert [line for line in out.splitlines() if line.startswith("[")] == [
        "[hand.txt]",
        "[notes.md]",
        "[ops.md]",
    ]
    assert "Written by hand.\nMeson version 1.2" in out
    assert ok(run("memory_recall", {"query": "rust"})) == "no notes match 'rust'\n"
    assert "query must be" in fails(run("memory_recall", {"query": 1}), "memory_recall")


# ---- client_9p ---------------------------------------------------------------------------


@pytest.fixture
def ollie(env: dict[str, str]) -> Path:
    """A plain directory laid out like the mounted tree."""
    root = Path(env["OLLIE"])
    me = root / "s" / SESSION
    (me / "ctl").write_text("")
    (me / "chat").write_text("user: hi\nassistant: hello\n")
    (me / "state").write_text("idle\n")
    (root / "s" / "other").mkdir()
    (root / "s" / "other" / "plan").write_text("other's plan\n")
    (root / "s" / "idx").write_text(f"{SESSION}\tidle\t/x\topenai\tm\n")
    (root / "t").mkdir()
    (root / "t" / "idx").write_text("file_read\n")
    (root / "help").write_text("")
    (root / "m").mkdir()
    return root


def test_client_9p_write_ctl(run: Run, ollie: Path) -> None:
    ctl = ollie / "s" / SESSION / "ctl"
    out = ok(run("client_9p", {"op": "write", "path": "ctl", "data": "tool_load file_read"}))
    assert out == f"wrote 20 bytes to /s/{SESSION}/ctl\n"
    assert ctl.read_text() == "tool_load file_read\n"
    ok(run("client_9p", {"op": "write", "path": "ctl", "data": "stop\n"}))
    assert ctl.read_text() == "stop\n"
    ok(run("client_9p", {"op": "write", "path": "ctl", "data": ""}))
    assert ctl.read_text() == "\n"
    out = ok(run("client_9p", {"op": "write", "path": "/m/new-note", "data": "é"}))
    assert out == "wrote 3 bytes to /m/new-note\n"
    assert (ollie / "m" / "new-note").read_text() == "é\n"


def test_client_9p_paths(run: Run, ollie: Path) -> None:
    assert ok(run("client_9p", {"op": "read", "path": "chat"})) == "user: hi\nassistant: hello\n"
    assert ok(run("client_9p", {"op": "read", "path": "./state"})) == "idle\n"
    assert ok(run("client_9p", {"op": "read", "path": "/t/idx"})) == "file_read\n"
    assert ok(run("client_9p", {"op": "read", "path": "../other/plan"})) == "other's plan\n"
    assert ok(run("client_9p", {"op": "read", "path": "/s/../s/./idx"})).startswith(SESSION)
    assert ok(run("client_9p", {"op": "read", "path": f"{ollie}/t/idx"})) == "file_read\n"
    assert ok(run("client_9p", {"op": "read", "path": "/help"})) == "(empty)\n"


@pytest.mark.parametrize("path", ["../../..", "/..", "/s/../../etc/passwd", "../../../x"])
def test_client_9p_refuses_climbing_out(run: Run, ollie: Path, path: str) -> None:
    err = fails(run("client_9p", {"op": "read", "path": path}), "client_9p")
    assert err == f"client_9p: {path}: '..' climbs above the root of the ollie tree\n"


@pytest.mark.parametrize(
    "path", ["stream", "events", "statewait", "fifo.out", "/events", "/s/other/stream"]
)
def test_client_9p_refuses_blocking_files(run: Run, ollie: Path, path: str) -> None:
    err = fails(run("client_9p", {"op": "read", "path": path}), "client_9p")
    assert "refusing to read" in err
    assert "blocks" in err


def test_client_9p_reads_other_files_without_blocking(run: Run, ollie: Path) -> None:
    """An unlisted blocking file is opened O_NONBLOCK: a FIFO with no data reads as empty."""
    os.mkfifo(ollie / "s" / SESSION / "newpipe")
    r = run("client_9p", {"op": "read", "path": "newpipe"})
    assert ok(r) == "(empty)\n"


def test_client_9p_ls(run: Run, ollie: Path) -> None:
    assert ok(run("client_9p", {"op": "ls", "path": "/"})) == "help\nm/\ns/\nt/\n"
    assert ok(run("client_9p", {"op": "ls"})) == "chat\nctl\nstate\n"
    assert ok(run("client_9p", {"op": "ls", "path": "/s"})) == f"{SESSION}/\nidx\nother/\n"
    assert ok(run("client_9p", {"op": "ls", "path": "/t/idx"})) == "/t/idx\n"
    (ollie / "empty").mkdir()
    assert ok(run("client_9p", {"op": "ls", "path": "/empty"})) == "(empty directory)\n"


def test_client_9p_errors(run: Run, ollie: Path, env: dict[str, str]) -> None:
    err = fails(run("client_9p", {"op": "read", "path": "nope"}), "client_9p")
    assert err == f"client_9p: /s/{SESSION}/nope: No such file or directory\n"
    err = fails(run("client_9p", {"op": "ls", "path": "/nope"}), "client_9p")
    assert err == "client_9p: /nope: No such file or directory\n"
    err = fails(run("client_9p", {"op": "write", "path": "/no/dir", "data": "x"}), "client_9p")
    assert err == "client_9p: /no/dir: No such file or directory\n"
    assert "is a directory" in fails(run("client_9p", {"op": "read", "path": "/s"}), "client_9p")
    err = fails(run("client_9p", {"op": "write", "path": "ctl"}), "client_9p")
    assert "data must be a string" in err
    assert "op must be" in fails(run("client_9p", {"op": "rm", "path": "ctl"}), "client_9p")
    assert "path must be" in fails(run("client_9p", {"op": "read"}), "client_9p")


def test_execute_code_ends_with_the_program_not_its_background_children(
    env: dict[str, str], cwd: Path
) -> None:
    """A background child that keeps the output pipe open holds nothing: the result is
    what the program printed, with a note; a child that writes on and on neither."""
    for code, expect in (
        ("sleep 1000 & echo hi", "hi\n"),
        ("yes &\nprintf 'done\\n' >&2", ""),
    ):
        proc = subprocess.Popen(
            [str(TOOLS / "execute_code")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            start_new_session=True,  # (its group is the children's, ended below)
        )
        try:
            out, err = proc.communicate(json.dumps({"code": code}).encode(), timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):  # (yes dies of SIGPIPE)
                os.killpg(proc.pid, 9)
            proc.wait()
        assert (proc.returncode, err) == (0, b""), (out, err)
        text = out.decode()
        assert text.startswith(expect), text
        assert text.endswith(
            "[background processes were still running when the program exited: "
            "they end with this call]\n"
        ), text


def test_tool_search_ranks_the_tools_the_session_may_load(env: dict[str, str], run: Run) -> None:
    session = Path(env["OLLIE"]) / "s" / SESSION
    (session / "t").mkdir()
    schema = '{"type":"object"}'
    many = [f"mcp_big_op{i}\tDo thing number {i}.\t{schema}\thot\tserial" for i in range(300)]
    lines = [
        f"file_read\tRead a text file with line numbers.\t{schema}\tcold\tparallel",
        f"mcp_time_get_current_time\tGet the current time in a timezone.\t{schema}\tcold\tparallel",
        f"mcp_time_convert_time\tConvert a time between timezones.\t{schema}\tcold\tparallel",
        *many,
    ]
    (session / "t" / "idx").write_text("\n".join(lines) + "\n")
    (session / "tools").write_text(
        "client_9p\thot\tserial\nmcp_time_convert_time\tcold\tparallel\n"
    )
    r = run("tool_search", {"query": "current time zone"})
    assert r.rc == 0, r.err
    out = r.out.splitlines()
    assert out[0].startswith("mcp_time_get_current_time (not loaded): Get the current time")
    assert out[1].startswith("mcp_time_convert_time (loaded):")
    assert "tool_load NAME" in out[-1] and not any("file_read" in x for x in out)
    r = run("tool_search", {"query": "thing", "limit": 3})
    assert r.rc == 0 and "... 297 more match" in r.out
    r = run("tool_search", {"query": "quantum teleport"})
    assert r.rc == 0 and "no tool matches" in r.out
    for bad in ({}, {"query": "  "}, {"query": "x", "limit": 0}):
        r = run("tool_search", bad)
        assert r.rc == 1 and r.err.startswith("tool_search: "), bad
