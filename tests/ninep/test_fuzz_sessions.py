"""Hostile 9P sessions under hypothesis, checked step by step against a model.

test_fuzz throws garbage at the server and checks the end state. This plays whole
hostile sessions, one message (or one pipelined burst) at a time: well-formed requests
on bogus, stale and real fids, walks that stop half way, opens that fail after the file
system gave a handle, blocking reads and storms of Tflush (flushes of flushes, of
unknown tags, of reads sent in the same burst), version resets, and at the end a
reused tag, an R-message, or a random, cut or mangled frame.

A model built only from the replies the server sent says what it must hold for that
connection: which fids exist and are open, which requests are still in flight (only
reads of the blocking file may be), which handles a read still holds after its fid was
clunked, how many attaches are live. After every step the server's own books
(ServerStats, the file system's handle table and attach count, the number of trio tasks
in the process) must agree with the model exactly, so a fid, handle, attach or task kept
after a refused request fails the example at that step. A good client on another
connection to the same server holds an open file throughout and must still work at the
end, both while the hostile connection lingers and after it is gone.

``OLLIE_FUZZ_EXAMPLES`` sets the number of examples (200 by default, a few seconds);
``OLLIE_FUZZ_EXAMPLES=20000 pytest tests/ninep/test_fuzz_sessions.py
--hypothesis-show-statistics`` is the long run by hand, and the statistics show how
deep the sessions went (events: blocked reads, partial walks, handles held by reads).
"""

from __future__ import annotations

import functools
import logging
import socket
from dataclasses import dataclass

import msgspec
import trio
from hypothesis import event, given
from hypothesis import strategies as st

from ninep import Client
from ninep import codec as c
from ninep.codec import NinePError
from ninep.server import MIN_MSIZE, ServerStats, serve_connection
from ninep.transport import Transport
from tests.ninep import strategies as strat
from tests.ninep.conftest import MemFS, MNode, settle
from tests.ninep.strategies import FUZZ
from tests.ninep.test_fuzz import VIOLATIONS

FUZZ_MSIZE = 8192
FUZZ_PENDING = 24  # small, so a storm can hit the in-flight limit (a violation)
FUZZ_FIDS = 12  # small, so "too many fids" is reached
KEEP = "keep-☃"  # the good client's directory: no name the fuzzer uses reaches it
KEEP_TEXT = b"the good client's file\n"
GOOD_FIDS = 2  # the good client's root and its open file
GOOD_HANDLES = 1

_NAMES = st.one_of(
    st.sampled_from(
        [
            "hello",
            "big",
            "rw",
            "block",
            "boom",
            "badclunk",
            "secret",
            "sub",
            "a",
            "many",
            "empty",
            "baddir",
            "..",
            ".",
            "",
            "nope",
            "a/b",
        ]
    ),
    st.text("ab./", max_size=3),
)
_FIDS = st.one_of(st.integers(0, 5), st.just(c.NOFID), strat.u32)
_MODES = st.one_of(
    st.sampled_from(
        [
            c.OREAD,
            c.OWRITE,
            c.ORDWR,
            c.OEXEC,
            c.OREAD | c.OTRUNC,
            c.ORDWR | c.OTRUNC,
            c.OREAD | c.ORCLOSE,
            c.ORDWR | c.ORCLOSE,
        ]
    ),
    strat.u8,
)
_OFFSETS = st.one_of(st.integers(0, 300), strat.u64)
_WSTATS = st.one_of(
    st.just(c.NOCHANGE),
    st.builds(msgspec.structs.replace, st.just(c.NOCHANGE), length=st.integers(0, 5)),
    st.builds(msgspec.structs.replace, st.just(c.NOCHANGE), name=_NAMES),
    strat.stats(),
)
_VERSIONS = st.builds(
    c.Tversion,
    st.sampled_from([c.NOTAG, 0, 5]),
    st.one_of(st.sampled_from([0, 255, 256, 300, FUZZ_MSIZE, 1 << 20]), strat.u32),
    st.one_of(st.sampled_from(["9P2000", "9P2000.L", "9P2000.u", "9P", ""]), strat.text),
)
# Walks that go somewhere, that stop half way (partial: no newfid), and anything at all.
_PATHS = st.one_of(
    st.sampled_from(
        [
            (),
            ("sub", "a"),
            ("sub", "nope"),
            ("sub", "nope"),
            ("sub", "a", "x"),
            ("sub", "a", "x"),
            ("..", "sub", ".."),
            ("hello", "x"),
            ("empty", "..", "block"),
            ("baddir",),
            ("many", "entry-000-"),
        ]
    ),
    st.lists(_NAMES, max_size=c.MAXWELEM).map(tuple),
)
_RANDOM_T = st.one_of(*[strat.messages_of(t) for t in c.T_TYPES if t not in (c.Tversion, c.Tflush)])
_R_MESSAGES = st.one_of(*[strat.messages_of(t) for t in c.R_TYPES])
# (bogus, n): picks among the tags in flight (or fids that exist), or any u16 at all.
# One time in four it is bogus (hypothesis shrinks towards 0: an aimed choice).
_TAG_CHOICE = st.tuples(st.integers(0, 3).map(lambda n: n == 3), strat.u16)


