"""build_runtime: shipped and user profiles resolved to a Runtime, with real prompt files
and commands."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from olliefs.agent.build import build_runtime
from olliefs.agent.profile import Profile, load_profile, profile_path
from olliefs.agent.prompt import PromptError
from olliefs.agent.shell import base_env
from olliefs.backend.base import GenerationParams
from olliefs.settings import shipped_dir

SHIPPED = shipped_dir()
ENV = {**base_env(), "OLLIE_SESSION_ID": "s1"}


async def test_coding_profile(tmp_path: Path) -> None:
    user_prompts = tmp_path / "prompts"
    user_prompts.mkdir()
    dirs = [tmp_path / "agents", SHIPPED / "profiles"]
    profile = load_profile("coding", dirs)
    rt = await build_runtime(
        profile,
        name="coding",
        cwd=str(tmp_path),
        env=ENV,
        profile_dir=profile_path("coding", dirs).parent,
        prompt_dirs=[user_prompts, SHIPPED / "prompts"],
    )
    assert rt.prompt == (SHIPPED / "prompts" / "coding.md").read_text()
    assert "PLAN:" in rt.prompt
    assert rt.system_prompt is None and rt.user_prompts == []
    assert rt.tools[0] == "client_9p" and "file_edit" in rt.tools
    assert "reasoning_think" in rt.auto_load
    assert rt.permits("file_grep") and not rt.permits("web_fetch")
    assert rt.max_steps == 100
    assert rt.backend is None and rt.model is None
    assert rt.hooks == {} and rt.hook_failure == "warn" and rt.hook_timeout == 60
    assert rt.text_tool_calls is None  # the backend's default
    # The user's prompt file of the same name wins.
    (user_prompts / "coding.md").write_text("my own coding rules")
    rt = await build_runtime(
        profile,
        name="coding",
        cwd=str(tmp_path),
        env=ENV,
        profile_dir=SHIPPED / "profiles",
        prompt_dirs=[user_prompts, SHIPPED / "prompts"],
    )
    assert rt.prompt == "my own coding rules"


async def test_default_profile() -> None:
    rt = await build_runtime(
        load_profile("default", [SHIPPED / "profiles"]), name="default", cwd="/", env=ENV
    )
    assert rt.tools == ["client_9p"] and rt.auto_load == [] and rt.allow_tools is None
    assert rt.permits("anything") and rt.prompt == "" and rt.max_steps is None
    assert rt.params == GenerationParams()


async def test_every_key_reaches_the_runtime(tmp_path: Path) -> None:
    (tmp_path / "sys.md").write_text("system from a file\n")
    profile = msgspec.json.decode(
        b"""{
        "description": "all keys",
        "systemPrompt": "./sys.md",
        "prompt": ["echo first", "echo $OLLIE_SESSION_ID"],
        "userPrompts": ["Summarize $OLLIE_SESSION_ID", ["echo from a command"], ["true"]],
        "backend": "openai", "model": "gpt-4o", "compactionModel": "gpt-4o-mini",
        "tools": ["client_9p", "file_read"], "autoLoad": ["file_read", "file_grep"],
        "allowTools": ["client_9p", "file_*"], "maxSteps": 12,
        "maxTokens": 500, "temperature": 0.5, "frequencyPenalty": 0.1, "presencePenalty": -0.1,
        "thinkingBudget": 4096,
        "hooks": {"preTool": "guard.sh", "postTurn": ["a", "b"], "turnError": []},
        "hookFailure": "block", "hookTimeout": 5, "textToolCalls": false
        }""",
        type=Profile,
    )
    rt = await build_runtime(profile, name="all", cwd=str(tmp_path), env=ENV, profile_dir=tmp_path)
    assert rt.name == "all" and rt.description == "all keys"
    assert rt.system_prompt == "system from a file\n"
    assert rt.prompt == "first\ns1\n"
    # userPrompts resolve in order; one that prints nothing is dropped (as an empty write).
    assert rt.user_prompts == ["Summarize s1", "from a command"]
    assert (rt.backend, rt.model, rt.compaction_model) == ("openai", "gpt-4o", "gpt-4o-mini")
    assert rt.tools == ["client_9p", "file_read"]
    assert rt.auto_load == ["file_grep"]  # file_read is loaded at start already
    assert rt.allow_tools == ("client_9p", "file_*")
    assert rt.max_steps == 12
    assert rt.params == GenerationParams(
        max_tokens=500, temperature=0.5, frequency_penalty=0.1, presence_penalty=-0.1
    )
    assert rt.thinking_budget == 4096
    assert rt.hooks == {"preTool": ["guard.sh"], "postTurn": ["a", "b"]}
    assert rt.hook_commands("turnError") == []
    assert (rt.hook_failure, rt.hook_timeout) == ("block", 5.0)
    assert rt.text_tool_calls is False
    assert rt.notes == []


async def test_a_failing_prompt_fails_the_build(tmp_path: Path) -> None:
    profile = Profile(prompt=["echo ok", "echo 'git: not a repository' >&2; exit 128"])
    with pytest.raises(PromptError, match=r"exit status 128.*not a repository"):
        await build_runtime(profile, name="x", cwd=str(tmp_path), env=ENV)
    with pytest.raises(PromptError, match="prompt file not found"):
        await build_runtime(
            Profile(system_prompt="./missing.md"), name="x", cwd="/", env=ENV, profile_dir=tmp_path
        )
