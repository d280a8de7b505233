"""Blocking files: live wake-ups, signals on a blocked reader, many waiters, one byte stream.

A signal test is only worth something if the reader really is blocked in the read when
the signal comes: a reader signalled on its way there dies whatever the daemon does.
So every such test first waits until the reader's thread sits in a FUSE request
(``/proc/<pid>/task/<tid>/wchan``) inside a read system call (``.../syscall``), and
nothing else can end that read: no data arrives, only the interrupt can free it.
"""

from __future__ import annotations

import ctypes
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable

import pytest

from tests.conftest import Daemon, deadline, script

# System call numbers of read(2), readv, pread64, preadv per machine; elsewhere only the
# wchan is looked at.
READS = {"x86_64": {0, 17, 19, 295}, "aarch64": {63, 65, 67, 69}}.get(platform.machine())
SYS_TGKILL = {"x86_64": 234, "aarch64": 131}.get(platform.machine(), 234)
libc = ctypes.CDLL(None, use_errno=True)


def _proc(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:  # gone, or a thread that just ended
        return ""


def in_fuse_read(pid: int, tid: int) -> bool:
    """Is this thread blocked in a read that waits for the FUSE daemon's answer?"""
    wchan = _proc(f"/proc/{pid}/task/{tid}/wchan")
    if not (wchan == "request_wait_answer" or wchan.startswith("fuse_")):
        return False
    if READS is None:
        return True
    nr = _proc(f"/proc/{pid}/task/{tid}/syscall").split(" ", 1)[0]
    return nr.isdigit() and int(nr) in READS


def _tasks(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def family(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for tid in _tasks(p):
            todo += [int(c) for c in _proc(f"/proc/{p}/task/{tid}/children").split()]
    return out


def blocked(pids: Iterable[int]) -> list[int]:
    """The threads of ``pids`` that are blocked in a FUSE read."""
    return [tid for pid in pids for tid in _tasks(pid) if in_fuse_read(pid, tid)]


def wait_blocked(root: int, n: int = 1) -> list[int]:
    """Wait until ``n`` threads of ``root`` or its descendants are blocked in a FUSE read;
    returns the pids (not tids) of the processes holding them."""
    with deadline(30):
        while True:
            pids = [p for p in family(root) if blocked([p])]
            if len(blocked(pids)) >= n:
                return pids
            time.sleep(0.005)


def state(pid: int) -> str:
    """The process's state letter (R, S, D, T, Z...), "" when there is no such process."""
    stat = _proc(f"/proc/{pid}/stat")
    return stat.rsplit(")", 1)[1].split()[0] if stat else ""


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody reaped yet (its orphan's reaper)."""
    return state(pid) in ("", "Z")


def out_of_the_read(pid: int) -> bool:
    """Stopped (the read returned and the stop took effect) or exited."""
    return state(pid) in ("", "Z", "T", "t")


def drain(proc: subprocess.Popen[bytes], want: int) -> bytes:
    """Read what the reader passes on until ``want`` bytes: it is then at the end."""
    assert proc.stdout is not None
    got = b""
    with deadline(20):
        while len(got) < want:
            chunk = os.read(proc.stdout.fileno(), 65536)
            assert chunk, f"reader ended early: {got!r}"
            got += chunk
    return got


def start_reader(daemon: Daemon, argv: list[str], rel: str) -> tuple[subprocess.Popen[bytes], int]:
    """Start ``argv`` (``{}`` stands for the path of ``rel``) as a shell starts a job (a
    process group of its own in our session, so that a stop signal really stops it), and
    return it once a process of it is blocked reading ``rel``, with that reader's pid."""
    want = len(daemon.snapshot(rel).encode())
    path = str(daemon.p(rel))
    proc = subprocess.Popen(
        [path if a == "{}" else a for a in argv], stdout=subprocess.PIPE, process_group=0
    )
    drain(proc, want)
    (reader,) = wait_blocked(proc.pid)
    return proc, reader


def end(daemon: Daemon, proc: subprocess.Popen[bytes]) -> None:
    """Kill what is left of a reader's job. If the read holds it even against SIGKILL (the
    defect these tests are about), the daemon is stopped, which ends every read with EOF,
    so that a failing test fails instead of hanging."""
    for pid in family(proc.pid):
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        daemon.stop()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


# The reader is the process that opened the file, or one that only inherited it: the
# shapes from the issue (``timeout 5 jq -c . < events``; ``exec 3<``; a command group).
PATTERNS = {
    "opener": ["cat", "{}"],
    "timeout": ["bash", "-c", 'timeout 600 cat < "$1"', "sh", "{}"],
    "exec-fd": ["bash", "-c", 'exec 3< "$1"; cat <&3', "sh", "{}"],
    "group": ["bash", "-c", '{ cat; cat; } < "$1"', "sh", "{}"],
}


def signal_ends_reader(daemon: Daemon, argv: list[str], rel: str, sig: int) -> None:
    """Ctrl-C (or kill) the job: the blocked reader and the whole job must go."""
    proc, reader = start_reader(daemon, argv, rel)
    try:
        # What a terminal does on Ctrl-C, to the reader's process group: GNU timeout puts
        # itself and its command in a group of their own.
        os.killpg(os.getpgid(reader), sig)
        code = proc.wait(timeout=20)  # a deadline for a hang, not a timing
        if argv[0] == "cat":
            assert code == -sig
        daemon.wait_for(lambda: gone(reader))
    finally:
        end(daemon, proc)


# ---- wake-ups ------------------------------------------------------------------------


def test_stream_wakes_on_new_text(daemon: Daemon) -> None:
    daemon.new(name="live")
    proc, _ = start_reader(daemon, ["cat", "{}"], "s/live/stream")
    assert proc.stdout is not None
    try:
        daemon.prompt("live", "ping")
        seen = b""
        with deadline(20):
            while b"assistant: echo: ping\n" not in seen:
                seen += os.read(proc.stdout.fileno(), 65536)
    finally:
        end(daemon, proc)


# ---- signals -------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_signal_ends_a_blocked_stream_reader(daemon: Daemon, pattern: str) -> None:
    daemon.new(name="int")
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        signal_ends_reader(daemon, PATTERNS[pattern], "s/int/stream", sig)
    assert daemon.read("s/int/state") == "idle\n"


@pytest.mark.parametrize("rel", ["s/sw/statewait", "s/sw/events", "events", "s/sw/fifo.out"])
@pytest.mark.parametrize("pattern", ["opener", "timeout", "exec-fd"])
def test_statewait_and_events_readers_are_killable(daemon: Daemon, rel: str, pattern: str) -> None:
    daemon.new(name="sw")
    for sig in (signal.SIGINT, signal.SIGKILL):
        signal_ends_reader(daemon, PATTERNS[pattern], rel, sig)


@pytest.mark.parametrize("rel", ["stream", "events", "statewait", "fifo.out"])
def test_removing_the_session_ends_its_blocked_reads(daemon: Daemon, rel: str) -> None:
    """EOF for a reader blocked on any of the session's blocking files when the session
    goes; the daemon's shutdown relies on it too (it ends the FUSE loop only after)."""
    daemon.new(name="gone")
    proc, _ = start_reader(daemon, ["cat", "{}"], f"s/gone/{rel}")
    try:
        daemon.write("s/gone/ctl", "kill")
        assert proc.wait(timeout=20) == 0
    finally:
        end(daemon, proc)


def test_caught_sigint_interrupts_the_read(daemon: Daemon) -> None:
    """A reader that handles SIGINT itself (Python's KeyboardInterrupt) gets control back,
    and its read fails with EINTR rather than going on."""
    daemon.new(name="py")
    code = (
        "import sys\n"
        "f = open(sys.argv[1], 'rb', buffering=0)\n"
        "sys.stdout.buffer.write(f.read(1 << 20)); sys.stdout.flush()\n"
        "try:\n"
        "    f.read(1 << 20)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
    )
    proc, reader = start_reader(daemon, [sys.executable, "-c", code, "{}"], "s/py/stream")
    assert proc.stdout is not None
    try:
        assert reader == proc.pid
        proc.send_signal(signal.SIGINT)
        with deadline(20):
            assert proc.stdout.readline() == b"interrupted\n"
        assert proc.wait(timeout=20) == 0
    finally:
        end(daemon, proc)


THREADED = """
import os, sys, threading
path, n = sys.argv[1], int(sys.argv[2])
def reader():
    with open(path, 'rb', buffering=0) as f:
        f.read(1)
for _ in range(n):
    threading.Thread(target=reader, daemon=True).start()
threading.Event().wait()
"""


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name
)
def test_threads_of_a_reader_are_released(daemon: Daemon, sig: int) -> None:
    """Readers that are not the main thread: the process exits whole. The request names
    each reader thread; a caught SIGINT goes to the main thread, and its exit then
    kills the blocked threads, which the daemon must release too."""
    daemon.new(name="mt")
    n = 4
    argv = [sys.executable, "-c", THREADED, str(daemon.p("s/mt/statewait")), str(n)]
    proc = subprocess.Popen(argv, process_group=0)
    try:
        wait_blocked(proc.pid, n)
        os.killpg(proc.pid, sig)
        assert proc.wait(timeout=20) == -sig
    finally:
        end(daemon, proc)


# One thread (not the main one) reads with read(2) itself, as C code does: Python's own
# reads retry after EINTR (PEP 475), and only the main thread runs Python's handlers, so
# a Python read in a thread goes on after the daemon ended it. The main thread waits for
# a line on stdin, then sends the signal itself when the line says "self".
THREAD_READER = """
import ctypes, os, signal, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
caught = []
signal.signal(signal.SIGUSR1, lambda *_: caught.append(1))
fd = os.open(sys.argv[1], os.O_RDONLY)
buf = ctypes.create_string_buffer(1 << 20)
def reader():
    while (n := libc.read(fd, buf, 1 << 20)) > 0:
        pass
    print("read:", os.strerror(ctypes.get_errno()) if n < 0 else "EOF", flush=True)
t = threading.Thread(target=reader)
t.start()
if sys.stdin.readline().strip() == "self":
    signal.pthread_kill(t.ident, signal.SIGUSR1)
t.join()
print("caught", len(caught), flush=True)
"""


@pytest.mark.parametrize("sender", ["tgkill", "self"])
def test_a_handled_signal_sent_to_a_reading_thread_ends_its_read(
    daemon: Daemon, sender: str
) -> None:
    """A signal with a handler, aimed at the one thread (not the main one) that is blocked
    in the read (tgkill from outside, or pthread_kill from the process's main thread):
    that read fails with EINTR at once, and the handler runs."""
    daemon.new(name="thr")
    argv = [sys.executable, "-c", THREAD_READER, str(daemon.p("s/thr/stream"))]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, process_group=0)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        wait_blocked(proc.pid, 1)
        (tid,) = blocked([proc.pid])
        assert tid != proc.pid  # the reader is not the main thread
        if sender == "tgkill":
            assert libc.syscall(SYS_TGKILL, proc.pid, tid, signal.SIGUSR1) == 0
        proc.stdin.write(f"{sender}\n".encode())
        proc.stdin.flush()
        with deadline(20):
            assert proc.stdout.readline() == b"read: Interrupted system call\n"
            assert proc.stdout.readline() == b"caught 1\n"
        assert proc.wait(timeout=20) == 0
    finally:
        proc.stdin.close()
        end(daemon, proc)


# A reader that takes EINTR as an error, as stdio programs (jq) do; cat retries.
STRICT = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open(sys.argv[1], os.O_RDONLY)
buf = ctypes.create_string_buffer(65536)
while (n := libc.read(fd, buf, 65536)) > 0:
    os.write(1, buf.raw[:n])
sys.exit(f"read: {os.strerror(ctypes.get_errno())}" if n else 0)
"""


@pytest.mark.parametrize("reader", ["cat", "strict"])
def test_ctrl_z_then_fg_does_not_end_a_blocked_read(daemon: Daemon, reader: str) -> None:
    """SIGTSTP on a blocked ``cat stream`` must not fail its read (FUSE cannot restart a
    read after a stop): after SIGCONT the same read goes on and gets the next bytes."""
    daemon.new(name="tstp")
    argv = ["cat", "{}"] if reader == "cat" else [sys.executable, "-c", STRICT, "{}"]
    proc, reader_pid = start_reader(daemon, argv, "s/tstp/stream")
    assert proc.stdout is not None
    try:
        os.killpg(proc.pid, signal.SIGTSTP)
        # the daemon got the interrupt, looked, and chose to wait on (or ended the read)
        needle = f"blocked read of thread {reader_pid}: stopped"
        daemon.wait_for(lambda: needle in daemon.stderr() or out_of_the_read(reader_pid))
        assert not out_of_the_read(reader_pid), "Ctrl-Z ended the read"
        os.killpg(proc.pid, signal.SIGCONT)
        daemon.prompt("tstp", "after the stop")
        seen = b""
        with deadline(20):
            while b"assistant: echo: after the stop\n" not in seen:
                chunk = os.read(proc.stdout.fileno(), 65536)
                assert chunk, "cat ended"
                seen += chunk
        assert proc.poll() is None
    finally:
        end(daemon, proc)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_a_stopped_blocked_reader_can_still_be_killed(daemon: Daemon, sig: int) -> None:
    """The kernel sends one interrupt per request; it was spent on the stop. The signal
    that comes after must still free the reader."""
    daemon.new(name="stopkill")
    proc, reader = start_reader(daemon, PATTERNS["group"], "s/stopkill/stream")
    try:
        os.killpg(proc.pid, signal.SIGTSTP)
        needle = f"blocked read of thread {reader}: stopped"
        daemon.wait_for(lambda: needle in daemon.stderr() or out_of_the_read(reader))
        assert not out_of_the_read(reader), "the stop ended the read"
        os.killpg(proc.pid, sig)
        os.killpg(proc.pid, signal.SIGCONT)  # as a shell's ``kill %1`` does
        proc.wait(timeout=20)
        daemon.wait_for(lambda: gone(reader))
    finally:
        end(daemon, proc)


@pytest.mark.parametrize(
    "cmd", ["timeout 0.2 cat s/bound/statewait", "timeout 0.2 cat < s/bound/events"]
)
def test_timeout_bounds_a_wait(daemon: Daemon, cmd: str) -> None:
    """How a script bounds a wait (ollie(5)): ``timeout`` ends the read (its SIGTERM goes
    to the reader, whether or not it opened the file) and says so."""
    daemon.new(name="bound")
    proc = subprocess.run(
        ["bash", "-c", cmd], cwd=daemon.path, stdout=subprocess.DEVNULL, timeout=60
    )
    assert proc.returncode == 124


# ---- many readers --------------------------------------------------------------------


def test_a_thousand_blocked_readers_do_not_stall_the_mount(daemon: Daemon) -> None:
    daemon.new(name="many")
    path = daemon.p("s/many/stream")
    start = len(daemon.read("s/many/chat").encode())
    n = 1000
    results: list[bytes] = []
    lock = threading.Lock()
    at_end = threading.Semaphore(0)

    def reader() -> None:
        with open(path, "rb", buffering=0) as f:
            data = f.read(start)
            at_end.release()  # the next read is the one that blocks
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
        assert at_end.acquire(timeout=60)
    # every reader is blocked at the end of the stream: the mount must still answer
    # everything else at once
    wait_blocked(os.getpid(), n)
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


# ---- one byte stream -----------------------------------------------------------------


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
    grew = threading.Condition()

    def poll_by_size() -> None:
        # how an editor follows a file: on its timer (Emacs' auto-revert: a few times a
        # second), stat, then read what is new
        while not stop.wait(0.01):
            size = os.stat(chat).st_size
            if size > len(polled):
                with open(chat, "rb") as f:
                    f.seek(len(polled))
                    more = f.read(size - len(polled))
                with grew:
                    polled.extend(more)
                    grew.notify_all()

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
        with grew:
            assert grew.wait_for(lambda: len(polled) >= len(final), 20), "the editor fell behind"
        assert outs[0] == final and outs[1] == final and bytes(polled) == final
    finally:
        stop.set()
        poller.join()
        for proc in (cat, tail):
            proc.kill()
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()


# ---- reads at and past the end of a log ------------------------------------------------


def test_a_read_past_the_end_waits_until_the_log_reaches_it(daemon: Daemon) -> None:
    """A read at an offset past the end (a pread, or a seek and a read) is woken by each
    append, and waits on while the log is still short of its offset: it returns the bytes
    there, never an early EOF. A read at the end on the same descriptor gets the first
    append's bytes at once."""
    sid = daemon.new(name="far")
    rel = f"s/{sid}/events"

    def grow() -> int:  # one event more (a cfg change is journaled and logged)
        before = len(daemon.snapshot(rel).encode())
        daemon.write(f"s/{sid}/cfg", f"temperature=0.{before % 9 + 1}\n")
        daemon.wait_for(lambda: len(daemon.snapshot(rel).encode()) > before)
        return len(daemon.snapshot(rel).encode()) - before

    fd = os.open(daemon.p(rel), os.O_RDONLY)
    got: dict[str, bytes] = {}

    def pread(name: str, off: int) -> None:
        got[name] = os.pread(fd, 65536, off)

    try:
        size = len(daemon.snapshot(rel).encode())
        at_end = threading.Thread(target=pread, args=("end", size))
        at_end.start()
        with deadline(30):
            while len(blocked([os.getpid()])) < 1:
                time.sleep(0.005)
        step = grow()
        at_end.join(20)
        assert got["end"] == daemon.snapshot(rel).encode()[size : size + step]

        # Two events more fall short of it: an event's size varies by a few bytes (its
        # time stamp's digits), far less than the margin.
        far = len(daemon.snapshot(rel).encode()) + 2 * step + 32
        past = threading.Thread(target=pread, args=("far", far))
        past.start()
        with deadline(30):
            while len(blocked([os.getpid()])) < 1:
                time.sleep(0.005)
        grow()
        grow()  # the log is still short of the offset: the read waits on
        assert len(daemon.snapshot(rel).encode()) <= far
        assert "far" not in got and len(blocked([os.getpid()])) == 1
        while len(daemon.snapshot(rel).encode()) <= far:
            grow()
        past.join(20)
        assert got["far"] == daemon.snapshot(rel).encode()[far : far + 65536]
        assert got["far"]
    finally:
        os.close(fd)
