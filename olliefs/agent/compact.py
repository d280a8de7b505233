"""Compaction that never loses anything and always shrinks (SPEC 4; the seed's compact.go).

A long session ends at the provider's context limit unless the history shrinks. It
shrinks here by replacing its older part with a summary the compaction model writes,
in three zones::

    cold   1 user message    the TaskState as JSON (goal, progress, next, plan step, ...)
    warm   1 user message    the decision index: one line per decision, at most 10
    hot    the last 8        verbatim, except tool results the model has already seen
           messages, fewer   whose tier is warm (summarized) or cold (collapsed)
           if they are big

"Never loses anything" is a promise about the disk, not the context: before the caller
replaces a single message, ``write_snapshot`` puts the whole pre-compaction history in
``compactions/<n>/before.jsonl``, with ``summary`` (the text that replaced it) and
``dropped`` (one line per message that left the context) beside it, atomically. The
caller's order is therefore fixed::

    p = plan(history.messages, taskstate, focus, budget=...)  # may raise CompactionFailed
    r = await compact(backend, model, p, params, retry=...)   # always a Result
    write_snapshot(dir, n, p.before, r.summary, r.dropped)    # may raise OSError
    history.messages = r.messages; taskstate = r.state        # only now

and any exception before the last line leaves the old history in force.

Decisions this module makes:

* **The hot boundary.** The hot zone is the last ``HOT`` (8) messages, moved back while
  it would start at a tool result, so an assistant message with tool calls always
  travels with all of its results (the zone may then hold more than 8). The new history
  starts with the cold user message, so it never starts with a tool result or an
  assistant message. ``plan`` checks the new history with ``problems`` before any
  request is made and refuses (``CompactionFailed``) one a provider would reject, e.g. a
  history whose last tool calls are still unanswered.
* **A hot zone that fits.** Eight verbatim messages can themselves hold more than the
  trigger (one big file read is enough), and a history that stays above the trigger
  compacts again before every request. Given a ``budget`` (the tokens the new history
  may take: the agent gives ``TARGET``, 30% of the context, less what every request
  sends besides the history), ``plan`` makes the estimate of the new history (cold and
  warm zones from the current TaskState, and the hot zone) fit: first the results the
  model has seen in the hot zone are reduced like warm ones, oldest first (big outputs
  are what fills a context; the calls and the words around them stay), then the
  boundary moves later, a whole group at a time (a message with the tool results that
  answer it). The last group always stays.
* **Result tiers at compaction.** In the hot zone a tool result the model has already
  answered after is reduced: a warm one to the one-line summary the compaction model
  gives for its id (or, if it gives none, its first line and its size), a cold one to
  the same collapsed line ``History.for_model`` shows. Such messages get the tier
  ``summarized`` (never collapsed again). A result the model has not seen yet stays
  verbatim whatever its tier.
* **The transcript.** The compaction model gets the current TaskState and the whole
  history flattened to plain text: each tool call on one line with its result under it
  (cold results collapsed, others cut at ``RESULT_CHARS``), a marker line before the hot
  zone, and results to summarize tagged with their ids. ``max_chars`` bounds it by
  leaving out the oldest messages (the TaskState covers them).
* **How the answer is asked for.** As structured output where the provider has it
  (``RESPONSE_SCHEMA``, which each backend maps to its wire: see ``ResponseSchema``), and
  always in the prompt too. A provider that refuses the request with the schema (a 400:
  ``BadResponseError`` or ``ToolUnsupportedError``) is asked again at once without it;
  ``Result.schema_refused`` tells the caller, who remembers it for that backend and
  model. Rate limits and transient failures are retried by the caller's ``RetryPolicy``,
  with its waits, like any request.
* **How the answer is read: leniently.** Models put prose before the object, a code
  fence around it, extra keys in it, leave lists out. The answer is the first JSON
  object in the text (after any ``<think>`` block) that has a ``goal`` and a non-empty
  ``state`` (an object wrapping such an object one level down counts too); unknown keys
  are ignored, a missing or null list is empty, a lone string is a list of one, and
  ``results`` may be an object (id to summary) or a list of ``{"id", "summary"}``. An
  Anthropic answer comes as the forced tool's call, whose arguments are read the same way.
  Decisions, questions and files are folded to one line each and cut; the last
  ``MAX_DECISIONS`` decisions are kept.
* **Never a session that cannot shrink.** When the answer is still unusable, or the
  request failed for good (after the retries), the compaction is done mechanically:
  the current TaskState is the cold zone, its decisions the warm one, the same hot zone,
  with seen warm results reduced to their first line and size. ``Result.mechanical``
  says why, and the ``summary`` file starts with it. Only ``plan`` refuses
  (``CompactionFailed``): nothing to compact (``NothingToCompact``), or no valid history
  possible. A cancelled compaction (``stop``) leaves the history as it was.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio

from olliefs.agent.dispatch import one_line_args
from olliefs.agent.history import collapse, estimate_tokens, message_tokens
from olliefs.agent.retry import RetryPolicy
from olliefs.agent.taskstate import MAX_DECISIONS, MAX_FILES, TaskState, cut, fold, to_json
from olliefs.backend.base import (
    Backend,
    BackendError,
    BadResponseError,
    GenerationParams,
    Message,
    ResponseSchema,
    ToolUnsupportedError,
    Usage,
)

COMPACT_AT = 0.5  # of the model's context length
TARGET = 0.3  # of the context: what a compacted history may fill, at most
HOT = 8
RESULT_CHARS = 2000  # a tool result in the transcript
TEXT_CHARS = 8000  # a user or assistant text in the transcript
ARGS_CHARS = 500
PREVIEW_CHARS = 80  # one line of ``dropped``
LINE_CHARS = 200  # a decision, question or file
PROSE_CHARS = 2000  # goal, state, next
REDUCED_TOKENS = (2 * LINE_CHARS + 100) // 4  # a result reduced at compaction, at most
SUMMARIZED = "summarized"  # the tier of a result reduced by compaction
HOT_MARK = "=== the messages below stay in the context verbatim ==="
MAX_OBJECTS = 100  # JSON object starts tried in one answer


class CompactionFailed(Exception):
    """Compaction could not be done; the old history stays. ``reason`` is one line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NothingToCompact(CompactionFailed):
    """No message can leave the context (or be reduced in it): not a failure."""


