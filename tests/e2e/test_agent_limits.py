"""The agent's limits end to end: automatic compaction, the safety table, turnError.

Each behaviour is driven through the mount with the replay server scripting the model,
and checked twice: by what the replay server received (the request that carries the
nudge, the compacted history, the request without tools, how many requests there were)
and by what ``chat`` and ``events`` show the user. The unit tests of ``safety`` and
``compact`` pin the rules; these pin that the daemon applies them to real requests.

Tool rounds use ``reasoning_think`` (a real call through toolsrv that succeeds) or a
tool that is not loaded (answered ``[tool error]`` by the daemon itself, a failing
round); each round's arguments differ unless a test wants the same action repeated, so
that the stall rule stays out of the way of the others.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from typing import Any

import pytest

from olliefs.agent.compact import CHECKPOINT_HEADER, COMPACTED_HEADER, PROMPT
from olliefs.agent.loop import SUMMARY_PROMPT
from olliefs.replay import Entry, ReplayServer
from olliefs.testing import Daemon
from tests.conftest import oserror, script

ANSWER = {"goal": "count", "state": "counted to three", "decisions": ["use ints"], "next": "stop"}
OVERFLOW = (
    '{"status": 400, "error": "This model\'s maximum context length is 8 tokens",'
    ' "error_code": "context_length_exceeded"}'
)


def context(daemon: Daemon, sid: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in daemon.read(f"s/{sid}/context").splitlines()]


def events(daemon: Daemon, sid: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in daemon.snapshot(f"s/{sid}/events").splitlines()]


def turns(daemon: Daemon, sid: str, n: int) -> None:
    """``n`` short echo turns: 2n messages of history, small enough not to compact."""
    for i in range(n):
        daemon.prompt(sid, f"step {i}")
        daemon.wait_idle(sid)


def call(
    name: str, i: int, *, text: str = "", usage: tuple[int, int] | None = None, **args: Any
) -> str:
    """One scripted reply with one tool call (id ``c<i>``)."""
    entry: dict[str, Any] = {"tool_calls": [{"id": f"c{i}", "name": name, "arguments": args}]}
    if text:
        entry["reply"] = text
    if usage is not None:
        entry["usage"] = {"prompt_tokens": usage[0], "completion_tokens": usage[1]}
    return json.dumps(entry)


def think(i: int, thought: str | None = None, text: str = "") -> str:
    return call("reasoning_think", i, text=text, thought=thought or f"thought {i}")


def texts(request: dict[str, Any]) -> list[str]:
    return [m.get("content") or "" for m in request["messages"]]


def run(daemon: Daemon, sid: str, prompt: str, *lines: str) -> list[dict[str, Any]]:
    """Script ``lines``, send ``prompt``, wait for the turn; the requests it made."""
    n0 = len(daemon.replay.requests)
    daemon.replay.add(script(*lines))
    daemon.prompt(sid, prompt)
    daemon.wait_idle(sid)
    return daemon.replay.requests[n0:]


def thinker(daemon: Daemon, name: str) -> str:
    sid = daemon.new(name=name)
    daemon.write(f"s/{sid}/ctl", "tool_load reasoning_think")
    return sid


# ---- compaction -------------------------------------------------------------------------


@pytest.mark.parametrize("measure", ["usage", "estimate"])
def test_a_half_full_context_compacts_before_the_next_request(
    daemon_factory: Callable[..., Daemon], measure: str
) -> None:
    """Half of the model's context (8000 tokens here, from the replay server's model list)
    is crossed by one tool round: as the provider counted it (``usage``), or, when the
    provider reports no usage, as estimated from the history's bytes / 4 (``estimate``).
    The next request of the same turn is then preceded by a compaction and carries the
    compacted history: cold, warm, and the last 8 messages verbatim, unless they would
    hold more than 30% of the context: the big prompt of ``estimate`` leaves the context
    then, and only the last round stays."""
    d = daemon_factory()
    d.replay.context_length = 8000
    d.start()
    sid = d.new(name="auto")
    turns(d, sid, 5)
    small = context(d, sid)
    assert len(small) == 10
    if measure == "usage":
        prompt, usage = "work", (4100, 10)  # 4110 >= 4000
    else:
        prompt, usage = "work " + "x" * 16400, (0, 0)  # no usage: ~4100 tokens by bytes/4
    reqs = run(
        d,
        sid,
        prompt,
        call("file_read", 1, usage=usage, path="x"),
        json.dumps({"reply": json.dumps(ANSWER)}),
        '{"reply": "done"}',
    )
    assert len(reqs) == 3
    first, comp, after = reqs
    assert ("[estimated]" in d.read(f"s/{sid}/usage")) == (measure == "estimate")
    assert not comp.get("tools") and texts(comp)[0] == PROMPT
    assert first.get("tools") and after.get("tools")

    before = [json.loads(x) for x in d.read(f"s/{sid}/compactions/1/before.jsonl").splitlines()]
    assert before[:10] == small and len(before) == 13
    assert before[10] == {"role": "user", "content": prompt}
    assert [m["role"] for m in before[11:]] == ["assistant", "tool"]
    summary = d.read(f"s/{sid}/compactions/1/summary")
    assert "counted to three" in summary and "use ints" in summary
    dropped = d.read(f"s/{sid}/compactions/1/dropped").splitlines()
    cut = 5 if measure == "usage" else 11
    assert [x.split("\t")[0] for x in dropped] == [str(i) for i in range(cut)]

    # What the next request carried: system, cold, warm, then the hot zone verbatim.
    sent = texts(after)
    assert sent[1].startswith(COMPACTED_HEADER) and "counted to three" in sent[1]
    assert sent[2].startswith("[ollie: decision index]") and "- use ints" in sent[2]
    hot = before[cut:]
    assert [m["role"] for m in after["messages"][3:]] == [m["role"] for m in hot]
    assert sent[3:] == [m.get("content", "") for m in hot]
    assert after["messages"][-2]["tool_calls"][0]["id"] == "c1"
    now = context(d, sid)
    assert now[2:-1] == hot and now[-1] == {"role": "assistant", "content": "done"}

    # Announced before the compaction request and after it, then the turn went on.
    roles = [e["role"] for e in events(d, sid)]
    lines = [(e["role"], e["content"]) for e in events(d, sid)]
    start = lines.index(("info", "compacting"))
    end = lines.index(("info", f"compacted 13 messages into {2 + len(hot)} (compactions/1)"))
    assert max(i for i, r in enumerate(roles) if r == "tool") < start < end
    assert end < max(i for i, r in enumerate(roles) if r == "assistant")
    chat = d.read(f"s/{sid}/chat")
    assert chat.index(":: compacting\n") < chat.index(":: compacted 13") < chat.index("done")


def test_no_compaction_below_half(daemon: Daemon) -> None:
    """The control: the same script with usage under half the context compacts nothing
    (the replay server's default context is 128000 tokens)."""
    sid = daemon.new(name="low")
    turns(daemon, sid, 5)
    reqs = run(daemon, sid, "work", call("file_read", 1, usage=(60000, 10), path="x"))
    assert len(reqs) == 2 and all(r.get("tools") for r in reqs)
    assert "compacting" not in daemon.read(f"s/{sid}/chat")


def test_context_overflow_compacts_then_retries_once(daemon: Daemon) -> None:
    sid = daemon.new(name="over")
    turns(daemon, sid, 5)
    small = context(daemon, sid)
    reqs = run(
        daemon,
        sid,
        "more",
        OVERFLOW,
        json.dumps({"reply": json.dumps(ANSWER)}),
        '{"reply": "fits"}',
    )
    assert len(reqs) == 3
    assert texts(reqs[1])[0] == PROMPT and not reqs[1].get("tools")
    assert texts(reqs[2])[1].startswith(COMPACTED_HEADER)
    assert texts(reqs[2])[-1] == "more" and len(reqs[2]["messages"]) == 1 + 2 + 8
    before = [
        json.loads(x) for x in daemon.read(f"s/{sid}/compactions/1/before.jsonl").splitlines()
    ]
    assert before == [*small, {"role": "user", "content": "more"}]
    chat = daemon.read(f"s/{sid}/chat")
    assert chat.endswith("assistant: fits\n") and "error:" not in chat

    # Exactly one retry: a second overflow after the compaction ends the turn.
    reqs = run(daemon, sid, "again", OVERFLOW, json.dumps({"reply": json.dumps(ANSWER)}), OVERFLOW)
    assert len(reqs) == 3
    last = daemon.read(f"s/{sid}/chat").splitlines()[-1]
    assert last.startswith("error: ") and "context" in last
    assert daemon.read(f"s/{sid}/compactions/2/before.jsonl")
    assert daemon.read(f"s/{sid}/state") == "idle\n"


# ---- the safety table -------------------------------------------------------------------

ERRORS_NUDGE = "[ollie] The last 5 tool rounds all had errors."
REPLAN_NUDGE = "[ollie] 8 tool rounds without a plan."
STALL_NUDGE = "[ollie] The last 5 tool rounds did the same thing"
REINJECT = "[ollie] Task state (repeated every 10 tool rounds"


def nudged(reqs: list[dict[str, Any]], needle: str) -> list[int]:
    """The requests (0-based) that carry one message starting with ``needle`` more than
    the request before them: where a new one was added (older ones stay in history)."""
    counts = [sum(t.startswith(needle) for t in texts(r)) for r in reqs]
    return [i for i in range(1, len(reqs)) if counts[i] > counts[i - 1]]


def test_five_failing_rounds_nudge_the_next_request(daemon: Daemon) -> None:
    sid = daemon.new(name="err5")
    failing = [call("file_read", i, path=f"f{i}") for i in range(1, 6)]
    reqs = run(daemon, sid, "read them", *failing, '{"reply": "giving up"}')
    assert len(reqs) == 6
    assert nudged(reqs, ERRORS_NUDGE) == [5]  # the 6th request, not before
    assert texts(reqs[5])[-1].startswith(ERRORS_NUDGE)  # right after the 5th results
    assert STALL_NUDGE not in json.dumps(reqs)
    chat = daemon.read(f"s/{sid}/chat")
    assert chat.count(":: safety: errors nudge\n") == 1
    assert chat.endswith("assistant: giving up\n")


def test_ten_failing_rounds_abort_the_turn(daemon: Daemon) -> None:
    sid = daemon.new(name="err10")
    failing = [call("file_read", i, path=f"f{i}") for i in range(1, 12)]
    reqs = run(daemon, sid, "read them", *failing[:10], '{"reply": "fine"}')
    assert len(reqs) == 10  # no 11th request: the scripted reply is left
    assert nudged(reqs, ERRORS_NUDGE) == [5]  # once per streak
    chat = daemon.read(f"s/{sid}/chat").splitlines()
    assert chat[-1] == "error: 10 tool rounds in a row had errors: the turn is stopped"
    assert chat.count(":: safety: errors nudge") == 1
    assert daemon.read(f"s/{sid}/state") == "idle\n"
    # The session goes on: the left-over entry answers the next prompt.
    daemon.prompt(sid, "next")
    daemon.wait_idle(sid)
    assert len(daemon.replay.requests) == 11
    assert daemon.read(f"s/{sid}/chat").endswith("assistant: fine\n")


def test_replan_gate_after_eight_rounds_without_a_plan(daemon: Daemon) -> None:
    sid = thinker(daemon, "replan")
    reqs = run(daemon, sid, "go", *[think(i) for i in range(1, 10)], '{"reply": "ok"}')
    assert len(reqs) == 10
    assert nudged(reqs, REPLAN_NUDGE) == [8]  # the 9th request
    assert texts(reqs[8])[-1].startswith(REPLAN_NUDGE)
    assert ":: safety: replan nudge" in daemon.read(f"s/{sid}/chat")

    # The control: a reply with a PLAN: block resets the count, so 9 rounds with one at
    # the 4th say nothing.
    rounds = [think(i, text="PLAN:\n- [ ] think more" if i == 4 else "") for i in range(1, 10)]
    reqs = run(daemon, sid, "again", *rounds, '{"reply": "ok"}')
    assert len(reqs) == 10 and nudged(reqs, REPLAN_NUDGE) == []


def test_stall_after_five_rounds_with_the_same_action(daemon: Daemon) -> None:
    sid = thinker(daemon, "stall")
    same = [think(i, "the same thought") for i in range(1, 6)]
    reqs = run(daemon, sid, "go", *same, '{"reply": "ok"}')
    assert len(reqs) == 6
    assert nudged(reqs, STALL_NUDGE) == [5]
    assert "(reasoning_think(" in texts(reqs[5])[-1]  # it names the repeated action
    assert ":: safety: stall nudge" in daemon.read(f"s/{sid}/chat")
    # The control: five different actions do not stall.
    reqs = run(daemon, sid, "again", *[think(i) for i in range(6, 11)], '{"reply": "ok"}')
    assert len(reqs) == 6 and nudged(reqs, STALL_NUDGE) == []


def test_plan_is_reinjected_every_ten_rounds(daemon: Daemon) -> None:
    sid = thinker(daemon, "reinj")
    plan = "PLAN:\n- [ ] think ten times"  # a PLAN: block every round: no replan nudge
    rounds = [think(i, text=plan) for i in range(1, 12)]
    reqs = run(daemon, sid, "the big goal", *rounds, '{"reply": "ok"}')
    assert len(reqs) == 12
    assert nudged(reqs, REINJECT) == [10]  # the 11th request
    text = texts(reqs[10])[-1]
    assert text.startswith(REINJECT)
    state = json.loads(text.split("\n", 1)[1])
    assert state["goal"] == "the big goal" and state["plan_step"] == "think ten times"
    assert nudged(reqs, REPLAN_NUDGE) == []
    assert daemon.read(f"s/{sid}/chat").count(":: safety: plan nudge\n") == 1


def _final_request_has_no_tools(daemon: Daemon, sid: str, steps: int) -> None:
    rounds = [think(i) for i in range(1, steps + 1)]
    summary = {"reply": "summary: thought a lot", "tool_calls": [{"name": "reasoning_think"}]}
    reqs = run(daemon, sid, "go", *rounds, json.dumps(summary))
    assert len(reqs) == steps + 1
    assert all(r.get("tools") for r in reqs[:steps])
    final = reqs[steps]
    assert not final.get("tools") and "tool_choice" not in final
    assert texts(final)[-1] == SUMMARY_PROMPT
    chat = daemon.read(f"s/{sid}/chat")
    assert f":: step limit of {steps} reached: asking for a summary\n" in chat
    assert chat.endswith("assistant: summary: thought a lot\n")
    # The calls the model made anyway are dropped: the history stays valid.
    assert context(daemon, sid)[-1] == {"role": "assistant", "content": "summary: thought a lot"}
    assert daemon.read(f"s/{sid}/tcct") == f"{steps}\n"


def test_ctl_maxsteps_ends_with_a_request_without_tools(daemon: Daemon) -> None:
    sid = thinker(daemon, "max")
    daemon.write(f"s/{sid}/ctl", "maxsteps 3")
    _final_request_has_no_tools(daemon, sid, 3)


@pytest.mark.parametrize("how", ["s/new", "ctl agent"])
def test_profile_maxsteps_ends_with_a_request_without_tools(daemon: Daemon, how: str) -> None:
    """The profile's maxSteps, for a session made with it and for one switched to it."""
    profile = {"tools": ["client_9p", "reasoning_think"], "maxSteps": 2}
    with open(daemon.p("a/short.json"), "w") as f:
        f.write(json.dumps(profile))
    if how == "s/new":
        sid = daemon.new(name="maxp", agent="short")
    else:
        sid = daemon.new(name="maxp")
        daemon.write(f"s/{sid}/ctl", "agent short")
    _final_request_has_no_tools(daemon, sid, 2)


# ---- the turnError hook -----------------------------------------------------------------

TURN_ERROR = (
    "cat > payload.json; echo 'switched to plan B'; echo 'no retries today' >&2; "
    "exit $(cat exitcode)"
)


@pytest.fixture
def hooked(daemon: Daemon) -> str:
    """A session whose profile (written to a/) has a turnError hook; the hook saves its
    payload and exits with the status the test puts in ``exitcode`` (in the session's
    working directory, where hooks run)."""
    profile = {"tools": ["client_9p"], "hooks": {"turnError": TURN_ERROR}}
    with open(daemon.p("a/careful.json"), "w") as f:
        f.write(json.dumps(profile))
    return daemon.new(name="te", agent="careful")


def set_exit(daemon: Daemon, status: int) -> None:
    (daemon.work / "exitcode").write_text(f"{status}\n")


def test_turn_error_hook_exit_0_handles_the_error(daemon: Daemon, hooked: str) -> None:
    set_exit(daemon, 0)
    reqs = run(daemon, hooked, "go", '{"status": 503, "error": "overloaded"}')
    assert len(reqs) == 1  # handled: no retry (a retry would get an echo)
    payload = json.loads((daemon.work / "payload.json").read_text())
    assert payload["event"] == "turnError" and payload["session_id"] == hooked
    assert "overloaded" in payload["error"] and "503" in payload["error"]
    assert payload["error_type"] == "transient" and payload["attempt"] == 0
    chat = daemon.read(f"s/{hooked}/chat")
    assert chat.splitlines()[-1].startswith("error: ")
    assert chat.splitlines()[-1].endswith("(handled by the turnError hook)")
    assert "retrying" not in chat
    assert context(daemon, hooked)[-1] == {
        "role": "user",
        "content": "[turnError hook]\nswitched to plan B",
    }


def test_turn_error_hook_failing_takes_the_normal_path(daemon: Daemon, hooked: str) -> None:
    set_exit(daemon, 1)
    reqs = run(daemon, hooked, "go", '{"status": 503, "error": "overloaded"}', '{"reply": "ok"}')
    assert len(reqs) == 2  # the usual retry
    chat = daemon.read(f"s/{hooked}/chat")
    assert ":: hook turnError (`" in chat and "exited 1: no retries today" in chat
    assert "retrying in " in chat and chat.endswith("assistant: ok\n")
    assert json.loads((daemon.work / "payload.json").read_text())["event"] == "turnError"


def test_turn_error_hook_exit_2_blocks_the_retries(daemon: Daemon, hooked: str) -> None:
    set_exit(daemon, 2)
    reqs = run(daemon, hooked, "go", '{"status": 503, "error": "overloaded"}')
    assert len(reqs) == 1
    lines = daemon.read(f"s/{hooked}/chat").splitlines()
    assert lines[-2] == "error: blocked by the turnError hook: no retries today"
    assert lines[-1].startswith("error: ") and "overloaded" in lines[-1]
    assert not any(x.startswith("retrying") for x in lines)


# The seed's recovery: the hook names another model (or backend) and the request is sent
# again there. It logs the model each failure was on, and switches only away from "bad".
RECOVER = (
    'echo "$OLLIE_BACKEND/$OLLIE_MODEL $OLLIE_ERROR_TYPE" >> hook.log; '
    'if [ "$OLLIE_MODEL" = bad ]; then cat switch; echo "the bad model is down"; fi'
)


@pytest.fixture
def recovering(daemon_factory: Callable[..., Daemon], replay: ReplayServer) -> tuple[Daemon, str]:
    """A session on model ``bad`` whose turnError hook switches to what the test writes
    in ``switch``; every backend points at the replay server."""
    d = daemon_factory(**replay.settings())
    d.start()
    with open(d.p("a/recover.json"), "w") as f:
        f.write(json.dumps({"hooks": {"turnError": RECOVER}}))
    return d, d.new(name="rec", agent="recover", model="bad")


@pytest.mark.parametrize(
    "switch", ["model=good\n", "backend=ollama\nmodel=good\n"], ids=["model", "backend"]
)
def test_turn_error_hook_switches_model_and_the_request_is_sent_again(
    recovering: tuple[Daemon, str], switch: str
) -> None:
    """A provider that fails on one model and answers on another: the hook's
    ``model=``/``backend=`` lines switch the session in the running turn (where ctl and
    cfg refuse to), the request goes again at once on the new model, the turn goes on
    there, and so does the session."""
    d, sid = recovering
    (d.work / "switch").write_text(switch)
    backend = "ollama" if "backend" in switch else "openai"
    d.replay.add(
        script(
            '{"for_model": "bad", "status": 503, "error": "overloaded"}',
            '{"for_model": "good", "reply": "recovered"}',
        )
    )
    reqs = run(d, sid, "go")
    assert [r["model"] for r in reqs] == ["bad", "good"]  # no back-off, no retry on bad
    assert [r.wire for r in d.replay.recorded] == ["openai", backend]
    assert texts(reqs[1])[-2:] == ["go", "[turnError hook]\nthe bad model is down"]
    chat = d.read(f"s/{sid}/chat")
    assert f":: turnError hook: switched to {switch.strip().replace(chr(10), ' ')}; " in chat
    assert chat.endswith("assistant: recovered\n")
    assert "error:" not in chat and "retrying" not in chat
    cfg = d.read(f"s/{sid}/cfg")
    assert f"backend={backend}\n" in cfg and "model=good\n" in cfg
    assert (d.work / "hook.log").read_text() == "openai/bad transient\n"
    # The switch is the session's, journaled: the next turn and a restart keep it.
    d.stop()
    d.start()
    assert d.read(f"s/{sid}/cfg") == cfg
    assert run(d, sid, "again")[0]["model"] == "good"


def test_a_turn_error_switch_that_fails_again_takes_the_usual_way(
    recovering: tuple[Daemon, str],
) -> None:
    """Once per request: when the new model fails too, the hook is not asked again (two
    hooks could switch back and forth forever); the usual retries follow, then the error."""
    d, sid = recovering
    (d.work / "switch").write_text("model=good\n")
    fail = '{"for_model": "good", "status": 503, "error": "also down"}'
    reqs = run(d, sid, "go", '{"for_model": "bad", "status": 503}', *[fail] * 4)
    assert [r["model"] for r in reqs] == ["bad"] + ["good"] * 4  # 3 retries on good
    assert (d.work / "hook.log").read_text() == "openai/bad transient\n"
    lines = d.read(f"s/{sid}/chat").splitlines()
    assert lines[-1].startswith("error: ") and "also down" in lines[-1]
    assert sum(x.startswith("retrying in ") for x in lines) == 3


def test_a_turn_error_switch_that_cannot_be_applied_is_a_warning(
    recovering: tuple[Daemon, str],
) -> None:
    d, sid = recovering
    (d.work / "switch").write_text("backend=nosuch\n")
    reqs = run(d, sid, "go", '{"for_model": "bad", "status": 503}', '{"reply": "retried"}')
    assert len(reqs) == 2  # the usual retry, on the same model
    assert [r["model"] for r in reqs] == ["bad", "bad"]
    chat = d.read(f"s/{sid}/chat")
    assert ":: hook turnError: not switched: unknown backend: nosuch" in chat
    assert "retrying in " in chat and chat.endswith("assistant: retried\n")
    assert "model=bad\n" in d.read(f"s/{sid}/cfg")


# ---- a subagent from a checkpoint -------------------------------------------------------


def test_subagent_spawn_from_a_checkpoint(daemon: Daemon) -> None:
    """The child's history is the parent's checkpoint (cold TaskState, warm decision
    index) and its task: none of the parent's messages reach the child's model."""
    sid = daemon.new(name="par")
    daemon.write(f"s/{sid}/ctl", "tool_load subagent_spawn")
    turns(daemon, sid, 5)
    daemon.replay.add([Entry(reply=json.dumps(ANSWER))])
    daemon.write(f"s/{sid}/ctl", "compact")  # the TaskState now has a decision
    daemon.wait_idle(sid)
    spawn = {"name": "kid", "prompt": "count again", "checkpoint": True}
    reqs = run(
        daemon,
        sid,
        "delegate",
        json.dumps({"tool_calls": [{"id": "s1", "name": "subagent_spawn", "arguments": spawn}]}),
        '{"reply": "the kid says 42"}',
        '{"reply": "parent done"}',
    )
    assert len(reqs) == 3
    child = texts(reqs[1])
    assert len(child) == 4  # system, cold, warm, the task
    assert child[1].startswith(CHECKPOINT_HEADER)
    state = json.loads(child[1].split("\n", 1)[1])
    assert state["goal"] == "count" and state["progress"] == "counted to three"
    assert child[2].startswith("[ollie: decision index]") and "- use ints" in child[2]
    assert child[3] == "count again"
    assert "step 0" not in json.dumps(reqs[1]) and "delegate" not in json.dumps(reqs[1])
    assert "[par__kid] the kid says 42" in daemon.read(f"s/{sid}/chat")
    assert [m["role"] for m in context(daemon, "par__kid")] == ["user"] * 3 + ["assistant"]
    kid_chat = daemon.read("s/par__kid/chat")
    assert ":: forked from par, starting from its checkpoint" in kid_chat
    assert daemon.read("s/par__kid/cfg") == daemon.read(f"s/{sid}/cfg")
    assert "subagent_spawn" in daemon.read("s/par__kid/tools")


def test_ctl_fork_checkpoint(daemon: Daemon) -> None:
    sid = daemon.new(name="src")
    turns(daemon, sid, 2)
    daemon.write(f"s/{sid}/ctl", "fork cp checkpoint")
    ctx = context(daemon, "cp")
    assert len(ctx) == 1 and ctx[0]["role"] == "user"  # no decision yet: no warm zone
    assert ctx[0]["content"].startswith(CHECKPOINT_HEADER)
    assert json.loads(ctx[0]["content"].split("\n", 1)[1])["goal"] == "step 0"
    assert len(context(daemon, sid)) == 4  # the source is untouched
    assert ":: forked into cp, which starts from this checkpoint" in daemon.read(f"s/{sid}/chat")
    for bad, err in (("fork cp2 checkpoint x", errno.EINVAL), ("fork cp2 chk", errno.EINVAL),
                     ("fork cp checkpoint", errno.EEXIST)):  # fmt: skip
        assert oserror(daemon.write, f"s/{sid}/ctl", bad) == err, bad
    assert "cp2" not in os.listdir(daemon.p("s"))
    daemon.prompt("cp", "go on")
    daemon.wait_idle("cp")
    assert texts(daemon.replay.requests[-1])[1:] == [ctx[0]["content"], "go on"]


def test_compaction_hooks_and_model(daemon: Daemon) -> None:
    """preCompact and postCompact hear which trigger fired; preCompact's output goes to
    the compaction model, postCompact's into the new context; the profile's
    compactionModel writes the summary."""
    log = daemon.work / "compact.log"
    profile = {
        "compactionModel": "small-model",
        "hooks": {
            "preCompact": f"cat >> {log}; echo >> {log}; echo 'mind the numbers'",
            "postCompact": f"cat >> {log}; echo >> {log}; echo 'compacted: reread the plan'",
        },
    }
    with open(daemon.p("a/watch.json"), "w") as f:
        f.write(json.dumps(profile))
    sid = daemon.new(name="hk", agent="watch")
    turns(daemon, sid, 5)
    answer = json.dumps({"reply": json.dumps(ANSWER)})
    reqs = run(daemon, sid, "more", OVERFLOW, answer, '{"reply": "fits"}')
    assert len(reqs) == 3
    comp, retry = reqs[1], reqs[2]
    assert comp["model"] == "small-model" and retry["model"] == "replay"
    assert "mind the numbers" in texts(comp)[1]
    assert texts(retry)[-1] == "[postCompact hook]\ncompacted: reread the plan"
    assert ":: compacting\n" in daemon.read(f"s/{sid}/chat")  # the hook's text is not a focus
    daemon.replay.add([Entry(reply=json.dumps(ANSWER))])
    daemon.write(f"s/{sid}/ctl", "compact")
    daemon.wait_idle(sid)
    payloads = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(p["event"], p["trigger"]) for p in payloads] == [
        ("preCompact", "overflow"),
        ("postCompact", "overflow"),
        ("preCompact", "ctl"),
        ("postCompact", "ctl"),
    ]
    assert payloads[0]["tokens"] > 0 and payloads[1]["compaction"] == 1
    assert payloads[3]["compaction"] == 2


