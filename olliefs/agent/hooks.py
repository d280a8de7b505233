"""Hooks: the user's shell commands at fixed points of an agent's life (SPEC 4, seed "Hooks").

A profile maps an event to one command or a list of them (``"hooks": {"preTool":
["check.sh", "log.sh"]}``). `run_hook` runs one event's commands, in order, each as
``/bin/sh -c`` through `shell.run_shell` (session cwd, own process group, the whole group
killed on timeout, output capped), and folds what they did into one `HookResult`:

=========  =================================================================
exit 0     its stdout (trailing newlines removed) joins ``context``: the caller adds it
           to what the model sees
exit 2     **block**: ``blocked`` is set, its stderr is the ``reason``, and the commands
           after it do not run
otherwise  a line in ``warnings`` (non-0/2 exit, death by a signal, timeout, a command
           that could not start); the next command runs
=========  =================================================================

With ``failure="block"`` (a profile's ``"hookFailure": "block"``) the "otherwise" row
blocks instead: the hook fails closed, so a guard that crashes or hangs stops the action
rather than waving it through. Its reason then says what went wrong.

Each command gets the event's payload as one JSON object on stdin (``event`` added), and
the environment it is given plus ``OLLIE_<KEY>`` for each top-level payload key (see
`hook_env`). What each event's payload holds, and what a block stops, is the caller's
contract, written down in ollie-agent(5).

`run_hook` never raises for anything a command does; only cancellation (``ctl stop``)
propagates, after the command's group is gone.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, get_args

import msgspec

from olliefs.agent.shell import run_shell

HookEvent = Literal[
    "agentSpawn", "preTurn", "postTurn", "preTool", "postTool", "preCompact", "postCompact",
    "turnError",
]  # fmt: skip
EVENTS: Final[tuple[str, ...]] = get_args(HookEvent)
HookFailure = Literal["warn", "block"]

HOOK_TIMEOUT = 60.0
"""Seconds each hook command may run (a profile's ``hookTimeout`` overrides it)."""
HOOK_OUTPUT_CAP = 32 * 1024
"""Bytes of each stream kept per command, as for a tool result (SPEC 4)."""
ENV_VALUE_MAX = 16 * 1024
"""Longer payload values stay out of the environment (read them from stdin): one
variable may not exceed 128 KiB on Linux, and all of them share the exec limit."""
BLOCK_EXIT = 2

_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True)
class HookResult:
    """What one event's commands decided.

    ``blocked``/``reason``: a command blocked (exit 2, or a failure under
    ``failure="block"``); the commands after it did not run. ``context``: the stdout of
    the commands that exited 0, in order, joined with newlines (empty if none printed).
    ``warnings``: one line each, for chat. ``ran``: commands started. ``ok``: at least one
    command ran and every one that ran exited 0 (turnError reads this as "handled").
    """

    blocked: bool = False
    reason: str = ""
    context: str = ""
    warnings: list[str] = field(default_factory=list)
    ran: int = 0
    ok: bool = False


def hook_payload(
    event: HookEvent,
    *,
    session_id: str,
    agent: str,
    cwd: str,
    backend: str,
    model: str,
    **fields: Any,
) -> dict[str, Any]:
    """A payload with the fields every event carries, plus the event's own ``fields``.

    The fields of each event (ollie-agent(5), HOOK PAYLOAD): agentSpawn ``parent depth``;
    preTurn ``prompt``; postTurn ``prompt reply end rounds``; preTool ``tool args
    call_id``; postTool ``tool args call_id result is_error``; preCompact ``trigger focus
    tokens``; postCompact ``trigger compaction messages_before messages_after``; turnError
    ``error error_type attempt``.
    """
    return {
        "event": event,
        "session_id": session_id,
        "agent": agent,
        "cwd": cwd,
        "backend": backend,
        "model": model,
        "ts": time.time(),
        **fields,
    }


