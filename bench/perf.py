"""THE benchmark of issue 10: one table, each figure next to its reference from the same run.

    .venv/bin/python bench/perf.py                 # 1,000 sessions (the issue's figures)
    PERF_SESSIONS=100 .venv/bin/python bench/perf.py   # quicker, while developing

Needs root, /dev/fuse, gcc and Debian's libfuse3-dev (pkg-config fuse3). It builds the C
reference (``bench/ref/reffs.c``) in a scratch directory, mounts it with the attribute and
entry timeouts olliefs uses (read from olliefs itself, so the two can never drift apart),
mounts olliefs through the test harness (``olliefs.testing.Daemon``: the real daemon, a
loopback replay server), makes the sessions in both, and measures the same operation on
both in turns. Then it adds the rows of ``bench/perf_stream.py`` (streams, journal,
runtime latency, 200 streams) and ``bench/bench_toolsrv.py`` (a tool call against a bare
spawn of the same script, three patterns, and the CPU per call); ``PERF_PARTS`` picks
(``fs``, ``stream``, ``toolsrv``; all by default).

Nothing is asserted: a figure that misses its target is printed as MISS.
"""

from __future__ import annotations

import compileall
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from perf_common import Row, p50, p99, table, within

from olliefs.fs import fuse, nodes, spec
from olliefs.live import StateCell
from olliefs.replay import ReplayServer
from olliefs.testing import Daemon

HERE = Path(__file__).resolve().parent

SESSIONS = int(os.environ.get("PERF_SESSIONS", "1000"))
REPEAT = int(os.environ.get("PERF_REPEAT", "3000"))  # per small-operation figure
READERS = int(os.environ.get("PERF_READERS", "1000"))  # blocked readers for the idle figure
# Where the filesystems and the client run while the small operations are timed: "split"
# (both filesystems on the first CPU, the client on the last), "same" (all on the last),
# or "none" (wherever the scheduler puts them); a comma-separated list times the small
# operations once per placement, in that order, the rows of all but the first named
# after theirs. A round trip between two CPUs costs a wake-up of the other (on this VM
# ~40 us more than on one CPU), and unpinned each run draws its own placement for each
# filesystem: pinned, both sides pay the same; unpinned is what a user's machine does.
# Both by default: the issue judges open+read+close in both.
PINS = [p for p in os.environ.get("PERF_PIN", "split,none").split(",") if p]
# Which parts to run: "fs" (this file's rows), "stream" (bench/perf_stream.py's: streams,
# journal, runtime latency, many streams), "toolsrv" (bench/bench_toolsrv.py's: a call
# against a bare spawn of the same tool script); all three by default.
PARTS = set(os.environ.get("PERF_PARTS", "fs,stream,toolsrv").split(","))
CLK = os.sysconf("SC_CLK_TCK")


# ---- the C reference ---------------------------------------------------------------------


def build_ref(out: Path) -> Path:
    flags = subprocess.run(
        ["pkg-config", "--cflags", "--libs", "fuse3"], check=True, capture_output=True, text=True
    ).stdout.split()
    exe = out / "reffs"
    subprocess.run(
        ["gcc", "-O2", "-o", str(exe), str(HERE / "ref" / "reffs.c"), *flags], check=True
    )
    return exe


def timeouts() -> list[str]:
    """What olliefs tells the kernel, in reffs's argument order."""
    state = nodes.Text(("s", "x", "state"), lambda: "", source=StateCell())
    handle = state.open(nodes.Open(pid=0, nonblock=False, waiters=nodes.Waiters(1)))
    return [
        str(nodes.Dir.attr_ttl),
        str(nodes.CACHED_TTL if state.watch() is not None else state.attr_ttl),
        str(nodes.Node.entry_ttl),
        str(spec.SessionDir.entry_ttl),
        str(int(state.direct_io)),
        "0",  # keep_cache: olliefs decides per open; 0 is the case of a changed file
        # FOPEN_NOFLUSH for read-only opens (0 for a tree without it, as before it had it)
        str(int(getattr(fuse, "noflush", lambda h, f: False)(handle, os.O_RDONLY))),
    ]


