"""Prompt dual mode with real files and real shell commands."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from olliefs.agent.prompt import (
    PromptError,
    expand_vars,
    prompt_file,
    resolve_prompt,
)
from olliefs.agent.shell import OUTPUT_CAP, base_env
from olliefs.errors import InvalidRequest

ENV = {**base_env(), "OLLIE_SESSION_ID": "s1", "PROJECT": "olliefs"}


async def resolve(value: str | list[str], cwd: Path, **kw: object) -> str:
    return await resolve_prompt(value, cwd=str(cwd), env=ENV, **kw)  # type: ignore[arg-type]


# ---- literal text --------------------------------------------------------------------


def test_variables() -> None:
    env = {"A": "1", "B_2": "two", "EMPTY": ""}
    assert expand_vars("$A ${B_2} [$EMPTY]", env) == "1 two []"
    assert expand_vars("costs $5, $$A is literal, $UNSET and ${UNSET} stay", env) == (
        "costs $5, $A is literal, $UNSET and ${UNSET} stay"
    )
    assert expand_vars("$A$B_2$", env) == "1two$"
    assert expand_vars("${A", env) == "${A"


async def test_literal_with_command_lines(tmp_path: Path) -> None:
    text = "\n".join(
        [
            "Session $OLLIE_SESSION_ID in ${PROJECT}.",
            "!pwd",
            "!printf 'a\\nb\\n\\n\\n'",
            "\\!not a command $PROJECT",
            "!",
            "  !indented is text",
            "!echo $PROJECT from the shell",
        ]
    )
    assert await resolve(text, tmp_path) == "\n".join(
        [
            "Session s1 in olliefs.",
            str(tmp_path),
            "a\nb",
            "!not a command olliefs",
            "!",
            "  !indented is text",
            "olliefs from the shell",
        ]
    )


async def test_plain_words_are_literal_text(tmp_path: Path) -> None:
    assert await resolve("Be concise.", tmp_path) == "Be concise."
    assert await resolve("", tmp_path) == ""
    assert await resolve("concise", tmp_path, search_dirs=[tmp_path]) == "concise"


# ---- commands ------------------------------------------------------------------------


async def test_array_concatenates_stdouts_in_order(tmp_path: Path) -> None:
    (tmp_path / "x.md").write_text("from a file\n")
    out = await resolve(["cat x.md", "printf 'no newline'", "true", "echo $PROJECT"], tmp_path)
    assert out == "from a file\nno newline\nolliefs\n"


async def test_a_failing_command_names_itself_and_its_stderr(tmp_path: Path) -> None:
    with pytest.raises(PromptError) as err:
        await resolve(["echo fine", "echo 'no such thing' >&2; exit 3"], tmp_path)
    assert str(err.value) == (
        "prompt command `echo 'no such thing' >&2; exit 3` failed (exit status 3): no such thing"
    )
    assert isinstance(err.value, InvalidRequest)
    with pytest.raises(PromptError, match=r"`false` failed \(exit status 1\) \(no stderr\)"):
        await resolve("text\n!false", tmp_path)
    with pytest.raises(PromptError, match=r"failed \(signal 9\)"):
        await resolve(["kill -9 $$"], tmp_path)


async def test_command_timeout(tmp_path: Path) -> None:
    with trio.fail_after(60), pytest.raises(PromptError, match=r"timed out after 0\.3s"):
        await resolve(["sleep 1000"], tmp_path, timeout=0.3)


async def test_command_output_limits(tmp_path: Path) -> None:
    with pytest.raises(PromptError, match=f"output larger than {OUTPUT_CAP} bytes"):
        await resolve([f"head -c {OUTPUT_CAP + 1} /dev/zero"], tmp_path)
    with pytest.raises(PromptError, match="output is not UTF-8"):
        await resolve(["printf '\\377'"], tmp_path)
    with pytest.raises(PromptError, match="prompt command is empty"):
        await resolve(["  "], tmp_path)


async def test_commands_in_a_missing_cwd(tmp_path: Path) -> None:
    with pytest.raises(PromptError, match="cannot run /bin/sh in"):
        await resolve(["true"], tmp_path / "gone")


# ---- files ---------------------------------------------------------------------------


async def test_files_by_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    profile_dir = tmp_path / "agents"
    (profile_dir / "sub").mkdir(parents=True)
    (profile_dir / "sub" / "p.md").write_text("relative $PROJECT\n!not run\n")
    (tmp_path / "abs.md").write_text("absolute")
    home = tmp_path / "home"
    home.mkdir()
    (home / "mine.md").write_text("from home")
    monkeypatch.setenv("HOME", str(home))
    # A file is used verbatim: no command runs, no variable is expanded.
    assert await resolve("./sub/p.md", tmp_path, base_dir=profile_dir) == (
        "relative $PROJECT\n!not run\n"
    )
    assert await resolve(f"  {tmp_path}/abs.md\n", tmp_path) == "absolute"
    assert await resolve("~/mine.md", tmp_path) == "from home"
    assert await resolve("../abs.md", tmp_path, base_dir=profile_dir) == "absolute"


async def test_a_path_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(PromptError, match=r"prompt file not found: ./nope.md \("):
        await resolve("./nope.md", tmp_path, base_dir=tmp_path)
    with pytest.raises(PromptError, match=r"prompt file not found: /nonexistent/x\.md"):
        await resolve("/nonexistent/x.md", tmp_path)
    with pytest.raises(PromptError, match="relative to no profile directory"):
        await resolve("./x.md", tmp_path)
    with pytest.raises(PromptError, match="not found"):
        await resolve(str(tmp_path), tmp_path)  # a directory is not a prompt file


async def test_bare_names_search_the_dirs_in_order(tmp_path: Path) -> None:
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    for d in (user, shipped):
        (d / "team").mkdir(parents=True)
    (shipped / "coding.md").write_text("shipped")
    (shipped / "team" / "review.md").write_text("shipped review")
    (shipped / "only.md").write_text("only shipped")
    (user / "coding.md").write_text("user's own")
    dirs = [user, shipped]
    assert await resolve("coding.md", tmp_path, search_dirs=dirs) == "user's own"
    assert await resolve("only.md", tmp_path, search_dirs=dirs) == "only shipped"
    assert await resolve("team/review.md", tmp_path, search_dirs=dirs) == "shipped review"
    # Not found: literal text (a one-word prompt), not an error.
    assert await resolve("missing.md", tmp_path, search_dirs=dirs) == "missing.md"
    # No climbing out of the search dirs.
    (tmp_path / "secret.md").write_text("secret")
    assert prompt_file("team/../../secret.md", base_dir=None, search_dirs=dirs) is None


async def test_bad_prompt_files(tmp_path: Path) -> None:
    (tmp_path / "bin.md").write_bytes(b"\xff\xfe")
    with pytest.raises(PromptError, match="not UTF-8 text"):
        await resolve("./bin.md", tmp_path, base_dir=tmp_path)
    unreadable = tmp_path / "locked.md"
    unreadable.write_text("x")
    unreadable.chmod(0)
    if os.geteuid() != 0:  # root reads it anyway
        with pytest.raises(PromptError, match="Permission denied"):
            await resolve("./locked.md", tmp_path, base_dir=tmp_path)
