"""Settings from the config env file, and the API key on the wire (never in the tree)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from olliefs.replay import ReplayServer
from olliefs.testing import HAVE_FUSE, Daemon
from tests.conftest import script

pytestmark = pytest.mark.skipif(not HAVE_FUSE, reason="needs /dev/fuse (mounts for real)")


def test_env_file_settings_and_key(tmp_path: Path) -> None:
    with ReplayServer(key="sk-from-env-file") as srv:
        d = Daemon(tmp_path, srv, {})
        for k in ("OLLIE_OPENAI_URL", "OLLIE_OPENAI_KEY", "OLLIE_MODEL"):
            d.env.pop(k)
        (d.home / "config").mkdir(parents=True)
        (d.home / "config" / "env").write_text(
            f"# defaults\nOLLIE_OPENAI_URL={srv.url.removesuffix('/v1')}\n"
            "export OLLIE_OPENAI_KEY='sk-from-env-file'\nOLLIE_MODEL=from-file\n"
        )
        with d.running():
            d.new(name="e")
            assert "model=from-file\n" in d.read("s/e/cfg")
            d.prompt("e", "hi")
            d.wait_idle("e")
            assert d.read("s/e/chat").endswith("assistant: echo: hi\n")
            for dirpath, _, files in os.walk(d.path):
                for f in ("chat", "cfg", "env", "context"):
                    if f in files:
                        assert "sk-from-env-file" not in Path(dirpath, f).read_text()


def test_wrong_key_is_an_error_line_not_a_crash(tmp_path: Path) -> None:
    with ReplayServer(key="right") as srv:
        with Daemon(tmp_path, srv, {"OLLIE_OPENAI_KEY": "wrong"}).running() as d:
            d.new(name="k")
            d.prompt("k", "hi")
            d.wait_idle("k")
            last = d.read("s/k/chat").splitlines()[-1]
            assert last.startswith("error: ") and "401" in last and "wrong" not in last


def test_hanging_backend_ends_the_turn(tmp_path: Path) -> None:
    with ReplayServer() as srv:
        srv.add(script(*['{"hang": true}'] * 4))
        with Daemon(tmp_path, srv, {"OLLIE_READ_TIMEOUT": "0.2"}).running() as d:
            d.new(name="h")
            d.prompt("h", "hi")
            d.wait_idle("h")
            chat = d.read("s/h/chat")
            assert chat.count("retrying in ") == 3
            assert chat.splitlines()[-1].startswith("error: ")
