"""The profile schema, the write-time verdicts (SPEC 3.7) and where profiles are found."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from olliefs.agent.hooks import EVENTS
from olliefs.agent.profile import (
    KEYS,
    MAX_PROFILE_BYTES,
    Profile,
    ProfileChecker,
    ProfileError,
    Status,
    check_complete,
    check_partial,
    load_profile,
    permits,
    profile_names,
    profile_path,
)
from olliefs.errors import InvalidRequest
from olliefs.settings import shipped_dir

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "agents" / "profiles"


def verdict(doc: Any) -> Status:
    return check_partial(json.dumps(doc).encode()).status


# ---- the shipped profiles ------------------------------------------------------------


@pytest.mark.parametrize("name", ["default", "coding"])
def test_shipped_profiles_are_valid(name: str) -> None:
    data = (SHIPPED / f"{name}.json").read_bytes()
    v = check_complete(data)
    assert v.status is Status.VALID, v.reason
    # Every prefix of it is a write in progress, never refused.
    checker = ProfileChecker()
    for i in range(len(data)):
        assert checker.feed(data[i : i + 1]).status is not Status.INVALID, data[: i + 1]
    assert checker.close().status is Status.VALID


def test_shipped_profiles_are_installed_as_package_data() -> None:
    installed = shipped_dir() / "profiles"
    assert {"default", "coding"} <= set(profile_names([installed]))
    assert (shipped_dir() / "prompts" / "coding.md").is_file()


def test_default_starts_with_client_9p_only() -> None:
    p = load_profile("default", [SHIPPED])
    assert p.start_tools() == ["client_9p"]
    assert p.allow_tools is None and p.auto_load is None


def test_coding_profile_is_a_coding_agent() -> None:
    p = load_profile("coding", [SHIPPED])
    assert {"file_read", "file_edit", "file_write", "execute_code"} <= set(p.start_tools())
    assert p.max_steps is not None and p.max_steps > 0
    assert p.allow_tools is not None
    assert not p.permits("some_network_tool")
    assert p.prompt == "coding.md"  # resolved from the shipped prompts/ dir


# ---- the schema ----------------------------------------------------------------------


def test_every_key_round_trips() -> None:
    doc = {
        "description": "d",
        "prompt": ["echo hi", "cat x.md"],
        "systemPrompt": "You are terse.",
        "userPrompts": ["first", ["git status"]],
        "backend": "openai",
        "model": "gpt-4o-mini",
        "tools": ["client_9p", "file_read"],
        "autoLoad": ["file_grep"],
        "allowTools": ["client_9p", "file_*"],
        "maxSteps": 7,
        "compactionModel": "gpt-4o-mini",
        "maxTokens": 1000,
        "temperature": 0.2,
        "frequencyPenalty": -1.5,
        "presencePenalty": 2,
        "thinkingBudget": 2048,
        "hooks": {"preTool": "true", "postTurn": ["a", "b"]},
        "hookFailure": "block",
        "hookTimeout": 2.5,
        "textToolCalls": False,
        "edits": "review",
        "checkpointLimit": 1 << 30,
        "toolsrv": "ssh:me@build:/src",
    }
    assert sorted(doc) == sorted(KEYS)
    v = check_complete(json.dumps(doc).encode())
    assert v.status is Status.VALID, v.reason
    assert v.profile is not None
    assert msgspec.to_builtins(v.profile) == doc
    assert v.profile.hook_commands("preTool") == ["true"]
    assert v.profile.hook_commands("postTurn") == ["a", "b"]
    assert v.profile.hook_commands("turnError") == []
    assert v.profile.user_prompt_values() == ["first", ["git status"]]


def test_empty_object_is_a_valid_profile_with_defaults() -> None:
    v = check_complete(b"{}")
    assert v.profile == Profile()
    assert v.profile.hook_failure == "warn" and v.profile.hook_timeout == 60
    assert v.profile.start_tools() == ["client_9p"]


@pytest.mark.parametrize(
    ("doc", "reason"),
    [
        ({"promt": "x"}, "unknown key `promt` (keys: description prompt"),
        ({"prompt": 1}, "prompt: Expected `str | array | null`, got `int`"),
        ({"prompt": ["ls", " "]}, "prompt: empty command"),
        ({"userPrompts": [""]}, "userPrompts[0]: empty prompt"),
        ({"userPrompts": [[]]}, "userPrompts[0]: empty list of commands"),
        ({"maxSteps": 0}, "maxSteps: Expected `int` >= 1"),
        ({"maxSteps": 1.5}, "maxSteps: Expected `int | null`, got `float`"),
        ({"temperature": 3}, "temperature: Expected `float` <= 2.0"),
        ({"maxTokens": -1}, "maxTokens: Expected `int` >= 1"),
        ({"thinkingBudget": "lots"}, "thinkingBudget: Expected `int | null`, got `str`"),
        ({"hookFailure": "ignore"}, "hookFailure: Invalid enum value 'ignore'"),
        ({"hookTimeout": 0}, "hookTimeout: Expected `float` > 0"),
        ({"hooks": {"onStart": "x"}}, "hooks: unknown event 'onStart' (events: agentSpawn"),
        ({"hooks": {"preTool": ""}}, "hooks.preTool: empty command"),
        ({"hooks": {"preTool": [1]}}, "hooks[...][0]: Expected `str`, got `int`"),
        ({"hooks": ["x"]}, "hooks: Expected `object`, got `array`"),
        ({"tools": "file_read"}, "tools: Expected `array | null`, got `str`"),
        ({"tools": ["File Read"]}, "tools: not a tool name: 'File Read'"),
        ({"tools": ["file_read", "file_read"]}, "tools: a tool is listed twice"),
        ({"allowTools": ["../x"]}, "allowTools: not a tool name or glob"),
        ({"tools": ["execute_code"], "allowTools": ["file_*"]}, "tools: execute_code is not"),
        ({"allowTools": ["file_*"]}, "tools: client_9p is not permitted"),  # the default
        ({"autoLoad": ["x"], "allowTools": ["client_9p"]}, "autoLoad: x is not permitted"),
        ({"backend": "my backend"}, "backend: not a valid name"),
        ({"model": "a\nb"}, "model: not a valid name"),
        ({"compactionModel": ""}, "compactionModel: not a valid name"),
        ({"description": None}, "description: Expected `str`, got `null`"),
        ({"textToolCalls": "no"}, "textToolCalls: Expected `bool | null`, got `str`"),
        ({"textToolCalls": 0}, "textToolCalls: Expected `bool | null`, got `int`"),
    ],
)
def test_wrong_keys_and_types_are_refused_with_a_reason(doc: Any, reason: str) -> None:
    v = check_complete(json.dumps(doc).encode())
    assert v.status is Status.INVALID
    assert v.reason.startswith(reason), v.reason


def test_allow_tools_globs() -> None:
    assert permits(None, "anything")
    assert not permits([], "client_9p")
    assert permits(["file_*", "client_9p"], "file_grep")
    assert not permits(["file_*"], "xfile_grep")
    assert permits(["file_[rw]*"], "file_write") and not permits(["file_[rw]*"], "file_edit")
    assert permits(["?xecute_code"], "execute_code")
    # An explicit empty tools list is fine with an empty allowTools: an agent with no tools.
    assert verdict({"tools": [], "allowTools": []}) is Status.VALID


# ---- verdicts on data written so far -------------------------------------------------


@pytest.mark.parametrize(
    ("data", "status", "reason"),
    [
        (b"", Status.INCOMPLETE, "empty document"),
        (b"  \n", Status.INCOMPLETE, "empty document"),
        (b'{"tools": ["file_read", ', Status.INCOMPLETE, "document ends expecting a value; 2"),
        # keys are judged once the document is complete
        (b'{"promt', Status.INCOMPLETE, "document ends inside a string"),
        (b'{"tools": ]', Status.INVALID, "JSON syntax error: line 1 column 11"),
        (b'{"a": 1,}', Status.INVALID, "JSON syntax error: line 1 column 9: expected a key"),
        (b"[", Status.INVALID, "a profile must be a JSON object"),
        (b'  "prompt"', Status.INVALID, "a profile must be a JSON object"),
        (b"{} {", Status.INVALID, "JSON syntax error: line 1 column 4: unexpected '{'"),
        (b'{"prompt": "\xff"}', Status.INVALID, "JSON syntax error: line 1 column 13: invalid UTF"),
        (b'{"prompt": "\\ud800"}', Status.INVALID, "JSON syntax error: line 1 column 19: a high"),
        (b'{"maxSteps": 5}\n', Status.VALID, ""),
    ],
)
def test_partial_verdicts(data: bytes, status: Status, reason: str) -> None:
    v = check_partial(data)
    assert v.status is status, v
    assert v.reason.startswith(reason), v.reason


def test_incomplete_at_close_is_invalid() -> None:
    v = check_complete(b'{"prompt": "hel')
    assert v.status is Status.INVALID
    assert v.reason.startswith("incomplete JSON at close: document ends inside a string")
    assert check_complete(b"").reason == "incomplete JSON at close: empty document"
    checker = ProfileChecker()
    checker.feed(b'{"tools": [')
    assert checker.close().status is Status.INVALID


def test_too_large_is_refused() -> None:
    big = b'{"prompt": "' + b"x" * MAX_PROFILE_BYTES + b'"}'
    assert check_partial(big).reason.startswith("larger than")
    checker = ProfileChecker()
    checker.feed(big[: MAX_PROFILE_BYTES // 2])
    assert checker.feed(big[MAX_PROFILE_BYTES // 2 :]).status is Status.INVALID


def test_checker_stays_invalid_and_keeps_a_valid_verdict_through_whitespace() -> None:
    c = ProfileChecker()
    assert c.feed(b'{"maxSteps": 3}').status is Status.VALID
    assert c.feed(b"\n\n").status is Status.VALID
    assert c.feed(b"x").status is Status.INVALID
    assert c.feed(b"").status is Status.INVALID
    assert c.close().status is Status.INVALID


# Valid profiles drawn at random: every prefix is let through, the whole is VALID.
names = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True)
commands = st.text(min_size=1, max_size=10).filter(str.strip)
prompts = st.one_of(st.text(max_size=30), st.lists(commands, max_size=3))
profiles = st.fixed_dictionaries(
    {},
    optional={
        "description": st.text(max_size=20),
        "prompt": prompts,
        "systemPrompt": prompts,
        "userPrompts": st.lists(st.text(min_size=1, max_size=10).filter(str.strip), max_size=2),
        "model": st.from_regex(r"[a-z0-9/:.-]{1,12}", fullmatch=True),
        "tools": st.lists(names, max_size=3, unique=True),
        "maxSteps": st.integers(1, 1000),
        "temperature": st.floats(0, 2),
        "hooks": st.dictionaries(st.sampled_from(EVENTS), st.text(min_size=1).filter(str.strip)),
        "hookFailure": st.sampled_from(["warn", "block"]),
        "hookTimeout": st.floats(0.001, 3600),
        "textToolCalls": st.booleans(),
    },
)


@given(profiles, st.sampled_from([None, 2]), st.data())
@settings(deadline=None, max_examples=150)
def test_random_valid_profiles_are_never_refused_midway(
    doc: dict[str, Any], indent: int | None, data: st.DataObject
) -> None:
    raw = json.dumps(doc, indent=indent, ensure_ascii=data.draw(st.booleans())).encode()
    checker = ProfileChecker()
    pos = 0
    while pos < len(raw):
        step = data.draw(st.integers(1, 16))
        v = checker.feed(raw[pos : pos + step])
        pos += step
        assert v.status is not Status.INVALID, (raw[:pos], v.reason)
        assert v.status == check_partial(raw[:pos]).status
    assert checker.close().status is Status.VALID


# ---- where profiles are found --------------------------------------------------------


def test_user_profile_wins_by_name(tmp_path: Path) -> None:
    user = tmp_path / "agents"
    user.mkdir()
    (user / "coding.json").write_text('{"maxSteps": 3}')
    (user / "mine.json").write_text("{}")
    dirs = [user, SHIPPED]
    assert load_profile("coding", dirs).max_steps == 3
    assert load_profile("default", dirs).start_tools() == ["client_9p"]
    assert profile_path("coding", dirs) == user / "coding.json"
    assert {"coding", "default", "mine"} <= set(profile_names(dirs))


def test_a_broken_user_profile_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    (tmp_path / "coding.json").write_text('{"maxSteps": "many"}')
    with pytest.raises(ProfileError) as err:
        load_profile("coding", [tmp_path, SHIPPED])
    msg = str(err.value)
    assert msg.startswith(f"profile coding ({tmp_path / 'coding.json'}): maxSteps: Expected")
    assert isinstance(err.value, InvalidRequest)  # EINVAL for a frontend


def test_unknown_and_bad_names(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match=r"unknown agent profile: nope \(known: .*coding"):
        load_profile("nope", [tmp_path, SHIPPED])
    for bad in ("../default", ".hidden", "", "a/b", "x" * 65):
        with pytest.raises(ProfileError, match="not a valid profile name"):
            load_profile(bad, [SHIPPED])


def test_unreadable_profile(tmp_path: Path) -> None:
    (tmp_path / "dir.json").mkdir()  # not a file: skipped as if absent
    with pytest.raises(ProfileError, match="unknown agent profile: dir"):
        load_profile("dir", [tmp_path])
    (tmp_path / "trunc.json").write_text('{"tools": [')
    with pytest.raises(ProfileError, match="incomplete JSON at close"):
        load_profile("trunc", [tmp_path])


# ---- the man page documents every key and event ----------------------------------------


def test_man_page_documents_every_key_and_event() -> None:
    man = (ROOT / "man" / "ollie-agent.5").read_text()
    for key in KEYS:
        assert re.search(rf"^\.TP\n\.B {key}\b", man, re.M), f"key {key} not documented"
    for event in EVENTS:
        assert re.search(rf"^\.B {event}\b", man, re.M), f"event {event} not documented"
