"""Each hook event's exit statuses end to end: 0 (its output reaches the model), 2 (it
blocks what ollie-agent(5) says it blocks) and any other (a warning, and the action goes
on), through the mount, with real hook processes and the replay server as the model.

Each test gives a profile one hook, for the event under test, that saves its payload,
prints ``out:<event>``, says ``<event> refuses`` on stderr and exits with the status in
the file ``exit`` of the session's working directory (where hooks run), so one session
goes through the three statuses in turn. What reached the model is read from the
requests the replay server received. turnError has its own tests
(tests/e2e/test_agent_limits.py), the recovery by a switch of model included.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from olliefs.agent.compact import PROMPT
from olliefs.testing import Daemon
from tests.conftest import script
from tests.e2e.test_agent_limits import ANSWER, call, context, run, texts, turns

HOOK = (
    'cat > "$OLLIE_EVENT.json"; echo "out:$OLLIE_EVENT"; echo "$OLLIE_EVENT refuses" >&2; '
    "exit $(cat exit)"
)
STATUSES = (0, 2, 3)


def hooked(daemon: Daemon, event: str, name: str) -> str:
    profile = {"tools": ["client_9p", "file_write"], "hooks": {event: HOOK}}
    with open(daemon.p(f"a/{event}.json"), "w") as f:
        f.write(json.dumps(profile))
    return daemon.new(name=name, agent=event)


def status(daemon: Daemon, n: int) -> None:
    (daemon.work / "exit").write_text(f"{n}\n")


def mark(daemon: Daemon, sid: str) -> int:
    return len(daemon.read(f"s/{sid}/chat"))


def said(daemon: Daemon, sid: str, event: str, n: int, since: int = 0) -> None:
    """What chat says of status ``n`` from ``since`` on: the block's reason, the
    warning, or neither."""
    chat = daemon.read(f"s/{sid}/chat")[since:]
    blocked = f"error: blocked by the {event} hook: {event} refuses\n" in chat
    warned = f":: hook {event} (`" in chat and f"exited 3: {event} refuses\n" in chat
    assert blocked == (n == 2) and warned == (n == 3), (n, chat)


def last_user(req: dict[str, Any]) -> list[str]:
    """The texts of the user messages at the end of a request."""
    out: list[str] = []
    for m in reversed(req["messages"]):
        if m["role"] != "user":
            break
        out.insert(0, m["content"])
    return out


def test_agent_spawn(daemon: Daemon) -> None:
    for n in STATUSES:
        status(daemon, n)
        sid = hooked(daemon, "agentSpawn", f"as{n}")
        first = run(daemon, sid, "hello")[0]
        payload = json.loads((daemon.work / "agentSpawn.json").read_text())
        assert payload["session_id"] == sid and payload["depth"] == 0
        hook = ["[agentSpawn hook]\nout:agentSpawn"] if n == 0 else []
        assert last_user(first) == [*hook, "hello"], n
        said(daemon, sid, "agentSpawn", n)


def test_pre_turn(daemon: Daemon) -> None:
    sid = hooked(daemon, "preTurn", "pt")
    for n in STATUSES:
        since = mark(daemon, sid)
        status(daemon, n)
        reqs = run(daemon, sid, f"prompt {n}")
        if n == 2:
            assert reqs == []  # the prompt never reached the model
            assert context(daemon, sid)[-1]["content"] != "prompt 2"
        else:
            hook = ["[preTurn hook]\nout:preTurn"] if n == 0 else []
            assert last_user(reqs[0]) == [f"prompt {n}", *hook], n
        said(daemon, sid, "preTurn", n, since)


def test_post_turn(daemon: Daemon) -> None:
    sid = hooked(daemon, "postTurn", "po")
    for n in STATUSES:
        since = mark(daemon, sid)
        status(daemon, n)
        run(daemon, sid, f"prompt {n}")
        status(daemon, 0)
        # What postTurn said after that turn, the model reads with the next prompt.
        req = run(daemon, sid, "next")[0]
        hook = ["[postTurn hook]\nout:postTurn"] if n == 0 else []
        assert last_user(req) == [*hook, "next"], n
        said(daemon, sid, "postTurn", n, since)
    assert json.loads((daemon.work / "postTurn.json").read_text())["end"] == "done"


def tool_round(daemon: Daemon, sid: str, n: int) -> str:
    """A turn with one file_write call that makes ``made<n>``; the result the model got."""
    write = call("file_write", n, path=f"made{n}", content="x")
    reqs = run(daemon, sid, f"write {n}", write, '{"reply": "ok"}')
    [result] = [m for m in reqs[1]["messages"] if m.get("tool_call_id") == f"c{n}"]
    content: str = result["content"]
    return content


@pytest.mark.parametrize("event", ["preTool", "postTool"])
def test_pre_and_post_tool(daemon: Daemon, event: str) -> None:
    sid = hooked(daemon, event, "tl")
    plain = "wrote 1 bytes to"
    for n in STATUSES:
        since = mark(daemon, sid)
        status(daemon, n)
        result = tool_round(daemon, sid, n)
        ran = (daemon.work / f"made{n}").exists()
        payload = json.loads((daemon.work / f"{event}.json").read_text())
        assert payload["tool"] == "file_write" and payload["call_id"] == f"c{n}"
        if n == 0:
            assert ran and not result.startswith("[tool error]"), result
            assert result.endswith(f"\n[{event} hook]\nout:{event}"), result
        elif n == 2 and event == "preTool":
            assert not ran  # the call never reached toolsrv
            assert result == "[tool error] blocked by the preTool hook: preTool refuses"
        elif n == 2:
            assert ran and result.startswith(f"[tool error] {plain}"), result
            assert result.endswith("\n[blocked by the postTool hook: postTool refuses]")
        else:
            assert ran and result.startswith(plain) and "hook" not in result, result
        said(daemon, sid, event, n, since)
    if event == "postTool":
        assert payload["result"].startswith(plain) and payload["is_error"] is False


def compaction(daemon: Daemon, sid: str) -> list[dict[str, Any]]:
    """``ctl compact`` of a session with ten messages more; the requests it made."""
    turns(daemon, sid, 5)
    n0 = len(daemon.replay.requests)
    daemon.replay.add(script(json.dumps({"reply": json.dumps(ANSWER)})))
    daemon.write(f"s/{sid}/ctl", "compact")
    daemon.wait_idle(sid)
    return daemon.replay.requests[n0:]


@pytest.mark.parametrize("event", ["preCompact", "postCompact"])
def test_pre_and_post_compact(daemon: Daemon, event: str) -> None:
    sid = hooked(daemon, event, "cp")
    done = 0
    for n in STATUSES:
        since = mark(daemon, sid)
        status(daemon, n)
        before = context(daemon, sid)
        reqs = compaction(daemon, sid)
        payload = json.loads((daemon.work / f"{event}.json").read_text())
        assert payload["trigger"] == "ctl"
        if n == 2 and event == "preCompact":
            assert reqs == []  # no compaction at all; the history stays
            assert len(context(daemon, sid)) == len(before) + 10
            run(daemon, sid, "use up the answer")  # the one the compaction did not take
            said(daemon, sid, event, n, since)
            continue
        done += 1
        assert texts(reqs[0])[0] == PROMPT
        asked = texts(reqs[0])[1]
        assert ("out:preCompact" in asked) == (event == "preCompact" and n == 0), n
        assert daemon.read(f"s/{sid}/compactions/{done}/summary")
        last = context(daemon, sid)[-1]["content"]
        assert (last == "[postCompact hook]\nout:postCompact") == (
            event == "postCompact" and n == 0
        ), n
        said(daemon, sid, event, n, since)