def should_compact(estimated_tokens: int, context_length: int) -> bool:
    """Estimated tokens have reached ``COMPACT_AT`` of the context (unknown context: no)."""
    return context_length > 0 and estimated_tokens >= COMPACT_AT * context_length


def budget_for(context_length: int, overhead: int) -> int:
    """The tokens a compacted history may take: ``TARGET`` of the context, less
    ``overhead`` (what every request sends besides the history: system prompt, tool
    schemas). 0 (no bound) when the context length is unknown; at least 1 otherwise."""
    if context_length <= 0:
        return 0
    return max(1, int(TARGET * context_length) - overhead)


# ---- the answer -------------------------------------------------------------------------

ANSWER_NAME = "compaction_answer"
_STRINGS: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
#: The answer's JSON Schema, in the strict form (every key required, no other key).
ANSWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "goal": {"type": "string", "description": "what the user wants, in a sentence or two"},
        "state": {
            "type": "string",
            "description": "where the work stands: what is done and what is known",
        },
        "decisions": {**_STRINGS, "description": "one line per decision or fact to keep"},
        "next": {"type": "string", "description": "the next step"},
        "open_questions": {**_STRINGS, "description": "questions still open"},
        "files": {**_STRINGS, "description": "files changed so far"},
        "results": {
            "type": "array",
            "description": "a one-line summary of each result listed to summarize",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "string"}, "summary": {"type": "string"}},
                "required": ["id", "summary"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["goal", "state", "decisions", "next", "open_questions", "files", "results"],
    "additionalProperties": False,
}
RESPONSE_SCHEMA = ResponseSchema(ANSWER_NAME, ANSWER_SCHEMA)


@dataclass(frozen=True)
class Answer:
    """What the compaction model answered, as read (see ``parse_answer``)."""

    goal: str
    state: str
    decisions: tuple[str, ...] = ()
    next: str = ""
    open_questions: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    results: Mapping[str, str] = field(default_factory=dict)


