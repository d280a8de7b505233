"""Message history and token accounting of one agent."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import msgspec

from olliefs.backend.base import Message, Usage, WireCache


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
    """The fallback estimate of SPEC 4: UTF-8 bytes / 4. (An ASCII text's length is its
    byte count, and Python knows a str is ASCII without looking: a 10 MB reply is not
    encoded just to be counted.)"""
    return ((len(text) if text.isascii() else len(text.encode())) + 3) // 4


def message_text(m: Message) -> str:
    return m.content + m.reasoning + "".join(c.name + c.arguments for c in m.tool_calls)


IMAGE_TOKENS = 1600
"""What an image is counted as: about what the providers bill for one of a megapixel
(Anthropic: width x height / 750, scaled down to 1.15 megapixels at most)."""


def message_tokens(m: Message) -> int:
    """The estimate of one message: its text, and its images."""
    return estimate_tokens(message_text(m)) + IMAGE_TOKENS * len(m.images)


class History:
    """An agent's messages, with what every request needs of them kept up to date.

    A turn asks the history for its size (the compaction trigger, when the provider
    reported none) and for the messages as the model sees them; both walked the whole
    history, so a session's 500th turn paid for its first 499 again. Here the figures
    follow the changes: an append adds one message's estimate, a cut drops a tail of
    running sums, a replace starts over. The size is that of the messages as sent
    (``for_model``): a cold result counts as its collapsed line once the model has
    answered after it, which the append of that answer accounts for. ``messages`` is
    read freely but changed only through ``append``, ``truncate``, ``replace`` and
    ``clear``; a change made to the list behind the history's back is noticed by its
    length and recounted whole.
    """

    def __init__(self, messages: list[Message] | None = None) -> None:
        self.messages: list[Message] = []
        self.totals = Totals()
        self._sums: list[int] = []  # _sums[i]: the estimate of messages[: i + 1]
        self._cold: list[int] = []  # indices of cold tool results, ascending
        self._last_assistant = -1
        self._savings: list[int] = []  # per cold result: its estimate less its collapsed one
        self._saved = 0  # the savings of the first _saved_upto cold results (the collapsed)
        self._saved_upto = 0
        self._collapsed: dict[int, tuple[Message, Message]] = {}  # id -> (cold, collapsed)
        self._texts: dict[int, tuple[Message, Message]] = {}  # id -> (it, without images)
        self.wire = WireCache()  # its encoded messages, for the backend (``Backend.stream``)
        # The model refused a request with images: tool results go as their text only
        # (their text names each image's file), for the rest of the session's run.
        self.text_only = False
        if messages:
            self.replace(messages)

    def append(self, m: Message) -> None:
        self._fresh()
        self.messages.append(m)
        self._count(len(self.messages) - 1, m)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` messages (a rewind)."""
        self._fresh()
        del self.messages[n:]
        del self._sums[n:]
        while self._cold and self._cold[-1] >= n:
            self._cold.pop()
            self._savings.pop()
        if self._last_assistant >= n:
            self._last_assistant = next(
                (i for i in range(n - 1, -1, -1) if self.messages[i].role == "assistant"), -1
            )
        self._saved_upto = bisect.bisect_left(self._cold, self._last_assistant)
        self._saved = sum(self._savings[: self._saved_upto])

    def clear(self) -> None:
        self.replace([])

    def replace(self, messages: list[Message]) -> None:
        """Install a compacted history. The provider-reported size of the last request
        described the old history, so it is forgotten: until the next request reports
        one, ``estimate()`` is the size (else a 50% trigger would fire again at once)."""
        self.messages = list(messages)
        self.totals.last_context_tokens = 0
        self._recount()

    def estimate(self) -> int:
        """The estimate of the messages as sent (``for_model``)."""
        self._fresh()
        return (self._sums[-1] if self._sums else 0) - self._saved

    def for_model(self) -> list[Message]:
        """The messages as the model gets them: cold tool results collapsed (SPEC 4).

        A cold result (``file_read``, ``memory_recall``) is shown verbatim to the model for
        the one request that follows it; once the model has answered after it, it is
        replaced by a one-line summary in every later request. The history itself keeps
        the full text (``context`` shows it, compaction may use it). A collapsed message
        is made once and then the same object every time, so what a backend derives from
        a message (its encoded wire form) is derived once.
        """
        self._fresh()
        out = list(self.messages)
        for i in self._cold:
            if i >= self._last_assistant:
                break
            m = out[i]
            known = self._collapsed.get(id(m))
            if known is None or known[0] is not m:
                known = (m, msgspec.structs.replace(m, content=collapse(m), images=()))
                self._collapsed[id(m)] = known
            out[i] = known[1]
        if self.text_only:
            for i, m in enumerate(out):
                if m.images:
                    known = self._texts.get(id(m))
                    if known is None or known[0] is not m:
                        known = (m, msgspec.structs.replace(m, images=()))
                        self._texts[id(m)] = known
                    out[i] = known[1]
        return out

    def _count(self, i: int, m: Message) -> None:
        text = message_text(m)
        tokens = estimate_tokens(text) + IMAGE_TOKENS * len(m.images)
        self._sums.append((self._sums[-1] if self._sums else 0) + tokens)
        if m.role == "assistant":
            self._last_assistant = i
            cold, savings = self._cold, self._savings
            while self._saved_upto < len(cold) and cold[self._saved_upto] < i:
                self._saved += savings[self._saved_upto]
                self._saved_upto += 1
        elif m.role == "tool" and m.tier == "cold":
            self._cold.append(i)
            self._savings.append(tokens - estimate_tokens(collapse(m) + text[len(m.content) :]))

    def _recount(self) -> None:
        self._sums, self._cold, self._last_assistant = [], [], -1
        self._savings, self._saved, self._saved_upto = [], 0, 0
        live = {id(m) for m in self.messages}
        self._collapsed = {k: v for k, v in self._collapsed.items() if k in live}
        self._texts = {k: v for k, v in self._texts.items() if k in live}
        for i, m in enumerate(self.messages):
            self._count(i, m)

    def _fresh(self) -> None:
        if len(self._sums) != len(self.messages):
            self._recount()


def collapse(m: Message) -> str:
    lines = m.content.count("\n") + 1 if m.content else 0
    size = len(m.content.encode())
    return f"[{m.name} result collapsed: {lines} lines, {size} bytes; call it again to see it]"