@contextmanager
def reffs(exe: Path, mnt: Path, sessions: int) -> Iterator[tuple[float, int]]:
    """Mounted reference; yields the seconds from spawn to the first answered stat, and
    its pid."""
    mnt.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [str(exe), str(mnt), str(sessions), *timeouts()], stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    if proc.stdout.readline() != b"ready\n":
        raise RuntimeError("reffs did not mount")
    os.stat(mnt / "s" / "0000" / "state")
    took = time.perf_counter() - t0
    try:
        yield took, proc.pid
    finally:
        subprocess.run(["fusermount3", "-uz", str(mnt)], check=False)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


# ---- measures ----------------------------------------------------------------------------


def timed(op: Callable[[], object], n: int) -> list[float]:
    """Seconds per call of ``op``, ``n`` times, after a warm-up call."""
    op()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        op()
        out.append(time.perf_counter() - t0)
    return out


def in_turns(
    ours: Callable[[], object], ref: Callable[[], object], n: int
) -> tuple[list[float], list[float]]:
    """``timed`` for both, one call of each in turn: on a machine shared with other
    jobs a burst of theirs then slows both sides alike, not whichever ran then. Which
    goes first alternates: the one that runs right after the bench's own bookkeeping
    (and after the other filesystem's request) is not always the same."""
    ours()
    ref()
    a: list[float] = []
    b: list[float] = []
    for i in range(n):
        first, second, x, y = (ours, ref, a, b) if i % 2 == 0 else (ref, ours, b, a)
        t0 = time.perf_counter()
        first()
        t1 = time.perf_counter()
        second()
        t2 = time.perf_counter()
        x.append(t1 - t0)
        y.append(t2 - t1)
    return a, b


@contextmanager
def pinned(pin: str, *servers: int) -> Iterator[str]:
    """Pin ``servers`` (every thread) and this thread as ``pin`` says; yields a note."""
    cpus = sorted(os.sched_getaffinity(0))
    if pin == "none" or len(cpus) < 2:
        yield "unpinned"
        return
    server_cpu, client_cpu = (cpus[0], cpus[-1]) if pin == "split" else (cpus[-1], cpus[-1])
    for pid in servers:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), {server_cpu})
    os.sched_setaffinity(0, {client_cpu})
    try:
        yield f"pinned {pin}: servers on CPU {server_cpu}, client on CPU {client_cpu}"
    finally:
        os.sched_setaffinity(0, cpus)
        for pid in servers:
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    os.sched_setaffinity(int(tid), cpus)
                except OSError:
                    pass  # a worker thread that ended meanwhile


def us(xs: list[float]) -> list[float]:
    return [x * 1e6 for x in xs]


def stat_of(path: Path) -> Callable[[], object]:
    return lambda: os.stat(path)


def cat(path: Path) -> Callable[[], object]:
    def op() -> bytes:
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.read(fd, 65536)
        finally:
            os.close(fd)

    return op


def listdir(path: Path) -> Callable[[], object]:
    return lambda: os.listdir(path)


def ls_l(path: Path) -> Callable[[], object]:
    return lambda: subprocess.run(["ls", "-l", str(path)], check=True, stdout=subprocess.DEVNULL)


def pair(
    name: str, ours: list[float], ref: list[float], unit: str, factor: float, note: str = ""
) -> list[Row]:
    target = f"<= {factor:g}x ref"
    rows = []
    for label, f in (("p50", p50), ("p99", p99)):
        o, r = f(ours), f(ref)
        rows.append(Row(f"{name} {label}", o, r, unit, target, within(o, r, factor), note))
        note = ""
    return rows


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def make_sessions(d: Daemon, n: int, start: int = 0) -> list[str]:
    out = []
    for i in range(start, n):
        out.append(d.new(name=f"{i:04d}"))
    return out