def _pick(choice: tuple[bool, int], tags: list[int]) -> int:
    bogus, n = choice
    return n if bogus or not tags else tags[n % len(tags)]


def _requests_strategy() -> st.SearchStrategy[c.TMessage]:
    """One well-formed request (tag 0: the caller sets it), mostly on fids that may
    exist. Built once: hypothesis validates a strategy when it is first drawn from."""
    t = st.just(0)
    perms = st.one_of(st.sampled_from([0o644, c.DMDIR | 0o755, c.DMAPPEND | 0o600]), strat.u32)
    creates = st.builds(c.Tcreate, t, _FIDS, _NAMES, perms, _MODES)
    return st.one_of(
        st.builds(
            c.Tattach,
            t,
            _FIDS,
            st.sampled_from([c.NOFID, 0]),
            st.just("me"),
            st.sampled_from(["", "bad"]),
        ),
        # Walks, opens and creates weigh more: they make the state the rest works on.
        *[st.builds(c.Twalk, t, _FIDS, _FIDS, _PATHS)] * 4,
        *[st.builds(c.Topen, t, _FIDS, _MODES)] * 2,
        *[creates] * 2,
        st.builds(c.Tread, t, _FIDS, _OFFSETS, st.one_of(st.integers(0, 300), strat.u32)),
        st.builds(c.Twrite, t, _FIDS, _OFFSETS, st.binary(max_size=150)),
        st.builds(c.Tclunk, t, _FIDS),
        st.builds(c.Tremove, t, _FIDS),
        st.builds(c.Tstat, t, _FIDS),
        st.builds(c.Twstat, t, _FIDS, _WSTATS),
        st.builds(c.Tauth, t, _FIDS, strat.text, strat.text),
        _RANDOM_T,
    )


_REQUESTS = _requests_strategy()


def _request(data: st.DataObject, tag: int, fids: dict[int, _MFid]) -> c.TMessage:
    """A request; half of those that take a fid are aimed at one that exists, mostly
    of a kind the request suits (a walk at a directory, a read at an open fid), and a
    walk's newfid is often a free one or the fid itself (a walk in place)."""
    msg = msgspec.structs.replace(data.draw(_REQUESTS), tag=tag)
    aim = data.draw(_TAG_CHOICE, label="aim")
    if _fid_of(msg) is not None and not aim[0] and fids:
        if isinstance(msg, (c.Twalk, c.Tcreate)):
            suited = [n for n, f in fids.items() if f.is_dir and not f.open]
        elif isinstance(msg, c.Topen):
            suited = [n for n, f in fids.items() if not f.open]
        elif isinstance(msg, (c.Tread, c.Twrite)):
            suited = [n for n, f in fids.items() if f.open]
        else:
            suited = []
        choices = sorted(suited if suited and aim[1] % 4 != 3 else fids)
        msg = msgspec.structs.replace(msg, fid=_pick(aim, choices))
    if isinstance(msg, c.Twalk):
        newfid = data.draw(_NEWFIDS, label="newfid")
        if newfid != "drawn":
            free = max(fids, default=0) + 1
            msg = msgspec.structs.replace(msg, newfid=free if newfid == "free" else msg.fid)
    return msg


