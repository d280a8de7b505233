"""Tools end to end: daemon + real toolsrv (spawned by the daemon) + replay LLM server.

The model's tool calls are scripted on the replay server; everything else is real: the
daemon spawns toolsrv, attaches per agent over 9P, runs the calls under Landlock and
feeds the results back to the model.
"""

from __future__ import annotations

import errno
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from olliefs.testing import expect_log, running_toolsrv
from tests.conftest import Daemon, oserror, script


def call(name: str, args: dict[str, Any], cid: str) -> dict[str, Any]:
    return {"name": name, "arguments": args, "id": cid}


def calls(*cs: dict[str, Any]) -> str:
    return json.dumps({"tool_calls": list(cs)})


def reply(text: str) -> str:
    return json.dumps({"reply": text})


def sent_tools(daemon: Daemon, i: int) -> list[str]:
    return [t["function"]["name"] for t in daemon.replay.requests[i].get("tools", [])]


def tool_messages(daemon: Daemon, i: int) -> list[dict[str, Any]]:
    return [m for m in daemon.replay.requests[i]["messages"] if m["role"] == "tool"]


def context(daemon: Daemon, sid: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in daemon.read(f"s/{sid}/context").splitlines()]


def workdir(daemon: Daemon) -> Path:
    return daemon.work


def test_tree_shows_tools(daemon: Daemon) -> None:
    sid = daemon.new(name="t", cwd=str(workdir(daemon)))
    assert daemon.read(f"s/{sid}/tools") == "client_9p\thot\tserial\n"
    idx = daemon.read("t/idx").splitlines()
    names = [line.split("\t")[0] for line in idx]
    for n in ("client_9p", "execute_code", "file_edit", "file_glob", "file_grep", "file_read"):
        assert n in names
    fr = next(line.split("\t") for line in idx if line.startswith("file_read\t"))
    assert fr[3:] == ["cold", "parallel"]
    assert json.loads(fr[2])["type"] == "object"
    assert "file_read" in os.listdir(daemon.p("t"))
    assert daemon.read("t/file_read").startswith("#!")


def test_tool_load_and_unload_through_ctl(daemon: Daemon) -> None:
    sid = daemon.new(name="t", cwd=str(workdir(daemon)))
    daemon.write(f"s/{sid}/ctl", "tool_load file_read")
    assert daemon.read(f"s/{sid}/tools") == "client_9p\thot\tserial\nfile_read\tcold\tparallel\n"
    assert ":: tool file_read loaded\n" in daemon.read(f"s/{sid}/chat")
    # Unknown tool, unloading what is not loaded, and a bad line after a good one: EINVAL,
    # nothing changes (the good line of the same write is undone).
    assert oserror(daemon.write, f"s/{sid}/ctl", "tool_load nope") == errno.EINVAL
    assert oserror(daemon.write, f"s/{sid}/ctl", "tool_unload file_grep") == errno.EINVAL
    bad = "tool_load file_grep\ntool_load nope"
    assert oserror(daemon.write, f"s/{sid}/ctl", bad) == errno.EINVAL
    assert "file_grep" not in daemon.read(f"s/{sid}/tools")
    assert "error: tool_load: unknown tool: nope\n" in daemon.read(f"s/{sid}/chat")
    daemon.write(f"s/{sid}/ctl", "tool_unload file_read")
    assert daemon.read(f"s/{sid}/tools") == "client_9p\thot\tserial\n"


