"""A shell user's day on the mount: tests/clients/scenario.sh, run by bash against a real
mount with a scripted model.

The scenario is the contract ollie(5) gives shell users (SYNOPSIS, FOLLOWING A SESSION,
WHICH FILES BLOCK), written as a user writes it: echo, cat, ls, tail, mv, rm -r, timeout,
with every step checked by the script itself (set -e plus explicit tests), so a broken
feature fails the script and its output names the step.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from olliefs.testing import Daemon
from tests.conftest import script

SCENARIO = Path(__file__).with_name("scenario.sh")

# A reply slow enough to be seen streaming (60 deltas), ending in a marker.
SLOW = "word " * 20 + "the end"


def test_shell_scenario(daemon: Daemon, tmp_path: Path) -> None:
    daemon.replay.add(
        script(
            '{"reply": "first reply"}',
            f'{{"reply": "{SLOW}", "chunk": 2, "delay": 0.005}}',
            '{"reply": "partial words then more", "chunk": 4, "hang": true, "hang_after": 2}',
        )
    )
    work = tmp_path / "shell"
    work.mkdir()
    env = {**daemon.env, "OLLIE": str(daemon.path), "WORK": str(work)}
    run = subprocess.run(
        ["bash", str(SCENARIO)],
        env=env,
        cwd=work,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,  # a deadline for a hang, not a timing
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.endswith("scenario ok\n")
    # The model saw the three prompts, and the stopped one was sent once.
    assert len(daemon.replay.requests) == 3
