"""Sandbox profiles, and how a tool process is confined.

A tool runs with read and execute rights on the whole tree but may write only beneath its
*write roots* (the call's cwd, its tmp dir and the profile's extra roots) and to
``/dev/null``. The walls, each covering what the others cannot (toolsrv(8) has the why):

- **Landlock** (the `landlock` package, plus a few lines for network rules and scopes): no
  file writes outside the roots; no TCP bind/connect unless the profile has network; no
  signals to processes outside the call's domain, no abstract unix sockets outside it.
- **A private mount namespace** (root only): everything outside the roots read-only at the
  mount level, so metadata changes (chmod, chown, utimes, xattrs, rename...) that Landlock
  does not govern fail there too; every ``.git`` and ``.ollie`` beneath a root, at any
  depth, read-only (`toolsrv.protect` finds them); the daemon's sockets and secrets hidden.
- **An empty network namespace** (root only), shared by every call without network: no
  TCP, UDP or abstract unix socket reaches the host.
- **No capabilities at all**: effective, permitted, inheritable, ambient and bounding sets
  empty, and no_new_privs, so not even a setuid binary gives any back.
- **A seccomp filter** (`toolsrv.seccomp`): ptrace, keyrings, bpf, mounts, new user
  namespaces, socket families the profile does not allow.

The work is split in two so that spawning stays cheap: `prepare` runs in the server and
builds what can be built ahead (the Landlock ruleset, the list of protected entries, the
seccomp program); `Prepared.enter` applies it all to a thread created for the spawn, whose
restrictions the spawned process inherits. Applying them to a thread rather than in a forked
child lets the spawn use vfork (a full fork of the Python server costs milliseconds) and
never runs Python code between fork and exec.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import operator
import os
import re
import stat
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, TypeVar

import msgspec
from landlock import SyscallError
from landlock.plumbing import (
    CREATE_RULESET_VERSION,
    FSAccess,
    PathBeneathAttr,
    RulesetAttr,
    get_add_rule,
    get_create_ruleset,
    get_restrict_self,
)

from olliewire.checkpoints import PROTECTED_NAMES
from toolsrv import namespaces, seccomp
from toolsrv.checkpoint import Overlay
from toolsrv.protect import ProtectedScan

log = logging.getLogger(__name__)

MiB = 1 << 20
MEMORY_MAX = 2048 * MiB
"""A call's memory cap unless its profile says otherwise (`Profile.memory_max`)."""

# --- Landlock ------------------------------------------------------------------------------
#
# The `landlock` package (pinned in pyproject) gives the ABI query, the filesystem access
# flags and the three ruleset syscalls with their error reasons. It knows nothing of network
# rules and scopes (ABI 4 and 6): what it lacks is the longer ``landlock_ruleset_attr`` below,
# handed to its create_ruleset through a pointer cast, and two sets of bits.
#
# Its syscall wrappers take ``ctypes.get_errno() != 0`` for failure, not the return value,
# and ctypes keeps one private errno per thread for every ``use_errno`` library: after any
# failed call in the same thread (ours or its own), a successful Landlock call would be
# reported as failing with that stale errno. `_ll` clears it before each call.

FS_EXECUTE = int(FSAccess.EXECUTE)
FS_WRITE_FILE = int(FSAccess.WRITE_FILE)
FS_READ_FILE = int(FSAccess.READ_FILE)
FS_READ_DIR = int(FSAccess.READ_DIR)
FS_REFER = int(FSAccess.REFER)  # ABI 2
FS_TRUNCATE = int(FSAccess.TRUNCATE)  # ABI 3
FS_IOCTL_DEV = int(FSAccess.IOCTL_DEV)  # ABI 5
NET_BIND_TCP = 1 << 0  # ABI 4
NET_CONNECT_TCP = 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1  # ABI 6
_RULE_PATH_BENEATH = 1

