"""Compaction end to end: ``ctl compact`` against the replay server, nothing lost.

``ctl compact`` outside a turn is the session's work, like a turn: the write returns at
once, whatever the provider does, and ``stop``/``kill`` end it.

Then compaction against real models' habits, on every wire: each answer shape models
give (prose before the object, a fence after a sentence, an extra key, a list left out,
no object at all, a 429 first), with structured output and without it (the provider
refused the schema once, which is remembered); the automatic trigger at half the
context, which must leave the context well under it; and token counts without provider
usage, which must count everything sent.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from olliefs.agent.compact import ANSWER_NAME, ANSWER_SCHEMA
from olliefs.backend.gemini import response_schema as gemini_schema
from olliefs.replay import Entry, EntryToolCall, Recorded, ReplayServer
from olliefs.testing import HAVE_FUSE, Daemon
from tests.conftest import oserror, script

ANSWER = {"goal": "count", "state": "counted to three", "decisions": ["use ints"], "next": "stop"}


def context(daemon: Daemon, sid: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in daemon.read(f"s/{sid}/context").splitlines()]


def turns(daemon: Daemon, sid: str, n: int) -> None:
    for i in range(n):
        daemon.prompt(sid, f"step {i}")
        daemon.wait_idle(sid)


def test_compact_keeps_everything_and_shrinks_the_history(daemon: Daemon) -> None:
    sid = daemon.new(name="cp")
    turns(daemon, sid, 10)
    before = context(daemon, sid)
    daemon.replay.add([Entry(reply=json.dumps(ANSWER))])
    daemon.write(f"s/{sid}/ctl", "compact keep the numbers")
    daemon.wait_idle(sid)
    after = context(daemon, sid)
    assert len(after) < len(before)
    snap = [json.loads(x) for x in daemon.read(f"s/{sid}/compactions/1/before.jsonl").splitlines()]
    assert snap == before
    assert "counted to three" in daemon.read(f"s/{sid}/compactions/1/summary")
    assert daemon.read(f"s/{sid}/compactions/1/dropped").strip()
    chat = daemon.read(f"s/{sid}/chat")
    assert ":: compacting (focus: keep the numbers)" in chat and "(compactions/1)" in chat
    request = daemon.replay.requests[-1]
    assert not request.get("tools") and "keep the numbers" in json.dumps(request["messages"])
    daemon.stop()
    daemon.start()
    assert context(daemon, sid) == after


def test_an_unusable_answer_compacts_mechanically(daemon: Daemon) -> None:
    """No JSON in the answer: the session still shrinks, from its own TaskState, and
    nothing is lost."""
    sid = daemon.new(name="bad")
    turns(daemon, sid, 10)
    before = context(daemon, sid)
    state = json.loads(daemon.read(f"s/{sid}/taskstate"))
    daemon.replay.add([Entry(reply="this is not json")])
    daemon.write(f"s/{sid}/ctl", "compact")
    daemon.wait_idle(sid)
    after = context(daemon, sid)
    assert len(after) < len(before) and after[-8:] == before[-8:]
    assert json.loads(daemon.read(f"s/{sid}/taskstate")) == state
    snap = [json.loads(x) for x in daemon.read(f"s/{sid}/compactions/1/before.jsonl").splitlines()]
    assert snap == before
    summary = daemon.read(f"s/{sid}/compactions/1/summary")
    assert summary.startswith("[mechanical compaction: the compaction model's answer is not")
    chat = daemon.read(f"s/{sid}/chat")
    assert f":: compacted 20 messages into {len(after)} mechanically (compactions/1): " in chat
    assert "error:" not in chat
    assert daemon.read(f"s/{sid}/state") == "idle\n"


def test_nothing_to_compact_is_no_error(daemon_factory: Callable[..., Daemon]) -> None:
    """One prompt bigger than half the context: the automatic trigger fires before its
    request and finds nothing that could leave the context. That is logged, not said in
    chat (it would be said again before every request); ``ctl compact`` says it."""
    d = daemon_factory()
    d.replay.context_length = 4000
    d.start()
    sid = d.new(name="huge")
    d.prompt(sid, "x" * 9000)  # ~2250 tokens: over 2000 by itself
    d.wait_idle(sid)
    chat = d.read(f"s/{sid}/chat")
    assert "error:" not in chat and ":: compact" not in chat and ":: nothing" not in chat
    assert chat.endswith("assistant: echo: " + "x" * 9000 + "\n")
    assert os.listdir(d.p(f"s/{sid}/compactions")) == []
    small = d.new(name="small")
    d.prompt(small, "hi")
    d.wait_idle(small)
    d.write(f"s/{small}/ctl", "compact")
    d.wait_idle(small)
    assert d.read(f"s/{small}/chat").endswith(
        ":: nothing to compact: all 2 messages are in the hot zone\n"
    )
    assert os.listdir(d.p(f"s/{small}/compactions")) == []


def test_taskstate_and_tcct(daemon: Daemon) -> None:
    sid = daemon.new(name="ts")
    daemon.prompt(sid, "the goal")
    daemon.wait_idle(sid)
    assert json.loads(daemon.read(f"s/{sid}/taskstate"))["goal"] == "the goal"
    assert daemon.read(f"s/{sid}/tcct") == "0\n"
    # ``clear`` forgets the conversation and so what was inferred from it: the next
    # prompt sets the goal again.
    daemon.write(f"s/{sid}/ctl", "clear")
    assert json.loads(daemon.read(f"s/{sid}/taskstate"))["goal"] == ""
    daemon.prompt(sid, "another goal")
    daemon.wait_idle(sid)
    assert json.loads(daemon.read(f"s/{sid}/taskstate"))["goal"] == "another goal"


# ---- ctl compact is the session's work ---------------------------------------------------


@pytest.fixture
def patient(daemon_factory: Callable[..., Daemon]) -> Iterator[Daemon]:
    """A daemon that waits for a silent provider as long as by default (300 s), not the
    2 s of the other tests: a hang here lasts until ``stop`` or ``kill`` ends it."""
    d = daemon_factory(OLLIE_READ_TIMEOUT="300")
    d.start()
    yield d


def shell(*argv: str) -> None:
    """Run a command as a user types it; it must come back. A writer the daemon held
    while the provider hung stayed in D state, unkillable, for the read timeout (300 s):
    that is what the generous timeout here catches, not a duration."""
    proc = subprocess.Popen(argv)
    try:
        assert proc.wait(timeout=60) == 0, argv
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{argv} did not return while the provider hangs") from None


def hanging_compaction(daemon: Daemon, name: str) -> tuple[str, list[dict[str, Any]]]:
    """A session with history whose ``ctl compact`` the provider never answers; returns
    once the compaction request is held by the provider."""
    sid = daemon.new(name=name)
    turns(daemon, sid, 10)
    before = context(daemon, sid)
    asked = len(daemon.replay.requests)
    daemon.replay.add([Entry(hang=True)])
    shell("sh", "-c", 'echo compact > "$1"', "sh", str(daemon.p(f"s/{sid}/ctl")))
    assert daemon.read(f"s/{sid}/state") == "compacting\n"
    daemon.wait_for(lambda: len(daemon.replay.requests) > asked)
    return sid, before


def test_ctl_compact_returns_at_once_and_stop_ends_it(patient: Daemon) -> None:
    sid, before = hanging_compaction(patient, "hang")
    asked = len(patient.replay.requests)
    # Meanwhile a prompt queues behind it (the state stays compacting) and what needs
    # the session at rest is refused, as during a turn.
    patient.prompt(sid, "after")
    assert patient.read(f"s/{sid}/state") == "compacting\n"
    assert oserror(patient.write, f"s/{sid}/ctl", "compact") == errno.EBUSY
    assert oserror(patient.write, f"s/{sid}/ctl", "rn other") == errno.EBUSY
    assert (
        patient.read(f"s/{sid}/err")
        == "rn: refused while a compaction is running (ctl stop first)\n"
    )
    assert len(patient.replay.requests) == asked  # the prompt waits for the compaction
    patient.write(f"s/{sid}/ctl", "stop")
    patient.wait_idle(sid)
    after = [{"role": "user", "content": "after"}, {"role": "assistant", "content": "echo: after"}]
    assert context(patient, sid) == before + after
    assert os.listdir(patient.p(f"s/{sid}/compactions")) == []
    chat = patient.read(f"s/{sid}/chat")
    stopped = chat.index(":: compaction stopped; history kept\n")
    assert chat.index(":: compacting\n") < stopped < chat.index("assistant: echo: after")
    assert "compaction failed" not in chat
    assert len(patient.replay.requests) == asked + 1


@pytest.mark.parametrize("how", ["ctl kill", "rm -r"])
def test_kill_ends_a_hanging_compaction(patient: Daemon, how: str) -> None:
    sid, _ = hanging_compaction(patient, "gone")
    if how == "ctl kill":
        shell("sh", "-c", 'echo kill > "$1"', "sh", str(patient.p(f"s/{sid}/ctl")))
    else:
        shell("rm", "-r", str(patient.p(f"s/{sid}")))
    assert sid not in os.listdir(patient.p("s"))
    other = patient.new(name="next")
    patient.prompt(other, "still here")
    patient.wait_idle(other)
    assert "assistant: echo: still here\n" in patient.read(f"s/{other}/chat")


def test_compact_in_a_turn_that_asks_no_more_runs_after_it(daemon: Daemon) -> None:
    """Asked for during the turn's last request: done as soon as the turn ends, before
    the prompts queued behind the turn."""
    sid = daemon.new(name="late")
    turns(daemon, sid, 10)
    slow = json.dumps({"reply": "slow " * 40, "chunk": 1, "delay": 0.02})
    daemon.replay.add(script(slow, json.dumps({"reply": json.dumps(ANSWER)})))
    daemon.prompt(sid, "one more")
    daemon.wait_chat(sid, "assistant: s")
    daemon.write(f"s/{sid}/ctl", "compact")
    daemon.prompt(sid, "queued")
    daemon.wait_idle(sid)
    chat = daemon.read(f"s/{sid}/chat")
    marks = [
        ":: compaction requested",
        "slow \n",
        ":: compacting\n",
        ":: compacted",
        "echo: queued",
    ]
    at = [chat.index(m) for m in marks]
    assert at == sorted(at), chat
    assert os.listdir(daemon.p(f"s/{sid}/compactions")) == ["1"]


def test_stop_drops_the_compaction_asked_for_in_the_turn(patient: Daemon) -> None:
    sid = patient.new(name="drop")
    turns(patient, sid, 10)
    patient.replay.add(script('{"reply": "x", "hang": true}'))
    asked = len(patient.replay.requests)
    patient.prompt(sid, "hang")
    patient.wait_for(lambda: len(patient.replay.requests) > asked)
    patient.write(f"s/{sid}/ctl", "compact")
    patient.write(f"s/{sid}/ctl", "stop")
    patient.wait_idle(sid)
    assert ":: stopped\n:: the compaction requested for this turn is dropped\n" in patient.read(
        f"s/{sid}/chat"
    )
    patient.prompt(sid, "go on")
    patient.wait_idle(sid)
    assert len(patient.replay.requests) == asked + 2  # no compaction request between
    assert os.listdir(patient.p(f"s/{sid}/compactions")) == []


# ---- the automatic trigger and what it is measured by --------------------------------------


def ctxsz(daemon: Daemon, sid: str) -> int:
    return int(daemon.read(f"s/{sid}/ctxsz").split(" / ")[0])


def compactions(daemon: Daemon, sid: str) -> int:
    return len(os.listdir(daemon.p(f"s/{sid}/compactions")))


def test_the_automatic_trigger_leaves_the_context_well_under_it(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """A turn compacts first exactly when the context has reached half of it (4000
    tokens here, as the provider counted the last request). Eight messages of this
    session hold more than that by themselves, so the hot zone is cut until the
    compacted history fits 30%: the turn after a compaction never compacts again."""
    d = daemon_factory()
    d.replay.models = ("replay", "compactor")
    d.replay.context_length = 4000
    d.start()
    with open(d.p("a/small.json"), "w") as f:
        f.write(json.dumps({"compactionModel": "compactor"}))
    # Only compaction requests (for the compactor) take these; turns are echoed.
    d.replay.add([Entry(for_model="compactor", reply=json.dumps(ANSWER))] * 4)
    sid = d.new(name="auto", agent="small")
    seen: list[tuple[int, bool]] = []  # (ctxsz before the turn, the turn compacted)
    for i in range(10):
        size, done = ctxsz(d, sid), compactions(d, sid)
        d.prompt(sid, f"{i} " + "x" * 1200)  # ~300 tokens, and as much echoed
        d.wait_idle(sid)
        seen.append((size, compactions(d, sid) > done))
    assert all(compacted == (size >= 2000) for size, compacted in seen), seen
    assert sum(c for _, c in seen) >= 2, seen
    assert not any(a and b for (_, a), (_, b) in itertools.pairwise(seen)), seen
    compaction = [r for r in d.replay.recorded if r.model == "compactor"]
    assert all(r.schema == ANSWER_SCHEMA for r in compaction)
    chat = d.read(f"s/{sid}/chat")
    assert "error:" not in chat and "mechanically" not in chat


def test_without_provider_usage_everything_sent_is_counted(
    wired: tuple[ReplayServer, Daemon],
) -> None:
    """Kiro reports no usage: the estimate is what was sent, system prompt and tool
    schemas included, not the history alone (a 2 KB request once counted as 1 token)."""
    server, daemon = wired
    sid = daemon.new(name="k", backend="kiro")
    fresh = ctxsz(daemon, sid)
    system = len(daemon.read(f"s/{sid}/systemprompt").encode())
    assert fresh > system // 4  # the system prompt and the tools, before any request
    daemon.prompt(sid, "hi")
    daemon.wait_idle(sid)
    usage = daemon.read(f"s/{sid}/usage")
    assert usage.endswith("[estimated]\n")
    sent = int(usage.split(" in,")[0])
    assert sent >= fresh > system // 4
    assert sent <= len(json.dumps(server.recorded[-1].body)) // 4


# ---- every answer shape, on every wire ---------------------------------------------------------

KEY = "sk-e2e-compaction-0123456789"
WIRES = ["openai", "copilot", "anthropic", "ollama", "gemini", "kiro"]
STATE = "counted to three"  # ANSWER's
SHAPES = {
    "prose then object": "Here is the compacted context.\n" + json.dumps(ANSWER) + "\nDone.",
    "fence after a sentence": "Sure:\n```json\n" + json.dumps(ANSWER, indent=2) + "\n```\n",
    "extra key": json.dumps({**ANSWER, "notes": "the model added this"}),
    "missing list": json.dumps({k: v for k, v in ANSWER.items() if k != "decisions"}),
    "unusable": "I am sorry, I cannot summarize this conversation.",
}


@pytest.fixture
def wired(tmp_path: Path) -> Iterator[tuple[ReplayServer, Daemon]]:
    if not HAVE_FUSE:
        pytest.skip(reason="needs /dev/fuse (this test mounts a real FUSE filesystem)")
    with ReplayServer(key=KEY, models=("replay", "plain")) as server:
        daemon = Daemon(tmp_path, server, server.settings())
        with daemon.running():
            yield server, daemon


def structured_answer(wire: str, text: str) -> Entry:
    """How a provider gives ``text`` when the request asked for structured output. Only
    Anthropic differs: the answer is the forced tool's input, always an object (the
    shapes around an object cannot happen there; the object's own shapes can)."""
    if wire != "anthropic":
        return Entry(reply=text)
    if text == SHAPES["unusable"]:
        return Entry(tool_calls=(EntryToolCall(name=ANSWER_NAME, arguments={"summary": text}),))
    doc = json.loads(text[text.index("{") : text.rindex("}") + 1])
    return Entry(tool_calls=(EntryToolCall(name=ANSWER_NAME, arguments=doc),))


