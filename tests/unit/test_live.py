"""GrowingLog against a byte-exact model: whatever the window, every byte reads back.

The log keeps its newest bytes in memory and moves older ones to its backing file only
when they leave memory; these tests read at every offset with tiny windows, so both
halves and the boundary between them are crossed on every example.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from olliefs.live import GrowingLog


def read_all(log: GrowingLog, off: int, step: int) -> bytes:
    """What a reader looping on read() from ``off`` gets. Every read is whole (``step``
    bytes, fewer only at the end): the kernel takes a short read of a file without
    direct_io as its end."""
    out = bytearray()
    while True:
        data = log.read(off + len(out), step)
        if not data:
            return bytes(out)
        assert len(data) == min(step, len(log) - off - len(out))
        out += data


appends = st.lists(st.binary(min_size=0, max_size=40), max_size=30)


@settings(max_examples=150, deadline=None)
@given(chunks=appends, window=st.integers(1, 32), step=st.integers(1, 50), data=st.data())
def test_every_byte_reads_back(
    tmp_path_factory: pytest.TempPathFactory,
    chunks: list[bytes],
    window: int,
    step: int,
    data: st.DataObject,
) -> None:
    path = tmp_path_factory.mktemp("live") / "log"
    log = GrowingLog(path, window=window)
    try:
        model = b""
        for chunk in chunks:
            log.append(chunk)
            model += chunk
            assert len(log) == len(model)
            off = data.draw(st.integers(0, len(model)))
            assert read_all(log, off, step) == model[off:]
        # Memory holds twice the window and the piece across its start (small appends are
        # merged up to the window's size); the file, made at the first spill, holds
        # exactly what left memory.
        on_disk = path.stat().st_size if path.exists() else 0
        assert path.exists() == (len(model) > 2 * window)
        largest = max(2 * window, *map(len, chunks), 0)
        assert on_disk <= len(model) and len(model) - on_disk <= 2 * window + largest
        assert log.endswith_newline() == model.endswith(b"\n")
    finally:
        log.discard()


def test_a_holder_reads_on_after_discard(tmp_path: Path) -> None:
    log = GrowingLog(tmp_path / "chat", window=8)
    text = b"".join(b"line %d\n" % i for i in range(50))
    for i in range(0, len(text), 7):
        log.append(text[i : i + 7])
    log.hold()  # an open handle
    log.discard()  # the session is killed: the name goes, the bytes stay for the holder
    assert not (tmp_path / "chat").exists()
    assert read_all(log, 0, 64) == text
    log.append(b"more")  # nothing is appended to a discarded log
    assert read_all(log, 0, 4096) == text
    log.let_go()


def test_memory_only_log_keeps_everything() -> None:
    log = GrowingLog(None, window=4)
    for i in range(100):
        log.append(b"%d," % i)
    assert read_all(log, 0, 3) == b"".join(b"%d," % i for i in range(100))