@contextmanager
def blocked_readers(d: Daemon, sids: list[str], n: int) -> Iterator[None]:
    """``n`` threads each blocked in read(2) at the end of a session's ``stream``."""
    fds = []
    for i in range(n):
        fd = os.open(d.p(f"s/{sids[i % len(sids)]}/stream"), os.O_RDONLY)
        os.read(fd, 1 << 20)  # what the chat holds already
        fds.append(fd)
    threads = [threading.Thread(target=os.read, args=(fd, 1 << 16), daemon=True) for fd in fds]
    for t in threads:
        t.start()
    # Wait until the daemon holds them all: the kernel shows each thread asleep in FUSE.
    deadline = time.monotonic() + 60
    while sum(_fuse_wait(t.native_id) for t in threads) < n:
        if time.monotonic() > deadline:
            raise RuntimeError("the readers did not all block in the daemon")
        time.sleep(0.05)
    try:
        yield
    finally:
        for fd in fds:
            os.close(fd)  # release: EOF is not needed, the threads are daemons
        # the threads stay blocked until the daemon stops; killing sessions ends them


def _fuse_wait(tid: int | None) -> bool:
    try:
        with open(f"/proc/self/task/{tid}/wchan") as f:
            wchan = f.read()
        return "request_wait_answer" in wchan or "fuse" in wchan
    except OSError:
        return False


def compiled() -> None:
    """Compile the daemon's own packages to bytecode where they are (``__pycache__``)."""
    for name in ("olliefs", "ninep", "toolsrv"):
        spec_ = importlib.util.find_spec(name)
        if spec_ is not None and spec_.submodule_search_locations:
            for where in spec_.submodule_search_locations:
                compileall.compile_dir(where, quiet=1)


# ---- the run -----------------------------------------------------------------------------


