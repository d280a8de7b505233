"""The ``ctl`` command table: one entry per command (SPEC 3.5).

Each entry says how many arguments the command takes, whether it may run while a turn
runs, and how to prepare it. Preparing checks everything and returns the action without
changing anything; the session runs the actions of a whole write only once every line of
it prepared cleanly (SPEC 3.7: a write is applied whole or not at all). A new command is
one ``@command`` function here, nothing else.

``Pending`` carries what the earlier lines of the same write will have changed, so that a
later line is checked against it (``tool_load a`` then ``tool_unload a`` is valid).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from olliefs.agent.config import resolve_cwd
from olliefs.caller import USER, Caller
from olliefs.errors import Busy, InvalidRequest

if TYPE_CHECKING:
    from olliefs.session.session import Session

# An action; one that has more to do off the serving thread (an fsync, a file move)
# returns what the write then awaits before it returns.
Apply = Callable[[], Awaitable[None] | None]
Arity = Literal["none", "one", "maybe", "rest", "any"]


@dataclass
class Pending:
    """What a write's earlier lines leave behind, for checking its later lines."""

    tools: list[str]
    known_tools: set[str]
    caller: Caller = USER  # who wrote the request: a sandboxed one is held to its rights
    compact: bool = False  # an earlier line asked for a compaction


@dataclass(frozen=True)
class Command:
    name: str
    arity: Arity
    while_running: bool
    help: str
    prepare: Callable[[Session, str, Pending], Apply]


COMMANDS: dict[str, Command] = {}


def command(
    name: str, arity: Arity, help: str, *, while_running: bool = True
) -> Callable[[Callable[[Session, str, Pending], Apply]], Callable[[Session, str, Pending], Apply]]:
    def register(
        fn: Callable[[Session, str, Pending], Apply],
    ) -> Callable[[Session, str, Pending], Apply]:
        COMMANDS[name] = Command(name, arity, while_running, help, fn)
        return fn

    return register


def prepare(s: Session, line: str, pending: Pending) -> Apply:
    """One ctl line checked against the table; its action returned, nothing changed."""
    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    if not name:
        raise InvalidRequest("empty command")
    cmd = COMMANDS.get(name)
    if cmd is None:
        raise InvalidRequest(f"unknown command: {name} (known: {' '.join(sorted(COMMANDS))})")
    if cmd.arity == "none" and arg:
        raise InvalidRequest(f"{name}: takes no argument")
    if cmd.arity in ("one", "rest") and not arg:
        raise InvalidRequest(f"{name}: missing argument")
    if cmd.arity in ("one", "maybe") and len(arg.split()) > 1:
        raise InvalidRequest(f"{name}: takes one argument")
    if not cmd.while_running and s.running:
        raise Busy(f"{name}: refused while a {s.work} is running (ctl stop first)")
    return cmd.prepare(s, arg, pending)


def split_request(text: str, what: str) -> list[str]:
    """Whitespace-separated tokens; a value with spaces in double (or single) quotes,
    ``cwd="/home/me/my proj"``, with backslash escapes as in a shell. Control bytes other
    than the separators (tab, newline) are refused: they would end up raw in chat, in
    file names and in the journal."""
    check_text(text, what)
    try:
        return shlex.split(text, comments=False, posix=True)
    except ValueError as err:  # an unclosed quote
        raise InvalidRequest(f"{what}: {err}") from None


def check_text(text: str, what: str) -> None:
    bad = CONTROL.search(text)
    if bad:
        raise InvalidRequest(f"{what}: control character {bad.group()!r} refused")


CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def tool_names(text: str) -> list[str]:
    """The tools a ctl write names in ``tool_load`` lines (checked before the write)."""
    out = []
    for line in text.splitlines():
        name, _, arg = line.strip().partition(" ")
        if name == "tool_load" and arg.strip():
            out.append(arg.strip())
    return out


# ---- the commands ----------------------------------------------------------------------


