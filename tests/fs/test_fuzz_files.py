"""Fuzz every writable file of the tree (issue 11 item 9).

Hypothesis drives open/write/pwrite/ftruncate/close sequences, with random bytes, UTF-8
cut between writes, O_APPEND and O_TRUNC, huge writes and concurrent writers, at every
file ollie(5) marks writable: s/new, a session's ctl, cfg, prompt, fifo.in, plan and
peer/NAME, a/NAME.json, sk/NAME.md and the files of m/, tmp/ and t/ (and, to be sure
they stay read-only, every other file of the tree). After every call it checks what the
manual promises:

* a refused call fails with an errno ollie(5) lists for that file, its reason is in the
  right ``err`` (the session's, or the root one), a session's chat gained only ``error:``
  lines, and everything else a client can observe (state, cfg, plan, prompt.prev, tools,
  s/idx, the folders on disk) is as it was;
* an accepted call did what the manual says (a prompt's text is the session's
  prompt.prev, a plan or a file on disk holds exactly the bytes written, a cfg reads
  back with the values written, a profile or skill is either what was written or, when
  refused, what it was before);
* the daemon is alive, holds no more descriptors than before the test (the handles of a
  refused write are released too), and its log has no undeclared WARNING or worse
  (checked when the module's mount stops).

One mount for the module, so the examples are cheap (a few ms each). The number of
examples per target is ``OLLIE_FUZZ_EXAMPLES`` (default 20, about 40 s for the module on
a quiet 2-core machine); ``OLLIE_FUZZ_EXAMPLES=2000 pytest tests/fs/test_fuzz_files.py
--hypothesis-show-statistics`` is the long run by hand.

``test_every_writable_file_is_fuzzed`` walks the tree and reads the manual's THE WHOLE
TREE: a writable file that no fuzzer here covers fails it, so a new writable file cannot
be added without its fuzzer.
"""

from __future__ import annotations

import codecs
import errno
import hashlib
import itertools
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from olliefs.agent.chat import visible
from olliefs.replay import ReplayServer
from olliefs.testing import HAVE_FUSE, Daemon, deadline, expect_log, logs_checked

EXAMPLES = int(os.environ.get("OLLIE_FUZZ_EXAMPLES", "20"))
FUZZ = settings(
    deadline=None,
    max_examples=EXAMPLES,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
    derandomize=False,
)
# A "huge" write: several MiB in one write(2) (the kernel splits it into FUSE requests
# of max_write bytes; the daemon must treat them as one request or refuse them all).
HUGE = 2 << 20
MAN = Path(__file__).resolve().parents[2] / "man" / "ollie.5"

# The errnos ollie(5) lists for each writable file (ERRORS and the file's entry).
ERRNOS: dict[str, set[int]] = {
    "s/new": {errno.EINVAL, errno.EEXIST, errno.EFBIG},
    "s/ID/ctl": {errno.EINVAL, errno.EBUSY, errno.EEXIST, errno.EFBIG},
    "s/ID/cfg": {errno.EINVAL, errno.EBUSY, errno.EFBIG},
    "s/ID/prompt": {errno.EINVAL, errno.EFBIG},
    "s/ID/fifo.in": {errno.EINVAL, errno.EFBIG},
    "s/ID/peer/NAME": {errno.EINVAL, errno.ENOENT, errno.EFBIG},
    "s/ID/plan": {errno.EINVAL, errno.EFBIG},
    "a/NAME.json": {errno.EINVAL, errno.EFBIG},
    "sk/NAME.md": {errno.EINVAL, errno.EFBIG},
    "m/NAME": {errno.EFBIG, errno.ENOSPC},
    "tmp/PATH": {errno.EFBIG, errno.ENOSPC},
    "t/TOOL": {errno.EFBIG, errno.ENOSPC},
    "mcp/NAME.json": {errno.EFBIG, errno.ENOSPC},
    "complete": {errno.EINVAL, errno.EBUSY, errno.EFBIG},
}
# What a read of complete may fail with (its entry in ollie(5)).
COMPLETE_READ = {errno.EINVAL, errno.EFBIG, errno.ETIMEDOUT, errno.EREMOTEIO}


# ---- the module's mount --------------------------------------------------------------


@dataclass
class Fuzzed:
    """The daemon and the sessions the fuzzers write to."""

    d: Daemon
    sid: str  # the session most fuzzers write to
    peer: str  # a session of its family (the target of peer/NAME)
    baseline_fds: int
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        assert self.d.proc is not None
        return self.d.proc.pid

    def fds(self) -> int:
        """Descriptors held, but the backing files of logs: a log makes its file when it
        first outgrows its window (``GrowingLog``), and keeps it while it lives."""
        logs = str(self.d.home / "state" / "logs") + "/"
        return sum(not t.startswith(logs) for t in self.fd_targets())

    def fd_targets(self) -> list[str]:
        out = []
        for fd in os.listdir(f"/proc/{self.pid}/fd"):
            try:
                out.append(os.readlink(f"/proc/{self.pid}/fd/{fd}"))
            except OSError:
                pass
        return sorted(out)

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1
        event(what)

    def alive(self) -> None:
        assert self.d.proc is not None and self.d.proc.poll() is None, "the daemon died"
        assert self.d.serving(), "the mount stopped answering"

    def settle(self) -> None:
        """Every session idle (a turn a prompt started is over), the daemon alive."""
        self.alive()
        for sid in (self.sid, self.peer):
            self.d.wait_idle(sid)


