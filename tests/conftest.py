"""Shared fixtures: a replay LLM server and a real olliefs mount served by a real daemon.

The daemon always runs in a subprocess: the test process must never touch a FUSE mount
from the thread that serves it, and a subprocess is also what a user runs. Tests talk to
the mount with plain file operations, exactly as a shell would.

A test fails if the daemon logged an unexpected ERROR or a traceback (the s3ql habit):
client mistakes are answered with errnos and must not look like daemon failures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from olliefs.replay import Entry, ReplayServer, parse_script
from olliefs.testing import HAVE_FUSE, Daemon, deadline


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