def small_ops(d: Daemon, ref: Path, sids: list[str], suffix: str, placement: str) -> list[Row]:
    """The operations timed against the reference in turns, under one placement; the
    rows' names end with ``suffix`` (the placement, for all but the first)."""
    rows: list[Row] = []
    ours_f, ref_f = d.p(f"s/{sids[1]}/state"), ref / "s" / "0001" / "state"
    o, r = in_turns(stat_of(ours_f), stat_of(ref_f), REPEAT)
    rows += pair(f"stat s/<id>/state{suffix}", us(o), us(r), "us", 1.5, placement)
    o, r = in_turns(cat(ours_f), cat(ref_f), REPEAT)
    rows += pair(f"open+read+close state{suffix}", us(o), us(r), "us", 1.5)
    # A session's directory, of the same shape in both (names, kinds and about the sizes
    # of an idle session's files): what ls, a shell's completion and a file manager do.
    ours_s, ref_s = d.p(f"s/{sids[1]}"), ref / "s" / "0001"
    entries = len(os.listdir(ours_s))
    if entries != len(os.listdir(ref_s)):
        raise RuntimeError(f"reffs's session directory is not of olliefs's shape: {entries}")
    o, r = in_turns(listdir(ours_s), listdir(ref_s), max(20, REPEAT // 10))
    rows += pair(f"readdir s/<id>/ ({entries} entries){suffix}", us(o), us(r), "us", 2)
    o, r = in_turns(listdir(d.p("s")), listdir(ref / "s"), max(20, REPEAT // 100))
    rows += pair(f"readdir s/ ({SESSIONS} sessions){suffix}", us(o), us(r), "us", 2)
    ls_o, ls_r = in_turns(ls_l(d.p("s")), ls_l(ref / "s"), 10)
    rows.append(
        Row(
            f"ls -l s/ ({SESSIONS} sessions){suffix} p50",
            p50(ls_o) * 1e3,
            p50(ls_r) * 1e3,
            "ms",
            "< 100 ms",
            p50(ls_o) < 0.1,
            "ls process start included, in both",
        )
    )
    return rows


def fs_rows(tmp: Path) -> list[Row]:
    exe = build_ref(tmp)
    rows: list[Row] = []
    with ReplayServer() as srv:
        (tmp / "ours").mkdir()
        d = Daemon(tmp / "ours", srv, {})
        d.start()
        try:
            assert d.proc is not None
            # The first session loads what any first session does once (the backends
            # are imported at their first use): the figure is what each one more costs.
            first = make_sessions(d, 1)
            before = rss_kib(d.proc.pid)
            sids = first + make_sessions(d, SESSIONS, start=1)
            with open(d.p(f"s/{sids[0]}/chat"), "rb"):
                pass
            # Idle sessions: let a collection settle what creating them left.
            time.sleep(1)
            per = (rss_kib(d.proc.pid) - before) / (SESSIONS - 1)
            with reffs(exe, tmp / "ref", SESSIONS) as (ref_mount_s, ref_pid):
                ref = tmp / "ref"
                ours_f = d.p(f"s/{sids[1]}/state")
                for i, pin in enumerate(PINS):
                    with pinned(pin, d.proc.pid, ref_pid) as placement:
                        rows += small_ops(d, ref, sids, "" if i == 0 else f", {pin}", placement)
                with pinned(PINS[0], d.proc.pid, ref_pid):
                    rows.append(Row("RSS per idle session", per, None, "KiB", "< 50 KiB", per < 50))
                    # Other operations with READERS reads blocked in the daemon, then idle CPU.
                    cat_before = us(timed(cat(ours_f), REPEAT))
                    with blocked_readers(d, sids, READERS):
                        cat_with = us(timed(cat(ours_f), REPEAT))
                        c0, t0 = cpu_seconds(d.proc.pid), time.monotonic()
                        time.sleep(3)
                        cpu = (cpu_seconds(d.proc.pid) - c0) / (time.monotonic() - t0) * 100
                        rows.append(
                            Row(
                                f"idle CPU, {READERS} blocked readers",
                                cpu,
                                None,
                                "%",
                                "< 2%",
                                cpu < 2,
                            )
                        )
                        rows.append(
                            Row(
                                f"open+read+close with {READERS} readers p50",
                                p50(cat_with),
                                p50(cat_before),
                                "us",
                                "<= 1.2x without",
                                within(p50(cat_with), p50(cat_before), 1.2),
                                "ref: the same without readers",
                            )
                        )
            d.stop()
            # Mount-to-usable: the saved sessions restored and s/ listed whole. With the
            # bytecode compiled, as an installed package has it (pip compiles at install;
            # a checkout run with PYTHONDONTWRITEBYTECODE=1 compiles every module at
            # every start: ~130 ms more here).
            compiled()
            # The median of three starts: one start is one draw of the disk's and the
            # scheduler's moods (0.29-0.32 s for the same code, five starts in a row).
            starts = []
            for _ in range(3):
                d.stop()
                t0 = time.perf_counter()
                d.start()
                while len(os.listdir(d.p("s"))) < SESSIONS + 2:
                    pass
                starts.append(time.perf_counter() - t0)
            mount = p50(starts)
            rows.append(
                Row(
                    f"mount-to-usable, {SESSIONS} saved",
                    mount,
                    ref_mount_s,
                    "s",
                    "< 0.3 s",
                    mount < 0.3,
                    "spawn to a full listing of s/, median of 3 starts; compiled; ref: reffs spawn",
                )
            )
        finally:
            d.stop()
    return rows


def main() -> int:
    rows: list[Row] = []
    if "fs" in PARTS:
        with tempfile.TemporaryDirectory() as t:
            rows += fs_rows(Path(t))
    for part, name in (("stream", "perf_stream"), ("toolsrv", "bench_toolsrv")):
        if part in PARTS:
            rows += bench_module(name).rows()
    print(table(rows))
    print(f"\n{SESSIONS} sessions, {REPEAT} repeats; {machine()}")
    return 0 if all(r.ok is not False for r in rows) else 1


def bench_module(name: str) -> Any:
    """``bench/<name>.py``, loaded by path (bench/ is not a package)."""
    spec_ = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec_ is not None and spec_.loader is not None
    mod = importlib.util.module_from_spec(spec_)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec_.loader.exec_module(mod)
    return mod


def machine() -> str:
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"nproc {os.cpu_count()}, {cpu}, kernel {os.uname().release}"


if __name__ == "__main__":
    shutil.which("gcc") or sys.exit("perf.py needs gcc and libfuse3-dev")
    sys.exit(main())
