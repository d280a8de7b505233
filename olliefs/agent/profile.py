"""Agent profiles: the ``a/<name>.json`` format, its validation, and where profiles live.

A profile is one JSON object; `Profile` is its schema as a msgspec Struct, with the
on-disk camelCase keys and ``forbid_unknown_fields``, so a typo is an error and not a
silently ignored key. Every constraint lives in a type or in ``__post_init__``, so one
decode both parses and validates. ollie-agent(5) documents each key; in short:

=================  ==============================================================
prompt             the agent's instructions, added to olliefs' system preamble
systemPrompt       replaces the built-in part of the preamble (identity, cwd, how to load
                   tools); ``prompt`` still follows it
userPrompts        prompts submitted, in order, when the agent starts (new session or
                   ``ctl agent``), as if written to ``prompt``
backend, model     switched to when the agent starts; absent: the session keeps its own
tools              loaded at start (default ``["client_9p"]``)
autoLoad           loaded at start too, after ``tools``: where ``tools`` replaces the
                   default, ``autoLoad`` adds to it
allowTools         names or shell-style globs: the only tools this agent may load or call
                   (absent: all). ``tools`` and ``autoLoad`` must lie inside it
maxSteps           tool rounds per turn before the final summary turn
compactionModel    model (same backend) that writes compaction summaries
maxTokens ...      generation parameters: maxTokens temperature frequencyPenalty
                   presencePenalty thinkingBudget
toolsrv            where the tools run: ``local`` or ``ssh:[user@]host[:dir]``
hooks              event -> command or list of commands (see `hooks`)
hookFailure        "warn" (default) or "block": a crashing or hanging hook blocks
hookTimeout        seconds per hook command (default 60)
textToolCalls      false: tool calls and <think> written in a reply's text stay text
                   (default: read, on the OpenAI-compatible and Ollama backends)
description        one line saying what the agent is for
=================  ==============================================================

**Validation of writes** (SPEC 3.7): `check_partial` judges the bytes written so far:
VALID (a complete document that fits the schema), INCOMPLETE (could still become valid:
the JSON is unfinished), or INVALID (certainly not: a syntax error before the end of the
data, a top level that is not an object, or a complete document with a wrong key or
type). `check_complete` is the same at close, where INCOMPLETE is INVALID too.
`ProfileChecker` does the same incrementally, for a handle written sequentially in many
small writes (one pass over the data instead of one per write).

**Where profiles live**: the user's config ``agents/`` first, then the shipped
``profiles/``; the user's file wins by name and nothing is copied (SPEC 2). `load_profile`
takes the directories in that order.
"""

from __future__ import annotations

import enum
import fnmatch
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Final, Literal

import msgspec

from olliefs.agent.config import MaxTokens, Penalty, Temperature
from olliefs.agent.hooks import EVENTS, HOOK_TIMEOUT, HookFailure
from olliefs.agent.jsonscan import JsonScanner
from olliefs.errors import InvalidRequest
from olliefs.toolclient.remote import parse_toolsrv

MAX_PROFILE_BYTES = 1024 * 1024
DEFAULT_TOOLS: Final[tuple[str, ...]] = ("client_9p",)

# Tool names as toolsrv's registry accepts them; an allowTools entry may also hold globs.
_TOOL_NAME = re.compile(r"[a-z][a-z0-9_]*")
_TOOL_GLOB = re.compile(r"[a-z0-9_*?\[\]!-]+")
_PROFILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_BACKEND_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

MaxSteps = Annotated[int, msgspec.Meta(ge=1, le=100_000)]
ThinkingBudget = Annotated[int, msgspec.Meta(ge=0, le=10_000_000)]
HookTimeout = Annotated[float, msgspec.Meta(gt=0, le=3600)]
CheckpointLimit = Annotated[int, msgspec.Meta(ge=0)]
Prompt = str | list[str]
"""A prompt value: literal text / a file name (string), or shell commands (array)."""


class ProfileError(InvalidRequest):
    """A profile that cannot be found, read, parsed or built (EINVAL)."""


