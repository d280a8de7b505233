"""The doors the project itself opens, tried by a hostile agent and a careless user.

The sandbox walls are tested in tests/toolsrv/; these are the ways around them that go
through the tree: a cwd inside the mount (the daemon would wait on itself), and a tool
that writes ``s/new``, a ``!cmd`` prompt, ``ctl``/``cfg`` or ``t/`` through client_9p to
get another process to act for it with rights it has not (olliefs.caller).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

from olliefs.testing import expect_log
from tests.conftest import Daemon, oserror, script


def _shell(daemon: Daemon, cmd: str) -> subprocess.CompletedProcess[str]:
    """``cmd`` in a child with a time limit: a daemon that hangs on its own mount fails
    the test instead of hanging it (and the kill leaves the child, not us, in D state)."""
    return subprocess.run(
        ["timeout", "-s", "KILL", "20", "bash", "-c", cmd],
        cwd=daemon.path,
        capture_output=True,
        text=True,
        check=False,
    )


def _answers(daemon: Daemon) -> str:
    """The tree still answers (from a child, under a time limit): the root err."""
    done = _shell(daemon, "cat s/idx >/dev/null && ls t >/dev/null && cat err")
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_cwd_inside_the_mount_is_refused_and_the_daemon_keeps_serving(
    daemon: Daemon, tmp_path: Path
) -> None:
    mnt = daemon.path
    link = tmp_path / "into-tree"
    link.symlink_to(mnt / "m")
    hop = tmp_path / "hop"
    hop.symlink_to(link)  # a symlink to a symlink into the tree
    for cwd in (f"{mnt}/m", f"{mnt}", f"{mnt}/s/../tmp", str(link), f"{hop}/", f"{link}/x/.."):
        done = _shell(daemon, f"echo 'cwd={cwd} name=in' > s/new")
        assert done.returncode not in (0, 137), (cwd, done)
        assert "Invalid argument" in done.stderr, (cwd, done.stderr)
        assert "olliefs tree" in _answers(daemon), cwd
    assert "in" not in os.listdir(mnt / "s")
    sid = daemon.new(name="w")
    for cmd in (f"echo 'cwd {mnt}/tmp' > s/{sid}/ctl", f"echo 'cwd={link}' > s/{sid}/cfg"):
        done = _shell(daemon, cmd)
        assert "Invalid argument" in done.stderr, (cmd, done)
        assert "olliefs tree" in daemon.read(f"s/{sid}/err")
        _answers(daemon)
    assert f"cwd={daemon.work}\n" in daemon.read(f"s/{sid}/cfg")
    # A directory beside the tree is fine, and kept as its real path.
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "via").symlink_to(real)
    daemon.write(f"s/{sid}/ctl", f"cwd {tmp_path}/via")
    assert f"cwd={real}\n" in daemon.read(f"s/{sid}/cfg")


def _agent_calls(daemon: Daemon, sid: str, calls: list[dict[str, str]]) -> list[str]:
    """Have the model of ``sid`` make the client_9p calls, in order, in one round (a
    dozen failing rounds in a row would end the turn); their results."""
    uses = [{"name": "client_9p", "arguments": c, "id": f"c{i}"} for i, c in enumerate(calls)]
    before = len(daemon.replay.requests)
    daemon.replay.add(script(json.dumps({"tool_calls": uses}), '{"reply": "done"}'))
    daemon.prompt(sid, "go")
    daemon.wait_for(lambda: len(daemon.replay.requests) == before + 2)
    daemon.wait_idle(sid)
    last = daemon.replay.requests[-1]["messages"]
    return [str(m["content"]) for m in last if m["role"] == "tool"][-len(calls) :]


def _write(path: str, data: str) -> dict[str, str]:
    return {"op": "write", "path": path, "data": data}


def test_a_tool_cannot_make_or_steer_a_session_beyond_its_own_rights(
    daemon: Daemon, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    mine = daemon.work / "sub"
    mine.mkdir()
    sid = daemon.new(name="ev")
    other = daemon.new(name="other", cwd=str(outside))
    results = _agent_calls(
        daemon,
        sid,
        [
            _write("/s/new", f"name=wide cwd={outside}"),
            _write("/s/new", "name=root cwd=/"),
            _write("/s/new", f"name=home cwd={daemon.home}"),
            _write("prompt", f"!touch {outside}/pwned"),
            _write("ctl", f"cwd {outside}"),
            _write("cfg", f"cwd={outside}"),
            _write("ctl", "agent default"),
            _write(f"/s/{other}/ctl", f"cwd {outside}"),
            _write(f"/s/{other}/ctl", "fork stolen"),
            _write(f"/s/{other}/prompt", "!id"),
            _write(f"/s/{other}/ctl", "inject !id"),
            _write("/s/new", f"name=ev__kid cwd={mine} agent=coding"),
            # Within its own rights: a session in its own cwd, a child with its profile.
            _write("/s/new", f"name=mine cwd={mine}"),
            _write("/s/new", f"name=ev__kid2 cwd={mine} agent=default"),
        ],
    )
    for i, refused in enumerate(results[:-2]):
        # ctl cwd and agent of its own session come while its turn runs: busy first.
        why = ("Permission denied", "busy") if i in (4, 6) else ("Permission denied",)
        assert any(w in refused for w in why), (i, refused)
    assert "error" not in results[-2].lower() and "error" not in results[-1].lower(), results
    sessions = set(os.listdir(daemon.p("s")))
    assert {"mine", "ev__kid2"} <= sessions
    assert not sessions & {"wide", "root", "home", "stolen", "ev__kid"}
    assert not (outside / "pwned").exists()
    assert f"cwd={daemon.work}\n" in daemon.read(f"s/{sid}/cfg")
    assert f"cwd={outside}\n" in daemon.read(f"s/{other}/cfg")
    assert "prompt: !cmd (it runs with the session's rights): not allowed from a sandboxed" in (
        daemon.read(f"s/{sid}/chat")
    )
    # The user, unconfined, may do each of these.
    daemon.write(f"s/{sid}/ctl", f"cwd {outside}")
    daemon.new(name="wide", cwd=str(outside))


TOOL = '#!/bin/sh\n# ollie-tool\n# description: x\n# args: {"type": "object"}\n'


def test_a_tool_cannot_write_a_tool_with_more_rights_than_its_own(daemon: Daemon) -> None:
    # A refused write leaves its file empty (made by the open, as on a disk): toolsrv, if
    # it looks then, leaves that file out of its tools and says why.
    expect_log(
        r"toolsrv\.registry: tool \S+/(fetch2?|net) left out: \S+:1: first line must be",
        count=range(10),
    )
    sid = daemon.new(name="tw")
    results = _agent_calls(
        daemon,
        sid,
        [
            _write("/t/fetch", TOOL + "# sandbox: network\necho hi\n"),
            _write("/t/fetch2", TOOL + "# sandbox:   unsandboxed \r\necho hi\n"),
            _write("/t/plain", TOOL + "echo plain\n"),
            _write("/t/mine", TOOL + "# sandbox: ollie\necho mine\n"),
        ],
    )
    assert "Permission denied" in results[0] and "Permission denied" in results[1], results
    assert not any("error" in r.lower() for r in results[2:]), results
    assert "sandbox profile 'unsandboxed'" in daemon.read("err")
    tools = daemon.p("t")
    assert {"plain", "mine"} <= set(os.listdir(tools))
    # fetch and fetch2 were created empty before the refused write: nothing with a
    # profile wider than the caller's is there.
    for name in ("fetch", "fetch2"):
        if (tools / name).exists():
            assert "sandbox" not in (tools / name).read_text()
    # Nor can it edit a tool the user gave the network: the header still asks for it.
    (tools / "net").write_text(TOOL + "# sandbox: network\necho net\n")
    results = _agent_calls(daemon, sid, [_write("/t/net", TOOL + "# sandbox: network\nevil\n")])
    assert "Permission denied" in results[0], results
    # (emptied by the O_TRUNC of its open, as on a disk; never holding the agent's code)
    assert "evil" not in (tools / "net").read_text()
    # The user may write any header.
    assert oserror((tools / "net2").write_text, TOOL + "# sandbox: network\n") == 0


def test_a_no_new_privs_process_is_held_to_the_rules_on_every_write_path(
    daemon: Daemon,
) -> None:
    """Any process under no_new_privs is a sandboxed caller, not only toolsrv's: each way
    of changing a file in t/ (write at an offset, append, truncate by path and by handle)
    is checked on the header it would leave; and with no private mount namespace to read
    its write roots from, it may not name a cwd at all."""
    tools = daemon.p("t")
    (tools / "cut").write_text(TOOL + "# sandbox: networkx\necho x\n")
    (tools / "h").write_text(TOOL + "# sandbox: xxxxxxx\necho h\n")
    size = len(TOOL + "# sandbox: network")
    nnp = "setpriv --no-new-privs bash -c"
    for cmd in (
        f"truncate -s {size} t/cut",
        f"python3 -c 'import os; os.truncate(\"t/cut\", {size})'",
        f"python3 -c 'import os; fd = os.open(\"t/cut\", os.O_WRONLY); os.ftruncate(fd, {size})'",
        "printf '# sandbox: network\\n' >> t/cut",
        f"printf network | dd of=t/h bs=1 seek={len(TOOL + '# sandbox: ')} conv=notrunc",
    ):
        done = _shell(daemon, f"{nnp} {shlex.quote(cmd)}")
        assert "Permission denied" in done.stderr or "denied" in done.stderr.lower(), (cmd, done)
    assert (tools / "cut").read_text().endswith("networkx\necho x\n")
    assert "network" not in (tools / "h").read_text()
    # The same process may write a plain tool, and the user may cut the header.
    done = _shell(daemon, f"{nnp} {shlex.quote(f'printf %s {shlex.quote(TOOL)} > t/ok')}")
    assert done.returncode == 0, done
    assert oserror(os.truncate, tools / "cut", size) == 0
    # No view of its own to read write roots from: no cwd at all.
    done = _shell(daemon, f"{nnp} 'echo cwd={daemon.work} name=nnp > s/new'")
    assert "Permission denied" in done.stderr, done
    assert "write roots are unknown" in daemon.read("err")
