"""Load (issue 11 item 8): thousands of blocked readers, writers, streaming sessions.

``READERS`` readers (2,000 by default; ``OLLIE_LOAD_READERS`` scales it) block on the
``stream``, ``events`` and ``statewait`` files of ``SESSIONS`` sessions: threads of a few
helper processes, plus one ``cat stream`` process per session. Once every one of them is
seen blocked in a FUSE read (``/proc/<pid>/task/<tid>/wchan``), ``WRITERS`` writer threads
drive the sessions (cfg, prompts, ctl lines, a cfg refused with EBUSY while the turn
runs, a second prompt queued behind it) and every session streams two replies.

Then: every stream and events reader holds exactly the bytes of the final ``chat`` and
``events`` (what a reader got is compared with the file once all sessions are idle);
every statewait reader saw only valid states. Then every reader is interrupted at once
(SIGKILL to half the helpers, SIGINT to the other half and to the ``cat`` processes) and
all of them must exit; the daemon must be left with the trio tasks and file descriptors
it had before the readers came (counted through SIGUSR1, see ollie(1), and
``/proc/<pid>/fd``; pyfuse3's worker pool is counted apart: it shrinks back on its own,
and the backend's HTTP keep-alive connections, a bounded pool, are counted apart too).

Nothing here times anything: ``bench/bench_load.py`` prints the figures.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from olliefs.fs import patched
from olliefs.replay import Entry, ReplayServer
from olliefs.testing import HAVE_FUSE, Daemon, deadline, wait_until
from tests.fs.test_blocking import family, in_fuse_read

READERS = int(os.environ.get("OLLIE_LOAD_READERS", "2000"))
SESSIONS = int(os.environ.get("OLLIE_LOAD_SESSIONS", "50"))
WRITERS = SESSIONS
HELPERS = 8
STATES = {"idle", "thinking", "limitretry", "compacting"}
# Each session streams two replies of this many characters, in deltas of CHUNK with
# DELAY seconds between them, so that the readers are woken many times mid-reply.
REPLY_CHARS, CHUNK, DELAY = 240, 12, 0.01

# A reader helper: one thread per (kind, path) given as JSON on stdin. stream and events
# threads read to EOF (which never comes while the session lives); statewait threads read
# a value, check the second read is EOF, and open again. "report" on stdin answers with
# what each thread holds: (length, sha256) or the list of states seen.
HELPER = r"""
import hashlib, json, os, resource, signal, sys, threading
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
signal.signal(signal.SIGINT, signal.SIG_DFL)  # die of SIGINT as cat does
threading.stack_size(256 * 1024)
jobs = json.loads(sys.stdin.readline())
got = [bytearray() if kind != "statewait" else [] for kind, _ in jobs]
errors = []
def follow(i, path):
    fd = os.open(path, os.O_RDONLY)
    while True:
        data = os.read(fd, 65536)
        if not data:
            errors.append(f"{path}: EOF")
            return
        got[i] += data
def statewait(i, path):
    while True:
        with open(path, "rb", buffering=0) as f:
            value = f.read(4096)
            if f.read(4096) != b"":
                errors.append(f"{path}: second read not EOF")
        got[i].append(value.decode())
for i, (kind, path) in enumerate(jobs):
    target = statewait if kind == "statewait" else follow
    threading.Thread(target=target, args=(i, path), daemon=True).start()
print("started", flush=True)
for line in sys.stdin:
    out = [
        g if isinstance(g, list) else [len(g), hashlib.sha256(bytes(g)).hexdigest()]
        for g in got
    ]
    print(json.dumps({"got": out, "errors": errors}), flush=True)
