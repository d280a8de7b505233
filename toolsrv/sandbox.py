"""Sandbox profiles and the Landlock confinement of tool processes.

A tool runs with read and execute rights on the whole tree but may write only beneath its
*write roots* (the call's cwd, its tmp dir and the profile's extra roots) and to
``/dev/null``; TCP bind/connect is denied unless the profile allows network; it may not
signal processes outside its sandbox nor reach abstract unix sockets (Landlock scopes). The
``.git`` directory at the top of each write root stays read-only although it lies beneath a
writable root: Landlock rules only add rights, so that exception is a read-only bind mount in
a private mount namespace (or, where namespaces are not available, per-entry rules). Tools
also run with no_new_privs and, when the server is root, without the capabilities Landlock
does not cover (module loading, network administration, reboot...: see ``_CAPS_KEPT``).

Known gaps, all Landlock's: UDP and pathname unix sockets are not restricted (a root tool
can reach e.g. /var/run/docker.sock); a future ABI's new access rights stay allowed until
`fs_rights` names them.

The work is split in two so that spawning stays cheap: `prepare` runs in the server and
builds the Landlock ruleset (opening paths, adding rules); `Prepared.enter` is the cheap
part, a handful of syscalls run in a thread created for the spawn, whose restrictions the
spawned process inherits. Applying them to a thread rather than in a forked child lets the
spawn use vfork (a full fork of the Python server costs milliseconds) and never runs Python
code between fork and exec.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import operator
import os
import re
import stat
import threading
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
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

log = logging.getLogger(__name__)

MiB = 1 << 20

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


# --- other kernel constants ------------------------------------------------------------------

_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOEXEC = 8
_MS_REMOUNT = 32
_MS_NOATIME = 1024
_MS_NODIRATIME = 2048
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_MS_RELATIME = 1 << 21
_ST_RELATIME = 4096
_CAP_VERSION_3 = 0x20080522

# Capabilities a root tool keeps: Docker's default set without MKNOD (a device node made in a
# write root would be writable through Landlock), SETPCAP and SETFCAP. Everything else goes,
# because Landlock does not cover it: CAP_SYS_MODULE loads kernel code, CAP_NET_ADMIN rewires
# the host network, CAP_SYS_BOOT reboots, CAP_SYS_RESOURCE/CAP_SYS_ADMIN ignore RLIMIT_NPROC,
# CAP_SYS_PTRACE could reach the server through the spawning thread. NET_RAW (raw sockets
# bypass the TCP rules) is kept only for profiles with network.
_CAPS_KEPT = frozenset({0, 1, 3, 4, 5, 6, 7, 10, 18, 29})  # CHOWN .. AUDIT_WRITE
_CAP_NET_RAW = 13

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _oserror(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


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
    """Whether ``path`` is, or lies inside, a ``.git`` directory (so tools must not write it).

    File tools use this to answer "the .git directory is read-only" instead of an opaque
    EROFS/EACCES. A relative ``path`` is taken relative to the first write root (the call's
    cwd); symlinks are resolved, so ``src/link -> ../.git`` is caught too.
    """
    if not os.path.isabs(path) and write_roots:
        path = os.path.join(write_roots[0], path)
    return ".git" in Path(os.path.realpath(path)).parts


# --- kernel feature probes -------------------------------------------------------------------


@functools.cache
def _probe_abi() -> int:
    try:
        version = _ll("landlock ABI", lambda: get_create_ruleset()(None, 0, CREATE_RULESET_VERSION))
    except OSError as err:  # ENOSYS, EOPNOTSUPP (disabled at boot), or seccomp
        log.debug("%s", err.strerror)
        return 0
    return max(int(version), 0)


def landlock_abi() -> int:
    """The running kernel's Landlock ABI version; 0 if it lacks Landlock or seccomp denies it.

    Looked up through the module at each call (tests replace it to exercise the refusal).
    """
    return _probe_abi()


def _run_in_thread(fn: Callable[[], None]) -> BaseException | None:
    """Run ``fn`` in a throw-away thread (for probes that change thread state)."""
    box: list[BaseException | None] = [None]

    def body() -> None:
        try:
            fn()
        except BaseException as err:
            box[0] = err

    t = threading.Thread(target=body, name="toolsrv-probe")
    t.start()
    t.join()
    return box[0]


@functools.cache
def mount_namespaces() -> bool:
    """Whether a thread can get a private mount namespace (root, or CAP_SYS_ADMIN).

    Probed once for real in a throw-away thread: ``unshare`` can be refused by seccomp or a
    container runtime even to root.
    """

    def probe() -> None:
        _unshare(_CLONE_NEWNS)
        _mount(None, "/", _MS_REC | _MS_PRIVATE)

    err = _run_in_thread(probe)
    if err is not None:
        log.debug("sandbox: no private mount namespaces (%s)", err)
    return err is None


# --- syscall wrappers ------------------------------------------------------------------------


def _unshare(flags: int) -> None:
    if _libc.unshare(ctypes.c_int(flags)) != 0:
        raise _oserror("unshare")


def _mount(src: str | None, target: str, flags: int) -> None:
    s = None if src is None else os.fsencode(src)
    if _libc.mount(s, os.fsencode(target), None, ctypes.c_ulong(flags), None) != 0:
        raise _oserror(f"mount {target}")


def _prctl(option: int, arg: int) -> int:
    return int(
        _libc.prctl(
            ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), None
        )
    )


def _drop_caps(network: bool) -> None:
    """Drop from this thread every capability a tool does not keep (see _CAPS_KEPT).

    Effective, permitted and inheritable sets, then the ambient set. That is final because
    `Prepared.enter` also sets no_new_privs: an exec can then never gain capabilities, not
    even root's, whatever the bounding set says. The bounding set is left alone: dropping a
    capability from it is a credential commit each, ~3 µs times thirty on every call. As a
    non-root user there is nothing to drop.
    """
    keep = _CAPS_KEPT | ({_CAP_NET_RAW} if network else set())
    hdr = _CapHeader(_CAP_VERSION_3, 0)
    data = (_CapData * 2)()
    if _libc.capget(ctypes.byref(hdr), data) != 0:
        raise _oserror("capget")
    mask = [0, 0]
    for cap in keep:
        mask[cap // 32] |= 1 << (cap % 32)
    for i in (0, 1):
        data[i].effective &= mask[i]
        data[i].permitted &= mask[i]
        data[i].inheritable &= mask[i]
    if _libc.capset(ctypes.byref(hdr), data) != 0:
        raise _oserror("capset")
    _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)


def _remount_flags(path: str) -> int:
    """Flags for the read-only remount that keep the mount's nosuid/nodev/noexec/atime."""
    st = os.statvfs(path).f_flag
    flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY
    flags |= st & (_MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_NOATIME | _MS_NODIRATIME)
    if st & _ST_RELATIME:
        flags |= _MS_RELATIME
    return flags


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

    ``ruleset_fd`` is None when the profile runs unsandboxed. ``git_binds`` are the ``.git``
    entries to make read-only in a private mount namespace; ``isolate_net`` asks for an empty
    network namespace (how network is denied when Landlock is older than ABI 4).
    """

    ruleset_fd: int | None
    git_binds: tuple[str, ...] = ()
    isolate_net: bool = False
    network: bool = False

    def close(self) -> None:
        """Release the ruleset fd (the restricted processes keep their domain)."""
        if self.ruleset_fd is not None:
            os.close(self.ruleset_fd)
            self.ruleset_fd = None

    def enter(self) -> None:
        """Restrict the calling thread for good: private mounts, capabilities, NNP, Landlock.

        Only for a thread created to spawn the tool and ending right after: credentials,
        capabilities, no_new_privs, the Landlock domain and the mount namespace are all
        per-thread on Linux, and a child inherits them from the thread that forks it. The
        server's other threads are untouched. Raises OSError when a step fails; nothing may
        be spawned from the thread then.
        """
        flags = (_CLONE_NEWNS if self.git_binds else 0) | (_CLONE_NEWNET if self.isolate_net else 0)
        if flags:
            _unshare(flags)
        if self.git_binds:
            # rprivate first: our read-only binds must not propagate back to the host.
            _mount(None, "/", _MS_REC | _MS_PRIVATE)
            for git in self.git_binds:
                _mount(git, git, _MS_BIND)
                _mount(None, git, _remount_flags(git))
        if _prctl(_PR_SET_NO_NEW_PRIVS, 1) != 0:
            raise _oserror("prctl(PR_SET_NO_NEW_PRIVS)")
        _drop_caps(self.network)
        if self.ruleset_fd is not None:
            fd = self.ruleset_fd
            _ll("landlock_restrict_self", lambda: get_restrict_self()(fd, 0))


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


def _clean_roots(roots: Sequence[str]) -> list[str]:
    out: list[str] = []
    for root in roots:
        real = os.path.realpath(root)
        if not os.path.exists(real):
            log.debug("sandbox: write root %s does not exist, skipped", root)
        elif real not in out:
            out.append(real)
    return out


def _git_entry(root: str) -> str | None:
    git = os.path.join(root, ".git")
    try:
        st = os.lstat(git)
    except OSError:
        return None
    # A symlinked .git cannot be protected by a bind (the mount lands on its target);
    # Landlock still forbids writing the target unless it is itself beneath a root.
    return None if stat.S_ISLNK(st.st_mode) else git


def prepare(
    profile: Profile,
    write_roots: Sequence[str],
    *,
    abi: int | None = None,
    mount_ns: bool | None = None,
) -> Prepared:
    """Build the Landlock ruleset for one call in the server (the expensive half).

    Policy: read + execute everywhere; every write-ish right (WRITE_FILE, REMOVE_*, MAKE_*,
    REFER, TRUNCATE, IOCTL_DEV as the ABI has them) beneath ``write_roots`` only, plus
    write/truncate on ``/dev/null``; TCP bind and connect denied unless ``profile.network``;
    scopes: no signals to processes outside the sandbox, no abstract unix sockets.

    The ``.git`` at the top of each root is made read-only by `Prepared.enter` with a bind
    mount when ``mount_ns`` (default: `mount_namespaces()`). Without namespaces, the root
    instead gets write rules per top-level entry except ``.git``; limitation: new top-level
    files or directories cannot then be created (or top-level entries removed or renamed) in
    such a root, and symlinked top-level entries are not writable through.

    An ``unsandboxed`` profile gets no Landlock domain at all (so no .git protection
    either, since everything is writable): only capabilities are dropped and NNP is set.

    Raises SandboxError when Landlock is missing and the profile is not ``unsandboxed``,
    OSError when the kernel refuses a rule.
    """
    abi = landlock_abi() if abi is None else abi
    if profile.unsandboxed:
        log.debug("sandbox %s: unsandboxed by profile", profile.name)
        return Prepared(None, network=profile.network)
    if abi <= 0:
        raise SandboxError(_refusal(profile.name))
    roots = _clean_roots(write_roots)
    gits = {root: git for root in roots if (git := _git_entry(root)) is not None}
    need_net = not profile.network and abi < 4
    use_ns = False
    if gits or need_net:  # probe (once) only when a namespace would be used
        use_ns = mount_namespaces() if mount_ns is None else mount_ns
    isolate_net = False
    if need_net:
        if use_ns:
            isolate_net = True
        else:
            warn_once(
                "net",
                f"Landlock ABI {abi} < 4 and no namespaces: TCP cannot be denied to tools",
            )
    handled_fs = fs_rights(abi)
    attr = _RulesetAttr(handled_fs, 0, 0)
    size = 8
    if abi >= 4:
        size = 16
        if not profile.network:
            attr.handled_access_net = NET_BIND_TCP | NET_CONNECT_TCP
    if abi >= 6:
        size = 24
        attr.scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL
    # The package's wrapper is typed for its one-field struct; the kernel reads ``size``.
    ptr = ctypes.cast(ctypes.pointer(attr), ctypes.POINTER(RulesetAttr))
    fd = int(_ll("landlock_create_ruleset", lambda: get_create_ruleset()(ptr, size, 0)))
    prepared = Prepared(fd, isolate_net=isolate_net, network=profile.network)
    try:
        _add_rule(fd, "/", FS_READ_EXEC)
        _add_rule(fd, "/dev/null", FS_DEV_NULL & handled_fs, missing_ok=True)
        for root in roots:
            if root in gits and not use_ns:
                _add_entries_except_git(fd, root, handled_fs)
            else:
                _add_rule(fd, root, handled_fs)
    except BaseException:
        prepared.close()
        raise
    if use_ns:
        prepared.git_binds = tuple(gits.values())
    return prepared


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


def _add_entries_except_git(ruleset: int, root: str, access: int) -> None:
    with os.scandir(root) as it:
        for entry in it:
            if entry.name == ".git" or entry.is_symlink():
                continue
            try:
                _add_rule(ruleset, entry.path, access)
            except FileNotFoundError:  # removed meanwhile
                continue
