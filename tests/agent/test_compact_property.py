"""Property: whatever the shape of a (provider-valid) history, compaction gives a valid
history, keeps the hot zone, and its snapshot reads back as the very same messages."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import trio
from hypothesis import HealthCheck, given, settings

from olliefs.agent import compact as C
from olliefs.agent.compact import CompactionFailed, plan, problems, read_snapshot, write_snapshot
from olliefs.agent.history import estimate_tokens, message_text
from olliefs.agent.taskstate import MAX_DECISIONS, TaskState
from olliefs.backend.base import Message, ToolCall
from tests.agent.scripted import Reply, ScriptedBackend

# Any text msgspec can carry: newlines, tabs, quotes, non-ASCII, JSON-looking text.
texts = st.one_of(
    st.text(max_size=120),
    st.sampled_from(["", "PLAN:\n- [ ] a", '{"role": "tool"}', "line\n" * 30, '\t\\"\u2028é']),
)
tiers = st.sampled_from(["", "hot", "warm", "cold", "summarized"])


@st.composite
def histories(draw: st.DrawFn) -> list[Message]:
    """user / assistant text / assistant with calls followed by all their results (in any
    order) / injected user lines, in any sequence, starting with a user prompt."""
    msgs = [Message("user", draw(texts))]
    for b in range(draw(st.integers(0, 30))):
        kind = draw(st.sampled_from(["user", "text", "calls", "calls"]))
        if kind == "user":
            msgs.append(Message("user", draw(texts)))
        elif kind == "text":
            msgs.append(Message("assistant", draw(texts), reasoning=draw(texts)))
        else:
            k = draw(st.integers(1, 5))
            calls = tuple(
                ToolCall(f"b{b}c{x}", draw(st.sampled_from(["t", "file_read", "w"])), draw(texts))
                for x in range(k)
            )
            msgs.append(Message("assistant", draw(texts), tool_calls=calls))
            for x in draw(st.permutations(range(k))):
                msgs.append(
                    Message(
                        "tool",
                        draw(texts),
                        tool_call_id=calls[x].id,
                        name=calls[x].name,
                        tier=draw(tiers),
                    )
                )
    return msgs


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=histories(), hot=st.integers(1, 12), summaries=st.booleans(), data=st.data())
def test_compaction_of_any_history_is_valid_and_lossless(
    msgs: list[Message], hot: int, summaries: bool, data: st.DataObject
) -> None:
    assert problems(msgs) == []  # the generator makes what the loop makes
    budget = data.draw(st.sampled_from([0, 0, 1, 60, 400]))
    groups = [i for i, m in enumerate(msgs) if m.role != "tool"]
    try:
        p = plan(
            msgs,
            TaskState(goal="g"),
            "",
            hot=hot,
            max_chars=data.draw(st.sampled_from([0, 500])),
            budget=budget,
        )
    except CompactionFailed as err:
        assert "nothing to compact" in err.reason
        if budget:
            assert len(groups) == 1 or len(msgs) <= hot
        else:
            assert len(msgs) <= hot or msgs[max(0, len(msgs) - hot)].role == "tool"
        return
    results = {msgs[i].tool_call_id: "s" for i in p.summarize} if summaries else {}
    doc = {
        "goal": "g",
        "state": "s",
        "decisions": data.draw(st.lists(texts, max_size=15)),
        "next": "",
        "results": results,
    }
    backend = ScriptedBackend([Reply.text(json.dumps(doc))])
    res = trio.run(C.compact, backend, "m", p)

    new = res.messages
    assert problems(new) == []
    assert new[0].role == "user"
    kept = new[len(new) - (len(msgs) - p.hot_start) :]
    assert kept[0].role != "tool"
    assert len(kept) >= min(hot, len(msgs) - p.hot_start)
    if budget:  # the hot zone fits, or it is the last group alone
        size = sum(estimate_tokens(message_text(m)) for m in kept)
        assert size <= budget or p.hot_start == groups[-1], (size, budget)
    for i, m in zip(range(p.hot_start, len(msgs)), kept, strict=True):
        old = msgs[i]
        assert (m.role, m.tool_calls, m.tool_call_id, m.name) == (
            old.role,
            old.tool_calls,
            old.tool_call_id,
            old.name,
        )
        if i in p.summarize or i in p.collapse:
            assert m.tier == C.SUMMARIZED and "\n" not in m.content
        else:
            assert m == old
    assert len(res.dropped) == p.hot_start + len(p.summarize) + len(p.collapse)
    assert all("\n" not in line and line.count("\t") >= 2 for line in res.dropped)
    assert len(res.state.decisions) <= MAX_DECISIONS

    with tempfile.TemporaryDirectory() as d:
        path = write_snapshot(Path(d), 1, p.before, res.summary, res.dropped)
        assert read_snapshot(path) == msgs
        assert (path / "dropped").read_text().splitlines() == res.dropped
