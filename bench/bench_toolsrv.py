"""toolsrv benchmark: a tool call round trip against a bare spawn of the same tool script.

Run: ``.venv/bin/python bench/bench_toolsrv.py`` (Linux with Landlock). Prints medians and
the ratio against a reference measured in the same run; it asserts nothing.
``bench/perf.py`` takes the same figures as table rows from `rows`.

Measured: olliefs' tool client (``ToolsrvConn.call``, the code the agent's dispatch runs)
-> 9P over the unix socket -> toolsrv -> a sandboxed process (own process group, Landlock,
mount and network namespaces, seccomp, pids cgroup, limits) running a tool script whose
interpreter is ``/usr/bin/true`` -> the result JSON back.

Reference: a bare spawn of the same tool script doing the same work, as a program that
runs tools without toolsrv would: ``subprocess.run([script], input=<the args JSON>,
capture_output=True, env=<the environment toolsrv gives the tool>, cwd=<the call's cwd>)``
from the same process. (The script's ``#!`` costs an exec of its own, and the tool's
``LANG=C.UTF-8`` a locale load: both are the tool's, so both are in the reference.)

Three patterns, the reference measured the same way each time:

* interleaved: one reference run (in a worker thread, so the event loop goes on), then one
  tool call, so that each call finds the machine as the reference found it.
* paced: the same with 5 ms of idle between runs (an idle vCPU wakes slowly on a VM).
* burst: a round of 20 serial tool calls back to back (the call fids for the round opened
  first, side by side, as dispatch does), then 20 reference runs; per call, the round's
  time / 20.

Target: a call within 1.5x of the reference, in every pattern (2x in an earlier round).

Then CPU per call, which a busy machine does not blur as it blurs wall time: the CPU that
toolsrv (its server process, and separately the tool processes it reaped) and the client
spent per call over a run of serial calls, against the reference's (the parent's CPU and
the child's).

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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import trio
from perf_common import Row, p50, within

from olliefs.testing import ToolsrvProc, running_toolsrv
from toolsrv.protect import ProtectedScan

CALLS = 600
WARMUP = 20
BURST = 20
TARGET = 1.5  # within 1.5x of the reference in every pattern (2x before)
SESSION = "bench"
ARGS = b"{}"

TRUE_TOOL = """#!{true}
# ollie-tool
# description: does nothing, successfully (benchmark)
# args: {{"type": "object", "properties": {{}}}}
# parallel: true
"""

Samples = tuple[list[float], list[float]]  # tool calls, reference runs (seconds)


@dataclass
class Cpu:
    """CPU seconds over ``n`` serial calls, and over ``n`` reference runs."""

    n: int
    server: float
    tools: float
    client: float
    ref_parent: float
    ref_child: float

    @property
    def ours(self) -> float:
        return (self.server + self.tools + self.client) / self.n

    @property
    def ref(self) -> float:
        return (self.ref_parent + self.ref_child) / self.n


@dataclass
class Figures:
    patterns: dict[str, Samples]
    cpu: Cpu


@dataclass
class Bench:
    """One toolsrv, its tool script and a work dir, and the reference's way to run it."""

    srv: ToolsrvProc
    script: str
    work: Path

    def env(self) -> dict[str, str]:
        """What toolsrv gives the tool for a call with OLLIE_SESSION_ID=bench (toolsrv's
        ``ToolServer._env``): the reference's tool runs with the same."""
        tmp = str(self.srv.tmp_root / SESSION)
        return {
            "OLLIE_SESSION_ID": SESSION,
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/"),
            "TMPDIR": tmp,
            "OLLIE_TMP": tmp,
            "OLLIE_CWD": str(self.work),
            "LANG": "C.UTF-8",
            "OLLIE_AGENT": SESSION,
        }

    def spawn(self, env: dict[str, str]) -> float:
        """The reference: a bare spawn of the tool script, as a tool runner would."""
        t0 = time.perf_counter()
        subprocess.run(
            [self.script], input=ARGS, capture_output=True, env=env, cwd=self.work, check=True
        )
        return time.perf_counter() - t0


def _setup(base: Path) -> tuple[Path, Path]:
    tools = base / "tools"
    tools.mkdir()
    tool = tools / "nothing"
    tool.write_text(TRUE_TOOL.format(true=shutil.which("true") or "/usr/bin/true"))
    tool.chmod(0o755)
    work = base / "work"
    work.mkdir()
    return tools, work


