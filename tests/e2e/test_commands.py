"""ctl commands and command prompts end to end: each is one entry of the command table.

Through the mount, against the replay LLM server (and the daemon's own toolsrv for
``!cmd``): inject, irw, queue clear, maxsteps, save, fork, rewind, /cmd and !cmd prompts,
the session cost cap.
"""

from __future__ import annotations

import errno
import json
import os
from typing import Any

from olliefs.testing import Daemon
from tests.conftest import oserror, script

SLOW = '{"reply": "slow and steady", "chunk": 1, "delay": 0.05}'


def context(daemon: Daemon, sid: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in daemon.read(f"s/{sid}/context").splitlines()]


def last_user(daemon: Daemon, i: int) -> str:
    users = [m for m in daemon.replay.requests[i]["messages"] if m["role"] == "user"]
    return str(users[-1]["content"])


def test_inject_reaches_the_running_turn_at_its_next_step(daemon: Daemon) -> None:
    daemon.replay.add(script(SLOW, '{"reply": "done"}'))
    sid = daemon.new(name="inj")
    daemon.prompt(sid, "start")
    daemon.wait_chat(sid, "assistant: s")
    daemon.write(f"s/{sid}/ctl", "inject also check the docs")
    daemon.write(f"s/{sid}/ctl", "irw check the tests instead")
    daemon.wait_idle(sid)
    # One turn, two requests: the second carries the (rewritten) injection.
    assert len(daemon.replay.requests) == 2
    assert last_user(daemon, 1) == "check the tests instead"
    chat = daemon.read(f"s/{sid}/chat")
    assert "injection replaced" in chat and "user: check the tests instead" in chat
    assert "also check the docs" not in [m["content"] for m in context(daemon, sid)]


def test_inject_while_idle_is_a_prompt(daemon: Daemon) -> None:
    sid = daemon.new(name="idle")
    daemon.write(f"s/{sid}/ctl", "inject hello there")
    daemon.wait_idle(sid)
    assert last_user(daemon, 0) == "hello there"


def test_queue_clear_drops_waiting_prompts_for_good(daemon: Daemon) -> None:
    daemon.replay.add(script('{"reply": "x", "hang": true}'))
    sid = daemon.new(name="qc")
    daemon.prompt(sid, "first")
    daemon.wait_for(lambda: len(daemon.replay.requests) == 1)
    daemon.prompt(sid, "second")
    daemon.prompt(sid, "third")
    daemon.write(f"s/{sid}/ctl", "queue clear")
    assert oserror(lambda: daemon.write(f"s/{sid}/ctl", "queue flush")) == errno.EINVAL
    daemon.write(f"s/{sid}/ctl", "stop")
    daemon.wait_idle(sid)
    assert ":: queue cleared (2 prompts)" in daemon.read(f"s/{sid}/chat")
    daemon.stop()
    daemon.start()
    daemon.wait_idle(sid)
    assert len(daemon.replay.requests) == 1  # neither ran, not even after the restart


def test_maxsteps_ends_with_a_summary_without_tools(daemon: Daemon) -> None:
    think = json.dumps(
        {"tool_calls": [{"name": "reasoning_think", "arguments": {"thought": "t"}, "id": "c"}]}
    )
    daemon.replay.add(script(think, think, think))
    sid = daemon.new(name="ms")
    daemon.write(f"s/{sid}/ctl", "tool_load reasoning_think")
    daemon.write(f"s/{sid}/ctl", "maxsteps 2")
    assert oserror(lambda: daemon.write(f"s/{sid}/ctl", "maxsteps 0")) == errno.EINVAL
    daemon.prompt(sid, "go")
    daemon.wait_idle(sid)
    reqs = daemon.replay.requests
    assert len(reqs) == 3
    assert "tools" in reqs[1] and not reqs[2].get("tools")
    assert "step limit" in last_user(daemon, 2)
    chat = daemon.read(f"s/{sid}/chat")
    assert ":: maxsteps 2" in chat and ":: step limit of 2 reached" in chat
    # The summary request offered no tools; a tool call in its answer is not run.
    assert chat.count("-> reasoning_think") == 2
    last = context(daemon, sid)[-1]
    assert last["role"] == "assistant" and not last.get("tool_calls")


def test_save_writes_the_chat_to_tr(daemon: Daemon) -> None:
    sid = daemon.new(name="sv")
    daemon.prompt(sid, "keep me")
    daemon.wait_idle(sid)
    daemon.write(f"s/{sid}/ctl", "save")
    (saved,) = (daemon.home / "state" / "transcripts").glob("*-sv.md")
    assert "user: keep me" in saved.read_text()
    assert f":: saved to tr/{saved.name}" in daemon.read(f"s/{sid}/chat")


