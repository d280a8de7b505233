"""How fast ``cat state`` answers while the backend misbehaves (issue 11 item 7: 100 ms).

Run: ``.venv/bin/python bench/bench_faults.py [wire ...]`` (root, /dev/fuse; wires default
to openai and anthropic). Prints a table; it asserts nothing. Every figure is measured in
this run, the reference too.

For each wire, a real daemon talks to the replay server. First the reference: a session
whose backend is idle, its ``state`` read ``SAMPLES`` times (open, read, close: what
``cat state`` does, without the fork). Then, for each fault, a session is put into it
(its request is seen at the replay server before sampling starts) and the same file of
that session is read ``SAMPLES`` times while the fault runs: a 429 wait (Retry-After),
a 5xx back-off, a stream dropped and retried over and over, a slow-loris reply (a byte per
``BYTE_DELAY``), a queue of turns ending in garbage, a stream hung after its headers, a
server that never answers. p50, p99 and the worst read go next to the reference, and the
p99 ratio to it. A fault still running when its samples are done is stopped (``ctl
stop``), and how long the stop took to reach ``idle`` is printed too.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import msgspec

from olliefs.replay import Entry, ReplayServer
from olliefs.testing import Daemon, expect_log

SAMPLES = int(os.environ.get("OLLIE_BENCH_SAMPLES", "1000"))
BYTE_DELAY = 0.01
KEY = "sk-bench-faults"

FAULTS: dict[str, list[Entry]] = {
    "429, Retry-After 30": [Entry(status=429, retry_after="30")] * 4,
    "5xx back-off (30 s base)": [Entry(status=503)] * 4,
    "drop mid-stream, again": [Entry(reply="word " * 400, chunk=5, delay=0.002, drop_after=300)]
    * 4,
    f"slow-loris, 1 B/{BYTE_DELAY * 1000:g} ms": [
        Entry(reply="slow " * 2000, byte_delay=BYTE_DELAY)
    ],
    "garbage, 200 turns queued": [Entry(garbage="{not json")] * 200,
    "hung after headers": [Entry(hang=True)],
    "accepted, never answered": [Entry(silent=True)],
}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def sample(path: Path) -> list[float]:
    out = []
    for _ in range(SAMPLES):
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            f.read()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def run_wire(wire: str, base: Path) -> None:
    with ReplayServer(key=KEY) as server:
        daemon = Daemon(
            base,
            server,
            {
                **server.settings(),
                "OLLIE_RETRY_BASE": "30",
                "OLLIE_RATELIMIT_BASE": "30",
                "OLLIE_READ_TIMEOUT": "3600",
            },
        )
        expect_log(r"HTTP [45]\d\d", count=None)  # the faults it is fed
        with daemon.running():
            idle = daemon.new(name="idle", backend=wire, model="idle")
            reads = sample(daemon.p(f"s/{idle}/state"))
            rows: list[tuple[str, list[float], float | None]] = [("idle backend", reads, None)]
            for i, (name, entries) in enumerate(FAULTS.items()):
                model = f"fault{i}"
                server.add([msgspec.structs.replace(e, for_model=model) for e in entries])
                sid = daemon.new(name=model, backend=wire, model=model)
                if name.startswith("garbage"):
                    for n in range(len(entries)):
                        daemon.prompt(sid, f"go {n}")
                else:
                    daemon.prompt(sid, "go")
                daemon.wait_for(partial(seen, server, model))
                reads = sample(daemon.p(f"s/{sid}/state"))
                stop_ms = None
                if daemon.read(f"s/{sid}/state") != "idle\n":
                    t0 = time.perf_counter()
                    daemon.write(f"s/{sid}/ctl", "stop")
                    while daemon.read(f"s/{sid}/state") != "idle\n":
                        # garbage: the queue drains turn by turn; others stop at once
                        if name.startswith("garbage"):
                            daemon.write(f"s/{sid}/ctl", "stop")
                    stop_ms = (time.perf_counter() - t0) * 1000
                rows.append((name, reads, stop_ms))
    ref = pct(rows[0][1], 0.99)
    print(f"wire {wire}: `cat state` (open+read+close), {SAMPLES} reads each, ms")
    print(f"    {'during':30s} {'p50':>7s} {'p99':>7s} {'max':>7s}  p99/ref  stop->idle")
    for name, reads, stop_ms in rows:
        stop = f"{stop_ms:8.1f}" if stop_ms is not None else "       -"
        print(
            f"    {name:30s} {pct(reads, 0.5):7.3f} {pct(reads, 0.99):7.3f}"
            f" {max(reads):7.3f}  {pct(reads, 0.99) / ref:6.2f}x  {stop}"
        )


def seen(server: ReplayServer, model: str) -> bool:
    return any(r.model == model for r in server.recorded)


def main() -> int:
    wires = sys.argv[1:] or ["openai", "anthropic"]
    for wire in wires:
        with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
            run_wire(wire, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