FS_READ_EXEC = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
# The rights Landlock accepts on a rule for a non-directory.
FS_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
# /dev/null: writable (shells redirect there constantly) but nothing directory-like.
FS_DEV_NULL = FS_WRITE_FILE | FS_TRUNCATE | FS_IOCTL_DEV
# The rights ABI 1 knows: EXECUTE .. MAKE_SYM.
_FS_ABI1 = functools.reduce(
    operator.or_, (int(a) for a in FSAccess if int(a) < int(FSAccess.REFER)), 0
)

_T = TypeVar("_T")


def _ll(what: str, fn: Callable[[], _T]) -> _T:
    """Call into the `landlock` package with the thread's ctypes errno cleared (see above).

    Its SyscallError becomes a one-line OSError saying ``what`` failed and the package's
    reason for that errno (e.g. "Landlock has been disabled at boot time").
    """
    ctypes.set_errno(0)
    try:
        return fn()
    except SyscallError as err:
        why = f" ({err.reason})" if err.reason else ""
        raise OSError(err.errno, f"{what}: {err.strerror}{why}") from None


class _RulesetAttr(ctypes.Structure):
    """``struct landlock_ruleset_attr`` as of ABI 6 (the package's has the first field)."""

    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class SandboxError(Exception):
    """A profile cannot be loaded, or policy forbids running the tool (one-line message)."""


# --- profiles --------------------------------------------------------------------------------


