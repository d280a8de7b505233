"""Prompt values of a profile, resolved to text (the seed's "Prompt Type").

A prompt value (``prompt``, ``systemPrompt``, each of ``userPrompts``) is one of:

* **a JSON array**: shell commands, run in order in the session's cwd; their standard
  outputs, each ending with a newline (one is added where missing), concatenated. The
  composable form: ``["cat ~/prompts/base.md", "git log --oneline -5"]``.
* **a JSON string naming a file**: the string, without surrounding whitespace, holds no
  whitespace, and either starts with ``/``, ``~``, ``./`` or ``../`` (a path: absolute,
  home-relative, or relative to the directory of the profile file; it must exist), or is a
  bare relative name (``coding.md``, ``team/review.md``) found in one of the search
  directories: the profile's directory, then the user's ``prompts/``, then the shipped
  ``prompts/`` (the user's file wins by name, as everywhere in olliefs). The value is the
  file's text, **verbatim**: a file is data, so a Markdown image line ``![x](y)`` in it
  never runs anything, and ``$HOME`` in a code sample stays as written.
* **any other JSON string**: literal text, line by line:

  - a line whose first character is ``!`` is replaced by the standard output of the rest
    of the line run as a shell command, trailing newlines removed (as ``$(...)`` does);
    ``\\!`` at the start of a line stands for a literal ``!``; a line that is just ``!``
    stays as it is;
  - in every other line ``$NAME`` and ``${NAME}`` are replaced by the variable's value
    from the environment the commands also get; ``$$`` is a literal ``$``. A name that is
    not set is **left as written** (``$FOO`` stays ``$FOO``), so prices and shell snippets
    in a prompt survive; the shell expands variables of ``!`` lines itself.

Commands run through `shell.run_shell` (own process group, killed whole on timeout,
output capped). A command that exits non-zero, times out, prints more than the cap or
prints invalid UTF-8 fails the whole resolution with a `PromptError` that names the
command and quotes its stderr: a prompt silently missing a part is worse than an agent
that says why it cannot start.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from olliefs.agent.shell import OUTPUT_CAP, run_shell
from olliefs.errors import InvalidRequest

PROMPT_TIMEOUT = 30.0
"""Seconds one prompt command may run."""
FILE_CAP = 1024 * 1024
"""Largest prompt file read (bytes)."""

PromptValue = str | Sequence[str]

_VAR = re.compile(r"\$(?:\$|\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_PATH_PREFIXES = ("/", "~", "./", "../")


class PromptError(InvalidRequest):
    """A prompt could not be resolved: missing file, failing command, ..."""


async def resolve_prompt(
    value: PromptValue,
    *,
    cwd: str,
    env: Mapping[str, str],
    base_dir: Path | None = None,
    search_dirs: Sequence[Path] = (),
    timeout: float = PROMPT_TIMEOUT,
) -> str:
    """The text of a prompt value (see the module doc).

    ``cwd``: where commands run. ``env``: their exact environment, also the variables of
    ``$NAME`` expansion. ``base_dir``: the profile file's directory (``./x`` and ``../x``
    are relative to it; without one they are refused). ``search_dirs``: where bare file
    names are looked up, in order (usually base_dir, the user's prompts/, the shipped
    prompts/). Raises PromptError.
    """
    if not isinstance(value, str):
        parts = []
        for cmd in value:
            out = await run_command(cmd, cwd=cwd, env=env, timeout=timeout)
            parts.append(out if out.endswith("\n") or not out else out + "\n")
        return "".join(parts)
    path = prompt_file(value, base_dir=base_dir, search_dirs=search_dirs)
    if path is not None:
        return read_prompt_file(path)
    return await expand_text(value, cwd=cwd, env=env, timeout=timeout)


def prompt_file(value: str, *, base_dir: Path | None, search_dirs: Sequence[Path]) -> Path | None:
    """The file a string prompt names, or None when the string is literal text.

    Raises PromptError for a string that is a path (``/``, ``~``, ``./``, ``../``) of a
    file that does not exist: that is a typo, not a one-word prompt.
    """
    name = value.strip()
    if not name or any(c.isspace() for c in name) or name.startswith(("!", "\\!")):
        return None
    if name.startswith(_PATH_PREFIXES):
        if name.startswith("~"):
            path = Path(os.path.expanduser(name))
            if not path.is_absolute():
                raise PromptError(f"prompt file: cannot expand {name}")
        elif name.startswith("/"):
            path = Path(name)
        elif base_dir is None:
            raise PromptError(f"prompt file {name}: relative to no profile directory")
        else:
            path = base_dir / name
        if not path.is_file():
            raise PromptError(f"prompt file not found: {name} ({path})")
        return path
    if "$" in name or ".." in Path(name).parts:
        return None
    for d in search_dirs:
        if (d / name).is_file():
            return d / name
    return None


def read_prompt_file(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(FILE_CAP + 1)
    except OSError as err:
        raise PromptError(f"prompt file {path}: {err.strerror or err}") from None
    if len(data) > FILE_CAP:
        raise PromptError(f"prompt file {path}: larger than {FILE_CAP} bytes")
    try:
        return data.decode()
    except UnicodeDecodeError as err:
        raise PromptError(f"prompt file {path}: not UTF-8 text ({err.reason})") from None


async def expand_text(
    text: str, *, cwd: str, env: Mapping[str, str], timeout: float = PROMPT_TIMEOUT
) -> str:
    """Literal prompt text: ``!command`` lines run, ``$NAME`` expanded (module doc)."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("!") and line.strip() != "!":
            lines[i] = (await run_command(line[1:], cwd=cwd, env=env, timeout=timeout)).rstrip("\n")
        elif line.startswith("\\!"):
            lines[i] = expand_vars(line[1:], env)
        else:
            lines[i] = expand_vars(line, env)
    return "\n".join(lines)


def expand_vars(text: str, env: Mapping[str, str]) -> str:
    """``$NAME`` / ``${NAME}`` from ``env``; ``$$`` is ``$``; unknown names stay as written."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name is None:
            return "$"
        value = env.get(name)
        return m.group(0) if value is None else value

    return _VAR.sub(sub, text)


async def run_command(
    command: str, *, cwd: str, env: Mapping[str, str], timeout: float = PROMPT_TIMEOUT
) -> str:
    """A prompt command's stdout as text; PromptError unless it exits 0 cleanly."""
    shown = command.strip()
    if not shown:
        raise PromptError("prompt command is empty")
    res = await run_shell(command, cwd=cwd, env=env, timeout=timeout, cap=OUTPUT_CAP)
    if res.error:
        raise PromptError(f"prompt command `{shown}`: {res.error}")
    stderr = res.stderr_text()
    why = f": {stderr}" if stderr else " (no stderr)"
    if res.timed_out:
        raise PromptError(f"prompt command `{shown}` timed out after {timeout:g}s{why}")
    if res.status != 0:
        assert res.status is not None
        how = f"exit status {res.status}" if res.status > 0 else f"signal {-res.status}"
        raise PromptError(f"prompt command `{shown}` failed ({how}){why}")
    if res.stdout_cut:
        raise PromptError(f"prompt command `{shown}`: output larger than {OUTPUT_CAP} bytes")
    try:
        return res.stdout.decode()
    except UnicodeDecodeError as err:
        raise PromptError(f"prompt command `{shown}`: output is not UTF-8 ({err.reason})") from None