PROMPT = f"""\
You compact the context of an agent whose conversation has grown too long. Everything \
above the line "{HOT_MARK}" will be replaced by your answer; the messages below it stay. \
Keep what the agent needs to go on: the goal, what is done, the decisions taken and why, \
facts learned (paths, names, commands, error messages), and what comes next.

Answer with one JSON object and nothing else: no prose, no code fence. Exactly these keys:
{{
  "goal": "what the user wants, in one or two sentences",
  "state": "where the work stands: what is done and what is known, specific",
  "decisions": ["one line per decision or fact worth keeping, oldest first, at most \
{MAX_DECISIONS}"],
  "next": "the next step",
  "open_questions": ["questions still open (may be empty)"],
  "files": ["files changed so far (may be empty)"],
  "results": [{{"id": "<id>", "summary": "a one-line summary of that tool result"}}]
}}
"state" must not be empty. "results" has one entry for each id listed under "Results to \
summarize" (an empty list when there are none). Keep the earlier decisions of the task \
state that still matter.
"""

_THINK = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL)
_decoder = json.JSONDecoder(strict=False)  # a raw newline inside a string is common


def parse_answer(text: str) -> Answer:
    """The answer in ``text``, read leniently (module docstring); ``CompactionFailed``
    with a one-line reason when there is none."""
    body = _THINK.sub("", text).strip()
    if not body:
        raise CompactionFailed("the compaction model gave an empty answer")
    first: str | None = None
    for doc in json_objects(body):
        for candidate in (doc, *(v for v in doc.values() if isinstance(v, dict))):
            why = _unusable(candidate)
            if why is None:
                return _answer_of(candidate)
            first = first or why
    what = first or "no JSON object in it"
    raise CompactionFailed(
        f"the compaction model's answer is not usable ({what}): {cut(fold(body), PREVIEW_CHARS)}"
    )


def json_objects(text: str) -> Iterator[dict[str, Any]]:
    """The JSON objects in ``text``, in order, whatever surrounds them: decoding starts at
    each ``{`` that is not inside an object already found (at most ``MAX_OBJECTS``)."""
    i = text.find("{")
    for _ in range(MAX_OBJECTS):
        if i < 0:
            return
        try:
            doc, end = _decoder.raw_decode(text, i)
        except ValueError:
            i = text.find("{", i + 1)
            continue
        yield doc
        i = text.find("{", end)


def _unusable(doc: dict[str, Any]) -> str | None:
    goal, state = doc.get("goal"), doc.get("state")
    if not isinstance(state, str):
        return 'no "state" text' if state is None else '"state" is not text'
    if not state.strip():
        return '"state" is empty'
    if not isinstance(goal, str):
        return 'no "goal" text' if goal is None else '"goal" is not text'
    return None


def _answer_of(doc: dict[str, Any]) -> Answer:
    return Answer(
        goal=doc["goal"],
        state=doc["state"],
        decisions=_strings(doc.get("decisions")),
        next=_text(doc.get("next")),
        open_questions=_strings(doc.get("open_questions")),
        files=_strings(doc.get("files")),
        results=_results(doc.get("results")),
    )


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    return tuple(_text(v) for v in items if v is not None)


def _results(value: Any) -> dict[str, str]:
    if isinstance(value, dict):
        return {str(k): _text(v) for k, v in value.items()}
    out: dict[str, str] = {}
    for item in value if isinstance(value, list) else ():
        if isinstance(item, dict) and item.get("id") is not None:
            out[_text(item["id"])] = _text(item.get("summary"))
    return out


# ---- well-formed histories --------------------------------------------------------------


def problems(messages: Sequence[Message]) -> list[str]:
    """What a provider would reject in ``messages`` (empty when well-formed).

    Rules: the first message that is not ``system`` is a ``user`` message; every tool
    result answers a call of the assistant message right before its block of results;
    every call of an assistant message is answered, exactly once, before the next
    message that is not a tool result; call ids of one message are distinct.
    """
    out: list[str] = []
    first = next((m for m in messages if m.role != "system"), None)
    if first is not None and first.role != "user":
        out.append(f"the history starts with a {first.role} message, not a user message")
    open_calls: dict[str, str] = {}
    for i, m in enumerate(messages):
        if m.role == "tool":
            if m.tool_call_id in open_calls:
                del open_calls[m.tool_call_id]
            else:
                out.append(f"#{i}: tool result {m.tool_call_id!r} answers no open call")
            continue
        if open_calls:
            out.append(f"#{i}: calls {sorted(open_calls)} unanswered before a {m.role} message")
        open_calls = {}
        if m.role == "assistant":
            for c in m.tool_calls:
                if c.id in open_calls:
                    out.append(f"#{i}: call id {c.id!r} used twice")
                open_calls[c.id] = c.name
    if open_calls:
        out.append(f"calls {sorted(open_calls)} are unanswered at the end")
    return out