def carried(wire: str, request: Recorded) -> Any:
    """The schema a compaction request carried, checked in its wire's own shape."""
    body = request.body
    if request.schema is None:
        assert not {"response_format", "format", "tool_choice"} & set(body)
        assert "responseSchema" not in body.get("generationConfig", {})
        return None
    if wire in ("openai", "copilot"):
        form = body["response_format"]
        assert form["type"] == "json_schema" and form["json_schema"]["strict"] is True
        assert form["json_schema"]["name"] == ANSWER_NAME
    elif wire == "anthropic":
        assert body["tool_choice"] == {"type": "tool", "name": ANSWER_NAME}
        assert [t["name"] for t in body["tools"]] == [ANSWER_NAME] and "thinking" not in body
    elif wire == "gemini":
        assert body["generationConfig"]["responseMimeType"] == "application/json"
        assert request.schema == gemini_schema(ANSWER_SCHEMA)
        return ANSWER_SCHEMA  # the same schema in Gemini's own form
    return request.schema


def compact_with(daemon: Daemon, sid: str, *entries: Entry) -> list[Recorded]:
    """One more turn (something to compact), then ``ctl compact`` answered by
    ``entries``; the requests the compaction made."""
    turns(daemon, sid, 1)
    asked = len(daemon.replay.recorded)
    daemon.replay.add(entries)
    daemon.write(f"s/{sid}/ctl", "compact")
    daemon.wait_idle(sid)
    return daemon.replay.recorded[asked:]


