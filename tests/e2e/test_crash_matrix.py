"""The crash matrix: SIGKILL the daemon, or its toolsrv, at each point of a turn.

Each daemon point crashes a real daemon at a state the test waits for (never after a
sleep), remounts on the same home and checks what SPEC 3.7 promises of a restart:

- every acknowledged prompt and every completed message is there (the chat and the
  context read before the crash are prefixes of what comes back);
- every journal is readable (whole JSON lines only);
- a turn cut by the crash is marked: the ``:: interrupted by restart`` chat line, which is
  journaled as an ``info`` event followed by the turn's ``end`` record (so the cut turn is
  marked once, and a second restart finds it closed); an open tool call is answered
  ``[tool error] interrupted by restart before the tool ended``; a ``ctl compact`` cut by
  the crash leaves ``:: compaction interrupted by restart; history kept``;
- no toolsrv, keeper or tool process outlives the crashed daemon;
- nothing is left half-written where the tree shows it (``compactions/``, ``branches/``,
  ``tr/``, journals): a file is whole or absent.

The torn journal write is swept in-process at every byte offset of the last record (and
at the first, middle and last byte of every other record); a sample of the offsets is
restored by a real daemon, all at once, as one session per torn copy.
``OLLIE_CRASH_OFFSETS=all`` sweeps every byte offset of the whole journal instead.

The toolsrv points SIGKILL the daemon's toolsrv server (not its keeper) while a call is
before its spawn, running, streaming its output back, and ended but not yet answered;
toolsrv is held at a point with SIGSTOP, which leaves its tools running.

``DAEMON_POINTS`` and ``TOOLSRV_POINTS`` name every point the tests below reach.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from olliefs.replay import Entry
from olliefs.session import persist
from olliefs.testing import deadline, expect_log
from tests.conftest import Daemon, script
from tests.e2e.test_tools import call, calls, expect_toolsrv_killed, reply, toolsrv_pids

DAEMON_POINTS = [
    "mid-stream",
    "mid-tool",
    "mid-compaction",
    "mid-journal-write (the last record torn at every byte offset)",
    "s/new after the write returned",
    "s/new while its journal appears",
    "s/new torn or empty journal",
    "rename (ctl rn) after the write returned",
    "rename (mv) after the write returned",
    "rename (mv) while its record is written",
    "fork after the write returned",
    "fork while its journal appears",
    "rewind after the write returned",
    "rewind while its branch is written",
]
TOOLSRV_POINTS = ["before spawn", "tool running", "output streaming back", "ended, unanswered"]


# ---- checks ------------------------------------------------------------------------------


def strays(d: Daemon) -> list[int]:
    """Live processes of this daemon's tool side: toolsrv and its keeper (their argv
    names the home) and every tool process (its environment names the mount)."""
    home = str(d.home).encode()
    mark = b"OLLIE=" + str(d.path).encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != b"Z" and (any(home in a for a in argv) or mark in env):
            out.append(int(name))
    return out


def tool_procs(d: Daemon) -> list[int]:
    """The tool processes alone (toolsrv and keeper left out)."""
    mark = b"OLLIE=" + str(d.path).encode()
    out = []
    for pid in strays(d):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    out.append(pid)
        except OSError:
            pass
    return out


def crash(d: Daemon) -> None:
    """SIGKILL the daemon; its toolsrv and every tool must go with it."""
    d.crash()
    d.wait_for(lambda: not strays(d))


def journals(d: Daemon) -> dict[str, list[persist.Record]]:
    """Every session journal by uid; each must be whole JSON lines, every one readable."""
    out = {}
    for path in sorted((d.home / "state" / "sessions").glob("*.jsonl")):
        data = path.read_bytes()
        assert not data or data.endswith(b"\n"), f"{path}: torn last line after restart"
        records = persist.read_journal(path)
        assert len(records) == data.count(b"\n"), f"{path}: unreadable records"
        out[path.stem] = records
    return out


def check_whole(d: Daemon) -> None:
    """Journals readable; what compactions/, branches/ and tr/ show is whole."""
    journals(d)
    for rel in ("tr",):
        for name in os.listdir(d.p(rel)):
            assert not name.endswith(".tmp"), name
    for sid in os.listdir(d.p("s")):
        if sid in ("new", "idx"):
            continue
        for n in os.listdir(d.p(f"s/{sid}/compactions")):
            base = f"s/{sid}/compactions/{n}"
            assert sorted(os.listdir(d.p(base))) == ["before.jsonl", "dropped", "summary"]
            assert d.read(f"{base}/summary").endswith("\n")
            for line in d.read(f"{base}/before.jsonl").splitlines():
                json.loads(line)
        for k in os.listdir(d.p(f"s/{sid}/branches")):
            base = f"s/{sid}/branches/{k}"
            assert sorted(os.listdir(d.p(base))) == ["chat", "context"]
            for line in d.read(f"{base}/context").splitlines():
                json.loads(line)


def context(d: Daemon, sid: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in d.read(f"s/{sid}/context").splitlines()]


def restart(d: Daemon) -> None:
    d.start()
    check_whole(d)


def no_lost(d: Daemon, sid: str, chat: str, ctx: list[dict[str, Any]]) -> str:
    """What was acknowledged before the crash (``chat``, ``ctx``) is all still there."""
    after = d.read(f"s/{sid}/chat")
    assert after.startswith(chat), (chat, after)
    assert context(d, sid)[: len(ctx)] == ctx
    return after


def session_id(records: list[persist.Record]) -> str:
    """The session's name after every rename its journal holds."""
    sid = ""
    for r in records:
        if isinstance(r, persist.Create | persist.Rename):
            sid = r.id
    return sid


