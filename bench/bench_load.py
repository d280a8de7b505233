"""Load figures: many blocked readers, many streaming sessions, what it costs the daemon.

Run: ``.venv/bin/python bench/bench_load.py [READERS]`` (root, /dev/fuse; default 2,000
readers over 50 sessions). Prints a table; it asserts nothing. Every figure is measured in
this run, the reference too.

The reference: the same 50 sessions stream the same replies with no reader attached.
Then ``READERS`` reader threads (in a few helper processes: stream, events and statewait
of every session) are started and counted as blocked from ``/proc/<pid>/task/<tid>/wchan``,
and the sessions stream again. For both runs: the wall time from the first prompt until
every session is idle again, the daemon's CPU (utime + stime from ``/proc/<pid>/stat``)
over that time, and for the loaded run the time until every reader holds every byte of
its file (each helper reports what it has; the last reader to catch up sets the figure).
Then every reader is SIGKILLed at once and the time until all helper processes have
exited, and until the daemon's pyfuse3 workers have gone back to the pool and no read is
parked (SIGUSR1 counts), is printed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from olliefs.replay import Entry, ReplayServer
from olliefs.testing import Daemon

# The readers are the load test's own helpers (tests/ is not installed): one definition
# of what a reader does, for the test and the figures.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.fs.test_load import (
    HELPER,
    Helper,
    blocked_threads,
    debug_counts,
    raise_nofile,
    sha,
)

SESSIONS = 50
HELPERS = 8
REPLY_CHARS, CHUNK, DELAY = 2000, 16, 0.005
TICK = os.sysconf("SC_CLK_TCK")


def cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def stream_round(daemon: Daemon, sids: list[str], tag: str) -> tuple[float, float]:
    """Every session streams one reply; (wall seconds, daemon CPU seconds)."""
    assert daemon.proc is not None
    for i, _ in enumerate(sids):
        reply = f"{tag} " + "y" * REPLY_CHARS
        daemon.replay.add([Entry(reply=reply, chunk=CHUNK, delay=DELAY, for_model=f"m{i}")])
    c0, t0 = cpu(daemon.proc.pid), time.perf_counter()
    for sid in sids:
        daemon.prompt(sid, tag)
    for sid in sids:
        daemon.wait_idle(sid)
    return time.perf_counter() - t0, cpu(daemon.proc.pid) - c0


def main() -> int:
    readers = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    raise_nofile()
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp, ReplayServer() as server:
        daemon = Daemon(Path(tmp), server, {"OLLIE_READ_TIMEOUT": "60"})
        with daemon.running():
            sids = [daemon.new(name=f"B{i}", model=f"m{i}") for i in range(SESSIONS)]
            stream_round(daemon, sids, "warm")
            wall0, cpu0 = stream_round(daemon, sids, "alone")

            kinds = ["stream", "events", "stream", "events", "statewait"]
            jobs = [
                (kinds[i % 5], str(daemon.p(f"s/{sids[i % SESSIONS]}/{kinds[i % 5]}")))
                for i in range(readers)
            ]
            helpers = []
            t0 = time.perf_counter()
            for n in range(HELPERS):
                proc = subprocess.Popen(
                    [sys.executable, "-c", HELPER],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    process_group=0,
                )
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(json.dumps(jobs[n::HELPERS]) + "\n")
                proc.stdin.flush()
                proc.stdout.readline()
                helpers.append(Helper(proc, jobs[n::HELPERS]))
            pids = [h.proc.pid for h in helpers]
            while blocked_threads(pids) < readers:
                time.sleep(0.01)
            t_block = time.perf_counter() - t0

            t1 = time.perf_counter()
            wall1, cpu1 = stream_round(daemon, sids, "loaded")
            want = {}
            for sid in sids:
                want[str(daemon.p(f"s/{sid}/stream"))] = sha(daemon.p(f"s/{sid}/chat").read_bytes())
                want[str(daemon.p(f"s/{sid}/events"))] = sha(
                    daemon.snapshot(f"s/{sid}/events").encode()
                )
            for helper in helpers:
                while any(
                    kind != "statewait" and got != want[path]
                    for (kind, path), got in zip(helper.jobs, helper.report()["got"], strict=True)
                ):
                    time.sleep(0.01)
            t_deliver = time.perf_counter() - t1

            t2 = time.perf_counter()
            for h in helpers:
                os.killpg(h.proc.pid, signal.SIGKILL)
            for h in helpers:
                h.proc.wait()
            t_exit = time.perf_counter() - t2
            while debug_counts(daemon)[1] > 8 or debug_counts(daemon)[2]:
                time.sleep(0.01)
            t_pool = time.perf_counter() - t2
            for h in helpers:
                for f in (h.proc.stdin, h.proc.stdout):
                    if f is not None:
                        f.close()

    print(f"{SESSIONS} sessions, each streaming {REPLY_CHARS} chars in {CHUNK}-char deltas")
    print(f"{DELAY * 1000:g} ms apart; {readers} readers (40% stream, 40% events, 20% statewait)")
    print(f"    all readers blocked after start:       {t_block:8.2f} s")
    print(f"    {'':38s} {'wall s':>8s} {'CPU s':>8s}")
    print(f"    streams, no reader:                    {wall0:8.2f} {cpu0:8.2f}")
    print(f"    streams, {readers:5d} readers:               {wall1:8.2f} {cpu1:8.2f}")
    print(f"    CPU ratio loaded / alone:              {cpu1 / max(cpu0, 1e-9):8.2f}x")
    print(f"    every reader holds every byte after:   {t_deliver:8.2f} s")
    print(f"    SIGKILL to all -> all exited:          {t_exit * 1000:8.1f} ms")
    print(f"    SIGKILL to all -> workers back to pool:{t_pool * 1000:8.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
