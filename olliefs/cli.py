"""``ollie``: mount, umount, status, doctor, build-pyfuse3, install-helpers, man, and the
replay LLM server.

``ollie mount`` checks everything it can before it forks (so mistakes are reported by the
command that made them, in one line, with a non-zero exit), then starts the daemon in its
own session and waits until the daemon says the tree answers, or reports why it died.

``ollie umount`` and ``ollie status`` act on the mount they name, whichever state dir its
daemon uses (``olliefs.mounts`` finds the daemon behind a mount point); without a mount
point they act on the daemon of this state dir. ``ollie doctor`` only looks
(``olliefs.doctor``). ``ollie build-pyfuse3`` builds pyfuse3 with olliefs's patches into
the environment ollie runs in (``olliefs.fs.patched``). ``ollie install-helpers`` copies
the mount(8) helper, the systemd user unit, the bash completion and the man pages (all
shipped as package data) where mount(8), systemd, bash and man(1) look for them.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import importlib.util
import logging
import os
import re
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from olliefs import mounts
from olliefs.settings import Paths, install_defaults, load_settings, paths, private_file
from olliefs.toolclient import remote

if TYPE_CHECKING:
    from olliefs.fs.export9p import Address

PROG = "ollie"


class CliError(Exception):
    pass


@dataclass(frozen=True)
class Exports:
    """What ``--9p`` asked for: where to serve the tree over 9P, and the key, if any."""

    addresses: Sequence[Address]
    key: str | None


def default_mountpoint() -> str:
    return os.environ.get("OLLIE") or os.path.expanduser("~/ollie")


def _daemon_pid(p: Paths) -> tuple[int, str] | None:
    """(pid, mountpoint) of the live daemon of this state dir, if any.

    Alive means: it holds the state lock. A pid file alone can lie (a SIGKILLed daemon
    leaves it behind, its pid may be reused, or linger as a zombie nobody reaps).
    """
    try:
        fd = os.open(p.lock_file, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pass  # held: a daemon is alive
    else:
        return None
    finally:
        os.close(fd)
    try:
        pid_s, mnt = p.pid_file.read_text().splitlines()[:2]
        return int(pid_s), mnt
    except (OSError, ValueError):
        return -1, "(unknown: no pid file)"


def _clear_stale(mnt: str) -> None:
    subprocess.run(["fusermount3", "-uz", mnt], capture_output=True, check=False)


def preflight(mnt: str, p: Paths, *, create_default: bool) -> None:
    if not os.path.exists("/dev/fuse"):
        raise CliError("/dev/fuse is missing: this machine has no FUSE (modprobe fuse?)")
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as err:
        raise CliError(f"cannot open /dev/fuse: {err.strerror}") from None
    if shutil.which("fusermount3") is None:
        raise CliError("fusermount3 not found: install the fuse3 package")
    running = _daemon_pid(p)
    if running:
        raise CliError(f"already mounted at {running[1]} (daemon pid {running[0]})")
    here = mounts.mount_at(mounts.canonical(mnt))
    if here is not None and here.fstype.startswith("fuse"):
        # A dead daemon's mount can still answer stat from the kernel's attribute cache;
        # listing it always reaches the daemon, and fails with ENOTCONN when it is gone.
        try:
            os.listdir(mnt)
        except OSError as err:
            if err.errno != errno.ENOTCONN:
                raise CliError(f"mount point {mnt}: {err.strerror}") from None
            _clear_stale(mnt)
            print(f"{PROG}: cleared a stale mount left at {mnt} by a dead daemon", file=sys.stderr)
        else:
            raise CliError(f"{mnt} is already a FUSE mount point")
    try:
        st = os.stat(mnt)
    except FileNotFoundError:
        if not create_default:
            raise CliError(f"mount point does not exist: {mnt}") from None
        os.makedirs(mnt, exist_ok=True)
        st = os.stat(mnt)
    except OSError as err:
        raise CliError(f"mount point {mnt}: {err.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CliError(f"mount point is not a directory: {mnt}")
    if os.listdir(mnt):
        raise CliError(f"mount point is not empty: {mnt}")


class LogFile(logging.Handler):
    """The daemon's log file, written so that a full disk costs log lines, nothing more.

    ``logging.FileHandler`` buffers, and at every line a full disk refuses it prints a
    traceback to stderr (for a daemon, that same file). Here each line is one unbuffered
    append: a line the disk refuses is cut back and counted, and the count goes in before
    the next line that fits, so the log says what it is missing.
    """

    def __init__(self, path: Path) -> None:
        super().__init__()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.lost = 0  # lines not written since the last one that was
        self._why = ""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = (self.format(record) + "\n").encode(errors="replace")
        except Exception:
            self.handleError(record)
            return
        if self.lost:  # with the line, in one append: both are written, or neither
            line = (
                f"(the {self.lost} log lines before this one were lost: {self._why})\n".encode()
                + line
            )
        if self._put(line):
            self.lost = 0
        else:
            self.lost += 1

    def _put(self, data: bytes) -> bool:
        done = 0
        try:
            while done < len(data):
                done += os.write(self._fd, data[done:])
        except OSError as err:
            self._why = err.strerror or str(err)
            if done:  # no half line left for the next one to be glued to
                try:
                    os.ftruncate(self._fd, os.fstat(self._fd).st_size - done)
                except OSError:
                    pass
            return False
        return True

    def close(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        super().close()


def _setup_logging(p: Paths, foreground: bool, verbose: bool) -> None:
    private_file(p.log_file)
    handlers: list[logging.Handler] = [LogFile(p.log_file)]
    if foreground:
        handlers.append(logging.StreamHandler(sys.stderr))
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=handlers,
    )


def run_daemon(
    mnt: str,
    p: Paths,
    ready_fd: int | None,
    verbose: bool,
    exports: Exports | None = None,
) -> int:
    from olliefs.daemon import DaemonError, lock_state, serve

    _setup_logging(p, ready_fd is None, verbose)
    # Not passed on to toolsrv or to the tools: only this process may report readiness.
    notify_socket = os.environ.pop("NOTIFY_SOCKET", None)
    settings = load_settings(p)

    def ready() -> None:
        if ready_fd is not None:
            os.write(ready_fd, b"ok\n")
            os.close(ready_fd)
        if notify_socket:
            sd_notify(notify_socket, f"READY=1\nSTATUS=mounted at {mnt}\n")

    try:
        lock = lock_state(p)
        try:
            trio.run(serve, mnt, p, settings, ready, exports)
        finally:
            os.close(lock)
    except DaemonError as err:
        logging.getLogger("olliefs").error("%s", err)
        if ready_fd is not None:
            os.write(ready_fd, f"{err}\n".encode())
        else:
            print(f"{PROG}: {err}", file=sys.stderr)
        return 1
    return 0


def _exports(args: argparse.Namespace) -> Exports | None:
    """The ``--9p`` addresses and key, checked before anything starts: an address off
    loopback is refused unless ``--9p-allow-remote`` and a key file are given."""
    if not args.ninep:
        if args.ninep_allow_remote or args.ninep_key_file:
            raise CliError("--9p-allow-remote and --9p-key-file go with --9p ADDRESS")
        return None
    from olliefs.fs import export9p  # the 9P server and its codec: only for an export

    try:
        addresses = [export9p.parse_address(a) for a in args.ninep]
        key = export9p.read_key(args.ninep_key_file) if args.ninep_key_file else None
        export9p.check_exports(addresses, args.ninep_allow_remote, key)
    except export9p.AddressError as err:
        raise CliError(str(err)) from None
    return Exports(addresses, key)


def _export_args(args: argparse.Namespace) -> list[str]:
    """The 9P flags again, for the daemon child (the key file by absolute path)."""
    out: list[str] = []
    for a in args.ninep or ():
        out += ["--9p", a]
    if args.ninep_allow_remote:
        out.append("--9p-allow-remote")
    if args.ninep_key_file:
        out += ["--9p-key-file", os.path.abspath(args.ninep_key_file)]
    return out


def cmd_mount(args: argparse.Namespace) -> int:
    from olliefs import memory

    if args.foreground or args.ready_fd is not None:
        memory.reexec_with_huge_pages()  # returns when already done (or not wanted)
        memory.settle_environment()
    p = paths()
    mnt = os.path.abspath(os.path.expanduser(args.mountpoint or default_mountpoint()))
    exports = _exports(args)
    if args.toolsrv:
        # A remote toolsrv: the daemon (and its forked child) read these as settings.
        if not args.toolsrv.startswith("unix:"):
            try:
                remote.parse_toolsrv(args.toolsrv)
            except ValueError as err:
                raise CliError(f"--toolsrv: unix:PATH, local or ssh:...: {err}") from None
            os.environ["OLLIE_TOOLSRV"] = args.toolsrv  # ssh is the authentication
        elif not args.toolsrv_key_file:
            raise CliError("--toolsrv needs --toolsrv-key-file (the key toolsrv was started with)")
        else:
            os.environ["OLLIE_TOOLSRV"] = args.toolsrv
            os.environ["OLLIE_TOOLSRV_KEY_FILE"] = os.path.abspath(args.toolsrv_key_file)
    p.ensure()
    install_defaults(p)
    if args.ready_fd is not None:  # the daemon child; the parent did the checks
        return run_daemon(mnt, p, args.ready_fd, args.verbose, exports)
    preflight(mnt, p, create_default=args.mountpoint is None)
    if args.foreground:
        return run_daemon(mnt, p, None, args.verbose, exports)
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "olliefs", "mount", "--ready-fd", str(w), *_export_args(args)]
    cmd.append(mnt)
    if args.verbose:
        cmd.insert(4, "-v")
    private_file(p.log_file)
    with open(os.devnull, "rb") as devnull, open(p.log_file, "ab") as logf:
        child = subprocess.Popen(
            cmd,
            pass_fds=(w,),
            stdin=devnull,
            stdout=logf,
            stderr=logf,
            start_new_session=True,
            env=memory.huge_page_environment(os.environ),  # None: this environment
        )
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        answer = pipe.readline().decode().strip()
    if answer == "ok":
        print(f"mounted at {mnt} (daemon pid {child.pid}; log {p.log_file})")
        for addr in mounts.exports_in(p.pid_file):
            print(f"9P export on {addr}")
        return 0
    code = child.wait()
    reason = answer or f"daemon exited with status {code}; see {p.log_file}"
    raise CliError(reason)


def sd_notify(address: str, message: str) -> None:
    """Tell systemd the daemon is ready (``Type=notify`` in ``ollie.service``).

    The protocol is one datagram to the unix socket named by ``$NOTIFY_SOCKET`` (``@`` for
    the abstract namespace). A failure is logged, never fatal: readiness is a courtesy to
    the service manager, the mount works either way.
    """
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.sendall(message.encode())
    except OSError as err:
        logging.getLogger("olliefs").warning("cannot notify systemd: %s", err)


def _terminate(pid: int, timeout: float = 30.0) -> bool:
    """SIGTERM the daemon and wait for it to end; False if it is still there at timeout.

    Through a pidfd: the signal cannot reach another process that took over a reused pid,
    and the wait is one poll(2), woken by the exit itself. A daemon unmounts before it
    exits, so once it is gone the mount is too.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        try:
            signal.pidfd_send_signal(fd, signal.SIGTERM)
        except ProcessLookupError:
            return True
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(int(timeout * 1000)))
    finally:
        os.close(fd)


