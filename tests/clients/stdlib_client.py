#!/usr/bin/env python3
"""A client of an olliefs mount that uses only Python's standard library.

Run by tests/clients/test_stdlib_client.py as ``python3 stdlib_client.py MOUNT WORKDIR``
against a daemon whose replay server plays ``SCRIPT`` (``--script`` prints it, one JSON
entry per line, in the order this client makes its model requests). Exit status 0 when
every check held; otherwise the failed check on stderr and status 1.

It exercises every file of the tree as ollie(5) describes it: reads what is readable,
writes what is writable with a valid and an invalid value (the errno, and the reason in
``err``), opens what is not writable for writing (EACCES), reads each blocking file with
O_NONBLOCK (EAGAIN when there is nothing, the data when there is), and has several
concurrent readers of ``stream`` and ``events`` that must get identical bytes. At the end
it walks the tree (stat only: a walk never reads) and fails if it meets a kind of file
it did not exercise, or misses one ollie(5) lists: a new file in the tree must be taught
to this client.

Blocking files (stream, events, statewait, fifo.out) block on a plain read, so a plain
read of them happens only in a thread with a join deadline or under an alarm; every
operation of the main thread runs under SIGALRM, which ends a read blocked on the mount
with EINTR (a hang becomes a failure that names the step).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType

MARK = "MARK-END"
ANSWER = {"goal": "count", "state": "counted to three", "decisions": ["use ints"], "next": "stop"}
SCRIPT: list[dict[str, object]] = [
    {"reply": "return 1", "for_model": "fim"},  # complete (only its model takes it)
    {"reply": "hello reply"},  # R1: the first prompt
    {"reply": "slow " * 15 + MARK, "chunk": 3, "delay": 0.002},  # R2: concurrent readers
    {"reply": "hung reply", "chunk": 4, "hang": True, "hang_after": 1},  # R3: stopped
    {"reply": "fifo reply"},  # R4: fifo.in when idle
    {"reply": "kid reply"},  # R5: the child, prompted through peer/
    {"reply": "turn reply 1"},  # R6-R8: enough history to compact
    {"reply": "turn reply 2"},
    {"reply": "turn reply 3"},
    {"reply": json.dumps(ANSWER)},  # R9: ctl compact
]

# Every kind of file ollie(5) lists, as the final walk names them (session ids, branch
# and compaction numbers and transcript stamps replaced): the walk must find each.
EXPECTED = {
    "a/default.json", "a/coding.json", "backends", "complete", "err", "events", "help",
    "p/*", "s/idx", "s/new", "sk/idx", "t/idx", "t/*", "u/complete", "mcp/idx",
    "tr/*.md", "tr/*.jsonl", "m/*", "tmp/*", "tmp/*/*", "sk/*.md", "a/*.json",
    *(
        f"s/ID/{f}"
        for f in (
            "cfg chat context cost ctl ctxsz env err events fifo.in fifo.out models offset "
            "plan prompt prompt.prev state statewait stream systemprompt tail taskstate "
            "tcct tools usage peer/NAME branches/K/chat branches/K/context t/idx t/* "
            "compactions/N/before.jsonl compactions/N/summary compactions/N/dropped "
            "checkpoints/diff staged/files staged/diff"
        ).split()
    ),
}  # fmt: skip


class Failed(Exception):
    pass


def check(cond: object, what: str) -> None:
    if not cond:
        raise Failed(what)


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise Failed(f"no result within {seconds}s: {what}")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def errno_of(fn: Callable[[], object]) -> int:
    try:
        fn()
    except OSError as e:
        return e.errno or -1
    return 0


class Client:
    def __init__(self, root: str, work: str) -> None:
        self.root = root
        self.work = work
        self.seen: set[str] = set()  # kinds of files exercised (see kind())

    # ---- file operations, each one recorded ------------------------------------------

    def p(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def kind(self, rel: str) -> str:
        """The name of ``rel`` with its variable parts replaced, as EXPECTED has them."""
        parts = rel.split("/")
        if parts[0] == "s" and len(parts) > 2:
            parts[1] = "ID"
            if len(parts) > 3 and parts[2] in ("branches", "compactions"):
                parts[3] = "K" if parts[2] == "branches" else "N"
            if len(parts) > 3 and parts[2] == "peer":
                parts[3] = "NAME"
            if len(parts) > 3 and parts[2] == "t" and parts[3] != "idx":
                parts[3] = "*"
        elif parts[0] == "tr":
            parts[1] = "*" + os.path.splitext(parts[1])[1]
        elif parts[0] in ("m", "p", "tmp") or (parts[0] == "t" and parts[1] != "idx"):
            parts[1:] = ["*"] * (len(parts) - 1)
        elif parts[0] == "sk" and parts[1] != "idx":
            parts[1] = "*.md"
        elif parts[0] == "a" and parts[1] not in ("default.json", "coding.json"):
            parts[1] = "*.json"
        return "/".join(parts)

    def mark(self, rel: str) -> None:
        self.seen.add(self.kind(rel))

    def read(self, rel: str) -> str:
        """A plain read of a file that never blocks, to EOF."""
        self.mark(rel)
        with deadline(20, f"read {rel}"), open(self.p(rel), "rb") as f:
            return f.read().decode()

    def write(self, rel: str, data: bytes | str, *, trunc: bool = True) -> int:
        """One open (O_CREAT, as a shell's > does), one write(2), one close; the errno,
        or 0."""
        self.mark(rel)
        raw = data.encode() if isinstance(data, str) else data
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if trunc else os.O_APPEND)
        with deadline(20, f"write {rel}"):
            try:
                fd = os.open(self.p(rel), flags, 0o644)
            except OSError as e:
                return e.errno or -1
            try:
                os.write(fd, raw)
            except OSError as e:
                os.close(fd)
                return e.errno or -1
            try:
                os.close(fd)
            except OSError as e:
                return e.errno or -1
        return 0

    def refuses_write(self, rel: str) -> None:
        self.mark(rel)
        code = errno_of(lambda: os.close(os.open(self.p(rel), os.O_WRONLY)))
        check(code == errno.EACCES, f"open {rel} for writing: errno {code}, not EACCES")

    def refuses_read(self, rel: str) -> None:
        """A write-only file: reading it fails with EACCES, except for root, who reads it
        as empty (as on a disk, so that tar and cp -a as root archive a session)."""
        self.mark(rel)
        got: list[bytes] = []

        def read_it() -> None:
            fd = os.open(self.p(rel), os.O_RDONLY | os.O_NONBLOCK)
            try:
                got.append(os.read(fd, 4096))
            finally:
                os.close(fd)

        with deadline(20, f"read {rel}"):
            code = errno_of(read_it)
        if os.getuid() == 0:
            check(code == 0 and got == [b""], f"root reading {rel}: errno {code}, {got}")
        else:
            check(code == errno.EACCES, f"reading {rel}: errno {code}, not EACCES")

    def nonblock(self, rel: str, *, start: int = 0) -> tuple[bytes, str]:
        """Read with O_NONBLOCK from ``start`` until EAGAIN or EOF: (data, "EAGAIN"|"EOF")."""
        self.mark(rel)
        with deadline(20, f"O_NONBLOCK read of {rel}"):
            fd = os.open(self.p(rel), os.O_RDONLY | os.O_NONBLOCK)
            try:
                os.lseek(fd, start, os.SEEK_SET)
                return drain(fd)
            finally:
                os.close(fd)

    def refused(self, rel: str, data: bytes | str, want: int, reason: str, err: str) -> None:
        """A write refused with errno ``want`` and ``reason`` in the ``err`` file."""
        code = self.write(rel, data)
        check(code == want, f"write {data!r} to {rel}: errno {code}, not {want}")
        said = self.read(err)
        check(reason in said, f"{err} after the refused write to {rel}: {said!r}, not {reason!r}")

    # ---- sessions --------------------------------------------------------------------

    def new(self, spec: str) -> str:
        """Create a session on one handle of s/new and read its id back from it."""
        self.mark("s/new")
        with deadline(20, "s/new"):
            fd = os.open(self.p("s/new"), os.O_RDWR)
            try:
                os.write(fd, spec.encode())
                return os.pread(fd, 4096, 0).decode().strip()
            finally:
                os.close(fd)

    def state(self, sid: str) -> str:
        return self.read(f"s/{sid}/state").strip()

    def wait_idle(self, sid: str) -> None:
        """ollie(5)'s statewait loop: open, then look, then wait (no lost wake-up)."""
        self.mark(f"s/{sid}/statewait")
        with deadline(30, f"waiting for {sid} to be idle"):
            while True:
                with open(self.p(f"s/{sid}/statewait"), "rb") as w:
                    if self.state(sid) == "idle":
                        return
                    w.read()

    def follow(self, sid: str, needle: str) -> bytes:
        """Follow ``stream`` (blocking reads) until ``needle`` shows; what it gave."""
        rel = f"s/{sid}/stream"
        self.mark(rel)
        with deadline(30, f"following {rel} for {needle!r}"), open(self.p(rel), "rb") as f:
            seen = b""
            while needle.encode() not in seen:
                chunk = f.read1(65536)
                check(chunk, f"{rel} ended before {needle!r}: {seen!r}")
                seen += chunk
            return seen

    def prompt(self, sid: str, text: str) -> None:
        check(self.write(f"s/{sid}/prompt", text) == 0, f"prompt {text!r} refused")

    def turn(self, sid: str, text: str) -> None:
        self.prompt(sid, text)
        self.wait_idle(sid)


def drain(fd: int) -> tuple[bytes, str]:
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return out, "EAGAIN"
        if not chunk:
            return out, "EOF"
        out += chunk


# ---- the steps ---------------------------------------------------------------------------


def root_files(c: Client) -> None:
    # NAME, a tab and whether it is configured (ollie(5) says one name per line).
    backends = [line.split("\t")[0] for line in c.read("backends").splitlines()]
    check("openai" in backends, f"backends: {backends}")
    check("ollie(5)" in c.read("help"), "help does not point to ollie(5)")
    check("ctl commands:" in c.read("help"), "help lacks the ctl commands")
    for rel in ("backends", "help", "err", "events", "s/idx"):
        c.refuses_write(rel)
    template = c.read("s/new")
    check(template.splitlines() == ["name=", "cwd=", "backend=", "model=", "agent="], template)
    c.refused("s/new", "cwd=/no/such/dir", errno.EINVAL, "cwd is not an existing directory", "err")
    c.refused("s/new", f'cwd="{c.work}" colour=red', errno.EINVAL, "colour", "err")
    c.refused("s/new", "cwd", errno.EINVAL, "s/new: expected key=value, got 'cwd'\n", "err")
    check(c.read("err").count("s/new:") == 1, f"err names s/new twice: {c.read('err')!r}")
    c.refused("s/new", f'cwd="{c.work}" name=new', errno.EINVAL, "new", "err")
    # complete: the request written on one handle, the text to insert read back from it.
    c.mark("complete")
    with deadline(20, "complete"):
        fd = os.open(c.p("complete"), os.O_RDWR)
        try:
            os.write(fd, b"model=fim\nsuffix=1\n\ndef f():\n    \n")
            got = os.read(fd, 4096)
        finally:
            os.close(fd)
    check(got == b"return 1", f"complete: {got!r}")
    c.refused("complete", "colour=red\n\n", errno.EINVAL, "unknown key 'colour'", "err")


def first_turn(c: Client, sid: str) -> None:
    check(c.state(sid) == "idle", "a new session is not idle")
    idx = c.read("s/idx").splitlines()
    check(f"{sid}\tidle\t{c.work}\topenai\treplay" in idx, f"s/idx: {idx}")
    c.turn(sid, "hello")
    chat = c.read(f"s/{sid}/chat")
    check("user: hello\nassistant: hello reply\n" in chat, f"chat: {chat!r}")
    off = int(c.read(f"s/{sid}/offset"))
    check(chat.encode()[off:] == b"hello reply\n", f"offset {off} in {chat!r}")
    check(c.read(f"s/{sid}/prompt.prev") == "hello\n", "prompt.prev")


def read_only_session_files(c: Client, sid: str) -> None:
    d = f"s/{sid}"
    context = [json.loads(x) for x in c.read(f"{d}/context").splitlines()]
    check([m["role"] for m in context[-2:]] == ["user", "assistant"], f"context: {context}")
    check(re.search(r"costLast=\$\d+\.\d{4}", c.read(f"{d}/cost")), "cost")
    check(re.fullmatch(r"\d+ / \d+ \(\d+%\)\n", c.read(f"{d}/ctxsz")), "ctxsz")
    env = c.read(f"{d}/env")
    check(f"OLLIE_SESSION_ID={sid}\n" in env and "KEY" not in env, f"env: {env!r}")
    check(c.read(f"{d}/models").splitlines() == ["replay"], "models")
    check("cwd" in c.read(f"{d}/systemprompt") or c.read(f"{d}/systemprompt"), "systemprompt")
    check(c.read(f"{d}/tail").startswith("#!/bin/sh"), "tail is not a script")
    check(os.access(c.p(f"{d}/tail"), os.X_OK), "tail is not executable")
    check(isinstance(json.loads(c.read(f"{d}/taskstate")), dict), "taskstate")
    check(c.read(f"{d}/tcct").strip().isdigit(), "tcct")
    for line in c.read(f"{d}/tools").splitlines():
        check(len(line.split("\t")) == 3, f"tools line {line!r}")
    check(re.match(r"\d+ in, \d+ out, \d+ requests?", c.read(f"{d}/usage")), "usage")
    check(c.read(f"{d}/err") == "", "err of a session with no refused write")
    read_only = (
        "chat context cost ctxsz env err models offset prompt.prev state statewait stream "
        "systemprompt tail taskstate tcct tools usage events fifo.out"
    )
    # t/: what this agent may load (the default profile: every tool), read-only.
    check(c.read(f"{d}/t/idx") == c.read("t/idx"), "t/idx of a session without allowTools")
    check(c.read(f"{d}/t/file_read") == c.read("t/file_read"), "t/file_read of a session")
    read_only += " t/idx t/file_read"
    for f in read_only.split():
        c.refuses_write(f"{d}/{f}")
    for f in ("ctl", "prompt", "fifo.in"):
        c.refuses_read(f"{d}/{f}")


def blocking_files_nonblock(c: Client, sid: str) -> None:
    d = f"s/{sid}"
    chat = c.read(f"{d}/chat").encode()
    data, end = c.nonblock(f"{d}/stream")
    check((data, end) == (chat, "EAGAIN"), f"O_NONBLOCK stream: {end}, {data!r}")
    data, end = c.nonblock(f"{d}/stream", start=len(chat))
    check((data, end) == (b"", "EAGAIN"), f"O_NONBLOCK stream at its end: {end}, {data!r}")
    for rel in (f"{d}/events", "events"):
        data, end = c.nonblock(rel)
        check(end == "EAGAIN" and data.endswith(b"\n"), f"O_NONBLOCK {rel}: {end}")
        events = [json.loads(x) for x in data.splitlines()]
        check(any(e["role"] == "assistant" and e["session"] == sid for e in events), rel)
        size = os.stat(c.p(rel)).st_size
        check(size == len(data), f"{rel} reports size {size}, has {len(data)}")
        data, end = c.nonblock(rel, start=size)
        check((data, end) == (b"", "EAGAIN"), f"O_NONBLOCK {rel} at its end: {end}")
    # statewait and fifo.out with nothing to give: EAGAIN at once.
    check(c.nonblock(f"{d}/statewait") == (b"", "EAGAIN"), "O_NONBLOCK statewait when idle")
    check(c.nonblock(f"{d}/fifo.out") == (b"", "EAGAIN"), "O_NONBLOCK fifo.out, empty queue")


def concurrent_readers(c: Client, sid: str) -> None:
    """Readers of stream, events and the root events, all at the end before a turn,
    read it as it streams: every reader of one file gets the same bytes."""
    d = f"s/{sid}"
    idle_after_thinking = re.compile(rb'"role":"state"[^\n]*"content":"idle"[^\n]*\n')

    def stream_done(b: bytes) -> int:
        i = b.find(MARK.encode())
        return -1 if i < 0 else i + len(MARK)

    def events_done(b: bytes) -> int:
        t = b.find(b'"content":"thinking"')
        m = idle_after_thinking.search(b, t) if t >= 0 else None
        return -1 if m is None else m.end()

    readers: list[tuple[str, Callable[[bytes], int]]] = []
    readers += [(f"{d}/stream", stream_done)] * 4
    readers += [(f"{d}/events", events_done)] * 3
    readers += [("events", events_done)] * 2
    results: list[bytes | None] = [None] * len(readers)
    errors: list[str] = []
    # All readers of one file start at one offset, its size before any of them opened
    # it: an event appended while they open (a late usage line) is then read by all.
    start = {rel: os.stat(c.p(rel)).st_size for rel, _ in readers}
    files = []
    for rel, _ in readers:
        c.mark(rel)
        f = open(c.p(rel), "rb")
        f.seek(start[rel])
        files.append(f)

    def run(i: int) -> None:
        done = readers[i][1]
        seen = b""
        try:
            while (n := done(seen)) < 0:
                chunk = files[i].read1(65536)
                if not chunk:
                    errors.append(f"{readers[i][0]} ended early: {seen!r}")
                    return
                seen += chunk
            results[i] = seen[:n]
        except Exception as e:  # reported below, as the thread cannot fail the run
            errors.append(f"{readers[i][0]}: {e!r}")

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(readers))]
    for t in threads:
        t.start()
    c.prompt(sid, "many readers")
    for t in threads:
        t.join(30)
    check(not any(t.is_alive() for t in threads), "a concurrent reader never finished")
    check(not errors, f"concurrent readers: {errors}")
    for f in files:
        f.close()
    for rel in {r for r, _ in readers}:
        got = {results[i] for i, (r, _) in enumerate(readers) if r == rel}
        check(len(got) == 1, f"concurrent readers of {rel} got different bytes: {got}")
    stream = results[0]
    check(stream is not None and stream.endswith(MARK.encode()), "stream")
    c.wait_idle(sid)
    check(c.read(f"{d}/chat").encode().find(stream or b"") > 0, "stream differs from chat")


