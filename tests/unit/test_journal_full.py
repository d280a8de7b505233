"""A full disk under the journal, the growing logs and the daemon's log file.

Each test writes on a real tmpfs of its own, filled by a filler file until it refuses
one more byte (``SmallDisk``), so every refusal is the kernel's own ENOSPC, with the
short write it makes first when a record ends past the last free byte. A cut-back that
fails is made real with the append-only attribute (``chattr +a``), under which the
kernel appends but refuses ``ftruncate``.
"""

from __future__ import annotations

import errno
import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from olliefs.cli import LogFile
from olliefs.errors import DiskError
from olliefs.live import GrowingLog
from olliefs.session import persist
from olliefs.session.persist import End, Prompt, Record, Start
from olliefs.testing import SmallDisk, expect_log

BIG = "x" * 10_000  # more than a page: never fits in the slack a full disk leaves


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    why = SmallDisk.unavailable()
    if why is not None:
        pytest.skip(reason=why)
    with SmallDisk(tmp_path / "disk", 256 * 1024) as d:
        yield d


def lines(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), "a torn record is left at the end"
    return data.splitlines()


def test_an_append_the_disk_refuses_is_cut_back(disk: SmallDisk) -> None:
    path = disk.path / "j.jsonl"
    j = persist.Journal(path)
    broken: list[DiskError] = []
    mended: list[bool] = []
    j.on_broken = broken.append
    j.on_mended = lambda: mended.append(True)
    done: list[Record] = [Start(1), Prompt(1, "a", 0.0)]
    for r in done:
        j.append(r, strict=True)
    disk.fill()

    # Strict: refused with the disk's errno; the short write it made is cut back.
    with pytest.raises(DiskError) as err:
        j.append(Prompt(2, BIG, 0.0), strict=True)
    assert err.value.errno == errno.ENOSPC and "No space left on device" in str(err.value)
    assert path.stat().st_size == j.size
    assert persist.read_journal(path) == done and len(lines(path)) == len(done)
    assert not broken and j.error is None  # a refused request owes nothing

    # Not strict: kept in the backlog, in order; a small record that would fit in the
    # slack waits behind it, so the file stays a prefix of the records.
    with expect_log(r"j\.jsonl: journal: No space left on device; records are kept in memory"):
        j.append(Prompt(3, BIG, 0.0))
    j.append(End(3))
    assert j.owed == 2 and len(broken) == 1 and broken[0].errno == errno.ENOSPC
    assert persist.read_journal(path) == done
    with pytest.raises(DiskError):  # a strict one cannot pass the backlog either
        j.append(End(4), strict=True)
    assert persist.read_journal(path) == done and j.owed == 2

    disk.free()
    j.append(End(5))
    assert j.owed == 0 and j.error is None and mended == [True]
    assert persist.read_journal(path) == [*done, Prompt(3, BIG, 0.0), End(3), End(5)]
    j.close()
    assert len(lines(path)) == len(done) + 3


def test_a_cut_that_fails_is_made_before_the_next_append(disk: SmallDisk) -> None:
    path = disk.path / "j.jsonl"
    j = persist.Journal(path)
    j.append(Start(1), strict=True)
    subprocess.run(["chattr", "+a", str(path)], check=True)  # appends pass, cuts fail
    try:
        disk.fill()
        cut = r"journal \(cutting back a partial record\): Operation not permitted; cut before"
        with expect_log(cut), pytest.raises(DiskError):
            j.append(Prompt(1, BIG, 0.0), strict=True)
        assert path.stat().st_size > j.size  # the torn bytes could not be cut
        with pytest.raises(DiskError) as err:  # nor now: refused, nothing glued on
            j.append(End(1), strict=True)
        assert err.value.errno == errno.EPERM
        assert path.stat().st_size > j.size
    finally:
        subprocess.run(["chattr", "-a", str(path)], check=True)
    disk.free()
    j.append(Prompt(2, "after", 0.0), strict=True)  # the cut first, then the record
    j.close()
    assert persist.read_journal(path) == [Start(1), Prompt(2, "after", 0.0)]
    assert len(lines(path)) == 2


def test_retract_takes_records_out_and_keeps_those_after(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    j = persist.Journal(path)
    j.append(Start(1))
    start = j.append_records([Prompt(2, "taken back", 0.0), Start(2)])
    end = j.size
    j.append(End(1))
    j.append(End(2))
    j.retract(start, end)
    assert j.size == path.stat().st_size
    j.append(Start(3))
    j.close()
    assert persist.read_journal(path) == [Start(1), End(1), End(2), Start(3)]


def test_a_record_glued_to_a_torn_one_is_restored(tmp_path: Path) -> None:
    """What older versions left after a full disk: a record torn in the middle of the
    file, the next acknowledged prompt glued to it on the same line, more after."""
    enc = [persist._encoder.encode(r) for r in (Start(1), Prompt(2, "glued", 0.0), End(1))]
    torn = persist._encoder.encode(Prompt(9, 'torn {"type":"x"} here', 0.0))[:-20]
    path = tmp_path / "j.jsonl"
    path.write_bytes(enc[0] + b"\n" + torn + enc[1] + b"\n" + enc[2] + b"\n")
    with expect_log(r"j\.jsonl:2: a torn record \(50 bytes\) dropped"):
        assert persist.restore_journal(path) == [Start(1), Prompt(2, "glued", 0.0), End(1)]
    path.write_bytes(enc[0] + b"\n" + b"garbage\n" + enc[2] + b"\n")
    with expect_log(r"j\.jsonl:2: unreadable journal record ignored from here: JSON is malformed"):
        assert persist.restore_journal(path) == [Start(1)]  # unknown damage: stops there


def test_a_growing_log_stays_in_memory_while_the_disk_is_full(disk: SmallDisk) -> None:
    """A spill the disk refuses keeps the bytes in memory; the next try comes once the
    log has grown by another window, and then moves them all."""
    path = disk.path / "chat"
    log = GrowingLog(path, window=4096)
    data = b""

    def append(n: int) -> None:
        nonlocal data
        for i in range(n):
            chunk = bytes([65 + i % 26]) * 1000
            log.append(chunk)
            data += chunk

    append(20)  # its file is made, and takes the oldest bytes
    assert path.stat().st_size > 0
    disk.fill()
    with expect_log(r"olliefs\.live: log .*/chat stays in memory for now: .*No space left"):
        append(40)
    assert path.stat().st_size < len(data) - 2 * 4096  # at most the slack of its last page
    assert log.read(0, len(data)) == data
    disk.free()
    with expect_log(r"olliefs\.live: log .*/chat written again"):
        append(10)
    assert path.stat().st_size >= len(data) - 2 * 4096  # all but the window, at once
    assert log.read(0, len(data)) == data
    log.discard()


def test_the_log_file_says_how_many_lines_a_full_disk_cost(disk: SmallDisk) -> None:
    path = disk.path / "daemon.log"
    handler = LogFile(path)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("test_journal_full")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        logger.warning("before")
        disk.fill()
        for _ in range(3):
            logger.warning(BIG)  # each refused after a short write, which is cut back
        assert handler.lost == 3
        disk.free()
        logger.warning("after")
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert lines(path) == [
        b"before",
        b"(the 3 log lines before this one were lost: No space left on device)",
        b"after",
    ]
