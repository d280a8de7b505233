r"""Test and benchmark harness: a real olliefs daemon in a subprocess, on a private home.

Used by the test-suite (``tests/conftest.py``) and by ``bench/``. The daemon always runs
in a subprocess: a process must never touch a FUSE mount from the thread that serves it,
and a subprocess is also what a user runs. Callers talk to the mount with plain file
operations, exactly as a shell would.

Logs (the s3ql habit, one rule for every log a test produces): a log record at WARNING or
above fails the test unless the test declared it. That holds for the test process's own
``logging`` (checked by the autouse fixture in ``tests/conftest.py``), and for the logs of
the daemons and toolsrvs it ran (``Daemon.check_log`` and ``ToolsrvProc.check_log``, both
through ``check_log_files``, when they stop; a fixture wider than a test wraps its daemon
in ``logs_checked()``, whose declarations are its own). A declaration says which records
to expect::

    from olliefs.testing import expect_log

    def test_x(daemon):
        expect_log(r"olliefs\.toolclient\.spawn: toolsrv .* exited")  # the rest of the test
        ...
        with expect_log("cannot parse", level=logging.ERROR):  # only within the block
            ...

    @pytest.mark.expect_log(r"HTTP 5\d\d", count=None)  # the same, for the whole test
    def test_y(daemon): ...

``pattern`` is a regular expression searched in ``"<logger name>: <message>"`` (with any
traceback after it), ``level`` must be the record's level exactly (WARNING unless said),
``count`` is how many such records the test must produce (default 1; None: one or more;
a ``range``: as many as it holds, for a fuzzer whose drawn inputs decide, never to be
lenient with a test that could know).
A declaration made with ``with`` covers the records logged (or, for a subprocess, checked)
within its block, and its count is checked at the block's end; a daemon's or toolsrv's log
is checked when it stops, so declare its records with a plain call (for the rest of the
test), or in a block that stops it. A declaration the test never meets fails it too, so
declarations cannot outlive the warning they were written for. Never declare a broad
pattern to quiet a log: a warning nobody expected is a bug to fix, or a behaviour to name
in the test that causes it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from types import FrameType

import trio

from olliefs.replay import ReplayServer
from olliefs.settings import shipped_dir
from olliefs.toolclient.client import ToolsrvConn, connect
from toolsrv.protect import FILE_EVENTS, Inotify

HAVE_FUSE = os.path.exists("/dev/fuse") and os.access("/dev/fuse", os.R_OK | os.W_OK)


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail with TimeoutError if the block takes longer (a hung mount must fail a test).

    SIGALRM interrupts a read blocked on the mount too: the daemon sees the pending signal
    and answers EINTR, so this also keeps exercising that mechanism.
    """

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"no result within {seconds}s")

    if signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        yield  # an outer deadline is already running; it stays in force
        return
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def wait_until(
    cond: Callable[[], object],
    what: str,
    timeout: float = 30,
    *,
    files: Iterable[str | Path] = (),
    exits: Iterable[int] = (),
    reaps: Iterable[int] = (),
) -> None:
    """Wait until ``cond()`` holds, looking again only when something it depends on
    happened, never after a delay: an entry of the directory of one of ``files`` made,
    written, renamed or removed (inotify), one of ``exits`` ended, one of ``reaps``
    reaped (a pidfd: readable at the exit, hung up at the reaping). AssertionError
    naming ``what`` after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    poller = select.poll()
    watch = None
    pidfds: list[int] = []
    try:
        dirs = {str(Path(f).parent) for f in files}
        if dirs:
            watch = Inotify()
            for d in dirs:
                if watch.add(d, FILE_EVENTS) is None:
                    raise AssertionError(f"cannot watch {d}")
            poller.register(watch.fd, select.POLLIN)
        for pids, mask in ((exits, select.POLLIN), (reaps, 0)):
            for pid in pids:
                try:
                    fd = os.pidfd_open(pid)
                except ProcessLookupError:
                    continue  # gone (and reaped) already
                pidfds.append(fd)
                poller.register(fd, mask)  # 0: only the hang-up, at the reaping
        while not cond():
            left = end - time.monotonic()
            events = poller.poll(left * 1000) if left > 0 else []
            if not events:  # the time is up with nothing seen: not a look at last
                raise AssertionError(f"never happened: {what}")
            for fd, _ in events:
                if watch is not None and fd == watch.fd:
                    watch.read()  # drained; what changed is cond's to judge
                else:
                    poller.unregister(fd)  # it happened, and it stays so
    finally:
        if watch is not None:
            watch.close()
        for fd in pidfds:
            os.close(fd)


async def await_until(
    cond: Callable[[], object],
    what: str,
    timeout: float = 30,
    *,
    files: Iterable[str | Path] = (),
    exits: Iterable[int] = (),
    reaps: Iterable[int] = (),
) -> None:
    """``wait_until`` from a trio task (in a worker thread: ``cond`` must not touch
    trio's objects)."""
    files, exits, reaps = list(files), list(exits), list(reaps)
    await trio.to_thread.run_sync(
        lambda: wait_until(cond, what, timeout, files=files, exits=exits, reaps=reaps),
        abandon_on_cancel=True,
    )


# ---- logs ---------------------------------------------------------------------------

# A record's first line, as olliefs (cli._setup_logging) and toolsrv (__main__) write it:
# "<asctime> [toolsrv ]<LEVEL> <logger>: <message>". Other lines continue the record above.
LOG_LINE = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?:toolsrv )?"
    r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) (\S+): (.*)"
)
# What Python itself prints on stderr when something escaped every handler: such a record
# counts as an ERROR whatever level the line above it had.
CRASH_MARKS = ("Traceback (most recent call last):", "Exception ignored in", "Exception in thread")