# Mostly single requests. Deliberate violations end a session, so they are endings.
_KINDS = st.sampled_from(["request"] * 6 + ["reads"] * 2 + ["storm"] * 2 + ["drop", "version"])
_NEWFIDS = st.sampled_from(["free", "free", "same", "drawn"])
# How far a session gets by the book before the fuzzing starts (deep states need fids).
_PRELUDES = st.sampled_from(["files"] * 5 + ["none", "version", "attach"])
_PRELUDE: list[c.TMessage] = [
    c.Tversion(c.NOTAG, FUZZ_MSIZE, c.VERSION),
    c.Tattach(0, 0, c.NOFID, "me", ""),
    c.Twalk(0, 0, 1, ("block",)),
    c.Topen(0, 1, c.OREAD),
    c.Twalk(0, 0, 2, ("rw",)),
    c.Topen(0, 2, c.ORDWR),
    c.Twalk(0, 0, 3, ("sub",)),
    c.Twalk(0, 0, 4, ("baddir",)),  # its open gets a handle, then fails: see _FuzzFS
]
# prelude -> (messages of _PRELUDE sent, fids it leaves)
_PRELUDES_DONE = {"none": (0, 0), "version": (1, 0), "attach": (2, 1), "files": (8, 5)}
_STEPS = st.integers(0, 24)
_READS = st.integers(1, 4)
_COUNTS = st.integers(0, 64)
# Mostly under the in-flight limit; sometimes over it (the server must hang up then).
_FLUSHES = st.one_of(*[st.integers(1, 8)] * 9, st.integers(9, 30))
_ENDINGS = st.sampled_from(["close", "eof", "version", "raw", "dup", "reply"])
_RAW_KINDS = st.sampled_from(["bytes", "cut", "mangled", "violation"])
_RAW_BYTES = st.binary(min_size=1, max_size=200)
_VIOLATIONS = st.sampled_from(list(VIOLATIONS.values()))
_MANGLES = st.integers(1, 4)
_PAYLOADS = st.binary(max_size=300)


def _count_tasks() -> int:
    """Every task of this trio run: a request task the server forgot shows up here."""

    def count(task: trio.lowlevel.Task) -> int:
        return 1 + sum(count(t) for n in task.child_nurseries for t in n.child_tasks)

    root = trio.lowlevel.current_root_task()
    assert root is not None
    return count(root)


def _socketpair() -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return trio.SocketStream(a), trio.SocketStream(b)


def _fid_of(msg: c.TMessage) -> int | None:
    """The fid a request works on (that must exist), if it has one."""
    if isinstance(msg, (c.Tattach, c.Tversion, c.Tauth, c.Tflush)):
        return None
    return msg.fid


@dataclass(eq=False)
class _MFid:
    """What the model knows of one fid: from the qids the server sent for it."""

    qpath: int
    is_dir: bool
    open: bool = False
    mode: int = 0
    gone: bool = False  # clunked or removed (its handle lives on while a read holds it)


