"""A replay server with a key, for every contract test: auth is part of each wire."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from olliefs.replay import ReplayServer
from tests.contract.harness import KEY


@pytest.fixture
def server() -> Iterator[ReplayServer]:
    with ReplayServer(key=KEY, models=("replay", "other")) as srv:
        yield srv