def check_compacted(daemon: Daemon, sid: str, n: int, shape: str) -> None:
    chat = daemon.read(f"s/{sid}/chat")
    last = chat[chat.rindex(":: compacting\n") :]
    summary = daemon.read(f"s/{sid}/compactions/{n}/summary")
    state = json.loads(daemon.read(f"s/{sid}/taskstate"))
    assert "error:" not in last, last
    if shape == "unusable":
        assert f" mechanically (compactions/{n}): the compaction model's answer is not" in last
        assert summary.startswith("[mechanical compaction: ")
        return
    assert f" (compactions/{n})\n" in last and "mechanical" not in summary, last
    assert state["progress"] == STATE and STATE in summary
    assert state.get("decisions", []) == ([] if shape == "missing list" else ["use ints"])


@pytest.mark.parametrize("wire", WIRES)
def test_every_answer_shape_on_every_wire(wired: tuple[ReplayServer, Daemon], wire: str) -> None:
    _, daemon = wired
    shapes = [*SHAPES, "429 then success"]
    # Structured output, where the wire has it (Kiro has none: the prompt alone asks).
    sid = daemon.new(name="s", backend=wire, model="replay")
    turns(daemon, sid, 4)
    for n, shape in enumerate(shapes, 1):
        answer = structured_answer(wire, SHAPES.get(shape, json.dumps(ANSWER)))
        first = [Entry(status=429, retry_after="0")] if shape.startswith("429") else []
        reqs = compact_with(daemon, sid, *first, answer)
        assert len(reqs) == 1 + len(first)
        schema = None if wire == "kiro" else ANSWER_SCHEMA
        assert [carried(wire, r) for r in reqs] == [schema] * len(reqs), shape
        check_compacted(daemon, sid, n, "ok" if shape.startswith("429") else shape)
    assert "retrying in 0s..." in daemon.read(f"s/{sid}/chat")
    if wire == "kiro":
        assert "Answer with one JSON object" in json.dumps(reqs[-1].body)
        return
    # A model that refuses the schema (400): asked again at once without it, and never
    # asked with it again, in this session or another.
    plain = daemon.new(name="p", backend=wire, model="plain")
    turns(daemon, plain, 4)
    reqs = compact_with(daemon, plain, Entry(refuse_schema=True, reply=json.dumps(ANSWER)))
    assert [carried(wire, r) for r in reqs] == [ANSWER_SCHEMA, None]
    check_compacted(daemon, plain, 1, "ok")
    chat = daemon.read(f"s/{plain}/chat")
    assert f":: {wire} refused structured output for plain: " in chat
    for n, shape in enumerate(SHAPES, 2):
        reqs = compact_with(daemon, plain, Entry(reply=SHAPES[shape]))
        assert [carried(wire, r) for r in reqs] == [None], shape
        check_compacted(daemon, plain, n, shape)
    other = daemon.new(name="p2", backend=wire, model="plain")
    turns(daemon, other, 5)
    [req] = compact_with(daemon, other, Entry(reply=SHAPES["fence after a sentence"]))
    assert carried(wire, req) is None
    check_compacted(daemon, other, 1, "fence after a sentence")
