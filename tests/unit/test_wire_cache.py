"""WireCache gives the bytes a plain encoding would, whatever the history did in between."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from olliefs.backend import ollama, openai
from olliefs.backend.base import GenerationParams, Message, ToolCall, WireCache

messages = st.one_of(
    st.builds(Message, st.sampled_from(["user", "assistant", "system"]), st.text(max_size=20)),
    st.builds(
        lambda text: Message("assistant", text, tool_calls=(ToolCall("c", "t", "{}"),)),
        st.text(max_size=5),
    ),
    st.builds(lambda n: Message("tool", "x" * n, tool_call_id="c", name="t"), st.integers(0, 300)),
)


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["append", "cut", "copy", "swap wire"]), messages, st.floats(0, 1)
        ),
        max_size=30,
    )
)
def test_same_bytes_as_plain_encoding(steps: list[tuple[str, Message, float]]) -> None:
    cache = WireCache(max_bytes=200)  # small: messages over it are encoded every time
    history: list[Message] = []
    mod = openai
    for op, m, where in steps:
        if op == "append":
            history = [*history, m]
        elif op == "cut":  # a rewind
            history = history[: int(len(history) * where)]
        elif op == "copy":  # equal messages that are other objects (a restore)
            history = [msgspec.structs.replace(x) for x in history]
        else:  # ctl backend: another wire format
            mod = ollama if mod is openai else openai
        got = cache.encode(history, mod.wire_message)
        assert [bytes(r) for r in got] == [
            msgspec.json.encode(mod.wire_message(x)) for x in history
        ]


def test_request_body_through_the_cache() -> None:
    cache = WireCache()
    history = [Message("system", "s"), Message("user", "u"), Message("assistant", "a")]
    plain = openai.request_body("m", history, [], GenerationParams())
    cached = openai.request_body("m", history, [], GenerationParams(), wire=cache)
    assert msgspec.json.encode(cached) == msgspec.json.encode(plain)
    history.append(Message("user", "again"))
    again = openai.request_body("m", history, [], GenerationParams(), wire=cache)
    assert msgspec.json.decode(msgspec.json.encode(again))["messages"][-1] == {
        "role": "user",
        "content": "again",
    }