class Profile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One ``sandbox/<name>.toml``: what the tools that name it may do.

    ``unsandboxed = true`` runs the tools without Landlock (no file, network or scope rules,
    so no .git protection either), for kernels that lack it; they keep their own session,
    the limits, the timeout, no_new_privs and the capability drop.

    ``write`` entries add writable roots; they may use ``${VAR}`` (from the call's
    environment) and a leading ``~``. An entry whose variable is unset or whose path does not
    exist is skipped: a profile such as ``ollie`` must not break calls made where the mount
    is absent, it just grants nothing there.
    """

    name: str
    network: bool = False
    unsandboxed: bool = False
    write: list[str] = []
    max_output: Annotated[int, msgspec.Meta(ge=0)] = MiB
    max_procs: Annotated[int, msgspec.Meta(ge=1)] = 256
    max_memory: Annotated[int, msgspec.Meta(ge=0)] = 0
    memory_max: Annotated[int, msgspec.Meta(ge=0)] = MEMORY_MAX
    timeout_cap: Annotated[float, msgspec.Meta(gt=0)] = 600.0


_NAME = re.compile(r"[a-z0-9_-]+")


def load_profile(dirs: Sequence[Path], name: str) -> Profile:
    """Load ``<name>.toml`` from the first of ``dirs`` that has it (user dir before shipped).

    The name is checked before it touches a path, so a tool's meta cannot point outside the
    sandbox dirs. Every problem is a `SandboxError` with a one-line message naming the file.
    """
    if not _NAME.fullmatch(name):
        raise SandboxError(f"invalid sandbox profile name {name!r} (allowed: a-z 0-9 _ -)")
    for d in dirs:
        path = Path(d) / f"{name}.toml"
        try:
            text = path.read_text(encoding="utf-8")
        except (FileNotFoundError, NotADirectoryError):
            continue
        except (OSError, UnicodeDecodeError) as err:
            raise SandboxError(f"{path}: cannot read: {err}") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise SandboxError(f"{path}: invalid TOML: {err}") from None
        if "name" in data:
            raise SandboxError(f"{path}: unknown key 'name' (the file name is the profile name)")
        try:
            return msgspec.convert({**data, "name": name}, Profile, strict=True)
        except msgspec.ValidationError as err:
            raise SandboxError(f"{path}: {err}") from None
    where = ", ".join(str(d) for d in dirs) or "no sandbox dirs"
    raise SandboxError(f"no sandbox profile {name!r} ({name}.toml not found in {where})")


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_write(entries: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """The profile's extra write roots for a call with environment ``env``.

    Expansion uses the call's environment, not the server's: ``${OLLIE}`` is where *this*
    caller's olliefs is mounted. Unusable entries are skipped with a debug log (see Profile).
    """
    out: list[str] = []
    for entry in entries:
        missing = [v for v in _VAR.findall(entry) if not env.get(v)]
        if missing:
            log.debug("sandbox: write entry %r skipped: %s unset", entry, ", ".join(missing))
            continue
        path = _VAR.sub(lambda m: env[m.group(1)], entry)
        if path == "~" or path.startswith("~/"):
            path = (env.get("HOME") or os.path.expanduser("~")) + path[1:]
        if not os.path.isabs(path):
            log.debug("sandbox: write entry %r skipped: %r is not absolute", entry, path)
            continue
        if not os.path.exists(path):
            log.debug("sandbox: write entry %r skipped: %s does not exist", entry, path)
            continue
        out.append(path)
    return out


def is_protected(path: str, write_roots: Sequence[str]) -> bool:
    """Whether ``path`` is, or lies inside, a protected entry (``.git``, ``.ollie``).

    File tools use this to answer "the .git directory is read-only" instead of an opaque
    EROFS/EACCES. A relative ``path`` is taken relative to the first write root (the call's
    cwd); symlinks are resolved, so ``src/link -> ../.git`` is caught too.
    """
    if not os.path.isabs(path) and write_roots:
        path = os.path.join(write_roots[0], path)
    return not PROTECTED_NAMES.isdisjoint(Path(os.path.realpath(path)).parts)


# --- kernel feature probes -------------------------------------------------------------------


@functools.cache
def _probe_abi() -> int:
    try:
        version = _ll("landlock ABI", lambda: get_create_ruleset()(None, 0, CREATE_RULESET_VERSION))
    except OSError as err:  # ENOSYS, EOPNOTSUPP (disabled at boot), or seccomp
        log.debug("%s", err.strerror)
        return 0
    return max(int(version), 0)


mount_namespaces = namespaces.mount_namespaces


def landlock_abi() -> int:
    """The running kernel's Landlock ABI version; 0 if it lacks Landlock or seccomp denies it.

    Looked up through the module at each call (tests replace it to exercise the refusal).
    """
    return _probe_abi()


# --- the restriction -------------------------------------------------------------------------

_warned: set[str] = set()


def warn_once(key: str, msg: str) -> None:
    """Log a warning about a missing kernel feature once per process, not per call."""
    if key not in _warned:
        _warned.add(key)
        log.warning("%s", msg)


@dataclass(eq=False)
class Prepared:
    """A sandbox built in the server for one call; `enter` applies it to a spawning thread.

    ``ruleset_fd`` is None when the profile runs unsandboxed; ``mounts`` is None without
    mount namespaces (or unsandboxed); ``netns_fd`` (not owned) is the shared empty network
    namespace to join, None with network or where there is none; ``seccomp`` the filter.

    The ruleset and the mount namespace are the call's own descriptors, duplicates of
    the ones a cache keeps (`RulesetCache`, `namespaces.MountNsCache`): a cache closes
    its descriptors when it drops an entry (the least recently used; every kept
    namespace when the host's mount table changes), which can happen while the call
    waits for its spawn, and the number of a closed descriptor may be given to another
    ruleset or namespace the moment after.
    """

    ruleset_fd: int | None
    mounts: namespaces.MountPlan | None = None
    netns_fd: int | None = None
    seccomp: seccomp.Loaded | None = None
    network: bool = False
    mount_ns_fd: int | None = None  # (a duplicate of) a kept namespace made to ``mounts``
    keep_ns: bool = False  # `enter` keeps the namespace it makes, in ``built_ns_fd``
    built_ns_fd: int | None = None  # owned until taken (see `take_built_ns`)
    ruleset_key: tuple[object, ...] | None = None  # its key in a `RulesetCache`, if kept
    ns_serial: int | None = None  # which kept namespace ``mount_ns_fd`` is
    owns_netns: bool = False  # ``netns_fd`` is ours (`copy`)
    ids: namespaces.Ids = field(default_factory=dict)  # identities seen preparing it
    overlay: Overlay | None = None  # checkpoints: the overlay over the cwd (toolsrv.checkpoint)

    @property
    def protect(self) -> tuple[str, ...]:
        """The entries made read-only by a bind mount."""
        return self.mounts.protect if self.mounts is not None else ()

    def take_built_ns(self) -> int | None:
        """The namespace `enter` made (``keep_ns``), now the caller's to keep or close."""
        fd, self.built_ns_fd = self.built_ns_fd, None
        return fd

    def join_kept_ns(self, fd: int | None, serial: int | None) -> None:
        """Join (at `enter`) the kept namespace ``fd`` (a cache's: duplicated here), or
        none (None); ``serial`` tells which kept namespace it is."""
        mine = None if fd is None else os.dup(fd)
        if self.mount_ns_fd is not None:
            os.close(self.mount_ns_fd)
        self.mount_ns_fd, self.ns_serial = mine, serial

    def close(self) -> None:
        """Release the descriptors (the restricted processes keep their domain)."""
        if self.ruleset_fd is not None:
            os.close(self.ruleset_fd)
            self.ruleset_fd = None
        for fd in (self.built_ns_fd, self.mount_ns_fd):
            if fd is not None:
                os.close(fd)
        self.built_ns_fd = self.mount_ns_fd = None
        if self.owns_netns and self.netns_fd is not None:
            os.close(self.netns_fd)
        self.netns_fd = None
        self.owns_netns = False

    def key(self) -> tuple[object, ...] | None:
        """What `enter` applies, as a value to compare: two calls whose keys are equal get
        the same sandbox (the same kept ruleset, the same kept mount namespace, the same
        network namespace and filter). None when part of it is this call's alone (a ruleset
        or a namespace not kept): nobody else could have entered it.

        A spawning thread can then enter a call's sandbox ahead of the call
        (`toolsrv.exec.spawn.Spawner.prestart`), for the next call like it.
        """
        if self.ruleset_fd is not None and self.ruleset_key is None:
            return None
        if self.overlay is not None:  # (one call's own upper dir)
            return None
        if self.mounts is not None and (self.mount_ns_fd is None or self.ns_serial is None):
            return None
        return (
            self.ruleset_key,
            self.mounts,
            self.ns_serial,
            self.netns_fd,
            self.seccomp,
            self.network,
        )

    def copy(self) -> Prepared:
        """The same sandbox with descriptors of its own, for a thread that enters it later
        (ours may be closed, and their numbers reused, by then); `close` releases them."""

        def dup(fd: int | None) -> int | None:
            return None if fd is None else os.dup(fd)

        return Prepared(
            dup(self.ruleset_fd),
            self.mounts,
            dup(self.netns_fd),
            self.seccomp,
            self.network,
            mount_ns_fd=dup(self.mount_ns_fd),
            owns_netns=True,
        )

    def enter(self, *, bounding_dropped: bool = False) -> None:
        """Restrict the calling thread for good: mounts, network, capabilities, NNP,
        Landlock, seccomp, in that order (each step needs the privileges the next drops).

        Only for a thread created to spawn the tool and ending right after: credentials,
        capabilities, no_new_privs, the Landlock domain, the seccomp filter and the
        namespaces are all per-thread on Linux, and a child inherits them from the thread
        that forks it. The server's other threads are untouched. ``bounding_dropped``: the
        thread already emptied its bounding set (spare threads do it ahead). The mount
        namespace is ``mount_ns_fd`` when the server kept one made to the same plan, else
        made here (and handed back in ``built_ns_fd`` with ``keep_ns``). Raises OSError
        when a step fails; nothing may be spawned from the thread then.
        """
        if self.mounts is not None:
            if self.mount_ns_fd is not None:
                namespaces.join_mount_ns(self.mount_ns_fd)
            else:
                self.mounts.apply()
                if self.keep_ns:
                    self.built_ns_fd = namespaces.this_mount_ns()
        if self.overlay is not None and self.mounts is not None:
            self.overlay.enter(self.ruleset_fd)  # (checkpoints)
        if self.netns_fd is not None:
            namespaces.setns(self.netns_fd, namespaces.CLONE_NEWNET)
        if not bounding_dropped:
            namespaces.drop_bounding_set()
        namespaces.no_new_privs()
        if self.ruleset_fd is not None:
            fd = self.ruleset_fd
            _ll("landlock_restrict_self", lambda: get_restrict_self()(fd, 0))
        namespaces.drop_all_caps()
        if self.seccomp is not None:
            self.seccomp.load()


class RulesetCache:
    """Landlock rulesets already built, for calls with the same roots (one per session).

    A ruleset can restrict any number of threads, and building one costs a syscall per rule
    plus an open and a stat per path. Its rules hold the inodes they were made from, so the
    key has the identity (st_dev, st_ino) of each root besides its path: a root replaced on
    disk gets a new ruleset. At most ``size`` are kept (least recently used go first).
    """

    def __init__(self, size: int = 32) -> None:
        self.size = size
        self._kept: dict[tuple[object, ...], int] = {}

    def get(self, key: tuple[object, ...]) -> int | None:
        fd = self._kept.pop(key, None)
        if fd is not None:
            self._kept[key] = fd  # most recently used last
        return fd

    def put(self, key: tuple[object, ...], fd: int) -> None:
        self._kept[key] = fd
        while len(self._kept) > self.size:
            old = next(iter(self._kept))
            os.close(self._kept.pop(old))

    def close(self) -> None:
        for fd in self._kept.values():
            os.close(fd)
        self._kept.clear()


def _ruleset_key(
    abi: int, network: bool, roots: Sequence[str], seen: namespaces.Ids
) -> tuple[object, ...] | None:
    ids = namespaces.identities(roots, seen)
    return None if ids is None else (abi, network, tuple(roots), ids)


def _refusal(name: str) -> str:
    return (
        "landlock unavailable: refusing to run tools unsandboxed "
        f"(set unsandboxed = true in sandbox/{name}.toml to allow)"
    )


def fs_rights(abi: int) -> int:
    """Every filesystem access right the given ABI knows (all of them get handled).

    ABI 7 added no access right (only audit flags). A later ABI may add rights this code
    does not know yet: those would stay unhandled, i.e. allowed, until named here.
    """
    rights = _FS_ABI1
    if abi >= 2:
        rights |= FS_REFER
    if abi >= 3:
        rights |= FS_TRUNCATE
    if abi >= 5:
        rights |= FS_IOCTL_DEV
    return rights


_beneath = namespaces.beneath


@dataclass(frozen=True)
class Hidden:
    """The paths hidden from a call's tools, resolved for it (`resolve_hidden`).

    ``dirs`` and ``files``: real paths of the hidden paths that exist (what lies beneath a
    hidden directory is hidden with it); ``named``: the paths as given, whose lookups
    (`namespaces.lookup_chain`) must stay where they lead; ``show``: real paths that exist,
    inside hidden directories, that tools may still read and execute.
    """

    dirs: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    named: tuple[str, ...] = ()
    show: tuple[str, ...] = ()

    def zone(self, path: str) -> str | None:
        """The hidden directory ``path`` lies inside, if any."""
        for d in self.dirs:
            if namespaces.strictly_beneath(path, d):
                return d
        return None

    def holding(self, path: str) -> str | None:
        """The hidden directory that is ``path`` or holds it, if any."""
        for d in self.dirs:
            if _beneath(path, d):
                return d
        return None


def resolve_hidden(
    hide: Sequence[str], show: Sequence[str] = (), ids: namespaces.Ids | None = None
) -> Hidden:
    """Resolve the hidden and shown paths for one call (they may have been made, removed
    or replaced since the last one)."""
    dirs, files = namespaces.split_hidden(hide, ids)
    shown = []
    for path in show:
        real = namespaces.real_path(path, ids)
        if real is not None and any(namespaces.strictly_beneath(real, d) for d in dirs):
            shown.append(real)
    named = tuple(os.path.abspath(h) for h in hide)
    return Hidden(dirs, files, named, tuple(shown))


def clean_roots(
    roots: Sequence[str], ids: namespaces.Ids | None = None, hidden: Hidden | None = None
) -> list[str]:
    """Real paths of the roots that exist, without those inside another root.

    A root inside another needs no rule nor mount of its own, and must not get one: a tool
    may replace it (its parent is writable) with a symlink to "/" between two calls, and a
    mount copied from that path would then make "/" writable. A root inside a directory
    ``hidden`` from tools (the per-session tmp dir inside the daemon's data dir) is kept
    whatever holds it: it is put back inside the hidden directory, and no tool can reach
    its parent to replace it.
    """
    real: list[str] = []
    for root in roots:
        r = namespaces.real_path(root, ids)
        if r is None:
            log.debug("sandbox: write root %s does not exist, skipped", root)
        elif r not in real:
            real.append(r)
    zone = hidden.zone if hidden is not None else (lambda _p: None)
    return [
        r for r in real if not any(o != r and _beneath(r, o) and zone(o) == zone(r) for o in real)
    ]


def outer_roots(roots: Sequence[str]) -> list[str]:
    """The roots not inside another one (a hidden directory's roots are inside theirs)."""
    return [r for r in roots if not any(namespaces.strictly_beneath(r, o) for o in roots)]


def _hidden_plan(
    roots: Sequence[str], hidden: Hidden, ids: namespaces.Ids
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], frozenset[str]]:
    """(hidden dirs, hidden files, shown paths, pins) of a call with ``roots``.

    A hidden directory that is a root (a profile's own write entry) stays visible. A
    shown path inside one of the call's roots in the same hidden directory is writable
    with it. Pins: the entries beneath a root that a lookup of a hidden path passes
    through (`namespaces.lookup_chain`), except those inside hidden directories.
    """
    dirs = tuple(d for d in hidden.dirs if d not in roots)
    kept = Hidden(dirs, hidden.files, hidden.named, hidden.show)
    files = tuple(f for f in hidden.files if f not in roots)
    show = tuple(
        s
        for s in hidden.show
        if kept.zone(s) is not None
        and not any(_beneath(s, r) and kept.zone(r) == kept.zone(s) for r in roots)
    )
    outer = [r for r in roots if kept.zone(r) is None]
    targets = (*dirs, *files, *hidden.named)
    pins: set[str] = set()
    if any(namespaces.strictly_beneath(t, r) for t in targets for r in outer):
        seen: dict[str, os.stat_result | None] = {}
        for name in hidden.named:
            for entry in namespaces.lookup_chain(name, seen):
                if (
                    entry not in dirs
                    and entry not in files
                    and entry not in roots
                    and kept.holding(entry) is None
                    and any(namespaces.strictly_beneath(entry, r) for r in outer)
                ):
                    pins.add(entry)
        for entry in pins:
            st = seen[entry]
            if st is not None:
                ids.setdefault(entry, (st.st_dev, st.st_ino))
    return dirs, files, show, frozenset(pins)


