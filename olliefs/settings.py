"""Where olliefs keeps things on disk and which settings it runs with.

Paths follow the XDG base directories (through platformdirs); ``OLLIE_HOME`` overrides all
of them with one folder holding ``config/ state/ data/ run/`` (tests use it so that each
test owns a private world).

Settings are ``KEY=VALUE`` pairs: the config ``env`` file gives defaults, the process
environment overrides them. Keys, tokens and URLs live only here, never in the tree.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import platformdirs

APP = "ollie"


@dataclass(frozen=True)
class Paths:
    config: Path
    state: Path
    data: Path
    run: Path

    @property
    def sessions(self) -> Path:
        return self.state / "sessions"

    @property
    def transcripts(self) -> Path:
        return self.state / "transcripts"

    @property
    def memory(self) -> Path:
        """Memory notes (``memory_remember``); must exist for the sandbox to allow writes."""
        return self.data / "memory"

    @property
    def scratch(self) -> Path:
        """``tmp/`` of the tree: the user's scratch files (toolsrv's per-session tmp dirs
        are ``data/tmp``, which it owns and cleans)."""
        return self.data / "scratch"

    @property
    def env_file(self) -> Path:
        return self.config / "env"

    @property
    def pid_file(self) -> Path:
        return self.run / "ollie.pid"

    @property
    def lock_file(self) -> Path:
        return self.state / "daemon.lock"

    @property
    def log_file(self) -> Path:
        return self.state / "daemon.log"

    def ensure(self) -> None:
        """Every folder made private (0700): journals, logs and transcripts hold the
        conversations, and the config folder may hold keys in ``env``."""
        for d in (self.config, self.state, self.data, self.run):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(d, 0o700)
        for d in (self.sessions, self.transcripts, self.memory, self.scratch):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)


def private_file(path: Path) -> None:
    """Create ``path`` 0600 if missing, make it 0600 if not (a log from an older version)."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600))
    os.chmod(path, 0o600)


def paths(environ: Mapping[str, str] | None = None) -> Paths:
    env = os.environ if environ is None else environ
    home = env.get("OLLIE_HOME")
    if home:
        root = Path(home).expanduser().absolute()
        return Paths(root / "config", root / "state", root / "data", root / "run")
    runtime = env.get("XDG_RUNTIME_DIR")
    run = Path(runtime) / APP if runtime else Path(f"/tmp/ollie-{os.getuid()}")
    return Paths(
        Path(platformdirs.user_config_dir(APP)),
        Path(platformdirs.user_state_dir(APP)),
        Path(platformdirs.user_data_dir(APP)),
        run,
    )


def parse_env_file(text: str) -> dict[str, str]:
    """``KEY=VALUE`` lines; ``#`` comments, blank lines, ``export`` and quotes allowed."""
    out: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not key:
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key] = value
    return out


def load_settings(p: Paths, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The config ``env`` file as defaults, overridden by the process environment."""
    env = os.environ if environ is None else environ
    settings: dict[str, str] = {}
    try:
        settings.update(parse_env_file(p.env_file.read_text()))
    except FileNotFoundError:
        pass
    settings.update(
        {k: v for k, v in env.items() if k.startswith("OLLIE") or k.endswith("_API_KEY")}
    )
    return settings


@functools.cache
def shipped_dir() -> Path:
    """The project's ``agents/`` folder, installed as package data ``olliefs._agents``.

    Found once: the installed package does not move while the daemon runs, and the
    search (an importlib lookup) cost a restore three per session and a render of
    ``systemprompt`` one per stat.
    """
    spec = importlib.util.find_spec("olliefs._agents")
    if spec is None or spec.origin is None:
        raise RuntimeError("olliefs is not installed properly: olliefs._agents is missing")
    return Path(spec.origin).parent


# Where earlier versions copied each shipped folder: (shipped sub-folder, config sub-folder).
COPIED = (("profiles", "agents"), ("tools", "tools"), ("sandbox", "sandbox"))
MIGRATION = "shipped-copies-removed"


def install_defaults(p: Paths) -> None:
    """Undo what earlier versions did here: copy the shipped defaults into the config dir.

    Nothing shipped is copied any more (SPEC 2): profiles, tools, prompts and sandbox
    files are read from the installed package, behind the user's own files of the same
    name, so an upgrade reaches every default the user did not override. What an earlier
    version copied would pin the old default for good, so a copy byte-identical to the
    shipped file is removed; every other file of a shipped name is the user's change and
    stays (``ollie doctor`` lists it as an override). A config sub-folder left empty is
    removed too (the copying made it).

    This runs once per install (a line in ``state/migrations``): afterwards a copy the
    user makes on purpose, say to pin a default against upgrades, is the user's file.
    """
    done = p.state / "migrations"
    try:
        applied = done.read_text().split()
    except FileNotFoundError:
        applied = []
    if MIGRATION in applied:
        return
    remove_shipped_copies(p)
    with open(done, "a") as f:
        f.write(MIGRATION + "\n")


def remove_shipped_copies(p: Paths) -> list[Path]:
    """Remove the config files byte-identical to the shipped file they copy; the removed."""
    removed: list[Path] = []
    src = shipped_dir()
    for sub, dest in COPIED:
        folder = p.config / dest
        for f in sorted((src / sub).glob("*")) if (src / sub).is_dir() else []:
            copy = folder / f.name
            if not f.is_file() or copy.is_symlink() or not copy.is_file():
                continue
            if _same_bytes(f, copy):
                copy.unlink()
                removed.append(copy)
        try:
            folder.rmdir()  # only if empty
        except OSError:
            pass
    return removed


def _same_bytes(a: Path, b: Path) -> bool:
    try:
        if a.stat().st_size != b.stat().st_size:
            return False
        return a.read_bytes() == b.read_bytes()
    except OSError:
        return False


def agent_names(p: Paths) -> set[str]:
    names = {f.stem for f in (shipped_dir() / "profiles").glob("*.json")}
    names.update(f.stem for f in (p.config / "agents").glob("*.json"))
    return names