"""


@dataclass
class Helper:
    proc: subprocess.Popen[str]
    jobs: list[tuple[str, str]]

    def report(self) -> dict[str, list[object]]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("report\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())  # type: ignore[no-any-return]


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def blocked_threads(pids: list[int]) -> int:
    n = 0
    for root in pids:
        for pid in family(root):
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                continue
            n += sum(in_fuse_read(pid, tid) for tid in tids)
    return n


def wait_all_blocked(pids: list[int], n: int, timeout: float = 60) -> None:
    """Wait until ``n`` threads of these processes sit in a FUSE read."""
    with deadline(timeout):
        while (got := blocked_threads(pids)) < n:
            assert got <= n
            time.sleep(0.01)


class Counts(NamedTuple):
    tasks: int  # trio tasks
    workers: int  # pyfuse3 workers
    parked: int  # reads waiting at the end of a log as parked requests, not workers
    fds: int
    inodes: int  # in the FUSE frontend's table
    alive: int  # session objects not freed yet, killed ones included
    refreezes: int  # times what lives was frozen again (olliefs.daemon.Collector)
    frozen: int  # objects in the permanent generation
    collections: int  # by the cyclic garbage collector, all generations


def debug_counts(daemon: Daemon) -> Counts:
    """What the daemon's SIGUSR1 line says."""
    assert daemon.proc is not None
    seen = len(re.findall(r"debug: \d+ trio tasks", daemon.stderr()))
    daemon.proc.send_signal(signal.SIGUSR1)
    lines: list[tuple[str, ...]] = []

    def answered() -> bool:
        lines[:] = re.findall(
            r"debug: (\d+) trio tasks, (\d+) pyfuse3 workers, (\d+) parked reads, (\d+) fds,"
            r" (\d+) inodes,"
            r" (\d+) sessions alive, (\d+) refreezes, (\d+) frozen, (\d+) collections",
            daemon.stderr(),
        )
        return len(lines) > seen

    wait_until(answered, "the SIGUSR1 line", 20, files=[daemon.stderr_path])
    return Counts(*(int(x) for x in lines[-1]))