def prepare(
    profile: Profile,
    write_roots: Sequence[str],
    *,
    abi: int | None = None,
    mount_ns: bool | None = None,
    protect: Sequence[str] | None = None,
    hide: Sequence[str] | Hidden = (),
    netns_fd: int | None = None,
    use_seccomp: bool = True,
    rulesets: RulesetCache | None = None,
    clean: Sequence[str] | None = None,
    ids: namespaces.Ids | None = None,
) -> Prepared:
    """Build the sandbox of one call in the server (the expensive half).

    Policy: read + execute everywhere; every write-ish right (WRITE_FILE, REMOVE_*, MAKE_*,
    REFER, TRUNCATE, IOCTL_DEV as the ABI has them) beneath ``write_roots`` only, plus
    write/truncate on ``/dev/null``; TCP bind and connect denied unless ``profile.network``;
    scopes: no signals to processes outside the sandbox, no abstract unix sockets.

    ``hide``: paths no tool may see or change (a `Hidden`, or paths to resolve), wherever
    they are; a root inside a hidden directory (and a shown path) is put back at its path.
    With mount namespaces (``mount_ns``, default: `namespaces.mount_namespaces()`), the rest
    of the tree is read-only at the mount level, the protected entries beneath the roots
    (``protect``, as `ProtectedScan.find` gives them for the `outer_roots`; a fresh full
    scan if None) are read-only binds, and the hidden paths are covered (`MountPlan`).
    Without them only the protected entries at the top of a root are kept, by Landlock
    rules per top-level entry: new top-level files or directories cannot then be created
    (or top-level entries removed or renamed) in such a root, and symlinked top-level
    entries are not writable through; a root holding a hidden path gets such rules down
    the way to it, which stays read-only (but readable).

    ``rulesets``: where Landlock rulesets made for the same roots are kept (with mount
    namespaces only: without them the rules depend on a root's entries, listed per call).
    ``clean``: `clean_roots` of ``write_roots``, when the caller has it already; ``ids``:
    the identities it saw (`namespaces.resolve`), completed here and kept in ``ids`` of the
    result, for the keys of the ruleset and of the mount namespace.

    ``netns_fd``: the empty network namespace a call without network joins (None: none is
    available; the TCP rules and the seccomp filter still hold). An ``unsandboxed`` profile
    gets no Landlock domain and no mount changes (everything is writable): it keeps the
    network namespace, the seccomp filter, the capability drop and NNP.

    Raises SandboxError when Landlock is missing and the profile is not ``unsandboxed``,
    OSError when the kernel refuses a rule.
    """
    abi = landlock_abi() if abi is None else abi
    netns = None if profile.network else netns_fd
    if not profile.network and netns is None:
        warn_once("netns", "no network namespace: tools without network keep the host's")
    filt = seccomp.loaded(profile.network) if use_seccomp else None
    if profile.unsandboxed:
        log.debug("sandbox %s: unsandboxed by profile", profile.name)
        return Prepared(None, netns_fd=netns, seccomp=filt, network=profile.network)
    if abi <= 0:
        raise SandboxError(_refusal(profile.name))
    if not profile.network and abi < 4 and netns is None:
        warn_once("tcp", f"Landlock ABI {abi} < 4 and no network namespace: TCP is not denied")
    ids = {} if ids is None else ids
    hidden = hide if isinstance(hide, Hidden) else resolve_hidden(hide, (), ids)
    roots = clean_roots(write_roots, ids, hidden) if clean is None else list(clean)
    use_ns = namespaces.mount_namespaces() if mount_ns is None else mount_ns
    if use_ns:
        mounts, tops = _mount_plan(roots, hidden, ids, protect), {}
    else:
        mounts, tops = None, _kept_tops(roots, hidden, ids)
    key = None
    if rulesets is not None and not tops:
        key = _ruleset_key(abi, profile.network, roots, ids)
    kept = rulesets.get(key) if rulesets is not None and key is not None else None
    if kept is not None:
        return Prepared(
            os.dup(kept), mounts, netns, filt, profile.network, ruleset_key=key, ids=ids
        )
    fd = _build_ruleset(abi, profile.network, roots, tops)
    prepared = Prepared(fd, mounts, netns, filt, profile.network, ids=ids)
    if key is not None and rulesets is not None:
        try:
            rulesets.put(key, os.dup(fd))
        except BaseException:
            prepared.close()
            raise
        prepared.ruleset_key = key
    return prepared


