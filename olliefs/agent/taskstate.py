"""TaskState: what the agent is doing, inferred after every tool round (the seed's overlay).

The model's history grows without bound; TaskState is the small, structured record of
where the work stands that survives everything else: it is the session's ``taskstate``
file (JSON), the text re-injected every ten tool rounds (``safety``), the cold zone of a
compaction (``compact``) and the whole of a checkpoint handed to a subagent.

Fields (all optional; an empty value means "not known"):

``goal``
    What the user wants overall. Set from the first line of the turn's prompt when still
    empty (``start_turn``); a compaction replaces it with the model's own statement.
``progress`` / ``next``
    Where the work stands and the next thing to do, in the compaction model's words.
``plan_step``
    The step being worked on (see "PlanStep" below).
``last_action``
    The most recent tool call and the start of its result, on one line (see below).
``rounds``
    Tool rounds this session has run (every turn counts; never reset).
``errors``
    Consecutive tool rounds with at least one failed call, across turns; a round without
    a failure resets it to 0. Informational: the safety limits keep their own per-turn
    counters (``safety``), so what the model is told and what stops a turn cannot drift.
``decisions``
    The warm index: one-line decisions worth keeping, oldest first, at most
    ``MAX_DECISIONS``. Only a compaction writes them.
``files``
    Files the agent changed (write/edit calls), most recent last, at most ``MAX_FILES``.
``open_questions``
    Questions the compaction model found unanswered.

Inference is deterministic: the same state, round and plan give the same result, so the
tests can pin every rule.

LastAction
    ``name(args) -> result`` for the last call of the round, in the model's order: the
    arguments as one-line JSON cut at ``ARGS_CHARS``, the result with its whitespace
    folded to single spaces and cut at ``RESULT_CHARS``, prefixed ``error: `` when the call
    failed. Two rounds that did the same thing with the same outcome have equal
    LastActions, which is what stall detection compares.

PlanStep, first rule that applies:
    1. The session's ``plan`` file holds a markdown checklist (``- [ ]`` / ``- [x]``, also
       with ``*`` or ``+``): the text of its first unchecked item, or ``""`` when every
       item is checked. The file is authoritative once it has a checklist.
    2. The reply of this round has a ``PLAN:`` block: its first unchecked checklist item;
       or, with no checkboxes, its first list item not marked done (``~~struck~~``,
       ``(done)``, ``✓``/``✔``/``✅``); or the text after ``PLAN:`` on the same line.
    3. Otherwise the previous PlanStep stays.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from olliefs.agent.dispatch import ERROR_MARK, one_line_args
from olliefs.backend.base import Message, ToolCall

MAX_DECISIONS = 10
MAX_FILES = 20
ARGS_CHARS = 120
RESULT_CHARS = 160
GOAL_CHARS = 300

# Tools whose ``path``-like argument names a file the agent changed.
_WRITE_HINTS = ("write", "edit", "patch", "create", "move", "rename", "delete")
_PATH_KEYS = ("path", "file_path", "file", "filename", "target")


class TaskState(msgspec.Struct, frozen=True, kw_only=True):
    goal: str = ""
    progress: str = ""
    next: str = ""
    plan_step: str = ""
    last_action: str = ""
    rounds: int = 0
    errors: int = 0
    decisions: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    open_questions: tuple[str, ...] = ()


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(TaskState)


def to_json(state: TaskState) -> str:
    """The ``taskstate`` file: one JSON object, pretty enough for ``cat``, then a newline."""
    return msgspec.json.format(_encoder.encode(state), indent=2).decode() + "\n"


def from_json(data: bytes | str) -> TaskState:
    """Inverse of ``to_json`` (journal restore); raises ``msgspec.ValidationError``."""
    return _decoder.decode(data)


@dataclass(frozen=True)
class Round:
    """One tool round: the reply that asked for tools and the results that answered it."""

    reply: Message
    results: tuple[Message, ...]

    @property
    def failed(self) -> bool:
        """At least one call of the round failed (its result carries dispatch's mark)."""
        return any(is_error(m) for m in self.results)

    @property
    def planned(self) -> bool:
        """The reply wrote a ``PLAN:`` block (the replan gate's reset)."""
        return has_plan_block(self.reply.content)


def last_round(messages: Sequence[Message]) -> Round | None:
    """The latest tool round of a history: the last assistant message with tool calls and
    the tool results that follow it; None if the history has no tool round."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.role == "assistant" and m.tool_calls:
            results = []
            for r in messages[i + 1 :]:
                if r.role != "tool":
                    break
                results.append(r)
            return Round(m, tuple(results))
    return None


def is_error(m: Message) -> bool:
    return m.role == "tool" and m.content.startswith(ERROR_MARK)


def start_turn(state: TaskState, prompt: str) -> TaskState:
    """At a turn's start: the goal is the prompt's first line when none is known yet."""
    if state.goal:
        return state
    first = next((ln.strip() for ln in prompt.splitlines() if ln.strip()), "")
    return msgspec.structs.replace(state, goal=cut(first, GOAL_CHARS))


def infer(state: TaskState, rnd: Round, plan_text: str = "") -> TaskState:
    """The state after ``rnd``; ``plan_text`` is the session's ``plan`` file."""
    answers = {m.tool_call_id: m for m in rnd.results}
    last_action = state.last_action
    if rnd.reply.tool_calls:
        call = rnd.reply.tool_calls[-1]
        last_action = describe(call, answers.get(call.id))
    files = list(state.files)
    for call in rnd.reply.tool_calls:
        path = touched_file(call)
        if path is not None and not is_error(answers.get(call.id, Message("tool"))):
            if path in files:
                files.remove(path)
            files.append(path)
    return msgspec.structs.replace(
        state,
        last_action=last_action,
        plan_step=plan_step(state.plan_step, rnd.reply.content, plan_text),
        rounds=state.rounds + 1,
        errors=state.errors + 1 if rnd.failed else 0,
        files=tuple(files[-MAX_FILES:]),
    )


def describe(call: ToolCall, result: Message | None) -> str:
    args = cut(one_line_args(call.arguments), ARGS_CHARS)
    if result is None:
        return f"{call.name}({args}) -> (no result)"
    text = result.content
    prefix = ""
    if text.startswith(ERROR_MARK):
        text, prefix = text[len(ERROR_MARK) :], "error: "
    return f"{call.name}({args}) -> {prefix}{cut(fold(text), RESULT_CHARS)}"


def touched_file(call: ToolCall) -> str | None:
    """The file a write-like call changes, from its ``path``-like argument."""
    if not any(h in call.name.lower() for h in _WRITE_HINTS):
        return None
    try:
        args = msgspec.json.decode(call.arguments or "{}")
    except msgspec.DecodeError:
        return None
    if not isinstance(args, dict):
        return None
    for key in _PATH_KEYS:
        value = args.get(key)
        if isinstance(value, str) and value.strip():
            return cut(value.strip(), 200)
    return None


# ---- PlanStep ---------------------------------------------------------------------------

_CHECK = re.compile(r"^\s*[-*+]\s+\[([ xX])\]\s*(.*?)\s*$")
_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+(.*?)\s*$")
# A PLAN: line, also as markdown emphasis or a heading: "PLAN:", "**PLAN:**", "## PLAN:".
_PLAN = re.compile(r"^\s*(?:#+\s*)?(?:\*\*|__)?PLAN(?:\*\*|__)?:(?:\*\*|__)?\s*(.*?)\s*$")
_DONE = re.compile(r"^~~.*~~$|\((?:done|finished|complete[d]?)\)|[✓✔✅]", re.IGNORECASE)


def has_plan_block(text: str) -> bool:
    """The text has a line starting with ``PLAN:`` (what the replan gate looks for)."""
    return any(_PLAN.match(ln) for ln in text.splitlines())


def checklist_step(text: str) -> str | None:
    """First unchecked item of a markdown checklist; "" when all are checked; None when
    the text has no checklist at all."""
    seen = False
    for ln in text.splitlines():
        m = _CHECK.match(ln)
        if m is None:
            continue
        seen = True
        if m.group(1) == " ":
            return cut(m.group(2), GOAL_CHARS)
    return "" if seen else None


def plan_block_step(text: str) -> str | None:
    """The heuristic step of the last ``PLAN:`` block in ``text``; None without a block."""
    lines = text.splitlines()
    start = None
    for i, ln in enumerate(lines):
        if _PLAN.match(ln):
            start = i
    if start is None:
        return None
    head = _PLAN.match(lines[start])
    inline = head.group(1) if head else ""
    block: list[str] = []
    for ln in lines[start + 1 :]:
        if not ln.strip():
            if block:
                break
            continue
        if _CHECK.match(ln) or _ITEM.match(ln):
            block.append(ln)
        elif block:
            break  # the list ended: prose after it is not part of the plan
    checked = checklist_step("\n".join(block))
    if checked is not None:
        return checked  # the first unchecked item, or "" when every item is checked
    items = [m.group(1) for m in map(_ITEM.match, block) if m and m.group(1)]
    for item in items:
        if not _DONE.search(item):
            return cut(item, GOAL_CHARS)
    if inline:
        return cut(inline, GOAL_CHARS)
    return "" if items else None  # all done, or an empty block that says nothing


def plan_step(previous: str, reply_text: str, plan_text: str) -> str:
    step = checklist_step(plan_text)
    if step is not None:
        return step
    step = plan_block_step(reply_text)
    if step is not None:
        return step
    return previous


# ---- text helpers -----------------------------------------------------------------------


def fold(text: str) -> str:
    """Whitespace folded to single spaces: one line."""
    return " ".join(text.split())


def cut(text: str, limit: int) -> str:
    text = fold(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"