def test_model_calls_a_tool_and_sees_the_result(daemon: Daemon) -> None:
    w = workdir(daemon)
    (w / "notes.txt").write_text("alpha\nbeta\n")
    daemon.replay.add(
        script(
            calls(call("file_read", {"path": "notes.txt"}, "c1")),
            reply("it says alpha"),
            reply("and again"),
        )
    )
    sid = daemon.new(name="t", cwd=str(w))
    daemon.write(f"s/{sid}/ctl", "tool_load file_read")
    daemon.prompt(sid, "read notes")
    daemon.wait_idle(sid)
    chat = daemon.read(f"s/{sid}/chat")
    assert '-> file_read({"path":"notes.txt"})\n' in chat
    assert "alpha" in chat.split("-> file_read")[1]
    assert chat.endswith("assistant: it says alpha\n")
    assert sorted(sent_tools(daemon, 0)) == ["client_9p", "file_read"]
    system = daemon.replay.requests[0]["messages"][0]
    assert system["role"] == "system" and "file_read" in system["content"]
    assert daemon.read(f"s/{sid}/systemprompt") == system["content"]
    # The model saw the cold result verbatim right after the call ...
    (msg,) = tool_messages(daemon, 1)
    assert msg["tool_call_id"] == "c1" and "alpha" in msg["content"]
    # ... and collapsed to one line once it had answered after it.
    daemon.prompt(sid, "more")
    daemon.wait_idle(sid)
    (msg,) = tool_messages(daemon, 2)
    assert msg["content"].startswith("[file_read result collapsed:")
    ctx = context(daemon, sid)
    tool = next(m for m in ctx if m["role"] == "tool")
    assert "alpha" in tool["content"] and tool["tier"] == "cold"


def test_model_loads_a_tool_through_client_9p(daemon: Daemon) -> None:
    w = workdir(daemon)
    (w / "a.py").write_text("x = 1\n")
    daemon.replay.add(
        script(
            calls(
                call(
                    "client_9p", {"op": "write", "path": "ctl", "data": "tool_load file_glob"}, "c1"
                )
            ),
            calls(call("file_glob", {"pattern": "*.py"}, "c2")),
            reply("found it"),
        )
    )
    sid = daemon.new(name="t", cwd=str(w))
    daemon.prompt(sid, "find python files")
    daemon.wait_idle(sid)
    assert sent_tools(daemon, 0) == ["client_9p"]
    assert sorted(sent_tools(daemon, 1)) == ["client_9p", "file_glob"]
    chat = daemon.read(f"s/{sid}/chat")
    assert ":: tool file_glob loaded\n" in chat
    assert "-> file_glob(" in chat and "a.py" in chat.split("-> file_glob(")[1]
    assert "file_glob\twarm\tparallel\n" in daemon.read(f"s/{sid}/tools")


def test_unknown_tool_and_bad_arguments(daemon: Daemon) -> None:
    daemon.replay.add(
        script(
            calls(
                call("file_read", {"path": "x"}, "c1"),
                {"name": "client_9p", "arguments": "{not json", "id": "c2"},
            ),
            reply("ok"),
        )
    )
    sid = daemon.new(name="t", cwd=str(workdir(daemon)))
    daemon.prompt(sid, "go")
    daemon.wait_idle(sid)
    msgs = tool_messages(daemon, 1)
    assert [m["tool_call_id"] for m in msgs] == ["c1", "c2"]
    assert msgs[0]["content"].startswith("[tool error] unknown tool 'file_read': not loaded")
    assert msgs[1]["content"] == (
        "[tool error] the arguments are not valid JSON (JSON is malformed: object keys "
        "must be strings (byte 1)); received: {not json. Call client_9p again with all its "
        "arguments as one JSON object."
    )
    # The call goes back with arguments that parse (the replay server, like vLLM or
    # Ollama, refuses a request whose history holds a call with unparseable ones).
    [assistant] = [m for m in daemon.replay.requests[1]["messages"] if m.get("tool_calls")]
    assert [c["function"]["arguments"] for c in assistant["tool_calls"]] == [
        '{"path":"x"}',
        "{}",
    ]


RENDEZVOUS = """#!/bin/bash
# ollie-tool
# description: meet the other rendezvous tool (test)
# args: {"type": "object", "properties": {}}
# parallel: true
# tier: hot
touch "$OLLIE_CWD/$(basename "$0").here"
for i in $(seq 100); do
  [ -e "$OLLIE_CWD/$OTHER.here" ] && { echo met; exit 0; }
  sleep 0.05
done
echo alone
"""


