"""Shared fixtures: a replay LLM server and a real olliefs mount served by a real daemon.

The daemon always runs in a subprocess: the test process must never touch a FUSE mount
from the thread that serves it, and a subprocess is also what a user runs. Tests talk to
the mount with plain file operations, exactly as a shell would.

Logs (the s3ql habit): every test runs under ``checked_logs``, and fails on any log record
at WARNING or above that it did not declare with ``olliefs.testing.expect_log`` (a call, a
``with`` block, or ``@pytest.mark.expect_log(pattern, level=..., count=...)``), whether the
record came from the test process's ``logging``, a daemon's log or a toolsrv's log (those
are read when the daemon or toolsrv stops). A declaration the test does not meet fails it
as well. Why one rule for all: a warning is the daemon saying something went wrong; client
mistakes are answered with errnos and must not look like daemon trouble, and the troubles a
test provokes on purpose are part of what it asserts. See olliefs/testing.py's docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import pytest

from olliefs.replay import Entry, ReplayServer, parse_script
from olliefs.testing import HAVE_FUSE, Daemon, checking_logs, deadline

FAILED = pytest.StashKey[bool]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "expect_log(pattern, level=logging.WARNING, count=1): the test logs this record"
        " (olliefs.testing.expect_log)",
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        item.stash[FAILED] = True
    return report


@pytest.fixture(autouse=True)
def checked_logs(request: pytest.FixtureRequest) -> Iterator[None]:
    """Set up before, and so torn down after, every other fixture of the test: the daemons
    and toolsrvs it ran have stopped and had their logs checked when this looks."""
    with checking_logs() as check:
        for mark in request.node.iter_markers("expect_log"):
            check.expect(*mark.args, **mark.kwargs)
        yield
    problems = check.unexpected_records()
    if not request.node.stash.get(FAILED, False):  # unmet declarations of a failed test: noise
        problems += check.unmet()
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


def script(*lines: str) -> list[Entry]:
    return parse_script("\n".join(lines))


@pytest.fixture
def replay() -> Iterator[ReplayServer]:
    with ReplayServer() as srv:
        yield srv


@pytest.fixture
def daemon_factory(tmp_path: Path, replay: ReplayServer) -> Iterator[Callable[..., Daemon]]:
    """Make daemons (not started) on one home: for restart and crash tests."""
    if not HAVE_FUSE:
        pytest.skip(reason="needs /dev/fuse (this test mounts a real FUSE filesystem)")
    made: list[Daemon] = []

    def make(**env: str) -> Daemon:
        d = Daemon(tmp_path, replay, env)
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()
    for d in made:
        d.check_log()


@pytest.fixture
def daemon(tmp_path: Path, replay: ReplayServer) -> Iterator[Daemon]:
    if not HAVE_FUSE:
        pytest.skip(reason="needs /dev/fuse (this test mounts a real FUSE filesystem)")
    with Daemon(tmp_path, replay, {}).running() as d:
        yield d


def oserror(fn: Callable[..., object], *args: object) -> int:
    """Run ``fn(*args)`` and return the errno it failed with (0 if it did not fail)."""
    try:
        fn(*args)
    except OSError as err:
        return err.errno or -1
    return 0


__all__ = ["Daemon", "deadline", "oserror", "script"]