def hook_env(event: str, payload: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """``env`` plus ``OLLIE_EVENT`` and one ``OLLIE_<KEY>`` per top-level payload key.

    The key is upper-cased, camelCase humps and other characters becoming ``_``
    (``session_id`` and ``sessionId`` both give ``OLLIE_SESSION_ID``). Values: strings as
    they are, numbers in JSON form, booleans ``true``/``false``, null empty, objects and
    arrays as compact JSON. A value longer than ``ENV_VALUE_MAX`` bytes, or holding a NUL,
    is left out (the payload on stdin has it whole). Payload variables win over ``env``.
    """
    out = dict(env)
    for key, value in payload.items():
        name = env_name(key)
        if name is None:
            continue
        if isinstance(value, str):
            text = value
        elif value is None:
            text = ""
        else:
            text = _encode(value).decode()
        if "\0" in text or len(text.encode()) > ENV_VALUE_MAX:
            out.pop(name, None)  # a stale value from env would lie
            continue
        out[name] = text
    out["OLLIE_EVENT"] = event
    return out


def env_name(key: str) -> str | None:
    """``OLLIE_<KEY>`` for a payload key, None for a key that gives no usable name."""
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", key)
    snake = re.sub(r"[^A-Za-z0-9]+", "_", snake).strip("_").upper()
    return f"OLLIE_{snake}" if snake else None


async def run_hook(
    event: str,
    commands: Sequence[str],
    payload: Mapping[str, Any],
    *,
    cwd: str,
    env: Mapping[str, str],
    timeout: float = HOOK_TIMEOUT,
    failure: HookFailure = "warn",
) -> HookResult:
    """Run ``commands`` for ``event`` in order; see the module doc. No commands: an empty
    result (not blocked, ``ok`` false)."""
    body = dict(payload)
    body.setdefault("event", event)
    stdin = _encode(body)
    cmd_env = hook_env(event, body, env)
    context: list[str] = []
    warnings: list[str] = []
    ran = 0
    all_zero = True
    for i, command in enumerate(commands):
        label = f"hook {event}" + (f"[{i + 1}]" if len(commands) > 1 else "")
        ran += 1
        res = await run_shell(
            command,
            cwd=cwd,
            env=cmd_env,
            stdin=stdin,
            timeout=timeout,
            cap=HOOK_OUTPUT_CAP,
        )
        if res.status == 0 and not res.timed_out:
            out = res.stdout.decode(errors="replace").rstrip("\n")
            if res.stdout_cut:
                out += f"\n[{label}: {res.stdout_cut} more bytes of output cut]"
            if out:
                context.append(out)
            continue
        all_zero = False
        stderr = res.stderr_text()
        if res.status == BLOCK_EXIT and not res.timed_out:
            reason = stderr or f"blocked by {label} ({_short(command)}), no reason given"
            return HookResult(True, reason, "\n".join(context), warnings, ran, False)
        if res.error:
            what = f"could not start: {res.error}"
        elif res.timed_out:
            what = f"timed out after {timeout:g}s and was killed"
        else:
            assert res.status is not None
            what = f"exited {res.status}" if res.status > 0 else f"killed by signal {-res.status}"
        line = f"{label} ({_short(command)}) {what}" + (f": {_one_line(stderr)}" if stderr else "")
        if failure == "block":
            return HookResult(
                True, f"{line} (hookFailure is block)", "\n".join(context), warnings, ran, False
            )
        warnings.append(line)
    return HookResult(False, "", "\n".join(context), warnings, ran, ran > 0 and all_zero)


def _short(command: str, limit: int = 60) -> str:
    text = " ".join(command.split())
    return f"`{text}`" if len(text) <= limit else f"`{text[: limit - 3]}...`"


def _one_line(text: str, limit: int = 300) -> str:
    """stderr folded onto the warning's line: its lines joined by ' | ', capped."""
    flat = " | ".join(s.strip() for s in text.splitlines() if s.strip())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
