"""Hooks with real shell commands: exit codes, payload, environment, order, fail-closed,
timeouts that kill the whole process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from olliefs.agent.hooks import (
    ENV_VALUE_MAX,
    HOOK_OUTPUT_CAP,
    HookFailure,
    HookResult,
    env_name,
    hook_env,
    run_hook,
)
from olliefs.agent.shell import base_env, group_members
from olliefs.testing import await_until
from tests.agent.conftest import alive, read_pid

ENV = {**base_env(), "OLLIE": "/mnt/ollie", "OLLIE_SESSION_ID": "from-env"}
PAYLOAD = {"session_id": "s1", "cwd": "/w", "tool": "file_write", "args": {"path": "a"}}


async def hook(
    tmp_path: Path,
    *commands: str,
    payload: dict[str, object] | None = None,
    timeout: float = 60.0,
    failure: HookFailure = "warn",
) -> HookResult:
    return await run_hook(
        "preTool",
        list(commands),
        PAYLOAD if payload is None else payload,
        cwd=str(tmp_path),
        env=ENV,
        timeout=timeout,
        failure=failure,
    )


async def test_exit_0_adds_stdout_to_the_context(tmp_path: Path) -> None:
    res = await hook(tmp_path, "echo one", "printf 'two\\n\\n'", "true", "echo three")
    assert not res.blocked and res.warnings == []
    assert res.context == "one\ntwo\nthree"
    assert res.ran == 4 and res.ok


async def test_payload_on_stdin_and_ollie_variables(tmp_path: Path) -> None:
    res = await hook(
        tmp_path,
        "cat > payload.json; env > env.txt; pwd > cwd.txt",
        payload={**PAYLOAD, "isError": False, "attempt": 2, "nothing": None},
    )
    assert res.ok
    sent = json.loads((tmp_path / "payload.json").read_text())
    assert sent == {**PAYLOAD, "isError": False, "attempt": 2, "nothing": None, "event": "preTool"}
    env = dict(line.split("=", 1) for line in (tmp_path / "env.txt").read_text().splitlines())
    assert env["OLLIE_EVENT"] == "preTool"
    assert env["OLLIE_SESSION_ID"] == "s1"  # the payload wins over the given env
    assert env["OLLIE"] == "/mnt/ollie"  # the given env is there
    assert env["OLLIE_CWD"] == "/w"
    assert env["OLLIE_TOOL"] == "file_write"
    assert env["OLLIE_ARGS"] == '{"path":"a"}'
    assert env["OLLIE_IS_ERROR"] == "false"
    assert env["OLLIE_ATTEMPT"] == "2"
    assert env["OLLIE_NOTHING"] == ""
    assert (tmp_path / "cwd.txt").read_text() == f"{tmp_path}\n"


def test_env_names_and_limits() -> None:
    assert env_name("session_id") == "OLLIE_SESSION_ID"
    assert env_name("sessionId") == "OLLIE_SESSION_ID"
    assert env_name("is-error") == "OLLIE_IS_ERROR"
    assert env_name("__") is None
    env = hook_env(
        "preTurn",
        {"prompt": "x" * (ENV_VALUE_MAX + 1), "nul": "a\0b", "ok": "y"},
        {"OLLIE_PROMPT": "stale"},
    )
    assert "OLLIE_PROMPT" not in env and "OLLIE_NUL" not in env
    assert env["OLLIE_OK"] == "y" and env["OLLIE_EVENT"] == "preTurn"


async def test_exit_2_blocks_with_stderr_and_stops(tmp_path: Path) -> None:
    res = await hook(
        tmp_path,
        "echo before",
        "echo 'no writes to /etc' >&2; exit 2",
        "touch ran-after",
    )
    assert res.blocked and res.reason == "no writes to /etc"
    assert res.context == "before"  # what ran before the block
    assert not (tmp_path / "ran-after").exists()
    assert res.ran == 2 and not res.ok


async def test_exit_2_without_stderr_still_has_a_reason(tmp_path: Path) -> None:
    res = await hook(tmp_path, "exit 2")
    assert res.blocked and res.reason == "blocked by hook preTool (`exit 2`), no reason given"


async def test_other_exits_warn_and_go_on(tmp_path: Path) -> None:
    res = await hook(
        tmp_path,
        "echo 'lint: 3 problems' >&2; echo second line >&2; exit 1",
        "kill -9 $$",
        "echo after",
    )
    assert not res.blocked and not res.ok
    assert res.warnings == [
        "hook preTool[1] (`echo 'lint: 3 problems' >&2; echo second line >&2; exit 1`) "
        "exited 1: lint: 3 problems | second line",
        "hook preTool[2] (`kill -9 $$`) killed by signal 9",
    ]
    assert res.context == "after"


@pytest.mark.parametrize(
    ("command", "why"),
    [
        ("echo boom >&2; exit 1", "exited 1: boom"),
        ("kill -TERM $$", "killed by signal 15"),
    ],
)
async def test_failure_block_fails_closed(tmp_path: Path, command: str, why: str) -> None:
    res = await hook(tmp_path, command, "touch ran-after", failure="block")
    assert res.blocked
    assert why in res.reason and res.reason.endswith("(hookFailure is block)")
    assert not (tmp_path / "ran-after").exists()
    warn = await hook(tmp_path, command, failure="warn")
    assert not warn.blocked and why in warn.warnings[0]


async def test_a_hook_that_cannot_start(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    res = await run_hook("postTurn", ["true"], {}, cwd=str(gone), env=ENV)
    assert not res.blocked
    assert res.warnings[0].startswith("hook postTurn (`true`) could not start: cannot run")
    res = await run_hook("postTurn", ["true"], {}, cwd=str(gone), env=ENV, failure="block")
    assert res.blocked and "could not start" in res.reason


async def test_timeout_kills_the_group_grandchild_included(tmp_path: Path) -> None:
    script = (
        "echo $$ > leader.pid; "
        "sh -c 'trap \"\" TERM; echo $$ > gc.pid; exec sleep 1000' & "
        "echo started; wait"
    )
    with trio.fail_after(60):
        res = await hook(tmp_path, script, "touch ran-after", timeout=2.0)
    assert not res.blocked
    assert res.warnings[0].endswith("timed out after 2s and was killed")
    assert (tmp_path / "ran-after").exists()  # a warning: the next command runs
    assert not alive(read_pid(tmp_path / "gc.pid"))
    assert group_members(read_pid(tmp_path / "leader.pid")) == []
    # Fail closed: a hanging guard blocks.
    with trio.fail_after(60):
        res = await hook(tmp_path, "sleep 1000", timeout=0.5, failure="block")
    assert res.blocked and "timed out after 0.5s" in res.reason


async def test_output_is_capped(tmp_path: Path) -> None:
    res = await hook(tmp_path, f"head -c {HOOK_OUTPUT_CAP + 100} /dev/zero | tr '\\0' x")
    assert res.ok
    assert res.context.startswith("x" * HOOK_OUTPUT_CAP)
    assert res.context.endswith("[hook preTool: 100 more bytes of output cut]")


async def test_a_cut_stderr_says_so(tmp_path: Path) -> None:
    """A block reason longer than the cap says how much of it was cut."""
    res = await hook(tmp_path, f"head -c {HOOK_OUTPUT_CAP + 7} /dev/zero | tr '\\0' e >&2; exit 2")
    assert res.blocked
    assert res.reason.startswith("e" * 100)
    assert res.reason.endswith("[7 more bytes of stderr cut]")


async def test_a_big_payload_and_a_hook_that_does_not_read_it(tmp_path: Path) -> None:
    with trio.fail_after(60):
        res = await hook(tmp_path, "true", payload={"prompt": "p" * 1_000_000})
    assert res.ok
    res = await hook(tmp_path, "wc -c", payload={"prompt": "p" * 1_000_000})
    assert int(res.context) > 1_000_000


async def test_no_commands() -> None:
    res = await run_hook("preTurn", [], {}, cwd="/", env=ENV)
    assert not res.blocked and res.ran == 0 and not res.ok and res.context == ""


async def test_cancel_while_a_hook_runs_leaves_no_process(tmp_path: Path) -> None:
    """``ctl stop`` during a preTool hook: the hook's whole group goes with the turn."""
    pidfile = tmp_path / "bg.pid"
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hook, tmp_path, "sleep 1000 & echo $$ $! > bg.pid; wait")
            await await_until(
                lambda: pidfile.exists() and len(pidfile.read_text().split()) == 2,
                "hook started",
                files=[pidfile],
            )
            nursery.cancel_scope.cancel()
    leader, bg = (int(x) for x in pidfile.read_text().split())
    assert not alive(bg)
    assert group_members(leader) == []
