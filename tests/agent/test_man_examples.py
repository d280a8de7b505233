"""The examples of ollie-agent(5) work: every JSON example is a valid profile, and the
guard hooks and the hook script do what the page says."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec

from olliefs.agent.hooks import hook_payload, run_hook
from olliefs.agent.loop import switch_directives
from olliefs.agent.profile import Profile, Status, check_complete
from olliefs.agent.shell import base_env

MAN = Path(__file__).resolve().parents[2] / "man" / "ollie-agent.5"


def examples() -> list[str]:
    """The .EX/.EE blocks of the page, roff escapes undone (as a reader copies them)."""
    text = MAN.read_text()
    blocks = re.findall(r"^\.EX\n(.*?)^\.EE$", text, re.M | re.S)
    unescape = {r"\-": "-", r"\(aq": "'", r"\(dq": '"', r"\e": "\\", r"\&": ""}
    out = []
    for block in blocks:
        for roff, plain in unescape.items():
            block = block.replace(roff, plain)
        out.append(block)
    return out


def profile_examples() -> list[Profile]:
    found = []
    for block in examples():
        if block.startswith("{"):
            v = check_complete(block.encode())
            assert v.status is Status.VALID, (v.reason, block)
            assert v.profile is not None
            found.append(v.profile)
    return found


def test_every_json_example_is_a_valid_profile() -> None:
    assert len(profile_examples()) == 4
    # The fragment that shows the hooks key is valid inside an object.
    fragment = next(b for b in examples() if b.startswith('"hooks"'))
    assert msgspec.json.decode(("{" + fragment + "}").encode(), type=Profile).hooks


def payload(cwd: Path, **fields: object) -> dict[str, object]:
    return hook_payload(
        "preTool", session_id="s1", agent="guarded", cwd=str(cwd), backend="b", model="m", **fields
    )


async def test_the_guard_example_blocks_rm_rf(tmp_path: Path) -> None:
    guarded = profile_examples()[2]
    env = base_env()
    cmds = guarded.hook_commands("preTool")
    bad = payload(tmp_path, tool="execute_code", args={"code": "rm -rf /tmp/x"})
    res = await run_hook("preTool", cmds, bad, cwd=str(tmp_path), env=env, failure="block")
    assert res.blocked and res.reason == "rm -rf is not allowed"
    fine = payload(tmp_path, tool="execute_code", args={"code": "ls"})
    res = await run_hook("preTool", cmds, fine, cwd=str(tmp_path), env=env, failure="block")
    assert not res.blocked and res.ok
    # preTurn outside a git repository: nothing to add, no failure.
    res = await run_hook(
        "preTurn",
        guarded.hook_commands("preTurn"),
        payload(tmp_path, prompt="hi"),
        cwd=str(tmp_path),
        env=env,
        failure="block",
    )
    assert res.ok and res.context == ""
    # postTool after another tool than file_edit: nothing runs.
    res = await run_hook(
        "postTool",
        guarded.hook_commands("postTool"),
        payload(tmp_path, tool="file_read", args={}, result="x", is_error=False),
        cwd=str(tmp_path),
        env=env,
        failure="block",
    )
    assert res.ok


async def test_the_logging_hook_script(tmp_path: Path) -> None:
    script = next(b for b in examples() if b.startswith("#!/bin/sh"))
    path = tmp_path / "ollie-log"
    path.write_text(script)
    path.chmod(0o755)
    env = {**base_env(), "HOME": str(tmp_path)}
    res = await run_hook(
        "preTool", [str(path)], payload(tmp_path, tool="t"), cwd=str(tmp_path), env=env
    )
    assert res.ok and not res.warnings
    line = (tmp_path / "ollie-events.log").read_text()
    assert re.fullmatch(r"\d\d:\d\d:\d\d s1 preTool: \{.*\}\n", line)
    assert json.loads(line.split(": ", 1)[1])["tool"] == "t"


async def test_the_fallback_example_switches_only_away_from_the_main_model(
    tmp_path: Path,
) -> None:
    fallback = profile_examples()[3]
    cmds = fallback.hook_commands("turnError")
    for model, ok, switch in (("gpt-4o", True, {"model": "gpt-4o-mini"}), ("other", False, {})):
        p = hook_payload(
            "turnError", session_id="s1", agent="f", cwd=str(tmp_path), backend="openai",
            model=model, error="openai: HTTP 503", error_type="transient", attempt=0,
        )  # fmt: skip
        res = await run_hook("turnError", cmds, p, cwd=str(tmp_path), env=base_env())
        assert res.ok is ok and switch_directives(res.context) == (switch, ""), model
