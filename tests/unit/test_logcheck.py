"""The log rule of the test-suite (olliefs/testing.py, tests/conftest.py): a record at
WARNING or above fails a test unless the test declared it, and a declaration the test does
not meet fails it too; the same for the test process and for a subprocess's log."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from olliefs.testing import LogCheck, check_log_files, checking_logs, expect_log, parse_log

DAEMON_LOG = """\
2026-12-05 00:13:01,123 INFO olliefs.daemon: mounted at /mnt
2026-12-05 00:13:01,124 WARNING olliefs.live: log /x stays in memory: No space left
2026-12-05 00:13:01,125 DEBUG olliefs.fs.fuse: read 3
Traceback (most recent call last):
  File "x.py", line 1, in f
ValueError: boom
2026-12-05 00:13:01,126 ERROR olliefs.fs.fuse: unexpected failure in read
"""

TOOLSRV_LOG = """\
fuse: a line no logger wrote
2026-12-05 00:13:01,123 toolsrv INFO toolsrv.server: listening
2026-12-05 00:13:01,124 toolsrv WARNING toolsrv.exec.cgroup: no memory cgroup for /x: EPERM
"""


def test_parse_log_reads_levels_names_and_continuations() -> None:
    got = [(logging.getLevelName(r.level), r.name, r.text) for r in parse_log(DAEMON_LOG, "d")]
    assert got[:2] == [
        ("INFO", "olliefs.daemon", "mounted at /mnt"),
        ("WARNING", "olliefs.live", "log /x stays in memory: No space left"),
    ]
    # A traceback after a record is part of it, and makes it an ERROR at least.
    assert got[2][:2] == ("ERROR", "olliefs.fs.fuse") and got[2][2].endswith("ValueError: boom")
    assert got[3] == ("ERROR", "olliefs.fs.fuse", "unexpected failure in read")


def test_parse_log_reads_toolsrv_lines_and_output_no_logger_wrote() -> None:
    got = [(logging.getLevelName(r.level), r.name, r.text) for r in parse_log(TOOLSRV_LOG, "t")]
    assert got == [
        ("WARNING", "output", "fuse: a line no logger wrote"),
        ("INFO", "toolsrv.server", "listening"),
        ("WARNING", "toolsrv.exec.cgroup", "no memory cgroup for /x: EPERM"),
    ]


def test_subprocess_logs_fail_on_what_was_not_declared(tmp_path: Path) -> None:
    log = tmp_path / "daemon.stderr"
    log.write_text(DAEMON_LOG)
    with checking_logs() as check:
        with pytest.raises(AssertionError) as err:
            check_log_files(log, tmp_path / "absent.log")
        assert "stays in memory" in str(err.value) and "unexpected failure" in str(err.value)
        assert "mounted at" not in str(err.value)
        check_log_files(log)  # what was checked is not checked again
        with log.open("a") as f:
            f.write(DAEMON_LOG)
        live = expect_log(r"olliefs\.live: log /x stays in memory")
        fuse = expect_log(r"^olliefs\.fs\.fuse: ", level=logging.ERROR, count=2)
        check_log_files(log)
        assert (live.seen, fuse.seen) == (1, 2) and check.unmet() == []


def test_the_test_process_records_go_to_the_innermost_check() -> None:
    with checking_logs() as outer, checking_logs() as inner:
        logging.getLogger("olliefs.x").warning("boom %d", 1)
        logging.getLogger("olliefs.x").info("fine")
    assert inner.unexpected_records() == [
        "unexpected log record: test process: WARNING olliefs.x: boom 1"
    ]
    assert outer.unexpected_records() == []


def test_a_declaration_counts_exactly() -> None:
    check = LogCheck()
    twice = check.expect("boom", count=2)
    some = check.expect("bang", level=logging.ERROR, count=None)
    assert check.unmet() == [
        "expected 2 log record(s) at WARNING matching 'boom', saw 0",
        "expected one or more log record(s) at ERROR matching 'bang', saw 0",
    ]
    (r,) = parse_log("2026-12-05 00:13:01,124 WARNING x: boom\n", "d")
    assert check.claim(r) and check.claim(r) and check.claim(r)
    (e,) = parse_log("2026-12-05 00:13:01,124 ERROR x: bang\n", "d")
    assert check.claim(e)
    assert (twice.seen, some.seen) == (3, 1)
    assert check.unmet() == ["expected 2 log record(s) at WARNING matching 'boom', saw 3"]


CASES = """
import logging
import pytest
from olliefs.testing import expect_log

log = logging.getLogger("olliefs.case")

def test_undeclared():
    log.warning("boom")

def test_declared():
    expect_log("olliefs.case: boom")
    log.warning("boom")

def test_declared_not_seen():
    expect_log("boom")

def test_wrong_level():
    expect_log("boom")
    log.error("boom")

@pytest.mark.expect_log("boom", count=2)
def test_marker():
    log.warning("boom")
    log.warning("boom")

def test_block_ends_before_the_record():
    with expect_log("boom"):
        pass
    log.warning("boom")

def test_block_takes_no_record_after_it():
    with expect_log("boom", count=None):
        log.warning("boom")
    log.warning("boom")

def test_block():
    with expect_log("boom"):
        log.warning("boom")

def test_failed_test_is_not_blamed_for_unmet_declarations():
    expect_log("boom")
    assert False, "the test's own failure"
"""


def test_the_fixture_fails_undeclared_and_unmet(tmp_path: Path) -> None:
    case = tmp_path / "test_cases.py"
    case.write_text(CASES)
    repo = Path(__file__).resolve().parents[2]
    argv = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider"]
    r = subprocess.run(
        [*argv, "-q", "-rA", "--rootdir", str(tmp_path), str(case)],
        cwd=repo,
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [x for x in r.stdout.splitlines() if "test_cases.py::" in x and x[0].isupper()]
    outcome: dict[str, set[str]] = {}
    for line in lines:
        word, _, rest = line.partition(" ")
        outcome.setdefault(rest.split("::")[1].split(" ")[0], set()).add(word)
    assert outcome == {
        "test_undeclared": {"PASSED", "ERROR"},  # the call passed, the log check did not
        "test_declared": {"PASSED"},
        "test_declared_not_seen": {"PASSED", "ERROR"},
        "test_wrong_level": {"PASSED", "ERROR"},
        "test_marker": {"PASSED"},
        "test_block_ends_before_the_record": {"FAILED"},
        "test_block_takes_no_record_after_it": {"PASSED", "ERROR"},
        "test_block": {"PASSED"},
        "test_failed_test_is_not_blamed_for_unmet_declarations": {"FAILED"},
    }, r.stdout
    assert "unexpected log record: test process: WARNING olliefs.case: boom" in r.stdout
    assert "expected 1 log record(s) at WARNING matching 'boom', saw 0" in r.stdout
