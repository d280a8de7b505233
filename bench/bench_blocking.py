"""Blocked readers: what 1,000 of them cost the daemon, and how fast a signal frees one.

Run: ``.venv/bin/python bench/bench_blocking.py`` (root, /dev/fuse). Prints a table; it
asserts nothing. Every figure is measured in this run, the references too.

(a) Idle daemon CPU over ``IDLE_SECONDS`` (utime + stime of the daemon process from
    ``/proc/<pid>/stat``), with no reader and with ``READERS`` threads of one helper
    process blocked on ``s/<id>/stream`` and ``s/<id>/statewait`` (half each). The readers
    are counted as blocked from ``/proc/<pid>/task/<tid>/wchan`` before anything is timed.
(b) ``stat`` and open+read+close of a file of another session, p50 and p99 of
    ``ACCESSES``, with no reader and with the readers blocked.
(c) Signal -> exit: a reader of ``s/<id>/stream`` is started in its own process group,
    waits until its thread is blocked in the read, gets SIGINT or SIGKILL (to its process
    group, as a terminal does) and the time until the reader process has exited is taken;
    the reader is the opener (``cat FILE``) or a process that only inherited the open file
    (``timeout 600 cat < FILE``, ``exec 3< FILE; cat <&3``, ``{ cat; cat; } < FILE``).
    A reader still there after ``STUCK_AFTER`` seconds is reported as stuck.

Run it with another olliefs checkout's interpreter to compare (that checkout's daemon is
the one started): ``/path/to/other/.venv/bin/python bench/bench_blocking.py``.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import olliefs
from olliefs.replay import ReplayServer
from olliefs.testing import Daemon

READERS = 1000
IDLE_SECONDS = 3.0
ACCESSES = 3000
RUNS = 5
STUCK_AFTER = 5.0

HELPER = """
import sys, threading
stream, statewait, n, skip = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def reader(path, first):
    with open(path, 'rb', buffering=0) as f:
        if first:
            f.read(first)
        f.read(65536)
for i in range(n):
    args = (stream, skip) if i % 2 else (statewait, 0)
    threading.Thread(target=reader, args=args, daemon=True).start()
sys.stdin.read()
"""

PATTERNS = {
    "cat FILE (opener)": ["cat", "{}"],
    "timeout 600 cat < FILE": ["bash", "-c", 'timeout 600 cat < "$1"', "sh", "{}"],
    "exec 3< FILE; cat <&3": ["bash", "-c", 'exec 3< "$1"; cat <&3', "sh", "{}"],
    "{ cat; cat; } < FILE": ["bash", "-c", '{ cat; cat; } < "$1"', "sh", "{}"],
}


def _proc(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def blocked_threads(pid: int) -> int:
    """Threads of ``pid`` that wait for a FUSE answer."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    n = 0
    for tid in tids:
        wchan = _proc(f"/proc/{pid}/task/{tid}/wchan")
        n += wchan == "request_wait_answer" or wchan.startswith("fuse_")
    return n


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for tid in os.listdir(f"/proc/{p}/task") if os.path.isdir(f"/proc/{p}") else []:
            todo += [int(c) for c in _proc(f"/proc/{p}/task/{tid}/children").split()]
    return out


def alive(pid: int) -> bool:
    stat = _proc(f"/proc/{pid}/stat")
    return bool(stat) and stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_for(cond: object, timeout: float = 60) -> bool:
    assert callable(cond)
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


def cpu_seconds(pid: int) -> float:
    fields = _proc(f"/proc/{pid}/stat").rsplit(")", 1)[1].split()
    # fields[0] is the state (field 3); utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def settle(pid: int, quiet: float = 0.5, limit: float = 10.0) -> tuple[float, float]:
    """Wait until the daemon used no CPU for ``quiet`` seconds (the work that the readers'
    arrival caused is done); returns (seconds it took, CPU seconds used meanwhile)."""
    t0 = last_change = time.monotonic()
    c0 = c = cpu_seconds(pid)
    while time.monotonic() - last_change < quiet and time.monotonic() - t0 < limit:
        time.sleep(0.05)  # sampling the CPU counter
        now = cpu_seconds(pid)
        if now != c:
            c, last_change = now, time.monotonic()
    return last_change - t0, c - c0


def idle_cpu(pid: int) -> float:
    """Percent of one core the daemon used while nothing happened."""
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(IDLE_SECONDS)  # the measurement window itself, not a synchronisation
    return (cpu_seconds(pid) - c0) / (time.monotonic() - t0) * 100


def access_times(path: Path) -> tuple[list[float], list[float]]:
    st, rd = [], []
    for _ in range(ACCESSES):
        t0 = time.perf_counter()
        os.stat(path)
        t1 = time.perf_counter()
        with open(path, "rb") as f:
            f.read()
        t2 = time.perf_counter()
        st.append(t1 - t0)
        rd.append(t2 - t1)
    return st, rd


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(len(xs) * q))] * 1e3