def backend_sockets(pid: int, port: int) -> set[str]:
    """Inodes of the daemon's TCP sockets to the replay server (httpx's keep-alive pool)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if int(cols[2].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def daemon_fds(daemon: Daemon) -> tuple[int, int]:
    """(fds that are not backend connections, backend connections) of the daemon."""
    assert daemon.proc is not None
    pid = daemon.proc.pid
    pool = backend_sockets(pid, daemon.replay.port)
    other = conns = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in pool:
            conns += 1
        else:
            other += 1
    return other, conns


@pytest.fixture
def loaded(tmp_path: Path) -> Iterator[Daemon]:
    if not HAVE_FUSE:
        pytest.skip(reason="needs /dev/fuse (mounts for real)")
    raise_nofile()
    with ReplayServer() as server:
        daemon = Daemon(tmp_path, server, {"OLLIE_READ_TIMEOUT": "30"})
        with daemon.running():
            yield daemon


def sha(data: bytes) -> list[object]:
    return [len(data), hashlib.sha256(data).hexdigest()]


def test_thousands_of_readers_writers_and_streams(loaded: Daemon) -> None:
    daemon = loaded
    sids = [daemon.new(name=f"L{i}", model=f"m{i}") for i in range(SESSIONS)]
    # A first turn everywhere, so that what a session keeps after its first turn (its
    # history, its backend connection) is there before the baseline is taken.
    for sid in sids:
        daemon.prompt(sid, "warm up")
    for sid in sids:
        daemon.wait_idle(sid)
    tasks0, workers0, parked0, *_ = debug_counts(daemon)
    assert parked0 == 0
    fds0, _ = daemon_fds(daemon)

    # ---- the readers: helpers' threads, and a cat per session -----------------------
    cats = [
        subprocess.Popen(
            ["cat", str(daemon.p(f"s/{sid}/stream"))],
            stdout=subprocess.PIPE,
            process_group=0,
        )
        for sid in sids
    ]
    kinds = ["stream", "events", "stream", "events", "statewait"]  # 40% 40% 20%
    jobs = [
        (kinds[i % len(kinds)], str(daemon.p(f"s/{sids[i % SESSIONS]}/{kinds[i % len(kinds)]}")))
        for i in range(max(READERS - len(cats), 0))
    ]
    helpers = []
    for n in range(HELPERS):
        mine = jobs[n::HELPERS]
        proc = subprocess.Popen(
            [sys.executable, "-c", HELPER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            process_group=0,
        )
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(mine) + "\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "started\n"
        helpers.append(Helper(proc, mine))
    pids = [c.pid for c in cats] + [h.proc.pid for h in helpers]
    try:
        wait_all_blocked(pids, len(jobs) + len(cats))
        # Each blocked read holds a pyfuse3 worker (statewait) or is parked on its log
        # (stream, events): what the counts after the storm must have given back. A
        # thread is in the FUSE wait as soon as its request is queued in the kernel,
        # before the daemon has taken it: wait until the daemon holds them all.
        with deadline(60):
            while sum(debug_counts(daemon)[1:3]) < len(jobs) + len(cats):
                time.sleep(0.05)
        if patched.DEFER:  # the cats' reads of stream hold no worker
            assert debug_counts(daemon).parked >= len(cats)

        # ---- writers and streams --------------------------------------------------------
        for i, sid in enumerate(sids):
            daemon.replay.add(
                Entry(
                    reply=f"{sid}/{n} " + "x" * REPLY_CHARS,
                    chunk=CHUNK,
                    delay=DELAY,
                    for_model=f"m{i}",
                )
                for n in (1, 2)
            )
        failures: list[BaseException] = []

        def writer(sid: str) -> None:
            try:
                daemon.write(f"s/{sid}/cfg", "temperature=0.5\n")
                daemon.prompt(sid, f"first {sid}")
                daemon.write(f"s/{sid}/ctl", "maxsteps")
                try:
                    daemon.write(f"s/{sid}/cfg", "temperature=0.7\n")
                except OSError as e:  # refused while the turn runs: fine, and in chat
                    assert e.errno == 16, e
                daemon.prompt(sid, f"second {sid}")
            except BaseException as e:
                failures.append(e)

        threads = [threading.Thread(target=writer, args=(sid,)) for sid in sids[:WRITERS]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failures, failures
        for sid in sids:
            daemon.wait_idle(sid)
            assert daemon.read(f"s/{sid}/chat").endswith(
                f"assistant: {sid}/2 {'x' * REPLY_CHARS}\n"
            )

        # ---- every reader got every byte ------------------------------------------------
        # (stream holds the bytes of chat; events read without blocking up to its end)
        want = {}
        for sid in sids:
            want[str(daemon.p(f"s/{sid}/stream"))] = sha(daemon.p(f"s/{sid}/chat").read_bytes())
            want[str(daemon.p(f"s/{sid}/events"))] = sha(
                daemon.snapshot(f"s/{sid}/events").encode()
            )
        with deadline(120):
            for helper in helpers:
                while True:
                    report = helper.report()
                    assert not report["errors"], report["errors"]
                    pending = [
                        path
                        for (kind, path), got in zip(helper.jobs, report["got"], strict=True)
                        if kind != "statewait" and got != want[path]
                    ]
                    if not pending:
                        break
                    time.sleep(0.05)  # readers still catching up: ask again
                for (kind, path), got in zip(helper.jobs, report["got"], strict=True):
                    if kind == "statewait":
                        assert isinstance(got, list) and got, path
                        assert {v.strip() for v in got} <= STATES, got
        # every reader is blocked again, at the end of its file
        wait_all_blocked(pids, len(jobs) + len(cats))

        # ---- every reader interrupted at once -------------------------------------------
        for n, h in enumerate(helpers):
            os.killpg(h.proc.pid, signal.SIGKILL if n % 2 else signal.SIGINT)
        for c in cats:
            os.killpg(c.pid, signal.SIGINT)
        with deadline(60):
            for h in helpers:
                h.proc.wait()
            for i, c in enumerate(cats):
                assert c.wait() == -signal.SIGINT
                assert c.stdout is not None
                out = c.stdout.read()
                assert sha(out) == want[str(daemon.p(f"s/{sids[i]}/stream"))]
        assert [h.proc.returncode for h in helpers] == [
            -signal.SIGKILL if n % 2 else -signal.SIGINT for n in range(HELPERS)
        ]
    finally:
        procs: list[subprocess.Popen[Any]] = [*(h.proc for h in helpers), *cats]
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            for f in (p.stdin, p.stdout):
                if f is not None:
                    f.close()

    # ---- nothing leaked ---------------------------------------------------------------
    # The daemon answers every interrupted read; its workers go back to the pool. Wait
    # (on the daemon's own counts) until everything else is back where it was.
    with deadline(60):
        while True:
            tasks, workers, parked, *_ = debug_counts(daemon)
            fds, conns = daemon_fds(daemon)
            if (tasks - workers, fds, parked) == (tasks0 - workers0, fds0, 0):
                break
            time.sleep(0.05)
    print(f"tasks {tasks0}->{tasks} workers {workers0}->{workers} fds {fds0}->{fds} conns {conns}")
    assert conns <= SESSIONS
