"""Stream and runtime figures of issue 10 (items 2, 3 and the 200-session row of item 5).

Run: ``.venv/bin/python bench/perf_stream.py`` (root, /dev/fuse): prints one table. It
asserts nothing; every reference is measured in the same run. ``bench/perf.py`` imports
``rows()`` and prints these rows in its own table.

(1) token -> blocked ``stream`` reader: the replay server sends a reply one token at a time
    (10 ms apart, so each travels alone) and notes when each was written to the socket; a
    thread blocked in ``read`` on ``s/<id>/stream`` notes when it got it. Reference: an
    httpx client reading the same stream from the replay server directly.
(2) 10 MB reply through ``stream``, in 4 KB and in 50-byte deltas: from the first to the
    last byte of the reply at a reader of ``stream`` (every byte checked). The replay server
    sends a prepared SSE body in 64 KiB writes, so the figure is the daemon's, not the
    server's. Reference: httpx reading the same body directly. Also the growth of the
    session journal per byte of reply (target: the text once, about 1x).
(3) prompt write returning -> the first byte of the request at the LLM server, p50 over
    the first turns and over turns 481-500 of one session; and the TCP connections those
    500 turns used. The server is a small one of this script that notes the time of the
    first ``recv`` of each request. Reference: an httpx client on a kept-alive connection,
    from the call to the first byte (what HTTP itself costs).
(4) many sessions streaming at once (200 at 200 tokens/s each, then 1,000 at 50): a pacer
    sends every stream one token a tick (a late tick sends the tokens it owes in one
    write); a ``cat`` per session follows ``stream`` into a file. Over a window in which
    every stream is running: tokens offered (sent by the pacer) and delivered (bytes the
    readers got / token size) per second, and CPU: the daemon's main thread (the event
    loop that serves the tree), and the daemon's whole work (every thread, and the
    network process's when the streams go through one).

``STREAM_LOADS`` (``200x200,1000x50``: sessions x tokens/s, comma-separated) and
``STREAM_TURNS`` change the sizes of (4) and (3);
``STREAM_PARTS=13`` runs only sections (1) and (3); ``STREAM_MARK=path``: (4) writes the
daemon's pid to ``path`` as each window starts (for a profiler, see bench/README.md).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import msgspec
from perf_common import Row, p50, p99, table

from olliefs.replay import ReplayServer, parse_script
from olliefs.replay.script import Entry
from olliefs.testing import Daemon, recv_request

# (4)'s loads: sessions x tokens per second each. The first is the earlier round's row;
# the second a swarm of subagents (issue 24's row).
LOADS = [
    (int(n), float(r))
    for n, r in (
        part.split("x") for part in os.environ.get("STREAM_LOADS", "200x200,1000x50").split(",")
    )
]
TURNS = int(os.environ.get("STREAM_TURNS", "500"))
PARTS = os.environ.get("STREAM_PARTS", "1234")  # which of the sections below to run
MARK = os.environ.get("STREAM_MARK", "")  # (4) writes the daemon's pid there as a window starts
TOKENS = 200
GAP = 0.01
BIG = 10 * 1000 * 1000
BIG_RUNS = 3


# ---- (1) token latency ---------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.sent: dict[str, float] = {}

    def on_send(self, text: str, t: float) -> None:
        self.sent.setdefault(text, t)


def token_script() -> str:
    reply = "".join(f"<{i:04d}>" for i in range(TOKENS))
    return f'{{"reply": "{reply}", "chunk": 6, "delay": {GAP}}}'


def receive_times(chunks: list[tuple[bytes, float]]) -> dict[str, float]:
    """When each ``<NNNN>`` token was first complete in what the reader had."""
    seen = b""
    out: dict[str, float] = {}
    for data, t in chunks:
        start = len(seen)
        seen += data
        i = seen.find(b"<", max(start - 5, 0))
        while i >= 0 and i + 6 <= len(seen):
            tok = seen[i : i + 6].decode(errors="replace")
            if tok[0] == "<" and tok[-1] == ">":
                out.setdefault(tok, t)
            i = seen.find(b"<", i + 1)
    return out


def lat(clock: Clock, got: dict[str, float]) -> list[float]:
    return [got[tok] - t for tok, t in clock.sent.items() if tok in got]


def read_direct(url: str) -> list[tuple[bytes, float]]:
    """A streamed reply read straight off the replay server: each read and when."""
    chunks: list[tuple[bytes, float]] = []
    body = {"model": "replay", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    with httpx.Client() as client, client.stream("POST", url, json=body) as r:
        for data in r.iter_raw():
            chunks.append((data, time.monotonic()))
    return chunks


def token_direct(clock: Clock, srv: ReplayServer) -> list[float]:
    """In the bench's own process: no process hop at all (the replay server is a thread
    here, and a thread wakes another in ~20 us)."""
    return lat(clock, receive_times(read_direct(srv.url + "/chat/completions")))


def token_direct_process(clock: Clock, srv: ReplayServer) -> list[float]:
    """The reference a user would compare with: their own client process reading the
    stream directly (`read_direct`, run as ``perf_stream.py --read-direct URL``;
    CLOCK_MONOTONIC is one clock for every process)."""
    out = subprocess.run(
        [sys.executable, __file__, "--read-direct", srv.url + "/chat/completions"],
        capture_output=True,
        check=True,
    ).stdout
    chunks = msgspec.msgpack.decode(out, type=list[tuple[bytes, float]])
    return lat(clock, receive_times(chunks))


@contextmanager
def reader(path: Path) -> Iterator[list[tuple[bytes, float]]]:
    """A thread blocked on ``path`` (a blocking file) noting each read; ends at EOF."""
    chunks: list[tuple[bytes, float]] = []
    fd = os.open(path, os.O_RDONLY)

    def run() -> None:
        while data := os.read(fd, 1 << 20):
            chunks.append((data, time.monotonic()))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield chunks
    finally:
        t.join(30)
        os.close(fd)


def token_olliefs(clock: Clock, d: Daemon) -> list[float]:
    sid = d.new(name="tok")
    with reader(d.p(f"s/{sid}/stream")) as chunks:
        d.prompt(sid, "go")
        d.wait_idle(sid)
        d.write(f"s/{sid}/ctl", "kill")  # EOF ends the reader
    return lat(clock, receive_times(chunks))


# ---- (2) throughput --------------------------------------------------------------------------


def sse_body(text: str, delta: int) -> bytes:
    """An OpenAI chat-completions stream of ``text`` in ``delta``-byte deltas."""
    enc = msgspec.json.encode
    frames = []
    for i in range(0, len(text), delta):
        chunk = {
            "id": "chatcmpl-big",
            "object": "chat.completion.chunk",
            "model": "replay",
            "choices": [{"index": 0, "delta": {"content": text[i : i + delta]}}],
        }
        frames.append(b"data: " + enc(chunk) + b"\n\n")
    stop = {"id": "chatcmpl-big", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    frames.append(b"data: " + enc(stop) + b"\n\ndata: [DONE]\n\n")
    return b"".join(frames)


def big_text() -> str:
    line = "".join(chr(97 + i % 26) for i in range(99)) + "\n"
    return (line * (BIG // len(line) + 1))[:BIG]


def big_entry(body: bytes) -> Entry:
    return Entry(raw=body, raw_chunk=65536, content_type="text/event-stream")


def throughput_direct(srv: ReplayServer, body: bytes) -> float:
    srv.add([big_entry(body)])
    req = {"model": "replay", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    with httpx.Client() as client:
        t0 = 0.0
        n = 0
        with client.stream("POST", srv.url + "/chat/completions", json=req) as r:
            for data in r.iter_raw():
                t0 = t0 or time.monotonic()
                n += len(data)
        dt = time.monotonic() - t0
    assert n == len(body)
    return BIG / dt / 1e6


def throughput_olliefs(d: Daemon, body: bytes, text: str, name: str) -> tuple[float, float]:
    """MB/s from the prompt write to the whole reply at a ``stream`` reader; and the
    journal growth over the reply size."""
    sid = d.new(name=name)
    d.prompt(sid, "warm")
    d.wait_idle(sid)
    journal = next((d.home / "state" / "sessions").glob("*.jsonl"), None)
    journals = {p: p.stat().st_size for p in (d.home / "state" / "sessions").glob("*.jsonl")}
    assert journal is not None
    fd = os.open(d.p(f"s/{sid}/stream"), os.O_RDONLY)
    try:
        start = len(os.read(fd, 1 << 20))  # the chat so far; the reader is at its end
        want = start + len("user: go\nassistant: ") + len(text)
        d.replay.add([big_entry(body)])
        got = bytearray()
        d.prompt(sid, "go")
        head = len("user: go\nassistant: ")
        t0 = 0.0
        while start + len(got) < want:
            data = os.read(fd, 1 << 20)
            assert data, "stream ended early"
            got += data
            if not t0 and len(got) > head:
                t0 = time.monotonic()  # the reply's first byte
        dt = time.monotonic() - t0
    finally:
        os.close(fd)
    assert bytes(got).decode() == "user: go\nassistant: " + text, "the reply differs"
    d.wait_idle(sid)
    after = {p: p.stat().st_size for p in (d.home / "state" / "sessions").glob("*.jsonl")}
    growth = sum(after[p] - journals.get(p, 0) for p in after)
    d.write(f"s/{sid}/ctl", "kill")
    return BIG / dt / 1e6, growth / BIG


# ---- a tiny OpenAI-shaped server for (3) and (4) ---------------------------------------------

MODELS = b'{"object":"list","data":[{"id":"replay","object":"model"}]}'


def _frame(text: str) -> bytes:
    ev = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":%b}}]}\n\n' % (
        msgspec.json.encode(text)
    )
    return b"%x\r\n%b\r\n" % (len(ev), ev)


_TAIL = (
    b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b"data: [DONE]\n\n"
)
_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


class Stream:
    def __init__(self, conn: socket.socket, tokens: int) -> None:
        self.conn = conn
        self.total = tokens
        self.left = tokens
        self.start = 0.0
        self.done = threading.Event()
        self.pending = b""  # offered, not taken by the socket yet (the daemon is behind)


class TinyServer:
    """HTTP/1.1 with keep-alive; notes the first ``recv`` of every POST; answers "ok" at
    once, or, when ``paced``, hands the stream to the pacer (one token a tick)."""

    def __init__(
        self, paced_tokens: int = 0, rate: float = 200.0, token: str = "tok|", hold: int = 0
    ) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=512)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.accepted = 0
        self.first_bytes: list[float] = []
        self.posted = threading.Semaphore(0)
        self.paced_tokens = paced_tokens
        self.interval = 1 / rate
        self.token = _frame(token)
        self.sent = 0  # tokens the pacer wrote
        self.ticks = 0  # rounds of the pacer
        self.hold = hold  # streams to wait for before pacing any
        self.started = threading.Event()  # set when they are all there
        self.streams: list[Stream] = []
        self.lock = threading.Lock()
        self.stopping = False
        threading.Thread(target=self._accept, daemon=True).start()
        if paced_tokens:
            threading.Thread(target=self._pace, daemon=True).start()

    def close(self) -> None:
        self.stopping = True
        self.sock.close()

    def _accept(self) -> None:
        while not self.stopping:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.accepted += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        try:
            while True:
                got = recv_request(conn, buf)
                if got is None:
                    return
                request, buf = got
                if request.head.startswith(b"GET"):
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%b" % (len(MODELS), MODELS)
                    )
                    continue
                self.first_bytes.append(request.first_byte)
                self.posted.release()
                if self.paced_tokens:
                    conn.sendall(_STREAM_HEAD)
                    s = Stream(conn, self.paced_tokens)
                    with self.lock:
                        self.streams.append(s)
                    s.done.wait()
                else:
                    ev = _frame("ok")
                    tail = b"%x\r\n%b\r\n0\r\n\r\n" % (len(_TAIL), _TAIL)
                    conn.sendall(_STREAM_HEAD + ev + tail)
        except OSError:
            return
        finally:
            conn.close()

    def _pace(self) -> None:
        """Each tick, every running stream gets the tokens it is due by now (``rate`` a
        second from its start): one token a tick while the pacer keeps up; a tick that
        comes late (a loaded machine) sends what it owes in one write, so the tokens
        offered per second stay the nominal rate."""
        tail = b"%x\r\n%b\r\n0\r\n\r\n" % (len(_TAIL), _TAIL)
        rate = 1 / self.interval
        while not self.stopping:
            now = time.monotonic()
            self.ticks += 1
            with self.lock:
                streams = list(self.streams)
            if len(streams) < self.hold and not self.started.is_set():
                streams = []  # every stream starts together, once all have asked
            elif self.hold:
                self.started.set()
            for s in streams:
                try:
                    if not s.start:
                        s.start = now
                        s.conn.setblocking(False)
                    due = min(int((now - s.start) * rate) + 1, s.total) - s.total + s.left
                    if due > 0:
                        s.pending += self.token * due
                        s.left -= due
                        self.sent += due
                    elif not s.left and not s.pending:
                        s.conn.setblocking(True)
                        s.conn.sendall(tail)
                        raise OSError
                    if s.pending:
                        # What the socket takes now; the rest waits for the next tick, so a
                        # daemon that falls behind gets a backlog, never a cut frame.
                        try:
                            s.pending = s.pending[s.conn.send(s.pending) :]
                        except BlockingIOError:
                            pass
                except OSError:
                    with self.lock:
                        self.streams.remove(s)
                    s.done.set()
            delay = now + self.interval - time.monotonic()
            if delay > 0:
                time.sleep(delay)


# ---- (3) prompt -> request ---------------------------------------------------------------


def overhead_direct(srv: TinyServer, n: int = 200) -> list[float]:
    out = []
    body = {"model": "replay", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    with httpx.Client() as client:
        for _ in range(n):
            t0 = time.monotonic()
            with client.stream("POST", srv.url + "/chat/completions", json=body) as r:
                srv.posted.acquire()
                out.append(srv.first_bytes[-1] - t0)
                r.read()
    return out


def overhead_olliefs(d: Daemon, srv: TinyServer, turns: int, name: str = "turns") -> list[float]:
    sid = d.new(name=name)
    out = []
    for i in range(turns):
        d.prompt(sid, f"turn {i}")
        t0 = time.monotonic()
        srv.posted.acquire()
        out.append(srv.first_bytes[-1] - t0)
        d.wait_idle(sid)
    return out


# ---- (4) many streams --------------------------------------------------------------------


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def daemon_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of the daemon's main thread, and of the daemon with its children
    (the network process) that are running now."""
    whole = cpu_seconds(pid)
    for child in children(pid):
        with contextlib.suppress(OSError):
            whole += cpu_seconds(child)
    return cpu_seconds(pid, pid), whole


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _pacer_process(
    conn: Connection, tokens: int, hold: int, rate: float, shared: Any, started: Any
) -> None:
    """The paced server, in a process of its own: in the bench's process its threads
    competed for one GIL with the measuring thread, which then woke seconds late."""
    srv = TinyServer(paced_tokens=tokens, rate=rate, hold=hold)
    conn.send(srv.url)
    while True:
        with shared.get_lock():
            shared[0], shared[1] = srv.sent, srv.ticks
            shared[2] = min((st.left for st in list(srv.streams)), default=0)
        if srv.started.is_set():
            started.set()
        time.sleep(0.005)