# ---- zones ------------------------------------------------------------------------------


def cold_message(state: TaskState, header: str) -> Message:
    """The cold zone: the TaskState as JSON (decisions are the warm zone's)."""
    body = to_json(msgspec.structs.replace(state, decisions=()))
    return Message("user", f"{header}\n{body}")


def warm_message(decisions: Sequence[str]) -> Message | None:
    if not decisions:
        return None
    lines = "".join(f"- {d}\n" for d in decisions)
    return Message(
        "user", f"[ollie: decision index] Decisions and facts so far, oldest first:\n{lines}"
    )


COMPACTED_HEADER = (
    "[ollie: compacted context] The conversation before this point was compacted: its "
    "full text is kept in this session's compactions/ directory. Task state:"
)
CHECKPOINT_HEADER = (
    "[ollie: checkpoint] You start from a checkpoint: this is the state of the work so far. "
    "Task state:"
)


def checkpoint(state: TaskState) -> list[Message]:
    """The seed's ``History.Checkpoint``: a fresh history that inherits ``state`` (cold and
    warm zones, no messages), for a narrow-context subagent."""
    warm = warm_message(state.decisions)
    return [cold_message(state, CHECKPOINT_HEADER), *([warm] if warm else [])]


# ---- the plan ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What a compaction will do, computed before anything is asked or changed."""

    before: tuple[Message, ...]  # the whole history, as it was
    state: TaskState
    focus: str
    hot_start: int  # before[hot_start:] is the hot zone
    summarize: frozenset[int]  # indices of seen warm results in the hot zone
    collapse: frozenset[int]  # indices of seen cold results in the hot zone
    transcript: str

    def request(self) -> list[Message]:
        """The messages sent to the compaction model (with no tools)."""
        parts = [f"Task state so far:\n{to_json(self.state)}"]
        if self.focus:
            parts.append(f"Focus of this compaction (weigh it above all else): {self.focus}\n")
        ids = [self.before[i].tool_call_id for i in sorted(self.summarize)]
        parts.append(f"Results to summarize: {', '.join(ids) if ids else '(none)'}\n")
        parts.append(f"Transcript:\n{self.transcript}")
        return [Message("system", PROMPT), Message("user", "\n".join(parts))]


def plan(
    messages: Sequence[Message],
    state: TaskState,
    focus: str = "",
    *,
    hot: int = HOT,
    max_chars: int = 0,
    budget: int = 0,
) -> Plan:
    """Zone ``messages``; raise ``CompactionFailed`` when the result would not be a valid
    history, ``NothingToCompact`` when there is nothing to gain. ``max_chars`` > 0 bounds
    the transcript; ``budget`` > 0 the estimated tokens of the new history (module
    docstring, "A hot zone that fits")."""
    before = tuple(messages)
    start = max(0, len(before) - hot)
    while start > 0 and before[start].role == "tool":
        start -= 1
    last_assistant = max((i for i, m in enumerate(before) if m.role == "assistant"), default=-1)
    summarize: set[int] = set()
    if budget > 0:
        start, summarize = _fit(before, start, last_assistant, state, budget)
    collapsed: set[int] = set()
    for i in range(start, last_assistant):
        m = before[i]
        if m.role == "tool" and m.tier == "warm":
            summarize.add(i)
        elif m.role == "tool" and m.tier == "cold":
            collapsed.add(i)
    if start == 0 and not summarize and not collapsed:
        raise NothingToCompact(
            f"nothing to compact: all {len(before)} messages are in the hot zone"
        )
    bad = problems([Message("user", "(cold)"), *before[start:]])
    if bad:
        raise CompactionFailed("the kept messages would not be a valid history: " + bad[0])
    transcript = flatten(before, start, summarize, max_chars)
    return Plan(
        before, state, focus.strip(), start, frozenset(summarize), frozenset(collapsed), transcript
    )


