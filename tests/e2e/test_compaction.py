"""Compaction end to end: ``ctl compact`` against the replay server, nothing lost.

``ctl compact`` outside a turn is the session's work, like a turn: the write returns at
once, whatever the provider does, and ``stop``/``kill`` end it.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from olliefs.replay import Entry
from olliefs.testing import Daemon
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


def test_a_malformed_answer_keeps_the_history(daemon: Daemon) -> None:
    sid = daemon.new(name="bad")
    turns(daemon, sid, 10)
    before = context(daemon, sid)
    daemon.replay.add([Entry(reply="this is not json")])
    daemon.write(f"s/{sid}/ctl", "compact")
    daemon.wait_idle(sid)
    assert context(daemon, sid) == before
    assert "error: compaction failed, history kept" in daemon.read(f"s/{sid}/chat")
    assert daemon.read(f"s/{sid}/state") == "idle\n"


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
