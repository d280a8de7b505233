"""The journal's record kinds and the replay table: a kind added to persist.Record with
no entry in session.REPLAY would be skipped at every restart, silently."""

from __future__ import annotations

import typing

from olliefs.session import persist
from olliefs.session.session import REPLAY


def test_every_record_kind_but_create_has_a_replay_step() -> None:
    kinds = set(typing.get_args(persist.Record))
    assert persist.Prompt in kinds and persist.Rewind in kinds  # the union was read
    # Create is read by the registry, which makes the session the others replay into.
    assert set(REPLAY) == kinds - {persist.Create}
