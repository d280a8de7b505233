"""The profile catalogue on its own (no daemon, no toolsrv): what a session of a profile
starts with, read from the config dir before the shipped profiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from olliefs.errors import InvalidRequest
from olliefs.session.catalogue import Profiles
from olliefs.settings import Paths


def _paths(tmp_path: Path) -> Paths:
    paths = Paths(tmp_path / "config", tmp_path / "state", tmp_path / "data", tmp_path / "run")
    (paths.config / "agents").mkdir(parents=True)
    return paths


def test_a_users_profile_sets_the_starting_tools_within_allow_tools(tmp_path: Path) -> None:
    paths = _paths(tmp_path)
    doc = {"tools": ["read", "write"], "autoLoad": ["grep", "read"], "allowTools": ["read", "grep"]}
    (paths.config / "agents" / "mine.json").write_text(json.dumps(doc))
    profiles = Profiles(paths)
    assert profiles.profile_tools("mine") == ["read", "grep"]
    profiles.check_agent("mine")
    with pytest.raises(InvalidRequest, match="unknown agent profile: nope"):
        profiles.check_agent("nope")


def test_a_restore_reads_each_profile_once(tmp_path: Path) -> None:
    paths = _paths(tmp_path)
    path = paths.config / "agents" / "mine.json"
    path.write_text(json.dumps({"prompt": "first"}))
    profiles = Profiles(paths)
    profiles.caching(True)
    assert profiles.profile_prompt("mine") == "first"
    path.write_text(json.dumps({"prompt": "second"}))
    assert profiles.profile_prompt("mine") == "first"  # the restore's one read
    profiles.caching(False)
    assert profiles.profile_prompt("mine") == "second"