async def measure(base: Path, n: int) -> Figures:
    tools, work = _setup(base)
    with running_toolsrv(base, tools_dirs=(tools,), log_level="INFO") as srv:
        b = Bench(srv, str(tools / "nothing"), work)
        async with srv.agent(SESSION, "nothing") as conn:
            call_env = {"OLLIE_SESSION_ID": SESSION}

            async def call() -> float:
                t0 = time.perf_counter()
                res = await conn.call("nothing", {}, str(work), call_env)
                assert not res.isError, res.text
                return time.perf_counter() - t0

            for _ in range(WARMUP):
                await call()
            env = b.env()
            assert Path(env["TMPDIR"]).is_dir()  # made by the calls
            for _ in range(WARMUP):
                b.spawn(env)
            out: dict[str, Samples] = {}
            for name, gap in (("interleaved", 0.0), ("paced 5 ms", 0.005)):
                calls, refs = [], []
                for _ in range(n):
                    await trio.sleep(gap)
                    refs.append(await trio.to_thread.run_sync(b.spawn, env))
                    await trio.sleep(gap)
                    calls.append(await call())
                out[name] = (calls, refs)
            calls, refs = [], []
            for _ in range(n // BURST):
                # One round of BURST serial calls, as dispatch runs it: fids for the whole
                # round are opened first, side by side; a sample is the round's time per call.
                t0 = time.perf_counter()
                await conn.warm(BURST)
                for _ in range(BURST):
                    await call()
                calls.append((time.perf_counter() - t0) / BURST)
                t0 = time.perf_counter()
                for _ in range(BURST):
                    b.spawn(env)
                refs.append((time.perf_counter() - t0) / BURST)
            out[f"burst of {BURST}"] = (calls, refs)
            cpu = await cpu_cost(b, call, n)
    return Figures(out, cpu)


def _cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of a process: (its own, its reaped children's)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, (int(fields[13]) + int(fields[14])) / tick


async def cpu_cost(b: Bench, call: Callable[[], Awaitable[float]], n: int) -> Cpu:
    assert b.srv.proc is not None
    keeper = b.srv.proc.pid  # the keeper; the server is its child
    with open(f"/proc/{keeper}/task/{keeper}/children") as f:
        server = int(f.read().split()[0])
    s0, t0 = _cpu(server)
    c0 = time.process_time()
    for _ in range(n):
        await call()
    s1, t1 = _cpu(server)
    c1 = time.process_time()
    env = b.env()
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    p0 = time.process_time()
    for _ in range(n):
        b.spawn(env)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    p1 = time.process_time()
    child = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    return Cpu(n, s1 - s0, t1 - t0, c1 - c0, p1 - p0, child)


def figures(n: int = CALLS) -> Figures:
    with tempfile.TemporaryDirectory() as d:
        return trio.run(measure, Path(d), n)


REF_NOTE = "ref: subprocess.run of the same tool script (stdin, stdout, env, cwd as the call's)"


def rows(n: int = CALLS) -> list[Row]:
    """The toolsrv figures of issue 10 (item 4) as ``bench/perf.py`` table rows: per
    pattern the call's p50 next to the reference's, and the CPU per call."""
    fig = figures(n)
    out: list[Row] = []
    for name, (calls, refs) in fig.patterns.items():
        ours, ref = p50(calls) * 1e6, p50(refs) * 1e6
        out.append(
            Row(
                f"toolsrv call p50, {name}",
                ours,
                ref,
                "us",
                f"<= {TARGET:g}x ref",
                within(ours, ref, TARGET),
                REF_NOTE,
            )
        )
    cpu = fig.cpu
    out.append(
        Row(
            "toolsrv CPU per call",
            cpu.ours * 1e6,
            cpu.ref * 1e6,
            "us",
            "(printed)",
            None,
            f"server {cpu.server / cpu.n * 1e6:.0f} + tool {cpu.tools / cpu.n * 1e6:.0f} + "
            f"client {cpu.client / cpu.n * 1e6:.0f}; ref: parent + child of the same spawn",
        )
    )
    return out


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
    fig = figures(CALLS)
    print(f"python {sys.version.split()[0]}, {CALLS} calls and reference runs per pattern")
    for name, (calls, refs) in fig.patterns.items():
        r = statistics.median(refs) * 1e6
        c = statistics.median(calls) * 1e6
        p90 = statistics.quantiles(calls, n=10)[-1] * 1e6
        print(
            f"{name:>12}: tool call {c:6.0f} us (p90 {p90:5.0f}), bare spawn of the script "
            f"{r:5.0f} us: {c / r:.2f}x (target <= {TARGET:g}x)"
        )
    cpu = fig.cpu
    n = cpu.n
    print(
        f"CPU per call, {n} serial calls: toolsrv {cpu.server / n * 1e6:.0f} us + its tool "
        f"processes {cpu.tools / n * 1e6:.0f} us + client {cpu.client / n * 1e6:.0f} us = "
        f"{cpu.ours * 1e6:.0f} us; bare spawn of the tool script: parent "
        f"{cpu.ref_parent / n * 1e6:.0f} us + child {cpu.ref_child / n * 1e6:.0f} us = "
        f"{cpu.ref * 1e6:.0f} us: {cpu.ours / cpu.ref:.2f}x"
    )
    with tempfile.TemporaryDirectory() as d:
        scan_cost(Path(d))


if __name__ == "__main__":
    main()