def _mount_plan(
    roots: list[str], hidden: Hidden, ids: namespaces.Ids, protect: Sequence[str] | None
) -> namespaces.MountPlan:
    """The mount namespace of a call with ``roots`` (see `prepare`)."""
    dirs, files, show, pins = _hidden_plan(roots, hidden, ids)
    if protect is None:
        protect = ProtectedScan(inotify=False).find(outer_roots(roots))
    return namespaces.MountPlan(
        tuple(roots), tuple(protect), dirs, files, show, tuple(sorted(pins))
    )


def _kept_tops(roots: list[str], hidden: Hidden, ids: namespaces.Ids) -> dict[str, frozenset[str]]:
    """Without mount namespaces: the roots whose top-level entries get a rule each (they
    hold a protected name or the way to a hidden path), each with the entries that get none
    (the way to a hidden path, beneath the root)."""
    warn_once(
        "mountns",
        "no mount namespaces: only .git at the top of a write root is protected, "
        "metadata outside the roots (chmod, chown, utimes, xattrs) is not read-only, "
        "and the hidden paths are read-only but not hidden",
    )
    dirs, files, _show, pins = _hidden_plan(roots, hidden, ids)
    keep_out = frozenset((*pins, *dirs, *files))
    tops: dict[str, frozenset[str]] = {}
    for r in roots:
        away = frozenset(p for p in keep_out if namespaces.strictly_beneath(p, r))
        if away or any(os.path.lexists(os.path.join(r, n)) for n in PROTECTED_NAMES):
            tops[r] = away
    return tops