def test_the_agent_compacts_itself_through_its_ctl(daemon: Daemon) -> None:
    """Issue 8: compaction "by the agent itself through its ctl". The model writes
    ``compact FOCUS`` to its own ctl with client_9p while its turn runs: the write is
    accepted (not EBUSY), and the turn's next request is preceded by a compaction with
    that focus and carries the compacted history."""
    sid = daemon.new(name="selfcompact")
    turns(daemon, sid, 5)
    reqs = run(
        daemon,
        sid,
        "tidy up",
        call("client_9p", 1, op="write", path="ctl", data="compact keep the ints"),
        json.dumps({"reply": json.dumps(ANSWER)}),
        '{"reply": "tidied"}',
    )
    assert len(reqs) == 3
    _first, comp, after = reqs
    assert texts(comp)[0] == PROMPT and "keep the ints" in "\n".join(texts(comp))
    assert texts(after)[1].startswith(COMPACTED_HEADER)
    chat = daemon.read(f"s/{sid}/chat")
    assert "error:" not in chat
    assert chat.index(":: compaction requested") < chat.index(":: compacting (focus: keep the")
    assert chat.index(":: compacted") < chat.index("tidied")
    assert daemon.read(f"s/{sid}/compactions/1/summary")


def test_post_turn_is_told_how_the_turn_ended(daemon: Daemon) -> None:
    """postTurn's payload has ``end`` (done, maxsteps, error; stopped is a cancel) and
    ``rounds`` (tool rounds), as ollie-agent(5) lists them."""
    log = daemon.work / "post.log"
    profile = {
        "tools": ["client_9p", "reasoning_think"],
        "hooks": {"postTurn": f'echo "$OLLIE_END $OLLIE_ROUNDS" >> {log}'},
    }
    with open(daemon.p("a/post.json"), "w") as f:
        f.write(json.dumps(profile))
    sid = daemon.new(name="pt", agent="post")
    run(daemon, sid, "two rounds", think(1), think(2), '{"reply": "done"}')
    daemon.write(f"s/{sid}/ctl", "maxsteps 1")
    run(daemon, sid, "one round then the limit", think(3), '{"reply": "summary"}')
    run(daemon, sid, "a failing backend", '{"status": 400, "error": "bad request"}')
    assert log.read_text().split("\n")[:-1] == ["done 2", "maxsteps 1", "error 0"]
