"""Nothing is lost: sessions come back after a clean restart and after a SIGKILL."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from olliefs.agent.compact import PROMPT
from tests.conftest import Daemon, script
from tests.e2e.test_agent_limits import ANSWER, think, turns

SAME_AFTER_RESTART = ("chat", "context", "usage", "cost", "cfg", "prompt.prev", "offset", "env")


def snapshot(d: Daemon, sid: str) -> dict[str, str]:
    out = {name: d.read(f"s/{sid}/{name}") for name in SAME_AFTER_RESTART}
    out["events"] = d.snapshot(f"s/{sid}/events")
    return out


def test_clean_restart_restores_everything(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory()
    d.start()
    d.replay.add(script('{"reasoning": "r", "reply": "one", "usage": {"cost": 0.125}}'))
    d.new(name="keep", model="gpt-4o")
    d.write("s/keep/cfg", "temperature=0.25\n")
    d.prompt("keep", "first")
    d.wait_idle("keep")
    d.prompt("keep", "second")
    d.wait_idle("keep")
    d.write("s/keep/ctl", "rn kept")
    before = snapshot(d, "kept")
    d.stop()
    d.start()
    assert sorted(os.listdir(d.p("s"))) == ["idx", "kept", "new"]
    assert snapshot(d, "kept") == before
    d.prompt("kept", "third")
    d.wait_idle("kept")
    assert d.replay.requests[-1]["temperature"] == 0.25
    assert [m["content"] for m in d.replay.requests[-1]["messages"][1:]] == [
        "first",
        "one",
        "second",
        "echo: second",
        "third",
    ]


def test_sigkill_mid_reply_loses_no_acknowledged_prompt(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory()
    d.start()
    d.replay.add(script('{"reply": "' + "tick " * 400 + '", "chunk": 5, "delay": 0.01}'))
    d.new(name="crash")
    d.prompt("crash", "done before")
    d.wait_idle("crash")
    d.replay.add(script('{"reply": "' + "tock " * 400 + '", "chunk": 5, "delay": 0.01}'))
    d.prompt("crash", "long one")
    d.wait_chat("crash", "assistant: tock tock")
    d.prompt("crash", "queued behind")
    d.crash()
    # the dead mount answers ENOTCONN until the next mount clears it
    d.start()
    assert "cleared a stale mount" in d.stderr()
    d.wait_idle("crash")
    chat = d.read("s/crash/chat")
    assert "user: done before\nassistant: tick tick" in chat
    assert "user: long one\n" in chat and "user: queued behind\n" in chat
    cut = chat.index(":: interrupted by restart\n")
    assert "tock tock" in chat[:cut]
    assert chat.endswith("assistant: echo: queued behind\n")
    assert chat.count(":: interrupted by restart") == 1
    # the cut turn was not re-run: the last request is the queued prompt
    assert [r["messages"][-1]["content"] for r in d.replay.requests][-1] == "queued behind"
    d.stop()
    d.start()
    assert d.read("s/crash/chat") == chat


def test_taskstate_survives_restarts_and_feeds_the_next_compaction(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """The TaskState (goal, plan step, last action, rounds, the decisions of a
    compaction) is the same after a clean restart and after a SIGKILL, and the next
    compaction is asked to go on from it: the decisions it should carry reach it."""
    d = daemon_factory()
    d.start()
    sid = d.new(name="ts")
    d.write(f"s/{sid}/ctl", "tool_load reasoning_think")
    turns(d, sid, 4)
    d.replay.add(
        script(
            think(1, text="PLAN:\n- [x] look\n- [ ] count the ints"),
            think(2, "the ints are three"),
            '{"reply": "counted"}',
        )
    )
    d.prompt(sid, "count the ints")
    d.wait_idle(sid)
    d.replay.add(script(json.dumps({"reply": json.dumps(ANSWER)})))
    d.write(f"s/{sid}/ctl", "compact")
    d.wait_idle(sid)
    d.replay.add(script(think(3, "and a fourth"), '{"reply": "four"}'))
    d.prompt(sid, "one more")
    d.wait_idle(sid)
    before = d.read(f"s/{sid}/taskstate")
    state = json.loads(before)
    assert state["goal"] == "count" and state["decisions"] == ["use ints"]
    assert state["plan_step"] == "count the ints" and state["rounds"] == 3
    assert state["last_action"].startswith('reasoning_think({"thought":"and a fourth"})')

    d.stop()
    d.start()
    assert d.read(f"s/{sid}/taskstate") == before
    d.crash()
    d.start()
    assert d.read(f"s/{sid}/taskstate") == before

    turns(d, sid, 1)  # the compacted history has nothing older than the hot zone yet
    n0 = len(d.replay.requests)
    more = {**ANSWER, "decisions": ["use ints", "stop at four"]}
    d.replay.add(script(json.dumps({"reply": json.dumps(more)})))
    d.write(f"s/{sid}/ctl", "compact")
    d.wait_idle(sid)
    assert json.loads(d.read(f"s/{sid}/taskstate"))["decisions"] == more["decisions"]
    comp = d.replay.requests[n0]
    assert comp["messages"][0]["content"] == PROMPT
    asked = comp["messages"][1]["content"]
    assert asked.startswith("Task state so far:\n")
    carried = json.loads(asked.split("\n", 1)[1].split("\nResults to summarize")[0])
    assert carried == state
