"""Hypothesis strategies for every 9P2000 message, shared by the codec and interop tests.

``messages_of(cls, py9p_safe=True)`` stays inside what py9p (plan9port's codec behind a
ctypes binding) accepts: offsets and lengths are signed 64-bit there, u64 on the wire.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from ninep import codec as c

# Other suites run in parallel on the same machine: a slow example is load, not a bug.
PROPERTY = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Fuzzers of a live server: a moderate number of examples in CI (a few seconds), and
# ``OLLIE_FUZZ_EXAMPLES=20000`` for a long run by hand. The count is read when the suite
# is collected, so it is one setting for every fuzzer that uses FUZZ.
FUZZ_EXAMPLES = int(os.environ.get("OLLIE_FUZZ_EXAMPLES", "200"))
FUZZ = settings(
    PROPERTY,
    max_examples=FUZZ_EXAMPLES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 0xFFFFFFFFFFFFFFFF)
i64 = st.integers(0, 0x7FFFFFFFFFFFFFFF)
# 9P strings: UTF-8 without NUL (intro(5)); codec="utf-8" leaves out lone surrogates.
text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=24)
data = st.binary(max_size=300)
qids = st.builds(c.Qid, u8, u32, u64)


def stats(py9p_safe: bool = False) -> st.SearchStrategy[c.Stat]:
    return st.builds(
        c.Stat,
        type=u16,
        dev=u32,
        qid=qids,
        mode=u32,
        atime=u32,
        mtime=u32,
        length=i64 if py9p_safe else u64,
        name=text,
        uid=text,
        gid=text,
        muid=text,
    )


def _strategies(py9p_safe: bool) -> dict[type[c.Message], st.SearchStrategy[c.Message]]:
    off = i64 if py9p_safe else u64
    stat = stats(py9p_safe)
    names = st.lists(text, max_size=c.MAXWELEM).map(tuple)
    qlist = st.lists(qids, max_size=c.MAXWELEM).map(tuple)
    return {
        c.Tversion: st.builds(c.Tversion, u16, u32, text),
        c.Rversion: st.builds(c.Rversion, u16, u32, text),
        c.Tauth: st.builds(c.Tauth, u16, u32, text, text),
        c.Rauth: st.builds(c.Rauth, u16, qids),
        c.Tattach: st.builds(c.Tattach, u16, u32, u32, text, text),
        c.Rattach: st.builds(c.Rattach, u16, qids),
        c.Rerror: st.builds(c.Rerror, u16, text),
        c.Tflush: st.builds(c.Tflush, u16, u16),
        c.Rflush: st.builds(c.Rflush, u16),
        c.Twalk: st.builds(c.Twalk, u16, u32, u32, names),
        c.Rwalk: st.builds(c.Rwalk, u16, qlist),
        c.Topen: st.builds(c.Topen, u16, u32, u8),
        c.Ropen: st.builds(c.Ropen, u16, qids, u32),
        c.Tcreate: st.builds(c.Tcreate, u16, u32, text, u32, u8),
        c.Rcreate: st.builds(c.Rcreate, u16, qids, u32),
        c.Tread: st.builds(c.Tread, u16, u32, off, u32),
        c.Rread: st.builds(c.Rread, u16, data),
        c.Twrite: st.builds(c.Twrite, u16, u32, off, data),
        c.Rwrite: st.builds(c.Rwrite, u16, u32),
        c.Tclunk: st.builds(c.Tclunk, u16, u32),
        c.Rclunk: st.builds(c.Rclunk, u16),
        c.Tremove: st.builds(c.Tremove, u16, u32),
        c.Rremove: st.builds(c.Rremove, u16),
        c.Tstat: st.builds(c.Tstat, u16, u32),
        c.Rstat: st.builds(c.Rstat, u16, stat),
        c.Twstat: st.builds(c.Twstat, u16, u32, stat),
        c.Rwstat: st.builds(c.Rwstat, u16),
    }


_FULL = _strategies(False)
_SAFE = _strategies(True)
ALL_TYPES: list[type[c.Message]] = list(_FULL)


def messages_of(cls: type[c.Message], py9p_safe: bool = False) -> st.SearchStrategy[c.Message]:
    return (_SAFE if py9p_safe else _FULL)[cls]


messages: st.SearchStrategy[c.Message] = st.one_of(*_FULL.values())
