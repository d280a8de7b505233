"""The tree of SPEC 3 on a real mount: files, formats, modes and refused writes."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
from pathlib import Path

from tests.conftest import Daemon, oserror, script

SESSION_FILES = {
    "prompt",
    "peer",
    "plan",
    "compactions",
    "taskstate",
    "tcct",
    "models",
    "err",
    "fifo.in",
    "fifo.out",
    "branches",
    "checkpoints",
    "staged",
    "prompt.prev",
    "chat",
    "stream",
    "events",
    "state",
    "statewait",
    "cfg",
    "ctl",
    "offset",
    "usage",
    "cost",
    "ctxsz",
    "context",
    "env",
    "tools",
    "systemprompt",
    "tail",
    "t",
}


def test_root(daemon: Daemon) -> None:
    root = [
        "a",
        "backends",
        "complete",
        "err",
        "events",
        "help",
        "m",
        "mcp",
        "p",
        "s",
        "sk",
        "t",
        "tmp",
        "tr",
        "u",
        "x",
    ]
    assert sorted(os.listdir(daemon.path)) == root
    assert daemon.read("backends").split("\n")[0].split("\t")[0] == "openai"
    assert "s/new" in daemon.read("help")
    assert sorted(os.listdir(daemon.p("s"))) == ["idx", "new"]
    assert daemon.read("s/new") == "name=\ncwd=\nbackend=\nmodel=\nagent=\n"
    assert daemon.read("s/idx") == ""


def test_new_session_and_its_files(daemon: Daemon) -> None:
    sid = daemon.new(name="demo")
    assert sid == "demo"
    assert set(os.listdir(daemon.p("s/demo"))) == SESSION_FILES
    assert daemon.read("s/idx") == f"demo\tidle\t{daemon.work}\topenai\treplay\n"
    assert daemon.read("s/demo/state") == "idle\n"
    cfg = daemon.read("s/demo/cfg")
    assert cfg.splitlines() == [
        "state=idle",
        "backend=openai",
        "model=replay",
        "agent=default",
        f"cwd={daemon.work}",
        "maxTokens=",
        "temperature=",
        "frequencyPenalty=",
        "presencePenalty=",
        "thinkingBudget=",
        "edits=direct",
        "toolsrv=",
    ]
    env = daemon.read("s/demo/env").splitlines()
    assert env[0] == "OLLIE_SESSION_ID=demo"
    assert {line.split("=")[0] for line in env} == {
        "OLLIE_SESSION_ID",
        "OLLIE",
        "OLLIE_AGENT",
        "OLLIE_BACKEND",
        "OLLIE_MODEL",
        "OLLIE_CWD",
    }
    assert daemon.read("s/demo/usage") == "0 in, 0 out, 0 requests, 0 cached\n"
    assert daemon.read("s/demo/cost") == "costLast=$0.0000\ncostSession=$0.0000\n"
    # Before any request the context holds what every request sends: the system prompt.
    system = len(daemon.read("s/demo/systemprompt").encode())
    assert daemon.read("s/demo/ctxsz") == f"{(system + 3) // 4} / 128000 (0%)\n"
    modes = {n: stat.S_IMODE(os.stat(daemon.p(f"s/demo/{n}")).st_mode) for n in SESSION_FILES}
    assert modes["prompt"] == 0o222 and modes["ctl"] == 0o222
    assert modes["chat"] == 0o444 and modes["cfg"] == 0o666 and modes["tail"] == 0o555


def test_unnamed_session_id_format(daemon: Daemon) -> None:
    sid = daemon.new()
    ns, _, tail = sid.partition("-")
    assert ns.isdigit() and len(tail) == 6 and int(tail, 16) >= 0
    assert os.path.isdir(daemon.p(f"s/{sid}"))


def test_bad_new_requests_create_nothing(daemon: Daemon) -> None:
    daemon.new(name="taken")
    before = sorted(os.listdir(daemon.p("s")))
    journals = sorted(os.listdir(daemon.home / "state" / "sessions"))
    work = daemon.work
    cases = {
        "cwd": errno.EINVAL,  # token without =
        f"cwd={work} colour=red": errno.EINVAL,
        "name=x": errno.EINVAL,  # no cwd
        "cwd=/does/not/exist": errno.EINVAL,
        "cwd=relative/path": errno.EINVAL,
        f"cwd={work} backend=nope": errno.EINVAL,
        f"cwd={work} agent=nope": errno.EINVAL,
        f"cwd={work} cwd={work}": errno.EINVAL,
        f"cwd={work} name=new": errno.EINVAL,
        f"cwd={work} name=a/b": errno.EINVAL,
        f"cwd={work} name=taken": errno.EEXIST,
    }
    for text, want in cases.items():
        assert oserror(daemon.write, "s/new", text) == want, text
    assert sorted(os.listdir(daemon.p("s"))) == before
    assert sorted(os.listdir(daemon.home / "state" / "sessions")) == journals


def test_new_with_tilde_and_params(daemon: Daemon) -> None:
    sid = daemon.new(name="t", cwd="~", model="other-model")
    assert sid == "t"
    cfg = daemon.read("s/t/cfg")
    assert f"cwd={os.path.expanduser('~')}" in cfg and "model=other-model" in cfg


def test_read_only_and_write_only_files_refuse_by_mode(daemon: Daemon) -> None:
    daemon.new(name="m")
    for name in ("chat", "stream", "state", "usage", "backends"):
        rel = f"s/m/{name}" if name != "backends" else name
        assert oserror(os.open, daemon.p(rel), os.O_WRONLY) == errno.EACCES, name
    for name in ("prompt", "ctl"):
        if os.getuid() == 0:  # root reads a write-only file as on a disk: empty
            assert daemon.p(f"s/m/{name}").read_bytes() == b""
        else:
            assert oserror(os.open, daemon.p(f"s/m/{name}"), os.O_RDONLY) == errno.EACCES
    assert oserror(os.open, daemon.p("s/m/newfile"), os.O_WRONLY | os.O_CREAT) == errno.EACCES
    assert oserror(os.mkdir, daemon.p("s/m/dir")) == errno.EACCES


def test_prompt_and_reply(daemon: Daemon) -> None:
    daemon.new(name="p")
    daemon.prompt("p", "  hello there \n")
    daemon.wait_idle("p")
    chat = daemon.read("s/p/chat")
    assert chat.endswith("user: hello there\nassistant: echo: hello there\n")
    assert daemon.read("s/p/prompt.prev") == "hello there\n"
    offset = int(daemon.read("s/p/offset"))
    assert chat.encode()[offset:] == b"echo: hello there\n"
    usage = daemon.read("s/p/usage")
    assert usage.endswith(" 1 requests, 0 cached\n")
    ctx = [json.loads(x) for x in daemon.read("s/p/context").splitlines()]
    assert ctx == [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "echo: hello there"},
    ]
    # the key went to the server, and nowhere into the tree
    assert daemon.replay.requests[-1]["messages"][-1]["content"] == "hello there"


def test_empty_prompt_does_nothing(daemon: Daemon) -> None:
    daemon.new(name="e")
    before = daemon.read("s/e/chat")
    daemon.prompt("e", "  \n ")
    assert daemon.read("s/e/chat") == before
    assert daemon.replay.requests == []


def test_events_are_json_lines(daemon: Daemon) -> None:
    daemon.new(name="ev")
    daemon.prompt("ev", "hi")
    daemon.wait_idle("ev")
    lines = daemon.snapshot("s/ev/events").splitlines()
    events = [json.loads(x) for x in lines]
    roles = [e["role"] for e in events]
    assert {"info", "user", "state", "assistant", "usage"} <= set(roles)
    assert all(e["session"] == "ev" and isinstance(e["ts"], float) for e in events)
    text = "".join(e["content"] for e in events if e["role"] == "assistant")
    assert text == "echo: hi"
    root = [json.loads(x) for x in daemon.snapshot("events").splitlines()]
    assert [e for e in root if e["session"] == "ev"] == events


def test_api_key_never_in_the_tree(daemon: Daemon) -> None:
    daemon.new(name="k")
    daemon.prompt("k", "hi")
    daemon.wait_idle("k")
    key = daemon.env["OLLIE_OPENAI_KEY"]
    url = daemon.replay.url
    for dirpath, _, files in os.walk(daemon.path):
        for f in files:
            if f in ("stream", "events", "statewait", "prompt", "ctl", "fifo.in", "fifo.out"):
                continue
            text = Path(dirpath, f).read_text()
            assert key not in text and url not in text, f
    assert key not in daemon.snapshot("s/k/events") and key not in daemon.stderr()


def test_tail_script_follows_stream(daemon: Daemon) -> None:
    daemon.new(name="ts")
    daemon.prompt("ts", "one")
    daemon.wait_idle("ts")
    proc = subprocess.Popen([str(daemon.p("s/ts/tail"))], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        got = b""
        want = daemon.read("s/ts/chat").encode()
        while len(got) < len(want):
            got += os.read(proc.stdout.fileno(), 65536)
        assert got == want
    finally:
        proc.terminate()
        proc.wait()
        proc.stdout.close()


def test_rm_r_kills_and_keeps_the_journal(daemon: Daemon) -> None:
    daemon.new(name="gone")
    daemon.prompt("gone", "remember me")
    daemon.wait_idle("gone")
    subprocess.run(["rm", "-r", str(daemon.p("s/gone"))], check=True)
    assert "gone" not in os.listdir(daemon.p("s"))
    kept = list((daemon.home / "state" / "transcripts").glob("*-gone.jsonl"))
    assert len(kept) == 1 and "remember me" in kept[0].read_text()
    assert list((daemon.home / "state" / "sessions").glob("*.jsonl")) == []


def test_mv_renames(daemon: Daemon) -> None:
    daemon.new(name="a")
    daemon.new(name="b")
    with open(daemon.p("s/a/chat")) as held:
        os.rename(daemon.p("s/a"), daemon.p("s/c"))
        assert sorted(os.listdir(daemon.p("s"))) == ["b", "c", "idx", "new"]
        assert ":: renamed from a to c" in held.read()
    assert oserror(os.rename, daemon.p("s/c"), daemon.p("s/b")) == errno.EEXIST
    daemon.write("s/c/ctl", "rn d")
    assert "d" in os.listdir(daemon.p("s"))
    assert daemon.read("s/d/env").startswith("OLLIE_SESSION_ID=d\n")


def test_unlink_inside_session_is_a_no_op(daemon: Daemon) -> None:
    daemon.new(name="u")
    os.unlink(daemon.p("s/u/chat"))
    assert "chat" in os.listdir(daemon.p("s/u"))


def test_cfg_writes(daemon: Daemon) -> None:
    daemon.new(name="c")
    daemon.write("s/c/cfg", "model=m2\ntemperature=0.5\nmaxTokens=100\n")
    cfg = daemon.read("s/c/cfg")
    assert "model=m2\n" in cfg and "temperature=0.5\n" in cfg and "maxTokens=100\n" in cfg
    # writing the whole file back is a no-op, not an error
    daemon.write("s/c/cfg", cfg)
    for bad in ("colour=red", "temperature=warm", "maxTokens=-1", "state=thinking", "model"):
        assert oserror(daemon.write, "s/c/cfg", bad) == errno.EINVAL, bad
    # a bad line undoes the whole write
    assert oserror(daemon.write, "s/c/cfg", "model=m3\nbackend=nope\n") == errno.EINVAL
    assert "model=m2\n" in daemon.read("s/c/cfg")
    daemon.prompt("c", "x")
    daemon.wait_idle("c")
    sent = daemon.replay.requests[-1]
    assert sent["model"] == "m2" and sent["temperature"] == 0.5 and sent["max_tokens"] == 100
    assert "error: cfg: unknown key: colour" in daemon.read("s/c/chat")


def test_ctl_commands(daemon: Daemon) -> None:
    daemon.new(name="x")
    daemon.write("s/x/ctl", "stop")  # idle: nothing to do, succeeds
    for bad, err in (
        ("frobnicate", "unknown command: frobnicate"),
        ("backend", "backend: missing"),
    ):
        assert oserror(daemon.write, "s/x/ctl", bad) == errno.EINVAL
        assert f"\nerror: {err}" in daemon.read("s/x/chat")
    assert oserror(daemon.write, "s/x/ctl", "backend nope") == errno.EINVAL
    assert oserror(daemon.write, "s/x/ctl", "cwd /no/such/dir") == errno.EINVAL
    assert oserror(daemon.write, "s/x/ctl", "stop now") == errno.EINVAL
    daemon.write("s/x/ctl", "model m9\nbackend openai\n")
    assert "model=m9" in daemon.read("s/x/cfg")
    # the whole write is refused when one line is bad
    assert oserror(daemon.write, "s/x/ctl", "model m10\nbogus\n") == errno.EINVAL
    assert "model=m9" in daemon.read("s/x/cfg")
    daemon.write("s/x/ctl", f"cwd {daemon.base}")
    assert f"cwd={daemon.base}\n" in daemon.read("s/x/cfg")
    daemon.prompt("x", "first")
    daemon.wait_idle("x")
    daemon.write("s/x/ctl", "clear")
    assert daemon.read("s/x/context") == ""
    assert ":: history cleared" in daemon.read("s/x/chat")
    daemon.write("s/x/ctl", "kill")
    assert "x" not in os.listdir(daemon.p("s"))


def test_statewait(daemon: Daemon) -> None:
    daemon.replay.add(script('{"reply": "slow", "first_delay": 0.3}'))
    daemon.new(name="w")
    with open(daemon.p("s/w/statewait")) as w:
        daemon.prompt("w", "go")
        assert w.read() == "thinking\n"
        assert w.read() == ""  # one value per open
    daemon.wait_idle("w")
    assert os.stat(daemon.p("s/w/statewait")).st_size == 0


def test_nonblocking_read_at_end(daemon: Daemon) -> None:
    daemon.new(name="nb")
    for name in ("stream", "events"):
        fd = os.open(daemon.p(f"s/nb/{name}"), os.O_RDONLY | os.O_NONBLOCK)
        try:
            data = os.read(fd, 1 << 20)
            assert data  # the creation line
            assert oserror(os.read, fd, 100) == errno.EAGAIN
        finally:
            os.close(fd)


def test_new_answers_the_id_to_a_shell(daemon: Daemon) -> None:
    out = subprocess.run(
        ["bash", "-c", f'exec 3<>s/new; echo "cwd={daemon.work}" >&3; read -r id <&3; echo $id'],
        cwd=daemon.path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out and os.path.isdir(daemon.p(f"s/{out}"))
