"""``ollie``: mount, umount, status, and the replay LLM server.

``ollie mount`` checks everything it can before it forks (so mistakes are reported by the
command that made them, in one line, with a non-zero exit), then starts the daemon in its
own session and waits until the daemon says the tree answers, or reports why it died.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import trio

from olliefs.settings import Paths, install_defaults, load_settings, paths, private_file

PROG = "ollie"


class CliError(Exception):
    pass


def default_mountpoint() -> str:
    return os.environ.get("OLLIE") or os.path.expanduser("~/ollie")


def _mounts() -> dict[str, str]:
    """Mount point -> filesystem type, from /proc/self/mountinfo."""
    out: dict[str, str] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if len(fields) > 4 and right:
                mnt = fields[4].replace("\\040", " ")
                out[mnt] = right.split()[0]
    return out


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
    if _mounts().get(mnt, "").startswith("fuse"):
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


def _setup_logging(p: Paths, foreground: bool, verbose: bool) -> None:
    private_file(p.log_file)
    handlers: list[logging.Handler] = [logging.FileHandler(p.log_file)]
    if foreground:
        handlers.append(logging.StreamHandler(sys.stderr))
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=handlers,
    )


def run_daemon(mnt: str, p: Paths, ready_fd: int | None, verbose: bool) -> int:
    from olliefs.daemon import DaemonError, lock_state, serve

    _setup_logging(p, ready_fd is None, verbose)
    settings = load_settings(p)

    def ready() -> None:
        if ready_fd is not None:
            os.write(ready_fd, b"ok\n")
            os.close(ready_fd)

    try:
        lock = lock_state(p)
        try:
            trio.run(serve, mnt, p, settings, ready)
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


def cmd_mount(args: argparse.Namespace) -> int:
    p = paths()
    mnt = os.path.abspath(os.path.expanduser(args.mountpoint or default_mountpoint()))
    if args.toolsrv:
        # A remote toolsrv: the daemon (and its forked child) read these as settings.
        if not args.toolsrv.startswith("unix:"):
            raise CliError(f"--toolsrv: only unix:PATH is supported: {args.toolsrv}")
        if not args.toolsrv_key_file:
            raise CliError("--toolsrv needs --toolsrv-key-file (the key toolsrv was started with)")
        os.environ["OLLIE_TOOLSRV"] = args.toolsrv
        os.environ["OLLIE_TOOLSRV_KEY_FILE"] = os.path.abspath(args.toolsrv_key_file)
    p.ensure()
    install_defaults(p)
    if args.ready_fd is not None:  # the daemon child; the parent did the checks
        return run_daemon(mnt, p, args.ready_fd, args.verbose)
    preflight(mnt, p, create_default=args.mountpoint is None)
    if args.foreground:
        return run_daemon(mnt, p, None, args.verbose)
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "olliefs", "mount", "--ready-fd", str(w), mnt]
    if args.verbose:
        cmd.insert(4, "-v")
    private_file(p.log_file)
    with open(os.devnull, "rb") as devnull, open(p.log_file, "ab") as logf:
        child = subprocess.Popen(
            cmd, pass_fds=(w,), stdin=devnull, stdout=logf, stderr=logf, start_new_session=True
        )
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        answer = pipe.readline().decode().strip()
    if answer == "ok":
        print(f"mounted at {mnt} (daemon pid {child.pid}; log {p.log_file})")
        return 0
    code = child.wait()
    reason = answer or f"daemon exited with status {code}; see {p.log_file}"
    raise CliError(reason)


def cmd_umount(args: argparse.Namespace) -> int:
    p = paths()
    running = _daemon_pid(p)
    if running is None:
        mnt = os.path.abspath(os.path.expanduser(args.mountpoint or default_mountpoint()))
        if _mounts().get(mnt, "").startswith("fuse"):
            _clear_stale(mnt)
            print(f"{PROG}: no daemon; cleared the mount at {mnt}", file=sys.stderr)
            return 0
        raise CliError("not mounted")
    pid, mnt = running
    if pid <= 0:
        raise CliError("a daemon holds the state lock but left no pid file")
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if _daemon_pid(p) is None:  # it released the state lock: it is gone
            print(f"unmounted {mnt}")
            return 0
        time.sleep(0.05)
    raise CliError(f"daemon pid {pid} did not exit after SIGTERM")


def cmd_status(args: argparse.Namespace) -> int:
    p = paths()
    running = _daemon_pid(p)
    if running is None:
        print("not mounted")
        return 1
    pid, mnt = running
    sessions = len(list(p.sessions.glob("*.jsonl")))
    print(f"mounted at {mnt} (daemon pid {pid}), {sessions} sessions, state in {p.state}")
    return 0


def cmd_replay(argv: list[str]) -> int:
    from olliefs.replay import run_cli

    return run_cli(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["replay-server"]:
        return cmd_replay(argv[1:])
    ap = argparse.ArgumentParser(prog=PROG, description="olliefs: an agent runtime as a file tree")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("mount", help="mount the tree (daemonizes; -f stays in the foreground)")
    m.add_argument("mountpoint", nargs="?")
    m.add_argument("-f", "--foreground", action="store_true")
    m.add_argument("-v", "--verbose", action="store_true")
    m.add_argument("--toolsrv", metavar="unix:PATH", help="use this toolsrv, not a spawned one")
    m.add_argument("--toolsrv-key-file", metavar="FILE", help="the hex key that toolsrv uses")
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    m.set_defaults(fn=cmd_mount)
    u = sub.add_parser("umount", help="unmount and stop the daemon")
    u.add_argument("mountpoint", nargs="?")
    u.set_defaults(fn=cmd_umount)
    s = sub.add_parser("status", help="is it mounted, where, by which daemon")
    s.set_defaults(fn=cmd_status)
    sub.add_parser("replay-server", help="run the replay LLM server (see --help)")
    args = ap.parse_args(argv)
    try:
        return int(args.fn(args))
    except CliError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