class _Hostile:
    """One hostile connection, and the model of what the server holds for it."""

    def __init__(self, stream: trio.SocketStream, block_path: int, inline: bool) -> None:
        self.stream = stream
        self.block_path = block_path
        self.replies: list[c.Message] = []
        self.done = trio.Event()
        self.reader_scope = trio.CancelScope()
        self.closed_by_server = False
        self.msize = 0
        self.fids: dict[int, _MFid] = {}
        self.roots = 0  # attaches not yet ended by a Tversion
        self.pending: dict[int, c.TMessage] = {}  # sent, not answered, not flushed
        self.reads: dict[int, _MFid | None] = {}  # pending Tread tag -> its fid then
        self.aborted: set[int] = set()  # flushed or reset: must never be answered
        self.inline = inline  # the file system answers all but reads of block at once
        # Pending requests the server answers before it reads the next frame: a later
        # Tflush or Tversion cannot abort them, their reply comes first (flush(5)).
        self.immediate: set[int] = set()
        self.version: c.Tversion | None = None
        self.must_close = False  # something was sent that the server must hang up on
        self.next_tag = 0

    def tag(self) -> int:
        self.next_tag += 1
        return self.next_tag

    async def read_replies(self) -> None:
        transport = Transport(self.stream)
        try:
            with self.reader_scope:
                while True:
                    frame = await transport.next_frame(1 << 24)
                    if frame is None:
                        self.closed_by_server = True
                        return
                    self.replies.append(c.decode(frame))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.closed_by_server = True
        finally:
            self.done.set()

    async def send(self, msgs: list[c.TMessage]) -> None:
        """Send ``msgs`` in one write; the model follows the server's frame-time rules
        (a Tflush aborts its target when the Tflush frame is read, not later)."""
        out = []
        flushed_now: set[int] = set()  # aborted targets stay in the server's table until they run
        for m in msgs:
            frame = c.encode(m)
            out.append(frame)
            if len(frame) > (self.msize or FUZZ_MSIZE):
                event("violation: frame over msize")
                self.must_close = True
                break
            if isinstance(m, c.Tversion):
                for tag in [t for t in self.pending if t not in self.immediate]:
                    del self.pending[tag]
                    self.reads.pop(tag, None)
                    self.aborted.add(tag)
                self.version = m
                continue
            now = self._at_once(m, flushed_now)
            waiting = sum(t not in self.immediate for t in self.pending) + len(flushed_now)
            reused = m.tag in self.pending and m.tag not in self.immediate
            if reused or (not now and waiting >= FUZZ_PENDING):
                event("violation: " + ("tag reused" if reused else "too many"))
                self.must_close = True
                break
            if isinstance(m, c.Tflush) and not now and m.oldtag in self.pending:
                del self.pending[m.oldtag]
                self.reads.pop(m.oldtag, None)
                self.aborted.add(m.oldtag)
                flushed_now.add(m.oldtag)
            self.pending[m.tag] = m
            if now:
                self.immediate.add(m.tag)
            if isinstance(m, c.Tread):
                self.reads[m.tag] = self.fids.get(m.fid)
        await self.stream.send_all(b"".join(out))

    def _at_once(self, m: c.TMessage, flushed_now: set[int]) -> bool:
        """Whether the server answers ``m`` in its reader, before the next frame.
        ``flushed_now``: requests aborted in this burst, still in the server's table."""
        if isinstance(m, c.Tflush):  # nothing to wait for: its target is answered
            if m.oldtag in flushed_now:
                return False
            return m.oldtag not in self.pending or m.oldtag in self.immediate
        if not self.inline:
            return False
        f = self.fids.get(m.fid) if isinstance(m, c.Tread) else None
        return not (f is not None and f.open and f.qpath == self.block_path)

    def absorb(self) -> None:
        """Take in the replies that came, checking each against the request it answers."""
        replies, self.replies = self.replies, []
        for r in replies:
            assert isinstance(r, c.R_TYPES), r
            if self.version is not None and r.tag == self.version.tag:
                self._versioned(self.version, r)
                self.version = None
                continue
            assert r.tag not in self.aborted, f"a flushed request was answered: {r}"
            req = self.pending.pop(r.tag)  # KeyError: an answer to nothing we sent
            self.immediate.discard(r.tag)
            self.reads.pop(r.tag, None)
            self._answered(req, r)

    def _versioned(self, req: c.Tversion, r: c.Message) -> None:
        for f in self.fids.values():
            f.gone = True
        self.fids.clear()
        self.roots = 0
        self.msize = 0
        if req.msize < MIN_MSIZE:
            assert r == c.Rerror(req.tag, f"msize {req.msize} is too small (minimum 256)")
        elif req.version == "9P2000" or req.version.startswith("9P2000."):
            assert r == c.Rversion(req.tag, min(req.msize, FUZZ_MSIZE), "9P2000")
            self.msize = r.msize
        else:
            assert r == c.Rversion(req.tag, min(req.msize, FUZZ_MSIZE), "unknown")

    def _answered(self, req: c.TMessage, r: c.Message) -> None:
        event(f"{type(req).__name__} -> {'Rerror' if isinstance(r, c.Rerror) else 'ok'}")
        if isinstance(req, c.Tflush):
            assert r == c.Rflush(req.tag)
            return
        if not self.msize:
            assert r == c.Rerror(req.tag, "Tversion must come first")
            return
        fid = _fid_of(req)
        if fid is not None and fid not in self.fids:
            assert r == c.Rerror(req.tag, c.EUNKNOWNFID), (req, r)
            return
        if r == c.Rerror(req.tag, c.EUNKNOWNFID):
            raise AssertionError(f"the server lost fid {fid}: {req}")
        if isinstance(req, c.Tauth) or (isinstance(req, c.Tattach) and req.afid != c.NOFID):
            assert r == c.Rerror(req.tag, "authentication not required")
        elif isinstance(req, c.Tattach) and isinstance(r, c.Rattach):
            assert req.fid not in self.fids
            self.fids[req.fid] = _MFid(r.qid.path, bool(r.qid.type & c.QTDIR))
            self.roots += 1
        elif isinstance(req, c.Twalk) and isinstance(r, c.Rwalk):
            assert 0 < len(r.qids) <= len(req.wnames) or not req.wnames, (req, r)
            if len(r.qids) < len(req.wnames):
                event("partial walk")
            else:  # a partial walk made no newfid
                src = self.fids[req.fid]
                dst = _MFid(src.qpath, src.is_dir)
                if r.qids:
                    dst = _MFid(r.qids[-1].path, bool(r.qids[-1].type & c.QTDIR))
                if req.newfid == req.fid:
                    src.qpath, src.is_dir = dst.qpath, dst.is_dir
                else:
                    assert req.newfid not in self.fids
                    self.fids[req.newfid] = dst
        elif isinstance(req, (c.Topen, c.Tcreate)) and isinstance(r, (c.Ropen, c.Rcreate)):
            f = self.fids[req.fid]
            assert not f.open
            f.open, f.mode = True, req.mode
            f.qpath, f.is_dir = r.qid.path, bool(r.qid.type & c.QTDIR)
        elif isinstance(req, (c.Tclunk, c.Tremove)):
            # Whatever the answer, the fid is gone (clunk(5), remove(5)).
            self.fids.pop(req.fid).gone = True

    def check(self, stats: ServerStats, fs: MemFS, base_tasks: int) -> None:
        """The server holds exactly what the model says, for this connection and the
        good client's; nothing else is in flight, nothing else is open."""
        for tag, req in self.pending.items():
            f = self.reads.get(tag)
            assert isinstance(req, c.Tread) and f is not None, f"unanswered: {req}"
            assert f.open and f.mode & 3 != c.OWRITE and f.qpath == self.block_path, req
        # A clunked fid's handle lives on while a read that began before still runs.
        lingering = {id(f) for f in self.reads.values() if f is not None and f.gone}
        open_fids = sum(f.open for f in self.fids.values())
        # What the run reached (--hypothesis-show-statistics prints these).
        if self.pending:
            event("reads blocked in flight")
        if lingering:
            event("handle held by a read on a clunked fid")
        if open_fids:
            event("fid open")
        assert stats.in_flight == len(self.pending)
        assert stats.fids == GOOD_FIDS + len(self.fids)
        assert stats.handles == GOOD_HANDLES + open_fids + len(lingering)
        assert len(fs.open_handles) == stats.handles and fs.double_clunks == 0
        assert fs.attaches - fs.detaches == 1 + self.roots
        assert _count_tasks() == base_tasks + len(self.pending)


