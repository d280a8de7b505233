"""toolsrv benchmark: a tool call round trip against spawning the same program directly.

Run: ``.venv/bin/python bench/bench_toolsrv.py`` (Linux with Landlock). Prints medians and
the ratio against a reference measured in the same run; it asserts nothing.

Measured: olliefs' tool client (``ToolsrvConn.call``, the code the agent's dispatch runs)
-> 9P over the unix socket -> toolsrv -> a sandboxed process (own process group, Landlock,
limits) running ``/usr/bin/true`` as the tool's interpreter -> result JSON back.
Reference: ``subprocess.run(["true"])`` from the same process. Both sides pause GAP
between calls (an agent never calls tools back to back: the model answers in between).
Target (issue 3): under 3x.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from olliefs.testing import running_toolsrv

CALLS = 400
WARMUP = 20
# An agent calls tools between model replies, never back to back; the pause lets the
# client's background work (the next proc slot) happen where it happens in real use.
GAP = 0.005

TRUE_TOOL = """#!{true}
# ollie-tool
# description: does nothing, successfully (benchmark)
# args: {{"type": "object", "properties": {{}}}}
# parallel: true
"""


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def reference(n: int) -> list[float]:
    true = shutil.which("true") or "/usr/bin/true"
    out = []
    for _ in range(n):
        time.sleep(GAP)
        t0 = time.perf_counter()
        subprocess.run([true], check=True)
        out.append(time.perf_counter() - t0)
    return out


async def through_toolsrv(base: Path, n: int) -> tuple[list[float], list[float]]:
    tools = base / "tools"
    tools.mkdir()
    tool = tools / "nothing"
    tool.write_text(TRUE_TOOL.format(true=shutil.which("true") or "/usr/bin/true"))
    tool.chmod(0o755)
    work = base / "work"
    work.mkdir()
    with running_toolsrv(base, tools_dirs=(tools,)) as srv:
        async with srv.agent("bench", "nothing") as conn:
            env = {"OLLIE_SESSION_ID": "bench"}
            for _ in range(WARMUP):
                await conn.call("nothing", {}, str(work), env)
            calls, reads = [], []
            for _ in range(n):
                await trio.sleep(GAP)
                t0 = time.perf_counter()
                res = await conn.call("nothing", {}, str(work), env)
                calls.append(time.perf_counter() - t0)
                assert not res.isError, res.text
                t0 = time.perf_counter()
                await conn.rev()
                reads.append(time.perf_counter() - t0)
    return calls, reads


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        ref = reference(WARMUP)  # warm the page cache and the allocator
        ref = reference(CALLS)
        calls, reads = trio.run(through_toolsrv, Path(d), CALLS)
        ref2 = reference(CALLS)  # again, to see drift over the run
    r = median_us(ref + ref2)
    c = median_us(calls)
    print(f"python {sys.version.split()[0]}, {CALLS} calls each")
    print(f"subprocess.run(['true'])            median {r:8.0f} us")
    p90 = statistics.quantiles(calls, n=10)[-1] * 1e6
    print(f"tool call via 9P + toolsrv + sandbox median {c:8.0f} us  (p90 {p90:.0f} us)")
    print(f"one small 9P file read (agent/rev)   median {median_us(reads):8.0f} us")
    print(f"ratio tool call / subprocess: {c / r:.2f}x (target < 3x)")


if __name__ == "__main__":
    main()