def test_read_safe_calls_run_in_parallel_others_in_order(daemon: Daemon) -> None:
    tools = daemon.home / "config" / "tools"
    tools.mkdir(exist_ok=True)  # nothing is copied there any more
    for me, other in (("meet_a", "meet_b"), ("meet_b", "meet_a")):
        p = tools / me
        p.write_text(RENDEZVOUS.replace("$OTHER", other))
        p.chmod(0o755)
    w = workdir(daemon)
    daemon.replay.add(
        script(
            calls(
                call("meet_a", {}, "c1"),
                call("meet_b", {}, "c2"),
                call("execute_code", {"code": "echo serial1 > order; cat order"}, "c3"),
                call("execute_code", {"code": "echo serial2 >> order; cat order"}, "c4"),
            ),
            reply("done"),
        )
    )
    sid = daemon.new(name="t", cwd=str(w))
    daemon.write(f"s/{sid}/ctl", "tool_load meet_a\ntool_load meet_b\ntool_load execute_code")
    daemon.prompt(sid, "go")
    daemon.wait_idle(sid)
    msgs = tool_messages(daemon, 1)
    # Each waits up to 5 s for the other: only concurrent runs can both say "met".
    assert [m["content"] for m in msgs[:2]] == ["met", "met"]
    assert msgs[3]["content"] == "serial1\nserial2"
    chat = daemon.read(f"s/{sid}/chat")
    assert chat.index("-> meet_a(") < chat.index("-> meet_b(") < chat.index("-> execute_code(")


def test_per_turn_read_cache(daemon: Daemon) -> None:
    w = workdir(daemon)
    (w / "f.txt").write_text("one\n")

    def read(cid: str) -> dict[str, Any]:
        return call("file_read", {"path": "f.txt"}, cid)

    daemon.replay.add(
        script(
            calls(read("c1")),
            calls(read("c2")),
            calls(call("file_write", {"path": "f.txt", "content": "two\n"}, "c3")),
            calls(read("c4")),
            reply("done"),
            calls(read("c5")),
            reply("done again"),
        )
    )
    sid = daemon.new(name="t", cwd=str(w))
    daemon.write(f"s/{sid}/ctl", "tool_load file_read\ntool_load file_write")
    daemon.prompt(sid, "go")
    daemon.wait_idle(sid)
    note = "[from this turn's read cache"
    c1, c2, _, c4 = (m["content"] for m in context(daemon, sid) if m["role"] == "tool")
    assert "one" in c1 and note not in c1
    assert "one" in c2 and note in c2
    assert "two" in c4 and note not in c4  # the file changed: read afresh
    daemon.prompt(sid, "again")
    daemon.wait_idle(sid)
    c5 = [m for m in context(daemon, sid) if m["role"] == "tool"][-1]["content"]
    assert "two" in c5 and note not in c5  # a new turn starts with an empty cache


BIG = """#!/bin/bash
# ollie-tool
# description: print 30000 numbers (test)
# args: {"type": "object", "properties": {}}
seq 1 30000
"""


def test_big_results_are_cut_with_a_note(daemon: Daemon) -> None:
    w = workdir(daemon)
    big = daemon.home / "config" / "tools" / "big"
    big.parent.mkdir(exist_ok=True)
    big.write_text(BIG)
    big.chmod(0o755)
    daemon.replay.add(script(calls(call("big", {}, "c1")), reply("long")))
    sid = daemon.new(name="t", cwd=str(w))
    daemon.write(f"s/{sid}/ctl", "tool_load big")
    daemon.prompt(sid, "go")
    daemon.wait_idle(sid)
    (msg,) = tool_messages(daemon, 1)
    body, note = msg["content"].rsplit("\n", 1)
    full = "".join(f"{i}\n" for i in range(1, 30001))
    assert len(body.encode()) <= 32 * 1024 and full.startswith(body)
    assert note.startswith("[output cut: showing ") and f"of {len(full) - 1} bytes" in note
    path = note.split("the whole output is in ")[1].split(":")[0]
    assert Path(path).read_text() == full.rstrip("\n")


def tool_tmp(daemon: Daemon, sid: str) -> Path:
    """The session's tmp dir, where a running tool's files are seen at once."""
    return daemon.home / "data" / "tmp" / sid


