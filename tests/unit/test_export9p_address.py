"""``--9p`` addresses and keys: pure parsing and the loopback rule (no daemon)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from olliefs.fs.export9p import (
    Address,
    AddressError,
    check_exports,
    is_loopback,
    parse_address,
    read_key,
)


def test_addresses_parse() -> None:
    assert parse_address("unix:/run/o.sock") == Address("unix", path="/run/o.sock")
    assert parse_address("unix:rel/o.sock").path == os.path.abspath("rel/o.sock")
    assert parse_address("tcp:127.0.0.1:5640") == Address("tcp", host="127.0.0.1", port=5640)
    assert parse_address("tcp:[::1]:0") == Address("tcp", host="::1", port=0)
    assert str(parse_address("tcp:[::1]:7")) == "tcp:[::1]:7"
    for bad in ("unix:", "tcp:1.2.3.4", "tcp::5", "tcp:h:99999", "tcp:h:x", "udp:h:1", "x"):
        with pytest.raises(AddressError):
            parse_address(bad)


def test_loopback_rule() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("127.1.2.3") and is_loopback("::1")
    assert is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::")
    assert not is_loopback("192.0.2.1")
    assert not is_loopback("no-such-host.invalid")  # unresolvable: not known to be local
    local = [parse_address("tcp:127.0.0.1:1"), parse_address("unix:/x")]
    check_exports(local, allow_remote=False, key=None)
    remote = [parse_address("tcp:0.0.0.0:1")]
    with pytest.raises(AddressError, match="--9p-allow-remote"):
        check_exports(remote, allow_remote=False, key="k" * 16)
    with pytest.raises(AddressError, match="--9p-key-file"):
        check_exports(remote, allow_remote=True, key=None)
    check_exports(remote, allow_remote=True, key="k" * 16)


def test_key_file(tmp_path: Path) -> None:
    f = tmp_path / "key"
    f.write_text("  0123456789abcdef0123\n")
    f.chmod(0o600)
    assert read_key(str(f)) == "0123456789abcdef0123"
    f.chmod(0o640)
    with pytest.raises(AddressError, match="readable by others"):
        read_key(str(f))
    f.write_text("short")
    f.chmod(0o600)
    with pytest.raises(AddressError, match="at least 16"):
        read_key(str(f))
    with pytest.raises(AddressError):
        read_key(str(tmp_path / "missing"))