def _build_ruleset(
    abi: int, network: bool, roots: Sequence[str], tops: Mapping[str, frozenset[str]]
) -> int:
    """A new Landlock ruleset (its fd, the caller's) with the rules of `prepare`."""
    handled_fs = fs_rights(abi)
    attr = _RulesetAttr(handled_fs, 0, 0)
    size = 8
    if abi >= 4:
        size = 16
        if not network:
            attr.handled_access_net = NET_BIND_TCP | NET_CONNECT_TCP
    if abi >= 6:
        size = 24
        attr.scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL
    # The package's wrapper is typed for its one-field struct; the kernel reads ``size``.
    ptr = ctypes.cast(ctypes.pointer(attr), ctypes.POINTER(RulesetAttr))
    with contextlib.ExitStack() as stack:
        fd = int(_ll("landlock_create_ruleset", lambda: get_create_ruleset()(ptr, size, 0)))
        stack.callback(os.close, fd)
        _add_rule(fd, "/", FS_READ_EXEC)
        _add_rule(fd, "/dev/null", FS_DEV_NULL & handled_fs, missing_ok=True)
        for root in roots:
            if root in tops:
                _add_entries_except(fd, root, handled_fs, tops[root])
            else:
                _add_rule(fd, root, handled_fs)
        stack.pop_all()  # complete: the caller's
    return fd


