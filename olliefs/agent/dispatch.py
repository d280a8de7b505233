"""Running one round of tool calls (the seed's dispatch.go).

1. Each call is classified from its tool's metadata: unknown/not loaded, read-safe
   (``parallel``) or not.
2. Consecutive read-safe calls form a batch that runs concurrently; any other call runs
   alone, in the order the model gave.
3. Eligible file reads are answered from the per-turn ``ReadCache`` when the file is
   unchanged.
4. What goes to the model is capped at ``MAX_RESULT`` bytes; the whole output is kept in
   the session's tmp dir and the note says where and how to read the rest.
5. Every result carries its tool's tier (hot/warm/cold) into the history.

In ``chat`` each call shows as ``-> tool(args)`` followed by its result. Calls of a batch
are shown in the model's order, each right before its result, as soon as it and every
call before it has finished, so the transcript never interleaves two results.

A ``stop`` cancels the round: toolsrv kills the running calls (the 9P client flushes the
pending result reads) and every call without a result is answered "cancelled", so the
history stays well-formed (each tool call of an assistant message has its answer).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec
import trio

from olliefs.agent.cache import ReadCache, fingerprint
from olliefs.agent.events import EventRole
from olliefs.agent.hooks import HookEvent, HookResult
from olliefs.agent.runtime import ToolLink
from olliefs.backend.base import Image, Message, ToolCall
from olliefs.toolclient.client import ToolsrvError

log = logging.getLogger(__name__)

MAX_RESULT = 32 * 1024
ERROR_MARK = "[tool error] "
BAD_ARGS_SHOWN = 200  # characters of malformed arguments quoted back to the model
_args_decoder = msgspec.json.Decoder(dict[str, Any])


class ToolHost(Protocol):
    link: ToolLink

    @property
    def cwd(self) -> str: ...

    def tool_env(self) -> Mapping[str, str]: ...

    def permits(self, tool: str) -> bool:
        """allowTools of the agent's profile: a call outside it never reaches toolsrv."""
        ...

    async def hook(self, event: HookEvent, **fields: Any) -> HookResult | None: ...

    def results_dir(self) -> Path: ...

    def set_state(self, state: str) -> None: ...

    def emit(
        self, role: EventRole, content: str = "", name: str = "", response_id: str = ""
    ) -> None: ...

    def add_message(self, msg: Message) -> None: ...


@dataclass
class Outcome:
    call: ToolCall
    shown_args: str
    text: str | None = None
    tier: str = "hot"
    error: bool = False
    announced: bool = False  # its "-> tool(args)" line is in chat
    images: tuple[Image, ...] = ()  # what the tool answered as images (an MCP tool's)


@dataclass
class Round:
    host: ToolHost
    cache: ReadCache
    outcomes: list[Outcome] = field(default_factory=list)
    shown: int = 0  # outcomes already written to chat and history


def one_line_args(arguments: str) -> str:
    try:
        return msgspec.json.encode(msgspec.json.decode(arguments or "{}")).decode()
    except msgspec.DecodeError:
        return " ".join(arguments.split())


def batches(calls: tuple[ToolCall, ...], link: ToolLink) -> list[list[int]]:
    """Indices of ``calls`` grouped: runs of read-safe calls together, others alone."""
    out: list[list[int]] = []
    prev = False
    for i, c in enumerate(calls):
        meta = link.metas.get(c.name)
        parallel = meta is not None and meta.parallel
        if parallel and prev:
            out[-1].append(i)
        else:
            out.append([i])
        prev = parallel
    return out


async def run_tools(host: ToolHost, calls: tuple[ToolCall, ...], cache: ReadCache) -> None:
    rnd = Round(host, cache, [Outcome(c, one_line_args(c.arguments)) for c in calls])
    try:
        known = sum(1 for c in calls if c.name in host.link.metas)
        if known > 1:
            await host.link.warm(known)
        for group in batches(calls, host.link):
            names = ", ".join(dict.fromkeys(calls[i].name for i in group))
            host.set_state(f"calling: {names}")
            if len(group) == 1:
                i = group[0]
                _show_call(rnd, i)
                await _run_one(rnd, i)
                _release(rnd)
            else:
                async with trio.open_nursery() as nursery:
                    for i in group:
                        nursery.start_soon(_run_and_release, rnd, i)
    finally:
        # Whatever did not finish (stop, or a bug) still gets its answer in the history.
        for o in rnd.outcomes[rnd.shown :]:
            if o.text is None:
                o.text, o.error = "cancelled: the turn was stopped before the tool ended", True
        _release(rnd, force=True)
        host.set_state("thinking")


async def _run_and_release(rnd: Round, i: int) -> None:
    await _run_one(rnd, i)
    _release(rnd)


def _show_call(rnd: Round, i: int) -> None:
    o = rnd.outcomes[i]
    rnd.host.emit("call", o.shown_args, name=o.call.name)
    o.announced = True


def _release(rnd: Round, force: bool = False) -> None:
    """Write finished outcomes to chat and history, in order, up to the first running one."""
    while rnd.shown < len(rnd.outcomes):
        o = rnd.outcomes[rnd.shown]
        if o.text is None and not force:
            return
        if not o.announced:
            _show_call(rnd, rnd.shown)
        text = o.text or ""
        if o.error:
            text = ERROR_MARK + text
        rnd.host.emit("tool", text, name=o.call.name)
        rnd.host.add_message(
            Message(
                "tool",
                text,
                tool_call_id=o.call.id,
                name=o.call.name,
                tier=o.tier,
                images=o.images,
            )
        )
        rnd.shown += 1


