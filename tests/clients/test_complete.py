"""``u/complete`` run exactly as ellie.el runs it, for every wire (no Emacs needed).

ellie's M-/ runs, through ``sh -c``, ``printf '%s' PREFIX | MNT/u/complete -file NAME
-suffix SUFFIX -model M -backend B`` with ``OLLIE=MNT`` in the environment, reads
stdout and stderr together, and shows what was printed as ghost text unless the exit
status is not 0 or nothing was printed. These tests do the same against a real mount
whose backends all point at the replay server (with keys, checked as the providers do),
and check the printed bytes and the request each provider got, over real HTTP.
tests/clients/test_ellie.py runs ellie.el itself.
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from olliefs.backend.fim import CURSOR
from olliefs.replay import Entry, Recorded, ReplayServer
from olliefs.testing import HAVE_FUSE, Daemon, wait_until

pytestmark = pytest.mark.skipif(not HAVE_FUSE, reason="needs /dev/fuse (mounts for real)")

KEY = "sk-complete-0123456789"
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"
NATIVE = {"ollama": "/api/generate", "openai": "/v1/completions"}
CHAT = ["anthropic", "gemini", "copilot", "kiro"]
# What a chat model says around the insertion: all of it but the insertion must go.
CHATTY = "Here is the completion:\n```python\n    return a + b\n\nprint(add(1, 2))\n```\nDone."


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[tuple[ReplayServer, Daemon]]:
    with ReplayServer(key=KEY) as server:
        # Timeouts far beyond any wait here: a request that ends did not time out.
        env = {**server.settings(), "OLLIE_COMPLETE_TIMEOUT": "600", "OLLIE_READ_TIMEOUT": "600"}
        daemon = Daemon(tmp_path, server, env)
        with daemon.running():
            yield server, daemon


def ellie(
    d: Daemon,
    backend: str,
    prefix: str = PREFIX,
    suffix: str = SUFFIX,
    model: str = "replay",
    **popen: object,
) -> subprocess.CompletedProcess[bytes]:
    """Run u/complete as ellie-complete does: the same command line, through sh."""
    argv = [str(d.p("u/complete")), "-file", "m.py", "-suffix", suffix]
    cmd = shlex.join([*argv, "-model", model, "-backend", backend])
    line = f"printf '%s' {shlex.quote(prefix)} | {cmd}"
    env = {**os.environ, "OLLIE": str(d.path)}
    return subprocess.run(  # type: ignore[call-overload, no-any-return]
        ["sh", "-c", line],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one buffer, as Emacs' process buffer
        timeout=60,  # a deadline for a hang, not a timing
        **popen,
    )


def carries(request: Recorded, text: str) -> bool:
    """Whether ``text`` is one string of the request's JSON body."""
    return json.dumps(text)[1:-1] in json.dumps(request.body)


@pytest.mark.parametrize("backend", [*NATIVE, *CHAT])
def test_each_wire_prints_only_the_text_to_insert(
    keyed: tuple[ReplayServer, Daemon], backend: str
) -> None:
    server, d = keyed
    server.add([Entry(reply="return a + b" if backend in NATIVE else CHATTY)])
    run = ellie(d, backend)
    assert (run.returncode, run.stdout) == (0, b"return a + b")
    [request] = server.recorded
    if backend in NATIVE:
        assert request.path == NATIVE[backend]
        body = request.body
        assert (body["prompt"], body["suffix"], body["model"]) == (PREFIX, SUFFIX, "replay")
    else:
        assert carries(request, "m.py")  # the file's name: its language
        assert carries(request, PREFIX + CURSOR + SUFFIX)
    assert d.read("err") == ""


def test_an_openai_server_without_completions_gets_a_chat_request_from_then_on(
    keyed: tuple[ReplayServer, Daemon],
) -> None:
    server, d = keyed
    server.completions = False  # /v1/completions: 404, as a chat-only server
    server.add([Entry(reply=CHATTY), Entry(reply="<insert>return a - b</insert>")])
    assert ellie(d, "openai").stdout == b"return a + b"
    assert ellie(d, "openai").stdout == b"return a - b"
    assert server.not_found == ["/v1/completions"]  # asked once, then remembered
    assert [r.path for r in server.recorded] == ["/v1/chat/completions"] * 2


def test_an_ollama_model_without_insert_gets_a_chat_request(
    keyed: tuple[ReplayServer, Daemon],
) -> None:
    server, d = keyed
    no_insert = "registry.ollama.ai/library/replay:latest does not support insert"
    server.add([Entry(status=400, error=no_insert), Entry(reply="<insert>return a + b</insert>")])
    run = ellie(d, "ollama")
    assert (run.returncode, run.stdout) == (0, b"return a + b")
    assert [r.path for r in server.recorded] == ["/api/generate", "/api/chat"]


def test_a_server_that_ignores_the_suffix_does_not_get_it_inserted_twice(
    keyed: tuple[ReplayServer, Daemon],
) -> None:
    server, d = keyed
    server.add([Entry(reply="return a + b\n\nprint(add(1, 2))")])
    assert ellie(d, "openai").stdout == b"return a + b"