def cut_once(d: Daemon, sid: str, chat: str) -> None:
    """The cut turn is marked once, in chat and in the journal, and stays closed."""
    assert chat.count(":: interrupted by restart\n") == 1
    (records,) = (r for r in journals(d).values() if session_id(r) == sid)
    starts = {r.seq for r in records if isinstance(r, persist.Start)}
    ends = {r.seq for r in records if isinstance(r, persist.End)}
    assert starts == ends
    marks = [
        i
        for i, r in enumerate(records)
        if isinstance(r, persist.Ev) and r.ev.content == "interrupted by restart"
    ]
    assert len(marks) == 1 and isinstance(records[marks[0] + 1], persist.End)


def journaled(d: Daemon, needle: bytes) -> int:
    """How often ``needle`` is in the journals on disk (written there, a SIGKILL cannot
    lose it; deltas may be journaled one by one or several to a record)."""
    return sum(
        p.read_bytes().count(needle) for p in (d.home / "state" / "sessions").glob("*.jsonl")
    )


@pytest.fixture
def d(daemon_factory: Callable[..., Daemon]) -> Iterator[Daemon]:
    daemon = daemon_factory()
    daemon.start()
    yield daemon


def turn(d: Daemon, sid: str, text: str) -> None:
    d.prompt(sid, text)
    d.wait_idle(sid)


