"""``toolsrv=`` values: what is a host, what is refused before ssh ever runs."""

from __future__ import annotations

import pytest

from olliefs import doctor
from olliefs.toolclient.remote import SshTarget, parse_toolsrv, ssh_argv


def test_values() -> None:
    assert parse_toolsrv("") is None and parse_toolsrv("local") is None
    assert parse_toolsrv("ssh:build") == SshTarget("build")
    assert parse_toolsrv("ssh:me@build:/src/p/") == SshTarget("me@build", "/src/p")
    assert str(parse_toolsrv("ssh:me@build:/src")) == "ssh:me@build:/src"
    for bad in ("ssh:", "ssh:@", "ssh:-oProxyCommand=x", "ssh:a b", "ssh:h:rel", "tcp:h:1",
                "ssh:a@b@c", "ssh:h;rm", "ssh:h:/a\nb"):  # fmt: skip
        with pytest.raises(ValueError):
            parse_toolsrv(bad)


def test_the_ssh_command_line_never_takes_the_host_for_an_option() -> None:
    argv = ssh_argv("me@build", {"OLLIE_SSH": "ssh -F '/my cfg'"}, "--stdio")
    assert argv == ["ssh", "-F", "/my cfg", "-T", "-o", "BatchMode=yes", "me@build", "--",
                    "toolsrv --stdio"]  # fmt: skip


def test_doctor_leaves_local_and_unix_toolsrv_alone() -> None:
    assert doctor.check_remote_toolsrv({}) is None
    assert doctor.check_remote_toolsrv({"OLLIE_TOOLSRV": "unix:/x.sock"}) is None
    got = doctor.check_remote_toolsrv({"OLLIE_TOOLSRV": "ssh:h:rel"})
    assert got is not None and not got.ok
