"""``ollie doctor``: what this machine and this install need, one line per check.

Each check returns one ``Result``; a failing one says what to do about it. The checks
only look: nothing is created, fixed or mounted, so doctor is safe to run at any time,
also next to a running daemon. The order is the order in which a new user meets the
problems: FUSE, then the sandbox, then the install, then the files, then the network.

Output, one line per check (``ollie doctor`` exits 1 if any line is a FAIL)::

    ok   <check>: <detail>
    FAIL <check>: <detail> -> fix: <what to do>
"""

from __future__ import annotations

import ctypes
import errno
import filecmp
import importlib.metadata
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from olliefs import mounts
from olliefs.settings import Paths, shipped_dir
from olliefs.toolclient import remote


@dataclass(frozen=True)
class Result:
    check: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self) -> str:
        if self.ok:
            return f"ok   {self.check}: {self.detail}"
        return f"FAIL {self.check}: {self.detail} -> fix: {self.fix}"


def ok(check: str, detail: str) -> Result:
    return Result(check, True, detail)


def fail(check: str, detail: str, fix: str) -> Result:
    return Result(check, False, detail, fix)


# ---- FUSE ------------------------------------------------------------------------------


def check_dev_fuse(dev: str = "/dev/fuse") -> Result:
    name = "/dev/fuse"
    try:
        st = os.stat(dev)
    except FileNotFoundError:
        return fail(
            name,
            f"{dev} is missing: this machine has no FUSE",
            "load the module (modprobe fuse); in a container, start it with --device /dev/fuse",
        )
    if not stat.S_ISCHR(st.st_mode):
        return fail(name, f"{dev} is not a character device", f"remove it and reboot: {dev}")
    try:
        os.close(os.open(dev, os.O_RDWR | os.O_CLOEXEC))
    except OSError as err:
        return fail(
            name,
            f"cannot open {dev}: {err.strerror}",
            f"make it usable by you (Debian ships it 0666): chmod 0666 {dev}",
        )
    return ok(name, f"character device {os.major(st.st_rdev)},{os.minor(st.st_rdev)}, opens")


def check_fusermount(euid: int | None = None) -> Result:
    name = "fusermount3"
    path = shutil.which("fusermount3")
    if path is None:
        return fail(name, "not found in PATH", "install it: apt-get install fuse3")
    euid = os.geteuid() if euid is None else euid
    st = os.stat(path)
    if euid != 0 and not (st.st_uid == 0 and st.st_mode & stat.S_ISUID):
        return fail(
            name,
            f"{path} is not setuid root, so you cannot mount without root",
            f"chmod u+s {path} (as root; the fuse3 package installs it so)",
        )
    return ok(name, path + (" (setuid root)" if st.st_mode & stat.S_ISUID else ""))


# ---- Landlock ----------------------------------------------------------------------------

SYS_LANDLOCK_CREATE_RULESET = 444  # the same on every architecture since Linux 5.13
LANDLOCK_CREATE_RULESET_VERSION = 1 << 0

#: The ABI versions that brought what toolsrv's sandbox uses, for the detail of the check.
ABI_FEATURES = {1: "filesystem rules", 4: "TCP rules", 6: "scopes (abstract sockets, signals)"}


