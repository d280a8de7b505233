"""Our codec against a third-party one: py9p, i.e. plan9port's C convS2M/convM2S.

For every message kind, generated messages must encode to the very bytes plan9port
produces, and each side must decode the other's frames to the same fields.
"""

from __future__ import annotations

from typing import Any

import py9p
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ninep import codec as c
from tests.ninep.strategies import ALL_TYPES, PROPERTY, messages_of, stats


def pqid(q: c.Qid) -> Any:
    return py9p.Qid(type=q.type, vers=q.version, path=q.path)


def pdir(s: c.Stat) -> Any:
    return py9p.Dir(
        type=s.type,
        dev=s.dev,
        qid=pqid(s.qid),
        mode=s.mode,
        atime=s.atime,
        mtime=s.mtime,
        length=s.length,
        name=s.name,
        uid=s.uid,
        gid=s.gid,
        muid=s.muid,
    )


def to_py9p(m: c.Message) -> Any:
    """The same message as a py9p dataclass (field names differ a little)."""
    t = m.tag
    match m:
        case c.Tversion():
            return py9p.Tversion(msize=m.msize, version=m.version, tag=t)
        case c.Rversion():
            return py9p.Rversion(msize=m.msize, version=m.version, tag=t)
        case c.Tauth():
            return py9p.Tauth(afid=m.afid, uname=m.uname, aname=m.aname, tag=t)
        case c.Rauth():
            return py9p.Rauth(aqid=pqid(m.aqid), tag=t)
        case c.Tattach():
            return py9p.Tattach(fid=m.fid, afid=m.afid, uname=m.uname, aname=m.aname, tag=t)
        case c.Rattach():
            return py9p.Rattach(qid=pqid(m.qid), tag=t)
        case c.Rerror():
            return py9p.Rerror(ename=m.ename, tag=t)
        case c.Tflush():
            return py9p.Tflush(oldtag=m.oldtag, tag=t)
        case c.Rflush():
            return py9p.Rflush(tag=t)
        case c.Twalk():
            return py9p.Twalk(fid=m.fid, newfid=m.newfid, wname=m.wnames, tag=t)
        case c.Rwalk():
            return py9p.Rwalk(wqid=tuple(pqid(q) for q in m.qids), tag=t)
        case c.Topen():
            return py9p.Topen(fid=m.fid, mode=m.mode, tag=t)
        case c.Ropen():
            return py9p.Ropen(qid=pqid(m.qid), iounit=m.iounit, tag=t)
        case c.Tcreate():
            return py9p.Tcreate(fid=m.fid, name=m.name, perm=m.perm, mode=m.mode, tag=t)
        case c.Rcreate():
            return py9p.Rcreate(qid=pqid(m.qid), iounit=m.iounit, tag=t)
        case c.Tread():
            return py9p.Tread(fid=m.fid, offset=m.offset, count=m.count, tag=t)
        case c.Rread():
            return py9p.Rread(data=m.data, tag=t)
        case c.Twrite():
            return py9p.Twrite(fid=m.fid, offset=m.offset, data=m.data, tag=t)
        case c.Rwrite():
            return py9p.Rwrite(count=m.count, tag=t)
        case c.Tclunk():
            return py9p.Tclunk(fid=m.fid, tag=t)
        case c.Rclunk():
            return py9p.Rclunk(tag=t)
        case c.Tremove():
            return py9p.Tremove(fid=m.fid, tag=t)
        case c.Rremove():
            return py9p.Rremove(tag=t)
        case c.Tstat():
            return py9p.Tstat(fid=m.fid, tag=t)
        case c.Rstat():
            return py9p.Rstat(stat=pdir(m.stat), tag=t)
        case c.Twstat():
            return py9p.Twstat(fid=m.fid, stat=pdir(m.stat), tag=t)
        case c.Rwstat():
            return py9p.Rwstat(tag=t)
    raise AssertionError(type(m))  # pragma: no cover


@pytest.mark.parametrize("cls", ALL_TYPES, ids=lambda t: t.__name__)
@PROPERTY
@given(data=st.data())
def test_same_bytes_as_plan9port(cls: type[c.Message], data: st.DataObject) -> None:
    msg = data.draw(messages_of(cls, py9p_safe=True))
    ours = c.encode(msg)
    theirs = py9p.encode_message(to_py9p(msg))
    assert ours == theirs
    assert py9p.decode_message(ours) == to_py9p(msg)
    assert c.decode(theirs) == msg


@PROPERTY
@given(stats(py9p_safe=True))
def test_stat_same_bytes_as_plan9port(s: c.Stat) -> None:
    ours = c.encode_stat(s)
    assert ours == py9p.encode_dir(pdir(s))
    assert py9p.decode_dir(ours) == pdir(s)
    assert c.decode_stats(py9p.encode_dir(pdir(s))) == [s]


def test_plan9port_rejects_what_we_reject() -> None:
    """Spot checks that the strictness is shared, not an invention of ours."""
    frame = c.encode(c.Rread(1, b"abc"))
    for bad in (frame[:-1], frame + b"x"):
        with pytest.raises(c.ProtocolError):
            c.decode(bad)
        with pytest.raises(py9p.CodecError):
            py9p.decode_message(bad)