def _fit(
    before: tuple[Message, ...], start: int, last_assistant: int, state: TaskState, budget: int
) -> tuple[int, set[int]]:
    """Until the estimate of the new history is within ``budget``: results the model has
    seen in the hot zone reduced, oldest first (the calls and the words around them
    stay), then the boundary moved later, one group at a time (a message with the
    results that follow it; the last group stays). Returns the boundary and the results
    to reduce besides the warm ones."""

    def tokens(i: int) -> int:
        m = before[i]
        if m.role == "tool" and i < last_assistant and m.tier in ("warm", "cold"):
            return REDUCED_TOKENS if m.tier == "warm" else estimate_tokens(collapse(m))
        return message_tokens(m)

    sizes = [tokens(i) for i in range(len(before))]
    warm = warm_message(state.decisions)
    total = estimate_tokens(cold_message(state, COMPACTED_HEADER).content) + sum(sizes[start:])
    total += estimate_tokens(warm.content) if warm else 0
    reduce: set[int] = set()
    for i in range(start, last_assistant):
        if total <= budget:
            break
        m = before[i]
        if m.role == "tool" and m.tier not in ("warm", "cold", SUMMARIZED):
            if sizes[i] > REDUCED_TOKENS:
                reduce.add(i)
                total -= sizes[i] - REDUCED_TOKENS
                sizes[i] = REDUCED_TOKENS
    last_group = max((i for i, m in enumerate(before) if m.role != "tool"), default=0)
    while total > budget and start < last_group:
        nxt = start + 1
        while before[nxt].role == "tool":
            nxt += 1
        total -= sum(sizes[start:nxt])
        start = nxt
    return start, {i for i in reduce if i >= start}


def flatten(
    messages: Sequence[Message], hot_start: int, summarize: set[int], max_chars: int = 0
) -> str:
    """The history as plain text: each tool call with its result under it."""
    answers: dict[str, int] = {}
    for k, r in enumerate(messages):
        if r.role == "tool":
            answers.setdefault(r.tool_call_id, k)
    shown: set[int] = set()
    chunks: list[str] = []
    for i, m in enumerate(messages):
        if i in shown:
            continue
        lines: list[str] = []
        if i == hot_start and i > 0:
            lines.append(HOT_MARK)
        if m.role == "tool":
            lines.append(_result_text(i, m, i in summarize))
        else:
            if m.content or not m.tool_calls:
                lines.append(f"#{i} {m.role}: {_cut_block(m.content, TEXT_CHARS)}")
            for c in m.tool_calls:
                args = cut(one_line_args(c.arguments), ARGS_CHARS)
                lines.append(f"#{i} {m.role} called {c.name}({args})")
                j = answers.get(c.id)
                # A result is shown under its call, unless the marker lies between them
                # (only in a malformed history): then it is shown where it is.
                if j is not None and j > i and j not in shown and (i >= hot_start or j < hot_start):
                    shown.add(j)
                    lines.append(_result_text(j, messages[j], j in summarize))
        chunks.append("\n".join(lines) + "\n")
    text = "".join(chunks)
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    left = 0
    size = len(text)
    while left < len(chunks) - 1 and size > max_chars:
        size -= len(chunks[left])
        left += 1
    note = f"[the oldest {left} entries are left out here; the task state covers them]\n"
    text = note + "".join(chunks[left:])
    return text if len(text) <= max_chars else note + text[len(text) - max_chars + len(note) :]


def _result_text(j: int, m: Message, tagged: bool) -> str:
    tag = f" [summarize: id={m.tool_call_id}]" if tagged else ""
    body = collapse(m) if m.tier == "cold" else _cut_block(m.content, RESULT_CHARS)
    return f"#{j} result of {m.name or 'tool'}{tag}: {body}"


def _cut_block(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... {len(text) - limit} more characters]"


# ---- the compaction ---------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    messages: list[Message]  # the new history: cold, warm (if any), hot
    state: TaskState  # the new TaskState (goal, progress, next, decisions, ... updated)
    summary: str  # what replaced the dropped part (the ``summary`` file)
    dropped: list[str]  # one line per message that left the context (``dropped``)
    usage: Usage | None  # of the compaction request, as the provider reported it
    mechanical: str = ""  # why the model's answer was not used ("" when it was)
    schema_refused: bool = False  # the provider refused the schema and did without it


