"""History's running figures against the plain definitions, under any sequence of changes.

The history keeps its token estimate, its last assistant message and its cold results up
to date as it changes, instead of walking every message at every turn; these tests say it
always answers what the walk would.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from olliefs.agent.history import History, collapse, estimate_tokens, message_text
from olliefs.backend.base import Message, ToolCall


def naive_estimate(msgs: list[Message]) -> int:
    return sum(estimate_tokens(message_text(m)) for m in msgs)


def naive_for_model(msgs: list[Message]) -> list[Message]:
    last = max((i for i, m in enumerate(msgs) if m.role == "assistant"), default=-1)
    return [
        Message(m.role, collapse(m), m.reasoning, m.tool_calls, m.tool_call_id, m.name, m.tier)
        if m.role == "tool" and m.tier == "cold" and i < last
        else m
        for i, m in enumerate(msgs)
    ]


messages = st.one_of(
    st.builds(Message, st.just("user"), st.text(max_size=30)),
    st.builds(
        Message,
        st.just("assistant"),
        st.text(max_size=30),
        st.text(max_size=10),
        st.just((ToolCall("c1", "file_read", '{"path": "x"}'),)),
    ),
    st.builds(
        lambda text, tier: Message("tool", text, tool_call_id="c1", name="file_read", tier=tier),
        st.text(max_size=60),
        st.sampled_from(["cold", "warm", "hot", ""]),
    ),
)

ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), messages),
        st.tuples(st.just("truncate"), st.floats(0, 1)),  # where, as a share of the length
        st.tuples(st.just("replace"), st.lists(messages, max_size=8)),
        st.tuples(st.just("clear"), st.none()),
        st.tuples(st.just("behind its back"), messages),  # a direct append to the list
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops)
def test_figures_follow_every_change(ops: list[tuple[str, object]]) -> None:
    h = History()
    model: list[Message] = []
    for op, arg in ops:
        if op == "append":
            assert isinstance(arg, Message)
            h.append(arg)
            model.append(arg)
        elif op == "truncate":
            assert isinstance(arg, float)
            cut = int(len(model) * arg)
            h.truncate(cut)
            del model[cut:]
        elif op == "replace":
            assert isinstance(arg, list)
            h.replace(arg)
            model = list(arg)
        elif op == "clear":
            h.clear()
            model = []
        else:
            assert isinstance(arg, Message)
            h.messages.append(arg)
            model.append(arg)
        assert h.messages == model
        assert h.estimate() == naive_estimate(naive_for_model(model))  # as sent
        first = h.for_model()
        assert first == naive_for_model(model)
        # a collapsed message is the same object at every request
        assert all(a is b for a, b in zip(first, h.for_model(), strict=True))


def test_a_cold_result_is_whole_until_the_model_answered_after_it() -> None:
    h = History()
    h.append(Message("user", "read it"))
    h.append(Message("assistant", "", tool_calls=(ToolCall("c1", "file_read", "{}"),)))
    cold = Message("tool", "line\n" * 100, tool_call_id="c1", name="file_read", tier="cold")
    h.append(cold)
    assert h.for_model()[-1] is cold  # the request right after it sees it verbatim
    h.append(Message("assistant", "done"))
    assert h.for_model()[2].content.startswith("[file_read result collapsed: 101 lines")
    assert h.messages[2] is cold  # the history keeps the text


def test_a_cut_forgets_the_cold_results_it_removed() -> None:
    """A rewind past a cold result, then new messages at its place: nothing there may
    be collapsed (hypothesis rarely finds this order by itself)."""
    h = History()
    h.append(Message("user", "a"))
    h.append(Message("tool", "x" * 50, tool_call_id="c", name="file_read", tier="cold"))
    h.truncate(1)
    h.append(Message("user", "b"))
    h.append(Message("assistant", "ok"))
    assert h.for_model() == h.messages
    assert h.estimate() == naive_estimate(h.messages)


def test_the_estimate_is_of_what_is_sent() -> None:
    """A collapsed cold result counts as its one line, not as the text it replaced."""
    h = History()
    h.append(Message("user", "read it"))
    h.append(Message("assistant", "", tool_calls=(ToolCall("c1", "file_read", "{}"),)))
    h.append(Message("tool", "x" * 40_000, tool_call_id="c1", name="file_read", tier="cold"))
    assert h.estimate() > 10_000  # the next request sends it whole
    h.append(Message("assistant", "done"))
    assert h.estimate() == naive_estimate(h.for_model()) < 100