async def _step(h: _Hostile, data: st.DataObject) -> None:
    """One hostile move: a request, a burst of reads and flushes, or a violation."""
    kind = data.draw(_KINDS, label="kind")
    if kind == "request":
        await h.send([_request(data, h.tag(), h.fids)])
    elif kind == "drop":  # clunk or remove a fid that exists (a read may be using it)
        aim = data.draw(_TAG_CHOICE, label="drop")
        fid = _pick((False, aim[1]), sorted(h.fids)) if h.fids else aim[1]
        await h.send([(c.Tremove if aim[0] else c.Tclunk)(h.tag(), fid)])
    elif kind == "version":
        await h.send([data.draw(_VERSIONS)])
    elif kind in ("reads", "storm"):
        burst: list[c.TMessage] = []
        if kind == "reads" or data.draw(st.booleans(), label="reads first"):
            blocking = [n for n, f in h.fids.items() if f.open and f.qpath == h.block_path]
            aim = data.draw(_TAG_CHOICE, label="read fid")
            fid = _pick(aim, blocking if blocking and aim[1] % 4 != 3 else sorted(h.fids))
            for _ in range(data.draw(_READS, label="reads")):
                burst.append(c.Tread(h.tag(), fid, 0, data.draw(_COUNTS)))
        if kind == "storm":
            for _ in range(data.draw(_FLUSHES, label="flushes")):
                targets = [*h.pending, *(m.tag for m in burst)]
                aim = data.draw(_TAG_CHOICE, label="oldtag")
                oldtag = _pick((aim[0] and aim[1] % 4 == 3, aim[1]), targets)
                burst.append(c.Tflush(h.tag(), oldtag))
        await h.send(burst)