def _stop(pid: int, mnt: str) -> None:
    if not _terminate(pid):
        raise CliError(f"daemon pid {pid} did not exit within 30 s of SIGTERM")
    at = mounts.mount_at(mounts.canonical(mnt))
    if at is not None and at.fstype == mounts.FSTYPE:  # it died before it could unmount
        _clear_stale(mnt)
    print(f"unmounted {mnt}")


def _umount_point(mnt: str) -> int:
    st = mounts.status(mnt)
    if st.state is mounts.State.LIVE:
        if st.daemon is None:
            raise CliError(
                f"{mnt} is served by a daemon this user cannot see;"
                f" its owner (or root) can unmount it: fusermount3 -u {mnt}"
            )
        _stop(st.daemon.pid, mnt)
        return 0
    if st.state is mounts.State.DEAD:
        _clear_stale(mnt)
        print(f"{PROG}: no daemon; cleared the dead mount at {mnt}", file=sys.stderr)
        return 0
    if st.state is mounts.State.FOREIGN:
        raise CliError(f"not an olliefs mount: {mnt} ({st.fstype})")
    raise CliError(f"not mounted: {mnt}")


def cmd_umount(args: argparse.Namespace) -> int:
    if args.mountpoint is not None:
        return _umount_point(mounts.canonical(args.mountpoint))
    p = paths()
    running = _daemon_pid(p)
    if running is not None:
        pid, mnt = running
        if pid <= 0:
            raise CliError("a daemon holds the state lock but left no pid file")
        _stop(pid, mnt)
        return 0
    # No daemon of this state dir: a dead mount it left at the default mount point is
    # cleared; a live one there belongs to another state dir and is only named.
    mnt = mounts.canonical(default_mountpoint())
    st = mounts.status(mnt)
    if st.state is mounts.State.DEAD:
        return _umount_point(mnt)
    if st.state is mounts.State.LIVE:
        raise CliError(
            f"not mounted by this state dir ({p.state}); to end the mount at {mnt}"
            f" all the same: {PROG} umount {mnt}"
        )
    raise CliError("not mounted")


