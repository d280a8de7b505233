"""Foundation benchmark: token latency to a blocked ``stream`` reader, and file access cost.

Run: ``.venv/bin/python bench/bench_foundation.py`` (root, /dev/fuse). Prints medians and
ratios against references measured in the same run; it asserts nothing.

(a) token latency: the replay server streams a reply one token at a time; each token's
    send time (taken right after it was flushed to the socket) is compared with the time a
    ``read`` blocked on ``s/<id>/stream`` returns it. Reference: a plain httpx client
    reading the same SSE stream straight from the replay server.
(b) ``stat`` + ``read`` of a session file through the mount against the same on a plain
    tmpfs file (/dev/shm).
(c) Ctrl-C: time from SIGINT to the exit of a ``cat`` blocked on ``stream``.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from perf_stream import Clock, lat, receive_times, token_direct

from olliefs.replay import ReplayServer, parse_script
from olliefs.testing import Daemon

TOKENS = 200
GAP = 0.01  # seconds between tokens: each one travels alone
STAT_READS = 3000


def token_script() -> str:
    reply = "".join(f"<{i:04d}>" for i in range(TOKENS))
    return f'{{"reply": "{reply}", "chunk": 6, "delay": {GAP}}}'


def through_olliefs(clock: Clock, d: Daemon) -> list[float]:
    d.new(name="bench")
    chunks: list[tuple[bytes, float]] = []
    fd = os.open(d.p("s/bench/stream"), os.O_RDONLY)
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            data = os.read(fd, 65536)
            if not data:
                return
            chunks.append((data, time.monotonic()))

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    d.prompt("bench", "go")
    d.wait_idle("bench")
    stop.set()
    d.write("s/bench/ctl", "kill")  # EOF ends the reader
    t.join()
    os.close(fd)
    return lat(clock, receive_times(chunks))


def stat_read(path: Path) -> list[float]:
    out = []
    for _ in range(STAT_READS):
        t0 = time.perf_counter()
        os.stat(path)
        with open(path, "rb") as f:
            f.read()
        out.append(time.perf_counter() - t0)
    return out


def ctrl_c(d: Daemon, runs: int = 10) -> list[float]:
    d.new(name="intr")
    out = []
    for _ in range(runs):
        proc = subprocess.Popen(["cat", str(d.p("s/intr/stream"))], stdout=subprocess.PIPE)
        assert proc.stdout is not None
        os.read(proc.stdout.fileno(), 65536)  # it has the chat and now waits at the end
        time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait()
        out.append(time.monotonic() - t0)
        proc.stdout.close()
    return out


def ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:8.3f} ms"


def us(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e6:8.1f} us"


def main() -> int:
    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp, ReplayServer(on_send=clock.on_send) as srv:
        srv.add(parse_script(token_script()))
        ref = token_direct(clock, srv)
        clock.sent.clear()
        srv.add(parse_script(token_script()))
        d = Daemon(Path(tmp), srv, {})
        d.start()
        try:
            fs = through_olliefs(clock, d)
            d.new(name="files")
            d.prompt("files", "hello")
            d.wait_idle("files")
            mount_sr = stat_read(d.p("s/files/chat"))
            shm = Path("/dev/shm") / f"olliefs-bench-{os.getpid()}"
            shm.write_bytes(d.p("s/files/chat").read_bytes())
            try:
                tmpfs_sr = stat_read(shm)
            finally:
                shm.unlink()
            intr = ctrl_c(d)
        finally:
            d.stop()
    print(f"(a) token -> reader latency, median of {len(fs)} tokens")
    print(f"    through olliefs (replay -> backend -> chat -> blocked read): {ms(fs)}")
    print(f"    reference (httpx reading the replay server directly):        {ms(ref)}")
    print(f"    ratio olliefs / direct: {statistics.median(fs) / statistics.median(ref):.2f}x")
    print(f"    p90 through olliefs: {sorted(fs)[int(len(fs) * 0.9)] * 1e3:.3f} ms")
    print(f"(b) stat + read of a file, median of {STAT_READS}")
    print(f"    s/<id>/chat through the mount: {us(mount_sr)}")
    print(f"    same bytes on tmpfs:           {us(tmpfs_sr)}")
    ratio = statistics.median(mount_sr) / statistics.median(tmpfs_sr)
    print(f"    ratio mount / tmpfs: {ratio:.1f}x")
    print(f"(c) SIGINT -> exit of a cat blocked on stream, median of {len(intr)}: {ms(intr)}")
    print(f"    worst: {max(intr) * 1e3:.1f} ms (target: under 500 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