def signal_to_exit(d: Daemon, argv: list[str], sig: int) -> float | None:
    """Seconds from the signal to the blocked reader's exit; None if it stayed."""
    rel = "s/sig/stream"
    want = len(d.snapshot(rel).encode())
    path = str(d.p(rel))
    proc = subprocess.Popen(
        [path if a == "{}" else a for a in argv], stdout=subprocess.PIPE, process_group=0
    )
    assert proc.stdout is not None
    got = 0
    while got < want:
        got += len(os.read(proc.stdout.fileno(), 65536))
    readers: list[int] = []

    def one_blocked() -> bool:
        readers[:] = [p for p in descendants(proc.pid) if blocked_threads(p)]
        return bool(readers)

    assert wait_for(one_blocked), "reader never blocked"
    reader = readers[0]
    t0 = time.perf_counter()
    os.killpg(os.getpgid(reader), sig)
    freed = wait_for(lambda: not alive(reader), STUCK_AFTER)
    dt = time.perf_counter() - t0
    if not freed:
        d.prompt("sig", "free the stuck reader")  # data ends its read; the signal then acts
        wait_for(lambda: not alive(reader))
    for p in descendants(proc.pid):
        try:
            os.killpg(os.getpgid(p), signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()  # bash may report its killed child on stderr: expected
    proc.stdout.close()
    return dt if freed else None


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp, ReplayServer() as srv:
        d = Daemon(Path(tmp), srv, {})
        d.start()
        assert d.proc is not None
        try:
            pid = d.proc.pid
            d.new(name="other")
            d.prompt("other", "hello")
            d.wait_idle("other")
            d.new(name="wait")
            d.new(name="sig")
            other = d.p("s/other/chat")
            access_times(other)  # warm up
            cpu0 = idle_cpu(pid)
            st0, rd0 = access_times(other)

            stream, statewait = d.p("s/wait/stream"), d.p("s/wait/statewait")
            skip = len(d.snapshot("s/wait/stream").encode())
            argv = [sys.executable, "-c", HELPER, str(stream), str(statewait)]
            helper = subprocess.Popen([*argv, str(READERS), str(skip)], stdin=subprocess.PIPE)
            assert helper.stdin is not None
            try:
                t0 = time.monotonic()
                ok = wait_for(lambda: blocked_threads(helper.pid) >= READERS, 120)
                assert ok, f"only {blocked_threads(helper.pid)} readers blocked"
                # The kernel queues a request before the daemon reads it: a stat answered
                # after them all means the daemon has taken every read and parked it.
                os.stat(other)
                t_block = time.monotonic() - t0
                t_settle, cpu_settle = settle(pid)
                cpu1 = idle_cpu(pid)
                st1, rd1 = access_times(other)
            finally:
                d.write("s/wait/ctl", "kill")  # EOF for every reader
                helper.stdin.close()
                helper.wait()

            times: dict[tuple[str, int], list[float | None]] = {}
            for name, argv in PATTERNS.items():
                for sig in (signal.SIGINT, signal.SIGKILL):
                    times[name, sig] = [signal_to_exit(d, argv, sig) for _ in range(RUNS)]
        finally:
            d.stop()

    print(f"olliefs from {os.path.dirname(os.path.dirname(olliefs.__file__))}")
    print(f"(a) idle daemon CPU over {IDLE_SECONDS:g} s, % of one core")
    print(f"    no blocked reader:            {cpu0:6.2f} %")
    print(f"    {READERS} blocked readers:        {cpu1:6.2f} %")
    print(f"    (all blocked {t_block:.2f} s after they started; the daemon's work for their")
    print(
        f"    arrival then ended within {t_settle:.2f} s and took {cpu_settle * 1e3:.0f} ms of CPU)"
    )
    print(f"(b) a file of another session, {ACCESSES} times, ms        p50      p99")
    for what, sample in (
        ("stat, no reader", st0),
        (f"stat, {READERS} readers", st1),
        ("open+read+close, no reader", rd0),
        (f"open+read+close, {READERS} readers", rd1),
    ):
        print(f"    {what:37s} {pct(sample, 0.5):7.3f}  {pct(sample, 0.99):7.3f}")
    print(f"    stat p99 ratio readers / none: {pct(st1, 0.99) / pct(st0, 0.99):.2f}x")
    print(f"(c) signal -> exit of a reader blocked on stream, {RUNS} runs, ms  median    worst")
    for (name, signum), xs in times.items():
        done = [x for x in xs if x is not None]
        stuck = len(xs) - len(done)
        med = f"{statistics.median(done) * 1e3:7.2f}" if done else "      -"
        worst = f"{max(done) * 1e3:7.2f}" if done else "      -"
        note = f"   {stuck} stuck > {STUCK_AFTER:g} s" if stuck else ""
        print(f"    {name:26s} {signal.Signals(signum).name:8s} {med}  {worst}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