def while_running(c: Client, sid: str) -> None:
    """A turn that hangs: statewait and fifo.out with O_NONBLOCK, EBUSY for changes."""
    d = f"s/{sid}"
    c.mark(f"{d}/statewait")
    fd = os.open(c.p(f"{d}/statewait"), os.O_RDONLY | os.O_NONBLOCK)
    try:
        check(drain(fd) == (b"", "EAGAIN"), "statewait before any change")
        c.prompt(sid, "hang there")
        data, end = drain(fd)
        check(data == b"thinking\n", f"statewait after the prompt: {data!r} {end}")
        check(drain(fd) == (b"", "EOF"), "statewait gives one value per open")
    finally:
        os.close(fd)
    c.mark(f"{d}/fifo.out")
    fd = os.open(c.p(f"{d}/fifo.out"), os.O_RDONLY | os.O_NONBLOCK)
    try:
        check(drain(fd) == (b"", "EAGAIN"), "fifo.out before anything is queued")
        check(c.write(f"{d}/fifo.in", "queued then taken") == 0, "fifo.in while running")
        check(drain(fd) == (b"queued then taken\n", "EOF"), "fifo.out after a queued prompt")
    finally:
        os.close(fd)
    # The request is on its way once the first delta is in chat: stop it only then, or
    # the stop could come before the request is sent and the next turn would get its
    # scripted answer.
    c.follow(sid, "assistant: hung")
    c.refused(f"{d}/cfg", "temperature=0.3", errno.EBUSY, "while a turn is running", f"{d}/err")
    c.refused(f"{d}/ctl", "rn other", errno.EBUSY, "while a turn is running", f"{d}/err")
    code = errno_of(lambda: os.rename(c.p(d), c.p("s/other")))
    check(code == errno.EBUSY, f"rename of a running session: errno {code}")
    check(c.write(f"{d}/ctl", "stop") == 0, "stop")
    c.wait_idle(sid)
    chat = c.read(f"{d}/chat")
    check(":: stopped\n" in chat, f"no stop in chat: {chat!r}")
    check("queued then taken" not in chat.split(":: stopped")[1], "the taken prompt ran")


