"""A client with only Python's standard library exercises every file of the tree.

tests/clients/stdlib_client.py runs in its own interpreter with ``-I -S`` (no site
packages, so nothing of olliefs nor any third-party module can leak in) against a real
mount whose replay server plays the client's own script (``--script``), in the order of
its model requests. The client checks everything itself and ends by walking the tree:
a kind of file it did not exercise fails it, so a file added to the tree must be taught
to it.
"""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

from olliefs.testing import Daemon
from tests.conftest import oserror, script

CLIENT = Path(__file__).with_name("stdlib_client.py")


def test_stdlib_client_exercises_every_file(daemon: Daemon, tmp_path: Path) -> None:
    py = [sys.executable, "-I", "-S", str(CLIENT)]
    entries = subprocess.run([*py, "--script"], capture_output=True, text=True, check=True)
    daemon.replay.add(script(*entries.stdout.splitlines()))
    work = tmp_path / "a work dir"  # a cwd with a space, given quoted
    work.mkdir()
    run = subprocess.run(
        [*py, str(daemon.path), str(work)],
        cwd=work,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,  # a deadline for a hang, not a timing
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "stdlib client ok" in run.stdout
    # Every scripted answer was asked for, and nothing more: the client's requests are
    # the ones it planned (a refused prompt never reached the model).
    assert len(daemon.replay.requests) == len(entries.stdout.splitlines())


def test_a_refused_skill_says_why(daemon: Daemon) -> None:
    """A SKILL.md is checked at close, whose errors shells ignore: the reason must be in
    the root err and on the root events (the stdlib client found it missing)."""
    skill = "---\nname: greet\ndescription: say hello\n---\nSay hello.\n"
    daemon.p("sk/greet.md").write_text(skill)
    # bash ignores close(2)'s error, as with a user's echo: only err can tell.
    subprocess.run(["bash", "-c", 'echo "no front matter" > sk/greet.md'], cwd=daemon.path)
    assert daemon.read("sk/greet.md") == skill
    assert "SKILL.md must start with a '---' front matter line" in daemon.read("err")
    assert oserror(lambda: open(daemon.p("sk/bad name.md"), "w")) == errno.EINVAL
    assert "sk/ holds only <name>.md skill files" in daemon.read("err")
    events = daemon.snapshot("events")
    assert "SKILL.md must start with" in events and "sk/ holds only" in events