def test_an_empty_suffix_still_asks_for_fill_in_the_middle(
    keyed: tuple[ReplayServer, Daemon],
) -> None:
    """Ollama renders its fill-in-the-middle template only for a suffix that is not
    empty; OpenAI's plain completion needs none."""
    server, d = keyed
    server.add([Entry(reply="1"), Entry(reply="2")])
    assert ellie(d, "ollama", "x = ", "").stdout == b"1"
    assert ellie(d, "openai", "x = ", "").stdout == b"2"
    generate, completions = (r.body for r in server.recorded)
    assert (generate["prompt"], generate["suffix"]) == ("x = ", "\n")
    assert completions["prompt"] == "x = " and "suffix" not in completions


def test_no_completion_is_a_failure_with_its_reason(keyed: tuple[ReplayServer, Daemon]) -> None:
    server, d = keyed
    server.add([Entry(status=404, error="model 'nope' not found")])
    run = ellie(d, "ollama", model="nope")
    assert run.returncode == 1
    assert d.read("err") == "complete: ollama: HTTP 404: model 'nope' not found\n"
    run = ellie(d, "nope")
    assert run.returncode == 1
    assert "unknown backend nope" in d.read("err")
    assert len(server.recorded) == 1  # the unknown backend asked nothing


def test_a_silent_provider_is_given_up_after_the_timeout(
    keyed: tuple[ReplayServer, Daemon],
) -> None:
    server, d = keyed
    server.add([Entry(silent=True)])
    run = subprocess.run(
        [d.p("u/complete"), "-backend", "ollama", "-model", "replay", "-timeout", "0.5"],
        input=b"x = ",
        env={**os.environ, "OLLIE": str(d.path)},
        capture_output=True,
        timeout=60,
    )
    assert (run.returncode, run.stdout) == (1, b"")
    reason = "complete: no answer from ollama (model replay) within 0.5 s\n"
    assert run.stderr.endswith(reason.encode()) and d.read("err") == reason
    server.wait_connections(lambda n: n == 0)  # the request was given up, not left open


def test_ctrl_c_ends_the_wait_and_the_request(keyed: tuple[ReplayServer, Daemon]) -> None:
    server, d = keyed
    server.add([Entry(silent=True)])
    proc = subprocess.Popen(
        ["sh", "-c", f"printf 'x = ' | {shlex.quote(str(d.p('u/complete')))} -backend ollama"],
        env={**os.environ, "OLLIE": str(d.path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        server.wait_recorded(lambda r: len(r) == 1)  # the read waits on the model now
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
        wait_until(lambda: proc.poll() is not None, "u/complete ended", exits=[proc.pid])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert proc.returncode != 0
    server.wait_connections(lambda n: n == 0)  # the daemon gave the request up
    assert "complete:" not in d.read("err")  # a cancel is no failure


def test_word_completion_stays_under_its_own_option(keyed: tuple[ReplayServer, Daemon]) -> None:
    server, d = keyed
    env = {**os.environ, "OLLIE": str(d.path)}

    def run(*args: str) -> bytes:
        done = subprocess.run(
            [d.p("u/complete"), *args], env=env, input=b"", capture_output=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert run("-w", "tool_l") == b"tool_load\n"
    assert run("-w", "-s", "nobody", "--", "tool_l") == b"tool_load\n"
    assert b"tool_load\n" in run("-w")  # stdin not a terminal, but -w: every command
    assert run("tool_l") == b"tool_load\n"  # words alone: word completion, as before
    assert server.recorded == []
    # No argument at all and the text on stdin: code completion (with the defaults).
    server.add([Entry(reply="42")])
    assert run() == b"42"
    assert [r.path for r in server.recorded] == ["/v1/completions"]


def test_the_file_without_a_request_reads_empty_and_asks_nothing(
    keyed: tuple[ReplayServer, Daemon],
) -> None:
    server, d = keyed
    assert d.read("complete") == ""
    with open(d.p("complete"), "w") as f:  # written, closed, never read: not asked
        f.write("model=replay\n\nx = ")
    assert server.recorded == []


def test_a_handle_carries_one_request_of_at_most_1_mib(
    keyed: tuple[ReplayServer, Daemon],
) -> None:
    server, d = keyed
    server.add([Entry(reply="1")])
    fd = os.open(d.p("complete"), os.O_RDWR)
    try:
        os.write(fd, b"backend=ollama\nmodel=replay\n\nx = ")
        assert os.read(fd, 100) == b"1"
        with pytest.raises(OSError) as refused:
            os.write(fd, b"y = ")
        assert refused.value.errno == errno.EBUSY
        assert "one request per open" in d.read("err")
    finally:
        os.close(fd)
    fd = os.open(d.p("complete"), os.O_RDWR)
    try:
        os.write(fd, b"backend=ollama\n\n")
        with pytest.raises(OSError) as refused:
            for _ in range(17):  # the write that passes 1 MiB fails
                os.write(fd, b"x" * (1 << 16))
        assert refused.value.errno == errno.EFBIG
        assert "longer than 1 MiB" in d.read("err")
        with pytest.raises(OSError) as refused:
            os.read(fd, 100)
        assert refused.value.errno == errno.EFBIG  # nothing of it is asked
    finally:
        os.close(fd)
    assert len(server.recorded) == 1