class LogRecordText:
    """One log record: of the test process, or read back from a subprocess's log."""

    __slots__ = ("level", "name", "source", "text")

    def __init__(self, source: str, level: int, name: str, text: str) -> None:
        self.source = source  # "test process" or the log file's path
        self.level = level
        self.name = name  # the logger's ("output": a line no logger wrote)
        self.text = text  # the message, and the traceback or lines that followed it

    def __str__(self) -> str:
        return f"{self.source}: {logging.getLevelName(self.level)} {self.name}: {self.text}"


def parse_log(text: str, source: str) -> list[LogRecordText]:
    """The records of a log as written by olliefs or toolsrv. Lines before the first
    record are output no logger wrote (a print, a C library): a WARNING each, since
    nothing healthy prints there. A record followed by a traceback is an ERROR at least."""
    out: list[LogRecordText] = []
    cur: LogRecordText | None = None
    for line in text.splitlines():
        m = LOG_LINE.fullmatch(line)
        if m:
            level = logging.getLevelNamesMapping()[m[1]]
            cur = LogRecordText(source, level, m[2], m[3])
            out.append(cur)
        elif cur is None:
            if line.strip():
                out.append(LogRecordText(source, logging.WARNING, "output", line))
        else:
            cur.text += "\n" + line
    for r in out:
        if any(mark in r.text for mark in CRASH_MARKS):
            r.level = max(r.level, logging.ERROR)
    return out


class ExpectedLog:
    """One declaration of ``expect_log``; also a context manager that checks, at the end
    of its block, that the records it expects were already all seen."""

    def __init__(self, pattern: str, level: int, count: int | range | None) -> None:
        self.regex = re.compile(pattern)
        self.level = level
        self.count = count
        self.seen = 0
        self.closed = False  # its block ended: it takes no more records

    def matches(self, r: LogRecordText) -> bool:
        return (
            not self.closed
            and r.level == self.level
            and self.regex.search(f"{r.name}: {r.text}") is not None
        )

    def problem(self) -> str | None:
        """What is wrong with what was seen (None: as declared)."""
        if self.count is None:
            if self.seen > 0:
                return None
            want = "one or more"
        elif isinstance(self.count, range):
            if self.seen in self.count:
                return None
            want = f"{self.count.start} to {self.count.stop - 1}"
        elif self.seen == self.count:
            return None
        else:
            want = str(self.count)
        return (
            f"expected {want} log record(s) at {logging.getLevelName(self.level)}"
            f" matching {self.regex.pattern!r}, saw {self.seen}"
        )

    def __enter__(self) -> ExpectedLog:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.closed = True
        if exc_type is None and (problem := self.problem()) is not None:
            raise AssertionError(problem)