class Profile(
    msgspec.Struct, frozen=True, kw_only=True, rename="camel", forbid_unknown_fields=True
):
    description: str = ""
    prompt: Prompt | None = None
    system_prompt: Prompt | None = None
    user_prompts: str | list[Prompt] | None = None
    backend: str | None = None
    model: str | None = None
    tools: list[str] | None = None
    auto_load: list[str] | None = None
    allow_tools: list[str] | None = None
    max_steps: MaxSteps | None = None
    compaction_model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    thinking_budget: ThinkingBudget | None = None
    hooks: dict[str, str | list[str]] = msgspec.field(default_factory=dict)
    hook_failure: HookFailure = "warn"
    hook_timeout: HookTimeout = HOOK_TIMEOUT
    text_tool_calls: bool | None = None
    edits: Literal["direct", "review"] | None = None  # checkpoints: cfg edits
    checkpoint_limit: CheckpointLimit | None = None  # bytes of pre-images kept
    toolsrv: str | None = None

    def __post_init__(self) -> None:
        # msgspec turns a ValueError here into a ValidationError, so these checks report
        # exactly like a wrong type does.
        _check_prompt("prompt", self.prompt)
        _check_prompt("systemPrompt", self.system_prompt)
        for i, p in enumerate(self.user_prompt_values()):
            _check_prompt(f"userPrompts[{i}]", p, allow_empty=False)
        for key in ("backend", "model", "compaction_model"):
            value = getattr(self, key)
            if value is not None and not _word(value, key == "backend"):
                outside = "compactionModel" if key == "compaction_model" else key
                raise ValueError(f"{outside}: not a valid name: {value!r}")
        for key, names in (("tools", self.tools), ("autoLoad", self.auto_load)):
            for n in names or ():
                if not _TOOL_NAME.fullmatch(n):
                    raise ValueError(f"{key}: not a tool name: {n!r}")
            if names is not None and len(set(names)) != len(names):
                raise ValueError(f"{key}: a tool is listed twice")
        for pat in self.allow_tools or ():
            if not _TOOL_GLOB.fullmatch(pat):
                raise ValueError(f"allowTools: not a tool name or glob: {pat!r}")
        for key, names in (("tools", self.start_tools()), ("autoLoad", self.auto_load or [])):
            for n in names:
                if not self.permits(n):
                    raise ValueError(f"{key}: {n} is not permitted by allowTools")
        if self.toolsrv is not None:
            parse_toolsrv(self.toolsrv)  # its ValueError names what is wrong
        for event, cmds in self.hooks.items():
            if event not in EVENTS:
                raise ValueError(f"hooks: unknown event {event!r} (events: {' '.join(EVENTS)})")
            for cmd in [cmds] if isinstance(cmds, str) else cmds:
                if not cmd.strip():
                    raise ValueError(f"hooks.{event}: empty command")

    # ---- derived views ---------------------------------------------------------------

    def permits(self, tool: str) -> bool:
        """Whether allowTools lets this agent load or call ``tool``."""
        return permits(self.allow_tools, tool)

    def start_tools(self) -> list[str]:
        """``tools``, or the default when the key is absent."""
        return list(DEFAULT_TOOLS) if self.tools is None else list(self.tools)

    def user_prompt_values(self) -> list[Prompt]:
        """``userPrompts`` as a list (a single string is one prompt)."""
        if self.user_prompts is None:
            return []
        if isinstance(self.user_prompts, str):
            return [self.user_prompts]
        return list(self.user_prompts)

    def hook_commands(self, event: str) -> list[str]:
        cmds = self.hooks.get(event, [])
        return [cmds] if isinstance(cmds, str) else list(cmds)


def permits(allow_tools: Sequence[str] | None, tool: str) -> bool:
    """``tool`` matches one of ``allow_tools`` (names or fnmatch globs, case-sensitive);
    None allows everything, an empty list nothing."""
    if allow_tools is None:
        return True
    return any(fnmatch.fnmatchcase(tool, pat) for pat in allow_tools)


def _word(value: str, strict: bool) -> bool:
    if strict:
        return _BACKEND_NAME.fullmatch(value) is not None
    return bool(value) and not any(c.isspace() or ord(c) < 32 or c == "\x7f" for c in value)


def _check_prompt(key: str, value: Prompt | None, *, allow_empty: bool = True) -> None:
    if value is None:
        return
    if isinstance(value, str):
        if not allow_empty and not value.strip():
            raise ValueError(f"{key}: empty prompt")
        return
    if not allow_empty and not value:
        raise ValueError(f"{key}: empty list of commands")
    for cmd in value:
        if not cmd.strip():
            raise ValueError(f"{key}: empty command")


KEYS: Final[tuple[str, ...]] = tuple(f.encode_name for f in msgspec.structs.fields(Profile))
"""Every key a profile may hold, as written on disk."""


# ---- validation of written data ------------------------------------------------------


class Status(enum.Enum):
    VALID = "valid"
    INCOMPLETE = "incomplete"
    INVALID = "invalid"


@dataclass(frozen=True)
class Verdict:
    """`status`; for INVALID and INCOMPLETE a `reason`; for VALID the `profile`."""

    status: Status
    reason: str = ""
    profile: Profile | None = None

    @property
    def invalid(self) -> bool:
        return self.status is Status.INVALID


