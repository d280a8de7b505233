"""The safety state machine: every threshold and every reset of ``olliefs.agent.safety``."""

from __future__ import annotations

import pytest

from olliefs.agent.safety import (
    ERROR_ABORT_AT,
    ERROR_NUDGE_AT,
    REINJECT_EVERY,
    REPLAN_AT,
    STALL_AT,
    Abort,
    Action,
    FinalSummary,
    Nudge,
    Reinject,
    Safety,
)
from olliefs.agent.taskstate import TaskState, from_json


class Driver:
    """Feeds rounds; by default each round is fine, planned and does something new.

    ``round`` leaves out the periodic ``Reinject`` unless ``every=True``, so that tests of
    the other counters can run past round 10 and stay readable."""

    def __init__(self, safety: Safety) -> None:
        self.safety = safety
        self.n = 0

    def round(
        self,
        *,
        failed: bool = False,
        planned: bool = True,
        action: str | None = None,
        every: bool = False,
    ) -> list[Action]:
        self.n += 1
        state = TaskState(last_action=f"act {self.n}" if action is None else action, rounds=self.n)
        got = self.safety.after_round(state, failed=failed, planned=planned)
        return got if every else [a for a in got if not isinstance(a, Reinject)]


def kinds(actions: list[Action]) -> list[str]:
    out: list[str] = []
    for a in actions:
        if isinstance(a, Nudge):
            out.append(a.kind)
        else:
            out.append(type(a).__name__)
    return out


def test_thresholds_are_the_specs() -> None:
    assert (ERROR_NUDGE_AT, ERROR_ABORT_AT, REPLAN_AT, STALL_AT, REINJECT_EVERY) == (
        5,
        10,
        8,
        5,
        10,
    )


def test_failing_rounds_nudge_at_5_once_and_abort_at_10() -> None:
    d = Driver(Safety())
    got = [kinds(d.round(failed=True)) for _ in range(10)]
    assert got[:4] == [[]] * 4
    assert got[4] == ["errors"]
    assert got[5:9] == [[]] * 4  # once per streak
    assert got[9] == ["Abort"]
    abort = d.safety.after_round(TaskState(last_action="x"), failed=True, planned=True)
    assert isinstance(abort[0], Abort) and "11 tool rounds" in abort[0].reason


def test_a_good_round_resets_the_failing_streak() -> None:
    d = Driver(Safety())
    for _ in range(4):
        assert d.round(failed=True) == []
    d.round(failed=False)
    for _ in range(4):
        assert d.round(failed=True) == []
    assert kinds(d.round(failed=True)) == ["errors"]
    for _ in range(4):
        d.round(failed=True)
    d.round(failed=False)
    for _ in range(9):
        assert "Abort" not in kinds(d.round(failed=True))


def test_start_turn_resets_the_failing_streak() -> None:
    s = Safety()
    d = Driver(s)
    for _ in range(9):
        d.round(failed=True)
    s.start_turn()
    for _ in range(4):
        assert d.round(failed=True) == []
    assert kinds(d.round(failed=True)) == ["errors"]


def test_replan_gate_after_8_rounds_without_plan_and_again_8_later() -> None:
    d = Driver(Safety())
    for _ in range(7):
        assert d.round(planned=False) == []
    assert kinds(d.round(planned=False)) == ["replan"]
    for _ in range(7):
        assert d.round(planned=False) == []
    assert kinds(d.round(planned=False)) == ["replan"]


def test_a_plan_resets_the_replan_gate() -> None:
    s = Safety()
    d = Driver(s)
    for _ in range(7):
        d.round(planned=False)
    assert d.round(planned=True) == []
    for _ in range(7):
        assert d.round(planned=False) == []
    s.start_turn()
    for _ in range(7):
        assert d.round(planned=False) == []
    assert kinds(d.round(planned=False)) == ["replan"]


def test_stall_after_5_rounds_with_the_same_action() -> None:
    d = Driver(Safety())
    for _ in range(4):
        assert d.round(action="grep x -> nothing") == []
    nudge = d.round(action="grep x -> nothing")
    assert kinds(nudge) == ["stall"]
    assert isinstance(nudge[0], Nudge) and "grep x -> nothing" in nudge[0].text
    # The run restarts after the nudge: 5 more identical rounds nudge again.
    for _ in range(4):
        assert d.round(action="grep x -> nothing") == []
    assert kinds(d.round(action="grep x -> nothing")) == ["stall"]


def test_a_different_or_unknown_action_resets_the_stall_run() -> None:
    s = Safety()
    d = Driver(s)
    for _ in range(4):
        d.round(action="A")
    d.round(action="B")  # a new run of length 1
    for _ in range(3):
        assert d.round(action="B") == []
    assert kinds(d.round(action="B")) == ["stall"]
    for _ in range(4):
        d.round(action="C")
    d.round(action="")  # nothing known: no run
    for _ in range(4):
        assert d.round(action="C") == []
    s.start_turn()
    for _ in range(4):
        assert d.round(action="C") == []
    assert kinds(d.round(action="C")) == ["stall"]


def test_plan_reinjection_every_10_rounds_with_the_task_state() -> None:
    s = Safety()
    d = Driver(s)
    seen = []
    for _ in range(2 * REINJECT_EVERY):
        acts = d.round(every=True)
        if acts:
            seen.append(d.n)
            (a,) = acts
            assert isinstance(a, Reinject)
            state = from_json(a.text.split("\n", 1)[1])
            assert state.rounds == d.n and state.last_action == f"act {d.n}"
    assert seen == [10, 20]
    s.start_turn()
    for _ in range(9):
        assert d.round(every=True) == []
    assert kinds(d.round(every=True)) == ["Reinject"]


def test_max_steps_asks_for_a_final_summary() -> None:
    d = Driver(Safety(max_steps=3))
    assert d.round() == []
    assert d.round() == []
    (a,) = d.round()
    assert isinstance(a, FinalSummary)
    assert "3 tool rounds" in a.prompt and "Do not call any tool" in a.prompt


def test_no_max_steps_never_stops() -> None:
    d = Driver(Safety())
    for _ in range(100):
        assert "FinalSummary" not in kinds(d.round())


def test_abort_beats_the_final_summary_and_the_summary_beats_nudges() -> None:
    d = Driver(Safety(max_steps=10))
    got = [d.round(failed=True) for _ in range(10)]
    assert kinds(got[-1]) == ["Abort"]
    d = Driver(Safety(max_steps=8))
    got = [d.round(planned=False) for _ in range(8)]
    assert kinds(got[-1]) == ["FinalSummary"]


def test_several_actions_in_one_round_come_nudges_first() -> None:
    d = Driver(Safety())
    for _ in range(5):
        assert kinds(d.round(failed=True, planned=False, action="same")) == (
            [] if d.n < 5 else ["errors", "stall"]
        )
    for _ in range(2):
        d.round(failed=False, planned=False, action="same")
    # round 8: unplanned 8 -> replan; same 8 (after the nudge at 5 restarted it at 0: 3)
    assert kinds(d.round(planned=False, action="same")) == ["replan"]
    d.round(planned=True, action="same")
    # round 10: same reaches 5 again and the re-injection is due
    assert kinds(d.round(planned=True, action="same", every=True)) == ["stall", "Reinject"]


def test_max_steps_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Safety(max_steps=0)