def _raw(data: st.DataObject) -> bytes:
    """A random, cut or mangled frame, or a known protocol violation."""
    kind = data.draw(_RAW_KINDS, label="raw")
    if kind == "bytes":
        return data.draw(_RAW_BYTES)
    if kind == "violation":
        return data.draw(_VIOLATIONS)
    frame = c.encode(_request(data, 1, {}))
    if kind == "cut":
        return frame[: 1 + data.draw(strat.u16, label="cut at") % (len(frame) - 1)]
    mangled = bytearray(frame)
    for _ in range(data.draw(_MANGLES)):
        i = data.draw(strat.u16, label="byte") % len(mangled)
        mangled[i] = data.draw(strat.u8)
    return bytes(mangled)


class _FuzzFS(MemFS):
    """MemFS plus ``baddir``: a directory whose listing fails after ``open`` (or
    ``create``) already gave the server a handle, which must then be clunked."""

    async def readdir(self, node: MNode) -> list[c.Stat]:
        if node.name == "baddir":
            raise NinePError("listing failed")
        return await super().readdir(node)


@dataclass
class _World:
    """The server under test and the good client's session on it."""

    fs: _FuzzFS
    stats: ServerStats
    good: Client
    root: int
    held: int  # the good client's open file, held for the whole session
    base_tasks: int = 0  # tasks while the hostile connection is up and idle

    def check(self, h: _Hostile) -> None:
        h.check(self.stats, self.fs, self.base_tasks)

    async def good_client_works(self, payload: bytes = b"") -> None:
        good = self.good
        assert await good.read(self.held, 0, 100) == KEEP_TEXT
        if payload:
            await good.write_all(self.root, f"{KEEP}/rw", payload)
            assert await good.read_all(self.root, f"{KEEP}/rw") == payload
            assert sorted(s.name for s in await good.listdir(self.root, KEEP)) == ["ro", "rw"]


async def _play(h: _Hostile, w: _World, data: st.DataObject) -> None:
    """The prelude by the book, then hostile steps; after each, the model must hold."""
    n, fids = _PRELUDES_DONE[data.draw(_PRELUDES, label="prelude")]
    for m in _PRELUDE[:n]:
        await h.send([msgspec.structs.replace(m, tag=h.tag())])
        await settle()
        h.absorb()
        w.check(h)
    assert len(h.fids) == fids, "the prelude failed"
    for _ in range(data.draw(_STEPS, label="steps")):
        await _step(h, data)
        await settle()
        h.absorb()
        if h.closed_by_server or h.must_close:
            return
        w.check(h)
        await w.good_client_works()


