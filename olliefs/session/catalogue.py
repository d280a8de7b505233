"""What the daemon knows beside its sessions, one concern a class: the backends and their
models (``Backends``), the agent profiles (``Profiles``) and the tools toolsrv serves
(``Tools``). The registry (``olliefs.session.registry``) owns one of each and passes them
to the sessions; each can be made and tested without a daemon."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from olliefs.agent.build import Runtime, build_runtime
from olliefs.agent.profile import DEFAULT_TOOLS, Profile, load_profile, permits, profile_path
from olliefs.agent.runtime import ToolLink
from olliefs.agent.shell import base_env
from olliefs.backend.base import Backend, BackendError
from olliefs.errors import InvalidRequest
from olliefs.settings import Paths, agent_names, shipped_dir
from olliefs.toolclient.client import ToolsrvError
from olliewire import ToolMeta

if TYPE_CHECKING:
    from olliefs.backend import pool
    from olliefs.session.session import Session

log = logging.getLogger(__name__)

DEFAULT_MODEL = "gpt-4o-mini"
CATALOGUE_MAX_AGE = 1.0


class Backends:
    """The backends (made at their first use) and what they say of their models."""

    def __init__(self, settings: Mapping[str, str], default_context_length: int) -> None:
        self.settings = settings
        self._pool: pool.Pool | None = None  # made at its first use (see ``pool``)
        self.default_context_length = default_context_length

    @property
    def made(self) -> pool.Pool | None:
        """The pool if it was made (nothing to close otherwise)."""
        return self._pool

    @property
    def pool(self) -> pool.Pool:
        """The backends, imported and made at the first use: the backend modules (and
        httpx under them) are a fifth of what a mount would import before it can serve,
        and a restore or a listing needs none of them."""
        if self._pool is None:
            from olliefs.backend import pool as backends

            self._pool = backends.Pool(self.settings)
        return self._pool

    def backend_names(self) -> list[str]:
        from olliefs.backend import pool as backends

        return backends.backend_names()

    def backend(self, name: str) -> Backend:
        try:
            return self.pool.get(name)
        except ValueError as err:
            raise InvalidRequest(str(err)) from None

    async def context_length(self, backend: str, model: str) -> int:
        try:
            return await self.pool.context_length(backend, model)
        except ValueError as err:
            log.info("context length of %s/%s unknown (%s)", backend, model, err)
            return self.default_context_length

    async def fresh_models(self, s: Session, *, refresh: bool = False) -> None:
        """``models``: what the session's backend offers (cached by the pool)."""
        name = s.cfg.backend
        try:
            got = await (self.pool.refresh(name) if refresh else self.pool.models(name))
            s.models_text = "".join(f"{m}\n" for m in got)
        except (BackendError, ValueError) as err:
            s.models_text = f"error: {err}\n"

    async def models_command(self, s: Session) -> None:
        await self.fresh_models(s, refresh=True)
        n = s.models_text.count("\n")
        if s.models_text.startswith("error:"):
            s.error(f"models: {s.models_text.strip()[len('error: ') :]}")
        else:
            s.emit("info", f"models refreshed: {n} from {s.cfg.backend}")

    def default_model(self, backend: str) -> str:
        try:
            return self.pool.default_model(backend)
        except ValueError:
            return DEFAULT_MODEL

    def check_backend(self, name: str) -> None:
        if name not in self.backend_names():
            known = " ".join(self.backend_names())
            raise InvalidRequest(f"unknown backend: {name} (known: {known})")