@command("stop", "none", "interrupt the running turn; its partial work is kept")
def _stop(s: Session, arg: str, p: Pending) -> Apply:
    return s.stop


@command("kill", "none", "end the session (same as rm -r); its journal goes to tr/")
def _kill(s: Session, arg: str, p: Pending) -> Apply:
    return lambda: s.host.kill(s)


@command("rn", "one", "rename the session", while_running=False)
def _rn(s: Session, arg: str, p: Pending) -> Apply:
    s.host.check_new_name(arg)
    return lambda: s.host.rename(s, arg)


@command("backend", "one", "switch the backend", while_running=False)
def _backend(s: Session, arg: str, p: Pending) -> Apply:
    s.host.check_backend(arg)
    return lambda: s.set_cfg({"backend": arg})


@command("model", "one", "switch the model", while_running=False)
def _model(s: Session, arg: str, p: Pending) -> Apply:
    return lambda: s.set_cfg({"model": arg})


@command("cwd", "rest", "change the working directory", while_running=False)
def _cwd(s: Session, arg: str, p: Pending) -> Apply:
    path = resolve_cwd(arg)
    p.caller.check_dir(path, "cwd")
    if path != s.cwd and s.host.staged(s):  # (staged against the cwd)
        raise Busy("cwd: edits are staged (ctl accept or ctl reject them)")
    return lambda: s.set_cfg({"cwd": path})


@command("tool_load", "one", "give the agent a tool (t/idx lists them)")
def _tool_load(s: Session, arg: str, p: Pending) -> Apply:
    if arg not in p.known_tools:
        raise InvalidRequest(f"tool_load: unknown tool: {arg}")
    if not s.agent.permits(arg):
        raise InvalidRequest(f"tool_load: {arg} is not permitted for this agent (allowTools)")
    if arg in p.tools:
        return lambda: None
    p.tools.append(arg)
    names = list(p.tools)
    return lambda: s.set_tools(names, f"tool {arg} loaded")


@command("tool_unload", "one", "take a tool away from the agent")
def _tool_unload(s: Session, arg: str, p: Pending) -> Apply:
    if arg not in p.tools:
        raise InvalidRequest(f"tool_unload: not loaded: {arg}")
    p.tools.remove(arg)
    names = list(p.tools)
    return lambda: s.set_tools(names, f"tool {arg} unloaded")


@command("models", "none", "list the backend's models again (the models file)")
def _models(s: Session, arg: str, p: Pending) -> Apply:
    return lambda: s.host.models_command(s)


@command("agent", "one", "switch to a profile: fresh tools, cleared history", while_running=False)
def _agent(s: Session, arg: str, p: Pending) -> Apply:
    s.host.check_agent(arg)
    p.caller.check(False, f"agent {arg}")
    return lambda: s.switch_agent(arg)


@command("clear", "none", "forget the conversation (chat keeps it)", while_running=False)
def _clear(s: Session, arg: str, p: Pending) -> Apply:
    return s.clear


@command("inject", "rest", "add text to the running turn at its next step (idle: a prompt)")
def _inject(s: Session, arg: str, p: Pending) -> Apply:
    return lambda: s.inject(arg, replace=False, caller=p.caller)


@command("irw", "rest", "replace the injection the running turn has not taken yet")
def _irw(s: Session, arg: str, p: Pending) -> Apply:
    return lambda: s.inject(arg, replace=True, caller=p.caller)


@command("queue", "one", "queue clear: drop the prompts waiting behind the running turn")
def _queue(s: Session, arg: str, p: Pending) -> Apply:
    if arg != "clear":
        raise InvalidRequest(f"queue: unknown subcommand: {arg} (queue clear)")
    return s.clear_queue


@command("maxsteps", "maybe", "show (in chat) or set the step limit of a turn")
def _maxsteps(s: Session, arg: str, p: Pending) -> Apply:
    n = _count("maxsteps", arg, 1, 10_000) if arg else None
    return lambda: s.set_max_steps(n)