def writable_session_files(c: Client, sid: str) -> None:
    d = f"s/{sid}"
    # cfg: the whole file written back is a no-op; a change applies; a bad value is refused.
    cfg = c.read(f"{d}/cfg")
    check(c.write(f"{d}/cfg", cfg) == 0, "cfg written back whole")
    check(c.write(f"{d}/cfg", "temperature=0.3\nmaxTokens=500") == 0, "cfg change")
    cfg = c.read(f"{d}/cfg")
    check("temperature=0.3\n" in cfg and "maxTokens=500\n" in cfg, f"cfg: {cfg!r}")
    c.refused(f"{d}/cfg", "temperature=9", errno.EINVAL, "temperature", f"{d}/err")
    c.refused(f"{d}/cfg", "state=thinking", errno.EINVAL, "state", f"{d}/err")
    check("temperature=0.3\n" in c.read(f"{d}/cfg"), "a refused cfg write changed cfg")
    # ctl
    check(c.write(f"{d}/ctl", "maxsteps 40") == 0, "ctl maxsteps")
    c.refused(f"{d}/ctl", "frobnicate", errno.EINVAL, "unknown command: frobnicate", f"{d}/err")
    c.refused(f"{d}/ctl", "maxsteps 0", errno.EINVAL, "maxsteps", f"{d}/err")
    # prompt: bytes that can never be UTF-8 are refused at write(2), and nothing runs.
    chat = c.read(f"{d}/chat")
    c.refused(f"{d}/prompt", b"\xff\xfe bad", errno.EINVAL, "UTF-8", f"{d}/err")
    c.refused(f"{d}/fifo.in", b"\xff bad", errno.EINVAL, "UTF-8", f"{d}/err")
    check(c.state(sid) == "idle", "a refused prompt started a turn")
    check("\xff" not in c.read(f"{d}/chat"), "a refused prompt reached chat")
    check(c.read(f"{d}/chat").startswith(chat), "chat rewritten")
    # fifo.in on an idle session runs at once.
    check(c.write(f"{d}/fifo.in", "from the fifo") == 0, "fifo.in when idle")
    c.wait_idle(sid)
    chat = c.read(f"{d}/chat")
    check("user: from the fifo\nassistant: fifo reply\n" in chat, f"fifo.in ran: {chat!r}")
    # plan: a file, applied at close; not UTF-8 refused at close, the old plan kept.
    check(c.write(f"{d}/plan", "- [ ] one\n- [ ] two\n") == 0, "plan")
    with open(c.p(f"{d}/plan"), "r+b") as f:
        f.seek(3)
        f.write(b"x")
    check(c.read(f"{d}/plan") == "- [x] one\n- [ ] two\n", "plan written at an offset")
    c.refused(f"{d}/plan", b"\xff\xfe", errno.EINVAL, "UTF-8", f"{d}/err")
    check(c.read(f"{d}/plan") == "- [x] one\n- [ ] two\n", "a refused plan changed it")


