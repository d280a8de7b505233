"""A real sshd on a loopback port, with a separate user as the remote side.

The daemon reaches it as ``ssh -F <config> remote-test``: the config names the port, the
key made for the test and a known_hosts file that pins the host key made for the test, so
nothing of the machine's own ssh setup is used or changed. The remote user finds this
checkout's ``toolsrv`` on its PATH (``SetEnv`` in the test's sshd_config).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from olliefs.testing import wait_until

SSHD = "/usr/sbin/sshd"
USER = "ollie-remote"


@dataclass
class Sshd:
    host: str  # the ssh config's Host alias
    config: Path  # ssh -F this
    user: str
    home: Path  # the remote user's home (its files are the remote files)
    proc: subprocess.Popen[bytes]

    @property
    def ssh(self) -> str:
        return f"ssh -F {self.config}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _user(home: Path) -> None:
    try:
        pwd.getpwnam(USER)
        subprocess.run(["usermod", "-d", str(home), USER], check=True)
    except KeyError:
        subprocess.run(["useradd", "-M", "-d", str(home), "-s", "/bin/sh", USER], check=True)
    # useradd's "!" is a locked account, which sshd refuses even for a key; "*" is an
    # account with no password that a key may enter.
    subprocess.run(["usermod", "-p", "*", USER], check=True)


def _toolsrv_wrapper(path: Path) -> None:
    """``toolsrv`` for the remote user: this checkout's, through an interpreter that user
    may run. The test's own may live where only root may enter (a pyenv under /root);
    then the system's python3 of the same minor version runs it, with the venv's
    site-packages added as a site dir (so that its .pth files, the editable install's
    finder among them, apply)."""
    exe = os.path.realpath(sys.executable)
    python = exe
    if any(not os.stat(p).st_mode & 0o001 for p in Path(exe).parents):
        python = shutil.which("python3", path="/usr/bin:/bin") or ""
        minor = subprocess.run(
            [python or "false", "-c", "import sys; print(sys.version_info[:2])"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        if minor != str(sys.version_info[:2]):
            why = f"{exe} is not reachable by another user and no system python3 of version"
            pytest.skip(reason=f"{why} {sys.version_info[:2]} can stand in")
    site = next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))
    path.write_text(
        f'#!/bin/sh\nexec {python} -c \'import site, sys; site.addsitedir("{site}"); '
        f'from toolsrv.__main__ import main; main()\' "$@"\n'
    )
    path.chmod(0o755)


@contextmanager
def running_sshd(base: Path) -> Iterator[Sshd]:
    """sshd -D on 127.0.0.1:<free port>; stopped (by its pid) when the block ends."""
    if os.geteuid() != 0:
        pytest.skip(reason="needs root: the remote side is a separate user made by useradd")
    if not os.path.exists(SSHD) or shutil.which("ssh") is None:
        pytest.skip(reason=f"needs openssh-server ({SSHD}) and ssh (apt-get install)")
    # Outside the test's tmp dir, which only root may enter: the remote user lives here.
    home = Path(tempfile.mkdtemp(prefix="ollie-remote-home-"))
    try:
        _user(home)
        uid = pwd.getpwnam(USER).pw_uid
        os.chmod(home, 0o755)
        os.chown(home, uid, uid)
        base.mkdir(parents=True, exist_ok=True)
        for name in ("host_key", "client_key"):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(base / name)],
                check=True,
            )
        keys = home / "authorized_keys"
        shutil.copy(base / "client_key.pub", keys)
        os.chmod(keys, 0o644)
        port = _free_port()
        bindir = home / "bin"
        bindir.mkdir()
        _toolsrv_wrapper(bindir / "toolsrv")
        sshd_config = base / "sshd_config"
        sshd_config.write_text(
            f"ListenAddress 127.0.0.1\nPort {port}\nHostKey {base / 'host_key'}\n"
            f"AuthorizedKeysFile {keys}\nStrictModes no\nPasswordAuthentication no\n"
            f"KbdInteractiveAuthentication no\nUsePAM no\nPidFile none\n"
            f"AllowUsers {USER}\nSetEnv PATH={bindir}:/usr/bin:/bin\n"
        )
        host_pub = (base / "host_key.pub").read_text().split()
        (base / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
        config = base / "ssh_config"
        config.write_text(
            f"Host remote-test\n  HostName 127.0.0.1\n  Port {port}\n  User {USER}\n"
            f"  IdentityFile {base / 'client_key'}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {base / 'known_hosts'}\n  StrictHostKeyChecking yes\n"
            "  ConnectTimeout 10\n  LogLevel ERROR\n"
        )
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # its privilege separation dir
        log = open(base / "sshd.log", "wb")
        proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(sshd_config)], stderr=log, stdin=subprocess.DEVNULL
        )
        log.close()
        try:
            wait_until(
                lambda: (
                    b"Server listening" in (base / "sshd.log").read_bytes()
                    or proc.poll() is not None
                ),
                "sshd listening",
                files=[base / "sshd.log"],
                exits=[proc.pid],
            )
            if proc.poll() is not None:
                raise RuntimeError(f"sshd failed: {(base / 'sshd.log').read_text()}")
            yield Sshd("remote-test", config, USER, home, proc)
        finally:
            proc.terminate()
            proc.wait()
    finally:
        shutil.rmtree(home, ignore_errors=True)