class ProfileChecker:
    """`check_partial` for data arriving in order: `feed` each write, `close` at the end.

    Only for sequential writes; a write at another offset (an editor seeking back) needs
    `check_partial` on the whole buffer instead. Once INVALID, stays INVALID.
    """

    def __init__(self) -> None:
        self.scanner = JsonScanner()
        self.data = bytearray()
        self.verdict = Verdict(Status.INCOMPLETE, "empty document")

    def feed(self, chunk: bytes) -> Verdict:
        if self.verdict.invalid:
            return self.verdict
        self.data += chunk
        if len(self.data) > MAX_PROFILE_BYTES:
            self.verdict = Verdict(Status.INVALID, f"larger than {MAX_PROFILE_BYTES} bytes")
            return self.verdict
        was_complete = self.scanner.complete
        self.scanner.feed(chunk)
        if was_complete and self.scanner.ok and self.verdict.status is Status.VALID:
            return self.verdict  # only whitespace came after a checked document
        self.verdict = _judge(self.scanner, bytes(self.data))
        return self.verdict

    def close(self) -> Verdict:
        return _final(self.verdict)


def check_partial(data: bytes) -> Verdict:
    """The verdict on a profile written so far (see the module doc)."""
    if len(data) > MAX_PROFILE_BYTES:
        return Verdict(Status.INVALID, f"larger than {MAX_PROFILE_BYTES} bytes")
    scanner = JsonScanner()
    scanner.feed(data)
    return _judge(scanner, data)


def check_complete(data: bytes) -> Verdict:
    """The verdict on a profile as closed: VALID or INVALID, never INCOMPLETE."""
    return _final(check_partial(data))


def _final(v: Verdict) -> Verdict:
    if v.status is Status.INCOMPLETE:
        return Verdict(Status.INVALID, f"incomplete JSON at close: {v.reason}")
    return v


def _judge(scanner: JsonScanner, data: bytes) -> Verdict:
    if not scanner.ok:
        return Verdict(Status.INVALID, f"JSON syntax error: {scanner.error}")
    if scanner.started and data.lstrip(b" \t\r\n")[:1] != b"{":
        return Verdict(Status.INVALID, "a profile must be a JSON object ({...})")
    if not scanner.complete:
        return Verdict(Status.INCOMPLETE, scanner.describe())
    try:
        profile = msgspec.json.decode(data, type=Profile)
    except msgspec.ValidationError as err:
        return Verdict(Status.INVALID, _explain(str(err)))
    except msgspec.DecodeError as err:  # what the scanner lets through (lone surrogates)
        return Verdict(Status.INVALID, f"JSON error: {err}")
    return Verdict(Status.VALID, profile=profile)


def _explain(msg: str) -> str:
    """msgspec's message, with the list of keys when a key was unknown."""
    m = re.fullmatch(r"(.*) - at `\$\.?(.*)`", msg, re.DOTALL)
    if m is not None:
        msg = f"{m.group(2)}: {m.group(1)}" if m.group(2) else m.group(1)
    if "unknown field" in msg:
        msg = msg.replace("Object contains unknown field", "unknown key")
        msg += f" (keys: {' '.join(KEYS)})"
    return msg


# ---- where profiles live -------------------------------------------------------------


def check_name(name: str) -> None:
    """A profile name: letters, digits, ``_ . -``, not starting with ``.``; at most 64."""
    if not _PROFILE_NAME.fullmatch(name):
        raise ProfileError(f"not a valid profile name: {name!r}")


def profile_names(dirs: Sequence[Path]) -> list[str]:
    """Every profile name found in ``dirs``, sorted."""
    names: set[str] = set()
    for d in dirs:
        try:
            names.update(
                p.stem for p in d.glob("*.json") if _PROFILE_NAME.fullmatch(p.stem) and p.is_file()
            )
        except OSError:
            continue
    return sorted(names)


def profile_path(name: str, dirs: Sequence[Path]) -> Path:
    """The file of profile ``name``: the first ``<dir>/<name>.json`` of ``dirs``."""
    check_name(name)
    for d in dirs:
        path = d / f"{name}.json"
        if path.is_file():
            return path
    known = " ".join(profile_names(dirs)) or "none"
    raise ProfileError(f"unknown agent profile: {name} (known: {known})")


def load_profile(name: str, dirs: Sequence[Path]) -> Profile:
    """Profile ``name`` from the first of ``dirs`` holding it (user's config dir first).

    A user's file that is unreadable or invalid is an error, not a reason to fall back on
    the shipped one of the same name: the user's file is the one they meant. Raises
    ProfileError with the file and the reason.
    """
    path = profile_path(name, dirs)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PROFILE_BYTES + 1)
    except OSError as err:
        raise ProfileError(f"profile {name} ({path}): {err.strerror or err}") from None
    verdict = check_complete(data)
    if verdict.profile is None:
        raise ProfileError(f"profile {name} ({path}): {verdict.reason}")
    return verdict.profile