# Exit codes of `ollie status`, as documented in ollie(1).
LIVE, NOT_MOUNTED, DEAD = 0, 1, 2


def _dead(mnt: str) -> int:
    print(f"dead mount at {mnt}: its daemon is gone (ENOTCONN); `{PROG} umount {mnt}` clears it")
    return DEAD


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def cmd_status(args: argparse.Namespace) -> int:
    if args.mountpoint is not None:
        mnt = mounts.canonical(args.mountpoint)
        st = mounts.status(mnt)
        if st.state is mounts.State.LIVE:
            d = st.daemon
            if d is None:
                print(f"mounted at {mnt} (by a daemon this user cannot see)")
            else:
                print(
                    f"mounted at {mnt} (daemon pid {d.pid}), {d.sessions} sessions,"
                    f" state in {d.state}"
                )
                for addr in d.exports:
                    print(f"9P export on {addr}")
                for line in _lines(d.run / "9p-peers"):
                    print(f"9P client {line}")
                for line in remote.status_in(d.run):
                    print(f"remote toolsrv {line}")
            return LIVE
        if st.state is mounts.State.DEAD:
            return _dead(mnt)
        if st.state is mounts.State.FOREIGN:
            print(f"not an olliefs mount: {mnt} ({st.fstype})")
        else:
            print(f"not mounted: {mnt}")
        return NOT_MOUNTED
    p = paths()
    running = _daemon_pid(p)
    if running is not None:
        pid, mnt = running
        sessions = len(list(p.sessions.glob("*.jsonl")))
        print(f"mounted at {mnt} (daemon pid {pid}), {sessions} sessions, state in {p.state}")
        for addr in mounts.exports_in(p.pid_file):
            print(f"9P export on {addr}")
        for line in _lines(p.run / "9p-peers"):
            print(f"9P client {line}")
        for line in remote.status_in(p.run):
            print(f"remote toolsrv {line}")
        return LIVE
    # A killed daemon leaves its pid file behind, naming the mount it left dead.
    places = [default_mountpoint()]
    try:
        places.insert(0, p.pid_file.read_text().splitlines()[1])
    except (OSError, IndexError):
        pass
    for place in places:
        mnt = mounts.canonical(place)
        if mounts.status(mnt).state is mounts.State.DEAD:
            return _dead(mnt)
    print("not mounted")
    # Mounted under another OLLIE_HOME (the demo's, a test's): say where, not just "no".
    for d in mounts.daemons():
        print(f"other olliefs mount: {d.mountpoint} (daemon pid {d.pid}, state in {d.state})")
    return NOT_MOUNTED