class Background:
    """A write to the mount that blocks (or may block) in another thread; a crash of the
    daemon ends it with an error, which is kept."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.error: BaseException | None = None
        self.result: object = None

        def run() -> None:
            try:
                self.result = fn()
            except BaseException as err:
                self.error = err

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join(20)
        assert not self.thread.is_alive()


def kill_when(d: Daemon, cond: Callable[[], bool], work: Background) -> bool:
    """SIGKILL the daemon the moment ``cond`` holds (a file appeared, a journal grew),
    while ``work`` is under way; returns whether ``work`` had already returned.

    A busy check, not a sleep: the point is to land inside a step that takes
    microseconds; either side of it must be a consistent state after the restart."""
    with deadline(20):
        while not cond() and work.thread.is_alive():
            pass
    done = not work.thread.is_alive()
    crash(d)
    work.join()
    return done


# ---- daemon points -----------------------------------------------------------------------


def test_mid_stream(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory(OLLIE_READ_TIMEOUT="120")  # the held stream is not timed out
    d.start()
    sid = d.new(name="st")
    turn(d, sid, "done before")
    d.replay.add(
        script(json.dumps({"reply": "tick " * 50, "chunk": 5, "hang_after": 4, "hang": True}))
    )
    d.prompt(sid, "long one")
    d.prompt(sid, "queued behind")
    d.wait_chat(sid, "assistant: tick tick tick")
    d.wait_for(lambda: journaled(d, b"tick") >= 3)
    chat, ctx = d.read(f"s/{sid}/chat"), context(d, sid)
    crash(d)
    restart(d)
    d.wait_idle(sid)
    after = no_lost(d, sid, chat.rpartition("assistant:")[0], ctx)
    cut = after.index(":: interrupted by restart\n")
    assert "assistant: tick tick" in after[:cut] and "user: queued behind\n" in after[:cut]
    assert after.endswith("assistant: echo: queued behind\n")
    cut_once(d, sid, after)
    # the cut turn was not re-run; the prompt queued behind it ran once the daemon was back
    assert d.replay.requests[-1]["messages"][-1]["content"] == "queued behind"


def test_mid_tool(d: Daemon) -> None:
    # In the session's tmp dir: the cwd shows a call's files when it ends (checkpoints).
    code = "echo $$ > $OLLIE_TMP/pid; (trap '' TERM; sleep 1000) & echo $! >> $OLLIE_TMP/pid; wait"
    d.replay.add(script(calls(call("execute_code", {"code": code}, "c1"))))
    sid = d.new(name="tl")
    d.write(f"s/{sid}/ctl", "tool_load execute_code\ntool_load reasoning_think")
    d.prompt(sid, "go")
    pids = d.home / "data" / "tmp" / sid / "pid"
    d.wait_for(lambda: pids.exists() and len(pids.read_text().split()) == 2)
    tools = [int(p) for p in pids.read_text().split()]
    chat, ctx = d.read(f"s/{sid}/chat"), context(d, sid)
    crash(d)
    assert not any(os.path.exists(f"/proc/{p}") for p in tools)
    restart(d)
    d.wait_idle(sid)
    after = no_lost(d, sid, chat, ctx)
    assert "[tool error] interrupted by restart before the tool ended\n" in after
    assert after.endswith(":: interrupted by restart\n")
    cut_once(d, sid, after)
    assert context(d, sid)[-1]["role"] == "tool"
    # the next call runs on a new toolsrv
    d.replay.add(script(calls(call("reasoning_think", {"thought": "x"}, "c2")), reply("on")))
    turn(d, sid, "again")
    assert '-> reasoning_think({"thought":"x"})\nok\n' in d.read(f"s/{sid}/chat")
    # A clean stop while a call runs: the call is cancelled without a traceback in the
    # log (checked at teardown), and toolsrv takes its tools with it.
    pids.unlink()
    d.replay.add(script(calls(call("execute_code", {"code": code}, "c3"))))
    d.prompt(sid, "hang")
    d.wait_for(lambda: pids.exists() and len(pids.read_text().split()) == 2)
    d.stop()
    d.wait_for(lambda: not strays(d))


def test_mid_compaction(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory(OLLIE_READ_TIMEOUT="120")  # the held request is not timed out
    d.start()
    sid = d.new(name="cp")
    for i in range(10):
        turn(d, sid, f"step {i}")
    chat, ctx = d.read(f"s/{sid}/chat"), context(d, sid)
    d.replay.add([Entry(hang=True)])
    asked = len(d.replay.requests)
    d.write(f"s/{sid}/ctl", "compact")  # returns at once: the runner compacts
    d.wait_for(lambda: len(d.replay.requests) > asked)
    crash(d)
    restart(d)
    assert d.read(f"s/{sid}/state") == "idle\n"
    after = no_lost(d, sid, chat, ctx)
    assert context(d, sid) == ctx
    assert after.endswith(":: compacting\n:: compaction interrupted by restart; history kept\n")
    assert os.listdir(d.p(f"s/{sid}/compactions")) == []
    # the next compaction is number 1, whole
    answer = {"goal": "count", "state": "four steps", "decisions": [], "next": "stop"}
    d.replay.add([Entry(reply=json.dumps(answer))])
    d.write(f"s/{sid}/ctl", "compact")
    d.wait_idle(sid)
    assert os.listdir(d.p(f"s/{sid}/compactions")) == ["1"]
    check_whole(d)


def test_control_writes_right_after_they_returned(d: Daemon) -> None:
    """s/new, ctl fork, ctl rewind, ctl rn and mv, then SIGKILL: each one is whole."""
    made = d.new(name="made")
    sid = d.new(name="src")
    turn(d, sid, "one")
    ctx1 = context(d, sid)
    turn(d, sid, "two")
    ctx2 = context(d, sid)
    d.write(f"s/{sid}/ctl", "fork kid 2")
    chat = d.read(f"s/{sid}/chat")
    d.write(f"s/{sid}/ctl", "rewind 1")
    d.write(f"s/{sid}/ctl", "rn renamed")
    os.rename(d.p(f"s/{made}"), d.p("s/moved"))
    crash(d)
    restart(d)
    assert sorted(os.listdir(d.p("s"))) == ["idx", "kid", "moved", "new", "renamed"]
    assert "session made created" in d.read("s/moved/chat")
    assert d.read("s/moved/state") == "idle\n"
    assert context(d, "kid") == ctx2[:2]
    assert "forked from src with its first 2 messages" in d.read("s/kid/chat")
    assert context(d, "renamed") == ctx1
    branch = [json.loads(x) for x in d.read("s/renamed/branches/1/context").splitlines()]
    assert branch == ctx2 and d.read("s/renamed/branches/1/chat") == chat
    after = d.read("s/renamed/chat")
    assert after.startswith(chat) and after.endswith("renamed from src to renamed\n")


def test_new_while_its_journal_appears(d: Daemon) -> None:
    sessions = d.home / "state" / "sessions"
    d.new(name="first")
    before = set(os.listdir(sessions))
    work = Background(lambda: d.new(name="racing"))
    returned = kill_when(d, lambda: set(os.listdir(sessions)) != before, work)
    # A journal caught under its dot name (the kill came before its rename) goes.
    expect_log(
        r"registry: \S+\.jsonl\.tmp: session creation cut by a crash; removed", count=range(2)
    )
    restart(d)
    names = set(os.listdir(d.p("s"))) - {"new", "idx"}
    if returned:
        assert "racing" in names
    # whole or absent: never a session without its create line, never a stray journal
    assert names in ({"first"}, {"first", "racing"})
    assert len(journals(d)) == len(names)
    if "racing" in names:
        assert "session racing created" in d.read("s/racing/chat")
    else:
        d.new(name="racing")  # the name is free again


def test_mv_while_its_record_is_written(d: Daemon) -> None:
    sid = d.new(name="here")
    turn(d, sid, "hello")
    chat = d.read(f"s/{sid}/chat")
    (path,) = (d.home / "state" / "sessions").glob("*.jsonl")
    size = path.stat().st_size
    work = Background(lambda: os.rename(d.p("s/here"), d.p("s/there")))
    kill_when(d, lambda: path.stat().st_size != size, work)
    restart(d)
    # the rename record is one write(2): once the journal grew, the rename is whole
    assert not d.p("s/here").exists()
    assert d.read("s/there/chat").startswith(chat)


def test_fork_while_its_journal_appears(d: Daemon) -> None:
    sessions = d.home / "state" / "sessions"
    sid = d.new(name="src")
    turn(d, sid, "one")
    ctx = context(d, sid)
    before = set(os.listdir(sessions))
    work = Background(lambda: d.write(f"s/{sid}/ctl", "fork kid"))
    returned = kill_when(d, lambda: set(os.listdir(sessions)) != before, work)
    # A journal caught under its dot name (the kill came before its rename) goes.
    expect_log(
        r"registry: \S+\.jsonl\.tmp: session creation cut by a crash; removed", count=range(2)
    )
    restart(d)
    names = set(os.listdir(d.p("s"))) - {"new", "idx"}
    assert names in ({"src"}, {"src", "kid"}) and (not returned or "kid" in names)
    if "kid" in names:  # all of it, or no fork at all
        assert context(d, "kid") == ctx and "forked from src" in d.read("s/kid/chat")
    assert len(journals(d)) == len(names)


def test_a_creation_cut_before_its_rename_leaves_no_session(d: Daemon) -> None:
    """A session's journal is written whole under a dot name and renamed: a crash in
    between (a fork copying a history, cut after its create record) leaves that file,
    which a restore removes, and no session with part of its beginning."""
    sessions = d.home / "state" / "sessions"
    sid = d.new(name="src")
    cut = sessions / ".cutuid.jsonl.tmp"
    j = persist.Journal(cut)
    j.append(persist.Create("cutuid", "kid", str(d.work), "openai", "replay", "", 1.0))
    j.close()
    d.crash()
    expect_log(r"registry: \S+/\.cutuid\.jsonl\.tmp: session creation cut by a crash; removed")
    restart(d)
    assert set(os.listdir(d.p("s"))) == {sid, "new", "idx"}
    assert not cut.exists()
    assert all(not n.startswith(".") for n in os.listdir(sessions))


def test_rewind_while_its_branch_is_written(d: Daemon) -> None:
    sid = d.new(name="rw")
    turn(d, sid, "one")
    ctx1 = context(d, sid)
    turn(d, sid, "two")
    ctx2, chat = context(d, sid), d.read(f"s/{sid}/chat")
    branches = d.home / "state" / "branches"
    work = Background(lambda: d.write(f"s/{sid}/ctl", "rewind 1"))
    returned = kill_when(d, lambda: branches.exists() and any(os.listdir(branches)), work)
    ((uid, records),) = journals(d).items()
    rewound = any(isinstance(r, persist.Rewind) for r in records)
    assert rewound or not returned
    # Whichever side of the record the kill landed, make it the worst case a SIGKILL can
    # leave: the branch not renamed into place yet, its temp dir half written.
    shutil.rmtree(branches / uid / "1", ignore_errors=True)
    (branches / uid / ".1.tmp").mkdir(parents=True, exist_ok=True)
    (branches / uid / ".1.tmp" / "context").write_text('{"role": "us')
    if rewound:
        expect_log(r"session\.session: session rw: branches/1 rebuilt from the journal")
    restart(d)  # checks that a branch the tree shows is whole
    assert context(d, sid) == (ctx1 if rewound else ctx2)
    if rewound:  # the record is there: its branch is rebuilt from the journal
        assert os.listdir(d.p(f"s/{sid}/branches")) == ["1"]
        got = [json.loads(x) for x in d.read(f"s/{sid}/branches/1/context").splitlines()]
        assert got == ctx2 and d.read(f"s/{sid}/branches/1/chat") == chat
    else:
        assert os.listdir(d.p(f"s/{sid}/branches")) == []
    # the next rewind writes its branch whole (over the temp dir if it is number 1)
    d.write(f"s/{sid}/ctl", "rewind 1")
    assert context(d, sid) == ([] if rewound else ctx1)
    k = 2 if rewound else 1
    assert sorted(os.listdir(branches / uid)) == [str(i) for i in range(1, k + 1)]
    got = [json.loads(x) for x in d.read(f"s/{sid}/branches/{k}/context").splitlines()]
    assert got == (ctx1 if rewound else ctx2)
    check_whole(d)


# ---- the torn journal write --------------------------------------------------------------


def tear_offsets(data: bytes) -> list[tuple[int, int]]:
    """(offset, whole records before it): the first, middle and last byte of every record
    and every byte of the last one (``OLLIE_CRASH_OFFSETS=all``: every byte of all)."""
    ends = [i + 1 for i, b in enumerate(data) if b == ord("\n")]
    starts = [0, *ends[:-1]]
    every = os.environ.get("OLLIE_CRASH_OFFSETS") == "all"
    out = []
    for k, (a, b) in enumerate(zip(starts, ends, strict=True)):
        offsets: Sequence[int]
        if every or k == len(ends) - 1:
            offsets = range(a, b)
        else:
            offsets = range(a, b) if b - a < 3 else (a, a + 1, (a + b) // 2, b - 1)
        out += [(o, k) for o in sorted(set(offsets))]
    return out


def torn_journal(d: Daemon) -> tuple[Path, bytes]:
    """A real journal: cfg, a tool call, usage, a plain turn; the daemon stopped cleanly."""
    d.replay.add(
        script(
            calls(call("reasoning_think", {"thought": "x"}, "c1")),
            reply("thought"),
            '{"reasoning": "r", "reply": "two", "usage": {"cost": 0.5}}',
        )
    )
    sid = d.new(name="tj")
    d.write(f"s/{sid}/cfg", "temperature=0.25\n")
    d.write(f"s/{sid}/ctl", "tool_load reasoning_think")
    turn(d, sid, "first")
    turn(d, sid, "second")
    d.stop()
    (path,) = (d.home / "state" / "sessions").glob("*.jsonl")
    return path, path.read_bytes()


def test_torn_journal_at_every_offset(d: Daemon, tmp_path: Path) -> None:
    path, data = torn_journal(d)
    records = persist.read_journal(path)
    n = data.count(b"\n")
    assert len(records) == n > 20
    offsets = tear_offsets(data)
    torn = tmp_path / "torn.jsonl"
    for o, k in offsets:
        torn.write_bytes(data[:o])
        cut = 0 if o == 0 or data[o - 1] == ord("\n") else 1  # a warning per tear
        with expect_log(r"torn\.jsonl: torn last record \(\d+ bytes\) cut", count=cut):
            got = persist.restore_journal(torn)  # what a restore reads
        # the torn record is dropped, every one before it is whole
        assert got == records[:k], o
        assert persist.read_journal(torn) == got
        assert torn.read_bytes() == data[: data.rfind(b"\n", 0, o) + 1]
        j = persist.Journal(torn)  # the next append starts on a line of its own
        j.append(persist.End(99))
        j.close()
        assert persist.read_journal(torn) == [*records[:k], persist.End(99)]
    print(f"torn journal: {len(offsets)} offsets over {n} records ({len(data)} bytes)")

    # A real daemon restores a sample: one session per torn copy, beside a copy cut at the
    # record boundary before the tear; both must come back alike.
    kinds = [type(r).__name__ for r in records]
    msg = next(i for i, r in enumerate(records) if isinstance(r, persist.Msg) and r.msg.tool_calls)
    sample = {
        "create": 0,
        "prompt": kinds.index("Prompt"),
        "start": kinds.index("Start"),
        "toolcall": msg,
        "last": n - 1,
    }
    ends = [i + 1 for i, b in enumerate(data) if b == ord("\n")]
    starts = [0, *ends[:-1]]
    create = records[0]
    assert isinstance(create, persist.Create)
    sessions = path.parent
    for name, k in sample.items():
        for variant, cut in (("torn", (starts[k] + ends[k]) // 2), ("tcut", starts[k])):
            if name == "last" and variant == "torn":
                cut = ends[k] - 1  # all of it but its newline
            uid = f"{create.uid}-{name}-{variant}"
            head = msgspec.structs.replace(create, uid=uid, id=f"{name}-{variant}")
            body = data[ends[0] : cut] if k else b""
            first = msgspec.json.encode(head) + b"\n" if k else data[:cut]
            (sessions / f"{uid}.jsonl").write_bytes(first + body)
    # Each torn copy is cut back to its last whole record; a create without one goes.
    expect_log(r"persist: \S+-torn\.jsonl: torn last record \(\d+ bytes\) cut", count=len(sample))
    expect_log(r"registry: \S+-create-t(orn|cut)\.jsonl: create cut by a crash; removed", count=2)
    restart(d)
    for name, k in sample.items():
        if k == 0:  # a create that never completed: no session, and its file is gone
            assert not d.p(f"s/{name}-torn").exists() and not d.p(f"s/{name}-tcut").exists()
            continue
        d.wait_idle(f"{name}-torn")
        d.wait_idle(f"{name}-tcut")
        for f in ("chat", "context", "cfg", "tools", "usage"):
            assert d.read(f"s/{name}-torn/{f}") == d.read(f"s/{name}-tcut/{f}"), (name, f)
    assert "interrupted by restart" in d.read("s/toolcall-torn/chat")
    assert len(journals(d)) == 1 + 2 * (len(sample) - 1)
    d.stop()


def test_torn_create_or_empty_journal(d: Daemon) -> None:
    """s/new killed before its create record was whole: no session, no stray file."""
    sessions = d.home / "state" / "sessions"
    d.stop()
    (sessions / "1-aaaaaa.jsonl").write_bytes(b"")
    (sessions / "2-bbbbbb.jsonl").write_bytes(b'{"type":"create","uid":"2-bbbbbb","id":"ha')
    expect_log(r"persist: \S+/2-bbbbbb\.jsonl: torn last record \(42 bytes\) cut")
    expect_log(r"registry: \S+/1-aaaaaa\.jsonl: create cut by a crash; removed")
    expect_log(r"registry: \S+/2-bbbbbb\.jsonl: create cut by a crash; removed")
    restart(d)
    assert sorted(os.listdir(d.p("s"))) == ["idx", "new"]
    assert list(sessions.iterdir()) == []
    d.new(name="ha")


# ---- toolsrv points ----------------------------------------------------------------------


def proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return "gone"


def wchan(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read()
    except OSError:
        return ""


GATE_TOOL = """#!/usr/bin/env python3
# ollie-tool
# description: crash matrix: writes its pid, waits for the gate fifo, then writes size bytes
# args: {"type": "object", "properties": {"size": {"type": "integer"}}}
import json, os, sys
args = json.loads(sys.stdin.buffer.read() or b"{}")
tmp = os.environ["OLLIE_TMP"]  # (the cwd shows a call's files when it ends)
with open(os.path.join(tmp, "pid"), "w") as f:
    f.write(str(os.getpid()))
