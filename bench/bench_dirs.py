"""The folders on disk (m/, tmp/): what going through the mount costs against the disk.

Run: ``.venv/bin/python bench/bench_dirs.py`` (root, /dev/fuse). Prints medians and ratios
against the same operations on the backing folder itself, measured in the same run; it
asserts nothing.

(a) write 32 MiB in 128 KiB writes and fsync, then read it back (``tmp/big``);
(b) ``sed -i`` of a 1 MiB note (``m/note``): a temp file, a chmod, a rename;
(c) create, stat and remove 500 small files (``tmp/many/``).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from olliefs.replay import ReplayServer
from olliefs.testing import Daemon

ROUNDS = 5
CHUNK = 128 * 1024
BIG = 32 * 1024 * 1024


def timed(fn: Callable[[], None]) -> float:
    times = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def write_read(path: Path) -> None:
    block = os.urandom(CHUNK)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(BIG // CHUNK):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    with open(path, "rb", buffering=0) as f:
        while f.read(CHUNK):
            pass
    os.unlink(path)


def sed_i(path: Path) -> None:
    subprocess.run(["sed", "-i", "s/a/b/;s/b/a/", str(path)], check=True)


def many(folder: Path) -> None:
    folder.mkdir()
    for i in range(500):
        (folder / f"f{i}").write_bytes(b"x")
    for i in range(500):
        os.stat(folder / f"f{i}")
    for i in range(500):
        os.unlink(folder / f"f{i}")
    folder.rmdir()


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp, ReplayServer() as replay:
        d = Daemon(Path(tmp), replay, {})
        with d.running():
            scratch, memory = d.home / "data" / "scratch", d.home / "data" / "memory"
            note = "".join(f"line {i} aaaa\n" for i in range(70000))  # about 1 MiB
            (memory / "note").write_text(note)
            rows = [
                ("write+fsync+read 32 MiB", lambda p: write_read(p / "big"), "tmp", scratch),
                ("sed -i of a 1 MiB note", lambda p: sed_i(p / "note"), "m", memory),
                ("500 files: create, stat, rm", lambda p: many(p / "many"), "tmp", scratch),
            ]
            print(f"{'operation':32} {'mount':>10} {'disk':>10} {'ratio':>7}")
            for name, op, top, disk in rows:
                through = timed(lambda op=op, top=top: op(d.p(top)))  # type: ignore[misc]
                direct = timed(lambda op=op, disk=disk: op(disk))  # type: ignore[misc]
                print(
                    f"{name:32} {through * 1e3:8.1f}ms {direct * 1e3:8.1f}ms "
                    f"{through / direct:6.1f}x"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