def family(c: Client, sid: str) -> str:
    """A child session (PARENT__CHILD) is a peer: a prompt to it through peer/."""
    kid = c.new(f'cwd="{c.work}" name={sid}__kid')
    check(kid == f"{sid}__kid", f"child id {kid!r}")
    check(os.listdir(c.p(f"s/{sid}/peer")) == [kid], "peer/ lists the child")
    check(os.listdir(c.p(f"s/{kid}/peer")) == [sid], "the child's peer/ lists the parent")
    c.refuses_read(f"s/{sid}/peer/{kid}")
    check(c.write(f"s/{sid}/peer/{kid}", "hi kid") == 0, "peer write")
    c.wait_idle(kid)
    check(f"user: [from {sid}] hi kid\nassistant: kid reply\n" in c.read(f"s/{kid}/chat"), "kid")
    c.refused(f"s/{sid}/peer/{kid}", b"\xff", errno.EINVAL, "UTF-8", f"s/{sid}/err")
    return kid


def history_dirs(c: Client, sid: str) -> None:
    """compactions/N and branches/K, made by ctl compact and ctl rewind; tr/ by ctl save."""
    d = f"s/{sid}"
    for i in (1, 2, 3):
        c.turn(sid, f"turn {i}")
    before = c.read(f"{d}/context")
    check(c.write(f"{d}/ctl", "compact") == 0, "ctl compact")
    c.wait_idle(sid)
    snap = c.read(f"{d}/compactions/1/before.jsonl")
    check(snap == before, "compactions/1/before.jsonl is not the history before")
    check("counted to three" in c.read(f"{d}/compactions/1/summary"), "summary")
    check(c.read(f"{d}/compactions/1/dropped").strip(), "dropped")
    for f in ("before.jsonl", "summary", "dropped"):
        c.refuses_write(f"{d}/compactions/1/{f}")
    chat = c.read(f"{d}/chat")
    context = c.read(f"{d}/context")
    check(c.write(f"{d}/ctl", "rewind 1") == 0, "ctl rewind")
    check(c.read(f"{d}/branches/1/chat") == chat, "branches/1/chat")
    check(c.read(f"{d}/branches/1/context") == context, "branches/1/context")
    c.refuses_write(f"{d}/branches/1/chat")
    c.refuses_write(f"{d}/branches/1/context")
    c.refused(f"{d}/ctl", "rewind 99", errno.EINVAL, "rewind", f"{d}/err")
    # No tool changed a file: no checkpoint, nothing staged.
    for f in ("checkpoints/diff", "staged/files", "staged/diff"):
        check(c.read(f"{d}/{f}") == "", f"{f} of a session that changed no file")
        c.refuses_write(f"{d}/{f}")
    check(c.write(f"{d}/ctl", "save") == 0, "ctl save")
    saved = [n for n in os.listdir(c.p("tr")) if n.endswith(f"-{sid}.md")]
    check(len(saved) == 1, f"tr/ after ctl save: {os.listdir(c.p('tr'))}")
    check("user: hello" in c.read(f"tr/{saved[0]}"), "the transcript")
    c.refuses_write(f"tr/{saved[0]}")


