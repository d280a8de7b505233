"""Compaction end to end: ``ctl compact`` against the replay server, nothing lost."""

from __future__ import annotations

import json

from olliefs.replay import Entry
from olliefs.testing import Daemon

ANSWER = {"goal": "count", "state": "counted to three", "decisions": ["use ints"], "next": "stop"}


def context(daemon: Daemon, sid: str) -> list[dict[str, object]]:
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


def test_a_malformed_answer_keeps_the_history(daemon: Daemon) -> None:
    sid = daemon.new(name="bad")
    turns(daemon, sid, 10)
    before = context(daemon, sid)
    daemon.replay.add([Entry(reply="this is not json")])
    daemon.write(f"s/{sid}/ctl", "compact")
    assert context(daemon, sid) == before
    assert "error: compaction failed, history kept" in daemon.read(f"s/{sid}/chat")
    assert daemon.read(f"s/{sid}/state") == "idle\n"


def test_taskstate_and_tcct(daemon: Daemon) -> None:
    sid = daemon.new(name="ts")
    daemon.prompt(sid, "the goal")
    daemon.wait_idle(sid)
    assert json.loads(daemon.read(f"s/{sid}/taskstate"))["goal"] == "the goal"
    assert daemon.read(f"s/{sid}/tcct") == "0\n"