def cmd_doctor(args: argparse.Namespace) -> int:
    from olliefs import doctor

    p = paths()
    failed = False
    for result in doctor.run(p, load_settings(p)):
        print(result.line(), flush=True)
        failed = failed or not result.ok
    return 1 if failed else 0


def cmd_build_pyfuse3(args: argparse.Namespace) -> int:
    """Build pyfuse3 with the patches of ``.ci/pyfuse3/`` (shipped as ``olliefs._pyfuse3``)
    into the environment of this Python: what ``.ci/setup`` does for a clone."""
    missing = [tool for tool in ("bash", "gcc", "pkg-config", "patch") if not shutil.which(tool)]
    if "pkg-config" not in missing:
        probe = subprocess.run(["pkg-config", "--exists", "fuse3"], check=False)
        if probe.returncode != 0:
            missing.append("libfuse3-dev")
    if missing:
        raise CliError(
            f"building pyfuse3 needs {', '.join(missing)}:"
            " apt-get install gcc pkg-config patch libfuse3-dev (as root)"
        )
    script = pyfuse3_dir() / "build.sh"
    print(f"building pyfuse3 with olliefs's patches into {sys.prefix} ...", flush=True)
    done = subprocess.run(["bash", str(script), sys.executable], check=False)
    if done.returncode != 0:
        raise CliError(f"the build failed ({script} exited {done.returncode}; see above)")
    print("done; a running daemon uses it from its next start (ollie umount; ollie mount)")
    return 0