#: Waits ``delay`` seconds before a retry of a request that failed with the error.
Wait = Callable[[BackendError, float], Awaitable[None]]


async def _sleep(err: BackendError, delay: float) -> None:
    await trio.sleep(delay)


async def compact(
    backend: Backend,
    model: str,
    p: Plan,
    params: GenerationParams | None = None,
    *,
    structured: bool = True,
    retry: RetryPolicy | None = None,
    wait: Wait = _sleep,
) -> Result:
    """Ask ``model`` on ``backend`` (streamed, no tools) and build the new history; built
    mechanically when the answer is unusable or the request failed for good. With
    ``structured`` the request asks for ``RESPONSE_SCHEMA``, and once without it if the
    provider refuses it. ``retry`` (default: none) decides on retries, ``wait`` waits
    before each. Raises nothing but ``trio.Cancelled``."""
    base = params or GenerationParams()
    schema = RESPONSE_SCHEMA if structured else None
    refused = False
    attempt = 0
    while True:
        asked = msgspec.structs.replace(base, response_schema=schema)
        try:
            text, usage = await _ask(backend, model, p.request(), asked)
            break
        except BackendError as err:
            if schema is not None and isinstance(err, BadResponseError | ToolUnsupportedError):
                schema, refused = None, True  # asked again at once, without the schema
                continue
            delay = (retry or RetryPolicy(max_retries=0)).delay(err, attempt)
            if delay is None:
                return build(p, None, None, reason=f"the compaction model failed: {err}")
            await wait(err, delay)
            attempt += 1
    try:
        answer = parse_answer(text)
    except CompactionFailed as err:
        return build(p, None, usage, reason=err.reason, schema_refused=refused)
    return build(p, answer, usage, schema_refused=refused)


async def _ask(
    backend: Backend, model: str, messages: list[Message], params: GenerationParams
) -> tuple[str, Usage | None]:
    """The answer's text (the forced tool's arguments, if the answer came as its call)."""
    text: list[str] = []
    usage: Usage | None = None
    called: str | None = None
    async with backend.stream(model, messages, [], params) as evs:
        async for ev in evs:
            if ev.kind == "content":
                text.append(ev.text)
            elif ev.kind == "tool_calls":
                called = next((c.arguments for c in ev.tool_calls if c.name == ANSWER_NAME), None)
            elif ev.kind == "usage":
                usage = ev.usage
    return (called if called is not None else "".join(text)), usage


MECHANICAL = "[mechanical compaction: {}]"


def build(
    p: Plan,
    answer: Answer | None,
    usage: Usage | None = None,
    *,
    reason: str = "",
    schema_refused: bool = False,
) -> Result:
    """The new history, state, summary and dropped list from a parsed answer, or, without
    one, mechanically (``reason`` says why): the current TaskState and decisions as the
    cold and warm zones, seen results in the hot zone reduced to their first line."""
    old = p.state
    state = old
    if answer is not None:
        files = list(old.files)
        for f in answer.files:
            f = cut(f, LINE_CHARS)
            if f:
                if f in files:
                    files.remove(f)
                files.append(f)
        state = msgspec.structs.replace(
            old,
            goal=cut(answer.goal, PROSE_CHARS) or old.goal,
            progress=cut(answer.state, PROSE_CHARS),
            next=cut(answer.next, PROSE_CHARS),
            decisions=_lines(answer.decisions)[-MAX_DECISIONS:],
            open_questions=_lines(answer.open_questions)[-MAX_DECISIONS:],
            files=tuple(files[-MAX_FILES:]),
        )
    said = answer.results if answer is not None else {}
    cold = cold_message(state, COMPACTED_HEADER)
    warm = warm_message(state.decisions)
    hot: list[Message] = []
    reduced: list[str] = []
    dropped = [_preview(i, m) for i, m in enumerate(p.before[: p.hot_start])]
    for i in range(p.hot_start, len(p.before)):
        m = p.before[i]
        if i in p.summarize:
            line = cut(fold(said.get(m.tool_call_id, "")), LINE_CHARS * 2)
            content = (
                f"[{m.name} result, summarized at compaction: {line}]" if line else _mechanical(m)
            )
        elif i in p.collapse:
            content = collapse(m)
        else:
            hot.append(m)
            continue
        hot.append(msgspec.structs.replace(m, content=content, tier=SUMMARIZED, images=()))
        reduced.append(f"#{i} {m.name}: {content}")
        dropped.append(_preview(i, m, "[summarized in place] "))
    messages = [cold, *([warm] if warm else []), *hot]
    summary = MECHANICAL.format(reason) + "\n" if answer is None else ""
    summary += cold.content + (f"\n{warm.content}" if warm else "")
    if reduced:
        summary += "\n[tool results reduced in the kept messages]\n" + "\n".join(reduced) + "\n"
    mechanical = (reason or "no answer") if answer is None else ""
    return Result(messages, state, summary, dropped, usage, mechanical, schema_refused)