with open(os.path.join(tmp, "gate")) as g:
    g.read()
sys.stdout.write("a" * args.get("size", 0) + "end\\n")
"""


def children(pid: int) -> list[str]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += f.read().split()
    return out


@pytest.mark.parametrize("point", TOOLSRV_POINTS)
def test_toolsrv_killed(daemon_factory: Callable[..., Daemon], point: str) -> None:
    d = daemon_factory()
    tools = d.home / "config" / "tools"
    tools.mkdir(parents=True)
    (tools / "crash_gate").write_text(GATE_TOOL)
    (tools / "crash_gate").chmod(0o755)
    d.start()
    size = 1 << 20 if point == "output streaming back" else 0  # more than a pipe holds
    think = calls(call("reasoning_think", {"thought": "x"}, "c2"))
    gated = calls(call("crash_gate", {"size": size}, "c1"))
    # "before spawn": the step's model request is held (until the read timeout) while
    # toolsrv is stopped, so the retried request's call meets a toolsrv that cannot
    # spawn anything; the other points take the call at once.
    held = [json.dumps({"hang": True})] if point == "before spawn" else []
    d.replay.add(script(think, reply("warm"), *held, gated, reply("went on"), think, reply("2")))
    sid = d.new(name="ts")
    d.write(f"s/{sid}/ctl", "tool_load crash_gate\ntool_load reasoning_think")
    d.prompt(sid, "warm")  # toolsrv up, the tools loaded, a proc slot made ahead
    d.wait_idle(sid)
    gate = d.home / "data" / "tmp" / sid / "gate"  # (made by the warm call)
    os.mkfifo(gate)
    (server,) = toolsrv_pids(d)
    expect_toolsrv_killed()
    pidfile = d.home / "data" / "tmp" / sid / "pid"
    asked = len(d.replay.requests)
    d.prompt(sid, "go")
    if point == "before spawn":
        d.wait_for(lambda: len(d.replay.requests) > asked)
        os.kill(server, signal.SIGSTOP)
        d.wait_state(sid, "calling: crash_gate")
        spawned = children(server)  # none: the call is on its way in, nothing spawned
    else:
        d.wait_for(lambda: pidfile.exists() and pidfile.read_text() != "")
        tool = int(pidfile.read_text())
        if point != "tool running":
            os.kill(server, signal.SIGSTOP)
            with deadline(20), open(gate, "w"):
                pass  # EOF at the gate: the tool goes on, toolsrv cannot read what it says
        if point == "output streaming back":
            d.wait_for(lambda: "pipe_write" in wchan(tool))
        elif point == "ended, unanswered":
            d.wait_for(lambda: proc_state(tool) in ("Z", "gone"))
    os.kill(server, signal.SIGKILL)
    d.wait_idle(sid)
    d.wait_for(lambda: not tool_procs(d) and server not in strays(d))
    chat = d.read(f"s/{sid}/chat")
    assert "[tool error] toolsrv died; the call was cut\n" in chat, chat
    assert chat.endswith("assistant: went on\n") and "internal error" not in chat
    if point == "before spawn":
        assert spawned == [] and not pidfile.exists()
    turn(d, sid, "again")
    chat = d.read(f"s/{sid}/chat")
    assert '-> reasoning_think({"thought":"x"})\nok\n' in chat and chat.endswith("assistant: 2\n")
    assert server not in toolsrv_pids(d)
