"""The backend fault matrix (issue 11 item 7): every fault, on every wire format, end to end.

A real daemon talks to the replay server in each of the six wire formats; the server
plays a fault script per session (``for_model``: each session asks for a model name of
its own, so all of them run side by side on one server, and the requests each one made,
its retries, are counted at the server). For each fault the turn must end or recover as
SPEC 3.7 and 4 say:

* 429 with ``Retry-After`` waits what the provider asked for, without it
  ``OLLIE_RATELIMIT_BASE``·2^n, in state ``limitretry``; three retries, then ``error:``;
* a burst of 5xx is retried (``OLLIE_RETRY_BASE``·2^n) and recovers, or after three
  retries ends the turn with ``error:``;
* a stream dropped mid-reply (after whole events, or after any byte count, inside an
  event, a UTF-8 sequence or an HTTP chunk) keeps the partial text, shows ``retrying
  in``, and the retried reply starts a fresh ``assistant:`` line;
* a slow-loris server (one byte per HTTP chunk) is slow, not broken: the reply arrives
  whole, split anywhere;
* a garbage body ends the turn with one ``error:`` line and no retry;
* a hung server (headers then nothing, part of a stream then nothing, or no answer at
  all) is cut by the read timeout and retried; ``ctl stop`` ends a hung turn at once.

After every fault the session is ``idle`` and takes the next prompt; ``state`` answers
throughout (the latency figure is ``bench/bench_faults.py``'s: tests do not time).
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest

from olliefs.replay import Entry, ReplayServer
from olliefs.testing import HAVE_FUSE, Daemon, deadline, expect_log
from tests.e2e.test_memory import rss
from tests.e2e.test_replay_server import USER, dechunk, raw_post, read_all, read_until

KEY = "sk-faults-0123456789"
WIRES = ["openai", "anthropic", "ollama", "gemini", "copilot", "kiro"]
STATES = {"idle", "thinking", "limitretry", "compacting"}
# Seconds between the bytes of a slow-loris answer. A byte a second is the real thing
# (OLLIE_FAULT_BYTE_DELAY=1 by hand: minutes per reply); CI keeps it short but still
# sends each byte in its own HTTP chunk, which is what the parsers must survive.
BYTE_DELAY = float(os.environ.get("OLLIE_FAULT_BYTE_DELAY", "0.002"))
READ_TIMEOUT = max(1.5, 3 * BYTE_DELAY)
# A reply with multi-byte characters, so byte-level cuts and splits land inside them.
REPLY = "héllo wörld — all here"


def after(prefix: str) -> str:
    return f"{prefix}: {REPLY}"


@dataclass
class Fault:
    """A fault script and what SPEC says the session shows after it."""

    entries: list[Entry]
    requests: int  # requests the server must have seen (1 + retries)
    recovers: bool  # the turn ends with the scripted reply (else with an error: line)
    retry_lines: list[str] = field(default_factory=list)  # "retrying in Ns..." waits
    limitretry: int = 0  # limitretry events (429 waits)
    partial: bool = False  # a cut reply's partial text stays in chat before the retry
    # wires that end the turn at the first request (a bad payload, not retried)
    per_wire: dict[str, int] = field(default_factory=dict)

    def expect(self, wire: str) -> tuple[int, list[str]]:
        """(requests, retry waits) on ``wire``."""
        if wire in self.per_wire:
            n = self.per_wire[wire]
            return n, self.retry_lines[: n - 1]
        return self.requests, self.retry_lines


def ok(name: str) -> Entry:
    return Entry(reply=after(name), chunk=3)


FAULTS: dict[str, Fault] = {
    "429-retry-after": Fault(
        [Entry(status=429, retry_after="0.05"), ok("429-retry-after")],
        requests=2,
        recovers=True,
        retry_lines=["0.05"],
        limitretry=1,
    ),
    "429-retry-after-ms": Fault(
        [Entry(status=429, retry_after_ms="30"), ok("429-retry-after-ms")],
        requests=2,
        recovers=True,
        retry_lines=["0.03"],
        limitretry=1,
    ),
    "429-bare": Fault(
        [Entry(status=429), Entry(status=429), ok("429-bare")],
        requests=3,
        recovers=True,
        retry_lines=["0.01", "0.02"],  # OLLIE_RATELIMIT_BASE 0.01 * 2^n
        limitretry=2,
    ),
    "429-exhausted": Fault(
        [Entry(status=429, error="slow down")] * 4,
        requests=4,
        recovers=False,
        retry_lines=["0.01", "0.02", "0.04"],
        limitretry=3,
    ),
    "5xx-burst": Fault(
        [Entry(status=500), Entry(status=502), Entry(status=503), ok("5xx-burst")],
        requests=4,
        recovers=True,
        retry_lines=["0.01", "0.02", "0.04"],  # OLLIE_RETRY_BASE 0.01 * 2^n
    ),
    "5xx-exhausted": Fault(
        [Entry(status=503, error="overloaded")] * 4,
        requests=4,
        recovers=False,
        retry_lines=["0.01", "0.02", "0.04"],
    ),
    "5xx-in-stream": Fault(
        [
            Entry(reply="partial answer", chunk=4, drop_after=2, status=500, in_stream=True),
            ok("5xx-in-stream"),
        ],
        requests=2,
        recovers=True,
        retry_lines=["0.01"],
        partial=True,
    ),
    "drop-mid-stream": Fault(
        [Entry(reply="cut short here", chunk=4, drop_after=2), ok("drop-mid-stream")],
        requests=2,
        recovers=True,
        retry_lines=["0.01"],
        partial=True,
    ),
    "drop-at-byte": Fault(
        # past the first delta of every wire, inside a later one
        [Entry(reply="ünïcödé " * 40, chunk=2, cut_after=1001), ok("drop-at-byte")],
        requests=2,
        recovers=True,
        retry_lines=["0.01"],
        partial=True,
    ),
    "drop-before-body": Fault(
        [Entry(reply="x", cut_after=0), ok("drop-before-body")],
        requests=2,
        recovers=True,
        retry_lines=["0.01"],
    ),
    "slow-loris": Fault(
        [Entry(reply=after("slow-loris"), chunk=3, byte_delay=BYTE_DELAY)],
        requests=1,
        recovers=True,
    ),
    "garbage-stream": Fault([Entry(garbage="{not json at all")], requests=1, recovers=False),
    "garbage-body": Fault(
        [Entry(body="<html><body>502 Bad Gateway</body></html>")],
        requests=1,
        recovers=False,
    ),
    # Binary noise: no line of it is an SSE field, so an SSE parser sees no event at all
    # and then the body ends without the wire's end marker: a dropped stream, retried
    # (ollie(5) FAULTS). NDJSON (Ollama) and the event stream (Kiro) see a bad payload.
    "garbage-bytes": Fault(
        [Entry(raw=bytes(range(256)) * 4, raw_chunk=100)] * 4,
        requests=4,
        recovers=False,
        retry_lines=["0.01", "0.02", "0.04"],
        per_wire={"ollama": 1, "kiro": 1},
    ),
    "hung-after-headers": Fault(
        [Entry(hang=True), ok("hung-after-headers")],
        requests=2,
        recovers=True,
        retry_lines=["0.01"],
    ),
    "hung-mid-stream": Fault(
        [Entry(reply="started then", chunk=4, hang=True, hang_after=2), ok("hung-mid-stream")],
        requests=2,
        recovers=True,
        retry_lines=["0.01"],
        partial=True,
    ),
    "hung-silent": Fault(
        [Entry(silent=True), ok("hung-silent")],
        requests=2,
        recovers=True,
        retry_lines=["0.01"],
    ),
}


def model_of(fault: str, wire: str) -> str:
    return f"f-{fault}-{wire}"


def keyed_daemon(base: Path, server: ReplayServer, **env: str) -> Daemon:
    daemon = Daemon(base, server, {**server.settings(), **env})
    # The backends log the faults they are fed (when a test feeds HTTP errors); those
    # lines are the point here, and a test that feeds none sees none.
    expect_log(r"HTTP [45]\d\d", count=range(10**6))
    return daemon


def requests_of(server: ReplayServer, model: str) -> int:
    return sum(r.model == model for r in server.recorded)


class StatePoller:
    """Reads every session's ``state`` in a loop from a thread while the faults run;
    remembers every answer, and any error, to check afterwards."""

    def __init__(self, daemon: Daemon, sids: list[str]) -> None:
        self.daemon, self.sids = daemon, sids
        self.seen: dict[str, set[str]] = {sid: set() for sid in sids}
        self.errors: list[BaseException] = []
        self.reads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="state-poller")

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for sid in self.sids:
                    self.seen[sid].add((self.daemon.p(f"s/{sid}/state")).read_text())
                    self.reads += 1
        except BaseException as e:  # reported by stop()
            self.errors.append(e)

    def __enter__(self) -> StatePoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "a read of state blocked"
        assert not self.errors, self.errors


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ReplayServer, Daemon]]:
    """Every fault on every wire at once, one session each; yields once all are idle."""
    if not HAVE_FUSE:
        pytest.skip(reason="needs /dev/fuse (mounts for real)")
    base = tmp_path_factory.mktemp("faults")
    with ReplayServer(key=KEY) as server:
        daemon = keyed_daemon(
            base,
            server,
            OLLIE_RETRY_BASE="0.01",
            OLLIE_RATELIMIT_BASE="0.01",
            OLLIE_READ_TIMEOUT=str(READ_TIMEOUT),
        )
        with daemon.running():
            sids = []
            for name, fault in FAULTS.items():
                for wire in WIRES:
                    model = model_of(name, wire)
                    entries = fault.entries[: fault.expect(wire)[0]]
                    server.add([_for(e, model) for e in entries])
                    sids.append(daemon.new(name=model, backend=wire, model=model))
            with StatePoller(daemon, sids) as poller:
                for sid in sids:
                    daemon.prompt(sid, "go")
                for sid in sids:
                    daemon.wait_state(sid, "idle", timeout=120)
            assert poller.reads >= len(sids)
            yield server, daemon


def _for(entry: Entry, model: str) -> Entry:
    return msgspec.structs.replace(entry, for_model=model)


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("name", list(FAULTS))
def test_fault(matrix: tuple[ReplayServer, Daemon], name: str, wire: str) -> None:
    server, daemon = matrix
    fault, sid = FAULTS[name], model_of(name, wire)
    requests, retry_lines = fault.expect(wire)
    assert requests_of(server, sid) == requests
    assert daemon.read(f"s/{sid}/state") == "idle\n"
    chat = daemon.read(f"s/{sid}/chat")
    # an error quoting a garbage body shows its bytes escaped, never raw
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f]", chat), chat
    lines = chat.splitlines()
    turn = lines[lines.index("user: go") + 1 :]
    waits = [x.split()[2] for x in turn if x.startswith("retrying in ")]
    assert waits == [f"{w}s..." for w in retry_lines], chat
    if fault.recovers:
        assert turn[-1] == f"assistant: {after(name)}", chat
        assert not any(x.startswith("error: ") for x in turn), chat
        context = [json.loads(x) for x in daemon.read(f"s/{sid}/context").splitlines()]
        # only the retried reply goes into the history
        assert context[-1]["content"] == after(name)
    else:
        assert turn[-1].startswith(f"error: {wire}: "), chat
        assert sum(x.startswith("error: ") for x in turn) == 1, chat
    if fault.partial:
        # the cut reply's text stays, closed, before the retry line
        cut = next(x for x in turn if x.startswith("assistant: "))
        assert cut != f"assistant: {after(name)}" and len(cut) > len("assistant: ")
        assert turn[turn.index(cut) + 1].startswith("retrying in ")
    events = [json.loads(x) for x in daemon.snapshot(f"s/{sid}/events").splitlines()]
    assert sum(e["role"] == "limitretry" for e in events) == fault.limitretry
    states = [e["content"] for e in events if e["role"] == "state"]
    assert states.count("limitretry") == fault.limitretry
    assert states[-1] == "idle"


def test_every_session_takes_the_next_prompt(matrix: tuple[ReplayServer, Daemon]) -> None:
    _server, daemon = matrix
    sids = [model_of(name, wire) for name in FAULTS for wire in WIRES]
    for sid in sids:
        daemon.prompt(sid, f"again {sid}")
    for sid in sids:
        daemon.wait_idle(sid)
        assert_echoed(daemon.read(f"s/{sid}/chat"), f"again {sid}")


def assert_echoed(chat: str, prompt: str) -> None:
    """The last turn was answered by the replay server's echo of ``prompt``. A turn that
    ended in an error or a stop leaves its prompt unanswered in the history; the Anthropic
    and Kiro wires merge it with the next one, so the echo may start with "go"."""
    answer = chat.rsplit(f"user: {prompt}\n", 1)[1]
    assert answer.startswith("assistant: echo: ") and answer.endswith(f"{prompt}\n"), chat


# Faults that last until something ends them: the read timeout is an hour here.
HANGS: dict[str, Entry] = {
    "after-headers": Entry(hang=True),
    "mid-stream": Entry(reply="started then", chunk=4, hang=True, hang_after=2),
    "silent": Entry(silent=True),
    "slow-loris": Entry(reply="a byte an hour " * 20, byte_delay=3600),
}


@pytest.fixture
def hung(tmp_path: Path) -> Iterator[Callable[[], tuple[ReplayServer, Daemon, list[str]]]]:
    if not HAVE_FUSE:
        pytest.skip(reason="needs /dev/fuse (mounts for real)")
    with ReplayServer(key=KEY) as server:
        daemon = keyed_daemon(tmp_path, server, OLLIE_READ_TIMEOUT="3600")
        with daemon.running():

            def start() -> tuple[ReplayServer, Daemon, list[str]]:
                """Every hang on every wire, each session in its turn, its request at the
                server and nothing more coming."""
                sids = []
                for name, entry in HANGS.items():
                    for wire in WIRES:
                        model = f"h-{name}-{wire}"
                        server.add([_for(entry, model)])
                        sids.append(daemon.new(name=model, backend=wire, model=model))
                        daemon.prompt(model, "go")
                server.wait_recorded(
                    lambda got: all(sum(r.model == s for r in got) == 1 for s in sids), 60
                )
                for sid in sids:
                    daemon.wait_state(sid, "thinking")
                return server, daemon, sids

            yield start


def test_state_answers_while_the_backend_hangs_and_stop_ends_it(
    hung: Callable[[], tuple[ReplayServer, Daemon, list[str]]],
) -> None:
    server, daemon, sids = hung()
    # Every session is stuck in its backend until stopped. Each state read must answer,
    # many times over (each with_deadline bounded: a blocked read fails the test).
    with deadline(60):
        for _ in range(5):
            for sid in sids:
                assert daemon.p(f"s/{sid}/state").read_text() == "thinking\n"
                assert "state=thinking\n" in daemon.p(f"s/{sid}/cfg").read_text()
    for sid in sids:
        daemon.write(f"s/{sid}/ctl", "stop")
    for sid in sids:
        # at once: the read timeout is an hour and nothing else would end these turns
        daemon.wait_state(sid, "idle", timeout=20)
        chat = daemon.read(f"s/{sid}/chat")
        assert chat.endswith(":: stopped\n"), chat
        assert "error: " not in chat and "retrying in" not in chat, chat
        assert requests_of(server, sid) == 1
    for sid in sids:
        daemon.prompt(sid, "after the hang")
    for sid in sids:
        daemon.wait_idle(sid)
        assert_echoed(daemon.read(f"s/{sid}/chat"), "after the hang")


# ---- a line that never ends ------------------------------------------------------------

MB = 1024 * 1024
FLOOD = 256 * MB


@pytest.mark.parametrize("status", [200, 400])
@pytest.mark.parametrize("wire", WIRES)
def test_a_line_that_never_ends_ends_the_turn_with_the_memory_bounded(
    tmp_path: Path, wire: str, status: int
) -> None:
    """A server that starts a payload and never ends it (256 MiB of one SSE line, NDJSON
    line or event stream frame; or of an error body): the turn ends with one ``error:``
    line once 16 MiB of it came, not retried, and the daemon never held much more than
    that (it held all of it, several times over: 300 MB took it to 1.6 GB)."""
    if not HAVE_FUSE:
        pytest.skip(reason="needs /dev/fuse (mounts for real)")
    with ReplayServer(key=KEY) as server:
        daemon = keyed_daemon(tmp_path, server)
        with daemon.running():
            sid = daemon.new(name="flood", backend=wire, model="flood")
            daemon.prompt(sid, "warm up")
            daemon.wait_idle(sid)
            before = rss(daemon)
            server.add([Entry(flood=FLOOD, status=status)])
            daemon.prompt(sid, "go")
            daemon.wait_idle(sid)
            peak = rss(daemon, "VmHWM")
            assert peak - before < 96 * MB, f"the daemon's peak grew {(peak - before) / MB} MB"
            chat = daemon.read(f"s/{sid}/chat")
            turn = chat.split("user: go\n", 1)[1].splitlines()
            assert len(turn) == 1 and turn[0].startswith(f"error: {wire}: "), chat
            if status == 200:
                assert "longer than 16 MiB" in turn[0], chat
            else:
                assert turn[0].startswith(f"error: {wire}: HTTP 400: "), chat
            assert requests_of(server, "flood") == 2  # the warm-up and one, not retried
            daemon.prompt(sid, "after the flood")
            daemon.wait_idle(sid)
            assert_echoed(daemon.read(f"s/{sid}/chat"), "after the flood")


# ---- the replay server's fault fields, seen on the wire ---------------------------------


@pytest.fixture
def server() -> Iterator[ReplayServer]:
    with ReplayServer() as srv:
        yield srv


STREAM = {"model": "m", "messages": USER, "stream": True}


def test_cut_after_drops_inside_a_chunk(server: ReplayServer) -> None:
    server.add([Entry(reply="abcdefgh" * 10, chunk=8, cut_after=100)])
    with raw_post(server, STREAM) as sock:
        head, _, body = read_all(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    size, _, rest = body.partition(b"\r\n")
    first = int(size, 16)
    # the first chunk is announced whole and cut at byte 100 of the body
    assert first > 100 or len(rest) < first
    payload = b""
    while body:
        size, _, body = body.partition(b"\r\n")
        n = int(size, 16)
        payload += body[:n]
        if len(body) < n + 2:
            break
        body = body[n + 2 :]
    assert len(payload) == 100
    assert b"[DONE]" not in payload


def test_byte_delay_sends_a_byte_per_chunk(server: ReplayServer) -> None:
    server.add([Entry(reply="héllo", chunk=10, byte_delay=0.0001)])
    with raw_post(server, STREAM) as sock:
        body = read_all(sock).partition(b"\r\n\r\n")[2]
    chunks, complete = dechunk(body)
    assert complete and all(len(c) == 1 for c in chunks)
    text = b"".join(chunks)
    assert b"h\\u00e9llo" in text or "héllo".encode() in text
    assert text.endswith(b"data: [DONE]\n\n")


def test_silent_answers_nothing_until_stopped(server: ReplayServer) -> None:
    server.add([Entry(silent=True)])
    sock = raw_post(server, STREAM)
    try:
        server.wait_recorded(lambda got: len(got) == 1)
        sock.settimeout(0.05)
        with pytest.raises(TimeoutError):
            sock.recv(1)  # nothing at all, not even a status line
        sock.settimeout(30)
        server.stop()
        assert read_all(sock) == b""
    finally:
        sock.close()


def test_for_model_routes_and_headers_are_sent(server: ReplayServer) -> None:
    server.add(
        [
            Entry(reply="for b", chunk=10, for_model="b"),
            Entry(reply="for a", chunk=10, for_model="a", headers={"x-fault": "yes"}),
        ]
    )
    with raw_post(server, {**STREAM, "model": "a"}) as sock:
        got = read_all(sock)
    assert b"x-fault: yes\r\n" in got and b'"content":"for a"' in got
    assert b'"content":"echo: hello there"' not in got
    with raw_post(server, {**STREAM, "model": "c"}) as sock:
        got = read_all(sock)  # no entry for c: the fallback (echo)
    assert b'"model":"c"' in got and b"for " not in got
    with raw_post(server, {**STREAM, "model": "b"}) as sock:
        assert b'"content":"for b"' in read_until(sock, b"[DONE]")
    assert [r.model for r in server.recorded] == ["a", "c", "b"]
