"""toolsrv benchmark: a tool call round trip against spawning the same program directly.

Run: ``.venv/bin/python bench/bench_toolsrv.py`` (Linux with Landlock). Prints medians and
the ratio against a reference measured in the same run; it asserts nothing.

Measured: olliefs' tool client (``ToolsrvConn.call``, the code the agent's dispatch runs)
-> 9P over the unix socket -> toolsrv -> a sandboxed process (own process group, Landlock,
pids cgroup, limits) running ``/usr/bin/true`` as the tool script's interpreter -> the
result JSON back. Reference: ``subprocess.run(["true"])`` from the same process.

Three patterns, the reference measured the same way each time:

* interleaved: one reference run (in a worker thread, so the event loop goes on), then one
  tool call. Between two calls the client has ~1 ms for its background work (making the
  next proc slot), as it has while a model answers.
* paced: the same with 5 ms of idle between runs (an idle vCPU wakes slowly on a VM).
* burst: a round of 20 serial tool calls back to back (the procs for the round made first,
  side by side, as dispatch does), then 20 reference runs; per call, the round's time / 20.

Target (issue 3): under 3x; issue 10: within 2x.

Then CPU per call, which a busy machine does not blur as it blurs wall time: the CPU that
toolsrv (its server process, and separately the tool processes it reaped) and the client
spent per call over a run of serial calls, against ``subprocess.run`` of the same tool
script (the parent's CPU and the child's).

Then the cost of finding the protected names (.git, .ollie) of a write root, on a tree of
50,000 files in 5,000 directories with 10 repositories in it (``toolsrv.protect``): the first
scan, a call's refresh when nothing changed (inotify: one read), a refresh after one
directory changed, and the fallback's refresh by directory mtimes (one stat per
directory). Reference: ``os.walk`` of the same tree.
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from olliefs.testing import running_toolsrv
from toolsrv.protect import ProtectedScan

CALLS = 600
WARMUP = 20
BURST = 20

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


Samples = tuple[list[float], list[float]]  # tool calls, reference runs


async def measure(base: Path, n: int) -> dict[str, Samples]:
    true = shutil.which("true") or "/usr/bin/true"
    tools = base / "tools"
    tools.mkdir()
    tool = tools / "nothing"
    tool.write_text(TRUE_TOOL.format(true=true))
    tool.chmod(0o755)
    work = base / "work"
    work.mkdir()
    out: dict[str, Samples] = {}
    with running_toolsrv(base, tools_dirs=(tools,), log_level="INFO") as srv:
        async with srv.agent("bench", "nothing") as conn:
            env = {"OLLIE_SESSION_ID": "bench"}

            async def call() -> float:
                t0 = time.perf_counter()
                res = await conn.call("nothing", {}, str(work), env)
                assert not res.isError, res.text
                return time.perf_counter() - t0

            for _ in range(WARMUP):
                await call()
                run_true(true)
            for name, gap in (("interleaved", 0.0), ("paced 5 ms", 0.005)):
                calls, refs = [], []
                for _ in range(n):
                    await trio.sleep(gap)
                    refs.append(await trio.to_thread.run_sync(run_true, true))
                    await trio.sleep(gap)
                    calls.append(await call())
                out[name] = (calls, refs)
            calls, refs = [], []
            for _ in range(n // BURST):
                # One round of BURST serial calls, as dispatch runs it: procs for the whole
                # round are made first, side by side; a sample is the round's time per call.
                t0 = time.perf_counter()
                await conn.warm(BURST)
                for _ in range(BURST):
                    await call()
                calls.append((time.perf_counter() - t0) / BURST)
                t0 = time.perf_counter()
                for _ in range(BURST):
                    run_true(true)
                refs.append((time.perf_counter() - t0) / BURST)
            out[f"burst of {BURST}"] = (calls, refs)
    return out


def _cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of a process: (its own, its reaped children's)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, (int(fields[13]) + int(fields[14])) / tick


async def cpu_cost(base: Path, n: int) -> None:
    tools = base / "tools"
    tools.mkdir()
    tool = tools / "nothing"
    tool.write_text(TRUE_TOOL.format(true=shutil.which("true") or "/usr/bin/true"))
    tool.chmod(0o755)
    work = base / "work"
    work.mkdir()
    with running_toolsrv(base, tools_dirs=(tools,), log_level="INFO") as srv:
        assert srv.proc is not None
        keeper = srv.proc.pid  # the keeper; the server is its child
        with open(f"/proc/{keeper}/task/{keeper}/children") as f:
            server = int(f.read().split()[0])
        async with srv.agent("bench", "nothing") as conn:
            env = {"OLLIE_SESSION_ID": "bench"}
            for _ in range(WARMUP):
                await conn.call("nothing", {}, str(work), env)
            s0, t0 = _cpu(server)
            c0 = time.process_time()
            for _ in range(n):
                await conn.call("nothing", {}, str(work), env)
            s1, t1 = _cpu(server)
            c1 = time.process_time()
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    p0 = time.process_time()
    for _ in range(n):
        subprocess.run([str(tool)], check=True)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    p1 = time.process_time()
    child = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    ours = (s1 - s0) + (t1 - t0) + (c1 - c0)
    ref = (p1 - p0) + child
    print(
        f"CPU per call, {n} serial calls: toolsrv {(s1 - s0) / n * 1e6:.0f} us + its tool "
        f"processes {(t1 - t0) / n * 1e6:.0f} us + client {(c1 - c0) / n * 1e6:.0f} us = "
        f"{ours / n * 1e6:.0f} us; subprocess.run of the tool script: parent "
        f"{(p1 - p0) / n * 1e6:.0f} us + child {child / n * 1e6:.0f} us = {ref / n * 1e6:.0f} us: "
        f"{ours / ref:.2f}x"
    )


def scan_cost(base: Path, dirs: int = 5000, files_per_dir: int = 10) -> None:
    root = base / "tree"
    for i in range(dirs):
        d = root / f"p{i % 50}" / f"m{i // 50 % 10}" / f"d{i}"
        d.mkdir(parents=True)
        for j in range(files_per_dir):
            (d / f"f{j}").write_bytes(b"")
        if i % 500 == 0:
            (d / ".git").mkdir()
    for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:  # not "fresh" (protect.py)
        os.utime(d, (1e9, 1e9))
    r = str(root)
    t0 = time.perf_counter()
    for _ in os.walk(r):
        pass
    walk = time.perf_counter() - t0
    scan = ProtectedScan()
    t0 = time.perf_counter()
    found = scan.find([r])
    first = time.perf_counter() - t0
    refresh = []
    for _ in range(20):
        t0 = time.perf_counter()
        scan.find([r])
        refresh.append(time.perf_counter() - t0)
    fallback = ProtectedScan(inotify=False)  # where inotify watches run out
    fallback.find([r])
    by_mtime = []
    for _ in range(5):
        t0 = time.perf_counter()
        fallback.find([r])
        by_mtime.append(time.perf_counter() - t0)
    (root / "p3" / "m1" / "new" / ".git").mkdir(parents=True)
    t0 = time.perf_counter()
    after = scan.find([r])
    changed = time.perf_counter() - t0
    assert len(after) == len(found) + 1
    scan.close()
    n = sum(1 for _ in root.rglob("*"))
    same = statistics.median(refresh)
    print(
        f"protected-name scan, {n} entries, {len(found)} repositories:"
        f" os.walk {walk * 1e3:.1f} ms; first scan {first * 1e3:.1f} ms;"
        f" refresh unchanged {same * 1e3:.1f} ms ({same / walk:.2f}x os.walk);"
        f" after one change {changed * 1e3:.1f} ms; without inotify (mtimes) refresh"
        f" {statistics.median(by_mtime) * 1e3:.1f} ms"
    )


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        results = trio.run(measure, Path(d), CALLS)
    print(f"python {sys.version.split()[0]}, {CALLS} calls and reference runs per pattern")
    for name, (calls, refs) in results.items():
        r = median_us(refs)
        c = median_us(calls)
        p90 = statistics.quantiles(calls, n=10)[-1] * 1e6
        print(
            f"{name:>12}: tool call {c:6.0f} us (p90 {p90:5.0f}), subprocess.run(true) "
            f"{r:5.0f} us: {c / r:.2f}x (target < 3x)"
        )
    with tempfile.TemporaryDirectory() as d:
        trio.run(cpu_cost, Path(d), CALLS)
    with tempfile.TemporaryDirectory() as d:
        scan_cost(Path(d))


if __name__ == "__main__":
    main()
