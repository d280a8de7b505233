"""Daemon memory: resident set at start, after 1,000 sessions made and removed, during and
after a 10 MB reply. Prints a table; asserts nothing (the bounds are tested in
tests/e2e/test_memory.py).

    .venv/bin/python bench/bench_memory.py
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from olliefs.replay import Entry, ReplayServer
from olliefs.testing import Daemon

MB = 1024 * 1024


def rss(d: Daemon) -> float:
    assert d.proc is not None
    with open(f"/proc/{d.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    rows: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp, ReplayServer() as replay:
        d = Daemon(Path(tmp), replay, {})
        with d.running():
            rows.append(("started", rss(d)))
            start = time.monotonic()
            for i in range(1000):
                fd = os.open(d.p("s/new"), os.O_RDWR)
                os.write(fd, f"cwd={d.work} name=c{i}\n".encode())
                sid = os.pread(fd, 256, 0).decode().strip()
                os.close(fd)
                for name in ("chat", "cfg", "state"):
                    d.p(f"s/{sid}/{name}").read_bytes()
            rows.append(("1,000 sessions alive", rss(d)))
            for i in range(1000):
                shutil.rmtree(d.p(f"s/c{i}"))
            rows.append(("... and removed", rss(d)))
            churn = time.monotonic() - start
            replay.add(Entry(reply="x" * (10 * MB), chunk=4096) for _ in range(1))
            sid = d.new(name="big")
            d.prompt(sid, "big")
            d.wait_idle(sid)
            rows.append(("after a 10 MB reply (session alive)", rss(d)))
            shutil.rmtree(d.p(f"s/{sid}"))
            time.sleep(0.5)
            rows.append(("... and the session removed", rss(d)))
    print(f"{'daemon RSS':40} {'MB':>8}")
    for name, mb in rows:
        print(f"{name:40} {mb:8.1f}")
    print(f"(1,000 creates + removes took {churn:.1f} s)")


if __name__ == "__main__":
    main()
