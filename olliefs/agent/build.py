"""BuildRuntime: a profile turned into what a running agent uses (the seed's seven steps).

The seed's BuildRuntime does, in order: (1) list the loaded tools and the registry
revision, (2) resolve the prompts, (3) take the generation parameters, (4) build the tool
executor, (5) take the parallelism and tier classifiers, (6) apply the tool restrictions,
(7) return the Runtime. Steps 1, 4 and 5 talk to toolsrv, which the agent's `ToolLink`
owns; `build_runtime` does the others and hands back a `Runtime` record saying which tools
to load and which the agent may use, so the caller applies it to a fresh link (``ctl
agent``: new toolsrv attach, then ``link.set_wanted(rt.tools)``) and checks every call
against `Runtime.permits`.

It is "pure-ish": it reads files and runs the profile's prompt commands, nothing else —
no session, no toolsrv, no backend — so a switch can build the new runtime completely
before touching the running agent, and a failure (a prompt command that fails) leaves
everything as it was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from olliefs.agent.hooks import HookFailure
from olliefs.agent.profile import Profile, permits
from olliefs.agent.prompt import PROMPT_TIMEOUT, resolve_prompt
from olliefs.backend.base import GenerationParams


@dataclass(frozen=True)
class Runtime:
    """What a profile resolves to. Tool lists are in profile order, already filtered by
    ``allow_tools``; None means "the profile does not say" (the session keeps its own)."""

    name: str  # the profile's name
    prompt: str  # resolved ``prompt``: added to the preamble ("" if none)
    system_prompt: str | None  # resolved ``systemPrompt``: replaces the built-in preamble
    user_prompts: list[str]  # resolved ``userPrompts``: submitted when the agent starts
    backend: str | None
    model: str | None
    tools: list[str]  # ``tools``: loaded at start
    auto_load: list[str]  # ``autoLoad`` less what ``tools`` has: loaded at start after them
    allow_tools: tuple[str, ...] | None  # None: every tool
    params: GenerationParams
    thinking_budget: int | None
    max_steps: int | None
    compaction_model: str | None
    hooks: dict[str, list[str]]  # event -> commands, only events that have some
    hook_failure: HookFailure
    hook_timeout: float
    text_tool_calls: bool | None = None  # None: the backend's default
    edits: str | None = None  # ``edits``: direct or review (None: the session keeps its own)
    description: str = ""
    notes: list[str] = field(default_factory=list)  # startup messages for chat (":: ...")

    def permits(self, tool: str) -> bool:
        """Whether this agent may load or call ``tool`` (allowTools)."""
        return permits(self.allow_tools, tool)

    @property
    def initial_tools(self) -> list[str]:
        """What the agent starts with: ``tools``, then ``autoLoad``."""
        return [*self.tools, *self.auto_load]

    def hook_commands(self, event: str) -> list[str]:
        return self.hooks.get(event, [])


async def build_runtime(
    profile: Profile,
    *,
    name: str,
    cwd: str,
    env: Mapping[str, str],
    profile_dir: Path | None = None,
    prompt_dirs: Sequence[Path] = (),
    prompt_timeout: float = PROMPT_TIMEOUT,
) -> Runtime:
    """Resolve ``profile`` (named ``name``) for an agent working in ``cwd``.

    ``env``: the exact environment of prompt commands and of ``$NAME`` expansion (build it
    with `shell.base_env` plus the session's variables). ``profile_dir``: the directory
    of the profile's file (``./x`` in a prompt is relative to it, and it is searched first
    for bare file names). ``prompt_dirs``: then searched in order (the user's
    ``prompts/``, then the shipped one). Prompts resolve in order: systemPrompt, prompt,
    userPrompts. Raises PromptError (EINVAL) when one cannot be resolved.
    """
    search = [*([profile_dir] if profile_dir is not None else []), *prompt_dirs]

    async def resolve(value: str | list[str]) -> str:
        return await resolve_prompt(
            value,
            cwd=cwd,
            env=env,
            base_dir=profile_dir,
            search_dirs=search,
            timeout=prompt_timeout,
        )

    # Step 2: the prompts.
    system_prompt = None if profile.system_prompt is None else await resolve(profile.system_prompt)
    prompt = "" if profile.prompt is None else await resolve(profile.prompt)
    user_prompts = []
    for value in profile.user_prompt_values():
        text = (await resolve(value)).strip()
        if text:  # an empty prompt does nothing, as when written to the prompt file
            user_prompts.append(text)
    # Step 3: generation parameters.
    params = GenerationParams(
        max_tokens=profile.max_tokens,
        temperature=profile.temperature,
        frequency_penalty=profile.frequency_penalty,
        presence_penalty=profile.presence_penalty,
    )
    # Step 6: restrictions. A valid profile lists only permitted tools; filtering again
    # keeps the guarantee even for a Profile built in code.
    allow = None if profile.allow_tools is None else tuple(profile.allow_tools)
    notes = []
    tools = []
    for t in profile.start_tools():
        if permits(allow, t):
            tools.append(t)
        else:
            notes.append(f"tool {t} is not permitted for this agent; not loaded")
    auto_load = [t for t in profile.auto_load or [] if permits(allow, t) and t not in tools]
    hooks = {e: cmds for e in profile.hooks if (cmds := profile.hook_commands(e))}
    return Runtime(
        name=name,
        prompt=prompt,
        system_prompt=system_prompt,
        user_prompts=user_prompts,
        backend=profile.backend,
        model=profile.model,
        tools=tools,
        auto_load=auto_load,
        allow_tools=allow,
        params=params,
        thinking_budget=profile.thinking_budget,
        max_steps=profile.max_steps,
        compaction_model=profile.compaction_model,
        hooks=hooks,
        hook_failure=profile.hook_failure,
        hook_timeout=profile.hook_timeout,
        text_tool_calls=profile.text_tool_calls,
        edits=profile.edits,
        description=profile.description,
        notes=notes,
    )