def many_streams(
    base: Path, replay: ReplayServer, sessions: int, rate: float, window: float = 3.0
) -> list[Row]:
    tokens = int(rate * (window + 3))
    ctx = multiprocessing.get_context("fork")
    shared = ctx.Array("q", 3)  # tokens sent, pacer rounds, fewest tokens left
    started = ctx.Event()
    ours, theirs = ctx.Pipe()
    pacer = ctx.Process(
        target=_pacer_process, args=(theirs, tokens, sessions, rate, shared, started)
    )
    pacer.start()
    url = ours.recv()
    d = Daemon(base, replay, {"OLLIE_OPENAI_URL": url, "OLLIE_READ_TIMEOUT": "30"})
    d.start()
    outs: list[Path] = []
    cats: list[subprocess.Popen[bytes]] = []

    def sample() -> tuple[int, int, int]:
        with shared.get_lock():
            return shared[0], shared[1], shared[2]

    try:
        sids = [d.new(name=f"m{i}") for i in range(sessions)]
        for sid in sids:
            out = base / f"{sid}.out"
            outs.append(out)
            with open(out, "wb") as f:
                cats.append(subprocess.Popen(["cat", str(d.p(f"s/{sid}/stream"))], stdout=f))
        for sid in sids:
            d.prompt(sid, "go")
        if not started.wait(120):
            raise RuntimeError("not every session reached the server")
        assert d.proc is not None
        pid = d.proc.pid

        def delivered() -> int:
            """Tokens the readers have (each ``tok|`` in what ``cat`` wrote)."""
            return sum(p.read_bytes().count(b"tok|") for p in outs)

        time.sleep(0.5)  # every stream well started
        if MARK:  # a profiler waits for this file to attach to the daemon for the window
            Path(MARK).write_text(f"{pid}\n")
        (s0, k0, _), b0, (m0, c0), t0 = sample(), delivered(), daemon_cpu(pid), time.monotonic()
        time.sleep(window)
        (s1, k1, left), (m1, c1), t1 = sample(), daemon_cpu(pid), time.monotonic()
        b1 = delivered()
        ticks = (k1 - k0) / (t1 - t0)
    finally:
        pacer.kill()
        pacer.join()
        for c in cats:
            c.kill()
            c.wait()
        d.stop()
    dt = t1 - t0
    offered = (s1 - s0) / dt
    got = (b1 - b0) / dt
    main = (m1 - m0) / dt * 100
    cpu = (c1 - c0) / dt * 100
    note = f"window {dt:.1f} s; pacer {ticks:.0f} rounds/s"
    # Offered but not yet at a reader when the window closed: how far behind they are.
    note += f"; backlog at the end {max(0, s1 - b1) / sessions / rate * 1e3:.0f} ms of stream"
    if left == 0:
        note += "; WARNING: some stream ended inside the window"
    name = f"{sessions} streams x {rate:g} tok/s"
    return [
        Row(
            f"{name}: tokens delivered/s",
            got,
            offered,
            "tok/s",
            ">= 0.98x offered",
            got >= 0.98 * offered,
            note,
        ),
        Row(
            f"{name}: tokens offered/s",
            offered,
            sessions * rate,
            "tok/s",
            "= sessions x rate",
            offered >= 0.98 * sessions * rate,
            "what the pacer sent",
        ),
        Row(
            f"{name}: daemon main thread CPU",
            main,
            None,
            "%",
            "<= 40%",
            main <= 40,
            "utime+stime of the event loop's thread over the window, 100% = one core",
        ),
        Row(
            f"{name}: daemon CPU, all of it",
            cpu,
            None,
            "%",
            "(printed)",
            None,
            "every thread of the daemon and its network process",
        ),
    ]


