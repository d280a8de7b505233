"""Peers and subagents: sessions named ``<parent>__<child>`` and their ``peer/`` files."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable

from olliefs.replay import ReplayServer
from olliefs.testing import Daemon
from tests.conftest import oserror, script


def test_peer_files_list_the_family_and_deliver_prompts(daemon: Daemon) -> None:
    for name in ("p", "p__a", "p__b", "q", "p__a__x"):
        daemon.new(name=name)
    assert sorted(os.listdir(daemon.p("s/p__a/peer"))) == ["p", "p__a__x", "p__b"]
    assert sorted(os.listdir(daemon.p("s/p/peer"))) == ["p__a", "p__b"]
    assert sorted(os.listdir(daemon.p("s/q/peer"))) == []
    daemon.write("s/p__a/peer/p__b", "hello sibling")
    assert "user: [from p__a] hello sibling" in daemon.wait_chat("p__b", "user: [from")
    daemon.wait_idle("p__b")
    assert oserror(lambda: daemon.write("s/p__a/peer/q", "not family")) in (
        errno.ENOENT,
        errno.EACCES,
    )
    assert "not family" not in daemon.read("s/q/chat")


def test_subagent_depth_is_limited(daemon: Daemon) -> None:
    daemon.new(name="a__b__c__d")
    err = oserror(lambda: daemon.write("s/new", f"cwd={daemon.work} name=a__b__c__d__e"))
    assert err == errno.EINVAL


def test_subagent_spawn_runs_a_child_session_and_returns_its_answer(daemon: Daemon) -> None:
    spawn = {"name": "subagent_spawn", "arguments": {"name": "kid", "prompt": "count"}}
    daemon.replay.add(
        script(
            json.dumps({"tool_calls": [{**spawn, "id": "c1"}]}),
            '{"reply": "the kid says 42", "usage": {"prompt_tokens": 10, "completion_tokens": 5}}',
            '{"reply": "parent done"}',
        )
    )
    sid = daemon.new(name="par")
    daemon.write(f"s/{sid}/ctl", "tool_load subagent_spawn")
    daemon.prompt(sid, "delegate")
    daemon.wait_chat(sid, "assistant: parent done", timeout=60)
    daemon.wait_idle(sid)
    chat = daemon.read(f"s/{sid}/chat")
    assert "[par__kid] the kid says 42" in chat
    assert "user: count" in daemon.read("s/par__kid/chat")
    assert "child par__kid=$" in daemon.read(f"s/{sid}/cost")
    assert "par__kid" in os.listdir(daemon.p(f"s/{sid}/peer"))


def spawn_call(i: int, **args: object) -> str:
    return json.dumps(
        {"tool_calls": [{"id": f"s{i}", "name": "subagent_spawn", "arguments": args}]}
    )


def test_a_fresh_subagent_runs_as_its_parent_does_now(
    daemon_factory: Callable[..., Daemon], replay: ReplayServer
) -> None:
    """A fresh child is what its parent is: its profile, its backend and its model as
    they are now (here switched since the parent started), not the daemon's defaults."""
    d = daemon_factory(**replay.settings())
    d.start()
    spawner = {"model": "profile-model", "tools": ["client_9p", "subagent_spawn"]}
    with open(d.p("a/spawner.json"), "w") as f:
        f.write(json.dumps(spawner))
    sid = d.new(name="par", agent="spawner", backend="ollama")
    d.write(f"s/{sid}/cfg", "model=switched\n")
    d.replay.add(
        script(
            spawn_call(1, name="kid", prompt="count"),
            '{"reply": "the kid says 42"}',
            '{"reply": "parent done"}',
        )
    )
    d.prompt(sid, "delegate")
    d.wait_chat(sid, "assistant: parent done", timeout=60)
    d.wait_idle(sid)
    assert "[par__kid] the kid says 42" in d.read(f"s/{sid}/chat")
    kid = d.read("s/par__kid/cfg")
    assert "backend=ollama\n" in kid and "model=switched\n" in kid and "agent=spawner\n" in kid
    [request] = [r for r in d.replay.recorded if r.body["messages"][-1]["content"] == "count"]
    assert request.wire == "ollama" and request.body["model"] == "switched"


def test_a_refused_subagent_tells_the_model_why(daemon: Daemon) -> None:
    """Deeper than OLLIE_SUBAGENT_DEPTH (3): s/new (a fresh child) and ctl fork (from a
    checkpoint) refuse it with EINVAL, and the tool's failed result carries the tree's
    reason, not only "Invalid argument"."""
    deep = daemon.new(name="a__b__c__d")
    daemon.write(f"s/{deep}/ctl", "tool_load subagent_spawn")
    daemon.replay.add(
        script(
            spawn_call(1, name="kid", prompt="count"),
            spawn_call(2, name="kid", prompt="count", checkpoint=True),
            '{"reply": "too deep"}',
        )
    )
    daemon.prompt(deep, "delegate")
    daemon.wait_idle(deep)
    reqs = daemon.replay.requests
    results = [reqs[i]["messages"][-1]["content"] for i in (1, 2)]
    why = "a__b__c__d__kid: subagent depth 4 is over the limit of 3 (OLLIE_SUBAGENT_DEPTH)"
    assert results[0].startswith("[tool error] ")
    assert f"s/new refused (Invalid argument): s/new: {why}" in results[0]
    assert f"s/{deep}/ctl refused (Invalid argument): {why}" in results[1]
    assert "a__b__c__d__kid" not in os.listdir(daemon.p("s"))
