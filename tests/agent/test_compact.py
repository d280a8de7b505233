"""Compaction: zones, the request through the backend seam, failures that keep the old
history, and the snapshot that keeps everything.

The compaction model is a ``ScriptedBackend`` (the Backend protocol, answering from a
script); everything else is the real code, and the snapshot is written to a real disk.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import msgspec
import pytest

from olliefs.agent import compact as C
from olliefs.agent.compact import (
    HOT,
    HOT_MARK,
    RESPONSE_SCHEMA,
    SUMMARIZED,
    CompactionFailed,
    NothingToCompact,
    checkpoint,
    next_snapshot_number,
    plan,
    problems,
    read_snapshot,
    should_compact,
    write_snapshot,
)
from olliefs.agent.dispatch import ERROR_MARK
from olliefs.agent.history import History, collapse, estimate_tokens, message_text
from olliefs.agent.retry import RetryPolicy
from olliefs.agent.taskstate import TaskState, from_json
from olliefs.backend.base import (
    Backend,
    BackendError,
    BadResponseError,
    GenerationParams,
    Message,
    RateLimitError,
    StreamDropError,
    StreamEvent,
    ToolCall,
    ToolUnsupportedError,
    Usage,
)
from tests.agent.scripted import Reply, ScriptedBackend

TIERS = {"file_read": "cold", "summarize_logs": "warm", "file_write": "hot", "execute_code": ""}


def tool_round(n: int, *names: str) -> list[Message]:
    calls = tuple(
        ToolCall(f"r{n}c{k}", name, json.dumps({"path": f"src/m{n}_{k}.py"}))
        for k, name in enumerate(names)
    )
    out = [Message("assistant", f"round {n}: working", tool_calls=calls)]
    for k, c in enumerate(calls):
        body = "\n".join(f"line {i} of {c.name} {n}/{k}" for i in range(40))
        if n % 7 == 3 and k == 0:
            body = ERROR_MARK + "no such file"
        out.append(Message("tool", body, tool_call_id=c.id, name=c.name, tier=TIERS[c.name]))
    return out


def long_conversation(rounds: int = 40) -> list[Message]:
    """A coding session: prompts, rounds of read/write/warm/exec calls, plain replies."""
    msgs = [Message("user", "Refactor the parser and make the tests pass.")]
    names = ["file_read", "summarize_logs", "file_write", "execute_code"]
    for n in range(rounds):
        if n % 10 == 5:
            msgs.append(Message("assistant", f"PLAN:\n- [x] step {n}\n- [ ] step {n + 1}"))
            msgs.append(Message("user", f"ok, go on ({n})"))
        picked = [names[(n + i) % 4] for i in range(1 + n % 3)]
        msgs.extend(tool_round(n, *picked))
    msgs.append(Message("assistant", "Done for now: the parser is refactored."))
    return msgs


def answer(**over: Any) -> str:
    doc: dict[str, Any] = {
        "goal": "Refactor the parser; tests pass",
        "state": "parser split in two modules; 3 tests still fail",
        "decisions": [f"decision {i}" for i in range(14)],
        "next": "fix test_edge",
        "open_questions": ["keep the old API?"],
        "files": ["src/parser.py", "src/lexer.py"],
        "results": {},
    }
    doc.update(over)
    return json.dumps(doc)


def hot_ids(p: C.Plan) -> list[str]:
    return [p.before[i].tool_call_id for i in sorted(p.summarize)]


async def run(
    msgs: list[Message], text: str, state: TaskState | None = None, **kw: Any
) -> tuple[C.Plan, C.Result, ScriptedBackend]:
    p = plan(msgs, state or TaskState(goal="refactor"), kw.pop("focus", ""), **kw)
    backend = ScriptedBackend([Reply.text(text, Usage(input_tokens=900, output_tokens=80))])
    b: Backend = backend
    res = await C.compact(b, "small-model", p, GenerationParams(max_tokens=2000))
    return p, res, backend


def test_should_compact_at_half_the_context() -> None:
    assert not should_compact(4999, 10_000)
    assert should_compact(5000, 10_000)
    assert should_compact(20_000, 10_000)
    assert not should_compact(10**9, 0)  # context unknown: never


async def test_long_conversation_is_compacted_and_nothing_is_lost(tmp_path: Path) -> None:
    msgs = long_conversation()
    original = list(msgs)
    p0 = plan(msgs, TaskState())
    results = {i: f"summary of {i}" for i in hot_ids(p0)}
    state = TaskState(goal="refactor", rounds=40, last_action="x", decisions=("old one",))
    p, res, backend = await run(msgs, answer(results=results), state, focus="the lexer")
    assert msgs == original  # the input is never touched

    # The request: the compaction model, no tools, the schema, state, focus, transcript.
    (req,) = backend.requests
    assert req.model == "small-model" and req.tools == []
    assert req.params.max_tokens == 2000
    system, user = req.messages
    assert system.role == "system" and '"decisions"' in system.content
    assert "Focus of this compaction (weigh it above all else): the lexer" in user.content
    assert '"old one"' in user.content  # the current TaskState is shown
    assert user.content.count(HOT_MARK) == 1
    # tool pairs flattened: the call on one line, its result right under it
    assert '#1 assistant called file_read({"path":"src/m0_0.py"})\n#2 result of file_read: ' in (
        user.content
    )
    # cold results are collapsed in the transcript, warm/hot ones are not
    assert "line 5 of file_read" not in user.content
    assert "line 5 of summarize_logs" in user.content
    assert all(f"[summarize: id={i}]" in user.content for i in hot_ids(p))

    # The new history: cold, warm, then the hot zone.
    new = res.messages
    assert problems(new) == []
    cold, warm, *hot = new
    assert cold.role == "user" and cold.content.startswith("[ollie: compacted context]")
    shown = from_json(cold.content.split("\n", 1)[1])
    assert shown.goal == "Refactor the parser; tests pass"
    assert shown.progress.startswith("parser split")
    assert shown.decisions == ()  # they are the warm zone's
    assert shown.rounds == 40 and shown.last_action == "x"
    assert warm.content.splitlines()[1:] == [f"- decision {i}" for i in range(4, 14)]
    assert res.state.decisions == tuple(f"decision {i}" for i in range(4, 14))
    assert res.state.files == ("src/parser.py", "src/lexer.py")
    assert len(hot) >= HOT and len(hot) == len(msgs) - p.hot_start
    assert hot[0].role != "tool"
    for i, m in zip(range(p.hot_start, len(msgs)), hot, strict=True):
        if i in p.summarize:
            assert (
                m.content
                == f"[summarize_logs result, summarized at compaction: summary of {m.tool_call_id}]"
            )
            assert m.tier == SUMMARIZED
        elif i in p.collapse:
            assert m.content == collapse(msgs[i]) and m.tier == SUMMARIZED
        else:
            assert m == msgs[i]
    assert res.usage == Usage(input_tokens=900, output_tokens=80)

    # The snapshot: every message of before, the summary, one dropped line per message.
    n = next_snapshot_number(tmp_path / "compactions")
    assert n == 1
    d = write_snapshot(tmp_path / "compactions", n, p.before, res.summary, res.dropped)
    assert d == tmp_path / "compactions" / "1"
    assert read_snapshot(d) == original
    assert len((d / "before.jsonl").read_bytes().splitlines()) == len(original)
    assert (d / "summary").read_text() == res.summary.rstrip("\n") + "\n"
    assert cold.content in res.summary and warm.content in res.summary
    dropped = (d / "dropped").read_text().splitlines()
    assert len(dropped) == p.hot_start + len(p.summarize) + len(p.collapse)
    assert dropped[0] == "0\tuser\tRefactor the parser and make the tests pass."
    assert dropped[1].startswith("1\tassistant\tround 0: working")
    assert dropped[2].startswith("2\ttool:file_read\tline 0 of file_read 0/0")
    assert all(len(line.split("\t")[2]) <= C.PREVIEW_CHARS for line in dropped)
    assert sorted(os.listdir(tmp_path / "compactions")) == ["1"]
    assert next_snapshot_number(tmp_path / "compactions") == 2


async def test_a_compacted_history_compacts_again(tmp_path: Path) -> None:
    msgs = long_conversation(20)
    p1, r1, _ = await run(msgs, answer())
    grown = r1.messages + long_conversation(12)[1:]
    p2, r2, backend = await run(grown, answer(decisions=["new"]), r1.state)
    assert problems(r2.messages) == []
    # The first compaction's cold and warm messages are now in the dropped part.
    assert r1.messages[0].content.split("\n", 1)[0] in backend.requests[0].messages[1].content
    write_snapshot(tmp_path, 1, p1.before, r1.summary, r1.dropped)
    write_snapshot(tmp_path, 2, p2.before, r2.summary, r2.dropped)
    assert read_snapshot(tmp_path / "2")[:2] == r1.messages[:2]
    assert r2.state.decisions == ("new",)


GOOD = json.loads(answer())
PROSE = "Here is the compacted context you asked for:\n"


@pytest.mark.parametrize(
    ("text", "check"),
    [
        (answer(), {}),
        ("```json\n" + answer() + "\n```\n", {}),
        (PROSE + answer() + "\nI hope this helps.", {}),
        (PROSE + "```json\n" + answer() + "\n```", {}),
        (answer(notes="the model added this"), {}),
        (
            json.dumps({"goal": "g", "state": "s"}),
            {"decisions": (), "open_questions": (), "files": (), "next": "", "results": {}},
        ),
        (answer(decisions=None, files="one/file.py"), {"decisions": (), "files": ("one/file.py",)}),
        (answer(results=[{"id": "r1", "summary": "ok"}, {"x": 1}]), {"results": {"r1": "ok"}}),
        (answer(results={"r1": "ok"}), {"results": {"r1": "ok"}}),
        (answer(decisions=["a", {"b": 1}, 3]), {"decisions": ("a", '{"b": 1}', "3")}),
        (answer().replace('"fix test_edge"', '"fix\ntest_edge"').replace("\\n", "\n"), {}),
        ('<think>maybe {"goal": "draft", "state": "draft"}</think>\n' + answer(), {}),
        (json.dumps({"answer": GOOD}), {}),
        ('Example: {"a": 1}. The answer: ' + answer(), {}),
        ("{ not json } then " + answer(), {}),
    ],
    ids=[
        "bare",
        "fenced",
        "prose around",
        "fence after a sentence",
        "extra key",
        "only goal and state",
        "null list, lone string",
        "results as a list",
        "results as a map",
        "items not text",
        "raw newline in a string",
        "think block first",
        "wrapped one level",
        "another object first",
        "broken braces first",
    ],
)
def test_answer_shapes_real_models_give_are_read(text: str, check: dict[str, Any]) -> None:
    a = C.parse_answer(text)
    assert a.goal == "Refactor the parser; tests pass" or a.goal == "g"
    assert a.state in (GOOD["state"], "s")
    for key, want in check.items():
        assert getattr(a, key) == want
    if "next" not in check and a.goal != "g":
        assert a.next.replace("\n", " ") == "fix test_edge"


UNUSABLE = [
    ("", "empty answer"),
    ("   \n", "empty answer"),
    ("Sure! Here is the summary: the parser is done.", "no JSON object"),
    (answer()[:-1], "not usable"),  # cut short: only its inner objects are whole
    (answer(state=""), '"state" is empty'),
    (answer(state=["a list"]), '"state" is not text'),
    (json.dumps({"goal": "g", "decisions": [], "next": "n"}), 'no "state"'),
    (json.dumps({"state": "s"}), 'no "goal"'),
    ("[1, 2]", "no JSON object"),
    ("<think>" + answer(), "empty answer"),  # an unclosed think block is all thinking
]


@pytest.mark.parametrize(("text", "why"), UNUSABLE)
def test_what_cannot_be_read_is_said_in_one_line(text: str, why: str) -> None:
    with pytest.raises(CompactionFailed) as exc:
        C.parse_answer(text)
    assert why in exc.value.reason
    assert "\n" not in exc.value.reason  # one line, fit for chat


def assert_mechanical(p: C.Plan, res: C.Result, why: str) -> None:
    """A mechanical compaction: the TaskState kept, the same zones, valid, said why."""
    assert why in res.mechanical
    assert res.state == p.state
    assert problems(res.messages) == []
    cold = res.messages[0]
    assert cold.content.startswith("[ollie: compacted context]")
    assert from_json(cold.content.split("\n", 1)[1]) == msgspec.structs.replace(
        p.state, decisions=()
    )
    assert res.summary.startswith("[mechanical compaction: ")
    assert why in res.summary.split("\n", 1)[0]
    hot = res.messages[-(len(p.before) - p.hot_start) :]
    for i, m in zip(range(p.hot_start, len(p.before)), hot, strict=True):
        if i in p.summarize:
            assert m.content.startswith(f"[{m.name} result, reduced at compaction: ")
        elif i not in p.collapse:
            assert m == p.before[i]
    assert len(res.dropped) == p.hot_start + len(p.summarize) + len(p.collapse)


@pytest.mark.parametrize(("text", "why"), UNUSABLE)
async def test_an_unusable_answer_compacts_mechanically(text: str, why: str) -> None:
    msgs = long_conversation()
    original = list(msgs)
    state = TaskState(goal="refactor", progress="half done", decisions=("keep the API",))
    p, res, _ = await run(msgs, text, state)
    assert msgs == original
    assert_mechanical(p, res, why)
    assert res.messages[1].content.endswith("- keep the API\n")  # the warm zone
    assert res.usage == Usage(input_tokens=900, output_tokens=80)


@pytest.mark.parametrize(
    "reply",
    [
        Reply(error_before=BadResponseError("HTTP 401: bad key")),
        Reply(
            [StreamEvent("content", text='{"goal": "g", "sta')],
            error_after=StreamDropError("dropped"),
        ),
    ],
)
async def test_a_request_that_fails_for_good_compacts_mechanically(reply: Reply) -> None:
    msgs = long_conversation()
    p = plan(msgs, TaskState(goal="g"))
    res = await C.compact(ScriptedBackend([reply]), "m", p, structured=False)
    assert_mechanical(p, res, "the compaction model failed: ")
    assert msgs == list(p.before) and not res.schema_refused


async def test_rate_limits_and_drops_are_retried_by_the_policy() -> None:
    msgs = long_conversation()
    p = plan(msgs, TaskState())
    backend = ScriptedBackend(
        [
            Reply(error_before=RateLimitError("HTTP 429: slow down", retry_after=7)),
            Reply([StreamEvent("content", text="{")], error_after=StreamDropError("cut")),
            Reply.text(answer()),
        ]
    )
    waits: list[tuple[str, float]] = []

    async def wait(err: BackendError, delay: float) -> None:
        waits.append((type(err).__name__, delay))

    res = await C.compact(backend, "m", p, retry=RetryPolicy(base=2.0), wait=wait)
    assert not res.mechanical and res.state.next == "fix test_edge"
    assert waits == [("RateLimitError", 7.0), ("StreamDropError", 4.0)]
    assert len(backend.requests) == 3
    # out of retries: mechanical, not an exception
    again = ScriptedBackend([Reply(error_before=RateLimitError("429"))] * 4)
    res = await C.compact(again, "m", p, retry=RetryPolicy(), wait=wait)
    assert_mechanical(p, res, "the compaction model failed: 429")
    assert len(again.requests) == 4


async def test_structured_output_is_asked_for_and_a_refusal_asked_again_without() -> None:
    msgs = long_conversation()
    p = plan(msgs, TaskState())
    ok = await C.compact(ScriptedBackend([Reply.text(answer())]), "m", p)
    assert not ok.schema_refused and not ok.mechanical
    refused = BadResponseError("HTTP 400: response_format is not supported")
    for error in (refused, ToolUnsupportedError("HTTP 400: this model does not support tools")):
        backend = ScriptedBackend([Reply(error_before=error), Reply.text(answer())])
        res = await C.compact(backend, "m", p, GenerationParams(max_tokens=99))
        first, second = backend.requests
        assert first.params == GenerationParams(max_tokens=99, response_schema=RESPONSE_SCHEMA)
        assert second.params == GenerationParams(max_tokens=99)
        assert first.messages == second.messages  # the prompt asks for the JSON either way
        assert res.schema_refused and not res.mechanical
    # Refused once only: a second 400 is the end of it (and proves nothing about the
    # schema), as is a failure that is not a refusal.
    backend = ScriptedBackend([Reply(error_before=refused), Reply(error_before=refused)])
    res = await C.compact(backend, "m", p)
    assert_mechanical(p, res, "response_format is not supported")
    assert not res.schema_refused and len(backend.requests) == 2
    plain = ScriptedBackend([Reply.text(answer())])
    await C.compact(plain, "m", p, structured=False)
    assert plain.requests[0].params.response_schema is None


async def test_an_answer_given_as_the_forced_tool_call_is_read() -> None:
    """Anthropic's structured output: the answer is the forced tool's input."""
    msgs = long_conversation()
    p = plan(msgs, TaskState())
    call = ToolCall("toolu_1", C.ANSWER_NAME, answer(notes="extra"))
    other = ToolCall("toolu_2", "something_else", "{}")
    reply = Reply([StreamEvent("tool_calls", tool_calls=(other, call)), StreamEvent("done")])
    res = await C.compact(ScriptedBackend([reply]), "m", p)
    assert not res.mechanical and res.state.next == "fix test_edge"


def test_the_schema_is_the_answer_the_reader_takes() -> None:
    """A document that follows ``ANSWER_SCHEMA`` reads whole (results as its list)."""
    schema = C.ANSWER_SCHEMA
    doc = {
        "goal": "g",
        "state": "s",
        "decisions": ["d"],
        "next": "n",
        "open_questions": ["q"],
        "files": ["f"],
        "results": [{"id": "r1", "summary": "one line"}],
    }
    assert sorted(doc) == sorted(schema["properties"]) == sorted(schema["required"])
    assert schema["additionalProperties"] is False
    assert C.parse_answer(json.dumps(doc)) == C.Answer(
        "g", "s", ("d",), "n", ("q",), ("f",), {"r1": "one line"}
    )
    assert C.RESPONSE_SCHEMA.name == C.ANSWER_NAME
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,64}", C.ANSWER_NAME)


def tokens_of(msgs: Sequence[Message]) -> int:
    return sum(estimate_tokens(message_text(m)) for m in msgs)


def big_rounds(n: int, size: int, *, talk: int = 0) -> list[Message]:
    """A prompt, then ``n`` rounds each reading one file of ``size`` characters (an
    untiered result) with ``talk`` characters of words in each reply, then a last reply."""
    msgs = [Message("user", "read the files")]
    for k in range(n):
        call = ToolCall(f"b{k}", "execute_code", json.dumps({"code": f"cat f{k}"}))
        msgs.append(Message("assistant", "w" * talk, tool_calls=(call,)))
        msgs.append(Message("tool", f"f{k}\n" + "x" * size, tool_call_id=call.id, name=call.name))
    msgs.append(Message("assistant", "all read"))
    return msgs


def test_big_results_in_the_hot_zone_are_reduced_until_the_history_fits() -> None:
    """Eight verbatim messages can hold more than the trigger itself: then the results
    the model has seen are reduced, oldest first, and only as many as needed."""
    msgs = big_rounds(10, 8000)
    state = TaskState(goal="read the files")
    free = plan(msgs, state)
    assert tokens_of(C.build(free, None, reason="x").messages) > 6000
    p = plan(msgs, state, budget=3000)
    assert p.hot_start == free.hot_start  # the calls stay
    res = C.build(p, None, reason="x")
    assert tokens_of(res.messages) <= 3000 and problems(res.messages) == []
    reduced = sorted(p.summarize)
    assert reduced and reduced == sorted(p.summarize - free.summarize)
    hot_results = [i for i in range(p.hot_start, len(msgs)) if msgs[i].role == "tool"]
    assert reduced == hot_results[: len(reduced)]  # the oldest ones
    assert len(reduced) < len(hot_results)  # no more than needed
    # the model is asked to summarize them
    assert all(f"[summarize: id={msgs[i].tool_call_id}]" in p.transcript for i in reduced)


def test_the_hot_zone_is_cut_by_whole_groups_until_it_fits() -> None:
    msgs = big_rounds(10, 100, talk=3000)  # the words themselves are big
    state = TaskState(goal="read the files")
    free = plan(msgs, state)
    p = plan(msgs, state, budget=2000)
    assert p.hot_start > free.hot_start and msgs[p.hot_start].role != "tool"
    res = C.build(p, None, reason="x")
    assert tokens_of(res.messages) <= 2000 and problems(res.messages) == []
    # one group earlier would not have fitted: cut no more than needed
    earlier = max(i for i in range(p.hot_start) if msgs[i].role != "tool")
    assert tokens_of(res.messages) + tokens_of(msgs[earlier : p.hot_start]) > 2000
    # the last group stays, whatever the budget
    last = plan(msgs, state, budget=1)
    assert last.hot_start == len(msgs) - 1
    unseen = msgs[:-1]  # ends with a call and its result, which the model has not seen
    tight = plan(unseen, state, budget=1)
    assert tight.hot_start == len(unseen) - 2 and not tight.summarize
    assert problems(C.build(tight, None, reason="x").messages) == []


def test_budget_for() -> None:
    assert C.budget_for(100_000, 2_000) == 28_000
    assert C.budget_for(100_000, 50_000) == 1  # the overhead alone is over: cut to the bone
    assert C.budget_for(0, 2_000) == 0  # context unknown: no bound


def test_the_hot_zone_never_splits_a_tool_round() -> None:
    # 6 tool results in the last 8 messages: the boundary moves back to their call.
    msgs = [Message("user", "go"), *tool_round(0, "file_write"), Message("assistant", "mid")]
    msgs += tool_round(1, *["file_write"] * 6)  # assistant + 6 results
    msgs += [Message("assistant", "done")]
    p = plan(msgs, TaskState())
    assert msgs[len(msgs) - HOT].tool_calls  # the last 8 start at the call: no move
    assert p.hot_start == len(msgs) - HOT == 4
    msgs += [Message("user", "more")]  # now the last 8 start at a tool result
    p = plan(msgs, TaskState())
    assert msgs[len(msgs) - HOT].role == "tool"
    assert p.hot_start == 4 and msgs[4].tool_calls  # back to the assistant with the calls
    assert len(msgs) - p.hot_start == 9


def test_a_round_bigger_than_the_hot_zone_is_kept_whole() -> None:
    msgs = [
        Message("user", "go"),
        *tool_round(0, "file_write"),
        *tool_round(1, *["file_write"] * 12),
    ]
    p = plan(msgs, TaskState())
    assert p.hot_start == 3 and len(msgs) - p.hot_start == 13
    res = C.build(p, C.parse_answer(answer()))
    assert problems(res.messages) == []


def test_results_the_model_has_not_seen_stay_verbatim() -> None:
    msgs = long_conversation(12)[:-1]  # ends with the results of the last round: unseen
    assert msgs[-1].role == "tool"
    last = max(i for i, m in enumerate(msgs) if m.role == "assistant")
    p = plan(msgs, TaskState())
    assert all(i < last for i in p.summarize | p.collapse)
    res = C.build(p, C.parse_answer(answer()))
    assert res.messages[-(len(msgs) - last) :] == msgs[last:]


def test_warm_results_without_a_summary_are_reduced_mechanically() -> None:
    msgs = long_conversation()
    p = plan(msgs, TaskState())
    assert p.summarize
    ids = hot_ids(p)
    res = C.build(
        p, C.parse_answer(answer(results={ids[0]: "the logs say OK", "zzz": "unknown id"}))
    )
    by_id = {m.tool_call_id: m for m in res.messages if m.role == "tool"}
    assert (
        by_id[ids[0]].content
        == "[summarize_logs result, summarized at compaction: the logs say OK]"
    )
    for i in ids[1:]:
        assert by_id[i].content.startswith(
            "[summarize_logs result, reduced at compaction: 'line 0 of"
        )
        assert "40 lines" in by_id[i].content


def test_nothing_to_compact() -> None:
    msgs = [Message("user", "hi"), Message("assistant", "hello")]
    with pytest.raises(NothingToCompact, match="nothing to compact"):
        plan(msgs, TaskState())
    with pytest.raises(NothingToCompact, match="nothing to compact"):
        plan([], TaskState())
    with pytest.raises(NothingToCompact):  # within the budget, it stays so
        plan(msgs, TaskState(), budget=1000)


def test_open_tool_calls_are_refused_before_asking() -> None:
    msgs = long_conversation()
    msgs.append(Message("assistant", tool_calls=(ToolCall("open", "file_read", "{}"),)))
    with pytest.raises(CompactionFailed, match="would not be a valid history"):
        plan(msgs, TaskState())


def test_the_transcript_can_be_bounded() -> None:
    msgs = long_conversation()
    full = plan(msgs, TaskState()).transcript
    p = plan(msgs, TaskState(), max_chars=6000)
    assert len(p.transcript) <= 6000 < len(full)
    assert p.transcript.startswith("[the oldest ")
    assert HOT_MARK in p.transcript
    assert p.transcript.endswith(full[-200:])


def test_problems_finds_what_a_provider_rejects() -> None:
    call = ToolCall("a", "t", "{}")
    ok = [
        Message("user", "x"),
        Message("assistant", tool_calls=(call,)),
        Message("tool", "r", tool_call_id="a"),
    ]
    assert problems(ok) == []
    assert problems(ok[1:])  # starts with an assistant
    assert problems([ok[0], ok[2]])  # a result without its call
    assert problems(ok[:2])  # a call left unanswered at the end
    assert problems([*ok[:2], Message("user", "y"), ok[2]])  # answered too late
    assert problems([*ok, ok[2]])  # answered twice
    dup = Message("assistant", tool_calls=(call, call))
    assert problems([ok[0], dup, ok[2], ok[2]])


def test_checkpoint_is_a_fresh_history_that_inherits_the_task_state() -> None:
    s = TaskState(
        goal="port the lexer", plan_step="write tests", decisions=("use re2", "no globals")
    )
    msgs = checkpoint(s)
    assert problems(msgs) == []
    cold, warm = msgs
    assert cold.content.startswith("[ollie: checkpoint]")
    assert from_json(cold.content.split("\n", 1)[1]) == msgspec.structs.replace(s, decisions=())
    assert warm.content.splitlines()[1:] == ["- use re2", "- no globals"]
    assert checkpoint(TaskState(goal="g")) == [checkpoint(TaskState(goal="g"))[0]]


# ---- the snapshot writer ----------------------------------------------------------------


class Failing(Sequence[Message]):
    """A history whose iteration breaks half-way: a write that fails in the middle."""

    def __init__(self, msgs: list[Message]) -> None:
        self.msgs = msgs

    def __len__(self) -> int:
        return len(self.msgs)

    @overload
    def __getitem__(self, i: int) -> Message: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Message]: ...
    def __getitem__(self, i: int | slice) -> Message | Sequence[Message]:
        return self.msgs[i]

    def __iter__(self) -> Iterator[Message]:
        yield from self.msgs[:3]
        raise OSError(28, "No space left on device")


def test_snapshot_is_atomic(tmp_path: Path) -> None:
    msgs = long_conversation(5)
    with pytest.raises(OSError, match="No space"):
        write_snapshot(tmp_path, 1, Failing(msgs), "s", ["d"])
    assert os.listdir(tmp_path) == []  # no partial snapshot, no temp dir
    write_snapshot(tmp_path, 1, msgs, "s", ["d"])
    with pytest.raises(FileExistsError):
        write_snapshot(tmp_path, 1, [], "other", [])
    assert read_snapshot(tmp_path / "1") == msgs
    assert (tmp_path / "1" / "summary").read_text() == "s\n"
    # a temp dir left by a crash is cleared, and never counted as a snapshot
    (tmp_path / ".2.tmp").mkdir()
    (tmp_path / ".2.tmp" / "before.jsonl").write_text("torn")
    assert next_snapshot_number(tmp_path) == 2
    write_snapshot(tmp_path, 2, msgs[:2], "s2", [])
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]
    assert read_snapshot(tmp_path / "2") == msgs[:2]
    assert (tmp_path / "2" / "dropped").read_text() == ""


async def test_history_replace_forgets_the_old_context_size() -> None:
    h = History(long_conversation())
    h.totals.add(Usage(input_tokens=90_000, output_tokens=10), 0.0, False)
    assert should_compact(h.totals.last_context_tokens or h.estimate(), 100_000)
    _, res, _ = await run(h.messages, answer())
    h.replace(res.messages)
    assert h.messages == res.messages
    assert h.totals.last_context_tokens == 0 and h.totals.input_tokens == 90_000
    assert not should_compact(h.totals.last_context_tokens or h.estimate(), 100_000)
