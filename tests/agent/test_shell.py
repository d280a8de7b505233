"""run_shell with real /bin/sh: output, caps, timeouts and process groups killed whole."""

from __future__ import annotations

import os
from pathlib import Path

import trio

from olliefs.agent.shell import base_env, group_members, run_shell
from olliefs.testing import await_until
from tests.agent.conftest import alive, ignores_sigterm, read_pid

ENV = base_env()


async def test_output_status_and_stdin(tmp_path: Path) -> None:
    res = await run_shell(
        "cat; echo err >&2; pwd; exit 3", cwd=str(tmp_path), env=ENV, stdin=b"in\n", timeout=30
    )
    assert res.status == 3 and not res.timed_out and not res.error
    assert res.stdout == f"in\n{tmp_path}\n".encode()
    assert res.stderr == b"err\n"


async def test_exact_environment() -> None:
    res = await run_shell("env", cwd="/", env={"ONLY": "this"}, timeout=30)
    lines = set(res.stdout.decode().splitlines())
    assert "ONLY=this" in lines
    assert not any(line.startswith("OLLIE_OPENAI_KEY") for line in lines)


def test_base_env_keeps_no_secrets() -> None:
    env = base_env(
        {"PATH": "/bin", "HOME": "/h", "LC_ALL": "C", "OLLIE_OPENAI_KEY": "sk", "X_API_KEY": "k"}
    )
    assert env == {"PATH": "/bin", "HOME": "/h", "LC_ALL": "C"}
    assert base_env({})["PATH"]


async def test_output_is_capped_but_read_to_the_end() -> None:
    res = await run_shell("head -c 300000 /dev/zero", cwd="/", env=ENV, timeout=30, cap=1000)
    assert res.status == 0
    assert len(res.stdout) == 1000 and res.stdout_cut == 299_000


async def test_cannot_start() -> None:
    res = await run_shell("true", cwd="/nonexistent/dir", env=ENV, timeout=30)
    assert res.status is None and "cannot run /bin/sh in /nonexistent/dir" in res.error


async def test_background_leftovers_die_when_the_shell_exits(tmp_path: Path) -> None:
    """The command ends with its shell: what it left in its group is killed, and the
    pipes it held do not keep us waiting."""
    with trio.fail_after(60):  # broken, this would wait for the sleep
        res = await run_shell(
            "sleep 1000 & echo $! > bg.pid; echo done", cwd=str(tmp_path), env=ENV, timeout=600
        )
    assert res.status == 0 and res.stdout == b"done\n" and not res.timed_out
    assert not alive(read_pid(tmp_path / "bg.pid"))
    assert res.pid is not None and group_members(res.pid) == []


async def test_timeout_kills_the_whole_group_even_a_child_ignoring_sigterm(
    tmp_path: Path,
) -> None:
    script = (
        "sh -c 'trap \"\" TERM; echo $$ > gc.pid; exec sleep 1000' & echo $$ > leader.pid; wait"
    )
    res = await run_shell(script, cwd=str(tmp_path), env=ENV, timeout=2.0, kill_grace=0.2)
    assert res.timed_out
    assert res.status is not None and res.status < 0  # ended by a signal
    grandchild = read_pid(tmp_path / "gc.pid")
    assert not alive(grandchild)
    assert res.pid == read_pid(tmp_path / "leader.pid")
    assert group_members(res.pid) == []


async def test_cancel_kills_the_whole_group(tmp_path: Path) -> None:
    """A cancelled run (ctl stop) cleans up the same way; the grandchild ignores SIGTERM and
    is not in the shell's foreground, so only the group SIGKILL can end it."""
    script = "sh -c 'trap \"\" TERM; echo $$ > gc.pid; exec sleep 1000' & wait"
    gc = tmp_path / "gc.pid"
    done = trio.Event()

    async def run(scope_box: list[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            scope_box.append(scope)
            await run_shell(script, cwd=str(tmp_path), env=ENV, timeout=600, kill_grace=0.2)
        done.set()

    box: list[trio.CancelScope] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, box)
            await await_until(
                lambda: gc.exists() and gc.read_text().strip(), "grandchild started", files=[gc]
            )
            pid = read_pid(gc)
            assert ignores_sigterm(pid)  # the trap comes before the pid is written
            pgid = os.getpgid(pid)
            box[0].cancel()
            await done.wait()
    assert not alive(pid)
    assert group_members(pgid) == []


async def test_many_commands_at_once_leave_nothing(tmp_path: Path) -> None:
    results = []

    async def one(i: int) -> None:
        results.append(
            await run_shell(f"sleep 1000 & echo {i}", cwd=str(tmp_path), env=ENV, timeout=60)
        )

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(one, i)
    assert sorted(int(r.stdout) for r in results) == list(range(20))
    for r in results:
        assert r.pid is not None and group_members(r.pid) == []