# ---- the table ---------------------------------------------------------------------------


def rows() -> list[Row]:
    out: list[Row] = []
    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp, ReplayServer(on_send=clock.on_send) as srv:
        base = Path(tmp)
        if "1" in PARTS or "2" in PARTS:
            out += token_and_throughput(base / "a", srv, clock)
        if "3" in PARTS:
            out += overhead(base / "b", srv)
        if "4" in PARTS:
            for i, (sessions, rate) in enumerate(LOADS):
                (base / f"c{i}").mkdir()
                out += many_streams(base / f"c{i}", srv, sessions, rate)
    return out


def token_and_throughput(base: Path, srv: ReplayServer, clock: Clock) -> list[Row]:
    out: list[Row] = []
    base.mkdir()
    d = Daemon(base, srv, {"OLLIE_READ_TIMEOUT": "30"})
    d.start()
    try:
        if "1" in PARTS:
            srv.add(parse_script(token_script()))
            in_process = token_direct(clock, srv)
            clock.sent.clear()
            srv.add(parse_script(token_script()))
            ref = token_direct_process(clock, srv)
            clock.sent.clear()
            srv.add(parse_script(token_script()))
            ours = token_olliefs(clock, d)
            out.append(
                Row(
                    "token -> blocked stream reader p50",
                    p50(ours) * 1e3,
                    p50(ref) * 1e3,
                    "ms",
                    "<= 1.5x ref",
                    p50(ours) <= 1.5 * p50(ref),
                    "ref: a client process of its own reading the replay server (httpx); "
                    f"in the server's own process {p50(in_process) * 1e3:.2f} ms",
                )
            )
            out.append(
                Row(
                    "token -> blocked stream reader p99",
                    p99(ours) * 1e3,
                    p99(ref) * 1e3,
                    "ms",
                    "< 2 ms",
                    p99(ours) < 2e-3,
                    "",
                )
            )
        if "2" in PARTS:
            text = big_text()
            for delta, target in ((4096, 250.0), (50, 20.0)):
                body = sse_body(text, delta)
                # Three replies each, alternating with the reference; the median. The
                # first reply of a daemon also grows its heap by the logs' windows and
                # the reply's text (page faults of fresh memory): noted apart.
                runs = [
                    (
                        throughput_direct(srv, body),
                        *throughput_olliefs(d, body, text, f"b{delta}{i}"),
                    )
                    for i in range(BIG_RUNS)
                ]
                direct = sorted(r[0] for r in runs)[len(runs) // 2]
                rate = sorted(r[1] for r in runs)[len(runs) // 2]
                growth = max(r[2] for r in runs)
                out.append(
                    Row(
                        f"10 MB reply via stream, {delta} B deltas",
                        rate,
                        direct,
                        "MB/s",
                        f">= {target:g} MB/s",
                        rate >= target,
                        f"median of {len(runs)} replies (the first {runs[0][1]:.0f}), first to "
                        "last byte at the reader; ref: httpx direct",
                    )
                )
                out.append(
                    Row(
                        f"journal growth / reply size, {delta} B deltas",
                        growth,
                        1.0,
                        "x",
                        "< 1.3x",
                        growth < 1.3,
                        "the reply's text journaled once",
                    )
                )
    finally:
        d.stop()
    return out


def overhead(base: Path, srv: ReplayServer) -> list[Row]:
    tiny = TinyServer()
    try:
        base.mkdir()
        d = Daemon(base, srv, {"OLLIE_OPENAI_URL": tiny.url, "OLLIE_READ_TIMEOUT": "60"})
        d.start()
        try:
            per_turn = overhead_olliefs(d, tiny, TURNS)
        finally:
            d.stop()
        conns = tiny.accepted  # before the reference client opens its own
        direct_oh = overhead_direct(tiny)
    finally:
        tiny.close()
    first, last = per_turn[1:21], per_turn[-20:]
    return [
        Row(
            "prompt write -> request at server p50, turns 2-21",
            p50(first) * 1e3,
            p50(direct_oh) * 1e3,
            "ms",
            "< 2 ms",
            p50(first) < 2e-3,
            "ref: httpx call -> first byte, kept-alive",
        ),
        Row(
            f"prompt write -> request at server p50, turns {TURNS - 19}-{TURNS}",
            p50(last) * 1e3,
            p50(first) * 1e3,
            "ms",
            "< 2 ms, flat",
            p50(last) < 2e-3,
            "ref: the same at turns 2-21",
        ),
        Row(
            f"TCP connections for {TURNS} turns",
            conns,
            1,
            "conn",
            "1",
            conns == 1,
            "keep-alive (model list included)",
        ),
    ]


def main() -> int:
    if sys.argv[1:2] == ["--read-direct"]:  # (`token_direct_process`'s client)
        sys.stdout.buffer.write(msgspec.msgpack.encode(read_direct(sys.argv[2])))
        return 0
    print(table(rows()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
