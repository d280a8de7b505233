"""An agent's configuration as one typed record: what ``cfg`` shows and accepts.

``Cfg`` is a frozen msgspec Struct. Its field names are the ``cfg`` keys (camelCase on the
outside, through ``rename``), and every constraint on a value lives in its type, so one
``msgspec.convert`` both parses a written string and validates it. A change never mutates
a record: ``with_values`` returns a new one, so a write of several lines is checked line
by line against the record as the earlier lines leave it, and is applied (or dropped)
whole.

``state`` is shown in ``cfg`` but belongs to the session, not to the record: writing it
back unchanged is accepted (editors save the whole file), changing it is refused.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

import msgspec

from olliefs.backend.base import GenerationParams
from olliefs.errors import InvalidRequest
from olliefs.mounts import InsideTree, real_dir
from olliefs.toolclient.remote import parse_toolsrv

MaxTokens = Annotated[int, msgspec.Meta(gt=0, le=10_000_000)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
Budget = Annotated[int, msgspec.Meta(ge=0, le=10_000_000)]


class Cfg(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    backend: str
    model: str
    agent: str
    cwd: str
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    thinking_budget: Budget | None = None
    edits: Literal["direct", "review"] = "direct"  # checkpoints: applied or staged
    # Where the tools run: "" the daemon's default (OLLIE_TOOLSRV), ``local``, or
    # ``ssh:[user@]host[:dir]`` (olliefs.toolclient.remote).
    toolsrv: str = ""

    def params(self) -> GenerationParams:
        return GenerationParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            thinking_budget=self.thinking_budget,
        )

    def values(self) -> dict[str, Any]:
        """Every key (outside names) with its value; None for an unset parameter."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        for key in PARAM_KEYS:
            out.setdefault(key, None)
        return out

    def text(self, state: str) -> str:
        lines = [f"state={state}"]
        for key, value in self.values().items():
            lines.append(f"{key}={'' if value is None else value}")
        return "\n".join(lines) + "\n"

    def with_values(self, values: dict[str, Any]) -> Cfg:
        """A new record with ``values`` (outside names) applied; None unsets a parameter."""
        merged = self.values() | values
        try:
            return msgspec.convert(merged, Cfg)
        except msgspec.ValidationError as err:
            raise InvalidRequest(f"cfg: {err}") from None


# Keys as ``cfg`` shows them, in order; the generation parameters may be empty (unset).
KEYS = ("state", "backend", "model", "agent", "cwd", "maxTokens", "temperature",
        "frequencyPenalty", "presencePenalty", "thinkingBudget", "edits",
        "toolsrv")  # fmt: skip
PARAM_KEYS = KEYS[5:10]
_FIELD_TYPES = {
    "maxTokens": MaxTokens | None,
    "temperature": Temperature | None,
    "frequencyPenalty": Penalty | None,
    "presencePenalty": Penalty | None,
    "thinkingBudget": Budget | None,
}


def parse_param(key: str, value: str) -> Any:
    """A written parameter value, typed and checked (empty = unset)."""
    if value == "":
        return None
    try:
        return msgspec.convert(value, _FIELD_TYPES[key], strict=False)
    except msgspec.ValidationError as err:
        raise InvalidRequest(f"{key}: {err}: {value}") from None


def check_toolsrv(value: str) -> str:
    """A written ``toolsrv`` value, checked (empty: back to the daemon's default)."""
    try:
        target = parse_toolsrv(value)
    except ValueError as err:
        raise InvalidRequest(str(err)) from None
    return "" if not value else str(target) if target is not None else "local"


def resolve_cwd(value: str) -> str:
    """``~`` expanded; must be absolute and an existing directory outside every olliefs
    tree. The real path is what is kept, so that no later use of it can be led into a
    tree by a symlink changed meanwhile (`olliefs.mounts.real_dir`)."""
    path = os.path.expanduser(value)
    if not os.path.isabs(path):
        raise InvalidRequest(f"cwd must be an absolute path: {value}")
    try:
        return real_dir(path)
    except InsideTree as err:
        raise InvalidRequest(
            f"cwd {value}: leads into an olliefs tree ({err.filename}); a session works "
            "in a directory of the disk"
        ) from None
    except OSError as err:
        raise InvalidRequest(
            f"cwd is not an existing directory: {value} ({err.strerror})"
        ) from None