class LogCheck:
    """What one test declared and what it logged; outside a test (bench/), the process's."""

    def __init__(self) -> None:
        self.expected: list[ExpectedLog] = []
        self.unexpected: list[LogRecordText] = []  # the test process's own records
        self.read_upto: dict[Path, int] = {}  # how far each subprocess log was checked
        self.lock = threading.Lock()  # records come from worker threads too

    def expect(
        self, pattern: str, level: int = logging.WARNING, count: int | range | None = 1
    ) -> ExpectedLog:
        e = ExpectedLog(pattern, level, count)
        with self.lock:
            self.expected.append(e)
        return e

    def claim(self, r: LogRecordText) -> bool:
        """Whether ``r`` may be logged: below WARNING, or declared (then it is counted)."""
        if r.level < logging.WARNING:
            return True
        with self.lock:
            for e in self.expected:
                if e.matches(r):
                    e.seen += 1
                    return True
        return False

    def read_new(self, path: Path) -> list[LogRecordText]:
        """The records ``path`` gained since the last look (a home's logs outlive a daemon
        restart, and several daemons of a test share one)."""
        try:
            with open(path, "rb") as f:
                f.seek(self.read_upto.get(path, 0))
                data = f.read()
        except FileNotFoundError:
            return []
        self.read_upto[path] = self.read_upto.get(path, 0) + len(data)
        return parse_log(data.decode(errors="replace"), str(path))

    def unexpected_records(self) -> list[str]:
        return [f"unexpected log record: {r}" for r in self.unexpected]

    def unmet(self) -> list[str]:
        return [p for e in self.expected if (p := e.problem()) is not None]


class _ToCurrentCheck(logging.Handler):
    """The test process's records at WARNING or above, judged by the current check."""

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        r = LogRecordText("test process", record.levelno, record.name, text)
        check = _log_check
        if not check.claim(r):
            with check.lock:
                check.unexpected.append(r)


_log_check = LogCheck()  # outside checking_logs: the process's (bench/)
_handler = _ToCurrentCheck(logging.WARNING)


@contextmanager
def checking_logs() -> Iterator[LogCheck]:
    """A fresh ``LogCheck`` for the block (one test), fed with every record the process
    logs at WARNING or above. The caller judges it after the block."""
    global _log_check
    outer, _log_check = _log_check, LogCheck()
    root = logging.getLogger()
    added = _handler not in root.handlers  # a nested block feeds only its own check
    if added:
        root.addHandler(_handler)
    try:
        yield _log_check
    finally:
        if added:
            root.removeHandler(_handler)
        _log_check = outer


@contextmanager
def logs_checked() -> Iterator[LogCheck]:
    """``checking_logs``, judged at the block's end: for a fixture wider than a test (a
    module's daemon), whose logs are checked after the tests' own checks ended."""
    with checking_logs() as check:
        yield check
    problems = check.unexpected_records() + check.unmet()
    assert not problems, "\n".join(problems)


def expect_log(
    pattern: str, level: int = logging.WARNING, count: int | range | None = 1
) -> ExpectedLog:
    """Declare, for the rest of the current test, ``count`` log records at ``level`` whose
    ``"<logger>: <message>"`` matches ``pattern`` (see the module docstring)."""
    return _log_check.expect(pattern, level, count)


def check_log_files(*paths: Path) -> None:
    """The one rule for subprocesses' logs (a daemon's, a toolsrv's): what they gained
    since the last check holds no record at WARNING or above that the test did not
    declare. AssertionError listing those that were not."""
    bad = [r for p in paths for r in _log_check.read_new(p) if not _log_check.claim(r)]
    assert not bad, "unexpected log records:\n" + "\n".join(map(str, bad))