# ---- helpers and man pages, shipped as package data --------------------------------------


def _package_data(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise CliError(f"olliefs is not installed properly: {name} is missing")
    return Path(spec.origin).parent


def helpers_dir() -> Path:
    """The project's ``mount_helpers/`` folder, installed as ``olliefs._helpers``."""
    return _package_data("olliefs._helpers")


def pyfuse3_dir() -> Path:
    """The project's ``.ci/pyfuse3/`` folder (build script, patches), installed as
    ``olliefs._pyfuse3``."""
    return _package_data("olliefs._pyfuse3")


def man_dir() -> Path:
    """The project's ``man/`` folder, installed as ``olliefs._man``."""
    return _package_data("olliefs._man")


def man_pages() -> list[Path]:
    return sorted(man_dir().glob("*.[1-8]"))


def ollie_command() -> str:
    """The absolute path of this install's ``ollie``: what mount(8) and systemd run, with
    a PATH of their own that may not hold a virtualenv or ~/.local/bin."""
    beside = Path(sys.executable).parent / PROG
    if os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(PROG)
    if found is None:
        raise CliError(f"cannot find the {PROG} command (is the package installed with pip?)")
    return os.path.abspath(found)


def _with_command(name: str, text: str, command: str) -> str:
    """The shipped helper with the absolute ``ollie`` in the place its comment names."""
    if name == "mount.fuse.ollie":
        in_quotes = re.sub(r'([\\"$`])', r"\\\1", command)  # inside "${...:=...}"
        pattern, repl = r"^: \"\$\{OLLIE_BIN:=ollie\}\"$", f': "${{OLLIE_BIN:={in_quotes}}}"'
    elif name == "ollie.service":
        quoted = f'"{command}"' if re.search(r"\s", command) else command
        pattern, repl = r"^ExecStart=ollie ", f"ExecStart={quoted} "
    else:
        return text
    out, n = re.subn(pattern, lambda m: repl, text, count=1, flags=re.M)
    if n != 1:
        raise CliError(f"{name}: the line that names ollie is missing")
    return out


def _install(src_text: str, dest: Path, mode: int) -> None:
    """Written next to its place, then renamed over it: never a half-written helper."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        tmp.write_text(src_text)
        os.chmod(tmp, mode)
        os.replace(tmp, dest)
    except OSError as err:
        raise CliError(
            f"cannot write {dest}: {err.strerror} (install as root, or with --user, or choose"
            " --prefix and --sbindir)"
        ) from None
    print(f"installed {dest}")


def cmd_install_helpers(args: argparse.Namespace) -> int:
    if args.user:
        if args.prefix:
            raise CliError("--user and --prefix exclude each other")
        home = Path.home()
        data = Path(os.environ.get("XDG_DATA_HOME") or home / ".local/share")
        config = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
        completions = data / "bash-completion/completions"
        units, man = config / "systemd/user", data / "man"
    else:
        prefix = Path(args.prefix or "/usr/local")
        completions = prefix / "share/bash-completion/completions"
        units, man = prefix / "lib/systemd/user", prefix / "share/man"
    command = ollie_command()
    src = helpers_dir()
    sbindir = args.sbindir or (None if args.user else "/sbin")
    if sbindir is not None:
        text = _with_command("mount.fuse.ollie", (src / "mount.fuse.ollie").read_text(), command)
        _install(text, Path(sbindir) / "mount.fuse.ollie", 0o755)
    _install((src / "ollie.bash").read_text(), completions / PROG, 0o644)
    for page in man_pages():
        _install(page.read_text(), man / f"man{page.suffix[1:]}" / page.name, 0o644)
    text = _with_command("ollie.service", (src / "ollie.service").read_text(), command)
    if not _man_finds(man / "man1" / "ollie.1"):
        # man(1) does not look there (~/.local/share/man is searched only when ~/.local/bin
        # is on PATH): the unit names the pages by path, so `systemctl help` and
        # `systemd-analyze verify` find them, and the user is told how to get `man ollie`.
        pages = " ".join(f"file://{man}/man{n}/ollie.{n}" for n in ("1", "5"))
        text = text.replace("Documentation=man:ollie(1) man:ollie(5)", f"Documentation={pages}")
        print(
            f"man does not look in {man}: for `man ollie`, add to your shell's profile\n"
            f'  export MANPATH="{man}:"    (the final colon keeps the system pages)'
        )
    _install(text, units / "ollie.service", 0o644)
    print("to mount at login: systemctl --user daemon-reload; systemctl --user enable --now ollie")
    return 0


def _man_finds(page: Path) -> bool:
    """Whether ``man`` as this environment runs it finds ``page`` by name."""
    man = shutil.which("man")
    if man is None:
        return False
    r = subprocess.run(
        [man, "-w", page.suffix[1:], page.stem], capture_output=True, text=True, check=False
    )
    return r.returncode == 0 and r.stdout.strip() == str(page)


def resolve_page(page: str) -> Path:
    """``ollie`` or ``ollie.1`` or ``1``; ``ollie.5`` or ``5``; ``toolsrv``; ``ollie-replay``."""
    pages = man_pages()
    by_name = {p.name: p for p in pages}
    if page in by_name:
        return by_name[page]
    if page.isdigit():
        found = [p for p in pages if p.suffix == f".{page}"]
        found.sort(key=lambda p: p.stem != PROG)  # ollie.N first
    else:
        found = [p for p in pages if p.stem == page]  # sorted: the lowest section first
    if not found:
        raise CliError(f"no man page {page!r} (there are: {' '.join(by_name)})")
    return found[0]


def cmd_man(args: argparse.Namespace) -> int:
    page = resolve_page(args.page)
    if args.path:
        print(page)
        return 0
    man = shutil.which("man")
    if man is None:
        raise CliError(f"man(1) is not installed; the page is {page}")
    os.execv(man, ["man", "-l", str(page)])


def cmd_replay(argv: list[str]) -> int:
    from olliefs.replay import run_cli

    return run_cli(argv)


def cmd_mcp(args: argparse.Namespace) -> int:
    """``ollie mcp``: olliefs.mcpserve over the mount (this state dir's by default)."""
    if args.mountpoint is not None:
        mnt = mounts.canonical(args.mountpoint)
        if mounts.status(mnt).state is not mounts.State.LIVE:
            raise CliError(f"not a live olliefs mount: {mnt}")
    else:
        running = _daemon_pid(paths())
        if running is None:
            raise CliError(f"not mounted (start it with: {PROG} mount)")
        mnt = running[1]
    # The 9P export's rule, and its key file checks (0600, 16 characters at least).
    from olliefs.fs import export9p

    key = None
    if args.http_key_file:
        try:
            key = export9p.read_key(args.http_key_file)
        except export9p.AddressError as err:
            raise CliError(str(err).replace("9P key file", "--http-key-file")) from None
    from olliefs import mcpserve

    if args.http is None:
        mcpserve.serve_stdio(Path(mnt))
        return 0
    if not export9p.is_loopback(args.http_host) and key is None:
        raise CliError("--http off the loopback needs --http-key-file (the secret clients send)")
    mcpserve.serve_http(Path(mnt), args.http_host, args.http, key)
    return 0


def parser() -> argparse.ArgumentParser:
    """Every subcommand and flag (ollie(1) and the bash completion are checked against it)."""
    ap = argparse.ArgumentParser(prog=PROG, description="olliefs: an agent runtime as a file tree")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("mount", help="mount the tree (daemonizes; -f stays in the foreground)")
    m.add_argument("mountpoint", nargs="?")
    m.add_argument("-f", "--foreground", action="store_true")
    m.add_argument("-v", "--verbose", action="store_true")
    m.add_argument(
        "--toolsrv",
        metavar="ADDR",
        help="use this toolsrv, not a spawned one: unix:PATH, local or ssh:[user@]host[:dir]",
    )
    m.add_argument("--toolsrv-key-file", metavar="FILE", help="the hex key that toolsrv uses")
    m.add_argument(
        "--9p",
        dest="ninep",
        action="append",
        metavar="ADDRESS",
        help="also serve the tree over 9P2000 at unix:PATH or tcp:HOST:PORT (repeatable)",
    )
    m.add_argument(
        "--9p-allow-remote",
        dest="ninep_allow_remote",
        action="store_true",
        help="allow a --9p tcp address that is not loopback (needs --9p-key-file)",
    )
    m.add_argument(
        "--9p-key-file",
        dest="ninep_key_file",
        metavar="FILE",
        help="9P clients must attach with this file's text as aname",
    )
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    m.set_defaults(fn=cmd_mount)
    u = sub.add_parser("umount", help="unmount and stop the daemon")
    u.add_argument("mountpoint", nargs="?", help="the mount to end (default: this state dir's)")
    u.set_defaults(fn=cmd_umount)
    s = sub.add_parser(
        "status", help="live, dead or not mounted; where, by which daemon (exit 0, 2, 1)"
    )
    s.add_argument("mountpoint", nargs="?", help="the mount to look at (default: this state dir's)")
    s.set_defaults(fn=cmd_status)
    d = sub.add_parser("doctor", help="check this machine and install, one line per check")
    d.set_defaults(fn=cmd_doctor)
    b = sub.add_parser(
        "build-pyfuse3",
        help="build pyfuse3 with olliefs's patches into the environment ollie runs in",
    )
    b.set_defaults(fn=cmd_build_pyfuse3)
    h = sub.add_parser(
        "install-helpers",
        help="install the mount(8) helper, systemd user unit, bash completion and man pages",
    )
    h.add_argument("--prefix", metavar="DIR", help="install under DIR (default /usr/local)")
    h.add_argument("--sbindir", metavar="DIR", help="where mount.fuse.ollie goes (default /sbin)")
    h.add_argument("--user", action="store_true", help="for this user only (no mount helper)")
    h.set_defaults(fn=cmd_install_helpers)
    mp = sub.add_parser("man", help="read a man page of olliefs (ollie, ollie.5, toolsrv, ...)")
    mp.add_argument("page", nargs="?", default=PROG, help="ollie (default), 5, toolsrv, ...")
    mp.add_argument("--path", action="store_true", help="print the page's file instead")
    mp.set_defaults(fn=cmd_man)
    sub.add_parser("replay-server", help="run the replay LLM server (see --help)")
    mc = sub.add_parser("mcp", help="serve the mounted tree's sessions to MCP clients (stdio)")
    mc.add_argument("mountpoint", nargs="?", help="the mount to serve (default: this state dir's)")
    mc.add_argument("--http", type=int, metavar="PORT", help="streamable HTTP on PORT instead")
    mc.add_argument(
        "--http-host", default="127.0.0.1", metavar="HOST", help="where --http listens (loopback)"
    )
    mc.add_argument(
        "--http-key-file",
        metavar="FILE",
        help="HTTP clients must send Authorization: Bearer with this file's text",
    )
    mc.set_defaults(fn=cmd_mcp)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["replay-server"]:
        return cmd_replay(argv[1:])
    args = parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except CliError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