@command("save", "none", "write the chat so far to tr/<time>-<id>.md")
def _save(s: Session, arg: str, p: Pending) -> Apply:
    return lambda: s.host.save(s)


@command("fork", "rest", "fork <name> [<n>|checkpoint]: a new session with the first n "
         "messages, or with only this one's checkpoint (task state, decisions)")  # fmt: skip
def _fork(s: Session, arg: str, p: Pending) -> Apply:
    parts = arg.split()
    if len(parts) > 2:
        raise InvalidRequest("fork: fork <name> [<n>|checkpoint]")
    name = parts[0]
    # The fork works in this session's cwd: a sandboxed caller may make it only where it
    # could have made the session itself.
    p.caller.check_dir(s.cwd, "fork")
    if parts[1:] == ["checkpoint"]:
        # No message is copied, so no cut can split a tool call from its result: this
        # is also valid in the middle of a tool round (subagent_spawn runs there).
        s.host.check_new_name(name)
        return lambda: s.host.fork(s, name, 0, checkpoint=True)
    total = len(s.agent.history.messages)
    n = _count("fork", parts[1], 0, total) if len(parts) == 2 else total
    msgs = s.agent.history.messages
    if n < total and msgs[n].role == "tool":
        raise InvalidRequest(f"fork: message {n} is a tool result; cut before its call")
    if n and msgs[n - 1].tool_calls:
        raise InvalidRequest(f"fork: message {n} has tool calls whose results would be cut")
    s.host.check_new_name(name)
    return lambda: s.host.fork(s, name, n)


@command("rewind", "rest", "rewind n [chat|files] [force]: drop the last n turns (kept under "
         "branches/) and restore the files they changed", while_running=False)  # fmt: skip
def _rewind(s: Session, arg: str, p: Pending) -> Apply:
    parts = arg.split()
    force = "force" in parts
    rest = [x for x in parts[1:] if x != "force"]
    if not parts or len(rest) > 1 or (rest and rest[0] not in ("chat", "files")):
        raise InvalidRequest("rewind: rewind <n> [chat|files] [force]")
    n = _count("rewind", parts[0], 1, max(s.turns(), 1))
    if s.turns() == 0:
        raise InvalidRequest("rewind: no turn to drop")
    what = rest[0] if rest else "both"
    if what != "chat" and not force:
        s.host.check_rewind(s, n)  # (raises Busy: nothing is done)
    return lambda: s.host.rewind(s, n, what)


@command("accept", "any", "accept [path...]: apply the edits staged for review (all or those)",
         while_running=False)  # fmt: skip
def _accept(s: Session, arg: str, p: Pending) -> Apply:
    chosen = s.host.check_review(s, "accept", shlex.split(arg))
    return lambda: s.host.review(s, "accept", chosen)


@command("reject", "any", "reject [path...]: drop the edits staged for review (all or those)",
         while_running=False)  # fmt: skip
def _reject(s: Session, arg: str, p: Pending) -> Apply:
    chosen = s.host.check_review(s, "reject", shlex.split(arg))
    return lambda: s.host.review(s, "reject", chosen)


@command("compact", "any", "compact [focus]: summarize the history now, as the session's work "
         "(in a turn: before its next request, or right after it)")  # fmt: skip
def _compact(s: Session, arg: str, p: Pending) -> Apply:
    if p.compact:
        raise InvalidRequest("compact: given twice in one request")
    s.check_compact()
    p.compact = True
    return lambda: s.compact(arg)


def _count(name: str, arg: str, low: int, high: int) -> int:
    try:
        n = int(arg)
    except ValueError:
        raise InvalidRequest(f"{name}: not a whole number: {arg}") from None
    if not low <= n <= high:
        raise InvalidRequest(f"{name}: {n} is out of range ({low}..{high})")
    return n


def help_text() -> str:
    return "".join(f"{c.name}\t{c.help}\n" for c in sorted(COMMANDS.values(), key=_name))


def _name(c: Command) -> str:
    return c.name