class Daemon:
    """An olliefs daemon on a private OLLIE_HOME, mounted at ``path``."""

    def __init__(self, base: Path, replay: ReplayServer, extra_env: dict[str, str]) -> None:
        self.base = base
        self.home = base / "home"
        self.path = base / "mnt"
        self.path.mkdir(exist_ok=True)
        self.work = base / "work"
        self.work.mkdir(exist_ok=True)
        self.replay = replay
        self.env = {
            **os.environ,
            "OLLIE_HOME": str(self.home),
            "OLLIE_BACKEND": "openai",
            "OLLIE_MODEL": "replay",
            "OLLIE_OPENAI_URL": replay.url,
            "OLLIE_OPENAI_KEY": "sk-test-secret-key-0123456789",
            "OLLIE_RETRY_BASE": "0.01",
            "OLLIE_RATELIMIT_BASE": "0.01",
            "OLLIE_READ_TIMEOUT": "2",
            **extra_env,
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.python = sys.executable  # the environment the daemon runs in
        self.mount_args: list[str] = []  # more ``ollie mount`` flags (``--9p unix:...``)

    # ---- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        stderr = open(self.stderr_path, "ab")
        self.proc = subprocess.Popen(
            [self.python, "-m", "olliefs", "mount", "-f", *self.mount_args, str(self.path)],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=stderr,
            stderr=stderr,
        )
        stderr.close()
        end = time.monotonic() + 30
        while not self.serving():
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited: {self.stderr()}")
            if time.monotonic() > end:
                raise RuntimeError(f"daemon did not mount: {self.stderr()}")
            time.sleep(0.02)

    def serving(self) -> bool:
        """Mounted and answering (a stale mount left by a crash answers ENOTCONN)."""
        try:
            return self.mounted() and (self.path / "s" / "new").exists()
        except OSError:
            return False

    def mounted(self) -> bool:
        with open("/proc/self/mountinfo") as f:
            return any(f" {self.path} " in line and "fuse" in line for line in f)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self.mounted():
            subprocess.run(["fusermount3", "-uz", str(self.path)], check=False)

    @contextlib.contextmanager
    def running(self) -> Iterator[Daemon]:
        """Started for the block, stopped after it; then its logs are checked."""
        self.start()
        try:
            yield self
        finally:
            self.stop()
        self.check_log()

    def crash(self) -> None:
        """SIGKILL the daemon and leave the dead mount behind, as a real crash does."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self.proc = None

    @property
    def stderr_path(self) -> Path:
        return self.base / "daemon.stderr"

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def check_log(self) -> None:
        """The daemon's log and the log of the toolsrv it spawned hold no undeclared
        WARNING or worse (``check_log_files``)."""
        check_log_files(self.stderr_path, self.home / "state" / "toolsrv.log")

    # ---- file helpers ---------------------------------------------------------------

    def p(self, rel: str) -> Path:
        return self.path / rel

    def read(self, rel: str) -> str:
        with deadline(20):
            return self.p(rel).read_text()

    def snapshot(self, rel: str) -> str:
        """What a blocking file holds now: read with O_NONBLOCK up to EAGAIN."""
        fd = os.open(self.p(rel), os.O_RDONLY | os.O_NONBLOCK)
        out = b""
        try:
            while True:
                try:
                    chunk = os.read(fd, 1 << 20)
                except BlockingIOError:
                    return out.decode()
                if not chunk:
                    return out.decode()
                out += chunk
        finally:
            os.close(fd)

    def write(self, rel: str, data: str) -> None:
        """One write(2), like ``echo`` does; raises the OSError the daemon answered."""
        fd = os.open(self.p(rel), os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, data.encode())
        finally:
            os.close(fd)

    def new(self, **kw: str) -> str:
        kw.setdefault("cwd", str(self.work))
        fd = os.open(self.p("s/new"), os.O_RDWR)
        try:
            os.write(fd, " ".join(f"{k}={v}" for k, v in kw.items()).encode())
            return os.pread(fd, 4096, 0).decode().strip()
        finally:
            os.close(fd)

    def prompt(self, sid: str, text: str) -> None:
        self.write(f"s/{sid}/prompt", text)

    def wait_state(self, sid: str, want: str, timeout: float = 20) -> None:
        """Wait for a state through ``statewait`` (no lost wake-ups: open, then check)."""
        with deadline(timeout):
            while True:
                with open(self.p(f"s/{sid}/statewait")) as w:
                    if self.read(f"s/{sid}/state").strip() == want:
                        return
                    w.read()

    def wait_for(self, cond: Callable[[], bool], timeout: float = 20) -> None:
        """Wait for something outside the mount (a file a tool wrote, a pid gone)."""
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end:
                raise AssertionError("condition not met in time")
            time.sleep(0.01)

    def wait_idle(self, sid: str) -> None:
        """Wait until the session ran every queued prompt and is idle."""
        self.wait_state(sid, "idle")

    def wait_chat(self, sid: str, needle: str, timeout: float = 20) -> str:
        """Follow ``stream`` until ``needle`` appears; returns the chat up to there."""
        with deadline(timeout), open(self.p(f"s/{sid}/stream"), "rb") as f:
            seen = b""
            while needle.encode() not in seen:
                chunk = f.read1(65536)
                if not chunk:
                    raise AssertionError(f"stream ended before {needle!r}: {seen!r}")
                seen += chunk
            return seen.decode()


class SmallDisk:
    """A small tmpfs mounted at ``path`` (root only), and a filler file that takes every
    block it has left: a full disk, made and freed when a test says so.

    ``fill`` writes the filler until the disk refuses even one more byte, so what was
    already written keeps only the slack of its last page: an append that needs a page
    more fails with ENOSPC, as on a real full disk (a small one may still fit).
    """

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size
        self.filler = path / ".filler"

    @staticmethod
    def unavailable() -> str | None:
        """Why no tmpfs can be mounted here (None: it can)."""
        if os.geteuid() != 0:
            return "needs root (it mounts a small tmpfs to fill)"
        return None

    def __enter__(self) -> SmallDisk:
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size},mode=0700", "tmpfs", str(self.path)],
            check=True,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        # Lazily: a daemon killed a moment ago may still hold files open in there.
        subprocess.run(["umount", "-l", str(self.path)], check=False)

    def fill(self) -> None:
        fd = os.open(self.filler, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            for size in (1 << 20, 4096, 1):
                block = b"\0" * size
                while True:
                    try:
                        os.write(fd, block)
                    except OSError as err:
                        if err.errno != errno.ENOSPC:
                            raise
                        break
        finally:
            os.close(fd)

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)


class ToolsrvProc:
    def __init__(
        self,
        base: Path,
        *,
        tools_dirs: tuple[Path, ...] = (),
        sandbox_dirs: tuple[Path, ...] = (),
        log_level: str = "DEBUG",
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.sandbox_dirs = sandbox_dirs
        self.log_level = log_level
        self.extra_args = extra_args
        base.mkdir(parents=True, exist_ok=True)
        self.base = base
        self.socket = str(base / "toolsrv.sock")
        self.tmp_root = base / "tooltmp"
        self.log_path = base / "toolsrv.log"
        self.key = secrets.token_bytes(32)
        self.tools_dirs = tools_dirs
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [sys.executable, "-m", "toolsrv", "--socket", self.socket]
        argv += ["--tmp-dir", str(self.tmp_root), "--exit-with-stdin"]
        argv += ["--log-level", self.log_level]
        for d in self.tools_dirs:
            argv += ["--tools-dir", str(d)]
        # toolsrv imports nothing of olliefs: the shipped defaults are named, as the
        # daemon's spawner names them.
        argv += ["--tools-dir", str(shipped_dir() / "tools")]
        for d in self.sandbox_dirs:  # (the user's before the shipped ones, as olliefs does)
            argv += ["--sandbox-dir", str(d)]
        argv += ["--sandbox-dir", str(shipped_dir() / "sandbox")]
        argv += self.extra_args
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log
            )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(self.key.hex().encode() + b"\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if line != b"ready\n":
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"toolsrv did not start:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        if self.proc is None:
            return
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("toolsrv did not exit when its stdin closed") from None
        finally:
            if self.proc is not None and self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None

    def check_log(self) -> None:
        """Its log holds no undeclared WARNING or worse (``check_log_files``)."""
        check_log_files(self.log_path)

    @asynccontextmanager
    async def agent(self, agent_id: str, *tools: str) -> AsyncIterator[ToolsrvConn]:
        async with connect(self.socket, self.key, agent_id) as conn:
            if tools:
                await conn.ctl("".join(f"load {t}\n" for t in tools))
            yield conn


@contextmanager
def running_toolsrv(
    base: Path,
    *,
    tools_dirs: tuple[Path, ...] = (),
    sandbox_dirs: tuple[Path, ...] = (),
    log_level: str = "DEBUG",
    extra_args: tuple[str, ...] = (),
) -> Iterator[ToolsrvProc]:
    t = ToolsrvProc(
        base,
        tools_dirs=tools_dirs,
        sandbox_dirs=sandbox_dirs,
        log_level=log_level,
        extra_args=extra_args,
    )
    t.start()
    try:
        yield t
    finally:
        t.stop()
    t.check_log()


class Request:
    """One HTTP/1.1 request as ``recv_request`` read it off a socket."""

    __slots__ = ("body", "first_byte", "head")

    def __init__(self, head: bytes, body: bytes, first_byte: float) -> None:
        self.head = head  # request line and headers, without the blank line
        self.body = body
        self.first_byte = first_byte  # time.monotonic() when its first byte came


def recv_request(conn: socket.socket, buf: bytes) -> tuple[Request, bytes] | None:
    """The next request on a blocking socket (head, a Content-Length body) and the bytes
    read past it; None when the peer closed first. For the tests' and benchmarks' tiny
    HTTP servers, which answer each request with bytes of their own."""
    first = time.monotonic()
    while b"\r\n\r\n" not in buf:
        data = conn.recv(65536)
        if not data:
            return None
        if not buf:
            first = time.monotonic()
        buf += data
    head, _, buf = buf.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(buf) < length:
        data = conn.recv(65536)
        if not data:
            return None
        buf += data
    return Request(head, buf[:length], first), buf[length:]
