"""Peers and subagents: sessions named ``<parent>__<child>`` and their ``peer/`` files."""

from __future__ import annotations

import errno
import json
import os

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
