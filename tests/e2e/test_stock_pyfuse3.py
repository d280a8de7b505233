"""olliefs installed as ``pip install`` installs it: with stock pyfuse3 from PyPI; and
``ollie build-pyfuse3``, which puts the patched one in its place.

A second venv gets pyfuse3 3.5.0 built from its sdist as released and the project
(editable, so it runs the code under test); the daemon runs from it. It must mount, serve
a turn, list directories, let poll sleep, end the read of a blocked opener on its
Ctrl-C (no FUSE_INTERRUPT there: the opener's pending signals are watched), and say once
in its log, as ``ollie doctor`` does, what it does without the patches.

The venv takes a minute to make (the sdist's build most of it); it is made once and kept
in pytest's cache, keyed by what went into it, so later runs only check it is there.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from olliefs.fs import patched
from olliefs.replay import ReplayServer
from olliefs.testing import HAVE_FUSE, Daemon, expect_log
from tests.fs.test_blocking import end, gone, start_reader
from tests.fs.test_poll import follow, result

pytestmark = pytest.mark.skipif(not HAVE_FUSE, reason="needs /dev/fuse (mounts for real)")

ROOT = Path(__file__).parents[2]
STOCK = "pyfuse3==3.5.0"


def _key() -> str:
    """What the venv is made of: a change of any of it makes a new one."""
    h = hashlib.sha256()
    for part in (STOCK, sys.version, str(ROOT), (ROOT / "pyproject.toml").read_text()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _pip(python: Path, *args: str) -> None:
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, f"pip install {' '.join(args)} failed:\n{done.stderr}"


@pytest.fixture(scope="session")
def stock_python(request: pytest.FixtureRequest) -> Iterator[Path]:
    """The python of a venv with stock pyfuse3 and olliefs; made once, then kept."""
    key = _key()
    cache = Path(request.config.cache.mkdir("stock-pyfuse3"))
    venv = cache / key
    python = venv / "bin" / "python"
    with open(cache / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another pytest run may be making it
        if not (venv / "made").is_file():
            for old in cache.iterdir():  # venvs of other keys: outdated
                if old.is_dir():
                    shutil.rmtree(old)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
            _pip(python, "--no-binary", "pyfuse3", STOCK)
            _pip(python, "-e", str(ROOT))
            (venv / "made").write_text(key + "\n")
    probe = subprocess.run(
        [str(python), "-c", "import pyfuse3; print(hasattr(pyfuse3, 'current_request'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout == "False\n", "the venv's pyfuse3 is not stock"
    yield python


def test_doctor_names_what_stock_pyfuse3_lacks(stock_python: Path, tmp_path: Path) -> None:
    env = {**os.environ, "OLLIE_HOME": str(tmp_path / "home"), "OLLIE_OPENAI_URL": "http://x"}
    r = subprocess.run(
        [str(stock_python), "-m", "olliefs", "doctor"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    (line,) = [x for x in r.stdout.splitlines() if x.split(":")[0].split()[-1] == "pyfuse3"]
    assert line.startswith("FAIL pyfuse3: 3.5.0 mounts, without olliefs's patches: ")
    assert "no FUSE_INTERRUPT (interrupt.patch): Ctrl-C and kill end a blocked read" in line
    assert "a reader that inherited the descriptor" in line and "cannot be interrupted" in line
    assert "PollHandle" not in line  # 3.5.0 has poll
    assert line.endswith(
        "-> fix: ollie build-pyfuse3 (as root: apt-get install libfuse3-dev pkg-config gcc first)"
    )
    assert r.returncode == 1


def test_stock_pyfuse3_mounts_serves_and_lets_an_opener_go(
    stock_python: Path, tmp_path: Path, replay: ReplayServer
) -> None:
    daemon = Daemon(tmp_path, replay, {})
    daemon.python = str(stock_python)
    expect_log(r"olliefs\.daemon: pyfuse3 3\.5\.0 lacks olliefs's patches")
    with daemon.running():
        lines = [x for x in daemon.stderr().splitlines() if "lacks olliefs's patches" in x]
        assert len(lines) == 1 and " WARNING " in lines[0], daemon.stderr()
        assert "pyfuse3 3.5.0 lacks olliefs's patches (ollie build-pyfuse3 builds them)" in lines[0]

        sid = daemon.new(name="stock")
        assert sid in os.listdir(daemon.p("s"))  # readdir, one entry at a time
        follower = follow(daemon, f"s/{sid}/stream", "epoll", "assistant: echo: hi\n")
        try:
            daemon.prompt(sid, "hi")
            got = result(follower)
        finally:
            follower.kill()
            follower.wait()
        assert got["spurious"] == 0, got
        daemon.wait_idle(sid)
        assert daemon.read(f"s/{sid}/chat").endswith("user: hi\nassistant: echo: hi\n")

        # Ctrl-C of a reader blocked in a read of the file it opened ends the read.
        for rel in ("stream", "statewait", "events"):
            proc, reader = start_reader(daemon, ["cat", "{}"], f"s/{sid}/{rel}")
            try:
                assert reader == proc.pid  # cat opened the file itself
                os.killpg(proc.pid, signal.SIGINT)
                assert proc.wait(timeout=20) == -signal.SIGINT  # a deadline, not a timing
                assert gone(reader)
            finally:
                end(daemon, proc)
        assert daemon.read(f"s/{sid}/state") == "idle\n"


# ---- ollie build-pyfuse3 -----------------------------------------------------------------


def _series() -> list[str]:
    lines = (ROOT / ".ci" / "pyfuse3" / "series").read_text().splitlines()
    return [line for line in lines if line and not line.startswith("#")]


def test_the_package_ships_the_build(tmp_path: Path) -> None:
    """A wheel (what pip and pipx install) holds the build script, the series and every
    patch it names: ``ollie build-pyfuse3`` works from any install. Built from a copy
    of the tree as a fresh clone has it (an in-tree build/ would lend its old files)."""
    src = tmp_path / "src"
    junk = shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", ".*_cache", "__pycache__"
    )
    shutil.copytree(ROOT, src, ignore=junk)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(src)],
        check=True,
        timeout=600,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("olliefs-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("build.sh", "series", *_series()):
        assert f"olliefs/_pyfuse3/{name}" in names, name
    assert {n for n in os.listdir(ROOT / ".ci" / "pyfuse3") if n.endswith(".patch")} == set(
        _series()
    )


def test_build_pyfuse3_says_what_it_needs(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "olliefs", "build-pyfuse3"],
        env={**os.environ, "PATH": str(tmp_path)},  # no compiler, no bash, nothing
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == (
        "ollie: building pyfuse3 needs bash, gcc, pkg-config, patch:"
        " apt-get install gcc pkg-config patch libfuse3-dev (as root)\n"
    )


def test_build_pyfuse3_leaves_this_build_alone() -> None:
    """The environment the tests run in has the build of this checkout (.ci/setup made
    it): the command finds it there and changes nothing."""
    local = re.search(r"^LOCAL=(\S+)", (ROOT / ".ci" / "pyfuse3" / "build.sh").read_text(), re.M)
    assert local is not None
    if patched.build() != f"3.5.0+{local.group(1)}":
        pytest.skip(reason=f"this venv has pyfuse3 {patched.build()}: run .ci/setup")
    r = subprocess.run(
        [sys.executable, "-m", "olliefs", "build-pyfuse3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith(
        "done; a running daemon uses it from its next start (ollie umount; ollie mount)\n"
    )
    assert patched.build() == f"3.5.0+{local.group(1)}"