def start_stubborn_tool(daemon: Daemon) -> tuple[str, list[int]]:
    """A session running a tool (and a child) that ignore SIGTERM; their pids."""
    w = workdir(daemon)
    # The pids go to the session's tmp dir: what a call writes in the cwd shows there
    # only when the call ends (checkpoints).
    code = (
        "trap '' TERM; (trap '' TERM; sleep 1000) & echo $! > $OLLIE_TMP/pids;"
        " echo $$ >> $OLLIE_TMP/pids; wait"
    )
    daemon.replay.add(script(calls(call("execute_code", {"code": code}, "c1"))))
    sid = daemon.new(name="t", cwd=str(w))
    daemon.write(f"s/{sid}/ctl", "tool_load execute_code")
    daemon.prompt(sid, "go")
    pids_file = tool_tmp(daemon, sid) / "pids"
    daemon.wait_for(lambda: pids_file.exists() and len(pids_file.read_text().split()) == 2)
    return sid, [int(x) for x in pids_file.read_text().split()]


def test_stop_kills_a_running_tool(daemon: Daemon) -> None:
    sid, pids = start_stubborn_tool(daemon)
    assert daemon.read(f"s/{sid}/state") == "calling: execute_code\n"
    daemon.write(f"s/{sid}/ctl", "stop")
    daemon.wait_idle(sid)
    chat = daemon.read(f"s/{sid}/chat")
    assert "[tool error] cancelled" in chat and chat.endswith(":: stopped\n")
    daemon.wait_for(lambda: not any(os.path.exists(f"/proc/{p}") for p in pids))
    ctx = context(daemon, sid)
    assert ctx[-1]["role"] == "tool" and ctx[-1]["tool_call_id"] == "c1"


def test_sigkill_of_toolsrv_mid_call_cuts_the_call_and_the_turn_goes_on(daemon: Daemon) -> None:
    """toolsrv SIGKILLed while a tool runs: the tool, its background child and a setsid()
    escapee die with it; the call is answered plainly; the turn and the next prompt go on."""
    w = workdir(daemon)
    code = (
        "(setsid sleep 4242 & echo $! >> $OLLIE_TMP/pids); (trap '' TERM; sleep 1000) &"
        " echo $! >> $OLLIE_TMP/pids; echo $$ >> $OLLIE_TMP/pids; wait"
    )
    think = calls(call("reasoning_think", {"thought": "x"}, "c2"))
    daemon.replay.add(
        script(
            calls(call("execute_code", {"code": code}, "c1")), reply("went on"), think, reply("two")
        )
    )
    sid = daemon.new(name="t", cwd=str(w))
    daemon.write(f"s/{sid}/ctl", "tool_load execute_code\ntool_load reasoning_think")
    daemon.prompt(sid, "go")
    pids_file = tool_tmp(daemon, sid) / "pids"
    daemon.wait_for(lambda: pids_file.exists() and len(pids_file.read_text().split()) == 3)
    pids = [int(x) for x in pids_file.read_text().split()]
    assert all(os.path.exists(f"/proc/{p}") for p in pids)
    (server,) = toolsrv_pids(daemon)
    expect_toolsrv_killed()
    os.kill(server, signal.SIGKILL)
    daemon.wait_idle(sid)
    daemon.wait_for(lambda: not any(os.path.exists(f"/proc/{p}") for p in pids))
    chat = daemon.read(f"s/{sid}/chat")
    assert "[tool error] toolsrv died; the call was cut\n" in chat
    assert chat.endswith("assistant: went on\n") and "internal error" not in chat
    daemon.prompt(sid, "again")
    daemon.wait_idle(sid)
    chat = daemon.read(f"s/{sid}/chat")
    assert '-> reasoning_think({"thought":"x"})\nok\n' in chat
    assert chat.endswith("assistant: two\n")
    assert toolsrv_pids(daemon) != [server]


