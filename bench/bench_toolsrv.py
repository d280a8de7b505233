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

CALLS = 600
WARMUP = 20
# Two paces: back to back (CPUs stay busy), and with a pause between calls as an agent
# makes them (the model answers in between; the client makes the next proc slot then).
# On a VM an idle vCPU wakes slowly, which weighs on both sides of the ratio.
GAPS = (0.0, 0.005)

TRUE_TOOL = """#!{true}
# ollie-tool
# description: does nothing, successfully (benchmark)
# args: {{"type": "object", "properties": {{}}}}
# parallel: true
"""


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def run_true(true: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([true], check=True)
    return time.perf_counter() - t0


async def measure(base: Path, n: int) -> dict[float, tuple[list[float], list[float], list[float]]]:
    """Tool calls and the reference, interleaved one for one, so that the machine's drift
    (this is a shared VM) weighs on both the same."""
    true = shutil.which("true") or "/usr/bin/true"
    tools = base / "tools"
    tools.mkdir()
    tool = tools / "nothing"
    tool.write_text(TRUE_TOOL.format(true=true))
    tool.chmod(0o755)
    work = base / "work"
    work.mkdir()
    out = {}
    with running_toolsrv(base, tools_dirs=(tools,), log_level="INFO") as srv:
        async with srv.agent("bench", "nothing") as conn:
            env = {"OLLIE_SESSION_ID": "bench"}
            for _ in range(WARMUP):
                await conn.call("nothing", {}, str(work), env)
                run_true(true)
            for gap in GAPS:
                calls, refs, reads = [], [], []
                for _ in range(n):
                    await trio.sleep(gap)
                    refs.append(run_true(true))
                    await trio.sleep(gap)
                    t0 = time.perf_counter()
                    res = await conn.call("nothing", {}, str(work), env)
                    calls.append(time.perf_counter() - t0)
                    assert not res.isError, res.text
                    t0 = time.perf_counter()
                    await conn.rev()
                    reads.append(time.perf_counter() - t0)
                out[gap] = (calls, refs, reads)
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        results = trio.run(measure, Path(d), CALLS)
    print(f"python {sys.version.split()[0]}, {CALLS} calls each, interleaved with the reference")
    for gap, (calls, refs, reads) in results.items():
        r = median_us(refs)
        c = median_us(calls)
        p90 = statistics.quantiles(calls, n=10)[-1] * 1e6
        print(f"-- {gap * 1000:g} ms between calls")
        print(f"subprocess.run(['true'])             median {r:8.0f} us")
        print(f"tool call via 9P + toolsrv + sandbox median {c:8.0f} us  (p90 {p90:.0f} us)")
        print(f"one small 9P file read (agent/rev)   median {median_us(reads):8.0f} us")
        print(f"ratio tool call / subprocess: {c / r:.2f}x (target < 3x)")


if __name__ == "__main__":
    main()
