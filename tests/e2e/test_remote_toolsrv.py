"""A session's tools on another host: ``toolsrv=ssh:...`` against a real sshd on loopback,
with a separate user as the remote side (tests/e2e/sshd.py)."""

from __future__ import annotations

import errno
import importlib.metadata
import json
import os
import pwd
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from olliefs.testing import expect_log
from tests.conftest import Daemon, oserror, script
from tests.e2e.sshd import Sshd, running_sshd
from tests.e2e.test_tools import call, calls, reply


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    with running_sshd(tmp_path_factory.mktemp("sshd")) as s:
        yield s


def remote_dir(sshd: Sshd, name: str) -> Path:
    """A directory of the remote user's (its files are the remote files)."""
    work = sshd.home / name
    work.mkdir()
    uid = pwd.getpwnam(sshd.user).pw_uid
    os.chown(work, uid, uid)
    return work


def ssh_pids(sshd: Sshd) -> list[int]:
    """The ssh processes that use the test's ssh config (the daemon's link to the host)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv[0] == b"ssh" and str(sshd.config).encode() in argv:
            found.append(int(d))
    return found


def test_tools_and_bang_commands_run_on_the_remote_host_as_its_user(
    sshd: Sshd, daemon_factory: Callable[..., Daemon]
) -> None:
    work = remote_dir(sshd, "work1")
    # A tool only the remote user has (in its own ollie config dir there).
    tools = sshd.home / ".config" / "ollie" / "tools"
    tools.mkdir(parents=True, exist_ok=True)
    (tools / "only_there").write_text(
        "#!/bin/sh\n# ollie-tool\n# description: a tool of the remote host\n"
        '# args: {"type": "object"}\necho there\n'
    )
    (tools / "only_there").chmod(0o755)
    uid = pwd.getpwnam(sshd.user).pw_uid
    for p in (sshd.home / ".config", sshd.home / ".config" / "ollie", tools):
        os.chown(p, uid, uid)
    d = daemon_factory(OLLIE_TOOLSRV=f"ssh:{sshd.host}:{work}", OLLIE_SSH=sshd.ssh)
    d.replay.add(
        script(calls(call("execute_code", {"code": "id -un > who; pwd"}, "c1")), reply("ok"))
    )
    with d.running():
        idx = d.read("t/idx")  # what the remote toolsrv serves
        assert "execute_code" in idx and "only_there\ta tool of the remote host" in idx
        sid = d.new(name="t")
        d.write(f"s/{sid}/ctl", "tool_load execute_code")
        d.prompt(sid, "who")
        d.wait_idle(sid)
        assert (work / "who").read_text() == "ollie-remote\n"
        assert (work / "who").stat().st_uid == pwd.getpwnam(sshd.user).pw_uid
        assert f"\n{work}\n" in d.read(f"s/{sid}/chat")
        d.prompt(sid, "!echo hi > bang; id -un")
        d.wait_idle(sid)
        assert (work / "bang").read_text() == "hi\n"
        assert "ollie-remote" in d.read(f"s/{sid}/chat").split("!echo hi", 1)[1]
        assert len(ssh_pids(sshd)) == 1  # one connection for the tree and the session


def test_the_remote_side_is_sandboxed_there(
    sshd: Sshd, daemon_factory: Callable[..., Daemon]
) -> None:
    work = remote_dir(sshd, "work2")
    outside = remote_dir(sshd, "outside")
    d = daemon_factory(OLLIE_TOOLSRV=f"ssh:{sshd.host}:{work}", OLLIE_SSH=sshd.ssh)
    code = f"echo x > {outside}/f; echo rc=$?"
    d.replay.add(script(calls(call("execute_code", {"code": code}, "c1")), reply("ok")))
    with d.running():
        sid = d.new(name="t")
        d.write(f"s/{sid}/ctl", "tool_load execute_code")
        d.prompt(sid, "escape")
        d.wait_idle(sid)
        assert not (outside / "f").exists()
        assert "rc=1" in d.read(f"s/{sid}/chat")


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"OLLIE_SSH_TOOLSRV": "no-such-toolsrv"}, "no no-such-toolsrv on the PATH of"),
        ({"OLLIE_TOOLSRV": "ssh:nohost.invalid"}, "ssh cannot reach nohost.invalid"),
        ({"OLLIE_SSH": "no-such-ssh"}, "no ssh on this machine (no-such-ssh not found)"),
    ],
)
def test_what_is_missing_is_named(
    sshd: Sshd, daemon_factory: Callable[..., Daemon], env: dict[str, str], says: str
) -> None:
    settings = {"OLLIE_TOOLSRV": f"ssh:{sshd.host}", "OLLIE_SSH": sshd.ssh} | env
    # The turn goes on without tools; the daemon says why, once where the link failed
    # (not for a missing ssh, found before any start) and once where the turn met it.
    said = re.escape(says)
    expect_log(rf"toolclient\.remote: toolsrv ssh:\S+: {said}", count=range(2))
    expect_log(rf"agent\.loop: toolsrv ssh:\S+: {said}")
    d = daemon_factory(**settings)
    d.replay.add(script(reply("no tools today")))
    with d.running():
        sid = d.new(name="t")
        d.prompt(sid, "hi")
        d.wait_idle(sid)
        chat = d.read(f"s/{sid}/chat")
        assert says in chat
        assert chat.endswith("assistant: no tools today\n")


def test_a_dropped_connection_cuts_the_call_and_the_next_one_reconnects(
    sshd: Sshd, daemon_factory: Callable[..., Daemon]
) -> None:
    work = remote_dir(sshd, "work3")
    d = daemon_factory(OLLIE_TOOLSRV=f"ssh:{sshd.host}:{work}", OLLIE_SSH=sshd.ssh)
    d.replay.add(
        script(
            calls(call("execute_code", {"code": "touch started; sleep 1000"}, "c1")),
            reply("went on"),
            calls(call("execute_code", {"code": "echo again"}, "c2")),
            reply("two"),
        )
    )
    with d.running():
        sid = d.new(name="t")
        d.write(f"s/{sid}/ctl", "tool_load execute_code")
        d.prompt(sid, "go")
        d.wait_for(lambda: (work / "started").exists())
        (pid,) = ssh_pids(sshd)
        expect_log(r"agent\.runtime: toolsrv connection of \S+ lost: connection closed")
        expect_log(r"toolclient\.remote: toolsrv ssh:\S+: ssh ended \(-9\); reconnects")
        os.kill(pid, signal.SIGKILL)
        d.wait_idle(sid)
        chat = d.read(f"s/{sid}/chat")
        assert "[tool error] toolsrv died; the call was cut\n" in chat
        assert chat.endswith("assistant: went on\n")
        d.prompt(sid, "again")
        d.wait_idle(sid)
        assert d.read(f"s/{sid}/chat").endswith("again\nassistant: two\n")
        assert ssh_pids(sshd) != [pid]


def test_cfg_toolsrv_moves_one_session_and_its_bang_commands(
    sshd: Sshd, daemon_factory: Callable[..., Daemon]
) -> None:
    work = remote_dir(sshd, "work4")
    d = daemon_factory(OLLIE_SSH=sshd.ssh)  # the daemon's default stays local
    d.replay.add(
        script(
            calls(call("execute_code", {"code": "id -un"}, "c1")),
            reply("here"),
            calls(call("execute_code", {"code": "id -un > who"}, "c2")),
            reply("there"),
        )
    )
    with d.running():
        sid = d.new(name="t")
        d.write(f"s/{sid}/ctl", "tool_load execute_code")
        d.prompt(sid, "where")
        d.wait_idle(sid)
        assert "\nroot\n" in d.read(f"s/{sid}/chat")
        for bad in ("ssh:", "ssh:host:relative", "nfs:x", "ssh:-oProxyCommand=x"):
            assert oserror(d.write, f"s/{sid}/cfg", f"toolsrv={bad}\n") == errno.EINVAL
        d.write(f"s/{sid}/cfg", f"toolsrv=ssh:{sshd.host}:{work}\n")
        assert f"toolsrv=ssh:{sshd.host}:{work}\n" in d.read(f"s/{sid}/cfg")
        d.prompt(sid, "and now")
        d.wait_idle(sid)
        assert (work / "who").read_text() == "ollie-remote\n"
        d.prompt(sid, "!id -un > bang")
        d.wait_idle(sid)
        assert (work / "bang").read_text() == "ollie-remote\n"
        d.write(f"s/{sid}/cfg", "toolsrv=local\n")
        d.prompt(sid, "!id -un")
        d.wait_idle(sid)
        assert d.read(f"s/{sid}/chat").endswith("root\n")
    d.start()  # the journal keeps where the session's tools run
    assert "toolsrv=local\n" in d.read(f"s/{sid}/cfg")
    d.stop()


def test_a_profile_names_the_toolsrv_of_its_sessions(
    sshd: Sshd, daemon_factory: Callable[..., Daemon]
) -> None:
    work = remote_dir(sshd, "work5")
    d = daemon_factory(OLLIE_SSH=sshd.ssh)
    with d.running():
        bad = json.dumps({"toolsrv": "ssh:h:rel"})
        assert oserror(d.p("a/far.json").write_text, bad) == errno.EINVAL
        d.p("a/far.json").write_text(json.dumps({"toolsrv": f"ssh:{sshd.host}:{work}"}))
        sid = d.new(name="t", agent="far")
        assert f"toolsrv=ssh:{sshd.host}:{work}\n" in d.read(f"s/{sid}/cfg")
        d.prompt(sid, "!id -un > who")
        d.wait_idle(sid)
        assert (work / "who").read_text() == "ollie-remote\n"


def ollie(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "olliefs", *args],
        env=d.env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def test_status_lists_the_connection_and_doctor_asks_the_remote_version(
    sshd: Sshd, daemon_factory: Callable[..., Daemon]
) -> None:
    work = remote_dir(sshd, "work6")
    d = daemon_factory(OLLIE_TOOLSRV=f"ssh:{sshd.host}:{work}", OLLIE_SSH=sshd.ssh)
    with d.running():
        d.read("t/idx")  # the tree's attach opens the connection
        (pid,) = ssh_pids(sshd)
        status = ollie(d, "status").stdout
        assert f"remote toolsrv ssh:{sshd.host} connected (ssh pid {pid}" in status
        doc = ollie(d, "doctor").stdout
        version = importlib.metadata.version("olliefs")
        assert f"ok   remote toolsrv: ssh:{sshd.host}:{work}: toolsrv {version} (same" in doc
    d.env["OLLIE_SSH_TOOLSRV"] = "no-such-toolsrv"
    doc = ollie(d, "doctor").stdout
    assert f"FAIL remote toolsrv: no no-such-toolsrv on the PATH of {sshd.host}" in doc