def folders(c: Client, kid: str) -> None:
    # a/: profiles; a bad one refused with the reason in the root err.
    check("description" in json.loads(c.read("a/default.json")), "a/default.json")
    json.loads(c.read("a/coding.json"))
    profile = {"description": "a client's profile", "tools": []}
    check(c.write("a/mine.json", json.dumps(profile)) == 0, "a new profile")
    check(json.loads(c.read("a/mine.json")) == profile, "a/mine.json")
    c.refused("a/mine.json", '{"description": 3}', errno.EINVAL, "mine.json", "err")
    check(json.loads(c.read("a/mine.json")) == profile, "a refused profile replaced it")
    c.refused("a/mine.txt", "{}", errno.EINVAL, "mine.txt", "err")
    # m/: plain files on disk.
    check(c.write("m/note", "remember this\n") == 0, "m/note")
    check(c.write("m/note", "and this\n", trunc=False) == 0, "m/note again")
    check(c.read("m/note") == "remember this\nand this\n", "m/note appended to")
    # p/: read-only fragments.
    for name in sorted(os.listdir(c.p("p"))):
        check(c.read(f"p/{name}"), f"p/{name} is empty")
        c.refuses_write(f"p/{name}")
    # sk/: a skill is checked whole at close.
    skill = "---\nname: greet\ndescription: say hello\n---\nSay hello.\n"
    check(c.write("sk/greet.md", skill) == 0, "a new skill")
    check(c.read("sk/greet.md") == skill, "sk/greet.md")
    check(c.read("sk/idx") == "greet\tsay hello\n", "sk/idx")
    c.refused("sk/greet.md", "no front matter\n", errno.EINVAL, "SKILL.md must start", "err")
    check(c.read("sk/greet.md") == skill, "a refused skill replaced it")
    c.refuses_write("sk/idx")
    # t/: shipped scripts are read-only; idx describes them.
    idx = c.read("t/idx").splitlines()
    names = [line.split("\t")[0] for line in idx]
    check(names == sorted(names) and "file_read" in names, f"t/idx: {names}")
    for line in idx:
        check(len(line.split("\t")) == 5, f"t/idx line {line!r}")
        json.loads(line.split("\t")[2])
    for name in sorted(os.listdir(c.p("t"))):
        if name != "idx":
            check(c.read(f"t/{name}").startswith("#!"), f"t/{name} is not a script")
    c.refuses_write("t/file_read")
    c.refuses_write("t/idx")
    # mcp/: no server configured; idx (their states) is read-only.
    check(c.read("mcp/idx") == "", "mcp/idx without servers")
    c.refuses_write("mcp/idx")
    # A user's tool: created 0755 whatever the mode asked, listed in idx at once.
    tool = (
        "#!/bin/sh\n# ollie-tool\n# description: say hi\n"
        '# args: {"type": "object", "properties": {}}\n# parallel: true\necho hi\n'
    )
    check(c.write("t/say_hi", tool) == 0, "a user's tool")
    check(stat.S_IMODE(os.stat(c.p("t/say_hi")).st_mode) == 0o755, "t/say_hi mode")
    check(c.read("t/say_hi") == tool, "t/say_hi read back")
    check("say_hi\tsay hi\t" in c.read("t/idx"), "t/idx lacks the user's tool")
    os.unlink(c.p("t/say_hi"))
    # ollie(5): a script made, changed or removed is seen in idx at once (toolsrv
    # watches its tool folders).
    check("say_hi" not in c.read("t/idx"), "t/idx still lists a removed tool")
    # tmp/: sub-folders.
    os.mkdir(c.p("tmp/sub"))
    check(c.write("tmp/sub/f", "scratch") == 0, "tmp/sub/f")
    check(c.write("tmp/top", "top") == 0, "tmp/top")
    check(c.read("tmp/sub/f") == "scratch" and c.read("tmp/top") == "top", "tmp files")
    check(errno_of(lambda: os.rmdir(c.p("tmp/sub"))) == errno.ENOTEMPTY, "rmdir non-empty")
    check(errno_of(lambda: os.mkdir(c.p("m/sub"))) == errno.EACCES, "mkdir in m/")
    # What the tree refuses whatever the folder: symlinks, hard links, xattrs, a rename
    # to another folder (mv copies then).
    code = errno_of(lambda: os.symlink("top", c.p("tmp/link")))
    check(code == errno.ENOSYS, f"symlink in tmp/: {code}")
    code = errno_of(lambda: os.link(c.p("tmp/top"), c.p("tmp/hard")))
    check(code == errno.EPERM, f"link in tmp/: {code}")
    code = errno_of(lambda: os.setxattr(c.p("tmp/top"), "user.x", b"1"))
    check(code == errno.ENOTSUP, f"setxattr in tmp/: {code}")
    code = errno_of(lambda: os.rename(c.p("tmp/top"), c.p("m/top")))
    check(code == errno.EXDEV, f"rename tmp/ to m/: {code}")
    code = errno_of(lambda: os.rename(c.p("tmp/top"), c.p("tmp/sub/top")))
    check(code == errno.EXDEV, f"rename tmp/ to tmp/sub/: {code}")
    os.rename(c.p("tmp/sub/f"), c.p("tmp/sub/g"))  # within one folder: replaces, as sed -i
    check(c.read("tmp/sub/g") == "scratch", "renamed within tmp/sub/")
    # u/complete runs through the mount; x/ holds nothing shipped.
    c.mark("u/complete")
    run = subprocess.run(
        [c.p("u/complete"), "s/"], capture_output=True, text=True, timeout=30, check=False
    )
    check(run.returncode == 0, f"u/complete: {run.returncode} {run.stderr}")
    check(f"s/{kid}/" in run.stdout.splitlines(), f"u/complete s/: {run.stdout!r}")
    c.refuses_write("u/complete")
    check(os.listdir(c.p("x")) == [], "x/")
    code = errno_of(lambda: os.close(os.open(c.p("x/new"), os.O_WRONLY | os.O_CREAT, 0o644)))
    check(code == errno.EACCES, f"create in x/: {code}")


