"""Safety limits of a turn (SPEC 4): a small state machine fed once per tool round.

A model that keeps failing, keeps doing the same thing, or works on without a plan burns
tokens and goes nowhere. The loop cannot judge the work, but it can count; these counters
and their thresholds are the seed's table:

==========================  =========  ==========================================
mechanism                   threshold  action
==========================  =========  ==========================================
consecutive failing rounds  5          ``Nudge("errors")``: try a different approach
consecutive failing rounds  10         ``Abort``: the turn ends
replan gate                 8          ``Nudge("replan")``: write a PLAN: block
stall                       5          ``Nudge("stall")``: the same action again
plan re-injection           every 10   ``Reinject``: the TaskState, as text
max steps                   per agent  ``FinalSummary``: one last request, no tools
==========================  =========  ==========================================

How the loop uses it: one ``Safety`` per turn (or ``start_turn()`` on a kept one); after
every tool round (a reply with tool calls, and its results appended to the history),
``after_round`` with the inferred ``TaskState`` and two facts about the round. It returns
the actions for that round, in the order to apply them; an empty list means "go on".

* ``Abort(reason)`` comes alone: end the turn with ``reason`` as an ``error:`` line.
* ``FinalSummary(prompt)`` comes alone (unless an abort wins): make one more request
  with ``prompt`` appended as a user message and **no tools**, show its answer, end the
  turn. The ``maxsteps`` event belongs there.
* ``Nudge(kind, text)`` and ``Reinject(text)``: append ``text`` as a user message before
  the next request (nudges first, then the re-injection); the loop may also show them
  as ``info`` lines.

Counters, and exactly when each one moves (a *round* is one ``after_round`` call):

``rounds``
    +1 every round. Reset to 0 only by ``start_turn``. Drives the re-injection (a
    ``Reinject`` whenever ``rounds`` is a multiple of 10) and max steps (``FinalSummary``
    when ``rounds`` reaches ``max_steps``).
``failing``
    +1 for a round with ``failed=True`` (at least one call of the round failed); reset
    to 0 by a round with ``failed=False`` and by ``start_turn``. ``Nudge("errors")``
    when it *becomes* 5 (once per streak: 6..9 say nothing more); ``Abort`` when it
    becomes 10.
``unplanned``
    +1 for a round whose reply had no ``PLAN:`` block (``planned=False``); reset to 0 by
    a round with ``planned=True``, by ``start_turn``, and right after its own nudge, so
    a model that ignores the nudge is nudged again after 8 more rounds without a plan.
``same``
    Length of the current run of rounds whose ``TaskState.last_action`` is identical to
    the previous round's (the first round of a run counts 1). A different action starts
    a new run at 1; an empty action (nothing known) resets it to 0. ``Nudge("stall")``
    when it reaches 5; then it restarts at 0, so the same action repeated 5 more times
    nudges again. Reset by ``start_turn``.

Every counter is per turn: a new prompt is a new request, and a streak of failures in
the last turn says nothing about this one. (``TaskState.errors`` is the session-wide,
informational count.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from olliefs.agent.taskstate import TaskState, to_json

ERROR_NUDGE_AT = 5
ERROR_ABORT_AT = 10
REPLAN_AT = 8
STALL_AT = 5
REINJECT_EVERY = 10

NudgeKind = Literal["errors", "replan", "stall"]


@dataclass(frozen=True)
class Nudge:
    kind: NudgeKind
    text: str


@dataclass(frozen=True)
class Reinject:
    text: str


@dataclass(frozen=True)
class Abort:
    reason: str


@dataclass(frozen=True)
class FinalSummary:
    prompt: str


Action = Nudge | Reinject | Abort | FinalSummary


def final_summary_prompt(max_steps: int) -> str:
    return (
        f"[ollie] The step limit of this turn ({max_steps} tool rounds) is reached. Do not "
        "call any tool. Answer with a summary: what you did, what is left to do, and the "
        "next step you would take."
    )


def reinject_text(state: TaskState) -> str:
    return (
        f"[ollie] Task state (repeated every {REINJECT_EVERY} tool rounds so that it "
        f"stays in view):\n{to_json(state)}"
    )


class Safety:
    """Per-turn counters; see the module docstring for every rule and reset."""

    def __init__(self, max_steps: int | None = None) -> None:
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, not {max_steps}")
        self.max_steps = max_steps
        self.start_turn()

    def start_turn(self) -> None:
        self.rounds = 0
        self.failing = 0
        self.unplanned = 0
        self.same = 0
        self._last_action = ""

    def after_round(self, state: TaskState, *, failed: bool, planned: bool) -> list[Action]:
        """The actions after one tool round; ``state`` is the TaskState inferred from it."""
        self.rounds += 1
        self.failing = self.failing + 1 if failed else 0
        self.unplanned = 0 if planned else self.unplanned + 1
        action = state.last_action
        if not action:
            self.same = 0
        elif action == self._last_action:
            self.same += 1
        else:
            self.same = 1
        self._last_action = action

        if self.failing >= ERROR_ABORT_AT:
            return [Abort(f"{self.failing} tool rounds in a row had errors: the turn is stopped")]
        if self.max_steps is not None and self.rounds >= self.max_steps:
            return [FinalSummary(final_summary_prompt(self.max_steps))]

        out: list[Action] = []
        if self.failing == ERROR_NUDGE_AT:
            out.append(
                Nudge(
                    "errors",
                    f"[ollie] The last {ERROR_NUDGE_AT} tool rounds all had errors. Try a "
                    "different approach: read the error messages again, check your "
                    "assumptions, or take a smaller step.",
                )
            )
        if self.unplanned >= REPLAN_AT:
            self.unplanned = 0
            out.append(
                Nudge(
                    "replan",
                    f"[ollie] {REPLAN_AT} tool rounds without a plan. Before the next tool "
                    "call, write a PLAN: block: what is done, what is left, the next step.",
                )
            )
        if self.same >= STALL_AT:
            self.same = 0
            out.append(
                Nudge(
                    "stall",
                    f"[ollie] The last {STALL_AT} tool rounds did the same thing with the "
                    f"same result ({action}). You seem stuck: try something different.",
                )
            )
        if self.rounds % REINJECT_EVERY == 0:
            out.append(Reinject(reinject_text(state)))
        return out
