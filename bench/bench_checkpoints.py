"""Checkpoints benchmark: what capturing a tool call's changes adds to the call.

Run: ``.venv/bin/python bench/bench_checkpoints.py`` (root, Linux with Landlock and
overlayfs). Prints medians; it asserts nothing.

Measured: olliefs' tool client (``ToolsrvConn.call``) -> toolsrv -> a sandboxed tool that
writes one file (``echo`` into ``out.txt``, a new content each call) in a cwd of 50,000
files in 5,000 directories, with capture (``capture`` and ``turn`` in the request: the
overlay over the cwd, the walk of its upper dir, the blobs and the record synced, the
file moved into place) and without (the same call writing the cwd directly).
Interleaved: one call without, one with, so that each pair finds the machine alike.

Target (checkpoints): the capture adds under 5 ms to such a call.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

from olliefs.testing import running_toolsrv

CALLS = 200
WARMUP = 10
SESSION = "bench"

WRITE_TOOL = """#!/bin/sh
# ollie-tool
# description: writes one file in the cwd (benchmark)
# args: {"type": "object", "properties": {}}
echo "$$" > out.txt
"""


def tree(root: Path, dirs: int = 5000, files_per_dir: int = 10) -> int:
    for i in range(dirs):
        d = root / f"p{i % 50}" / f"m{i // 50 % 10}" / f"d{i}"
        d.mkdir(parents=True)
        for j in range(files_per_dir):
            (d / f"f{j}").write_bytes(b"x\n")
    (root / ".git").mkdir()
    return dirs * files_per_dir


async def measure(base: Path, n: int) -> tuple[list[float], list[float], int]:
    tools = base / "tools"
    tools.mkdir()
    (tools / "write_one").write_text(WRITE_TOOL)
    (tools / "write_one").chmod(0o755)
    work = base / "work"
    files = tree(work)
    capture_dir = base / "checkpoints"
    extra = ("--capture-dir", str(capture_dir))
    with running_toolsrv(base, tools_dirs=(tools,), log_level="INFO", extra_args=extra) as srv:
        async with srv.agent(SESSION, "write_one") as conn:
            env = {"OLLIE_SESSION_ID": SESSION}

            async def call(capture: bool) -> float:
                t0 = time.perf_counter()
                key = (SESSION, 1, False) if capture else ("", 0, False)
                res = await conn.call("write_one", {}, str(work), env, key)
                assert not res.isError, res.text
                return time.perf_counter() - t0

            for _ in range(WARMUP):
                await call(False)
                await call(True)
            plain, captured = [], []
            for _ in range(n):
                plain.append(await call(False))
                captured.append(await call(True))
    records = len(list((capture_dir / SESSION / "rec").glob("*.json")))
    assert records == WARMUP + n, records  # each captured call made its record
    return plain, captured, files


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-cp-") as d:
        plain, captured, files = trio.run(measure, Path(d), CALLS)
    p = statistics.median(plain) * 1e3
    c = statistics.median(captured) * 1e3
    p90 = statistics.quantiles(captured, n=10)[-1] * 1e3
    print(f"python {sys.version.split()[0]}, {CALLS} calls each, cwd of {files} files")
    print(
        f"call writing one file: without capture {p:.2f} ms, with capture {c:.2f} ms "
        f"(p90 {p90:.2f} ms): capture adds {c - p:.2f} ms (target < 5 ms)"
    )


if __name__ == "__main__":
    main()