def ending(c: Client, sid: str, kid: str) -> None:
    """rm -r of the child moves its journal to tr/; the errors all reached events."""
    os.rmdir(c.p(f"s/{kid}"))
    check(not os.path.exists(c.p(f"s/{kid}")), "the child is still there")
    check(errno_of(lambda: os.rmdir(c.p(f"s/{kid}"))) == errno.ENOENT, "rmdir twice")
    check(os.listdir(c.p(f"s/{sid}/peer")) == [], "peer/ after the child ended")
    journals = [n for n in os.listdir(c.p("tr")) if n.endswith(f"-{kid}.jsonl")]
    check(len(journals) == 1, f"tr/: {os.listdir(c.p('tr'))}")
    for line in c.read(f"tr/{journals[0]}").splitlines():
        json.loads(line)
    saved = [n for n in os.listdir(c.p("tr")) if n.endswith(".md")]
    os.unlink(c.p(f"tr/{saved[0]}"))  # read-only, but rm is allowed
    check(not os.path.exists(c.p(f"tr/{saved[0]}")), "rm of a transcript")
    data, _ = c.nonblock("events")
    reasons = [e["content"] for e in map(json.loads, data.splitlines()) if e["role"] == "error"]
    for want in ("cwd is not an existing directory", "unknown command: frobnicate", "UTF-8"):
        check(any(want in r for r in reasons), f"no error event with {want!r}: {reasons}")