def _add_rule(ruleset: int, path: str, access: int, *, missing_ok: bool = False) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            access &= FS_FILE_RIGHTS  # Landlock rejects directory rights on a file (EINVAL)
        # The package's struct lacks the kernel's ``packed``: it is 16 bytes, not 12, with
        # the same first 12, and the kernel reads only those.
        rule = PathBeneathAttr(access, fd)
        _ll(
            f"landlock_add_rule {path}",
            lambda: get_add_rule()(ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), 0),
        )
    finally:
        os.close(fd)


def _add_entries_except(ruleset: int, top: str, access: int, away: frozenset[str]) -> None:
    """Rules for the entries of ``top`` but its protected names, its symlinks and the
    entries in ``away``; a directory in ``away`` that is not itself hidden (the way to a
    hidden path) gets the same treatment, one level down."""
    with os.scandir(top) as it:
        for entry in it:
            if entry.name in PROTECTED_NAMES or entry.is_symlink():
                continue
            if entry.path in away:
                inner = frozenset(p for p in away if namespaces.strictly_beneath(p, entry.path))
                if inner and entry.is_dir(follow_symlinks=False):
                    _add_entries_except(ruleset, entry.path, access, inner)
                continue
            try:
                _add_rule(ruleset, entry.path, access)
            except FileNotFoundError:  # removed meanwhile
                continue


add_rule = _add_rule