def _lines(items: Sequence[str]) -> tuple[str, ...]:
    out: list[str] = []
    for item in items:
        line = cut(item, LINE_CHARS)
        if line and line not in out:
            out.append(line)
    return tuple(out)


def _mechanical(m: Message) -> str:
    first = cut(m.content.split("\n", 1)[0], LINE_CHARS)
    lines = m.content.count("\n") + 1 if m.content else 0
    size = len(m.content.encode())
    return (
        f"[{m.name} result, reduced at compaction: {first!r}, {lines} lines, {size} bytes; "
        "the full text is in the compaction snapshot]"
    )


def _preview(i: int, m: Message, note: str = "") -> str:
    """One line of ``dropped``: index, role (``tool:<name>`` for a result), the text's
    first ``PREVIEW_CHARS`` characters (a reply with only calls: the calls)."""
    label = f"tool:{fold(m.name)}" if m.role == "tool" and m.name else m.role
    text = m.content
    if not text and m.tool_calls:
        text = "; ".join(f"-> {c.name}({one_line_args(c.arguments)})" for c in m.tool_calls)
    return f"{i}\t{label}\t{cut(note + fold(text), PREVIEW_CHARS)}"


# ---- the snapshot -----------------------------------------------------------------------

_msg_encoder = msgspec.json.Encoder()
_msg_decoder = msgspec.json.Decoder(Message)


def write_snapshot(
    dir: Path, n: int, before: Sequence[Message], summary: str, dropped: Sequence[str]
) -> Path:
    """Write ``dir/<n>/{before.jsonl,summary,dropped}`` atomically and durably.

    The files are written and fsync'd in ``dir/.<n>.tmp``, which is then renamed to
    ``dir/<n>`` and ``dir`` fsync'd: after a crash, ``<n>`` is either whole or absent. A
    leftover temp dir from an earlier crash is removed first. Raises ``FileExistsError``
    if ``<n>`` exists, ``OSError`` on any I/O failure (then nothing is left behind).
    Blocking: run it in a worker thread from trio.
    """
    if n < 0:
        raise ValueError(f"snapshot number must be >= 0, not {n}")
    created = not dir.exists()
    dir.mkdir(parents=True, exist_ok=True)
    final = dir / str(n)
    if final.exists():
        raise FileExistsError(f"{final} exists")
    tmp = dir / f".{n}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        _write_synced(
            tmp / "before.jsonl", b"".join(_msg_encoder.encode(m) + b"\n" for m in before)
        )
        _write_synced(tmp / "summary", (summary.rstrip("\n") + "\n").encode())
        _write_synced(tmp / "dropped", "".join(line + "\n" for line in dropped).encode())
        _fsync_dir(tmp)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(dir)
    if created:
        _fsync_dir(dir.parent)
    return final


def read_snapshot(path: Path) -> list[Message]:
    """The messages of ``path/before.jsonl`` (``path`` is ``dir/<n>``)."""
    data = (path / "before.jsonl").read_bytes()
    return [_msg_decoder.decode(line) for line in data.split(b"\n") if line]


def next_snapshot_number(dir: Path) -> int:
    """1 + the highest ``<n>`` in ``dir`` (1 when there is none)."""
    try:
        names = os.listdir(dir)
    except FileNotFoundError:
        return 1
    return 1 + max((int(s) for s in names if s.isdigit()), default=0)


def _write_synced(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