def walk(c: Client, absent: set[str]) -> None:
    """Every kind of file in the tree was exercised, and every kind ollie(5) lists is there
    (but ``absent``: the journal of a removed session before one is removed, a peer after
    the only child is gone).

    A walk stats and lists; it never reads, so blocking files are no obstacle."""
    found: set[str] = set()
    for dirpath, _dirs, files in os.walk(c.root):
        for name in files:
            full = os.path.join(dirpath, name)
            check(stat.S_ISREG(os.lstat(full).st_mode), f"{full} is not a regular file")
            found.add(c.kind(os.path.relpath(full, c.root)))
    missing = EXPECTED - absent - found
    check(not missing, f"ollie(5) files not in the tree: {sorted(missing)}")
    untested = found - c.seen
    check(not untested, f"files the client did not exercise: {sorted(untested)}")


def main() -> int:
    if sys.argv[1:] == ["--script"]:
        for entry in SCRIPT:
            print(json.dumps(entry))
        return 0
    root, work = sys.argv[1:3]
    c = Client(root, work)
    steps: list[tuple[str, Callable[[], object]]] = [
        ("root files", lambda: root_files(c)),
    ]
    sid = ""

    def create() -> None:
        nonlocal sid
        sid = c.new(f'cwd="{c.work}" name=cl')
        check(sid == "cl", f"id {sid!r}")

    steps += [
        ("a session", create),
        ("a first turn", lambda: first_turn(c, sid)),
        ("read-only session files", lambda: read_only_session_files(c, sid)),
        ("blocking files with O_NONBLOCK", lambda: blocking_files_nonblock(c, sid)),
        ("concurrent readers", lambda: concurrent_readers(c, sid)),
        ("while a turn runs", lambda: while_running(c, sid)),
        ("writable session files", lambda: writable_session_files(c, sid)),
    ]
    kid = ""

    def fam() -> None:
        nonlocal kid
        kid = family(c, sid)

    steps += [
        ("a family", fam),
        ("compactions, branches, transcripts", lambda: history_dirs(c, sid)),
        ("folders on disk", lambda: folders(c, kid)),
        ("the whole tree", lambda: walk(c, {"tr/*.jsonl"})),
        ("the end of a session", lambda: ending(c, sid, kid)),
        ("the whole tree again", lambda: walk(c, {"s/ID/peer/NAME", "tr/*.md"})),
    ]
    for name, fn in steps:
        print(f"== {name}", flush=True)
        try:
            fn()
        except (Failed, OSError, ValueError, KeyError) as e:
            print(f"FAIL in {name}: {e!r}", file=sys.stderr)
            return 1
    print(f"stdlib client ok: {len(c.seen)} kinds of file exercised")
    return 0


if __name__ == "__main__":
    sys.exit(main())