def landlock_abi() -> tuple[int, int]:
    """(ABI version, 0) or (0, errno): the kernel's answer to
    ``landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)``."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(
        ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET),
        None,
        ctypes.c_size_t(0),
        ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION),
    )
    if abi < 0:
        return 0, ctypes.get_errno()
    return int(abi), 0


def check_landlock(answer: tuple[int, int] | None = None) -> Result:
    name = "landlock"
    abi, err = landlock_abi() if answer is None else answer
    if abi > 0:
        features = "; ".join(f for n, f in sorted(ABI_FEATURES.items()) if n <= abi)
        return ok(name, f"ABI {abi} ({features})")
    unsandboxed = "until then tools run only where their sandbox profile says unsandboxed = true"
    if err == errno.EOPNOTSUPP:
        return fail(
            name,
            "built into the kernel but disabled at boot",
            f"add landlock to the lsm= kernel parameter and reboot; {unsandboxed}",
        )
    why = os.strerror(err) if err else "no version"
    return fail(
        name,
        f"this kernel has no Landlock ({why}; it needs Linux 5.13 or later)",
        f"use a kernel built with CONFIG_SECURITY_LANDLOCK; {unsandboxed}",
    )


# ---- the install -----------------------------------------------------------------------


def check_pyfuse3() -> Result:
    """What the daemon logs at mount (``olliefs.daemon.check_pyfuse3``): the patched APIs
    the installed pyfuse3 lacks, each with what the daemon does without it. It mounts
    and works without them; the check fails so that the degraded parts are known, and
    says the one command that builds the patched pyfuse3 into this environment."""
    name = "pyfuse3"
    try:
        import pyfuse3  # noqa: F401

        from olliefs.fs import patched
    except ImportError as err:
        return fail(
            name,
            f"cannot import it: {err}",
            f"apt-get install fuse3 libfuse3-dev; then {sys.executable} -m pip install olliefs",
        )
    version = patched.build() or "(version unknown)"
    found = patched.gaps(version)
    if found:
        return fail(
            name,
            f"{version} mounts, without olliefs's patches: {patched.summary(found)}",
            f"{patched.FIX} (as root: apt-get install libfuse3-dev pkg-config gcc first)",
        )
    return ok(name, f"{version}, patched (Ctrl-C ends any blocked read; poll sleeps)")


# ---- the private directories -----------------------------------------------------------


def check_private_dir(name: str, path: Path, euid: int | None = None) -> Result:
    """0700 and the user's own: it holds sockets, journals, logs or keys."""
    euid = os.geteuid() if euid is None else euid
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return ok(name, f"{path} does not exist yet (ollie mount makes it 0700)")
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return fail(name, f"{path} is not a directory", f"move it away: mv {path} {path}.old")
    if st.st_uid != euid:
        return fail(
            name,
            f"{path} belongs to uid {st.st_uid}, not to you (uid {euid})",
            f"have its owner or root remove it (rm -r {path}); ollie mount makes it again",
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        return fail(name, f"{path} is {mode:04o}: others can look in", f"chmod 0700 {path}")
    return ok(name, f"{path} is 0700, yours")


# ---- the backend -----------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """A GET that tells whether a backend answers: its model list."""

    url: str
    headers: dict[str, str] = field(default_factory=dict)
    url_setting: str = ""
    key_settings: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Known:
    url: str  # default base URL
    version: str  # the path segment added when the base URL has none
    endpoint: str  # the model list, under the version
    auth: Callable[[str], dict[str, str]]
    keys: tuple[str, ...]  # settings holding the key, first set wins (after OLLIE_<NAME>_KEY)


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


KNOWN_BACKENDS: dict[str, _Known] = {
    "openai": _Known("https://api.openai.com/v1", "v1", "models", _bearer, ("OPENAI_API_KEY",)),
    "anthropic": _Known(
        "https://api.anthropic.com",
        "v1",
        "models",
        lambda k: {"x-api-key": k, "anthropic-version": "2023-06-01"},
        ("ANTHROPIC_API_KEY",),
    ),
    "ollama": _Known("http://localhost:11434", "api", "tags", _bearer, ()),
    "gemini": _Known(
        "https://generativelanguage.googleapis.com",
        "v1beta",
        "models",
        lambda k: {"x-goog-api-key": k},
        ("GEMINI_API_KEY", "GOOGLE_API_KEY"),
    ),
}

# A base URL already ending in a version (/v1, /v1beta, /api, /api/v4) is used as given:
# users paste https://host as often as https://host/v1, and both must work (SPEC 4).
_VERSIONED = re.compile(r"/(v\d+[a-z0-9]*|api)$")


def probe_for(backend: str, settings: Mapping[str, str]) -> Probe | None:
    """The request that shows whether ``backend`` answers, from its ``OLLIE_<NAME>_URL``
    (or the provider's default) and its key; None when no URL is known for it.

    Backends other than the four known ones get ``<OLLIE_<NAME>_URL>/models`` with
    ``OLLIE_<NAME>_KEY`` as a bearer token, the OpenAI-compatible convention.
    """
    upper = re.sub(r"[^A-Z0-9]", "_", backend.upper())
    url_setting, own_key = f"OLLIE_{upper}_URL", f"OLLIE_{upper}_KEY"
    known = KNOWN_BACKENDS.get(backend)
    base = settings.get(url_setting, "").strip() or (known.url if known else "")
    if not base:
        return None
    version, endpoint, auth, keys = (
        (known.version, known.endpoint, known.auth, known.keys)
        if known
        else ("", "models", _bearer, ())
    )
    base = base.rstrip("/")
    if version and not _VERSIONED.search(urlsplit(base).path):
        base += "/" + version
    key_settings = (own_key, *keys)
    key = next((v for k in key_settings if (v := settings.get(k, "").strip())), "")
    return Probe(f"{base}/{endpoint}", auth(key) if key else {}, url_setting, key_settings)


def shown(url: str) -> str:
    """A URL fit to print: credentials in it (user:password@) are dropped."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=netloc))


def _count_models(body: bytes) -> int | None:
    import json

    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if isinstance(doc, dict):
        for k in ("data", "models"):
            if isinstance(doc.get(k), list):
                return len(doc[k])
    return None


def check_backend(settings: Mapping[str, str], timeout: float = 3.0) -> Result:
    import httpx

    from olliefs.backend.pool import backend_names

    backend = settings.get("OLLIE_BACKEND", "").strip() or "openai"
    name = "backend"
    known = backend_names()
    if backend not in known:
        return fail(
            name,
            f"OLLIE_BACKEND={backend} is not a backend (known: {', '.join(known)})",
            "set OLLIE_BACKEND to one of them (environment or the config env file)",
        )
    probe = probe_for(backend, settings)
    if probe is None:
        return fail(
            name,
            f"{backend}: no URL is known for it",
            f"set OLLIE_{backend.upper()}_URL (environment or the config env file)",
        )
    url = shown(probe.url)
    try:
        r = httpx.get(probe.url, headers=probe.headers, timeout=timeout, follow_redirects=True)
    except httpx.HTTPError as err:
        why = str(err) or type(err).__name__
        return fail(
            name,
            f"{backend}: {url} cannot be reached ({why})",
            f"check {probe.url_setting} and that the server runs and is reachable from here",
        )
    if r.status_code in (401, 403):
        have = "is refused" if probe.headers else "is missing"
        return fail(
            name,
            f"{backend}: {url} answers HTTP {r.status_code}: the key {have}",
            f"set {' or '.join(probe.key_settings)} (environment or the config env file)",
        )
    if not r.is_success:
        return fail(
            name,
            f"{backend}: {url} answers HTTP {r.status_code}",
            f"check {probe.url_setting} (the base URL; with or without /v1 both work)",
        )
    n = _count_models(r.content)
    models = f", {n} models" if n is not None else ""
    return ok(name, f"{backend}: {url} answers (HTTP {r.status_code}{models})")


# ---- mounts ----------------------------------------------------------------------------


def check_stale_mounts() -> Result:
    name = "stale mounts"
    known = list(mounts.daemons())
    live: list[str] = []
    dead: list[str] = []
    for m in mounts.mounts():
        if m.fstype != mounts.FSTYPE or m.point in live or m.point in dead:
            continue
        st = mounts.status(m.point, known)
        if st.state is mounts.State.DEAD:
            dead.append(m.point)
        elif st.state is mounts.State.LIVE:
            pid = f" (daemon pid {st.daemon.pid})" if st.daemon else ""
            live.append(m.point + pid)
    also = f"; live: {', '.join(live)}" if live else ""
    if dead:
        fixes = "; ".join(f"ollie umount {p}" for p in dead)
        return fail(name, f"dead (their daemons are gone): {', '.join(dead)}{also}", fixes)
    return ok(name, "none" + also)


# ---- shipped defaults the user shadows -------------------------------------------------

#: config dir folder -> the shipped folder (under the package's agents/) it shadows.
SHADOWED = {
    "agents": "profiles",
    "prompts": "prompts",
    "sandbox": "sandbox",
    "scripts/u": "scripts/u",
    "scripts/x": "scripts/x",
    "tools": "tools",
}


def overrides(config: Path, shipped: Path) -> list[tuple[str, bool]]:
    """(config-relative name, identical to the shipped file) for every user file that
    shadows a shipped one by name."""
    out: list[tuple[str, bool]] = []
    for mine, theirs in sorted(SHADOWED.items()):
        src = shipped / theirs
        if not src.is_dir():
            continue
        for f in sorted(src.iterdir()):
            if not f.is_file() or f.name.startswith((".", "_")):
                continue
            user = config / mine / f.name
            if user.is_file():
                out.append((f"{mine}/{f.name}", filecmp.cmp(user, f, shallow=False)))
    return out


def check_overrides(p: Paths, shipped: Path | None = None) -> Result:
    """Not a failure: a user's file wins by name, on purpose. Said so that an upgrade
    whose default does not arrive is explained, and an identical copy can go."""
    name = "overrides"
    found = overrides(p.config, shipped_dir() if shipped is None else shipped)
    if not found:
        return ok(name, f"none (every shipped default is in force; config in {p.config})")
    parts = [
        f"{n} (identical to the shipped file: remove it to follow upgrades)" if same else n
        for n, same in found
    ]
    return ok(name, f"{len(found)} in {p.config}: " + ", ".join(parts))


# ---- all of them -----------------------------------------------------------------------


def check_remote_toolsrv(settings: Mapping[str, str], timeout: float = 30.0) -> Result | None:
    """With ``OLLIE_TOOLSRV=ssh:...``: is the host reachable, and which toolsrv answers
    there (``toolsrv --version`` over the same ssh command line the daemon uses)."""
    name = "remote toolsrv"
    value = settings.get("OLLIE_TOOLSRV", "")
    if value.startswith("unix:"):
        return None  # a local socket: the daemon checks its key when it attaches
    try:
        target = remote.parse_toolsrv(value)
    except ValueError as err:
        return fail(name, str(err), "set OLLIE_TOOLSRV=local or ssh:[user@]host[:dir]")
    if target is None:
        return None
    argv = remote.ssh_argv(target.dest, settings, "--version")
    try:
        got = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False
        )
    except FileNotFoundError:
        return fail(name, f"no ssh on this machine ({argv[0]})", "install openssh-client")
    except subprocess.TimeoutExpired:
        return fail(name, f"ssh {target.dest}: no answer in {timeout:.0f}s", "check the host")
    out = got.stdout.decode(errors="replace").strip()
    if got.returncode != 0 or not out.startswith("toolsrv "):
        why = remote.why_failed(target.dest, settings, got.returncode, got.stderr, b"")
        return fail(name, why, f"make `ssh {target.dest} toolsrv --version` work")
    mine = _version()
    there = out.split()[-1]
    same = "same as here" if there == mine else f"this machine has {mine}"
    return ok(name, f"{target}: {out} ({same})")


def _version() -> str:
    try:
        return importlib.metadata.version("olliefs")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def run(p: Paths, settings: Mapping[str, str]) -> list[Result]:
    remote_check = check_remote_toolsrv(settings)
    return [
        *([remote_check] if remote_check is not None else []),
        check_dev_fuse(),
        check_fusermount(),
        check_landlock(),
        check_pyfuse3(),
        check_private_dir("runtime dir", p.run),
        check_private_dir("state dir", p.state),
        check_private_dir("config dir", p.config),
        check_private_dir("data dir", p.data),
        check_stale_mounts(),
        check_overrides(p),
        check_backend(settings),
    ]
