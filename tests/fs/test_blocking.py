"""Blocking files: live wake-ups, Ctrl-C on a blocked reader, many waiters, one byte stream."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from tests.conftest import Daemon, deadline, script


def _blocked_cat(daemon: Daemon, rel: str) -> subprocess.Popen[bytes]:
    """A ``cat`` that has read everything there is and now waits at the end."""
    want = len(daemon.snapshot(rel).encode())
    proc = subprocess.Popen(["cat", str(daemon.p(rel))], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    got = 0
    with deadline(20):
        while got < want:
            got += len(os.read(proc.stdout.fileno(), 65536))
    return proc


def test_stream_wakes_on_new_text(daemon: Daemon) -> None:
    daemon.new(name="live")
    proc = _blocked_cat(daemon, "s/live/stream")
    assert proc.stdout is not None
    try:
        daemon.prompt("live", "ping")
        seen = b""
        with deadline(20):
            while b"assistant: echo: ping\n" not in seen:
                seen += os.read(proc.stdout.fileno(), 65536)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_sigint_ends_a_blocked_cat(daemon: Daemon) -> None:
    daemon.new(name="int")
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        proc = _blocked_cat(daemon, "s/int/stream")
        assert proc.stdout is not None
        proc.send_signal(sig)
        # No data arrives: only the interrupt mechanism can end this read.
        assert proc.wait(timeout=10) == -sig
        proc.stdout.close()
    assert daemon.read("s/int/state") == "idle\n"


def test_caught_sigint_interrupts_the_read(daemon: Daemon) -> None:
    """A reader that handles SIGINT itself (Python's KeyboardInterrupt) gets control back."""
    daemon.new(name="py")
    code = (
        "import sys\n"
        "f = open(sys.argv[1], 'rb')\n"
        "f.read1(1 << 20)\n"
        "print('blocked', flush=True)\n"
        "try:\n"
        "    f.read1(1 << 20)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(daemon.p("s/py/stream"))],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "blocked\n"
    time.sleep(0.05)  # let it enter the blocking read; correctness does not depend on it
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline() == "interrupted\n"
    assert proc.wait(timeout=10) == 0
    proc.stdout.close()


def test_statewait_and_events_interruptible(daemon: Daemon) -> None:
    daemon.new(name="sw")
    for rel in ("s/sw/statewait", "events"):
        proc = subprocess.Popen(["cat", str(daemon.p(rel))], stdout=subprocess.DEVNULL)
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == -signal.SIGINT


def test_a_thousand_blocked_readers_do_not_stall_the_mount(daemon: Daemon) -> None:
    daemon.new(name="many")
    path = daemon.p("s/many/stream")
    start = len(daemon.read("s/many/chat").encode())
    n = 1000
    ready = threading.Semaphore(0)
    results: list[bytes] = []
    lock = threading.Lock()

    def reader() -> None:
        with open(path, "rb", buffering=0) as f:
            data = f.read(start)
            ready.release()
            while True:
                chunk = f.read(65536)
                if not chunk:
                    break
                data += chunk
        with lock:
            results.append(data)

    threads = [threading.Thread(target=reader, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for _ in range(n):
        assert ready.acquire(timeout=60)
    # every reader is at the end of the stream (or about to block there): the mount
    # must still answer everything else at once
    with deadline(20):
        for _ in range(20):
            os.stat(daemon.p("s/many/chat"))
            assert daemon.read("s/many/state") == "idle\n"
            assert daemon.read("backends").startswith("openai")
    daemon.prompt("many", "wake")
    daemon.wait_idle("many")
    final = daemon.read("s/many/chat").encode()
    daemon.write("s/many/ctl", "kill")  # EOF for every reader
    for t in threads:
        t.join(timeout=60)
    assert len(results) == n
    assert final.endswith(b"assistant: echo: wake\n")
    assert all(r == final + b":: session killed\n" for r in results)


def test_stream_tail_and_size_polling_see_the_same_bytes(daemon: Daemon) -> None:
    daemon.replay.add(
        script(
            '{"reply": "first answer, streamed slowly", "chunk": 3, "delay": 0.01}',
            '{"reasoning": "hmm", "reply": "second", "chunk": 2, "delay": 0.01}',
        )
    )
    daemon.new(name="same")
    chat = daemon.p("s/same/chat")
    cat = subprocess.Popen(["cat", str(daemon.p("s/same/stream"))], stdout=subprocess.PIPE)
    tail = subprocess.Popen(["tail", "-c", "+1", "-f", str(chat)], stdout=subprocess.PIPE)
    polled = bytearray()
    stop = threading.Event()

    def poll_by_size() -> None:
        # how an editor follows a file: stat, then read what is new
        while not stop.is_set():
            size = os.stat(chat).st_size
            if size > len(polled):
                with open(chat, "rb") as f:
                    f.seek(len(polled))
                    polled.extend(f.read(size - len(polled)))
            time.sleep(0.01)

    poller = threading.Thread(target=poll_by_size)
    poller.start()
    try:
        daemon.prompt("same", "one")
        daemon.prompt("same", "two")
        daemon.wait_idle("same")
        final = daemon.read("s/same/chat").encode()
        assert b"<think>\nhmm\n</think>\nassistant: second\n" in final
        outs = []
        for proc in (cat, tail):
            assert proc.stdout is not None
            got = b""
            with deadline(20):
                while len(got) < len(final):
                    got += os.read(proc.stdout.fileno(), 65536)
            outs.append(got)
        with deadline(20):
            while len(polled) < len(final):
                time.sleep(0.01)
        assert outs[0] == final and outs[1] == final and bytes(polled) == final
    finally:
        stop.set()
        poller.join()
        for proc in (cat, tail):
            proc.kill()
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
