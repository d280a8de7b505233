"""The backend contract's types: opaque provider data survives history and the journal;
the Usage convention drives the cost of every provider."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from olliefs.agent.cost import request_cost
from olliefs.backend.base import GenerationParams, Message, StreamEvent, ToolCall, Usage
from olliefs.session import persist

THINKING = {
    "anthropic": {
        "thinking": [
            {"type": "thinking", "thinking": "let me see\n", "signature": "EqQBCgIYAh=="},
            {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3p"},
        ]
    },
    "gemini": {"signatures": [{"call": "c1", "signature": "CiIBVKhc"}]},
}
REPLY = Message(
    "assistant",
    "calling",
    reasoning="let me see\n",
    tool_calls=(ToolCall("c1", "ls", '{"path": "."}'),),
    provider_data=THINKING,
)


def test_provider_data_round_trips_through_msgspec() -> None:
    assert msgspec.json.decode(msgspec.json.encode(REPLY), type=Message) == REPLY
    assert msgspec.json.encode(Message("user", "hi")) == b'{"role":"user","content":"hi"}'


def test_provider_data_survives_the_journal(tmp_path: Path) -> None:
    journal = persist.Journal(tmp_path / "s.journal")
    journal.append(persist.Msg(REPLY))
    journal.append(persist.Msg(Message("tool", "a", tool_call_id="c1")))
    journal.close()
    records = persist.read_journal(tmp_path / "s.journal")
    assert [r.msg for r in records if isinstance(r, persist.Msg)] == [
        REPLY,
        Message("tool", "a", tool_call_id="c1"),
    ]


def test_a_done_event_carries_provider_data() -> None:
    event = StreamEvent("done", provider_data=THINKING)
    assert msgspec.json.decode(msgspec.json.encode(event), type=StreamEvent) == event
    assert StreamEvent("done").provider_data == {}


def test_thinking_budget_is_a_generation_parameter() -> None:
    assert msgspec.to_builtins(GenerationParams(thinking_budget=2048)) == {"thinking_budget": 2048}


# ---- cost -------------------------------------------------------------------------------------

M = 1_000_000


def test_input_tokens_include_cached_and_created_ones() -> None:
    """claude-sonnet-4: $3 in, $15 out. 1M input of which 600k cache reads (10%) and
    200k cache writes (125%): 200k * 3 + 600k * 0.3 + 200k * 3.75 = 1.53 dollars."""
    usage = Usage(
        input_tokens=M, output_tokens=0, cached_input_tokens=600_000, cache_creation_tokens=200_000
    )
    assert request_cost("claude-sonnet-4-5", usage, "anthropic") == pytest.approx(1.53)


@pytest.mark.parametrize(
    ("model", "provider", "expected"),
    [
        ("gpt-4o", "openai", 2.50 * 0.5 + 2.50 * 0.5 * 0.5 + 10.0),  # cached at 50%
        ("anthropic/claude-sonnet-4", "openai", 3 * 0.5 + 3 * 0.5 * 0.1 + 15),  # Claude: 10%
        ("gemini-2.5-flash", "gemini", 0.30 * 0.5 + 0.30 * 0.5 * 0.5 + 2.50),
        ("claude-opus-4-5", "anthropic", 5 * 0.5 + 5 * 0.5 * 0.1 + 25),
        ("llama3.2", "ollama", 0.0),
        ("gpt-4o", "copilot", 0.0),  # a subscription: not billed per token
        ("claude-sonnet-4", "kiro", 0.0),
        ("my-local-model", "openai", 0.0),
    ],
)
def test_cost_per_provider(model: str, provider: str, expected: float) -> None:
    # half the input read from the cache: half at the full price, half at the cached share
    usage = Usage(input_tokens=M, output_tokens=M, cached_input_tokens=M // 2)
    assert request_cost(model, usage, provider) == pytest.approx(expected)


def test_a_reported_cost_wins() -> None:
    usage = Usage(input_tokens=M, output_tokens=M, cost=0.0042)
    assert request_cost("gpt-4o", usage, "openai") == 0.0042