def test_fork_copies_the_history_up_to_n(daemon: Daemon) -> None:
    sid = daemon.new(name="orig")
    for p in ("one", "two"):
        daemon.prompt(sid, p)
        daemon.wait_idle(sid)
    daemon.write(f"s/{sid}/cfg", "temperature=0.5")
    daemon.write(f"s/{sid}/ctl", "fork all")
    daemon.write(f"s/{sid}/ctl", "fork half 2")
    assert context(daemon, "all") == context(daemon, sid)
    assert context(daemon, "half") == context(daemon, sid)[:2]
    assert "temperature=0.5\n" in daemon.read("s/all/cfg")
    assert oserror(lambda: daemon.write(f"s/{sid}/ctl", "fork all")) == errno.EEXIST
    assert oserror(lambda: daemon.write(f"s/{sid}/ctl", "fork x 99")) == errno.EINVAL
    daemon.prompt("half", "three")
    daemon.wait_idle("half")
    assert [m["content"] for m in daemon.replay.requests[-1]["messages"][1:]] == [
        "one",
        "echo: one",
        "three",
    ]
    daemon.stop()
    daemon.start()
    assert len(context(daemon, "half")) == 4 and len(context(daemon, "all")) == 4


def test_rewind_drops_turns_in_place_and_keeps_a_branch(daemon: Daemon) -> None:
    sid = daemon.new(name="rw")
    for p in ("one", "two", "three"):
        daemon.prompt(sid, p)
        daemon.wait_idle(sid)
    full = daemon.read(f"s/{sid}/context")
    assert oserror(lambda: daemon.write(f"s/{sid}/ctl", "rewind 4")) == errno.EINVAL
    chat_before = daemon.read(f"s/{sid}/chat")
    daemon.write(f"s/{sid}/ctl", "rewind 2")
    assert [m["content"] for m in context(daemon, sid)] == ["one", "echo: one"]
    assert sorted(os.listdir(daemon.p(f"s/{sid}/branches"))) == ["1"]
    assert daemon.read(f"s/{sid}/branches/1/context") == full
    assert daemon.read(f"s/{sid}/branches/1/chat") == chat_before
    assert ":: rewound 2 turns (kept in branches/1)" in daemon.read(f"s/{sid}/chat")
    daemon.prompt(sid, "four")
    daemon.wait_idle(sid)
    daemon.write(f"s/{sid}/ctl", "rewind 1")
    daemon.stop()
    daemon.start()
    assert [m["content"] for m in context(daemon, sid)] == ["one", "echo: one"]
    assert sorted(os.listdir(daemon.p(f"s/{sid}/branches"))) == ["1", "2"]


def test_slash_prompts_are_commands(daemon: Daemon) -> None:
    sid = daemon.new(name="sl")
    daemon.prompt(sid, "/maxsteps 7")
    assert ":: maxsteps 7" in daemon.wait_chat(sid, ":: maxsteps")
    assert "user: /maxsteps" not in daemon.read(f"s/{sid}/chat")
    assert not daemon.replay.requests


def test_bang_prompts_run_in_the_cwd_under_the_sandbox(daemon: Daemon) -> None:
    sid = daemon.new(name="sh")
    (daemon.work / "marker.txt").write_text("here\n")
    daemon.prompt(sid, "!ls; echo hi > /etc/ollie-escape || echo refused")
    daemon.wait_idle(sid)
    chat = daemon.read(f"s/{sid}/chat")
    assert "marker.txt" in chat and "refused" in chat
    assert not os.path.exists("/etc/ollie-escape")
    ctx = context(daemon, sid)
    assert ctx[-1]["role"] == "user" and "marker.txt" in ctx[-1]["content"]
    assert not daemon.replay.requests  # no model request for a shell prompt


def test_the_session_cost_cap_ends_the_turn(daemon: Daemon) -> None:
    daemon.stop()
    daemon.env["OLLIE_MAX_SESSION_COST"] = "0.000001"
    daemon.env["OLLIE_MODEL"] = "gpt-4o"
    daemon.start()
    usage = '{"reply": "priced", "usage": {"prompt_tokens": 1000, "completion_tokens": 1000}}'
    daemon.replay.add(script(usage))
    sid = daemon.new(name="cap")
    daemon.prompt(sid, "one")
    daemon.wait_idle(sid)
    daemon.prompt(sid, "two")
    daemon.wait_idle(sid)
    assert len(daemon.replay.requests) == 1
    assert "reached the cap" in daemon.read(f"s/{sid}/chat")


def test_models_file_and_command(daemon: Daemon) -> None:
    sid = daemon.new(name="mo")
    models = daemon.read(f"s/{sid}/models")
    assert models and not models.startswith("error:"), models
    daemon.write(f"s/{sid}/ctl", "models")
    assert ":: models refreshed: " in daemon.read(f"s/{sid}/chat")
    assert oserror(lambda: daemon.write(f"s/{sid}/ctl", "models x")) == errno.EINVAL
