"""TaskState inference: every rule of ``olliefs.agent.taskstate`` pinned by an example."""

from __future__ import annotations

import json

from olliefs.agent.dispatch import ERROR_MARK
from olliefs.agent.taskstate import (
    MAX_FILES,
    RESULT_CHARS,
    Round,
    TaskState,
    checklist_step,
    from_json,
    has_plan_block,
    infer,
    last_round,
    plan_block_step,
    start_turn,
    to_json,
)
from olliefs.backend.base import Message, ToolCall


def call(cid: str, name: str, args: str = "{}") -> ToolCall:
    return ToolCall(cid, name, args)


def result(cid: str, name: str, text: str, error: bool = False) -> Message:
    return Message("tool", (ERROR_MARK if error else "") + text, tool_call_id=cid, name=name)


def rnd(text: str, *pairs: tuple[ToolCall, Message]) -> Round:
    return Round(
        Message("assistant", text, tool_calls=tuple(c for c, _ in pairs)),
        tuple(r for _, r in pairs),
    )


def one(
    name: str = "file_read", args: str = '{"path": "a.py"}', out: str = "ok", err: bool = False
) -> Round:
    c = call("c1", name, args)
    return rnd("", (c, result("c1", name, out, err)))


def test_last_action_is_the_last_call_with_its_folded_result() -> None:
    r = rnd(
        "",
        (call("a", "file_read", '{"path":"x"}'), result("a", "file_read", "first")),
        (
            call("b", "execute_code", '{"code": "ls\\n -l"}'),
            result("b", "execute_code", "a\n  b\n"),
        ),
    )
    s = infer(TaskState(), r)
    assert s.last_action == 'execute_code({"code":"ls\\n -l"}) -> a b'
    assert s.rounds == 1


def test_last_action_marks_errors_and_cuts_long_results() -> None:
    s = infer(TaskState(), one(out="x" * 1000, err=True))
    assert s.last_action.startswith('file_read({"path":"a.py"}) -> error: xxx')
    assert s.last_action.endswith("…")
    assert len(s.last_action.split(" -> error: ")[1]) == RESULT_CHARS


def test_a_call_without_result_says_so() -> None:
    r = Round(Message("assistant", tool_calls=(call("a", "t"),)), ())
    assert infer(TaskState(), r).last_action == "t({}) -> (no result)"


def test_errors_count_consecutive_failing_rounds_and_reset() -> None:
    s = TaskState()
    for n in range(1, 4):
        s = infer(s, one(err=True))
        assert s.errors == n
    # One failed call among good ones fails the round.
    mixed = rnd(
        "",
        (call("a", "t"), result("a", "t", "fine")),
        (call("b", "t"), result("b", "t", "bad", error=True)),
    )
    s = infer(s, mixed)
    assert s.errors == 4
    s = infer(s, one())
    assert s.errors == 0
    assert s.rounds == 5


def test_files_touched_by_write_calls_only_and_most_recent_last() -> None:
    s = TaskState()
    s = infer(s, one("file_write", '{"path": "a.py", "content": "x"}'))
    s = infer(s, one("file_read", '{"path": "b.py"}'))
    s = infer(s, one("file_edit", '{"path": "c.py"}'))
    s = infer(s, one("file_write", '{"path": "d.py"}', err=True))  # failed: not touched
    s = infer(s, one("file_edit", '{"path": "a.py"}'))  # again: moves to the end
    s = infer(s, one("file_write", "not json"))
    assert s.files == ("c.py", "a.py")
    for i in range(MAX_FILES + 5):
        s = infer(s, one("file_write", json.dumps({"path": f"f{i}"})))
    assert len(s.files) == MAX_FILES
    assert s.files[-1] == f"f{MAX_FILES + 4}"


def test_plan_file_checklist_gives_the_step() -> None:
    plan = "# plan\n- [x] read the code\n- [ ] write the parser\n* [ ] test it\n"
    s = infer(TaskState(plan_step="old"), one(), plan)
    assert s.plan_step == "write the parser"
    # The file is authoritative over a PLAN: block in the reply.
    r = rnd("PLAN:\n- [ ] something else", (call("c", "t"), result("c", "t", "ok")))
    assert infer(s, r, plan).plan_step == "write the parser"
    # Every item checked: no step (the plan is done).
    done = plan.replace("[ ]", "[x]")
    assert infer(s, one(), done).plan_step == ""


def test_plan_block_in_the_reply_when_the_file_has_no_checklist() -> None:
    r = rnd(
        "Let me go on.\nPLAN:\n1. ~~read the code~~\n2. edit parse() (done)\n3. run the tests\n"
        "\nThen I will report.",
        (call("c", "t"), result("c", "t", "ok")),
    )
    assert infer(TaskState(), r, "free text plan, no checklist").plan_step == "run the tests"


def test_plan_block_variants() -> None:
    assert plan_block_step("PLAN:\n- [x] a\n- [ ] b\n- [ ] c") == "b"
    assert plan_block_step("PLAN:\n- [x] a\n- [x] b") == ""
    assert plan_block_step("**PLAN:** fix the bug first") == "fix the bug first"
    assert plan_block_step("## PLAN:\n- a ✓\n- b") == "b"
    # The last block wins: the model replanned.
    assert plan_block_step("PLAN:\n1. a\n\nlater\nPLAN:\n1. z") == "z"
    # Prose after the list is not a step.
    assert plan_block_step("PLAN:\n- a ✓\nnow working") == ""
    assert plan_block_step("PLAN:") is None
    assert plan_block_step("no plan here") is None


def test_no_plan_anywhere_keeps_the_previous_step() -> None:
    s = infer(TaskState(plan_step="keep me"), one(), "")
    assert s.plan_step == "keep me"


def test_has_plan_block() -> None:
    assert has_plan_block("ok\nPLAN:\n1. x")
    assert has_plan_block("  **PLAN:** x")
    assert not has_plan_block("my plan: x")
    assert not has_plan_block("EXPLAN: x")
    assert rnd("PLAN: x").planned
    assert not rnd("x").planned


def test_checklist_step() -> None:
    assert checklist_step("nothing") is None
    assert checklist_step("- [X] a\n+ [ ] b") == "b"


def test_last_round_finds_the_latest_tool_round() -> None:
    msgs = [
        Message("user", "go"),
        Message("assistant", tool_calls=(call("a", "t"),)),
        result("a", "t", "1"),
        Message("assistant", "x", tool_calls=(call("b", "t"), call("c", "t"))),
        result("b", "t", "2"),
        result("c", "t", "3"),
        Message("user", "nudge"),
    ]
    r = last_round(msgs)
    assert r is not None
    assert r.reply is msgs[3]
    assert [m.content for m in r.results] == ["2", "3"]
    assert last_round([Message("user", "hi"), Message("assistant", "hello")]) is None


def test_start_turn_sets_the_goal_once() -> None:
    s = start_turn(TaskState(), "\n  Fix the   parser\nplease\n")
    assert s.goal == "Fix the parser"
    assert start_turn(s, "something else").goal == "Fix the parser"


def test_json_round_trip_and_determinism() -> None:
    s = infer(start_turn(TaskState(), "goal"), one("file_write", '{"path": "p"}'), "- [ ] a")
    assert (
        infer(start_turn(TaskState(), "goal"), one("file_write", '{"path": "p"}'), "- [ ] a") == s
    )
    text = to_json(s)
    assert text.endswith("\n")
    assert from_json(text) == s
    assert json.loads(text)["plan_step"] == "a"