async def _run_one(rnd: Round, i: int) -> None:
    host, o = rnd.host, rnd.outcomes[i]
    name = o.call.name
    if not host.permits(name):
        o.text, o.error = f"{name}: not permitted for this agent (its profile's allowTools)", True
        return
    meta = host.link.metas.get(name)
    if meta is None:
        loaded = ", ".join(host.link.wanted) or "none"
        o.text, o.error = (
            f"unknown tool {name!r}: not loaded (loaded: {loaded}); "
            f"load it with tool_load {name} through ctl",
            True,
        )
        return
    o.tier = meta.tier
    try:
        args = _args_decoder.decode(o.call.arguments or "{}")
    except msgspec.DecodeError as err:
        o.text, o.error = bad_arguments(name, o.call.arguments, err), True
        return
    pre = await host.hook("preTool", tool=name, args=args, call_id=o.call.id)
    if pre is not None and pre.blocked:
        o.text, o.error = f"blocked by the preTool hook: {pre.reason or '(no reason)'}", True
        return
    await _call(rnd, o, name, args)
    post = await host.hook(
        "postTool", tool=name, args=args, call_id=o.call.id, result=o.text, is_error=o.error
    )
    # What the hooks said goes with the result, after it (the model reads the tool's own
    # output first); a postTool block cannot undo the call, so it fails the result.
    notes = [f"[preTool hook]\n{pre.context.strip()}"] if pre and pre.context.strip() else []
    if post is not None and post.context.strip():
        notes.append(f"[postTool hook]\n{post.context.strip()}")
    if post is not None and post.blocked:
        notes.append(f"[blocked by the postTool hook: {post.reason or '(no reason)'}]")
        o.error = True
    if notes:
        o.text = "\n".join(x for x in [o.text, *notes] if x)


def bad_arguments(name: str, arguments: str, err: msgspec.DecodeError) -> str:
    """The tool error for arguments that are not a JSON object: what is wrong with them
    (cut off, not JSON, JSON of another type), the start of what came, and what to do.
    The model reads this as its call's result and can try again."""
    if isinstance(err, msgspec.ValidationError):  # JSON, but not an object
        problem = "the arguments must be a JSON object"
    elif "truncated" in str(err):
        problem = "the arguments were cut off before their end (truncated JSON)"
    else:
        problem = f"the arguments are not valid JSON ({err})"
    shown = " ".join(arguments.split())
    if len(shown) > BAD_ARGS_SHOWN:
        shown = shown[:BAD_ARGS_SHOWN] + f"... ({len(arguments)} characters in all)"
    return (
        f"{problem}; received: {shown or '(nothing)'}. "
        f"Call {name} again with all its arguments as one JSON object."
    )


async def _call(rnd: Round, o: Outcome, name: str, args: dict[str, Any]) -> None:
    host = rnd.host
    cached = ReadCache.key(name, args, host.cwd)
    if cached is not None:
        hit = rnd.cache.get(*cached)
        if hit is not None:
            o.text = hit + "\n[from this turn's read cache: the file is unchanged]"
            return
        before = fingerprint(cached[1])
    try:
        result = await host.link.call(name, args, host.cwd, host.tool_env())
    except ToolsrvError as err:
        o.text, o.error = str(err), True
        return
    text = _cut(result.text, host, o.call.id)
    if cached is not None and not result.isError:
        rnd.cache.put(cached[0], before, cached[1], text)
    o.text, o.error = text, result.isError
    o.images = tuple(
        Image(c.mimeType, len(c.data) * 3 // 4 - c.data.count("=", -2), c.data)
        for c in result.content
        if c.type == "image" and isinstance(c.data, str) and isinstance(c.mimeType, str)
    )


def _cut(text: str, host: ToolHost, call_id: str) -> str:
    data = text.encode()
    if len(data) <= MAX_RESULT:
        return text
    head = data[:MAX_RESULT].decode(errors="ignore")
    note = f"[output cut: showing {len(head.encode())} of {len(data)} bytes"
    path = None
    try:
        d = host.results_dir()
        d.mkdir(parents=True, exist_ok=True)
        safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in call_id) or "call"
        path = d / f"{safe}.txt"
        path.write_bytes(data)
        lines = head.count("\n") + 1
        note += f"; the whole output is in {path}: read the rest with file_read offset={lines}]"
    except OSError as err:
        log.warning("cannot keep the whole tool output: %s", err)
        if path is not None:  # a full disk: no cut copy is left to pass for the whole
            with contextlib.suppress(OSError):
                path.unlink()
        note += "; narrow the command to see the rest]"
    return head.rstrip("\n") + "\n" + note


def tool_env(
    *, mountpoint: str, session_id: str, agent: str, cwd: str, memory_dir: str
) -> dict[str, str]:
    return {
        "OLLIE": mountpoint,
        "OLLIE_SESSION_ID": session_id,
        "OLLIE_AGENT": agent,
        "OLLIE_CWD": cwd,
        "OLLIE_MEMORY_DIR": memory_dir,
        "LANG": os.environ.get("LANG", "C.UTF-8"),
    }
