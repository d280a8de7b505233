"""The tool registry: which tools exist, what they declare, and which ones an agent loaded.

A tool is a program, not a Python object. Keeping tools as plain executables is what lets a
user drop a shell script into ``tools/`` (or ``t/`` of the mounted tree) and have it offered
to the model at once, in any language, with nothing to register and nothing to restart.
This module only *reads* tools; running them (``exec.py``) and confining them
(``sandbox.py``) live elsewhere.

The tool script contract
========================

Files and names
    A tool is an executable regular file in a tools dir. Its name is the file name minus its
    last extension (``file_read``, ``file_read.py`` and ``file_read.sh`` all name
    ``file_read``) and must match ``[a-z][a-z0-9_]*``. Dotfiles and editor backups (names
    ending in ``~``, ``.swp``, ``.swo``, ``.swx``, ``.tmp``, ``.bak``, ``.orig``, ``.rej``)
    are ignored; so are subdirectories and anything that is not a regular file (symlinks are
    followed). Every other file is a candidate, and a candidate that is not executable, has a
    bad name or a bad header is left out and reported in :meth:`ToolRegistry.errors`.

Precedence
    Dirs are searched in the order given: the user's config ``tools/`` first, then the
    shipped ``agents/tools/``. The first *executable* file of a name claims it, even if its
    header is broken: a user's broken override makes the tool disappear (with an error)
    instead of silently running a different program than the one the user wrote. A
    non-executable file claims nothing (a copy that lost its ``x`` bit falls back to the
    shipped tool, reported). Two executables of one name in one dir: the first in sorted
    file-name order wins, the other is reported.

Invocation (by toolsrv)
    The file is executed directly; the kernel reads its ``#!`` line.

    * stdin: the call's arguments, one JSON object, then EOF (a tool may exit without
      reading it, so a broken pipe on that write is not a failure of the call);
    * cwd: the session's cwd;
    * env: only a small base (``PATH``, ``HOME``, ``LANG``, ``TMPDIR`` = the session's tmp
      dir) plus ``OLLIE`` (mount point of the ollie tree), ``OLLIE_SESSION_ID``,
      ``OLLIE_AGENT``, ``OLLIE_CWD``, ``OLLIE_MEMORY_DIR`` (memory notes dir) and
      ``OLLIE_TMP`` (same as ``TMPDIR``). Never a key or token;
    * stdout: the result text (UTF-8);
    * exit status 0: success. Non-zero: the result has ``isError``; the tool explains on
      stderr. The error content is the stdout text (if any) followed by the stderr text, so
      a tool may print partial output and still fail (``execute_code`` prints the command's
      output on stdout and ``exit status N`` last).
    * the process runs in its own process group under a Landlock sandbox applied by toolsrv
      before exec (write only cwd, the tmp dir and the roots of the tool's sandbox profile;
      no TCP unless the profile allows it), with the header's timeout. Scripts do not
      sandbox themselves.

The header
    Line 1 is the ``#!`` line. Line 2 opens the header and every header line is a comment
    with the prefix chosen by line 2: ``#``, ``//`` or ``--`` (for languages whose comment
    is not ``#``; the kernel still needs ``#!`` on line 1). Only the first 64 KiB of a
    file are read. Grammar, with ``P`` the prefix::

        line 2     P ollie-tool                     (spaces around "ollie-tool" optional)
        entry      P key: value                     (at most one space after P;
                                                     key = [A-Za-z_][A-Za-z0-9_-]*)
        more       P  continuation                  (two or more spaces after P: continues
                                                     the value of the entry above; args only)

    The header ends at the first line that is neither an entry nor a continuation: a
    non-comment line, a line with another prefix, a comment that is empty or all blanks,
    or a comment whose text does not start with ``key:`` (so prose may follow the header
    after a blank ``#`` line). Keys:

    ============  ========  ====================================================
    key           required  value
    ============  ========  ====================================================
    description   yes       one line, not empty
    args          yes       a JSON Schema for the arguments object:
                            ``{"type": "object", ...}``; ``properties`` (if
                            given) an object of objects, ``required`` (if given)
                            a list of names from ``properties``. The JSON may go
                            on over continuation lines.
    tier          no        ``hot`` (default), ``warm`` or ``cold``: what happens
                            to the result at compaction (SPEC 4)
    parallel      no        ``true`` or ``false`` (default): read-safe, may run
                            concurrently with other parallel calls
    timeout       no        seconds, ``60`` by default, digits with an optional
                            fraction, > 0
    sandbox       no        profile name ``[a-z0-9_-]+``, ``default`` by default
    ============  ========  ====================================================

    Values are stripped of surrounding blanks; continuation lines are joined to the value
    with newlines. An unknown key, a bad value, a duplicate key, invalid JSON, a missing
    required key or a continuation of a key other than ``args`` raises :class:`ToolError`
    with ``path:line: reason`` (line 2 for a missing key).

Errors
    :meth:`ToolRegistry.errors` maps the path of each file left out to its reason: the header
    error, ``not executable (chmod +x)``, ``bad tool name ...``, ``duplicate tool name
    ...``, ``broken symlink``. An executable shadowed by an earlier dir is not reported (it
    would not be used anyway). Each new or changed reason is logged once at WARNING.

Example::

    #!/usr/bin/env python3
    # ollie-tool
    # description: Read a text file with line numbers.
    # args: {"type": "object", "required": ["path"],
    #   "properties": {"path": {"type": "string"}}}
    # tier: cold
    # parallel: true

Rescans
=======

:meth:`ToolRegistry.tools` is called on every ``tools/`` walk and every call, so it must be cheap
when nothing changed: it stats each dir and each known file and re-reads only the files
whose (mtime, size, mode, inode) changed, re-lists only the dirs whose mtime changed. A
timestamp is only as fine as the file system's clock tick, so two changes within one tick
could look like one; as git does with its index, entries whose mtime is within
``RACY_SECONDS`` of the scan are treated as changed again on the next call. This module does
blocking file I/O; it is a handful of ``stat`` calls, cheap enough for the trio thread.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import stat
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from olliewire import ToolMeta
from toolsrv.protect import FILE_EVENTS, Inotify

__all__ = [
    "HEADER_LIMIT",
    "KEYS",
    "NAME_RE",
    "AgentTools",
    "ToolError",
    "ToolInfo",
    "ToolRegistry",
    "parse_header",
    "tool_name",
]

log = logging.getLogger(__name__)

Tier = Literal["hot", "warm", "cold"]

NAME_RE = re.compile(r"[a-z][a-z0-9_]*")
"""A tool name: also a 9P file name, a function name for every provider, and a ctl token."""

HEADER_LIMIT = 64 * 1024
"""Bytes of a file read for its header: a binary dropped into tools/ costs no more than this."""

KEYS = ("description", "args", "tier", "parallel", "timeout", "sandbox")

RACY_SECONDS = 2.0
"""Entries modified this recently are checked again at the next scan (coarse clocks; FAT's
2-second mtime is the coarsest a tools dir is likely to live on)."""

_PREFIXES = ("#", "//", "--")
_KEY_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_-]*):(.*)")
_TIMEOUT_RE = re.compile(r"[0-9]+(\.[0-9]+)?")
_SANDBOX_RE = re.compile(r"[a-z0-9_-]+")
_TIERS: tuple[Tier, ...] = ("hot", "warm", "cold")
_BACKUP_SUFFIXES = ("~", ".swp", ".swo", ".swx", ".tmp", ".bak", ".orig", ".rej")


class ToolError(Exception):
    """A tool is unusable or a request about tools is wrong; the message says why.

    Header errors read ``path:line: reason``; agent errors ``unknown tool: x`` and
    ``not loaded: x``. The message is shown to users and models as is.
    """


class ToolInfo(msgspec.Struct, frozen=True):
    """What a tool declares in its header, plus where it lives.

    ``args`` is the JSON Schema of the arguments object, passed to the model unchanged.
    """

    name: str
    description: str
    args: dict[str, Any]
    tier: Tier
    parallel: bool
    timeout: float
    sandbox: str
    path: str
    server: str = ""  # an MCP server's tool (toolsrv.mcp): the server's name
    remote: str = ""  # ... and the tool's own name there

    def meta(self) -> ToolMeta:
        """The wire form of ``tools/<name>/meta`` (everything but the schema and the path)."""
        return ToolMeta(
            self.name, self.description, self.tier, self.parallel, self.timeout, self.sandbox
        )


def tool_name(file_name: str) -> str:
    """The tool name a file provides: its name minus its last extension."""
    return os.path.splitext(file_name)[0]


# ---- the header ------------------------------------------------------------------------


def parse_header(text: str, name: str, path: str) -> ToolInfo:
    """Parse the ``ollie-tool`` header of a tool file (see the module docstring).

    ``text`` is the start of the file (a cut last line is harmless: the header must end
    before it). Raises :class:`ToolError` naming ``path`` and a 1-based line number.
    """
    lines = text.split("\n")

    def err(lineno: int, msg: str) -> ToolError:
        return ToolError(f"{path}:{lineno}: {msg}")

    if not lines[0].startswith("#!"):
        raise err(1, "first line must be a #! line (toolsrv executes the file directly)")
    marker = lines[1].rstrip("\r") if len(lines) > 1 else ""
    prefix = next(
        (p for p in _PREFIXES if marker.startswith(p) and marker[len(p) :].strip() == "ollie-tool"),
        None,
    )
    if prefix is None:
        raise err(2, "no header: line 2 must be '# ollie-tool' (or '// ollie-tool', '-- ...')")

    # Collect (key, first line number, value text); continuation lines extend the value.
    entries: list[tuple[str, int, list[str]]] = []
    for index in range(2, len(lines)):
        lineno = index + 1
        line = lines[index].rstrip("\r")
        if not line.startswith(prefix):
            break
        rest = line[len(prefix) :]
        if not rest.strip():
            break
        if rest.startswith("  "):
            if not entries:
                raise err(lineno, "continuation line with no key above it")
            key = entries[-1][0]
            if key != "args":
                raise err(lineno, f"only args may go on over several lines, not {key}")
            entries[-1][2].append(rest.strip())
            continue
        m = _KEY_RE.fullmatch(rest.removeprefix(" "))
        if m is None:
            break
        entries.append((m.group(1), lineno, [m.group(2).strip()]))

    fields: dict[str, tuple[int, str]] = {}
    for key, lineno, parts in entries:
        if key not in KEYS:
            raise err(lineno, f"unknown key {key!r} (known: {', '.join(KEYS)})")
        if key in fields:
            raise err(lineno, f"duplicate key {key!r} (first on line {fields[key][0]})")
        fields[key] = (lineno, "\n".join(parts))

    for key in ("description", "args"):
        if key not in fields:
            raise err(2, f"missing required key {key!r}")

    desc_line, description = fields["description"]
    if not description:
        raise err(desc_line, "description is empty")
    args = _parse_args(*fields["args"], err)

    tier: Tier = "hot"
    if "tier" in fields:
        lineno, value = fields["tier"]
        found = next((t for t in _TIERS if t == value), None)
        if found is None:
            raise err(lineno, f"tier must be hot, warm or cold, not {value!r}")
        tier = found

    parallel = False
    if "parallel" in fields:
        lineno, value = fields["parallel"]
        if value not in ("true", "false"):
            raise err(lineno, f"parallel must be true or false, not {value!r}")
        parallel = value == "true"

    timeout = 60.0
    if "timeout" in fields:
        lineno, value = fields["timeout"]
        if not _TIMEOUT_RE.fullmatch(value) or not 0 < float(value) < math.inf:
            raise err(lineno, f"timeout must be a number of seconds > 0, not {value!r}")
        timeout = float(value)

    sandbox = "default"
    if "sandbox" in fields:
        lineno, value = fields["sandbox"]
        if not _SANDBOX_RE.fullmatch(value):
            raise err(lineno, f"sandbox must be a profile name [a-z0-9_-]+, not {value!r}")
        sandbox = value

    return ToolInfo(
        name=name,
        description=description,
        args=args,
        tier=tier,
        parallel=parallel,
        timeout=timeout,
        sandbox=sandbox,
        path=path,
    )


def _reject_constant(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")


def _parse_args(lineno: int, value: str, err: Callable[[int, str], ToolError]) -> dict[str, Any]:
    """Decode and sanity-check the args schema.

    The stdlib ``json`` rather than msgspec here: its errors carry a line and column that map
    straight onto the file's continuation lines, which is what a user fixing a header needs.
    Only the shape that every provider relies on is checked (an object schema, properties,
    required); the rest of the schema is the model's business.
    """
    try:
        schema = json.loads(value, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        msg = f"args is not valid JSON: {e.msg} (column {e.colno})"
        raise err(lineno + e.lineno - 1, msg) from None
    except ValueError as e:  # NaN / Infinity, or an integer beyond int's digit limit
        raise err(lineno, f"args is not valid JSON: {e}") from None
    except RecursionError:
        raise err(lineno, "args is not valid JSON: nested too deeply") from None
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise err(lineno, 'args must be a JSON Schema object with "type": "object"')
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(p, dict) for p in props.values()):
        raise err(lineno, "args: properties must be an object mapping names to schemas")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise err(lineno, "args: required must be a list of property names")
    missing = [r for r in required if r not in props]
    if missing:
        raise err(lineno, f"args: required names unknown properties: {', '.join(missing)}")
    return schema


# ---- the registry ----------------------------------------------------------------------


class _File(msgspec.Struct):
    """What the last scan learnt about one file; reused while its signature is unchanged."""

    sig: tuple[int, int, int, int]
    racy: bool
    executable: bool
    info: ToolInfo | None
    error: str | None


class _Dir(msgspec.Struct):
    mtime_ns: int
    racy: bool
    names: list[str]


def _ignored(file_name: str) -> bool:
    return file_name.startswith(".") or file_name.endswith(_BACKUP_SUFFIXES)


def _read_head(path: str) -> tuple[str, bool]:
    """The first ``HEADER_LIMIT`` bytes as text, and whether the file goes on beyond them."""
    with open(path, "rb") as f:
        data = f.read(HEADER_LIMIT + 1)
    return data[:HEADER_LIMIT].decode("utf-8", errors="replace"), len(data) > HEADER_LIMIT


class ToolRegistry:
    """Every tool available from a list of dirs, rescanned as the dirs change.

    ``dirs`` are searched in order and earlier dirs win on a name clash. A dir that does
    not exist (yet) simply provides nothing.
    """

    def __init__(self, dirs: Sequence[Path], *, max_age: float = 0.0, watch: bool = False) -> None:
        """``max_age``: a scan younger than this many seconds is trusted without looking at
        the disk (toolsrv sets it so that a tool call costs no directory walk); a name that
        is not found always triggers a fresh scan, so a new tool is seen at once.
        ``watch``: the dirs are watched (inotify) too, and any change in one (a script
        made, written, chmod-ed, renamed or removed) makes the next look scan again at
        once; ``max_age`` stays the bound for what a watch cannot see (a dir made later,
        a script's symlink target changed elsewhere)."""
        self.max_age = max_age
        self._watch = Inotify() if watch else None
        self._watched: set[Path] = set()
        self._last_scan = -math.inf
        self.dirs = [Path(d) for d in dirs]
        self._dirs: dict[Path, _Dir] = {}
        self._files: dict[str, _File] = {}
        self._tools: dict[str, ToolInfo] = {}
        self._errors: dict[str, str] = {}
        self._scanned = False
        # The tools of MCP servers (toolsrv.mcp), offered beside the scripts; a script of
        # the same name wins.
        self.extra: Callable[[], dict[str, ToolInfo]] | None = None

    def _all(self) -> dict[str, ToolInfo]:
        return self._tools if self.extra is None else {**self.extra(), **self._tools}

    def tools(self) -> dict[str, ToolInfo]:
        """Name → info of every usable tool, after a rescan of whatever changed."""
        self._maybe_rescan()
        return dict(self._all())

    def _maybe_rescan(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_scan >= self.max_age or self._changed():
            self._rescan()
            self._last_scan = now

    def _changed(self) -> bool:
        """A watched dir changed since the last look (one non-blocking read)."""
        if self._watch is None:
            return False
        wds, lost = self._watch.read()
        return bool(wds) or lost

    def _watch_dirs(self) -> None:
        if self._watch is None:
            return
        for d in self.dirs:
            if d not in self._watched and self._watch.add(str(d), FILE_EVENTS) is not None:
                self._watched.add(d)  # a dir removed later: max_age sees what follows

    def __contains__(self, name: str) -> bool:
        self._maybe_rescan()
        if name in self._all():
            return True
        self._maybe_rescan(force=True)
        return name in self._all()

    def errors(self) -> dict[str, str]:
        """Path → reason for every file left out (bad header, not executable, ...)."""
        self._rescan()
        return dict(self._errors)

    def get(self, name: str) -> ToolInfo:
        """The info of one tool; ``KeyError`` if there is no usable tool of that name."""
        if name not in self:
            raise KeyError(name)
        return self._all()[name]

    def _rescan(self) -> None:
        self._watch_dirs()  # first, so that a change during the scan is seen next time
        now = time.time_ns()
        racy_ns = int(RACY_SECONDS * 1e9)
        changed = not self._scanned
        files: dict[str, _File] = {}
        listing: list[tuple[Path, list[str]]] = []
        for d in self.dirs:
            names, dir_changed = self._list(d, now, racy_ns)
            changed |= dir_changed
            listing.append((d, names))
            for file_name in names:
                path = os.path.join(d, file_name)
                entry = self._file(path, file_name, now, racy_ns)
                if entry is None:
                    continue
                files[path] = entry
                changed |= entry is not self._files.get(path)
        changed |= files.keys() != self._files.keys()
        self._files = files
        self._scanned = True
        if changed:
            self._rebuild(listing)

    def _list(self, d: Path, now: int, racy_ns: int) -> tuple[list[str], bool]:
        """The candidate file names of one dir, and whether the listing changed."""
        try:
            st = d.stat()
        except OSError:
            return [], self._dirs.pop(d, None) is not None
        cached = self._dirs.get(d)
        if cached is not None and cached.mtime_ns == st.st_mtime_ns and not cached.racy:
            return cached.names, False
        try:
            names = sorted(n for n in os.listdir(d) if not _ignored(n))
        except OSError:
            names = []
        self._dirs[d] = _Dir(st.st_mtime_ns, now - st.st_mtime_ns < racy_ns, names)
        return names, cached is None or cached.names != names

    def _file(self, path: str, file_name: str, now: int, racy_ns: int) -> _File | None:
        """The (possibly cached) scan result of one file; None for non-candidates."""
        cached = self._files.get(path)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if not os.path.islink(path):
                return None  # removed since the listing; the dir's mtime says so next time
            new = _File((0, 0, 0, 0), True, False, None, "broken symlink")
        except OSError as e:
            new = _File((0, 0, 0, 0), True, False, None, f"cannot stat: {e.strerror}")
        else:
            if not stat.S_ISREG(st.st_mode):
                return None
            sig = (st.st_mtime_ns, st.st_size, st.st_mode, st.st_ino)
            if cached is not None and cached.sig == sig and not cached.racy:
                return cached
            new = self._examine(path, tool_name(file_name), sig, now - st.st_mtime_ns < racy_ns)
        if cached is not None and (cached.executable, cached.info, cached.error) == (
            new.executable,
            new.info,
            new.error,
        ):
            # Same outcome (a racy entry read again, a touch): keep the old object, so the
            # scan sees no change and nothing is rebuilt or logged.
            cached.sig, cached.racy = new.sig, new.racy
            return cached
        return new

    @staticmethod
    def _examine(path: str, name: str, sig: tuple[int, int, int, int], racy: bool) -> _File:
        """Read and judge one regular file whose signature is new."""
        executable = os.access(path, os.X_OK)
        if not NAME_RE.fullmatch(name):
            error = f"bad tool name {name!r}: must match [a-z][a-z0-9_]*"
            return _File(sig, racy, executable, None, error)
        if not executable:
            return _File(sig, racy, executable, None, "not executable (chmod +x)")
        cut = False
        try:
            text, cut = _read_head(path)
            return _File(sig, racy, executable, parse_header(text, name, path), None)
        except ToolError as e:
            error = str(e)
            if cut:
                error += f" (only the first {HEADER_LIMIT // 1024} KiB are read)"
        except OSError as e:
            error = f"cannot read: {e.strerror}"
        return _File(sig, racy, executable, None, error)

    def _rebuild(self, listing: Iterable[tuple[Path, list[str]]]) -> None:
        tools: dict[str, ToolInfo] = {}
        claimed: dict[str, str] = {}  # name -> path of the file that claimed it
        errors: dict[str, str] = {}
        for d, names in listing:
            seen_here: dict[str, str] = {}
            for file_name in names:
                path = os.path.join(d, file_name)
                entry = self._files.get(path)
                if entry is None:
                    continue
                name = tool_name(file_name)
                if entry.executable and NAME_RE.fullmatch(name):
                    if name in seen_here:
                        errors[path] = f"duplicate tool name {name!r}: {seen_here[name]} is used"
                        continue
                    seen_here[name] = path
                    if name in claimed:
                        continue  # shadowed by an earlier dir: the intended override
                    claimed[name] = path
                if entry.error is not None:
                    errors[path] = entry.error
                elif entry.info is not None:
                    tools[name] = entry.info
        for path, msg in errors.items():
            if self._errors.get(path) != msg:
                log.warning("tool %s left out: %s", path, msg)
        self._tools = tools
        self._errors = errors


# ---- an agent's loaded tools -----------------------------------------------------------


class AgentTools:
    """The tools one agent has loaded (``agent/ctl``, ``agent/loaded``, ``agent/rev``).

    ``loaded()`` is what the agent asked for, in load order; ``infos()`` is what it can
    use now. They differ when a loaded tool is deleted from disk (or breaks): it vanishes
    from ``infos()`` but stays loaded, and comes back when the file does.

    ``rev`` changes whenever what the agent sees changes: a load or unload, and also a
    loaded tool appearing, disappearing or changing its header on disk, so an agent that
    rebuilds its tool schemas when ``rev`` moves also picks up edited tools.

    ``initial`` (the profile's tool list) is loaded as is, without a ``rev`` bump; names
    with no tool behind them are kept, logged and left out of ``infos()`` until they exist.
    """

    def __init__(self, registry: ToolRegistry, initial: Sequence[str] = ()) -> None:
        self.registry = registry
        self._loaded: list[str] = []
        self._rev = 0
        for name in initial:
            if name not in self._loaded:
                self._loaded.append(name)
        available = registry.tools()
        missing = [n for n in self._loaded if n not in available]
        if missing:
            # Not an error: attach must not fail over a profile's tool list, and a name
            # loaded before its file exists is exactly a tool deleted from disk (below).
            log.warning("initial tools not found (loaded anyway): %s", ", ".join(missing))
        self._seen = self._snapshot()

    @property
    def rev(self) -> int:
        """A counter bumped on every change of the loaded set or of a loaded tool."""
        self._sync()
        return self._rev

    def loaded(self) -> list[str]:
        return list(self._loaded)

    def infos(self) -> list[ToolInfo]:
        """Infos of the loaded tools that exist now, in load order."""
        tools = self.registry.tools()
        return [tools[n] for n in self._loaded if n in tools]

    def load(self, name: str) -> None:
        """Load a tool; loading a loaded tool changes nothing (and does not bump ``rev``)."""
        if name not in self.registry:
            raise ToolError(f"unknown tool: {name}")
        if name in self._loaded:
            return
        self._change(lambda: self._loaded.append(name))

    def unload(self, name: str) -> None:
        if name not in self._loaded:
            raise ToolError(f"not loaded: {name}")
        self._change(lambda: self._loaded.remove(name))

    def _change(self, apply: Callable[[], None]) -> None:
        self._sync()  # a disk change that happened before this one counts on its own
        apply()
        self._seen = self._snapshot()
        self._rev += 1

    def _sync(self) -> None:
        now = self._snapshot()
        if now != self._seen:
            self._seen = now
            self._rev += 1

    def _snapshot(self) -> tuple[tuple[str, ...], tuple[ToolInfo, ...]]:
        return tuple(self._loaded), tuple(self.infos())
