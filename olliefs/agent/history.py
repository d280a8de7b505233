"""Message history and token accounting of one agent."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from olliefs.backend.base import Message, Usage


@dataclass
class Totals:
    input_tokens: int = 0
    output_tokens: int = 0
    requests: int = 0
    cached_input_tokens: int = 0
    cache_creation_tokens: int = 0
    estimated: bool = False  # some request reported no usage and was estimated
    session_cost: float = 0.0
    last_turn_cost: float = 0.0
    last_context_tokens: int = 0  # input + output of the latest request

    def add(self, usage: Usage, cost: float, estimated: bool) -> None:
        self.input_tokens += usage.input_tokens
        self.output_tokens += usage.output_tokens
        self.cached_input_tokens += usage.cached_input_tokens
        self.cache_creation_tokens += usage.cache_creation_tokens
        self.requests += 1
        self.estimated = self.estimated or estimated
        self.session_cost += cost
        self.last_context_tokens = usage.input_tokens + usage.output_tokens

    def usage_text(self) -> str:
        est = " [estimated]" if self.estimated else ""
        return (
            f"{self.input_tokens} in, {self.output_tokens} out, {self.requests} requests, "
            f"{self.cached_input_tokens} cached{est}\n"
        )

    def cost_text(self) -> str:
        return f"costLast=${self.last_turn_cost:.4f}\ncostSession=${self.session_cost:.4f}\n"


def estimate_tokens(text: str) -> int:
    """The fallback estimate of SPEC 4: UTF-8 bytes / 4."""
    return (len(text.encode()) + 3) // 4


def message_text(m: Message) -> str:
    return m.content + m.reasoning + "".join(c.name + c.arguments for c in m.tool_calls)


@dataclass
class History:
    messages: list[Message] = field(default_factory=list)
    totals: Totals = field(default_factory=Totals)

    def append(self, m: Message) -> None:
        self.messages.append(m)

    def clear(self) -> None:
        self.messages.clear()

    def replace(self, messages: list[Message]) -> None:
        """Install a compacted history. The provider-reported size of the last request
        described the old history, so it is forgotten: until the next request reports
        one, ``estimate()`` is the size (else a 50% trigger would fire again at once)."""
        self.messages = list(messages)
        self.totals.last_context_tokens = 0

    def estimate(self) -> int:
        return sum(estimate_tokens(message_text(m)) for m in self.messages)

    def for_model(self) -> list[Message]:
        """The messages as the model gets them: cold tool results collapsed (SPEC 4).

        A cold result (``file_read``, ``memory_recall``) is shown verbatim to the model for
        the one request that follows it; once the model has answered after it, it is
        replaced by a one-line summary in every later request. The history itself keeps
        the full text (``context`` shows it, compaction may use it).
        """
        last_assistant = max(
            (i for i, m in enumerate(self.messages) if m.role == "assistant"), default=-1
        )
        out: list[Message] = []
        for i, m in enumerate(self.messages):
            if m.role == "tool" and m.tier == "cold" and i < last_assistant:
                m = msgspec.structs.replace(m, content=collapse(m))
            out.append(m)
        return out


def collapse(m: Message) -> str:
    lines = m.content.count("\n") + 1 if m.content else 0
    size = len(m.content.encode())
    return f"[{m.name} result collapsed: {lines} lines, {size} bytes; call it again to see it]"