async def _end(h: _Hostile, w: _World, data: st.DataObject) -> None:
    """End the hostile connection one way or another; it must be gone afterwards."""
    ending = data.draw(_ENDINGS)
    if not h.must_close and not h.closed_by_server and ending in ("dup", "reply"):
        if ending == "reply":  # an R-message from a client
            await h.stream.send_all(c.encode(data.draw(_R_MESSAGES)))
            h.must_close = True
        elif h.pending:  # a tag still in flight, reused
            tag = _pick((False, data.draw(strat.u16, label="tag")), sorted(h.pending))
            await h.send([c.Tstat(tag, 0)])
            assert h.must_close
        await settle()
        h.absorb()
    event("closed for a violation" if h.must_close else f"ending: {ending}")
    if h.must_close:
        assert h.closed_by_server, "a protocol violation did not close the connection"
    elif h.closed_by_server:
        raise AssertionError("the server hung up on well-formed requests")
    elif ending == "version":
        await h.send([c.Tversion(c.NOTAG, FUZZ_MSIZE, c.VERSION)])
        await settle()
        h.absorb()
        w.check(h)
        assert not h.fids and not h.pending
    elif ending == "raw":
        await h.stream.send_all(_raw(data))
        await settle()
        if not h.closed_by_server:  # e.g. a frame cut short: the server waits for it
            assert _count_tasks() == w.base_tasks + w.stats.in_flight
            await w.good_client_works(b"while a frame is pending")
        if data.draw(st.booleans(), label="half-close"):
            await h.stream.send_eof()
    elif ending == "eof":
        await h.stream.send_eof()  # end of stream: the server hangs up
    if not h.closed_by_server and ending != "eof":
        h.reader_scope.cancel()
        await h.stream.aclose()
    with trio.fail_after(10):
        await h.done.wait()
    await settle()


async def _hostile_session(data: st.DataObject) -> None:
    fs = _FuzzFS(inline=data.draw(st.booleans(), label="inline"))
    fs.mkdir(fs.root, "baddir")
    keep = fs.mkdir(fs.root, KEEP)
    fs.file("ro", KEEP_TEXT, parent=keep)
    fs.file("rw", b"", parent=keep, writable=True)
    assert fs.root.children is not None
    block_path = fs.root.children["block"].path
    stats = ServerStats()
    serve = functools.partial(
        serve_connection,
        fs=fs,
        stats=stats,
        max_msize=FUZZ_MSIZE,
        max_fids=FUZZ_FIDS,
        max_pending=FUZZ_PENDING,
    )
    good_end, server_end = _socketpair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve, server_end)
        async with Client.connect(good_end, msize=FUZZ_MSIZE) as good:
            root = await good.attach("me", "")
            held = await good.walk(root, [KEEP, "ro"])
            await good.open(held, c.OREAD)
            await settle()
            tasks_before = _count_tasks()
            w = _World(fs, stats, good, root, held)

            hostile_end, server_end = _socketpair()
            async with hostile_end:  # ours to close, whoever hangs up first
                nursery.start_soon(serve, server_end)
                h = _Hostile(hostile_end, block_path, fs.inline)
                nursery.start_soon(h.read_replies)
                await settle()
                w.base_tasks = _count_tasks()
                await _play(h, w, data)
                await _end(h, w, data)

            # The hostile connection is gone, and with it all it held.
            assert stats.connections == 1
            assert (stats.fids, stats.handles, stats.in_flight) == (GOOD_FIDS, GOOD_HANDLES, 0)
            assert len(fs.open_handles) == GOOD_HANDLES and fs.double_clunks == 0
            assert fs.attaches - fs.detaches == 1
            assert _count_tasks() == tasks_before
            await w.good_client_works(data.draw(_PAYLOADS, label="good payload") or b"x")
            await good.clunk(held)
            await good.clunk(root)
    assert stats.connections == 0 and stats.handles == 0 and stats.fids == 0
    fs.assert_all_clunked()


@FUZZ
@given(data=st.data())
async def test_hostile_sessions_leave_nothing_behind(data: st.DataObject) -> None:
    # Application bugs on purpose (boom, badclunk) are logged with tracebacks: keep
    # thousands of examples from filling the captured log.
    log = logging.getLogger("ninep.server")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        await _hostile_session(data)
    finally:
        log.setLevel(level)
