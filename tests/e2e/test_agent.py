"""Agent turns end to end: daemon + real OpenAI backend + replay server over loopback."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable

from tests.conftest import Daemon, oserror, script


def context(daemon: Daemon, sid: str) -> list[dict[str, object]]:
    return [json.loads(x) for x in daemon.read(f"s/{sid}/context").splitlines()]


def user_texts(daemon: Daemon) -> list[str]:
    return [r["messages"][-1]["content"] for r in daemon.replay.requests]


def test_prompts_written_while_running_are_queued(daemon: Daemon) -> None:
    daemon.replay.add(script('{"reply": "slow one", "chunk": 1, "delay": 0.02}'))
    daemon.new(name="q")
    daemon.prompt("q", "a")
    daemon.wait_chat("q", "assistant: s")
    daemon.prompt("q", "b")
    daemon.prompt("q", "c")
    daemon.wait_idle("q")
    assert user_texts(daemon) == ["a", "b", "c"]
    chat = daemon.read("s/q/chat")
    for line in ("user: b\n", "user: c\n", "assistant: echo: b\n", "assistant: echo: c\n"):
        assert line in chat
    assert chat.index("assistant: echo: b") < chat.index("assistant: echo: c")
    roles = [m["role"] for m in context(daemon, "q")]
    assert roles == ["user", "assistant"] * 3


def test_stop_interrupts_and_keeps_the_partial_reply(daemon: Daemon) -> None:
    daemon.replay.add(script('{"reply": "' + "word " * 200 + '", "chunk": 5, "delay": 0.02}'))
    daemon.new(name="s")
    daemon.prompt("s", "talk")
    daemon.wait_chat("s", "assistant: word word")
    daemon.write("s/s/ctl", "stop")
    daemon.wait_idle("s")
    chat = daemon.read("s/s/chat")
    assert chat.endswith("\n:: stopped\n")
    partial = chat.split("assistant: ")[-1].split("\n")[0]
    assert partial.startswith("word word") and len(partial) < 1000
    ctx = context(daemon, "s")
    assert ctx[-1] == {"role": "assistant", "content": partial}
    daemon.prompt("s", "again")
    daemon.wait_idle("s")
    assert daemon.read("s/s/chat").endswith("assistant: echo: again\n")


def test_busy_while_running(daemon: Daemon) -> None:
    daemon.replay.add(script('{"reply": "x", "hang": true}'))
    daemon.new(name="b")
    daemon.prompt("b", "hang")
    daemon.wait_state("b", "thinking")

    for cmd in ("model m2", "backend openai", f"cwd {daemon.base}", "clear", "rn b2"):
        assert oserror(daemon.write, "s/b/ctl", cmd) == errno.EBUSY, cmd
    assert oserror(daemon.write, "s/b/cfg", "model=m2") == errno.EBUSY
    assert oserror(os.rename, daemon.p("s/b"), daemon.p("s/b2")) == errno.EBUSY
    assert "error: model: refused while a turn is running" in daemon.read("s/b/chat")
    daemon.write("s/b/cfg", "model=replay\n")  # unchanged values are fine
    daemon.write("s/b/ctl", "stop")
    daemon.wait_idle("b")


def test_rate_limit_then_reply(daemon: Daemon) -> None:
    daemon.replay.add(
        script(
            '{"status": 429, "retry_after_ms": 30}',
            '{"status": 429}',
            '{"reply": "made it"}',
        )
    )
    daemon.new(name="r")
    with open(daemon.p("s/r/statewait")) as w:
        daemon.prompt("r", "go")
        assert w.read() == "thinking\n"
    daemon.wait_idle("r")
    chat = daemon.read("s/r/chat")
    assert "retrying in 0.03s... (" in chat
    assert "retrying in 0.02s... (" in chat  # no Retry-After: OLLIE_RATELIMIT_BASE * 2^1
    assert chat.endswith("assistant: made it\n")
    events = [json.loads(x) for x in daemon.snapshot("s/r/events").splitlines()]
    assert [e["content"] for e in events if e["role"] == "state"].count("limitretry") == 2
    assert sum(e["role"] == "limitretry" for e in events) == 2


def test_dropped_stream_is_retried_and_only_the_retry_is_history(daemon: Daemon) -> None:
    daemon.replay.add(
        script(
            '{"reply": "this will be cut", "chunk": 4, "drop_after": 2}',
            '{"reply": "whole answer"}',
        )
    )
    daemon.new(name="d")
    daemon.prompt("d", "go")
    daemon.wait_idle("d")
    chat = daemon.read("s/d/chat")
    assert "assistant: this wil\nretrying in 0.01s... (" in chat
    assert chat.endswith("assistant: whole answer\n")
    assert context(daemon, "d")[-1] == {"role": "assistant", "content": "whole answer"}
    assert daemon.read("s/d/usage").split(", ")[2] == "1 requests"


def test_server_errors_exhaust_retries_and_end_the_turn(daemon: Daemon) -> None:
    daemon.replay.add(script(*['{"status": 503, "error": "overloaded"}'] * 4))
    daemon.new(name="e")
    daemon.prompt("e", "go")
    daemon.wait_idle("e")
    chat = daemon.read("s/e/chat")
    assert chat.count("retrying in ") == 3
    assert chat.splitlines()[-1].startswith("error: ") and "overloaded" in chat
    daemon.prompt("e", "still alive?")
    daemon.wait_idle("e")
    assert daemon.read("s/e/chat").endswith("assistant: echo: still alive?\n")


def test_garbage_ends_the_turn_with_an_error(daemon: Daemon) -> None:
    daemon.replay.add(script('{"garbage": "{not json"}', '{"status": 400, "error": "bad"}'))
    daemon.new(name="g")
    daemon.prompt("g", "one")
    daemon.wait_idle("g")
    daemon.prompt("g", "two")
    daemon.wait_idle("g")
    lines = daemon.read("s/g/chat").splitlines()
    errors = [x for x in lines if x.startswith("error: ")]
    assert len(errors) == 2 and "bad" in errors[1]
    assert daemon.read("s/g/state") == "idle\n"


def test_context_overflow_is_reported(daemon: Daemon) -> None:
    daemon.replay.add(
        script(
            '{"status": 400, "error": "This model\'s maximum context length is 8 tokens",'
            ' "error_code": "context_length_exceeded"}'
        )
    )
    daemon.new(name="o")
    daemon.prompt("o", "too long")
    daemon.wait_idle("o")
    assert "error: " in daemon.read("s/o/chat")
    assert "context" in daemon.read("s/o/chat").splitlines()[-1]


def test_hung_backend_times_out_and_stop_cancels_a_back_off(
    daemon_factory: Callable[..., Daemon],
) -> None:
    d = daemon_factory(OLLIE_READ_TIMEOUT="0.2", OLLIE_RETRY_BASE="60")
    d.start()
    d.replay.add(script('{"hang": true}'))
    d.new(name="h")
    d.prompt("h", "go")
    d.wait_chat("h", "retrying in 60s...")
    d.write("s/h/ctl", "stop")  # cancels the 60 s back-off at once
    d.wait_idle("h")
    last = d.read("s/h/chat").splitlines()[-2:]
    assert last[0].startswith("retrying in 60s... (") and last[1] == ":: stopped"


def test_reasoning_tool_calls_usage_and_cost(daemon: Daemon) -> None:
    daemon.replay.add(
        script(
            '{"reasoning": "let me think", "tool_calls": [{"id": "c1", "name": "file_read",'
            ' "arguments": {"path": "x"}}], "late_ids": true,'
            ' "usage": {"prompt_tokens": 100, "completion_tokens": 20, "cached_tokens": 50,'
            ' "cost": 0.25}}',
            '{"reply": "done", "usage": {"prompt_tokens": 130, "completion_tokens": 5,'
            ' "cost": 0.5}}',
        )
    )
    daemon.new(name="t")
    daemon.prompt("t", "read x")
    daemon.wait_idle("t")
    chat = daemon.read("s/t/chat")
    assert (
        "user: read x\n<think>\nlet me think\n</think>\n"
        '-> file_read({"path":"x"})\n'
        "[tool error] unknown tool 'file_read': not loaded (loaded: client_9p); "
        "load it with tool_load file_read through ctl\n"
        "assistant: done\n"
    ) in chat
    assert daemon.read("s/t/usage") == "230 in, 25 out, 2 requests, 50 cached\n"
    assert daemon.read("s/t/cost") == "costLast=$0.7500\ncostSession=$0.7500\n"
    assert daemon.read("s/t/ctxsz") == "135 / 128000 (0%)\n"
    sent = daemon.replay.requests[-1]["messages"]
    assert sent[-2]["role"] == "assistant" and sent[-2]["tool_calls"][0]["id"] == "c1"
    assert sent[-1]["role"] == "tool" and sent[-1]["tool_call_id"] == "c1"
    assert sent[-1]["content"].startswith("[tool error] unknown tool 'file_read'")


def test_cost_from_the_price_table(daemon: Daemon) -> None:
    daemon.replay.add(
        script(
            '{"reply": "ok", "usage": {"prompt_tokens": 1000000, "completion_tokens": 100000,'
            ' "cached_tokens": 200000}}'
        )
    )
    daemon.new(name="u", model="gpt-4o")
    daemon.prompt("u", "hello")
    daemon.wait_idle("u")
    assert daemon.read("s/u/usage") == "1000000 in, 100000 out, 1 requests, 200000 cached\n"
    # 800k plain input at $2.50/M, 200k cached at half that, 100k output at $10/M
    assert daemon.read("s/u/cost") == "costLast=$3.2500\ncostSession=$3.2500\n"