class Profiles:
    """The agent profiles: the config dir's first, then the shipped ones."""

    def __init__(self, paths: Paths) -> None:
        self.paths = paths
        # Profiles as read during a restore (every session of a profile reads the same);
        # None outside a restore, where each read goes to the file.
        self._profiles: dict[str, dict[str, Any]] | None = None
        # Profiles as built at runtime builds, by file, while the file stays the same.
        self._loaded: dict[Path, tuple[tuple[int, int, int, int], Profile]] = {}

    def caching(self, on: bool) -> None:
        """During a restore, each profile is read once for all its sessions."""
        self._profiles = {} if on else None

    def profile_dirs(self) -> list[Path]:
        return [self.paths.config / "agents", shipped_dir() / "profiles"]

    async def build_runtime(self, name: str, cwd: str, env: Mapping[str, str]) -> Runtime:
        """A profile loaded and built (its prompt commands run in ``cwd``)."""
        dirs = self.profile_dirs()
        path = profile_path(name, dirs)
        profile = await self._load_profile(name, path, dirs)
        return await build_runtime(
            profile,
            name=name,
            cwd=cwd,
            env=base_env() | dict(env),
            profile_dir=path.parent,
            prompt_dirs=[self.paths.config / "prompts", shipped_dir() / "prompts"],
        )

    async def _load_profile(self, name: str, path: Path, dirs: list[Path]) -> Profile:
        """``load_profile``, read and checked again only when its file changed (sessions
        of one profile that build their runtimes one after another read it once)."""
        try:
            st = os.stat(path)
        except OSError:
            stamp = None
        else:
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            got = self._loaded.get(path)
            if got is not None and got[0] == stamp:
                return got[1]
        profile = await trio.to_thread.run_sync(load_profile, name, dirs)
        if stamp is not None:
            self._loaded[path] = (stamp, profile)
        return profile

    def check_agent(self, name: str) -> None:
        if name not in agent_names(self.paths):
            raise InvalidRequest(f"unknown agent profile: {name}")

    def profile(self, agent: str) -> dict[str, Any]:
        """The profile's JSON (config dir first, then shipped); {} when unreadable."""
        if self._profiles is None:
            return self._read_profile(agent)
        got = self._profiles.get(agent)
        if got is None:
            got = self._profiles[agent] = self._read_profile(agent)
        return got

    def _read_profile(self, agent: str) -> dict[str, Any]:
        for d in (self.paths.config / "agents", shipped_dir() / "profiles"):
            try:
                data = msgspec.json.decode((d / f"{agent}.json").read_bytes())
            except FileNotFoundError:
                continue
            except (OSError, msgspec.DecodeError) as err:
                log.warning("profile %s: %s", agent, err)
                return {}
            return data if isinstance(data, dict) else {}
        return {}

    def profile_tools(self, agent: str) -> list[str]:
        """The tools a session of ``agent`` starts with: ``tools`` (default client_9p),
        then ``autoLoad``, each only if allowTools permits it (as ``Runtime``)."""
        prof = self.profile(agent)
        names: list[str] = []
        for key, default in (("tools", list(DEFAULT_TOOLS)), ("autoLoad", [])):
            got = prof.get(key, default)
            if not isinstance(got, list) or not all(isinstance(t, str) for t in got):
                log.warning("profile %s: %s must be a list of names", agent, key)
                got = default
            names += got
        allow = prof.get("allowTools")
        if not isinstance(allow, list) or not all(isinstance(t, str) for t in allow):
            allow = None
        return [t for t in dict.fromkeys(names) if permits(allow, t)]

    def profile_prompt(self, agent: str) -> str:
        prompt = self.profile(agent).get("prompt", "")
        return prompt if isinstance(prompt, str) else ""


class Tools:
    """What toolsrv serves (t/idx, tool metadata, tool_load names), read over the
    daemon's own attach (``link``), so a remote toolsrv is listed as it really is."""

    def __init__(self, paths: Paths, link: ToolLink) -> None:
        self.paths = paths
        self._tree_link = link
        self.catalogue: dict[str, tuple[ToolMeta, dict[str, Any]]] = {}
        self.mcp_status = ""  # toolsrv's mcp file, read with the catalogue
        self._catalogue_at = -1e9
        self.version = 0  # counts the reads of the catalogue (what t/idx and tools show)
        self._catalogue_lock = trio.Lock()

    async def refresh_tools(self, max_age: float = 0.0, probe: Sequence[str] = ()) -> None:
        """Read what toolsrv serves, unless the last read is younger than ``max_age``.

        ``probe``: tool names just written through ``t/``, asked for by name first; an
        unknown name makes toolsrv rescan its dirs at once, where a listing may be up to a
        second old.

        toolsrv not reachable: the catalogue stays as it was and the reason is logged;
        the tree shows what it knew.
        """
        async with self._catalogue_lock:
            if trio.current_time() - self._catalogue_at < max_age:
                return
            try:
                conn = await self._tree_link.conn()
                if probe:
                    await conn.metas(list(probe))
                self.catalogue = await conn.metas(await conn.names())
                self.version += 1
            except ToolsrvError as err:
                log.warning("tool catalogue not read: %s", err)
                return
            self._catalogue_at = trio.current_time()

    async def fresh_catalogue(self) -> None:
        await self.refresh_tools(CATALOGUE_MAX_AGE)

    def tool_meta(self, name: str) -> ToolMeta | None:
        got = self.catalogue.get(name)
        return None if got is None else got[0]

    def known_tools(self, s: Session) -> set[str]:
        return set(self.catalogue) | set(s.agent.link.catalogue)

    def tools_idx_text(self, permits: Callable[[str], bool] = lambda name: True) -> str:
        """``t/idx``: name, description, args schema, tier, parallel flag; tab-separated.
        ``permits``: only the tools it lets through (a session's ``t/idx``)."""
        out = []
        for name, (meta, schema) in sorted(self.catalogue.items()):
            if not permits(name):
                continue
            args = msgspec.json.encode(schema).decode()
            flag = "parallel" if meta.parallel else "serial"
            out.append(f"{name}\t{meta.description}\t{args}\t{meta.tier}\t{flag}\n")
        return "".join(out)

    async def refresh_mcp(self) -> None:
        """Read toolsrv's ``mcp`` file (at each open of ``mcp/idx``), after a listing of
        its ``tools/``, which waits for the servers being listed (a file just written)."""
        try:
            conn = await self._tree_link.conn()
            await conn.names()
            self.mcp_status = await conn.mcp_status()
        except ToolsrvError as err:
            log.warning("MCP servers' state not read: %s", err)

    def mcp_idx_text(self) -> str:
        """``mcp/idx``: toolsrv's view of each MCP server (``McpServers.status``)."""
        return self.mcp_status

    def tool_script(self, name: str) -> Path | None:
        """The script of a tool toolsrv serves, where this machine has it (user's first)."""
        for d in (self.paths.config / "tools", shipped_dir() / "tools"):
            if (d / name).is_file():
                return d / name
        return None