@pytest.fixture(scope="module")
def fz(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    if not HAVE_FUSE:
        pytest.skip(reason="needs /dev/fuse (this test mounts a real FUSE filesystem)")
    base = tmp_path_factory.mktemp("fuzz")
    # The replay server echoes every prompt at once, so the turns prompts start end fast.
    with logs_checked(), ReplayServer() as replay, Daemon(base, replay, {}).running() as d:
        # Tool scripts of drawn bytes, which toolsrv leaves out of its catalogue (as many
        # times as it happens to rescan while one is there).
        expect_log(r"toolsrv\.registry: tool \S*/tools/fz\w* left out: ", count=range(10**6))
        sid = d.new(name="fz")
        peer = d.new(name="fz__kid")
        d.prompt(sid, "warm up")  # the backend's connection pool exists from now on
        d.wait_idle(sid)
        d.prompt(peer, "warm up")
        d.wait_idle(peer)
        # What opens a connection for good (the model list, toolsrv's), opened once
        # before the count of descriptors is taken.
        d.write(f"s/{sid}/ctl", "models\ntool_load file_read")
        rd(d, f"s/{sid}/models")
        d.write(f"s/{sid}/ctl", "tool_unload file_read")
        rd(d, "t/idx")
        d.wait_idle(sid)
        f = Fuzzed(d, sid, peer, 0)
        f.baseline_fds = f.fds()
        print("\nbaseline descriptors:", f.fd_targets())
        yield f
        f.settle()
        print("\nfuzz counts:", sorted(f.counts.items()))


@pytest.fixture
def fresh(fz: Fuzzed) -> Iterator[Fuzzed]:
    """Each test: everything idle before; after, alive and no descriptor kept."""
    fz.settle()
    yield fz
    fz.settle()
    # release(2) reaches the daemon after close(2) returned: wait for the count to come
    # back rather than read it at once.
    try:
        fz.d.wait_for(lambda: fz.fds() <= fz.baseline_fds, timeout=20)
    except AssertionError:
        raise AssertionError(f"descriptors kept: {fz.fd_targets()}") from None


# ---- what a client can observe -------------------------------------------------------


def rd(d: Daemon, rel: str) -> str:
    """A file's text as its bytes say (no newline translation: a plan may hold \\r)."""
    with deadline(20):
        return d.p(rel).read_bytes().decode()


def _digest(path: Path) -> str:
    try:
        return hashlib.sha1(path.read_bytes()).hexdigest()[:12]
    except IsADirectoryError:
        return "dir"


def folder_view(d: Daemon, rel: str) -> dict[str, str]:
    """A folder of the tree, name -> content digest (recursive for tmp/)."""
    out: dict[str, str] = {}
    root = d.p(rel)
    for dirpath, dirs, files in os.walk(root):
        for name in files + dirs:
            p = Path(dirpath) / name
            if name == "idx":
                continue  # generated from the rest
            out[str(p.relative_to(root))] = _digest(p)
    return out


def tree_view(d: Daemon) -> dict[str, object]:
    return {
        "s/idx": rd(d, "s/idx"),
        **{f"{k}/": folder_view(d, k) for k in ("a", "m", "sk", "t", "tmp")},
    }


def session_view(d: Daemon, sid: str) -> dict[str, str]:
    files = ("state", "cfg", "plan", "prompt.prev", "tools", "err", "chat")
    return {f: rd(d, f"s/{sid}/{f}") for f in files}


def assert_refused_in_session(
    d: Daemon, sid: str, before: dict[str, str], what: str, err: int, allowed: set[int]
) -> None:
    """A refused write: a listed errno, its reason in err and in chat, nothing else."""
    assert err in allowed, f"{what}: errno {errno.errorcode.get(err, err)} is not listed"
    after = session_view(d, sid)
    reason = after["err"].rstrip("\n")
    assert reason, f"{what}: refused with no reason in err"
    assert after["chat"].startswith(before["chat"]), f"{what}: chat was rewritten"
    added = after["chat"][len(before["chat"]) :]
    shown = visible(reason)  # chat shows control characters, err has them as they are
    assert f"error: {shown}" in added, f"{what}: the reason is not in chat: {added!r}"
    # Only error: lines were added (a reason may hold a newline the writer sent).
    assert added.startswith("error: "), f"{what}: chat gained more than error: {added!r}"
    for k in ("state", "cfg", "plan", "prompt.prev", "tools"):
        assert after[k] == before[k], f"{what}: {k} changed though the write was refused"


def assert_refused_at_root(
    d: Daemon, before: dict[str, object], what: str, err: int, allowed: set[int]
) -> None:
    assert err in allowed, f"{what}: errno {errno.errorcode.get(err, err)} is not listed"
    assert rd(d, "err").strip(), f"{what}: refused with no reason in the root err"
    assert tree_view(d) == before, f"{what}: the tree changed though the write was refused"


# ---- strategies ----------------------------------------------------------------------

text = st.text(max_size=120)
nonascii = st.text(st.characters(min_codepoint=0x80, max_codepoint=0x10FFFF, codec="utf-8"))


@st.composite
def split_utf8(draw: st.DrawFn) -> list[bytes]:
    """UTF-8 text cut into pieces at any byte, inside characters too."""
    data = draw(st.text(max_size=40).map(str.encode) | nonascii.map(str.encode))
    cuts = sorted(draw(st.sets(st.integers(0, len(data)), max_size=4)))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


chunk = st.one_of(
    st.binary(max_size=200),
    text.map(str.encode),
    nonascii.map(str.encode),
    st.sampled_from([b"", b"\n", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", b"\xff", b"\x00"]),
)

# (op, payload, offset): write, pwrite at an offset, ftruncate, write one huge buffer.
op = st.one_of(
    st.tuples(st.just("write"), chunk, st.just(0)),
    st.tuples(st.just("pwrite"), chunk, st.integers(0, 3000)),
    st.tuples(st.just("ftruncate"), st.just(b""), st.integers(0, 300)),
    split_utf8().map(lambda parts: ("writes", b"\0".join(parts), len(parts))),
)
OPENS = {
    "w": os.O_WRONLY,
    "w+trunc": os.O_WRONLY | os.O_TRUNC,
    "w+append": os.O_WRONLY | os.O_APPEND,
    "rw": os.O_RDWR,
    "rw+trunc": os.O_RDWR | os.O_TRUNC,
    "rw+append": os.O_RDWR | os.O_APPEND,
    "w+append+trunc": os.O_WRONLY | os.O_APPEND | os.O_TRUNC,
}
opens = st.sampled_from(sorted(OPENS))


def pieces(o: tuple[str, bytes, int]) -> list[tuple[str, bytes, int]]:
    """A "writes" op stands for several write(2) calls (its pieces were joined by NUL)."""
    kind, data, n = o
    if kind != "writes":
        return [o]
    return [("write", p, 0) for p in data.split(b"\0", n - 1)] if n else []


def call(fd: int, kind: str, data: bytes, off: int) -> int:
    """One system call; 0 or the errno it failed with."""
    try:
        if kind == "write":
            os.write(fd, data)
        elif kind == "pwrite":
            os.pwrite(fd, data, off)
        elif kind == "ftruncate":
            os.ftruncate(fd, off)
        else:
            raise AssertionError(kind)
    except OSError as e:
        return e.errno or -1
    return 0


def close(fd: int) -> int:
    try:
        os.close(fd)
    except OSError as e:
        return e.errno or -1
    return 0


def opened(d: Daemon, rel: str, flags: int) -> int:
    with deadline(20):
        return os.open(d.p(rel), flags)


# ---- control files: one request per write(2) -----------------------------------------

CTL_SAFE = ["stop", "maxsteps", "tool_load", "tool_unload", "queue", "models", "inject"]
CTL_WORDS = [*CTL_SAFE, "clear", "rewind", "backend", "model", "cwd", "agent", "irw"]
ctl_line = st.one_of(
    st.tuples(st.sampled_from(CTL_WORDS), st.sampled_from(["", " "]), text),
    st.tuples(
        st.sampled_from(CTL_SAFE),
        st.just(" "),
        st.sampled_from(["", "0", "1", "10000", "10001", "-3", "file_read", "nope", "clear"]),
    ),
    # The destructive commands only with arguments that must be refused.
    st.tuples(
        st.sampled_from(["kill", "rn", "fork", "save"]),
        st.just(" "),
        st.sampled_from(["x y", "a/b", "new", "idx", "1 2 3 4", ""]).filter(bool),
    ),
).map(lambda t: f"{t[0]}{t[1]}{t[2]}")
CFG_KEYS = [
    "state",
    "backend",
    "model",
    "agent",
    "cwd",
    "maxTokens",
    "temperature",
    "frequencyPenalty",
    "presencePenalty",
    "thinkingBudget",
]
cfg_value = st.one_of(
    text,
    st.integers(-5, 20_000_000).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(["", "replay", "openai", "nope", "/", "relative", "~", "1e3", "0x10"]),
)
cfg_line = st.tuples(
    st.sampled_from([*CFG_KEYS, "nope", ""]), st.sampled_from(["=", ""]), cfg_value
)


def request(lines: st.SearchStrategy[str]) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.lists(lines, min_size=1, max_size=4).map(lambda ls: "\n".join(ls).encode()),
        chunk,
    )


ctl_request = request(ctl_line)
cfg_request = request(cfg_line.map(lambda t: "".join(t)))
new_request = st.one_of(
    # Mostly valid: a name (valid or not, taken or not) and an existing cwd.
    st.tuples(
        text | st.sampled_from(["fz", "fz__kid", "ok1", "a.b-c", "fz__n", "-x", "x" * 201]),
        st.sampled_from(["", " backend=openai", " model=x", " agent=default", " agent=nope"]),
    ).map(lambda t: f"cwd=/ name={t[0]}{t[1]}".encode()),
    request(
        st.tuples(
            st.sampled_from(["name", "cwd", "backend", "model", "agent", "nope", ""]),
            st.sampled_from(["=", ""]),
            st.one_of(text, st.sampled_from(["/", "/nonexistent", "fz", "new", "a__b__c__d__e"])),
        ).map(lambda t: "".join(t))
    ),
)


def _cfg_values(cfg: str) -> dict[str, str]:
    return dict(line.partition("=")[::2] for line in cfg.splitlines())


def _check_cfg_applied(before: str, after: str, data: bytes) -> None:
    """An accepted cfg write: each key=value line reads back (a number as its value)."""
    want = _cfg_values(before)
    for line in data.decode().splitlines():
        if not line.strip():
            continue
        key, _, value = line.strip().partition("=")
        key, value = key.strip(), value.strip()
        if key == "state" or (not value and key not in ("maxTokens", "temperature")):
            continue
        want[key] = value
    got = _cfg_values(after)
    for key, value in want.items():
        if key in ("state", "cwd", "frequencyPenalty", "presencePenalty", "thinkingBudget"):
            continue
        if key in ("maxTokens", "temperature") and value and got[key]:
            assert float(got[key]) == float(value), f"cfg {key}: {got[key]} for {value}"
        elif key not in ("maxTokens", "temperature"):
            assert got[key] == value, f"cfg {key}: {got[key]!r} for {value!r}"


@FUZZ
@given(reqs=st.lists(st.tuples(ctl_request, st.sampled_from(["write", "pwrite"])), max_size=4))
def test_fuzz_ctl(fresh: Fuzzed, reqs: list[tuple[bytes, str]]) -> None:
    _fuzz_control(fresh, "ctl", reqs)


@FUZZ
@given(reqs=st.lists(st.tuples(cfg_request, st.sampled_from(["write", "pwrite"])), max_size=4))
def test_fuzz_cfg(fresh: Fuzzed, reqs: list[tuple[bytes, str]]) -> None:
    _fuzz_control(fresh, "cfg", reqs)


def _fuzz_control(fz: Fuzzed, name: str, reqs: list[tuple[bytes, str]]) -> None:
    d, sid = fz.d, fz.sid
    what = f"s/ID/{name}"
    fd = opened(d, f"s/{sid}/{name}", os.O_WRONLY | os.O_TRUNC)
    try:
        for data, how in reqs:
            before = session_view(d, sid)
            err = call(fd, how, data, 7)
            if err:
                fz.count(f"{name} refused {errno.errorcode.get(err)}")
                assert_refused_in_session(d, sid, before, f"{what} {data!r}", err, ERRNOS[what])
                continue
            fz.count(f"{name} accepted")
            after = session_view(d, sid)
            assert after["err"] == before["err"], f"{what}: accepted {data!r} set err"
            if name == "cfg":
                _check_cfg_applied(before["cfg"], after["cfg"], data)
                # Written back whole, the cfg read is a no-op (ollie(5)).
                err = call(fd, "write", after["cfg"].encode(), 0)
                assert err == 0, f"cfg written back refused: {err}"
                assert rd(d, f"s/{sid}/cfg") == after["cfg"]
            fz.settle()  # a command may have started something (a queued prompt's turn)
    finally:
        assert close(fd) == 0, "a control file's close never fails"


@FUZZ
@given(data=new_request)
def test_fuzz_s_new(fresh: Fuzzed, data: bytes) -> None:
    d = fresh.d
    before = tree_view(d)
    fd = opened(d, "s/new", os.O_RDWR)
    try:
        err = call(fd, "write", data, 0)
        if err:
            fresh.count(f"s/new refused {errno.errorcode.get(err)}")
            assert_refused_at_root(d, before, f"s/new {data!r}", err, ERRNOS["s/new"])
            assert os.pread(fd, 4096, 0).decode().startswith("name=")  # still the template
            return
        new = os.pread(fd, 4096, 0).decode().strip()
    finally:
        close(fd)
    if not data:  # write(2) of nothing never reaches the daemon
        assert new.startswith("name="), "an empty write created a session"
        return
    fresh.count("s/new accepted")
    assert f"\n{new}\t" in "\n" + rd(d, "s/idx"), f"s/new {data!r}: {new} not in s/idx"
    os.rmdir(d.p(f"s/{new}"))
    assert rd(d, "s/idx") == before["s/idx"]


# ---- prompts: collected per open file, submitted at close ----------------------------


def _prompt_model(ops: list[tuple[str, bytes, int]]) -> tuple[bytearray, list[int]]:
    """What PromptHandle keeps: appends whatever the offset; a write that can never be
    UTF-8 is refused and not kept; ftruncate cuts (never grows)."""
    buf = bytearray()
    want = []
    for kind, data, off in ops:
        if kind == "ftruncate":
            del buf[off:]
            want.append(0)
            continue
        try:
            codecs.getincrementaldecoder("utf-8")().decode(bytes(buf) + data, final=False)
        except UnicodeDecodeError:
            want.append(errno.EINVAL)
            continue
        buf += data
        want.append(0)
    return buf, want


prompt_ops = st.lists(op, max_size=6).map(lambda os_: [p for o in os_ for p in pieces(o)])


@FUZZ
@given(target=st.sampled_from(["prompt", "fifo.in", "peer"]), how=opens, ops=prompt_ops)
def test_fuzz_prompt(
    fresh: Fuzzed, target: str, how: str, ops: list[tuple[str, bytes, int]]
) -> None:
    d, sid = fresh.d, fresh.sid
    rel = f"s/{sid}/peer/{fresh.peer}" if target == "peer" else f"s/{sid}/{target}"
    what = "s/ID/peer/NAME" if target == "peer" else f"s/ID/{target}"
    receiver = fresh.peer if target == "peer" else sid
    buf, want = _prompt_model(ops)
    fd = opened(d, rel, OPENS[how])
    try:
        for (kind, data, off), expect in zip(ops, want, strict=True):
            before = session_view(d, sid)
            err = call(fd, kind, data, off)
            assert err == expect, f"{what} {kind} {data!r}: errno {err}, want {expect}"
            if err:
                fresh.count(f"{target} write refused")
                assert_refused_in_session(d, sid, before, f"{what} {data!r}", err, ERRNOS[what])
            else:
                assert session_view(d, sid) == before, f"{what}: a write changed the session"
        try:
            text = bytes(buf).decode().strip()
        except UnicodeDecodeError:
            text = None
        if text and text[0] in "/!":
            # /cmd and !cmd are commands (fuzzed as ctl, and shell commands run tools):
            # cut them here, which is one more ftruncate to check.
            assert call(fd, "ftruncate", b"", 0) == 0
            buf, text = bytearray(), ""
        before = session_view(d, receiver)
        errd = session_view(d, sid)
    finally:
        err = close(fd)
    if text is None:
        fresh.count(f"{target} refused at close")
        assert_refused_in_session(d, sid, errd, f"{what} at close", err, ERRNOS[what])
        return
    assert err == 0, f"{what}: close failed with {err} for {bytes(buf)!r}"
    if not text:
        fresh.count(f"{target} empty")
        assert session_view(d, receiver) == before
        return
    fresh.count(f"{target} submitted")
    if target == "peer":
        text = f"[from {sid}] {text}"
    assert rd(d, f"s/{receiver}/prompt.prev") == text + "\n"
    assert f"user: {visible(text)}" in rd(d, f"s/{receiver}/chat")
    d.wait_idle(receiver)


# ---- plan: a file on disk, applied whole at close ------------------------------------


def _disk_model(
    initial: bytes, flags: int, ops: list[tuple[str, bytes, int]], fill: bytes = b"\0"
) -> bytearray:
    """What a file on disk holds after these calls on one descriptor (a profile fills
    what a write past the end or an ftruncate adds with spaces, not NUL bytes)."""
    buf = bytearray(b"" if flags & os.O_TRUNC else initial)
    pos = 0
    for kind, data, off in ops:
        if kind == "ftruncate":
            buf = buf[:off] + bytearray(fill * max(0, off - len(buf)))
            continue
        if not data:
            continue  # write(2) of nothing changes nothing, not even the size
        at = len(buf) if flags & os.O_APPEND else (off if kind == "pwrite" else pos)
        if at > len(buf):
            buf += bytearray(fill * (at - len(buf)))
        buf[at : at + len(data)] = data
        if kind == "write":
            pos = at + len(data)
    return buf


file_ops = st.lists(op, max_size=6).map(lambda os_: [p for o in os_ for p in pieces(o)])


@FUZZ
@given(how=opens, ops=file_ops)
def test_fuzz_plan(fresh: Fuzzed, how: str, ops: list[tuple[str, bytes, int]]) -> None:
    d, sid = fresh.d, fresh.sid
    what = "s/ID/plan"
    old = d.p(f"s/{sid}/plan").read_bytes()
    buf = _disk_model(old, OPENS[how], ops)
    fd = opened(d, f"s/{sid}/plan", OPENS[how])
    try:
        for kind, data, off in ops:
            assert call(fd, kind, data, off) == 0, f"{what}: {kind} refused before close"
        before = session_view(d, sid)
        assert before["plan"].encode() == old, "plan changed before close"
    finally:
        err = close(fd)
    try:
        text = bytes(buf).decode()
    except UnicodeDecodeError:
        fresh.count("plan refused")
        assert_refused_in_session(d, sid, before, f"{what} {bytes(buf)!r}", err, ERRNOS[what])
        return
    assert err == 0, f"{what}: close failed with {err}"
    changed = bool(ops) or bool(OPENS[how] & os.O_TRUNC and old)
    fresh.count("plan saved" if changed else "plan untouched")
    assert rd(d, f"s/{sid}/plan") == (text if changed else old.decode())


# ---- complete: a request written in pieces, asked at the first read ------------------

HEADS = [b"", b"\n", b"model=replay\n\n", b"suffix=3\nfile=m.py\nbackend=openai\n\n"]
complete_piece = st.one_of(
    st.sampled_from(
        [b"model=replay\n", b"backend=", b"openai\n", b"file=m.py\n", b"suffix=3\n", b"\n"]
    ),
    st.sampled_from([b"timeout=30\n", b"max_tokens=16\n", b"\n\n", b"x = 1\n", b"\xc3\xa9"]),
    chunk,
)
complete_op = st.one_of(
    st.tuples(st.just("write"), complete_piece, st.just(0)),
    st.tuples(st.just("pwrite"), complete_piece, st.integers(0, 3000)),
    st.tuples(st.just("ftruncate"), st.just(b""), st.integers(0, 300)),
)


@FUZZ
@given(
    how=st.sampled_from(["rw", "rw+trunc", "rw+append"]),
    head=st.sampled_from(HEADS),
    ops=st.lists(complete_op, max_size=8),
)
def test_fuzz_complete(
    fresh: Fuzzed, how: str, head: bytes, ops: list[tuple[str, bytes, int]]
) -> None:
    """Any writes, then a read: a refused write is a listed errno with its reason and
    changes nothing; every accepted byte (each write appends, ftruncate cuts) reaches
    the model exactly, the suffix's bytes last; the answer is what the model said."""
    d = fresh.d
    sent = b""
    asked = len(d.replay.recorded)
    fd = opened(d, "complete", OPENS[how])
    try:
        for kind, data, off in [("write", head, 0), *ops]:
            before = tree_view(d)
            err = call(fd, kind, data, off)
            if err:
                fresh.count(f"complete refused {errno.errorcode.get(err)}")
                assert_refused_at_root(
                    d, before, f"complete {kind} {data!r}", err, ERRNOS["complete"]
                )
            elif kind == "ftruncate":
                sent = sent[:off]
            else:
                sent += data
        try:
            with deadline(60):
                answer = os.read(fd, 1 << 20)
        except OSError as e:
            fresh.count(f"complete read {errno.errorcode.get(e.errno or 0)}")
            assert e.errno in COMPLETE_READ, f"complete read: {e}"
            assert rd(d, "err").startswith("complete: "), "a failed read without its reason"
            return
    finally:
        assert close(fd) == 0
    if not sent:
        assert answer == b"" and len(d.replay.recorded) == asked, "asked with nothing written"
        return
    fresh.count("complete answered")
    [request] = d.replay.recorded[asked:]
    body = sent.split(b"\n\n", 1)[1] if not sent.startswith(b"\n") else sent[1:]
    got = request.body
    assert (got["prompt"] + got.get("suffix", "")).encode() == body, "not the bytes written"
    assert answer == f"echo: {got['prompt']}".encode()


# ---- the folders on disk -------------------------------------------------------------

NAMES = {"m": "m/NAME", "tmp": "tmp/PATH", "t": "t/TOOL", "mcp": "mcp/NAME.json"}


@FUZZ
@given(
    folder=st.sampled_from(sorted(NAMES)),
    name=st.sampled_from(["note", ".note.swp", "x.txt", "sub/deep"]),
    how=opens,
    ops=file_ops,
)
def test_fuzz_disk_file(
    fresh: Fuzzed, folder: str, name: str, how: str, ops: list[tuple[str, bytes, int]]
) -> None:
    d = fresh.d
    if "/" in name and folder != "tmp":
        name = name.replace("/", "_")
    if folder == "t":
        name = "fz" + name.replace(".", "_")  # a user's tool of its own (not a shipped one)
    if "/" in name:
        d.p(f"{folder}/{name}").parent.mkdir(exist_ok=True)
    rel = f"{folder}/{name}"
    old = d.p(rel).read_bytes() if d.p(rel).exists() else b""
    buf = _disk_model(old, OPENS[how], ops)
    fd = opened(d, rel, OPENS[how] | os.O_CREAT)
    try:
        for kind, data, off in ops:
            err = call(fd, kind, data, off)
            assert err == 0, f"{rel}: {kind} at {off} failed with {err}"
    finally:
        assert close(fd) == 0
    fresh.count(f"{folder}/ written")
    assert d.p(rel).read_bytes() == bytes(buf), f"{rel}: not what was written"


@st.composite
def profile_text(draw: st.DrawFn) -> bytes:
    good = b'{"description": "fz", "prompt": "be brief"}'
    return draw(
        st.one_of(
            st.just(good),
            st.binary(max_size=100),
            text.map(str.encode),
            st.sampled_from([good[:n] for n in range(len(good))]),  # incomplete
            st.just(b'{"tools": 3}'),
        )
    )


@st.composite
def skill_text(draw: st.DrawFn) -> bytes:
    good = b"---\nname: fz\ndescription: a fuzzed skill\n---\nbody\n"
    return draw(
        st.one_of(
            st.just(good),
            st.binary(max_size=100),
            text.map(str.encode),
            st.sampled_from([good[:n] for n in range(len(good))]),
            st.just(b"---\nname:\ndescription: x\n---\n"),
        )
    )


@FUZZ
@given(
    kind=st.sampled_from(["a", "sk"]),
    name=st.sampled_from(["fz1", "fz2", "bad name", "x/y", "fz1.txt"]),
    how=opens,
    first=st.one_of(profile_text(), skill_text()),
    ops=file_ops,
)
def test_fuzz_profile_and_skill(
    fresh: Fuzzed, kind: str, name: str, how: str, first: bytes, ops: list[tuple[str, bytes, int]]
) -> None:
    """a/NAME.json and sk/NAME.md: checked as written and at close, all or nothing."""
    d = fresh.d
    what = "a/NAME.json" if kind == "a" else "sk/NAME.md"
    suffix = ".json" if kind == "a" else ".md"
    fname = name if name.endswith(".txt") or "/" in name else name + suffix
    rel = f"{kind}/{fname}"
    path = d.p(rel)
    old = path.read_bytes() if "/" not in fname and path.exists() else None
    before = tree_view(d)
    try:
        with deadline(20):
            fd = os.open(path, OPENS[how] | os.O_CREAT, 0o644)
    except OSError as e:
        fresh.count(f"{kind}/ open refused {errno.errorcode.get(e.errno or 0)}")
        assert " " in name or "/" in name or name.endswith(".txt"), f"{rel}: open {e}"
        allowed = ERRNOS[what] | ({errno.ENOENT} if "/" in name else set())
        assert (e.errno or 0) in allowed
        if e.errno != errno.ENOENT:
            assert_refused_at_root(d, before, rel, e.errno or 0, allowed)
        return
    # A refused write is not kept (the handle goes on with what it had); the close
    # then saves what the accepted calls made, or is refused and leaves the old file.
    accepted: list[tuple[str, bytes, int]] = []
    try:
        for k, data, off in [("write", first, 0), *ops]:
            refused = call(fd, k, data, off)
            if refused:
                fresh.count(f"{kind}/ write refused {errno.errorcode.get(refused)}")
                assert refused in ERRNOS[what], f"{rel}: errno {refused} not listed"
                assert rd(d, "err").strip(), f"{rel}: refused with no reason in err"
            elif data or k == "ftruncate":  # write(2) of nothing never reaches the daemon
                accepted.append((k, data, off))
    finally:
        closed = close(fd)
    now = path.read_bytes() if path.exists() else None
    if closed:
        fresh.count(f"{kind}/ close refused {errno.errorcode.get(closed)}")
        assert closed in ERRNOS[what], f"{rel}: errno {closed} not listed"
        assert rd(d, "err").strip(), f"{rel}: refused with no reason in err"
        assert now == old, f"{rel}: changed though its close was refused: {old!r} -> {now!r}"
        return
    want = bytes(_disk_model(old or b"", OPENS[how], accepted, b" " if kind == "a" else b"\0"))
    if accepted:
        fresh.count(f"{kind}/ saved")
        # Saved: exactly the bytes the accepted calls wrote, as a disk would hold them.
        assert now == want, f"{rel}: saved {now!r}, written {want!r}"
    else:
        # Nothing written: the profile or skill stays as it was (a new one is not made).
        assert now == old, f"{rel}: {old!r} -> {now!r} with no write accepted"


# ---- read-only files stay read-only --------------------------------------------------


def walk(d: Daemon) -> Iterator[tuple[str, os.stat_result]]:
    """Every path of the tree with its lstat (no file is opened: some block)."""
    stack = [""]
    while stack:
        rel = stack.pop()
        for name in sorted(os.listdir(d.p(rel) if rel else d.path)):
            r = f"{rel}/{name}" if rel else name
            st_ = os.lstat(d.p(r))
            yield r, st_
            if os.path.isdir(d.p(r)) and not os.path.islink(d.p(r)):
                stack.append(r)


def kind_of(rel: str, sessions: set[str]) -> str:
    """The manual's name (THE WHOLE TREE) for a path of the tree."""
    parts = rel.split("/")
    if parts[0] == "s" and len(parts) > 1 and parts[1] in sessions:
        parts[1] = "ID"
        if len(parts) > 3 and parts[2] == "peer":
            parts[3] = "NAME"
        if len(parts) > 3 and parts[2] in ("branches", "compactions"):
            return f"s/ID/{parts[2]}/"
        if len(parts) > 3 and parts[2] == "t" and parts[3] != "idx":
            parts[3] = "TOOL"
        return "/".join(parts)
    folder = parts[0]
    if len(parts) == 1:
        return rel
    if parts[-1] == "idx":
        return rel
    if folder == "a":
        return "a/NAME.json"
    if folder == "sk":
        return "sk/NAME.md"
    if folder == "tmp":
        return "tmp/PATH"
    if folder == "t":
        return "t/TOOL"
    if folder == "mcp":
        return "mcp/NAME.json"
    if folder in ("m", "p"):
        return f"{folder}/NAME"
    if folder == "tr":
        return "tr/STAMP-ID.md"
    if folder in ("u", "x"):
        return "u/complete" if rel == "u/complete" else "u/NAME, x/NAME"
    return rel


def man_modes() -> dict[str, str]:
    """THE WHOLE TREE of ollie(5): each entry's name and the modes it lists."""
    lines = MAN.read_text().splitlines()
    start = lines.index(".SH THE WHOLE TREE")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith(".SH "))
    out = {}
    for i in range(start, end):
        if lines[i] != ".TP":
            continue
        m = re.match(r"\.(?:B|I|IB|BI|RB|BR|IR|RI)\s+(.*)", lines[i + 1])
        assert m, f"ollie(5) line {i + 2}: an entry without a name"
        tag = "".join(p.strip('"') for p in re.findall(r'"[^"]*"|\S+', m.group(1)))
        mode = lines[i + 2].replace("\\-", "-")
        out[tag.replace("\\-", "-")] = " ".join(
            re.findall(r"(?:^|(?<=[\s(]))[r-][w-][x-](?=[.\s),]|$)", mode)
        )
    return out


# Which fuzzer covers each writable entry of ollie(5).
FUZZERS: dict[str, str] = {
    "s/new": "test_fuzz_s_new",
    "s/ID/ctl": "test_fuzz_ctl",
    "s/ID/cfg": "test_fuzz_cfg",
    "s/ID/prompt": "test_fuzz_prompt",
    "s/ID/fifo.in": "test_fuzz_prompt",
    "s/ID/peer/NAME": "test_fuzz_prompt",
    "s/ID/plan": "test_fuzz_plan",
    "a/NAME.json": "test_fuzz_profile_and_skill",
    "sk/NAME.md": "test_fuzz_profile_and_skill",
    "m/NAME": "test_fuzz_disk_file",
    "tmp/PATH": "test_fuzz_disk_file",
    "t/TOOL": "test_fuzz_disk_file",
    "mcp/NAME.json": "test_fuzz_disk_file",
    "complete": "test_fuzz_complete",
    # Folders: creating names in them is fuzzed by test_fuzz_create_names.
    **{
        f: "test_fuzz_create_names"
        for f in ("a/", "m/", "mcp/", "s/", "sk/", "t/", "tmp/", "tr/", "s/ID/peer/")
    },
}


def test_every_writable_file_is_fuzzed(fresh: Fuzzed) -> None:
    """Every writable entry of ollie(5), and every writable path of the live tree, has
    a fuzzer here; a new writable file without one fails this test."""
    modes = man_modes()
    writable = {tag for tag, mode in modes.items() if "w" in mode}
    assert writable, "no writable entry found in ollie(5): the parser is broken"
    missing = writable - set(FUZZERS)
    assert not missing, f"writable in ollie(5) but not fuzzed: {sorted(missing)}"
    d = fresh.d
    sessions = {line.split("\t")[0] for line in rd(d, "s/idx").splitlines()}
    seen = set()
    for rel, st_ in walk(d):
        kind = kind_of(rel, sessions) + ("/" if os.path.isdir(d.p(rel)) else "")
        kind = kind.replace("//", "/").replace("tmp/PATH/", "tmp/PATH")
        seen.add(kind)
        if st_.st_mode & 0o222:
            assert kind in FUZZERS, f"{rel} ({kind}) is writable but no fuzzer covers it"
            assert kind in writable, f"{rel} ({kind}) is writable but ollie(5) says not"
    # The live tree has an example of every writable file the fuzzers cover.
    want = {"s/new", "s/ID/ctl", "s/ID/cfg", "s/ID/prompt", "s/ID/fifo.in", "s/ID/plan"}
    assert want | {"s/ID/peer/NAME"} <= seen


@FUZZ
@given(
    folder=st.sampled_from(
        ["a", "m", "mcp", "s", "sk", "t", "tmp", "tr", "p", "u", "x", "peer", ""]
    ),
    name=st.one_of(
        st.text(st.characters(codec="utf-8", exclude_characters="/\x00"), min_size=1, max_size=40),
        st.sampled_from(["idx", "new", ".", "..", "x" * 256, "fz", "fz.json", "fz.md"]),
    ),
    mkdir=st.booleans(),
)
def test_fuzz_create_names(fresh: Fuzzed, folder: str, name: str, mkdir: bool) -> None:
    """Creating any name in any folder: created where the folder is writable, else a
    listed errno and nothing changed."""
    d = fresh.d
    parent = f"s/{fresh.sid}/peer" if folder == "peer" else folder
    rel = f"{parent}/{name}" if parent else name
    before = tree_view(d)
    existed = os.path.lexists(d.p(rel))
    try:
        with deadline(20):
            if mkdir:
                os.mkdir(d.p(rel))
            else:
                os.close(os.open(d.p(rel), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except OSError as e:
        fresh.count(f"create refused {errno.errorcode.get(e.errno or 0)}")
        allowed = {
            errno.EACCES,
            errno.EINVAL,
            errno.EEXIST,
            errno.ENAMETOOLONG,
            errno.EPERM,
            errno.EISDIR,
            errno.ENOENT,
        }
        assert e.errno in allowed, f"create {rel}: {e}"
        assert tree_view(d) == before or existed, f"create {rel}: refused but changed"
        return
    fresh.count(f"created in {folder or '/'}")
    assert folder in ("a", "m", "mcp", "sk", "t", "tmp"), f"created {rel} in a read-only folder"
    if folder == "a" and not mkdir:
        # A profile is made by its first valid close: an empty create makes none.
        assert not os.path.lexists(d.p(rel)) or existed
        return
    assert os.path.lexists(d.p(rel))
    if os.path.isdir(d.p(rel)):
        os.rmdir(d.p(rel))
    else:
        os.unlink(d.p(rel))


def test_read_only_files_refuse_writers(fresh: Fuzzed) -> None:
    """Every file of the live tree that is not writable refuses a writer with EACCES
    (open for writing, O_TRUNC, O_APPEND, truncate) and nothing changes."""
    d = fresh.d
    before = tree_view(d)
    plan = rd(d, f"s/{fresh.sid}/plan")
    tried = 0
    for rel, st_ in walk(d):
        if not os.path.isfile(d.p(rel)) or st_.st_mode & 0o222:
            continue
        tried += 1
        for flags in (os.O_WRONLY, os.O_RDWR | os.O_TRUNC, os.O_WRONLY | os.O_APPEND):
            try:
                with deadline(20):
                    os.close(os.open(d.p(rel), flags))
            except OSError as e:
                assert e.errno == errno.EACCES, f"{rel}: {e}"
            else:
                raise AssertionError(f"{rel} opened for writing")
        try:
            os.truncate(d.p(rel), 0)
        except OSError as e:
            assert e.errno in (errno.EACCES, errno.EPERM), f"truncate {rel}: {e}"
        else:
            raise AssertionError(f"{rel} truncated")
    fresh.counts["read-only files tried"] = tried
    assert tried > 40, "the walk found too few read-only files"
    assert tree_view(d) == before
    assert rd(d, f"s/{fresh.sid}/plan") == plan


# ---- huge and concurrent writes ------------------------------------------------------


def test_huge_writes(fresh: Fuzzed) -> None:
    """Several MiB in one write(2) to each writable file: refused whole (EFBIG for the
    control files, whose limit is one FUSE request) or taken whole."""
    d, sid = fresh.d, fresh.sid
    junk = (b"x" * 1000 + b"\n") * (HUGE // 1001)
    for name, allowed in (("ctl", ERRNOS["s/ID/ctl"]), ("cfg", ERRNOS["s/ID/cfg"])):
        before = session_view(d, sid)
        fd = opened(d, f"s/{sid}/{name}", os.O_WRONLY)
        err = call(fd, "write", junk, 0)
        assert close(fd) == 0
        assert err, f"{name}: {HUGE} bytes of junk accepted"
        assert_refused_in_session(d, sid, before, f"huge {name}", err, allowed)
        assert len(rd(d, f"s/{sid}/err")) < 64 << 10, f"{name}: the reason echoes it all"
    before_tree = tree_view(d)
    fd = opened(d, "s/new", os.O_WRONLY)
    err = call(fd, "write", junk, 0)
    close(fd)
    assert_refused_at_root(d, before_tree, "huge s/new", err, ERRNOS["s/new"])
    assert len(rd(d, "err")) < 64 << 10, "s/new: the reason echoes it all"
    # A plan up to its limit is taken whole, a longer one refused whole; files on disk
    # are taken whole.
    text = junk.decode()
    d.write(f"s/{sid}/plan", text[: 1 << 20])
    assert d.p(f"s/{sid}/plan").stat().st_size == 1 << 20
    with pytest.raises(OSError) as refused:
        d.write(f"s/{sid}/plan", text)
    assert refused.value.errno == errno.EFBIG
    assert d.p(f"s/{sid}/plan").stat().st_size == 1 << 20
    d.write(f"s/{sid}/plan", "")
    for rel in ("m/huge", "tmp/huge"):
        d.p(rel).write_bytes(junk)
        assert d.p(rel).read_bytes() == junk
        d.p(rel).unlink()
    # A profile or skill over 1 MiB is refused and not made.
    for rel in ("a/fzhuge.json", "sk/fzhuge.md"):
        fd = os.open(d.p(rel), os.O_WRONLY | os.O_CREAT, 0o644)
        err = call(fd, "write", b'{"name": "' + junk, 0)
        cerr = close(fd)
        assert (err or cerr) in (errno.EFBIG, errno.EINVAL), f"{rel}: {err} {cerr}"
        assert not d.p(rel).exists()
    # A huge prompt, in a session of its own (its context is then huge), is submitted.
    big = d.new(name="fzhuge")
    d.prompt(big, "h" * (HUGE // 4))  # its turn sends it and echoes it: kept smaller
    assert d.p(f"s/{big}/prompt.prev").stat().st_size == HUGE // 4 + 1
    d.wait_idle(big)
    os.rmdir(d.p(f"s/{big}"))


def test_concurrent_writers(fresh: Fuzzed) -> None:
    """Threads writing the same files at once: each call is answered with a listed
    errno or accepted, nothing hangs, and the daemon stays up."""
    d, sid = fresh.d, fresh.sid
    d.write(f"s/{sid}/plan", "")
    errors: list[str] = []
    n = 4

    def ctl(i: int) -> None:
        for j in range(9):
            fd = os.open(d.p(f"s/{sid}/{'ctl' if j % 2 else 'cfg'}"), os.O_WRONLY)
            err = call(fd, "write", [b"maxsteps 50", b"bogus", b"temperature=0.5"][j % 3], 0)
            os.close(fd)
            if err not in (0, errno.EINVAL, errno.EBUSY):
                errors.append(f"ctl/cfg: {err}")

    def prompt(i: int) -> None:
        for j in range(2):
            fd = os.open(d.p(f"s/{sid}/{'fifo.in' if j % 2 else 'prompt'}"), os.O_WRONLY)
            for piece in ("caf\u00e9 ".encode()[:4], "caf\u00e9 ".encode()[4:], f"{i}".encode()):
                if call(fd, "write", piece, 0):
                    errors.append("prompt piece refused")
            if close(fd):
                errors.append("prompt close failed")

    def disk(i: int) -> None:
        fd = os.open(d.p("tmp/concurrent"), os.O_RDWR | os.O_CREAT, 0o644)
        for j in range(50):
            os.pwrite(fd, bytes([65 + i]) * 100, (j * n + i) * 100)
        os.close(fd)

    def plan(i: int) -> None:
        for _ in range(5):
            fd = os.open(d.p(f"s/{sid}/plan"), os.O_WRONLY | os.O_APPEND)
            os.write(fd, f"- [ ] step {i}\n".encode())
            if close(fd):
                errors.append("plan close failed")

    threads = [
        threading.Thread(target=fn, args=(i,)) for i in range(n) for fn in (ctl, prompt, disk, plan)
    ]
    with deadline(120):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    fresh.settle()
    data = d.p("tmp/concurrent").read_bytes()
    assert len(data) == 50 * n * 100
    for k in range(50 * n):
        assert data[k * 100 : (k + 1) * 100] == bytes([65 + k % n]) * 100
    d.p("tmp/concurrent").unlink()
    plan_text = rd(d, f"s/{sid}/plan")
    # Each writer's close replaces the plan whole: it is some writer's view, never torn.
    assert all(re.fullmatch(r"- \[ \] step \d", line) for line in plan_text.splitlines())
    d.write(f"s/{sid}/plan", "")


# ---- regressions: what the fuzzers found, one test each -------------------------------


def test_non_utf8_control_write_says_why(fresh: Fuzzed) -> None:
    d, sid = fresh.d, fresh.sid
    for name in ("ctl", "cfg"):
        before = session_view(d, sid)
        fd = opened(d, f"s/{sid}/{name}", os.O_WRONLY)
        err = call(fd, "write", b"stop\xff", 0)
        close(fd)
        assert_refused_in_session(d, sid, before, name, err, {errno.EINVAL})
        assert rd(d, f"s/{sid}/err") == f"{name}: not valid UTF-8\n"
    before_tree = tree_view(d)
    fd = opened(d, "s/new", os.O_WRONLY)
    err = call(fd, "write", b"cwd=/\xff", 0)
    close(fd)
    assert_refused_at_root(d, before_tree, "s/new", err, {errno.EINVAL})
    assert rd(d, "err") == "s/new: not valid UTF-8\n"


def test_refused_peer_write_is_the_writers(fresh: Fuzzed) -> None:
    d, sid, peer = fresh.d, fresh.sid, fresh.peer
    theirs = session_view(d, peer)
    before = session_view(d, sid)
    fd = opened(d, f"s/{sid}/peer/{peer}", os.O_WRONLY)
    err = call(fd, "write", b"\xff", 0)
    close(fd)
    assert_refused_in_session(d, sid, before, "peer", err, {errno.EINVAL})
    assert session_view(d, peer) == theirs  # the peer was never reached


def test_plan_truncate_and_append_as_on_a_disk(fresh: Fuzzed) -> None:
    d, sid = fresh.d, fresh.sid
    plan = d.p(f"s/{sid}/plan")
    d.write(f"s/{sid}/plan", "- [ ] one\n")
    os.close(os.open(plan, os.O_WRONLY | os.O_TRUNC))  # : > plan
    assert rd(d, f"s/{sid}/plan") == ""
    fd = os.open(plan, os.O_RDWR)
    os.ftruncate(fd, 3)
    assert close(fd) == 0
    assert rd(d, f"s/{sid}/plan") == "\0\0\0"
    d.write(f"s/{sid}/plan", "ab")
    fd = os.open(plan, os.O_WRONLY | os.O_APPEND)
    os.ftruncate(fd, 0)
    os.write(fd, b"x")
    os.write(fd, b"y")
    assert close(fd) == 0
    assert rd(d, f"s/{sid}/plan") == "xy"
    d.write(f"s/{sid}/plan", "")


def test_a_tool_script_toolsrv_refuses_leaves_t_listable(fresh: Fuzzed) -> None:
    d = fresh.d
    d.p("t/fzjunk").write_bytes(b"\xff not a tool\n")
    try:
        assert "fzjunk" in os.listdir(d.p("t"))  # was EIO (an ExceptionGroup escaped)
        assert "fzjunk\t" not in rd(d, "t/idx")
    finally:
        d.p("t/fzjunk").unlink()


def test_refused_profile_or_skill_create_leaves_no_name(fresh: Fuzzed) -> None:
    d = fresh.d
    for rel, bad, good in (
        ("a/fzre.json", b"[1]", b'{"description": "x"}'),
        ("sk/fzre.md", b"no front matter\n", b"---\nname: n\ndescription: d\n---\n"),
    ):
        fd = os.open(d.p(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        refused = call(fd, "write", bad, 0)
        closed = close(fd)
        assert errno.EINVAL in (refused, closed), f"{rel}: {refused} {closed}"
        assert rd(d, "err").startswith(("a/fzre.json", "sk/")), rd(d, "err")
        assert not d.p(rel).exists(), f"{rel} is shown though it was never made"
        d.p(rel).write_bytes(good)  # writing the name again works at once
        assert d.p(rel).read_bytes() == good
        d.p(rel).unlink()


def test_removed_session_frees_its_log_files(fresh: Fuzzed) -> None:
    d = fresh.d
    sid = d.new(name="fzgone")
    d.prompt(sid, "hello")
    d.wait_idle(sid)
    for name in ("chat", "events", "state", "cfg"):
        d.p(f"s/{sid}/{name}").stat()  # the kernel now holds these nodes
    os.rmdir(d.p(f"s/{sid}"))
    d.wait_for(lambda: not any(sid in t or "(deleted)" in t for t in fresh.fd_targets()))
