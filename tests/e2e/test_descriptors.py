"""A daemon started with a low soft limit of open descriptors still serves many sessions."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from olliefs.replay import ReplayServer
from olliefs.testing import HAVE_FUSE, Daemon


def test_more_sessions_than_the_soft_descriptor_limit(tmp_path: Path) -> None:
    """Each session holds its journal open; a daemon that kept the soft limit it was
    started with (here 256, as 1,024 is on most systems) failed the next s/new with
    EMFILE once the sessions had used it up."""
    if not HAVE_FUSE:
        pytest.skip(reason="needs /dev/fuse (this test mounts a real FUSE filesystem)")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(reason=f"the hard descriptor limit ({hard}) leaves no room above 256")
    with ReplayServer() as replay:
        d = Daemon(tmp_path, replay, {})
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # the daemon inherits it
        try:
            d.start()
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        try:
            sids = [d.new(name=f"n{i}") for i in range(300)]
            assert len(d.read("s/idx").splitlines()) == 300
            d.prompt(sids[-1], "still there?")
            d.wait_idle(sids[-1])
            assert "user: still there?" in d.read(f"s/{sids[-1]}/chat")
        finally:
            d.stop()
        d.check_log()