def test_loaded_tools_survive_a_restart(daemon: Daemon) -> None:
    sid = daemon.new(name="t", cwd=str(workdir(daemon)))
    daemon.write(f"s/{sid}/ctl", "tool_load file_grep")
    daemon.stop()
    daemon.start()
    assert daemon.read(f"s/{sid}/tools") == "client_9p\thot\tserial\nfile_grep\twarm\tparallel\n"
    daemon.replay.add(script(calls(call("file_grep", {"pattern": "zzz"}, "c1")), reply("ok")))
    daemon.prompt(sid, "go")
    daemon.wait_idle(sid)
    assert sorted(sent_tools(daemon, 0)) == ["client_9p", "file_grep"]


def test_a_given_toolsrv_is_used_instead_of_spawning_one(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    with running_toolsrv(tmp_path / "remote") as srv:
        key = tmp_path / "toolsrv.key"
        key.write_text(srv.key.hex() + "\n")
        d = daemon_factory(OLLIE_TOOLSRV=f"unix:{srv.socket}", OLLIE_TOOLSRV_KEY_FILE=str(key))
        d.replay.add(script(calls(call("reasoning_think", {"thought": "hm"}, "c1")), reply("ok")))
        with d.running():
            sid = d.new(name="t")
            d.write(f"s/{sid}/ctl", "tool_load reasoning_think")
            d.prompt(sid, "think")
            d.wait_idle(sid)
            assert '-> reasoning_think({"thought":"hm"})\nok\n' in d.read(f"s/{sid}/chat")
            assert not list((d.home / "run").glob("toolsrv*.sock"))
            assert not (d.home / "state" / "toolsrv.log").exists()  # none was spawned


def test_a_wrong_toolsrv_key_is_an_error_line_not_a_crash(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    with running_toolsrv(tmp_path / "remote") as srv:
        key = tmp_path / "toolsrv.key"
        key.write_text("00" * 32 + "\n")
        d = daemon_factory(OLLIE_TOOLSRV=f"unix:{srv.socket}", OLLIE_TOOLSRV_KEY_FILE=str(key))
        d.replay.add(script(reply("no tools today")))
        expect_log(r"olliefs\.agent\.loop: toolsrv: attach refused: authentication failed$")
        with d.running():
            sid = d.new(name="t")
            d.prompt(sid, "hi")
            d.wait_idle(sid)
            chat = d.read(f"s/{sid}/chat")
            assert "error: toolsrv: attach refused: authentication failed (going on without" in chat
            assert chat.endswith("assistant: no tools today\n")
            assert "tools" not in d.replay.requests[-1]


def test_a_crashed_daemon_leaves_no_tool_running(daemon: Daemon) -> None:
    sid, pids = start_stubborn_tool(daemon)
    (sock,) = (daemon.home / "run").glob("toolsrv*.sock")
    daemon.crash()
    # toolsrv sees its stdin close, kills its calls' process groups and exits.
    daemon.wait_for(lambda: not any(os.path.exists(f"/proc/{p}") for p in pids))
    daemon.wait_for(lambda: not sock.exists())
    daemon.start()
    daemon.wait_idle(sid)
    chat = daemon.read(f"s/{sid}/chat")
    assert "[tool error] interrupted by restart" in chat
    assert chat.endswith(":: interrupted by restart\n")


def test_memory_notes_are_written_and_recalled_under_the_sandbox(daemon: Daemon) -> None:
    note = {"text": "the build uses meson", "name": "build"}
    daemon.replay.add(
        script(
            calls(call("memory_remember", note, "c1")),
            calls(call("memory_recall", {"query": "meson"}, "c2")),
            reply("remembered"),
        )
    )
    sid = daemon.new(name="t")
    daemon.write(f"s/{sid}/ctl", "tool_load memory_remember\ntool_load memory_recall")
    daemon.prompt(sid, "remember the build system")
    daemon.wait_idle(sid)
    saved = (daemon.home / "data" / "memory" / "build.md").read_text()
    assert "the build uses meson" in saved
    first, second = (m["content"] for m in context(daemon, sid) if m["role"] == "tool")
    assert not first.startswith("[tool error]")
    assert "the build uses meson" in second


def expect_toolsrv_killed(lost: int = 1) -> None:
    """Declare what a toolsrv server killed by SIGKILL leaves in the logs: its keeper's
    report, the daemon's notice that the keeper ended too, and each of the ``lost``
    connections, each noticed by its session at its next tool use."""
    expect_log(r"toolsrv\.keeper: toolsrv server \(pid \d+\) ended by signal 9; killed \d+ ")
    expect_log(r"olliefs\.toolclient\.spawn: toolsrv \(pid \d+\) exited with 137; respawned")
    expect_log(r"olliefs\.agent\.runtime: toolsrv connection of \S+ lost: ", count=lost)


def toolsrv_pids(daemon: Daemon) -> list[int]:
    """The daemon's toolsrv servers: each runs below its keeper, the process the daemon
    spawned (toolsrv(8)); the keeper is left out."""
    procs: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{d}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if b"toolsrv" in argv and any(str(daemon.home).encode() in a for a in argv):
            procs[int(d)] = ppid
    return [pid for pid, ppid in procs.items() if ppid in procs]


def test_a_dead_toolsrv_is_respawned_on_next_use(daemon: Daemon) -> None:
    think = calls(call("reasoning_think", {"thought": "x"}, "c1"))
    daemon.replay.add(script(think, reply("one"), think, reply("two")))
    sid = daemon.new(name="t")
    daemon.write(f"s/{sid}/ctl", "tool_load reasoning_think")
    daemon.prompt(sid, "first")
    daemon.wait_idle(sid)
    (pid,) = toolsrv_pids(daemon)
    os.kill(pid, signal.SIGKILL)
    daemon.wait_for(lambda: pid not in toolsrv_pids(daemon))
    expect_toolsrv_killed()
    daemon.prompt(sid, "second")
    daemon.wait_idle(sid)
    chat = daemon.read(f"s/{sid}/chat")
    assert chat.count('-> reasoning_think({"thought":"x"})\nok\n') == 2
    assert chat.endswith("assistant: two\n") and "error:" not in chat
    (new,) = toolsrv_pids(daemon)
    assert new != pid


def test_a_session_in_the_daemon_home_cannot_read_or_rewrite_its_dirs(daemon: Daemon) -> None:
    """cwd = OLLIE_HOME, which holds config/ state/ data/ run/: a tool reads no journal,
    log or key there and cannot rewrite a sandbox profile; the next call still runs in the
    sandbox of the user's profile; its own tmp dir and the tool scripts work."""
    attack = """
        for f in state/daemon.log state/toolsrv.log config/env state/sessions/*; do
            if cat "$f" > /dev/null 2>&1; then echo "read $f"; else echo "unreadable $f"; fi
        done
        mkdir -p config/sandbox 2> /dev/null
        evil='unsandboxed = true\nnetwork = true\nwrite = ["/"]\n'
        if printf "$evil" > config/sandbox/default.toml 2> /dev/null; then
            echo profile-rewritten
        else
            echo profile-kept
        fi
        echo scratch > "$TMPDIR/scratch" && cat "$TMPDIR/scratch"
    """
    escape = "touch ../work/escaped 2> /dev/null && echo escaped || echo stayed"
    daemon.replay.add(
        script(
            calls(call("execute_code", {"code": attack}, "c1")),
            calls(call("execute_code", {"code": escape}, "c2")),
            reply("done"),
        )
    )
    sid = daemon.new(name="t", cwd=str(daemon.home))
    daemon.write(f"s/{sid}/ctl", "tool_load execute_code")
    daemon.prompt(sid, "look around")
    daemon.wait_idle(sid)
    first, second = (m["content"] for m in context(daemon, sid) if m["role"] == "tool")
    journals = list((daemon.home / "state" / "sessions").iterdir())
    assert journals, "the session has a journal on the host"
    assert "read " not in first and "unreadable state/sessions/*" in first, first
    assert "profile-kept" in first and "scratch" in first, first
    assert not (daemon.home / "config" / "sandbox" / "default.toml").exists()
    assert "stayed" in second, second
    assert not (daemon.work / "escaped").exists()
