"""Profiles in a/ and agent switching, end to end through the mount."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess

import pytest

from olliefs.agent.profile import MAX_PROFILE_BYTES
from olliefs.testing import Daemon
from tests.conftest import oserror, script

MINE = {
    "prompt": "You are terse. Working in $OLLIE_CWD.",
    "tools": ["client_9p", "file_read"],
    "allowTools": ["client_9p", "file_*"],
    "maxSteps": 7,
}


def put(daemon: Daemon, rel: str, text: str) -> None:
    """As the shell's ``>`` does: create or truncate, one write(2), close."""
    fd = os.open(daemon.p(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def test_profiles_are_validated_as_written(daemon: Daemon) -> None:
    assert "default.json" in os.listdir(daemon.p("a"))
    put(daemon, "a/mine.json", json.dumps(MINE))
    assert json.loads(daemon.read("a/mine.json")) == MINE
    # Certainly invalid at write: refused at once, the old version kept.
    assert oserror(lambda: put(daemon, "a/mine.json", '{"prompt": 1}')) == errno.EINVAL
    assert oserror(lambda: put(daemon, "a/mine.json", '{"nosuchkey": true}')) == errno.EINVAL
    assert oserror(lambda: put(daemon, "a/mine.json", "{]")) == errno.EINVAL
    assert json.loads(daemon.read("a/mine.json")) == MINE
    assert "a/mine.json" in daemon.read("err")
    assert oserror(lambda: put(daemon, "a/bad name.json", "{}")) == errno.EINVAL


def test_switching_agent_rebuilds_and_clears(daemon: Daemon) -> None:
    put(daemon, "a/mine.json", json.dumps(MINE))
    sid = daemon.new(name="sw")
    daemon.prompt(sid, "before")
    daemon.wait_idle(sid)
    daemon.write(f"s/{sid}/ctl", "agent mine")
    assert daemon.read(f"s/{sid}/context") == ""
    tools = daemon.read(f"s/{sid}/tools")
    assert tools.splitlines()[0].startswith("client_9p") and "file_read" in tools
    assert f"Working in {daemon.work}" in daemon.read(f"s/{sid}/systemprompt")
    # The model is offered the tools it may load, not the others.
    daemon.prompt(sid, "after")
    daemon.wait_idle(sid)
    system = daemon.replay.requests[-1]["messages"][0]["content"]
    assert "- file_grep:" in system and "execute_code" not in system
    assert "agent=mine\n" in daemon.read(f"s/{sid}/cfg")
    assert oserror(lambda: daemon.write(f"s/{sid}/ctl", "tool_load execute_code")) == errno.EINVAL
    assert "not permitted" in daemon.read(f"s/{sid}/err")
    assert oserror(lambda: daemon.write(f"s/{sid}/ctl", "agent nosuch")) == errno.EINVAL


def test_hooks_block_add_context_and_run_in_order(daemon: Daemon) -> None:
    log = daemon.work / "hook.log"
    hooked = {
        "tools": ["client_9p", "reasoning_think"],
        "hooks": {
            "preTurn": f"grep -q forbidden && {{ echo 'no forbidden prompts' >&2; exit 2; }}; "
            f"echo turn >> {log}; echo 'remember: be brief'",
            "preTool": 'grep -Eq \'"thought": ?"bad"\' && '
            "{ echo 'bad thought' >&2; exit 2; }; true",
            "postTurn": f"echo post >> {log}",
        },
    }
    put(daemon, "a/hooked.json", json.dumps(hooked))
    sid = daemon.new(name="hk")
    daemon.write(f"s/{sid}/ctl", "agent hooked")
    daemon.prompt(sid, "something forbidden")
    daemon.wait_idle(sid)
    assert "blocked by the preTurn hook: no forbidden prompts" in daemon.read(f"s/{sid}/chat")
    assert not daemon.replay.requests
    think = {"name": "reasoning_think", "arguments": {"thought": "bad"}, "id": "c1"}
    daemon.replay.add(script(json.dumps({"tool_calls": [think]}), '{"reply": "ok"}'))
    daemon.prompt(sid, "fine")
    daemon.wait_idle(sid)
    msgs = daemon.replay.requests[0]["messages"]
    assert any("remember: be brief" in str(m.get("content")) for m in msgs)
    tool = [m for m in daemon.replay.requests[1]["messages"] if m["role"] == "tool"]
    assert "blocked by the preTool hook: bad thought" in tool[0]["content"]
    assert log.read_text().split() == ["turn", "post"]


def test_a_tool_cannot_write_a_profile(daemon: Daemon) -> None:
    evil = {"hooks": {"preTurn": "touch /tmp/ollie-pwned"}}
    args = {"op": "write", "path": "/a/evil.json", "data": json.dumps(evil)}
    call = {"name": "client_9p", "arguments": args, "id": "c1"}
    daemon.replay.add(script(json.dumps({"tool_calls": [call]}), '{"reply": "done"}'))
    sid = daemon.new(name="ev")
    daemon.prompt(sid, "try")
    daemon.wait_idle(sid)
    assert "evil.json" not in os.listdir(daemon.p("a"))
    tool = [m for m in daemon.replay.requests[1]["messages"] if m["role"] == "tool"]
    assert "Permission denied" in tool[0]["content"] or "EACCES" in tool[0]["content"]
    assert "sandboxed process" in daemon.read("err")


def test_s_new_with_an_agent_starts_it_as_ctl_agent_does(daemon: Daemon) -> None:
    """``s/new agent=NAME`` is the agent's start as ollie-agent(5) tells it, not only its
    prompt and tools: the profile's model and generation parameters (unless s/new names
    them), the agentSpawn hook (its output joins the context) and the userPrompts, run
    in order."""
    starter = {
        "model": "profile-model",
        "temperature": 0.25,
        "maxTokens": 333,
        "userPrompts": ["first task", "second task"],
        "hooks": {"agentSpawn": "echo spawned at depth $OLLIE_DEPTH"},
    }
    put(daemon, "a/starter.json", json.dumps(starter))
    daemon.replay.add(script('{"reply": "one"}', '{"reply": "two"}'))
    sid = daemon.new(name="st", agent="starter")
    daemon.wait_for(lambda: len(daemon.replay.requests) == 2)
    daemon.wait_idle(sid)
    cfg = daemon.read(f"s/{sid}/cfg")
    assert "model=profile-model\n" in cfg and "temperature=0.25\n" in cfg
    assert "maxTokens=333\n" in cfg
    first, second = daemon.replay.requests
    assert first["model"] == "profile-model" and first.get("temperature") == 0.25
    assert any("spawned at depth" in str(m.get("content")) for m in first["messages"])
    assert first["messages"][-1]["content"] == "first task"
    assert second["messages"][-1]["content"] == "second task"
    # s/new's own model wins over the profile's; the default profile starts nothing.
    other = daemon.new(name="st2", agent="starter", model="given")
    assert "model=given\n" in daemon.read(f"s/{other}/cfg")
    plain = daemon.new(name="plain")
    daemon.wait_idle(plain)
    assert daemon.read(f"s/{plain}/context") == ""


def test_a_profile_over_the_limit_is_refused_and_nothing_of_it_saved(daemon: Daemon) -> None:
    """Past MAX_PROFILE_BYTES the write that passes it fails with EFBIG, and so does the
    close: nothing is saved, not even a document complete before the limit (the part
    the kernel passed first, of one long write(2), was saved)."""
    put(daemon, "a/mine.json", json.dumps(MINE))
    other = json.dumps({**MINE, "maxSteps": 3})
    for doc in (
        '{"prompt": "' + "x" * MAX_PROFILE_BYTES + '"}',
        other + " " * MAX_PROFILE_BYTES,  # valid, then spaces past the limit
    ):
        # one write(2), as cp and the shell's > make it
        with pytest.raises(OSError) as err, open(daemon.p("a/mine.json"), "w") as f:
            f.write(doc)
        assert err.value.errno == errno.EFBIG
        # in pieces, as an editor saves: every write after the limit fails, the close too
        fd = os.open(daemon.p("a/mine.json"), os.O_WRONLY | os.O_TRUNC)
        data = doc.encode()
        errs = [oserror(os.write, fd, data[i : i + 65536]) for i in range(0, len(data), 65536)]
        assert errs == [0] * (MAX_PROFILE_BYTES // 65536) + [errno.EFBIG]
        assert oserror(os.write, fd, b" ") == errno.EFBIG
        assert oserror(os.close, fd) == errno.EFBIG
        assert json.loads(daemon.read("a/mine.json")) == MINE
    assert daemon.read("err") == "a/mine.json: longer than 1 MiB (not saved)\n"


def test_editors_saving_a_profile_leave_the_reason_that_matters_in_err(daemon: Daemon) -> None:
    """vim's refused save says what is wrong with the document (not "empty document": the
    write was refused, so its close found nothing); Emacs' lock file and vim's probe of
    the folder are refused quietly, so a good save leaves err as it was."""
    path = daemon.p("a/ed.json")
    path.write_text('{"description": "x"}\n')
    r = subprocess.run(
        ["vim", "-es", "-u", "NONE", "-c", '%s/"x"/"x", "bogus": 1/', "-c", "wq", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode != 0
    assert "unknown key `bogus`" in daemon.read("err")
    assert path.read_text() == '{"description": "x"}\n'
    # any refusal, to see that a good save keeps it
    assert oserror(daemon.write, "s/new", "cwd=relative") == errno.EINVAL
    before = daemon.read("err")
    assert before.startswith("s/new: cwd must be an absolute path")
    for target, text in ((path, '"y"'), (daemon.p("sk/ed.md"), "more")):
        if target.suffix == ".md":
            target.write_text("---\nname: ed\ndescription: d\n---\nbody\n")
        edit = f'(progn (goto-char (point-max)) (insert "{text}") (save-buffer))'
        if target.suffix == ".json":
            edit = (
                '(progn (goto-char (point-min)) (replace-string "\\"x\\"" "\\"y\\"") (save-buffer))'
            )
        r = subprocess.run(
            ["emacs", "--batch", str(target), "--eval", edit],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert r.returncode == 0, r.stderr
        assert text.strip('"') in target.read_text()
        assert daemon.read("err") == before
    r = subprocess.run(
        ["vim", "-es", "-u", "NONE", "-c", '%s/"y"/"z"/', "-c", "wq", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0 and '"z"' in path.read_text()
    assert daemon.read("err") == before


@pytest.mark.parametrize("how", ["s/new", "ctl agent"])
def test_auto_load_tools_are_loaded_when_the_agent_starts(daemon: Daemon, how: str) -> None:
    """autoLoad adds to the tools an agent starts with (the default client_9p when the
    profile has no ``tools``): the model gets their schemas from its first request on,
    after a switch to the profile too; the shipped coding profile is one."""
    put(daemon, "a/extra.json", json.dumps({"autoLoad": ["file_read", "reasoning_think"]}))
    for agent in ("extra", "coding"):
        if how == "s/new":
            sid = daemon.new(name=f"al-{agent}", agent=agent)
        else:
            sid = daemon.new(name=f"al-{agent}")
            daemon.write(f"s/{sid}/ctl", f"agent {agent}")
        daemon.wait_idle(sid)
        loaded = [line.split("\t")[0] for line in daemon.read(f"s/{sid}/tools").splitlines()]
        profile = json.loads(daemon.read(f"a/{agent}.json"))
        want = list(dict.fromkeys([*profile.get("tools", ["client_9p"]), *profile["autoLoad"]]))
        assert loaded == want, agent
        n0 = len(daemon.replay.requests)
        daemon.prompt(sid, "hello")
        daemon.wait_idle(sid)
        sent = [t["function"]["name"] for t in daemon.replay.requests[n0]["tools"]]
        assert sorted(sent) == sorted(want), agent


def test_session_t_shows_the_tools_the_agent_may_load(daemon: Daemon) -> None:
    """``s/ID/t/``: ``idx`` and a read-only script per tool, as the root ``t/`` has them,
    but only the tools the profile's allowTools permits."""
    put(daemon, "a/mine.json", json.dumps(MINE))
    everything = sorted(os.listdir(daemon.p("t")))
    assert "execute_code" in everything and "file_read" in everything
    plain = daemon.new(name="plain")
    assert sorted(os.listdir(daemon.p(f"s/{plain}/t"))) == everything
    assert daemon.read(f"s/{plain}/t/idx") == daemon.read("t/idx")
    sid = daemon.new(name="mine", agent="mine")
    allowed = [n for n in everything if n == "client_9p" or n.startswith("file_")]
    assert sorted(os.listdir(daemon.p(f"s/{sid}/t"))) == sorted([*allowed, "idx"])
    idx = daemon.read(f"s/{sid}/t/idx").splitlines()
    assert [line.split("\t")[0] for line in idx] == [n for n in allowed if n != "idx"]
    assert set(idx) <= set(daemon.read("t/idx").splitlines())
    assert daemon.read(f"s/{sid}/t/file_read") == daemon.read("t/file_read")
    assert not os.path.exists(daemon.p(f"s/{sid}/t/execute_code"))
    mode = os.stat(daemon.p(f"s/{sid}/t/file_read")).st_mode
    assert stat.S_ISREG(mode) and not mode & 0o222
    assert stat.S_ISDIR(os.stat(daemon.p(f"s/{sid}/t")).st_mode)
    assert oserror(lambda: daemon.write(f"s/{sid}/t/file_read", "x")) in (errno.EACCES, errno.EPERM)
    assert oserror(lambda: put(daemon, f"s/{sid}/t/mine", "x")) in (errno.EACCES, errno.EPERM)
    # A switch to another profile changes what it may load.
    daemon.write(f"s/{sid}/ctl", "agent default")
    assert sorted(os.listdir(daemon.p(f"s/{sid}/t"))) == everything
